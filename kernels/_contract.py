"""The input contracts of the ops, shared by each kernel and its eager reference.

Each entry point and its reference accept the same arguments and reject the same bad input with
the same message, so the checks (and token_stats' result type) live here once, in one style: every
failure is a ValueError naming the argument, the first bad value and where it sits, and survives
`python -O` (no asserts).
"""

import math
from typing import NamedTuple, Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
REFERENCE_DTYPES = KERNEL_DTYPES + (torch.float64,)
SEGMENT_VALUE_DTYPES = KERNEL_DTYPES + (torch.float64,)


class TokenStats(NamedTuple):
    """Per-row results; N rows (T, or len(rows)), J ids per row, all float32 (float64 for float64 logits).

    logp: log softmax(logits / temperature) at each id, [N, J].
    entropy: entropy of softmax(logits / temperature), [N], or None when not requested.
    scores: logits / temperature at each id, [N, J]; its gradient is a pure one-hot scatter (no
        softmax term), so differences of scores (score-function centering) carry no lse.
    """

    logp: torch.Tensor
    entropy: Optional[torch.Tensor]
    scores: torch.Tensor


class TokenStatsInputs(NamedTuple):
    """Validated arguments: 2-D logits view, ids, optional rows, and the tp layout."""

    logits: torch.Tensor  # [T, V_local]
    ids: torch.Tensor  # [N, J], int64
    rows: Optional[torch.Tensor]  # [N] int64 or None (then N = T)
    temperature: float
    vocab_start: int
    vocab_global: int


def as_2d_logits(logits: torch.Tensor) -> torch.Tensor:
    """Accept [T, V] or slime's [1, T, V]; return the [T, V] view."""
    if not isinstance(logits, torch.Tensor):
        raise ValueError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    if logits.dim() == 3 and logits.shape[0] == 1:
        logits = logits[0]
    if logits.dim() != 2:
        raise ValueError(f"logits must have shape [T, V] or [1, T, V], got {tuple(logits.shape)}")
    return logits


# The temperatures the kernels answer exactly. The kernels carry log2(e) / T and 1 / T as fp32 and
# the entropy's gradient a factor g_H / T^2: below 1e-6 that factor overflows fp32 for entropy
# gradients above ~3e8 (at 1e-19 for any), above 1e6 nothing breaks until log2(e) / T leaves fp32's
# normal range (~1e38); a symmetric range keeps a wide margin on both sides of what samplers use
# (SGLang treats temperatures below 1e-6 as greedy).
TEMPERATURE_RANGE = (1e-6, 1e6)


def check_temperature(temperature) -> float:
    """A sampling temperature must be a number within TEMPERATURE_RANGE (a string or a bool is
    refused, not converted: `"0.7"` from a config file is a bug to surface, not a value to guess).

    Plain comparisons (NaN fails both), no `math.isfinite`: under torch.compile a temperature that
    changes between calls is a symbolic float, which comparisons guard on and math cannot read.
    """
    if isinstance(temperature, (str, bytes, bool)) or not hasattr(temperature, "__float__"):
        raise ValueError(f"temperature must be a number, got {type(temperature).__name__} {temperature!r}")
    try:
        value = float(temperature)
    except (TypeError, ValueError, RuntimeError, OverflowError) as error:
        raise ValueError(f"temperature must be one number, got {_short(temperature)} ({error})") from None
    low, high = TEMPERATURE_RANGE
    if not low <= value <= high:
        raise ValueError(f"temperature must lie in [{low:g}, {high:g}], got {_short(temperature)}")
    return value


