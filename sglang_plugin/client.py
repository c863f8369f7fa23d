"""Client side: turn a `/generate` response's `meta_info` into token-sample tensors.

The request must carry `return_logprob: true` and `top_logprobs_num: K` and go to a server
running the plugin with AGENTCORE_SGLANG_TOKEN_SAMPLES=1. Each output position's
`output_top_logprobs` entry is then the sampled token followed by K draws, each a
`[logprob, token_id, text_or_null]` triple. Anything else (a server without the plugin returns K
top tokens, not 1 + K entries) is rejected rather than misread as draws.

    samples = parse_token_samples(response["meta_info"], num_samples=K)
    samples.draw_ids        # [resp_len, K] long
"""

from __future__ import annotations

import math
from typing import Any, List, Mapping, NamedTuple, Optional

import torch


class TokenSamples(NamedTuple):
    """Per output position t: the sampled token, K draws from its distribution, logprobs."""

    sampled_ids: torch.Tensor  # [resp_len] long
    sampled_logprobs: torch.Tensor  # [resp_len] float32
    draw_ids: torch.Tensor  # [resp_len, K] long
    draw_logprobs: torch.Tensor  # [resp_len, K] float32
    weight_version: Optional[Any]  # meta_info["weight_version"], None when absent


def parse_token_samples(meta_info: Mapping[str, Any], num_samples: int) -> TokenSamples:
    """Parse and check `meta_info` of one `/generate` response served with K = num_samples.

    Raises ValueError when num_samples is not a positive int, when meta_info lacks the logprob
    fields, or naming the first position whose top-logprob entry does not hold exactly
    1 + num_samples well-formed triples starting with the sampled token.
    """
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples must be a positive int, got {num_samples!r}")
    sampled = _required_list(meta_info, "output_token_logprobs")
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
    """(logprob, token_id) of one `[logprob, token_id, text]` entry, checked."""
    if not isinstance(entry, (list, tuple)) or len(entry) < 2:
        raise ValueError(f"position {position}: malformed {key} entry {entry!r}")
    logprob, token = entry[0], entry[1]
    valid_logprob = (
        isinstance(logprob, (int, float))
        and not isinstance(logprob, bool)
        and not math.isnan(logprob)
    )
    valid_token = isinstance(token, int) and not isinstance(token, bool) and token >= 0
    if not (valid_logprob and valid_token):
        raise ValueError(f"position {position}: malformed {key} entry {entry!r}")
    return float(logprob), token
