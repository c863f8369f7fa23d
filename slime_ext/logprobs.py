"""Fused replacements of slime's log-prob / entropy functions, on `fusedrl.kernels.token_stats`.

slime's `get_log_probs_and_entropy` (slime/backends/megatron_utils/loss.py) divides the
`[T, V/tp]` logits by the rollout temperature, builds the shifted target of every packed row, runs
`calculate_log_probs_and_entropy` (slime/utils/ppo_utils.py) over all rows (a `[T, V/tp]` softmax
kept for backward) and slices each sample's response. The versions here return the same values:
the temperature is folded into the kernel, only the response rows are read (prompt and padding
rows are neither read nor given gradient), and slime's top-p replay takes the kept ids of each row
in compact form instead of a `[T, V/tp]` boolean mask.

Top-p replay, as slime defines it: for a response row with a recorded nucleus S (the row's
`top_p_token_ids[offsets[j]:offsets[j+1]]`), the log-prob is renormalised over S plus the sampled
token a, `log p(a) = z'(a) - logsumexp_{v in S u {a}} z'(v)`, while the entropy stays over the
full vocabulary; rows past the recorded offsets keep the full-vocabulary log-prob. The
renormaliser is computed from the kernel's gathered tempered logits (`scores`), whose gradient is
a pure one-hot scatter, so no masked softmax over the vocabulary is ever formed.
"""

from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..kernels import token_stats
from . import megatron
from .context_parallel import SampleRows
from .responses import ResponseTokens, check_values


class ReplaySupport(NamedTuple):
    """Compact top-p supports of N rows: `ids[N, J]` (slot 0 = the sampled token), `valid[N, J]`
    (slots that belong to the row's set, each id once) and `recorded[N]` (rows with a nucleus)."""

    ids: torch.Tensor
    valid: torch.Tensor
    recorded: torch.Tensor

    def at(self, slots) -> "ReplaySupport":
        """The supports of rows `slots`."""
        return ReplaySupport(self.ids[slots], self.valid[slots], self.recorded[slots])


def _as_long_tensor(values) -> torch.Tensor:
    """slime stores replay data as lists, tensors or lazy `TensorRef`s (`.load()`)."""
    if hasattr(values, "load"):
        values = values.load()
    return torch.as_tensor(values, dtype=torch.long).reshape(-1)


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def support_from_pairs(targets: torch.Tensor, pair_rows: torch.Tensor, pair_ids: torch.Tensor, recorded) -> ReplaySupport:
    """Build the rectangular support of N rows from (row, id) pairs of kept ids.

    Duplicates and the sampled token itself are dropped from the pairs (the target sits in slot 0);
    J is rounded up to a power of two so the kernel sees few distinct shapes.
    """
    num_rows, device = targets.numel(), targets.device
    pair_rows, pair_ids = pair_rows.to(device), pair_ids.to(device)
    other = pair_ids != targets[pair_rows]
    pair_rows, pair_ids = pair_rows[other], pair_ids[other]
    if pair_ids.numel():
        span = int(pair_ids.max()) + 1
        keys = torch.unique(pair_rows * span + pair_ids)  # sorted: rows ascending, ids ascending
        pair_rows, pair_ids = keys // span, keys % span
    counts = torch.bincount(pair_rows, minlength=num_rows)
    width = _next_power_of_two(1 + int(counts.max()) if num_rows else 1)
    ids = targets.unsqueeze(1).repeat(1, width)
    valid = torch.zeros((num_rows, width), dtype=torch.bool, device=device)
    valid[:, 0] = True
    starts = torch.cumsum(counts, 0) - counts
    slots = 1 + torch.arange(pair_rows.numel(), device=device) - starts[pair_rows]
    ids[pair_rows, slots] = pair_ids
    valid[pair_rows, slots] = True
    return ReplaySupport(ids, valid, torch.as_tensor(recorded, dtype=torch.bool, device=device))


