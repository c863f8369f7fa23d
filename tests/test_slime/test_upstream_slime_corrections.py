"""slime's off-policy corrections on `fusedrl.slime_ext.losses.policy_loss` against slime's own
`loss_function` and `policy_loss_function` (FUSEDRL_SLIME_SRC) on the same micro-batch: loss,
every metric slime reports and the logits gradient, to 1e-6 relative, at tp = 1, 2 x cp = 1, 2 on
gloo (one call of the layout's worker pool runs every case).

Truth: slime's code in float64 (float64 per-token inputs, its log-prob function replaced by the
float64 one of `slime_float64`, its torch.compile'd PPO and CISPO terms run eagerly) on the float32
logits slime asserts; the package runs in float32 through the same `loss_function`. The cases cover TIS
(--use-tis, --tis-clip, --tis-clip-low), a custom TIS function by path (slime's own
`icepop_function`, and `slime_harness.reject_outside_tis_band`, which drops tokens from the loss
masks), the package's AReaL trust region (`fusedrl.slime_ext.m2_tis`, which masks tokens across
the cp ranks), the mismatch metrics, CISPO with TIS and the unbiased KL, --use-rollout-logprobs,
OPSM and GSPO. The old, rollout and reference log-probs lie near the current ones (PPO ratios,
TIS ratios and OPSM's sequence KL fall on both sides of every band), samples are partly masked,
one is fully masked, and at cp = 2 a one-token response leaves a rank without a token of it.
"""

import pytest
import torch
from bench_package import import_bench
from distributed import get_pool
from numerics import FLOOR, assert_parity
from slime_float64 import Float64LogProbs
from slime_harness import (
    PAD,
    RESPONSES,
    SCALING,
    TOTALS,
    VOCAB,
    make_logits,
    make_samples,
    micro_batch,
    rank_logits,
    reference_response_stats,
    slime_args,
)

import_bench()
from bench.slime_loop import upstream_slime  # noqa: E402

upstream_slime.require()

TOLERANCE = 1e-6
# A metric that is a mean of differences of near-equal log-probs (old - new, old - rollout) rounds
# as the log-probs do (about 1 in size), not as its small difference: its error is taken relative
# to that size (as in test_upstream_slime_train.py).
# pg_loss (and the loss) is a sum of per-token terms of both signs (advantages of either sign), each
# about 1 in size: a rank's part can cancel far below its terms, whose rounding it keeps.
LOG_PROB_DIFFERENCES = {"ppo_kl": 1.0, "train_rollout_logprob_abs_diff": 1.0, "tis_abs": 1.0, "kl_loss": 1.0}
SIGNED_SUMS = {"loss": 1.0, "pg_loss": 1.0}
BAND = dict(tis_clip=1.1, tis_clip_low=0.9)
ICEPOP = "slime.backends.megatron_utils.loss.icepop_function"
REJECTION = "slime_harness.reject_outside_tis_band"
M2_TIS = "fusedrl.slime_ext.m2_tis.m2_trust_region_tis"  # AReaL's M2 trust region as a TIS function
KL = dict(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl")
CASES = {  # each case several options, so that one pool call stays short
    "tis_dual_clip_entropy_kl": dict(use_tis=True, eps_clip_c=3.0, entropy_coef=0.01, **KL, **BAND),
    "icepop_mismatch_metrics_cispo_unbiased_kl": dict(
        use_tis=True, get_mismatch_metrics=True, custom_tis_function_path=ICEPOP, advantage_estimator="cispo",
        use_unbiased_kl=True, **KL, **BAND),
    "rejection_opsm_entropy": dict(use_tis=True, custom_tis_function_path=REJECTION, use_opsm=True, opsm_delta=0.0,
                                   entropy_coef=0.01, **BAND),
    "m2_trust_region_tis": dict(use_tis=True, custom_tis_function_path=M2_TIS, fusedrl_m2_tis_tau=0.02, **BAND),
    "gspo_mismatch_metrics_rollout_logprobs": dict(
        advantage_estimator="gspo", eps_clip=0.05, get_mismatch_metrics=True, custom_tis_function_path=REJECTION,
        use_rollout_logprobs=True, **BAND),
}  # fmt: skip
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]


