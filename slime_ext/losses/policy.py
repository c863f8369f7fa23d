"""slime's policy-gradient loss on the fused kernel, for `--loss-type custom_loss
--custom-loss-function-path fusedrl.slime_ext.losses.policy_loss`.

Same objective and metrics as slime's `policy_loss_function` (slime/backends/megatron_utils/
loss.py) for PPO clip (eps_clip / eps_clip_high, dual clip eps_clip_c), CISPO
(--advantage-estimator cispo), REINFORCE (--pg-loss-type reinforce), the entropy bonus, the KL
loss to the reference model (k1, k2, k3, low_var_kl; --use-unbiased-kl) and
--use-rollout-logprobs, with two differences:

- the log-probs and entropies come from one fused kernel pass over the response rows only
  (`logprobs.response_log_probs`), top-p replay included; under --fusedrl-fused-lm-head the loss
  and its gradient come from the one-pass op over the hidden states (`one_pass`), the per-token
  terms (`token_terms`) and their combination (`objective`) written once for both paths;
- pg_loss is aggregated by --loss-aggregation (`aggregation.aggregate_pg_loss`; sample_mean, the
  default, is slime's own formula), while the entropy and KL terms and every metric keep slime's
  reducer, as slime does for its --custom-pg-loss-reducer-function-path.

Per-token tensors follow slime's CP layout: the rank's zigzag response positions, samples
concatenated (old log-probs and advantages arrive sliced that way).

slime's off-policy corrections run as slime runs them (`corrections`): GSPO's sequence-level ratio
and OPSM (--use-opsm) from each sample's whole response, and the TIS step (--use-tis,
--custom-tis-function-path, --get-mismatch-metrics) whose kept loss masks then weigh pg_loss under
--loss-aggregation and slime's reducer of the other terms. They need the micro-batch's every token
before any token's gradient, so under --fusedrl-fused-lm-head they take the recompute path. A
custom pg_loss reducer is refused (`flags/policy.py`): --loss-aggregation chooses it.

M2PO's trust region (--fusedrl-m2po-tau, `m2po`) replaces pg_loss by -M * pi / pi_rollout * A, M
masking the micro-batch's largest squared log-ratios among the tokens a PPO clip would act on; it
too needs every token first (recompute path under --fusedrl-fused-lm-head), and pg_clipfrac and
ppo_kl keep reporting the PPO clip against the old log-probs.
"""

from typing import NamedTuple, Optional

import torch

from .. import corrections, one_pass
from ..aggregation import aggregate_pg_loss, reduce_diagnostics
from ..arguments import check_at_first_use
from ..flags.policy import KL_TYPES, pg_loss_type
from ..logprobs import locate_responses, logprobs_and_entropy, response_log_probs
from ..m2po import m2po_terms
from ..responses import check_values
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


class PolicyInputs(NamedTuple):
    """Per-token inputs known before the forward, in the rows' order: old log-probs (None: the
    current ones, detached), advantages, reference log-probs (None without --use-kl-loss)."""

    old_log_probs: Optional[torch.Tensor]
    advantages: torch.Tensor
    ref_log_probs: Optional[torch.Tensor]

    @classmethod
    def of(cls, args, batch) -> "PolicyInputs":
        old = batch["rollout_log_probs"] if args.use_rollout_logprobs else batch.get("log_probs")
        ref = torch.cat(batch["ref_log_probs"]) if args.use_kl_loss else None
        return cls(torch.cat(old) if old else None, torch.cat(batch["advantages"]), ref)

    def at(self, slots) -> "PolicyInputs":
        """The inputs of rows `slots`."""
        return PolicyInputs(*(None if value is None else value[slots] for value in self))


class TokenTerms(NamedTuple):
    """The per-token terms of the objective and its diagnostics (kl: None without --use-kl-loss)."""

    old_log_probs: torch.Tensor
    ppo_kl: torch.Tensor
    pg_loss: torch.Tensor
    pg_clipfrac: torch.Tensor
    kl: Optional[torch.Tensor]


