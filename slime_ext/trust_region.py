"""M2PO's second-moment trust region (Zheng et al., arXiv 2510.01161): which tokens of a set to
mask so that the mean of their squared log-ratios M2 over the rest is at most tau.

The paper's rule: while the mean of M2 over the set exceeds tau, mask the token of the set with
the largest M2 and remove it from the set (an empty set counts as satisfied). Removing the largest
value one at a time is the same as sorting the set's M2 in descending order and removing its first
k, k the smallest count whose remainder has a mean <= tau: `second_moment_mask` computes that
from the suffix sums of the sorted values, with no host sync and no data-dependent shapes.

Ties in M2 are broken by position: of two tokens with equal M2 the one at the lower position is
removed first (a stable descending sort), so the selection is a function of the values and their
positions alone. Deterministic: a stable sort, a fixed-order scan in float64 (torch.cumsum on CUDA
may add in a different order from run to run), indexed writes to distinct positions, no atomics.

The set may span the ranks of a process group (the context-parallel ranks of a micro-batch, each
holding some of each sample's tokens): each rank writes its values at their positions of the
group-wide order into zeros and one all-reduce (sum) assembles the whole; every position has one
writer, so the sum is exact whatever order the reduction adds in, every rank selects from the same
values, and each keeps its own tokens' part of the result.
"""

from typing import NamedTuple, Optional

import torch
import torch.distributed as dist


class TrustRegion(NamedTuple):
    """keep: [N] bool, False for the set's tokens the trust region masks (True elsewhere);
    before, after: 0-d float64 means of M2 over the set before and after masking (0 when empty)."""

    keep: torch.Tensor
    before: torch.Tensor
    after: torch.Tensor


def second_moment_mask(
    m2: torch.Tensor,
    in_set: torch.Tensor,
    tau: float,
    *,
    positions: Optional[torch.Tensor] = None,
    num_positions: Optional[int] = None,
    group=None,
) -> TrustRegion:
    """The trust region over the tokens `in_set` of M2 values `m2` ([N] each, N this rank's tokens).

    positions: [N] int64, each token's place in the order ties are broken by (default: 0..N-1);
    with a `group` of more than one rank, their places in the group-wide order of `num_positions`
    tokens, every place held by exactly one rank. No gradient flows (a stop-gradient selection)."""
    m2 = m2.detach().to(torch.float64)
    in_set = in_set.detach().to(torch.bool)
    if m2.shape != in_set.shape or m2.dim() != 1:
        raise ValueError(f"m2 and in_set must be 1-D of one shape, got {tuple(m2.shape)} and {tuple(in_set.shape)}")
    spread = group is not None and dist.get_world_size(group) > 1
    if positions is None:
        if spread:
            raise ValueError("positions (each token's place in the group-wide order) are required with a process group")
        positions = torch.arange(m2.numel(), device=m2.device)
    positions = positions.to(device=m2.device, dtype=torch.int64)
    size = m2.numel() if num_positions is None else int(num_positions)
    values = m2.new_zeros(size).index_put_((positions,), m2)
    members = m2.new_zeros(size).index_put_((positions,), in_set.to(torch.float64))
    if spread:
        both = torch.stack([values, members])
        dist.all_reduce(both, group=group)
        values, members = both[0], both[1]
    removed, before, after = _select(values, members > 0, float(tau))
    return TrustRegion(~removed[positions], before, after)


def _select(values: torch.Tensor, in_set: torch.Tensor, tau: float):
    """(removed [P] bool, before, after) over the whole order: the set's values sorted descending
    (ties: lower position first), the first k removed, k the first count whose remainder's mean
    is <= tau (k = the set's size when none is)."""
    keys = torch.where(in_set, values, torch.full_like(values, float("-inf")))
    order = torch.sort(keys, descending=True, stable=True).indices  # the set first, largest first
    count = in_set.sum()
    ranks = torch.arange(values.numel(), device=values.device)
    members = ranks < count  # sorted slot j holds a member of the set
    ordered = torch.where(members, values[order], torch.zeros_like(values))
    remaining = _suffix_sums(ordered)  # slot k: the sum of the set's values from slot k on
    left = (count - ranks).clamp_min(1).to(torch.float64)
    satisfied = ~members | (remaining / left <= tau)  # past the set: empty remainder, satisfied
    sentinel = torch.ones(1, dtype=torch.bool, device=values.device)
    removed_count = torch.argmax(torch.cat([satisfied, sentinel]).to(torch.int32))  # the first satisfied
    removed = torch.zeros_like(in_set).index_put_((order,), ranks < removed_count)
    first = torch.cat([remaining, remaining.new_zeros(1)])
    before = torch.where(count > 0, first[0] / count.clamp_min(1), first.new_zeros(()))
    kept = count - removed_count
    after = torch.where(kept > 0, first.index_select(0, removed_count.view(1))[0] / kept.clamp_min(1), first.new_zeros(()))
    return removed, before, after


def _suffix_sums(values: torch.Tensor) -> torch.Tensor:
    """out[k] = sum of values[k:], by a log-depth scan whose additions come in a fixed order."""
    out = values.flip(0)
    shift = 1
    while shift < out.numel():
        out = torch.cat([out[:shift], out[shift:] + out[:-shift]])
        shift *= 2
    return out.flip(0)
