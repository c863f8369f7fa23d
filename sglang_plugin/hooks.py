"""The sampler-side hook bodies the plugin registers in SGLang's HookRegistry.

- `sampler_forward_hook` (AROUND `Sampler.forward`): decides which batch rows get draws and
  exposes that, with the batch's sampling info and positions, to the draw hooks below, which
  SGLang calls from inside `Sampler.forward` without them.
- `compute_logprobs_hook` (AROUND `OutputLogprobProcessor.compute_logprobs`, sglang >= 0.5.16)
  and `attach_logprobs_hook` (AROUND `Sampler._attach_logprobs_to_output`, 0.5.12 - 0.5.15):
  let SGLang do everything but the top-K of the draw rows, then fill their top-logprob slots
  with the sampled token and K draws (`draws.draw_token_samples`).

These run inside the scheduler's event loop, where any exception kills the server. So they
never raise: a row that asks for samples its sampling cannot back (refused at admission, so
only reachable by a route that skips it) keeps SGLang's plain top-K, which the client helper
rejects (K entries, not 1 + K), and a failure of the plugin's own code falls back to SGLang's
untouched result. Both are logged once per process and kind.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
from typing import Dict, FrozenSet, NamedTuple, Optional, Sequence

import torch

from .constraints import request_refusal, truncation_problem
from .draws import draw_token_samples

logger = logging.getLogger(__name__)

_logged_once = set()


def _log_once(kind: str, message: str, *args, exc_info: bool = False) -> None:
    if kind in _logged_once:
        logger.debug(message, *args, exc_info=exc_info)
        return
    _logged_once.add(kind)
    logger.error(message + " (logged once per process)", *args, exc_info=exc_info)


class _BatchContext(NamedTuple):
    """What the draw hooks need from the enclosing Sampler.forward call."""

    sampling_info: object
    positions: Optional[torch.Tensor]
    draw_rows: FrozenSet[int]  # rows that asked for samples their sampling backs


_current = threading.local()


def sampler_forward_hook(original, *args, **kwargs):
    try:
        context = _batch_context(original, args, kwargs)
    except Exception:
        _log_once(
            "context",
            "fusedrl token samples: could not read the batch; this batch keeps SGLang's top-K",
            exc_info=True,
        )
        context = None
    _current.batch = context
    try:
        return original(*args, **kwargs)
    finally:
        _current.batch = None


def _batch_context(original, args, kwargs) -> Optional[_BatchContext]:
    call = _bind(original, args, kwargs).arguments
    if not call["return_logprob"]:
        return None
    nums = call["top_logprobs_nums"]
    vocab_size = call["logits_output"].next_token_logits.shape[-1]
    refused = unfaithful_rows(call["sampling_info"], nums, call.get("logprob_logits"), vocab_size)
    for row, problem in refused.items():
        _log_once(
            "unfaithful",
            "fusedrl token samples: batch row %d returns SGLang's top-K instead of draws: %s",
            row,
            request_refusal(problem, nums[row]),
        )
    draw_rows = frozenset(i for i, k in enumerate(nums) if k > 0 and i not in refused)
    return _BatchContext(call["sampling_info"], call["positions"], draw_rows)


def unfaithful_rows(
    sampling_info,
    top_logprobs_nums: Sequence[int],
    logprob_logits: Optional[torch.Tensor],
    vocab_size: Optional[int] = None,
) -> Dict[int, str]:
    """{row: problem} for the batch rows that ask for samples their sampling cannot back.

    Reads per-row parameters off the device only when a batch-wide flag says some row
    truncates, so the common untruncated batch costs no synchronisation."""
    rows = [i for i, k in enumerate(top_logprobs_nums) if k > 0]
    if not rows:
        return {}
    if logprob_logits is not None:
        problem = "watermarked sampling (its logprobs describe the pre-watermark logits)"
        return dict.fromkeys(rows, problem)
    if sampling_info.is_all_greedy:
        return dict.fromkeys(rows, truncation_problem(1, 1.0, 0.0))
    if not (
        sampling_info.need_top_k_sampling
        or sampling_info.need_top_p_sampling
        or sampling_info.need_min_p_sampling
    ):
        return {}
    index = torch.tensor(rows, dtype=torch.long, device=sampling_info.top_ks.device)
    per_row = zip(
        rows,
        sampling_info.top_ks[index].tolist(),
        sampling_info.top_ps[index].tolist(),
        sampling_info.min_ps[index].tolist(),
    )
    problems = {
        row: truncation_problem(top_k, top_p, min_p, vocab_size)
        for row, top_k, top_p, min_p in per_row
    }
    return {row: problem for row, problem in problems.items() if problem is not None}


def compute_logprobs_hook(original, *args, **kwargs):
    """AROUND OutputLogprobProcessor.compute_logprobs: top-K slots of draw rows become draws."""
    prepared = _prepare_draw_call(original, args, kwargs)
    if prepared is None:
        return original(*args, **kwargs)
    call, context = prepared
    result = _call_for_plain_rows(original, call, context.draw_rows)
    drawn = _draw_or_none(context, call.arguments)
    if drawn is None:
        return original(*args, **kwargs)
    result.top_logprobs_val, result.top_logprobs_idx = _merge(
        result.top_logprobs_val, result.top_logprobs_idx, drawn, context.draw_rows
    )
    return result


def attach_logprobs_hook(original, *args, **kwargs):
    """AROUND Sampler._attach_logprobs_to_output (0.5.12 - 0.5.15), the same for that shape."""
    prepared = _prepare_draw_call(original, args, kwargs)
    if prepared is None:
        return original(*args, **kwargs)
    call, context = prepared
    _call_for_plain_rows(original, call, context.draw_rows)
    drawn = _draw_or_none(context, call.arguments)
    if drawn is None:
        return original(*args, **kwargs)
    output = call.arguments["logits_output"]
    output.next_token_top_logprobs_val, output.next_token_top_logprobs_idx = _merge(
        getattr(output, "next_token_top_logprobs_val", None),
        getattr(output, "next_token_top_logprobs_idx", None),
        drawn,
        context.draw_rows,
    )
    return None


def _prepare_draw_call(original, args, kwargs):
    """(bound call, batch context) when some row of this call gets draws, else None."""
    try:
        call = _bind(original, args, kwargs)
        context = _context_for(call.arguments["top_logprobs_nums"])
    except Exception:
        _log_once(
            "bind",
            "fusedrl token samples: unexpected logprob call; SGLang's top-K kept",
            exc_info=True,
        )
        return None
    if context is None or not context.draw_rows:
        return None
    return call, context


@functools.lru_cache(maxsize=None)
def _signature(function) -> inspect.Signature:
    return inspect.signature(function)


def _bind(original, args, kwargs) -> inspect.BoundArguments:
    """The call's arguments by SGLang's parameter names, however they were passed."""
    return _signature(original).bind(*args, **kwargs)


def _call_for_plain_rows(original, call: inspect.BoundArguments, draw_rows: FrozenSet[int]):
    """SGLang's own logprob step with the top-K of the draw rows turned off."""
    nums = call.arguments["top_logprobs_nums"]
    call.arguments["top_logprobs_nums"] = [0 if i in draw_rows else k for i, k in enumerate(nums)]
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
    context = getattr(_current, "batch", None)
    if context is None:
        _log_once(
            "outside",
            "fusedrl token samples: top logprobs requested outside Sampler.forward; "
            "returning SGLang's top-K unchanged for this call",
        )
    return context


