"""`fusedrl.slime_ext.losses.policy_loss` driven through slime's loss wrapper (harness) against an
eager float64 re-implementation of slime's policy loss written here from its documented formulas:
loss, every metric and the logits gradient, at tp = 1, 2 and cp = 1, 2 (zigzag and allgather), for
PPO clip, dual clip, CISPO and REINFORCE, with and without entropy and KL, under each
--loss-aggregation mode.

Prompt and padding rows of the logits are NaN (a huge finite value under allgather-CP, where
slime's wrapper itself touches every row): only response rows are read. tp = cp = 1 runs on the
`device` fixture's device; tp or cp > 1 on CPU gloo workers (`slime_harness.run_loss_on_ranks`).
"""

import pytest
import torch
from device import to_device

from fusedrl.slime_ext.losses import policy_loss
from slime_harness import (
    RESPONSES,
    TOTALS,
    VOCAB,
    assert_ranks_match_reference,
    make_logits,
    make_samples,
    micro_batch,
    rank_loss_and_grad,
    rank_response_positions,
    reference_losses,
    reference_response_stats,
    run_loss_on_ranks,
    slime_args,
    sum_of_sample_mean,
    top_p_replay,
)

PROMPT_DENOMINATORS = [9.0, 9.0, 4.0, 12.0, 3.0]
REJECTION = "slime_harness.reject_outside_tis_band"
BAND = dict(tis_clip=1.05, tis_clip_low=0.95)  # the samples' TIS ratios lie on both sides


# ----------------------------------------------------------------------------- reference


def reference_kl(log_probs, ref, kind, ratio=None):
    """Schulman's estimators of KL(pi || pi_ref) per token, as slime names them."""
    log_ratio = log_probs - ref
    if kind == "k1":
        kl = log_ratio
    elif kind == "k2":
        kl = log_ratio**2 / 2
    else:  # k3 and low_var_kl
        kl = torch.exp(-log_ratio) - 1 + log_ratio
    if ratio is not None:
        kl = ratio * kl
    return kl.clamp(-10, 10) if kind == "low_var_kl" else kl


def reference_pg_term(args, batch, pg_loss, reducer, cp_rank, cp_size):
    """pg_loss under --loss-aggregation: per-token weight m / D_s (math.md table)."""
    mode = args.loss_aggregation
    if mode in ("sample_mean", "token_mean"):
        return reducer(pg_loss)
    divisors = PROMPT_DENOMINATORS if mode == "prompt_mean" else [args.loss_aggregation_divisor] * len(TOTALS)
    total, start = 0, 0
    for mask, t, r, d in zip(batch["loss_masks"], TOTALS, RESPONSES, divisors):
        pos = rank_response_positions(t, r, cp_rank, cp_size)
        total = total + (pg_loss[start : start + len(pos)] * mask[pos]).sum() / d
        start += len(pos)
    return total


def reference_corrections(args, batch, samples, lp_full, cp_rank, cp_size):
    """slime's corrections on the rank's tokens: (GSPO's per-token ppo_kl or None, OPSM's keep
    multiplier or None, opsm_clipfrac or None), each sample's sequence KL from its whole response."""
    pos = [rank_response_positions(t, r, cp_rank, cp_size) for t, r in zip(TOTALS, RESPONSES)]
    old_full = [(s.rollout_log_probs if args.use_rollout_logprobs else s.log_probs).double() for s in samples]
    seq_kl = [((o - lp) * s.loss_mask).sum() / s.loss_mask.sum().clamp_min(1) for o, lp, s in zip(old_full, lp_full, samples)]
    ppo_kl = torch.cat([k.expand(len(p)) for k, p in zip(seq_kl, pos)]) if args.advantage_estimator == "gspo" else None
    if not args.use_opsm:
        return ppo_kl, None, None
    adv = [s.advantages.double()[p] for s, p in zip(samples, pos)]
    masked = [((a < 0) & (k.detach() > args.opsm_delta)).double() for a, k in zip(adv, seq_kl)]
    clipfrac = sum(m.sum() / s.loss_mask.sum().clamp_min(1) for m, s in zip(masked, samples))
    return ppo_kl, 1 - torch.cat(masked), clipfrac


