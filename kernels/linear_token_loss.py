"""A per-token loss straight from hidden states in one pass: the LM head's gradient made in its forward.

Why one pass. `linear_token_stats` never holds the `[T, V_local]` logits, but its backward pays a
fourth GEMM to recompute each chunk's logits. When the loss is a sum over rows of per-row terms
whose other inputs (advantages, old log-probs, masks, denominators) are known before the forward,
each chunk's gradient can be made while its logits are still in the buffer: GEMM -> token-statistics
partials -> (tensor parallelism: that chunk's all-gather of partials) -> the chunk's log-probs,
entropy and scores -> the caller's `row_loss` on those `[C, J]`-sized tensors and autograd through
them alone, giving d loss / d logp, d entropy, d scores -> the token-statistics backward kernel
turns the chunk's logits into their gradient in place -> d hidden of the chunk's rows and the
weight gradient, summed over chunks in fp32. Three GEMMs, as the unfused LM head; the backward
only scales the saved gradients by the incoming scalar.

Without `main_grad` the weight gradient is held from the forward to the backward, scaled there:
when one chunk holds every selected row (the default chunk does up to 768 rows), the chunk's GEMM
writes it once in the weight's dtype, from sums that stay in fp32 inside the GEMM, and no buffer
but the returned gradient exists; with several chunks it is summed over them in a per-call fp32
`[V_local, H]` buffer (the price of three GEMMs: without it each chunk's sum would be rounded to the
layer's dtype; for fp32 weights the buffer is the returned gradient). A bf16/fp16 layer's buffer
comes on top of the returned gradient, and it is bounded: above `weight_buffer_budget` bytes (1 GiB
by default: 2.3 GiB at H = 4096, V_local = 151936) the call walks the vocabulary instead, as
`linear_token_stats` does, in its forward: every selected row's statistics slice by slice, the loss
on all of them, then the slices again for the gradients (four GEMMs, each slice of the weight
gradient written once in the layer's dtype, no `[V_local, H]` sum). With
`main_grad` (megatron-core's fp32 `param.main_grad`) and `grad_scale` (the gradient the caller's
schedule will send into the loss: 1 / num_microbatches, times the loss scale if any), it goes
straight into `main_grad`, already scaled, with no buffer. That bets on the incoming gradient, so
the backward checks it equals `grad_scale` and raises a ValueError naming both otherwise: never a
silently wrong gradient. The hidden-state gradient takes the same scale in the forward (the token-
statistics coefficients are multiplied by it, so each gradient element is rounded once).

Why the scale belongs in the forward even without `main_grad`: each chunk's logits gradient is
formed in the layer's dtype, and at unit scale an fp16 one flushes to zero where per-token weights
(1 / response length) meet small probabilities; the unfused path forms it at the loss scale. So
`grad_scale` alone is a provisional scale: the gradients are formed at it and the backward
rescales both by incoming / grad_scale (nothing to do when they are equal, as under a schedule
that sends what it promised).

Tensor parallelism as `linear_token_stats`: `weight` is this rank's vocabulary shard, the returned
hidden-state gradient this rank's partial sum (reduce it with megatron's region functions), the
loss and statistics the same on every rank. Each chunk holds one collective, so every rank must
take the same chunks: same rows and `chunk_rows` (a default chunk derived from free GPU memory is
agreed on, the smallest, by one small all-reduce).

Eager only: `row_loss` is a Python callable, which cannot cross a torch custom op's schema, so this
is a `torch.autograd.Function` that launches kernels, runs a collective per chunk and reads the
incoming gradient on the host. torch.compile graph-breaks around it; use `linear_token_stats` in
compiled code. Deterministic: chunks in a fixed order, no atomics, the chunks' losses summed in
float64 in that order.
"""

import math
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch
import torch.distributed as dist

from ._contract import TokenStats, values_readable
from ._dispatch import uses_triton
from ._tp import TensorParallel
from .linear_token_stats import (
    ChunkedLogits, VocabularySlices, check_head_inputs, check_main_grad, device_chunk_rows, scatter_rows,
)  # fmt: skip
from .reference import token_stats_reference
from .token_stats import all_rank_partials, combine_partials, logits_grad, row_partials

