"""The implementations measured side by side: the fused kernels, the eager paths, and peers.

A subject runs on a workload: `run(x, workload)` with `x` the workload's differentiable input (a
private copy) returns the outputs the workload knows how to check and differentiate. A case a
subject cannot run gets its reason from `refuses`, printed as a note ("not supported"). The peers
(Liger-Kernel's cross entropy, megatron-core's vocab-parallel cross entropy) compute only the
log-prob of the sampled token, so they cover J = 1 without entropy at temperature 1. For the LM
head (`linear_token_stats`), `fused` is the recompute path, `eager` the unfused one, and `one_pass`
/ `one_pass_main_grad` the one-pass path (`linear_token_loss`), its weight gradient returned or
added to the workload's fp32 main_grad; the rivals (`bench/rivals/lm_heads.py`) are `verl` (verl's
linear cross-entropy, slime's `--log-probs-backend triton`), `verl_main_grad` (the same, its weight
gradient then added to main_grad as megatron-core does), `liger_flce` (Liger's fused linear
cross entropy, per token) and `liger_scaled` (Liger's fused linear scaled cross entropy, with
entropy), each taking one id per row.
"""

import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .baselines import eager_token_logprobs
from .rivals import lm_heads
from .workloads.linear_token_stats import run_fused, run_one_pass, run_one_pass_main_grad, run_unfused
from .workloads.segment_sum import eager_sum_of_sample_mean

SUBJECT_NAMES = ("fused", "eager", "compile", "liger", "megatron", "one_pass", "one_pass_main_grad",
                 "verl", "verl_main_grad", "liger_flce", "liger_scaled")


@dataclass(frozen=True)
class Subject:
    name: str
    runs: dict  # op -> run(x, workload)
    refuses: Callable[..., Optional[str]] = lambda case: None  # case -> why it cannot run it, or None
    # A peer is another project's code: a RuntimeError it raises while running a case (a build that
    # cannot run it: NVTX missing on a CPU-only torch) is that case's note, not the end of the run.
    # The package's own subjects are never peers: their errors end the run.
    peer: bool = False

    def covers(self, case) -> bool:
        return case.op in self.runs and self.refuses(case) is None

    def run(self, x, workload):
        return self.runs[workload.case.op](x, workload)


def _sampled_token_only(case) -> Optional[str]:
    """Why a peer that returns only the sampled token's log-prob at temperature 1 cannot run `case`."""
    if case.ids_per_row != 1:
        return "takes one id per row"
    if case.entropy:
        return "returns no entropy"
    if case.temperature != 1.0:
        return "takes no temperature"
    return None


def _token_stats_run(token_logprobs):
    def run(logits, workload):
        case = workload.case
        return token_logprobs(logits, workload.ids, temperature=case.temperature, with_entropy=case.entropy)

    return run


def _fused():
    from fusedrl.kernels import token_logprobs
    from fusedrl.kernels.segment_sum import segment_sum

    def aggregate(values, workload):
        # as slime_ext.aggregation calls it: inputs built by the package, value checks off
        return segment_sum(values, workload.mask, workload.segment_ids, workload.denominators, validate=False)

    return Subject("fused", {"token_stats": _token_stats_run(token_logprobs), "segment_sum": aggregate,
                             "linear_token_stats": run_fused})  # fmt: skip


def _eager():
    # for the LM head, the unfused path: the logits in the layer's dtype, then token_stats
    return Subject("eager", {"token_stats": _token_stats_run(eager_token_logprobs),
                             "segment_sum": eager_sum_of_sample_mean, "linear_token_stats": run_unfused})  # fmt: skip


def _compiled():
    # One dynamic-shape graph per (J, entropy, dtype) instead of one per shape, and a recompile
    # limit above the grid's 8 combinations, so the run never silently falls back to eager.
    config = torch._dynamo.config
    limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, limit, max(getattr(config, limit), 64))
    return Subject("compile", {"token_stats": _token_stats_run(torch.compile(eager_token_logprobs, dynamic=True))})


def _liger():
    from liger_kernel.transformers.functional import liger_cross_entropy

    def run(logits, workload):
        # Liger writes the gradient into `logits` during the forward (its design: no second pass).
        loss = liger_cross_entropy(logits, workload.ids[:, 0].contiguous(), reduction="none")
        return -loss.float().unsqueeze(1), None

    return Subject("liger", {"token_stats": run}, _sampled_token_only, peer=True)


