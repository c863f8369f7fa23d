"""Test-session setup: CPU tests exercise the Triton kernels through the Triton interpreter.

Without TRITON_INTERPRET=1 the public functions take the eager reference on CPU tensors, and the
parity tests would compare the reference with itself; so the interpreter is switched on before
anything imports triton.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
