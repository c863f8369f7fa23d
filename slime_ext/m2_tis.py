"""AReaL's variant of M2PO's trust region as a slime TIS function, for slime's own policy loss
and the package's: `--use-tis --custom-tis-function-path fusedrl.slime_ext.m2_tis.m2_trust_region_tis
--fusedrl-m2-tis-tau TAU`.

slime's TIS hook receives the trainer's old log-probs (recomputed before the rollout's first
step: AReaL's proximal policy) and the rollout's (the behaviour policy), not the current
log-probs or the advantages (slime's open PRs #2084 and #1912 ask for them), so the paper's form
(current over behaviour, the PPO-clip quadrant set: `--fusedrl-m2po-tau` on the package's policy
loss) cannot be written for slime's loss. AReaL's (areal/trainer/ppo/actor.py, `m2_threshold`)
can: per token M2 = (log pi_old - log pi_behav)^2 over every loss-masked token of the micro-batch,
no quadrant restriction, the largest masked until the mean of the rest is at most tau
(`m2po.micro_batch_region`, across the cp ranks); the kept tokens' pg_loss is weighted by
the behaviour importance ratio pi_old / pi_behav clamped to [--tis-clip-low, --tis-clip] (slime's
vanilla TIS, AReaL's decoupled loss), the masked ones drop out of the returned loss masks (slime
then leaves them out of every numerator, the denominators unchanged).

Metrics: slime's TIS ones (`tis`, `tis_clipfrac`, `tis_abs`) and M2PO's `m2po_masked_frac`,
`m2po_m2_before`, `m2po_m2_after` (the micro-batch's mean M2 before and after masking, on every token).
"""

from typing import Dict, List, Tuple

import torch
import torch.distributed as dist

from .flags.m2po import TIS_FLAG, tis_tau
from .m2po import loss_masked, micro_batch_region


def m2_trust_region_tis(
    args, *, pg_loss: torch.Tensor, train_log_probs: List[torch.Tensor], rollout_log_probs: List[torch.Tensor],
    loss_masks: List[torch.Tensor], total_lengths: List[int], response_lengths: List[int], **kwargs,
) -> Tuple[torch.Tensor, List[torch.Tensor], Dict[str, torch.Tensor]]:  # fmt: skip
    """slime's TIS signature: (re-weighted pg_loss, the loss masks without the masked tokens, metrics)."""
    threshold = tis_tau(args)
    if threshold is None:
        raise ValueError(f"--custom-tis-function-path {__name__}.m2_trust_region_tis needs {TIS_FLAG} (its tau)")
    device = pg_loss.device
    log_ratio = (torch.cat(train_log_probs).double() - torch.cat(rollout_log_probs).double()).to(device)
    in_set = loss_masked(total_lengths, response_lengths, loss_masks, device)
    region = micro_batch_region(log_ratio**2, in_set, threshold, total_lengths, response_lengths, pg_loss.dtype)
    ratio = torch.exp(log_ratio)
    weights = ratio.clamp(min=args.tis_clip_low, max=args.tis_clip)
    kept = region.keep.to(pg_loss.dtype)
    metrics = {
        "tis": ratio.to(pg_loss.dtype),
        "tis_clipfrac": (weights != ratio).to(pg_loss.dtype),
        "tis_abs": (ratio - 1).abs().to(pg_loss.dtype),
        **region.metrics,
    }
    masks = _without_masked(loss_masks, region.keep, region.positions, response_lengths, region.group)
    return pg_loss * weights.to(pg_loss.dtype) * kept, masks, metrics


def _without_masked(loss_masks, keep: torch.Tensor, positions: torch.Tensor, response_lengths, group) -> List[torch.Tensor]:
    """The full per-sample loss masks less every rank's masked tokens (one sum over the cp group:
    each position written by its one rank)."""
    removed = torch.zeros(sum(response_lengths), dtype=torch.float64, device=keep.device)
    removed.index_put_((positions,), (~keep).to(torch.float64))
    if group is not None:
        dist.all_reduce(removed, group=group)
    return [mask * (part == 0).to(device=mask.device, dtype=mask.dtype) for mask, part in zip(loss_masks, removed.split(list(response_lengths)))]
