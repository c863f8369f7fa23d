"""The door: refuse requests the token-sample mode cannot serve, before they reach a batch.

Two SGLang processes admit requests, and each gets a hook:
- `tokenizer_admission_hook` (AFTER `TokenizerManager._create_tokenized_object`): runs in the
  process that serves HTTP; its ValueError becomes SGLang's HTTP 400 `invalid_request_error`.
  SGLang's extra tokenizer workers (`--tokenizer-worker-num > 1`) never call `load_plugins()`,
  so there the next hook is the door.
- `scheduler_admission_hook` (AFTER `sglang.srt.managers.utils.validate_input_length`): runs in
  every scheduler process, which receives every generate request whatever front end tokenized
  it. A message returned there is SGLang's own per-request rejection: the scheduler aborts that
  request alone with HTTP 400 (`Req.set_finish_with_abort`, which also replaces its prompt by
  one in-vocabulary token) and keeps serving the others.

Both refuse, in this order: an input id outside the model's vocabulary (`vocab_size` of the
model config, which both processes hold), then top_logprobs_num above the configured bound,
then truncated or greedy sampling. Multimodal and input-embedding requests skip the id check:
SGLang puts placeholder ids into their prompts.

Both hooks are registered as `functools.partial(hook, max_samples)`.
"""

from __future__ import annotations

from .constraints import input_ids_problem, request_problem


def tokenizer_admission_hook(max_samples: int, tokenized, manager, *args, **kwargs) -> None:
    """Raise ValueError naming input_ids or the sampling parameter the request cannot have."""
    problem = _refusal(
        _plain_prompt(tokenized, "input_ids", "mm_inputs"),
        tokenized.sampling_params,
        getattr(tokenized, "top_logprobs_num", 0),
        getattr(getattr(manager, "model_config", None), "vocab_size", None),
        max_samples,
    )
    if problem is not None:
        raise ValueError(problem)
    return None


def scheduler_admission_hook(max_samples: int, error_message, req, *args, **kwargs):
    """SGLang's input-length verdict, or else this plugin's refusal of `req` (a `Req`).

    A refused request also stops asking for top logprobs, so the one-token prefill SGLang runs
    to finish an aborted request puts no draw request for it into the batch."""
    if error_message is not None:
        return error_message
    logprob = getattr(req, "logprob", None)
    problem = _refusal(
        _plain_prompt(req, "origin_input_ids", "multimodal_inputs"),
        req.sampling_params,
        getattr(logprob, "top_logprobs_num", 0),
        getattr(req, "vocab_size", None),
        max_samples,
    )
    if problem is not None and logprob is not None:
        logprob.top_logprobs_num = 0
    return problem


def _plain_prompt(request, ids_field: str, multimodal_field: str):
    """The prompt ids of `request` to check; None for a multimodal or input-embedding request
    (embedding requests have no input_embeds field)."""
    if getattr(request, multimodal_field, None) is not None:
        return None
    if getattr(request, "input_embeds", None) is not None:
        return None
    return getattr(request, ids_field, None)


def _refusal(input_ids, sampling_params, top_logprobs_num, vocab_size, max_samples):
    return input_ids_problem(input_ids, vocab_size) or request_problem(
        sampling_params, top_logprobs_num, vocab_size, max_samples
    )
