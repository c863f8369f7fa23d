"""--loss-aggregation flags: parsing and startup validation (ValueError naming the flag)."""

import argparse
import math

import pytest

from fusedrl.slime_ext import aggregation
from fusedrl.slime_ext.flags import aggregation as aggregation_flags
from fusedrl.slime_ext.rollout import prompt_groups
from fusedrl.slime_ext.hooks import load_function


def parse(*flags, loss_type="custom_loss", per_token=False, reducer=None, rollout="slime.rollout.sglang_rollout.generate_rollout"):
    """The namespace slime's parser would give with the package's flags registered."""
    parser = argparse.ArgumentParser()
    assert aggregation_flags.add_arguments(parser) is parser
    args = parser.parse_args(list(flags))
    args.loss_type = loss_type
    args.calculate_per_token_loss = getattr(args, "calculate_per_token_loss", False) or per_token
    args.rollout_batch_size, args.n_samples_per_prompt, args.global_batch_size = 4, 2, 8
    args.num_steps_per_rollout = args.load_debug_rollout_data = None
    args.custom_pg_loss_reducer_function_path = reducer
    args.rollout_function_path = rollout
    return args


@pytest.mark.parametrize(
    "divisor_flags,shown",
    [([], "None"), (["--loss-aggregation-divisor", "0"], "0.0"), (["--loss-aggregation-divisor", "-3"], "-3.0"),
     (["--loss-aggregation-divisor", "nan"], "nan"), (["--loss-aggregation-divisor", "inf"], "inf")],
)
def test_constant_rejects_a_missing_or_bad_divisor(divisor_flags, shown):
    args = parse("--loss-aggregation", "constant", *divisor_flags)
    with pytest.raises(ValueError, match=rf"--loss-aggregation-divisor must be finite and > 0 under --loss-aggregation constant, got {shown}"):
        aggregation_flags.validate_args(args, implied=None)


def test_constant_accepts_a_positive_divisor():
    args = parse("--loss-aggregation", "constant", "--loss-aggregation-divisor", "4096")
    aggregation_flags.validate_args(args, implied=None)
    assert args.loss_aggregation_divisor == 4096.0 and not args.calculate_per_token_loss


@pytest.mark.parametrize("mode", ["sample_mean", "prompt_mean", "token_mean"])
@pytest.mark.parametrize("divisor", ["nan", "-1", "0"])
def test_divisor_is_ignored_by_other_modes(mode, divisor):
    aggregation_flags.validate_args(parse("--loss-aggregation", mode, "--loss-aggregation-divisor", divisor), implied=None)


def test_constant_is_incompatible_with_per_token_loss():
    args = parse("--loss-aggregation", "constant", "--loss-aggregation-divisor", "8", per_token=True)
    with pytest.raises(ValueError, match="--loss-aggregation constant .* incompatible with --calculate-per-token-loss"):
        aggregation_flags.validate_args(args, implied=None)


@pytest.mark.parametrize("mode", ["sample_mean", "prompt_mean"])
def test_sample_weighted_modes_refuse_per_token_loss(mode):
    with pytest.raises(ValueError, match=f"--loss-aggregation {mode} weighs samples, but --calculate-per-token-loss"):
        aggregation_flags.validate_args(parse("--loss-aggregation", mode, per_token=True), implied=None)


def test_token_mean_sets_per_token_loss_while_parsing():
    args = parse("--loss-aggregation", "token_mean")
    assert args.calculate_per_token_loss is True
    aggregation_flags.validate_args(args, implied=None)
    assert args.calculate_per_token_loss is True


def test_token_mean_refuses_per_token_loss_left_off():
    args = parse()
    args.loss_aggregation = "token_mean"  # as from a YAML config, after the parse
    with pytest.raises(ValueError, match="--calculate-per-token-loss is off"):
        aggregation_flags.validate_args(args, implied=None)


@pytest.mark.parametrize(
    "setting,value,named",
    [("num_steps_per_rollout", 2, "--num-steps-per-rollout"), ("global_batch_size", 4, "--global-batch-size 4"),
     ("load_debug_rollout_data", "/x/rollout_{rollout_id}.pt", "--load-debug-rollout-data")],
)
def test_prompt_mean_refuses_settings_that_break_its_denominators(setting, value, named):
    args = parse("--loss-aggregation", "prompt_mean")
    setattr(args, setting, value)
    with pytest.raises(ValueError, match=named):
        aggregation_flags.validate_args(args, implied=None)


