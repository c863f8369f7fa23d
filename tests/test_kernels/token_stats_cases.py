"""Inputs, upstream gradients and probes shared by the token-statistics tests (tp = 1 and tp > 1)."""

import torch
import torch.distributed as dist
from device import to_cpu, to_device


def make_ids(num_rows, vocab, num_ids, generator):
    """Random ids whose slot 0 is the sampled token; slots repeat it and each other."""
    ids = torch.randint(0, vocab, (num_rows, num_ids), generator=generator)
    if num_ids > 2:
        ids[:, 1] = ids[:, 0]
        ids[:, 2] = ids[:, -1]
    return ids


def upstream_grads(stats, generator):
    """Random upstream gradients for every output of TokenStats (on CPU; `loss_of` moves them)."""

    def like(t):
        return None if t is None else torch.randn(t.shape, generator=generator, dtype=torch.float32)

    return [like(t) for t in stats]


def loss_of(stats, grads):
    """sum(out * g) over the outputs with an upstream gradient (None: the loss does not use it),
    each g moved to its output's device."""
    return sum(
        (out.double() * g.to(out.device).double()).sum() for out, g in zip(stats, grads) if out is not None and g is not None
    )


def run_with_grad(fn, logits, ids, grads=None, device=None, **kwargs):
    """Outputs, upstream gradients and d(loss)/d(logits) of fn(logits, ids, **kwargs).

    device: where fn runs (the `device` fixture, for the kernels under test): logits, ids and the
    tensors among kwargs are moved there. None: fn runs on the tensors as given (the float64 truth,
    on CPU). Outputs and gradient come back on CPU."""
    if device is not None:
        logits, ids, kwargs = to_device((logits, ids, kwargs), device)
    logits = logits.detach().requires_grad_(True)
    stats = fn(logits, ids, **kwargs)
    grads = grads or upstream_grads(stats, torch.Generator().manual_seed(7))
    (grad,) = torch.autograd.grad(loss_of(stats, grads), logits)
    return to_cpu(stats), grads, grad.cpu()


def random_logits(num_rows, vocab, dtype, generator, scale=3.0):
    return (torch.randn(num_rows, vocab, generator=generator) * scale).to(dtype)


COLLECTIVES = ["all_gather", "all_gather_into_tensor", "all_reduce", "reduce_scatter_tensor",
               "broadcast", "all_to_all_single", "reduce", "gather", "scatter"]


class CollectiveCounter:
    """Counts calls of torch.distributed collectives while active."""

    def __init__(self):
        self.calls = 0
        self._originals = {}

    def __enter__(self):
        for name in COLLECTIVES:
            original = getattr(dist, name)
            self._originals[name] = original

            def counted(*args, _original=original, **kwargs):
                self.calls += 1
                return _original(*args, **kwargs)

            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc):
        for name, original in self._originals.items():
            setattr(dist, name, original)