# How far the incoming gradient may sit from grad_scale: a few fp32 roundings of the schedule's
# product (1 / num_microbatches times a loss scale), far below any real mismatch.
SCALE_TOLERANCE = 2.0**-20
# The most bytes a call's fp32 [V_local, H] weight-gradient sum over chunks may take beside a bf16 or
# fp16 layer's returned gradient; above it the call walks the vocabulary (module docstring).
WEIGHT_BUFFER_BUDGET = 1 << 30


class LinearTokenLoss(NamedTuple):
    """loss: 0-d float32, differentiable with respect to hidden and weight.
    stats: the same forward's TokenStats (logp [N, J], entropy [N] or None, scores [N, J]),
    float32, detached: for the metrics a loss reports."""

    loss: torch.Tensor
    stats: TokenStats


RowLoss = Callable[[TokenStats, slice], torch.Tensor]


@dataclass
class _Gradients:
    """What the forward made for the backward; None where a gradient is not wanted (or lives in
    main_grad)."""

    hidden: Optional[torch.Tensor]
    weight: Optional[torch.Tensor]


@dataclass
class _Head:
    """One call's checked arguments and the chunk loop over them."""

    hidden: torch.Tensor
    weight: torch.Tensor
    ids: torch.Tensor
    rows: Optional[torch.Tensor]
    row_loss: RowLoss
    temperature: float
    with_entropy: bool
    tp: TensorParallel
    vocab_start: int
    chunk_rows: int
    main_grad: Optional[torch.Tensor]
    grad_scale: Optional[float]
    kernels: bool  # the Triton kernels (GPU or interpreter); False: the float64 eager reference per chunk
    weight_buffer_budget: Optional[int]  # None: no bound

    def run(self, wants_hidden: bool, wants_weight: bool):
        """(loss, stats, gradients): every chunk's statistics and loss terms, and, for what is
        wanted, d hidden (scaled by grad_scale when given) and d weight (into main_grad; written by
        the GEMM of a single chunk; or summed over chunks in a fresh fp32 buffer)."""
        if wants_weight and self._walks_vocabulary():
            return self._walk(wants_hidden)
        num_selected, num_ids = self.ids.shape
        per_id = dict(dtype=torch.float32, device=self.hidden.device)
        logp, scores = torch.empty((num_selected, num_ids), **per_id), torch.empty((num_selected, num_ids), **per_id)
        entropy = torch.empty((num_selected,), **per_id) if self.with_entropy else None
        chunks = ChunkedLogits(self.hidden, self.weight, self.rows, num_selected, self.chunk_rows)
        sum_weight = self.main_grad is not None or not chunks.single
        grads = _Gradients(
            torch.zeros(self.hidden.shape, dtype=self.hidden.dtype, device=self.hidden.device) if wants_hidden else None,
            None if not wants_weight else self.main_grad if self.main_grad is not None
            else torch.zeros(self.weight.shape, **per_id) if sum_weight else torch.empty_like(self.weight),
        )  # fmt: skip
        step = self._kernel_step if self.kernels else self._eager_step
        total = torch.zeros((), dtype=torch.float64, device=self.hidden.device)
        written = False
        for slots, rows_in, logits in chunks:
            stats, loss, grad_logits = step(logits, slots, wants_hidden or wants_weight)
            logp[slots], scores[slots] = stats.logp, stats.scores
            if entropy is not None:
                entropy[slots] = stats.entropy
            total += loss.double()
            if grad_logits is not None:
                chunks.add_layer_grads(slots, rows_in, grad_logits, grads.hidden, grads.weight, sum_weight)
                written = True
        if grads.weight is not None and not (sum_weight or written):
            grads.weight.zero_()  # a loss that does not use the statistics: no GEMM wrote it
        return total.float(), TokenStats(logp, entropy, scores), grads

    def _walks_vocabulary(self) -> bool:
        """Whether the weight gradient would be summed over several chunks in an fp32 buffer beside
        a bf16/fp16 layer's returned gradient, above the budget (module docstring)."""
        num_selected = self.ids.shape[0]
        return (
            self.kernels and self.main_grad is None and self.weight.dtype != torch.float32
            and self.weight_buffer_budget is not None and self.chunk_rows < num_selected
            and 4 * self.weight.numel() > self.weight_buffer_budget
        )  # fmt: skip

    def _walk(self, wants_hidden: bool):
        """`run` by `linear_token_stats`' vocabulary walk (four GEMMs): every selected row's
        statistics slice by slice, one collective, the loss on all rows at once, then the slices
        again for d hidden (summed in fp32) and d weight (each slice written once, weight's dtype)."""
        num_selected = self.ids.shape[0]
        slices = VocabularySlices(self.hidden, self.weight, self.rows, num_selected, self.chunk_rows)
        partials = slices.partials(self.ids, self.vocab_start, self.temperature, self.with_entropy)
        row = combine_partials(all_rank_partials(partials, self.tp), self.temperature)
        leaves = TokenStats(row.logp.requires_grad_(), row.entropy.requires_grad_() if self.with_entropy else None,
                            row.scores.requires_grad_())  # fmt: skip
        inputs = [leaves.logp, leaves.scores] + ([leaves.entropy] if self.with_entropy else [])
        loss, coefficients = self._loss_and_grads(leaves, slice(0, num_selected), inputs, True)
        stats = TokenStats(*(None if t is None else t.detach() for t in leaves))
        row_grads = slices.row_grads(self.hidden, self.rows) if wants_hidden else None
        grad_weight = torch.empty_like(self.weight)  # each slice written once by its GEMM
        if coefficients is None:
            grad_weight.zero_()  # a loss that does not use the statistics
        else:
            logp_grad, scores_grad, *entropy_grad = coefficients
            slices.backward(self.ids, row.softmax_state, (logp_grad, next(iter(entropy_grad), None), scores_grad),
                            self.vocab_start, self.temperature, row_grads, grad_weight, None)  # fmt: skip
        hidden = scatter_rows(row_grads, self.hidden, self.rows) if wants_hidden else None
        return loss.float(), stats, _Gradients(hidden, grad_weight)

    def _kernel_step(self, logits, slots, wants_grad):
        """A chunk through the token-statistics kernels: partials, the chunk's collective, the
        combine; the loss on fresh leaves; its coefficients into the logits gradient, in place."""
        ids = self.ids[slots]
        partials = row_partials(logits, ids, None, self.vocab_start, self.temperature, self.with_entropy)
        row = combine_partials(all_rank_partials(partials, self.tp), self.temperature)
        leaves = TokenStats(row.logp, row.entropy if self.with_entropy else None, row.scores)
        if wants_grad:
            leaves = TokenStats(*(None if t is None else t.requires_grad_() for t in leaves))
        inputs = [leaves.logp, leaves.scores] + ([leaves.entropy] if self.with_entropy else [])
        loss, coefficients = self._loss_and_grads(leaves, slots, inputs, wants_grad)
        stats = TokenStats(*(None if t is None else t.detach() for t in leaves))
        if coefficients is None:
            return stats, loss, None
        logp_grad, scores_grad, *entropy_grad = coefficients  # None: not used, zero (entropy: no term)
        grad_logits = logits_grad(logits, logits, ids, None, row.softmax_state, logp_grad, next(iter(entropy_grad), None),
                                  scores_grad, self.vocab_start, self.temperature)  # fmt: skip
        return stats, loss, grad_logits

    def _eager_step(self, logits, slots, wants_grad):
        """A chunk through the float64 reference (CPU outside the interpreter): autograd from the
        loss to the chunk's logits."""
        leaf = logits.detach().requires_grad_(wants_grad)
        with torch.enable_grad():
            stats = token_stats_reference(leaf, self.ids[slots], temperature=self.temperature,
                                          with_entropy=self.with_entropy, tp_group=self.tp.group, validate=False)  # fmt: skip
        loss, grad_logits = self._loss_and_grads(stats, slots, [leaf], wants_grad)
        stats = TokenStats(*(None if t is None else t.detach() for t in stats))
        return stats, loss, None if grad_logits is None else grad_logits[0]

    def _loss_and_grads(self, stats, slots, inputs, wants_grad):
        """(the chunk's loss, detached; its gradients with respect to `inputs` times grad_scale, None
        for an input it does not use; or None for all when no gradient is wanted or none is used)."""
        with torch.enable_grad() if wants_grad else torch.no_grad():
            loss = self.row_loss(stats, slots)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.dtype.is_floating_point:
            raise ValueError(f"row_loss must return a 0-d floating-point tensor, got {_describe(loss)}")
        if not (wants_grad and loss.requires_grad):
            return loss.detach(), None
        scale = torch.full((), 1.0 if self.grad_scale is None else self.grad_scale, dtype=loss.dtype, device=loss.device)
        grads = torch.autograd.grad(loss, inputs, grad_outputs=scale, allow_unused=True)
        return loss.detach(), None if all(g is None for g in grads) else grads


