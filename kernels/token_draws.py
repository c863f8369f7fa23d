"""K draws per row from a vocabulary distribution by inverse CDF, reading each row once.

The rollout side's draws (sglang_plugin/draws.py): given log-probabilities `[B, V]` of the
distribution a token was just sampled from and K uniforms in (0, 1) per row, return the K tokens
at which the row's CDF crosses `u * total`, the same tokens as `torch.searchsorted` on the float64
cumulative sum (`token_draws_reference`), with no `[B, V]` buffer. Two kernels:

1. the streaming pass, split over the row (every row size fills the GPU): the probabilities (fp32
   `exp`, as the torch path) summed in float64 per group of GROUP tokens and per block of
   GROUPS_PER_PROGRAM groups, `ceil(V / GROUP)` + `ceil(V / 2048)` float64 numbers per row (under
   2 % of an fp32 row);
2. the search, per row and DRAWS_PER_PROGRAM draws: the row's total and the CDF at each block's
   end from the block sums; each target `u * total` finds its block (how many block ends are at
   or below it), then its group from that block's group sums, then its token by a float64 scan
   of that group, read again.

So the bytes are one read of the row plus at most K groups of GROUP tokens, the sums written once
and read back (the block sums twice per search program: 1.2 KB at V = 151936), and no
probability is coarser than float64 rounding (2**-53 of the total), as in the reference. A row
whose total is not finite and positive (all -inf, NaN, +inf) gets -1 for every draw, which
`token_draws` turns into an error. Deterministic: fixed reduction orders, no atomics.

Layers: the Triton kernels; their host launch (`token_draws_forward`); the torch.library op
`fusedrl::token_draws` with a fake implementation (no gradient: ids are not differentiable); and
`token_draws`, which checks the input and picks the path.
"""

import torch
from torch._subclasses.fake_tensor import FakeTensor

from ._contract import check_token_draws_inputs
from ._dispatch import tl, triton, uses_triton
from .reference import token_draws_reference

GROUP = 128  # tokens per CDF group: the re-read per draw, and V / GROUP float64 numbers per row
GROUPS_PER_PROGRAM = 16  # groups in a block, one program of the streaming pass: 2048 tokens
DRAWS_PER_PROGRAM = 4  # targets one search program takes: [4, GROUP] float64 in the re-read; 8 puts
# 8-16 bytes of stack on sm_80 (Triton 3.6, 3.9) or sm_120 (3.9)
SEARCH_STEP = 128  # block ends compared per step of the block search
NUM_WARPS = 4  # both kernels: no spill or stack on sm_80 to sm_120 (`python -m bench --static`)


@triton.jit
def _probabilities(row_ptr, columns, in_row, INPUT_IS_PROB: tl.constexpr):
    """float64 probabilities of `columns` (0 outside the row): fp32 exp of the log-probabilities,
    as the torch path computes them, or the probabilities themselves."""
    if INPUT_IS_PROB:
        p = tl.load(row_ptr + columns, mask=in_row, other=0.0).to(tl.float32)
    else:
        p = tl.exp(tl.load(row_ptr + columns, mask=in_row, other=float("-inf")).to(tl.float32))
    return p.to(tl.float64)


@triton.jit
def _group_sums_kernel(
    logprobs_ptr,
    stride_row,
    rows_ptr,
    group_sums_ptr,
    block_sums_ptr,
    vocab,
    num_groups,
    num_blocks,
    BLOCK_GROUP: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,
    INPUT_IS_PROB: tl.constexpr,
):
    """One program per (selected row, block of BLOCK_GROUPS groups of its tokens): the groups'
    float64 probability sums, and the block's (their sum)."""
    program = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1).to(tl.int64)
    groups = block * BLOCK_GROUPS + tl.arange(0, BLOCK_GROUPS).to(tl.int64)
    row_ptr = logprobs_ptr + tl.load(rows_ptr + program).to(tl.int64) * stride_row
    columns = groups[:, None] * BLOCK_GROUP + tl.arange(0, BLOCK_GROUP).to(tl.int64)[None, :]
    group_sums = tl.sum(_probabilities(row_ptr, columns, columns < vocab, INPUT_IS_PROB), axis=1)
    tl.store(group_sums_ptr + program * num_groups + groups, group_sums, mask=groups < num_groups)
    tl.store(block_sums_ptr + program * num_blocks + block, tl.sum(group_sums, axis=0))


@triton.jit
def _running_ends(sums_row, start, running, count, SEARCH_STEP: tl.constexpr):
    """The float64 CDF at the ends of SEARCH_STEP blocks from `start`, continuing `running` (a [1]
    tensor: the CDF before them); +inf past the last block."""
    blocks = start + tl.arange(0, SEARCH_STEP).to(tl.int64)
    ends = running + tl.cumsum(tl.load(sums_row + blocks, mask=blocks < count, other=0.0), axis=0)
    return tl.where(blocks < count, ends, float("inf"))


