"""The door: a request the plugin cannot serve is refused with a message naming the parameter,
in SGLang's real TokenizerManager and scheduler validation, and a batch it shares with log-prob
requests never makes SGLang's real sampler raise; so are top_logprobs_num above the configured
bound and input ids outside the vocabulary."""

from __future__ import annotations

import collections
import logging
import re
from array import array
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.managers import utils as manager_utils
from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.managers.tokenizer_manager import TokenizerManager
from sglang.srt.sampling.sampling_params import SamplingParams

from fusedrl.sglang_plugin import hooks
from fusedrl.sglang_plugin.constraints import DEFAULT_MAX_SAMPLES, MAX_SAMPLES_ENV_VAR
from sglang_harness import (
    batch_sampling_info,
    hooks_enabled,
    make_req,
    publish_cpu_runtime,
    run_sampler,
    tempered_logprobs,
)

VOCAB = 40
TRUNCATED = dict(temperature=0.8, top_p=0.9)  # the request


def _tokenizer_manager() -> TokenizerManager:
    """SGLang's TokenizerManager without its processes: the attributes its
    `_create_tokenized_object` reads."""
    publish_cpu_runtime()
    manager = TokenizerManager.__new__(TokenizerManager)
    manager.preferred_sampling_params = None
    manager.sampling_params_class = SamplingParams
    manager.tokenizer = None
    manager.model_config = SimpleNamespace(vocab_size=VOCAB)
    timing = SimpleNamespace(time_stats=SimpleNamespace(set_tokenize_finish_time=lambda: None))
    manager.rid_to_state = collections.defaultdict(lambda: timing)
    return manager


def _tokenize(manager, return_logprob: bool, top_logprobs_num: int, **sampling_params):
    request = GenerateReqInput(
        input_ids=[1, 2, 3],
        sampling_params=sampling_params,
        return_logprob=return_logprob,
        top_logprobs_num=top_logprobs_num,
    )
    request.normalize_batch_and_arguments()
    return manager._create_tokenized_object(request, "", [1, 2, 3])


REFUSED = [
    (False, 8, TRUNCATED, r"top_logprobs_num=8\) is refused: top_p=0\.9 truncates"),
    (True, 4, dict(temperature=0.0), r"top_logprobs_num=4\) is refused: top_k=1 \(greedy"),
    (True, 4, dict(temperature=0.9, top_k=20), "top_k=20 truncates"),
    (True, 4, dict(temperature=0.9, top_k=VOCAB - 1), f"top_k={VOCAB - 1} truncates"),
    (True, 4, dict(temperature=0.9, min_p=0.05), "min_p=0.05 truncates"),
]
SERVED = [
    (True, 4, dict(temperature=0.9)),
    (True, 4, dict(temperature=0.9, top_k=VOCAB)),  # top_k >= V truncates nothing
    (False, 4, dict(temperature=1.3, top_k=VOCAB + 100)),
    (True, 0, dict(temperature=0.0, top_p=0.5)),  # asks for no samples
    (False, 0, TRUNCATED),
]


@pytest.mark.parametrize("return_logprob, num, params, message", REFUSED)
def test_tokenizer_manager_refuses_with_the_parameter_named(
    monkeypatch, return_logprob, num, params, message
):
    manager = _tokenizer_manager()
    with hooks_enabled(monkeypatch), pytest.raises(ValueError, match=message):
        _tokenize(manager, return_logprob, num, **params)


@pytest.mark.parametrize("return_logprob, num, params", SERVED)
def test_tokenizer_manager_admits_faithful_or_sample_free_requests(
    monkeypatch, return_logprob, num, params
):
    manager = _tokenizer_manager()
    with hooks_enabled(monkeypatch):
        tokenized = _tokenize(manager, return_logprob, num, **params)
    assert tokenized.top_logprobs_num == num


def test_tokenizer_manager_untouched_without_the_variable(monkeypatch):
    manager = _tokenizer_manager()
    with hooks_enabled(monkeypatch, env_value=None):
        tokenized = _tokenize(manager, False, 8, **TRUNCATED)
    assert tokenized.top_logprobs_num == 8


