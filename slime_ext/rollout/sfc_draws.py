"""SFC's rollout side: the sampled token plus K draws per generated token, carried to the loss.

`generate` is slime's --custom-generate-function-path (installed by the SFC flag checks,
`flags/sfc.py`, which
move a user's own generate function to --sfc-inner-generate-function-path). For training
rollouts it runs the inner generate function (default: slime's
`slime.rollout.sglang_rollout.generate`) with every /generate request it sends through the
`post` of the inner function's module extended by `top_logprobs_num = K`; with
AGENTCORE_SGLANG_TOKEN_SAMPLES=1 on the server the SGLang plugin answers each position with the
sampled token followed by K draws from the same untruncated distribution. Each response's
`meta_info` is checked by the plugin's client parser (exactly sampled + K entries per position,
the first being the sampled token; anything else fails the turn) and the sample gets, through
slime_ext/carry.py, per response token:

- `SFC_DRAWS_KEY` [resp_len, K] int64: the draws;
- `SFC_VERSIONS_KEY` [resp_len] int64: the weight version of the call that generated the token.

Tokens the inner function appends without generating them (a multi-turn tool observation) must be
loss-masked; they get the token itself as draws (a zero centered score) and version -1 (no age).
An engine no push has reached answers SGLang's weight version `"default"`: under
--update-weight-mode delta those are the base the delta updater captured before its first push
(`age.ENGINE_DEFAULT_VERSION`), in any other mode weights no push of this trainer gave (an engine
restarted by --use-fault-tolerance on --hf-checkpoint), whose tokens have no age: refused.
Every refused training sample is counted (`refusals`). Evaluation requests pass through untouched.
"""

import contextvars
import functools
import inspect
from typing import List, NamedTuple

import torch

from ...sglang_plugin.client import parse_token_samples
from .. import carry
from ..age import ENGINE_DEFAULT_VERSION
from ..carry import SFC_DRAWS_KEY, SFC_VERSIONS_KEY
from ..callables import load_function
from .refusals import TALLY, RefusedSample

DEFAULT_INNER = "slime.rollout.sglang_rollout.generate"
NOT_GENERATED = -1  # version of response tokens no /generate call produced
SGLANG_DEFAULT_VERSION = "default"  # SGLang's weight_version before any weight update
_CAPTURE: contextvars.ContextVar = contextvars.ContextVar("fusedrl_sfc_capture", default=None)
_WRAP_MARK = "_fusedrl_requests_draws"


class Capture(NamedTuple):
    """The draw count to request and the meta_info of every /generate answer of one call."""

    num_draws: int
    meta_infos: List[dict]


def check_sampling_params(args, sampling_params: dict) -> None:
    """The request samples at the training temperature from the untruncated distribution."""
    expected = (("temperature", float(args.rollout_temperature)), ("top_p", 1.0), ("top_k", -1), ("min_p", 0.0))
    for key, value in expected:
        got = sampling_params.get(key, value)
        if got != value:
            raise ValueError(
                f"SFC rollout request has sampling_params[{key!r}] = {got!r}, must be {value!r} (the draws "
                "and the loss assume the training temperature and untruncated sampling)"
            )


async def generate(args, sample, sampling_params, evaluation=False):
    """slime custom generate: the inner generate function plus K draws per generated token."""
    inner = load_function(getattr(args, "sfc_inner_generate_function_path", None) or DEFAULT_INNER)
    kwargs = {"evaluation": evaluation} if "evaluation" in inspect.signature(inner).parameters else {}
    if evaluation:
        return await inner(args, sample, sampling_params, **kwargs)
    check_sampling_params(args, sampling_params)
    _request_draws_through(inner)
    before = sample.response_length
    capture = Capture(int(args.sfc_num_auxiliary_token_samples), [])
    token = _CAPTURE.set(capture)
    try:
        sample = await inner(args, sample, sampling_params, **kwargs)
    finally:
        _CAPTURE.reset(token)
    try:
        attach_draws(sample, before, capture.meta_infos, capture.num_draws, engine_default_version(args))
    except RefusedSample as refusal:
        TALLY.refuse(refusal)
        raise
    except ValueError as error:
        refusal = RefusedSample("malformed_answer", str(error))
        TALLY.refuse(refusal)
        raise refusal from error
    TALLY.accept()
    return sample


def engine_default_version(args):
    """The version of SGLang's "default" weights: the delta updater's captured base under
    --update-weight-mode delta, else None (no push of this trainer gave them)."""
    return ENGINE_DEFAULT_VERSION if getattr(args, "update_weight_mode", "full") == "delta" else None


def _request_draws_through(inner) -> None:
    """Wrap the `post` the inner function's module calls (once); a no-op outside `generate`."""
    module_globals = inner.__globals__
    post = module_globals.get("post")
    if post is None:
        raise ValueError(f"{inner.__module__}.{inner.__name__} sends no request through a module-level `post`")
    if not getattr(post, _WRAP_MARK, False):
        module_globals["post"] = requesting_draws(post)


