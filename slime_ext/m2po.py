"""M2PO on the package's policy loss (--fusedrl-m2po-tau; Zheng et al., arXiv 2510.01161).

Per response token of the micro-batch, with log pi_theta the current log-prob and log pi_behav
the rollout's (`rollout_log_probs`, the policy that sampled the token):

    M2 = (log pi_theta - log pi_behav)^2,   r = exp(log pi_theta - log pi_behav)
    T  = loss-masked tokens with (A > 0 and r > 1) or (A < 0 and r < 1), the tokens a PPO clip
         would act on (r > 1 read as log pi_theta > log pi_behav, exactly)
    M  = the second-moment trust region over T at tau (`trust_region.second_moment_mask`: the
         largest M2 of T masked until T's mean M2 is <= tau), without gradient
    pg_loss = -M * r * A, no clip

The set is the whole micro-batch, the tokens the loss sees at once; under context parallelism its
tokens are spread over the cp ranks, so the selection spans the cp group (each token placed at its
position in the cp = 1 order: the result is the cp = 1 one). Tensor-parallel ranks compute the same
log-probs and so the same selection. The metrics, per token for slime's reducer: `m2po_masked_frac`
(1 where M masks a token), `m2po_m2_before` and `m2po_m2_after` (the micro-batch's mean M2 over T
before and after masking, 0 for an empty T, on every token: the reducer averages them over samples,
or tokens on the per-token path, like the other metrics). The SFC loss takes the same region
(`second_moment_region`) under --sfc-m2-tau to mask its centered-score term.
"""

from typing import Dict, NamedTuple, Optional

import torch

from . import megatron
from .context_parallel import chunked_loss_masks, response_ranges
from .flags.m2po import FLAG, tau
from .trust_region import second_moment_mask


class M2POTerms(NamedTuple):
    """M2PO's per-token pg_loss (gradient through the current log-probs) and per-token metrics."""

    pg_loss: torch.Tensor
    metrics: Dict[str, torch.Tensor]


def global_positions(total_lengths, response_lengths, cp_rank: int, cp_size: int, device) -> torch.Tensor:
    """[N] int64: each of the rank's response tokens (slime's zigzag layout) at its place in the
    micro-batch's cp = 1 order (samples concatenated, response positions in order)."""
    pieces, offset = [], 0
    for total, response in zip(total_lengths, response_lengths, strict=True):
        pieces += [torch.arange(offset + lo, offset + hi) for lo, hi in response_ranges(total, response, cp_rank, cp_size)]
        offset += response
    return (torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)).to(device)


class MicroBatchRegion(NamedTuple):
    """The trust region over a micro-batch on this rank: which of its tokens it keeps ([N] bool),
    the per-token metrics, and where its tokens sit (`global_positions`) in the cp group
    (None at cp = 1) the selection spans."""

    keep: torch.Tensor
    metrics: Dict[str, torch.Tensor]
    positions: torch.Tensor
    group: Optional[object]


def micro_batch_region(
    m2: torch.Tensor, in_set: torch.Tensor, threshold: float, total_lengths, response_lengths, dtype=torch.float32
) -> MicroBatchRegion:
    """The second-moment selection at `threshold` over the whole micro-batch (across the cp ranks),
    from this rank's tokens' M2 and membership (slime's CP layout), with M2PO's metrics in `dtype`:
    `m2po_masked_frac`, `m2po_m2_before`, `m2po_m2_after` (the set's mean M2 on every token)."""
    cp_rank, cp_size = megatron.cp_rank_and_size()
    positions = global_positions(total_lengths, response_lengths, cp_rank, cp_size, m2.device)
    group = megatron.cp_group() if cp_size > 1 else None
    region = second_moment_mask(m2, in_set, threshold, positions=positions, num_positions=sum(response_lengths), group=group)
    ones = torch.ones_like(m2, dtype=dtype)
    metrics = {
        "m2po_masked_frac": 1 - region.keep.to(ones.dtype),
        "m2po_m2_before": ones * region.before.to(ones.dtype),
        "m2po_m2_after": ones * region.after.to(ones.dtype),
    }
    return MicroBatchRegion(region.keep, metrics, positions, group)


def loss_masked(total_lengths, response_lengths, loss_masks, device) -> torch.Tensor:
    """[N] bool: this rank's response tokens the loss masks keep (slime's CP layout)."""
    cp_rank, cp_size = megatron.cp_rank_and_size()
    masks = chunked_loss_masks(total_lengths, response_lengths, loss_masks, cp_rank, cp_size)
    return torch.cat(masks).to(device) > 0 if masks else torch.zeros(0, dtype=torch.bool, device=device)


class SecondMomentRegion(NamedTuple):
    """M2PO's trust region over a micro-batch: which tokens it keeps ([N] bool), the log-ratio to
    the sampler (current - rollout log-prob, with the current log-probs' gradient) and the
    per-token metrics."""

    keep: torch.Tensor
    log_ratio: torch.Tensor
    metrics: Dict[str, torch.Tensor]


def second_moment_region(batch, log_probs: torch.Tensor, advantages: torch.Tensor, threshold: float, flag: str) -> SecondMomentRegion:
    """M2PO's trust region at `threshold` over the micro-batch, from the rank's concatenated
    current log-probs of the sampled tokens and their advantages (slime's CP layout): the set is
    the loss-masked tokens a PPO clip would act on; `flag` names the setting in the error when the
    batch has no rollout log-probs."""
    rollout_log_probs = batch.get("rollout_log_probs")
    if not rollout_log_probs:
        raise ValueError(
            f"{flag} needs the rollout log-probs (rollout_log_probs: each token's log-prob under the policy that "
            "sampled it, which slime's rollout records on Sample.rollout_log_probs) in the batch; it has none"
        )
    lengths = batch["total_lengths"], batch["response_lengths"]
    log_ratio = log_probs.float() - torch.cat(rollout_log_probs).to(log_probs.device).float()
    ahead = log_ratio.detach()
    in_set = loss_masked(*lengths, batch["loss_masks"], log_probs.device)
    in_set &= ((advantages > 0) & (ahead > 0)) | ((advantages < 0) & (ahead < 0))
    region = micro_batch_region(ahead.double() ** 2, in_set, threshold, *lengths)
    return SecondMomentRegion(region.keep, log_ratio, region.metrics)


def m2po_terms(args, batch, log_probs: torch.Tensor, advantages: torch.Tensor) -> Optional[M2POTerms]:
    """M2PO's terms from the rank's concatenated current log-probs and advantages (None when off)."""
    threshold = tau(args)
    if threshold is None:
        return None
    region = second_moment_region(batch, log_probs, advantages, threshold, FLAG)
    kept = region.keep.to(region.log_ratio.dtype)
    # exp of a masked token's log-ratio is never formed: its value (inf for an extreme outlier)
    # would turn 0 * inf into NaN, in the loss and in the gradient
    ratio = torch.exp(torch.where(region.keep, region.log_ratio, torch.zeros_like(region.log_ratio)))
    return M2POTerms(-kept * ratio * advantages, region.metrics)
