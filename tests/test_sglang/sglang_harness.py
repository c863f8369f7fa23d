"""Drives SGLang's real sampler, request and batch objects on CPU for the plugin tests.

`Sampler.__new__` plus the attributes its `__init__` sets stands in for the distributed runtime
that `__init__` needs; a namespace carries the `SamplingBatchInfo` fields `Sampler.forward`
reads, or `batch_sampling_info` builds the real one from real `Req`s. `publish_cpu_runtime`
publishes a CPU `ServerArgs` as SGLang's process config (sampling backend "pytorch"), which
`SamplingBatchInfo`, truncated sampling and the tokenizer manager read. `hooks_enabled`
registers the plugin through SGLang's HookRegistry, applies it, and puts every patched
attribute back afterwards.
"""

from __future__ import annotations

import contextlib
import functools
import math
import pkgutil
import sys
from array import array
from types import SimpleNamespace
from typing import List, Optional, Sequence

import torch
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.layers.logprob_processor import OutputLogprobProcessor
from sglang.srt.layers.sampler import Sampler
from sglang.srt.plugins.hook_registry import HookRegistry
from sglang.srt.sampling.sampling_params import TOP_K_ALL

from fusedrl.sglang_plugin import plugin
from fusedrl.sglang_plugin.constraints import ENV_VAR


def make_sampler() -> Sampler:
    sampler = Sampler.__new__(Sampler)
    torch.nn.Module.__init__(sampler)
    sampler.tp_sync_group = None
    sampler.cp_sync_group = None
    sampler.rl_on_policy_target = None
    sampler.enable_deterministic = False
    sampler.use_log_softmax_logprob = False
    sampler.use_ascend_backend = False
    sampler.sampling_mask_max_tokens = 0
    sampler.output_logprob_processor = OutputLogprobProcessor()
    return sampler


def sampling_info(
    temperatures: Sequence[float],
    top_ks: Optional[Sequence[int]] = None,
    top_ps: Optional[Sequence[float]] = None,
    min_ps: Optional[Sequence[float]] = None,
) -> SimpleNamespace:
    """The SamplingBatchInfo fields Sampler.forward reads, with SGLang's normalised values."""
    rows = len(temperatures)
    top_ks = list(top_ks) if top_ks is not None else [TOP_K_ALL] * rows
    top_ps = list(top_ps) if top_ps is not None else [1.0] * rows
    min_ps = list(min_ps) if min_ps is not None else [0.0] * rows
    return SimpleNamespace(
        temperatures=torch.tensor(temperatures, dtype=torch.float32).view(-1, 1),
        top_ks=torch.tensor(top_ks, dtype=torch.int32),
        top_ps=torch.tensor(top_ps, dtype=torch.float32),
        min_ps=torch.tensor(min_ps, dtype=torch.float32),
        is_all_greedy=all(k <= 1 for k in top_ks),
        need_top_k_sampling=any(k != TOP_K_ALL for k in top_ks),
        need_top_p_sampling=any(p < 1.0 for p in top_ps),
        need_min_p_sampling=any(p > 0.0 for p in min_ps),
        sampling_seed=None,
        has_custom_logit_processor=False,
        sampling_mask_batch_indices=None,
        sampling_support_logprobs_capture_indices=None,
        grammars=None,
        max_top_k=None,
    )


def run_sampler(
    logits: torch.Tensor,
    info,
    top_logprobs_nums: List[int],
    positions: Optional[torch.Tensor] = None,
    deterministic: bool = False,
):
    """SGLang's Sampler.forward with return_logprob: (sampled ids, LogitsProcessorOutput)."""
    output = LogitsProcessorOutput(next_token_logits=logits.clone())
    if positions is None:
        positions = torch.arange(logits.shape[0], dtype=torch.long)
    sampler = make_sampler()
    sampler.enable_deterministic = deterministic
    next_ids = sampler(
        output, info, True, list(top_logprobs_nums), [None] * logits.shape[0], positions
    )
    return next_ids, output


