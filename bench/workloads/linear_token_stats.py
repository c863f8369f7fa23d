"""The fused LM head (`linear_token_stats`) against the unfused path: cases, inputs, truth, costs.

`python -m bench --op linear_token_stats` measures it like the other ops (the `eager` subject is
the unfused path here: the matmul in the layer's dtype, then `token_stats`; `extra` is a share of
the unfused logits). `python -m bench.studies.lm_head_chunks` measures the peak extra memory of both
paths as the chunk grows, next to the cost model below, and projects that model to T = 16384,
V/tp = 151936, H = 4096 (a projection, not a measurement).

The one-pass path (`linear_token_loss`, subjects `one_pass` and `one_pass_main_grad`) is given the
workload's loss, a sum of per-row terms, and makes its gradient in the forward.

Cost model, per fwd+bwd with all T rows selected, C rows per chunk (the held logits: C V elements),
b bytes per element of the layer's dtype. The recompute path (`fused`) walks the vocabulary in
S = ceil(V / W) slices of W = C V / T columns, every row at once; the one-pass path walks k =
ceil(T / C) row chunks.
- GEMM flops: unfused 6 T V H (forward, dhidden, dweight); fused 8 T V H (the forward GEMM again
  in the backward, to recompute the logits); one pass 6 T V H.
- Peak extra memory (beyond inputs and returned gradients): unfused T V b logits kept for the
  backward plus their T V b gradient; fused one C V b chunk of logits plus, when b < 4, the fp32
  [T, H] hidden-state sums over slices (for fp32 layers they are the returned gradient); one pass
  the chunk plus, when b < 4 and k > 1, the fp32 [V, H] weight-gradient sums over chunks (one chunk:
  its GEMM writes the gradient; fp32: the sums are the returned gradient); one pass into main_grad
  the chunk alone (main_grad is the trainer's own buffer).
- Bytes each GEMM and kernel must move (operands read once, results written once): every path
  writes and reads every logit in the forward and reads, writes and reads them again in the
  backward (the gradient kernel, then two GEMMs). The fused path adds the recompute GEMM (the
  layer read, the logits written once more), reads the hidden states once per slice in each of
  its three slice GEMMs (S T H b) and the weight once per GEMM, writes the weight gradient once and
  reads and writes the fp32 hidden-state sums once per slice. The one-pass path reads the weight
  once per chunk in its forward and hidden-gradient GEMMs, and writes the weight gradient once (one
  chunk: exactly the unfused path's bytes) or reads and writes the fp32 sums once per chunk (several
  chunks, and always into main_grad).
"""

import gc
import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from ..cases import FLOOR_PASSES, Case
from ..harness.accuracy import RelativeError

# Hidden width of the cases: Qwen3-8B's 4096 on a GPU; 16x smaller on CPU, like the CPU grid's T
# and V (bench/cases.py), so the interpreter finishes in minutes.
GPU_HIDDEN, CPU_HIDDEN = 4096, 256
REFERENCE_CHUNK_BYTES = 1 << 28  # rows of float64 truth computed at a time


@dataclass(frozen=True)
class LinearCase(Case):
    """One LM-head problem: hidden [T, H] and weight [V, H] of `dtype`, J ids per row. Its
    `input_bytes` are the unfused path's logits [T, V]: what the fused path never holds."""

    op = "linear_token_stats"
    hidden: int = CPU_HIDDEN
    chunk_rows: Optional[int] = None  # None: the op's default

    def floor_bytes(self, phase: str) -> int:
        """Hidden states and weight read once per pass (the gradients written once in backward)."""
        return FLOOR_PASSES[phase] * (self.tokens + self.vocab) * self.hidden * self.torch_dtype.itemsize

    @property
    def label(self) -> str:
        chunk = "" if self.chunk_rows is None else f" C={self.chunk_rows}"
        return f"lm D={self.hidden}{chunk} {super().label}"

    def fields(self) -> dict:
        return dict(super().fields(), hidden=self.hidden, chunk_rows=self.chunk_rows)


def head_cases(token_cases, gpu: bool):
    """The LM-head twin of each token-statistics case (same T, V/tp, dtype, J, entropy)."""
    width = GPU_HIDDEN if gpu else CPU_HIDDEN
    return [LinearCase(c.tokens, c.vocab, c.dtype, c.ids_per_row, c.entropy, c.temperature, width) for c in token_cases]


