"""The SFC loss for slime: `--loss-type custom_loss --custom-loss-function-path
fusedrl.slime_ext.losses.sfc_loss` (the math is in `centering`, the flags in `flags/sfc.py`).

Per micro-batch: one kernel call over the rank's response rows with J = 1 + K ids each (the
sampled token and the K draws the rollout side carried, `rollout/sfc_draws.py`), each token's age
from the weight-version clock (`age`), and the per-token loss aggregated by --loss-aggregation
(set from --sfc-loss-agg-mode).
"""

from typing import List

import torch

from .. import carry
from ..age import CLOCK
from ..aggregation import aggregate_pg_loss
from ..arguments import check_at_first_use
from ..responses import ResponseTokens, check_values
from .centering import CenteredScores, center, centered_scores, kl_coefficients, sfc_token_loss
from .contract import detached, reaching_logits

__all__ = ["CenteredScores", "centered_scores", "kl_coefficients", "sfc_loss", "sfc_token_loss"]


def sfc_loss(args, batch, logits, sum_of_sample_mean):
    """slime custom-loss entry: `(loss, metrics)` for one micro-batch.

    Metrics (detached 0-d sums of per-sample means through slime's reducer): pg_loss,
    sfc_centered_score, sfc_kl, sfc_age, sfc_stale_frac, and ppo_kl = rollout log-prob - current
    log-prob when the batch has rollout_log_probs (the drift between trainer and sampler).
    """
    check_at_first_use(args)
    scores, ages = _token_scores(args, batch, logits)
    advantages = _cat(batch["advantages"], scores.logp)
    kl_coefs = kl_coefficients(ages, float(args.sfc_kl_beta))
    per_token = sfc_token_loss(scores, advantages, kl_coefs)
    loss = reaching_logits(aggregate_pg_loss(args, batch, per_token), logits, per_token.numel())
    metrics = {
        "loss": loss,
        "pg_loss": loss,
        "sfc_centered_score": sum_of_sample_mean(scores.centered_score),
        "sfc_kl": sum_of_sample_mean(kl_coefs * scores.kl_term),
        "sfc_age": sum_of_sample_mean(ages.float()),
        "sfc_stale_frac": sum_of_sample_mean((ages > 0).float()),
    }
    if batch.get("rollout_log_probs"):
        metrics["ppo_kl"] = sum_of_sample_mean(_cat(batch["rollout_log_probs"], scores.logp) - scores.logp)
    return loss, detached(metrics)


def _cat(per_sample, like: torch.Tensor) -> torch.Tensor:
    """Per-sample CP-local float tensors concatenated on `like`'s device (empty when none)."""
    if not per_sample:
        return like.new_zeros(0)
    return torch.cat(list(per_sample)).to(device=like.device, dtype=torch.float32)


def _token_scores(args, batch, logits):
    """CenteredScores and ages [n] over the rank's response tokens in slime's zigzag layout (the
    layout of batch["advantages"]); the kernel reads only the response rows."""
    tokens = ResponseTokens.locate(logits, batch["total_lengths"], batch["response_lengths"], args)
    num_draws = int(args.sfc_num_auxiliary_token_samples)
    draws = tokens.at_positions(_carried_draws(batch, carry.SFC_DRAWS_KEY, num_draws))
    weights = None
    if carry.SFC_DRAW_WEIGHTS_KEY in carry.carried(batch):
        weights = tokens.at_positions(_carried_draws(batch, carry.SFC_DRAW_WEIGHTS_KEY, num_draws))
    ids = torch.cat([tokens.targets(batch["unconcat_tokens"])[:, None], draws], dim=1)
    validate = check_values()
    stats = tokens.token_stats(logits, ids, temperature=float(args.rollout_temperature), validate=validate)
    per_row = torch.stack(center(stats, weights, validate=validate), dim=-1)
    scores = CenteredScores(*torch.cat(tokens.per_sample(per_row)).unbind(-1))
    versions = torch.cat(carry.per_token(batch, carry.SFC_VERSIONS_KEY, tokens.cp_rank, tokens.cp_size))
    return scores, CLOCK.ages(versions).to(logits.device)


def _carried_draws(batch, key: str, num_draws: int) -> List[torch.Tensor]:
    """The full-response carried tensors `[response_length, K]` under `key`, per sample."""
    per_sample = carry.per_token(batch, key, 0, 1)
    if per_sample and (per_sample[0].dim() != 2 or per_sample[0].shape[1] != num_draws):
        raise ValueError(
            f"carried {key!r} must have shape [response_length, K = {num_draws}] "
            f"(--sfc-num-auxiliary-token-samples), got {tuple(per_sample[0].shape)}"
        )
    return per_sample