def token_terms(args, kind: str, log_probs: torch.Tensor, inputs: PolicyInputs, ppo_kl=None) -> TokenTerms:
    """Every per-token term of the loss from the tokens' log-probs and their known inputs; the
    one definition the full-tensor path and the one-pass path's chunks both evaluate. ppo_kl:
    GSPO's sequence-level one (`corrections.sequence_terms`), else old - new per token."""
    old_log_probs = log_probs.detach() if inputs.old_log_probs is None else inputs.old_log_probs
    advantages = inputs.advantages
    ppo_kl = old_log_probs - log_probs if ppo_kl is None else ppo_kl
    if kind == "reinforce":
        pg_loss, pg_clipfrac = -advantages.detach() * log_probs, torch.zeros_like(log_probs)
    elif kind == "cispo":
        pg_loss, pg_clipfrac = cispo_surrogate(ppo_kl, log_probs, advantages, args.eps_clip, args.eps_clip_high)
    else:
        pg_loss, pg_clipfrac = clipped_surrogate(ppo_kl, advantages, args.eps_clip, args.eps_clip_high, args.eps_clip_c)
    kl = None
    if args.use_kl_loss:
        kl_log_probs = log_probs if float(args.kl_loss_coef) != 0 else log_probs.detach()
        ratio = torch.exp(kl_log_probs - old_log_probs) if getattr(args, "use_unbiased_kl", False) else None
        kl = approx_kl(kl_log_probs, inputs.ref_log_probs, args.kl_loss_type, ratio)
    return TokenTerms(old_log_probs, ppo_kl, pg_loss, pg_clipfrac, kl)


def objective(args, terms: TokenTerms, entropy: torch.Tensor, reduce_pg, reduce_mean):
    """(loss, its reduced parts) = pg_loss - entropy_coef * entropy_loss (+ kl_loss_coef * kl_loss)
    under the reducers given: the full ones, or a chunk's share of them (`one_pass.weighted_sum`)."""
    parts = {"pg_loss": reduce_pg(terms.pg_loss), "entropy_loss": reduce_mean(entropy)}
    loss = parts["pg_loss"] - args.entropy_coef * parts["entropy_loss"]
    if terms.kl is not None:
        parts["kl_loss"] = reduce_mean(terms.kl)
        if float(args.kl_loss_coef) != 0:
            loss = loss + float(args.kl_loss_coef) * parts["kl_loss"]
    return loss, parts


def _one_pass(args, batch, logits, sum_of_sample_mean, kind, tokens, targets, support, inputs):
    """(loss, log-probs, entropy) by the one-pass op: each chunk's share of `objective`."""
    num_rows, device = targets.numel(), targets.device
    pg_weights = one_pass.coefficients(lambda x: aggregate_pg_loss(args, batch, x), num_rows, device)
    mean_weights = one_pass.coefficients(sum_of_sample_mean, num_rows, device)
    with_entropy_grad = args.entropy_coef != 0

    def row_loss(stats, slots):
        rows_support = None if support is None else support.at(slots)
        log_probs, entropy = logprobs_and_entropy(stats, with_entropy_grad=with_entropy_grad, support=rows_support)
        terms = token_terms(args, kind, log_probs, inputs.at(slots))
        reduce_pg, reduce_mean = one_pass.weighted_sum(pg_weights[slots]), one_pass.weighted_sum(mean_weights[slots])
        return objective(args, terms, entropy, reduce_pg, reduce_mean)[0]

    result = one_pass.linear_token_loss(
        tokens, logits, targets.unsqueeze(1) if support is None else support.ids, row_loss, args=args, batch=batch,
        temperature=float(getattr(args, "rollout_temperature", 1.0)), with_entropy=True, validate=check_values(),
    )  # fmt: skip
    log_probs, entropy = logprobs_and_entropy(result.stats, with_entropy_grad=False, support=support)
    return result.loss, log_probs, entropy


