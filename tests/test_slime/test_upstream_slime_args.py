"""fusedrl's flags through slime's real argument parser (FUSEDRL_SLIME_SRC; tests/test_slime/upstream_slime.py).

slime parses with `ignore_unknown_args=True`: a flag nobody registered is dropped without a word.
So every flag the package documents or reads must be registered on slime's parser, by slime or by
`add_fusedrl_arguments` (the `add_custom_arguments` of `fusedrl.slime_ext.train`).

slime is imported only in one spawned worker (`observe`), which parses every command line the
tests need and returns plain values.
"""

import argparse

import pytest
import upstream_slime
from distributed import run_on_ranks

from fusedrl.slime_ext.arguments import add_fusedrl_arguments

upstream_slime.require()

# The least slime's own checks (slime_validate_args) accept.
BASE_ARGV = ["--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--num-rollout", "1"]
POLICY_LOSS = ["--loss-type", "custom_loss", "--custom-loss-function-path", "fusedrl.slime_ext.losses.policy_loss"]
SFC_LOSS = [
    "--loss-type", "custom_loss", "--custom-loss-function-path", "fusedrl.slime_ext.losses.sfc_loss",
    "--sfc-num-auxiliary-token-samples", "4", "--sfc-kl-beta", "0.1", "--entropy-coef", "0",
]  # fmt: skip
# Configurations whose startup checks must read only flags some parser defines.
CHECKED = {
    "policy_loss": POLICY_LOSS,
    "sfc_loss": SFC_LOSS,
    "constant": ["--loss-aggregation", "constant", "--loss-aggregation-divisor", "64"],
    "prompt_mean": POLICY_LOSS + ["--loss-aggregation", "prompt_mean"],
    "token_mean": ["--loss-aggregation", "token_mean"],
    "reinforce": POLICY_LOSS + ["--pg-loss-type", "reinforce"],
}
# prompt_mean next to settings that break its group denominators, and the flag to name: at 4 x 2,
# 8 steps per rollout are steps of 1 rollout, half a prompt group.
PROMPT_MEAN_BREAKERS = {
    "debug_rollout_data": (["--load-debug-rollout-data", "/nonexistent/rollout_{rollout_id}.pt"], "--load-debug-rollout-data"),
    "steps_per_rollout": (["--num-steps-per-rollout", "8"], "--global-batch-size 1 is not a multiple of --n-samples-per-prompt 2"),
}
# prompt_mean with several steps per rollout of whole groups, on fusedrl's policy loss and slime's.
PROMPT_MEAN_STEPS = {
    f"{loss}-{steps}steps": (argv + ["--loss-aggregation", "prompt_mean", "--num-steps-per-rollout", str(steps)])
    for loss, argv in (("policy_loss", []), ("fusedrl", POLICY_LOSS)) for steps in (2, 4)
}
# slime's own train.py with the init hook and a package flag its parser drops.
HOOK_ONLY_ARGV = ["--custom-megatron-init-path", "fusedrl.slime_ext.install", "--loss-aggregation", "prompt_mean"]


def fusedrl_actions():
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_fusedrl_arguments(parser)
    return [action for action in parser._actions if action.option_strings and action.dest != "help"]


def flag_cases():
    """(flag, command-line values, attribute, parsed value) for every fusedrl flag, every choice."""
    cases = []
    for action in fusedrl_actions():
        flag, dest = action.option_strings[0], action.dest
        if action.nargs == 0:
            cases.append((flag, (), dest, action.const))
        elif action.choices:
            cases += [(flag, (choice,), dest, choice) for choice in action.choices]
        elif action.type is float:
            cases.append((flag, ("2.5",), dest, 2.5))
        elif action.type is int:
            cases.append((flag, ("3",), dest, 3))
        else:
            cases.append((flag, ("some.module.function",), dest, "some.module.function"))
    return cases


# ----------------------------------------------------------------------------- the worker


class ReadRecorder(argparse.Namespace):
    """A Namespace that records the name of every attribute read from it."""

    def __init__(self, args):
        super().__init__(**vars(args))
        object.__setattr__(self, "_reads", set())

    def __getattribute__(self, name):
        if not name.startswith("_"):
            object.__getattribute__(self, "_reads").add(name)
        return object.__getattribute__(self, name)


