"""The four --loss-aggregation modes on slime-like micro-batches (cp = 1; CP in test_aggregation_cp).

One uneven step is used throughout (`aggregation_step`). Each mode's value is checked against a
float64 hand computation from the step's definition, and the additive invariances (micro-batches,
data-parallel ranks) with gradients.
"""

import sys
import types
from types import SimpleNamespace

import pytest
import torch
from aggregation_step import (
    DIVISOR,
    GROUPS,
    PARTITIONS,
    ROLLOUT_IDS,
    WHOLE,
    aggregate_with_grad,
    get_batch,
    local_pg_loss,
    make_step,
    mode_args,
)
from slime_harness import Scaling, slime_loss_function
from slime_harness import sum_of_sample_mean as slime_sum_of_sample_mean

from fusedrl.slime_ext import aggregation, carry, micro_batch
from fusedrl.slime_ext.flags.aggregation import MODES, REDUCER_PATH
from fusedrl.slime_ext.callables import load_function

EXACT = 1e-12


def hand_value(step, mode, strict=False):
    """sum_s sum_i l * m / D_s from the step's definition, in float64 Python arithmetic."""
    masks = [s.loss_mask.tolist() for s in step.samples]
    sums = [sum(l * m for l, m in zip(pg.tolist(), mask)) for pg, mask in zip(step.pg_loss, masks)]
    rollout_key = [rid if rid is not None else ("own", i) for i, rid in enumerate(ROLLOUT_IDS)]
    rollout_total = {k: sum(sum(masks[j]) for j in range(6) if rollout_key[j] == k) for k in rollout_key}
    group_total = {g: sum(sum(masks[j]) for j in range(6) if GROUPS[j] == g) for g in GROUPS}
    rollouts, prompts = len(set(rollout_key)), len(set(GROUPS))
    value = 0.0
    for i, total in enumerate(sums):
        if mode == "sample_mean":
            value += total / max(rollout_total[rollout_key[i]], 1)
        elif mode == "prompt_mean":
            value += total / (max(group_total[GROUPS[i]], 1) * (prompts / rollouts if strict else 1.0))
        elif mode == "token_mean":
            value += total
        else:
            value += total / DIVISOR
    return value


@pytest.mark.parametrize("mode,strict", [(m, False) for m in MODES] + [("prompt_mean", True)])
def test_each_mode_matches_hand_computation(mode, strict):
    step = make_step(mode, strict)
    value, grad = aggregate_with_grad(step, WHOLE, step.args)
    hand = hand_value(step, mode, strict)
    assert value.dtype == torch.float64
    assert abs(value.item() - hand) <= EXACT * abs(hand)
    # d/dl_i = m_i / D_s: zero on masked tokens, including the fully masked sample
    masks = torch.cat([s.loss_mask for s in step.samples]).double()
    assert torch.all(grad[masks == 0] == 0)


def test_modes_give_different_numbers_on_the_fixture():
    values = [hand_value(make_step(mode), mode) for mode in MODES] + [hand_value(make_step("prompt_mean"), "prompt_mean", True)]
    assert len({round(v, 9) for v in values}) == len(values)


def test_sample_mean_is_slimes_default_formula():
    step = make_step("sample_mean")
    batch = get_batch(step, WHOLE[0])
    pg = local_pg_loss(step, WHOLE[0], step.pg_loss)
    ours = aggregation.aggregate_pg_loss(step.args, batch, pg)
    slime = slime_sum_of_sample_mean(batch, 0, 1)(pg)
    assert abs(float(ours - slime)) <= EXACT * abs(float(slime))


def test_token_mean_is_slimes_per_token_path():
    step = make_step("token_mean")
    batch = get_batch(step, WHOLE[0])
    pg = local_pg_loss(step, WHOLE[0], step.pg_loss)
    ours = aggregation.aggregate_pg_loss(step.args, batch, pg)
    slime = slime_sum_of_sample_mean(batch, 0, 1, per_token=True)(pg)
    assert abs(float(ours - slime)) <= EXACT * abs(float(slime))


@pytest.mark.parametrize("partition", list(PARTITIONS))
@pytest.mark.parametrize("mode", MODES)
def test_partial_sums_add_up_to_the_step(mode, partition):
    step = make_step(mode, strict=mode == "prompt_mean")
    whole, whole_grad = aggregate_with_grad(step, WHOLE, step.args)
    parts, parts_grad = aggregate_with_grad(step, PARTITIONS[partition], step.args)
    assert abs((parts - whole).item()) <= EXACT * abs(whole.item())
    assert torch.allclose(parts_grad, whole_grad, rtol=EXACT, atol=0)


def effective_step_loss(step, ranks, mode):
    """What one optimizer step minimises, through slime's loss wrapper scaling and Megatron's
    reductions: per-sample modes average the scaled losses over micro-batches and data-parallel
    ranks; the per-token path divides their sum by the step's token count (the normaliser)."""
    args = step.args
    num_microbatches = len(ranks[0])
    scaling = Scaling(num_microbatches, step_global_batch_size=5, dp_cp_size=len(ranks), cp_size=1)
    total, tokens = 0.0, 0.0
    for rank in ranks:
        for mb in rank:
            batch = get_batch(step, mb)
            pg = local_pg_loss(step, mb, step.pg_loss)

            def loss_fn(args_, batch_, logits_, reducer_, pg=pg):
                return aggregation.aggregate_pg_loss(args_, batch_, pg), {}

            loss, _ = slime_loss_function(args, batch, None, loss_fn, 0, scaling)
            total += loss.item()
            tokens += sum(float(torch.clamp_min(m.sum(), 1)) for m in batch["loss_masks"])
    if args.calculate_per_token_loss:
        return total / tokens
    return total / (num_microbatches * len(ranks))


