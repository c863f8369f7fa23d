"""The fused LM head's weight gradient straight into megatron-core's fp32 `main_grad`.

The recompute path (`fusedrl.kernels.linear_token_stats`, `recompute_inputs`) adds the weight
gradient into `main_grad` in its backward, where the incoming gradient is known: it needs megatron's
protocol below, not the scale, and its placeholder gradient is handed out after the add.

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
The config is the one the schedule scales by: `get_model_config(model[0])`, where slime sets
`grad_scale_func`; under virtual pipeline stages each stage has its own config and the output
layer's is not that one (`lm_head.schedule_config`).

Under --recompute-loss-function (the loss runs twice: the forward would add twice), or for a
weight without megatron's fp32 `main_grad` (fp16 or bf16 grad buffers: --fp16 without
--accumulate-allreduce-grads-in-fp32, --grad-reduce-in-bf16), the op uses its per-call fp32
buffer, its gradients formed at the same scale (a provisional one: the backward rescales by what
arrives), so that an fp16 logits gradient is formed at the loss scale as on the unfused path and
does not flush to zero. Without the step sizes (a loss called outside slime's wrapper) no scale is
known: the buffer at unit scale, and under fp16 the recompute path instead (`one_pass.applies`).

Megatron's DDP hook drops a `.grad` of a weight whose `grad_added_to_main_grad` is set (unless
`zero_out_wgrad`), and the flag stays set until the next step's `zero_grad_buffer`: a weight whose
gradient went into `main_grad` in one micro-batch and into `.grad` in a later one would lose that
`.grad` silently. The paths that give the weight a `.grad` check for it (`checked_grad_path`).
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


def scale_known() -> bool:
    """Whether the incoming gradient can be known here: inside slime's (wrapped) `loss_function`."""
    return _SCHEDULE.get() is not None


class Target(NamedTuple):
    """How the op forms the weight gradient: megatron's `main_grad` (None: the op's buffer) and the
    incoming gradient's scale (None: not known, unit scale)."""

    main_grad: Optional[torch.Tensor]
    grad_scale: Optional[float]


def target(weight: torch.Tensor, config, args, batch) -> Target:
    """The scale when it is known (see the module docstring) and a gradient is being recorded, and
    `main_grad` with it when the weight is a megatron DDP parameter with an fp32 `main_grad` that
    the forward may add to once. `config`: the schedule's (`lm_head.schedule_config`)."""
    schedule = _SCHEDULE.get()
    if schedule is None or not (weight.requires_grad and torch.is_grad_enabled()):
        return Target(None, None)
    grad_scale = incoming_gradient(args, batch, config, schedule, weight.device)
    once = not getattr(args, "recompute_loss_function", False)
    return Target(usable_main_grad(weight) if once else None, grad_scale)


def usable_main_grad(weight: torch.Tensor) -> Optional[torch.Tensor]:
    """The weight's fp32 `main_grad` when it is a megatron DDP parameter whose gradient is being
    recorded and megatron's protocol applies to it (not FSDP, an fp32 buffer of its shape), else None."""
    main_grad = getattr(weight, "main_grad", None)
    usable = (
        main_grad is not None
        and hasattr(weight, "grad_added_to_main_grad")
        and not hasattr(weight, "__fsdp_param__")
        and main_grad.dtype == torch.float32
        and tuple(main_grad.shape) == tuple(weight.shape)
        and weight.requires_grad
        and torch.is_grad_enabled()
    )
    return main_grad if usable else None


_PLACEHOLDERS = {}  # (shape, dtype, device) -> megatron's dummy weight gradient, reused


def placeholder_gradient(weight: torch.Tensor) -> torch.Tensor:
    """The dummy `[V/tp, H]` gradient the weight receives in the backward, one buffer reused by every
    micro-batch (what megatron-core takes from Transformer Engine's `get_dummy_wgrad`): zeroed on
    every call when `zero_out_wgrad` is set (tied embeddings on one stage: the lookup's gradient is
    added to it and DDP's hook adds the sum), else left as it is (the hook drops it). Made NaN, once:
    were it ever added to `main_grad` (the protocol broken), the step's NaN check says so, where
    uninitialised memory would add silent garbage."""
    key = (tuple(weight.shape), weight.dtype, weight.device)
    if key not in _PLACEHOLDERS:
        _PLACEHOLDERS[key] = torch.full(weight.shape, float("nan"), dtype=weight.dtype, device=weight.device)
    placeholder = _PLACEHOLDERS[key]
    if getattr(weight, "zero_out_wgrad", False):
        placeholder.zero_()
    return placeholder.detach()


