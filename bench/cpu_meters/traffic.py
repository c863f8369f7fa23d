"""Bytes moved to and from memory: Triton kernels in the interpreter, aten operators by dispatch.

The CPU stand-in for a bandwidth measurement. Under ``TRITON_INTERPRET=1`` every ``tl.load`` and
``tl.store`` (plain, masked, block-pointer and tensor-descriptor forms all end in the interpreter
builder's masked load/store) is seen lane by lane, so the bytes a kernel would move on a GPU are
known exactly, masked-off lanes excluded. Host-side torch operators are counted at the aten level
(tensor inputs read plus tensor outputs written, per operator), which is a lower bound for them: an
operator that makes several passes internally (a softmax reads its input more than once) counts
once. Caches are not modelled: a row read twice counts twice, which is the point (the floor is one
read).
"""

import collections
import contextlib
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .aten_ops import ALLOCATING_OPS, package_op_body, relabels_memory, tensor_bytes, tensors_in

aten = torch.ops.aten

# In-place operators that overwrite `self` without reading it.
OVERWRITING_OPS = {aten.copy_, aten.zero_, aten.fill_}
# Operators that read only the elements of `self` they return.
INDEXING_OPS = {aten.gather, aten.index_select, aten.index}


@dataclass
class Bytes:
    """Bytes read and written by one kernel or operator (all its calls)."""

    read: int = 0
    written: int = 0
    calls: int = 0

    @property
    def total(self) -> int:
        return self.read + self.written


@dataclass
class Traffic:
    """Per-name byte counts: Triton kernels under `kernels`, aten operators under `operators`."""

    kernels: dict = field(default_factory=lambda: collections.defaultdict(Bytes))
    operators: dict = field(default_factory=lambda: collections.defaultdict(Bytes))

    @property
    def total(self) -> int:
        return sum(b.total for b in (*self.kernels.values(), *self.operators.values()))


def _active_lanes(ptrs, mask) -> int:
    """Lanes a memory op really touches: the mask broadcast over the pointer block."""
    return int(np.count_nonzero(np.broadcast_to(mask.data, ptrs.data.shape)))


def _element_bytes(ptrs) -> int:
    from triton.runtime.interpreter import _get_np_dtype

    return _get_np_dtype(ptrs.get_element_ty()).itemsize


def _bytes_read(func, args, kwargs, result) -> int:
    """Bytes of the tensor arguments an operator reads: write-only ones (`out=`, the destination
    of `copy_`, `zero_`, `fill_`) are skipped, and an indexing operator reads from `self` only as
    many elements as it returns."""
    total = 0
    for position, argument in enumerate(func._schema.arguments):
        value = kwargs.get(argument.name, args[position] if position < len(args) else None)
        mutated = argument.alias_info is not None and argument.alias_info.is_write
        if mutated and (argument.kwarg_only or func.overloadpacket in OVERWRITING_OPS):
            continue
        if argument.name == "self" and func.overloadpacket in INDEXING_OPS:
            value = result
        total += tensor_bytes(value)
    return total


class _AtenCounter(TorchDispatchMode):
    """Adds each aten operator's input and output bytes to `traffic.operators`."""

    def __init__(self, traffic: Traffic, paused):
        super().__init__()
        self.traffic, self.paused = traffic, paused

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        body = package_op_body(func)
        if body is not None:
            with self:
                return body(*args, **kwargs)
        result = func(*args, **kwargs)
        if self.paused() or relabels_memory(func) or func.overloadpacket in ALLOCATING_OPS:
            return result
        counted = self.traffic.operators[str(func.overloadpacket)]
        counted.read += _bytes_read(func, args, kwargs, result)
        counted.written += sum(tensor_bytes(out) for out in tensors_in(result))
        counted.calls += 1
        return result


@contextlib.contextmanager
def count_traffic():
    """Count the bytes every Triton kernel (per kernel name) and every aten operator (per operator)
    inside the block reads and writes.

    Needs the Triton interpreter (``TRITON_INTERPRET=1`` set before triton is imported): compiled
    kernels cannot be observed this way, and RuntimeError says so. The interpreter's own copies of
    kernel arguments are not counted.
    """
    import triton.knobs
    from triton.runtime import interpreter

    if not triton.knobs.runtime.interpret:
        raise RuntimeError("count_traffic needs TRITON_INTERPRET=1 set before triton is imported")
    traffic = Traffic()
    builder = interpreter.interpreter_builder
    executor = interpreter.GridExecutor
    plain_load, plain_store, plain_launch = builder.create_masked_load, builder.create_masked_store, executor.__call__
    launches = []  # names of the kernels being launched, innermost last

    def load(ptrs, mask, *args, **kwargs):
        traffic.kernels[launches[-1]].read += _active_lanes(ptrs, mask) * _element_bytes(ptrs)
        return plain_load(ptrs, mask, *args, **kwargs)

    def store(ptrs, value, mask, *args, **kwargs):
        traffic.kernels[launches[-1]].written += _active_lanes(ptrs, mask) * _element_bytes(ptrs)
        return plain_store(ptrs, value, mask, *args, **kwargs)

    def launch(self, *args, **kwargs):
        launches.append(self.fn.__name__)
        traffic.kernels[launches[-1]].calls += 1
        try:
            return plain_launch(self, *args, **kwargs)
        finally:
            launches.pop()

    builder.create_masked_load, builder.create_masked_store = load, store
    executor.__call__ = launch
    try:
        with _AtenCounter(traffic, paused=lambda: bool(launches)):
            yield traffic
    finally:
        del builder.create_masked_load, builder.create_masked_store
        executor.__call__ = plain_launch
