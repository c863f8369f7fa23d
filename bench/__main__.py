"""`python -m bench`: measure the fused kernels on the GPU if there is one, else on CPU.

Prints one table, appends the records to bench/results/bench_<cpu|gpu>.csv and draws a PNG there.
Options narrow or widen the case grid; with none, the default set runs (a few minutes either way).
"""

import argparse
import math
import os
from pathlib import Path

import torch

from . import report, rollout_draws, static, summary
from .cases import (
    CPU_GRID,
    DEFAULT_OPS,
    DTYPES,
    GPU_GRID,
    OPS,
    PHASES,
    SEGMENT_TOKENS,
    Grid,
    SegmentCase,
    default_cases,
)
from .device import pick_device
from .harness.budget import available_bytes, oversized_message
from .harness.measure import measure_case
from .harness.progress import Progress
from .studies.lm_head_chunks import format_projection
from .subjects import SUBJECT_NAMES, Unavailable, make_subjects, refusal_notes
from .workloads import WORKLOADS
from .workloads.linear_token_stats import head_cases

RESULTS = Path(__file__).resolve().parent / "results"


def _bool_choices(text):
    return {"on": (True,), "off": (False,), "both": (False, True)}[text]


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be finite and > 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The command line: every option with its help and default."""
    def grid_default(axis):
        cpu, gpu = (" ".join(map(str, getattr(grid, axis))) for grid in (CPU_GRID, GPU_GRID))
        return f"default: {cpu} on CPU, {gpu} on GPU" if cpu != gpu else f"default: {cpu}"

    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0],
                                     epilog="Axes not named come from the default set (or, with --full, the whole grid). "
                                            "Results: the table on stdout, progress on stderr, CSV and PNG in --results-dir.")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: cuda when torch sees a GPU, else cpu, where the kernels run through the "
                             "Triton interpreter (default: %(default)s)")
    parser.add_argument("--full", action="store_true",
                        help="the whole grid T x V x dtype x J x entropy instead of the default set (long; default: off)")
    parser.add_argument("--tokens", "-T", type=_positive_int, nargs="+", metavar="T",
                        help=f"tokens per micro-batch, >= 1 ({grid_default('tokens')}; "
                             f"aggregation: {' '.join(map(str, SEGMENT_TOKENS))})")
    parser.add_argument("--vocab", "-V", type=_positive_int, nargs="+", metavar="V",
                        help=f"vocabulary columns per tensor-parallel rank, >= 1 ({grid_default('vocabs')})")
    parser.add_argument("--dtype", nargs="+", choices=tuple(DTYPES), help=f"logits dtypes ({grid_default('dtypes')})")
    parser.add_argument("--ids-per-row", "-J", type=_positive_int, nargs="+", metavar="J",
                        help="ids per row, >= 1: the sampled token plus J - 1 centering draws, or a top-k head "
                             "(129: slime's score centering; default: 1, and 9 at the largest fp32 shape)")
    parser.add_argument("--entropy", choices=("on", "off", "both"),
                        help="compute the entropy too (default: off, and on at the largest fp32 shape)")
    parser.add_argument("--temperature", type=_positive_float, default=1.0, metavar="TEMP",
                        help="sampling temperature, fused into the kernel; finite, > 0 (default: %(default)s)")
    parser.add_argument("--op", nargs="+", choices=OPS,
                        help="token_stats: log-probs/entropy kernel; segment_sum: aggregation kernel; "
                             "linear_token_stats: the LM head fused with token_stats; token_draws: the "
                             "SGLang plugin's K draws beside SGLang's sampling step (bench/rollout_draws.py) "
                             f"(default: {' '.join(DEFAULT_OPS)}; with --static: {' '.join(static.OPS)})")
    parser.add_argument("--phase", nargs="+", choices=PHASES, default=list(PHASES),
                        help="passes to measure (default: all three)")
    parser.add_argument("--subjects", nargs="+", choices=SUBJECT_NAMES, default=list(SUBJECT_NAMES),
                        help="implementations to measure; fused is always included, peers that cannot run "
                             "here are skipped with a note (default: all)")
    parser.add_argument("--results-dir", type=Path, default=RESULTS, metavar="DIR",
                        help="where the CSV is appended and the PNG written (default: bench/results)")
    parser.add_argument("--static", action="store_true",
                        help="no timing: the static cost model of every kernel variant on each --arch (CPU, bench/static/__init__.py; --op narrows it; default: off)")
    parser.add_argument("--arch", default=",".join(static.ARCHS), metavar="ARCHS",
                        help=f"with --static: comma-separated archs to compile for (default: {','.join(static.ARCHS)})")
    return parser


def parse_args(argv):
    """The options, with what argparse cannot check (a GPU that is not there, a results path that
    is a file) refused the same way: a usage error naming the option."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(f"argument --device: cuda, but torch {torch.__version__} sees no GPU "
                     "(torch.cuda.is_available() is False); use --device cpu or auto")
    if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()):
        if os.environ.get("TRITON_INTERPRET") == "1":
            parser.error("argument --device: a GPU run times compiled kernels; unset TRITON_INTERPRET=1")
    if args.op is None:
        args.op = list(static.OPS if args.static else DEFAULT_OPS)
    try:
        args.archs = static.parse_archs(args.arch)
    except ValueError as error:
        parser.error(f"argument --arch: {error}")
    if args.results_dir.exists() and not args.results_dir.is_dir():
        parser.error(f"argument --results-dir: {args.results_dir} exists and is not a directory")
    try:  # before any case runs, so that no run's results are lost at the end
        args.results_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        parser.error(f"argument --results-dir: cannot create {args.results_dir}: {error.strerror}")
    if not os.access(args.results_dir, os.W_OK | os.X_OK):
        parser.error(f"argument --results-dir: {args.results_dir} is not writable")
    return args