class _OnePassLoss(torch.autograd.Function):
    """The loss of `_Head.run` whose gradients were made in the forward; the backward only scales."""

    @staticmethod
    def forward(ctx, hidden, weight, head, stats_out):
        wants_hidden, wants_weight = ctx.needs_input_grad[:2]
        loss, stats, grads = head.run(wants_hidden, wants_weight)
        stats_out.append(stats)
        ctx.grads, ctx.grad_scale, ctx.into_main_grad = grads, head.grad_scale, head.main_grad is not None
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        grads = ctx.grads
        if grads is None:
            raise RuntimeError(
                "linear_token_loss made its gradient in the forward and hands it out once: "
                "its backward cannot run a second time (retain_graph)"
            )
        ctx.grads = None  # frees the buffers; a second backward would add the gradient twice
        if ctx.into_main_grad:
            _check_incoming_gradient(float(grad_out), ctx.grad_scale)
            weight = None  # already in main_grad, scaled
            return grads.hidden, weight, None, None
        ratio = grad_out if ctx.grad_scale is None else grad_out.double() / ctx.grad_scale
        unit = bool(ratio == 1)
        ratio = ratio.float()
        hidden = grads.hidden if grads.hidden is None or unit else grads.hidden * ratio
        weight = grads.weight
        if weight is not None:
            weight = (weight if unit else weight.float() * ratio).to(ctx.weight_dtype)
        return hidden, weight, None, None