@pytest.mark.parametrize("return_logprob, num, params, message", REFUSED)
def test_scheduler_validation_refuses_and_drops_the_top_logprobs(
    monkeypatch, return_logprob, num, params, message
):
    """SGLang's scheduler aborts a request whose validate_input_length message is not None
    (Req.set_finish_with_abort, HTTP 400): the door for tokenizer workers that load no plugin."""
    publish_cpu_runtime()
    req = make_req("r", VOCAB, return_logprob=return_logprob, top_logprobs_num=num, **params)
    with hooks_enabled(monkeypatch):
        verdict = manager_utils.validate_input_length(req, 100, False)
    assert verdict is not None and re.search(message, verdict)
    assert req.logprob.top_logprobs_num == 0  # the abort's one-token prefill asks for nothing


@pytest.mark.parametrize("return_logprob, num, params", SERVED)
def test_scheduler_validation_admits_faithful_or_sample_free_requests(
    monkeypatch, return_logprob, num, params
):
    publish_cpu_runtime()
    req = make_req("r", VOCAB, return_logprob=return_logprob, top_logprobs_num=num, **params)
    with hooks_enabled(monkeypatch):
        assert manager_utils.validate_input_length(req, 100, False) is None
    assert req.logprob.top_logprobs_num == num


def test_scheduler_validation_keeps_sglang_own_verdict(monkeypatch):
    publish_cpu_runtime()
    req = make_req("r", VOCAB, return_logprob=True, top_logprobs_num=4, **TRUNCATED)
    with hooks_enabled(monkeypatch):
        verdict = manager_utils.validate_input_length(req, 2, False)  # 3 input tokens > 2
    assert verdict.startswith("Input length (3 tokens) exceeds")


def test_scheduler_module_sees_the_hooked_validation(monkeypatch):
    """The scheduler calls validate_input_length through its own `from ... import` binding."""
    import sglang.srt.managers.scheduler as scheduler_module

    with hooks_enabled(monkeypatch):
        assert scheduler_module.validate_input_length is manager_utils.validate_input_length
        assert hasattr(scheduler_module.validate_input_length, "__wrapped__")
    assert not hasattr(scheduler_module.validate_input_length, "__wrapped__")


def test_mixed_batch_never_raises_and_the_door_refuses_the_truncated_request(monkeypatch, caplog):
    """The issue's case: a truncated request without return_logprob but with top_logprobs_num
    shares a real ScheduleBatch with a log-prob request asking for K draws. SGLang puts both
    rows' top_logprobs_num into the batch; the sampler must serve the log-prob row and not
    raise on the other, and both doors refuse the truncated request naming top_p."""
    publish_cpu_runtime()
    bad = make_req("bad", VOCAB, return_logprob=False, top_logprobs_num=8, **TRUNCATED)
    good = make_req("good", VOCAB, return_logprob=True, top_logprobs_num=5, temperature=0.7)
    nums, info = batch_sampling_info([bad, good], VOCAB)
    assert nums == [8, 5] and info.need_top_p_sampling

    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(0)) * 2
    with caplog.at_level(logging.ERROR), hooks_enabled(monkeypatch):
        hooks._logged_once.clear()
        torch.manual_seed(1)
        next_ids, output = run_sampler(logits, info, nums)
        with pytest.raises(ValueError, match=r"top_logprobs_num=8\) is refused: top_p=0\.9"):
            _tokenize(_tokenizer_manager(), False, 8, **TRUNCATED)
        verdict = manager_utils.validate_input_length(bad, 100, False)
    assert "top_p=0.9 truncates" in verdict
    assert "batch row 0 returns SGLang's top-K instead of draws" in caplog.text

    ids = output.next_token_top_logprobs_idx
    assert ids[0].numel() == 8  # the refused row: SGLang's plain top-K
    assert ids[1].numel() == 6 and int(ids[1][0]) == int(next_ids[1])
    truth = tempered_logprobs(logits, [0.8, 0.7])
    torch.testing.assert_close(
        output.next_token_top_logprobs_val[1].double(), truth[1, ids[1]], rtol=1e-5, atol=1e-5
    )


