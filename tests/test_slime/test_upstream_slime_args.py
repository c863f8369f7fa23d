"""fusedrl's flags through slime's real argument parser (FUSEDRL_SLIME_SRC; bench/slime_loop/upstream_slime.py),
as slime 624b824 defines it and as a newer slime does (`stand_ins.use_newer_flags`: its own
--pg-loss-type, --use-score-centering, --score-centering-top-k, --log-probs-backend,
--flush-cache-interval, and a `slime_validate_args` returning `(args, restore_plan)`).

slime parses with `ignore_unknown_args=True`: a flag nobody registered is dropped without a word.
So every flag the package documents or reads must be registered on slime's parser, by slime or by
`add_fusedrl_arguments` (the `add_custom_arguments` of `fusedrl.slime_ext.train`), and never by
both: slime registers the custom arguments first, so a flag both define stops every parse.

slime is imported only in one spawned worker (`observe`), which parses every command line the
tests need, on both parsers, runs the package's entry point and init hook on them, and returns
plain values.
"""

import argparse
import os

import pytest
from bench_package import import_bench
from distributed import run_on_ranks

from fusedrl.slime_ext.arguments import add_fusedrl_arguments
from fusedrl.slime_ext.flags.aggregation import ROLLOUT_FUNCTION_PATH

import_bench()
from bench.slime_loop import stand_ins  # noqa: E402
from bench.slime_loop import upstream_slime  # noqa: E402

upstream_slime.require()

PARSERS = ("624b824", "newer")
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
# SFC on a rollout another job dumped (its tokens carry that job's weight versions), or none at all:
# (the flags, what the refusal names)
SFC_REPLAYS = {
    "debug_rollout_data": (["--load-debug-rollout-data", "/nonexistent/rollout_{rollout_id}.pt"], "--load-debug-rollout-data"),
    "forge_rollout_data": (["--rollout-function-path", "slime.rollout.forge_load.generate_rollout",
                            "--load-forge-rollout-data", "/nonexistent/{rollout_id}.pt"], "--load-forge-rollout-data"),
    "debug_train_only": (["--debug-train-only"], "--debug-train-only"),
}  # fmt: skip
# prompt_mean with several steps per rollout of whole groups, on fusedrl's policy loss and slime's.
PROMPT_MEAN_STEPS = {
    f"{loss}-{steps}steps": (argv + ["--loss-aggregation", "prompt_mean", "--num-steps-per-rollout", str(steps)])
    for loss, argv in (("policy_loss", []), ("fusedrl", POLICY_LOSS)) for steps in (2, 4)
}
# slime's own train.py with the init hook and a package flag its parser drops.
INIT_HOOK = ["--custom-megatron-init-path", "fusedrl.slime_ext.install"]
HOOK_ONLY_ARGV = INIT_HOOK + ["--loss-aggregation", "prompt_mean"]
# The configuration in which each package flag is read (the flag's own value comes after it).
FLAG_CONTEXTS = {
    "--loss-aggregation": POLICY_LOSS + ["--loss-aggregation-divisor", "64"],  # the divisor: for constant
    "--loss-aggregation-divisor": POLICY_LOSS + ["--loss-aggregation", "constant"],
    "--loss-aggregation-strict-prompt-scale": POLICY_LOSS + ["--loss-aggregation", "prompt_mean"],
    "--loss-aggregation-inner-rollout-function-path": POLICY_LOSS
    + ["--loss-aggregation", "prompt_mean", "--rollout-function-path", ROLLOUT_FUNCTION_PATH],
    "--pg-loss-type": POLICY_LOSS,
    "--sfc-num-auxiliary-token-samples": SFC_LOSS,
    "--sfc-kl-beta": SFC_LOSS,
    "--sfc-loss-agg-mode": SFC_LOSS,
    "--sfc-inner-generate-function-path": SFC_LOSS,
    "--sfc-max-refused-frac": SFC_LOSS,
    "--sfc-m2-tau": SFC_LOSS,
    "--fusedrl-m2-tis-tau": ["--use-tis", "--custom-tis-function-path", "fusedrl.slime_ext.m2_tis.m2_trust_region_tis"],
    "--fusedrl-fused-lm-head": POLICY_LOSS,
    "--fusedrl-keep-slime-log-probs": [],
    "--fusedrl-m2po-tau": POLICY_LOSS,
}
PLUGIN_ON = {"AGENTCORE_SGLANG_TOKEN_SAMPLES": "1"}
# slime's own newer features the package cannot run with: (command line, environment, what the
# refusal names), refused by the entry point's checks and by the init hook.
REFUSED = {
    "triton_backend": (["--log-probs-backend", "triton"], {}, ("--log-probs-backend triton", "fusedrl.slime_ext.install")),
    "triton_backend_fused_lm_head": (["--log-probs-backend", "triton", "--fusedrl-fused-lm-head"], {},
                                     ("--log-probs-backend triton", "--fusedrl-fused-lm-head")),
    "score_centering_fused_lm_head": (["--use-score-centering", "--fusedrl-fused-lm-head"], {},
                                      ("--use-score-centering", "--fusedrl-fused-lm-head")),
    "score_centering_policy_loss": (POLICY_LOSS + ["--use-score-centering"], {},
                                    ("--use-score-centering", "fusedrl.slime_ext.losses.policy_loss")),
    "score_centering_prompt_mean": (["--use-score-centering", "--loss-aggregation", "prompt_mean"], {},
                                    ("--use-score-centering", "--loss-aggregation prompt_mean")),
    "score_centering_plugin_draws": (["--use-score-centering"], PLUGIN_ON,
                                     ("--use-score-centering", "AGENTCORE_SGLANG_TOKEN_SAMPLES=1")),
    "flush_cache_interval_sfc": (SFC_LOSS + ["--flush-cache-interval", "2"], {},
                                 ("--flush-cache-interval 2", "fusedrl.slime_ext.losses.sfc_loss")),
}  # fmt: skip
# Refused also where slime's own train.py runs the init hook alone (no package flag on the command line).
REFUSED_HOOK_ONLY = ("triton_backend", "score_centering_plugin_draws")
# slime's newer features next to the package's where they can run: accepted by both.
ACCEPTED = {
    "triton_backend_slimes_log_probs": ["--log-probs-backend", "triton", "--fusedrl-keep-slime-log-probs"],
    "score_centering_slimes_policy_loss": ["--use-score-centering", "--loss-aggregation", "token_mean"],
    "flush_cache_interval_policy_loss": POLICY_LOSS + ["--flush-cache-interval", "2"],
    "slimes_reinforce": ["--pg-loss-type", "reinforce"],  # slime's own objective on slime's policy loss
}


