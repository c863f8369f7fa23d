"""Parity of the fused LM head + token statistics with a float64 truth built from hidden @ weight.T.

Shapes are chosen to break the chunking as well as the kernels: a chunk size that does not divide
the rows, one row per chunk, a chunk larger than the selection, V = 1, a prime V, V just above the
kernels' block (4099 > 4096), repeated ids, selected rows out of order, an empty selection. The
LM head runs on the `device` fixture's device, the float64 truth on CPU
(tests/test_kernels/test_device_fixture.py checks that every tensor the kernels receive here is on it).
"""

import gc

import pytest
import torch
from bench_package import import_bench
from device import to_device
from lm_head_cases import head_with_grad, random_layer, truth_head
from numerics import rel_err
from token_stats_cases import loss_of, make_ids, upstream_grads

import_bench()
from bench.harness.memory import TensorTally  # noqa: E402

from fusedrl.kernels import TokenStats, linear_token_stats, token_stats, token_stats_reference
from fusedrl.kernels.linear_token_stats import UPCAST_SHARE, add_product_fp32, default_chunk_rows

FP32_TOL = 1e-5


def unfused_head(hidden, weight, ids, **kwargs):
    """The path the fused one replaces: the matmul in the layer's dtype, then token_stats."""
    kwargs.pop("chunk_rows", None)
    return token_stats(hidden @ weight.t(), ids, **kwargs)


def eager_head(hidden, weight, ids, *, temperature, with_entropy, rows=None, **_):
    """The matmul in the layer's dtype, then an fp32 log-softmax: the bar for low precision."""
    logits = (hidden if rows is None else hidden[rows]) @ weight.t()
    tempered = logits.float() / temperature
    log_probs = torch.log_softmax(tempered, dim=-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1) if with_entropy else None
    return log_probs.gather(1, ids), entropy, tempered.gather(1, ids)


CASES = [
    # (T, H, V, J, temperature, with_entropy, chunk_rows, rows)
    (13, 24, 1, 1, 1.0, True, 4, None),
    (24, 32, 7, 9, 0.7, True, 5, [20, 3, 4, 0, 11, 17, 9]),
    (24, 32, 1000, 9, 0.7, True, 7, None),
    (17, 16, 4099, 3, 1.0, False, 64, [16, 0, 5]),
    (20, 48, 1000, 1, 0.7, True, 1, [2, 19, 7]),
    (40, 16, 333, 2, 1.3, True, None, None),
]


@pytest.mark.parametrize("num_rows,width,vocab,num_ids,temperature,with_entropy,chunk_rows,rows", CASES)
def test_fp32_outputs_and_gradients_match_float64(num_rows, width, vocab, num_ids, temperature, with_entropy,
                                                  chunk_rows, rows, device):  # fmt: skip
    gen = torch.Generator().manual_seed(num_rows * 1000 + vocab)
    hidden, weight = random_layer(num_rows, width, vocab, torch.float32, gen)
    rows = None if rows is None else torch.tensor(rows)
    ids = make_ids(num_rows if rows is None else rows.numel(), vocab, num_ids, gen)
    kwargs = dict(temperature=temperature, with_entropy=with_entropy, rows=rows, chunk_rows=chunk_rows)
    stats, grads, (grad_hidden, grad_weight) = head_with_grad(
        linear_token_stats, hidden, weight, ids, device=device, **kwargs
    )
    truth, _, (truth_hidden, truth_weight) = head_with_grad(truth_head, hidden, weight, ids, grads, **kwargs)
    assert (stats.entropy is None) == (not with_entropy)
    for name, out, ref in zip(truth._fields, stats, truth):
        if ref is not None:
            assert out.dtype == torch.float32
            assert rel_err(out, ref) < FP32_TOL, name
    assert grad_hidden.dtype == grad_weight.dtype == torch.float32
    assert rel_err(grad_hidden, truth_hidden) < FP32_TOL
    assert rel_err(grad_weight, truth_weight) < FP32_TOL
    if rows is not None:
        unselected = torch.ones(num_rows, dtype=torch.bool)
        unselected[rows] = False
        assert torch.equal(grad_hidden[unselected], torch.zeros_like(grad_hidden[unselected]))