def _tokenize_ids(manager, input_ids, top_logprobs_num=0, mm_inputs=None):
    request = GenerateReqInput(
        input_ids=list(input_ids),
        sampling_params=dict(temperature=1.0),
        return_logprob=True,
        top_logprobs_num=top_logprobs_num,
    )
    request.normalize_batch_and_arguments()
    return manager._create_tokenized_object(request, "", list(input_ids), mm_inputs=mm_inputs)


def _scheduler_req(input_ids, top_logprobs_num=0):
    req = make_req("r", VOCAB, return_logprob=True, top_logprobs_num=top_logprobs_num, temperature=1.0)
    req.origin_input_ids = array("q", input_ids)
    return req


OUT_OF_VOCABULARY = [([VOCAB + 5, 7], VOCAB + 5), ([1, 2, VOCAB], VOCAB), ([3, -1], -1)]


@pytest.mark.parametrize("input_ids, bad", OUT_OF_VOCABULARY)
@pytest.mark.parametrize("num", [0, 3])
def test_both_doors_refuse_input_ids_outside_the_vocabulary(monkeypatch, input_ids, bad, num):
    """Such an id would reach SGLang's embedding lookup and kill the scheduler; the refusal
    names input_ids, the id and the vocabulary size, whatever the request asks for."""
    message = rf"input_ids holds token id {bad}, outside the model's vocabulary of {VOCAB} tokens \(vocab_size={VOCAB}"
    publish_cpu_runtime()
    with hooks_enabled(monkeypatch):
        with pytest.raises(ValueError, match=message):
            _tokenize_ids(_tokenizer_manager(), input_ids, num)
        verdict = manager_utils.validate_input_length(_scheduler_req(input_ids, num), 100, False)
    assert verdict is not None and re.search(message, verdict)


def test_both_doors_admit_every_id_inside_the_vocabulary(monkeypatch):
    publish_cpu_runtime()
    ids = [0, 1, VOCAB - 1]
    with hooks_enabled(monkeypatch):
        assert list(_tokenize_ids(_tokenizer_manager(), ids).input_ids) == ids
        assert manager_utils.validate_input_length(_scheduler_req(ids), 100, False) is None


def test_multimodal_prompts_skip_the_id_check(monkeypatch):
    """SGLang puts placeholder ids beyond the vocabulary into multimodal prompts."""
    publish_cpu_runtime()
    with hooks_enabled(monkeypatch):
        tokenized = _tokenize_ids(_tokenizer_manager(), [VOCAB + 5], mm_inputs={"mm_items": []})
        req = _scheduler_req([VOCAB + 5])
        req.multimodal_inputs = object()
        assert manager_utils.validate_input_length(req, 100, False) is None
    assert list(tokenized.input_ids) == [VOCAB + 5]


def test_out_of_vocabulary_ids_are_sglang_business_without_the_variable(monkeypatch):
    publish_cpu_runtime()
    with hooks_enabled(monkeypatch, env_value=None):
        assert list(_tokenize_ids(_tokenizer_manager(), [VOCAB + 5]).input_ids) == [VOCAB + 5]
        assert manager_utils.validate_input_length(_scheduler_req([VOCAB + 5]), 100, False) is None


@pytest.mark.parametrize("bound, refused", [(None, DEFAULT_MAX_SAMPLES + 1), ("8", 9), ("1", 2)])
def test_both_doors_refuse_top_logprobs_num_above_the_bound(monkeypatch, bound, refused):
    limit = DEFAULT_MAX_SAMPLES if bound is None else int(bound)
    if bound is None:
        monkeypatch.delenv(MAX_SAMPLES_ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(MAX_SAMPLES_ENV_VAR, bound)
    message = rf"top_logprobs_num={refused} exceeds the limit of {limit} draws per position \({MAX_SAMPLES_ENV_VAR}"
    publish_cpu_runtime()
    with hooks_enabled(monkeypatch):
        manager = _tokenizer_manager()
        with pytest.raises(ValueError, match=message):
            _tokenize(manager, True, refused, temperature=1.0)
        assert _tokenize(manager, True, limit, temperature=1.0).top_logprobs_num == limit
        verdict = manager_utils.validate_input_length(_scheduler_req([1, 2], refused), 100, False)
        assert verdict is not None and re.search(message, verdict)
        assert manager_utils.validate_input_length(_scheduler_req([1, 2], limit), 100, False) is None
