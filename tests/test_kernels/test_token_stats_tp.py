"""Tensor parallelism on a CPU gloo group: every rank agrees with the unsplit computation.

Each rank holds a column shard of the same logits. Its logp, entropy and scores must equal the
tp = 1 result, its gradient must equal its column slice of the tp = 1 gradient, and the forward
must cost exactly one collective and the backward none. The ranks run on CPU, in the Triton
interpreter, whatever FUSEDRL_TEST_DEVICE says (gloo has no CUDA collectives); the unsplit run
they are compared with runs on the `device` fixture's device.
"""

import pytest
import torch
import torch.distributed as dist
from distributed import run_on_ranks
from numerics import rel_err
from token_stats_cases import CollectiveCounter, loss_of, make_ids, random_logits, run_with_grad

from fusedrl.kernels import token_stats, token_stats_reference


def shard_worker(rank, world_size, logits, ids, rows, grads, kwargs, use_megatron):
    """This rank's outputs, gradient shard and collective counts for its column shard."""
    width = logits.shape[1] // world_size
    shard = logits[:, rank * width : (rank + 1) * width].clone().requires_grad_(True)
    group = dist.group.WORLD
    if use_megatron:
        from megatron.core import parallel_state

        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
        group = None  # token_stats must find megatron's tensor-parallel group by itself
    with CollectiveCounter() as forward:
        stats = token_stats(shard, ids, tp_group=group, rows=rows, **kwargs)
    with CollectiveCounter() as backward:
        (grad,) = torch.autograd.grad(loss_of(stats, grads), shard)
    return [t.detach() if t is not None else None for t in stats], grad, forward.calls, backward.calls


TP_CASES = [
    # (world_size, vocab_local, num_ids, use rows, via megatron's parallel_state)
    (2, 1000, 9, False, False),
    (2, 37, 1, True, True),
    (4, 257, 9, True, False),
]


@pytest.mark.parametrize("world_size,vocab_local,num_ids,with_rows,use_megatron", TP_CASES)
def test_every_rank_matches_the_unsplit_result(world_size, vocab_local, num_ids, with_rows, use_megatron, device):
    gen = torch.Generator().manual_seed(world_size * vocab_local)
    vocab = world_size * vocab_local
    logits = random_logits(12, vocab, torch.float32, gen)
    rows = torch.tensor([0, 3, 4, 8, 11]) if with_rows else None
    ids = make_ids(12 if rows is None else rows.numel(), vocab, num_ids, gen)
    kwargs = dict(temperature=0.7, with_entropy=True)
    whole, grads, whole_grad = run_with_grad(token_stats, logits, ids, rows=rows, device=device, **kwargs)
    truth, _, truth_grad = run_with_grad(token_stats_reference, logits.double(), ids, grads, rows=rows, **kwargs)

    results = run_on_ranks(world_size, shard_worker, logits, ids, rows, grads, kwargs, use_megatron)
    for rank, (stats, grad, forward_calls, backward_calls) in enumerate(results):
        assert forward_calls == 1
        assert backward_calls == 0
        for out, unsplit, ref in zip(stats, whole, truth):
            assert rel_err(out, unsplit) < 1e-6
            assert rel_err(out, ref) < 1e-5
        columns = slice(rank * vocab_local, (rank + 1) * vocab_local)
        assert rel_err(grad, whole_grad[:, columns]) < 1e-6
        assert rel_err(grad, truth_grad[:, columns]) < 1e-5


def reference_worker(rank, world_size, logits, ids, grads):
    """The tp-aware reference on this rank's shard (its gradient is its slice of the full one)."""
    width = logits.shape[1] // world_size
    shard = logits[:, rank * width : (rank + 1) * width].double().requires_grad_(True)
    stats = token_stats_reference(shard, ids, tp_group=dist.group.WORLD, with_entropy=True)
    (grad,) = torch.autograd.grad(loss_of(stats, grads), shard)
    return [t.detach() for t in stats], grad


def test_tp_aware_reference_matches_the_unsplit_reference():
    gen = torch.Generator().manual_seed(1)
    logits = random_logits(6, 40, torch.float32, gen)
    ids = make_ids(6, 40, 3, gen)
    truth, grads, truth_grad = run_with_grad(token_stats_reference, logits.double(), ids, with_entropy=True)
    for rank, (stats, grad) in enumerate(run_on_ranks(2, reference_worker, logits, ids, grads)):
        for out, ref in zip(stats, truth):
            assert rel_err(out, ref) < 1e-12
        assert rel_err(grad, truth_grad[:, rank * 20 : (rank + 1) * 20]) < 1e-12
