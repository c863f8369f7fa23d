"""The output-layer hand-off of --fusedrl-fused-lm-head: hidden states out of the model, no logits.

slime's actor calls megatron-core's GPTModel, whose output layer (a `ColumnParallelLinear`)
turns the decoder's hidden states `[S, B, H]` into vocabulary-parallel logits `[S, B, V/tp]`.
Handed off, the layer returns the hidden states it would have multiplied instead, through the
same tensor-parallel region function its forward uses (sequence-parallel all-gather, or the
identity whose backward all-reduces), so their gradient is reduced across TP exactly as the
layer's backward reduces it. The model then returns `[1, T, H]` where slime expects logits, and
the log-prob path (`responses.ResponseTokens`) runs `linear_token_stats` on them with the weight
the layer was called with: the shared embedding weight when embeddings are tied (GPTModel passes
it in), else the layer's own.

The hand-off is installed on the models slime builds for the actor role (a critic keeps its value
head and the unfused path): the init hook wraps slime's `get_model_provider_func`
(`patching.handing_off_provider_func`). `restore()` puts every handed-off layer's own forward back.

Why the weight travels through module state: slime calls its loss as `loss_fn(args, batch, logits,
sum_of_sample_mean)`, with the model output in the logits' place and no way to pass the layer; the
output layer's forward, which the model calls with the weight it multiplies by (the shared
embedding weight when tied), records it here for the loss that reads that output next.
"""

import logging
import types
from typing import List, Optional

import torch

from . import megatron
from .callables import check_signature
from .flags.lm_head import FLAG


class _HandOffs:
    """The layers handed off in this process, the weight and config of the most recent hand-off
    call, and the config of the first model chunk built for the actor.

    slime's forward step runs the model and then its loss on the result, so the weight recorded by
    the call that produced a model output is the one the loss reads. The schedule scales the loss
    by the config of `model[0]` (`get_model_config(model[0])`, where slime sets `grad_scale_func`
    and megatron's schedules read `calculate_per_token_loss`); under virtual pipeline stages each
    chunk has its own config and the output layer sits on the last, so the provider records the
    first chunk's (`record_schedule_config`)."""

    def __init__(self):
        self.layers: List[torch.nn.Module] = []
        self.weight: Optional[torch.Tensor] = None
        self.config = None
        self.schedule_config = None


_STATE = _HandOffs()
_logger = logging.getLogger(__name__)
_LOGGED = set()


def log_path_once(reader: str, path: str) -> None:
    """Log, once per process and `reader`, which LM-head path computes what it reads."""
    if (reader, path) not in _LOGGED:
        _LOGGED.add((reader, path))
        _logger.info("fusedrl %s: fused LM head, %s", reader, path)


def _handed_off_forward(layer, input_, weight=None, runtime_gather_output=None):
    """`ColumnParallelLinear.forward` of a handed-off output layer: `(hidden states, None)`."""
    if runtime_gather_output:
        raise ValueError(f"{FLAG}: the output layer was asked for gathered logits (runtime_gather_output=True)")
    given = weight is not None
    weight = weight if given else layer.weight
    if weight is None:
        raise ValueError(f"{FLAG}: the output layer has no weight of its own (tied) and was given none")
    if tuple(weight.shape) != (layer.output_size_per_partition, layer.input_size):
        raise ValueError(
            f"{FLAG}: the output layer {'was given' if given else 'has'} a weight of shape {tuple(weight.shape)}, "
            f"expected {(layer.output_size_per_partition, layer.input_size)} (its vocabulary slice, whole: a weight "
            "sharded further, as by --tensor-parallel-num-weight-shards, is not supported)"
        )
    _STATE.weight, _STATE.config = weight, layer.config
    return megatron.column_parallel_input(layer, input_), None


def hand_off(layer) -> None:
    """Make megatron-core output layer `layer` return its (gathered) input instead of logits.

    Refuses, with a ValueError naming the flag, a layer whose logits something else would need or
    whose backward the hand-off does not reproduce."""
    if not isinstance(layer, megatron.column_parallel_linear_type()):
        raise ValueError(f"{FLAG} needs megatron-core's ColumnParallelLinear as the output layer, got {type(layer).__name__}")
    refusals = (
        (layer.bias is not None, "has a bias"),
        (layer.gather_output, "gathers its output (gather_output=True)"),
        (getattr(layer, "disable_grad_reduce", False), "does not reduce its input gradient (disable_grad_reduce)"),
        (getattr(layer, "is_expert", False), "is an expert layer"),
        (getattr(layer.config, "defer_embedding_wgrad_compute", False), "defers its weight gradient"),
    )
    for refused, why in refusals:
        if refused:
            raise ValueError(f"{FLAG} cannot hand off this output layer: it {why}")
    if any(handed is layer for handed in _STATE.layers):
        return
    forward = types.MethodType(_handed_off_forward, layer)
    check_signature(layer.forward, forward, f"{type(layer).__name__}.forward")
    layer.forward = forward
    _STATE.layers.append(layer)


def restore() -> None:
    """Give every handed-off layer its own forward back (and forget the recorded configs)."""
    while _STATE.layers:
        del _STATE.layers.pop().forward
    _STATE.weight = _STATE.config = _STATE.schedule_config = None


def record_schedule_config(config) -> None:
    """Record the config of the actor's first model chunk (`model[0]`: the chunk built with
    vp_stage 0, or the only one), the one megatron's schedule scales the loss by."""
    _STATE.schedule_config = config


def output_weight() -> Optional[torch.Tensor]:
    """The output weight `[V/tp, H]` of the most recent hand-off (None: the model returns logits)."""
    return _STATE.weight


def schedule_config():
    """The megatron-core config the schedule scales the loss by: the recorded first chunk's, else
    (a layer handed off outside slime's provider, one chunk) the most recent hand-off layer's."""
    return _STATE.config if _STATE.schedule_config is None else _STATE.schedule_config


def hidden_rows(output: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The model output `[1, T, H]` of a hand-off as `[T, H]` in the weight's dtype (megatron's
    Float16Module hands the last stage's output over in fp32; the cast back is exact)."""
    if output.dim() != 3 or output.shape[0] != 1 or output.shape[2] != weight.shape[1]:
        raise ValueError(
            f"{FLAG}: the model output must be the hidden states [1, T, H = {weight.shape[1]}], got shape "
            f"{tuple(output.shape)}"
        )
    return output[0].to(weight.dtype)
