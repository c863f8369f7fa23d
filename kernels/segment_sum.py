"""Segmented masked sum: per channel c, `sum_s (sum_{i in s} x[i, c] * m[i]) / D_s`, in one pass.

This is how every loss-aggregation mode reduces a micro-batch's per-token values: token i of
segment (sample) s weighs `m[i] / D_s`, with the denominators `D_s` fixed at step level so that
partial sums over micro-batches, data-parallel ranks and context-parallel chunks add up to the
whole step. C channels (pg_loss, entropy, approximate KL, clip fraction, ...) share one read of
the mask, segment ids and denominators.

Public form: a per-token segment index (`segment_ids[i]` = the segment of token i, any order,
segments may be empty), not per-segment lengths, so callers can pass CP-local tokens whose
segments are not contiguous runs of a known length without rebuilding offsets.

Deterministic by construction: each program sums a fixed block of rows into its own partial
(no atomics), and a second kernel adds the partials in block order. The same inputs give
bitwise identical outputs and gradients. The backward is `dx[i, c] = g[c] * m[i] / D_{s(i)}`, a
pure elementwise write; the mask and denominators are constants of the step and get no gradient.

Layers: the Triton kernels; their host launches (`segment_sum_forward`, `values_grad`); the
torch.library ops `fusedrl::segment_sum` and `fusedrl::segment_sum_backward` over them, with fake
implementations and registered autograd (what torch.compile sees); and `segment_sum`, which checks
the input and picks the path.
"""

import torch

from ._contract import check_segment_sum_inputs
from ._dispatch import tl, triton, uses_triton
from .reference import segment_sum_reference

BLOCK_ELEMENTS = 2048  # rows * channels of one tile
NUM_WARPS = 8  # 8 elements per thread per tile: full occupancy on Triton 3.6-3.9 (`python -m bench --static`)
MAX_BLOCK_CHANNELS = 16
# Tiles one forward program sums before its one reduction across threads: a [rows, channels]
# tile summed over its rows costs shuffles and a shared-memory round for every channel, which
# per tile was 26 instructions per element at 8 bf16 channels on sm_100 (`python -m bench --static`).
TILES_PER_PROGRAM = 8
PARTIALS_PER_STEP = 16  # partial rows the final reduction adds per loop step


@triton.jit
def _tile_rows(tile, num_rows, BLOCK_ROWS: tl.constexpr):
    """Tile `tile`'s rows (64-bit) and their in-bounds flags."""
    rows = tile * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS).to(tl.int64)
    return rows, rows < num_rows


@triton.jit
def _tile_channels(channel_block, num_channels, BLOCK_CHANNELS: tl.constexpr):
    """Channel block `channel_block`'s channels (64-bit) and their in-bounds flags."""
    channels = channel_block.to(tl.int64) * BLOCK_CHANNELS + tl.arange(0, BLOCK_CHANNELS).to(tl.int64)
    return channels, channels < num_channels


@triton.jit
def _row_weights(mask_ptr, segment_ptr, denom_ptr, rows, row_ok):
    """m[i] / D_{s(i)} per row, in the accumulation dtype (0 outside the tensor)."""
    mask = tl.load(mask_ptr + rows, mask=row_ok, other=0.0)
    segment = tl.load(segment_ptr + rows, mask=row_ok, other=0)
    denominator = tl.load(denom_ptr + segment, mask=row_ok, other=1.0)
    return mask / denominator


@triton.jit
def _tile_access(rows, row_ok, channels, channel_ok, stride_row, stride_channel, FULL_ROWS: tl.constexpr,
                 BLOCK_CHANNELS: tl.constexpr):  # fmt: skip
    """A tile's element offsets and in-bounds mask. FULL_ROWS (the host checked that the channels
    are contiguous and that stride_row and C are multiples of BLOCK_CHANNELS): every tile row is
    a whole, aligned run of BLOCK_CHANNELS elements, told to the compiler so that each thread's
    run is one vector access instead of one access per element."""
    if FULL_ROWS:
        offsets = (rows * stride_row)[:, None] + channels[None, :]
        offsets = tl.max_contiguous(tl.multiple_of(offsets, [1, BLOCK_CHANNELS]), [1, BLOCK_CHANNELS])
        mask = tl.broadcast_to(row_ok[:, None], (rows.shape[0], BLOCK_CHANNELS))
    else:
        offsets = (rows * stride_row)[:, None] + channels[None, :] * stride_channel
        mask = row_ok[:, None] & channel_ok[None, :]
    return offsets, mask


