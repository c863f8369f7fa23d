"""Where the kernels under test run: `FUSEDRL_TEST_DEVICE=cuda` runs them on the GPU; the default
(cpu) runs them in the Triton interpreter.

On CUDA the public entry points (`token_stats`, `token_logprobs`, `segment_sum`) are wrapped so
that every test, the losses' included, keeps building its inputs and float64 truths on CPU while
the kernels receive CUDA copies; the outputs come back to CPU through differentiable copies, so
gradients and tolerances are checked as written. Tests that call host functions directly move
their tensors with `to_device`.
"""

import functools
import os
import sys

import torch

DEVICE = torch.device(os.environ.get("FUSEDRL_TEST_DEVICE", "cpu"))
ON_GPU = DEVICE.type == "cuda"


def to_device(value):
    """CPU tensors (also inside lists, tuples and dicts) moved to the test device."""
    if isinstance(value, torch.Tensor):
        return value.to(DEVICE) if value.device.type == "cpu" else value
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(to_device(item) for item in value)
    if isinstance(value, dict):
        return {key: to_device(item) for key, item in value.items()}
    return value


def to_cpu(value):
    """Results back on CPU (NamedTuples such as TokenStats keep their type)."""
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if hasattr(value, "_fields"):
        return type(value)(*(to_cpu(item) for item in value))
    if isinstance(value, (list, tuple)):
        return type(value)(to_cpu(item) for item in value)
    return value


def on_cpu(fn):
    """The entry point itself, unwrapped: for tests of the CPU dispatch."""
    return getattr(fn, "__wrapped__", fn)


def _on_device(fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        return to_cpu(fn(*to_device(args), **to_device(kwargs)))

    return run


def install() -> None:
    """On CUDA, wrap the public entry points where every importer will find them (call before
    anything imports fusedrl's slime or SGLang side)."""
    if not ON_GPU:
        return
    if not torch.cuda.is_available():
        raise RuntimeError("FUSEDRL_TEST_DEVICE=cuda but torch sees no GPU")
    import fusedrl.kernels as kernels

    token_module = sys.modules["fusedrl.kernels.token_stats"]
    segment_module = sys.modules["fusedrl.kernels.segment_sum"]
    for name in ("token_stats", "token_logprobs"):
        wrapped = _on_device(getattr(token_module, name))
        setattr(kernels, name, wrapped)
        setattr(token_module, name, wrapped)
    wrapped = _on_device(segment_module.segment_sum)
    setattr(kernels, "segment_sum", wrapped)
    setattr(segment_module, "segment_sum", wrapped)
