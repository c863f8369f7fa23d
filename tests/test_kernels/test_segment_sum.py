"""Parity of the segmented masked-sum kernel with its float64 eager reference, and its contract.

Shapes are chosen to break things: N not a multiple of the row block, more row blocks than the
final reduction adds per step (two loop steps), C above the channel block (two channel blocks),
strided values, empty and fully masked segments, segments in scattered order, N = 0. The kernels
run on the `device` fixture's device, the float64 reference on CPU; the input checks, the same on
every device, get CPU tensors.
"""

import math

import pytest
import torch
from device import to_device
from numerics import rel_err
from sm90 import Launch, compile_for_hopper
from tiers import with_full_tier

from fusedrl.kernels.reference import segment_sum_reference
from fusedrl.kernels.segment_sum import segment_sum

FP32_TOL = 1e-5


def make_inputs(num_rows, num_channels, num_segments, seed, dtype=torch.float32, contiguous_segments=False):
    """Random values, a partly masked integer mask, segment ids with an empty segment (the last)
    and a fully masked one (segment 0), and denominators in (0.5, 40)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (num_rows,) if num_channels is None else (num_rows, num_channels)
    values = (torch.randn(shape, generator=gen, dtype=torch.float64) * 3).to(dtype)
    mask = (torch.rand(num_rows, generator=gen) > 0.3).int()
    used = max(num_segments - 1, 1)
    segments = torch.randint(0, used, (num_rows,), generator=gen)
    if contiguous_segments:
        segments = segments.sort().values
    mask[segments == 0] = 0
    denominators = torch.rand(num_segments, generator=gen, dtype=torch.float64) * 40 + 0.5
    return values, mask, segments, denominators


def value_and_grad(fn, values, mask, segments, denominators, upstream_seed=3, device=None):
    """fn's output and the values gradient of a random combination of it, on CPU; with a `device`,
    fn runs on copies of the inputs moved there."""
    if device is not None:
        values, mask, segments, denominators = to_device((values, mask, segments, denominators), device)
    values = values.detach().requires_grad_(True)
    out = fn(values, mask, segments, denominators)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(upstream_seed), dtype=torch.float64)
    (grad,) = torch.autograd.grad((out.double() * upstream.to(out.device)).sum(), values)
    return out.cpu(), grad.cpu()


SHAPES = [
    # (N, C, S): C None means 1-D values
    (300, None, 7),
    (1, 1, 1),
    (1029, 3, 11),  # 512-row tiles for C = 3: three tiles, the last nearly empty
    (4400, 16, 9),  # 128-row tiles, 8 a program: 5 partials, the last of 3 tiles
    (333, 20, 5),  # two channel blocks, the second partial
]
# The full tier: every combination of these axes (N around the 256- and 1024-row blocks, C = None,
# 1, 16 and 17 across the channel blocks, one segment to more segments than rows of a block).
FULL_AXES = ((1, 255, 1029, 4400, 70001), (None, 1, 3, 16, 17, 20), (1, 9, 300))


@pytest.mark.parametrize("num_rows,num_channels,num_segments", with_full_tier(SHAPES, *FULL_AXES))
def test_fp32_matches_float64_reference(num_rows, num_channels, num_segments, device):
    inputs = make_inputs(num_rows, num_channels, num_segments, seed=num_rows)
    out, grad = value_and_grad(segment_sum, *inputs, device=device)
    truth_inputs = (inputs[0].double(),) + inputs[1:]
    truth, truth_grad = value_and_grad(segment_sum_reference, *truth_inputs)
    assert out.dtype == torch.float32 and out.shape == truth.shape
    assert rel_err(out, truth) < FP32_TOL
    assert grad.dtype == torch.float32
    assert rel_err(grad, truth_grad) < FP32_TOL


def test_float64_is_exact_to_float64_rounding(device):
    inputs = make_inputs(1029, 3, 11, seed=5, dtype=torch.float64)
    out, grad = value_and_grad(segment_sum, *inputs, device=device)
    truth, truth_grad = value_and_grad(segment_sum_reference, *inputs)
    assert out.dtype == torch.float64
    assert rel_err(out, truth) < 1e-13
    assert rel_err(grad, truth_grad) < 1e-13


def eager_same_dtype(values, mask, segments, denominators):
    """The eager per-sample formula carried out in the values' own dtype: the bar for low precision."""
    matrix = values if values.dim() == 2 else values.unsqueeze(1)
    masked = matrix * mask.to(values.dtype).unsqueeze(1)
    per_segment = masked.new_zeros((denominators.numel(), matrix.shape[1])).index_add(0, segments, masked)
    return (per_segment / denominators.to(values.dtype).unsqueeze(1)).sum(0).reshape(values.shape[1:])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_no_worse_than_eager_in_that_dtype(dtype, device):
    values, mask, segments, denominators = make_inputs(700, 4, 6, seed=11, dtype=dtype)
    out, grad = value_and_grad(segment_sum, values, mask, segments, denominators, device=device)
    truth, truth_grad = value_and_grad(segment_sum_reference, values.double(), mask, segments, denominators)
    eager = eager_same_dtype(values, mask, segments, denominators)
    assert out.dtype == torch.float32  # accumulated and returned in fp32
    assert rel_err(out, truth) <= rel_err(eager, truth) + 1e-6
    assert grad.dtype == dtype
    # dx = g * m / D rounded once to the values' dtype
    assert rel_err(grad, truth_grad) <= torch.finfo(dtype).eps