@pytest.mark.parametrize("mode", MODES)
def test_data_parallel_step_loss_equals_single_rank(mode):
    step = make_step(mode)
    single = effective_step_loss(step, [WHOLE], mode)
    split = effective_step_loss(step, [[[5, 0], [4]], [[2], [3, 1]]], mode)
    assert abs(split - single) <= EXACT * abs(single)


def test_diagnostics_keep_slimes_default_weights_in_one_pass():
    for mode in MODES:
        step = make_step(mode)
        batch = get_batch(step, [4, 0, 2])
        values = torch.stack([local_pg_loss(step, [4, 0, 2], step.pg_loss) * k for k in (1.0, -2.0, 0.5)], dim=1)
        reducer = slime_sum_of_sample_mean(batch, 0, 1, per_token=step.args.calculate_per_token_loss)
        expected = torch.stack([reducer(values[:, c]) for c in range(3)])
        assert torch.allclose(aggregation.reduce_diagnostics(step.args, batch, values), expected, rtol=EXACT, atol=0)


def test_carried_keys_never_reach_the_model_forward():
    step = make_step("prompt_mean")
    batch = get_batch(step, [1, 5])
    assert batch["multimodal_train_inputs"] is None  # slime's forward step splats nothing
    assert carry.PROMPT_DENOMINATOR_KEY in batch[carry.CARRIED_KEY]


def test_wrong_pg_loss_length_is_rejected():
    step = make_step("sample_mean")
    batch = get_batch(step, [0, 2])
    with pytest.raises(ValueError, match=r"values must have one row per CP-local response token \(20\), got shape \(19,\)"):
        aggregation.aggregate_pg_loss(step.args, batch, torch.zeros(19, dtype=torch.float64))


@pytest.fixture
def megatron_args(monkeypatch):
    """megatron.training.global_vars as slime's train actor leaves it (initialize.init -> set_args)."""
    holder = SimpleNamespace(args=None)
    global_vars = types.ModuleType("megatron.training.global_vars")
    global_vars.get_args = lambda: holder.args
    training = types.ModuleType("megatron.training")
    training.global_vars = global_vars
    monkeypatch.setitem(sys.modules, "megatron.training", training)
    monkeypatch.setitem(sys.modules, "megatron.training.global_vars", global_vars)
    return holder


@pytest.mark.parametrize("mode", ["token_mean", "constant"])
def test_slime_reducer_hook_matches_the_fused_loss(megatron_args, mode):
    step = make_step(mode)
    megatron_args.args = step.args
    indices = [3, 1, 5]
    batch = get_batch(step, indices)
    pg = local_pg_loss(step, indices, step.pg_loss)
    factory = load_function(REDUCER_PATH)
    reducer = factory(batch["total_lengths"], batch["response_lengths"], batch["loss_masks"], mode == "token_mean")
    expected = aggregation.aggregate_pg_loss(step.args, batch, pg)
    assert abs(float(reducer(pg) - expected)) <= EXACT * abs(float(expected))


@pytest.mark.parametrize("strict", [False, True])
def test_slime_reducer_hook_reads_prompt_denominators_from_the_published_micro_batch(megatron_args, strict):
    """prompt_mean through slime's reducer hook: the factory, called inside slime's policy loss as
    the init hook wraps it (`micro_batch.publishing`), weighs by the batch's carried group totals."""
    step = make_step("prompt_mean", strict=strict)
    megatron_args.args = step.args
    indices = [4, 0, 5]
    batch = get_batch(step, indices)
    pg = local_pg_loss(step, indices, step.pg_loss)

    def slime_policy_loss(args, batch, logits, sum_of_sample_mean):  # calls the hook as slime's does
        factory = load_function(args.custom_pg_loss_reducer_function_path)
        return factory(batch["total_lengths"], batch["response_lengths"], batch["loss_masks"], False)(pg)

    args = SimpleNamespace(**{**vars(step.args), "custom_pg_loss_reducer_function_path": REDUCER_PATH})
    wrapped = micro_batch.publishing(slime_policy_loss)
    got = wrapped(args, batch, None, None)
    expected = aggregation.aggregate_pg_loss(step.args, batch, pg)
    assert abs(float(got - expected)) <= EXACT * abs(float(expected))
    assert micro_batch.publishing(wrapped) is wrapped  # installing twice is harmless
    with pytest.raises(ValueError, match="needs the micro-batch slime's policy_loss_function is computing"):
        slime_policy_loss(args, batch, None, None)  # not wrapped: the init hook did not run


def test_slime_reducer_hook_refuses_sample_mean(megatron_args):
    megatron_args.args = mode_args("sample_mean")
    with pytest.raises(ValueError, match="--loss-aggregation sample_mean is slime's own pg_loss reducer"):
        aggregation.get_pg_loss_reducer([5], [3], [torch.ones(3)], False)


@pytest.mark.parametrize("mode,per_token", [("constant", True), ("token_mean", False)])
def test_slime_reducer_hook_checks_the_per_token_flag(megatron_args, mode, per_token):
    megatron_args.args = mode_args(mode)
    with pytest.raises(ValueError, match=f"--loss-aggregation {mode} got calculate_per_token_loss={per_token}"):
        aggregation.get_pg_loss_reducer([5], [3], [torch.ones(3)], per_token)
