"""Token statistics straight from hidden states: the LM head fused with `token_stats`, in vocabulary slices.

Why slices and a recompute. An LM head's logits `[T, V_local]` are the largest activation of an RL
step (10 GB in fp32 at T = 16k, V = 152k) and their gradient is as large again, yet every loss here
needs only `3 + J` floats per row of them. Both passes hold the logits of every selected row for
one slice of the vocabulary at a time, in one buffer reused by every slice, `[N, columns]` with as
many elements as `chunk_rows` rows of the whole vocabulary (`slice_columns`: the budget is named in
rows, as the one-pass path's chunks are). The forward computes a slice's logits with one GEMM
(cuBLAS through torch) and reduces them to the token-statistics partials of that slice, taken as a
tensor-parallel shard starting at column `vocab_start + start`; the slices' partials are merged
into this rank's and sent through the one tensor-parallel collective.

Why the backward walks the vocabulary too. It recomputes each slice's logits (one extra GEMM of the
LM head: the price of never storing them; the same GEMMs as the forward's, so the same bits),
turns them into their gradient in place with the token-statistics backward kernel (the forward's
saved per-row softmax state and the ids falling in the slice are all it needs, as for a shard),
and applies the linear layer's two backward GEMMs. Walked by row chunks, the weight gradient would
be a sum over chunks, held in an fp32 `[V_local, H]` buffer (2.3 GiB at H = 4096, V_local =
151936); walked by slices, each slice of the weight gradient comes out of one GEMM, written once in
the weight's dtype from sums that stay in fp32 inside the GEMM. What is summed over slices is the
hidden-state gradient, in fp32 `[N, H]`, small next to `[V_local, H]` (with one slice, the whole
vocabulary, its GEMM writes it once in the layer's dtype, as the unfused path does). Rows not selected by `rows`
are never multiplied (they are gathered once, `[N, H]`, when `rows` is given).

Given megatron-core's fp32 `main_grad` of the weight (its gradient-accumulation fusion), each slice
of the weight gradient is added into the matching rows of `main_grad` instead, from the same fp32
sums, and the weight gets no `.grad`: no tensor the weight's size is made at all. The backward's
incoming gradient is known there, so unlike the one pass (`linear_token_loss`) no scale is needed.

Tensor parallelism: `weight` is this rank's vocabulary shard, as in megatron-core's
`ColumnParallelLinear`, and so is the returned hidden-state gradient: this rank's partial sum over
its own columns. Reducing it across the group is the caller's job, done the way megatron does it:
pass `copy_to_tensor_model_parallel_region(hidden)` (identity forward, all-reduce backward), or
under sequence parallelism `gather_from_sequence_parallel_region(hidden)` (all-gather forward,
reduce-scatter backward). The weight gradient needs no reduction: it is this rank's own slice.

Layers, as in `token_stats`: the slice loops over the token-statistics launches (and the row
chunks `ChunkedLogits` of the one-pass path, `linear_token_loss`), the torch.library
ops `fusedrl::linear_token_stats` and `fusedrl::linear_token_stats_backward` (fake implementations,
registered autograd; the group travels by name), and `linear_token_stats`, the checks and the path.
"""

import functools
import math
from typing import Optional, Tuple

import torch

from ._contract import KERNEL_DTYPES, TokenStats, check_token_stats_inputs
from ._dispatch import uses_triton
from ._tp import resolve_tp
from .token_stats import (
    logits_grad, merge_partials, op_arguments, op_outputs, op_outputs_fake, public_stats, row_partials, token_stats,
)  # fmt: skip

CHUNK_SHARE_OF_ROWS = 32
MIN_CHUNK_ROWS = 768
FREE_MEMORY_SHARE = 4
# Where a low-precision product is upcast to be summed in fp32 (CPU), the copies hold at most this
# share of the left operand's elements at a time (`add_product_fp32`).
UPCAST_SHARE = 4