def test_strided_values_read_in_place(device):
    base, mask, segments, denominators = make_inputs(257, 6, 4, seed=2)
    strided = base.t().contiguous().t()[:, ::2]  # column-major, every other column
    on_device = base.to(device).t().contiguous().t()[:, ::2]  # made where it lives: a copy would be contiguous
    out, grad = value_and_grad(segment_sum, on_device, mask, segments, denominators, device=device)
    truth, truth_grad = value_and_grad(segment_sum_reference, strided.double(), mask, segments, denominators)
    assert rel_err(out, truth) < FP32_TOL and rel_err(grad, truth_grad) < FP32_TOL


def test_a_column_slice_of_a_wider_tensor_is_read_in_place(device):
    """Whole aligned rows of channels with a row stride past C (a [:, :32] slice of [N, 48]):
    the vector-access path, two channel blocks, and 18 programs' partials, more than one step of
    the final reduction."""
    wide, mask, segments, denominators = make_inputs(17500, 48, 40, seed=5)
    sliced = wide.to(device)[:, :32]
    out, grad = value_and_grad(segment_sum, sliced, mask, segments, denominators, device=device)
    truth, truth_grad = value_and_grad(segment_sum_reference, wide[:, :32].double(), mask, segments, denominators)
    assert rel_err(out, truth) < FP32_TOL and rel_err(grad, truth_grad) < FP32_TOL


def test_empty_and_fully_masked_segments_contribute_nothing(device):
    values, mask, segments, denominators = make_inputs(400, 2, 6, seed=9)
    values[segments == 0] = 1e6  # fully masked segment: large values must vanish
    out, grad = value_and_grad(segment_sum, values, mask, segments, denominators, device=device)
    kept = segments != 0
    truth = segment_sum_reference(values[kept], mask[kept], segments[kept], denominators)
    assert rel_err(out, truth) < FP32_TOL
    assert torch.all(grad[segments == 0] == 0)
    assert (segments == denominators.numel() - 1).sum() == 0  # the last segment is empty


def test_order_of_tokens_does_not_matter(device):
    values, mask, segments, denominators = make_inputs(600, 3, 8, seed=4, dtype=torch.float64)
    order = torch.randperm(600, generator=torch.Generator().manual_seed(1))
    scattered = segment_sum(*to_device((values[order], mask[order], segments[order], denominators), device))
    grouped = segment_sum(*to_device((values, mask, segments, denominators), device))
    assert rel_err(scattered, grouped) < 1e-13


