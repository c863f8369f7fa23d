"""Bad input to linear_token_stats fails early with a ValueError naming the argument and the value:
the layer's own checks (shapes, H and dtype mismatches, chunk_rows, main_grad) and token_stats' checks of ids,
rows and temperature, with the same messages. The checks run before any kernel, the same on every
device: CPU tensors here, whatever FUSEDRL_TEST_DEVICE says."""

import math

import pytest
import torch

from fusedrl.kernels import linear_token_stats

HIDDEN = torch.randn(4, 6)
WEIGHT = torch.randn(10, 6)
IDS = torch.randint(0, 10, (4, 2))


def bad_ids():
    ids = IDS.clone()
    ids[2, 1] = 10
    return ids


BAD_CALLS = [
    (dict(hidden=HIDDEN[None]), r"hidden must be a \[T, H\] tensor, got shape \(1, 4, 6\)"),
    (dict(hidden=HIDDEN.tolist()), r"hidden must be a \[T, H\] tensor, got list"),
    (dict(weight=WEIGHT[0]), r"weight must be a \[V_local, H\] tensor, got shape \(6,\)"),
    (dict(weight=WEIGHT[:, :5]), r"weight must have H = 6 columns \(hidden's last dim\), got weight of shape \(10, 5\)"),
    (dict(hidden=HIDDEN.double(), weight=WEIGHT.double()), r"hidden dtype must be one of"),
    (dict(hidden=HIDDEN.int()), r"hidden dtype must be one of"),
    (dict(weight=WEIGHT.bfloat16()), r"weight dtype must equal hidden's \(torch.float32\), got torch.bfloat16"),
    (dict(weight=WEIGHT[:0]), r"V_local = 0"),
    (dict(weight=WEIGHT.to("meta")), r"weight is on meta but hidden on cpu"),
    (dict(ids=IDS.to("meta")), r"ids are on meta but logits on cpu"),
    (dict(chunk_rows=0), r"chunk_rows must be a positive int or None, got 0"),
    (dict(chunk_rows=-2), r"chunk_rows must be a positive int or None, got -2"),
    (dict(chunk_rows=2.0), r"chunk_rows must be a positive int or None, got 2.0"),
    (dict(chunk_rows=True), r"chunk_rows must be a positive int or None, got True"),
    (dict(ids=bad_ids()), r"ids must lie in \[0, 10\), got ids\[2, 1\] = 10"),
    (dict(ids=IDS[:, :0]), r"J = 0"),
    (dict(ids=IDS[:3]), r"ids must have T \(logits rows\) = 4 rows"),
    (dict(ids=IDS.float()), r"ids must be an integer tensor"),
    (dict(temperature=0.0), r"temperature must lie in \[1e-06, 1e\+06\], got 0.0"),
    (dict(temperature=1e-30), r"temperature must lie in \[1e-06, 1e\+06\], got 1e-30"),  # was a NaN hidden gradient
    (dict(temperature=math.nan), r"temperature must lie in \[1e-06, 1e\+06\], got nan"),
    (dict(rows=torch.tensor([0, 4])), r"rows must lie in \[0, 4\), got rows\[1\] = 4"),
    (dict(rows=torch.tensor([1, 3, 1]), ids=IDS[:3]), r"rows must be distinct, got row 1"),
    (dict(rows=torch.tensor([0, 1, 2])), r"ids must have len\(rows\) = 3 rows"),
]
# linear_token_loss takes these with grad_scale (tests/test_kernels/test_linear_token_loss_inputs.py)
MAIN_GRAD_BAD_CALLS = [
    (dict(main_grad=[0.0]), r"main_grad must be a torch.Tensor, got list"),
    (dict(main_grad=WEIGHT.bfloat16()), r"main_grad must be float32 \(megatron-core's main_grad\), got torch.bfloat16"),
    (dict(main_grad=WEIGHT[:, :5].clone()), r"main_grad must have weight's shape \(10, 6\), got \(10, 5\)"),
    (dict(main_grad=WEIGHT.to("meta")), r"main_grad is on meta but weight on cpu"),
]


@pytest.mark.parametrize("overrides,message", BAD_CALLS + MAIN_GRAD_BAD_CALLS)
def test_bad_input_raises_value_error_naming_it(overrides, message):
    args = dict(hidden=HIDDEN, weight=WEIGHT, ids=IDS)
    args.update(overrides)
    with pytest.raises(ValueError, match=message):
        linear_token_stats(args.pop("hidden"), args.pop("weight"), args.pop("ids"), **args)


def test_validation_can_be_switched_off_for_values_not_shapes():
    linear_token_stats(HIDDEN, WEIGHT, IDS, rows=torch.tensor([0, 1, 2, 3]), validate=False)
    with pytest.raises(ValueError, match="J = 0"):
        linear_token_stats(HIDDEN, WEIGHT, IDS[:, :0], validate=False)