def default_chunk_rows(num_rows: int, vocab_local: int, itemsize: int, free_bytes=None) -> int:
    """Rows per chunk when the caller names none; num_rows counts the selected rows.

    - num_rows / 32: the chunk's logits buffer, the only temporary that grows with the vocabulary,
      stays at ~3% of the unfused logits (~1.6% of the unfused logits plus their gradient).
    - at least 768 rows (or all of them): each chunk's weight-gradient GEMM reads and writes the
      fp32 `[V_local, H]` accumulator (8 V H bytes) for 2 V H C flops, about C / 4 flops per byte;
      below ~800 an H100/H200 (bf16 tensor-core flops over HBM bandwidth: ~200) waits on that
      accumulator instead of computing. 768 keeps the chunk at 2.3% of the unfused logits plus
      gradient at T = 16384, under the 3% the issue sets.
    - at most what a quarter of the free device memory holds (`free_bytes`, None on CPU): room is
      left for the GEMMs' workspace and the rest of the training step.
    """
    rows = max(min(num_rows, MIN_CHUNK_ROWS), math.ceil(num_rows / CHUNK_SHARE_OF_ROWS))
    if free_bytes is not None:
        rows = min(rows, free_bytes // FREE_MEMORY_SHARE // max(1, vocab_local * itemsize))
    return max(1, rows)


@torch.compiler.assume_constant_result
def _free_bytes(device: torch.device):
    """Free device memory, the caching allocator's idle reserve included; None on CPU.

    Under torch.compile it is read once, when the graph is traced, and the default chunk it sets is
    part of the compiled graph: the same chunks, hence the same sums, on every call."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def slice_columns(num_selected: int, vocab_local: int, chunk_rows: int) -> int:
    """Vocabulary columns per slice of the backward's walk: the `[num_selected, columns]` logits of a
    slice hold no more elements than the forward's `[chunk_rows, V_local]` chunk (at least one
    column). With the default chunk (at least num_selected / 32 rows) a slice is at least V_local /
    32 columns wide: 4748 at V_local = 151936, a full-width GEMM."""
    return max(1, min(vocab_local, chunk_rows * vocab_local // max(1, num_selected)))


def device_chunk_rows(hidden, weight, num_selected) -> int:
    """`default_chunk_rows` for this layer on its device (its free memory read on a GPU)."""
    return default_chunk_rows(num_selected, weight.shape[0], hidden.element_size(), _free_bytes(hidden.device))


def check_head_inputs(hidden, weight, ids, temperature, tp_group, rows, chunk_rows, validate):
    """(the tensor-parallel layout, the checked token-statistics inputs) of an LM-head call: the
    layer's own checks, then token_stats' checks of ids, rows and temperature, with its messages."""
    _check_layer(hidden, weight, chunk_rows)
    tp = resolve_tp(tp_group)
    inputs = check_token_stats_inputs(
        _logits_stand_in(hidden, weight), ids, temperature, rows, tp.size, tp.rank, validate, KERNEL_DTYPES
    )
    return tp, inputs


def check_main_grad(main_grad, weight) -> None:
    """main_grad, when given: an fp32 tensor of weight's shape on weight's device (megatron-core's
    `param.main_grad`), that the weight gradient is added into."""
    if main_grad is None:
        return
    if not isinstance(main_grad, torch.Tensor):
        raise ValueError(f"main_grad must be a torch.Tensor, got {type(main_grad).__name__}")
    if main_grad.dtype != torch.float32:
        raise ValueError(f"main_grad must be float32 (megatron-core's main_grad), got {main_grad.dtype}")
    if main_grad.shape != weight.shape:
        raise ValueError(f"main_grad must have weight's shape {tuple(weight.shape)}, got {tuple(main_grad.shape)}")
    if main_grad.device != weight.device:
        raise ValueError(f"main_grad is on {main_grad.device} but weight on {weight.device}")


class _GradIntoMainGrad(torch.autograd.Function):
    """`grad_into_main_grad` as an autograd function."""

    @staticmethod
    def forward(ctx, weight, main_grad):
        ctx.main_grad = main_grad
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        ctx.main_grad.add_(grad)  # each element widened exactly, no fp32 copy of the gradient
        return None, None


def grad_into_main_grad(weight: torch.Tensor, main_grad: torch.Tensor) -> torch.Tensor:
    """The weight as is in the forward; in the backward its gradient is added into `main_grad` (fp32)
    instead of becoming `.grad`, as megatron-core's DistributedDataParallel hook adds a layer's
    `.grad`: the unfused path's way to honour `main_grad`."""
    return _GradIntoMainGrad.apply(weight, main_grad)


