"""The fused LM head under tensor parallelism, on a CPU gloo group.

Each rank holds a vocabulary shard of the same weight. Its outputs must equal the float64 truth,
its weight gradient (returned, or added into main_grad) its own slice of the true one, and its
hidden-state gradient this rank's partial sum: the ranks' partials add up to the true gradient, and megatron-core's
`copy_to_tensor_model_parallel_region` (what ColumnParallelLinear does) turns them into it on
every rank. The forward costs exactly one collective whatever the number of chunks; the backward
none of its own. The ranks run on CPU, in the Triton interpreter, whatever FUSEDRL_TEST_DEVICE
says (gloo has no CUDA collectives); the float64 truth is computed on CPU.
"""

import pytest
import torch
from distributed import run_on_ranks
from numerics import rel_err
from lm_head_cases import head_with_grad, random_layer, rank_layer, truth_head
from token_stats_cases import CollectiveCounter, loss_of, make_ids

from fusedrl.kernels import linear_token_stats


def shard_worker(rank, world_size, hidden, weight, ids, grads, kwargs, through_megatron, into_main_grad):
    """This rank's outputs, gradients (d weight from main_grad when asked, the shard then getting
    none) and collective counts for its vocabulary shard."""
    leaf, layer_input, shard, group = rank_layer(rank, world_size, hidden, weight, through_megatron)
    main_grad = torch.zeros(shard.shape) if into_main_grad else None
    with CollectiveCounter() as forward:
        stats = linear_token_stats(layer_input, shard, ids, tp_group=group, main_grad=main_grad, **kwargs)
    with CollectiveCounter() as backward:
        grad_hidden, grad_weight = torch.autograd.grad(loss_of(stats, grads), [leaf, shard], allow_unused=True)
    outputs = [None if t is None else t.detach() for t in stats]
    assert (grad_weight is None) == into_main_grad
    return outputs, grad_hidden, main_grad if into_main_grad else grad_weight, forward.calls, backward.calls


TP_CASES = [
    # (vocab per rank, J, chunk_rows, rows, through megatron's region function, into main_grad)
    (1000, 9, 5, None, False, False),
    (37, 1, 3, [0, 3, 4, 8, 11, 10, 1], True, True),
]


@pytest.mark.parametrize("vocab_local,num_ids,chunk_rows,rows,through_megatron,into_main_grad", TP_CASES)
def test_each_rank_gets_the_truth_its_weight_slice_and_a_partial_hidden_gradient(
    vocab_local, num_ids, chunk_rows, rows, through_megatron, into_main_grad
):
    world_size, num_rows, width = 2, 12, 24
    gen = torch.Generator().manual_seed(vocab_local)
    hidden, weight = random_layer(num_rows, width, world_size * vocab_local, torch.float32, gen)
    rows = None if rows is None else torch.tensor(rows)
    ids = make_ids(num_rows if rows is None else rows.numel(), world_size * vocab_local, num_ids, gen)
    kwargs = dict(temperature=0.7, with_entropy=True, rows=rows, chunk_rows=chunk_rows)
    truth, grads, (truth_hidden, truth_weight) = head_with_grad(truth_head, hidden, weight, ids, **kwargs)

    results = run_on_ranks(world_size, shard_worker, hidden, weight, ids, grads, kwargs, through_megatron,
                           into_main_grad)  # fmt: skip
    partial_sum = torch.zeros_like(truth_hidden)
    for rank, (stats, grad_hidden, grad_weight, forward_calls, backward_calls) in enumerate(results):
        assert forward_calls == 1  # several chunks, one all-gather
        assert backward_calls == (1 if through_megatron else 0)  # megatron's all-reduce of dhidden
        for out, ref in zip(stats, truth):
            assert rel_err(out, ref) < 1e-5
        rank_rows = slice(rank * vocab_local, (rank + 1) * vocab_local)
        assert rel_err(grad_weight, truth_weight[rank_rows]) < 1e-5
        if through_megatron:
            assert rel_err(grad_hidden, truth_hidden) < 1e-5
        else:
            assert rel_err(grad_hidden, truth_hidden) > 1e-2  # a partial sum, not the gradient
            partial_sum += grad_hidden.double()
    if not through_megatron:
        assert rel_err(partial_sum, truth_hidden) < 1e-5
