"""Parity of the fused token-statistics kernel with the float64 eager reference (tp = 1).

Shapes are chosen to break things: V = 1, a prime V below the block, V just above the block
(4099 > 4096), J = 9, 33 and 129 with repeated ids and ids equal to the sampled token, selected rows, masked
rows full of NaN that must never be read. Every kernel call runs on the `device` fixture's device;
the float64 truth is computed on CPU.
"""

import pytest
import torch
from bench_package import import_bench
from numerics import assert_no_worse_than, rel_err
from tiers import with_full_tier
from token_stats_cases import loss_of, make_ids, random_logits, run_with_grad, upstream_grads

import_bench()
from bench.baselines import eager_token_stats as eager_same_dtype  # noqa: E402

from fusedrl.kernels import TokenStats, token_stats, token_stats_reference

FP32_TOL = 1e-5


CASES = [
    # (vocab, num_ids, temperature, with_entropy): every V with J = 1 and J = 9 somewhere, both
    # temperatures, entropy on and off
    (1, 1, 1.0, True),
    (1, 9, 0.7, False),
    (7, 9, 1.0, True),
    (7, 1, 0.7, True),
    (1000, 1, 1.0, False),
    (1000, 9, 0.7, True),
    (4099, 9, 1.0, True),
    (4099, 1, 0.7, False),
    (9001, 9, 0.7, True),
    (9001, 33, 1.0, False),  # a top-p replay support: many ids spread over several blocks
    (4099, 129, 0.7, True),  # slime's score centering: the sampled token and a top-128 head; repeats across id chunks
]
# The full tier: every combination of these axes (V = 1024: exactly one block; 32771: a prime
# over several blocks; J = 2: one draw).
FULL_AXES = ((1, 7, 127, 1024, 4097, 4099, 9001, 32771), (1, 2, 9, 33, 129), (0.7, 1.0), (True, False))


@pytest.mark.parametrize("vocab,num_ids,temperature,with_entropy", with_full_tier(CASES, *FULL_AXES))
def test_fp32_forward_and_backward_match_float64(vocab, num_ids, temperature, with_entropy, device):
    gen = torch.Generator().manual_seed(vocab * 31 + num_ids)
    logits = random_logits(24, vocab, torch.float32, gen)
    ids = make_ids(24, vocab, num_ids, gen)
    kwargs = dict(temperature=temperature, with_entropy=with_entropy)
    stats, grads, grad = run_with_grad(token_stats, logits, ids, device=device, **kwargs)
    truth, _, truth_grad = run_with_grad(token_stats_reference, logits.double(), ids, grads, **kwargs)
    assert (stats.entropy is None) == (not with_entropy)
    for name, out, ref in zip(truth._fields, stats, truth):
        if ref is not None:
            assert out.dtype == torch.float32
            assert rel_err(out, ref) < FP32_TOL, name
    assert rel_err(grad, truth_grad) < FP32_TOL


@pytest.mark.parametrize("used", TokenStats._fields)
def test_a_loss_of_one_output_alone_gets_the_exact_gradient(used, device):
    """Outputs a loss does not use reach the backward as None (no zeros filled for them)."""
    gen = torch.Generator().manual_seed(11)
    logits, ids = random_logits(16, 1000, torch.float32, gen), make_ids(16, 1000, 3, gen)
    kwargs = dict(temperature=0.7, with_entropy=True)
    grads = upstream_grads(token_stats_reference(logits.double(), ids, **kwargs), gen)
    grads = [grad if name == used else None for name, grad in zip(TokenStats._fields, grads)]
    _, _, grad = run_with_grad(token_stats, logits, ids, grads, device=device, **kwargs)
    _, _, truth = run_with_grad(token_stats_reference, logits.double(), ids, grads, **kwargs)
    assert rel_err(grad, truth) < FP32_TOL


