"""`fusedrl.slime_ext.losses.sfc_loss` through slime's loss wrapper (harness) against an eager
float64 implementation of the SFC formulas (docs/math.md) written here: loss, metrics and logits
gradient at tp = 1, 2 and cp = 1, 2 (zigzag and allgather), K = 1, 4 and 8, fresh and stale tokens
mixed, repeated draws and draws equal to the sampled token, each --sfc-loss-agg-mode. Prompt and
padding rows of the logits are NaN (huge under allgather-CP): only response rows are read. Kernels
run on the `device` fixture's device, except under tp or cp > 1: there on CPU gloo workers
(`slime_harness.run_loss_on_ranks`).
"""

import math

import pytest
import torch
from device import to_device

from fusedrl.slime_ext.carry import SFC_DRAWS_KEY as DRAWS_KEY
from fusedrl.slime_ext.carry import SFC_VERSIONS_KEY as VERSIONS_KEY
from fusedrl.slime_ext.flags.sfc import AGG_MODES
from fusedrl.slime_ext.losses.sfc import (
    CenteredScores,
    centered_scores,
    kl_coefficients,
    sfc_loss,
    sfc_token_loss,
)
from distributed import RankInfo
from numerics import assert_parity
from test_m2po import full_m2_and_set, loop_trust_region, tau_between
from slime_harness import (
    RESPONSES,
    TOTALS,
    VOCAB,
    assert_ranks_match_reference,
    make_logits,
    make_samples,
    micro_batch,
    rank_logits,
    rank_loss_and_grad,
    rank_response_positions,
    reference_losses,
    run_loss_on_ranks,
    slime_args,
)

PUSHES = {1: 0, 2: 2, 3: 3}  # weight version -> optimizer steps completed at its push
STEPS_STARTED = 4  # step 3 in flight: versions 1, 2, 3 have ages 3, 1, 0
BETA = 0.7


def sfc_args(num_draws, agg_mode="sample-mean", **overrides):
    aggregation, divisor = AGG_MODES[agg_mode]
    values = dict(
        custom_loss_function_path="fusedrl.slime_ext.losses.sfc_loss",
        sfc_num_auxiliary_token_samples=num_draws,
        sfc_kl_beta=BETA,
        sfc_m2_tau=None,
        loss_aggregation=aggregation,
        loss_aggregation_divisor=divisor,
        calculate_per_token_loss=aggregation == "token_mean",
    )
    return slime_args(**{**values, **overrides})


def make_draws(seed, samples, num_draws):
    """Per sample, draws [resp, K] (some equal to the sampled token, some repeated) and versions."""
    gen = torch.Generator().manual_seed(seed)
    draws, versions = [], []
    for s in samples:
        d = torch.randint(0, VOCAB, (s.response_length, num_draws), generator=gen)
        sampled = s.tokens[len(s.tokens) - s.response_length :]
        d[::2, 0] = sampled[::2]  # draw equal to the sampled token
        if num_draws > 1:
            d[:, -1] = d[:, 0]  # repeated draw
        draws.append(d)
        versions.append(torch.tensor(list(PUSHES), dtype=torch.int64)[torch.randint(0, 3, (s.response_length,), generator=gen)])
    return draws, versions


def carried_batch(samples, draws, versions, cp_rank, cp_size):
    batch = micro_batch(samples, cp_rank, cp_size)
    batch["multimodal_train_inputs"] = {DRAWS_KEY: torch.cat(draws), VERSIONS_KEY: torch.cat(versions)}
    return batch


# ----------------------------------------------------------------------------- reference


def sampled_log_probs(full_logits, samples, temperature):
    """Per sample, float64 log-probs of its sampled response tokens (every response position)."""
    out = []
    for logits, s in zip(full_logits, samples):
        total, response = len(s.tokens), s.response_length
        z = logits[total - response - 1 : total - 1].double() / temperature
        out.append(torch.log_softmax(z, -1).gather(1, s.tokens[total - response :, None])[:, 0])
    return out


def trust_region_truth(args, full_logits, samples):
    """(keep per token in cp = 1 order, M2 before, after) of --sfc-m2-tau by the paper's loop."""
    m2, in_set = full_m2_and_set(samples, sampled_log_probs(full_logits, samples, args.rollout_temperature))
    return loop_trust_region(m2, in_set, args.sfc_m2_tau)