def tempered_logprobs(logits: torch.Tensor, temperatures: Sequence[float]) -> torch.Tensor:
    """float64 log_softmax(logits / T) per row: the truth the returned logprobs must match."""
    temps = torch.tensor(temperatures, dtype=torch.float64).view(-1, 1)
    return torch.log_softmax(logits.double() / temps, dim=-1)


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit p-value of `counts` against `probs` (float64)."""
    expected = probs.double() * counts.sum()
    statistic = float(((counts.double() - expected) ** 2 / expected).sum())
    dof = counts.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(statistic / 2.0)))


@contextlib.contextmanager
def hooks_enabled(monkeypatch, env_value: Optional[str] = "1"):
    """Run plugin.register() under ENV_VAR=env_value (None: unset) and apply the hooks through
    SGLang's HookRegistry; restore every patched attribute on exit."""
    if env_value is None:
        monkeypatch.delenv(ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(ENV_VAR, env_value)
    HookRegistry.reset()
    plugin.register()
    saved = _save_targets(list(HookRegistry._hooks))
    try:
        HookRegistry.apply_hooks()
        yield
    finally:
        for (owner, name), value in saved.items():
            _restore(owner, name, value)
        HookRegistry.reset()


def _save_targets(targets: List[str]) -> dict:
    saved = {}
    for target in targets:
        owner_path, name = target.rsplit(".", 1)
        owner = pkgutil.resolve_name(owner_path)
        saved[(owner, name)] = owner.__dict__[name]
    return saved


def _restore(owner, name: str, original) -> None:
    """Put `original` back on `owner` and on every module the registry propagated it to."""
    patched = owner.__dict__[name]
    setattr(owner, name, original)
    if patched is original:
        return
    for module in list(sys.modules.values()):
        module_vars = getattr(module, "__dict__", None)
        if module_vars is None:
            continue
        for attr, value in list(module_vars.items()):
            if value is patched:
                setattr(module, attr, original)


@functools.lru_cache(maxsize=None)
def publish_cpu_runtime():
    """Publish a CPU ServerArgs as SGLang's process-wide config, once per test process."""
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(model_path="dummy", device="cpu", sampling_backend="pytorch")
    publish(server_args, role="scheduler")
    return server_args


def make_req(rid: str, vocab_size: int, *, return_logprob: bool, top_logprobs_num: int, **params):
    """A real scheduler `Req` with SGLang-normalised and verified sampling parameters."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    sampling_params = SamplingParams(**params)
    sampling_params.normalize(None)
    sampling_params.verify(vocab_size)
    return Req(
        rid,
        "",
        array("q", [1, 2, 3]),
        sampling_params,
        return_logprob=return_logprob,
        top_logprobs_num=top_logprobs_num,
        vocab_size=vocab_size,
    )


def batch_sampling_info(reqs, vocab_size: int):
    """(top_logprobs_nums, SamplingBatchInfo) of a real ScheduleBatch of `reqs`.

    `ScheduleBatch.init_new` decides whether the batch returns logprobs; the per-row
    top_logprobs_nums are then what `prepare_for_extend` and `get_new_batch_prefill` set:
    every request's `logprob.top_logprobs_num`, whether or not it returns logprobs."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    publish_cpu_runtime()
    batch = ScheduleBatch.init_new(
        reqs,
        SimpleNamespace(device="cpu"),
        None,
        None,
        SimpleNamespace(vocab_size=vocab_size),
        False,
        SpeculativeAlgorithm.NONE,
    )
    assert batch.return_logprob
    nums = [r.logprob.top_logprobs_num for r in batch.reqs]
    return nums, SamplingBatchInfo.from_schedule_batch(batch, vocab_size)


def is_close(a: float, b: float, tol: float = 1e-5) -> bool:
    return math.isclose(a, b, rel_tol=tol, abs_tol=tol)
