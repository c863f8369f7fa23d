"""Eager float64 references: the tests' truth, and the CPU path when Triton is not interpreted.

Written the plain way (full softmax over the gathered vocabulary) so that it shares no numerics
with the fused kernels: with float64 logits it is exact to float64 rounding.
"""

import torch
import torch.distributed as dist

from ._contract import REFERENCE_DTYPES, TokenStats, check_token_stats_inputs
from ._tp import resolve_tp


class _GatherVocab(torch.autograd.Function):
    """All-gather vocabulary shards into full rows; backward keeps this rank's column slice.

    Every rank then computes the same loss on the same full rows, so the gradient of its shard is
    exactly its slice of the full gradient: no reduction is needed.
    """

    @staticmethod
    def forward(ctx, shard, group, rank):
        ctx.rank, ctx.width = rank, shard.shape[-1]
        parts = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, shard.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad_full):
        start = ctx.rank * ctx.width
        return grad_full[..., start : start + ctx.width], None, None


def token_stats_reference(
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
    """Same arguments and results as `fusedrl.kernels.token_stats`, computed in float64 eagerly.

    `inplace_backward` is accepted for signature parity and ignored (the gradient is a new tensor).
    """
    del inplace_backward
    tp = resolve_tp(tp_group)
    inputs = check_token_stats_inputs(
        logits, ids, temperature, rows, tp.size, tp.rank, validate, REFERENCE_DTYPES
    )
    out_dtype = torch.promote_types(inputs.logits.dtype, torch.float32)
    selected = inputs.logits if inputs.rows is None else inputs.logits.index_select(0, inputs.rows)
    tempered = selected.double() / inputs.temperature
    if tp.group is not None:
        tempered = _GatherVocab.apply(tempered, tp.group, tp.rank)
    log_probs = torch.log_softmax(tempered, dim=-1)
    logp = log_probs.gather(1, inputs.ids)
    scores = tempered.gather(1, inputs.ids)
    entropy = None
    if with_entropy:
        # -inf columns (masked vocabulary) add 0, not 0 * -inf; masked_fill, unlike where, also
        # keeps that NaN out of the gradient. NaN logits stay NaN.
        finite_log_probs = log_probs.masked_fill(log_probs == float("-inf"), 0.0)
        entropy = -(log_probs.exp() * finite_log_probs).sum(-1).to(out_dtype)
    return TokenStats(logp.to(out_dtype), entropy, scores.to(out_dtype))


def token_logprobs_reference(logits, ids, **kwargs):
    """(logp, entropy) of `token_stats_reference`."""
    stats = token_stats_reference(logits, ids, **kwargs)
    return stats.logp, stats.entropy


def segment_sum_reference(values, mask, segment_ids, denominators):
    """Same result as `fusedrl.kernels.segment_sum` on checked inputs, computed in float64 eagerly.

    Written the plain way (masked sum per segment, then divide, then add the segments) so that it
    shares no numerics with the kernel's per-token weights; differentiable through autograd. Does
    not check its inputs: `segment_sum` checks them before dispatching here.
    """
    out_dtype = torch.promote_types(values.dtype, torch.float32)
    matrix = values.double() if values.dim() == 2 else values.double().unsqueeze(1)
    masked = matrix * mask.double().unsqueeze(1)
    per_segment = masked.new_zeros((denominators.numel(), matrix.shape[1]))
    per_segment = per_segment.index_add(0, segment_ids.long(), masked)
    total = (per_segment / denominators.double().unsqueeze(1)).sum(dim=0)
    return total.reshape(values.shape[1:]).to(out_dtype)


def token_draws_reference(logprobs, uniforms, rows, logprobs_are_probs=False):
    """Same ids as `fusedrl.kernels.token_draws` on checked inputs (`rows` an index tensor),
    computed the plain way: fp32 probabilities, their float64 cumulative sum over the whole row,
    and a search for each uniform times the total (strictly below it, so no draw runs past the
    last token with mass). A row without a finite, positive total raises ValueError."""
    selected = logprobs.index_select(0, rows).float()
    weights = selected if logprobs_are_probs else selected.exp()
    cdf = torch.cumsum(weights.double(), dim=1)
    total = cdf[:, -1:]
    bad = ~((total > 0) & (total < float("inf")))
    if bool(bad.any()):
        row = int(rows[int(torch.nonzero(bad[:, 0])[0])])
        raise ValueError(
            f"logprobs row {row} has no finite, positive probability mass to draw from "
            "(every entry -inf, or a NaN or +inf)"
        )
    targets = torch.minimum(uniforms.double() * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, targets, right=True).clamp_(max=logprobs.shape[1] - 1)
