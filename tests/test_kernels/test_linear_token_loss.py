"""Parity of the one-pass LM-head loss (`linear_token_loss`) with a float64 truth and with the recompute
path (`linear_token_stats`, then the same loss), and its main_grad protocol.

The truth applies the same separable loss (tests/test_kernels/lm_head_cases.py: PPO's clipped ratio, squared
log-ratios, score and entropy terms, a mask) to the float64 `token_stats_reference` of
hidden @ weight.T. Shapes break the chunking as the recompute tests do: chunks that do not divide
the rows, one row per chunk, a chunk larger than the selection, V = 1, odd V, V above the kernels'
block, J = 1 + 8 with repeated ids, selected rows out of order, an empty selection; and a low
temperature at a large logit scale. The head runs on the `device` fixture's device.
"""

import gc

import pytest
import torch
from bench_package import import_bench
from lm_head_cases import (
    SeparableLoss, loss_with_grad, one_pass_head, random_layer, recompute_head, truth_head, truth_loss_head,
    unfused_loss_head,
)  # fmt: skip
from numerics import assert_no_worse_than, rel_err
from token_stats_cases import make_ids
from torch.utils.flop_counter import FlopCounterMode

import_bench()
from bench.harness.flops import GemmFlops  # noqa: E402
from bench.harness.memory import TensorTally  # noqa: E402

from fusedrl.kernels import LinearTokenLoss, TokenStats, linear_token_loss
from fusedrl.kernels.linear_token_loss import WEIGHT_BUFFER_BUDGET

FP32_TOL = 1e-5

CASES = [
    # (T, H, V, J, temperature, with_entropy, chunk_rows, rows, logit scale); large scales: below
    (13, 24, 1, 1, 1.0, True, 4, None, 3.0),
    (24, 32, 7, 9, 0.7, True, 5, [20, 3, 4, 0, 11, 17, 9], 3.0),
    (24, 32, 1000, 9, 0.7, False, 7, None, 3.0),
    (17, 16, 4099, 3, 1.0, True, 64, [16, 0, 5], 3.0),
    (20, 48, 333, 1, 0.7, True, 1, [2, 19, 7], 3.0),
]


def problem(num_rows, width, vocab, num_ids, dtype, seed, rows=None, logit_scale=3.0, exact=False, **kwargs):
    """(hidden, weight, ids, the loss, kwargs) of one case; the loss's old log-probs sit near the truth.
    exact: an exact layer (lm_head_cases.random_layer)."""
    gen = torch.Generator().manual_seed(seed)
    hidden, weight = random_layer(num_rows, width, vocab, dtype, gen, logit_scale, exact)
    rows = None if rows is None else torch.tensor(rows, dtype=torch.long)
    ids = make_ids(num_rows if rows is None else rows.numel(), vocab, num_ids, gen)
    kwargs = dict(kwargs, rows=rows)
    truth_logp = truth_head(hidden, weight, ids, **kwargs).logp
    return hidden, weight, ids, SeparableLoss(truth_logp, gen), kwargs


def assert_close_all(actual, expected, tol, what):
    (loss, stats, grads), (ref_loss, ref_stats, ref_grads) = actual, expected
    assert rel_err(loss, ref_loss) < tol, f"{what}: loss"
    for name, out, ref in zip(TokenStats._fields, stats, ref_stats):
        assert (out is None) == (ref is None), name
        if ref is not None:
            assert rel_err(out, ref) < tol, f"{what}: {name}"
    for name, grad, ref in zip(("d hidden", "d weight"), grads, ref_grads):
        assert rel_err(grad, ref) < tol, f"{what}: {name} {rel_err(grad, ref):.3g}"


