"""The math of score-function centering (SFC), on the fused kernel's per-token statistics.

Per trained token with advantage A, sampled token a and K draws v_k from the sampler's own
distribution at that position (docs/math.md, "Score-function centering"):

    c = z'(a) - sum_k w_k z'(v_k)            (w_k = 1/K for random draws)
    L = -A * c - beta_e * sum_k w_k log p(v_k),   beta_e = beta0 / sqrt(age), 0 at age 0

c is built from the kernel's `scores` (tempered logits without the lse), so its gradient is the
pure scatter (e_a - sum_k w_k e_{v_k}) / tau: the sampler-dependent baseline that makes
`-A log pi` drift under staleness cancels exactly. The second term is a stochastic gradient of
beta_e * KL(q || p_theta) toward the sampler q; it is the only part that needs the lse, and it
vanishes on fresh tokens. No importance ratio, no entropy term.
"""

from typing import NamedTuple, Optional

import torch

from ...kernels import token_stats


class CenteredScores(NamedTuple):
    """Per-token SFC quantities, one per row of `ids`, float32, differentiable w.r.t. the logits.

    centered_score: z'(a) - sum_k w_k z'(v_k).
    kl_term: -sum_k w_k log p(v_k), the draws' cross-entropy (KL(q || p) up to q's entropy).
    logp: log p(a) of the sampled token (drift metrics against the rollout log-probs).
    """

    centered_score: torch.Tensor
    kl_term: torch.Tensor
    logp: torch.Tensor


def kl_coefficients(ages: torch.Tensor, kl_beta: float) -> torch.Tensor:
    """beta_e = kl_beta / sqrt(age) per token, exactly 0 where age == 0 (float32)."""
    if ages.numel() and bool((ages < 0).any()):
        raise ValueError(f"ages must be >= 0, got min age {int(ages.min())}")
    ages = ages.to(torch.float64)
    return torch.where(ages > 0, kl_beta / ages.clamp(min=1.0).sqrt(), torch.zeros_like(ages)).to(torch.float32)


def centered_scores(
    logits: torch.Tensor,
    ids: torch.Tensor,
    *,
    temperature: float = 1.0,
    rows: Optional[torch.Tensor] = None,
    draw_weights: Optional[torch.Tensor] = None,
    tp_group=None,
) -> CenteredScores:
    """SFC's per-token quantities from one fused pass over the logits.

    logits: [T, V_local] or [1, T, V_local] vocabulary-parallel logits (untempered).
    ids: [N, 1 + K] global ids per trained row: the sampled token first, then the K draws
        (draws may repeat and may equal the sampled token; every slot counts on its own).
    rows: optional [N] row indices into the logits (only those rows are read).
    draw_weights: optional [N, K] centering weights (default uniform 1/K); a top-k head with the
        sampler's probabilities gives head-based centering.
    """
    return center(token_stats(logits, ids, temperature=temperature, rows=rows, tp_group=tp_group), draw_weights)


def center(stats, draw_weights: Optional[torch.Tensor] = None, *, validate: bool = True) -> CenteredScores:
    """CenteredScores from the kernel's statistics of `[N, 1 + K]` ids (sampled token first).

    validate=False skips the finiteness check of the draw weights (a host sync), as the kernel's
    `validate` skips its value checks; shapes are always checked."""
    if stats.logp.shape[1] < 2:
        raise ValueError(f"ids must have shape [N, 1 + K] with K >= 1, got {tuple(stats.logp.shape)}")
    num_rows, num_draws = stats.logp.shape[0], stats.logp.shape[1] - 1
    if draw_weights is None:
        weights = torch.full((num_rows, num_draws), 1.0 / num_draws, dtype=torch.float32, device=stats.logp.device)
    else:
        weights = checked_draw_weights(draw_weights, num_rows, num_draws, validate).to(stats.logp.device)
    centered_score = stats.scores[:, 0] - (stats.scores[:, 1:] * weights).sum(-1)
    kl_term = -(stats.logp[:, 1:] * weights).sum(-1)
    return CenteredScores(centered_score, kl_term, stats.logp[:, 0])


def sfc_token_loss(scores: CenteredScores, advantages: torch.Tensor, kl_coefs: torch.Tensor) -> torch.Tensor:
    """Per-token L = -A * c + beta_e * kl_term (A and beta_e carry no gradient)."""
    num_rows = scores.centered_score.shape[0]
    for name, value in (("advantages", advantages), ("kl_coefs", kl_coefs)):
        if tuple(value.shape) != (num_rows,):
            raise ValueError(f"{name} must have shape [{num_rows}] (one per token), got {tuple(value.shape)}")
    advantages = advantages.detach().to(torch.float32)
    return -advantages * scores.centered_score + kl_coefs.detach().to(torch.float32) * scores.kl_term


def checked_draw_weights(draw_weights: torch.Tensor, num_rows: int, num_draws: int, check_finite: bool) -> torch.Tensor:
    """The caller's centering weights as float32, after a shape check and (`check_finite`) a finiteness check."""
    if tuple(draw_weights.shape) != (num_rows, num_draws):
        raise ValueError(
            f"draw_weights must have shape [{num_rows}, {num_draws}] (N rows, K draws), "
            f"got {tuple(draw_weights.shape)}"
        )
    if check_finite and not bool(torch.isfinite(draw_weights).all()):
        raise ValueError("draw_weights must be finite, got a NaN or infinite weight")
    return draw_weights.detach().to(torch.float32)