class _GradAddedToMainGrad(torch.autograd.Function):
    """A 0-d zero joined to the loss; its backward gives `weight` megatron's dummy gradient and
    sets `grad_added_to_main_grad` (the op added the real one to `main_grad` in its forward)."""

    @staticmethod
    def forward(ctx, weight):
        ctx.weight = weight  # the parameter itself: a saved tensor may come back an alias (checkpointing)
        return torch.zeros((), dtype=torch.float32, device=weight.device)

    @staticmethod
    def backward(ctx, grad):
        ctx.weight.grad_added_to_main_grad = True
        return placeholder_gradient(ctx.weight)


def joined(loss: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`loss` with the weight's megatron protocol attached (same value)."""
    return loss + _GradAddedToMainGrad.apply(weight)


class _AfterHiddenGradient(torch.autograd.Function):
    """The hidden states, unchanged, tied to the output weight. Their gradient comes from the
    recompute path's backward, which adds the weight gradient into `main_grad` in the same op; so
    this backward, run when that gradient arrives, is after the add: it gives the weight megatron's
    dummy gradient and sets `grad_added_to_main_grad`, and DDP's hook (a bucket's reduce under
    overlap_grad_reduce) fires on a `main_grad` that holds the micro-batch's gradient."""

    @staticmethod
    def forward(ctx, hidden, weight):
        ctx.weight = weight  # the parameter itself: a saved tensor may come back an alias (checkpointing)
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad):
        ctx.weight.grad_added_to_main_grad = True
        return grad, placeholder_gradient(ctx.weight)


def recompute_inputs(hidden: torch.Tensor, weight: torch.Tensor):
    """(hidden, weight, main_grad) for the recompute path (`linear_token_stats`): into the weight's
    fp32 `main_grad` in the backward, with megatron's protocol, where it is usable; else the `.grad`
    path (`checked_grad_path`) and None. Unlike the one pass, no scale is needed (the backward
    receives the gradient) and the loss may run twice (--recompute-loss-function: one backward)."""
    into = usable_main_grad(weight)
    if into is None:
        return hidden, checked_grad_path(weight), None
    return _AfterHiddenGradient.apply(hidden, weight), weight, into


def check_grad_path(weight: torch.Tensor) -> None:
    """ValueError when a `.grad` for `weight` would be dropped by megatron's DDP hook because an
    earlier micro-batch of this step put the gradient into `main_grad`."""
    if getattr(weight, "grad_added_to_main_grad", False) and not getattr(weight, "zero_out_wgrad", False):
        raise ValueError(
            "fused LM head: the output weight's gradient went into megatron's main_grad earlier in this step "
            "(grad_added_to_main_grad is set) and now takes the .grad path, which megatron-core's "
            "DistributedDataParallel would drop: every micro-batch of a step must take the same path "
            "(the same loss inside slime's loss_function, the same --recompute-loss-function)"
        )


class _GradPathCheck(torch.autograd.Function):
    """The weight, unchanged; its backward runs `check_grad_path` before the `.grad` reaches it."""

    @staticmethod
    def forward(ctx, weight):
        ctx.weight = weight
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        check_grad_path(ctx.weight)
        return grad


def checked_grad_path(weight: torch.Tensor) -> torch.Tensor:
    """`weight` for a path that gives it a `.grad`: a megatron DDP parameter's gradient passes
    `check_grad_path` in the backward (where every earlier micro-batch's backward has run)."""
    if not (hasattr(weight, "grad_added_to_main_grad") and weight.requires_grad and torch.is_grad_enabled()):
        return weight
    check_grad_path(weight)
    return _GradPathCheck.apply(weight)
