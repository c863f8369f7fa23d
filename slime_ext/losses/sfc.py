"""Score-function centering (SFC): a ratio-free policy-gradient loss for stale rollouts.

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

import math
from typing import List, NamedTuple, Optional

import torch

from ...kernels import token_stats
from .. import aggregation, carry
from ..age import CLOCK
from ..context_parallel import allgather_to_zigzag, cp_rank_and_size, local_response_rows
from ..logprobs import response_targets

LOSS_PATHS = ("fusedrl.slime_ext.losses.sfc_loss", "fusedrl.slime_ext.losses.sfc.sfc_loss")
GENERATE_PATH = "fusedrl.slime_ext.sfc_rollout.generate"
# Carried per response token (slime_ext/carry.py), attached by slime_ext/sfc_rollout.py.
DRAWS_KEY = "fusedrl_sfc_draws"  # [resp_len, K] int64: the sampler's K draws at each position
VERSIONS_KEY = "fusedrl_sfc_versions"  # [resp_len] int64: weight version that sampled the token
DRAW_WEIGHTS_KEY = "fusedrl_sfc_draw_weights"  # optional [resp_len, K] float: centering weights
# --sfc-loss-agg-mode -> (--loss-aggregation, --loss-aggregation-divisor)
AGG_MODES = {"sample-mean": ("sample_mean", None), "token-mean": ("token_mean", None), "token-sum": ("constant", 1.0)}


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
    if ids.dim() != 2 or ids.shape[1] < 2:
        raise ValueError(f"ids must have shape [N, 1 + K] with K >= 1, got {tuple(ids.shape)}")
    weights = _draw_weights(draw_weights, ids.shape[0], ids.shape[1] - 1, ids.device)
    stats = token_stats(logits, ids, temperature=temperature, rows=rows, tp_group=tp_group)
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


def _draw_weights(draw_weights, num_rows: int, num_draws: int, device) -> torch.Tensor:
    """Uniform 1/K weights, or the caller's [N, K] weights after a shape and finiteness check."""
    if draw_weights is None:
        return torch.full((num_rows, num_draws), 1.0 / num_draws, dtype=torch.float32, device=device)
    if tuple(draw_weights.shape) != (num_rows, num_draws):
        raise ValueError(
            f"draw_weights must have shape [{num_rows}, {num_draws}] (N rows, K draws), "
            f"got {tuple(draw_weights.shape)}"
        )
    if not bool(torch.isfinite(draw_weights).all()):
        raise ValueError("draw_weights must be finite, got a NaN or infinite weight")
    return draw_weights.detach().to(torch.float32)


# ----------------------------------------------------------------------------- slime loss


def sfc_loss(args, batch, logits, sum_of_sample_mean):
    """slime custom-loss entry (`--loss-type custom_loss --custom-loss-function-path
    fusedrl.slime_ext.losses.sfc_loss`): `(loss, metrics)` for one micro-batch.

    One kernel call over the rank's response rows with J = 1 + K ids each. The per-token loss is
    aggregated by --loss-aggregation (set from --sfc-loss-agg-mode); metrics (detached 0-d sums of
    per-sample means through slime's reducer): pg_loss, sfc_centered_score, sfc_kl, sfc_age,
    sfc_stale_frac, and ppo_kl = rollout log-prob - current log-prob when the batch has
    rollout_log_probs (the drift between trainer and sampler).
    """
    scores, ages = _token_scores(args, batch, logits)
    advantages = _cat(batch["advantages"], scores.logp)
    kl_coefs = kl_coefficients(ages, float(args.sfc_kl_beta))
    per_token = sfc_token_loss(scores, advantages, kl_coefs)
    if getattr(args, "loss_aggregation", None) is None:  # the package's flags were not registered
        loss = sum_of_sample_mean(per_token)
    else:
        loss = aggregation.aggregate_pg_loss(args, batch, per_token)
    if per_token.numel() == 0:  # keep every rank's backward through the logits
        loss = loss + 0 * logits.sum()
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
    return loss, {key: value.clone().detach() for key, value in metrics.items()}