def _check_incoming_gradient(incoming: float, grad_scale: float) -> None:
    """The gradient already applied in the forward must be the one the backward receives."""
    if not abs(incoming - grad_scale) <= SCALE_TOLERANCE * abs(grad_scale):
        raise ValueError(
            f"linear_token_loss was given grad_scale = {grad_scale!r}, and added grad_scale * d weight to "
            f"main_grad in the forward, but the loss's incoming gradient is {incoming!r}: pass the "
            "scale the schedule applies to this loss (1 / num_microbatches, times the loss scale)"
        )


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__


def _check_main_grad(main_grad, grad_scale, weight) -> Optional[float]:
    """main_grad: an fp32 tensor of weight's shape and device, only with grad_scale; grad_scale: a
    finite nonzero number. Returns grad_scale as a float (or None)."""
    if main_grad is not None and grad_scale is None:
        raise ValueError(
            "main_grad needs grad_scale: the weight gradient goes into main_grad already scaled by grad_scale, "
            "got grad_scale=None"
        )
    if grad_scale is not None and (
        isinstance(grad_scale, bool) or not isinstance(grad_scale, (int, float)) or not math.isfinite(grad_scale)
        or grad_scale == 0
    ):  # fmt: skip
        raise ValueError(f"grad_scale must be a finite nonzero number, got {grad_scale!r}")
    check_main_grad(main_grad, weight)
    return None if grad_scale is None else float(grad_scale)


def _check_fp16_scale(hidden, grad_scale) -> None:
    """An fp16 gradient needs its scale before the forward: each chunk's logits gradient is formed
    in fp16 there, and at unit scale its small entries (per-token weights times small
    probabilities) flush to zero, a gradient far worse than the unfused fp16 path's, which forms it
    at the loss scale."""
    if hidden.dtype == torch.float16 and grad_scale is None:
        raise ValueError(
            "linear_token_loss in float16 needs grad_scale when a gradient is wanted: the gradient the loss "
            "will receive (the loss scale / num_microbatches under fp16 training, 1.0 for a plain "
            "loss.backward()), got grad_scale=None; its fp16 logits gradient is formed at that scale"
        )


def _agreed_chunk_rows(chunk_rows: int, tp: TensorParallel, device) -> int:
    """The smallest of the ranks' default chunks: each chunk holds a collective, so every rank must
    take as many chunks, and free memory differs between GPUs."""
    value = torch.tensor([chunk_rows], dtype=torch.int64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN, group=tp.group)
    return int(value)