def _short(value) -> str:
    """repr of a value, cut to a line (an int of 400 digits, a large tensor)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def values_readable(*tensors) -> bool:
    """False for meta and fake tensors (shape propagation, torch.compile's tracing): they have
    shapes but no values, so value checks skip themselves and shape checks still run."""
    return not any(
        tensor.device.type == "meta" or isinstance(tensor, FakeTensor)
        for tensor in tensors
        if isinstance(tensor, torch.Tensor)
    )


def check_no_self_overlap(name: str, tensor: torch.Tensor, purpose: str) -> None:
    """A buffer that is written through (an in-place gradient) must not alias itself: a stride-0
    expand or rows closer than their width would take several writes per element, the last one
    winning, a silently wrong gradient."""
    if tensor.dim() == 2 and tensor.shape[0] > 1 and tensor.stride(0) < tensor.shape[1]:
        raise ValueError(
            f"{name} needs logits whose rows do not overlap ({purpose}), got shape "
            f"{tuple(tensor.shape)} with strides {tensor.stride()} (an expand or as_strided view); "
            "pass a contiguous copy or leave it False"
        )


def _first_bad(mask: torch.Tensor):
    """Index tuple of the first True element of mask."""
    return tuple(int(i) for i in mask.nonzero()[0])


def check_token_stats_inputs(
    logits, ids, temperature, rows, tp_size: int, tp_rank: int, validate: bool, dtypes=KERNEL_DTYPES
) -> TokenStatsInputs:
    """Normalise shapes and, when `validate`, check every value the kernel would trust blindly."""
    logits = as_2d_logits(logits)
    temperature = check_temperature(temperature)
    num_rows, vocab_local = logits.shape
    if logits.dtype not in dtypes:
        raise ValueError(f"logits dtype must be one of {dtypes}, got {logits.dtype}")
    if vocab_local == 0:
        raise ValueError("logits must have at least one vocabulary column, got V_local = 0")
    if logits.stride(1) != 1:
        raise ValueError(f"logits' last dim must be contiguous, got strides {logits.stride()}")
    if not isinstance(ids, torch.Tensor) or not _is_integer(ids):
        raise ValueError(f"ids must be an integer tensor, got {getattr(ids, 'dtype', type(ids))}")
    if ids.dim() != 2:
        raise ValueError(f"ids must have shape [N, J], got {tuple(ids.shape)}")
    if ids.shape[1] == 0:
        raise ValueError("ids must hold at least one id per row, got J = 0")
    if ids.device != logits.device:
        raise ValueError(f"ids are on {ids.device} but logits on {logits.device}")
    if rows is not None:
        rows = _check_rows(rows, num_rows, logits.device, validate)
    expected = num_rows if rows is None else rows.numel()
    if ids.shape[0] != expected:
        what = "T (logits rows)" if rows is None else "len(rows)"
        raise ValueError(f"ids must have {what} = {expected} rows, got ids of shape {tuple(ids.shape)}")
    vocab_global = vocab_local * tp_size
    if validate and ids.numel() > 0 and values_readable(ids):
        bad = (ids < 0) | (ids >= vocab_global)
        if bool(bad.any()):
            row, slot = _first_bad(bad)
            raise ValueError(
                f"ids must lie in [0, {vocab_global}), got ids[{row}, {slot}] = {int(ids[row, slot])}"
            )
    return TokenStatsInputs(logits, ids.long(), rows, temperature, tp_rank * vocab_local, vocab_global)


def _check_rows(rows, num_rows: int, device, validate: bool) -> torch.Tensor:
    """rows: 1-D distinct integer indices into the logits' rows."""
    if not isinstance(rows, torch.Tensor) or not _is_integer(rows):
        raise ValueError(f"rows must be an integer tensor, got {getattr(rows, 'dtype', type(rows))}")
    if rows.dim() != 1:
        raise ValueError(f"rows must be 1-D, got shape {tuple(rows.shape)}")
    if rows.device != device:
        raise ValueError(f"rows are on {rows.device} but logits on {device}")
    if validate and rows.numel() > 0 and values_readable(rows):
        bad = (rows < 0) | (rows >= num_rows)
        if bool(bad.any()):
            (i,) = _first_bad(bad)
            raise ValueError(f"rows must lie in [0, {num_rows}), got rows[{i}] = {int(rows[i])}")
        sorted_rows, _ = rows.sort()
        repeated = sorted_rows[1:] == sorted_rows[:-1]
        if bool(repeated.any()):
            (i,) = _first_bad(repeated)
            raise ValueError(f"rows must be distinct, got row {int(sorted_rows[i])} more than once")
    return rows.long()


def _is_integer(tensor: torch.Tensor) -> bool:
    """Integer dtypes only: no floats, complex or bool."""
    return not tensor.dtype.is_floating_point and not tensor.dtype.is_complex and tensor.dtype != torch.bool


def _check_tensor(name: str, tensor, dims: int) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D, got shape {tuple(tensor.shape)}")


def check_segment_sum_inputs(values, mask, segment_ids, denominators, validate: bool) -> None:
    """Shapes, dtypes and devices always; with `validate`, the values the kernel trusts (host syncs).

    Every failure is a ValueError naming the argument and the first bad value.
    """
    if not isinstance(values, torch.Tensor):
        raise ValueError(f"values must be a torch.Tensor, got {type(values).__name__}")
    if values.dim() not in (1, 2):
        raise ValueError(f"values must have shape [N] or [N, C], got {tuple(values.shape)}")
    if values.dtype not in SEGMENT_VALUE_DTYPES:
        raise ValueError(f"values dtype must be one of {SEGMENT_VALUE_DTYPES}, got {values.dtype}")
    num_rows = values.shape[0]
    _check_tensor("mask", mask, 1)
    _check_tensor("segment_ids", segment_ids, 1)
    _check_tensor("denominators", denominators, 1)
    for name, tensor in (("mask", mask), ("segment_ids", segment_ids)):
        if tensor.numel() != num_rows:
            raise ValueError(f"{name} must have N = {num_rows} entries (values' rows), got {tensor.numel()}")
    if mask.dtype.is_complex:
        raise ValueError(f"mask must be real (bool, integer or float), got {mask.dtype}")
    if not _is_integer(segment_ids):
        raise ValueError(f"segment_ids must be an integer tensor, got {segment_ids.dtype}")
    if denominators.dtype.is_complex or denominators.dtype == torch.bool:
        raise ValueError(f"denominators must be real numbers, got {denominators.dtype}")
    for name, tensor in (("mask", mask), ("segment_ids", segment_ids), ("denominators", denominators)):
        if tensor.device != values.device:
            raise ValueError(f"{name} is on {tensor.device} but values on {values.device}")
    for name, tensor in (("mask", mask), ("denominators", denominators)):
        if tensor.requires_grad:
            raise ValueError(f"{name} must not require grad: it is a constant of the step, got requires_grad=True")
    if validate and values_readable(mask, segment_ids, denominators):
        _check_values(mask, segment_ids, denominators, torch.promote_types(values.dtype, torch.float32))


def _check_values(mask, segment_ids, original_denominators, accumulate: torch.dtype) -> None:
    num_segments = original_denominators.numel()
    accumulated_denominators = original_denominators.to(accumulate)
    if segment_ids.numel() > 0:
        bad = (segment_ids < 0) | (segment_ids >= num_segments)
        if bool(bad.any()):
            (i,) = _first_bad(bad)
            raise ValueError(f"segment_ids must lie in [0, {num_segments}), got segment_ids[{i}] = {int(segment_ids[i])}")
    if mask.dtype.is_floating_point and mask.numel() > 0:
        bad = ~torch.isfinite(mask)
        if bool(bad.any()):
            (i,) = _first_bad(bad)
            raise ValueError(f"mask must be finite, got mask[{i}] = {float(mask[i])}")
    if num_segments > 0:
        # In the dtype the sums accumulate in: a float64 D that rounds to 0 or inf there, or to a
        # subnormal whose reciprocal overflows, would give NaN or inf weights m / D.
        smallest = torch.finfo(accumulated_denominators.dtype).tiny
        bad = ~(accumulated_denominators >= smallest) | ~torch.isfinite(accumulated_denominators)
        if bool(bad.any()):
            (i,) = _first_bad(bad)
            raise ValueError(
                f"denominators must be finite and >= {smallest:.3g} ({accumulated_denominators.dtype}'s smallest "
                f"normal, the dtype the sums accumulate in), got denominators[{i}] = "
                f"{float(original_denominators[i])!r}"
            )


class TokenDrawsInputs(NamedTuple):
    """Validated arguments of token_draws: the rows to draw from and their uniforms."""

    logprobs: torch.Tensor  # [B, V], unit stride along V
    uniforms: torch.Tensor  # [n, K] float64, contiguous
    rows: torch.Tensor  # [n] int64


def check_token_draws_inputs(logprobs, uniforms, rows, validate: bool) -> TokenDrawsInputs:
    """Shapes, dtypes and devices always; with `validate`, uniforms in (0, 1) and the rows' values
    (host syncs). A logprobs tensor strided along V is copied once to a unit stride."""
    _check_tensor("logprobs", logprobs, 2)
    _check_tensor("uniforms", uniforms, 2)
    if logprobs.dtype not in REFERENCE_DTYPES:
        raise ValueError(f"logprobs must be one of {REFERENCE_DTYPES}, got {logprobs.dtype}")
    if not uniforms.dtype.is_floating_point:
        raise ValueError(f"uniforms must be a floating tensor, got {uniforms.dtype}")
    if uniforms.device != logprobs.device:
        raise ValueError(f"uniforms are on {uniforms.device} but logprobs on {logprobs.device}")
    if logprobs.shape[1] == 0:
        raise ValueError(f"logprobs must have at least one column, got shape {tuple(logprobs.shape)}")
    if rows is None:
        rows = torch.arange(logprobs.shape[0], device=logprobs.device)
    rows = _check_rows(rows, logprobs.shape[0], logprobs.device, validate)
    if uniforms.shape[0] != rows.numel():
        raise ValueError(
            f"uniforms must have one row per drawn row ({rows.numel()}), got shape {tuple(uniforms.shape)}"
        )
    uniforms = uniforms.to(torch.float64).contiguous()
    if validate and uniforms.numel() > 0 and values_readable(uniforms):
        bad = ~((uniforms > 0) & (uniforms < 1))
        if bool(bad.any()):
            i, j = _first_bad(bad)
            raise ValueError(f"uniforms must lie in (0, 1), got uniforms[{i}, {j}] = {float(uniforms[i, j])}")
    if logprobs.stride(1) != 1:
        logprobs = logprobs.contiguous()
    return TokenDrawsInputs(logprobs, uniforms, rows)