def test_float_mask_weights_tokens(device):
    values, _, segments, denominators = make_inputs(300, 2, 5, seed=6)
    weights = torch.rand(300, generator=torch.Generator().manual_seed(0))
    out = segment_sum(*to_device((values, weights, segments, denominators), device)).cpu()
    assert rel_err(out, segment_sum_reference(values.double(), weights, segments, denominators)) < FP32_TOL


def test_bool_mask_and_int32_segment_ids(device):
    values, mask, segments, denominators = make_inputs(300, 2, 5, seed=8)
    out = segment_sum(*to_device((values, mask.bool(), segments.int(), denominators.float()), device)).cpu()
    assert rel_err(out, segment_sum_reference(values.double(), mask, segments, denominators)) < FP32_TOL


def test_no_tokens_gives_zeros_and_an_empty_gradient(device):
    out, grad = value_and_grad(
        segment_sum, torch.zeros(0, 3), torch.zeros(0), torch.zeros(0, dtype=torch.long), torch.ones(2), device=device
    )
    assert torch.equal(out, torch.zeros(3))
    assert grad.shape == (0, 3)


def test_deterministic_bitwise(device):
    inputs = make_inputs(4400, 16, 9, seed=12)
    first = value_and_grad(segment_sum, *inputs, device=device)
    second = value_and_grad(segment_sum, *inputs, device=device)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


