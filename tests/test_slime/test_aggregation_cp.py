"""Context parallel: for every mode, the per-rank aggregates of slime's zigzag slices (cp = 2, 3,
real megatron-core parallel_state on a gloo group) sum to the cp = 1 value, gradients included."""

import pytest
import torch
from aggregation_step import PARTITIONS, WHOLE, aggregate_with_grad, get_batch, local_pg_loss, make_step
from distributed import get_pool

from fusedrl.slime_ext import aggregation
from fusedrl.slime_ext.flags.aggregation import MODES

CASES = [(mode, False) for mode in MODES] + [("prompt_mean", True)]
TOL = 1e-12


def diagnostics(step, partition, cp_rank=0, cp_size=1):
    """reduce_diagnostics of three channels, summed over the partition's micro-batches."""
    return sum(
        aggregation.reduce_diagnostics(
            step.args,
            get_batch(step, mb, cp_rank, cp_size),
            torch.stack([local_pg_loss(step, mb, step.pg_loss, cp_rank, cp_size) * k for k in (1.0, 3.0, -0.5)], 1),
        )
        for mb in partition
    )


def rank_results(info, partition):
    """On one cp rank: per case, the summed aggregate over the partition, its gradient with respect
    to the full per-sample pg_loss (zero off the rank's positions), and the diagnostics."""
    results = []
    for mode, strict in CASES:
        step = make_step(mode, strict)
        pg_loss = [pg.clone().requires_grad_() for pg in step.pg_loss]
        total = sum(
            aggregation.aggregate_pg_loss(
                step.args,
                get_batch(step, mb, info.cp_rank, info.cp_size),
                local_pg_loss(step, mb, pg_loss, info.cp_rank, info.cp_size),
            )
            for mb in partition
        )
        grad = torch.cat(torch.autograd.grad(total, pg_loss))
        results.append((total.detach(), grad, diagnostics(step, partition, info.cp_rank, info.cp_size)))
    return results


@pytest.mark.parametrize("cp_size", [2, 3])
def test_sum_over_cp_ranks_equals_cp1(cp_size):
    partition = PARTITIONS["micro_batches"]
    per_rank = get_pool(cp=cp_size).run(rank_results, partition)
    for case, (mode, strict) in enumerate(CASES):
        step = make_step(mode, strict)
        whole, whole_grad = aggregate_with_grad(step, WHOLE, step.args)
        total = sum(rank[case][0] for rank in per_rank)
        grad = sum(rank[case][1] for rank in per_rank)
        assert abs((total - whole).item()) <= TOL * abs(whole.item()), (mode, strict)
        assert torch.allclose(grad, whole_grad, rtol=TOL, atol=0), (mode, strict)
        expected_diagnostics = diagnostics(step, WHOLE)
        assert torch.allclose(sum(rank[case][2] for rank in per_rank), expected_diagnostics, rtol=TOL, atol=0)