def _check_layer(hidden, weight, chunk_rows) -> None:
    """hidden [T, H] and weight [V_local, H] of one kernel dtype on one device; chunk_rows > 0."""
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2:
        raise ValueError(f"hidden must be a [T, H] tensor, got {_describe(hidden)}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"weight must be a [V_local, H] tensor, got {_describe(weight)}")
    if hidden.dtype not in KERNEL_DTYPES:
        raise ValueError(f"hidden dtype must be one of {KERNEL_DTYPES}, got {hidden.dtype}")
    if weight.dtype != hidden.dtype:
        raise ValueError(f"weight dtype must equal hidden's ({hidden.dtype}), got {weight.dtype}")
    if weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"weight must have H = {hidden.shape[1]} columns (hidden's last dim), got weight of shape "
            f"{tuple(weight.shape)}"
        )
    if weight.device != hidden.device:
        raise ValueError(f"weight is on {weight.device} but hidden on {hidden.device}")
    if chunk_rows is not None and (type(chunk_rows) is not int or chunk_rows < 1):
        raise ValueError(f"chunk_rows must be a positive int or None, got {chunk_rows!r}")


def _describe(value) -> str:
    return f"shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__


def _logits_stand_in(hidden, weight) -> torch.Tensor:
    """A [T, V_local] tensor with the logits' dtype and device over one row of storage: the
    token-statistics checks read only its metadata, so ids, rows and temperature get their messages."""
    return hidden.new_empty((1, weight.shape[0])).expand(hidden.shape[0], weight.shape[0])


