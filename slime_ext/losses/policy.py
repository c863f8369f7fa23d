"""slime's policy-gradient loss on the fused kernel, for `--loss-type custom_loss
--custom-loss-function-path fusedrl.slime_ext.losses.policy_loss`.

Same objective and metrics as slime's `policy_loss_function` (slime/backends/megatron_utils/
loss.py) for PPO clip (eps_clip / eps_clip_high, dual clip eps_clip_c), CISPO
(--advantage-estimator cispo), REINFORCE (--pg-loss-type reinforce), the entropy bonus, the KL
loss to the reference model (k1, k2, k3, low_var_kl; --use-unbiased-kl) and
--use-rollout-logprobs, with two differences:

- the log-probs and entropies come from one fused kernel pass over the response rows only
  (`logprobs.response_log_probs`), top-p replay included;
- pg_loss is aggregated by --loss-aggregation (`aggregation.aggregate_pg_loss`; sample_mean, the
  default, is slime's own formula), while the entropy and KL terms and every metric keep slime's
  reducer, as slime does for its --custom-pg-loss-reducer-function-path.

Per-token tensors follow slime's CP layout: the rank's zigzag response positions, samples
concatenated (old log-probs and advantages arrive sliced that way).

slime features this loss does not implement are refused (`flags/policy.py`: GSPO, OPSM, TIS /
mismatch metrics, a custom pg_loss reducer), never ignored: at startup through the package's entry
point, and at the loss's first call whichever way slime was started.
"""

import torch

from ..aggregation import aggregate_pg_loss
from ..arguments import check_at_first_use
from ..flags.policy import KL_TYPES, pg_loss_type
from ..logprobs import response_log_probs
from .contract import detached, reaching_logits


def approx_kl(log_probs, ref_log_probs, kl_loss_type: str, importance_ratio=None) -> torch.Tensor:
    """slime's per-token KL estimators of log pi - log pi_ref (Schulman's k1, k2, k3; low_var_kl
    is k3 clamped to [-10, 10]), optionally weighted by the importance ratio pi / pi_old."""
    log_ratio = log_probs.float() - ref_log_probs.float()
    if kl_loss_type == "k1":
        kl = log_ratio
    elif kl_loss_type == "k2":
        kl = log_ratio**2 / 2.0
    elif kl_loss_type in ("k3", "low_var_kl"):
        kl = torch.expm1(-log_ratio) + log_ratio
    else:
        raise ValueError(f"--kl-loss-type must be one of {KL_TYPES}, got {kl_loss_type!r}")
    if importance_ratio is not None:
        kl = importance_ratio * kl
    if kl_loss_type == "low_var_kl":
        kl = kl.clamp(min=-10, max=10)
    return kl


def clipped_surrogate(ppo_kl, advantages, eps_clip, eps_clip_high, eps_clip_c=None):
    """PPO's per-token clipped loss and clip indicator (dual clip caps negative-advantage tokens at
    -eps_clip_c * A)."""
    ratio = torch.exp(-ppo_kl)
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(1 - eps_clip, 1 + eps_clip_high) * advantages
    loss = torch.maximum(unclipped, clipped)
    clipfrac = (clipped > unclipped).float()
    if eps_clip_c is not None:
        loss = torch.where(advantages < 0, torch.minimum(-eps_clip_c * advantages, loss), loss)
    return loss, clipfrac


def cispo_surrogate(ppo_kl, log_probs, advantages, eps_clip, eps_clip_high):
    """CISPO: the clipped ratio as a stop-gradient weight on -A * log pi (gradient through log pi only)."""
    ratio = torch.exp(-ppo_kl)
    truncated = ratio.clamp(1 - eps_clip, 1 + eps_clip_high)
    return -truncated.detach() * advantages * log_probs, (truncated != ratio).float()


def _top_p_kwargs(args, batch) -> dict:
    """slime's top-p replay inputs: required from the batch whenever --rollout-top-p < 1."""
    if getattr(args, "rollout_top_p", 1.0) == 1.0:
        return {}
    ids, offsets = batch.get("rollout_top_p_token_ids"), batch.get("rollout_top_p_token_offsets")
    if ids is None or offsets is None:
        raise ValueError("--rollout-top-p != 1.0 requires rollout_top_p_token_ids and rollout_top_p_token_offsets in the batch")
    return {"top_p_token_ids": ids, "top_p_token_offsets": offsets}


def policy_loss(args, batch, logits, sum_of_sample_mean):
    """slime custom-loss entry: `(loss, metrics)` for one micro-batch, metrics detached 0-d sums of
    per-sample means named as slime names them."""
    check_at_first_use(args)
    kind = pg_loss_type(args)
    per_sample_log_probs, per_sample_entropy = response_log_probs(
        logits,
        args=args,
        unconcat_tokens=batch["unconcat_tokens"],
        total_lengths=batch["total_lengths"],
        response_lengths=batch["response_lengths"],
        with_entropy=True,
        with_entropy_grad=args.entropy_coef != 0,
        **_top_p_kwargs(args, batch),
    )
    log_probs = torch.cat(per_sample_log_probs)
    old = batch["rollout_log_probs"] if args.use_rollout_logprobs else batch.get("log_probs")
    old_log_probs = torch.cat(old) if old else log_probs.detach()
    advantages = torch.cat(batch["advantages"])
    ppo_kl = old_log_probs - log_probs

    if kind == "reinforce":
        pg_loss, pg_clipfrac = -advantages.detach() * log_probs, torch.zeros_like(log_probs)
    elif kind == "cispo":
        pg_loss, pg_clipfrac = cispo_surrogate(ppo_kl, log_probs, advantages, args.eps_clip, args.eps_clip_high)
    else:
        pg_loss, pg_clipfrac = clipped_surrogate(ppo_kl, advantages, args.eps_clip, args.eps_clip_high, args.eps_clip_c)

    pg_loss = aggregate_pg_loss(args, batch, pg_loss)
    entropy_loss = sum_of_sample_mean(torch.cat(per_sample_entropy))
    loss = pg_loss - args.entropy_coef * entropy_loss
    metrics = {
        "pg_loss": pg_loss,
        "entropy_loss": entropy_loss,
        "pg_clipfrac": sum_of_sample_mean(pg_clipfrac),
        "ppo_kl": sum_of_sample_mean(ppo_kl),
    }

    if args.use_kl_loss:
        coef = float(args.kl_loss_coef)
        kl_log_probs = log_probs if coef != 0 else log_probs.detach()
        ratio = torch.exp(kl_log_probs - old_log_probs) if getattr(args, "use_unbiased_kl", False) else None
        ref_log_probs = torch.cat(batch["ref_log_probs"])
        metrics["kl_loss"] = sum_of_sample_mean(approx_kl(kl_log_probs, ref_log_probs, args.kl_loss_type, ratio))
        if coef != 0:
            loss = loss + coef * metrics["kl_loss"]

    loss = reaching_logits(loss, logits, log_probs.numel())

    rollout_log_probs = batch.get("rollout_log_probs")
    if rollout_log_probs:
        compared = log_probs if args.use_rollout_logprobs else old_log_probs
        metrics["train_rollout_logprob_abs_diff"] = sum_of_sample_mean((compared - torch.cat(rollout_log_probs)).abs())
    if batch.get("opd_reverse_kl"):
        metrics["opd_reverse_kl"] = sum_of_sample_mean(torch.cat(batch["opd_reverse_kl"]))

    return loss, detached({"loss": loss, **metrics})