def _megatron(device):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)

    def run(logits, workload):
        # megatron subtracts the max from its input in place (`.float()` of fp32 logits aliases
        # them), so fp32 logits are copied first, as slime does.
        owned = logits.clone() if logits.dtype == torch.float32 else logits
        loss = vocab_parallel_cross_entropy(owned, workload.ids[:, 0].contiguous())
        return -loss.float().unsqueeze(1), None

    return Subject("megatron", {"token_stats": run}, _sampled_token_only, peer=True)


def _one_pass():
    return Subject("one_pass", {"linear_token_stats": run_one_pass})


def _one_pass_main_grad():
    return Subject("one_pass_main_grad", {"linear_token_stats": run_one_pass_main_grad})


def _verl(device, name="verl", make_run=lm_heads.verl_run):
    from .rivals import verl_import
    from .rivals.interpreter_dot import correct_bf16_dot

    cpu = device.type == "cpu"
    if cpu:
        correct_bf16_dot()  # verl's GEMMs are tl.dot: bf16 ones need the interpreter fixed
    linear_cross_entropy = verl_import.linear_cross_entropy(strip_asserts=cpu)
    return Subject(name, {"linear_token_stats": make_run(linear_cross_entropy)}, lm_heads.verl_refusal, peer=True)


def _liger_flce():
    import liger_kernel.transformers.functional  # noqa: F401  (unavailable: a note, not a crash at the first case)

    return Subject("liger_flce", {"linear_token_stats": lm_heads.run_liger_linear_cross_entropy}, _sampled_token_only,
                   peer=True)


def _liger_scaled(device):
    # Liger's own dispatch, asked now: on sm_90 it imports its CuTe DSL kernel, which may be missing
    from liger_kernel.ops.fused_linear_scaled_cross_entropy import _resolve_implementation

    _resolve_implementation(device)
    run = lm_heads.run_liger_scaled_cross_entropy
    return Subject("liger_scaled", {"linear_token_stats": run}, lm_heads.one_id_per_row, peer=True)


def refusal_notes(cases, subjects):
    """One line per subject and reason: the cases of its ops it does not run ("not supported")."""
    refused = {}
    for case in cases:
        for subject in subjects:
            reason = case.op in subject.runs and subject.refuses(case)
            if reason:
                refused.setdefault((subject.name, reason), []).append(case.label)
    return [f"{name}: not supported, {reason}: {', '.join(labels)}" for (name, reason), labels in refused.items()]


class Unavailable:
    """The cases each peer raised on while running (a RuntimeError: this build cannot run it), by
    subject and reason; `notes` gives one line for each, as `refusal_notes` does for refusals."""

    def __init__(self):
        self.cases = {}

    def add(self, subject, error, case) -> None:
        first_line = next(iter(str(error).strip().splitlines()), "")
        reason = f"{type(error).__name__}: {first_line}"
        self.cases.setdefault((subject.name, reason), []).append(case.label)

    def notes(self):
        return [f"{name}: unavailable ({reason}): {', '.join(labels)}" for (name, reason), labels in self.cases.items()]


def make_subjects(names, device):
    """The requested subjects that can run on `device`, and a note for each one that cannot."""
    builders = {
        "fused": _fused,
        "eager": _eager,
        "compile": _compiled,
        "liger": _liger,
        "megatron": lambda: _megatron(device),
        "one_pass": _one_pass,
        "one_pass_main_grad": _one_pass_main_grad,
        "verl": lambda: _verl(device),
        "verl_main_grad": lambda: _verl(device, "verl_main_grad", lm_heads.verl_main_grad_run),
        "liger_flce": _liger_flce,
        "liger_scaled": lambda: _liger_scaled(device),
    }
    gpu_only = {
        "compile": "measured on GPU only (its generated kernels are not observable on CPU)",
        "liger": "runs on GPU only",
    }
    subjects, notes = [], []
    for name in names:
        if device.type != "cuda" and name in gpu_only:
            notes.append(f"{name}: {gpu_only[name]}")
            continue
        try:
            subjects.append(builders[name]())
        except (ImportError, RuntimeError) as error:  # a missing or unusable peer is a note, not a crash
            notes.append(f"{name}: unavailable ({type(error).__name__}: {error})")
    return subjects, notes