def _draw_or_none(context: _BatchContext, arguments):
    """(values, ids) per row from `draws.draw_token_samples`, None if drawing failed."""
    nums = [k if i in context.draw_rows else 0 for i, k in enumerate(arguments["top_logprobs_nums"])]
    seeds = context.sampling_info.sampling_seed
    try:
        return draw_token_samples(
            arguments["logprobs"],
            arguments["batch_next_token_ids"],
            nums,
            seeds=seeds,
            positions=context.positions if seeds is not None else None,
            # Some 0.5.1x releases hand _attach_logprobs_to_output probabilities plus this flag.
            logprobs_are_probs=bool(arguments.get("logprobs_are_probs", False)),
        )
    except Exception:
        _log_once(
            "draw",
            "fusedrl token samples: drawing failed; this batch keeps SGLang's top-K",
            exc_info=True,
        )
        return None


def _merge(plain_values, plain_ids, drawn, draw_rows: FrozenSet[int]):
    """Per-row top-logprob lists: the draws on draw rows, SGLang's top-K (if any) elsewhere."""
    drawn_values, drawn_ids = drawn
    if plain_values is None:
        return drawn_values, drawn_ids
    values, ids = list(plain_values), list(plain_ids)
    for row in draw_rows:
        values[row], ids[row] = drawn_values[row], drawn_ids[row]
    return values, ids
