"""The uneven rollout step the aggregation tests share (cp = 1 in test_aggregation, cp > 1 in
test_aggregation_cp): six samples of different lengths, partly masked, one fully masked
(sample 1), in prompt groups of 3, 2 and 1 samples, two of them (3, 4) one compact rollout; the
rollout wrapper run on it, slime's micro-batches of it, and the aggregate over a partition."""

from types import SimpleNamespace

import torch
from slime_harness import make_samples, micro_batch, slice_per_token, slime_args

from fusedrl.slime_ext import aggregation, carry
from fusedrl.slime_ext.rollout import prompt_groups

TOTALS = [13, 9, 17, 11, 14, 20]
RESPONSES = [9, 6, 11, 5, 10, 14]
GROUPS = [0, 0, 0, 1, 1, 2]
ROLLOUT_IDS = [None, None, None, 40, 40, None]
DIVISOR = 16.0
NUM_ROLLOUTS = 5  # one training step: samples 3 and 4 are one rollout


def mode_args(mode, strict=False, **overrides):
    """slime args after the package's validation for `mode`."""
    return slime_args(
        loss_aggregation=mode,
        loss_aggregation_divisor=DIVISOR,
        loss_aggregation_strict_prompt_scale=strict,
        calculate_per_token_loss=mode == "token_mean",
        **overrides,
    )


def rollout_samples(samples):
    """The step's samples as slime's rollout side holds them (Sample fields the package reads)."""
    return [
        SimpleNamespace(
            index=i,
            group_index=group,
            rollout_id=rid,
            response_length=s.response_length,
            loss_mask=s.loss_mask.tolist(),
            remove_sample=False,
            multimodal_train_inputs=None,
        )
        for i, (s, group, rid) in enumerate(zip(samples, GROUPS, ROLLOUT_IDS))
    ]


def inner_rollout(args, rollout_id, data_source, evaluation=False):
    """Stand-in for slime's rollout function: the step's samples, grouped per prompt."""
    samples = data_source
    return [[s for s in samples if s.group_index == g] for g in sorted(set(GROUPS))]


def rollout_mask_sums(samples):
    """slime's conversion: per sample, the mask total of its rollout (None rollout id = own)."""
    totals = {}
    keys = [rid if rid is not None else ("own", i) for i, rid in enumerate(ROLLOUT_IDS)]
    for key, s in zip(keys, samples):
        totals[key] = totals.get(key, 0.0) + float(s.loss_mask.sum())
    return [totals[key] for key in keys]


class Step(SimpleNamespace):
    """A rollout step: slime samples, their rollout-side twins after the rollout wrapper, the
    per-token pg_loss (float64, full response per sample) and the mode's args."""


def make_step(mode, strict=False, seed=0):
    samples = make_samples(seed, TOTALS, RESPONSES, vocab=11)
    args = mode_args(
        mode, strict, loss_aggregation_inner_rollout_function_path=f"{__name__}.inner_rollout", global_batch_size=NUM_ROLLOUTS
    )
    rollout = rollout_samples(samples)
    prompt_groups.generate_rollout(args, 0, rollout)
    gen = torch.Generator().manual_seed(seed + 100)
    pg_loss = [torch.randn(r, generator=gen, dtype=torch.float64) for r in RESPONSES]
    return Step(samples=samples, rollout=rollout, pg_loss=pg_loss, args=args, mask_sums=rollout_mask_sums(samples))


def slime_get_batch(step, indices, cp_rank=0, cp_size=1):
    """slime's micro-batch for `indices`, multimodal_train_inputs concatenated key by key along
    dim 0 over the samples that have them (slime's `get_batch`)."""
    batch = micro_batch([step.samples[i] for i in indices], cp_rank, cp_size, [step.mask_sums[i] for i in indices])
    dicts = [step.rollout[i].multimodal_train_inputs for i in indices]
    dicts = [d for d in dicts if d is not None]
    if dicts:
        batch["multimodal_train_inputs"] = {key: torch.cat([d[key] for d in dicts]) for key in dicts[0]}
    return batch


get_batch = carry.without_carried_inputs(slime_get_batch)  # as the init hook installs it


def local_pg_loss(step, indices, pg_loss, cp_rank=0, cp_size=1):
    parts = [slice_per_token(pg_loss[i], TOTALS[i], RESPONSES[i], cp_rank, cp_size) for i in indices]
    return torch.cat(parts)


def aggregate_with_grad(step, partition, mode_args_):
    """Sum over the micro-batches of `partition` of aggregate_pg_loss, and d/d(pg_loss)."""
    pg_loss = [pg.clone().requires_grad_() for pg in step.pg_loss]
    total = sum(
        aggregation.aggregate_pg_loss(mode_args_, get_batch(step, mb), local_pg_loss(step, mb, pg_loss))
        for mb in partition
    )
    grads = torch.autograd.grad(total, pg_loss)
    return total, torch.cat(grads)


WHOLE = [[0, 1, 2, 3, 4, 5]]


PARTITIONS = {
    "micro_batches": [[0, 3], [5, 1, 2], [4]],
    "dp_ranks": [[5, 0], [4], [2], [3, 1]],  # rank 0: mbs [5, 0], [4]; rank 1: [2], [3, 1]
}
