"""The rollout side of prompt_mean (group denominators at step level) and the carry to the loss."""

from types import SimpleNamespace

import pytest
import torch

from fusedrl.slime_ext import carry
from fusedrl.slime_ext.rollout import prompt_groups

KEY = carry.PROMPT_DENOMINATOR_KEY


def sample(index, group, mask, rollout_id=None, removed=False, inputs=None):
    return SimpleNamespace(
        index=index,
        group_index=group,
        rollout_id=rollout_id,
        response_length=len(mask) if mask is not None else 4,
        loss_mask=mask,
        remove_sample=removed,
        multimodal_train_inputs=inputs,
    )


class TrainOutput(SimpleNamespace):
    """slime's RolloutFnTrainOutput(samples, metrics)."""


CALLS = []


def inner_rollout(args, rollout_id, data_source, evaluation=False):
    """Stand-in for the configured rollout function: returns whatever the test put in data_source."""
    CALLS.append((rollout_id, evaluation))
    return data_source


def wrapper_args(mode="prompt_mean", strict=False, global_batch_size=5):
    """slime's args as the wrapper reads them; uneven_groups() holds 5 rollouts (one step by default)."""
    return SimpleNamespace(
        loss_aggregation=mode,
        loss_aggregation_strict_prompt_scale=strict,
        loss_aggregation_inner_rollout_function_path=f"{__name__}.inner_rollout",
        global_batch_size=global_batch_size,
        rollout_batch_size=3,
        n_samples_per_prompt=2,
        num_steps_per_rollout=None,
    )


def denominators(samples):
    return [float(s.multimodal_train_inputs[KEY]) for s in samples]


def uneven_groups():
    """Groups of 3, 2 and 1 samples; group 1 fully masked; samples 3 and 4 one compact rollout;
    sample 2 removed by a filter (counts nothing) and sample 5 without a mask (counts all 4)."""
    return [
        [sample(0, 7, [1, 1, 0, 1]), sample(1, 7, [1, 0]), sample(2, 7, [1, 1, 1], removed=True)],
        [sample(3, 8, [0, 0], rollout_id=9), sample(4, 8, [0, 0, 0], rollout_id=9)],
        [sample(5, 3, None, inputs={"pixel_values": torch.ones(2, 3)})],
    ]


def flat(groups):
    return [s for group in groups for s in group]


@pytest.mark.parametrize("wrap", [lambda groups: groups, lambda groups: TrainOutput(samples=groups, metrics={})])
def test_group_denominators_attached_to_every_training_sample(wrap):
    groups = uneven_groups()
    output = wrap(groups)
    assert prompt_groups.generate_rollout(wrapper_args(), 5, output) is output
    # group 7: 3 + 1 + 0 (removed); group 8: 0, clamped at 1; group 3: 4 (no mask = all tokens)
    assert denominators(flat(groups)) == [4.0, 4.0, 4.0, 1.0, 1.0, 4.0]
    assert torch.equal(flat(groups)[5].multimodal_train_inputs["pixel_values"], torch.ones(2, 3))  # kept
    assert CALLS[-1] == (5, False)


def test_strict_scale_multiplies_by_prompts_over_rollouts():
    groups = uneven_groups()
    prompt_groups.generate_rollout(wrapper_args(strict=True), 0, groups)
    # P = 3 groups, N = 5 rollouts (samples 3 and 4 are one)
    assert denominators(flat(groups)) == pytest.approx([4 * 3 / 5] * 3 + [3 / 5] * 2 + [4 * 3 / 5], rel=1e-15)


def test_compact_rollouts_nested_deeper_are_found():
    groups = uneven_groups()
    nested = [[groups[0]], [groups[1], groups[2]]]
    prompt_groups.generate_rollout(wrapper_args(), 0, nested)
    assert denominators(flat(groups)) == [4.0, 4.0, 4.0, 1.0, 1.0, 4.0]