@pytest.mark.parametrize("vocab,rows", [(7, None), (4099, [9, 1, 2, 14, 6])])
def test_bf16_no_worse_than_the_unfused_and_eager_paths(vocab, rows, device):
    """Outputs: no worse than the eager bf16 matmul + fp32 log-softmax. Gradients: no worse than the
    unfused path (same matmul, same token_stats kernel); the eager path's bf16 gradients are the bar
    on a GPU, where the kernel rounds its fp32 gradient to bf16 as autograd does, but not under the
    Triton interpreter, which truncates (see README)."""
    gen = torch.Generator().manual_seed(vocab)
    hidden, weight = random_layer(16, 64, vocab, torch.bfloat16, gen, exact=True)  # the same bf16 logits on any machine
    rows = None if rows is None else torch.tensor(rows)
    ids = make_ids(16 if rows is None else rows.numel(), vocab, 9, gen)
    kwargs = dict(temperature=0.7, with_entropy=True, rows=rows)
    stats, grads, fused_grads = head_with_grad(
        linear_token_stats, hidden, weight, ids, device=device, chunk_rows=3, **kwargs
    )
    truth, _, truth_grads = head_with_grad(truth_head, hidden, weight, ids, grads, **kwargs)
    unfused, _, unfused_grads = head_with_grad(unfused_head, hidden, weight, ids, grads, device=device, **kwargs)
    eager, _, _ = head_with_grad(eager_head, hidden, weight, ids, grads, device=device, **kwargs)
    slack = 1e-6
    for out, ref, base, unfused_out in zip(stats, truth, eager, unfused):
        assert rel_err(out, ref) <= rel_err(base, ref) + slack
        assert rel_err(out, ref) <= rel_err(unfused_out, ref) + slack
    for grad, ref, base in zip(fused_grads, truth_grads, unfused_grads):
        assert grad.dtype == torch.bfloat16
        assert rel_err(grad, ref) <= rel_err(base, ref) * 1.05 + slack


@pytest.mark.parametrize("used", TokenStats._fields)
def test_a_loss_of_one_output_alone_gets_the_exact_gradients(used, device):
    """Outputs a loss does not use reach the backward as None (no zeros filled for them)."""
    gen = torch.Generator().manual_seed(13)
    hidden, weight = random_layer(12, 16, 301, torch.float32, gen)
    ids, kwargs = make_ids(12, 301, 3, gen), dict(temperature=0.7, with_entropy=True, chunk_rows=5)
    grads = upstream_grads(truth_head(hidden, weight, ids, **kwargs), gen)
    grads = [grad if name == used else None for name, grad in zip(TokenStats._fields, grads)]
    _, _, fused = head_with_grad(linear_token_stats, hidden, weight, ids, grads, device=device, **kwargs)
    _, _, truth = head_with_grad(truth_head, hidden, weight, ids, grads, **kwargs)
    for grad, truth_grad in zip(fused, truth):
        assert rel_err(grad, truth_grad) < FP32_TOL


def test_empty_selection_gives_empty_outputs_and_zero_gradients(device):
    hidden, weight = random_layer(6, 8, 50, torch.float32, torch.Generator().manual_seed(0))
    stats, _, (grad_hidden, grad_weight) = head_with_grad(
        linear_token_stats, hidden, weight, torch.zeros(0, 3, dtype=torch.long),
        rows=torch.zeros(0, dtype=torch.long), with_entropy=True, device=device,
    )  # fmt: skip
    assert stats.logp.shape == (0, 3) and stats.entropy.shape == (0,)
    assert torch.equal(grad_hidden, torch.zeros_like(grad_hidden))
    assert torch.equal(grad_weight, torch.zeros_like(grad_weight))


