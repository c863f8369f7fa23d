"""M2PO's trust region (--fusedrl-m2po-tau) on `fusedrl.slime_ext.losses.policy_loss`.

Truth: the paper's rule as a plain Python loop in float64 (`loop_trust_region`: while the set's
mean M2 exceeds tau, remove its largest M2, the lower position first among equals), independent of
the package's sort-and-scan selection (`slime_ext/trust_region.py`), and the M2PO objective on the
float64 eager log-probs of the harness's micro-batch (`reference_m2po_loss`). Checked: the
selection alone on many random sets (ties, empty sets, every member removed); the loss, every
metric and the logits gradient through slime's loss wrapper under each --loss-aggregation mode, on
a micro-batch with a one-token sample, loss-masked tokens and a fully masked sample, for a tie in
M2 across cp ranks, an empty set and a set masked whole; cp = 2 and tp = 2 x cp = 2 on gloo equal
to the same truth (the cp = 1 selection); bitwise determinism; and every refusal, naming the flag.

tau is put half way between two consecutive means of the removal sequence (`tau_between`), so
that float32 rounding of the log-probs cannot move the selection.
"""

import math

import pytest
import torch
from device import to_device
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
)
from numerics import assert_parity
from test_policy_loss import PROMPT_DENOMINATORS, reference_pg_term

from fusedrl.slime_ext import arguments, corrections
from fusedrl.slime_ext.flags import m2po as m2po_flags
from fusedrl.slime_ext.losses import policy_loss
from fusedrl.slime_ext.trust_region import second_moment_mask

FLAG = "--fusedrl-m2po-tau"
MODES = {
    "sample_mean": {},
    "prompt_mean": dict(loss_aggregation="prompt_mean"),
    "token_mean": dict(loss_aggregation="token_mean", calculate_per_token_loss=True),
    "constant": dict(loss_aggregation="constant", loss_aggregation_divisor=7.0),
}
# (sample, response position) of two tokens given the same logits row, target and rollout log-prob,
# so the same M2 in float32 and float64; at cp = 2 the first (lower position) sits on rank 1 and
# the second on rank 0, so only the group-wide order breaks the tie the cp = 1 way.
TIED = ((0, 2), (2, 8))


# ----------------------------------------------------------------------------- the truth


def loop_trust_region(m2, in_set, tau):
    """The paper's rule on Python floats: (keep per token, mean M2 over the set before, after)."""
    members = [i for i, inside in enumerate(in_set) if inside]
    before = sum(m2[i] for i in members) / len(members) if members else 0.0
    removed = set()
    while members and sum(m2[i] for i in members) / len(members) > tau:
        largest = max(members, key=lambda i: (m2[i], -i))  # equal M2: the lower position first
        members.remove(largest)
        removed.add(largest)
    after = sum(m2[i] for i in members) / len(members) if members else 0.0
    return [i not in removed for i in range(len(m2))], before, after


def removal_means(m2, in_set):
    """The set's mean M2 after removing its k largest, for k = 0, 1, ... (the loop's sequence)."""
    values = sorted((m2[i] for i, inside in enumerate(in_set) if inside), reverse=True)
    return [sum(values[k:]) / (len(values) - k) for k in range(len(values))]


def tau_between(m2, in_set, k):
    """A tau at which the loop removes exactly k tokens, half way between the means around it."""
    means = removal_means(m2, in_set)
    assert 0 < k < len(means) and means[k - 1] > means[k], (k, means)
    return (means[k - 1] + means[k]) / 2


def full_m2_and_set(samples, log_probs):
    """Per token of the micro-batch in cp = 1 order, from float64 log-probs: M2 and membership."""
    m2, in_set = [], []
    for sample, lp in zip(samples, log_probs):
        log_ratio = (lp.detach() - sample.rollout_log_probs.double()).tolist()
        for ratio, advantage, mask in zip(log_ratio, sample.advantages.tolist(), sample.loss_mask.tolist()):
            m2.append(ratio * ratio)
            in_set.append(bool(mask) and ((advantage > 0 and ratio > 0) or (advantage < 0 and ratio < 0)))
    return m2, in_set