def test_cpu_without_interpreter_takes_the_reference(monkeypatch):
    """CPU only, whatever the test device: the CPU dispatch outside the interpreter."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    inputs = make_inputs(50, 2, 3, seed=1)
    assert torch.equal(segment_sum(*inputs), segment_sum_reference(*inputs))


VALUES = torch.randn(5, 2)
MASK = torch.tensor([1, 0, 1, 1, 1])
SEGMENTS = torch.tensor([0, 0, 1, 2, 2])
DENOMS = torch.tensor([2.0, 1.0, 3.0])


def with_value(tensor, index, value):
    out = tensor.clone()
    out[index] = value
    return out


BAD_CALLS = [
    (dict(values=[1.0, 2.0]), r"values must be a torch.Tensor, got list"),
    (dict(values=VALUES[None]), r"values must have shape \[N\] or \[N, C\], got \(1, 5, 2\)"),
    (dict(values=VALUES.int()), r"values dtype must be one of .*, got torch.int32"),
    (dict(mask=MASK[:4]), r"mask must have N = 5 entries \(values' rows\), got 4"),
    (dict(mask=MASK[None]), r"mask must be 1-D, got shape \(1, 5\)"),
    (dict(mask=None), r"mask must be a torch.Tensor, got NoneType"),
    (dict(mask=with_value(MASK.float(), 3, math.nan)), r"mask must be finite, got mask\[3\] = nan"),
    (dict(mask=MASK.to(torch.complex64)), r"mask must be real"),
    (dict(segment_ids=SEGMENTS.float()), r"segment_ids must be an integer tensor, got torch.float32"),
    (dict(segment_ids=SEGMENTS[:3]), r"segment_ids must have N = 5 entries"),
    (dict(segment_ids=with_value(SEGMENTS, 4, 3)), r"segment_ids must lie in \[0, 3\), got segment_ids\[4\] = 3"),
    (dict(segment_ids=with_value(SEGMENTS, 1, -1)), r"segment_ids\[1\] = -1"),
    (dict(denominators=DENOMS[None]), r"denominators must be 1-D"),
    (dict(denominators=with_value(DENOMS, 1, 0.0)), r"denominators must be finite and >= 1.18e-38 \(torch.float32's "
                                                    r"smallest normal, .*\), got denominators\[1\] = 0.0"),
    # float64 denominators that float32, the sums' dtype, cannot hold (NaN out, before the check)
    (dict(denominators=with_value(DENOMS.double(), 1, 1e-50)), r"denominators\[1\] = 1e-50"),
    (dict(denominators=with_value(DENOMS.double(), 2, 1e-40)), r"denominators\[2\] = 1e-40"),
    (dict(denominators=with_value(DENOMS.double(), 0, 1e50)), r"denominators\[0\] = 1e\+50"),
    (dict(denominators=with_value(DENOMS, 2, -1.0)), r"denominators\[2\] = -1.0"),
    (dict(denominators=with_value(DENOMS, 0, math.nan)), r"denominators\[0\] = nan"),
    (dict(denominators=with_value(DENOMS, 0, math.inf)), r"denominators\[0\] = inf"),
    (dict(denominators=DENOMS.bool()), r"denominators must be real numbers, got torch.bool"),
    (dict(denominators=DENOMS.clone().requires_grad_()), r"denominators must not require grad"),
    (dict(mask=MASK.float().requires_grad_()), r"mask must not require grad"),
    (dict(segment_ids=SEGMENTS.to("meta")), r"segment_ids is on meta but values on (cpu|cuda)"),
]


@pytest.mark.parametrize("overrides,message", BAD_CALLS)
def test_bad_input_raises_value_error_naming_it(overrides, message):
    args = dict(values=VALUES, mask=MASK, segment_ids=SEGMENTS, denominators=DENOMS)
    args.update(overrides)
    with pytest.raises(ValueError, match=message):
        segment_sum(**args)


def test_float64_values_take_denominators_float32_cannot_hold(device):
    """float64 values accumulate in float64, where 1e-50 is an ordinary denominator."""
    denominators = with_value(DENOMS.double(), 1, 1e-50)
    values, mask, segments, denominators = to_device((VALUES.double(), MASK, SEGMENTS, denominators), device)
    out = segment_sum(values, mask, segments, denominators)
    expected = segment_sum_reference(VALUES.double(), MASK, SEGMENTS, with_value(DENOMS.double(), 1, 1e-50))
    assert torch.allclose(out.cpu(), expected, rtol=1e-12, atol=0) and bool(torch.isfinite(out).all())


def test_meta_tensors_get_shapes_with_the_value_checks_on():
    inputs = [tensor.to("meta") for tensor in (VALUES, MASK, SEGMENTS, DENOMS)]
    assert segment_sum(*inputs).shape == (2,)
    with pytest.raises(ValueError, match="mask must have N = 5 entries"):
        segment_sum(inputs[0], inputs[1][:4], *inputs[2:])


def test_validation_can_be_switched_off_for_values_not_shapes(device):
    inputs = to_device((VALUES, with_value(MASK.float(), 0, math.nan), SEGMENTS, DENOMS), device)
    out = segment_sum(*inputs, validate=False)
    assert torch.isnan(out).all()
    with pytest.raises(ValueError, match="mask must have N = 5 entries"):
        segment_sum(VALUES, MASK[:4], SEGMENTS, DENOMS, validate=False)


def test_kernels_compile_for_hopper():
    """Every kernel, for each values dtype with its accumulation dtype, one and several channel blocks."""
    launches = [
        Launch(f"segment_sum {phase} {dtype} C={channels}", f"bench.static.launches:segment_sum_{phase}",
               dict(dtype=dtype, channels=channels, tokens=5000))
        for phase in ("forward", "backward")
        for dtype in ("fp32", "bf16", "fp16", "fp64")
        for channels in ((1, 40) if dtype == "fp32" else (1,))
    ]  # fmt: skip
    kernels = {row["kernel"] for row in compile_for_hopper(launches)}
    assert kernels == {"_segment_sum_partials_kernel", "_sum_partials_kernel", "_segment_sum_bwd_kernel"}