def _cat(per_sample, like: torch.Tensor) -> torch.Tensor:
    """Per-sample CP-local float tensors concatenated on `like`'s device (empty when none)."""
    if not per_sample:
        return like.new_zeros(0)
    return torch.cat(list(per_sample)).to(device=like.device, dtype=torch.float32)


def _token_scores(args, batch, logits):
    """CenteredScores and ages [n] over the rank's response tokens in slime's zigzag layout (the
    layout of batch["advantages"]); the kernel reads only the response rows."""
    if logits.dim() != 3 or logits.shape[0] != 1:
        raise ValueError(f"logits must have shape [1, T, V/tp], got {tuple(logits.shape)}")
    totals, responses = list(batch["total_lengths"]), list(batch["response_lengths"])
    cp_rank, cp_size = cp_rank_and_size()
    allgather = bool(getattr(args, "allgather_cp", False)) and cp_size > 1
    device = logits.device
    samples = local_response_rows(
        totals, responses, cp_rank, cp_size, allgather_cp=allgather, local_length=logits.shape[1], device=device
    )
    num_draws = int(args.sfc_num_auxiliary_token_samples)
    draws = _rows_of(carry.per_token(batch, DRAWS_KEY, 0, 1), samples, DRAWS_KEY, num_draws)
    weights = None
    if DRAW_WEIGHTS_KEY in carry.carried(batch):
        weights = _rows_of(carry.per_token(batch, DRAW_WEIGHTS_KEY, 0, 1), samples, DRAW_WEIGHTS_KEY, num_draws)
    sampled = response_targets(batch["unconcat_tokens"], totals, responses, samples).to(device)
    rows = torch.cat([s.rows for s in samples]).to(device)
    scores = centered_scores(
        logits,
        torch.cat([sampled[:, None], draws.to(device)], dim=1),
        temperature=float(args.rollout_temperature),
        rows=rows,
        draw_weights=None if weights is None else weights.to(device),
    )
    if allgather:
        from megatron.core import parallel_state

        stacked = torch.stack(scores, dim=-1).split([s.rows.numel() for s in samples])
        group = parallel_state.get_context_parallel_group()
        zigzag = allgather_to_zigzag(list(stacked), samples, totals, responses, cp_rank, cp_size, group)
        scores = CenteredScores(*torch.cat(zigzag).unbind(-1))
    versions = torch.cat(carry.per_token(batch, VERSIONS_KEY, cp_rank, cp_size))
    return scores, CLOCK.ages(versions).to(device)


def _rows_of(per_sample: List[torch.Tensor], samples, key: str, num_draws: int) -> torch.Tensor:
    """The rows of full-response carried tensors [resp_len, K] at the rank's positions."""
    if per_sample and (per_sample[0].dim() != 2 or per_sample[0].shape[1] != num_draws):
        raise ValueError(
            f"carried {key!r} must have shape [response_length, K = {num_draws}] "
            f"(--sfc-num-auxiliary-token-samples), got {tuple(per_sample[0].shape)}"
        )
    return torch.cat([full[s.positions.to(full.device)] for full, s in zip(per_sample, samples, strict=True)])


# ----------------------------------------------------------------------------- flags


def uses_sfc(args) -> bool:
    """Whether slime's configured loss is the SFC loss."""
    return getattr(args, "loss_type", None) == "custom_loss" and getattr(args, "custom_loss_function_path", None) in LOSS_PATHS


def add_arguments(parser):
    """Register the --sfc-* flags on slime's parser."""
    parser.add_argument(
        "--sfc-num-auxiliary-token-samples",
        type=int,
        default=None,
        help="K: auxiliary draws per generated token requested from the SGLang plugin for SFC (>= 1). "
        "Required with the SFC loss.",
    )
    parser.add_argument(
        "--sfc-kl-beta",
        type=float,
        default=None,
        help="beta0 of SFC's KL pull toward the sampler: a token of age a (optimizer steps since its "
        "weights were pushed) gets beta0 / sqrt(a), fresh tokens 0. Required with the SFC loss.",
    )
    parser.add_argument(
        "--sfc-loss-agg-mode",
        choices=sorted(AGG_MODES),
        default=None,
        help="Aggregation of SFC's per-token loss: sample-mean (--loss-aggregation sample_mean), "
        "token-mean (token_mean) or token-sum (constant with divisor 1). Default: --loss-aggregation.",
    )
    parser.add_argument(
        "--sfc-inner-generate-function-path",
        default=None,
        help="The generate function SFC's rollout wrapper calls (default: slime's "
        "slime.rollout.sglang_rollout.generate; a --custom-generate-function-path given is moved here).",
    )
    return parser