def linear_token_loss(
    hidden,
    weight,
    ids,
    row_loss: RowLoss,
    *,
    temperature=1.0,
    with_entropy=False,
    tp_group=None,
    rows=None,
    chunk_rows=None,
    main_grad=None,
    grad_scale=None,
    weight_buffer_budget=WEIGHT_BUFFER_BUDGET,
    validate=True,
) -> LinearTokenLoss:
    """`row_loss` of `token_stats(hidden @ weight.T, ids, ...)`, its gradient made chunk by chunk in the
    forward: three GEMMs, one chunk of logits alive at a time (see the module docstring).

    hidden, weight, ids, temperature, with_entropy, tp_group, rows, chunk_rows, validate: as
        `linear_token_stats`.
    row_loss(stats, slots) -> 0-d tensor: the loss terms of the selected rows `slots` (a slice of
        [0, N)), from `stats`, that chunk's TokenStats (logp [C, J], entropy [C] or None, scores
        [C, J], float32 leaves requiring grad). The loss must be a sum over rows of per-row terms
        (slice the per-row inputs such as advantages with `slots`); the returned loss is the sum of
        the chunk values. The statistics are its only differentiable inputs: other tensors it reads
        are constants. An empty selection calls it once with an empty chunk.
    main_grad, grad_scale: main_grad only with grad_scale. main_grad: an fp32 tensor of weight's
        shape and device (megatron-core's `param.main_grad`); the forward adds grad_scale * d loss /
        d weight to it, and the backward returns no weight gradient and raises a ValueError unless
        the incoming gradient equals grad_scale (to fp32 rounding). Without main_grad the weight
        gradient is held from the forward to the backward: in the weight's dtype when one chunk holds
        every selected row, else summed over chunks in an fp32 [V_local, H] buffer; grad_scale
        alone (a finite nonzero number, the incoming gradient expected) forms both gradients at that
        scale, and the backward rescales them by incoming / grad_scale (fp16: no flush to zero;
        in fp16 a call that wants a gradient must pass grad_scale, a ValueError otherwise).
    weight_buffer_budget: the most bytes (an int >= 0, or None: no bound) the fp32 [V_local, H] sum
        of a bf16/fp16 weight gradient over several chunks may take; above it the call walks the
        vocabulary, four GEMMs and no such sum (module docstring). Default 1 GiB.

    Returns `LinearTokenLoss(loss, stats)`: the 0-d float32 loss, differentiable with respect to
    hidden and weight, and the same forward's statistics, detached. Without grad mode, or when
    neither hidden nor weight requires grad, only the loss and statistics are computed (main_grad
    untouched). CPU tensors outside the Triton interpreter take the float64 reference per chunk.
    Its backward runs once (no retain_graph).
    """
    tp, inputs = check_head_inputs(hidden, weight, ids, temperature, tp_group, rows, chunk_rows, validate)
    if not callable(row_loss):
        raise ValueError(f"row_loss must be a callable (stats, slots) -> 0-d tensor, got {type(row_loss).__name__}")
    grad_scale = _check_main_grad(main_grad, grad_scale, weight)
    if weight_buffer_budget is not None and (type(weight_buffer_budget) is not int or weight_buffer_budget < 0):
        raise ValueError(f"weight_buffer_budget must be an int >= 0 (bytes) or None, got {weight_buffer_budget!r}")
    if not values_readable(hidden, weight, inputs.ids):
        raise ValueError(
            "linear_token_loss needs tensors with values (it runs row_loss, a Python callable, on each chunk's "
            f"statistics), got hidden on {hidden.device.type}: linear_token_stats gives the shapes of meta or fake inputs"
        )
    kernels = uses_triton(hidden, "linear_token_loss")
    if chunk_rows is None:
        chunk_rows = device_chunk_rows(hidden, weight, inputs.ids.shape[0])
        if tp.group is not None and hidden.is_cuda:
            chunk_rows = _agreed_chunk_rows(chunk_rows, tp, hidden.device)
    rows = None if inputs.rows is None else inputs.rows.contiguous()
    head = _Head(hidden, weight, inputs.ids.contiguous(), rows, row_loss, inputs.temperature, bool(with_entropy), tp,
                 inputs.vocab_start, chunk_rows, main_grad, grad_scale, kernels, weight_buffer_budget)  # fmt: skip
    if not (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)):
        loss, stats, _ = head.run(wants_hidden=False, wants_weight=False)
        return LinearTokenLoss(loss, stats)
    _check_fp16_scale(hidden, grad_scale)
    stats_out = []
    loss = _OnePassLoss.apply(hidden, weight, head, stats_out)
    return LinearTokenLoss(loss, stats_out[0])