@pytest.mark.parametrize("num_rows,width,vocab,num_ids,temperature,with_entropy,chunk_rows,rows,scale", CASES)
def test_fp32_loss_stats_and_gradients_match_float64_and_the_recompute_path(
    num_rows, width, vocab, num_ids, temperature, with_entropy, chunk_rows, rows, scale, device
):
    hidden, weight, ids, row_loss, kwargs = problem(
        num_rows, width, vocab, num_ids, torch.float32, num_rows * 1000 + vocab, rows, scale,
        temperature=temperature, with_entropy=with_entropy, chunk_rows=chunk_rows,
    )  # fmt: skip
    one_pass = loss_with_grad(one_pass_head, hidden, weight, ids, row_loss, device=device, **kwargs)
    truth = loss_with_grad(truth_loss_head, hidden, weight, ids, row_loss, **kwargs)
    recompute = loss_with_grad(recompute_head, hidden, weight, ids, row_loss, device=device, **kwargs)
    assert one_pass[0].dtype == torch.float32 and one_pass[0].dim() == 0
    assert all(t is None or t.dtype == torch.float32 for t in one_pass[1])
    assert_close_all(one_pass, recompute, FP32_TOL, "one pass vs recompute")
    assert_close_all(one_pass, truth, FP32_TOL, "one pass vs float64")
    if rows is not None:
        unselected = torch.ones(num_rows, dtype=torch.bool)
        unselected[rows] = False
        assert torch.equal(one_pass[2][0][unselected], torch.zeros_like(one_pass[2][0][unselected]))


def test_fp32_at_large_logit_scale_no_worse_than_the_unfused_path(device):
    """|logits| / T in the hundreds: each probability's exponent (x - m) / T rounds at |x - m| / T
    times 2^-24, so every fp32 path's gradients sit near 1e-5 of the truth, and the entropy of so
    peaked a distribution (1e-8 and less) is a difference of nearly equal numbers: the bar is the
    unfused fp32 path's error (numerics.assert_no_worse_than, over 8 seeds), for the loss, every
    statistic and both gradients. An exact layer keeps the GEMM library's summation order out of
    the verdict."""
    names = ("loss", *TokenStats._fields, "d hidden", "d weight")
    per_seed = {name: [] for name in names}
    for seed in range(8):
        hidden, weight, ids, row_loss, kwargs = problem(
            16, 32, 501, 2, torch.float32, 500 + seed, logit_scale=30.0, exact=True, temperature=0.1,
            with_entropy=True, chunk_rows=6,
        )  # fmt: skip
        one_pass, truth, unfused = (
            loss_with_grad(head, hidden, weight, ids, row_loss, device=None if head is truth_loss_head else device, **kwargs)
            for head in (one_pass_head, truth_loss_head, unfused_loss_head)
        )  # fmt: skip
        flat = [[loss, *stats, *grads] for loss, stats, grads in (one_pass, truth, unfused)]
        for name, ours, ref, base in zip(names, *flat):
            per_seed[name].append((rel_err(ours, ref), rel_err(base, ref), 1e-7))
    for name, errors in per_seed.items():
        assert_no_worse_than(errors, f"{name}: one pass vs unfused fp32")


@pytest.mark.parametrize(
    "vocab,rows,chunk_rows,budget",
    [(7, None, 3, WEIGHT_BUFFER_BUDGET), (4099, [9, 1, 2, 14, 6], 3, WEIGHT_BUFFER_BUDGET), (4099, None, None, WEIGHT_BUFFER_BUDGET),
     (4099, [9, 1, 2, 14, 6], 3, 0)],
)  # fmt: skip
def test_bf16_no_worse_than_the_unfused_path(vocab, rows, chunk_rows, budget, device):
    """Several chunks (the weight gradient summed in fp32), one chunk of all the rows (the default
    here: the GEMM writes the weight gradient in bf16, no fp32 buffer), and several chunks whose fp32
    sum would exceed the budget (0 here): the vocabulary walk, each slice written once in bf16."""
    hidden, weight, ids, row_loss, kwargs = problem(
        16, 64, vocab, 9, torch.bfloat16, vocab, rows, exact=True, temperature=0.7, with_entropy=True
    )  # exact: the bf16 logits are the float64 product rounded once, whatever the GEMM's blocking
    one_pass = loss_with_grad(one_pass_head, hidden, weight, ids, row_loss, device=device, chunk_rows=chunk_rows,
                              weight_buffer_budget=budget, **kwargs)  # fmt: skip
    truth = loss_with_grad(truth_loss_head, hidden, weight, ids, row_loss, **kwargs)
    unfused = loss_with_grad(unfused_loss_head, hidden, weight, ids, row_loss, device=device, **kwargs)
    slack = 1e-6
    assert rel_err(one_pass[0], truth[0]) <= rel_err(unfused[0], truth[0]) + slack
    for out, ref, base in zip(one_pass[1], truth[1], unfused[1]):
        assert rel_err(out, ref) <= rel_err(base, ref) + slack
    for grad, ref, base in zip(one_pass[2], truth[2], unfused[2]):
        assert grad.dtype == torch.bfloat16
        assert rel_err(grad, ref) <= rel_err(base, ref) * 1.05 + slack