def reference_m2po_loss(args, batch, stats, reducer, cp_rank, cp_size, samples):
    """The policy loss with M2PO's pg_loss, on float64 log-probs and entropies of the rank's
    positions, the trust region taken over the whole micro-batch by the loop."""
    lp_full, ent_full = stats
    keep, before, after = loop_trust_region(*full_m2_and_set(samples, lp_full), args.fusedrl_m2po_tau)
    keep_full = torch.tensor(keep, dtype=torch.float64).split(RESPONSES)
    pos = [rank_response_positions(t, r, cp_rank, cp_size) for t, r in zip(TOTALS, RESPONSES)]

    def local(per_sample):
        return torch.cat([x[p] for x, p in zip(per_sample, pos)])

    lp, ent, kept = local(lp_full), local(ent_full), local(keep_full)
    adv, rollout = local([s.advantages.double() for s in samples]), local([s.rollout_log_probs.double() for s in samples])
    pg = -kept * torch.exp(lp - rollout) * adv
    old = rollout if args.use_rollout_logprobs else torch.cat(batch["log_probs"]).double()
    ratio = torch.exp(lp - old)  # pg_clipfrac and ppo_kl keep reporting the PPO clip
    clipped = ratio.clamp(1 - args.eps_clip, 1 + args.eps_clip_high)
    pg_loss = reference_pg_term(args, batch, pg, reducer, cp_rank, cp_size)
    entropy = reducer(ent if args.entropy_coef != 0 else ent.detach())
    loss = pg_loss - args.entropy_coef * entropy
    ones = torch.ones_like(lp)
    metrics = {
        "pg_loss": pg_loss,
        "entropy_loss": entropy,
        "pg_clipfrac": reducer((-clipped * adv > -ratio * adv).double()),
        "ppo_kl": reducer(old - lp),
        "train_rollout_logprob_abs_diff": reducer(((lp if args.use_rollout_logprobs else old) - rollout).abs()),
        "m2po_masked_frac": reducer(1 - kept),
        "m2po_m2_before": reducer(ones * before),
        "m2po_m2_after": reducer(ones * after),
    }
    return loss, {"loss": loss, **metrics}


# ----------------------------------------------------------------------------- the cases


