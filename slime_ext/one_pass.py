"""The one-pass fused LM head: the package's losses on `fusedrl.kernels.linear_token_loss`.

Under --fusedrl-fused-lm-head the model hands the loss hidden states (`lm_head`). The package's
policy and SFC losses are sums over response tokens of per-token terms, each a function of the
token's kernel statistics (log-probs, entropy, scores) and of inputs known before the forward
(advantages, old / reference / rollout log-probs, replay supports, SFC draws, weights and ages),
weighted by linear reducers (`aggregation.aggregate_pg_loss`, slime's `sum_of_sample_mean`) whose
per-token coefficients are fixed per micro-batch (`coefficients`). Such a loss runs in one pass:
the op computes the gradient in its forward, chunk by chunk (three GEMMs instead of
`linear_token_stats`' four), and the loss's metrics come from the op's detached statistics.

`applies` says whether a call takes the path and logs, once per process and loss, which path
runs. It does not under allgather context parallelism (the inputs arrive in slime's zigzag layout
and the kernel rows are a piece of the global stream: the inverse redistribution is not
implemented, the recompute path keeps `ResponseTokens.per_sample`'s), nor where no gradient is
being recorded (the op's forward would compute one for nothing), nor for fp16 weights where the
incoming gradient is not known (a loss called outside slime's `loss_function`: the op would form
the fp16 logits gradient at unit scale, where small entries flush to zero; the recompute path
forms it in the backward, at the scale that arrives, as the unfused path). slime's own losses
through `install` keep the recompute path: they read log-probs from `get_log_probs_and_entropy`.
"""

from typing import Callable, Optional

import torch

from ..kernels import LinearTokenLoss
from ..kernels import linear_token_loss as kernel_linear_token_loss
from . import lm_head, main_grad, megatron
from .responses import ResponseTokens


def applies(tokens: ResponseTokens, loss_name: str, needs_whole_batch: Optional[str] = None) -> bool:
    """Whether `loss_name`'s call on these tokens runs the one-pass path (logged once).
    needs_whole_batch: the flag of a term that needs every token's log-prob before any token's
    gradient (a sequence-level ratio, a TIS function over the whole pg_loss), which the op's
    chunk-by-chunk gradient cannot carry: then the recompute path."""
    if lm_head.output_weight() is None:
        return False
    if needs_whole_batch is not None:
        lm_head.log_path_once(loss_name, f"recompute path ({needs_whole_batch} needs the whole micro-batch's log-probs first)")
        return False
    if tokens.allgather:
        lm_head.log_path_once(loss_name, "recompute path (allgather context parallelism)")
        return False
    if not torch.is_grad_enabled():
        lm_head.log_path_once(loss_name, "recompute path (no gradient recorded)")
        return False
    if lm_head.output_weight().dtype == torch.float16 and not main_grad.scale_known():
        lm_head.log_path_once(loss_name, "recompute path (fp16 with no loss scale known: outside slime's loss_function)")
        return False
    lm_head.log_path_once(loss_name, "one-pass path (gradient in the forward)")
    return True


def coefficients(reduce: Callable[[torch.Tensor], torch.Tensor], num_rows: int, device) -> torch.Tensor:
    """[num_rows] float32: the per-token weights c of a linear reducer, reduce(x) = sum_i c_i x_i,
    read off as its gradient at a ones vector (what any linear reducer's own backward gives)."""
    ones = torch.ones(num_rows, dtype=torch.float32, device=device, requires_grad=True)
    with torch.enable_grad():
        reduced = reduce(ones)
    if not isinstance(reduced, torch.Tensor) or not reduced.requires_grad:
        return torch.zeros(num_rows, dtype=torch.float32, device=device)
    (grad,) = torch.autograd.grad(reduced, ones, allow_unused=True)
    return torch.zeros_like(ones) if grad is None else grad.detach()


def weighted_sum(weights: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """The reducer x -> sum_i weights_i x_i (a chunk's share of a linear reducer)."""
    return lambda values: (weights * values).sum()


def linear_token_loss(
    tokens: ResponseTokens,
    output: torch.Tensor,
    ids: torch.Tensor,
    row_loss,
    *,
    args,
    batch,
    temperature: float,
    with_entropy: bool,
    validate: bool,
) -> LinearTokenLoss:
    """The op over the response rows of the handed-off hidden states `output`, its gradients
    formed at the incoming scale and the output weight's into megatron's `main_grad` where
    `main_grad.target` allows (else a `.grad`, checked against an earlier main_grad path)."""
    weight = lm_head.output_weight()
    hidden = lm_head.hidden_rows(output, weight)
    into = main_grad.target(weight, lm_head.schedule_config(), args, batch)
    result = kernel_linear_token_loss(
        hidden, weight if into.main_grad is not None else main_grad.checked_grad_path(weight), ids, row_loss,
        temperature=temperature, with_entropy=with_entropy, tp_group=megatron.tp_group(), rows=tokens.rows,
        validate=validate, main_grad=into.main_grad, grad_scale=into.grad_scale,
    )  # fmt: skip
    if into.main_grad is None:
        return result
    return result._replace(loss=main_grad.joined(result.loss, weight))
