"""The K-draws kernel against its float64 inverse-CDF reference, the exact distribution, and its
contract.

Shapes are chosen to break things: V = 1, V below, at and just above one group (128) and one
block (2048, a streaming program), odd V, V past 128 blocks (a second step of the block search);
K below, at and above one search program (4) and several; -inf (masked) tokens, which must never
be drawn; rows that are not normalised; bf16, fp16 and fp64 log-probs;
probabilities as input; a subset of rows in scattered order; log-probs strided along V. For the
same uniforms the kernel must return the reference's ids, except where a uniform lies within
rounding of a CDF step (counted: none on these seeds). The kernels run on the `device` fixture's
device; the input checks, the same on every device, get CPU tensors.
"""

import math

import pytest
import torch
from device import to_device
from sm90 import compile_for_hopper, shipped

from fusedrl.kernels import token_draws, token_draws_reference

SEEDS = (0, 1, 2)
# How close (relative to the row's total) a target may lie to a CDF step of the reference for
# the kernel's fp32 exp (one rounding from the reference's) to cross it.
STEP_ROUNDING = 1e-6


def make_logprobs(num_rows, vocab, seed, dtype=torch.float32, masked=True, scale=3.0):
    """Random log-softmax rows at a logit scale of `scale`; with `masked`, every third token of
    row 0 and all but the last token of row 1 (when there are 2 rows) are -inf."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, vocab, generator=gen, dtype=torch.float64) * scale
    if masked and vocab > 1:
        logits[0, ::3] = float("-inf")
        if num_rows > 1:
            logits[1, :-1] = float("-inf")
    return torch.log_softmax(logits, dim=-1).to(dtype)


def uniforms_for(num_rows, num_draws, seed):
    return torch.rand(num_rows, num_draws, generator=torch.Generator().manual_seed(seed + 100), dtype=torch.float64)


def near_a_step(logprobs, uniforms, rows, probs=False) -> torch.Tensor:
    """[n, K] whether each target lies within STEP_ROUNDING (of the total) of a reference CDF step."""
    weights = logprobs.index_select(0, rows).float()
    cdf = torch.cumsum((weights if probs else weights.exp()).double(), dim=1)
    targets = uniforms * cdf[:, -1:]
    distance = (cdf[:, None, :] - targets[:, :, None]).abs().min(dim=2).values
    return distance <= STEP_ROUNDING * cdf[:, -1:]


def assert_reference_ids(logprobs, uniforms, device, rows=None, probs=False):
    """The kernel's ids on `device` equal the reference's but near a step; never a -inf token."""
    index = torch.arange(logprobs.shape[0]) if rows is None else rows
    expected = token_draws_reference(logprobs, uniforms, index, probs)
    moved_rows = None if rows is None else rows.to(device)
    ids = token_draws(logprobs.to(device), uniforms.to(device), rows=moved_rows, logprobs_are_probs=probs).cpu()
    assert ids.shape == expected.shape and ids.dtype == torch.int64
    differ = ids != expected
    near = near_a_step(logprobs, uniforms, index, probs)
    assert not (differ & ~near).any(), f"{int((differ & ~near).sum())} draws differ away from any CDF step"
    assert int(differ.sum()) == 0, f"{int(differ.sum())} draws differ (all within rounding of a step)"
    drawn = logprobs.index_select(0, index).float().gather(1, ids)
    assert not (drawn == (0.0 if probs else float("-inf"))).any(), "a token without mass was drawn"


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(
    "rows,vocab,draws",
    [(3, 1, 5), (4, 7, 1), (5, 128, 16), (6, 129, 17), (3, 2049, 33), (2, 4099, 4), (1, 128 * 2048 + 7, 5)],
)
def test_fp32_ids_are_the_float64_inverse_cdf(device, rows, vocab, draws, seed):
    logprobs = make_logprobs(rows, vocab, seed)
    assert_reference_ids(logprobs, uniforms_for(rows, draws, seed), device)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_low_precision_and_float64_log_probs(device, dtype):
    for seed in SEEDS:
        logprobs = make_logprobs(4, 300, seed, dtype)
        assert_reference_ids(logprobs, uniforms_for(4, 20, seed), device)


def test_probabilities_unnormalised_rows_and_a_scattered_subset_of_rows(device):
    for seed in SEEDS:
        logprobs = make_logprobs(6, 1000, seed, scale=100.0)  # logits in the hundreds: peaked rows
        probs = logprobs.double().exp().float() * 3.5  # not normalised: the draws follow p / sum(p)
        rows = torch.tensor([4, 0, 2])
        assert_reference_ids(probs, uniforms_for(3, 9, seed), device, rows=rows, probs=True)
        assert_reference_ids(logprobs - 7.0, uniforms_for(3, 9, seed), device, rows=rows)


def test_log_probs_strided_along_the_vocabulary(device):
    wide = make_logprobs(3, 400, 0, masked=False)
    assert_reference_ids(wide[:, ::2], uniforms_for(3, 8, 0), device)


def chi_square_rows(vocab):
    """Two rows over `vocab` tokens: half of row 0 masked, row 1 unmasked; logits at scale 1.5."""
    logprobs = make_logprobs(2, vocab, 5, scale=1.5)
    logprobs[1] = make_logprobs(1, vocab, 6, masked=False, scale=1.5)[0]
    logprobs[0, 1::2] = float("-inf")
    return torch.log_softmax(logprobs.double(), dim=-1).float()


def assert_draws_follow(logprobs, ids):
    """Pearson's chi-square of each row's draws against its exact probabilities (cells expected
    under 5 pooled into one), at a bound (p > 1e-6) that a correct sampler misses once in a
    million runs; and no masked token drawn."""
    for row in range(logprobs.shape[0]):
        p = logprobs[row].double().exp()
        counts = torch.bincount(ids[row], minlength=p.numel()).double()
        assert counts[p == 0].sum() == 0, "a masked token was drawn"
        expected = p * ids.shape[1]
        pooled = expected >= 5  # the tail pooled into one cell
        observed = torch.cat([counts[pooled], counts[~pooled & (p > 0)].sum().reshape(1)])
        wanted = torch.cat([expected[pooled], expected[~pooled & (p > 0)].sum().reshape(1)])
        keep = wanted > 0
        statistic = float(((observed[keep] - wanted[keep]) ** 2 / wanted[keep]).sum())
        dof = int(keep.sum()) - 1
        assert chi_square_p_value(statistic, dof) > 1e-6, (row, statistic, dof)


def test_draws_follow_the_distribution_and_never_a_masked_token(device):
    """512 kernel draws per row at V = 40 (fixed seeds)."""
    logprobs = chi_square_rows(40)
    assert_draws_follow(logprobs, token_draws(logprobs.to(device), uniforms_for(2, 512, 40).to(device)).cpu())


@pytest.mark.parametrize("vocab", [600, 151936])
def test_reference_draws_follow_the_distribution_and_never_a_masked_token(vocab):
    """4096 draws per row of the float64 reference, up to a real vocabulary; the kernel returns
    the reference's ids for the same uniforms (the tests above, and the next on these rows)."""
    logprobs = chi_square_rows(vocab)
    assert_draws_follow(logprobs, token_draws_reference(logprobs, uniforms_for(2, 4096, vocab), torch.arange(2)))