def add_product_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b with fp32 sums whatever a and b hold (bf16/fp16 products rounded once, at the end).

    Where torch cannot add a low-precision GEMM into fp32 (CPU), the operands are upcast exactly, in
    blocks: correct everywhere, at fp32 GEMM speed, without a temporary the size of the weight.
    When b's fp32 copy holds at most 1 / UPCAST_SHARE of a's elements (a weight gradient
    `[V, H] += [V, C] @ [C, H]`), b is upcast once and a in blocks of rows holding UPCAST_SHARE
    times b's elements: each row of acc is read and written once, the copies hold 1 + UPCAST_SHARE
    times b's elements whatever a's size, and b, read once per block, adds 1 / UPCAST_SHARE of a's
    fp32 copy to the bytes moved. Else blocks of a's columns (b's rows) holding at most
    1 / UPCAST_SHARE of a's elements, each one a pass over acc (a hidden-state gradient
    `[N, H] += [N, V_slice] @ [V_slice, H]`, acc small)."""
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
    elif _adds_low_precision_products_in_fp32(acc.device.type, a.dtype):
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)  # cuBLAS: low-precision A, B; fp32 C
    else:
        budget = max(1, a.numel() // UPCAST_SHARE)  # fp32 elements the copies may hold at once
        inner, width = b.shape
        if inner * width <= budget:
            b_fp32, rows = b.float(), max(1, UPCAST_SHARE * width)
            for start in range(0, a.shape[0], rows):
                acc[start : start + rows].addmm_(a[start : start + rows].float(), b_fp32)
        else:
            step = max(1, budget // (a.shape[0] + width))
            for start in range(0, inner, step):
                acc.addmm_(a[:, start : start + step].float(), b[start : start + step].float())


@functools.lru_cache(maxsize=None)
def _adds_low_precision_products_in_fp32(device_type: str, dtype: torch.dtype) -> bool:
    """Whether this torch adds a bf16/fp16 GEMM into an fp32 matrix in place on this device
    (`addmm(..., out_dtype=float32)` with an fp32 `self`: CUDA builds of recent torch; not CPU).
    Probed once on a 1x1 product rather than inferred from version numbers; starting from 1, the
    sum must be 2, so a build that overwrites instead of adding is caught too."""
    acc = torch.ones((1, 1), dtype=torch.float32, device=device_type)
    one = torch.ones((1, 1), dtype=dtype, device=device_type)
    try:
        torch.addmm(acc, one, one, out_dtype=torch.float32, out=acc)
    except (RuntimeError, TypeError):  # NotImplementedError is a RuntimeError
        return False
    return float(acc) == 2.0


class ChunkedLogits:
    """The logits of the selected rows, `chunk_rows` at a time, in one buffer reused by every chunk;
    and the linear layer's backward GEMMs of a chunk's logits gradient (`add_layer_grads`)."""

    def __init__(self, hidden, weight, rows, num_selected, chunk_rows):
        self.hidden, self.weight, self.rows, self.num_selected = hidden, weight, rows, num_selected
        self.chunk_rows = min(chunk_rows, max(num_selected, 1))
        self.logits = hidden.new_empty((self.chunk_rows, weight.shape[0]))
        self.gathered = None if rows is None else hidden.new_empty((self.chunk_rows, hidden.shape[1]))
        self.row_grads = None  # the selected rows' hidden-state gradient of a chunk, made on first use

    def __iter__(self):
        """(slots, hidden rows, logits) per chunk; slots index the outputs. An empty selection
        still yields one empty chunk, so every rank takes part in the collective."""
        for start in range(0, max(self.num_selected, 1), self.chunk_rows):
            slots = slice(start, min(start + self.chunk_rows, self.num_selected))
            size = slots.stop - slots.start
            if self.rows is None:
                rows_in = self.hidden[slots]
            else:
                rows_in = torch.index_select(self.hidden, 0, self.rows[slots], out=self.gathered[:size])
            yield slots, rows_in, torch.mm(rows_in, self.weight.t(), out=self.logits[:size])

    @property
    def single(self) -> bool:
        """Whether one chunk holds every selected row: then a GEMM can write the weight gradient."""
        return self.chunk_rows >= self.num_selected

    def add_layer_grads(self, slots, rows_in, grad_logits, grad_hidden, grad_weight, sum_weight=True) -> None:
        """grad_hidden[the chunk's rows] = grad_logits @ weight (each row written once) and
        grad_weight += grad_logits^T @ rows_in summed in fp32, or, with sum_weight False (one chunk
        only), written by the GEMM in grad_weight's dtype; a None gradient is not wanted."""
        if grad_hidden is not None and self.rows is None:
            torch.mm(grad_logits, self.weight, out=grad_hidden[slots])
        elif grad_hidden is not None:
            if self.row_grads is None:
                self.row_grads = torch.empty_like(self.gathered)
            size = slots.stop - slots.start
            grad_hidden.index_copy_(0, self.rows[slots], torch.mm(grad_logits, self.weight, out=self.row_grads[:size]))
        if grad_weight is not None and sum_weight:
            add_product_fp32(grad_weight, grad_logits.t(), rows_in)
        elif grad_weight is not None:
            torch.mm(grad_logits.t(), rows_in, out=grad_weight)


class VocabularySlices:
    """The selected rows' logits, all rows at once, one vocabulary slice of `slice_columns` at a
    time, in one buffer reused by every slice; and a slice's two backward GEMMs (`layer_grads`)."""

    def __init__(self, hidden, weight, rows, num_selected, chunk_rows):
        self.weight = weight
        self.selected = hidden if rows is None else hidden.index_select(0, rows)  # [N, H]
        self.columns = slice_columns(num_selected, weight.shape[0], chunk_rows)
        self.buffer = hidden.new_empty((num_selected * self.columns,))

    @property
    def single(self) -> bool:
        """Whether one slice spans the whole vocabulary: then one GEMM writes the hidden-state
        gradient, and no sum over slices is needed."""
        return self.columns >= self.weight.shape[0]

    def row_grads(self, hidden, rows) -> torch.Tensor:
        """The selected rows' hidden-state gradient buffer: written by the one slice's GEMM in
        hidden's dtype (rounded once, as the unfused path), else summed over slices in fp32 (zeros);
        for layers without `rows` whose dtype is the buffer's, the returned gradient itself."""
        num_selected, width = self.selected.shape
        if self.single:
            return hidden.new_empty(hidden.shape if rows is None else (num_selected, width))
        if rows is None and hidden.dtype == torch.float32:
            return torch.zeros_like(hidden)
        return torch.zeros((num_selected, width), dtype=torch.float32, device=hidden.device)

    def __iter__(self):
        """(first column, the slice's weight rows, its logits [N, width]) per slice."""
        num_selected = self.selected.shape[0]
        for start in range(0, self.weight.shape[0], self.columns):
            block = self.weight[start : start + self.columns]
            logits = self.buffer[: num_selected * block.shape[0]].view(num_selected, block.shape[0])
            yield start, block, torch.mm(self.selected, block.t(), out=logits)

    def partials(self, ids, vocab_start, temperature, with_entropy) -> torch.Tensor:
        """This rank's [N, P] token-statistics partials: each slice's, taken as a shard starting at
        its first column, merged (the forward's walk; the collective is the caller's)."""
        return merge_partials(torch.stack([
            row_partials(logits, ids, None, vocab_start + start, temperature, with_entropy)
            for start, _, logits in self
        ]), temperature)  # fmt: skip

    def backward(self, ids, softmax_state, coefficients, vocab_start, temperature, row_grads, grad_weight, main_grad):
        """The backward's walk: each slice's logits recomputed (the forward's GEMMs, the same bits),
        turned into their gradient in place from the saved softmax state and the per-row
        coefficients (logp_grad, entropy_grad, scores_grad; None: zero), then `layer_grads`."""
        for start, block, logits in self:
            grad_logits = logits_grad(logits, logits, ids, None, softmax_state, *coefficients, vocab_start + start,
                                      temperature)  # fmt: skip
            self.layer_grads(start, block, grad_logits, row_grads, grad_weight, main_grad)

    def layer_grads(self, start, block, grad_logits, row_grads, grad_weight, main_grad) -> None:
        """grad_weight[the slice] = grad_logits^T @ selected rows (written once, in grad_weight's
        dtype, from the GEMM's fp32 sums), or main_grad[the slice] += that product in fp32, and
        row_grads += grad_logits @ block in fp32 (= with one slice); a None gradient is not wanted."""
        columns = slice(start, start + block.shape[0])
        if main_grad is not None:
            add_product_fp32(main_grad[columns], grad_logits.t(), self.selected)
        elif grad_weight is not None:
            torch.mm(grad_logits.t(), self.selected, out=grad_weight[columns])
        if row_grads is not None and self.single:
            torch.mm(grad_logits, block, out=row_grads)
        elif row_grads is not None:
            add_product_fp32(row_grads, grad_logits, block)


@torch.library.custom_op("fusedrl::linear_token_stats", mutates_args=())
def linear_token_stats_op(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    rows: Optional[torch.Tensor],
    temperature: float,
    with_entropy: bool,
    vocab_start: int,
    tp_group_name: Optional[str],
    chunk_rows: int,
    main_grad: Optional[torch.Tensor],
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward as a torch op, opaque to torch.compile: (logp, entropy, scores, softmax_state), as
    `fusedrl::token_stats` (the group travels by name, the collective runs inside); `main_grad` is
    only carried to the backward, which adds the weight gradient into it. It walks the
    vocabulary slices the backward walks, so the backward recomputes bit for bit the logits the
    saved softmax state was taken from (a GEMM of another shape may round them otherwise, and at
    |logits| / T in the hundreds the gradient's 1 - p cancels that difference up to 1e-4)."""
    slices = VocabularySlices(hidden, weight, rows, ids.shape[0], chunk_rows)
    return op_outputs(slices.partials(ids, vocab_start, temperature, with_entropy), tp_group_name, temperature)


@linear_token_stats_op.register_fake
def _linear_token_stats_fake(hidden, weight, ids, rows, temperature, with_entropy, vocab_start, tp_group_name, chunk_rows,
                             main_grad):  # fmt: skip
    return op_outputs_fake(ids)


@torch.library.custom_op("fusedrl::linear_token_stats_backward", mutates_args=("main_grad",))
def linear_token_stats_backward_op(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    rows: Optional[torch.Tensor],
    softmax_state: torch.Tensor,
    logp_grad: Optional[torch.Tensor],
    entropy_grad: Optional[torch.Tensor],
    scores_grad: Optional[torch.Tensor],
    temperature: float,
    vocab_start: int,
    chunk_rows: int,
    wants_hidden: bool,
    wants_weight: bool,
    main_grad: Optional[torch.Tensor],
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(d hidden, d weight) with the logits recomputed one vocabulary slice at a time, every
    selected row at once (module docstring); a gradient not wanted is an empty tensor (an op
    returns no None), and so is d weight when it goes into `main_grad` (added in place). A None
    output gradient is zero (entropy_grad None: no entropy term)."""
    into_main_grad = main_grad if wants_weight else None
    grad_weight = weight.new_empty(weight.shape if wants_weight and main_grad is None else (0,))
    slices = VocabularySlices(hidden, weight, rows, ids.shape[0], chunk_rows)
    row_grads = slices.row_grads(hidden, rows) if wants_hidden else None
    slices.backward(ids, softmax_state, (logp_grad, entropy_grad, scores_grad), vocab_start, temperature, row_grads,
                    grad_weight if wants_weight else None, into_main_grad)  # fmt: skip
    if not wants_hidden:
        return hidden.new_empty((0,)), grad_weight
    return scatter_rows(row_grads, hidden, rows), grad_weight


def scatter_rows(row_grads, hidden, rows) -> torch.Tensor:
    """d hidden [T, H] in hidden's dtype: the selected rows' gradient (fp32 sums rounded once), zeros
    elsewhere."""
    if rows is None:
        return row_grads.to(hidden.dtype)
    grad_hidden = torch.zeros_like(hidden)
    return grad_hidden.index_copy_(0, rows, row_grads.to(hidden.dtype))


@linear_token_stats_backward_op.register_fake
def _linear_token_stats_backward_fake(hidden, weight, ids, rows, softmax_state, logp_grad, entropy_grad, scores_grad,
                                      temperature, vocab_start, chunk_rows, wants_hidden, wants_weight, main_grad):  # fmt: skip
    return (
        hidden.new_empty(hidden.shape if wants_hidden else (0,)),
        weight.new_empty(weight.shape if wants_weight and main_grad is None else (0,)),
    )


def _linear_token_stats_setup_context(ctx, inputs, output):
    hidden, weight, ids, rows, temperature, with_entropy, vocab_start, _, chunk_rows, main_grad = inputs
    ctx.save_for_backward(hidden, weight, ids, rows, output[3], main_grad)
    ctx.set_materialize_grads(False)  # an output the loss does not use gets None, not a zeros fill
    ctx.temperature, ctx.with_entropy, ctx.vocab_start, ctx.chunk_rows = temperature, with_entropy, vocab_start, chunk_rows


def _linear_token_stats_backward(ctx, logp_grad, entropy_grad, scores_grad, state_grad):
    del state_grad  # an internal output, saved for this backward
    hidden, weight, ids, rows, softmax_state, main_grad = ctx.saved_tensors
    wants_hidden, wants_weight = ctx.needs_input_grad[:2]
    grad_hidden, grad_weight = linear_token_stats_backward_op(
        hidden, weight, ids, rows, softmax_state, logp_grad, entropy_grad if ctx.with_entropy else None,
        scores_grad, ctx.temperature, ctx.vocab_start, ctx.chunk_rows, wants_hidden, wants_weight, main_grad,
    )  # fmt: skip
    return (
        grad_hidden if wants_hidden else None,
        grad_weight if wants_weight and main_grad is None else None,
        None, None, None, None, None, None, None, None,
    )  # fmt: skip


linear_token_stats_op.register_autograd(_linear_token_stats_backward, setup_context=_linear_token_stats_setup_context)


def linear_token_stats(
    hidden,
    weight,
    ids,
    *,
    temperature=1.0,
    with_entropy=False,
    tp_group=None,
    rows=None,
    chunk_rows=None,
    main_grad=None,
    validate=True,
) -> TokenStats:
    """`token_stats(hidden @ weight.T, ids, ...)` without ever holding more than one chunk of logits.

    hidden: [T, H] (fp32, bf16 or fp16). weight: [V_local, H] of the same dtype, this rank's
        vocabulary shard (global columns [rank * V_local, (rank + 1) * V_local) of a tensor-parallel
        group of size tp; default group: megatron-core's when initialised).
    ids, temperature, with_entropy, tp_group, rows, validate: as `token_stats`; only the selected
        rows' logits are computed, and the other rows get a zero hidden-state gradient.
    chunk_rows: selected rows per chunk (the logits buffer holds chunk_rows x V_local); default
        `default_chunk_rows` of the selected rows, V_local and the free device memory.
    main_grad: None, or an fp32 tensor of weight's shape (megatron-core's `weight.main_grad`): the
        backward adds the weight gradient into it, slice by slice, and the weight gets no `.grad`
        (the caller sets megatron's `grad_added_to_main_grad`, as its fused linear layers do).

    Returns `TokenStats(logp [N, J], entropy [N] or None, scores [N, J])`, float32, differentiable
    with respect to hidden and weight. Under tensor parallelism the hidden-state gradient is this
    rank's partial sum, to be reduced across the group by the caller (see the module docstring).
    CPU tensors outside the Triton interpreter take the unfused path (`token_stats` of the full
    logits, itself the float64 reference there).
    """
    tp, inputs = check_head_inputs(hidden, weight, ids, temperature, tp_group, rows, chunk_rows, validate)
    check_main_grad(main_grad, weight)
    if not uses_triton(hidden, "linear_token_stats"):
        if main_grad is not None and weight.requires_grad:
            weight = grad_into_main_grad(weight, main_grad)
        return token_stats(
            hidden @ weight.t(),
            ids,
            temperature=temperature,
            with_entropy=with_entropy,
            tp_group=tp_group,
            rows=rows,
            validate=False,
        )
    if chunk_rows is None:
        chunk_rows = device_chunk_rows(hidden, weight, inputs.ids.shape[0])
    outputs = linear_token_stats_op(hidden, weight, *op_arguments(inputs, with_entropy, tp), chunk_rows, main_grad)
    return public_stats(outputs, with_entropy)