class Weighted:
    """`loss` times a per-token weight (slime's 1 / response length), as the loss the op is given."""

    def __init__(self, loss, weight):
        self.loss, self.weight = loss, weight

    def to(self, device):
        return Weighted(self.loss.to(device), self.weight)

    def __call__(self, stats, slots):
        return self.weight * self.loss(stats, slots)


def scaled(head, scale):
    """The path `head`, its loss times `scale` (the incoming gradient a schedule sends)."""

    def run(hidden, weight, ids, row_loss, **kwargs):
        loss, stats = head(hidden, weight, ids, row_loss, **kwargs)
        return loss * torch.tensor(scale, dtype=torch.float32, device=loss.device), stats

    return run


FP16_WEIGHT, FP16_INCOMING = 1 / 4000, 2.0**16 / 32  # a 4000-token response; a loss scale of 2^16 over 32 micro-batches


@pytest.mark.parametrize("path", ["buffer", "written", "main_grad", "walk"])
def test_fp16_at_a_loss_scale_no_worse_than_the_unfused_path(path, device):
    """fp16 at realistic per-token weights and loss scales: the provisional grad_scale (no main_grad) and
    the main_grad path form the fp16 logits gradient at the incoming scale, as the unfused path does; at
    unit scale (no grad_scale) its small entries flush to zero (hidden-gradient errors 17-22x the unfused
    path's, weight gradient 2.7-3.7x). Bar: the unfused fp16 path's error against float64, the median
    over five seeds of the ratio at most 1.25 (the two paths round alike: ratios of 1.00). "buffer":
    two chunks, the weight gradient summed in fp32; "written": one chunk, written by its GEMM in fp16;
    "walk": two chunks whose fp32 sum exceeds the budget (0), the vocabulary walked, each slice written
    in fp16."""
    per_seed = {"d hidden": [], "d weight": []}
    for seed in range(5):
        chunk_rows = 16 if path == "written" else 8
        hidden, weight, ids, base, kwargs = problem(16, 64, 32768, 1, torch.float16, seed, chunk_rows=chunk_rows)
        row_loss = Weighted(base, FP16_WEIGHT)
        truth = loss_with_grad(scaled(truth_loss_head, FP16_INCOMING), hidden, weight, ids, row_loss, **kwargs)
        unfused = loss_with_grad(scaled(unfused_loss_head, FP16_INCOMING), hidden, weight, ids, row_loss, device=device,
                                 **kwargs)  # fmt: skip
        moved = [t.to(device) for t in (hidden, weight, ids)]
        hidden_leaf, weight_leaf = moved[0].requires_grad_(), moved[1].requires_grad_()
        main_grad = torch.zeros(weight.shape, dtype=torch.float32, device=device) if path == "main_grad" else None
        budget = 0 if path == "walk" else WEIGHT_BUFFER_BUDGET
        result = linear_token_loss(hidden_leaf, weight_leaf, moved[2], row_loss.to(device), main_grad=main_grad,
                                   grad_scale=FP16_INCOMING, weight_buffer_budget=budget, **kwargs)  # fmt: skip
        (result.loss * torch.tensor(FP16_INCOMING, device=device)).backward()
        grads = (hidden_leaf.grad, weight_leaf.grad if main_grad is None else main_grad)
        assert grads[0].dtype == torch.float16
        for name, grad, ref, base_grad in zip(per_seed, grads, truth[2], unfused[2]):
            per_seed[name].append((rel_err(grad, ref), rel_err(base_grad, ref), 0.0))
    for name, errors in per_seed.items():
        assert_no_worse_than(errors, f"fp16 {path} {name}", bar=1.25)


