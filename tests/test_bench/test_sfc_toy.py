"""The toy staleness experiment reproduces the qualitative result of issue 5.

On a sparse-reward bandit with Adam, ratio-free REINFORCE and SFC + KL both solve the task from
fresh rollouts; from rollouts 8 updates stale REINFORCE locks hard contexts onto wrong actions and
stalls well below SFC + KL, on every seed, and drifts further from its sampler.

The loss math runs through `token_stats` on CPU tensors; the Triton kernel itself is tested
against the reference elsewhere, so the interpreter is switched off here (it would only make the
few hundred optimizer steps slow).
"""

import importlib.util
import os

import pytest

SEEDS = (0, 1, 2)
TOY_PATH = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "bench", "studies", "sfc_staleness.py")


@pytest.fixture(scope="module")
def toy():
    spec = importlib.util.spec_from_file_location("staleness_toy", TOY_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def finals(toy):
    """{(method, staleness): [Curves per seed]} for staleness 0 and 8, eager CPU path."""
    saved = os.environ.pop("TRITON_INTERPRET", None)
    try:
        return {
            (method, staleness): [toy.run_toy(method, staleness, seed) for seed in SEEDS]
            for method in toy.METHODS
            for staleness in (0, 8)
        }
    finally:
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved


@pytest.mark.parametrize("method", ["reinforce", "sfc"])
def test_fresh_rollouts_solve_the_task(finals, method):
    for curves in finals[(method, 0)]:
        assert curves.reward[-1] > 0.95


def test_stale_reinforce_stalls_well_below_sfc(finals):
    for reinforce, sfc in zip(finals[("reinforce", 8)], finals[("sfc", 8)]):
        assert sfc.reward[-1] > 0.95
        assert reinforce.reward[-1] < sfc.reward[-1] - 0.15


def test_stale_reinforce_drifts_further_from_its_sampler(finals):
    for reinforce, sfc in zip(finals[("reinforce", 8)], finals[("sfc", 8)]):
        assert max(map(abs, reinforce.drift)) > 1.5 * max(map(abs, sfc.drift))


def test_fresh_rollouts_have_no_drift(finals):
    for method in ("reinforce", "sfc"):
        for curves in finals[(method, 0)]:
            assert max(map(abs, curves.drift)) < 1e-5


@pytest.mark.parametrize("kwargs, message", [({"method": "ppo"}, "method"), ({"staleness": -1}, "staleness")])
def test_bad_arguments_name_the_argument(toy, kwargs, message):
    call = {"method": "sfc", "staleness": 0, "seed": 0, **kwargs}
    with pytest.raises(ValueError, match=message):
        toy.run_toy(**call)
