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
    (dict(temperature=0.0), r"temperature must be finite and > 0, got 0.0"),
    (dict(temperature=-1.0), r"temperature must be finite and > 0, got -1.0"),
    (dict(temperature=math.nan), r"temperature must be finite and > 0, got nan"),
    (dict(temperature=math.inf), r"temperature must be finite and > 0, got inf"),
    (dict(temperature="0.7"), r"temperature must be a number, got str '0.7'"),
    (dict(temperature=True), r"temperature must be a number, got bool True"),
    (dict(temperature=None), r"temperature must be a number, got NoneType None"),
    (dict(rows=torch.tensor([0, 4])), r"rows must lie in \[0, 4\), got rows\[1\] = 4"),
    (dict(rows=torch.tensor([-1, 2])), r"rows\[0\] = -1"),
    (dict(rows=torch.tensor([1, 3, 1]), ids=IDS[:3]), r"rows must be distinct, got row 1"),
    (dict(rows=torch.tensor([[0, 1]])), r"rows must be 1-D"),
    (dict(rows=torch.tensor([0.0, 1.0])), r"rows must be an integer tensor"),
    (dict(rows=torch.tensor([0, 1, 2])), r"ids must have len\(rows\) = 3 rows"),
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