# A float flag's value where 2.5 is out of its range.
FLOAT_VALUES = {"--sfc-max-refused-frac": 0.25}


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
            value = FLOAT_VALUES.get(flag, 2.5)
            cases.append((flag, (str(value),), dest, value))
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


FAILED = "observation failed:\n"  # prefix of an observation's traceback in the worker's answer


def observe(rank, world_size, cases, script):
    """Every parse the tests check, on slime 624b824's parser and then on the newer one, in a
    process that imports slime: {parser: {observation: plain values, or FAILED + its traceback}}."""
    import traceback

    root = upstream_slime.load()
    out = {}
    for parser in PARSERS:
        if parser == "newer":
            stand_ins.use_newer_flags()
        out[parser] = {}
        for name, observation in observations(root, cases, script).items():
            try:
                out[parser][name] = observation()
            except Exception:  # reported by the tests that read this observation
                out[parser][name] = FAILED + traceback.format_exc()
    return out


def observations(root, cases, script):
    """{name: a function observing it} on the parser this process's slime builds."""
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

    def slime_dests():
        return set(vars(parse([], with_fusedrl=False)[0])) | set(vars(arguments._pre_parse_mode()))

    def parsed_value(argv, dest):
        args, unknown = parse(argv)
        return unknown, getattr(args, dest, None)

    def plain():
        args, unknown = parse(["--loss-aggregation", "prompt_mean", "--sfc-kl-beta", "0.1"], with_fusedrl=False)
        return unknown, hasattr(args, "loss_aggregation"), hasattr(args, "sfc_kl_beta")

    def undefined_reads():
        defined = slime_dests() | {action.dest for action in fusedrl_actions()}
        reads = {}
        for name, argv in CHECKED.items():
            recorder = ReadRecorder(parse(argv)[0])
            entry.validate(recorder)
            reads[name] = recorder._reads - defined
        return reads

    def prompt_mean_steps():
        steps = {}
        for name, argv in PROMPT_MEAN_STEPS.items():
            args = parse(argv)[0]
            steps[name] = (validate_error(args), args.loss_type, args.custom_pg_loss_reducer_function_path,
                           args.global_batch_size)  # fmt: skip
        return steps

    def newer_features(cases, environ_of, hook_only):
        if "use_score_centering" not in slime_dests():  # slime 624b824: none of them
            return {}
        return {name: refusals(root, script, argv, environ_of(name), parse, hook_only=name in hook_only) for name, argv in cases.items()}

    return {
        "slime_dests": slime_dests,
        "registered": lambda: {action.dest for action in fusedrl_actions()},  # what the package registers on this slime
        "flags": lambda: {(flag, values): parsed_value([flag, *values], dest) for flag, values, dest, _ in cases},
        "plain": plain,
        "eps_clip_high": lambda: parse(POLICY_LOSS + ["--eps-clip", "0.3"])[0].eps_clip_high,
        "pg_loss_type": lambda: parsed_value(POLICY_LOSS + ["--pg-loss-type", "reinforce"], "pg_loss_type"),
        "undefined_reads": undefined_reads,
        "token_mean_per_token": lambda: parse(["--loss-aggregation", "token_mean"])[0].calculate_per_token_loss,
        "prompt_mean_errors": lambda: {
            name: validate_error(parse(POLICY_LOSS + ["--loss-aggregation", "prompt_mean", *extra])[0])
            for name, (extra, _) in PROMPT_MEAN_BREAKERS.items()},
        "prompt_mean_steps": prompt_mean_steps,
        "sfc_replay_errors": lambda: {name: validate_error(parse(SFC_LOSS + argv)[0]) for name, (argv, _) in SFC_REPLAYS.items()},
        "hook_only": lambda: install_error(root, *upstream_slime.parse_known_args(BASE_ARGV + HOOK_ONLY_ARGV), HOOK_ONLY_ARGV),
        "plain_install": lambda: install_error(root, parse([], with_fusedrl=False)[0], [], INIT_HOOK),
        "entry": lambda: {(flag, values): through_entry_point(root, script, FLAG_CONTEXTS[flag] + [flag, *values], dest)
                          for flag, values, dest, _ in cases},
        "refused": lambda: newer_features({name: argv for name, (argv, _, _) in REFUSED.items()},
                                          lambda name: REFUSED[name][1], REFUSED_HOOK_ONLY),
        "accepted": lambda: newer_features(ACCEPTED, lambda name: {}, ()),
    }  # fmt: skip


