"""The SFC workflow as one loop: slime's own train.py on CPU (bench/slime_loop/loop.py), from
SGLang's real server with the package's plugin through the age clock to megatron-core's optimizer
and the weight push, on stale rollouts.

Lag 2 (the engine serves the snapshot two pushes behind the trainer) and 2 optimizer steps per
rollout: the engine serves v1 for rollouts 0-2 and v2 for rollout 3, so the loss's ages read
0,1 | 2,3 | 4,5 | 4,5. The runs, one after the other on one SGLang server: SFC on the float64
reference path, the package's REINFORCE, slime's PPO + TIS, SFC on fresh rollouts through slime's
two other ways to push: delta pushes (--update-weight-mode delta) and train actors released after
every push (--release-train), and SFC again with the Triton interpreter on (the fused kernels in
the loop).
"""

import math

import pytest
import torch
from bench_package import import_bench

import_bench()
from bench.slime_loop import upstream_slime  # noqa: E402

ROOT = upstream_slime.require()
# SGLang's start-up and the three runs, in the first test's setup: minutes on a quiet 2-core
# machine (ENGINE_START_TIMEOUT_S and LOOP_TIMEOUT_S bound each on a busy one).
pytestmark = pytest.mark.timeout(3600)

from bench.slime_loop import fork_server  # noqa: E402
from bench.slime_loop import loop as slime_loop  # noqa: E402
from bench.slime_loop import sglang_server  # noqa: E402

LAG, STEPS_PER_ROLLOUT = 2, 2
GEOMETRY = {"lag": LAG, "steps_per_rollout": STEPS_PER_ROLLOUT, "samples_per_step": 16, "samples_per_prompt": 8}
SFC = slime_loop.LoopConfig("sfc", rollouts=4, learner_reward=True, **GEOMETRY)
REINFORCE = slime_loop.LoopConfig("reinforce", rollouts=2, learner_reward=True, **GEOMETRY)
PPO_TIS = slime_loop.LoopConfig("ppo_tis", rollouts=2, learner_reward=True, **GEOMETRY)  # slime's own PPO loss with TIS
INTERPRETED = slime_loop.LoopConfig("sfc", rollouts=1, **GEOMETRY)  # without the learner's reward
FRESH = {**GEOMETRY, "lag": 0}
DELTA = slime_loop.LoopConfig("sfc", rollouts=2, weight_sync="delta", **FRESH)
RELEASE_TRAIN = slime_loop.LoopConfig("sfc", rollouts=2, weight_sync="release_train", **FRESH)
# Each optimizer step's SFC ages (issue 30): v1 pushed before step 0 and served for three
# rollouts, v2 pushed after step 1 and served from rollout 3.
AGES = [[0], [1], [2], [3], [4], [5], [4], [5]]
AGE_ZERO_DRIFT = 1e-6  # the losses' ppo_kl (a mean over tokens) at age 0
FP32_ROUNDING = 16 * torch.finfo(torch.float32).eps  # per token, relative to max(1, |log-prob|)
LOOP_TIMEOUT_S = 1200


def served_version(push: int) -> int:
    """The version the engine serves after the push of version `push` (1 is pushed first)."""
    return max(push - LAG, 1)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """(host, port) of SGLang's CPU server with the plugin on the task's model, and its task folder."""
    task_dir = tmp_path_factory.mktemp("loop_task")
    server = slime_loop.start_engine(slime_loop.task_files(task_dir, task_dir), task_dir)
    try:
        yield (sglang_server.HOST, server.wait_ready(slime_loop.ENGINE_START_TIMEOUT_S).port), task_dir, server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def runs(engine, tmp_path_factory):
    """{name: observations} of the runs, one after the other on the one server: forked from one
    process that imported slime's stack once (bench/slime_loop/fork_server.py), the interpreted
    run in its own (the interpreter is chosen at import)."""
    address, task_dir, _ = engine
    plans = {"sfc": SFC, "reinforce": REINFORCE, "ppo_tis": PPO_TIS, "delta": DELTA, "release_train": RELEASE_TRAIN}
    workdir = tmp_path_factory.mktemp
    with fork_server.ForkServer(workdir("fork_server") / "server.log", TRITON_INTERPRET=None) as server:
        observed = {name: server.run(config, workdir(f"loop_{name}"), address, task_dir, LOOP_TIMEOUT_S)
                    for name, config in plans.items()}  # fmt: skip
    observed["interpreted"] = slime_loop.run_in_subprocess(
        INTERPRETED, workdir("loop_interpreted"), address, task_dir, LOOP_TIMEOUT_S, TRITON_INTERPRET="1"
    )
    return observed


