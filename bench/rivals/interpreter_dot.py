"""bf16 `tl.dot` in the Triton interpreter, made to multiply numbers instead of bit patterns.

The interpreter (Triton 3.8 at least) stores a bf16 tile as numpy uint16 bits, and its `create_dot`
converts only fp8 operands before `np.matmul`: a bf16 x bf16 dot multiplies the raw integers (a
16 x 16 product of N(0, 1) tiles comes out about 2e10 off; triton-lang/triton issue 11584, closed
upstream as not supported yet). The package's kernels run no `tl.dot`;
verl's linear cross-entropy does all its logits GEMMs with it. `correct_bf16_dot` widens bf16
operands to fp32 first, which is what a GPU's tensor cores compute (bf16 products are exact in
fp32, accumulated in fp32), so verl's bf16 figures on CPU are its own and not the interpreter's.
It patches the interpreter's class, so the GEMM-flop counter (bench/harness/flops.py), which wraps
the interpreter's instance, still sees every dot.
"""

import numpy as np


def _widened(tile):
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle

    if tile.dtype != tl.bfloat16:
        return tile
    return TensorHandle((tile.data.astype(np.uint32) << 16).view(np.float32), tl.float32)


def correct_bf16_dot():
    """Patch the interpreter's `create_dot` once per process (a no-op when already patched)."""
    from triton.runtime.interpreter import InterpreterBuilder

    plain = InterpreterBuilder.create_dot
    if getattr(plain, "widens_bf16", False):
        return

    def create_dot(self, a, b, d, *args, **kwargs):
        return plain(self, _widened(a), _widened(b), d, *args, **kwargs)

    create_dot.widens_bf16 = True
    InterpreterBuilder.create_dot = create_dot
