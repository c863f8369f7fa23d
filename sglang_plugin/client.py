"""Client side: turn a `/generate` response's `meta_info` into token-sample tensors.

The request must carry `return_logprob: true` and `top_logprobs_num: K` and go to a server
running the plugin with AGENTCORE_SGLANG_TOKEN_SAMPLES=1. Each output position's
`output_top_logprobs` entry is then the sampled token followed by K draws, each a
`[logprob, token_id, text_or_null]` triple, or, for a request that sets SGLang's
`return_flat_raw_output_top_logprobs`, one row of the flat `output_top_logprobs_*` arrays (JSON
lists or, with `return_flat_raw_top_logprobs_b64`, base64). Anything else (a server without the
plugin returns K top tokens, not 1 + K entries) is rejected rather than misread as draws.

    samples = parse_token_samples(response["meta_info"], num_samples=K)
    samples.draw_ids        # [resp_len, K] long
"""

from __future__ import annotations

import base64
import math
from typing import Any, List, Mapping, NamedTuple, Optional

import numpy as np
import torch

_FLAT = "output_top_logprobs"
_FLAT_DTYPES = {"val": ("float32", "<f4"), "idx": ("int32", "<i4")}


class TokenSamples(NamedTuple):
    """Per output position t: the sampled token, K draws from its distribution, logprobs."""

    sampled_ids: torch.Tensor  # [resp_len] long
    sampled_logprobs: torch.Tensor  # [resp_len] float32
    draw_ids: torch.Tensor  # [resp_len, K] long
    draw_logprobs: torch.Tensor  # [resp_len, K] float32
    weight_version: Optional[Any]  # meta_info["weight_version"], None when absent


def parse_token_samples(meta_info: Mapping[str, Any], num_samples: int) -> TokenSamples:
    """Parse and check `meta_info` of one `/generate` response served with K = num_samples.

    Reads the nested `output_top_logprobs` or, when present, SGLang's flat format. Raises
    ValueError when num_samples is not a positive int, when meta_info lacks the logprob fields
    or its flat arrays are malformed (naming the field), or naming the first position whose
    top-logprob entry does not hold exactly 1 + num_samples well-formed entries starting with
    the sampled token.
    """
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples must be a positive int, got {num_samples!r}")
    if not isinstance(meta_info, Mapping):
        raise ValueError(
            f"meta_info must be the response's meta_info mapping, got {type(meta_info).__name__} "
            "(an error reply from the server has none)"
        )
    sampled = _required_list(meta_info, "output_token_logprobs")
    if f"{_FLAT}_shape" in meta_info:
        tops = _flat_positions(meta_info)
    else:
        tops = _required_list(meta_info, "output_top_logprobs")
    if len(tops) != len(sampled):
        raise ValueError(
            f"meta_info has {len(sampled)} output_token_logprobs but {len(tops)} "
            "output_top_logprobs positions"
        )

    sampled_ids: List[int] = []
    sampled_logprobs: List[float] = []
    draw_ids: List[List[int]] = []
    draw_logprobs: List[List[float]] = []
    for position, (token_entry, entries) in enumerate(zip(sampled, tops)):
        logprob, token = _triple(token_entry, position, "output_token_logprobs")
        row = _position_entries(entries, position, num_samples)
        if row[0][1] != token:
            raise ValueError(
                f"position {position}: first output_top_logprobs entry is token {row[0][1]}, "
                f"not the sampled token {token} (is the plugin enabled on the server?)"
            )
        sampled_ids.append(token)
        sampled_logprobs.append(logprob)
        draw_logprobs.append([entry_logprob for entry_logprob, _ in row[1:]])
        draw_ids.append([entry_token for _, entry_token in row[1:]])

    length = len(sampled_ids)
    return TokenSamples(
        sampled_ids=torch.tensor(sampled_ids, dtype=torch.long),
        sampled_logprobs=torch.tensor(sampled_logprobs, dtype=torch.float32),
        draw_ids=torch.tensor(draw_ids, dtype=torch.long).reshape(length, num_samples),
        draw_logprobs=torch.tensor(draw_logprobs, dtype=torch.float32).reshape(
            length, num_samples
        ),
        weight_version=meta_info.get("weight_version"),
    )


def _required_list(meta_info: Mapping[str, Any], key: str) -> list:
    value = meta_info.get(key)
    if not isinstance(value, list):
        raise ValueError(
            f"meta_info[{key!r}] must be a list, got {type(value).__name__} (send "
            "return_logprob=true and top_logprobs_num=K)"
        )
    return value