def requesting_draws(post):
    """slime's async `post(url, payload, ...)` that, inside an SFC training call, asks /generate
    for K draws and keeps each answer's meta_info."""

    @functools.wraps(post)
    async def post_requesting_draws(url, payload, *args, **kwargs):
        capture = _CAPTURE.get()
        if capture is None or not str(url).endswith("/generate"):
            return await post(url, payload, *args, **kwargs)
        payload = {**payload, "return_logprob": True, "top_logprobs_num": capture.num_draws}
        output = await post(url, payload, *args, **kwargs)
        capture.meta_infos.append(output["meta_info"])
        return output

    setattr(post_requesting_draws, _WRAP_MARK, True)
    return post_requesting_draws


def attach_draws(sample, before: int, meta_infos: List[dict], num_draws: int, default_version=None) -> None:
    """Append draws and versions for response tokens [before, response_length) to the sample.

    The generated segments (one per /generate answer) must appear in order among the new tokens;
    tokens between them are untrained filler (loss mask 0). Raises ValueError otherwise, and
    RefusedSample for an answer of SGLang's "default" weights when `default_version` (their
    version) is None.
    """
    tokens = list(sample.tokens[len(sample.tokens) - sample.response_length :]) if sample.response_length else []
    mask = list(sample.loss_mask) if sample.loss_mask is not None else [1] * sample.response_length
    draws, versions = _previous(sample, before, num_draws)
    position = before
    for call, meta_info in enumerate(meta_infos):
        parsed = parse_token_samples(meta_info, num_draws)
        generated = parsed.sampled_ids.tolist()
        start = _find_segment(tokens, mask, position, generated, call)
        _append_filler(draws, versions, tokens[position:start], num_draws)
        draws.append(parsed.draw_ids)
        version = _version(parsed.weight_version, call, default_version)
        versions.append(torch.full((len(generated),), version, dtype=torch.int64))
        position = start + len(generated)
    if any(mask[position:]):
        raise ValueError(
            f"response tokens {position}..{sample.response_length - 1} are trained (loss mask 1) but no "
            "/generate answer produced them, so they have no draws"
        )
    _append_filler(draws, versions, tokens[position:], num_draws)
    empty = [torch.zeros(0, num_draws, dtype=torch.int64)], [torch.zeros(0, dtype=torch.int64)]
    carry.attach(sample, SFC_DRAWS_KEY, torch.cat(draws or empty[0]))
    carry.attach(sample, SFC_VERSIONS_KEY, torch.cat(versions or empty[1]))


def _previous(sample, before: int, num_draws: int):
    """Draws and versions the sample already carries (from an earlier, aborted call)."""
    inputs = sample.multimodal_train_inputs or {}
    if before == 0:
        return [], []
    if SFC_DRAWS_KEY not in inputs or inputs[SFC_DRAWS_KEY].shape != (before, num_draws):
        got = tuple(inputs[SFC_DRAWS_KEY].shape) if SFC_DRAWS_KEY in inputs else None
        raise ValueError(
            f"the sample already has {before} response tokens but carries draws of shape {got}, "
            f"expected ({before}, {num_draws}): it was not generated through SFC's generate"
        )
    return [inputs[SFC_DRAWS_KEY]], [inputs[SFC_VERSIONS_KEY]]


def _find_segment(tokens, mask, position: int, generated: List[int], call: int) -> int:
    """First start >= position where `generated` sits, with only untrained tokens skipped."""
    for start in range(position, len(tokens) - len(generated) + 1):
        if tokens[start : start + len(generated)] == generated:
            return start
        if mask[start]:
            break
    raise ValueError(
        f"/generate answer {call} ({len(generated)} tokens) is not among the sample's new response tokens "
        f"from position {position}: the sampled tokens and the response disagree"
    )


def _append_filler(draws: list, versions: list, filler: List[int], num_draws: int) -> None:
    if filler:
        draws.append(torch.tensor(filler, dtype=torch.int64)[:, None].expand(-1, num_draws))
        versions.append(torch.full((len(filler),), NOT_GENERATED, dtype=torch.int64))


def _version(weight_version, call: int, default_version) -> int:
    if str(weight_version) == SGLANG_DEFAULT_VERSION:
        if default_version is None:
            raise RefusedSample(
                "unpushed_engine",
                f"/generate answer {call} came from an engine no weight push has reached (weight_version "
                f"{SGLANG_DEFAULT_VERSION!r}: SGLang's initial weights, --hf-checkpoint, e.g. an engine restarted by "
                "--use-fault-tolerance before its first push); this trainer never pushed them, so their tokens have "
                "no SFC age",
            )
        return default_version
    try:
        return int(str(weight_version))
    except ValueError:
        raise ValueError(
            f"/generate answer {call} has meta_info weight_version {weight_version!r}; SFC needs the integer "
            "versions slime's weight updaters push"
        ) from None