def test_ages_follow_the_pushes_and_the_lag(runs):
    for name, config in (("sfc", SFC), ("interpreted", INTERPRETED)):
        steps = runs[name]["steps"]
        assert [step["ages"] for step in steps] == AGES[: config.steps], name


def test_weight_versions_advance_and_the_engine_serves_the_lagged_one(runs):
    for name, config in (("sfc", SFC), ("reinforce", REINFORCE), ("ppo_tis", PPO_TIS), ("interpreted", INTERPRETED)):
        observed = runs[name]
        pushes = list(range(1, config.rollouts + 2))  # the first push, then one after every rollout
        assert [p["pushed"] for p in observed["pushes"]] == pushes, name
        assert [p["served"] for p in observed["pushes"]] == [served_version(v) for v in pushes], name
        if config.method == "sfc":  # the age clock (SFC's alone) saw every push after its rollout's steps
            assert observed["push_steps"] == {str(v): STEPS_PER_ROLLOUT * (v - 1) for v in pushes}, name
    served = [rollout["versions"] for rollout in runs["sfc"]["rollouts"]]
    assert served == [[served_version(r + 1)] for r in range(SFC.rollouts)] == [[1], [1], [1], [2]]


def test_every_trained_token_carries_k_draws_from_the_plugin(runs, engine):
    for name, config in (("sfc", SFC), ("interpreted", INTERPRETED)):
        for rollout in runs[name]["rollouts"]:
            samples = config.samples_per_step * config.steps_per_rollout
            assert rollout["samples"] == rollout["samples_with_draws"] == samples, name
            assert rollout["response_lengths"] == [8]
            assert rollout["trained_tokens"] == samples * 8
            # draws from the sampling distribution, not the sampled token repeated
            assert rollout["draws_differ_from_sampled"] > samples // 2, name
    assert sglang_server.ENABLED_LINE.split("{pid}")[0] in engine[2].log_text()  # the plugin's start-up line


def test_drift_at_age_zero_is_rounding(runs):
    """At age 0 the pushed weights reproduce the server's distribution: per token, SGLang's
    log-prob of the sampled token and Megatron's (slime's forward-only pass on the package's
    log-prob path) agree to fp32 rounding, and the losses' ppo_kl at the first step is below 1e-6."""
    assert runs["sfc"]["forward_drift"][0] < FP32_ROUNDING
    for name in runs:
        assert abs(runs[name]["steps"][0]["drift"]) < AGE_ZERO_DRIFT, name


def test_every_loss_trains_to_the_end(runs):
    for name, config in (("sfc", SFC), ("reinforce", REINFORCE), ("ppo_tis", PPO_TIS), ("interpreted", INTERPRETED),
                         ("delta", DELTA), ("release_train", RELEASE_TRAIN)):  # fmt: skip
        steps = runs[name]["steps"]
        assert len(steps) == config.steps, name
        # a step whose samples all scored alike has zero advantages, a zero gradient
        assert all(math.isfinite(step["pg_loss"]) and math.isfinite(step["grad_norm"]) for step in steps), name
        assert any(step["grad_norm"] > 0 for step in steps), name


def test_the_interpreted_run_has_the_fused_kernels_in_the_loop(runs):
    assert ["token_stats", "Triton interpreter (CPU)"] in runs["interpreted"]["kernel_paths"]
    assert all("interpreter" not in path for _, path in runs["sfc"]["kernel_paths"])


