"""SFC's rollout side: recorded engine answers (sampled token + K draws per position) go through
an inner generate function the way slime's default one sends them, reach the sample's carried
tensors intact and then the loss's batch; malformed answers and truncated sampling are rejected."""

import asyncio
import sys
import types
from argparse import Namespace

import pytest
import torch

from fusedrl.slime_ext import age, carry
from fusedrl.slime_ext.carry import SFC_DRAWS_KEY as DRAWS_KEY
from fusedrl.slime_ext.carry import SFC_VERSIONS_KEY as VERSIONS_KEY
from fusedrl.slime_ext.rollout import refusals
from fusedrl.slime_ext.rollout import sfc_draws as sfc_rollout

K = 3
PROMPT = [5, 6, 7]


class FakeSample:
    """The Sample fields the rollout side touches."""

    def __init__(self):
        self.tokens, self.response_length, self.loss_mask = [], 0, None
        self.multimodal_train_inputs, self.weight_versions = None, []


def engine_answer(tokens, draws, version):
    """A recorded /generate answer with the plugin on: sampled triple first, then K draws."""
    return {
        "text": "",
        "meta_info": {
            "output_token_logprobs": [[-0.5, t, None] for t in tokens],
            "output_top_logprobs": [[[-0.5, t, None]] + [[-1.0, d, None] for d in row] for t, row in zip(tokens, draws)],
            "weight_version": version,
        },
    }


INNER_SOURCE = """
async def post(url, payload, headers=None):
    sent.append(payload)
    return answers[len(sent) - 1]


async def generate(args, sample, sampling_params, evaluation=False):
    if not sample.tokens:
        sample.tokens = list(PROMPT)
        sample.loss_mask = []
    for turn in range(len(answers) - len(sent)):
        if turn:
            sample.tokens += list(observation)
            sample.loss_mask += [0] * len(observation)
            sample.response_length += len(observation)
        output = await post("http://router/generate", {"sampling_params": sampling_params, "return_logprob": True})
        new = [item[1] for item in output["meta_info"]["output_token_logprobs"]]
        sample.tokens += new
        sample.loss_mask += [1] * len(new)
        sample.response_length += len(new)
    return sample
"""


def make_inner(answers, observation=()):
    """A module whose multi-turn `generate` calls its module-level `post` once per answer (with an
    untrained observation between turns), as slime's generate functions do."""
    module = types.ModuleType("fusedrl_test_inner_generate")
    sent = []
    module.__dict__.update(answers=answers, sent=sent, observation=observation, PROMPT=PROMPT)
    exec(compile(INNER_SOURCE, module.__name__, "exec"), module.__dict__)
    sys.modules[module.__name__] = module
    return module, sent


def sfc_rollout_args(**overrides):
    values = dict(
        rollout_temperature=0.9,
        sfc_num_auxiliary_token_samples=K,
        sfc_inner_generate_function_path="fusedrl_test_inner_generate.generate",
    )
    values.update(overrides)
    return Namespace(**values)


def params(**overrides):
    return {"temperature": 0.9, "top_p": 1.0, "top_k": -1, **overrides}


def run(coro):
    return asyncio.run(coro)


def test_round_trip_multi_turn_sample_reaches_the_loss_batch():
    answers = [
        engine_answer([11, 12], [[1, 2, 3], [12, 12, 4]], "3"),
        engine_answer([13], [[13, 5, 5]], "4"),
    ]
    module, sent = make_inner(answers, observation=(20, 21))
    sample = run(sfc_rollout.generate(sfc_rollout_args(), FakeSample(), params()))
    assert all(payload["top_logprobs_num"] == K for payload in sent)
    draws = sample.multimodal_train_inputs[DRAWS_KEY]
    assert draws.tolist() == [[1, 2, 3], [12, 12, 4], [20, 20, 20], [21, 21, 21], [13, 5, 5]]
    assert sample.multimodal_train_inputs[VERSIONS_KEY].tolist() == [3, 3, -1, -1, 4]

    answers.append(engine_answer([30], [[7, 8, 9]], "4"))  # a second sample of the micro-batch
    other = run(sfc_rollout.generate(sfc_rollout_args(), FakeSample(), params()))
    batch = {
        "response_lengths": [sample.response_length, other.response_length],
        "total_lengths": [len(sample.tokens), len(other.tokens)],
        "multimodal_train_inputs": {
            key: torch.cat([sample.multimodal_train_inputs[key], other.multimodal_train_inputs[key]]) for key in (DRAWS_KEY, VERSIONS_KEY)
        },
    }
    per_sample = carry.per_token(batch, DRAWS_KEY, 0, 1)
    assert torch.equal(per_sample[0], draws) and per_sample[1].tolist() == [[7, 8, 9]]


