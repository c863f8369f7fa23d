"""The SFC loss for slime: `--loss-type custom_loss --custom-loss-function-path
fusedrl.slime_ext.losses.sfc_loss` (the math is in `centering`, the flags in `flags/sfc.py`).

Per micro-batch: one kernel call over the rank's response rows with J = 1 + K ids each (the
sampled token and the K draws the rollout side carried, `rollout/sfc_draws.py`), each token's age
from the weight-version clock (`age`), and the per-token loss aggregated by --loss-aggregation
(set from --sfc-loss-agg-mode). Under --sfc-m2-tau, M2PO's trust region over the micro-batch
(`m2po.second_moment_region`: the log-ratio of the current to the rollout log-prob of the sampled
token) masks the centered-score term of the tokens it removes; the KL term, the pull toward the
sampler, stays on every token. It needs every token's log-prob first, so under
--fusedrl-fused-lm-head it takes the recompute path.
"""

from typing import List, NamedTuple, Optional

import torch

from .. import carry, one_pass
from ..age import CLOCK
from ..aggregation import aggregate_pg_loss
from ..arguments import check_at_first_use
from ..m2po import second_moment_region
from ..responses import ResponseTokens, check_values
from .centering import CenteredScores, center, centered_scores, checked_draw_weights, kl_coefficients, sfc_token_loss
from .contract import detached, reaching_logits

__all__ = ["CenteredScores", "centered_scores", "kl_coefficients", "sfc_loss", "sfc_token_loss"]


def sfc_loss(args, batch, logits, sum_of_sample_mean):
    """slime custom-loss entry: `(loss, metrics)` for one micro-batch.

    Metrics (detached 0-d sums of per-sample means through slime's reducer): pg_loss,
    sfc_centered_score, sfc_kl, sfc_age, sfc_stale_frac, and ppo_kl = rollout log-prob - current
    log-prob when the batch has rollout_log_probs (the drift between trainer and sampler).
    Under --fusedrl-fused-lm-head the one-pass op computes the loss and its gradient (`one_pass`);
    both paths evaluate `sfc_token_loss` of `center`.
    """
    check_at_first_use(args)
    draws = _Draws.of(args, batch, logits)
    advantages = _cat(batch["advantages"], logits)
    kl_coefs = kl_coefficients(draws.ages, float(args.sfc_kl_beta))
    validate = check_values()
    temperature = float(args.rollout_temperature)
    tau = getattr(args, "sfc_m2_tau", None)
    if one_pass.applies(draws.tokens, "sfc_loss", needs_whole_batch=None if tau is None else "--sfc-m2-tau"):
        if draws.weights is not None:  # checked before the op adds any gradient
            checked_draw_weights(draws.weights, *draws.weights.shape, validate)
        weights = one_pass.coefficients(lambda x: aggregate_pg_loss(args, batch, x), advantages.numel(), advantages.device)

        def row_loss(stats, slots):
            rows_weights = None if draws.weights is None else draws.weights[slots]
            per_token = sfc_token_loss(center(stats, rows_weights, validate=False), advantages[slots], kl_coefs[slots])
            return one_pass.weighted_sum(weights[slots])(per_token)

        result = one_pass.linear_token_loss(
            draws.tokens, logits, draws.ids, row_loss, args=args, batch=batch, temperature=temperature,
            with_entropy=False, validate=validate,
        )  # fmt: skip
        scores, loss = center(result.stats, draws.weights, validate=False), result.loss
    else:
        stats = draws.tokens.token_stats(logits, draws.ids, temperature=temperature, validate=validate)
        per_row = torch.stack(center(stats, draws.weights, validate=validate), dim=-1)
        scores = CenteredScores(*torch.cat(draws.tokens.per_sample(per_row)).unbind(-1))
        region = None if tau is None else second_moment_region(batch, scores.logp, advantages, float(tau), "--sfc-m2-tau")
        trained = scores if region is None else scores._replace(centered_score=scores.centered_score * region.keep)
        loss = aggregate_pg_loss(args, batch, sfc_token_loss(trained, advantages, kl_coefs))
    loss = reaching_logits(loss, logits, advantages.numel())
    metrics = {
        "loss": loss,
        "pg_loss": loss,
        "sfc_centered_score": sum_of_sample_mean(scores.centered_score),
        "sfc_kl": sum_of_sample_mean(kl_coefs * scores.kl_term),
        "sfc_age": sum_of_sample_mean(draws.ages.float()),
        "sfc_stale_frac": sum_of_sample_mean((draws.ages > 0).float()),
    }
    if batch.get("rollout_log_probs"):
        metrics["ppo_kl"] = sum_of_sample_mean(_cat(batch["rollout_log_probs"], scores.logp) - scores.logp)
    if tau is not None:
        metrics.update({key: sum_of_sample_mean(value) for key, value in region.metrics.items()})
    return loss, detached(metrics)


def _cat(per_sample, like: torch.Tensor) -> torch.Tensor:
    """Per-sample CP-local float tensors concatenated on `like`'s device (empty when none)."""
    if not per_sample:
        return like.new_zeros(0, dtype=torch.float32)
    return torch.cat(list(per_sample)).to(device=like.device, dtype=torch.float32)


class _Draws(NamedTuple):
    """The rank's response tokens, their kernel ids `[N, 1 + K]` (sampled token, then the carried
    draws) and centering weights `[N, K]` (None: uniform) in kernel row order, and their ages [n]
    in slime's zigzag layout (the layout of batch["advantages"])."""

    tokens: ResponseTokens
    ids: torch.Tensor
    weights: Optional[torch.Tensor]
    ages: torch.Tensor

    @classmethod
    def of(cls, args, batch, logits) -> "_Draws":
        tokens = ResponseTokens.locate(logits, batch["total_lengths"], batch["response_lengths"], args)
        num_draws = int(args.sfc_num_auxiliary_token_samples)
        draws = tokens.at_positions(_carried_draws(batch, carry.SFC_DRAWS_KEY, num_draws))
        weights = None
        if carry.SFC_DRAW_WEIGHTS_KEY in carry.carried(batch):
            weights = tokens.at_positions(_carried_draws(batch, carry.SFC_DRAW_WEIGHTS_KEY, num_draws))
        ids = torch.cat([tokens.targets(batch["unconcat_tokens"])[:, None], draws], dim=1)
        versions = torch.cat(carry.per_token(batch, carry.SFC_VERSIONS_KEY, tokens.cp_rank, tokens.cp_size))
        return cls(tokens, ids, weights, CLOCK.ages(versions).to(logits.device))


def _carried_draws(batch, key: str, num_draws: int) -> List[torch.Tensor]:
    """The full-response carried tensors `[response_length, K]` under `key`, per sample."""
    per_sample = carry.per_token(batch, key, 0, 1)
    if per_sample and (per_sample[0].dim() != 2 or per_sample[0].shape[1] != num_draws):
        raise ValueError(
            f"carried {key!r} must have shape [response_length, K = {num_draws}] "
            f"(--sfc-num-auxiliary-token-samples), got {tuple(per_sample[0].shape)}"
        )
    return per_sample
