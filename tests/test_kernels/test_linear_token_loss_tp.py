"""The one-pass LM-head loss under tensor parallelism, on a CPU gloo group of two ranks.

Each rank holds a vocabulary shard of the same weight. Its loss and statistics must equal the
tp = 1 float64 truth, its weight gradient (returned, or added to main_grad) its own slice of the
true one, and its hidden-state gradient this rank's partial sum (megatron-core's
`copy_to_tensor_model_parallel_region` turns the partials into the gradient on every rank). Each
chunk holds one collective of partials (the same count on every rank, an empty selection
included); the backward none of its own. The ranks run on CPU in the Triton interpreter, whatever
FUSEDRL_TEST_DEVICE says (gloo has no CUDA collectives).
"""

import pytest
import torch
from distributed import run_on_ranks
from lm_head_cases import (
    SeparableLoss, loss_with_grad, random_layer, rank_layer, truth_head, truth_loss_head, unfused_loss_head,
)  # fmt: skip
from numerics import rel_err
from token_stats_cases import CollectiveCounter, make_ids

from fusedrl.kernels import linear_token_loss

GRAD_SCALE = 0.25


def shard_worker(rank, world_size, hidden, weight, ids, row_loss, kwargs, through_megatron, into_main_grad):
    """This rank's loss, statistics, gradients (d weight from main_grad when asked) and collective counts."""
    leaf, layer_input, shard, group = rank_layer(rank, world_size, hidden, weight, through_megatron)
    main_grad = torch.zeros(shard.shape) if into_main_grad else None
    scale = GRAD_SCALE if into_main_grad else None
    with CollectiveCounter() as forward:
        result = linear_token_loss(layer_input, shard, ids, row_loss, tp_group=group, main_grad=main_grad,
                                   grad_scale=scale, **kwargs)  # fmt: skip
    with CollectiveCounter() as backward:
        (result.loss * GRAD_SCALE).backward()
    grad_weight = main_grad if into_main_grad else shard.grad
    return result.loss.detach(), result.stats, leaf.grad, grad_weight, shard.grad, forward.calls, backward.calls


TP_CASES = [
    # (vocab per rank, J, chunk_rows, rows, through megatron's region function, into main_grad)
    (500, 9, 5, None, False, False),
    (37, 1, 3, [0, 3, 4, 8, 11, 10, 1], True, True),
    (37, 2, 4, [], False, True),  # an empty selection: one empty chunk, one collective, on every rank
]


@pytest.mark.parametrize("vocab_local,num_ids,chunk_rows,rows,through_megatron,into_main_grad", TP_CASES)
def test_each_rank_gets_the_truth_its_weight_slice_and_a_partial_hidden_gradient(
    vocab_local, num_ids, chunk_rows, rows, through_megatron, into_main_grad
):
    world_size, num_rows, width = 2, 12, 24
    gen = torch.Generator().manual_seed(vocab_local + len(rows or ()))
    hidden, weight = random_layer(num_rows, width, world_size * vocab_local, torch.float32, gen)
    rows = None if rows is None else torch.tensor(rows, dtype=torch.long)
    selected = num_rows if rows is None else rows.numel()
    ids = make_ids(selected, world_size * vocab_local, num_ids, gen)
    kwargs = dict(temperature=0.7, with_entropy=True, rows=rows, chunk_rows=chunk_rows)
    row_loss = SeparableLoss(truth_head(hidden, weight, ids, **kwargs).logp, gen)
    truth_loss, truth_stats, (truth_hidden, truth_weight) = loss_with_grad(
        truth_loss_head, hidden, weight, ids, row_loss, **kwargs
    )
    truth_hidden, truth_weight = GRAD_SCALE * truth_hidden, GRAD_SCALE * truth_weight

    results = run_on_ranks(world_size, shard_worker, hidden, weight, ids, row_loss, kwargs, through_megatron,
                           into_main_grad)  # fmt: skip
    chunks = max(1, -(-selected // chunk_rows))
    partial_sum = torch.zeros_like(truth_hidden)
    for rank, (loss, stats, grad_hidden, grad_weight, shard_grad, forward_calls, backward_calls) in enumerate(results):
        assert forward_calls == chunks  # one all-gather of partials per chunk
        assert backward_calls == (1 if through_megatron else 0)  # megatron's all-reduce of dhidden
        assert rel_err(loss, truth_loss) < 1e-5
        for out, ref in zip(stats, truth_stats):
            assert rel_err(out, ref) < 1e-5
        rank_rows = slice(rank * vocab_local, (rank + 1) * vocab_local)
        assert rel_err(grad_weight, truth_weight[rank_rows]) < 1e-5
        assert (shard_grad is None) == into_main_grad
        if through_megatron:
            assert rel_err(grad_hidden, truth_hidden) < 1e-5
        else:
            partial_sum += grad_hidden.double()
    if not through_megatron:
        assert rel_err(partial_sum, truth_hidden) < 1e-5
        if selected:
            assert rel_err(results[0][2], truth_hidden) > 1e-2  # a partial sum, not the gradient


def test_the_vocabulary_walk_takes_one_collective_and_is_no_worse_than_the_unfused_path():
    """bf16 over several chunks whose fp32 weight-gradient sum would exceed the budget (0): every
    rank walks its own shard's vocabulary, with one collective of partials however many chunks;
    through megatron's region, its loss, statistics, weight slice and hidden-state gradient are no
    worse against float64 than the unfused path's at tp = 1."""
    world_size, num_rows, width, vocab_local = 2, 12, 64, 37
    gen = torch.Generator().manual_seed(12)
    hidden, weight = random_layer(num_rows, width, world_size * vocab_local, torch.bfloat16, gen, exact=True)
    ids = make_ids(num_rows, world_size * vocab_local, 2, gen)
    kwargs = dict(temperature=0.7, with_entropy=True, chunk_rows=4)
    row_loss = SeparableLoss(truth_head(hidden, weight, ids, **kwargs).logp, gen)
    truth, unfused = (loss_with_grad(head, hidden, weight, ids, row_loss, **kwargs)
                      for head in (truth_loss_head, unfused_loss_head))  # fmt: skip

    results = run_on_ranks(world_size, shard_worker, hidden, weight, ids, row_loss, dict(kwargs, weight_buffer_budget=0),
                           True, False)  # fmt: skip
    slack = 1e-6
    for rank, (loss, stats, grad_hidden, grad_weight, _, forward_calls, _) in enumerate(results):
        assert forward_calls == 1  # the walk: one all-gather of partials, not one per chunk
        assert rel_err(loss, truth[0]) <= rel_err(unfused[0], truth[0]) + slack
        for out, ref, base in zip(stats, truth[1], unfused[1]):
            assert rel_err(out, ref) <= rel_err(base, ref) + slack
        rank_rows = slice(rank * vocab_local, (rank + 1) * vocab_local)
        ref_weight, base_weight = (GRAD_SCALE * grads[1][rank_rows] for grads in (truth[2], unfused[2]))
        assert grad_weight.dtype == torch.bfloat16
        assert rel_err(grad_weight, ref_weight) <= rel_err(base_weight, ref_weight) * 1.05 + slack
        ref_hidden, base_hidden = (GRAD_SCALE * grads[0] for grads in (truth[2], unfused[2]))
        assert rel_err(grad_hidden, ref_hidden) <= rel_err(base_hidden, ref_hidden) * 1.05 + slack