def test_a_frozen_weight_or_hidden_gets_no_gradient_and_the_other_the_same_one(device):
    gen = torch.Generator().manual_seed(2)
    hidden, weight = random_layer(10, 16, 300, torch.float32, gen)
    ids = make_ids(10, 300, 2, gen)
    kwargs = dict(with_entropy=True, chunk_rows=4)
    stats, grads, (both_hidden, both_weight) = head_with_grad(
        linear_token_stats, hidden, weight, ids, device=device, **kwargs
    )
    hidden, weight, ids = hidden.to(device), weight.to(device), ids.to(device)
    for trainable, expected in ((hidden, both_hidden), (weight, both_weight)):
        leaf = trainable.clone().requires_grad_(True)
        args = (leaf, weight) if trainable is hidden else (hidden, leaf)
        (grad,) = torch.autograd.grad(loss_of(linear_token_stats(*args, ids, **kwargs), grads), [leaf])
        assert torch.equal(grad.cpu(), expected)


def test_same_inputs_give_bitwise_identical_results(device):
    gen = torch.Generator().manual_seed(13)
    hidden, weight = random_layer(16, 32, 4099, torch.float32, gen)
    ids = make_ids(16, 4099, 9, gen)
    kwargs = dict(with_entropy=True, temperature=0.7, chunk_rows=5)
    first = head_with_grad(linear_token_stats, hidden, weight, ids, device=device, **kwargs)
    second = head_with_grad(linear_token_stats, hidden, weight, ids, device=device, **kwargs)
    for a, b in zip(first[0], second[0]):
        assert torch.equal(a, b)
    for a, b in zip(first[2], second[2]):
        assert torch.equal(a, b)


@pytest.mark.host_bookkeeping
@pytest.mark.parametrize("rows", [None, list(range(0, 32, 2))])
def test_one_chunk_of_logits_is_alive_at_a_time(rows, device):
    """Peak allocations of forward and backward, less the returned gradients, stay within one
    chunk's logits plus per-row bookkeeping: far below the [T, V] logits (chunks of 8 of 32 rows)."""
    gen = torch.Generator().manual_seed(4)
    num_rows, width, vocab, num_ids, chunk = 32, 16, 1000, 3, 8
    hidden, weight = random_layer(num_rows, width, vocab, torch.float32, gen)
    rows = None if rows is None else torch.tensor(rows, device=device)
    selected = num_rows if rows is None else rows.numel()
    ids = make_ids(selected, vocab, num_ids, gen).to(device)
    hidden = hidden.to(device).requires_grad_(True)
    weight = weight.to(device).requires_grad_(True)
    chunk_logits = chunk * vocab * 4
    # per row: the partials and the float64 combine's temporaries; per chunk: the gathered rows
    bookkeeping = 16 * selected * (3 + num_ids) * 8 + 2 * chunk * width * 4
    with TensorTally() as tally:
        stats = linear_token_stats(hidden, weight, ids, rows=rows, with_entropy=True, chunk_rows=chunk)
        forward_peak = tally.peak()
        gc.collect()  # the Triton interpreter's argument closures keep launched tensors in a cycle
        tally.reset_peak()
        grads = torch.autograd.grad(stats.logp.sum() + stats.entropy.sum(), [hidden, weight])
        backward_peak = tally.peak() - sum(g.numel() * g.element_size() for g in grads)
    assert forward_peak <= chunk_logits + bookkeeping
    assert backward_peak <= chunk_logits + bookkeeping
    assert chunk_logits + bookkeeping < num_rows * vocab * 4 / 2


def test_default_chunk_rows_follows_its_stated_rules():
    vocab, itemsize = 151936, 2
    assert default_chunk_rows(16384, vocab, itemsize) == 768  # the floor of 768 rows beats T / 32
    assert default_chunk_rows(65536, vocab, itemsize) == 2048  # T / 32
    assert default_chunk_rows(300, vocab, itemsize) == 300  # fewer rows than the floor: one chunk
    assert default_chunk_rows(0, vocab, itemsize) == 1
    quarter_holds = 4 * 100 * vocab * itemsize  # free memory whose quarter holds 100 rows of logits
    assert default_chunk_rows(16384, vocab, itemsize, free_bytes=quarter_holds) == 100
    assert default_chunk_rows(16384, vocab, itemsize, free_bytes=0) == 1


