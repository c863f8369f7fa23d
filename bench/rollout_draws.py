"""`python -m bench --op token_draws`: the SGLang plugin's K draws per decode step, beside the two
SGLang steps it sits next to, on the same logits.

Per case (B rows, V columns, the log-probs' dtype, K draws per row, seeded rows or not), one record
per subject:

- `kernel`: the plugin's draws on the fused kernel (`fusedrl.kernels.token_draws`; on CPU through
  the Triton interpreter, so its bytes are exact and its time is not measured);
- `torch path`: the plugin's draws on the torch path (`torch.multinomial` over an fp32 `exp` of
  the rows, or the float64 inverse CDF for seeded rows): what the plugin ran before the kernel,
  and still runs on CPU;
- `sglang sample`: SGLang's own sampling step as its `Sampler.forward` runs it for untruncated
  sampling: the logits divided by the temperature and softmaxed in place, one token drawn
  (`sampling_from_probs_torch`, unseeded: its seeded draw needs SGLang's CUDA hash), and the
  log-probs taken (`torch.log(probs)`);
- `sglang top-logprobs`: SGLang's top-logprobs step (`get_top_logprobs`), which the plugin replaces.

The SGLang subjects need SGLang installed (else they are skipped, with a note). Columns: the bytes
moved (CPU only: every Triton load and store and every aten operator, `bench/cpu_meters`), the
floor (one read of the log-probs plus the 1 + K ids and log-probs written per row), peak extra
memory, and on a GPU the median time and its ratio to `sglang sample`.
"""

import itertools
from dataclasses import asdict, dataclass

import torch

from . import report
from .cpu_meters.traffic import count_traffic
from .harness.memory import memory_meter
from .harness.progress import Progress
from .harness.timing import median_ms

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TEMPERATURE = 0.8
LOGIT_SCALE = 3.0


@dataclass(frozen=True)
class DrawCase:
    """One decode step's draws: B rows of V log-probs, K draws a row."""

    batch: int
    vocab: int
    dtype: str
    draws: int
    seeded: bool

    @property
    def floor_bytes(self) -> int:
        """One read of the log-probs; per row the 1 + K int64 ids and log-probs written."""
        itemsize = DTYPES[self.dtype].itemsize
        return self.batch * self.vocab * itemsize + self.batch * (1 + self.draws) * (8 + itemsize)

    @property
    def label(self) -> str:
        return f"B={self.batch} V={self.vocab} {self.dtype} K={self.draws}" + (" seeded" if self.seeded else "")


def grid(gpu: bool) -> list:
    """The issue's grid on a GPU; on CPU (the interpreter) fewer rows and one vocabulary size."""
    batches, vocabs = ((1, 64, 256), (4748, 151936)) if gpu else ((1, 8), (4748,))
    draws = (0, 4, 8, 32) if gpu else (0, 8)
    axes = (batches, vocabs, tuple(DTYPES), draws, (False, True))
    return [DrawCase(*values) for values in itertools.product(*axes)]


@dataclass
class Step:
    """The inputs of one decode step: raw fp32 logits, the log-probs the plugin reads (the case's
    dtype), the sampled tokens, per-row seeds and positions."""

    logits: torch.Tensor
    logprobs: torch.Tensor
    sampled: torch.Tensor
    seeds: torch.Tensor
    positions: torch.Tensor

    @classmethod
    def make(cls, case: DrawCase, device, seed: int = 0):
        generator = torch.Generator(device=device).manual_seed(seed)
        logits = torch.randn(case.batch, case.vocab, generator=generator, device=device) * LOGIT_SCALE
        logprobs = torch.log_softmax(logits / TEMPERATURE, dim=-1)
        sampled = torch.multinomial(logprobs.exp(), 1, generator=generator).view(-1)
        seeds = torch.arange(case.batch, device=device) + 42
        positions = torch.arange(case.batch, device=device) + 1000
        return cls(logits, logprobs.to(DTYPES[case.dtype]), sampled, seeds, positions)


def _plugin_draws(use_kernel: bool):
    def run(step: Step, case: DrawCase):
        from fusedrl.sglang_plugin.draws import draw_token_samples

        seeded = dict(seeds=step.seeds, positions=step.positions) if case.seeded else {}
        return draw_token_samples(step.logprobs, step.sampled, [case.draws] * case.batch, use_kernel=use_kernel,
                                  **seeded)  # fmt: skip

    return run


def _sglang_sample(step: Step, case: DrawCase):
    from sglang.srt.layers.sampler import sampling_from_probs_torch

    logits = step.logits  # a fresh copy per run (`measure`): SGLang works in place
    logits.div_(TEMPERATURE)
    if logits.is_cuda:  # SGLang's own softmax kernel, as its non-deterministic path calls it
        from sglang.kernels.ops.sampling import softmax as sampler_softmax

        logits[:] = sampler_softmax(logits)
    else:  # its deterministic path's (the Triton kernel needs a GPU)
        logits[:] = torch.softmax(logits, dim=-1)
    ids = sampling_from_probs_torch(logits)
    return ids, torch.log(logits)