def test_sample_without_group_is_rejected():
    groups = uneven_groups()
    groups[1][1].group_index = None
    with pytest.raises(ValueError, match=r"prompt_mean needs Sample.group_index .* group_index=None for sample 4 of the rollout \(index=4\)"):
        prompt_groups.generate_rollout(wrapper_args(), 0, groups)


class NoGroup(SimpleNamespace):
    @property
    def group_index(self):
        raise AssertionError("group_index read outside prompt_mean")


@pytest.mark.parametrize("mode", ["sample_mean", "token_mean", "constant"])
def test_other_modes_pass_through_without_reading_groups(mode):
    samples = [NoGroup(index=0, loss_mask=[1], response_length=1, multimodal_train_inputs=None)]
    assert prompt_groups.generate_rollout(wrapper_args(mode), 0, [samples]) == [samples]
    assert samples[0].multimodal_train_inputs is None


def test_evaluation_passes_through_untouched():
    groups = uneven_groups()
    prompt_groups.generate_rollout(wrapper_args(), 2, groups, evaluation=True)
    assert CALLS[-1] == (2, True)
    assert all(s.multimodal_train_inputs is None or KEY not in s.multimodal_train_inputs for s in flat(groups))


def test_later_rollouts_overwrite_stale_denominators():
    groups = uneven_groups()
    prompt_groups.generate_rollout(wrapper_args(), 0, groups)
    groups[0][0].loss_mask = [1, 1, 1, 1]
    prompt_groups.generate_rollout(wrapper_args(), 1, groups)
    assert denominators(groups[0]) == [5.0, 5.0, 5.0]


# ----------------------------------------------------------------------------- carry


def test_attach_rejects_foreign_keys_and_non_tensors():
    s = sample(0, 0, [1])
    with pytest.raises(ValueError, match=r"carried keys must be strings starting with 'fusedrl_', got 'pixel_values'"):
        carry.attach(s, "pixel_values", torch.ones(1))
    with pytest.raises(ValueError, match=r"carried values must be torch.Tensor, got float for 'fusedrl_x'"):
        carry.attach(s, "fusedrl_x", 1.0)


def carried_batch(per_sample=None, per_token=None, other=None):
    """A micro-batch of two samples (total 7 and 9 tokens, responses 3 and 5) as get_batch leaves it."""
    inputs = dict(other or {})
    if per_sample is not None:
        inputs["fusedrl_s"] = per_sample
    if per_token is not None:
        inputs["fusedrl_t"] = per_token
    return {"total_lengths": [7, 9], "response_lengths": [3, 5], "multimodal_train_inputs": inputs or None}


def test_filter_moves_only_the_packages_keys():
    pixels = torch.ones(4, 2)
    get_batch = carry.without_carried_inputs(lambda: carried_batch(torch.ones(2), other={"pixel_values": pixels}))
    batch = get_batch()
    assert list(batch["multimodal_train_inputs"]) == ["pixel_values"]
    assert list(batch[carry.CARRIED_KEY]) == ["fusedrl_s"]
    assert carry.without_carried_inputs(get_batch) is get_batch  # installing twice is harmless


def test_filter_leaves_batches_without_carried_keys_alone():
    plain = carried_batch(other={"pixel_values": torch.ones(1)})
    batch = carry.without_carried_inputs(lambda: plain)()
    assert carry.CARRIED_KEY not in batch and list(batch["multimodal_train_inputs"]) == ["pixel_values"]