def test_cpu_without_interpreter_takes_the_unfused_path(monkeypatch):
    """CPU only, whatever the test device: the CPU dispatch outside the interpreter."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    gen = torch.Generator().manual_seed(17)
    hidden, weight = random_layer(5, 8, 30, torch.float32, gen)
    ids = make_ids(5, 30, 2, gen)
    fused = linear_token_stats(hidden, weight, ids, with_entropy=True)
    reference = token_stats_reference(hidden @ weight.t(), ids, with_entropy=True)
    for a, b in zip(fused, reference):
        assert torch.equal(a, b)


def test_low_precision_weight_gradient_sums_in_fp32_on_every_device():
    """Where torch cannot add a bf16 GEMM into an fp32 matrix (CPU), the operands are upcast: the
    probe says which, and either way the sums are fp32 (the bf16 test above checks the values)."""
    from fusedrl.kernels.linear_token_stats import _adds_low_precision_products_in_fp32

    assert _adds_low_precision_products_in_fp32("cpu", torch.bfloat16) is False


def bf16_layer(num_rows, width, vocab, num_ids, gen, device):
    """(hidden, weight, ids) of a random bf16 layer on `device`, both layer tensors requiring grad."""
    hidden, weight = random_layer(num_rows, width, vocab, torch.bfloat16, gen)
    ids = make_ids(num_rows, vocab, num_ids, gen).to(device)
    return hidden.to(device).requires_grad_(True), weight.to(device).requires_grad_(True), ids


def gradients_and_backward_peak(hidden, weight, ids, chunk_rows):
    """(d hidden, d weight) of sum(logp) + sum(entropy) and the backward's peak allocation beyond them."""
    with TensorTally() as tally:
        stats = linear_token_stats(hidden, weight, ids, with_entropy=True, chunk_rows=chunk_rows)
        gc.collect()  # the Triton interpreter's argument closures keep launched tensors in a cycle
        tally.reset_peak()
        grads = torch.autograd.grad(stats.logp.sum() + stats.entropy.sum(), [hidden, weight])
        return grads, tally.peak() - sum(g.numel() * g.element_size() for g in grads)


@pytest.mark.host_bookkeeping
@pytest.mark.parametrize("shape", [(300, 8, 16), (7, 40, 3)])  # a weight gradient's rows; a tall inner dimension
def test_cpu_fp32_sums_of_low_precision_products_are_exact_and_hold_small_copies(shape):
    """acc += a @ b for bf16 a, b on CPU (no bf16 x bf16 -> fp32 GEMM there): the same bits as the
    product of the exact fp32 copies, added once, and copies of at most 1 + UPCAST_SHARE times b's
    elements when b is small next to a (each row of acc read and written once), else of a quarter
    of a's."""
    gen = torch.Generator().manual_seed(sum(shape))
    rows, inner, width = shape
    a = torch.randn((rows, inner), generator=gen).bfloat16()
    b = torch.randn((inner, width), generator=gen).bfloat16()
    start = torch.randn((rows, width), generator=gen)
    acc = start.clone()
    with TensorTally() as tally:
        add_product_fp32(acc, a, b)
    small_b = inner * width * UPCAST_SHARE <= a.numel()
    if small_b:
        assert torch.equal(acc, start.addmm(a.float(), b.float()))
        assert tally.peak() <= (1 + UPCAST_SHARE) * b.numel() * 4 < a.numel() * 4
    else:
        assert rel_err(acc, start.double() + a.double() @ b.double()) < 1e-6
        assert tally.peak() <= a.numel() // UPCAST_SHARE * 4


