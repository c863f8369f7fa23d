"""`python -m bench`: measure the fused kernels on the GPU if there is one, else on CPU.

Prints one table, appends the records to bench/results/bench_<cpu|gpu>.csv and draws a PNG there.
Options narrow or widen the case grid; with none, the default set runs (a few minutes either way).
"""

import argparse
import os
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def _bool_choices(text):
    return {"on": (True,), "off": (False,), "both": (False, True)}[text]


def parse_args(argv):
    from .cases import DEFAULT_OPS, DTYPES, OPS, PHASES
    from .subjects import SUBJECT_NAMES

    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: cuda when torch sees a GPU (default)")
    parser.add_argument("--full", action="store_true", help="the whole grid instead of the default set")
    parser.add_argument("--tokens", "-T", type=int, nargs="+", help="T values")
    parser.add_argument("--vocab", "-V", type=int, nargs="+", help="V/tp values (columns per rank)")
    parser.add_argument("--dtype", nargs="+", choices=tuple(DTYPES), help="logits dtypes")
    parser.add_argument("--ids-per-row", "-J", type=int, nargs="+", help="J values")
    parser.add_argument("--entropy", choices=("on", "off", "both"), help="compute the entropy")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--op", nargs="+", choices=OPS, default=list(DEFAULT_OPS),
                        help="token_stats: log-probs/entropy kernel; segment_sum: aggregation kernel; "
                             "linear_token_stats: the LM head fused with token_stats (not in the default)")
    parser.add_argument("--phase", nargs="+", choices=PHASES, default=list(PHASES))
    parser.add_argument("--subjects", nargs="+", choices=SUBJECT_NAMES, default=list(SUBJECT_NAMES),
                        help="implementations to measure (fused is always included)")
    parser.add_argument("--results-dir", type=Path, default=RESULTS)
    parser.add_argument("--static", action="store_true",
                        help="no timing: the sm_90 static cost model of every kernel variant (CPU, bench/static.py)")
    return parser.parse_args(argv)  # fmt: skip


def pick_device(choice: str) -> torch.device:
    """The device to measure on; on CPU, switch Triton to its interpreter before triton is imported."""
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda":
        if os.environ.get("TRITON_INTERPRET") == "1":
            raise SystemExit("TRITON_INTERPRET=1 is set: unset it to time compiled kernels on the GPU")
        return torch.device("cuda", torch.cuda.current_device())
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("triton was imported before TRITON_INTERPRET=1 could be set")
    os.environ["TRITON_INTERPRET"] = "1"
    return torch.device("cpu")


def select_cases(args, gpu: bool):
    """Token cases: the default set, or the grid the options describe (unnamed axes from the default
    set, or from the whole grid with --full). Aggregation cases: one per T."""
    from .cases import CPU_GRID, GPU_GRID, SEGMENT_TOKENS, Grid, SegmentCase, default_cases

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
        from .linear_token_stats_op import head_cases

        cases += head_cases(select_cases(argparse.Namespace(**dict(vars(args), op=["token_stats"])), gpu), gpu)
    return cases


def main(argv=None):
    """Run the benchmark; returns the records (one per case, phase and subject)."""
    args = parse_args(argv)
    if args.static:
        from .static import run

        return run(args.results_dir, args.op)
    device = pick_device(args.device)
    gpu = device.type == "cuda"
    from . import report
    from .measure import measure_case
    from .subjects import make_subjects

    names = ["fused"] + [name for name in args.subjects if name != "fused"]
    subjects, notes = make_subjects(names, device)
    cases = select_cases(args, gpu)
    if not gpu and any(case.dtype != "fp32" for case in cases):
        notes.append("the Triton interpreter casts fp32 to bf16/fp16 by truncation (a GPU rounds to nearest), "
                     "which about doubles the fused kernels' low-precision gradient error on CPU")  # fmt: skip
    records = []
    for number, case in enumerate(cases, 1):
        started = time.perf_counter()
        records += measure_case(case, subjects, device, phases=args.phase, timing=gpu)
        print(f"[{number}/{len(cases)}] {case.label}: {time.perf_counter() - started:.1f} s", file=sys.stderr)
        if gpu:
            torch.cuda.empty_cache()

    env = report.environment(device)
    kind = "gpu" if gpu else "cpu"
    stamp = env["date"].replace(":", "")
    print(f"{env['device']}, torch {env['torch']}, triton {env['triton']}, commit {env['commit']}")
    print(report.format_table(records, gpu))
    for note in notes:
        print(f"note: {note}")
    csv_path = report.append_csv(records, env, args.results_dir / f"bench_{kind}.csv")
    png_path = report.plot(records, gpu, args.results_dir / f"bench_{kind}_{stamp}.png")
    print(f"CSV: {csv_path} ({len(records)} rows appended)")
    print(f"PNG: {png_path}")
    return records


if __name__ == "__main__":
    main()
