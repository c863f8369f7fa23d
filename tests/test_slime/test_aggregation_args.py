"""--loss-aggregation flags: parsing and startup validation (ValueError naming the flag)."""

import argparse
import math

import pytest

from fusedrl.slime_ext import aggregation
from fusedrl.slime_ext.flags import aggregation as aggregation_flags
from fusedrl.slime_ext.rollout import prompt_groups
from fusedrl.slime_ext.callables import load_function


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
    [("global_batch_size", 3, "--global-batch-size 3 is not a multiple of --n-samples-per-prompt 2"),
     ("load_debug_rollout_data", "/x/rollout_{rollout_id}.pt", "--load-debug-rollout-data")],
)
def test_prompt_mean_refuses_settings_that_break_its_denominators(setting, value, named):
    args = parse("--loss-aggregation", "prompt_mean")
    setattr(args, setting, value)
    with pytest.raises(ValueError, match=named):
        aggregation_flags.validate_args(args, implied=None)


@pytest.mark.parametrize("steps, global_batch_size", [(1, 8), (2, 4), (4, 2)])
def test_prompt_mean_accepts_several_steps_per_rollout_of_whole_groups(steps, global_batch_size):
    """4 prompts x 2 samples: steps of 8, 4 or 2 rollouts hold whole groups (the rollout wrapper
    checks each rollout's actual groups)."""
    args = parse("--loss-aggregation", "prompt_mean")
    args.num_steps_per_rollout, args.global_batch_size = steps, global_batch_size
    aggregation_flags.validate_args(args, implied=None)
    assert args.rollout_function_path == aggregation_flags.ROLLOUT_FUNCTION_PATH


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


@pytest.mark.parametrize("loss_type", ["sft_loss", "value_loss"])
def test_prompt_mean_needs_a_loss_that_computes_pg_loss(loss_type):
    with pytest.raises(ValueError, match=f"--loss-aggregation prompt_mean weighs pg_loss, .* got --loss-type {loss_type}"):
        aggregation_flags.validate_args(parse("--loss-aggregation", "prompt_mean", loss_type=loss_type), implied=None)


@pytest.mark.parametrize("mode_flags", [("constant", "--loss-aggregation-divisor", "8"), ("prompt_mean",)])
def test_slimes_policy_loss_gets_the_packages_reducer(mode_flags):
    """constant and prompt_mean on slime's own policy_loss: the loss type stays (slime keeps its
    log-prob reuse) and the package's pg_loss reducer is installed."""
    args = parse("--loss-aggregation", *mode_flags, loss_type="policy_loss")
    aggregation_flags.validate_args(args, implied=None)
    assert args.loss_type == "policy_loss"
    assert args.custom_pg_loss_reducer_function_path == aggregation_flags.REDUCER_PATH
    assert load_function(aggregation_flags.REDUCER_PATH) is aggregation.get_pg_loss_reducer
    other = parse("--loss-aggregation", *mode_flags, loss_type="policy_loss", reducer="x.y")
    with pytest.raises(ValueError, match="needs --custom-pg-loss-reducer-function-path .*, got x.y"):
        aggregation_flags.validate_args(other, implied=None)


def test_reducer_hook_is_refused_for_sample_mean():
    args = parse("--loss-aggregation", "sample_mean", reducer=aggregation_flags.REDUCER_PATH)
    with pytest.raises(ValueError, match="--custom-pg-loss-reducer-function-path .* is not for --loss-aggregation sample_mean"):
        aggregation_flags.validate_args(args, implied=None)


def test_divisor_parses_as_float():
    assert math.isnan(parse("--loss-aggregation-divisor", "nan").loss_aggregation_divisor)