def test_ids_on_the_chi_square_rows_are_the_references(device):
    assert_reference_ids(chi_square_rows(600), uniforms_for(2, 64, 600), device)


def chi_square_p_value(statistic: float, dof: int) -> float:
    """Upper tail of the chi-square distribution (Wilson-Hilferty: ample at dof >= 10)."""
    z = ((statistic / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_same_inputs_give_bitwise_identical_ids(device):
    logprobs, uniforms = to_device((make_logprobs(5, 3000, 3), uniforms_for(5, 40, 3)), device)
    assert torch.equal(token_draws(logprobs, uniforms), token_draws(logprobs, uniforms))


def test_a_row_without_mass_is_named(device):
    logprobs = make_logprobs(3, 50, 0)
    logprobs[2] = float("-inf")
    with pytest.raises(ValueError, match="logprobs row 2 has no finite, positive probability mass"):
        token_draws(logprobs.to(device), uniforms_for(3, 4, 0).to(device))
    logprobs[2] = float("nan")
    with pytest.raises(ValueError, match="logprobs row 2 has no finite"):
        token_draws(logprobs.to(device), uniforms_for(3, 4, 0).to(device))


def test_no_rows_or_no_draws_give_empty_ids(device):
    logprobs = make_logprobs(3, 50, 0).to(device)
    assert token_draws(logprobs, torch.empty(3, 0, dtype=torch.float64, device=device)).shape == (3, 0)
    empty_rows = torch.empty(0, dtype=torch.long, device=device)
    assert token_draws(logprobs, torch.empty(0, 4, dtype=torch.float64, device=device), rows=empty_rows).shape == (0, 4)


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(uniforms=torch.full((3, 2), 1.0, dtype=torch.float64)), r"uniforms must lie in \(0, 1\), got uniforms\[0, 0\] = 1.0"),
        (dict(uniforms=torch.zeros(3, 2, dtype=torch.float64)), r"uniforms\[0, 0\] = 0.0"),
        (dict(uniforms=torch.rand(2, 2, dtype=torch.float64)), r"one row per drawn row \(3\), got shape \(2, 2\)"),
        (dict(uniforms=torch.ones(3, 2, dtype=torch.long)), "uniforms must be a floating tensor"),
        (dict(logprobs=torch.zeros(3, 10, dtype=torch.long)), "logprobs must be one of"),
        (dict(logprobs=torch.zeros(3, 0)), "logprobs must have at least one column"),
        (dict(logprobs=torch.zeros(10)), "logprobs must be 2-D"),
        (dict(rows=torch.tensor([0, 3, 1])), r"rows must lie in \[0, 3\), got rows\[1\] = 3"),
        (dict(rows=torch.tensor([1, 1, 0])), "rows must be distinct"),
    ],
)
def test_bad_input_is_named(change, message):
    arguments = dict(logprobs=make_logprobs(3, 10, 0), uniforms=uniforms_for(3, 2, 0), rows=None)
    arguments.update(change)
    with pytest.raises(ValueError, match=message):
        token_draws(arguments.pop("logprobs"), arguments.pop("uniforms"), **arguments)


def test_meta_tensors_get_the_ids_shape():
    logprobs = torch.empty(4, 151936, device="meta")
    ids = token_draws(logprobs, torch.empty(2, 8, dtype=torch.float64, device="meta"), rows=torch.empty(2, dtype=torch.long, device="meta"))
    assert ids.shape == (2, 8) and ids.dtype == torch.int64 and ids.device.type == "meta"


def test_kernels_compile_for_hopper_streaming_without_spills():
    rows = compile_for_hopper(shipped("token_draws", lambda kwargs: True))
    assert {row["kernel"] for row in rows} == {"_group_sums_kernel", "_token_draws_kernel"}
    assert all(row["local_bytes"] == 0 for row in rows), rows
    streaming = [row for row in rows if row["kernel"] == "_group_sums_kernel"]
    assert all(row["widest_load_bits"] == 128 for row in streaming), streaming