@pytest.mark.parametrize("per_token,mode", [(False, "sample_mean"), (True, "token_mean")])
def test_default_follows_slime(per_token, mode):
    args = parse(per_token=per_token)
    aggregation_flags.validate_args(args, implied=None)
    assert args.loss_aggregation == mode


def test_unknown_mode_is_rejected():
    with pytest.raises(SystemExit):
        parse("--loss-aggregation", "group_mean")
    args = parse()
    args.loss_aggregation = "group_mean"
    with pytest.raises(ValueError, match=r"--loss-aggregation must be one of .*, got 'group_mean'"):
        aggregation_flags.validate_args(args, implied=None)


def test_prompt_mean_wraps_the_rollout_function_once():
    args = parse("--loss-aggregation", "prompt_mean", rollout="my.rollout.fn")
    aggregation_flags.validate_args(args, implied=None)
    aggregation_flags.validate_args(args, implied=None)
    assert args.rollout_function_path == aggregation_flags.ROLLOUT_FUNCTION_PATH
    assert args.loss_aggregation_inner_rollout_function_path == "my.rollout.fn"
    assert load_function(args.rollout_function_path) is prompt_groups.generate_rollout


def test_prompt_mean_wrapper_given_explicitly_needs_the_inner_function():
    args = parse("--loss-aggregation", "prompt_mean", rollout=aggregation_flags.ROLLOUT_FUNCTION_PATH)
    with pytest.raises(ValueError, match="needs --loss-aggregation-inner-rollout-function-path"):
        aggregation_flags.validate_args(args, implied=None)
    args = parse("--loss-aggregation", "prompt_mean", "--loss-aggregation-inner-rollout-function-path", "a.b", rollout="c.d")
    with pytest.raises(ValueError, match="--loss-aggregation-inner-rollout-function-path a.b conflicts with --rollout-function-path c.d"):
        aggregation_flags.validate_args(args, implied=None)


@pytest.mark.parametrize("mode", ["sample_mean", "token_mean", "constant"])
def test_other_modes_keep_the_rollout_function(mode):
    args = parse("--loss-aggregation", mode, "--loss-aggregation-divisor", "2", rollout="my.rollout.fn")
    aggregation_flags.validate_args(args, implied=None)
    assert args.rollout_function_path == "my.rollout.fn"


def test_prompt_mean_needs_the_packages_loss():
    with pytest.raises(ValueError, match="--loss-aggregation prompt_mean is applied by the package's losses .* got --loss-type policy_loss"):
        aggregation_flags.validate_args(parse("--loss-aggregation", "prompt_mean", loss_type="policy_loss"), implied=None)


def test_constant_with_slimes_policy_loss_installs_the_reducer():
    args = parse("--loss-aggregation", "constant", "--loss-aggregation-divisor", "8", loss_type="policy_loss")
    aggregation_flags.validate_args(args, implied=None)
    assert args.custom_pg_loss_reducer_function_path == aggregation_flags.REDUCER_PATH
    assert load_function(aggregation_flags.REDUCER_PATH) is aggregation.get_pg_loss_reducer
    other = parse("--loss-aggregation", "constant", "--loss-aggregation-divisor", "8", loss_type="policy_loss", reducer="x.y")
    with pytest.raises(ValueError, match="needs --custom-pg-loss-reducer-function-path .*, got x.y"):
        aggregation_flags.validate_args(other, implied=None)


@pytest.mark.parametrize("mode", ["sample_mean", "prompt_mean"])
def test_reducer_hook_is_refused_for_modes_it_cannot_apply(mode):
    args = parse("--loss-aggregation", mode, reducer=aggregation_flags.REDUCER_PATH)
    with pytest.raises(ValueError, match=f"--custom-pg-loss-reducer-function-path .* cannot apply --loss-aggregation {mode}"):
        aggregation_flags.validate_args(args, implied=None)


def test_divisor_parses_as_float():
    assert math.isnan(parse("--loss-aggregation-divisor", "nan").loss_aggregation_divisor)