def _flat_positions(meta_info: Mapping[str, Any]) -> list:
    """SGLang's flat output top logprobs as per-position [[logprob, token_id], ...] lists.

    Rows cover positions null_prefix onwards, k entries each; positions before null_prefix
    carry no entries (and so fail the per-position check naming them)."""
    shape = meta_info[f"{_FLAT}_shape"]
    null_prefix = meta_info.get(f"{_FLAT}_null_prefix", 0)
    valid_shape = (
        isinstance(shape, list)
        and len(shape) == 2
        and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape)
    )
    if not valid_shape or not isinstance(null_prefix, int) or null_prefix < 0:
        raise ValueError(
            f"meta_info[{_FLAT + '_shape'!r}]={shape!r} / [{_FLAT + '_null_prefix'!r}]="
            f"{null_prefix!r}: expected [rows, k] of non-negative ints and an int >= 0"
        )
    rows, k = shape
    values = _flat_array(meta_info, "val", rows * k)
    ids = _flat_array(meta_info, "idx", rows * k)
    return [[] for _ in range(null_prefix)] + [
        [[values[r * k + j], ids[r * k + j]] for j in range(k)] for r in range(rows)
    ]


def _flat_array(meta_info: Mapping[str, Any], kind: str, size: int) -> list:
    """One flat array (`val` or `idx`) as a Python list of `size` numbers, from its JSON list
    or its base64 encoding."""
    plain, encoded = f"{_FLAT}_{kind}_flat", f"{_FLAT}_{kind}_flat_b64"
    if encoded in meta_info:
        dtype_name, numpy_dtype = _FLAT_DTYPES[kind]
        marker = meta_info.get(f"{encoded}_dtype", dtype_name)
        if marker != dtype_name:
            raise ValueError(f"meta_info[{encoded + '_dtype'!r}]={marker!r}, expected {dtype_name!r}")
        try:
            raw = base64.b64decode(meta_info[encoded], validate=True)
        except (TypeError, ValueError) as error:
            raise ValueError(f"meta_info[{encoded!r}] is not base64: {error}") from None
        if len(raw) != size * 4:
            raise ValueError(f"meta_info[{encoded!r}] holds {len(raw)} bytes, expected {size * 4}")
        return np.frombuffer(raw, dtype=numpy_dtype).tolist()
    values = meta_info.get(plain)
    if not isinstance(values, list) or len(values) != size:
        got = len(values) if isinstance(values, list) else type(values).__name__
        raise ValueError(
            f"meta_info[{plain!r}] must be a list of {size} numbers (the flat top logprobs' "
            f"shape), got {got}"
        )
    return values


def _position_entries(entries: Any, position: int, num_samples: int) -> List[tuple]:
    expected = 1 + num_samples
    count = len(entries) if isinstance(entries, list) else None
    if count != expected:
        raise ValueError(
            f"position {position}: expected the sampled token plus {num_samples} draws "
            f"({expected} output_top_logprobs entries), got "
            f"{count if count is not None else repr(entries)}"
        )
    return [_triple(entry, position, "output_top_logprobs") for entry in entries]


def _triple(entry: Any, position: int, key: str) -> tuple:
    """(logprob, token_id) of one `[logprob, token_id, text]` entry, checked: the log-probability a
    number that float32 holds (-inf, a probability of 0, included; NaN, +inf and magnitudes past
    float32's range are no log-probability), the token id an int that an int64 tensor holds."""
    if not isinstance(entry, (list, tuple)) or len(entry) < 2:
        raise ValueError(f"position {position}: malformed {key} entry {entry!r}")
    logprob, token = entry[0], entry[1]
    if isinstance(logprob, bool) or not isinstance(logprob, (int, float)) or not _is_logprob(logprob):
        raise ValueError(
            f"position {position}: malformed {key} entry {_short(entry)}: the log-probability must be -inf or a "
            f"finite number within float32's range, got {_short(logprob)}"
        )
    if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < _INT64_END:
        raise ValueError(
            f"position {position}: malformed {key} entry {_short(entry)}: the token id must be an int in "
            f"[0, 2**63), got {_short(token)}"
        )
    return float(logprob), token


_INT64_END = 2**63
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _is_logprob(value) -> bool:
    """-inf or a finite number within float32's range (the tensor it lands in)."""
    try:
        value = float(value)
    except OverflowError:
        return False
    return value == -math.inf or -_FLOAT32_MAX <= value <= _FLOAT32_MAX


def _short(value: Any) -> str:
    """repr of a value, cut to a line (an int of 400 digits)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