@pytest.mark.parametrize("filtered", [True, False])
def test_readers_split_per_sample_and_per_token(filtered):
    values = torch.arange(8.0)
    build = lambda: carried_batch(torch.tensor([2.0, 3.0]), values)  # noqa: E731
    batch = carry.without_carried_inputs(build)() if filtered else build()
    assert torch.equal(carry.per_sample(batch, "fusedrl_s"), torch.tensor([2.0, 3.0]))
    whole = carry.per_token(batch, "fusedrl_t", cp_rank=0, cp_size=1)
    assert [t.tolist() for t in whole] == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0, 6.0, 7.0]]
    # cp = 2: sample 0 (7 tokens, chunks of 2): rank 1 holds rows [2, 4) -> positions 0, and [4, 6) -> 1, 2
    rank1 = carry.per_token(batch, "fusedrl_t", cp_rank=1, cp_size=2)
    assert rank1[0].tolist() == [0.0, 1.0, 2.0] and len(rank1[1]) + len(carry.per_token(batch, "fusedrl_t", 0, 2)[1]) == 5


def test_readers_reject_missing_and_misaligned_tensors():
    batch = carried_batch(torch.ones(3), torch.ones(7))
    with pytest.raises(ValueError, match=r"carried 'fusedrl_s' must have one row per sample \(2\), got shape \(3,\)"):
        carry.per_sample(batch, "fusedrl_s")
    with pytest.raises(ValueError, match=r"carried 'fusedrl_t' must have one row per response token \(8\), got shape \(7,\)"):
        carry.per_token(batch, "fusedrl_t", 0, 1)
    with pytest.raises(ValueError, match=r"the micro-batch carries no 'fusedrl_missing' \(carried keys: \['fusedrl_s', 'fusedrl_t'\]\)"):
        carry.per_sample(batch, "fusedrl_missing")


def test_group_cut_between_two_steps_is_refused_naming_group_and_batch_settings():
    """At 2 rollouts per step, group 7's rollouts 0, 1 train in step 0 and rollout 2 in step 1."""
    with pytest.raises(ValueError, match=r"prompt group 7 \(Sample.group_index\) lies across step 0, step 1 of the rollout.*"
                       r"--global-batch-size 2 rollouts .*--rollout-batch-size 3 x --n-samples-per-prompt 2, --num-steps-per-rollout None"):
        prompt_groups.generate_rollout(wrapper_args(global_batch_size=2), 0, uneven_groups())


def test_group_cut_between_a_step_and_the_dropped_remainder_is_refused():
    """Five single-sample rollouts (groups 7, 7, 8, 8, 3) at 3 per step: step 0 holds samples 0, 1
    and 3, samples 4 and 5 are dropped, so group 8 is cut between step 0 and the remainder."""
    groups = uneven_groups()
    groups[0].pop()
    for member in groups[1]:
        member.rollout_id = None
    with pytest.raises(ValueError, match=r"prompt group 8 .* lies across step 0, the dropped remainder"):
        prompt_groups.generate_rollout(wrapper_args(global_batch_size=3), 0, groups)


def test_whole_groups_in_several_steps_get_their_own_step_denominators_and_scale():
    """At 4 rollouts per step: step 0 = groups 7 and 8 (rollouts 0-3), group 3's rollout 4 is the
    dropped remainder (whole, so accepted). Strict scale per step: P/N = 2/4 in step 0, 1/1 when dropped."""
    groups = uneven_groups()
    prompt_groups.generate_rollout(wrapper_args(strict=True, global_batch_size=4), 0, groups)
    assert denominators(flat(groups)) == pytest.approx([4 * 2 / 4] * 3 + [2 / 4] * 2 + [4.0], rel=1e-15)


def test_training_steps_follow_first_appearance_of_each_rollout():
    samples = [sample(i, 0, [1], rollout_id=rid) for i, rid in enumerate([5, None, 5, 2, None, 2, 7])]
    # rollouts in order: 5, (1), 2, (4), 7 -> steps of 2: [5, (1)], [2, (4)], 7 dropped
    assert prompt_groups.training_steps(samples, 2) == [0, 0, 0, 1, 1, 1, None]
    with pytest.raises(ValueError, match=r"--global-batch-size must be an integer >= 1, got 0"):
        prompt_groups.training_steps(samples, 0)
