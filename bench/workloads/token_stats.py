"""Inputs and float64 truth for the token-statistics cases."""

from dataclasses import dataclass
from typing import Optional

import torch

from ..harness.accuracy import RelativeError

# Rows of float64 reference computed at a time (bounds its memory at the GPU shapes).
REFERENCE_CHUNK_BYTES = 1 << 28


@dataclass
class TokenWorkload:
    """Logits, ids, and the upstream gradients of logp and entropy; outputs are (logp, entropy)."""

    case: object
    logits: torch.Tensor
    ids: torch.Tensor
    logp_grad: torch.Tensor
    entropy_grad: Optional[torch.Tensor]

    @classmethod
    def make(cls, case, device, seed=0):
        generator = torch.Generator(device=device).manual_seed(seed)
        shape = (case.tokens, case.vocab)
        logits = torch.randn(shape, device=device, generator=generator, dtype=torch.float32).mul_(2.0)
        ids = torch.randint(0, case.vocab, (case.tokens, case.ids_per_row), device=device, generator=generator)
        logp_grad = torch.randn(ids.shape, device=device, generator=generator)
        entropy_grad = torch.randn(case.tokens, device=device, generator=generator) if case.entropy else None
        return cls(case, logits.to(case.torch_dtype), ids, logp_grad, entropy_grad)

    @property
    def main_input(self) -> torch.Tensor:
        return self.logits

    def leaf(self) -> torch.Tensor:
        """A private copy of the logits that requires grad (some peers write into their input)."""
        return self.logits.detach().clone().requires_grad_()

    def backward(self, logits, outputs, rows=slice(None)) -> torch.Tensor:
        """d(sum logp * logp_grad + sum entropy * entropy_grad) / d logits, for `rows` of the batch."""
        logp, entropy = outputs
        tensors, grads = [logp], [self.logp_grad[rows]]
        if entropy is not None:
            tensors.append(entropy)
            grads.append(self.entropy_grad[rows])
        (grad,) = torch.autograd.grad(tensors, logits, [g.to(t.dtype) for g, t in zip(grads, tensors)])
        return grad

    def errors(self, outputs, grad):
        """(forward, backward) relative errors against the float64 reference, chunk by chunk; the
        forward one is the worse of logp and entropy."""
        from fusedrl.kernels import token_logprobs_reference

        case = self.case
        chunk = max(1, REFERENCE_CHUNK_BYTES // (case.vocab * 8))
        error = RelativeError()
        for start in range(0, case.tokens, chunk):
            rows = slice(start, start + chunk)
            exact = self.logits[rows].double().requires_grad_()
            truth = token_logprobs_reference(
                exact, self.ids[rows], temperature=case.temperature, with_entropy=case.entropy
            )
            error.add("logp", outputs[0][rows], truth[0])
            if case.entropy:
                error.add("entropy", outputs[1][rows], truth[1])
            error.add("grad", grad[rows], self.backward(exact, truth, rows))
        return error.worst("logp", "entropy"), error["grad"]
