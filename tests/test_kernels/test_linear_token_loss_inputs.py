"""Bad input to linear_token_loss fails early with a ValueError naming the argument and the value: every
check linear_token_stats makes (the same messages, tests/test_linear_token_stats_inputs.py's cases),
then its own: row_loss, main_grad and grad_scale, before any kernel runs (main_grad untouched); and
what row_loss returns, at the first chunk. The same on every device: CPU tensors here, whatever
FUSEDRL_TEST_DEVICE says; with and without a gradient wanted. (A wrong incoming gradient under
main_grad is tested in tests/test_linear_token_loss.py.)"""

import math

import pytest
import torch
from test_linear_token_stats_inputs import BAD_CALLS as LAYER_BAD_CALLS
from test_linear_token_stats_inputs import HIDDEN, IDS, WEIGHT

from fusedrl.kernels import linear_token_loss


def logp_sum(stats, slots):
    return stats.logp.sum()


BAD_CALLS = LAYER_BAD_CALLS + [
    (dict(row_loss=None), r"row_loss must be a callable \(stats, slots\) -> 0-d tensor, got NoneType"),
    (dict(row_loss=lambda stats, slots: 1.0), r"row_loss must return a 0-d floating-point tensor, got float"),
    (dict(row_loss=lambda stats, slots: stats.logp), r"row_loss must return a 0-d floating-point tensor, got a "
                                                     r"torch.float32 tensor of shape \(4, 2\)"),  # fmt: skip
    (dict(row_loss=lambda stats, slots: stats.logp.sum().long()), r"got a torch.int64 tensor of shape \(\)"),
    (dict(main_grad=torch.zeros(10, 6)), r"main_grad needs grad_scale: .* got grad_scale=None"),
    (dict(grad_scale=0.0), r"grad_scale must be a finite nonzero number, got 0\.0"),
    (dict(grad_scale=math.nan), r"grad_scale must be a finite nonzero number, got nan"),
    (dict(weight_buffer_budget=-1), r"weight_buffer_budget must be an int >= 0 \(bytes\) or None, got -1"),
    (dict(weight_buffer_budget=1.5e9), r"weight_buffer_budget must be an int >= 0 \(bytes\) or None, got 1500000000.0"),
    (dict(main_grad=torch.zeros(10, 6).tolist(), grad_scale=0.5), r"main_grad must be a torch.Tensor, got list"),
    (dict(main_grad=torch.zeros(10, 6, dtype=torch.bfloat16), grad_scale=0.5),
     r"main_grad must be float32 \(megatron-core's main_grad\), got torch.bfloat16"),
    (dict(main_grad=torch.zeros(6, 10), grad_scale=0.5), r"main_grad must have weight's shape \(10, 6\), got \(6, 10\)"),
    (dict(main_grad=torch.zeros(10, 6, device="meta"), grad_scale=0.5), r"main_grad is on meta but weight on cpu"),
    (dict(main_grad=torch.zeros(10, 6), grad_scale=math.nan), r"grad_scale must be a finite nonzero number, got nan"),
    (dict(main_grad=torch.zeros(10, 6), grad_scale=math.inf), r"grad_scale must be a finite nonzero number, got inf"),
    (dict(main_grad=torch.zeros(10, 6), grad_scale=True), r"grad_scale must be a finite nonzero number, got True"),
    (dict(main_grad=torch.zeros(10, 6), grad_scale="0.5"), r"grad_scale must be a finite nonzero number, got '0.5'"),
]


@pytest.mark.parametrize("overrides,message", BAD_CALLS)
@pytest.mark.parametrize("trained", [False, True])
def test_bad_input_raises_value_error_naming_it(overrides, message, trained):
    args = dict(hidden=HIDDEN, weight=WEIGHT, ids=IDS, row_loss=logp_sum)
    args.update(overrides)
    hidden = args.pop("hidden")
    if trained and isinstance(hidden, torch.Tensor) and hidden.dtype.is_floating_point:
        hidden = hidden.detach().requires_grad_(True)
    with pytest.raises(ValueError, match=message):
        linear_token_loss(hidden, args.pop("weight"), args.pop("ids"), args.pop("row_loss"), **args)


def test_validation_can_be_switched_off_for_values_not_shapes():
    linear_token_loss(HIDDEN, WEIGHT, IDS, logp_sum, rows=torch.tensor([0, 1, 2, 3]), validate=False)
    with pytest.raises(ValueError, match="J = 0"):
        linear_token_loss(HIDDEN, WEIGHT, IDS[:, :0], logp_sum, validate=False)


def test_meta_tensors_are_refused_naming_what_gives_their_shapes():
    """The op runs row_loss eagerly on each chunk's values: meta tensors have none (before the
    check: "Cannot copy out of meta tensor" from deep inside)."""
    meta = [tensor.to("meta") for tensor in (HIDDEN, WEIGHT, IDS)]
    with pytest.raises(ValueError, match=r"linear_token_loss needs tensors with values .* got hidden on meta: "
                                         r"linear_token_stats gives the shapes"):  # fmt: skip
        linear_token_loss(*meta, logp_sum)


@pytest.mark.parametrize("trained", [False, True])
def test_fp16_without_grad_scale_is_refused_when_a_gradient_is_wanted(trained):
    """At unit scale the fp16 logits gradient flushes to zero where per-token weights meet small
    probabilities (hidden-state gradient error 0.59 against the unfused fp16 path's 7.1e-4 at T = 32,
    H = 64, V = 32768, weights 1/4000, loss scale 2^11): refused naming grad_scale; without a
    gradient wanted, nothing is formed at any scale and the call runs."""
    hidden, weight = HIDDEN.half().requires_grad_(trained), WEIGHT.half()
    if trained:
        with pytest.raises(ValueError, match=r"linear_token_loss in float16 needs grad_scale .* got grad_scale=None"):
            linear_token_loss(hidden, weight, IDS, logp_sum)
        return
    result = linear_token_loss(hidden, weight, IDS, logp_sum)
    assert result.loss.dtype == torch.float32 and not result.loss.requires_grad