def build_case(seed, scenario):
    """(samples, full logits, tau): the harness's micro-batch with rollout log-probs at
    |log pi - log pi_rollout| in [0.05, 1.25] on either side, and the scenario's set and tau."""
    full_logits = make_logits(seed, TOTALS, VOCAB)
    samples = make_samples(seed, TOTALS, RESPONSES, VOCAB)
    if scenario == "tie":
        (s1, j1), (s2, j2) = TIED
        rows = [TOTALS[s] - RESPONSES[s] - 1 + j for s, j in TIED]
        full_logits[s2][rows[1]] = full_logits[s1][rows[0]]
        tokens = samples[s2].tokens.clone()
        tokens[rows[1] + 1] = samples[s1].tokens[rows[0] + 1]
        samples[s2] = samples[s2]._replace(tokens=tokens)
    current, _ = reference_response_stats(full_logits, [s.tokens for s in samples], TOTALS, RESPONSES, 1.0)
    gen = torch.Generator().manual_seed(seed + 5)
    for i, (sample, lp) in enumerate(zip(samples, current)):
        noise = torch.randn(len(lp), generator=gen, dtype=torch.float64)
        gap = noise.sign() * (0.05 + 0.4 * noise.abs().clamp(max=3.0))  # log pi - log pi_rollout
        advantages = sample.advantages.clone()
        if scenario == "empty":  # every advantage against its ratio's side: no token in the set
            advantages = -gap.sign().float() * advantages.abs()
        samples[i] = sample._replace(rollout_log_probs=(lp - gap).float(), advantages=advantages)
    if scenario == "tie":  # the two tokens far ahead of the sampler, the largest M2, advantages apart
        for (s, j), advantage in zip(TIED, (1.0, 2.5)):
            rollout, adv, mask = samples[s].rollout_log_probs.clone(), samples[s].advantages.clone(), samples[s].loss_mask.clone()
            rollout[j], adv[j], mask[j] = float(current[s][j]) - 3.0, advantage, 1
            samples[s] = samples[s]._replace(rollout_log_probs=rollout, advantages=adv, loss_mask=mask)
    m2, in_set = full_m2_and_set(samples, current)
    if scenario == "empty":
        assert not any(in_set)
        return samples, full_logits, 0.04
    if scenario == "all":
        return samples, full_logits, 1e-12  # below every member's M2: the whole set is masked
    if scenario == "tie":
        (i1, i2) = [sum(RESPONSES[:s]) + j for s, j in TIED]
        assert m2[i1] == m2[i2] and m2[i1] == max(m2) and in_set[i1] and in_set[i2]
        return samples, full_logits, tau_between(m2, in_set, 1)  # removes exactly one of the two
    return samples, full_logits, tau_between(m2, in_set, 1 + seed % (sum(in_set) // 2))


def case_args(mode, tau, **overrides):
    return slime_args(fusedrl_m2po_tau=tau, **MODES[mode], **overrides)


def case_batch(samples, args, cp_rank, cp_size):
    batch = micro_batch(samples, cp_rank, cp_size)
    if args.loss_aggregation == "prompt_mean":
        batch["multimodal_train_inputs"] = {"fusedrl_prompt_denominator": torch.tensor(PROMPT_DENOMINATORS)}
    return batch


def rank_m2po_loss(info, samples, full_logits, args, device):
    batch = case_batch(samples, args, info.cp_rank, info.cp_size)
    return rank_loss_and_grad(info, full_logits, args, batch, policy_loss, device)


def rank_cases(info, cases, device):
    """On one rank: the result of every case, so that one pool call serves them all."""
    return [rank_m2po_loss(info, samples, full_logits, args, device) for samples, full_logits, args in cases]


def expected(samples, full_logits, args, cp):
    """Per cp rank, slime's wrapper around the reference, and the float64 logits gradient."""
    ref_logits = [x.clone().requires_grad_() for x in full_logits]
    stats = reference_response_stats(ref_logits, [s.tokens for s in samples], TOTALS, RESPONSES, 1.0)
    per_rank = reference_losses(
        args,
        cp,
        lambda cp_rank: case_batch(samples, args, cp_rank, cp),
        lambda cp_rank: lambda a, b, logits, reducer: reference_m2po_loss(a, b, stats, reducer, cp_rank, cp, samples),
    )
    return per_rank, torch.autograd.grad(sum(loss for loss, _ in per_rank), ref_logits)


CASES = {  # (mode, scenario, seed, other flags)
    "sample_mean_tie": ("sample_mean", "tie", 3, {}),
    "prompt_mean_generic": ("prompt_mean", "generic", 4, {}),
    "token_mean_all_masked": ("token_mean", "all", 5, dict(entropy_coef=0.01)),
    "constant_empty_set": ("constant", "empty", 6, {}),
    "sample_mean_generic_rollout_logprobs": ("sample_mean", "generic", 7, dict(use_rollout_logprobs=True)),
    "token_mean_tie": ("token_mean", "tie", 8, {}),
    "constant_generic": ("constant", "generic", 9, dict(entropy_coef=0.01)),
    "prompt_mean_all_masked": ("prompt_mean", "all", 10, {}),
}


def _case(name):
    mode, scenario, seed, overrides = CASES[name]
    samples, full_logits, tau = build_case(seed, scenario)
    return samples, full_logits, case_args(mode, tau, **overrides)


# ----------------------------------------------------------------------------- the tests


@pytest.mark.parametrize("seed", range(40))
def test_selection_matches_the_loop(seed):
    gen = torch.Generator().manual_seed(seed)
    size = [0, 1, 2, 7, 33][seed % 5]
    if seed % 2:  # ties: a few distinct values
        m2 = torch.randint(0, 4, (size,), generator=gen).double() * 0.25
    else:
        m2 = torch.rand(size, generator=gen, dtype=torch.float64) ** 3 * 2
    in_set = torch.rand(size, generator=gen) < [0.0, 0.6, 1.0][seed % 3]
    tau = [1e-12, 0.1, 0.3, 5.0][seed % 4]
    region = second_moment_mask(m2, in_set, tau)
    keep, before, after = loop_trust_region(m2.tolist(), in_set.tolist(), tau)
    assert region.keep.tolist() == keep
    assert math.isclose(float(region.before), before, rel_tol=1e-12, abs_tol=1e-300)
    assert math.isclose(float(region.after), after, rel_tol=1e-12, abs_tol=1e-300)
    assert float(region.after) <= tau
    assert region.keep[~in_set].all()  # only the set's tokens are ever masked


def test_selection_breaks_ties_by_position_not_by_order_of_arrival():
    """Positions, not the order the tokens come in, decide among equal M2 (the cp layout
    interleaves a sample's tokens)."""
    m2 = torch.tensor([1.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    in_set = torch.ones(4, dtype=torch.bool)
    region = second_moment_mask(m2, in_set, 0.5, positions=torch.tensor([3, 0, 2, 1]), num_positions=4)
    # the loop removes positions 0 and 2 (tokens 1 and 2): the mean of the rest, 0.5, is tau
    assert region.keep.tolist() == [True, False, False, True]


@pytest.mark.parametrize("name", list(CASES))
def test_m2po_matches_the_float64_loop(name, device):
    samples, full_logits, args = _case(name)
    per_rank, ref_grads = expected(samples, full_logits, args, 1)
    results = run_loss_on_ranks(1, 1, device, rank_m2po_loss, samples, full_logits, args)
    assert_ranks_match_reference(results, per_rank, ref_grads, args)


def test_m2po_spans_the_cp_group():
    """At tp = 2 x cp = 2 (one pool of four gloo workers: tp = 2 costs no second pool) every
    rank's loss, metrics and gradient equal the reference, whose selection is the cp = 1 one over
    the whole micro-batch (the tie across cp ranks included)."""
    tp, cp = 2, 2
    cases = [_case(name) for name in ("sample_mean_tie", "prompt_mean_generic", "token_mean_all_masked", "constant_empty_set")]
    per_case = run_loss_on_ranks(tp, cp, torch.device("cpu"), rank_cases, cases)
    for i, (samples, full_logits, args) in enumerate(cases):
        per_rank, ref_grads = expected(samples, full_logits, args, cp)
        assert_ranks_match_reference([rank[i] for rank in per_case], per_rank, ref_grads, args)


def test_m2po_is_bitwise_deterministic(device):
    samples, full_logits, args = _case("sample_mean_tie")
    batch = to_device(case_batch(samples, args, 0, 1), device)
    full = torch.cat(full_logits).float().unsqueeze(0).to(device)
    runs = []
    for _ in range(2):
        logits = full.clone().requires_grad_()
        loss, metrics = policy_loss(args, batch, logits, sum_of_sample_mean(batch, 0, 1))
        loss.backward()
        runs.append((loss.detach(), metrics, logits.grad))
    (loss_a, metrics_a, grad_a), (loss_b, metrics_b, grad_b) = runs
    assert torch.equal(loss_a, loss_b) and torch.equal(grad_a, grad_b)
    assert all(torch.equal(metrics_a[key], metrics_b[key]) for key in metrics_a)
    assert 0 < float(metrics_a["m2po_masked_frac"]) < 1


REFUSED = [
    (dict(fusedrl_m2po_tau=0.0), f"{FLAG} must be finite and > 0, got 0.0"),
    (dict(fusedrl_m2po_tau=-0.04), f"{FLAG} must be finite and > 0, got -0.04"),
    (dict(fusedrl_m2po_tau=float("nan")), f"{FLAG} must be finite and > 0, got nan"),
    (dict(fusedrl_m2po_tau=float("inf")), f"{FLAG} must be finite and > 0, got inf"),
    (dict(use_tis=True), f"{FLAG} 0.04 cannot run with --use-tis"),
    (dict(custom_tis_function_path="a.tis"), f"{FLAG} 0.04 cannot run with --custom-tis-function-path a.tis"),
    (dict(get_mismatch_metrics=True), f"{FLAG} 0.04 cannot run with --get-mismatch-metrics"),
    (dict(use_opsm=True), f"{FLAG} 0.04 cannot run with --use-opsm"),
    (dict(advantage_estimator="gspo"), f"{FLAG} 0.04 cannot run with --advantage-estimator gspo"),
    (dict(advantage_estimator="cispo"), f"{FLAG} 0.04 cannot run with --advantage-estimator cispo"),
    (dict(pg_loss_type="reinforce"), f"{FLAG} 0.04 cannot run with --pg-loss-type reinforce"),
    (dict(eps_clip_c=3.0), f"{FLAG} 0.04 cannot run with --eps-clip-c 3.0"),
]  # fmt: skip


@pytest.mark.parametrize("overrides,named", REFUSED, ids=[f"{next(iter(flags))}-{i}" for i, (flags, _) in enumerate(REFUSED)])
def test_refused_at_startup_and_at_the_loss_first_use(overrides, named):
    args = slime_args(**{"fusedrl_m2po_tau": 0.04, **overrides})
    with pytest.raises(ValueError, match=named.replace("(", r"\(")):
        arguments.validate_fusedrl_args(slime_args(**{"fusedrl_m2po_tau": 0.04, **overrides}))
    samples = make_samples(5, TOTALS, RESPONSES, VOCAB)
    batch = micro_batch(samples, 0, 1)
    logits = torch.cat(make_logits(5, TOTALS, VOCAB)).float().unsqueeze(0).requires_grad_()
    with pytest.raises(ValueError, match=named.replace("(", r"\(")):
        policy_loss(args, batch, logits, sum_of_sample_mean(batch, 0, 1))


def test_refused_with_another_loss():
    for loss_type in ("policy_loss", "sft_loss"):
        args = slime_args(loss_type=loss_type, fusedrl_m2po_tau=0.04)
        with pytest.raises(ValueError, match=f"{FLAG} 0.04 is set but the loss is not fusedrl.slime_ext.losses.policy_loss"):
            arguments.check_at_first_use(args)


def test_refused_without_rollout_log_probs():
    samples = make_samples(5, TOTALS, RESPONSES, VOCAB)
    batch = micro_batch(samples, 0, 1)
    batch["rollout_log_probs"] = []
    logits = torch.cat(make_logits(5, TOTALS, VOCAB)).float().unsqueeze(0).requires_grad_()
    with pytest.raises(ValueError, match=f"{FLAG} needs the rollout log-probs"):
        policy_loss(slime_args(fusedrl_m2po_tau=0.04), batch, logits, sum_of_sample_mean(batch, 0, 1))


def test_the_flag_and_the_fused_lm_heads_recompute_path():
    """Registered on slime's parser (default off); under --fusedrl-fused-lm-head the loss needs the
    whole micro-batch first, which sends it down the recompute path (tests/test_slime/test_slime_one_pass.py)."""
    import argparse

    parser = arguments.add_fusedrl_arguments(argparse.ArgumentParser())
    assert parser.parse_args([]).fusedrl_m2po_tau is None
    assert parser.parse_args([FLAG, "0.04"]).fusedrl_m2po_tau == 0.04
    assert corrections.whole_batch(slime_args(fusedrl_m2po_tau=0.04)) == FLAG
    assert corrections.whole_batch(slime_args()) is None and m2po_flags.enabled(slime_args()) is None


# ----------------------------------------------------------------------------- AReaL's variant as a TIS function


def test_areal_variant_matches_the_loop():
    """`m2_trust_region_tis` against the paper's loop over every loss-masked token's
    (old - rollout)^2, no quadrant: the masked tokens leave pg_loss and the loss masks, the kept
    ones are weighted by slime's clamped TIS ratio."""
    from fusedrl.slime_ext.m2_tis import m2_trust_region_tis

    samples = make_samples(41, TOTALS, RESPONSES, VOCAB)
    old = [s.log_probs for s in samples]
    rollout = [s.rollout_log_probs for s in samples]
    masks = [s.loss_mask for s in samples]
    m2 = [(o - r).double().pow(2).tolist() for o, r in zip(old, rollout)]
    flat_m2, in_set = sum(m2, []), sum((m.bool().tolist() for m in masks), [])
    tau = tau_between(flat_m2, in_set, 3)
    keep, before, after = loop_trust_region(flat_m2, in_set, tau)
    args = slime_args(tis_clip=1.1, tis_clip_low=0.9, fusedrl_m2_tis_tau=tau)
    pg_loss = torch.randn(sum(RESPONSES), generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    out, out_masks, metrics = m2_trust_region_tis(
        args, pg_loss=pg_loss, train_log_probs=old, rollout_log_probs=rollout, loss_masks=masks,
        total_lengths=TOTALS, response_lengths=RESPONSES,
    )  # fmt: skip
    keep = torch.tensor(keep, dtype=torch.float64)
    ratio = torch.exp(torch.cat(old).double() - torch.cat(rollout).double())
    assert_parity(out, pg_loss * ratio.clamp(0.9, 1.1) * keep, 1e-12)
    assert torch.equal(torch.cat(out_masks).double(), torch.cat(masks).double() * keep)
    assert int((keep == 0).sum()) == 3 and float(metrics["m2po_masked_frac"].sum()) == 3
    assert float(metrics["m2po_m2_before"][0]) == pytest.approx(before, rel=1e-12) and float(metrics["m2po_m2_after"][0]) == pytest.approx(after, rel=1e-12)


@pytest.mark.parametrize(
    "overrides,named",
    [
        (dict(fusedrl_m2_tis_tau=0.1, use_tis=True), "read only by --custom-tis-function-path"),
        (dict(fusedrl_m2_tis_tau=0.1, custom_tis_function_path="fusedrl.slime_ext.m2_tis.m2_trust_region_tis"), "needs --use-tis"),
        (dict(fusedrl_m2_tis_tau=-1.0, use_tis=True, custom_tis_function_path="fusedrl.slime_ext.m2_tis.m2_trust_region_tis"), "finite and > 0"),
        (dict(use_tis=True, custom_tis_function_path="fusedrl.slime_ext.m2_tis.m2_trust_region_tis"), "needs --fusedrl-m2-tis-tau"),
    ],
)
def test_areal_variant_refused_at_startup(overrides, named):
    with pytest.raises(ValueError, match=named):
        m2po_flags.validate_args(slime_args(loss_type="policy_loss", **overrides))
