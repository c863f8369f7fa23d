"""Which tensor-parallel group the vocabulary is split over.

An explicit group wins; otherwise megatron-core's tensor-model-parallel group when it is
initialised (slime's case); otherwise no split (tp = 1). megatron-core is optional.

A process group cannot be an argument of a torch custom op, so the ops carry it by its registered
name (`ProcessGroup.group_name`), as torch's own functional collectives do, and look it up inside.
"""

import sys
from typing import NamedTuple, Optional

import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group


class TensorParallel(NamedTuple):
    group: Optional[object]
    size: int
    rank: int


def resolve_tp(tp_group=None) -> TensorParallel:
    """The group, its size and this process's rank in it (size 1 and group None when unsplit).

    Anything but None or a `torch.distributed.ProcessGroup` is refused, naming `tp_group`: a
    mistyped group would otherwise be ignored (no split) while the logits are a vocabulary shard."""
    if tp_group is not None and not isinstance(tp_group, dist.ProcessGroup):
        raise ValueError(
            f"tp_group must be a torch.distributed.ProcessGroup or None, got {type(tp_group).__name__} {tp_group!r:.60}"
        )
    if tp_group is None:
        tp_group = _megatron_tp_group()
    if tp_group is None or not dist.is_initialized():
        return TensorParallel(None, 1, 0)
    size = dist.get_world_size(tp_group)
    if size == 1:
        return TensorParallel(None, 1, 0)
    return TensorParallel(tp_group, size, dist.get_rank(tp_group))


def group_name(tp: TensorParallel) -> Optional[str]:
    """The name a custom op receives the group by; None when the vocabulary is not split."""
    return None if tp.group is None else tp.group.group_name


def tp_from_group_name(name: Optional[str]) -> TensorParallel:
    """Inside a custom op: the group registered under `name` (None: no split), its size and rank."""
    if name is None:
        return TensorParallel(None, 1, 0)
    group = _resolve_process_group(name)
    return TensorParallel(group, dist.get_world_size(group), dist.get_rank(group))


def _megatron_tp_group():
    # Only a process that imported parallel_state can have initialised it: skip the heavy import.
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is None or not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_tensor_model_parallel_group()
