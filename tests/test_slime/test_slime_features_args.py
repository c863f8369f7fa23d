"""slime's own newer flags the package meets, without slime: what the installed slime defines (a dry
build of a stand-in `slime.utils.arguments`), the package's flags registered around it, and the
startup refusals of `flags/slime_features.py`. The same through slime's real parser, 624b824's and a
newer one's: tests/test_slime/test_upstream_slime_args.py."""

import argparse
import sys
import types

import pytest
from slime_harness import slime_args

from fusedrl.slime_ext import arguments, patching, slime_options
from fusedrl.slime_ext.flags import policy, slime_features

SFC = dict(custom_loss_function_path="fusedrl.slime_ext.losses.sfc_loss")
SLIMES_POLICY_LOSS = dict(loss_type="policy_loss", custom_loss_function_path=None, custom_pg_loss_reducer_function_path=None)


@pytest.fixture
def slime_defining(monkeypatch):
    """Install a stand-in `slime.utils.arguments` whose own groups define the given options (as
    slime's `get_slime_extra_args_provider` does, the custom arguments left out)."""

    def install(*options):
        def get_slime_extra_args_provider(add_custom_arguments=None):
            def add_slime_arguments(parser):
                for option in options:
                    parser.add_argument(option, default=None)
                return parser

            return add_slime_arguments

        module = types.ModuleType("slime.utils.arguments")
        module.get_slime_extra_args_provider = get_slime_extra_args_provider
        monkeypatch.setitem(sys.modules, "slime.utils.arguments", module)

    return install


def package_options():
    return set(arguments.package_options())


def test_without_slime_nothing_is_defined_and_every_package_flag_registers():
    assert slime_options.defined_options() == frozenset()
    assert "--pg-loss-type" in package_options()


def test_a_slime_without_the_provider_defines_nothing_known(monkeypatch):
    monkeypatch.setitem(sys.modules, "slime.utils.arguments", types.ModuleType("slime.utils.arguments"))
    assert slime_options.defined_options() == frozenset()


def test_a_flag_slime_defines_is_read_from_slime_not_registered_again(slime_defining):
    slime_defining("--rollout-batch-size", "--pg-loss-type")
    assert slime_options.defines("--pg-loss-type") and not slime_options.defines("--loss-aggregation")
    assert "--pg-loss-type" not in package_options() and "--loss-aggregation" in package_options()
    # slime's parser as its parse_args builds it: the custom arguments first, slime's groups after
    parser = argparse.ArgumentParser()
    arguments.add_fusedrl_arguments(parser)
    sys.modules["slime.utils.arguments"].get_slime_extra_args_provider()(parser)
    assert parser.parse_args(["--pg-loss-type", "reinforce"]).pg_loss_type == "reinforce"


def test_a_package_flag_slime_came_to_define_otherwise_is_refused_by_name(slime_defining):
    slime_defining("--loss-aggregation", "--fusedrl-fused-lm-head")
    with pytest.raises(ValueError, match="the installed slime defines --fusedrl-fused-lm-head, --loss-aggregation itself"):
        arguments.add_fusedrl_arguments(argparse.ArgumentParser())


def test_pg_loss_type_is_slimes_default_objective_when_unset():
    args = slime_args(pg_loss_type=None)
    policy.validate_args(args)
    assert policy.pg_loss_type(args) == "ppo" and policy.pg_loss_type(slime_args(pg_loss_type=None, advantage_estimator="cispo")) == "cispo"
    policy.validate_args(slime_args(pg_loss_type=None, **SLIMES_POLICY_LOSS))  # slime's default on slime's loss


def test_reinforce_on_slimes_policy_loss_is_slimes_own_where_slime_defines_the_flag(slime_defining):
    args = slime_args(pg_loss_type="reinforce", **SLIMES_POLICY_LOSS)
    with pytest.raises(ValueError, match="--pg-loss-type reinforce is set but the loss is not"):
        policy.validate_args(args)  # the package's flag: only its policy loss reads it
    slime_defining("--pg-loss-type")
    policy.validate_args(args)  # slime's flag, read by slime's policy loss
    policy.validate_args(slime_args(pg_loss_type="reinforce", loss_type="custom_loss", custom_loss_function_path="my.loss"))
    with pytest.raises(ValueError, match="--pg-loss-type reinforce is set but the loss is not"):
        policy.validate_args(slime_args(pg_loss_type="reinforce", **SFC))


PLUGIN_ON = {"AGENTCORE_SGLANG_TOKEN_SAMPLES": "1"}
PACKAGE_REDUCER = dict(SLIMES_POLICY_LOSS, custom_pg_loss_reducer_function_path="fusedrl.slime_ext.aggregation.get_pg_loss_reducer")
TRITON, CENTERING = dict(log_probs_backend="triton"), dict(use_score_centering=True)
LM_HEAD, KEEP = dict(fusedrl_fused_lm_head=True), dict(fusedrl_keep_slime_log_probs=True)


