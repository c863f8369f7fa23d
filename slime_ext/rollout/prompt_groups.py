"""--loss-aggregation prompt_mean on slime's rollout side: per-prompt-group denominators.

The group denominators need every sample of the step, which only the rollout side sees. slime's default conversion (`RolloutManager._convert_samples_to_train_data`)
is a method of the rollout actor, and --custom-convert-samples-to-train-data-path replaces it
wholesale, so a converter cannot add to it without re-implementing it; the rollout function, in
contrast, is a plain dotted path whose output (every sample of the step, after dynamic filtering)
is converted as is. So `generate_rollout` wraps the configured rollout function: it calls it,
then attaches each sample's denominator to `Sample.multimodal_train_inputs` (`carry`); the
aggregation flag checks (`flags/aggregation.py`) install it in place of --rollout-function-path
under prompt_mean only. Other modes never read `group_index` and add nothing.

N and P are counted over the samples one rollout call returns (N = distinct rollouts, P =
distinct prompt groups), which must be exactly one optimizer step: the startup checks refuse
several steps per rollout and --load-debug-rollout-data (slime then bypasses the rollout
function), and `generate_rollout` refuses an output of other than --global-batch-size rollouts
(slime's DP schedule would drop the surplus while its masks still counted in the denominators).
"""

from typing import List

import torch

from .. import carry
from ..hooks import load_function


def generate_rollout(args, rollout_id, data_source, evaluation=False):
    """slime rollout function: the inner rollout function's output, with every training sample
    carrying its prompt_mean denominator (evaluation output and other modes pass through)."""
    inner = load_function(args.loss_aggregation_inner_rollout_function_path)
    output = inner(args, rollout_id, data_source, evaluation=evaluation)
    if not evaluation and args.loss_aggregation == "prompt_mean":
        samples = _leaf_samples(getattr(output, "samples", output))
        _check_one_step(samples, getattr(args, "global_batch_size", None))
        denominators = prompt_denominators(samples, strict_scale=args.loss_aggregation_strict_prompt_scale)
        for sample, denominator in zip(samples, denominators, strict=True):
            carry.attach(sample, carry.PROMPT_DENOMINATOR_KEY, torch.tensor([denominator], dtype=torch.float64))
    return output


def _check_one_step(samples, global_batch_size) -> None:
    """The rollout's samples are exactly the one step slime's DP schedule trains, none dropped."""
    num_rollouts = _num_rollouts(samples)
    if global_batch_size is not None and num_rollouts != global_batch_size:
        raise ValueError(
            f"--loss-aggregation prompt_mean: the rollout function returned {num_rollouts} rollouts, but slime trains "
            f"one step of --global-batch-size {global_batch_size} rollouts per rollout call and drops the rest, "
            "whose loss masks would still count in their prompt groups' denominators"
        )


def _leaf_samples(node) -> list:
    """The samples of slime's nested rollout output (groups of samples, possibly nested deeper)."""
    if isinstance(node, (list, tuple)):
        return [sample for child in node for sample in _leaf_samples(child)]
    return [node]


def prompt_denominators(samples, strict_scale: bool = False) -> List[float]:
    """Per sample, the mask total of its prompt group (`group_index`) over the step, clamped at 1;
    times P / N (prompt groups / rollouts) when `strict_scale`.

    Mask totals follow slime's conversion: a missing loss mask counts every response token and a
    removed sample (`remove_sample`) counts none. A sample without a group raises ValueError:
    treating it as a group of its own would quietly turn prompt_mean into another mode.
    """
    groups = []
    for position, sample in enumerate(samples):
        if sample.group_index is None:
            raise ValueError(
                f"--loss-aggregation prompt_mean needs Sample.group_index on every sample, got "
                f"group_index=None for sample {position} of the step (index={sample.index})"
            )
        groups.append(sample.group_index)
    group_totals = {}
    for group, sample in zip(groups, samples):
        group_totals[group] = group_totals.get(group, 0.0) + _mask_total(sample)
    scale = len(group_totals) / _num_rollouts(samples) if strict_scale else 1.0
    return [max(group_totals[group], 1.0) * scale for group in groups]


def _mask_total(sample) -> float:
    if getattr(sample, "remove_sample", False):
        return 0.0
    if sample.loss_mask is None:
        return float(sample.response_length)
    return float(torch.as_tensor(sample.loss_mask, dtype=torch.float64).sum())


def _num_rollouts(samples) -> int:
    """slime's rollout count: samples sharing a `rollout_id` are one rollout, None is its own."""
    ids = [sample.rollout_id for sample in samples]
    return len({rid for rid in ids if rid is not None}) + sum(rid is None for rid in ids)
