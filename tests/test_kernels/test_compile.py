"""torch.compile: the ops are `torch.library` custom ops (namespace `fusedrl`), so a loss through
them compiles with `fullgraph=True`, no graph break, and gives eager's values and gradients.

The losses are PPO-clip on the sampled token's logp, aggregated per sample by `segment_sum`: one
from logits through `token_stats`, one from hidden states through `linear_token_stats`. Both are
also checked against a float64 eager truth. `opcheck` checks each op's schema, fake (meta)
implementation, autograd registration and AOT dispatch. Inputs live on the `device` fixture's
device (the Triton interpreter on CPU); the compiled part around the ops is inductor's code for that
device. The tensor-parallel test runs on a CPU gloo group (gloo has no CUDA collectives).
"""

import pytest
import torch
import torch.distributed as dist
from device import to_device
from distributed import run_on_ranks
from numerics import assert_parity

import fusedrl.kernels as kernels
from fusedrl.kernels import linear_token_stats, segment_sum, token_stats
from fusedrl.kernels.linear_token_stats import linear_token_stats_backward_op, linear_token_stats_op
from fusedrl.kernels.segment_sum import segment_sum_backward_op, segment_sum_op
from fusedrl.kernels.token_stats import token_stats_backward_op, token_stats_op

CLIP = 0.2
ENTROPY_COEF = 0.01


def ppo_loss(logp, entropy, batch):
    """Per-sample mean PPO-clip loss minus an entropy bonus, summed over samples."""
    ratio = torch.exp(logp[:, 0] - batch["old_logp"])
    clipped = torch.clamp(ratio, 1.0 - CLIP, 1.0 + CLIP)
    per_token = -torch.minimum(ratio * batch["advantages"], clipped * batch["advantages"])
    per_token = per_token - ENTROPY_COEF * entropy
    return batch["aggregate"](per_token)


def make_batch(num_rows, vocab, gen, device, num_segments=3):
    """Sampled ids (slot 0) plus a repeated draw, old log-probs, advantages, and the samples'
    segments with a masked token and an empty segment, on `device`; `aggregate` is the fused
    segmented mean."""
    ids = torch.randint(0, vocab, (num_rows, 2), generator=gen)
    ids[::3, 1] = ids[::3, 0]  # a draw equal to the sampled token
    segment_ids = torch.randint(0, num_segments, (num_rows,), generator=gen)
    segment_ids[segment_ids == num_segments - 1] = 0  # the last segment is empty
    mask = (torch.rand(num_rows, generator=gen) > 0.2).float()
    denominators = torch.bincount(segment_ids, minlength=num_segments).clamp_min(1).float()
    batch = to_device({
        "ids": ids,
        "old_logp": -torch.rand(num_rows, generator=gen) * 5,
        "advantages": torch.randn(num_rows, generator=gen),
        "mask": mask,
        "segment_ids": segment_ids,
        "denominators": denominators,
    }, device)  # fmt: skip
    batch["aggregate"] = lambda values: segment_sum(
        values, batch["mask"], batch["segment_ids"], batch["denominators"], validate=False
    )
    return batch


def logits_loss(logits, rows, temperature, batch):
    stats = token_stats(logits, batch["ids"], temperature=temperature, with_entropy=True, rows=rows, validate=False)
    return ppo_loss(stats.logp, stats.entropy, batch)


def hidden_loss(hidden, weight, temperature, batch):
    stats = linear_token_stats(
        hidden, weight, batch["ids"], temperature=temperature, with_entropy=True, chunk_rows=8, validate=False
    )
    return ppo_loss(stats.logp, stats.entropy, batch)


def float64_truth(loss_fn, inputs, temperature, batch):
    """The loss and input gradients of the float64 eager references, on CPU."""
    leaves = [x.detach().cpu().double().requires_grad_(True) for x in inputs if x.is_floating_point()]
    cpu = {k: v.cpu() for k, v in batch.items() if isinstance(v, torch.Tensor)}
    cpu["aggregate"] = lambda values: kernels.segment_sum_reference(
        values, cpu["mask"], cpu["segment_ids"], cpu["denominators"]
    )
    if loss_fn is logits_loss:
        logits, rows = leaves[0], inputs[1].cpu()
    else:
        logits, rows = leaves[0] @ leaves[1].t(), None
    stats = kernels.token_stats_reference(logits, cpu["ids"], temperature=temperature, with_entropy=True, rows=rows)
    loss = ppo_loss(stats.logp, stats.entropy, cpu)
    return loss, torch.autograd.grad(loss, leaves)