def reference_sfc(args, batch, full_logits, samples, draws, versions, reducer, cp_rank, cp_size):
    """Eager float64 SFC loss and metrics for one rank, from the formulas (the trust region of
    --sfc-m2-tau by the paper's loop over the whole micro-batch)."""
    tau = args.rollout_temperature
    region = None if args.sfc_m2_tau is None else trust_region_truth(args, full_logits, samples)
    keep = None if region is None else torch.tensor(region[0], dtype=torch.float64).split([s.response_length for s in samples])
    per_token, scores, kls, ages, drift, kept = [], [], [], [], [], []
    for i, s in enumerate(samples):
        total, response = len(s.tokens), s.response_length
        pos = rank_response_positions(total, response, cp_rank, cp_size)
        z = full_logits[i][total - response - 1 + pos] / tau
        a = s.tokens[total - response + pos]
        v = draws[i][pos]
        c = z.gather(1, a[:, None])[:, 0] - z.gather(1, v).mean(-1)
        lp = torch.log_softmax(z, -1)
        kl = -lp.gather(1, v).mean(-1)
        age = torch.tensor([STEPS_STARTED - 1 - PUSHES[int(x)] for x in versions[i][pos]], dtype=torch.float64)
        beta = torch.tensor([args.sfc_kl_beta / math.sqrt(x) if x > 0 else 0.0 for x in age.tolist()], dtype=torch.float64)
        kept.append(torch.ones_like(c) if keep is None else keep[i][pos])
        per_token.append(-batch["advantages"][i].double() * c * kept[-1] + beta * kl)
        scores.append(c)
        kls.append(beta * kl)
        ages.append(age)
        drift.append(batch["rollout_log_probs"][i].double() - lp.gather(1, a[:, None])[:, 0])
    per_token = torch.cat(per_token)
    if args.loss_aggregation == "constant":
        masks = [m[rank_response_positions(len(s.tokens), s.response_length, cp_rank, cp_size)] for m, s in zip(batch["loss_masks"], samples)]
        loss = (per_token * torch.cat(masks)).sum() / args.loss_aggregation_divisor
    else:
        loss = reducer(per_token)
    ages = torch.cat(ages)
    metrics = {
        "loss": loss,
        "pg_loss": loss,
        "sfc_centered_score": reducer(torch.cat(scores)),
        "sfc_kl": reducer(torch.cat(kls)),
        "sfc_age": reducer(ages),
        "sfc_stale_frac": reducer((ages > 0).double()),
        "ppo_kl": reducer(torch.cat(drift)),
    }
    if region is not None:
        ones = torch.ones_like(ages)
        metrics.update(m2po_masked_frac=reducer(1 - torch.cat(kept)), m2po_m2_before=reducer(ones * region[1]),
                       m2po_m2_after=reducer(ones * region[2]))  # fmt: skip
    return loss, metrics


# ----------------------------------------------------------------------------- cases


def _rank_sfc_loss(info, samples, draws, versions, full_logits, args, device):
    """One rank's loss with the age clock at PUSHES / STEPS_STARTED (restored after: tp = cp = 1
    runs in the test process)."""
    from fusedrl.slime_ext.age import CLOCK

    saved = CLOCK.push_steps, CLOCK.steps_started
    CLOCK.push_steps, CLOCK.steps_started = dict(PUSHES), STEPS_STARTED
    try:
        batch = carried_batch(samples, draws, versions, info.cp_rank, info.cp_size)
        return rank_loss_and_grad(info, full_logits, args, batch, sfc_loss, device)
    finally:
        CLOCK.push_steps, CLOCK.steps_started = saved


CASES = {
    "k8_sample_mean": (1, 1, 8, "sample-mean", {}),
    "k1_tp2_token_mean": (2, 1, 1, "token-mean", {}),
    "k8_cp2_token_sum_temperature": (1, 2, 8, "token-sum", dict(rollout_temperature=0.7)),
    "k8_tp2_cp2": (2, 2, 8, "sample-mean", {}),
    "k4_allgather_cp2": (1, 2, 4, "sample-mean", dict(allgather_cp=True, rollout_temperature=1.3)),
    # --sfc-m2-tau at a threshold that removes 2 tokens of the set (TRUST_REGION_REMOVED)
    "k4_trust_region_token_sum": (1, 1, 4, "token-sum", dict(sfc_m2_tau="between")),
    "k4_trust_region_cp2_kl_off": (1, 2, 4, "sample-mean", dict(sfc_m2_tau="between", sfc_kl_beta=0.0)),
}
TRUST_REGION_REMOVED = 2


@pytest.mark.parametrize("case", list(CASES))
def test_sfc_loss_matches_reference(case, device):
    tp, cp, num_draws, agg_mode, overrides = CASES[case]
    args = sfc_args(num_draws, agg_mode, **overrides)
    samples = make_samples(31, TOTALS, RESPONSES, VOCAB)
    draws, versions = make_draws(32, samples, num_draws)
    full_logits = make_logits(31, TOTALS, VOCAB)
    if args.sfc_m2_tau == "between":  # half way between two of the loop's means: rounding cannot move it
        lps = sampled_log_probs(full_logits, samples, args.rollout_temperature)
        args.sfc_m2_tau = tau_between(*full_m2_and_set(samples, lps), TRUST_REGION_REMOVED)
        assert sum(not k for k in trust_region_truth(args, full_logits, samples)[0]) == TRUST_REGION_REMOVED

    ref_logits = [x.clone().requires_grad_() for x in full_logits]
    expected = reference_losses(
        args,
        cp,
        lambda cp_rank: carried_batch(samples, draws, versions, cp_rank, cp),
        lambda cp_rank: lambda a, b, logits, reducer: reference_sfc(a, b, ref_logits, samples, draws, versions, reducer, cp_rank, cp),
    )
    ref_grads = torch.autograd.grad(sum(loss for loss, _ in expected), ref_logits)
    results = run_loss_on_ranks(tp, cp, device, _rank_sfc_loss, samples, draws, versions, full_logits, args)
    assert_ranks_match_reference(results, expected, ref_grads, args)


