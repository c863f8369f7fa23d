"""Fused per-token statistics over vocabulary-parallel logits: log-probs of J ids, entropy, scores.

Why two kernels and one collective. The forward streams each row once with an online softmax and
emits `3 + J` per-row partials (running max `m`, rescaled exp-sum `s`, rescaled exp-weighted
centred-logit sum `u`, and the J gathered tempered logits). Under tensor parallelism those partials
are all-gathered once (`[tp, N, 3 + J]` floats, nothing of size V) and combined locally, so tp = 1
is the same code without the collective. Every loss in scope depends on a row only through
`logp[:, j]` and `entropy`, so the backward is one more streaming pass that writes
`dz' = sum_j c_j e_{id_j} + p * (-G - g_H (z' - E_p[z']))` (see docs/math.md) from the saved lse and
`E_p[z']`: no collective, each gradient element written exactly once in fp32 and cast (a bf16
read-modify-write of the target column would lose it), and the softmax term skipped for rows whose
coefficients vanish (a purely centred score on a fresh token).
"""

from typing import NamedTuple

import torch
import torch.distributed as dist

from ._contract import KERNEL_DTYPES, TokenStats, as_2d_logits, check_token_stats_inputs
from ._dispatch import tl, triton, uses_triton
from ._tp import resolve_tp
from .reference import token_stats_reference

MAX_BLOCK_V = 4096


def _block_v(vocab_local: int) -> int:
    return min(MAX_BLOCK_V, triton.next_power_of_2(vocab_local))


