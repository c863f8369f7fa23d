"""--loss-aggregation prompt_mean on slime's rollout side: per-prompt-group denominators.

The group denominators need every sample of the step, which only the rollout side sees. slime's
default conversion (`RolloutManager._convert_samples_to_train_data`) is a method of the rollout
actor, and --custom-convert-samples-to-train-data-path replaces it wholesale, so a converter cannot
add to it without re-implementing it; the rollout function, in contrast, is a plain dotted path
whose output (every sample of the rollout, after dynamic filtering) is converted as is. So
`generate_rollout` wraps the configured rollout function: it calls it, then attaches each sample's
denominator to `Sample.multimodal_train_inputs` (`carry`); the aggregation flag checks
(`flags/aggregation.py`) install it in place of --rollout-function-path under prompt_mean only.
Other modes never read `group_index` and add nothing.

Several steps per rollout (--num-steps-per-rollout). slime's DP schedule
(`slime/utils/dp_schedule.py: build_dp_schedule`) cuts the rollout into training steps before it
packs micro-batches or balances ranks: rollouts (samples sharing a `rollout_id`; a sample without
one is a rollout of its own) in order of first appearance, --global-batch-size rollouts per step,
a trailing remainder dropped. `training_steps` follows that cut (tests/test_slime/test_upstream_slime_train.py
checks it against slime's own function). A prompt group's denominator is its mask total, which is
the same over the step as over the rollout exactly when the whole group lies inside one step, so
`generate_rollout` refuses a group that spans two steps (or a step and the dropped remainder),
naming the group and the batch settings. Under the strict scale, N and P (rollouts and prompt
groups) are counted per step.
"""

from typing import Hashable, List, Optional, Sequence

import torch

from .. import carry
from ..callables import load_function


def generate_rollout(args, rollout_id, data_source, evaluation=False):
    """slime rollout function: the inner rollout function's output, with every training sample
    carrying its prompt_mean denominator (evaluation output and other modes pass through)."""
    inner = load_function(args.loss_aggregation_inner_rollout_function_path)
    output = inner(args, rollout_id, data_source, evaluation=evaluation)
    if not evaluation and args.loss_aggregation == "prompt_mean":
        samples = _leaf_samples(getattr(output, "samples", output))
        steps = training_steps(samples, args.global_batch_size)
        groups = _groups(samples)
        _check_groups_inside_steps(groups, steps, args)
        denominators = prompt_denominators(samples, steps, strict_scale=args.loss_aggregation_strict_prompt_scale)
        for sample, denominator in zip(samples, denominators, strict=True):
            carry.attach(sample, carry.PROMPT_DENOMINATOR_KEY, torch.tensor([denominator], dtype=torch.float64))
    return output


def _leaf_samples(node) -> list:
    """The samples of slime's nested rollout output (groups of samples, possibly nested deeper)."""
    if isinstance(node, (list, tuple)):
        return [sample for child in node for sample in _leaf_samples(child)]
    return [node]


def _rollout_keys(samples) -> List[Hashable]:
    """slime's rollout of each sample: its `rollout_id`, or the sample alone when that is None."""
    return [("sample", position) if sample.rollout_id is None else ("rollout", sample.rollout_id)
            for position, sample in enumerate(samples)]  # fmt: skip


def training_steps(samples, global_batch_size: int) -> List[Optional[int]]:
    """The training step slime trains each sample in (None: dropped): rollouts in order of first
    appearance, `global_batch_size` per step, the trailing remainder dropped."""
    if not isinstance(global_batch_size, int) or global_batch_size < 1:
        raise ValueError(f"--global-batch-size must be an integer >= 1, got {global_batch_size!r}")
    order = {}
    for key in _rollout_keys(samples):
        order.setdefault(key, len(order))
    num_steps = len(order) // global_batch_size
    steps = [order[key] // global_batch_size for key in _rollout_keys(samples)]
    return [step if step < num_steps else None for step in steps]


def _groups(samples) -> list:
    """Each sample's `group_index`; ValueError for a sample without one (treating it as a group of
    its own would quietly turn prompt_mean into another mode)."""
    for position, sample in enumerate(samples):
        if sample.group_index is None:
            raise ValueError(
                f"--loss-aggregation prompt_mean needs Sample.group_index on every sample, got "
                f"group_index=None for sample {position} of the rollout (index={sample.index})"
            )
    return [sample.group_index for sample in samples]


def _check_groups_inside_steps(groups: Sequence, steps: Sequence[Optional[int]], args) -> None:
    """Every prompt group lies inside one training step (or wholly in the dropped remainder)."""
    seen = {}
    for group, step in zip(groups, steps, strict=True):
        seen.setdefault(group, set()).add(step)
    for group, group_steps in seen.items():
        if len(group_steps) > 1:
            named = ", ".join("the dropped remainder" if step is None else f"step {step}" for step in
                              sorted(group_steps, key=lambda step: float("inf") if step is None else step))  # fmt: skip
            raise ValueError(
                f"--loss-aggregation prompt_mean: prompt group {group!r} (Sample.group_index) lies across {named} of the "
                f"rollout, but its denominator must count the tokens of one step only. slime cuts each rollout into "
                f"steps of --global-batch-size {args.global_batch_size} rollouts in rollout order (--rollout-batch-size "
                f"{args.rollout_batch_size} x --n-samples-per-prompt {args.n_samples_per_prompt}, --num-steps-per-rollout "
                f"{getattr(args, 'num_steps_per_rollout', None)}) and drops a remainder short of a step: make every "
                "group's rollouts fill whole steps"
            )


def prompt_denominators(samples, steps: Optional[Sequence[Optional[int]]] = None, strict_scale: bool = False) -> List[float]:
    """Per sample, the mask total of its prompt group (`group_index`) within its training step
    (`steps`, default: one step), clamped at 1; times P / N of that step (prompt groups / rollouts)
    when `strict_scale`.

    Mask totals follow slime's conversion: a missing loss mask counts every response token and a
    removed sample (`remove_sample`) counts none. A sample without a group raises ValueError.
    """
    steps = [0] * len(samples) if steps is None else list(steps)
    keys = list(zip(steps, _groups(samples)))
    group_totals, step_rollouts, step_groups = {}, {}, {}
    for key, rollout, sample in zip(keys, _rollout_keys(samples), samples):
        group_totals[key] = group_totals.get(key, 0.0) + _mask_total(sample)
        step_rollouts.setdefault(key[0], set()).add(rollout)
        step_groups.setdefault(key[0], set()).add(key[1])
    scales = {step: len(step_groups[step]) / len(step_rollouts[step]) if strict_scale else 1.0 for step in step_groups}
    return [max(group_totals[key], 1.0) * scales[key[0]] for key in keys]


def _mask_total(sample) -> float:
    if getattr(sample, "remove_sample", False):
        return 0.0
    if sample.loss_mask is None:
        return float(sample.response_length)
    return float(torch.as_tensor(sample.loss_mask, dtype=torch.float64).sum())
