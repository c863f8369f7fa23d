"""Which requests the token-sample mode can serve faithfully, and the refusal messages.

Two bounds hold for every request on a server in this mode: K = top_logprobs_num is at most
MAX_SAMPLES_ENV_VAR (default 64), since one request asks the sampler for K draws at every
position and the response carries as many entries; and every input id lies inside the model's
vocabulary, since SGLang 0.5.23 hands an id at or above vocab_size to the embedding lookup, whose
IndexError kills the scheduler and with it the whole server.

The K draws come from the untruncated, temperature-scaled distribution SGLang hands its logprob
step. They match the distribution the sampled token came from only when nothing truncated that
distribution: top_k unset (-1) or at least the vocabulary size, top_p = 1, min_p = 0, and a
temperature above zero (SGLang turns temperature 0 into top_k = 1, so greedy decoding shows up as
top_k = 1 below).
"""

from __future__ import annotations

import os
from typing import Optional, Sequence, Tuple

ENV_VAR = "AGENTCORE_SGLANG_TOKEN_SAMPLES"
MAX_SAMPLES_ENV_VAR = "AGENTCORE_SGLANG_TOKEN_SAMPLES_MAX_K"
DEFAULT_MAX_SAMPLES = 64

# SGLang's "whole vocabulary" top_k (sglang.srt.sampling.sampling_params.TOP_K_ALL, the value
# that top_k = -1 is normalised to); kept here so clients need not import SGLang.
TOP_K_ALL = 1 << 30

_MODE = (
    f"{ENV_VAR}=1 makes top_logprobs_num = K return the sampled token plus K draws from the "
    "untruncated sampling distribution"
)


def truncation_problem(
    top_k: int, top_p: float, min_p: float, vocab_size: Optional[int] = None
) -> Optional[str]:
    """None when (top_k, top_p, min_p), as normalised by SGLang, leave the distribution whole
    over a vocabulary of `vocab_size` tokens (unknown: only top_k = -1 keeps it whole);
    otherwise a sentence naming the offending parameter, its value and the value to use."""
    if top_k == 1:
        return (
            "top_k=1 (greedy decoding: SGLang turns temperature=0 into top_k=1) samples no "
            "distribution; use a temperature > 0 and top_k=-1"
        )
    keeps_every_token = top_k == TOP_K_ALL or (vocab_size is not None and top_k >= vocab_size)
    if not keeps_every_token:
        return f"top_k={top_k} truncates the sampling distribution; use top_k=-1"
    if top_p < 1.0:
        return f"top_p={top_p:.7g} truncates the sampling distribution; use top_p=1.0"
    if min_p > 0.0:
        return f"min_p={min_p:.7g} truncates the sampling distribution; use min_p=0.0"
    return None


def max_samples_from_env() -> Tuple[int, Optional[str]]:
    """(the K bound, None) from MAX_SAMPLES_ENV_VAR, or (the default, a sentence naming the
    variable and its bad value) when it is not a positive integer."""
    raw = os.environ.get(MAX_SAMPLES_ENV_VAR, "").strip()
    if not raw:
        return DEFAULT_MAX_SAMPLES, None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        return DEFAULT_MAX_SAMPLES, (
            f"{MAX_SAMPLES_ENV_VAR}={raw!r} is not a positive integer (the most draws a request "
            f"may ask for per position; default {DEFAULT_MAX_SAMPLES})"
        )
    return value, None


def request_problem(
    sampling_params, top_logprobs_num, vocab_size: Optional[int], max_samples: int
) -> Optional[str]:
    """The refusal for one request (SGLang-normalised `sampling_params`), None to serve it.

    Any top_logprobs_num > 0 counts, whether or not the request returns logprobs: SGLang puts
    every request's top_logprobs_num into the batch as soon as one request in it returns
    logprobs, so the request's row is asked for draws either way."""
    num = top_logprobs_num or 0
    if num <= 0:
        return None
    if num > max_samples:
        problem = (
            f"top_logprobs_num={num} exceeds the limit of {max_samples} draws per position "
            f"({MAX_SAMPLES_ENV_VAR}, default {DEFAULT_MAX_SAMPLES}); ask for at most "
            f"{max_samples}"
        )
        return request_refusal(problem, num)
    problem = truncation_problem(
        sampling_params.top_k, sampling_params.top_p, sampling_params.min_p, vocab_size
    )
    return None if problem is None else request_refusal(problem, num)


def input_ids_problem(input_ids: Optional[Sequence[int]], vocab_size: Optional[int]) -> Optional[str]:
    """The refusal naming `input_ids`, the first id outside [0, vocab_size) and the vocabulary
    size, or None when every id is inside it (or there are no ids or no known size)."""
    if input_ids is None or vocab_size is None or len(input_ids) == 0:
        return None
    if 0 <= min(input_ids) and max(input_ids) < vocab_size:
        return None
    bad = next(token for token in input_ids if not 0 <= token < vocab_size)
    return (
        f"{ENV_VAR}=1 checks every request's prompt, so this request is refused: "
        f"input_ids holds token id {bad}, outside the model's vocabulary of {vocab_size} tokens "
        f"(vocab_size={vocab_size}: valid ids are 0 to {vocab_size - 1}); SGLang's embedding "
        "lookup would fail on it and stop the server"
    )


def request_refusal(problem: str, top_logprobs_num: int) -> str:
    """The error returned to a client whose request cannot be served faithfully."""
    return (
        f"{_MODE}, so this request (top_logprobs_num={top_logprobs_num}) is refused: {problem} "
        "(its draws would not come from the distribution its tokens are sampled from)."
    )


def server_refusal(reason: str) -> str:
    """The error that stops a server whose configuration the mode cannot serve."""
    return f"{_MODE}; refusing to start: {reason}. Unset {ENV_VAR} or change the setting."
