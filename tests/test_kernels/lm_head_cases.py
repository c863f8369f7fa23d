"""Layers, gradients and the float64 truth shared by the fused-LM-head tests (tp = 1 and tp > 1)."""

import torch
from device import to_cpu, to_device
from token_stats_cases import loss_of, upstream_grads

from fusedrl.kernels import token_stats_reference


def random_layer(num_rows, width, vocab, dtype, generator, logit_scale=3.0):
    """hidden [T, H] and weight [V, H] whose product has entries of about `logit_scale`."""
    hidden = torch.randn(num_rows, width, generator=generator)
    weight = torch.randn(vocab, width, generator=generator) * (logit_scale / width**0.5)
    return hidden.to(dtype), weight.to(dtype)


def head_with_grad(fn, hidden, weight, ids, grads=None, device=None, **kwargs):
    """Outputs, upstream gradients and (d hidden, d weight) of fn(hidden, weight, ids, **kwargs).

    device: where fn runs (the `device` fixture, for the LM head under test): hidden, weight, ids
    and the tensors among kwargs are moved there. None: fn runs on the tensors as given (the
    float64 truth, on CPU). Outputs and gradients come back on CPU."""
    if device is not None:
        hidden, weight, ids, kwargs = to_device((hidden, weight, ids, kwargs), device)
    hidden = hidden.detach().requires_grad_(True)
    weight = weight.detach().requires_grad_(True)
    stats = fn(hidden, weight, ids, **kwargs)
    grads = grads or upstream_grads(stats, torch.Generator().manual_seed(7))
    grad_hidden, grad_weight = torch.autograd.grad(loss_of(stats, grads), [hidden, weight])
    return to_cpu(stats), grads, (grad_hidden.cpu(), grad_weight.cpu())


def truth_head(hidden, weight, ids, **kwargs):
    """The float64 truth: the full logits in float64, then the eager reference."""
    kwargs.pop("chunk_rows", None)
    return token_stats_reference(hidden.double() @ weight.double().t(), ids, **kwargs)