def _sglang_top_logprobs(step: Step, case: DrawCase):
    from sglang.srt.layers.logprob_processor import get_top_logprobs

    return get_top_logprobs(step.logprobs, [case.draws] * case.batch, no_copy_to_cpu=True)


def _has_sglang() -> bool:
    try:
        import sglang.srt.layers.logprob_processor  # noqa: F401
        import sglang.srt.layers.sampler  # noqa: F401
    except ImportError:
        return False
    return True


def subjects(with_sglang: bool) -> dict:
    """name -> run(step, case), and whether it needs K > 0 (SGLang's top-k of 0 is no step)."""
    chosen = {"kernel": (_plugin_draws(True), True), "torch path": (_plugin_draws(False), True)}
    if with_sglang:
        chosen |= {"sglang sample": (_sglang_sample, False), "sglang top-logprobs": (_sglang_top_logprobs, True)}
    return chosen


def _fresh(step: Step) -> Step:
    return Step(step.logits.clone(), step.logprobs, step.sampled, step.seeds, step.positions)


def measure(run, step: Step, case: DrawCase, device, gpu: bool) -> dict:
    """Bytes moved (CPU), peak extra memory and (GPU) median milliseconds of one subject."""
    fresh = _fresh(step)
    with memory_meter(device) as meter:
        if gpu:
            run(fresh, case)
            bytes_moved = None
        else:
            with count_traffic() as traffic:
                run(fresh, case)
            bytes_moved = traffic.total
        peak = meter.peak()
    ms = median_ms(lambda: _fresh(step), lambda state: run(state, case), device) if gpu else None
    return dict(bytes_moved=bytes_moved, peak_extra_bytes=peak, ms=ms)


def run_cases(cases, device, gpu: bool, with_sglang: bool, progress=None) -> list:
    """One record per case and subject (subjects that need K > 0 skip K = 0)."""
    chosen = subjects(with_sglang)
    records = []
    for case in cases:
        step = Step.make(case, device)
        for name, (run, needs_draws) in chosen.items():
            if needs_draws and case.draws == 0:
                continue
            records.append(dict(asdict(case), subject=name, floor_bytes=case.floor_bytes,
                                **measure(run, step, case, device, gpu)))  # fmt: skip
        if progress is not None:
            progress.finished(case.label)
    _add_time_ratios(records)
    return records


def _add_time_ratios(records) -> None:
    """Each record's time over SGLang's sampling step's on the same case (None without both)."""
    key = ("batch", "vocab", "dtype", "draws", "seeded")
    sample_ms = {tuple(r[k] for k in key): r["ms"] for r in records if r["subject"] == "sglang sample"}
    for record in records:
        base = sample_ms.get(tuple(record[k] for k in key))
        record["over_sglang_sample"] = record["ms"] / base if record["ms"] is not None and base else None


def format_table(records) -> str:
    header = f"{'case':<34} {'subject':<20} {'bytes/floor':>11} {'peak extra MB':>13} {'ms':>8} {'x sample':>8}"
    lines = [header]
    for r in records:
        case = DrawCase(r["batch"], r["vocab"], r["dtype"], r["draws"], r["seeded"])
        ratio = "-" if r["bytes_moved"] is None else f"{r['bytes_moved'] / r['floor_bytes']:.3f}"
        ms = "-" if r["ms"] is None else f"{r['ms']:.3f}"
        over = "-" if r["over_sglang_sample"] is None else f"{r['over_sglang_sample']:.2f}"
        lines.append(f"{case.label:<34} {r['subject']:<20} {ratio:>11} {r['peak_extra_bytes'] / 1e6:>13.3f} {ms:>8} {over:>8}")
    return "\n".join(lines)


CSV_FIELDS = ("date", "device", "torch", "triton", "commit", *DrawCase.__dataclass_fields__, "subject",
              "bytes_moved", "floor_bytes", "peak_extra_bytes", "ms", "over_sglang_sample")


def _csv_row(record, env) -> dict:
    return {field: dict(env, **record).get(field) for field in CSV_FIELDS}


def run(device, results_dir) -> list:
    """The grid for `device`: the table on stdout, progress on stderr, rows appended to
    `results_dir/bench_draws_{cpu,gpu}.csv`; returns the records."""
    gpu = device.type == "cuda"
    cases = grid(gpu)
    progress = Progress(["token_draws"] * len(cases))
    with_sglang = _has_sglang()
    records = run_cases(cases, device, gpu, with_sglang, progress)
    env = report.environment(device)
    print(f"{env['device']}, torch {env['torch']}, triton {env['triton']}, commit {env['commit']}")
    print(format_table(records))
    print("bytes/floor: bytes moved over one read of the log-probs plus the 1 + K ids and log-probs "
          "written a row (CPU: counted; a GPU run leaves it to the static model); x sample: time over "
          "SGLang's sampling step on the same logits (GPU only)")  # fmt: skip
    if not with_sglang:
        print("note: SGLang is not installed here: its sampling and top-logprobs steps are not measured")
    path = report.append_csv(records, env, results_dir / f"bench_draws_{'gpu' if gpu else 'cpu'}.csv",
                             fields=CSV_FIELDS, row=_csv_row)  # fmt: skip
    print(f"CSV: {path} ({len(records)} rows appended)")
    return records
