"""The one-pass LM head's weight gradient straight into megatron-core's fp32 `main_grad`.

`fusedrl.kernels.linear_token_loss` computes the whole gradient in its forward. Given a
`main_grad` and the scale the incoming gradient will have, it adds `grad_scale * dW` into
`main_grad` there and its backward returns no weight gradient (it raises, naming both, when the
incoming gradient is not `grad_scale`). What megatron-core expects of a layer that does this is
its gradient-accumulation fusion protocol (`LinearWithGradAccumulationAndAsyncCommunication` in
megatron/core/tensor_parallel/layers.py), reproduced here:

- the weight still receives a gradient in the backward (a dummy: zeros when `zero_out_wgrad` is
  set, i.e. tied embeddings on one pipeline stage, whose embedding lookup adds its real gradient
  to it; else uninitialised), so DistributedDataParallel's post-accumulation hook fires, and
  bucketed reduce works with `overlap_grad_reduce` (which asserts a gradient is there);
- `grad_added_to_main_grad = True`, so that hook adds nothing twice (it adds `.grad` only when
  the flag is off or `zero_out_wgrad` is set, then drops `.grad`).

The scale. slime's `loss_function` (slime/backends/megatron_utils/loss.py) multiplies the custom
loss by `num_microbatches / step_global_batch_size * dp_cp_size` (by `cp_size` under
--calculate-per-token-loss); megatron-core's schedule (`forward_step_calc_loss`) divides it by
the normaliser slime returns and by `num_microbatches` unless `config.calculate_per_token_loss`,
and its `backward_step` multiplies by `config.grad_scale_func` (the optimizer's loss scale). The
loss reaches the op with coefficient 1, so the incoming gradient is that chain's derivative,
replayed here in float32 in the backward's order so that it is the very number autograd
produces. The step sizes are only known inside slime's `loss_function`: the init hook (with
--fusedrl-fused-lm-head) wraps it so that they are published while it runs (`publishing`).
Without them (a loss called outside slime's wrapper), under --recompute-loss-function (the loss
runs twice: the forward would add twice), or for a weight without megatron's fp32 `main_grad`,
the op uses its per-call fp32 buffer, scaled in the backward: no scale is assumed.
"""

import contextvars
import functools
from typing import NamedTuple, Optional

import torch

from . import megatron

_SCHEDULE = contextvars.ContextVar("fusedrl_loss_function_schedule", default=None)
_MARK = "_fusedrl_publishes_schedule"


class Schedule(NamedTuple):
    """The step sizes slime's `loss_function` scales the micro-batch's loss by."""

    num_microbatches: int
    step_global_batch_size: int


def publishing(loss_function):
    """slime's `loss_function(args, batch, num_microbatches, step_global_batch_size, logits)`,
    publishing the step sizes while it runs. Wrapping a wrapped function returns it unchanged."""
    if getattr(loss_function, _MARK, False):
        return loss_function

    @functools.wraps(loss_function)
    def loss_function_publishing_schedule(args, batch, num_microbatches, step_global_batch_size, logits):
        token = _SCHEDULE.set(Schedule(int(num_microbatches), int(step_global_batch_size)))
        try:
            return loss_function(args, batch, num_microbatches, step_global_batch_size, logits)
        finally:
            _SCHEDULE.reset(token)

    setattr(loss_function_publishing_schedule, _MARK, True)
    return loss_function_publishing_schedule


def incoming_gradient(args, batch, config, schedule: Schedule, device) -> float:
    """The gradient megatron's backward hands the custom loss: the derivative of slime's and
    megatron's scaling, in float32, in the backward's order (loss scale, megatron's divisions,
    then slime's factors last to first)."""
    grad = torch.ones((), dtype=torch.float32)
    if getattr(config, "grad_scale_func", None) is not None:
        grad = grad * config.grad_scale_func(torch.ones(1, device=device)).float().cpu().reshape(())
    if not getattr(config, "calculate_per_token_loss", False):
        grad = grad / max(_slime_normaliser(args, batch), 1)
        grad = grad / schedule.num_microbatches
    if args.calculate_per_token_loss:
        grad = grad * megatron.cp_rank_and_size()[1]
    else:
        grad = grad * megatron.dp_cp_size()
        grad = grad / schedule.step_global_batch_size
        grad = grad * schedule.num_microbatches
    return float(grad)


def _slime_normaliser(args, batch) -> int:
    """The `num_tokens` slime's `loss_function` returns: the masked token count (each sample at
    least 1) under --calculate-per-token-loss, else 1."""
    if not args.calculate_per_token_loss:
        return 1
    per_sample = torch.stack([mask.sum() for mask in batch["loss_masks"]]).clamp(min=1)
    return int(per_sample.sum())  # one host read for the micro-batch


class Target(NamedTuple):
    """Where the op puts the weight gradient: megatron's `main_grad`, at the incoming scale."""

    main_grad: torch.Tensor
    grad_scale: float


def target(weight: torch.Tensor, config, args, batch) -> Optional[Target]:
    """`main_grad` and its scale when the weight is a megatron DDP parameter with an fp32
    `main_grad` and the scale is known (see the module docstring), else None (the op's buffer)."""
    main_grad = getattr(weight, "main_grad", None)
    schedule = _SCHEDULE.get()
    usable = (
        main_grad is not None
        and hasattr(weight, "grad_added_to_main_grad")
        and not hasattr(weight, "__fsdp_param__")
        and main_grad.dtype == torch.float32
        and tuple(main_grad.shape) == tuple(weight.shape)
        and weight.requires_grad
        and torch.is_grad_enabled()
        and schedule is not None
        and not getattr(args, "recompute_loss_function", False)
    )
    if not usable:
        return None
    return Target(main_grad, incoming_gradient(args, batch, config, schedule, weight.device))


class _GradAddedToMainGrad(torch.autograd.Function):
    """A 0-d zero joined to the loss; its backward gives `weight` megatron's dummy gradient and
    sets `grad_added_to_main_grad` (the op added the real one to `main_grad` in its forward)."""

    @staticmethod
    def forward(ctx, weight):
        ctx.save_for_backward(weight)
        return torch.zeros((), dtype=torch.float32, device=weight.device)

    @staticmethod
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
        weight.grad_added_to_main_grad = True
        return make(weight.shape, dtype=weight.dtype, device=weight.device)


def joined(loss: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`loss` with the weight's megatron protocol attached (same value)."""
    return loss + _GradAddedToMainGrad.apply(weight)
