"""The package's flag checks where its losses and hooks first run inside slime's trainer
(`arguments.check_at_first_use`): slime's own train.py never runs the entry point's checks.
The same refusals through slime's real loss_function: tests/test_slime/test_upstream_slime_train.py."""

from types import SimpleNamespace

import pytest
from slime_harness import slime_args

from fusedrl.slime_ext import arguments, patching
from fusedrl.slime_ext.flags import aggregation, sfc


def plain_slime_args(**overrides):
    """slime_args without any of the package's flags, as slime's own parser leaves them."""
    args = slime_args(**overrides)
    for dest in arguments.fusedrl_defaults():
        if hasattr(args, dest):
            delattr(args, dest)
    return args


@pytest.mark.parametrize(
    "overrides,named",
    [
        (dict(), "--loss-aggregation, --pg-loss-type and the package's other flags are not on slime's args"),
        (dict(use_tis=True, tis_clip_low=3.0), "--tis-clip-low"),
        (dict(custom_loss_function_path="fusedrl.slime_ext.losses.policy.policy_loss", use_opsm=True, opsm_delta=float("nan")), "--opsm-delta"),
    ],
)
def test_args_from_slimes_own_parser_are_refused_with_the_flag_named(overrides, named):
    args = plain_slime_args(**overrides)
    for _ in range(2):  # refused again: a refused configuration is never marked checked
        with pytest.raises(ValueError, match=named):
            arguments.check_at_first_use(args)


@pytest.mark.parametrize(
    "overrides,named",
    [
        (dict(loss_aggregation="token_mean"), "--calculate-per-token-loss is off"),
        (dict(loss_aggregation="prompt_mean", rollout_function_path="my.rollout", loss_aggregation_inner_rollout_function_path=None), "--rollout-function-path must be"),
        (dict(custom_loss_function_path=sfc.LOSS_PATHS[0], sfc_num_auxiliary_token_samples=2, sfc_kl_beta=0.1, custom_generate_function_path=None), "--custom-generate-function-path must be"),
        (dict(custom_loss_function_path=sfc.LOSS_PATHS[0], sfc_num_auxiliary_token_samples=2, sfc_kl_beta=0.1,
              custom_generate_function_path=sfc.GENERATE_PATH, custom_rollout_log_function_path=None), "--custom-rollout-log-function-path must be"),
        (dict(loss_type="policy_loss", loss_aggregation="constant", loss_aggregation_divisor=8.0), "--custom-pg-loss-reducer-function-path must be"),
        (dict(loss_type="policy_loss", loss_aggregation="prompt_mean"), "--custom-pg-loss-reducer-function-path must be"),
        (dict(loss_aggregation="prompt_mean", n_samples_per_prompt=2, global_batch_size=3), "--global-batch-size 3 is not a multiple"),
    ],
)
def test_settings_only_the_startup_checks_can_make_are_refused(overrides, named):
    with pytest.raises(ValueError, match=named):
        arguments.check_at_first_use(slime_args(**overrides))


def test_startup_validated_args_pass_once_and_late_resolvable_flags_resolve():
    args = slime_args(loss_aggregation=None)  # --custom-config-path's YAML gave only some flags
    del args.pg_loss_type
    arguments.check_at_first_use(args)
    assert (args.loss_aggregation, args.pg_loss_type) == ("sample_mean", None)
    args.use_opsm = True  # checked once per args object: the loss pays the check on its first call only
    arguments.check_at_first_use(args)


def test_the_init_hook_refuses_before_patching_anything():
    with pytest.raises(ValueError, match="--tis-clip-low"):
        patching.install(plain_slime_args(use_tis=True, tis_clip_low=3.0))
    assert patching.installed() == {}


def test_configures_package():
    assert arguments.configures_package(plain_slime_args())  # names the package's loss
    assert not arguments.configures_package(plain_slime_args(loss_type="policy_loss", custom_loss_function_path=None,
                                                             rollout_function_path="r", custom_generate_function_path=None))
    assert arguments.configures_package(SimpleNamespace(loss_aggregation="sample_mean"))
    assert aggregation.REDUCER_PATH.endswith("get_pg_loss_reducer")
