"""The one-pass fused LM head (`slime_ext/one_pass.py`) against the unfused output layer, on gloo
workers with megatron-core's parallel_state and a real megatron-core `ColumnParallelLinear`.

Per rank the same packed hidden states go through the layer twice: as megatron-core computes it
(logits `[1, T, V/tp]`, the package's loss on `token_stats`, gradients by autograd) and handed off
(hidden states, the loss on `linear_token_loss`, gradient made in the forward). Loss, every
metric, and the gradients of the layer's input and of the output weight agree within 1e-5 (fp32)
for the policy loss (PPO with dual clip, CISPO, REINFORCE; entropy bonus; KL terms; every
--loss-aggregation mode; top-p replay) and the SFC loss (K = 8, carried centering weights), at tp
= 1, 2 x cp = 1, 2, sequence parallel on and off, untied and tied, and on a cp rank that holds no
response token. Each rank also reports which path its log named: one-pass, or the recompute path
under allgather context parallelism and for the corrections that need the whole micro-batch
(slime's GSPO, OPSM, a TIS function; M2PO's trust region).
"""

import pytest
import torch
from distributed import get_pool
from numerics import assert_parity
from slime_harness import PAD, RESPONSES, SCALING, TOTALS, Scaling, make_samples, micro_batch, pack_rows, slime_args
from slime_harness import slime_loss_function, top_p_replay
from test_sfc_loss import PUSHES, STEPS_STARTED, carried_batch, make_draws, sfc_args
from test_slime_fused_lm_head import _on_cpu_megatron, _output_layer

HIDDEN = 16
VOCAB = 40
SEED = 13
POLICY = "fusedrl.slime_ext.losses.policy_loss"
SFC = "fusedrl.slime_ext.losses.sfc_loss"


def _batch(info, case, samples, extras):
    """The rank's micro-batch for the case: slime's keys, plus the carried SFC draws, centering
    weights and prompt_mean denominators, or the top-p replay data."""
    from fusedrl.slime_ext import carry

    if case["loss"] == SFC:
        draws, versions, weights = extras
        batch = carried_batch(samples, draws, versions, info.cp_rank, info.cp_size)
        batch["multimodal_train_inputs"][carry.SFC_DRAW_WEIGHTS_KEY] = torch.cat(weights)
        return batch
    batch = micro_batch(samples, info.cp_rank, info.cp_size)
    if case["args"].get("loss_aggregation") == "prompt_mean":
        denominators = torch.tensor([3.0, 1.0, 11.0, 1.0, 6.0][: len(samples)], dtype=torch.float64)
        batch["multimodal_train_inputs"] = {carry.PROMPT_DENOMINATOR_KEY: denominators}
    if extras is not None:
        batch["rollout_top_p_token_ids"], batch["rollout_top_p_token_offsets"] = extras
    return batch


def _args(case):
    if case["loss"] == SFC:
        return sfc_args(8, case["agg"], rollout_temperature=0.8, allgather_cp=case["allgather"])
    overrides = dict(case["args"])
    if overrides.get("loss_aggregation") == "token_mean":
        overrides["calculate_per_token_loss"] = True
    return slime_args(allgather_cp=case["allgather"], loss_aggregation_divisor=7.0, **overrides)


def _run_once(info, layer, weight, x, args, batch, loss_fn, fused):
    from fusedrl.slime_ext import lm_head

    x = x.clone().requires_grad_()
    if fused:
        lm_head.hand_off(layer)
    try:
        out, _ = layer(x, weight=weight)
        output = out.transpose(0, 1).contiguous()
        scaling = Scaling(dp_cp_size=info.cp_size * info.dp_size, cp_size=info.cp_size, **SCALING)
        loss, metrics = slime_loss_function(args, batch, output, loss_fn, info.cp_rank, scaling)
        loss.backward()
    finally:
        lm_head.restore()
    weight = layer.weight if weight is None else weight
    grad_weight = weight.grad.clone()
    weight.grad = None
    return loss, metrics, x.grad, grad_weight


def _rank_paths(info, case, full_hidden, full_weight, samples, extras):
    """Per embedding mode (untied, tied): unfused and fused results, and the paths logged."""
    from fusedrl.slime_ext import lm_head
    from fusedrl.slime_ext.age import CLOCK
    from fusedrl.slime_ext.callables import load_function

    _on_cpu_megatron()
    saved = CLOCK.push_steps, CLOCK.steps_started
    CLOCK.push_steps, CLOCK.steps_started = dict(PUSHES), STEPS_STARTED
    lm_head._LOGGED.clear()
    try:
        args = _args(case)
        batch = _batch(info, case, samples, extras)
        hidden = pack_rows(full_hidden, info.cp_rank, info.cp_size, allgather_cp=case["allgather"], pad_multiple=PAD)
        x = hidden.float().unsqueeze(1)
        if case["sp"]:
            x = x.chunk(info.tp_size)[info.tp_rank]
        shard = full_weight.float().chunk(info.tp_size)[info.tp_rank]
        loss_fn = load_function(case["loss"])
        results = {}
        for tied in (False, True):
            layer = _output_layer(info.tp_size, case["sp"], tied)
            weight = torch.nn.Parameter(shard.clone()) if tied else None
            if not tied:
                layer.weight.data.copy_(shard)
            results[tied] = [_run_once(info, layer, weight, x, args, batch, loss_fn, fused) for fused in (False, True)]
        return results, sorted(path for path in lm_head._LOGGED if path[0] != "log-probs")
    finally:
        CLOCK.push_steps, CLOCK.steps_started = saved