@triton.jit
def _segment_sum_partials_kernel(
    values_ptr,
    stride_row,
    stride_channel,
    mask_ptr,
    segment_ptr,
    denom_ptr,
    partials_ptr,
    num_rows,
    num_channels,
    FULL_ROWS: tl.constexpr,
    TILES: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_CHANNELS: tl.constexpr,
):
    """One program per (TILES row tiles, channel block): their weighted column sums, accumulated
    per element over the tiles and reduced across threads once."""
    program = tl.program_id(0).to(tl.int64)
    channels, channel_ok = _tile_channels(tl.program_id(1), num_channels, BLOCK_CHANNELS)
    acc = tl.zeros([BLOCK_ROWS, BLOCK_CHANNELS], dtype=denom_ptr.dtype.element_ty)
    last_tile = tl.minimum(program * TILES + TILES, tl.cdiv(num_rows, BLOCK_ROWS))  # a loop, not 8 copies of its body
    for tile in range(program * TILES, last_tile):
        rows, row_ok = _tile_rows(tile, num_rows, BLOCK_ROWS)
        weight = _row_weights(mask_ptr, segment_ptr, denom_ptr, rows, row_ok)
        offsets, mask = _tile_access(rows, row_ok, channels, channel_ok, stride_row, stride_channel, FULL_ROWS,
                                     BLOCK_CHANNELS)  # fmt: skip
        values = tl.load(values_ptr + offsets, mask=mask, other=0.0)
        acc += values.to(weight.dtype) * weight[:, None]
    tl.store(partials_ptr + program * num_channels + channels, tl.sum(acc, axis=0), mask=channel_ok)


@triton.jit
def _sum_partials_kernel(
    partials_ptr,
    out_ptr,
    num_blocks,
    num_channels,
    BLOCK_PARTIALS: tl.constexpr,
    BLOCK_CHANNELS: tl.constexpr,
):
    """One program per channel block: the row-block partials added in block order."""
    channels, channel_ok = _tile_channels(tl.program_id(0), num_channels, BLOCK_CHANNELS)
    acc = tl.zeros([BLOCK_PARTIALS, BLOCK_CHANNELS], dtype=out_ptr.dtype.element_ty)
    for start in range(0, num_blocks, BLOCK_PARTIALS):
        blocks = start + tl.arange(0, BLOCK_PARTIALS).to(tl.int64)
        tile = (blocks < num_blocks)[:, None] & channel_ok[None, :]
        acc += tl.load(partials_ptr + blocks[:, None] * num_channels + channels[None, :], mask=tile, other=0.0)
    tl.store(out_ptr + channels, tl.sum(acc, axis=0), mask=channel_ok)


@triton.jit
def _segment_sum_bwd_kernel(
    grad_out_ptr,
    mask_ptr,
    segment_ptr,
    denom_ptr,
    grad_values_ptr,
    num_rows,
    num_channels,
    FULL_ROWS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_CHANNELS: tl.constexpr,
):
    """dx[i, c] = g[c] * m[i] / D_{s(i)}, each element written once (grad_values is contiguous)."""
    rows, row_ok = _tile_rows(tl.program_id(0).to(tl.int64), num_rows, BLOCK_ROWS)
    channels, channel_ok = _tile_channels(tl.program_id(1), num_channels, BLOCK_CHANNELS)
    weight = _row_weights(mask_ptr, segment_ptr, denom_ptr, rows, row_ok)
    grad_out = tl.load(grad_out_ptr + channels, mask=channel_ok, other=0.0).to(weight.dtype)
    grad = weight[:, None] * grad_out[None, :]
    offsets, mask = _tile_access(rows, row_ok, channels, channel_ok, num_channels, 1, FULL_ROWS, BLOCK_CHANNELS)
    tl.store(grad_values_ptr + offsets, grad.to(grad_values_ptr.dtype.element_ty), mask=mask)


def _blocks(num_channels: int):
    """(rows, channels) per tile; depends only on C, so a given C always reduces the same way."""
    block_channels = min(MAX_BLOCK_CHANNELS, triton.next_power_of_2(max(num_channels, 1)))
    return BLOCK_ELEMENTS // block_channels, block_channels


def _full_rows(num_channels: int, stride_row: int, stride_channel: int, block_channels: int) -> bool:
    """Whether every tile row is a whole, aligned run of contiguous channels (`_tile_access`)."""
    return stride_channel == 1 and stride_row % block_channels == 0 and num_channels % block_channels == 0


def segment_sum_forward(values, mask, segment_ids, denominators) -> torch.Tensor:
    """The forward kernel launches on checked, converted inputs: values [N, C] (any strides), mask
    and denominators in the accumulation dtype, int64 segment ids; returns [C] in that dtype."""
    num_rows, num_channels = values.shape
    block_rows, block_channels = _blocks(num_channels)
    programs = triton.cdiv(triton.cdiv(num_rows, block_rows), TILES_PER_PROGRAM)
    channel_blocks = triton.cdiv(num_channels, block_channels)
    partials = torch.empty((programs, num_channels), dtype=denominators.dtype, device=values.device)
    out = torch.empty((num_channels,), dtype=denominators.dtype, device=values.device)
    if num_rows > 0 and num_channels > 0:
        _segment_sum_partials_kernel[(programs, channel_blocks)](
            values,
            values.stride(0),
            values.stride(1),
            mask,
            segment_ids,
            denominators,
            partials,
            num_rows,
            num_channels,
            FULL_ROWS=_full_rows(num_channels, values.stride(0), values.stride(1), block_channels),
            TILES=TILES_PER_PROGRAM,
            BLOCK_ROWS=block_rows,
            BLOCK_CHANNELS=block_channels,
            num_warps=NUM_WARPS,
        )
    if num_channels > 0:
        _sum_partials_kernel[(channel_blocks,)](
            partials,
            out,
            programs,
            num_channels,
            BLOCK_PARTIALS=PARTIALS_PER_STEP,
            BLOCK_CHANNELS=block_channels,
        )
    return out


