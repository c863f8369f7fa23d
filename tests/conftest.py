"""Test-session setup: where the kernels under test run (tests/device.py), and the `device` fixture.

Default: CPU tensors exercise the Triton kernels through the Triton interpreter. Without
TRITON_INTERPRET=1 the public functions take the eager reference on CPU tensors, and the parity
tests would compare the reference with itself; so the interpreter is switched on before anything
imports triton. With FUSEDRL_TEST_DEVICE=cuda the kernels run compiled on the GPU instead, on the
tensors each test moves to `device`.
"""

import os

import pytest
import torch
from device import DEVICE, ON_GPU

if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
elif not torch.cuda.is_available():
    raise RuntimeError("FUSEDRL_TEST_DEVICE=cuda but torch sees no GPU")


@pytest.fixture
def device() -> torch.device:
    """Where a test puts the kernels' inputs: CUDA under FUSEDRL_TEST_DEVICE=cuda, else CPU."""
    return DEVICE