def _policy(tp, cp, sp=False, allgather=False, top_p=False, lengths=None, path=None, **args):
    return dict(loss=POLICY, tp=tp, cp=cp, sp=sp, allgather=allgather, top_p=top_p, lengths=lengths, args=args, path=path)


def _sfc(tp, cp, agg, sp=False, allgather=False):
    return dict(loss=SFC, tp=tp, cp=cp, sp=sp, allgather=allgather, top_p=False, lengths=None, agg=agg, args={})


KL = dict(use_kl_loss=True, kl_loss_coef=0.1)
CASES = {
    "ppo_dual_clip_entropy_kl_sample_mean": _policy(
        1, 1, eps_clip_c=3.0, entropy_coef=0.01, kl_loss_type="low_var_kl", use_unbiased_kl=True, **KL
    ),
    "cispo_token_mean_top_p_tp2_sp": _policy(
        2, 1, sp=True, top_p=True, advantage_estimator="cispo", eps_clip_high=0.28, loss_aggregation="token_mean",
        rollout_top_p=0.9,
    ),
    "reinforce_constant_rollout_logprobs_cp2": _policy(
        1, 2, pg_loss_type="reinforce", loss_aggregation="constant", use_rollout_logprobs=True, entropy_coef=0.02
    ),
    "ppo_prompt_mean_k3_top_p_tp2_cp2": _policy(
        2, 2, top_p=True, loss_aggregation="prompt_mean", kl_loss_type="k3", rollout_top_p=0.9, rollout_temperature=0.7,
        **KL,
    ),
    "ppo_kl_metric_only_tp2_cp2_sp": _policy(2, 2, sp=True, use_kl_loss=True, kl_loss_coef=0.0, kl_loss_type="k2"),
    "empty_cp_rank": _policy(1, 2, lengths=([4, 4, 4], [1, 1, 1]), entropy_coef=0.01, **KL),
    "allgather_cp2_recompute_path": _policy(1, 2, allgather=True, entropy_coef=0.01, **KL),
    # slime's corrections need the whole micro-batch's log-probs first: the recompute path serves them
    "gspo_opsm_tis_rejection_tp2_cp2_recompute_path": _policy(
        2, 2, path="recompute path (--advantage-estimator gspo", advantage_estimator="gspo", use_opsm=True,
        opsm_delta=3.0, use_tis=True, custom_tis_function_path="slime_harness.reject_outside_tis_band", tis_clip=1.05,
        tis_clip_low=0.95, entropy_coef=0.01,
    ),
    # so does M2PO's trust region, a selection over the whole micro-batch
    "m2po_cp2_recompute_path": _policy(1, 2, path="recompute path (--fusedrl-m2po-tau", fusedrl_m2po_tau=0.5, entropy_coef=0.01),
    "sfc_k8_sample_mean": _sfc(1, 1, "sample-mean"),
    "sfc_k8_token_mean_tp2_cp2_sp": _sfc(2, 2, "token-mean", sp=True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_one_pass_matches_the_unfused_output_layer(name):
    case = CASES[name]
    totals, responses = case["lengths"] or (TOTALS, RESPONSES)
    gen = torch.Generator().manual_seed(SEED)
    full_hidden = [torch.randn(total, HIDDEN, generator=gen, dtype=torch.float64) for total in totals]
    full_weight = torch.randn(VOCAB, HIDDEN, generator=gen, dtype=torch.float64) * 0.5
    samples = make_samples(SEED, totals, responses, VOCAB)
    extras = top_p_replay(SEED, responses, VOCAB) if case["top_p"] else None
    if case["loss"] == SFC:
        draws, versions = make_draws(SEED, samples, 8)
        weights = [torch.softmax(torch.randn(r, 8, generator=gen), -1) for r in responses]
        extras = (draws, versions, weights)
    expected_path = case.get("path") or ("recompute path (allgather" if case["allgather"] else "one-pass path")
    loss_name = "sfc_loss" if case["loss"] == SFC else "policy_loss"
    gradient_mass = 0.0
    rank_results = get_pool(case["tp"], case["cp"]).run(_rank_paths, case, full_hidden, full_weight, samples, extras)
    for results, paths in rank_results:
        assert len(paths) == 1 and paths[0][0] == loss_name and expected_path in paths[0][1], paths
        for tied, (unfused, fused) in results.items():
            what = "tied" if tied else "untied"
            loss, metrics, grad_x, grad_w = fused
            assert_parity(loss, unfused[0], 1e-5, f"{what} loss")
            assert set(metrics) == set(unfused[1])
            for key, value in metrics.items():
                assert not value.requires_grad
                assert_parity(value, unfused[1][key], 1e-5, f"{what} {key}")
            assert bool(torch.isfinite(grad_x).all()) and bool(torch.isfinite(grad_w).all())
            gradient_mass += float(grad_w.abs().sum())
            assert_parity(grad_x, unfused[2], 1e-5, f"{what} hidden-state gradient")
            assert_parity(grad_w, unfused[3], 1e-5, f"{what} output-weight gradient")
    assert gradient_mass > 0