# ----------------------------------------------------------------------------- math


def _fresh_case(num_draws, seed=5, rows=7, vocab=33):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=gen) * 3).requires_grad_()
    ids = torch.randint(0, vocab, (rows, 1 + num_draws), generator=gen)
    ids[0, 1] = ids[0, 0]  # a draw equal to the sampled token
    ids[1, 2:] = ids[1, 1]  # repeated draws
    advantages = torch.randn(rows, generator=gen)
    return logits, ids, advantages


@pytest.mark.parametrize("num_draws", [1, 8])
def test_centered_score_gradient_on_fresh_tokens_is_the_pure_scatter(num_draws, device):
    """-A (e_a - mean_k e_{v_k}) / tau and nothing else: no softmax term leaks into any column."""
    logits, ids, advantages = _fresh_case(num_draws)
    tau = 0.8
    leaf, on_device = logits.detach().to(device).requires_grad_(), to_device((ids, advantages), device)
    scores = centered_scores(leaf, on_device[0], temperature=tau)
    loss = sfc_token_loss(scores, on_device[1], torch.zeros(len(ids), device=device)).sum()
    (grad,) = torch.autograd.grad(loss, leaf)
    grad = grad.cpu()
    expected = torch.zeros(logits.shape, dtype=torch.float64)
    rows = torch.arange(len(ids))[:, None]
    expected.index_put_((rows[:, 0], ids[:, 0]), -advantages.double() / tau, accumulate=True)
    expected.index_put_((rows.expand(-1, num_draws).reshape(-1), ids[:, 1:].reshape(-1)),
                        (advantages.double() / (num_draws * tau))[:, None].expand(-1, num_draws).reshape(-1), accumulate=True)
    assert bool((grad[expected == 0] == 0).all())  # exact zeros off the ids
    assert_parity(grad, expected, 1e-6)


def test_kl_coefficients():
    ages = torch.tensor([0, 1, 4, 9])
    coefs = kl_coefficients(ages, 0.6)
    assert coefs[0] == 0 and torch.allclose(coefs, torch.tensor([0.0, 0.6, 0.3, 0.2]), rtol=1e-7, atol=0)
    with pytest.raises(ValueError, match="ages"):
        kl_coefficients(torch.tensor([1, -1]), 0.6)


def test_centered_scores_reject_bad_shapes():
    logits, ids, advantages = _fresh_case(4)
    with pytest.raises(ValueError, match="ids"):
        centered_scores(logits, ids[:, :1])
    with pytest.raises(ValueError, match="draw_weights"):
        centered_scores(logits, ids, draw_weights=torch.ones(len(ids), 3))
    with pytest.raises(ValueError, match="draw_weights"):
        centered_scores(logits, ids, draw_weights=torch.full((len(ids), 4), float("nan")))
    scores = CenteredScores(*(torch.zeros(len(ids)) for _ in range(3)))
    with pytest.raises(ValueError, match="advantages"):
        sfc_token_loss(scores, advantages[:-1], torch.zeros(len(ids)))


def test_head_weights_center_on_the_weighted_head(device):
    logits, ids, _ = _fresh_case(3)
    weights = torch.softmax(torch.randn(len(ids), 3, generator=torch.Generator().manual_seed(1)), -1)
    scores = centered_scores(*to_device((logits, ids), device), draw_weights=weights.to(device))
    z = logits.detach().double()
    expected = z.gather(1, ids[:, :1])[:, 0] - (z.gather(1, ids[:, 1:]) * weights.double()).sum(-1)
    assert_parity(scores.centered_score, expected, 1e-6)


def test_sfc_loss_rejects_draws_of_the_wrong_width():
    samples = make_samples(31, TOTALS, RESPONSES, VOCAB)
    draws, versions = make_draws(32, samples, 4)
    batch = carried_batch(samples, draws, versions, 0, 1)
    logits = rank_logits(make_logits(31, TOTALS, VOCAB), RankInfo(0, 1, 0, 1, 0, 1, 0, 1))
    with pytest.raises(ValueError, match="sfc-num-auxiliary-token-samples"):
        sfc_loss(sfc_args(8), batch, logits, lambda x: x.sum())