def outcome(call, *args):
    """call(*args) or the error it raised, as "Type: message" (argparse's exit included)."""
    try:
        return call(*args), None
    except (Exception, SystemExit) as error:  # the observation under test
        return None, f"{type(error).__name__}: {error}"


def through_entry_point(root, script, argv, dest):
    """`python -m fusedrl.slime_ext.train SCRIPT BASE_ARGV ARGV` (slime's parse_args as
    upstream_slime runs it), then the init hook it set on the args the script's train() received:
    (the value of `dest` train() got, or the entry point's error; the init hook's error or None)."""
    args, error = outcome(run_entry_point, script, BASE_ARGV + argv)
    if error is not None:
        return error, None
    return getattr(args, dest), install_error(root, args, [], BASE_ARGV + argv)[1]


def run_entry_point(script, argv):
    """The args the entry script's train() received from `fusedrl.slime_ext.train.main`."""
    import sys

    from slime.utils import arguments

    from fusedrl.slime_ext import train as entry

    loaded = {}
    load_script, parse_args, saved = entry.load_script, arguments.parse_args, list(sys.argv)
    entry.load_script = lambda path: loaded.setdefault("script", load_script(path))
    arguments.parse_args = upstream_slime.parse_args  # slime's, without Megatron's and SGLang's halves
    try:
        entry.main([script, *argv])
    finally:
        entry.load_script, arguments.parse_args, sys.argv[:] = load_script, parse_args, saved
    return loaded["script"].CALLS.pop()