@triton.jit
def _row_total(sums_row, count, SEARCH_STEP: tl.constexpr):
    """The row's total as a [1] tensor, added block by block as `_running_ends` adds them, so the
    last block's end is the total bit for bit."""
    running = tl.zeros([1], dtype=tl.float64)
    for start in range(0, count, SEARCH_STEP):
        ends = _running_ends(sums_row, start, running, count, SEARCH_STEP)
        running = tl.max(tl.where(ends < float("inf"), ends, 0.0), axis=0, keep_dims=True)
    return running


@triton.jit
def _token_draws_kernel(
    logprobs_ptr,
    stride_row,
    rows_ptr,
    uniforms_ptr,
    group_sums_ptr,
    block_sums_ptr,
    ids_ptr,
    vocab,
    num_groups,
    num_blocks,
    num_draws,
    BLOCK_GROUP: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,
    DRAWS_PER_STEP: tl.constexpr,
    SEARCH_STEP: tl.constexpr,
    INPUT_IS_PROB: tl.constexpr,
):
    """One program per (selected row, DRAWS_PER_STEP of its draws): each target u * total finds
    its block by the block ends, its group by the block's group ends, then its token by a float64
    scan of that group (-1 for a row without a finite, positive total)."""
    program = tl.program_id(0).to(tl.int64)
    draws = tl.program_id(1).to(tl.int64) * DRAWS_PER_STEP + tl.arange(0, DRAWS_PER_STEP).to(tl.int64)
    draw_ok = draws < num_draws
    row_ptr = logprobs_ptr + tl.load(rows_ptr + program).to(tl.int64) * stride_row
    block_sums_row = block_sums_ptr + program * num_blocks
    total = _row_total(block_sums_row, num_blocks, SEARCH_STEP)
    has_mass = (total > 0) & (total < float("inf"))
    # the float64 just below the total: no target reaches it, so no draw runs past the last token
    # with mass
    below_total = (tl.where(has_mass, total, 1.0).to(tl.int64, bitcast=True) - 1).to(tl.float64, bitcast=True)
    uniforms = tl.load(uniforms_ptr + program * num_draws + draws, mask=draw_ok, other=0.5)
    targets = tl.minimum(uniforms * total, below_total)
    # the block of each target (how many block ends are at or below it) and the CDF before it
    block = tl.zeros([DRAWS_PER_STEP], dtype=tl.int32)
    block_base = tl.zeros([DRAWS_PER_STEP], dtype=tl.float64)
    running = tl.zeros([1], dtype=tl.float64)
    for start in range(0, num_blocks, SEARCH_STEP):
        ends = _running_ends(block_sums_row, start, running, num_blocks, SEARCH_STEP)
        passed = ends[None, :] <= targets[:, None]
        block += tl.sum(passed.to(tl.int32), axis=1)
        block_base = tl.maximum(block_base, tl.max(tl.where(passed, ends[None, :], 0.0), axis=1))
        running = tl.max(tl.where(ends < float("inf"), ends, 0.0), axis=0, keep_dims=True)
    block = tl.minimum(block, num_blocks - 1).to(tl.int64)
    # the group within the block: past the block's last group with mass only by rounding
    in_block = tl.arange(0, BLOCK_GROUPS)
    groups = block[:, None] * BLOCK_GROUPS + in_block[None, :]
    sums = tl.load(group_sums_ptr + program * num_groups + groups, mask=draw_ok[:, None] & (groups < num_groups),
                   other=0.0)  # fmt: skip
    group_ends = block_base[:, None] + tl.cumsum(sums, axis=1)
    last_group_with_mass = tl.max(tl.where(sums > 0, in_block[None, :], -1), axis=1)
    group_in_block = tl.minimum(tl.sum((group_ends <= targets[:, None]).to(tl.int32), axis=1), last_group_with_mass)
    base = tl.max(tl.where(in_block[None, :] < group_in_block[:, None], group_ends, block_base[:, None]), axis=1)
    group = block * BLOCK_GROUPS + group_in_block
    in_group = tl.arange(0, BLOCK_GROUP).to(tl.int64)
    columns = group[:, None] * BLOCK_GROUP + in_group[None, :]
    p = _probabilities(row_ptr, columns, draw_ok[:, None] & (columns >= 0) & (columns < vocab), INPUT_IS_PROB)
    within = tl.sum((base[:, None] + tl.cumsum(p, axis=1) <= targets[:, None]).to(tl.int32), axis=1)
    # a target past the group's rescanned end (rounding) takes the group's last token with mass
    last_with_mass = tl.max(tl.where(p > 0, tl.arange(0, BLOCK_GROUP)[None, :], -1), axis=1)
    ids = tl.where(has_mass, group * BLOCK_GROUP + tl.minimum(within, last_with_mass), -1)
    tl.store(ids_ptr + program * num_draws + draws, ids, mask=draw_ok)