class Layer(NamedTuple):
    """The differentiable input of an LM-head case; `device` as the benchmark asks of any input."""

    hidden: torch.Tensor
    weight: torch.Tensor

    @property
    def device(self) -> torch.device:
        return self.hidden.device


@dataclass
class LinearWorkload:
    """Hidden states, weight, ids and upstream gradients; the differentiable input is the pair
    (hidden, weight), the outputs (logp, entropy) or, from the one-pass subjects, (logp, entropy,
    loss) with the loss's gradient made in the forward.

    main_grad: the trainer's fp32 weight-gradient buffer (megatron-core keeps one per parameter for
    the whole run), made with the workload so no measured phase counts it, zeroed by `leaf` (the
    step's zero_grad); the main_grad subject accumulates into it instead of returning d weight."""

    case: LinearCase
    hidden: torch.Tensor
    weight: torch.Tensor
    ids: torch.Tensor
    logp_grad: torch.Tensor
    entropy_grad: Optional[torch.Tensor]
    main_grad: torch.Tensor

    @classmethod
    def make(cls, case, device, seed=0):
        generator = torch.Generator(device=device).manual_seed(seed)

        def normal(*shape):
            return torch.randn(shape, device=device, generator=generator)

        hidden = normal(case.tokens, case.hidden)
        weight = normal(case.vocab, case.hidden).mul_(2.0 / math.sqrt(case.hidden))  # logits ~ N(0, 4)
        ids = torch.randint(0, case.vocab, (case.tokens, case.ids_per_row), device=device, generator=generator)
        entropy_grad = normal(case.tokens) if case.entropy else None
        dtype = case.torch_dtype
        main_grad = torch.zeros(weight.shape, device=device)
        return cls(case, hidden.to(dtype), weight.to(dtype), ids, normal(*ids.shape), entropy_grad, main_grad)

    @property
    def main_input(self) -> torch.Tensor:
        return self.hidden

    def leaf(self) -> Layer:
        self.main_grad.zero_()
        return Layer(self.hidden.detach().clone().requires_grad_(), self.weight.detach().clone().requires_grad_())

    def loss(self, logp, entropy, rows=slice(None)):
        """sum logp * logp_grad + sum entropy * entropy_grad over `rows`: a sum of per-row terms."""
        loss = (logp.double() * self.logp_grad[rows]).sum()
        if entropy is not None:
            loss = loss + (entropy.double() * self.entropy_grad[rows]).sum()
        return loss

    def row_loss(self, stats, slots):
        """`loss` as the one-pass path takes it, chunk by chunk."""
        return self.loss(stats.logp, stats.entropy, slots)

    def backward(self, layer, outputs, rows=slice(None)):
        """(d hidden, d weight) of `loss` over `rows`: of the outputs' own loss when they carry one
        (d weight None when it went into main_grad)."""
        logp, entropy, *made = outputs
        loss = made[0] if made else self.loss(logp, entropy, rows)
        return torch.autograd.grad(loss, list(layer), allow_unused=True)

    def errors(self, outputs, grads):
        """(forward, backward) relative errors against float64, row chunk by row chunk: forward the
        worse of logp and entropy, backward the worse of d hidden and d weight."""
        from fusedrl.kernels import token_logprobs_reference

        case = self.case
        weight = self.weight.double().requires_grad_()
        chunk = max(1, REFERENCE_CHUNK_BYTES // (case.vocab * 8))
        error = RelativeError()
        truth_weight = torch.zeros_like(weight)
        for start in range(0, case.tokens, chunk):
            rows = slice(start, start + chunk)
            hidden = self.hidden[rows].double().requires_grad_()
            truth = token_logprobs_reference(
                hidden @ weight.t(), self.ids[rows], temperature=case.temperature, with_entropy=case.entropy
            )
            error.add("logp", outputs[0][rows], truth[0])
            if case.entropy:
                error.add("entropy", outputs[1][rows], truth[1])
            truth_hidden, chunk_weight = self.backward(Layer(hidden, weight), truth, rows)
            error.add("dhidden", grads[0][rows], truth_hidden)
            truth_weight += chunk_weight
        error.add("dweight", self.main_grad if grads[1] is None else grads[1], truth_weight)
        return error.worst("logp", "entropy"), error.worst("dhidden", "dweight")


def run_fused(layer, workload):
    from fusedrl.kernels import linear_token_stats

    case = workload.case
    stats = linear_token_stats(*layer, workload.ids, temperature=case.temperature, with_entropy=case.entropy,
                               chunk_rows=case.chunk_rows)  # fmt: skip
    if layer.device.type == "cpu":
        # The Triton interpreter keeps every tensor it launched a kernel on in a reference cycle
        # until the next collection, which would count the forward's freed chunk buffer as live
        # into the backward; a GPU frees it when the forward returns.
        gc.collect()
    return stats.logp, stats.entropy


def run_one_pass(layer, workload, main_grad=None):
    """The one-pass path: the workload's loss given to the forward, which makes its gradient."""
    from fusedrl.kernels import linear_token_loss

    case = workload.case
    # grad_scale: the incoming gradient `backward` sends (1.0), which an fp16 call must name
    result = linear_token_loss(*layer, workload.ids, workload.row_loss, temperature=case.temperature,
                               with_entropy=case.entropy, chunk_rows=case.chunk_rows, main_grad=main_grad,
                               grad_scale=1.0)  # fmt: skip
    if layer.device.type == "cpu":
        gc.collect()  # as in run_fused
    return result.stats.logp, result.stats.entropy, result.loss


def run_one_pass_main_grad(layer, workload):
    """The one-pass path with the weight gradient added to the workload's fp32 main_grad (the
    benchmark's backward sends the loss a gradient of 1, so grad_scale = 1)."""
    return run_one_pass(layer, workload, workload.main_grad)


def run_unfused(layer, workload):
    """The path the fused one replaces: the logits in the layer's dtype, then token_stats."""
    from fusedrl.kernels import token_logprobs

    hidden, weight = layer
    case = workload.case
    return token_logprobs(hidden @ weight.t(), workload.ids, temperature=case.temperature, with_entropy=case.entropy)


def cost(tokens, hidden, vocab, itemsize, chunk_rows) -> dict:
    """The cost model of the module docstring, fwd+bwd: GEMM flops, bytes moved, peak extra bytes."""
    from fusedrl.kernels.linear_token_loss import WEIGHT_BUFFER_BUDGET  # imports triton: after pick_device
    from fusedrl.kernels.linear_token_stats import slice_columns

    chunks, slices = math.ceil(tokens / chunk_rows), math.ceil(vocab / slice_columns(tokens, vocab, chunk_rows))
    rows, weight, logits = tokens * hidden * itemsize, vocab * hidden * itemsize, tokens * vocab * itemsize
    accumulator, row_sums = vocab * hidden * 4, tokens * hidden * 4
    unfused_bytes = 3 * (rows + weight) + 6 * logits  # 3 GEMMs, the two token_stats passes (read, read + write)
    fused_bytes = 4 * slices * rows + 4 * weight + 7 * logits + 2 * slices * row_sums
    # the weight read per chunk by the forward and hidden-gradient GEMMs; the weight gradient
    # written once by one chunk's GEMM, else its fp32 sums read and written per chunk
    one_pass_common = 3 * rows + 2 * chunks * weight + 6 * logits
    summed = one_pass_common + 2 * chunks * accumulator
    chunk_extra = min(chunk_rows, tokens) * vocab * itemsize
    low_precision = itemsize < 4
    fused_extra = chunk_extra + (row_sums if low_precision else 0)
    # without main_grad, a low-precision one pass over several chunks whose fp32 sum exceeds the
    # budget takes the vocabulary walk: the recompute path's GEMMs, bytes and memory
    walks = low_precision and chunks > 1 and accumulator > WEIGHT_BUFFER_BUDGET
    return dict(
        unfused_flops=6 * tokens * vocab * hidden,
        fused_flops=8 * tokens * vocab * hidden,
        one_pass_flops=(8 if walks else 6) * tokens * vocab * hidden,
        one_pass_main_grad_flops=6 * tokens * vocab * hidden,
        unfused_bytes=unfused_bytes,
        fused_bytes=fused_bytes,
        one_pass_bytes=fused_bytes if walks else one_pass_common + weight if chunks == 1 else summed,
        one_pass_main_grad_bytes=summed,
        unfused_extra=2 * logits,
        fused_extra=fused_extra,
        one_pass_extra=fused_extra if walks else chunk_extra + (accumulator if low_precision and chunks > 1 else 0),
        one_pass_main_grad_extra=chunk_extra,  # main_grad is the trainer's, not the call's
        fused_chunk_extra=chunk_extra,
        one_pass_walks=walks,
    )
