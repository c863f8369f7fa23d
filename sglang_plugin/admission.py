"""The door: refuse requests the token-sample mode cannot serve, before they reach a batch.

Two SGLang processes admit requests, and each gets a hook:
- `tokenizer_admission_hook` (AFTER `TokenizerManager._create_tokenized_object`): runs in the
  process that serves HTTP; its ValueError becomes SGLang's HTTP 400 `invalid_request_error`.
  SGLang's extra tokenizer workers (`--tokenizer-worker-num > 1`) never call `load_plugins()`,
  so there the next hook is the door.
- `scheduler_admission_hook` (AFTER `sglang.srt.managers.utils.validate_input_length`): runs in
  every scheduler process, which receives every generate request whatever front end tokenized
  it. A message returned there is SGLang's own per-request rejection: the scheduler aborts that
  request alone with HTTP 400 (`Req.set_finish_with_abort`) and keeps serving the others.
"""

from __future__ import annotations

from .constraints import request_problem


def tokenizer_admission_hook(tokenized, manager, *args, **kwargs) -> None:
    """Raise ValueError naming the parameter when a request with top_logprobs_num > 0 would be
    sampled from a truncated or greedy distribution."""
    problem = request_problem(
        tokenized.sampling_params,
        getattr(tokenized, "top_logprobs_num", 0),
        getattr(getattr(manager, "model_config", None), "vocab_size", None),
    )
    if problem is not None:
        raise ValueError(problem)
    return None


def scheduler_admission_hook(error_message, req, *args, **kwargs):
    """SGLang's input-length verdict, or else this plugin's refusal of `req` (a `Req`).

    A refused request also stops asking for top logprobs, so the one-token prefill SGLang runs
    to finish an aborted request puts no draw request for it into the batch."""
    if error_message is not None:
        return error_message
    logprob = getattr(req, "logprob", None)
    problem = request_problem(
        req.sampling_params,
        getattr(logprob, "top_logprobs_num", 0),
        getattr(req, "vocab_size", None),
    )
    if problem is not None:
        logprob.top_logprobs_num = 0
    return problem
