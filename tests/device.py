"""Where the kernels under test run: `FUSEDRL_TEST_DEVICE=cuda` runs them compiled on the GPU; the
default (cpu) runs them in the Triton interpreter.

Tests take the `device` fixture (tests/conftest.py) and move the inputs of the kernels to it;
their float64 truths are computed on CPU from the same CPU inputs, and results are compared on CPU
(`numerics.rel_err` and `assert_parity` move what they compare there). `DEVICE` and `ON_GPU` are
the switch itself, for helper modules and for tests that only make sense on one side.
"""

import os

import torch

DEVICE = torch.device(os.environ.get("FUSEDRL_TEST_DEVICE", "cpu"))
ON_GPU = DEVICE.type == "cuda"


def to_device(value, device):
    """`value` with its tensors (also inside lists, tuples and dicts) moved to `device`."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(to_device(item, device) for item in value)
    if isinstance(value, dict):
        return {key: to_device(item, device) for key, item in value.items()}
    return value


def to_cpu(value):
    """Results back on CPU (NamedTuples such as TokenStats keep their type; None stays None)."""
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if hasattr(value, "_fields"):
        return type(value)(*(to_cpu(item) for item in value))
    if isinstance(value, (list, tuple)):
        return type(value)(to_cpu(item) for item in value)
    if isinstance(value, dict):
        return {key: to_cpu(item) for key, item in value.items()}
    return value
