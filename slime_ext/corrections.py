"""slime's off-policy corrections of the policy gradient, for the package's policy loss.

What slime's `policy_loss_function` (slime/backends/megatron_utils/loss.py) does on top of the
per-token PPO / CISPO terms, with slime's semantics (written from its documented behaviour, not
copied):

- Sequence-level terms, which need each sample's whole response (`sequence_terms`):
  GSPO (--advantage-estimator gspo): every token's `ppo_kl` is its sample's masked mean of
  old - new log-probs (a sequence-level ratio), with a gradient through every token of the sample;
  OPSM (--use-opsm, --opsm-delta): a token with a negative advantage in a sample whose masked mean
  old - new log-prob exceeds the delta gets no pg_loss (`opsm_clipfrac`: per sample, the masked
  tokens over the sample's mask total, summed, as slime reports it).
  Under context parallelism a sample's tokens are spread over the cp ranks; slime all-gathers each
  whole sequence, here each rank all-reduces its per-sample partial sums (one float per sample,
  the all-reduce's backward carrying the gradient to every rank's tokens).
- The importance-sampling correction between the sampler and the trainer (`importance_sampling`,
  under --use-tis or --get-mismatch-metrics, as slime applies it under either): a function with
  slime's TIS signature, `--custom-tis-function-path` or slime's vanilla TIS (the trainer's old
  log-probs over the rollout's, clamped to [--tis-clip-low, --tis-clip]), returns the re-weighted
  per-token pg_loss, the loss masks it keeps (a rejection-sampling function drops tokens there) and
  its metrics. The kept masks then weigh pg_loss, the entropy and KL terms and the other metrics,
  over the original denominators; its own metrics and `ois` keep the original masks.
"""

import inspect
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence

import torch

from . import megatron
from .callables import load_function
from .context_parallel import chunked_loss_masks
from .flags.m2po import enabled as m2po_enabled


def sequence_level(args) -> Optional[str]:
    """The flag of a correction that needs whole sequences (None: none is on)."""
    if args.advantage_estimator == "gspo":
        return "--advantage-estimator gspo"
    return "--use-opsm" if getattr(args, "use_opsm", False) else None


def importance_sampling(args) -> Optional[str]:
    """The flag that turns slime's importance-sampling step on (None: off)."""
    if getattr(args, "use_tis", False):
        return "--use-tis"
    return "--get-mismatch-metrics" if getattr(args, "get_mismatch_metrics", False) else None


def whole_batch(args) -> Optional[str]:
    """The flag of a correction that needs every token of the micro-batch before any token's
    gradient (sequence-level terms, a TIS function over the whole pg_loss, or M2PO's trust region
    over the whole micro-batch, `m2po`), else None."""
    return sequence_level(args) or importance_sampling(args) or m2po_enabled(args)


class SequenceTerms(NamedTuple):
    """Per-token results of the sequence-level corrections (None where off)."""

    ppo_kl: Optional[torch.Tensor]  # GSPO's per-token ppo_kl (the sample's), with its gradient
    keep: Optional[torch.Tensor]  # OPSM's per-token pg_loss multiplier (0 or 1)
    opsm_clipfrac: Optional[torch.Tensor]


def _sample_mean_kl(log_probs: Sequence[torch.Tensor], old_log_probs: Sequence[torch.Tensor], batch) -> torch.Tensor:
    """[S]: per sample, sum over its whole response of (old - new) * mask / max(mask total, 1),
    each cp rank adding its tokens' part (differentiable all-reduce over the cp group)."""
    cp_rank, cp_size = megatron.cp_rank_and_size()
    masks = chunked_loss_masks(batch["total_lengths"], batch["response_lengths"], batch["loss_masks"], cp_rank, cp_size)
    device = log_probs[0].device
    partial = torch.stack(
        [((old - new) * mask.to(device)).sum() for new, old, mask in zip(log_probs, old_log_probs, masks, strict=True)]
    )
    if cp_size > 1:
        from torch.distributed.nn.functional import all_reduce

        partial = all_reduce(partial, group=megatron.cp_group())
    totals = torch.stack([mask.sum() for mask in batch["loss_masks"]]).to(device).clamp_min(1)
    return partial / totals