def refusals(root, script, argv, environ, parse, hook_only):
    """(the entry point's error, the init hook's error on the same flags parsed but unchecked, the
    init hook's error under slime's own train.py (its parser alone; only with `hook_only`)), each
    None when accepted; `environ` is added to the process environment meanwhile."""
    saved = dict(os.environ)
    os.environ.update(environ)
    try:
        entry_error = outcome(run_entry_point, script, BASE_ARGV + argv)[1]
        hook_error = install_error(root, parse(argv)[0], [], BASE_ARGV + argv)[1]
        plain = upstream_slime.parse_known_args(BASE_ARGV + argv + INIT_HOOK) if hook_only else None
        plain_error = install_error(root, *plain, BASE_ARGV + argv + INIT_HOOK)[1] if hook_only else None
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return entry_error, hook_error, plain_error


def install_error(root, args, unknown, argv):
    """`fusedrl.slime_ext.install(args)` in a process whose command line is `train.py ARGV`, as in
    slime's train actor: (what slime's parser dropped, the hook's error or None); undone after."""
    import sys

    from fusedrl.slime_ext import patching

    saved, sys.argv = sys.argv, [os.path.join(root, "train.py"), *argv]
    try:
        patching.install(args)
    except ValueError as error:
        return unknown, str(error)
    finally:
        sys.argv = saved
        patching.uninstall()
    return unknown, None


@pytest.fixture(scope="module")
def observed(tmp_path_factory):
    script = tmp_path_factory.mktemp("entry") / "train.py"
    script.write_text("CALLS = []\n\n\ndef train(args):\n    CALLS.append(args)\n")
    return run_on_ranks(1, observe, flag_cases(), str(script))[0]


class Observed(dict):
    """One parser's observations; reading one the worker failed to make fails the test with its traceback."""

    def __getitem__(self, name):
        value = super().__getitem__(name)
        if isinstance(value, str) and value.startswith(FAILED):
            pytest.fail(f"{name}: {value}")
        return value


@pytest.fixture
def on(observed, parser):
    """What the worker observed on `parser`."""
    return Observed(observed[parser])


# ----------------------------------------------------------------------------- the tests


@pytest.mark.parametrize("parser", PARSERS)
@pytest.mark.parametrize("flag, values, dest, expected", flag_cases(), ids=lambda x: x if isinstance(x, str) else "")
def test_every_fusedrl_flag_reaches_args_through_slimes_parser(on, flag, values, dest, expected):
    unknown, value = on["flags"][flag, values]
    assert unknown == [] and value == expected


@pytest.mark.parametrize("parser", PARSERS)
@pytest.mark.parametrize("flag, values, dest, expected", flag_cases(), ids=lambda x: x if isinstance(x, str) else "")
def test_every_fusedrl_flag_through_the_entry_point_and_the_init_hook(on, flag, values, dest, expected):
    """`python -m fusedrl.slime_ext.train` with the flag where it is read: the script's train()
    gets it, and the init hook accepts the args it got."""
    value, install_error = on["entry"][flag, values]
    assert (value, install_error) == (expected, None)


@pytest.mark.parametrize("parser", PARSERS)
def test_fusedrl_flags_neither_shadow_nor_are_shadowed_by_slimes(on):
    # Same option string: argparse refuses at registration (every parse would fail). Same
    # attribute under another option string: one of the two would be silently overwritten.
    assert on["registered"] and not on["registered"] & on["slime_dests"]


@pytest.mark.parametrize("parser", PARSERS)
def test_the_package_adopts_slimes_pg_loss_type_where_slime_defines_it(on, parser):
    assert ("pg_loss_type" in on["registered"]) == (parser == "624b824") and "pg_loss_type" in on["registered"] | on["slime_dests"]


@pytest.mark.parametrize("parser", PARSERS)
def test_plain_slime_parse_drops_fusedrl_flags(on):
    """Why the package's entry point exists: slime's own train.py drops them without a word."""
    assert on["plain"] == (["--loss-aggregation", "prompt_mean", "--sfc-kl-beta", "0.1"], False, False)


@pytest.mark.parametrize("parser", PARSERS)
def test_slime_defaults_eps_clip_high_to_eps_clip(on):
    """The args slime validated (on the newer parser a copy, returned with the restore plan)."""
    assert on["eps_clip_high"] == 0.3