def near_policy_samples(seed: int, full_logits):
    """The harness's samples with old log-probs = the current ones + 0.5 N(0, 1), rollout = old +
    0.2 N(0, 1), reference = old + 0.3 N(0, 1)."""
    samples = make_samples(seed, TOTALS, RESPONSES, VOCAB)
    current, _ = reference_response_stats(full_logits, [s.tokens for s in samples], TOTALS, RESPONSES, 1.0)
    gen = torch.Generator().manual_seed(seed + 2)
    out = []
    for sample, lp in zip(samples, current):
        old = lp + 0.5 * torch.randn(len(lp), generator=gen, dtype=torch.float64)
        noise = torch.randn(2, len(lp), generator=gen, dtype=torch.float64)
        out.append(sample._replace(log_probs=old.float(), rollout_log_probs=(old + 0.2 * noise[0]).float(),
                                   ref_log_probs=(old + 0.3 * noise[1]).float()))  # fmt: skip
    return out


def _batch(samples, info, dtype):
    """slime's micro-batch for the rank, per-token inputs in `dtype`, mask totals as tensors (as
    slime's train actor hands `rollout_mask_sums`)."""
    batch = micro_batch(samples, info.cp_rank, info.cp_size)
    batch["rollout_mask_sums"] = [torch.tensor(total) for total in batch["rollout_mask_sums"]]
    for key in ("advantages", "log_probs", "ref_log_probs", "rollout_log_probs"):
        batch[key] = [x.to(dtype) for x in batch[key]]
    return batch


def _slime_loss(args, batch, logits):
    """slime's `loss_function` on one micro-batch: (scaled loss, {metric: value}, logits gradient)."""
    from slime.backends.megatron_utils import loss as slime_loss

    logits = logits.detach().requires_grad_()
    value, _, log = slime_loss.loss_function(args, batch, SCALING["num_microbatches"], SCALING["step_global_batch_size"], logits)
    value.backward()
    return value.detach(), dict(zip(log["keys"], log["values"][1:])), logits.grad


def rank_cases(info, cases):
    """On this rank, per case: (truth, fusedrl), each (loss, metrics, logits gradient)."""
    upstream_slime.load()
    results = {}
    for name, (seed, overrides) in cases.items():
        full_logits = make_logits(seed, TOTALS, VOCAB)
        samples = near_policy_samples(seed, full_logits)
        logits = rank_logits(full_logits, info, pad_multiple=PAD, fill=0.0)  # float32, as slime asserts
        truth_args = slime_args(loss_type="policy_loss", **overrides)
        with Float64LogProbs(), torch._dynamo.config.patch(disable=True):
            truth = _slime_loss(truth_args, _batch(samples, info, torch.float64), logits)
        fused = _slime_loss(slime_args(**overrides), _batch(samples, info, torch.float32), logits)
        results[name] = (truth, fused)
    return info, results


@pytest.mark.parametrize("tp,cp", LAYOUTS)
def test_corrections_match_slime(tp, cp):
    cases = {name: (31 + 7 * i + tp + 2 * cp, overrides) for i, (name, overrides) in enumerate(CASES.items())}
    for info, results in get_pool(tp, cp).run(rank_cases, cases):
        for name, ((loss, metrics, grad), (f_loss, f_metrics, f_grad)) in results.items():
            where = f"{name} tp{tp} cp{cp} rank {info.rank}"
            assert_parity(f_loss, loss, TOLERANCE, f"{where}: loss", floor=SIGNED_SUMS["loss"])
            assert set(f_metrics) == set(metrics), (where, set(f_metrics) ^ set(metrics))
            for key, value in metrics.items():
                assert_parity(f_metrics[key], value, TOLERANCE, f"{where}: {key}", floor={**LOG_PROB_DIFFERENCES, **SIGNED_SUMS}.get(key, FLOOR))
            assert_parity(f_grad, grad, TOLERANCE, f"{where}: logits gradient")