@pytest.mark.host_bookkeeping
def test_one_slice_writes_the_hidden_gradient_by_one_gemm_with_no_fp32_copies(device):
    """Every selected row in one chunk, so one slice spans the vocabulary: its GEMM writes d hidden
    in the layer's dtype (rounded once, as the unfused path does) and d weight, so the bf16 backward
    holds beyond its returned gradients the slice of logits and per-row bookkeeping only, no fp32
    sum or copy; and d hidden is within one rounding of the fp32 product of the same logits gradient."""
    gen = torch.Generator().manual_seed(8)
    num_rows, width, vocab, num_ids = 24, 16, 2000, 2
    hidden, weight, ids = bf16_layer(num_rows, width, vocab, num_ids, gen, device)
    grads, backward_peak = gradients_and_backward_peak(hidden, weight, ids, num_rows)
    assert backward_peak <= num_rows * vocab * 2 + 16 * num_rows * (3 + num_ids) * 8
    logits = (hidden.detach().double() @ weight.detach().double().t()).requires_grad_(True)
    truth = token_stats_reference(logits, ids, with_entropy=True)
    (grad_logits,) = torch.autograd.grad(truth.logp.sum() + truth.entropy.sum(), [logits])
    assert rel_err(grads[0], grad_logits @ weight.detach().double()) < 2e-2  # bf16 operands and result


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vocabulary_walk_weight_gradient_no_worse_than_the_unfused_path(dtype, device):
    """The backward walks the vocabulary in slices (here 6, the last one short: V = 1037 is odd and
    no multiple of the slice), all selected rows at once: each slice of the weight gradient is one
    GEMM's output, rounded once to the layer's dtype, no fp32 [V, H] sum. Against float64, over
    seeds, at |logits| / T in the hundreds, with repeated ids and selected rows: no worse than the
    unfused path in the same dtype (the same token-statistics kernel on the full logits; on a GPU
    also the eager bf16 matmul + fp32 log-softmax, which the interpreter's truncating casts make
    unfair on CPU)."""
    num_rows, width, vocab, temperature = 20, 32, 1037, 0.05
    rows = torch.tensor([19, 2, 3, 7, 11, 0, 5, 8, 13, 17, 1, 4, 6, 9, 10, 12])
    bars = [unfused_head] + ([eager_head] if device.type == "cuda" else [])
    for seed in range(3):
        gen = torch.Generator().manual_seed(100 + seed)
        hidden, weight = random_layer(num_rows, width, vocab, dtype, gen, logit_scale=10.0, exact=dtype != torch.float32)
        ids = make_ids(rows.numel(), vocab, 5, gen)
        ids[:, 1] = ids[:, 0]  # a repeated id in every row
        kwargs = dict(temperature=temperature, with_entropy=True, rows=rows)
        _, grads, (fused_hidden, fused_weight) = head_with_grad(
            linear_token_stats, hidden, weight, ids, device=device, chunk_rows=3, **kwargs
        )
        _, _, (truth_hidden, truth_weight) = head_with_grad(truth_head, hidden, weight, ids, grads, **kwargs)
        assert fused_weight.dtype == dtype
        for bar in bars:
            _, _, (bar_hidden, bar_weight) = head_with_grad(bar, hidden, weight, ids, grads, device=device, **kwargs)
            assert rel_err(fused_weight, truth_weight) <= rel_err(bar_weight, truth_weight) * 1.05 + 1e-7, (seed, bar)
            assert rel_err(fused_hidden, truth_hidden) <= rel_err(bar_hidden, truth_hidden) * 1.05 + 1e-7, (seed, bar)
        if dtype == torch.float32:
            assert rel_err(fused_weight, truth_weight) < FP32_TOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_main_grad_gets_the_weight_gradient_added_and_the_weight_no_grad(dtype, device):
    """main_grad (megatron-core's fp32 `weight.main_grad`, random, not zeros): the backward adds
    each vocabulary slice of the weight gradient into it (5 slices here, the last one short) and
    the weight's .grad stays None. Against float64 (main_grad's start plus the true gradient), over
    seeds, with selected rows, a repeated id and |logits| / T in the hundreds: no worse than adding
    the gradient the walk writes without main_grad, in the layer's dtype (megatron without the
    fusion), and under 1e-5 in fp32; d hidden bitwise the one without main_grad."""
    num_rows, width, vocab, temperature = 12, 16, 301, 0.05
    rows = torch.tensor([11, 2, 3, 7, 0, 5, 8, 1])
    for seed in range(3):
        gen = torch.Generator().manual_seed(200 + seed)
        hidden, weight = random_layer(num_rows, width, vocab, dtype, gen, logit_scale=10.0, exact=dtype != torch.float32)
        ids = make_ids(rows.numel(), vocab, 3, gen)
        ids[:, 1] = ids[:, 0]
        kwargs = dict(temperature=temperature, with_entropy=True, rows=rows, chunk_rows=2)
        _, grads, (plain_hidden, plain_weight) = head_with_grad(linear_token_stats, hidden, weight, ids, device=device, **kwargs)
        _, _, (_, truth_weight) = head_with_grad(truth_head, hidden, weight, ids, grads, **kwargs)
        start = torch.randn(vocab, width, generator=gen) * truth_weight.abs().mean().float()
        layer_hidden, layer_weight = (t.to(device).requires_grad_(True) for t in (hidden, weight))
        main_grad = start.clone().to(device)
        stats = linear_token_stats(layer_hidden, layer_weight, ids.to(device), main_grad=main_grad, **to_device(kwargs, device))
        loss_of(stats, to_device(grads, device)).backward()
        assert layer_weight.grad is None
        assert torch.equal(layer_hidden.grad.cpu(), plain_hidden)
        truth = start.double() + truth_weight
        error = rel_err(main_grad.cpu(), truth)
        assert error <= rel_err(start + plain_weight.float(), truth) * 1.05 + 1e-7, seed
        if dtype == torch.float32:
            assert error < FP32_TOL


