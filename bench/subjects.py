"""The implementations measured side by side: the fused kernels, the eager paths, and peers.

A subject runs on a workload: `run(x, workload)` with `x` the workload's differentiable input (a
private copy) returns the outputs the workload knows how to check and differentiate. The peers
(Liger-Kernel's cross entropy, megatron-core's vocab-parallel cross entropy) compute only the
log-prob of the sampled token, so they cover J = 1 without entropy at temperature 1. For the LM
head (`linear_token_stats`), `fused` is the recompute path, `eager` the unfused one, and `one_pass`
/ `one_pass_main_grad` the one-pass path (`linear_token_loss`), its weight gradient returned or
added to the workload's fp32 main_grad. Liger's fused linear cross entropy is not among them: it
takes only a scalar gradient of the summed cross entropy, not the workload's per-token one.
"""

import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from .baselines import eager_token_logprobs
from .workloads.linear_token_stats import run_fused, run_one_pass, run_one_pass_main_grad, run_unfused
from .workloads.segment_sum import eager_sum_of_sample_mean

SUBJECT_NAMES = ("fused", "eager", "compile", "liger", "megatron", "one_pass", "one_pass_main_grad")


@dataclass(frozen=True)
class Subject:
    name: str
    runs: dict  # op -> run(x, workload)
    covers_case: Callable = lambda case: True

    def covers(self, case) -> bool:
        return case.op in self.runs and self.covers_case(case)

    def run(self, x, workload):
        return self.runs[workload.case.op](x, workload)


def _sampled_token_only(case) -> bool:
    return case.ids_per_row == 1 and not case.entropy and case.temperature == 1.0


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

    return Subject("liger", {"token_stats": run}, _sampled_token_only)


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

    return Subject("megatron", {"token_stats": run}, _sampled_token_only)


def _one_pass():
    return Subject("one_pass", {"linear_token_stats": run_one_pass})


def _one_pass_main_grad():
    return Subject("one_pass_main_grad", {"linear_token_stats": run_one_pass_main_grad})


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