@triton.jit
def _token_stats_fwd_kernel(
    logits_ptr,
    stride_row,
    ids_ptr,
    rows_ptr,
    partials_ptr,
    vocab_local,
    vocab_start,
    inv_temperature,
    J: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    WITH_ENTROPY: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """One program per selected row: online max / exp-sum / centred sum, then the J gathers."""
    pid = tl.program_id(0).to(tl.int64)
    if HAS_ROWS:
        row = tl.load(rows_ptr + pid).to(tl.int64)
    else:
        row = pid
    row_ptr = logits_ptr + row * stride_row
    offs = tl.arange(0, BLOCK_V)

    running_max = float("-inf")
    exp_sum = 0.0
    centred_sum = 0.0  # sum exp(z' - m) * (z' - m), kept relative to m for an exact entropy
    for start in range(0, vocab_local, BLOCK_V):
        cols = start + offs
        z = tl.load(row_ptr + cols, mask=cols < vocab_local, other=float("-inf"))
        z = z.to(tl.float32) * inv_temperature
        new_max = tl.maximum(running_max, tl.max(z, axis=0))
        # While every column so far is -inf the sums are 0 around any finite reference point;
        # 0 keeps exp(-inf - -inf) = NaN out of the rescale.
        reference = tl.where(new_max == float("-inf"), 0.0, new_max)
        rescale = tl.exp(running_max - reference)
        shifted = z - reference
        e = tl.exp(shifted)
        if WITH_ENTROPY:
            # Moving the reference point from the old max to the new one shifts every term by
            # (old - new); the guards keep 0 * -inf out (empty sums, -inf columns), not NaN.
            moved = exp_sum * tl.where(exp_sum == 0.0, 0.0, running_max - reference)
            block_centred = tl.sum(e * tl.where(z == float("-inf"), 0.0, shifted), axis=0)
            centred_sum = rescale * (centred_sum + moved) + block_centred
        exp_sum = exp_sum * rescale + tl.sum(e, axis=0)
        running_max = new_max

    out = partials_ptr + pid * (3 + J)
    tl.store(out, running_max)
    tl.store(out + 1, exp_sum)
    tl.store(out + 2, centred_sum)
    for j in range(J):
        local_id = tl.load(ids_ptr + pid * J + j) - vocab_start
        owned = (local_id >= 0) & (local_id < vocab_local)
        gathered = tl.load(row_ptr + local_id, mask=owned, other=0.0).to(tl.float32)
        tl.store(out + 3 + j, gathered * inv_temperature)


@triton.jit
def _token_stats_bwd_kernel(
    grad_ptr,
    stride_grad_row,
    logits_ptr,
    stride_row,
    slots_ptr,
    ids_ptr,
    scatter_coef_ptr,
    logp_grad_sum_ptr,
    entropy_grad_ptr,
    lse_ptr,
    mean_z_ptr,
    vocab_local,
    vocab_start,
    inv_temperature,
    J: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    WITH_ENTROPY: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """One program per logits row: writes the whole gradient row once (zeros for unselected rows)."""
    row = tl.program_id(0).to(tl.int64)
    if HAS_ROWS:
        slot = tl.load(slots_ptr + row).to(tl.int64)
    else:
        slot = row
    selected = slot >= 0
    safe_slot = tl.where(selected, slot, 0)

    logp_grad_sum = tl.load(logp_grad_sum_ptr + safe_slot, mask=selected, other=0.0)
    lse = tl.load(lse_ptr + safe_slot, mask=selected, other=0.0)
    entropy_grad = 0.0
    mean_z = 0.0
    if WITH_ENTROPY:
        entropy_grad = tl.load(entropy_grad_ptr + safe_slot, mask=selected, other=0.0)
        mean_z = tl.load(mean_z_ptr + safe_slot, mask=selected, other=0.0)
    needs_softmax = (logp_grad_sum != 0.0) | (entropy_grad != 0.0)

    row_ptr = logits_ptr + row * stride_row
    grad_row_ptr = grad_ptr + row * stride_grad_row
    offs = tl.arange(0, BLOCK_V)
    for start in range(0, vocab_local, BLOCK_V):
        cols = start + offs
        in_vocab = cols < vocab_local
        grad = tl.zeros([BLOCK_V], dtype=tl.float32)
        if needs_softmax:
            z = tl.load(row_ptr + cols, mask=in_vocab, other=0.0).to(tl.float32) * inv_temperature
            p = tl.exp(z - lse)
            grad = -logp_grad_sum * p
            if WITH_ENTROPY:
                grad -= entropy_grad * tl.where(z == float("-inf"), 0.0, p * (z - mean_z))
        # Each id lands in one block: a scalar range test per (block, slot) keeps the one-hot
        # work at O(J * BLOCK_V) per row rather than O(J * V), so large top-p supports stay cheap.
        for j in range(J):
            local_id = tl.load(ids_ptr + safe_slot * J + j, mask=selected, other=-1) - vocab_start
            if (local_id >= start) & (local_id < start + BLOCK_V):
                coef = tl.load(scatter_coef_ptr + safe_slot * J + j)
                grad += tl.where(cols == local_id, coef, 0.0)
        grad = grad * inv_temperature
        tl.store(grad_row_ptr + cols, grad.to(grad_ptr.dtype.element_ty), mask=in_vocab)


def row_partials(logits_2d, ids, rows, vocab_start, temperature, with_entropy) -> torch.Tensor:
    """This rank's per-row partials, [N, P] fp32: the forward kernel launch.

    Row i of the result belongs to logits row `rows[i]` (row i when `rows` is None) and ids[i];
    partials of all ranks go through `all_rank_partials` and `combine_partials`.
    """
    num_out, num_ids = ids.shape
    partials = torch.empty((num_out, 3 + num_ids), dtype=torch.float32, device=logits_2d.device)
    if num_out == 0:
        return partials
    vocab_local = logits_2d.shape[1]
    _token_stats_fwd_kernel[(num_out,)](
        logits_2d,
        logits_2d.stride(0),
        ids,
        rows if rows is not None else ids,  # any pointer: unread without HAS_ROWS
        partials,
        vocab_local,
        vocab_start,
        1.0 / temperature,
        J=num_ids,
        HAS_ROWS=rows is not None,
        WITH_ENTROPY=with_entropy,
        BLOCK_V=_block_v(vocab_local),
        num_warps=8,
    )
    return partials


def all_rank_partials(partials: torch.Tensor, tp) -> torch.Tensor:
    """[tp, N, P]: the one collective of the forward (skipped when the vocabulary is whole)."""
    if tp.group is None:
        return partials.unsqueeze(0)
    gathered = [torch.empty_like(partials) for _ in range(tp.size)]
    dist.all_gather(gathered, partials, group=tp.group)
    return torch.stack(gathered)


def combine_partials(partials_all: torch.Tensor):
    """(lse [N], mean_z [N], entropy [N], scores [N, J]) from all ranks' partials [tp, N, P].

    Natural-log units: `logp = scores - lse[:, None]`; mean_z is E_p[z / temperature].
    """
    rank_max, rank_sum, rank_centred = partials_all[..., 0], partials_all[..., 1], partials_all[..., 2]
    row_max = rank_max.max(dim=0).values
    weight = torch.exp(rank_max - row_max)
    # A rank whose shard is all -inf has rank_sum = 0 and rank_max = -inf: its shift is 0, not NaN.
    shift = torch.where(rank_sum == 0, 0.0, rank_sum * (rank_max - row_max))
    exp_sum = (weight * rank_sum).sum(dim=0)
    centred_sum = (weight * (rank_centred + shift)).sum(dim=0)
    log_exp_sum = torch.log(exp_sum)
    centred_mean = centred_sum / exp_sum
    lse = row_max + log_exp_sum
    mean_z = row_max + centred_mean
    entropy = log_exp_sum - centred_mean
    scores = partials_all[..., 3:].sum(dim=0)
    return lse, mean_z, entropy, scores


def logits_grad(
    grad_out, logits_2d, ids, rows, lse, mean_z, logp_grad, entropy_grad, scores_grad, vocab_start, temperature
) -> torch.Tensor:
    """The backward kernel launch: writes every element of grad_out [T, V_local] and returns it.

    grad_out may be `logits_2d` itself (in-place). Rows not in `rows` get zeros. `logp_grad` and
    `scores_grad` are [N, J] (None: zero); `entropy_grad` is [N] or None (no entropy term).
    """
    logp_grad = _zeros_if_none(logp_grad, ids)
    scores_grad = _zeros_if_none(scores_grad, ids)
    num_rows, vocab_local = logits_2d.shape
    if num_rows == 0:
        return grad_out
    slots = None
    if rows is not None:
        slots = torch.full((num_rows,), -1, dtype=torch.int64, device=rows.device)
        slots[rows] = torch.arange(rows.numel(), device=rows.device)
    with_entropy = entropy_grad is not None
    _token_stats_bwd_kernel[(num_rows,)](
        grad_out,
        grad_out.stride(0),
        logits_2d,
        logits_2d.stride(0),
        slots if slots is not None else lse,  # any pointer: unread without HAS_ROWS
        ids,
        (logp_grad + scores_grad).float().contiguous(),
        logp_grad.float().sum(dim=1).contiguous(),
        entropy_grad.float().contiguous() if with_entropy else lse,
        lse,
        mean_z,
        vocab_local,
        vocab_start,
        1.0 / temperature,
        J=ids.shape[1],
        HAS_ROWS=rows is not None,
        WITH_ENTROPY=with_entropy,
        BLOCK_V=_block_v(vocab_local),
        num_warps=8,
    )
    return grad_out


def _zeros_if_none(grad, like):
    return torch.zeros(like.shape, dtype=torch.float32, device=like.device) if grad is None else grad


class _Settings(NamedTuple):
    """The non-tensor arguments of one call, passed to the autograd Function as one value."""

    temperature: float
    with_entropy: bool
    tp: object
    vocab_start: int
    inplace: bool


class _TokenStatsFunction(torch.autograd.Function):
    """Autograd over `logits` as the caller passed it ([T, V] or [1, T, V]): the 2-D view is taken
    inside, so an in-place backward hands back the caller's own buffer with no view-backward copy."""

    @staticmethod
    def forward(ctx, logits, ids, rows, settings: _Settings):
        logits_2d = as_2d_logits(logits)
        partials = row_partials(logits_2d, ids, rows, settings.vocab_start, settings.temperature, settings.with_entropy)
        lse, mean_z, entropy, scores = combine_partials(all_rank_partials(partials, settings.tp))
        ctx.save_for_backward(logits, ids, rows, lse, mean_z)
        ctx.settings = settings
        return scores - lse.unsqueeze(1), entropy if settings.with_entropy else None, scores

    @staticmethod
    def backward(ctx, logp_grad, entropy_grad, scores_grad):
        logits, ids, rows, lse, mean_z = ctx.saved_tensors
        settings = ctx.settings
        grad = logits if settings.inplace else torch.empty_like(logits)
        logits_grad(
            as_2d_logits(grad),
            as_2d_logits(logits),
            ids,
            rows,
            lse,
            mean_z,
            logp_grad,
            entropy_grad if settings.with_entropy else None,
            scores_grad,
            settings.vocab_start,
            settings.temperature,
        )
        return grad, None, None, None  # ids, rows and settings take no gradient


def token_stats(
    logits,
    ids,
    *,
    temperature=1.0,
    with_entropy=False,
    tp_group=None,
    rows=None,
    inplace_backward=False,
    validate=True,
) -> TokenStats:
    """Log-probs and tempered logits of J ids per row, and optionally the entropy, in one pass.

    logits: [T, V_local] or [1, T, V_local] (fp32, bf16 or fp16; last dim contiguous, any row
        stride). With a tensor-parallel group of size tp (default: megatron-core's when
        initialised) this rank holds global columns [rank * V_local, (rank + 1) * V_local); every
        column, vocabulary padding included, takes part in the softmax.
    ids: [N, J] global vocabulary ids (N = T, or len(rows)); repeated ids are independent slots.
    temperature: the logits are divided by it (fused; no tempered copy is made).
    rows: optional distinct row indices; only those rows are read, outputs follow `rows` order and
        the other rows get a zero gradient (slime's prompt and padding rows).
    inplace_backward: write the gradient into the logits buffer (the logits must not be used after).
    validate: check ids and rows values (one host sync each); shapes and dtypes are always checked.

    Returns `TokenStats(logp [N, J], entropy [N] or None, scores [N, J])`, float32.
    Masked vocabularies: -inf logits are ordinary input (probability 0, gradient exactly 0), in
    any column and on any TP rank, a whole shard included. A row with a NaN logit, a +inf logit
    or no finite logit at all has no distribution: its logp and entropy are NaN (scores stay the
    tempered logits), as is its gradient wherever the softmax term enters; other rows are
    unaffected. The float64 reference gives the same.
    Differentiable with respect to logits. CPU tensors outside the Triton interpreter take the
    float64 eager reference.
    """
    tp = resolve_tp(tp_group)
    inputs = check_token_stats_inputs(
        logits, ids, temperature, rows, tp.size, tp.rank, validate, KERNEL_DTYPES
    )
    if not uses_triton(inputs.logits, "token_stats"):
        return token_stats_reference(
            logits,
            ids,
            temperature=temperature,
            with_entropy=with_entropy,
            tp_group=tp_group,
            rows=rows,
            validate=False,
        )
    settings = _Settings(inputs.temperature, bool(with_entropy), tp, inputs.vocab_start, bool(inplace_backward))
    logp, entropy, scores = _TokenStatsFunction.apply(
        logits, inputs.ids.contiguous(), None if inputs.rows is None else inputs.rows.contiguous(), settings
    )
    return TokenStats(logp, entropy, scores)


def token_logprobs(logits, ids, **kwargs):
    """(logp [N, J], entropy [N] or None): `token_stats` without the scores."""
    stats = token_stats(logits, ids, **kwargs)
    return stats.logp, stats.entropy