def observe(rank, world_size, cases):
    """Every parse the tests check, in a process that imports slime: a dict of plain values."""
    root = upstream_slime.load()
    from slime.utils import arguments

    from fusedrl.slime_ext import train as entry

    def parse(argv, with_fusedrl=True):
        return upstream_slime.parse_known_args(BASE_ARGV + argv, add_fusedrl_arguments if with_fusedrl else None)

    def validate_error(args):
        try:
            entry.validate(args)
        except ValueError as error:
            return str(error)
        return None

    plain, _ = parse([], with_fusedrl=False)
    slime_dests = set(vars(plain)) | set(vars(arguments._pre_parse_mode()))
    defined = slime_dests | {action.dest for action in fusedrl_actions()}
    out = {"slime_dests": slime_dests, "flags": {}, "undefined_reads": {}, "prompt_mean_errors": {}}
    for flag, values, dest, _ in cases:
        args, unknown = parse([flag, *values])
        out["flags"][flag, values] = (unknown, getattr(args, dest))
    args, unknown = parse(["--loss-aggregation", "prompt_mean", "--sfc-kl-beta", "0.1"], with_fusedrl=False)
    out["plain"] = (unknown, hasattr(args, "loss_aggregation"), hasattr(args, "sfc_kl_beta"))
    out["eps_clip_high"] = parse(POLICY_LOSS + ["--eps-clip", "0.3"])[0].eps_clip_high
    args, unknown = parse(POLICY_LOSS + ["--pg-loss-type", "reinforce"])
    out["pg_loss_type"] = (unknown, getattr(args, "pg_loss_type", None))
    for name, argv in CHECKED.items():
        recorder = ReadRecorder(parse(argv)[0])
        entry.validate(recorder)
        out["undefined_reads"][name] = recorder._reads - defined
    out["token_mean_per_token"] = parse(["--loss-aggregation", "token_mean"])[0].calculate_per_token_loss
    for name, (extra, _) in PROMPT_MEAN_BREAKERS.items():
        out["prompt_mean_errors"][name] = validate_error(parse(POLICY_LOSS + ["--loss-aggregation", "prompt_mean", *extra])[0])
    out["prompt_mean_steps"] = {}
    for name, argv in PROMPT_MEAN_STEPS.items():
        args = parse(argv)[0]
        out["prompt_mean_steps"][name] = (validate_error(args), args.loss_type, args.custom_pg_loss_reducer_function_path,
                                          args.global_batch_size)  # fmt: skip
    out["hook_only"] = hook_only_install_error(root)
    return out


def hook_only_install_error(root):
    """`python train.py ...HOOK_ONLY_ARGV` as slime runs it: its own parser (no package flags),
    then its init hook `fusedrl.slime_ext.install(args)` in a process whose command line is that
    one. Returns (what slime's parser dropped, the hook's error or None)."""
    import os
    import sys

    from fusedrl.slime_ext import patching

    args, unknown = upstream_slime.parse_known_args(BASE_ARGV + HOOK_ONLY_ARGV)
    saved, sys.argv = sys.argv, [os.path.join(root, "train.py"), *BASE_ARGV, *HOOK_ONLY_ARGV]
    try:
        patching.install(args)
    except ValueError as error:
        return unknown, str(error)
    finally:
        sys.argv = saved
        patching.uninstall()
    return unknown, None


@pytest.fixture(scope="module")
def observed():
    return run_on_ranks(1, observe, flag_cases())[0]


# ----------------------------------------------------------------------------- the tests


@pytest.mark.parametrize("flag, values, dest, expected", flag_cases(), ids=lambda x: x if isinstance(x, str) else "")
def test_every_fusedrl_flag_reaches_args_through_slimes_parser(observed, flag, values, dest, expected):
    unknown, value = observed["flags"][flag, values]
    assert unknown == [] and value == expected


def test_fusedrl_flags_neither_shadow_nor_are_shadowed_by_slimes(observed):
    # Same option string: argparse refuses at registration (every parse would fail). Same
    # attribute under another option string: one of the two would be silently overwritten.
    assert not {action.dest for action in fusedrl_actions()} & observed["slime_dests"]


def test_plain_slime_parse_drops_fusedrl_flags(observed):
    """Why the package's entry point exists: slime's own train.py drops them without a word."""
    assert observed["plain"] == (["--loss-aggregation", "prompt_mean", "--sfc-kl-beta", "0.1"], False, False)


def test_slime_defaults_eps_clip_high_to_eps_clip(observed):
    assert observed["eps_clip_high"] == 0.3


def test_pg_loss_type_reinforce_is_a_registered_flag(observed):
    assert observed["pg_loss_type"] == ([], "reinforce")


@pytest.mark.parametrize("config", list(CHECKED))
def test_startup_checks_read_only_flags_slime_or_fusedrl_define(observed, config):
    assert observed["undefined_reads"][config] == set()


def test_token_mean_turns_on_per_token_loss_within_slimes_parse(observed):
    assert observed["token_mean_per_token"] is True


@pytest.mark.parametrize("setting", list(PROMPT_MEAN_BREAKERS))
def test_prompt_mean_refuses_settings_that_break_its_denominators(observed, setting):
    error = observed["prompt_mean_errors"][setting]
    assert error is not None and PROMPT_MEAN_BREAKERS[setting][1] in error, error


@pytest.mark.parametrize("config", list(PROMPT_MEAN_STEPS))
def test_prompt_mean_accepts_several_steps_per_rollout(observed, config):
    """Steps of whole prompt groups are accepted (the rollout wrapper checks each rollout's groups);
    on slime's policy loss the loss type stays (slime's log-prob reuse) and the reducer is fusedrl's."""
    error, loss_type, reducer, global_batch_size = observed["prompt_mean_steps"][config]
    assert error is None and global_batch_size == 8 // int(config.split("-")[-1][0])
    if config.startswith("policy_loss"):
        assert (loss_type, reducer) == ("policy_loss", "fusedrl.slime_ext.aggregation.get_pg_loss_reducer")
    else:
        assert (loss_type, reducer) == ("custom_loss", None)


def test_init_hook_refuses_package_flags_slimes_own_train_py_dropped(observed):
    """slime's train.py with only the init hook and --loss-aggregation prompt_mean: slime's parser
    drops the flag, and install refuses, naming it and the entry point that parses it."""
    unknown, error = observed["hook_only"]
    assert unknown == ["--loss-aggregation", "prompt_mean"]
    assert error is not None and error.startswith("--loss-aggregation on the command line never reached slime's args")
    assert "python -m fusedrl.slime_ext.train path/to/slime/train.py" in error
