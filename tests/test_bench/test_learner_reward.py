"""The learner's reward of the stale-rollouts loop (bench/slime_loop/learner_reward.py): the right
number, from its own random stream, leaving the process's random state as it found it.

The loop itself is not bitwise reproducible run to run (SGLang's CPU server batches concurrent
requests as they arrive: two runs of one configuration, each on a fresh server of the same seed,
differ from their second step on), so that the learner's reward changes nothing in a run is shown
here, where it can be: it draws nothing from the generators the run draws from."""

import random

import pytest
import torch
from bench_package import import_bench

import_bench()
from bench.slime_loop import learner_reward, target_task  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The task's model as a push writes it: config and safetensors in one folder."""
    pytest.importorskip("transformers")
    return target_task.write_model(tmp_path_factory.mktemp("task") / "model", seed=3)


def test_greedy_answers_score_as_transformers_greedy_decoding(model_dir):
    """At a temperature near 0 the sampled answers are the greedy ones: the reward equals the one
    of transformers' own greedy `generate` on every context."""
    model = learner_reward.load_policy(model_dir, model_dir)
    prompts = torch.arange(target_task.CONTEXTS)[:, None]
    greedy = model.generate(prompts, max_new_tokens=target_task.ANSWER_TOKENS, do_sample=False, min_new_tokens=target_task.ANSWER_TOKENS)
    truth = sum(target_task.score(answer[1:].tolist(), label) for answer, label in zip(greedy, target_task.targets()))
    truth /= target_task.CONTEXTS
    assert learner_reward.learner_reward(model_dir, model_dir, 1e-6, seed=0, version=1) == pytest.approx(truth, abs=1e-12)


def test_its_own_stream_and_no_other(model_dir):
    torch.manual_seed(123)
    random.seed(123)
    torch_state, python_state = torch.get_rng_state(), random.getstate()
    first = learner_reward.learner_reward(model_dir, model_dir, 1.0, seed=0, version=2)
    assert torch.equal(torch.get_rng_state(), torch_state) and random.getstate() == python_state
    assert learner_reward.learner_reward(model_dir, model_dir, 1.0, seed=0, version=2) == first  # the same stream
    model = learner_reward.load_policy(model_dir, model_dir)
    streams = [learner_reward.sample_answers(model, 1.0, learner_reward.evaluation_generator(0, v)) for v in (2, 3)]
    assert not torch.equal(*streams)  # each push its own draws
    assert 0.0 <= first <= 1.0


def test_a_checkpoint_of_another_model_is_refused(model_dir, tmp_path):
    from safetensors.torch import save_file

    save_file({"model.embed_tokens.weight": torch.zeros(3, 3)}, str(tmp_path / "model.safetensors"))
    with pytest.raises((ValueError, RuntimeError)):
        learner_reward.load_policy(model_dir, tmp_path)