LOW_PRECISION = [(dtype, vocab) for vocab in (7, 4099) for dtype in (torch.bfloat16, torch.float16)]


@pytest.mark.parametrize(
    "dtype,vocab", with_full_tier(LOW_PRECISION, (torch.bfloat16, torch.float16), (7, 127, 1024, 4099, 32771))
)
def test_low_precision_no_worse_than_eager(dtype, vocab, device):
    """Outputs and the logits gradient no worse than eager torch in the logits' dtype, over 5 seeds
    (numerics.assert_no_worse_than, bar 1.05: the kernel's one rounding of an fp32 gradient
    against eager's several; one seed's ratio moves with the machine's low-precision arithmetic)."""
    per_seed = {name: [] for name in (*TokenStats._fields, "grad")}
    for seed in range(5):
        gen = torch.Generator().manual_seed(vocab + 1000 * seed)
        logits = random_logits(24, vocab, dtype, gen)
        ids = make_ids(24, vocab, 9, gen)
        kwargs = dict(temperature=0.7, with_entropy=True)
        stats, grads, grad = run_with_grad(token_stats, logits, ids, device=device, **kwargs)
        truth, _, truth_grad = run_with_grad(token_stats_reference, logits.double(), ids, grads, **kwargs)
        eager, _, eager_grad = run_with_grad(
            lambda x, i, **kw: eager_same_dtype(x, i, kw["temperature"], True), logits, ids, grads, device=device,
            **kwargs,
        )  # fmt: skip
        assert grad.dtype == dtype
        for name, out, ref, base in zip(per_seed, (*stats, grad), (*truth, truth_grad), (*eager, eager_grad)):
            per_seed[name].append((rel_err(out, ref), rel_err(base, ref), 1e-6))
    for name, errors in per_seed.items():
        assert_no_worse_than(errors, f"{dtype} V={vocab} {name}: fused vs eager in that dtype", bar=1.05)


def test_rows_reads_only_selected_rows_and_zeroes_the_rest(device):
    gen = torch.Generator().manual_seed(3)
    vocab = 4099
    logits = random_logits(20, vocab, torch.float32, gen)
    rows = torch.tensor([17, 2, 3, 11, 0])
    unselected = torch.ones(20, dtype=torch.bool)
    unselected[rows] = False
    poisoned = logits.clone()
    poisoned[unselected] = float("nan")
    ids = make_ids(rows.numel(), vocab, 9, gen)
    kwargs = dict(temperature=0.7, with_entropy=True, rows=rows)
    stats, grads, grad = run_with_grad(token_stats, poisoned, ids, device=device, **kwargs)
    truth, _, truth_grad = run_with_grad(token_stats_reference, logits.double(), ids, grads, **kwargs)
    for out, ref in zip(stats, truth):
        assert out.shape[0] == rows.numel()
        assert rel_err(out, ref) < FP32_TOL
    assert torch.equal(grad[unselected], torch.zeros_like(grad[unselected]))
    assert rel_err(grad, truth_grad) < FP32_TOL


def test_empty_rows_give_empty_outputs_and_zero_gradient(device):
    logits = random_logits(6, 50, torch.float32, torch.Generator().manual_seed(0))
    stats, _, grad = run_with_grad(
        token_stats, logits, torch.zeros(0, 3, dtype=torch.long), rows=torch.zeros(0, dtype=torch.long), device=device
    )
    assert stats.logp.shape == (0, 3)
    assert torch.equal(grad, torch.zeros_like(grad))