def policy_loss(args, batch, logits, sum_of_sample_mean):
    """slime custom-loss entry: `(loss, metrics)` for one micro-batch, metrics detached 0-d sums of
    per-sample means named as slime names them. Under --fusedrl-fused-lm-head the one-pass op
    computes the loss and its gradient (`one_pass`) unless a correction needs the whole micro-batch
    first, else the log-probs come from the kernel and the loss from them by autograd; both
    evaluate `token_terms` and `objective`."""
    check_at_first_use(args)
    kind = pg_loss_type(args)
    inputs = PolicyInputs.of(args, batch)
    tokens, targets, support = locate_responses(
        logits, args, batch["unconcat_tokens"], batch["total_lengths"], batch["response_lengths"],
        **_top_p_kwargs(args, batch),
    )  # fmt: skip
    if one_pass.applies(tokens, "policy_loss", needs_whole_batch=corrections.whole_batch(args)):
        loss, log_probs, entropy = _one_pass(args, batch, logits, sum_of_sample_mean, kind, tokens, targets, support, inputs)
        terms = token_terms(args, kind, log_probs, inputs)
        loss = reaching_logits(loss, logits, log_probs.numel())
        return _reported(args, batch, loss, log_probs, terms, entropy, sum_of_sample_mean)
    per_sample_log_probs, per_sample_entropy = response_log_probs(
        logits, tokens=tokens, targets=targets, support=support, args=args, with_entropy=True,
        with_entropy_grad=args.entropy_coef != 0,
    )  # fmt: skip
    log_probs, entropy = torch.cat(per_sample_log_probs), torch.cat(per_sample_entropy)
    old = log_probs.detach() if inputs.old_log_probs is None else inputs.old_log_probs
    sequence = corrections.sequence_terms(
        args, batch, per_sample_log_probs, list(old.split([len(x) for x in per_sample_log_probs])), inputs.advantages
    )
    terms = token_terms(args, kind, log_probs, inputs, ppo_kl=sequence.ppo_kl)
    if sequence.keep is not None:
        terms = terms._replace(pg_loss=terms.pg_loss * sequence.keep)
    extra, loss_masks, reduce_mean = {}, None, sum_of_sample_mean
    if corrections.importance_sampling(args):
        corrected = corrections.apply_tis(args, batch, terms.pg_loss, per_sample_log_probs)
        terms, loss_masks = terms._replace(pg_loss=corrected.pg_loss), corrected.loss_masks
        # slime rebuilds its reducer on the kept masks for the loss and its metrics; the TIS
        # function's own metrics and ois keep the batch's masks
        reduce_mean = lambda x: reduce_diagnostics(args, batch, x, loss_masks)  # noqa: E731
        extra = {"ois": sum_of_sample_mean(torch.exp(-terms.ppo_kl))}
        extra.update({key: sum_of_sample_mean(value) for key, value in corrected.metrics.items()})
    if sequence.opsm_clipfrac is not None:
        extra["opsm_clipfrac"] = sequence.opsm_clipfrac
    region = m2po_terms(args, batch, log_probs, inputs.advantages)
    if region is not None:
        terms = terms._replace(pg_loss=region.pg_loss)
        extra.update({key: reduce_mean(value) for key, value in region.metrics.items()})
    full_loss, parts = objective(args, terms, entropy, lambda x: aggregate_pg_loss(args, batch, x, loss_masks), reduce_mean)
    loss = reaching_logits(full_loss, logits, log_probs.numel())
    return _reported(args, batch, loss, log_probs, terms, entropy, reduce_mean, parts, extra)


def _reported(args, batch, loss, log_probs, terms, entropy, reduce_mean, parts=None, extra=None):
    """`(loss, metrics)` as slime reports them: pg_loss and the regularisers (`parts`, computed
    here from `terms` when not given), pg_clipfrac, ppo_kl, the rollout log-prob drift and the
    corrections' `extra` metrics."""
    if parts is None:
        parts = objective(args, terms, entropy, lambda x: aggregate_pg_loss(args, batch, x), reduce_mean)[1]
    metrics = {
        "pg_loss": parts["pg_loss"],
        "entropy_loss": parts["entropy_loss"],
        "pg_clipfrac": reduce_mean(terms.pg_clipfrac),
        "ppo_kl": reduce_mean(terms.ppo_kl),
    }
    if "kl_loss" in parts:
        metrics["kl_loss"] = parts["kl_loss"]
    rollout_log_probs = batch.get("rollout_log_probs")
    if rollout_log_probs:
        compared = log_probs if args.use_rollout_logprobs else terms.old_log_probs
        metrics["train_rollout_logprob_abs_diff"] = reduce_mean((compared - torch.cat(rollout_log_probs)).abs())
    if batch.get("opd_reverse_kl"):
        metrics["opd_reverse_kl"] = reduce_mean(torch.cat(batch["opd_reverse_kl"]))
    return loss, detached({"loss": loss, **metrics, **(extra or {})})