@pytest.mark.parametrize("parser", PARSERS)
def test_pg_loss_type_reinforce_is_a_registered_flag(on):
    assert on["pg_loss_type"] == ([], "reinforce")


@pytest.mark.parametrize("parser", PARSERS)
@pytest.mark.parametrize("config", list(CHECKED))
def test_startup_checks_read_only_flags_slime_or_fusedrl_define(on, parser, config):
    """On slime 624b824 the only others read are the newer slime's flags, each by capability
    (absent: slime's default)."""
    allowed = set() if parser == "newer" else {option[2:].replace("-", "_") for option in stand_ins.NEWER_FLAGS}
    assert on["undefined_reads"][config] <= allowed


@pytest.mark.parametrize("parser", PARSERS)
def test_token_mean_turns_on_per_token_loss_within_slimes_parse(on):
    assert on["token_mean_per_token"] is True


@pytest.mark.parametrize("parser", PARSERS)
@pytest.mark.parametrize("setting", list(PROMPT_MEAN_BREAKERS))
def test_prompt_mean_refuses_settings_that_break_its_denominators(on, setting):
    error = on["prompt_mean_errors"][setting]
    assert error is not None and PROMPT_MEAN_BREAKERS[setting][1] in error, error


@pytest.mark.parametrize("parser", PARSERS)
@pytest.mark.parametrize("replay", list(SFC_REPLAYS))
def test_sfc_refuses_a_replayed_rollout_at_startup(on, replay):
    """Its tokens' weight versions are the dumping job's, which this job's pushes number anew."""
    error = on["sfc_replay_errors"][replay]
    assert error is not None and SFC_REPLAYS[replay][1] in error, error


@pytest.mark.parametrize("parser", PARSERS)
@pytest.mark.parametrize("config", list(PROMPT_MEAN_STEPS))
def test_prompt_mean_accepts_several_steps_per_rollout(on, config):
    """Steps of whole prompt groups are accepted (the rollout wrapper checks each rollout's groups);
    on slime's policy loss the loss type stays (slime's log-prob reuse) and the reducer is fusedrl's."""
    error, loss_type, reducer, global_batch_size = on["prompt_mean_steps"][config]
    assert error is None and global_batch_size == 8 // int(config.split("-")[-1][0])
    if config.startswith("policy_loss"):
        assert (loss_type, reducer) == ("policy_loss", "fusedrl.slime_ext.aggregation.get_pg_loss_reducer")
    else:
        assert (loss_type, reducer) == ("custom_loss", None)


@pytest.mark.parametrize("parser", PARSERS)
def test_init_hook_refuses_package_flags_slimes_own_train_py_dropped(on):
    """slime's train.py with only the init hook and --loss-aggregation prompt_mean: slime's parser
    drops the flag, and install refuses, naming it and the entry point that parses it."""
    unknown, error = on["hook_only"]
    assert unknown == ["--loss-aggregation", "prompt_mean"]
    assert error is not None and error.startswith("--loss-aggregation on the command line never reached slime's args")
    assert "python -m fusedrl.slime_ext.train path/to/slime/train.py" in error


@pytest.mark.parametrize("parser", PARSERS)
def test_init_hook_alone_accepts_slimes_defaults(on):
    """slime's own train.py with the init hook and nothing else; on the newer slime its own
    --pg-loss-type default (None) is no package flag set."""
    assert on["plain_install"] == ([], None)


@pytest.mark.parametrize("parser", ["newer"])
@pytest.mark.parametrize("case", list(REFUSED))
def test_slimes_newer_features_the_package_cannot_run_with_stop_at_startup(on, case):
    """Refused by the entry point's checks, by the init hook on the same flags left unchecked, and
    (where no package flag is needed) by the init hook under slime's own train.py; each error
    names both sides."""
    entry_error, hook_error, plain_error = on["refused"][case]
    names = REFUSED[case][2]
    errors = [entry_error, hook_error] + ([plain_error] if case in REFUSED_HOOK_ONLY else [])
    for error in errors:
        assert error is not None and all(name in error for name in names), (error, names)


@pytest.mark.parametrize("parser", ["newer"])
@pytest.mark.parametrize("case", list(ACCEPTED))
def test_slimes_newer_features_the_package_runs_with_pass_startup(on, case):
    assert on["accepted"][case] == (None, None, None)