def reference_tis(args, batch, samples, pg):
    """slime's TIS step on the rank's per-token pg: (pg, kept full loss masks, metrics), for the
    vanilla function and `slime_harness.reject_outside_tis_band` (decided on the full responses)."""
    ratio = torch.exp(torch.cat(batch["log_probs"]).double() - torch.cat(batch["rollout_log_probs"]).double())
    low, high = args.tis_clip_low, args.tis_clip
    if args.custom_tis_function_path is None:
        clamped = ratio.clamp(low, high)
        metrics = {"tis": ratio, "tis_clipfrac": (clamped != ratio).double(), "tis_abs": (ratio - 1).abs()}
        return pg * clamped, batch["loss_masks"], metrics
    assert args.custom_tis_function_path == REJECTION
    kept = []
    for s in samples:
        full_ratio = torch.exp(s.log_probs.double() - s.rollout_log_probs.double())
        kept.append(s.loss_mask * ((full_ratio >= low) & (full_ratio <= high)).to(s.loss_mask.dtype))
    return pg * ratio, kept, {"rs_reject_frac": ((ratio < low) | (ratio > high)).double()}


def reference_policy_loss(args, batch, stats, reducer, cp_rank, cp_size, samples):
    """slime's policy loss on float64 log-probs / entropies of the rank's positions."""
    lp_full, ent_full = stats
    pos = [rank_response_positions(t, r, cp_rank, cp_size) for t, r in zip(TOTALS, RESPONSES)]
    lp = torch.cat([x[p] for x, p in zip(lp_full, pos)])
    ent = torch.cat([x[p] for x, p in zip(ent_full, pos)])
    old = torch.cat(batch["rollout_log_probs"] if args.use_rollout_logprobs else batch["log_probs"]).double()
    adv = torch.cat(batch["advantages"]).double()
    seq_ppo_kl, opsm_keep, opsm_clipfrac = reference_corrections(args, batch, samples, lp_full, cp_rank, cp_size)
    ppo_kl = old - lp if seq_ppo_kl is None else seq_ppo_kl
    ratio = torch.exp(-ppo_kl)
    clipped_ratio = ratio.clamp(1 - args.eps_clip, 1 + args.eps_clip_high)
    if getattr(args, "pg_loss_type", None) == "reinforce":
        pg = -adv * lp
        clipfrac = torch.zeros_like(lp)
    elif args.advantage_estimator == "cispo":
        pg = -clipped_ratio.detach() * adv * lp
        clipfrac = (clipped_ratio != ratio).double()
    else:
        pg = torch.maximum(-ratio * adv, -clipped_ratio * adv)
        clipfrac = (-clipped_ratio * adv > -ratio * adv).double()
        if args.eps_clip_c is not None:
            pg = torch.where(adv < 0, torch.minimum(-args.eps_clip_c * adv, pg), pg)
    if opsm_keep is not None:
        pg = pg * opsm_keep
    extra, kept_batch, metric_reducer = {}, batch, reducer
    if args.use_tis or args.get_mismatch_metrics:
        pg, kept, tis_metrics = reference_tis(args, batch, samples, pg)
        kept_batch = dict(batch, loss_masks=kept)  # slime's reducer rebuilt on the kept masks
        reducer = sum_of_sample_mean(kept_batch, cp_rank, cp_size, per_token=args.calculate_per_token_loss)
        extra = {"ois": metric_reducer(torch.exp(-ppo_kl)), **{k: metric_reducer(v) for k, v in tis_metrics.items()}}
    if opsm_clipfrac is not None:
        extra["opsm_clipfrac"] = opsm_clipfrac
    pg_loss = reference_pg_term(args, kept_batch, pg, reducer, cp_rank, cp_size)
    entropy = reducer(ent if args.entropy_coef != 0 else ent.detach())
    loss = pg_loss - args.entropy_coef * entropy
    metrics = {"pg_loss": pg_loss, "entropy_loss": entropy, "pg_clipfrac": reducer(clipfrac), "ppo_kl": reducer(ppo_kl)}
    if args.use_kl_loss:
        unbiased = torch.exp(lp - old) if args.use_unbiased_kl else None
        metrics["kl_loss"] = reducer(reference_kl(lp, torch.cat(batch["ref_log_probs"]).double(), args.kl_loss_type, unbiased))
        loss = loss + args.kl_loss_coef * metrics["kl_loss"]
    compared = lp if args.use_rollout_logprobs else old
    metrics["train_rollout_logprob_abs_diff"] = reducer((compared - torch.cat(batch["rollout_log_probs"]).double()).abs())
    return loss, {"loss": loss, **metrics, **extra}