def token_draws_forward(logprobs, uniforms, rows, logprobs_are_probs: bool) -> torch.Tensor:
    """The kernel launches on checked inputs: logprobs [B, V] (unit stride along V), float64
    uniforms [n, K] (contiguous), int64 rows [n]; returns int64 ids [n, K]."""
    num_rows, num_draws = uniforms.shape
    vocab = logprobs.shape[1]
    num_groups = triton.cdiv(vocab, GROUP)
    ids = torch.empty((num_rows, num_draws), dtype=torch.int64, device=logprobs.device)
    if num_rows == 0 or num_draws == 0:
        return ids
    num_blocks = triton.cdiv(num_groups, GROUPS_PER_PROGRAM)
    group_sums = torch.empty((num_rows, num_groups), dtype=torch.float64, device=logprobs.device)
    block_sums = torch.empty((num_rows, num_blocks), dtype=torch.float64, device=logprobs.device)
    _group_sums_kernel[(num_rows, num_blocks)](
        logprobs,
        logprobs.stride(0),
        rows,
        group_sums,
        block_sums,
        vocab,
        num_groups,
        num_blocks,
        BLOCK_GROUP=GROUP,
        BLOCK_GROUPS=GROUPS_PER_PROGRAM,
        INPUT_IS_PROB=logprobs_are_probs,
        num_warps=NUM_WARPS,
    )
    _token_draws_kernel[(num_rows, triton.cdiv(num_draws, DRAWS_PER_PROGRAM))](
        logprobs,
        logprobs.stride(0),
        rows,
        uniforms,
        group_sums,
        block_sums,
        ids,
        vocab,
        num_groups,
        num_blocks,
        num_draws,
        BLOCK_GROUP=GROUP,
        BLOCK_GROUPS=GROUPS_PER_PROGRAM,
        DRAWS_PER_STEP=DRAWS_PER_PROGRAM,
        SEARCH_STEP=SEARCH_STEP,
        INPUT_IS_PROB=logprobs_are_probs,
        num_warps=NUM_WARPS,
    )
    return ids


@torch.library.custom_op("fusedrl::token_draws", mutates_args=())
def token_draws_op(
    logprobs: torch.Tensor, uniforms: torch.Tensor, rows: torch.Tensor, logprobs_are_probs: bool
) -> torch.Tensor:
    """`token_draws_forward` as a torch op, opaque to torch.compile: int64 ids [n, K]."""
    return token_draws_forward(logprobs, uniforms, rows, logprobs_are_probs)


@token_draws_op.register_fake
def _token_draws_fake(logprobs, uniforms, rows, logprobs_are_probs):
    return uniforms.new_empty(uniforms.shape, dtype=torch.int64)


def token_draws(logprobs, uniforms, *, rows=None, logprobs_are_probs=False, validate=True) -> torch.Tensor:
    """Per selected row, the tokens at which its CDF crosses each uniform times its total.

    logprobs: [B, V] log-probabilities (fp32, bf16, fp16 or fp64; unit stride along V; -inf for
        masked tokens, which are never drawn), or with `logprobs_are_probs` the probabilities.
        The rows need not be normalised: the draws follow p / sum(p).
    uniforms: [n, K] floating uniforms in (0, 1), row i's for the i-th selected row (float64
        keeps every token's probability 2**-53-fine; lower precision is converted).
    rows: [n] distinct integer indices of the rows to draw from (default: all B rows, n = B).
    validate: check uniforms and rows (host syncs), and that every drawn row has a finite,
        positive total; shapes, dtypes and devices are always checked.

    Returns int64 ids [n, K]. CPU tensors outside the Triton interpreter take the float64
    reference (`token_draws_reference`), which returns the same ids except where a uniform lies
    within rounding of a CDF step.
    """
    inputs = check_token_draws_inputs(logprobs, uniforms, rows, validate)
    if not uses_triton(logprobs, "token_draws"):
        return token_draws_reference(inputs.logprobs, inputs.uniforms, inputs.rows, logprobs_are_probs)
    ids = token_draws_op(inputs.logprobs, inputs.uniforms, inputs.rows, logprobs_are_probs)
    has_values = not (ids.is_meta or isinstance(ids, FakeTensor))
    if validate and ids.numel() > 0 and has_values and bool((ids < 0).any()):
        (bad,) = torch.nonzero((ids < 0).any(dim=1))[0].tolist()
        raise ValueError(
            f"logprobs row {int(inputs.rows[bad])} has no finite, positive probability mass to draw from "
            "(every entry -inf, or a NaN or +inf)"
        )
    return ids
