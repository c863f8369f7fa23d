"""fusedrl's flags through slime's real argument parser (FUSEDRL_SLIME_SRC; tests/upstream_slime.py).

slime parses with `ignore_unknown_args=True`: a flag nobody registered is dropped without a word.
So every flag the package documents or reads must be registered on slime's parser, by slime or by
`add_fusedrl_arguments` (the `add_custom_arguments` of `fusedrl.slime_ext.train`).
"""

import argparse

import pytest
import upstream_slime

upstream_slime.load()

from fusedrl.slime_ext import train as entry  # noqa: E402
from fusedrl.slime_ext.arguments import add_fusedrl_arguments  # noqa: E402

# The least slime's own checks (slime_validate_args) accept.
BASE_ARGV = ["--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--num-rollout", "1"]
POLICY_LOSS = ["--loss-type", "custom_loss", "--custom-loss-function-path", "fusedrl.slime_ext.losses.policy_loss"]
SFC_LOSS = [
    "--loss-type", "custom_loss", "--custom-loss-function-path", "fusedrl.slime_ext.losses.sfc_loss",
    "--sfc-num-auxiliary-token-samples", "4", "--sfc-kl-beta", "0.1", "--entropy-coef", "0",
]  # fmt: skip


def parse(argv, with_fusedrl=True):
    return upstream_slime.parse_known_args(BASE_ARGV + argv, add_fusedrl_arguments if with_fusedrl else None)


def fusedrl_actions():
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_fusedrl_arguments(parser)
    return [action for action in parser._actions if action.option_strings and action.dest != "help"]


def slime_dests():
    """Every attribute slime's parse defines: its parser's flags and its pre-parsed mode flags."""
    from slime.utils import arguments

    args, _ = parse([], with_fusedrl=False)
    return set(vars(args)) | {name for name in vars(arguments._pre_parse_mode())}


def flag_values():
    """(flag, command-line values, parsed value) for every fusedrl flag, every choice of each."""
    cases = []
    for action in fusedrl_actions():
        flag = action.option_strings[0]
        if action.nargs == 0:
            cases.append((flag, [], action.const))
        elif action.choices:
            cases += [(flag, [choice], choice) for choice in action.choices]
        elif action.type is float:
            cases.append((flag, ["2.5"], 2.5))
        elif action.type is int:
            cases.append((flag, ["3"], 3))
        else:
            cases.append((flag, ["some.module.function"], "some.module.function"))
    return cases


@pytest.mark.parametrize("flag, values, expected", flag_values(), ids=lambda x: str(x) if isinstance(x, str) else None)
def test_every_fusedrl_flag_reaches_args_through_slimes_parser(flag, values, expected):
    args, unknown = parse([flag, *values])
    assert unknown == []
    assert getattr(args, next(a.dest for a in fusedrl_actions() if flag in a.option_strings)) == expected


def test_fusedrl_flags_neither_shadow_nor_are_shadowed_by_slimes():
    # Same option string: argparse refuses at registration (parse() above would fail). Same
    # attribute under another option string: one of the two would be silently overwritten.
    assert not {action.dest for action in fusedrl_actions()} & slime_dests()


def test_plain_slime_parse_drops_fusedrl_flags():
    """Why the package's entry point exists: slime's own train.py drops them without a word."""
    args, unknown = parse(["--loss-aggregation", "prompt_mean", "--sfc-kl-beta", "0.1"], with_fusedrl=False)
    assert unknown == ["--loss-aggregation", "prompt_mean", "--sfc-kl-beta", "0.1"]
    assert not hasattr(args, "loss_aggregation") and not hasattr(args, "sfc_kl_beta")


def test_slime_defaults_eps_clip_high_to_eps_clip():
    args, _ = parse(POLICY_LOSS + ["--eps-clip", "0.3"])
    assert args.eps_clip_high == 0.3


@pytest.mark.xfail(
    strict=True,
    reason="issue 12 item 1: --pg-loss-type (README, losses/policy.py) is neither a slime flag nor "
    "registered by fusedrl; slime drops it and PPO-clip runs (or the README claim and policy.py's "
    "reader go, and this test with them)",
)
def test_pg_loss_type_reinforce_is_a_registered_flag():
    args, unknown = parse(POLICY_LOSS + ["--pg-loss-type", "reinforce"])
    assert unknown == [] and args.pg_loss_type == "reinforce"


class ReadRecorder(argparse.Namespace):
    """A Namespace that records the name of every attribute read from it."""

    def __init__(self, args):
        super().__init__(**vars(args))
        object.__setattr__(self, "_reads", set())

    def __getattribute__(self, name):
        if not name.startswith("_"):
            object.__getattribute__(self, "_reads").add(name)
        return object.__getattribute__(self, name)


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(
            POLICY_LOSS,
            id="policy_loss",
            marks=pytest.mark.xfail(
                strict=True,
                reason="issue 12 items 1 and 3: the startup checks read pg_loss_type and use_score_centering, "
                "which no parser defines (a default stands in, so the check passes quietly)",
            ),
        ),
        pytest.param(
            SFC_LOSS,
            id="sfc_loss",
            marks=pytest.mark.xfail(
                strict=True,
                reason="issue 12 item 3: the SFC startup check reads flush_cache_interval, which slime does not "
                "define (a user's --flush-cache-interval is dropped, the check passes on its default)",
            ),
        ),
        pytest.param(["--loss-aggregation", "constant", "--loss-aggregation-divisor", "64"], id="constant"),
    ],
)
def test_startup_checks_read_only_flags_slime_or_fusedrl_define(argv):
    args, _ = parse(argv)
    recorder = ReadRecorder(args)
    entry.validate(recorder)
    defined = slime_dests() | {action.dest for action in fusedrl_actions()}
    assert recorder._reads - defined == set()


@pytest.mark.xfail(
    strict=True,
    reason="issue 12 item 5: token_mean sets args.calculate_per_token_loss in fusedrl's validate, after "
    "slime's parse_args has run Megatron's validate_args on the unset flag",
)
def test_token_mean_turns_on_per_token_loss_within_slimes_parse():
    args, _ = parse(["--loss-aggregation", "token_mean"])
    assert args.calculate_per_token_loss is True


@pytest.mark.parametrize(
    "extra, flag",
    [
        (["--load-debug-rollout-data", "/nonexistent/rollout_{rollout_id}.pt"], "--load-debug-rollout-data"),
        (["--num-steps-per-rollout", "2"], "--num-steps-per-rollout"),
    ],
    ids=["debug_rollout_data", "steps_per_rollout"],
)
@pytest.mark.xfail(
    strict=True,
    reason="issue 12 item 6: prompt_mean denominators come from the rollout wrapper, per rollout call: "
    "--load-debug-rollout-data bypasses the wrapper, and with several steps per rollout a group spans "
    "steps; neither is refused at startup (if the fix makes them exact instead, test that here)",
)
def test_prompt_mean_refuses_settings_that_break_its_denominators(extra, flag):
    args, _ = parse(POLICY_LOSS + ["--loss-aggregation", "prompt_mean", *extra])
    with pytest.raises(ValueError, match=flag):
        entry.validate(args)
