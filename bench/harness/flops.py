"""GEMM flops a computation runs, counted by torch's `FlopCounterMode` (matrix products only) and,
under the Triton interpreter, by every `tl.dot` a Triton kernel runs.

Three additions make the count whole. The in-place `addmm_` (how an fp32 accumulator takes a
product) has no formula in torch's registry; it gets `addmm`'s. And a `fusedrl::` torch op is one
opaque call to a dispatch mode, so its body (the host code, with its GEMMs) is run under the
counter instead, as the memory and traffic meters do. And a Triton kernel is no aten operator: on
CPU, where it runs in the interpreter, each `tl.dot` of an [M, K] by a [K, N] tile adds 2 M K N
(whole tiles, rows past the matrix's edge included, as the GPU's tensor cores compute them). A
compiled kernel cannot be observed so: on a GPU the Triton GEMMs of a peer (verl's) count nothing.
"""

import contextlib
import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..cpu_meters.aten_ops import package_op_body

aten = torch.ops.aten


def _addmm_flops(self_shape, a_shape, b_shape, out_shape=None, **kwargs) -> int:
    """acc += a @ b: 2 M K N, as torch counts `addmm` (torch passes the arguments' shapes)."""
    (rows, inner), (_, columns) = a_shape, b_shape
    return 2 * rows * inner * columns


class _PackageOpBodies(TorchDispatchMode):
    """Runs each `fusedrl::` op's body under the modes below it, so they see its operators."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        body = package_op_body(func)
        if body is not None:
            with self:
                return body(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _interpreted_dots(counted: list):
    """Adds 2 M K N to `counted[0]` for each `tl.dot` the Triton interpreter runs in the block (none
    when the interpreter is off)."""
    import triton.knobs

    if not triton.knobs.runtime.interpret:
        yield
        return
    from triton.runtime.interpreter import interpreter_builder as builder

    plain_dot = builder.create_dot

    def dot(a, b, *args, **kwargs):
        *batch, rows, inner = a.data.shape
        counted[0] += 2 * math.prod(batch) * rows * inner * b.data.shape[-1]
        return plain_dot(a, b, *args, **kwargs)

    builder.create_dot = dot
    try:
        yield
    finally:
        del builder.create_dot


class GemmFlops:
    """`with GemmFlops() as flops: ...`, then `flops.total`: the GEMM flops run inside."""

    def __enter__(self):
        # imports triton: not before `pick_device` has switched the interpreter on
        from torch.utils.flop_counter import FlopCounterMode

        self._stack = contextlib.ExitStack()
        self._counter = self._stack.enter_context(FlopCounterMode(display=False, custom_mapping={aten.addmm_: _addmm_flops}))
        self._stack.enter_context(_PackageOpBodies())
        self._triton = [0]
        self._stack.enter_context(_interpreted_dots(self._triton))
        return self

    def __exit__(self, *exc):
        self.total = self._counter.get_total_flops() + self._triton[0]
        return self._stack.__exit__(*exc)