def test_resumed_sample_appends_to_its_earlier_draws():
    answers = [engine_answer([11], [[1, 2, 3]], "1")]
    make_inner(answers)
    sample = run(sfc_rollout.generate(sfc_rollout_args(), FakeSample(), params()))
    answers.append(engine_answer([12, 13], [[4, 5, 6], [7, 8, 9]], "2"))  # resumed after an abort
    sample = run(sfc_rollout.generate(sfc_rollout_args(), sample, params()))
    assert sample.multimodal_train_inputs[DRAWS_KEY].tolist() == [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert sample.multimodal_train_inputs[VERSIONS_KEY].tolist() == [1, 2, 2]


def test_evaluation_requests_pass_through_untouched():
    _, sent = make_inner([{"text": "", "meta_info": {"output_token_logprobs": [[-0.1, 9, None]]}}])
    sample = run(sfc_rollout.generate(sfc_rollout_args(), FakeSample(), params(top_p=0.5), evaluation=True))
    assert "top_logprobs_num" not in sent[0] and sample.multimodal_train_inputs is None


@pytest.mark.parametrize(
    "answer, message",
    [
        (engine_answer([11], [[1, 2]], "1"), "plus 3 draws"),  # a missing draw
        (engine_answer([11], [[1, 2, 3, 4]], "1"), "plus 3 draws"),  # an extra draw
        (engine_answer([11], [[1, 2, 3]], "v7"), "weight_version"),
    ],
)
def test_malformed_answers_are_rejected(answer, message):
    make_inner([answer])
    with pytest.raises(ValueError, match=message) as refused:
        run(sfc_rollout.generate(sfc_rollout_args(), FakeSample(), params()))
    assert refused.value.cause == "malformed_answer"


@pytest.fixture
def tally(monkeypatch):
    """A fresh refusal count, as the rollout process starts with."""
    fresh = refusals.Tally()
    monkeypatch.setattr(sfc_rollout, "TALLY", fresh)
    return fresh


def test_an_unpushed_engine_is_refused_and_counted(tally):
    """SGLang's "default" weights (an engine restarted by fault tolerance before its first push)
    were never pushed by the trainer outside delta mode: the sample is refused, and counted."""
    make_inner([engine_answer([11], [[1, 2, 3]], "1")])
    run(sfc_rollout.generate(sfc_rollout_args(), FakeSample(), params()))
    make_inner([engine_answer([11], [[1, 2, 3]], "default")])
    with pytest.raises(refusals.RefusedSample, match="no weight push has reached") as refused:
        run(sfc_rollout.generate(sfc_rollout_args(update_weight_mode="full"), FakeSample(), params()))
    assert refused.value.cause == "unpushed_engine"
    accepted, counts, first = tally.take()
    assert (accepted, dict(counts)) == (1, {"unpushed_engine": 1}) and "--use-fault-tolerance" in first["unpushed_engine"]


def test_delta_mode_default_weights_are_the_captured_base(tally):
    """Under --update-weight-mode delta the engines' "default" weights are the base the delta
    updater captured at its first call, recorded by the age clock as ENGINE_DEFAULT_VERSION."""
    answers = [engine_answer([11], [[1, 2, 3]], "default"), engine_answer([12], [[4, 5, 6]], "1")]
    make_inner(answers)
    sample = run(sfc_rollout.generate(sfc_rollout_args(update_weight_mode="delta"), FakeSample(), params()))
    assert sample.multimodal_train_inputs[VERSIONS_KEY].tolist() == [age.ENGINE_DEFAULT_VERSION, 1]
    assert tally.take()[:2] == (1, {})


def test_plugin_missing_top_k_answer_is_rejected():
    answer = engine_answer([11], [[1, 2, 3]], "1")
    answer["meta_info"]["output_top_logprobs"][0][0][1] = 99  # top-K tokens, not sampled + draws
    make_inner([answer])
    with pytest.raises(ValueError, match="sampled token"):
        run(sfc_rollout.generate(sfc_rollout_args(), FakeSample(), params()))


@pytest.mark.parametrize("overrides, key", [({"top_p": 0.9}, "top_p"), ({"top_k": 20}, "top_k"), ({"min_p": 0.1}, "min_p"), ({"temperature": 1.0}, "temperature")])
def test_truncated_or_mistempered_sampling_is_rejected(overrides, key):
    make_inner([engine_answer([11], [[1, 2, 3]], "1")])
    with pytest.raises(ValueError, match=key):
        run(sfc_rollout.generate(sfc_rollout_args(), FakeSample(), params(**overrides)))


def test_trained_tokens_without_draws_are_rejected():
    sample = FakeSample()
    sample.tokens, sample.response_length, sample.loss_mask = PROMPT + [11, 12], 2, [1, 1]
    with pytest.raises(ValueError, match="no /generate answer"):
        sfc_rollout.attach_draws(sample, 0, [], K)