def sequence_terms(args, batch, log_probs: List[torch.Tensor], old_log_probs: List[torch.Tensor], advantages) -> SequenceTerms:
    """GSPO's and OPSM's per-token terms from per-sample (cp-local) log-probs and old log-probs,
    and the concatenated advantages."""
    if sequence_level(args) is None or not log_probs:
        return SequenceTerms(None, None, None)
    lengths = torch.tensor([len(x) for x in log_probs], device=advantages.device)
    seq_kl = _sample_mean_kl(log_probs, old_log_probs, batch)
    ppo_kl = torch.repeat_interleave(seq_kl, lengths) if args.advantage_estimator == "gspo" else None
    keep = opsm_clipfrac = None
    if getattr(args, "use_opsm", False):
        masked = ((advantages < 0) & (torch.repeat_interleave(seq_kl.detach(), lengths) > args.opsm_delta)).float()
        totals = torch.stack([mask.sum() for mask in batch["loss_masks"]]).to(masked.device).clamp_min(1)
        per_sample = torch.zeros(len(log_probs), device=masked.device).index_add_(
            0, torch.repeat_interleave(torch.arange(len(log_probs), device=masked.device), lengths), masked
        )
        keep, opsm_clipfrac = 1 - masked, (per_sample / totals).sum()
    return SequenceTerms(ppo_kl, keep, opsm_clipfrac)


class Corrected(NamedTuple):
    """What the TIS function returned: per-token pg_loss, the kept loss masks (full responses, as
    `batch["loss_masks"]`), and its per-token metrics."""

    pg_loss: torch.Tensor
    loss_masks: List[torch.Tensor]
    metrics: Dict[str, torch.Tensor]


def vanilla_tis(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kwargs):
    """slime's default TIS (`--use-tis` without `--custom-tis-function-path`): pg_loss times the
    ratio exp(train - rollout) clamped to [--tis-clip-low, --tis-clip]; the masks unchanged;
    metrics `tis` (the ratio), `tis_clipfrac` (clamped tokens), `tis_abs` (|ratio - 1|)."""
    ratio = torch.exp(torch.cat(train_log_probs) - torch.cat(rollout_log_probs))
    weights = ratio.clamp(min=args.tis_clip_low, max=args.tis_clip)
    metrics = {"tis": ratio.detach(), "tis_clipfrac": (weights != ratio).float(), "tis_abs": (ratio - 1).abs().detach()}
    return pg_loss * weights, loss_masks, metrics


def tis_function(args) -> Callable:
    """The TIS function slime would call: --custom-tis-function-path, else the vanilla one."""
    path = getattr(args, "custom_tis_function_path", None)
    return vanilla_tis if path is None else load_function(path)


def _checked(result, pg_loss: torch.Tensor, loss_masks: Sequence[torch.Tensor], flag: str) -> Corrected:
    """The TIS function's return, refused (ValueError naming the flag) unless it has slime's form."""
    if not (isinstance(result, tuple) and len(result) == 3):
        raise ValueError(f"{flag} must return (pg_loss, loss_masks, metrics), got {type(result).__name__}")
    new_loss, masks, metrics = result
    if not isinstance(new_loss, torch.Tensor) or new_loss.shape != pg_loss.shape:
        raise ValueError(f"{flag} returned a pg_loss of shape {getattr(new_loss, 'shape', None)}, expected {tuple(pg_loss.shape)}")
    shapes = [tuple(getattr(mask, "shape", ())) for mask in masks]
    if shapes != [tuple(mask.shape) for mask in loss_masks]:
        raise ValueError(f"{flag} returned loss masks of shapes {shapes}, expected those of the batch's loss_masks")
    if not isinstance(metrics, dict) or any(value.shape != pg_loss.shape for value in metrics.values()):
        raise ValueError(f"{flag} must return per-token metrics (a dict of tensors shaped like pg_loss)")
    return Corrected(new_loss, list(masks), metrics)


def apply_tis(args, batch, pg_loss: torch.Tensor, current_log_probs: List[torch.Tensor]) -> Corrected:
    """slime's TIS step on the per-token pg_loss: its function called with slime's keywords (the
    trainer's old log-probs, the current ones detached where the batch has none)."""
    flag = importance_sampling(args)
    rollout_log_probs = batch.get("rollout_log_probs")
    if not rollout_log_probs:
        raise ValueError(f"{flag} needs the rollout log-probs (rollout_log_probs) in the batch; it has none")
    train_log_probs = batch.get("log_probs") or [x.detach() for x in current_log_probs]
    path = getattr(args, "custom_tis_function_path", None)
    named = f"--custom-tis-function-path {path}" if path else flag
    function = tis_function(args)
    keywords = dict(
        args=args, pg_loss=pg_loss, train_log_probs=train_log_probs, rollout_log_probs=rollout_log_probs,
        loss_masks=batch["loss_masks"], total_lengths=batch["total_lengths"], response_lengths=batch["response_lengths"],
    )  # fmt: skip
    try:
        inspect.signature(function).bind(**keywords)
    except TypeError as error:
        raise ValueError(f"{named} does not take slime's TIS keywords: {error}") from None
    result = function(**keywords)
    return _checked(result, pg_loss, batch["loss_masks"], named)