@pytest.mark.parametrize(
    "overrides, environ, names",
    [
        (TRITON, {}, ("--log-probs-backend triton", "fusedrl.slime_ext.install", "--log-probs-backend torch")),
        ({**TRITON, **LM_HEAD}, {}, ("--log-probs-backend triton", "--fusedrl-fused-lm-head")),
        ({**CENTERING, **LM_HEAD, **SLIMES_POLICY_LOSS}, {}, ("--use-score-centering", "drop --fusedrl-fused-lm-head")),
        (CENTERING, {}, ("--use-score-centering", "fusedrl.slime_ext.losses.policy_loss")),
        ({**CENTERING, **SFC}, {}, ("--use-score-centering", "fusedrl.slime_ext.losses.sfc_loss")),
        ({**CENTERING, **PACKAGE_REDUCER, "loss_aggregation": "constant"}, {}, ("--loss-aggregation constant", "--use-score-centering")),
        ({**CENTERING, **SLIMES_POLICY_LOSS, "score_centering_top_k": 128}, PLUGIN_ON,
         ("--use-score-centering", "top_logprobs_num = 128", "AGENTCORE_SGLANG_TOKEN_SAMPLES=1", "unset AGENTCORE_SGLANG_TOKEN_SAMPLES")),
        (dict(flush_cache_interval=0, **SFC), {}, ("--flush-cache-interval 0", "fusedrl.slime_ext.losses.sfc_loss", "--flush-cache-interval 1")),
        # temperatures the kernels do not answer, refused at startup, not at every micro-batch
        (dict(rollout_temperature=1e-7), {}, ("--rollout-temperature must lie in [1e-06, 1e+06]", "got 1e-07", "--fusedrl-keep-slime-log-probs")),
        (dict(rollout_temperature=2e6, **KEEP, **LM_HEAD), {}, ("--rollout-temperature", "got 2000000.0")),
    ],
)  # fmt: skip
def test_slimes_features_the_package_cannot_run_with_are_refused_naming_both(overrides, environ, names):
    with pytest.raises(ValueError) as refused:
        slime_features.validate_args(slime_args(**overrides), environ=environ)
    assert all(name in str(refused.value) for name in names), str(refused.value)


@pytest.mark.parametrize(
    "overrides, environ",
    [
        ({}, PLUGIN_ON),  # a slime without the newer flags: slime's defaults
        ({**TRITON, **KEEP, **SLIMES_POLICY_LOSS}, {}),
        (dict(log_probs_backend="torch", use_score_centering=False, flush_cache_interval=1, **SFC), PLUGIN_ON),
        ({**CENTERING, **SLIMES_POLICY_LOSS}, {"AGENTCORE_SGLANG_TOKEN_SAMPLES": "0"}),
        (dict(flush_cache_interval=-1), {}),  # slime's policy loss: no token ages
        ({**KEEP, **SLIMES_POLICY_LOSS, "rollout_temperature": 1e-7}, {}),  # slime's own path reads it
    ],
)  # fmt: skip
def test_slimes_features_the_package_runs_with_pass(overrides, environ):
    slime_features.validate_args(slime_args(**overrides), environ=environ)


def test_the_init_hook_refuses_slimes_triton_backend_without_any_package_flag(monkeypatch):
    """slime's own train.py with only the init hook: args without the package's flags."""
    args = argparse.Namespace(loss_type="policy_loss", custom_loss_function_path=None, log_probs_backend="triton")
    monkeypatch.setattr(sys, "argv", ["train.py", "--log-probs-backend", "triton"])
    assert not arguments.configures_package(args)
    with pytest.raises(ValueError, match="--log-probs-backend triton hands slime's log-prob path"):
        patching.install(args)
    assert patching.installed() == {}


def test_the_init_hook_refuses_score_centering_toward_a_plugin_server(monkeypatch):
    args = argparse.Namespace(loss_type="policy_loss", custom_loss_function_path=None, use_score_centering=True)
    monkeypatch.setattr(sys, "argv", ["train.py", "--use-score-centering"])
    monkeypatch.setenv("AGENTCORE_SGLANG_TOKEN_SAMPLES", "1")
    with pytest.raises(ValueError, match="--use-score-centering asks the SGLang engines"):
        patching.install(args)
    assert patching.installed() == {}


def test_the_flags_check_the_kernels_temperature_range():
    from fusedrl.kernels import TEMPERATURE_RANGE
    from fusedrl.slime_ext import flags

    assert flags.TEMPERATURE_RANGE == TEMPERATURE_RANGE
