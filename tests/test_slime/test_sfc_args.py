"""The --sfc-* flags: registered on a parser, checked at startup with errors naming the flag."""

import argparse

import pytest

from fusedrl.slime_ext.arguments import add_fusedrl_arguments, validate_fusedrl_args
from fusedrl.slime_ext.flags import sfc
from fusedrl.slime_ext.callables import load_function
from fusedrl.slime_ext.rollout import refusals, sfc_draws


def parsed(*argv, **slime_defaults):
    """slime's flags the checks read (at slime's defaults), plus the package's, parsed."""
    parser = argparse.ArgumentParser()
    add_fusedrl_arguments(parser)
    args = parser.parse_args(list(argv))
    values = dict(
        loss_type="custom_loss",
        custom_loss_function_path="fusedrl.slime_ext.losses.sfc_loss",
        custom_generate_function_path=None,
        custom_rollout_log_function_path=None,
        rollout_function_path="slime.rollout.sglang_rollout.generate_rollout",
        rollout_temperature=1.0,
        rollout_top_p=1.0,
        rollout_top_k=-1,
        entropy_coef=0.0,
        calculate_per_token_loss=False,
        custom_pg_loss_reducer_function_path=None,
        advantage_estimator="grpo",
        eps_clip_c=None,
        use_kl_loss=False,
        kl_loss_type="k1",
    )
    values.update(slime_defaults)
    for key, value in values.items():
        if key != "calculate_per_token_loss" or not hasattr(args, key):  # keep what the parse turned on
            setattr(args, key, value)
    return args


GOOD = ("--sfc-num-auxiliary-token-samples", "4", "--sfc-kl-beta", "0.1")


def test_valid_configuration_installs_the_rollout_wrapper():
    args = parsed(*GOOD, custom_generate_function_path="my.multi_turn.generate")
    validate_fusedrl_args(args)
    assert args.custom_generate_function_path == sfc.GENERATE_PATH
    assert load_function(sfc.GENERATE_PATH) is sfc_draws.generate
    assert args.sfc_inner_generate_function_path == "my.multi_turn.generate"
    assert args.loss_aggregation == "sample_mean"
    validate_fusedrl_args(args)  # again: nothing changes
    assert args.sfc_inner_generate_function_path == "my.multi_turn.generate"


@pytest.mark.parametrize(
    "mode, aggregation_mode, per_token, divisor",
    [("token-mean", "token_mean", True, None), ("sample-mean", "sample_mean", False, None), ("token-sum", "constant", False, 1.0)],
)
def test_agg_mode_sets_the_loss_aggregation(mode, aggregation_mode, per_token, divisor):
    args = parsed(*GOOD, "--sfc-loss-agg-mode", mode)
    validate_fusedrl_args(args)
    assert (args.loss_aggregation, args.calculate_per_token_loss, args.loss_aggregation_divisor) == (aggregation_mode, per_token, divisor)


@pytest.mark.parametrize(
    "argv, slime, flag",
    [
        (("--sfc-kl-beta", "0.1"), {}, "--sfc-num-auxiliary-token-samples"),
        (("--sfc-num-auxiliary-token-samples", "0", "--sfc-kl-beta", "0.1"), {}, "--sfc-num-auxiliary-token-samples"),
        (("--sfc-num-auxiliary-token-samples", "4"), {}, "--sfc-kl-beta"),
        (("--sfc-num-auxiliary-token-samples", "4", "--sfc-kl-beta", "-1"), {}, "--sfc-kl-beta"),
        (GOOD, {"rollout_top_p": 0.95}, "--rollout-top-p"),
        (GOOD, {"rollout_top_k": 50}, "--rollout-top-k"),
        (GOOD, {"entropy_coef": 0.01}, "--entropy-coef"),
        (GOOD, {"rollout_temperature": 0.0}, "--rollout-temperature"),
        (GOOD, {"use_tis": True}, "--use-tis corrects an importance ratio"),
        (GOOD, {"advantage_estimator": "gspo"}, "--advantage-estimator gspo corrects"),
        (GOOD + ("--sfc-loss-agg-mode", "token-mean", "--loss-aggregation", "sample_mean"), {}, "--sfc-loss-agg-mode"),
        (GOOD + ("--sfc-loss-agg-mode", "token-sum", "--loss-aggregation-divisor", "8"), {}, "--loss-aggregation-divisor"),
        (GOOD + ("--sfc-inner-generate-function-path", "a.b"), {"custom_generate_function_path": "c.d"}, "--sfc-inner-generate-function-path"),
        (GOOD + ("--sfc-max-refused-frac", "1"), {}, "--sfc-max-refused-frac"),
        (GOOD + ("--sfc-m2-tau", "0"), {}, "--sfc-m2-tau must be finite and > 0"),
        (GOOD + ("--sfc-m2-tau", "inf"), {}, "--sfc-m2-tau must be finite and > 0"),
        (("--sfc-m2-tau", "0.1"), {"custom_loss_function_path": "fusedrl.slime_ext.losses.policy_loss"}, "--sfc-m2-tau"),
        (GOOD + ("--sfc-max-refused-frac", "-0.1"), {}, "--sfc-max-refused-frac"),
        (GOOD + ("--sfc-max-refused-frac", "nan"), {}, "--sfc-max-refused-frac"),
        (GOOD, {"load_debug_rollout_data": "dump/{rollout_id}.pt"}, "--load-debug-rollout-data dump"),
        (GOOD, {"load_forge_rollout_data": "dump/0.pt"}, "--load-forge-rollout-data dump/0.pt replays"),
        (GOOD, {"debug_train_only": True}, "--debug-train-only pushes no weights"),
        (("--sfc-max-refused-frac", "0.1"), {"custom_loss_function_path": "fusedrl.slime_ext.losses.policy_loss"}, "--sfc-max-refused-frac"),
        (("--sfc-kl-beta", "0.1"), {"custom_loss_function_path": "fusedrl.slime_ext.losses.policy_loss"}, "--sfc-kl-beta"),
    ],
)
def test_bad_configuration_names_the_flag(argv, slime, flag):
    args = parsed(*argv, **slime)
    with pytest.raises(ValueError, match=flag):
        validate_fusedrl_args(args)


def test_the_refusal_counts_join_slimes_rollout_log_with_a_users_log_function_behind():
    args = parsed(*GOOD, custom_rollout_log_function_path="my.logging.log_rollout")
    validate_fusedrl_args(args)
    assert args.custom_rollout_log_function_path == refusals.LOG_PATH
    assert load_function(refusals.LOG_PATH) is refusals.log_rollout_data
    assert getattr(args, refusals.USER_LOG_ATTR) == "my.logging.log_rollout"
    validate_fusedrl_args(args)  # again: nothing changes
    assert getattr(args, refusals.USER_LOG_ATTR) == "my.logging.log_rollout"


def test_other_losses_are_left_alone():
    args = parsed(custom_loss_function_path="fusedrl.slime_ext.losses.policy_loss")
    validate_fusedrl_args(args)
    assert args.custom_generate_function_path is None and args.custom_rollout_log_function_path is None