# ----------------------------------------------------------------------------- cases


def _batch(samples, args, info_cp_rank, cp_size, replay):
    batch = micro_batch(samples, info_cp_rank, cp_size)
    if replay is not None:
        batch["rollout_top_p_token_ids"], batch["rollout_top_p_token_offsets"] = replay
    if args.loss_aggregation == "prompt_mean":
        batch["multimodal_train_inputs"] = {"fusedrl_prompt_denominator": torch.tensor(PROMPT_DENOMINATORS)}
    return batch


def _rank_policy_loss(info, samples, full_logits, args, replay, device):
    batch = _batch(samples, args, info.cp_rank, info.cp_size, replay)
    return rank_loss_and_grad(info, full_logits, args, batch, policy_loss, device)


CASES = {
    "ppo": (1, 1, {}),
    "ppo_entropy_kl_k3": (2, 1, dict(entropy_coef=0.01, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k3")),
    "dual_clip_entropy_kl": (1, 2, dict(eps_clip_c=3.0, entropy_coef=0.02, use_kl_loss=True, kl_loss_coef=0.05, kl_loss_type="low_var_kl")),
    "cispo_entropy": (2, 2, dict(advantage_estimator="cispo", entropy_coef=0.01)),
    "cispo_unbiased_kl_k2": (1, 1, dict(advantage_estimator="cispo", use_kl_loss=True, kl_loss_coef=0.2, kl_loss_type="k2", use_unbiased_kl=True)),
    "dual_clip_asymmetric": (2, 2, dict(eps_clip_c=2.5, eps_clip_high=0.28)),
    "cispo_asymmetric": (1, 1, dict(advantage_estimator="cispo", eps_clip_high=0.28)),
    "ppo_rollout_logprobs_kl_metric_only": (1, 2, dict(use_rollout_logprobs=True, use_kl_loss=True, kl_loss_coef=0.0)),
    "ppo_top_p_temperature_allgather": (2, 2, dict(rollout_temperature=0.7, rollout_top_p=0.9, allgather_cp=True, entropy_coef=0.01)),
    "ppo_constant": (2, 1, dict(loss_aggregation="constant", loss_aggregation_divisor=7.0)),
    "ppo_token_mean": (1, 2, dict(loss_aggregation="token_mean", calculate_per_token_loss=True, entropy_coef=0.01)),
    "cispo_prompt_mean": (1, 2, dict(advantage_estimator="cispo", loss_aggregation="prompt_mean")),
    "reinforce_entropy": (2, 1, dict(pg_loss_type="reinforce", entropy_coef=0.01)),
    # slime's corrections under each --loss-aggregation mode (sample_mean against slime's own code:
    # test_upstream_slime_corrections.py): a TIS function's kept masks weigh every term
    "cispo_tis_kl": (1, 1, dict(advantage_estimator="cispo", use_tis=True, use_kl_loss=True, kl_loss_coef=0.1, **BAND)),
    "tis_constant": (2, 1, dict(use_tis=True, loss_aggregation="constant", loss_aggregation_divisor=7.0, entropy_coef=0.01, **BAND)),
    "rejection_prompt_mean": (1, 2, dict(use_tis=True, custom_tis_function_path=REJECTION, loss_aggregation="prompt_mean",
                                         use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k3", **BAND)),
    "rejection_token_mean": (2, 2, dict(get_mismatch_metrics=True, custom_tis_function_path=REJECTION, entropy_coef=0.01,
                                        loss_aggregation="token_mean", calculate_per_token_loss=True, **BAND)),
    "gspo_opsm_prompt_mean": (1, 2, dict(advantage_estimator="gspo", use_opsm=True, opsm_delta=3.0, loss_aggregation="prompt_mean")),
    "opsm_tis_constant": (2, 1, dict(use_opsm=True, opsm_delta=3.0, use_tis=True, loss_aggregation="constant",
                                     loss_aggregation_divisor=5.0, **BAND)),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_policy_loss_matches_slime_reference(case, device):
    tp, cp, overrides = CASES[case]
    args = slime_args(**overrides)
    samples = make_samples(21, TOTALS, RESPONSES, VOCAB)
    full_logits = make_logits(21, TOTALS, VOCAB)
    replay = top_p_replay(22, RESPONSES, VOCAB) if args.rollout_top_p < 1 else None

    ref_logits = [x.clone().requires_grad_() for x in full_logits]
    stats = reference_response_stats(ref_logits, [s.tokens for s in samples], TOTALS, RESPONSES, args.rollout_temperature, replay)
    expected = reference_losses(
        args,
        cp,
        lambda cp_rank: _batch(samples, args, cp_rank, cp, replay),
        lambda cp_rank: lambda a, b, logits, reducer: reference_policy_loss(a, b, stats, reducer, cp_rank, cp, samples),
    )
    ref_grads = torch.autograd.grad(sum(loss for loss, _ in expected), ref_logits)
    results = run_loss_on_ranks(tp, cp, device, _rank_policy_loss, samples, full_logits, args, replay)
    assert_ranks_match_reference(results, expected, ref_grads, args)


def test_policy_loss_needs_top_p_replay_data_when_top_p_below_one():
    samples = make_samples(3, TOTALS, RESPONSES, VOCAB)
    batch = micro_batch(samples, 0, 1)
    logits = torch.cat(make_logits(3, TOTALS, VOCAB)).float().unsqueeze(0)
    with pytest.raises(ValueError, match="rollout_top_p_token_ids"):
        policy_loss(slime_args(rollout_top_p=0.9), batch, logits, lambda x: x.sum())


def test_policy_loss_with_no_response_token_on_this_rank_keeps_the_graph(device):
    samples = make_samples(4, [3], [1], VOCAB)
    batch = micro_batch(samples, 0, 1)
    batch["loss_masks"] = [torch.zeros(1, dtype=torch.int)]
    batch["response_lengths"], batch["total_lengths"] = [0], [3]
    for key in ("advantages", "log_probs", "ref_log_probs", "rollout_log_probs"):
        batch[key] = [batch[key][0][:0]]
    batch["loss_masks"] = [batch["loss_masks"][0][:0]]
    batch = to_device(batch, device)
    logits = torch.randn(1, 4, VOCAB).to(device).requires_grad_(True)
    loss, metrics = policy_loss(slime_args(), batch, logits, lambda x: x.sum() * 0)
    loss.backward()
    assert float(loss.detach()) == 0.0 and torch.equal(logits.grad, torch.zeros_like(logits))
    assert float(metrics["pg_loss"]) == 0.0


def test_policy_loss_is_bitwise_deterministic(device):
    args = slime_args(entropy_coef=0.01, use_kl_loss=True, kl_loss_coef=0.1, rollout_top_p=0.9, rollout_temperature=0.8)
    samples = make_samples(9, TOTALS, RESPONSES, VOCAB)
    batch = to_device(micro_batch(samples, 0, 1), device)
    batch["rollout_top_p_token_ids"], batch["rollout_top_p_token_offsets"] = top_p_replay(9, RESPONSES, VOCAB)
    full = torch.cat(make_logits(9, TOTALS, VOCAB)).float().unsqueeze(0).to(device)
    runs = []
    for _ in range(2):
        logits = full.clone().requires_grad_()
        loss, metrics = policy_loss(args, batch, logits, lambda x: x.sum())
        loss.backward()
        runs.append((loss.detach(), metrics, logits.grad))
    (loss_a, metrics_a, grad_a), (loss_b, metrics_b, grad_b) = runs
    assert torch.equal(loss_a, loss_b) and torch.equal(grad_a, grad_b)
    assert all(torch.equal(metrics_a[key], metrics_b[key]) for key in metrics_a)


@pytest.mark.parametrize(
    "overrides,named",
    [
        (dict(pg_loss_type="reinforce", advantage_estimator="cispo"), "--pg-loss-type reinforce"),
        (dict(use_kl_loss=True, kl_loss_type="k9"), "--kl-loss-type"),
        (dict(use_tis=True, tis_clip_low=2.5), "--tis-clip-low"),
        (dict(get_mismatch_metrics=True, tis_clip=float("nan")), "--tis-clip"),
        (dict(use_opsm=True, opsm_delta=float("inf")), "--opsm-delta"),
        (dict(custom_pg_loss_reducer_function_path="a.b"), "--custom-pg-loss-reducer-function-path"),
        (dict(custom_loss_function_path="fusedrl.slime_ext.losses.policy.policy_loss", use_opsm=True, opsm_delta=float("nan")), "--opsm-delta"),
        (dict(loss_type="policy_loss", pg_loss_type="reinforce"), "--pg-loss-type reinforce"),
    ],
)
def test_policy_validation_names_the_flag(overrides, named):
    from fusedrl.slime_ext.flags.policy import validate_args

    with pytest.raises(ValueError, match=named):
        validate_args(slime_args(**overrides))


def test_policy_validation_ignores_other_losses():
    from fusedrl.slime_ext.flags.policy import validate_args

    validate_args(slime_args(loss_type="policy_loss", use_tis=True))


def _direct_call(args, batch=None):
    """The loss called directly (no startup check beyond its own first-use one), tp = cp = 1."""
    samples = make_samples(5, TOTALS, RESPONSES, VOCAB)
    batch = micro_batch(samples, 0, 1) if batch is None else batch
    logits = torch.cat(make_logits(5, TOTALS, VOCAB)).float().unsqueeze(0).requires_grad_()
    return policy_loss(args, batch, logits, sum_of_sample_mean(batch, 0, 1))


@pytest.mark.parametrize(
    "flags,reported",
    [
        (dict(use_tis=True, **BAND), {"ois", "tis", "tis_clipfrac", "tis_abs"}),
        (dict(get_mismatch_metrics=True, custom_tis_function_path=REJECTION, **BAND), {"ois", "rs_reject_frac"}),
        (dict(use_opsm=True, opsm_delta=3.0), {"opsm_clipfrac"}),
        (dict(advantage_estimator="gspo"), set()),
    ],
)
def test_a_correction_set_after_the_first_use_check_is_computed_not_ignored(flags, reported):
    """The first-use check runs once per args object: a correction switched on later (or args the
    entry point never saw) is still computed by the loss: its metrics appear and the loss moves."""
    args = slime_args()
    plain_loss, plain_metrics = _direct_call(args)
    for key, value in flags.items():
        setattr(args, key, value)
    loss, metrics = _direct_call(args)
    assert set(metrics) - set(plain_metrics) == reported
    assert not torch.equal(loss.detach(), plain_loss.detach())


def test_a_correction_without_its_inputs_or_with_a_malformed_tis_function_is_refused_naming_the_flag():
    batch = micro_batch(make_samples(5, TOTALS, RESPONSES, VOCAB), 0, 1)
    batch["rollout_log_probs"] = []
    with pytest.raises(ValueError, match="--use-tis needs the rollout log-probs"):
        _direct_call(slime_args(use_tis=True), batch)
    with pytest.raises(ValueError, match="--custom-tis-function-path fusedrl.slime_ext.losses.policy.policy_loss does not take"):
        _direct_call(slime_args(use_tis=True, custom_tis_function_path="fusedrl.slime_ext.losses.policy.policy_loss"))
    with pytest.raises(ValueError, match="--custom-tis-function-path test_policy_loss.pg_loss_only must return"):
        _direct_call(slime_args(get_mismatch_metrics=True, custom_tis_function_path="test_policy_loss.pg_loss_only"))


def pg_loss_only(args, *, pg_loss, **kwargs):
    """A TIS function that returns pg_loss alone instead of slime's (pg_loss, masks, metrics)."""
    return pg_loss