def values_grad(grad_out, mask, segment_ids, denominators, values_dtype) -> torch.Tensor:
    """The backward kernel launch: dx [N, C] in `values_dtype`, dx[i, c] = g[c] * m[i] / D_s(i)."""
    num_rows, num_channels = mask.numel(), grad_out.numel()
    grad_values = torch.empty((num_rows, num_channels), dtype=values_dtype, device=mask.device)
    if num_rows > 0 and num_channels > 0:
        block_rows, block_channels = _blocks(num_channels)
        grid = (triton.cdiv(num_rows, block_rows), triton.cdiv(num_channels, block_channels))
        _segment_sum_bwd_kernel[grid](
            grad_out.to(denominators.dtype).contiguous(),
            mask,
            segment_ids,
            denominators,
            grad_values,
            num_rows,
            num_channels,
            FULL_ROWS=_full_rows(num_channels, num_channels, 1, block_channels),
            BLOCK_ROWS=block_rows,
            BLOCK_CHANNELS=block_channels,
            num_warps=NUM_WARPS,
        )
    return grad_values


@torch.library.custom_op("fusedrl::segment_sum", mutates_args=())
def segment_sum_op(
    values: torch.Tensor, mask: torch.Tensor, segment_ids: torch.Tensor, denominators: torch.Tensor
) -> torch.Tensor:
    """`segment_sum_forward` as a torch op, opaque to torch.compile: [C] in the denominators' dtype."""
    return segment_sum_forward(values, mask, segment_ids, denominators)


@segment_sum_op.register_fake
def _segment_sum_fake(values, mask, segment_ids, denominators):
    return denominators.new_empty(values.shape[1:])


@torch.library.custom_op("fusedrl::segment_sum_backward", mutates_args=())
def segment_sum_backward_op(
    grad_out: torch.Tensor,
    mask: torch.Tensor,
    segment_ids: torch.Tensor,
    denominators: torch.Tensor,
    values_dtype: torch.dtype,
) -> torch.Tensor:
    """`values_grad` as a torch op: dx [N, C] in `values_dtype`."""
    return values_grad(grad_out, mask, segment_ids, denominators, values_dtype)


@segment_sum_backward_op.register_fake
def _segment_sum_backward_fake(grad_out, mask, segment_ids, denominators, values_dtype):
    return mask.new_empty((mask.shape[0], grad_out.shape[0]), dtype=values_dtype)


def _segment_sum_setup_context(ctx, inputs, output):
    values, mask, segment_ids, denominators = inputs
    ctx.save_for_backward(mask, segment_ids, denominators)
    ctx.values_dtype = values.dtype


def _segment_sum_backward(ctx, grad_out):
    mask, segment_ids, denominators = ctx.saved_tensors
    # mask, segment ids and denominators are constants of the step: no gradient
    return segment_sum_backward_op(grad_out, mask, segment_ids, denominators, ctx.values_dtype), None, None, None


segment_sum_op.register_autograd(_segment_sum_backward, setup_context=_segment_sum_setup_context)


def segment_sum(values, mask, segment_ids, denominators, *, validate=True) -> torch.Tensor:
    """Per channel, the sum over segments s of (masked sum of the segment's values) / D_s.

    values: [N] or [N, C] per-token values (fp32, bf16, fp16 or fp64; any strides).
    mask: [N] per-token weights m (bool, integer or float; slime's loss mask), multiplied in.
    segment_ids: [N] integer segment of each token, in [0, S); any order, segments may be empty.
    denominators: [S] per-segment D_s, finite and > 0 (a fully masked segment contributes 0), and
        no smaller than the accumulation dtype's smallest normal once converted to it.
    validate: check segment ids, mask and denominator values (host syncs); shapes, dtypes and
        devices are always checked.

    Returns `values.shape[1:]` (a 0-d tensor for [N] values), accumulated and returned in fp32
    (fp64 for fp64 values). Differentiable with respect to values: dx = g * m / D_s. CPU tensors
    outside the Triton interpreter take the float64 eager reference.
    """
    check_segment_sum_inputs(values, mask, segment_ids, denominators, validate)
    if not uses_triton(values, "segment_sum"):
        return segment_sum_reference(values, mask, segment_ids, denominators)
    accumulate = torch.promote_types(values.dtype, torch.float32)
    matrix = values if values.dim() == 2 else values.unsqueeze(1)
    out = segment_sum_op(
        matrix,
        mask.to(accumulate).contiguous(),
        segment_ids.to(torch.int64).contiguous(),
        denominators.to(accumulate).contiguous(),
    )
    return out.reshape(values.shape[1:])