def test_slime_layout_1_t_v_and_strided_rows(device):
    """slime passes [1, T, V_padded]; any row stride is accepted (here a column slice)."""
    gen = torch.Generator().manual_seed(5)
    wide = random_logits(16, 1200, torch.float32, gen)
    logits = wide.to(device)[:, :1000].unsqueeze(0)  # sliced where it lives: a copy would be contiguous
    ids = make_ids(16, 1000, 3, gen)
    stats, grads, grad = run_with_grad(token_stats, logits, ids, device=device, with_entropy=True)
    truth, _, truth_grad = run_with_grad(
        token_stats_reference, wide[:, :1000].unsqueeze(0).double(), ids, grads, with_entropy=True
    )
    assert grad.shape == logits.shape
    for out, ref in zip(stats, truth):
        assert rel_err(out, ref) < FP32_TOL
    assert rel_err(grad, truth_grad) < FP32_TOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inplace_backward_writes_the_same_gradient_into_logits(dtype, device):
    gen = torch.Generator().manual_seed(9)
    base = random_logits(12, 777, dtype, gen)
    ids = make_ids(12, 777, 9, gen)
    rows = torch.tensor([1, 4, 5, 9])
    kwargs = dict(temperature=0.7, with_entropy=True, rows=rows)
    _, grads, expected = run_with_grad(token_stats, base.clone(), ids[:4], device=device, **kwargs)
    ids, kwargs["rows"] = ids[:4].to(device), rows.to(device)

    buffer = base.clone().to(device).requires_grad_(True)
    stats = token_stats(buffer, ids, inplace_backward=True, **kwargs)
    (grad,) = torch.autograd.grad(loss_of(stats, grads), buffer)
    assert grad.data_ptr() == buffer.data_ptr()
    assert torch.equal(grad.cpu(), expected)

    batched = base.clone()[None].to(device).requires_grad_(True)  # slime's [1, T, V]: no copy either
    stats = token_stats(batched, ids, inplace_backward=True, **kwargs)
    (grad,) = torch.autograd.grad(loss_of(stats, grads), batched)
    assert grad.data_ptr() == batched.data_ptr()
    assert torch.equal(grad[0].cpu(), expected)


def test_centered_score_gradient_has_no_softmax_leakage(device):
    """d(scores_0 - mean_k scores_k) is exactly (e_a - mean_k e_vk) / tau: no lse, no softmax."""
    gen = torch.Generator().manual_seed(11)
    vocab, num_draws, tau = 300, 4, 0.7
    logits = random_logits(10, vocab, torch.float32, gen).to(device).requires_grad_(True)
    ids = make_ids(10, vocab, 1 + num_draws, gen)
    stats = token_stats(logits, ids.to(device), temperature=tau)
    centered = stats.scores[:, 0] - stats.scores[:, 1:].mean(dim=1)
    (grad,) = torch.autograd.grad(centered.sum(), logits)
    grad = grad.cpu()
    expected = torch.zeros(10, vocab)
    expected.scatter_add_(1, ids[:, :1], torch.ones(10, 1))
    expected.scatter_add_(1, ids[:, 1:], torch.full((10, num_draws), -1.0 / num_draws))
    assert torch.equal(grad, (expected.float() * (1.0 / tau)).float())


def test_same_inputs_give_bitwise_identical_results(device):
    gen = torch.Generator().manual_seed(13)
    logits = random_logits(16, 4099, torch.float32, gen)
    ids = make_ids(16, 4099, 9, gen)
    first = run_with_grad(token_stats, logits, ids, device=device, with_entropy=True, temperature=0.7)
    second = run_with_grad(token_stats, logits, ids, device=device, with_entropy=True, temperature=0.7)
    for a, b in zip(first[0], second[0]):
        assert torch.equal(a, b)
    assert torch.equal(first[2], second[2])


def test_cpu_without_interpreter_takes_the_reference(monkeypatch):
    """CPU only, whatever the test device: the CPU dispatch outside the interpreter."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    gen = torch.Generator().manual_seed(17)
    logits = random_logits(5, 30, torch.float32, gen)
    ids = make_ids(5, 30, 2, gen)
    fused = token_stats(logits, ids, with_entropy=True)
    reference = token_stats_reference(logits, ids, with_entropy=True)
    for a, b in zip(fused, reference):
        assert torch.equal(a, b)
