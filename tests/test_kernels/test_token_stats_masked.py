"""-inf-safe and NaN-honest math, in the kernels and the float64 reference alike.

Masked vocabularies (grammar-constrained decoding, banned tokens, -inf padding) give the right
finite logp, entropy and gradient, exactly 0 at -inf columns: a first block all -inf, the only
finite column in a later block, a TP rank whose whole shard is -inf. A NaN logit poisons its own
row only; +inf and all -inf rows are NaN (documented in `token_stats`). The kernels run on the
`device` fixture's device, the float64 reference on CPU.
"""

import pytest
import torch
from device import to_cpu, to_device
from numerics import rel_err

from fusedrl.kernels import token_stats, token_stats_reference
from fusedrl.kernels.token_stats import all_rank_partials, combine_partials, logits_grad, row_partials
from fusedrl.kernels._tp import TensorParallel

# The interpreter evaluates both sides of tl.where in NumPy, which warns about the discarded one.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

FP32_TOL = 1e-5
NEG_INF = float("-inf")


def masked_logits(num_rows, vocab, generator, keep=0.3):
    """Random logits with about (1 - keep) of each row set to -inf, the ids' columns kept finite."""
    logits = torch.randn(num_rows, vocab, generator=generator) * 3
    masked = torch.rand(num_rows, vocab, generator=generator) > keep
    logits[masked] = NEG_INF
    return logits


def finite_ids(logits, num_ids, generator):
    """ids drawn among each row's finite columns."""
    weights = torch.isfinite(logits).double()
    return torch.multinomial(weights, num_ids, replacement=True, generator=generator)


def value_and_grad(fn, logits, ids, grad_of=("logp", "entropy", "scores"), device=None, **kwargs):
    """fn's outputs and the logits gradient of a random combination of them, on CPU; with a
    `device`, fn runs on copies of logits and ids moved there."""
    leaf = logits.detach().clone()
    if device is not None:
        leaf, ids = leaf.to(device), ids.to(device)
    leaf.requires_grad_(True)
    stats = fn(leaf, ids, **kwargs)
    gen = torch.Generator().manual_seed(3)
    weights = [torch.randn(getattr(stats, name).shape, generator=gen).double() for name in grad_of]
    loss = sum((getattr(stats, name).double() * w.to(leaf.device)).sum() for name, w in zip(grad_of, weights))
    (grad,) = torch.autograd.grad(loss, leaf)
    return to_cpu(stats), grad.cpu()


def assert_matches_reference(logits, ids, device, grad_of=("logp", "entropy", "scores"), **kwargs):
    stats, grad = value_and_grad(token_stats, logits, ids, grad_of, device, with_entropy=True, **kwargs)
    truth, truth_grad = value_and_grad(token_stats_reference, logits.double(), ids, grad_of, with_entropy=True, **kwargs)
    for out, ref in zip(stats, truth):
        assert torch.isfinite(out).all() and torch.isfinite(ref).all()
        assert rel_err(out, ref) < FP32_TOL
    assert torch.isfinite(grad).all() and torch.isfinite(truth_grad).all()
    assert rel_err(grad, truth_grad) < FP32_TOL
    torch.testing.assert_close(grad.double(), truth_grad, rtol=1e-5, atol=1e-6)
    minus_inf = logits == NEG_INF
    assert (grad[minus_inf] == 0).all() and (truth_grad[minus_inf] == 0).all()


@pytest.mark.parametrize("vocab", [7, 1000, 9001])
def test_random_masks_give_finite_values_and_zero_gradient_at_masked_columns(vocab, device):
    gen = torch.Generator().manual_seed(vocab)
    logits = masked_logits(16, vocab, gen)
    logits[:, 0] = 0.5  # at least one finite column per row
    ids = finite_ids(logits, 3, gen)
    assert_matches_reference(logits, ids, device, temperature=0.7)


def test_first_block_all_minus_inf_and_single_finite_column_in_a_later_block(device):
    gen = torch.Generator().manual_seed(1)
    vocab = 9001  # three 4096-column blocks
    logits = torch.randn(4, vocab, generator=gen)
    logits[0, :5000] = NEG_INF  # the first block (and part of the second) all -inf
    logits[1, :] = NEG_INF
    logits[1, 8500] = 1.25  # the only finite column, in the last block
    logits[2, :4096] = NEG_INF
    logits[2, 4096:8192] = NEG_INF  # two whole blocks -inf, the rest finite
    ids = torch.tensor([[6000, 5000], [8500, 8500], [9000, 8200], [0, 1]])
    assert_matches_reference(logits, ids, device)
    stats = to_cpu(token_stats(logits.to(device), ids.to(device), with_entropy=True))
    assert stats.logp[1].eq(0).all() and stats.entropy[1] == 0


