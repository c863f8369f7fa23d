"""The hook bodies the plugin registers in SGLang's HookRegistry.

- `sampler_forward_hook` (AROUND `Sampler.forward`): refuses a batch row that asks for samples
  under truncated or greedy sampling, and exposes the batch's sampling info and positions to
  the draw hooks below, which SGLang calls from inside `Sampler.forward` without them.
- `compute_logprobs_hook` (AROUND `OutputLogprobProcessor.compute_logprobs`, sglang >= 0.5.16)
  and `attach_logprobs_hook` (AROUND `Sampler._attach_logprobs_to_output`, 0.5.12 - 0.5.15):
  let SGLang do everything but the top-K, then fill the top-logprob slots with the sampled token
  and K draws (`draws.draw_token_samples`).
- `admission_hook` (AFTER `TokenizerManager._create_tokenized_object`): the per-request error
  path; its ValueError becomes SGLang's HTTP 400 `invalid_request_error` with our message.
- `refuse_server_config` (AFTER `ServerArgs.check_server_args`): stops the server at start-up
  under settings the mode cannot serve (speculative decoding, watermarking, original logprobs).
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import threading
from typing import List, NamedTuple, Optional, Sequence

import torch

from .constraints import request_refusal, server_refusal, truncation_problem
from .draws import draw_token_samples

logger = logging.getLogger(__name__)


class _BatchContext(NamedTuple):
    """What the draw hooks need from the enclosing Sampler.forward call."""

    sampling_info: object
    positions: Optional[torch.Tensor]


_current = threading.local()


def _batch_context() -> Optional[_BatchContext]:
    return getattr(_current, "batch", None)


def sampler_forward_hook(original, *args, **kwargs):
    call = _bind(original, args, kwargs).arguments
    if call["return_logprob"]:
        reject_unfaithful_rows(
            call["sampling_info"], call["top_logprobs_nums"], call.get("logprob_logits")
        )
    _current.batch = _BatchContext(call["sampling_info"], call["positions"])
    try:
        return original(*args, **kwargs)
    finally:
        _current.batch = None


def reject_unfaithful_rows(
    sampling_info, top_logprobs_nums: Sequence[int], logprob_logits: Optional[torch.Tensor]
) -> None:
    """Raise ValueError naming the first batch row that asks for samples its sampling cannot
    back. Reads per-row parameters off the device only when a batch-wide flag says some row
    truncates, so the common untruncated batch costs no synchronisation."""
    rows = [i for i, k in enumerate(top_logprobs_nums) if k > 0]
    if not rows:
        return
    if logprob_logits is not None:
        problem = "watermarked sampling (its logprobs describe the pre-watermark logits)"
        raise _row_refusal(rows[0], problem, top_logprobs_nums)
    if sampling_info.is_all_greedy:
        raise _row_refusal(rows[0], truncation_problem(1, 1.0, 0.0), top_logprobs_nums)
    if not (
        sampling_info.need_top_k_sampling
        or sampling_info.need_top_p_sampling
        or sampling_info.need_min_p_sampling
    ):
        return
    index = torch.tensor(rows, dtype=torch.long, device=sampling_info.top_ks.device)
    per_row = zip(
        rows,
        sampling_info.top_ks[index].tolist(),
        sampling_info.top_ps[index].tolist(),
        sampling_info.min_ps[index].tolist(),
    )
    for row, top_k, top_p, min_p in per_row:
        problem = truncation_problem(top_k, top_p, min_p)
        if problem is not None:
            raise _row_refusal(row, problem, top_logprobs_nums)


def _row_refusal(row: int, problem: str, top_logprobs_nums: Sequence[int]) -> ValueError:
    return ValueError(f"batch row {row}: " + request_refusal(problem, top_logprobs_nums[row]))


def compute_logprobs_hook(original, *args, **kwargs):
    call = _bind(original, args, kwargs)
    context = _context_for(call.arguments["top_logprobs_nums"])
    if context is None:
        return original(*args, **kwargs)
    result = _call_without_top_k(original, call)
    result.top_logprobs_val, result.top_logprobs_idx = _draw(context, call.arguments)
    return result


def attach_logprobs_hook(original, *args, **kwargs):
    call = _bind(original, args, kwargs)
    context = _context_for(call.arguments["top_logprobs_nums"])
    if context is None:
        return original(*args, **kwargs)
    _call_without_top_k(original, call)
    output = call.arguments["logits_output"]
    output.next_token_top_logprobs_val, output.next_token_top_logprobs_idx = _draw(
        context, call.arguments
    )
    return None


@functools.lru_cache(maxsize=None)
def _signature(function) -> inspect.Signature:
    return inspect.signature(function)


def _bind(original, args, kwargs) -> inspect.BoundArguments:
    """The call's arguments by SGLang's parameter names, however they were passed."""
    return _signature(original).bind(*args, **kwargs)


def _call_without_top_k(original, call: inspect.BoundArguments):
    """SGLang's own logprob step with every row's top-K turned off (no top-k pass)."""
    nums = call.arguments["top_logprobs_nums"]
    call.arguments["top_logprobs_nums"] = [0] * len(nums)
    try:
        return original(*call.args, **call.kwargs)
    finally:
        call.arguments["top_logprobs_nums"] = nums


def _context_for(top_logprobs_nums: Sequence[int]) -> Optional[_BatchContext]:
    """The batch context when some row asks for samples, None to leave SGLang's top-K as is.

    A call from outside `Sampler.forward` carries no context: its rows were never checked, so
    it keeps the top-K (K entries, which the client helper rejects) and says so in the log."""
    if not any(k > 0 for k in top_logprobs_nums):
        return None
    context = _batch_context()
    if context is None:
        logger.warning(
            "fusedrl token samples: top logprobs requested outside Sampler.forward; "
            "returning SGLang's top-K unchanged for this call."
        )
    return context


def _draw(context: _BatchContext, arguments):
    seeds = context.sampling_info.sampling_seed
    return draw_token_samples(
        arguments["logprobs"],
        arguments["batch_next_token_ids"],
        arguments["top_logprobs_nums"],
        seeds=seeds,
        positions=context.positions if seeds is not None else None,
        # Some 0.5.1x releases hand _attach_logprobs_to_output probabilities plus this flag.
        logprobs_are_probs=bool(arguments.get("logprobs_are_probs", False)),
    )


def admission_hook(tokenized, *args, **kwargs) -> None:
    """Reject a generate request with top_logprobs_num > 0 whose (SGLang-normalised) sampling
    parameters truncate the distribution, before it reaches the scheduler."""
    top_logprobs_num = getattr(tokenized, "top_logprobs_num", 0) or 0
    if not getattr(tokenized, "return_logprob", False) or top_logprobs_num <= 0:
        return None
    params = tokenized.sampling_params
    problem = truncation_problem(params.top_k, params.top_p, params.min_p)
    if problem is not None:
        raise ValueError(request_refusal(problem, top_logprobs_num))
    return None


def refuse_server_config(result, server_args, *args, load_problems: Sequence[str] = (), **kwargs):
    """Raise ValueError listing every reason this server cannot serve true draws."""
    problems = list(load_problems) + server_problems(server_args)
    if problems:
        raise ValueError(server_refusal("; ".join(problems)))
    return None


def server_problems(server_args) -> List[str]:
    """Server settings under which the draws would not match the sampled tokens."""
    problems = []
    algorithm = getattr(server_args, "speculative_algorithm", None)
    if algorithm is not None and str(algorithm).upper() != "NONE":
        problems.append(
            f"speculative decoding (speculative_algorithm={algorithm}) samples tokens outside "
            "the hooked sampler"
        )
    if getattr(server_args, "enable_watermark", False):
        problems.append(
            "watermarking (enable_watermark) samples from watermarked logits while the "
            "logprobs describe the pre-watermark ones"
        )
    problem = original_logprob_problem()
    if problem is not None:
        problems.append(problem)
    return problems


def original_logprob_problem() -> Optional[str]:
    """SGLANG_RETURN_ORIGINAL_LOGPROB hands the logprob step pre-temperature values."""
    if os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "").strip().lower() in ("1", "true"):
        return "SGLANG_RETURN_ORIGINAL_LOGPROB=1 makes the logprobs untempered"
    return None