def test_slime_ppo_with_tis_reports_its_correction_and_the_drift_from_the_sampler(runs):
    """slime's own policy loss with --use-tis: its TIS weight (old log-probs over the sampler's) is
    1 to rounding while the engine serves the trainer's weights (rollout 0: v1 both) and moves away
    from 1 once it serves older ones (rollout 1: v1 served, the old log-probs from v2); the drift
    recorded is the sampler's, which the old log-probs' ppo_kl is not: equal to it at a rollout's
    first step only when the sampler is the trainer's weights."""
    steps = runs["ppo_tis"]["steps"]
    assert all(step[key] is not None for step in steps for key in slime_loop.PPO_METRICS)
    first, stale = steps[0], steps[STEPS_PER_ROLLOUT]  # the first step of rollout 0 and of rollout 1
    assert abs(first["tis"] - 1) < AGE_ZERO_DRIFT and abs(first["ppo_kl"]) < AGE_ZERO_DRIFT
    # a mean over tokens of weights on both sides of 1: 8e-5 from 1 on one CI machine, 1e-7 at age 0
    assert abs(stale["tis"] - 1) > 10 * AGE_ZERO_DRIFT
    assert abs(stale["ppo_kl"]) < AGE_ZERO_DRIFT < abs(stale["drift"])  # old == current at the step, sampler behind


def test_the_learners_reward_is_recorded_at_every_push(runs):
    """The pushed weights' held-out answers at every push (bench/slime_loop/learner_reward.py),
    the first before any step: a mean reward per push, in [0, 1]; none where the run leaves it out."""
    assert runs["interpreted"]["learner_rewards"] == []
    for name, config in (("sfc", SFC), ("reinforce", REINFORCE), ("ppo_tis", PPO_TIS)):
        rewards = runs[name]["learner_rewards"]
        assert [push["pushed"] for push in rewards] == list(range(1, config.rollouts + 2)), name
        assert all(0.0 <= push["reward"] <= 1.0 for push in rewards), name


@pytest.mark.parametrize(
    "name, config, served, push_steps",
    [
        # the delta updater's first call captures the engine's launch weights (SGLang's "default",
        # version 0 for SFC) and pushes nothing; every later call publishes and applies a delta
        ("delta", DELTA, [[0], [1]], {"0": 0, "1": 2, "2": 4}),
        # slime kills the train actor after every push and starts a new one from --save
        ("release_train", RELEASE_TRAIN, [[1], [2]], {"1": 0, "2": 2, "3": 4}),
    ],
)
def test_sfc_trains_on_delta_pushes_and_on_released_trainers(runs, name, config, served, push_steps):
    """SFC through slime's other two ways to push, on fresh rollouts: the ages of the loop (0, 1 in
    each rollout of two steps), the versions the engine served, the clock's pushes, and the pushed
    weights exactly what the trainer holds at every rollout (the delta applied onto the engine's
    checkpoint; the released trainer's successor loaded from --save): SGLang's and Megatron's
    log-probs agree to fp32 rounding before each rollout's first step and the drift there is rounding."""
    observed = runs[name]
    assert [step["ages"] for step in observed["steps"]] == [[0], [1]] * config.rollouts
    assert [rollout["versions"] for rollout in observed["rollouts"]] == served
    assert observed["push_steps"] == push_steps
    assert len(observed["forward_drift"]) == config.rollouts
    assert all(drift < FP32_ROUNDING for drift in observed["forward_drift"])
    assert all(abs(step["drift"]) < AGE_ZERO_DRIFT for step in observed["steps"][::STEPS_PER_ROLLOUT])


def test_release_train_starts_a_train_actor_per_rollout(runs):
    assert runs["sfc"]["train_actors"] == runs["delta"]["train_actors"] == 1
    assert runs["release_train"]["train_actors"] == 1 + RELEASE_TRAIN.rollouts