def replay_support(
    targets: torch.Tensor,
    samples: Sequence[SampleRows],
    top_p_token_ids: Sequence,
    top_p_token_offsets: Sequence,
) -> ReplaySupport:
    """Supports of the selected response rows from slime's per-sample `(ids, offsets)` replay data.

    Sample i's response position j has nucleus `ids[offsets[j]:offsets[j + 1]]` when
    `j < len(offsets) - 1`; other positions are not recorded (full vocabulary).
    """
    pair_rows, pair_ids, recorded = [], [], []
    base = 0
    for sample, ids, offsets in zip(samples, top_p_token_ids, top_p_token_offsets, strict=True):
        ids, offsets = _as_long_tensor(ids), _as_long_tensor(offsets)
        positions = sample.positions.cpu()
        has_nucleus = positions < offsets.numel() - 1
        recorded.append(has_nucleus)
        local = torch.nonzero(has_nucleus).squeeze(1)
        starts, ends = offsets[positions[local]], offsets[positions[local] + 1]
        counts = ends - starts
        within = torch.arange(int(counts.sum())) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
        pair_rows.append(base + torch.repeat_interleave(local, counts))
        pair_ids.append(ids[torch.repeat_interleave(starts, counts) + within])
        base += positions.numel()
    empty = torch.zeros(0, dtype=torch.long)
    return support_from_pairs(
        targets,
        torch.cat(pair_rows) if pair_rows else empty,
        torch.cat(pair_ids) if pair_ids else empty,
        torch.cat(recorded) if recorded else torch.zeros(0, dtype=torch.bool),
    )


def mask_support(targets: torch.Tensor, keep_mask: torch.Tensor, tp_group) -> ReplaySupport:
    """Supports from a `[T, V/tp]` keep mask (slime's own form): every tp rank's kept columns,
    gathered once so all ranks hold the same global ids. Rows kept whole are not recorded."""
    if keep_mask.shape[0] != targets.numel():
        raise ValueError(f"log_prob_keep_mask must have {targets.numel()} rows, got shape {tuple(keep_mask.shape)}")
    rank, size = megatron.rank_and_size(tp_group)
    vocab_local = keep_mask.shape[1]
    masked_rows = ~keep_mask.all(dim=1)
    if size > 1:
        everywhere = masked_rows.int()
        dist.all_reduce(everywhere, group=tp_group)  # a row is whole only if whole on every rank
        masked_rows = everywhere > 0
    pairs = torch.nonzero(keep_mask & masked_rows.unsqueeze(1))
    pairs[:, 1] += rank * vocab_local
    if size > 1:
        pairs = _all_gather_rows(pairs, tp_group, size)
    return support_from_pairs(targets, pairs[:, 0], pairs[:, 1], masked_rows)


def _all_gather_rows(x: torch.Tensor, group, size: int) -> torch.Tensor:
    """Concatenate every rank's `[n_r, 2]` rows (variable n_r) in rank order."""
    count = torch.tensor([x.shape[0]], device=x.device)
    counts = [torch.zeros_like(count) for _ in range(size)]
    dist.all_gather(counts, count, group=group)
    width = int(max(int(c) for c in counts))
    padded = torch.cat([x, x.new_zeros((width - x.shape[0], x.shape[1]))])
    parts = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([part[: int(c)] for part, c in zip(parts, counts)])


def renormalised_logp(logp: torch.Tensor, scores: torch.Tensor, support: ReplaySupport) -> torch.Tensor:
    """Log-prob of slot 0 renormalised over each recorded row's support; full-vocabulary log-prob
    elsewhere. Only gathered tempered logits enter the renormaliser (exact, no lse)."""
    in_support = scores.masked_fill(~support.valid, float("-inf"))
    restricted = scores[:, 0] - torch.logsumexp(in_support, dim=1)
    return torch.where(support.recorded, restricted, logp[:, 0])


def logprobs_and_entropy(stats, *, with_entropy_grad: bool, support: Optional[ReplaySupport] = None):
    """(log-prob [N], entropy [N] or None) of slot 0 from the kernel's `stats`, renormalised over
    the replay `support` when given. The entropy is detached when `with_entropy_grad` is false (a
    metric that no loss term uses)."""
    logp = stats.logp[:, 0] if support is None else renormalised_logp(stats.logp, stats.scores, support)
    entropy = stats.entropy
    if entropy is not None and not with_entropy_grad:
        entropy = entropy.detach()
    return logp, entropy