@pytest.mark.parametrize("used", TokenStats._fields)
def test_a_loss_of_one_statistic_alone_gets_the_exact_gradients(used, device):
    """A statistic the loss does not use has no coefficient (the kernel takes it as zero)."""
    hidden, weight, ids, _, kwargs = problem(12, 16, 301, 3, torch.float32, 13, temperature=0.7, with_entropy=True,
                                             chunk_rows=5)  # fmt: skip
    weights = torch.randn(12, 3, generator=torch.Generator().manual_seed(1))

    def row_loss(stats, slots):
        value = getattr(stats, used)
        return (value * (weights[slots] if value.dim() == 2 else weights[slots, 0]).to(value.device)).sum()

    row_loss.to = lambda device: row_loss
    one_pass = loss_with_grad(one_pass_head, hidden, weight, ids, row_loss, device=device, **kwargs)
    truth = loss_with_grad(truth_loss_head, hidden, weight, ids, row_loss, **kwargs)
    assert_close_all(one_pass, truth, FP32_TOL, used)


@pytest.mark.parametrize("chunk_rows,budget", [(16, None), (4, None), (4, 0)])
def test_a_loss_that_does_not_use_the_statistics_gets_zero_gradients(chunk_rows, budget, device):
    """One chunk (the weight gradient an uninitialised tensor its GEMM would write), several chunks
    (the fp32 sum) and the vocabulary walk: no GEMM runs, and both gradients are zeros, never
    whatever memory held."""
    hidden, weight, ids, _, kwargs = problem(16, 8, 50, 2, torch.bfloat16, 4)
    hidden, weight, ids = (t.to(device) for t in (hidden, weight, ids))
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    result = linear_token_loss(hidden, weight, ids, lambda stats, slots: torch.zeros((), device=device),
                               chunk_rows=chunk_rows, weight_buffer_budget=budget)  # fmt: skip
    result.loss.backward()
    assert torch.equal(weight.grad, torch.zeros_like(weight)) and torch.equal(hidden.grad, torch.zeros_like(hidden))


@pytest.mark.host_bookkeeping
def test_the_walk_holds_no_weight_sized_fp32_sum_and_runs_four_gemms(device):
    """bf16, several chunks, the budget below the fp32 [V, H] sum: the forward (which makes the
    gradients) holds beyond its returned gradients one slice of logits (as many elements as a
    chunk) and per-row bookkeeping, not the 4 V H bytes of the sum; and it runs the recompute
    path's four GEMMs."""
    num_rows, width, vocab, chunk = 32, 16, 1000, 4
    hidden, weight, ids, row_loss, kwargs = problem(num_rows, width, vocab, 3, torch.bfloat16, 6, with_entropy=True)
    hidden, weight, ids = (t.to(device).requires_grad_(t.is_floating_point()) for t in (hidden, weight, ids))
    row_loss = row_loss.to(device)
    chunk_logits = chunk * vocab * 2
    upcast = chunk_logits // 2  # CPU only: the fp32 copies of `add_product_fp32`, a quarter of a chunk's elements
    bookkeeping = 16 * num_rows * (3 + 3) * 8 + num_rows * width * 4  # the rows' statistics, fp32 d hidden sums
    with TensorTally() as tally, GemmFlops() as flops:
        result = linear_token_loss(hidden, weight, ids, row_loss, with_entropy=True, chunk_rows=chunk,
                                   weight_buffer_budget=4 * vocab * width - 1)  # fmt: skip
        gc.collect()  # the Triton interpreter's argument closures keep launched tensors in a cycle
        returned = (num_rows + vocab) * width * 2  # the bf16 gradients, made in the forward
        peak = tally.peak() - returned
    assert peak <= chunk_logits + upcast + bookkeeping < vocab * width * 4
    assert flops.total == 4 * 2 * num_rows * vocab * width  # addmm_ counted too (CPU's fp32 sums)
    result.loss.backward()
    assert weight.grad.dtype == torch.bfloat16


def test_row_loss_sees_each_chunk_once_in_order_as_fresh_leaves(device):
    hidden, weight, ids, row_loss, kwargs = problem(11, 8, 50, 2, torch.float32, 3, chunk_rows=4)
    moved, seen = row_loss.to(device), []

    def recording(stats, slots):
        seen.append((slots, tuple(stats.logp.shape), stats.logp.requires_grad and stats.logp.is_leaf))
        return moved(stats, slots)

    linear_token_loss(hidden.to(device).requires_grad_(), weight.to(device), ids.to(device), recording, **kwargs)
    assert seen == [(slice(0, 4), (4, 2), True), (slice(4, 8), (4, 2), True), (slice(8, 11), (3, 2), True)]