def run(loss_fn, leaves, extra, temperature, batch):
    """(loss, gradients of the leaves) of loss_fn(*leaves, *extra, temperature, batch)."""
    leaves = [x.detach().clone().requires_grad_(True) for x in leaves]
    loss = loss_fn(*leaves, *extra, temperature, batch)
    return loss.detach(), [g.detach() for g in torch.autograd.grad(loss, leaves)]


CASES = {
    # logits [T, V] (V odd, not a multiple of a tile) read at some rows; or hidden [T, H] @ weight [V, H]
    "token_stats": (logits_loss, lambda gen: [torch.randn(24, 517, generator=gen) * 3], lambda: [torch.tensor([0, 5, 6, 11, 17, 22, 23, 2, 9])]),
    "linear_token_stats": (hidden_loss, lambda gen: [torch.randn(18, 16, generator=gen), torch.randn(301, 16, generator=gen)], lambda: []),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_fullgraph_policy_loss_matches_eager_and_float64(case, device):
    loss_fn, make_leaves, make_extra = CASES[case]
    gen = torch.Generator().manual_seed(len(case))
    leaves, extra = to_device(make_leaves(gen), device), to_device(make_extra(), device)
    num_rows = extra[0].numel() if extra else leaves[0].shape[0]
    vocab = leaves[-1].shape[0] if case == "linear_token_stats" else leaves[0].shape[1]
    batch = make_batch(num_rows, vocab, gen, device)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(loss_fn)(*leaves, *extra, 0.7, batch)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1

    compiled = torch.compile(loss_fn, fullgraph=True)
    for temperature in (0.7, 1.3):  # a second float: no recompile that promotes it, same results
        eager_loss, eager_grads = run(loss_fn, leaves, extra, temperature, batch)
        loss, grads = run(compiled, leaves, extra, temperature, batch)
        truth_loss, truth_grads = float64_truth(loss_fn, leaves + extra, temperature, batch)
        assert_parity(loss.cpu(), eager_loss.cpu(), 1e-6, f"{case} loss, compiled vs eager")
        assert_parity(loss.cpu(), truth_loss, 1e-5, f"{case} loss vs float64")
        for grad, eager_grad, truth_grad in zip(grads, eager_grads, truth_grads):
            assert_parity(grad.cpu(), eager_grad.cpu(), 1e-6, f"{case} gradient, compiled vs eager")
            assert_parity(grad.cpu(), truth_grad, 1e-5, f"{case} gradient vs float64")


def test_compiled_token_stats_is_bitwise_eager(device):
    """The op's outputs leave the graph untouched: any change of an argument on the way in (a
    temperature promoted to fp64, another launch shape) would show as a changed bit."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 7, 131, generator=gen)[:1].to(device)  # slime's [1, T, V]
    ids = torch.randint(0, 131, (7, 3), generator=gen).to(device)

    def stats(logits, temperature):
        return tuple(token_stats(logits, ids, temperature=temperature, with_entropy=True, validate=False))

    compiled = torch.compile(stats, fullgraph=True)
    for temperature in (0.7, 0.9):
        for out, eager in zip(compiled(logits, temperature), stats(logits, temperature)):
            assert torch.equal(out, eager)


def test_compiled_inplace_backward_matches_eager(device):
    """The backward op writes the gradient into the logits buffer it is handed (here an
    intermediate of the compiled graph); the leaf's gradient is eager's, bit for bit."""
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 90, (6, 2), generator=gen).to(device)
    logits = torch.randn(6, 90, generator=gen).to(device)

    def loss(logits):
        stats = token_stats(logits * 1.0, ids, temperature=0.7, with_entropy=True, inplace_backward=True, validate=False)
        return stats.logp.sum() + stats.entropy.sum()

    _, (eager,) = run(lambda x, temperature, batch: loss(x), [logits], [], None, None)
    _, (compiled,) = run(torch.compile(lambda x, temperature, batch: loss(x), fullgraph=True), [logits], [], None, None)
    assert torch.equal(compiled, eager)


def _op_inputs(gen, device):
    """Checked, converted inputs of each op (what the public functions pass them), on `device`."""

    def leaf(*shape):
        return torch.randn(*shape, generator=gen).to(device).requires_grad_(True)

    logits = leaf(5, 70)
    ids = torch.randint(0, 70, (3, 2), generator=gen).to(device)
    rows = torch.tensor([4, 0, 2], device=device)
    per_row, per_id = torch.randn(3, generator=gen).to(device), torch.randn(3, 2, generator=gen).to(device)
    softmax_state = torch.randn(3, 3, generator=gen).to(device)
    hidden = leaf(5, 8)
    weight = leaf(70, 8)
    values = leaf(6, 2)
    mask, segments = torch.tensor([1.0, 0, 1, 1, 1, 1], device=device), torch.tensor([0, 2, 2, 0, 1, 0], device=device)
    denominators = torch.tensor([3.0, 1, 2], device=device)
    return {
        "token_stats": (token_stats_op, (logits, ids, rows, 0.7, True, 0, None, False)),
        "token_stats_backward": (
            token_stats_backward_op,
            (torch.empty_like(logits), logits.detach(), ids, rows, softmax_state, per_id, per_row, per_id, 0, 0.7),
        ),
        "linear_token_stats": (linear_token_stats_op, (hidden, weight, ids, rows, 0.7, True, 0, None, 2, None)),
        "linear_token_stats_backward": (
            linear_token_stats_backward_op,
            (hidden.detach(), weight.detach(), ids, rows, softmax_state, per_id, per_row, per_id, 0.7, 0, 2, True, True, None),
        ),
        "linear_token_stats_backward_main_grad": (  # the weight gradient added into main_grad, in place
            linear_token_stats_backward_op,
            (hidden.detach(), weight.detach(), ids, rows, softmax_state, per_id, per_row, per_id, 0.7, 0, 2, True, True,
             torch.randn(70, 8, generator=gen).to(device)),
        ),
        "segment_sum": (segment_sum_op, (values, mask, segments, denominators)),
        "segment_sum_backward": (segment_sum_backward_op, (torch.randn(2, generator=gen).to(device), mask, segments, denominators, torch.float32)),
    }  # fmt: skip


@pytest.mark.parametrize(
    "op", ["token_stats", "token_stats_backward", "linear_token_stats", "linear_token_stats_backward",
           "linear_token_stats_backward_main_grad", "segment_sum", "segment_sum_backward"]
)  # fmt: skip
def test_opcheck(op, device):
    fn, args = _op_inputs(torch.Generator().manual_seed(5), device)[op]
    torch.library.opcheck(fn, args)


def compiled_tp_worker(rank, world_size, logits, batch):
    """This rank's compiled loss and gradient over its column shard (aot_eager: the tracing is
    what is tested here; inductor's code for a loss is tested above)."""
    width = logits.shape[1] // world_size
    shard = logits[:, rank * width : (rank + 1) * width].clone().requires_grad_(True)
    batch = dict(batch, aggregate=torch.sum)

    def loss_fn(shard):
        stats = token_stats(
            shard, batch["ids"], temperature=0.7, with_entropy=True, tp_group=dist.group.WORLD, validate=False
        )
        return ppo_loss(stats.logp, stats.entropy, batch)

    explained = torch._dynamo.explain(loss_fn)(shard)
    loss = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")(shard)
    (grad,) = torch.autograd.grad(loss, shard)
    return explained.graph_break_count, loss.detach(), grad


def test_fullgraph_loss_under_tensor_parallelism_matches_the_unsplit_loss():
    """tp = 2 on gloo, on CPU (gloo has no CUDA collectives): the group reaches the op by its
    registered name; each rank's loss equals the unsplit loss and its gradient is its column slice
    of the unsplit gradient."""
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(10, 2 * 53, generator=gen)
    batch = {k: v for k, v in make_batch(10, 106, gen, torch.device("cpu")).items() if isinstance(v, torch.Tensor)}
    leaf = logits.double().requires_grad_(True)
    stats = kernels.token_stats_reference(leaf, batch["ids"], temperature=0.7, with_entropy=True)
    truth = ppo_loss(stats.logp, stats.entropy, dict(batch, aggregate=torch.sum))
    (truth_grad,) = torch.autograd.grad(truth, leaf)
    for rank, (breaks, loss, grad) in enumerate(run_on_ranks(2, compiled_tp_worker, logits, batch)):
        assert breaks == 0
        assert_parity(loss, truth, 1e-5, f"rank {rank} loss")
        assert_parity(grad, truth_grad[:, rank * 53 : (rank + 1) * 53], 1e-5, f"rank {rank} gradient")