def locate_responses(
    logits, args, unconcat_tokens, total_lengths, response_lengths, top_p_token_ids=None, top_p_token_offsets=None
) -> Tuple[ResponseTokens, torch.Tensor, Optional[ReplaySupport]]:
    """The micro-batch's response rows, the sampled token each predicts and, with slime's replay
    data, their top-p supports."""
    tokens = ResponseTokens.locate(logits, total_lengths, response_lengths, args)
    targets = tokens.targets(unconcat_tokens)
    support = None
    if top_p_token_ids is not None and top_p_token_offsets is not None:
        support = replay_support(targets, tokens.samples, top_p_token_ids, top_p_token_offsets)
    return tokens, targets, support


def response_log_probs(
    logits: torch.Tensor,
    *,
    args,
    with_entropy: bool,
    with_entropy_grad: bool,
    tokens: ResponseTokens,
    targets: torch.Tensor,
    support: Optional[ReplaySupport] = None,
):
    """Per-sample response log-probs (and entropies) of the located `tokens` (sampled `targets`,
    replay `support` if any) in slime's CP layout: lists of 1-D tensors, zigzag-sliced under
    context parallelism (allgather-CP results are redistributed to zigzag).
    """
    ids = targets.unsqueeze(1) if support is None else support.ids
    stats = tokens.token_stats(
        logits, ids, temperature=float(getattr(args, "rollout_temperature", 1.0)), with_entropy=with_entropy
    )
    logp, entropy = logprobs_and_entropy(stats, with_entropy_grad=with_entropy_grad, support=support)
    return tokens.per_sample(logp), (tokens.per_sample(entropy) if entropy is not None else None)


def get_log_probs_and_entropy(
    logits: torch.Tensor,
    *,
    args,
    unconcat_tokens: List[torch.Tensor],
    total_lengths: List[int],
    response_lengths: List[int],
    with_entropy: bool = False,
    non_loss_data: bool = True,
    top_p_token_ids=None,
    top_p_token_offsets=None,
):
    """Drop-in for slime's `get_log_probs_and_entropy`: `(empty tensor, {"log_probs": [...],
    "entropy": [...]})`, one 1-D tensor per sample over the rank's response positions.

    As in slime, the entropy carries a gradient only when `args.entropy_coef != 0`.
    """
    if not non_loss_data:
        raise ValueError("non_loss_data must be True (slime's log-prob path only runs as non-loss data)")
    tokens, targets, support = locate_responses(
        logits, args, unconcat_tokens, total_lengths, response_lengths, top_p_token_ids, top_p_token_offsets
    )
    log_probs, entropies = response_log_probs(
        logits, args=args, with_entropy=with_entropy,
        with_entropy_grad=with_entropy and getattr(args, "entropy_coef", 0.0) != 0,
        tokens=tokens, targets=targets, support=support,
    )  # fmt: skip
    result = {"log_probs": log_probs}
    if with_entropy:
        result["entropy"] = entropies
    return torch.empty((0,), device=logits.device), result


def calculate_log_probs_and_entropy(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    tp_group,
    with_entropy: bool = False,
    chunk_size: int = -1,
    log_prob_keep_mask: Optional[torch.Tensor] = None,
    with_entropy_grad: bool = True,
):
    """Drop-in for slime's `calculate_log_probs_and_entropy`: log-probs `[T, 1]` of `tokens` under
    the (already tempered) `[T, V/tp]` logits and entropy `[T]` (or None), every row read.

    `chunk_size` only bounds slime's eager memory and is accepted and ignored; the keep mask
    renormalises the log-probs over each masked row's kept ids plus its target.
    """
    del chunk_size
    tokens = tokens.reshape(-1).long()
    support = None if log_prob_keep_mask is None else mask_support(tokens, log_prob_keep_mask, tp_group)
    if logits.shape[0] == 0:
        empty = logits.new_zeros((0,))
        return empty.unsqueeze(1), (empty if with_entropy else None)
    ids = tokens.unsqueeze(1) if support is None else support.ids
    stats = token_stats(
        logits, ids, temperature=1.0, with_entropy=with_entropy, tp_group=tp_group, validate=check_values()
    )
    logp, entropy = logprobs_and_entropy(stats, with_entropy_grad=with_entropy_grad, support=support)
    return logp.unsqueeze(1), entropy
