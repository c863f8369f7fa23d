"""The slime integration's one door to Megatron: parallel state and the train actor's args.

slime's train actor initialises megatron-core's `parallel_state` before any hook or loss of this
package runs, and registers its parsed args with `megatron.training` (`set_args`). Everything the
package reads from Megatron goes through here, so a process without Megatron (rollout workers,
tests of the pure layouts) sees a single, unsplit rank. The kernels resolve their own default
tensor-parallel group (`fusedrl.kernels`, which knows nothing of slime); the slime paths hand them
the group from here explicitly.
"""

import sys
from typing import Optional, Tuple

import torch.distributed as dist


def _parallel_state():
    """megatron-core's parallel_state when initialised, else None.

    Only a process that imported it can have initialised it, so the heavy import is skipped."""
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is None or not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state


def cp_rank_and_size() -> Tuple[int, int]:
    """This process's context-parallel rank and size ((0, 1) when Megatron is not initialised)."""
    parallel_state = _parallel_state()
    if parallel_state is None:
        return 0, 1
    return parallel_state.get_context_parallel_rank(), parallel_state.get_context_parallel_world_size()


def dp_cp_size() -> int:
    """The data-parallel world size with context parallelism folded in (1 without Megatron), the
    factor slime's `loss_function` multiplies the loss by."""
    parallel_state = _parallel_state()
    return 1 if parallel_state is None else parallel_state.get_data_parallel_world_size(with_context_parallel=True)


def cp_group():
    """The context-parallel process group (None when Megatron is not initialised)."""
    parallel_state = _parallel_state()
    return None if parallel_state is None else parallel_state.get_context_parallel_group()


def tp_group():
    """The tensor-parallel process group the vocabulary is split over (None when unsplit)."""
    parallel_state = _parallel_state()
    return None if parallel_state is None else parallel_state.get_tensor_model_parallel_group()


def rank_and_size(group: Optional[object]) -> Tuple[int, int]:
    """This process's rank in `group` and the group's size ((0, 1) for no group)."""
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def train_args():
    """The args slime's train actor registered with Megatron (initialize.init -> set_args)."""
    from megatron.training.global_vars import get_args

    return get_args()


def column_parallel_linear_type() -> type:
    """megatron-core's `ColumnParallelLinear`, the class of GPTModel's output layer."""
    from megatron.core.tensor_parallel import ColumnParallelLinear

    return ColumnParallelLinear


def column_parallel_input(layer, input_):
    """The input `layer` (a `ColumnParallelLinear`) multiplies, through the region function its own
    forward uses, so that the backward reduces the input gradient across tensor parallelism as the
    layer's does: all-gather forward and reduce-scatter backward over the sequence dimension under
    sequence parallelism, else identity forward and all-reduce backward."""
    from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region

    group = getattr(layer, "tp_group", None)  # None: megatron-core's tensor-parallel group
    if layer.sequence_parallel:
        return gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True, group=group)
    return copy_to_tensor_model_parallel_region(input_, group=group)