def select_cases(args, gpu: bool):
    """Token cases: the default set, or the grid the options describe (unnamed axes from the default
    set, or from the whole grid with --full). Aggregation cases: one per T."""
    cases = []
    if "token_stats" in args.op:
        grid = GPU_GRID if gpu else CPU_GRID
        chosen = (args.tokens, args.vocab, args.dtype, args.ids_per_row, args.entropy)
        if args.full or any(value is not None for value in chosen):
            base = grid if args.full else Grid(grid.tokens, grid.vocabs, grid.dtypes, (1,), (False,))
            cases += Grid(
                tuple(args.tokens or base.tokens),
                tuple(args.vocab or base.vocabs),
                tuple(args.dtype or base.dtypes),
                tuple(args.ids_per_row or base.ids_per_row),
                _bool_choices(args.entropy) if args.entropy else base.entropy,
            ).cases(args.temperature)
        else:
            cases += default_cases(grid, args.temperature)
    if "segment_sum" in args.op:
        cases += [SegmentCase(tokens) for tokens in args.tokens or SEGMENT_TOKENS]
    if "linear_token_stats" in args.op:  # the LM head at the token-statistics shapes
        cases += head_cases(select_cases(argparse.Namespace(**dict(vars(args), op=["token_stats"])), gpu), gpu)
    return cases


def _check_temperature(temperature: float) -> None:
    """--temperature within what the kernels answer, as a usage error; read once the device is
    picked, since importing the kernels imports Triton, which must see TRITON_INTERPRET first."""
    from fusedrl.kernels import TEMPERATURE_RANGE

    low, high = TEMPERATURE_RANGE
    if not low <= temperature <= high:
        build_parser().error(f"argument --temperature: must lie in [{low:g}, {high:g}], got {temperature:g}")


def main(argv=None):
    """Run the benchmark; returns the records (one per case, phase and subject)."""
    args = parse_args(argv)
    if args.static:
        return static.run(args.results_dir, args.op, args.archs)
    device = pick_device(args.device)
    gpu = device.type == "cuda"
    _check_temperature(args.temperature)
    if "token_draws" in args.op:
        draws = rollout_draws.run(device, args.results_dir)
        if args.op == ["token_draws"]:
            return draws

    cases = select_cases(args, gpu)
    refusal = oversized_message(cases, available_bytes(device), device.type)
    if refusal:
        raise SystemExit(f"python -m bench: error: {refusal}")
    names = ["fused"] + [name for name in args.subjects if name != "fused"]
    subjects, notes = make_subjects(names, device)
    notes += refusal_notes(cases, subjects)
    if not gpu and any(case.dtype != "fp32" for case in cases):
        notes.append("the Triton interpreter casts fp32 to bf16/fp16 by truncation (a GPU rounds to nearest), "
                     "which about doubles the fused kernels' low-precision gradient error on CPU")  # fmt: skip
    progress = Progress(case.op for case in cases)
    records, unavailable = [], Unavailable()
    for case in cases:
        records += measure_case(WORKLOADS[case.op].make(case, device), subjects, phases=args.phase, timing=gpu,
                                unavailable=unavailable)  # fmt: skip
        progress.finished(case.label)
        if gpu:
            torch.cuda.empty_cache()

    env = report.environment(device)
    kind = "gpu" if gpu else "cpu"
    stamp = env["date"].replace(":", "")
    print(f"{env['device']}, torch {env['torch']}, triton {env['triton']}, commit {env['commit']}")
    print(report.format_table(records, gpu))
    subject_table = report.format_subject_table(records)
    if subject_table:
        print(subject_table)
    print(summary.legend(gpu, subject_table=bool(subject_table)))
    for line in summary.conclusions(records, gpu):
        print(line)
    for note in notes + unavailable.notes():
        print(f"note: {note}")
    if "linear_token_stats" in args.op:
        print(format_projection())
    csv_path = report.append_csv(records, env, args.results_dir / f"bench_{kind}.csv")
    png_path = report.plot(records, gpu, env, args.results_dir / f"bench_{kind}_{stamp}.png")
    print(f"CSV: {csv_path} ({len(records)} rows appended)")
    print(f"PNG: {png_path}")
    return records


if __name__ == "__main__":
    main()
