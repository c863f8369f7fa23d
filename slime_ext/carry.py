"""Carrying the package's own per-sample and per-token tensors from slime's rollout side to the loss.

slime forwards `Sample.multimodal_train_inputs` (a dict of tensors, or None) untouched from the
rollout to the train actors. Per micro-batch, `get_batch` (slime/backends/megatron_utils/data.py)
concatenates the dicts of the micro-batch's samples key by key along dim 0 (skipping samples whose
dict is None) into `batch["multimodal_train_inputs"]`, and the training and log-prob forward steps
(model.py) splat that dict into the model's forward keyword arguments. The package rides on this:

- Keys start with `fusedrl_`. Every sample of the step carries every key the step uses (a sample
  without it would shift the concatenation of the others), and each tensor's dim 0 is either one
  row per sample or one row per response token (the full response: slime does not slice these
  tensors for context parallelism, so the readers here do).
- The model must never receive these keys: `without_carried_inputs(get_batch)` wraps slime's
  `get_batch` so that they move from `batch["multimodal_train_inputs"]` to `batch[CARRIED_KEY]`
  before the forward step builds its kwargs (the batch dict itself is what the loss receives).
  The init hook (slime_ext/patching.py) puts the wrapper in place of slime's `get_batch` in every
  loaded module holding it (data.py, and model.py that imported it).
- The readers look in `batch[CARRIED_KEY]` and, when the wrapper has not run (a caller that
  builds the batch itself), in `batch["multimodal_train_inputs"]`.

The keys the package carries are defined here, where both sides (rollout writers, train readers)
find them without importing each other.
"""

import functools
from typing import Dict, List, Optional

import torch

from . import megatron
from .context_parallel import slice_response

PREFIX = "fusedrl_"
CARRIED_KEY = "fusedrl_carried"

# Per sample, attached by rollout/prompt_groups.py under --loss-aggregation prompt_mean:
PROMPT_DENOMINATOR_KEY = "fusedrl_prompt_denominator"  # [1] float64: the sample's prompt-group D_s
# Per response token, attached by rollout/sfc_draws.py for the SFC loss:
SFC_DRAWS_KEY = "fusedrl_sfc_draws"  # [resp_len, K] int64: the sampler's K draws at each position
SFC_VERSIONS_KEY = "fusedrl_sfc_versions"  # [resp_len] int64: weight version that sampled the token
SFC_DRAW_WEIGHTS_KEY = "fusedrl_sfc_draw_weights"  # optional [resp_len, K] float: centering weights
_FILTER_MARK = "_fusedrl_without_carried_inputs"


def _check_key(key) -> None:
    if not isinstance(key, str) or not key.startswith(PREFIX):
        raise ValueError(f"carried keys must be strings starting with {PREFIX!r}, got {key!r}")


def attach(sample, key: str, tensor: torch.Tensor) -> None:
    """Put `tensor` under `key` in `sample.multimodal_train_inputs` (creating the dict if None)."""
    _check_key(key)
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"carried values must be torch.Tensor, got {type(tensor).__name__} for {key!r}")
    if sample.multimodal_train_inputs is None:
        sample.multimodal_train_inputs = {}
    sample.multimodal_train_inputs[key] = tensor


def carried(batch: dict) -> Dict[str, torch.Tensor]:
    """The micro-batch's carried tensors by key (concatenated over its samples along dim 0)."""
    moved = batch.get(CARRIED_KEY)
    if moved is not None:
        return moved
    inputs = batch.get("multimodal_train_inputs") or {}
    return {key: value for key, value in inputs.items() if key.startswith(PREFIX)}


def _carried_tensor(batch: dict, key: str) -> torch.Tensor:
    _check_key(key)
    tensors = carried(batch)
    if key not in tensors:
        raise ValueError(
            f"the micro-batch carries no {key!r} (carried keys: {sorted(tensors)}); the rollout side "
            "must attach it to every sample of the step"
        )
    return tensors[key]


def per_sample(batch: dict, key: str) -> torch.Tensor:
    """The carried per-sample tensor `key`: one row per sample of the micro-batch, in batch order."""
    tensor = _carried_tensor(batch, key)
    num_samples = len(batch["response_lengths"])
    if tensor.shape[0] != num_samples:
        raise ValueError(
            f"carried {key!r} must have one row per sample ({num_samples}), got shape {tuple(tensor.shape)}"
        )
    return tensor


def per_token(batch: dict, key: str, cp_rank: Optional[int] = None, cp_size: Optional[int] = None) -> List[torch.Tensor]:
    """The carried per-token tensor `key`, per sample, restricted to this context-parallel rank's
    response positions in slime's zigzag order (the layout of `batch["advantages"]`); cp rank and
    size default to megatron-core's."""
    tensor = _carried_tensor(batch, key)
    response_lengths = list(batch["response_lengths"])
    if tensor.shape[0] != sum(response_lengths):
        raise ValueError(
            f"carried {key!r} must have one row per response token ({sum(response_lengths)}), "
            f"got shape {tuple(tensor.shape)}"
        )
    if cp_rank is None or cp_size is None:
        cp_rank, cp_size = megatron.cp_rank_and_size()
    return [
        slice_response(part, total, response, cp_rank, cp_size)
        for part, total, response in zip(
            tensor.split(response_lengths), batch["total_lengths"], response_lengths, strict=True
        )
    ]


def without_carried_inputs(get_batch):
    """slime's `get_batch`, with the package's keys moved out of the model's forward kwargs.

    Wrapping an already wrapped function returns it unchanged, so installing twice is harmless;
    the original stays reachable as `__wrapped__`.
    """
    if getattr(get_batch, _FILTER_MARK, False):
        return get_batch

    @functools.wraps(get_batch)
    def get_batch_without_carried_inputs(*args, **kwargs):
        batch = get_batch(*args, **kwargs)
        inputs = batch.get("multimodal_train_inputs")
        if inputs:
            ours = {key: inputs.pop(key) for key in list(inputs) if key.startswith(PREFIX)}
            if ours:
                batch[CARRIED_KEY] = ours
            if not inputs:
                batch["multimodal_train_inputs"] = None
        return batch

    setattr(get_batch_without_carried_inputs, _FILTER_MARK, True)
    return get_batch_without_carried_inputs