def validate_args(args) -> None:
    """Check the SFC configuration at startup; ValueError naming the flag otherwise.

    Installs the rollout wrapper as --custom-generate-function-path (moving a user's generate
    function behind it) and resolves --sfc-loss-agg-mode into --loss-aggregation, then re-runs the
    aggregation checks. Run it before `aggregation.validate_args` so an unset --loss-aggregation
    can follow --sfc-loss-agg-mode; calling it again changes nothing.
    """
    if not uses_sfc(args):
        _reject_unused_flags(args)
        return
    num_draws = args.sfc_num_auxiliary_token_samples
    if num_draws is None or isinstance(num_draws, bool) or int(num_draws) != num_draws or num_draws < 1:
        raise ValueError(f"--sfc-num-auxiliary-token-samples must be an integer >= 1 with the SFC loss, got {num_draws!r}")
    beta = args.sfc_kl_beta
    if beta is None or not math.isfinite(float(beta)) or float(beta) < 0:
        raise ValueError(f"--sfc-kl-beta must be finite and >= 0 with the SFC loss, got {beta!r}")
    _check_untruncated_sampling(args)
    _install_generate_wrapper(args)
    _resolve_aggregation(args)


def _reject_unused_flags(args) -> None:
    for flag in ("sfc_num_auxiliary_token_samples", "sfc_kl_beta", "sfc_loss_agg_mode", "sfc_inner_generate_function_path"):
        if getattr(args, flag, None) is not None:
            raise ValueError(
                f"--{flag.replace('_', '-')} is set but the loss is not SFC (--loss-type custom_loss "
                f"--custom-loss-function-path {LOSS_PATHS[0]})"
            )


def _check_untruncated_sampling(args) -> None:
    """The draws and the sampled token must come from the distribution the loss centers on."""
    temperature = float(getattr(args, "rollout_temperature", 1.0))
    expected = (
        ("rollout_top_p", 1.0, "sampling must be untruncated"),
        ("rollout_top_k", -1, "sampling must be untruncated"),
        ("entropy_coef", 0.0, "SFC has no entropy term"),
        ("flush_cache_interval", 1, "an in-place pause lets one request span two weight versions"),
    )
    for name, value, why in expected:
        got = getattr(args, name, value)
        if got != value:
            raise ValueError(f"--{name.replace('_', '-')} must be {value} with the SFC loss ({why}), got {got!r}")
    if not math.isfinite(temperature) or temperature <= 0:
        raise ValueError(f"--rollout-temperature must be finite and > 0 with the SFC loss, got {temperature!r}")


def _install_generate_wrapper(args) -> None:
    current = getattr(args, "custom_generate_function_path", None)
    if current is not None and current != GENERATE_PATH:
        inner = args.sfc_inner_generate_function_path
        if inner is not None and inner != current:
            raise ValueError(
                f"--sfc-inner-generate-function-path {inner} conflicts with --custom-generate-function-path "
                f"{current}: give the generate function once"
            )
        args.sfc_inner_generate_function_path = current
    args.custom_generate_function_path = GENERATE_PATH


def _resolve_aggregation(args) -> None:
    mode = args.sfc_loss_agg_mode
    if mode is not None:
        wanted, divisor = AGG_MODES[mode]
        current = getattr(args, "loss_aggregation", None)
        if current is not None and current != wanted:
            raise ValueError(f"--sfc-loss-agg-mode {mode} means --loss-aggregation {wanted}, got --loss-aggregation {current}")
        given = getattr(args, "loss_aggregation_divisor", None)
        if divisor is not None and given is not None and float(given) != divisor:
            raise ValueError(f"--sfc-loss-agg-mode {mode} means --loss-aggregation-divisor {divisor}, got {given}")
        args.loss_aggregation = wanted
        if divisor is not None:
            args.loss_aggregation_divisor = divisor
    aggregation.validate_args(args)
