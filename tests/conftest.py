"""Test-session setup: where the kernels under test run (tests/device.py).

Default: CPU tensors exercise the Triton kernels through the Triton interpreter. Without
TRITON_INTERPRET=1 the public functions take the eager reference on CPU tensors, and the parity
tests would compare the reference with itself; so the interpreter is switched on before anything
imports triton. With FUSEDRL_TEST_DEVICE=cuda the kernels run compiled on the GPU instead.
"""

import os

from device import ON_GPU, install

if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
install()
