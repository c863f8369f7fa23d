"""What an aten operator does to memory, as seen from its arguments and results.

Shared by the byte counter and the allocation tally so that both agree on which operators only
relabel memory (views, `set_`) and how many bytes a tensor argument spans.
"""

import math

import torch
from torch._library.custom_ops import _maybe_get_opdef

aten = torch.ops.aten

# Operators that produce a tensor over memory that already exists, reading and writing nothing.
RELABELLING_OPS = {aten.set_, aten.lift_fresh, aten.alias}
# Operators that reserve memory without touching it.
ALLOCATING_OPS = {aten.empty, aten.empty_like, aten.empty_strided, aten.new_empty, aten.new_empty_strided}


def relabels_memory(func) -> bool:
    """True for views and metadata-only operators: their results alias existing storage."""
    return func.is_view or func.overloadpacket in RELABELLING_OPS


def package_op_body(func):
    """The Python body of a `fusedrl::` torch op (the kernels' host code), else None.

    To a dispatch mode a custom op is one opaque call. The meters run its body under themselves
    instead, so they see what it does (Triton launches, aten operators, allocations), not its
    inputs and outputs as if they were one aten operator's. torch has no public handle on the body.
    """
    if func.namespace != "fusedrl":
        return None
    definition = _maybe_get_opdef(func)
    return None if definition is None else definition._init_fn


def tensor_bytes(value) -> int:
    """Bytes a tensor (or a list of tensors) addresses; broadcast (stride 0) dimensions count once."""
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(item) for item in value)
    if not isinstance(value, torch.Tensor):
        return 0
    distinct = math.prod(size for size, stride in zip(value.shape, value.stride()) if stride != 0)
    return distinct * value.element_size() if value.numel() else 0


def tensors_in(value):
    """The tensors in a (possibly nested) argument or result structure."""
    return [leaf for leaf in torch.utils._pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)]
