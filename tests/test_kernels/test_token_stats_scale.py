"""fp32 no worse than eager PyTorch at any logit scale: low temperatures, large and shifted logits.

At |logits| / T in the hundreds (ordinary for low-temperature sampling) a kernel that forms
`x / T - lse` rounds `lse` into every probability; eager PyTorch subtracts the row max first. Each
case compares the fused fp32 result and eager fp32 (`log_softmax(logits / T)`) with the float64
truth of the same fp32 inputs, worst element: fused within 2x eager's error plus 1e-7, for the
log-probs, the entropy and the logits gradient of `sum(w * logp) + sum(h * entropy)`; at tp = 1
through `token_stats`, at tp = 2 through the host functions on two vocabulary shards (the
combine of per-rank partials), and through the fused LM head. The ids include each row's argmax
and a repeated id. The interpreter runs these with RuntimeWarnings as errors (a masked lane that
multiplied 0 by inf once warned on ordinary input).
"""

import pytest
import torch
from device import to_cpu

from bench.baselines import eager_token_stats
from fusedrl.kernels import linear_token_stats, token_stats, token_stats_reference
from fusedrl.kernels.token_stats import combine_partials, logits_grad, row_partials

pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")

# (scale, shift, temperature): logits = randn * scale + shift, then / temperature
SCALES = [(1, 0, 1.0), (10, 0, 0.3), (100, 0, 1.0), (300, 0, 2.0), (1000, 0, 0.3), (3, 1000, 1.0), (3, -1000, 0.7)]
NUM_ROWS, VOCAB = 5, 1031  # V odd, over one trip of the kernel's tile and not a multiple of it


def _case(scale, shift, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(NUM_ROWS, VOCAB, generator=gen, dtype=torch.float64) * scale + shift).float()
    ids = torch.randint(0, VOCAB, (NUM_ROWS, 3), generator=gen)
    ids[:, 0] = logits.argmax(dim=1)  # the probability-1 column, where lse's rounding shows
    ids[:, 2] = ids[:, 1]  # a repeated id
    weights = torch.randn(NUM_ROWS, 3, generator=gen, dtype=torch.float64)
    entropy_weights = torch.randn(NUM_ROWS, generator=gen, dtype=torch.float64)
    return logits, ids, weights, entropy_weights


def _logp_entropy_grad(fn, logits, ids, weights, entropy_weights, temperature):
    """(logp, entropy, d loss / d logits) as float64, loss = sum(w logp) + sum(h entropy)."""
    leaf = logits.detach().requires_grad_(True)
    logp, entropy = fn(leaf, ids, temperature)[:2]
    loss = (logp.double() * weights).sum() + (entropy.double() * entropy_weights).sum()
    (grad,) = torch.autograd.grad(loss, leaf)
    return logp.double(), entropy.double(), grad.double()


def _truth_and_eager(logits, ids, weights, entropy_weights, temperature, exact_logits=None):
    """float64 truth (of `exact_logits`, default the fp32 logits themselves) and eager fp32."""

    def reference(x, i, t):
        return token_stats_reference(x, i, temperature=t, with_entropy=True)

    def eager(x, i, t):
        return eager_token_stats(x, i, t, True)

    exact_logits = logits.double() if exact_logits is None else exact_logits
    truth = _logp_entropy_grad(reference, exact_logits, ids, weights, entropy_weights, temperature)
    eager_fp32 = _logp_entropy_grad(eager, logits, ids, weights, entropy_weights, temperature)
    return truth, eager_fp32


def _assert_no_worse_than_eager(fused, eager, truth, case):
    for name, ours, theirs, exact in zip(("logp", "entropy", "grad"), fused, eager, truth):
        ours_err = float((ours.detach().cpu() - exact).abs().max())
        eager_err = float((theirs - exact).abs().max())
        assert ours_err <= 2 * eager_err + 1e-7, f"{case} {name}: fused {ours_err:.2e} vs eager fp32 {eager_err:.2e}"


