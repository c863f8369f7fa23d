"""Inputs, float64 truth and slime's eager form for the aggregation (segmented masked sum) cases."""

from dataclasses import dataclass

import torch

from ..harness.accuracy import RelativeError


@dataclass
class SegmentWorkload:
    """Per-token values [T, C], mask [T], segment ids [T] (contiguous samples, as slime packs them),
    denominators [S] and the upstream gradient [C]; the output is the [C] sums."""

    case: object
    values: torch.Tensor
    mask: torch.Tensor
    segment_ids: torch.Tensor
    sample_lengths: list
    denominators: torch.Tensor
    out_grad: torch.Tensor

    @classmethod
    def make(cls, case, device, seed=0):
        generator = torch.Generator(device=device).manual_seed(seed)
        cuts = torch.randperm(case.tokens - 1, generator=generator, device=device)[: case.segments - 1] + 1
        bounds = [0] + sorted(cuts.tolist()) + [case.tokens]
        lengths = [b - a for a, b in zip(bounds, bounds[1:])]
        segment_ids = torch.repeat_interleave(torch.arange(case.segments, device=device),
                                              torch.tensor(lengths, device=device))  # fmt: skip
        mask = (torch.rand(case.tokens, device=device, generator=generator) < 0.8).float()
        per_segment = torch.zeros(case.segments, device=device).index_add_(0, segment_ids, mask)
        values = torch.randn((case.tokens, case.channels), device=device, generator=generator)
        out_grad = torch.randn(case.channels, device=device, generator=generator)
        return cls(case, values.to(case.torch_dtype), mask, segment_ids, lengths, per_segment.clamp_min(1.0), out_grad)

    @property
    def main_input(self) -> torch.Tensor:
        return self.values

    def leaf(self) -> torch.Tensor:
        return self.values.detach().clone().requires_grad_()

    def backward(self, values, outputs) -> torch.Tensor:
        (grad,) = torch.autograd.grad(outputs, values, self.out_grad.to(outputs.dtype))
        return grad

    def errors(self, outputs, grad):
        """(forward, backward) relative errors against the float64 reference."""
        from fusedrl.kernels.reference import segment_sum_reference

        exact = self.values.double().requires_grad_()
        truth = segment_sum_reference(exact, self.mask, self.segment_ids, self.denominators)
        error = RelativeError()
        error.add("sums", outputs, truth)
        error.add("grad", grad, self.backward(exact, truth))
        return error["sums"], error["grad"]


def eager_sum_of_sample_mean(values, workload):
    """slime's `sum_of_sample_mean` over all channels at once: per sample, the masked sum of its
    tokens over its denominator, added over samples (one small kernel chain per sample)."""
    parts = zip(values.split(workload.sample_lengths), workload.mask.split(workload.sample_lengths),
                workload.denominators)  # fmt: skip
    return sum((part * mask.unsqueeze(1)).sum(dim=0) / denominator for part, mask, denominator in parts)
