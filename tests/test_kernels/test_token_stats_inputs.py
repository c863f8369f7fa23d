"""Bad input to token_stats fails early with a ValueError naming the argument and the value.

The checks run before any kernel and read only shapes, dtypes, devices and values, the same on every
device: CPU tensors here, whatever FUSEDRL_TEST_DEVICE says."""

import math

import pytest
import torch

from fusedrl.kernels import token_stats, token_stats_reference

LOGITS = torch.randn(4, 10)
IDS = torch.randint(0, 10, (4, 2))


def bad_ids():
    ids = IDS.clone()
    ids[2, 1] = 10
    return ids


def negative_ids():
    ids = IDS.clone()
    ids[1, 0] = -3
    return ids


BAD_CALLS = [
    (dict(ids=bad_ids()), r"ids must lie in \[0, 10\), got ids\[2, 1\] = 10"),
    (dict(ids=negative_ids()), r"ids\[1, 0\] = -3"),
    (dict(ids=IDS[:, :0]), r"J = 0"),
    (dict(ids=IDS[:3]), r"ids must have T \(logits rows\) = 4 rows"),
    (dict(ids=IDS[:, 0]), r"ids must have shape \[N, J\]"),
    (dict(ids=IDS.float()), r"ids must be an integer tensor"),
    (dict(logits=LOGITS.int()), r"logits dtype must be one of"),
    (dict(logits=LOGITS[None, None]), r"logits must have shape \[T, V\] or \[1, T, V\]"),
    (dict(logits=LOGITS[:, :0], ids=IDS[:, :0] + 0), r"V_local = 0|J = 0"),
    (dict(logits=LOGITS.t().contiguous().t()), r"last dim must be contiguous"),
    (dict(temperature=0.0), r"temperature must lie in \[1e-06, 1e\+06\], got 0.0"),
    (dict(temperature=-1.0), r"temperature must lie in \[1e-06, 1e\+06\], got -1.0"),
    (dict(temperature=math.nan), r"temperature must lie in \[1e-06, 1e\+06\], got nan"),
    (dict(temperature=math.inf), r"temperature must lie in \[1e-06, 1e\+06\], got inf"),
    # Finite temperatures the fp32 kernels cannot answer (NaN log-probs from 1e46 up, NaN entropy
    # gradients from 1e-19 down, before the range existed): refused, the range named.
    (dict(temperature=1e46), r"temperature must lie in \[1e-06, 1e\+06\], got 1e\+46"),
    (dict(temperature=1.01e6), r"got 1010000.0"),
    (dict(temperature=1e-19), r"temperature must lie in \[1e-06, 1e\+06\], got 1e-19"),
    (dict(temperature=1e-41), r"got 1e-41"),
    (dict(temperature=torch.tensor([1.0, 2.0])), r"temperature must be one number, got tensor\(\[1., 2.\]\)"),
    (dict(temperature=10**400), r"temperature must be one number, got 1000000000.*\.\.\. \(int too large"),
    (dict(temperature="0.7"), r"temperature must be a number, got str '0.7'"),
    (dict(temperature=True), r"temperature must be a number, got bool True"),
    (dict(temperature=None), r"temperature must be a number, got NoneType None"),
    (dict(rows=torch.tensor([0, 4])), r"rows must lie in \[0, 4\), got rows\[1\] = 4"),
    (dict(rows=torch.tensor([-1, 2])), r"rows\[0\] = -1"),
    (dict(rows=torch.tensor([1, 3, 1]), ids=IDS[:3]), r"rows must be distinct, got row 1"),
    (dict(rows=torch.tensor([[0, 1]])), r"rows must be 1-D"),
    (dict(rows=torch.tensor([0.0, 1.0])), r"rows must be an integer tensor"),
    (dict(rows=torch.tensor([0, 1, 2])), r"ids must have len\(rows\) = 3 rows"),
    # a mistyped group was ignored: no split, while the logits may be a vocabulary shard
    (dict(tp_group="tp"), r"tp_group must be a torch.distributed.ProcessGroup or None, got str 'tp'"),
    (dict(tp_group=2), r"tp_group must be a torch.distributed.ProcessGroup or None, got int 2"),
]


@pytest.mark.parametrize("fn", [token_stats, token_stats_reference])
@pytest.mark.parametrize("overrides,message", BAD_CALLS)
def test_bad_input_raises_value_error_naming_it(fn, overrides, message):
    args = dict(logits=LOGITS, ids=IDS)
    args.update(overrides)
    with pytest.raises(ValueError, match=message):
        fn(args.pop("logits"), args.pop("ids"), **args)


def test_validation_can_be_switched_off_for_values_not_shapes():
    token_stats(LOGITS, IDS, rows=torch.tensor([0, 1, 2, 3]), validate=False)
    with pytest.raises(ValueError, match="J = 0"):
        token_stats(LOGITS, IDS[:, :0], validate=False)


def test_float64_logits_are_reference_only():
    """The kernel accumulates in fp32, so float64 input would silently lose precision there."""
    with pytest.raises(ValueError, match="logits dtype must be one of"):
        token_stats(LOGITS.double(), IDS)
    assert token_stats_reference(LOGITS.double(), IDS).logp.dtype == torch.float64


def test_one_element_tensor_and_integer_temperatures_are_numbers():
    expected = token_stats_reference(LOGITS, IDS, temperature=2.0).logp
    for temperature in (torch.tensor(2.0), 2, torch.tensor([2.0])):
        assert torch.equal(token_stats_reference(LOGITS, IDS, temperature=temperature).logp, expected)


def test_inplace_backward_refuses_logits_whose_rows_overlap():
    """An expanded row (stride 0) written in place takes T writes per element, the last one
    winning: before the check the gradient was silently wrong (-3.7e-5 where the truth is 2.88)."""
    base = torch.randn(1, 10, requires_grad=True)
    for logits in (base.expand(4, 10), torch.randn(40).as_strided((4, 10), (5, 1))):
        with pytest.raises(ValueError, match=r"inplace_backward=True needs logits whose rows do not overlap.*strides"):
            token_stats(logits, IDS, inplace_backward=True)
    stats = token_stats(base.expand(4, 10), IDS)  # not in place: the gradient sums over the rows
    stats.logp.sum().backward()
    leaf = base.detach().double().expand(4, 10).clone().requires_grad_()
    token_stats_reference(leaf, IDS).logp.sum().backward()
    assert torch.allclose(base.grad.double(), leaf.grad.sum(0, keepdim=True), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fn", [token_stats, token_stats_reference])
def test_meta_tensors_get_shapes_with_the_value_checks_on(fn):
    """Value checks skip themselves on meta tensors (no values to read); shape checks still run."""
    stats = fn(LOGITS.to("meta"), IDS.to("meta"), with_entropy=True, rows=None)
    assert stats.logp.shape == (4, 2) and stats.entropy.shape == (4,) and stats.logp.device.type == "meta"
    with pytest.raises(ValueError, match="ids must have T"):
        fn(LOGITS.to("meta"), IDS[:3].to("meta"))