@pytest.mark.parametrize("scale,shift,temperature", SCALES)
def test_token_stats_fp32_no_worse_than_eager(scale, shift, temperature, device):
    logits, ids, weights, entropy_weights = _case(scale, shift)
    truth, eager = _truth_and_eager(logits, ids, weights, entropy_weights, temperature)

    def fused(x, i, t):
        return token_stats(x, i, temperature=t, with_entropy=True)

    ours = _logp_entropy_grad(fused, logits.to(device), ids.to(device), weights.to(device), entropy_weights.to(device),
                              temperature)  # fmt: skip
    _assert_no_worse_than_eager(to_cpu(ours), eager, truth, (scale, shift, temperature))


@pytest.mark.parametrize("scale,shift,temperature", SCALES)
def test_two_rank_combine_fp32_no_worse_than_eager(scale, shift, temperature, device):
    """tp = 2 as the ranks compute it: each shard's partials, the combine of both, each shard's
    gradient from the combined softmax state; the second shard holds the argmax of some rows."""
    logits, ids, weights, entropy_weights = _case(scale, shift, seed=1)
    truth, eager = _truth_and_eager(logits, ids, weights, entropy_weights, temperature)
    shard = VOCAB // 2 + 1
    shards = [logits[:, :shard].contiguous().to(device), logits[:, shard:].contiguous().to(device)]
    starts = (0, shard)
    ids = ids.to(device)
    partials = torch.stack([row_partials(s, ids, None, v0, temperature, True) for s, v0 in zip(shards, starts)])
    logp, entropy, _, softmax_state = combine_partials(partials, temperature)
    # d loss / d logp and d loss / d entropy are the weights: the shards' gradients, concatenated
    grad = torch.cat([
        logits_grad(torch.empty_like(s), s, ids, None, softmax_state, weights.float().to(device),
                    entropy_weights.float().to(device), None, v0, temperature).cpu()
        for s, v0 in zip(shards, starts)
    ], dim=1)  # fmt: skip
    _assert_no_worse_than_eager((logp, entropy, grad), eager, truth, (scale, shift, temperature, "tp=2"))


@pytest.mark.parametrize("scale,shift,temperature", [(10, 0, 0.3), (300, 0, 2.0), (3, 1000, 1.0)])
def test_fused_lm_head_fp32_no_worse_than_eager(scale, shift, temperature, device):
    """The LM head's logits are hidden @ weight.T, whose fp32 GEMM rounds on both sides: the truth
    is the float64 product, and the fused chunks (3 rows, not dividing 5) must add no more error
    than eager's unchunked GEMM and log-softmax."""
    gen = torch.Generator().manual_seed(2)
    width = 16
    hidden = torch.randn(NUM_ROWS, width, generator=gen)
    weight = torch.randn(VOCAB, width, generator=gen) * (scale / (width - 1) ** 0.5)
    hidden[:, -1], weight[:, -1] = 1.0, float(shift)  # the last unit carries the shift
    logits = hidden @ weight.t()
    _, ids, weights, entropy_weights = _case(scale, shift, seed=3)
    ids[:, 0] = logits.argmax(dim=1)
    exact_logits = hidden.double() @ weight.double().t()  # eager's fp32 GEMM rounds too
    truth, eager = _truth_and_eager(logits, ids, weights, entropy_weights, temperature, exact_logits)

    leaf = hidden.to(device).requires_grad_(True)
    stats = linear_token_stats(leaf, weight.to(device), ids.to(device), temperature=temperature, with_entropy=True,
                               chunk_rows=3)  # fmt: skip
    loss = (stats.logp.double() * weights.to(device)).sum() + (stats.entropy.double() * entropy_weights.to(device)).sum()
    (hidden_grad,) = torch.autograd.grad(loss, leaf)
    # The hidden-state gradient is d loss / d logits @ weight: compare it with the truth's the same way.
    ours = (stats.logp.double(), stats.entropy.double(), hidden_grad.double())
    truth_hidden = truth[2] @ weight.double()
    eager_hidden = (eager[2].float() @ weight).double()
    _assert_no_worse_than_eager(to_cpu(ours), (eager[0], eager[1], eager_hidden), (truth[0], truth[1], truth_hidden),
                                (scale, shift, temperature, "lm head"))  # fmt: skip
