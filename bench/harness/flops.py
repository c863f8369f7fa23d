"""GEMM flops a computation runs, counted by torch's `FlopCounterMode` (matrix products only: the
Triton kernels are not aten operators and count nothing).

Two additions make the count whole. The in-place `addmm_` (how an fp32 accumulator takes a
product) has no formula in torch's registry; it gets `addmm`'s. And a `fusedrl::` torch op is one
opaque call to a dispatch mode, so its body (the host code, with its GEMMs) is run under the
counter instead, as the memory and traffic meters do.
"""

import contextlib

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


class GemmFlops:
    """`with GemmFlops() as flops: ...`, then `flops.total`: the GEMM flops run inside."""

    def __enter__(self):
        # imports triton: not before `pick_device` has switched the interpreter on
        from torch.utils.flop_counter import FlopCounterMode

        self._stack = contextlib.ExitStack()
        self._counter = self._stack.enter_context(FlopCounterMode(display=False, custom_mapping={aten.addmm_: _addmm_flops}))
        self._stack.enter_context(_PackageOpBodies())
        return self

    def __exit__(self, *exc):
        self.total = self._counter.get_total_flops()
        return self._stack.__exit__(*exc)