def test_empty_selection_runs_one_empty_chunk_and_gives_zero_gradients(device):
    hidden, weight = random_layer(6, 8, 50, torch.float32, torch.Generator().manual_seed(0))
    calls = []

    def row_loss(stats, slots):
        calls.append(slots)
        return stats.logp.sum() + stats.entropy.sum()

    row_loss.to = lambda device: row_loss
    loss, stats, (grad_hidden, grad_weight) = loss_with_grad(
        one_pass_head, hidden, weight, torch.zeros(0, 3, dtype=torch.long), row_loss, device=device,
        rows=torch.zeros(0, dtype=torch.long), with_entropy=True,
    )  # fmt: skip
    assert calls == [slice(0, 0)]
    assert float(loss) == 0.0 and stats.logp.shape == (0, 3) and stats.entropy.shape == (0,)
    assert torch.equal(grad_hidden, torch.zeros_like(grad_hidden))
    assert torch.equal(grad_weight, torch.zeros_like(grad_weight))


def main_grad_case(device, seed=5):
    hidden, weight, ids, row_loss, kwargs = problem(
        14, 16, 333, 3, torch.float32, seed, [13, 2, 5, 7, 0, 9, 11, 4], temperature=0.7, with_entropy=True,
        chunk_rows=3,
    )  # fmt: skip
    truth = loss_with_grad(truth_loss_head, hidden, weight, ids, row_loss, **kwargs)
    hidden, weight, ids = (t.to(device) for t in (hidden, weight, ids))
    kwargs = dict(kwargs, rows=kwargs["rows"].to(device))
    return hidden, weight, ids, row_loss.to(device), kwargs, truth


@pytest.mark.parametrize("grad_scale", [0.25, 1.0 / 3.0])
def test_main_grad_gets_exactly_grad_scale_times_the_weight_gradient(grad_scale, device):
    hidden, weight, ids, row_loss, kwargs, (truth_loss, _, (truth_hidden, truth_weight)) = main_grad_case(device)
    main_grad = torch.randn(weight.shape, generator=torch.Generator().manual_seed(9)).to(device)
    before = main_grad.clone()
    hidden, weight = hidden.requires_grad_(), weight.requires_grad_()
    result = linear_token_loss(hidden, weight, ids, row_loss, main_grad=main_grad, grad_scale=grad_scale, **kwargs)
    assert isinstance(result, LinearTokenLoss)
    added = (main_grad - before).cpu()
    assert rel_err(added, grad_scale * truth_weight) < FP32_TOL * grad_scale  # in the forward, before backward
    (result.loss * torch.tensor(grad_scale, device=device)).backward()  # the schedule's scale, in fp32
    assert weight.grad is None  # no [V_local, H] gradient anywhere
    assert torch.equal((main_grad - before).cpu(), added)  # the backward adds nothing
    assert rel_err(hidden.grad, grad_scale * truth_hidden) < FP32_TOL * grad_scale
    assert rel_err(result.loss, truth_loss) < FP32_TOL


def test_main_grad_with_a_wrong_incoming_gradient_raises_naming_both(device):
    hidden, weight, ids, row_loss, kwargs, _ = main_grad_case(device)
    main_grad = torch.zeros(weight.shape, device=device)
    result = linear_token_loss(hidden.requires_grad_(), weight.requires_grad_(), ids, row_loss, main_grad=main_grad,
                               grad_scale=0.125, **kwargs)  # fmt: skip
    with pytest.raises(ValueError, match=r"grad_scale = 0\.125.*incoming gradient is 0\.25"):
        (result.loss * 0.25).backward()


def test_without_main_grad_the_backward_scales_both_gradients(device):
    hidden, weight, ids, row_loss, kwargs, (_, _, (truth_hidden, truth_weight)) = main_grad_case(device)
    hidden, weight = hidden.requires_grad_(), weight.requires_grad_()
    (0.375 * linear_token_loss(hidden, weight, ids, row_loss, **kwargs).loss).backward()
    assert rel_err(hidden.grad, 0.375 * truth_hidden) < FP32_TOL * 0.375
    assert rel_err(weight.grad, 0.375 * truth_weight) < FP32_TOL * 0.375