def test_entropy_on_logp_only_backpropagated_gives_zero_gradient_at_masked_columns(device):
    gen = torch.Generator().manual_seed(2)
    logits = masked_logits(12, 777, gen)
    logits[:, 5] = 0.0
    ids = finite_ids(logits, 1, gen)
    assert_matches_reference(logits, ids, device, grad_of=("logp",))


def test_tp_rank_with_an_all_minus_inf_shard(device):
    """Two vocabulary shards combined as TP ranks would be: shard 1 is -inf in every row."""
    gen = torch.Generator().manual_seed(4)
    shard, num_rows = 600, 6
    full = torch.randn(num_rows, 2 * shard, generator=gen) * 2
    full[:, shard:] = NEG_INF
    full[0, :shard] = NEG_INF  # row 0: shard 0 all -inf, shard 1 holds the finite columns
    full[0, shard + 17] = 0.3
    full[0, shard + 400] = -1.0
    ids = finite_ids(full, 2, gen)
    temperature = 0.9
    shards = [full[:, :shard].contiguous().to(device), full[:, shard:].contiguous().to(device)]
    partials = torch.stack([
        row_partials(s, ids.to(device), None, r * shard, temperature, True) for r, s in enumerate(shards)
    ]).cpu()
    logp, entropy, scores, softmax_state = combine_partials(partials, temperature)
    truth, truth_grad = value_and_grad(token_stats_reference, full.double(), ids, with_entropy=True, temperature=temperature)
    assert torch.isfinite(softmax_state).all() and torch.isfinite(entropy).all()
    assert rel_err(logp, truth.logp) < FP32_TOL
    assert rel_err(entropy, truth.entropy) < FP32_TOL
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(t.shape, generator=gen) for t in truth]
    per_row = to_device((ids, softmax_state, grads), device)
    grad = torch.cat([
        logits_grad(torch.empty_like(s), s, per_row[0], None, per_row[1], *per_row[2], r * shard, temperature).cpu()
        for r, s in enumerate(shards)
    ], dim=1)
    assert torch.isfinite(grad).all() and (grad[full == NEG_INF] == 0).all()
    assert rel_err(grad, truth_grad) < FP32_TOL
    assert all_rank_partials(partials[0], TensorParallel(None, 1, 0)).shape == (1,) + partials[0].shape


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), "all -inf"])
@pytest.mark.parametrize("fn", [token_stats, token_stats_reference])
def test_a_row_without_a_distribution_is_nan_and_poisons_only_itself(fn, poison, device):
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(5, 4099, generator=gen)
    ids = torch.randint(0, 4099, (5, 2), generator=gen)
    bad = logits.clone()
    if poison == "all -inf":
        bad[2] = NEG_INF
    else:
        bad[2, 4097] = poison
    device = device if fn is token_stats else None  # the reference: on CPU
    stats, grad = value_and_grad(fn, bad, ids, device=device, with_entropy=True)
    clean, clean_grad = value_and_grad(fn, logits, ids, device=device, with_entropy=True)
    assert stats.logp[2].isnan().all() and stats.entropy[2].isnan()
    assert grad[2].isnan().any()
    others = [0, 1, 3, 4]
    assert torch.equal(stats.logp[others], clean.logp[others])
    assert torch.equal(stats.entropy[others], clean.entropy[others])
    assert torch.equal(grad[others], clean_grad[others])
    assert torch.equal(stats.scores[others], clean.scores[others])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_masked_rows_stay_finite_with_exact_zero_gradient(dtype, device):
    gen = torch.Generator().manual_seed(6)
    logits = masked_logits(8, 4099, gen).to(dtype)
    logits[:, :4096] = NEG_INF
    logits[:, 4097] = 1.0
    ids = finite_ids(logits.float(), 2, gen)
    stats, grad = value_and_grad(token_stats, logits, ids, device=device, with_entropy=True)
    truth, _ = value_and_grad(token_stats_reference, logits.double(), ids, with_entropy=True)
    assert torch.isfinite(grad.float()).all() and (grad[logits == NEG_INF] == 0).all()
    for out, ref in zip(stats, truth):
        assert rel_err(out, ref) < 1e-5