def test_cpu_without_interpreter_adds_into_main_grad_too(monkeypatch):
    """The unfused path (CPU outside the interpreter) honours main_grad as the fused one does."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    gen = torch.Generator().manual_seed(19)
    hidden, weight = random_layer(5, 8, 30, torch.float32, gen)
    ids = make_ids(5, 30, 2, gen)
    start = torch.randn(30, 8, generator=gen)
    main_grad, plain_weight = start.clone(), weight.clone().requires_grad_(True)
    weight.requires_grad_(True)
    stats = linear_token_stats(hidden, weight, ids, with_entropy=True, main_grad=main_grad)
    (stats.logp.sum() + stats.entropy.sum()).backward()
    plain = linear_token_stats(hidden, plain_weight, ids, with_entropy=True)
    (plain.logp.sum() + plain.entropy.sum()).backward()
    assert weight.grad is None
    assert torch.equal(main_grad, start + plain_weight.grad)


@pytest.mark.host_bookkeeping
def test_low_precision_backward_holds_one_slice_of_logits_and_no_weight_sized_sum(device):
    """bf16: the backward's peak beyond its returned gradients is one slice of logits (as many
    elements as the forward's chunk) and per-row bookkeeping, not the fp32 [V, H] sum over row
    chunks it once held (4 V H bytes, 8x the chunk here)."""
    gen = torch.Generator().manual_seed(5)
    num_rows, width, vocab, num_ids, chunk = 16, 16, 2000, 3, 4
    hidden, weight, ids = bf16_layer(num_rows, width, vocab, num_ids, gen, device)
    chunk_logits = chunk * vocab * 2
    upcast = chunk_logits // 2  # CPU only: the fp32 copies of `add_product_fp32`, a quarter of a chunk's elements
    bookkeeping = 16 * num_rows * (3 + num_ids) * 8 + num_rows * width * 4  # the rows' fp32 d hidden sums
    _, backward_peak = gradients_and_backward_peak(hidden, weight, ids, chunk)
    assert backward_peak <= chunk_logits + upcast + bookkeeping
    assert chunk_logits + upcast + bookkeeping < vocab * width * 4