def test_forward_only_computes_no_gradient_and_leaves_main_grad_untouched(device):
    hidden, weight, ids, row_loss, kwargs, _ = main_grad_case(device)
    main_grad = torch.randn(weight.shape, generator=torch.Generator().manual_seed(3)).to(device)
    before = main_grad.clone()
    trained = linear_token_loss(hidden.requires_grad_(), weight.requires_grad_(), ids, row_loss, main_grad=main_grad,
                                grad_scale=0.5, **kwargs)  # fmt: skip
    main_grad.copy_(before)
    selected, vocab, width = ids.shape[0], weight.shape[0], weight.shape[1]
    for frozen in ("no_grad", "constants"):
        with FlopCounterMode(display=False) as flops:
            if frozen == "no_grad":
                with torch.no_grad():
                    result = linear_token_loss(hidden, weight, ids, row_loss, main_grad=main_grad, grad_scale=0.5,
                                               **kwargs)  # fmt: skip
            else:
                result = linear_token_loss(hidden.detach(), weight.detach(), ids, row_loss, main_grad=main_grad,
                                           grad_scale=0.5, **kwargs)  # fmt: skip
        assert flops.get_total_flops() == 2 * selected * vocab * width  # the forward GEMM alone
        assert torch.equal(main_grad, before)
        assert not result.loss.requires_grad
        assert torch.equal(result.loss, trained.loss)
        for a, b in zip(result.stats, trained.stats):
            assert torch.equal(a, b)


def test_a_frozen_weight_leaves_main_grad_untouched_and_hidden_gets_its_gradient(device):
    hidden, weight, ids, row_loss, kwargs, (_, _, (truth_hidden, _)) = main_grad_case(device)
    main_grad = torch.zeros(weight.shape, device=device)
    hidden = hidden.requires_grad_()
    result = linear_token_loss(hidden, weight, ids, row_loss, main_grad=main_grad, grad_scale=2.0, **kwargs)
    (2.0 * result.loss).backward()
    assert torch.equal(main_grad, torch.zeros_like(main_grad))
    assert rel_err(hidden.grad, 2.0 * truth_hidden) < 2.0 * FP32_TOL


def test_a_second_backward_is_refused():
    hidden, weight, ids, row_loss, kwargs, _ = main_grad_case(torch.device("cpu"))
    loss = linear_token_loss(hidden.requires_grad_(), weight, ids, row_loss, **kwargs).loss
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="cannot run a second time"):
        loss.backward()


def test_same_inputs_give_bitwise_identical_results(device):
    def run():
        hidden, weight, ids, row_loss, kwargs, _ = main_grad_case(device, seed=21)
        hidden, weight = hidden.requires_grad_(), weight.requires_grad_()
        main_grad = torch.ones(weight.shape, device=device)
        plain = linear_token_loss(hidden, weight, ids, row_loss, **kwargs)
        plain.loss.backward()
        into = linear_token_loss(hidden.detach(), weight, ids, row_loss, main_grad=main_grad, grad_scale=0.5, **kwargs)
        return [plain.loss, *plain.stats, hidden.grad, weight.grad, into.loss, main_grad]

    for a, b in zip(run(), run()):
        assert torch.equal(a, b)


def test_cpu_without_interpreter_takes_the_float64_reference_per_chunk(monkeypatch):
    """CPU only, whatever the test device: the same protocol on the eager path."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    hidden, weight, ids, row_loss, kwargs, (truth_loss, truth_stats, (truth_hidden, truth_weight)) = main_grad_case(
        torch.device("cpu")
    )
    main_grad = torch.randn(weight.shape)
    before = main_grad.clone()
    hidden, weight = hidden.requires_grad_(), weight.requires_grad_()
    with pytest.warns(UserWarning, match="linear_token_loss runs the float64 reference"):
        result = linear_token_loss(hidden, weight, ids, row_loss, main_grad=main_grad, grad_scale=0.5, **kwargs)
    (0.5 * result.loss).backward()
    assert rel_err(result.loss, truth_loss) < FP32_TOL
    for out, ref in zip(result.stats, truth_stats):
        assert rel_err(out, ref) < FP32_TOL
    assert rel_err(hidden.grad, 0.5 * truth_hidden) < FP32_TOL
    assert rel_err(main_grad - before, 0.5 * truth_weight) < FP32_TOL
    assert weight.grad is None
