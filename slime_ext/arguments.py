"""Every flag of the package: registered on slime's parser and validated, in one place.

slime's parser drops flags it does not define, so the wrapper entry point (`slime_ext.train`)
hands `add_fusedrl_arguments` to `slime.utils.arguments.parse_args(add_custom_arguments=...)`
and runs `validate_fusedrl_args` on the parsed namespace before training starts. Each feature's
flags and checks live in `flags/`; the order they run in is carried by the data they pass on:
the aggregation checks take, as an argument, the mode the SFC checks say --sfc-loss-agg-mode
stands for. The policy-loss checks read slime's own flags and --pg-loss-type, M2PO's
(--fusedrl-m2po-tau) those and its own; the fused LM head's read
slime's flags besides its own; the last checks meet slime's own newer features (`flags/slime_features.py`).

A flag the installed slime defines itself is never registered twice (`slime_options`): where the
package adopts slime's definition (--pg-loss-type) the feature skips it, and any other package flag
slime has come to define is refused by name, since the package cannot know slime's meaning of it.

The package's losses and hooks also run inside slime's trainer when it was started by slime's
own `train.py` (the flags then never reached slime's args), so each calls `check_at_first_use`
on its first call: the same checks, and a ValueError naming the flag wherever the startup checks
would have had to change something slime has already read. The init hook also refuses the
package's flags it finds on its process's command line but not on slime's args
(`refuse_dropped_flags`).
"""

import argparse
import copy
import weakref

from . import slime_options
from .flags import aggregation, lm_head, log_probs, m2po, policy, sfc, slime_features

# Resolved at first use without harm: only the package's own losses read them, per call.
LATE_RESOLVABLE = ("loss_aggregation", "loss_aggregation_divisor")
ENTRY_POINT = "python -m fusedrl.slime_ext.train path/to/slime/train.py"
_CHECKED = {}  # id(args) -> weak reference, for the args objects that passed check_at_first_use


FEATURES = (aggregation, policy, m2po, sfc, lm_head, log_probs)


def add_fusedrl_arguments(parser):
    """Register every feature's flags on slime's parser (those slime does not define itself);
    returns the parser (slime's convention). ValueError naming a package flag the installed slime
    now defines with a meaning the package does not adopt."""
    scratch = argparse.ArgumentParser(add_help=False)
    for feature in FEATURES:
        feature.add_arguments(scratch)
    options = {option for action in scratch._actions for option in action.option_strings}
    clashes = sorted(options & slime_options.defined_options())
    if clashes:
        raise ValueError(
            f"the installed slime defines {', '.join(clashes)} itself, as fusedrl does: this fusedrl predates slime's "
            "definition and cannot know its meaning, so it neither registers its own nor reads slime's; use a fusedrl "
            "that knows this slime's flag, or a slime without it"
        )
    for feature in FEATURES:
        feature.add_arguments(parser)
    return parser


def validate_fusedrl_args(args) -> None:
    """Check every feature's flags against the parsed slime arguments; ValueError names the flag.

    Resolves what the flags imply (the aggregation mode, the rollout and reducer hooks to
    install); calling it again on the result changes nothing.
    """
    aggregation.validate_args(args, implied=sfc.validate_args(args))
    policy.validate_args(args)
    m2po.validate_args(args)
    lm_head.validate_args(args)
    log_probs.validate_args(args)
    slime_features.validate_args(args)


def fusedrl_defaults() -> dict:
    """Every package flag's attribute and its default."""
    return vars(add_fusedrl_arguments(argparse.ArgumentParser()).parse_args([]))


def package_options() -> dict:
    """Every option string of the package's flags -> the attribute slime's args would hold it in."""
    parser = add_fusedrl_arguments(argparse.ArgumentParser(add_help=False))
    return {option: action.dest for action in parser._actions for option in action.option_strings}


def refuse_dropped_flags(args, argv) -> None:
    """ValueError naming the package's flags in `argv` (a command line) that never reached `args`.

    slime's own entry scripts parse with a parser that drops the flags it does not define, so
    `--loss-aggregation prompt_mean` given to slime's `train.py` would otherwise train as
    sample_mean without a word."""
    options = package_options()
    given = [token.split("=", 1)[0] for token in argv if isinstance(token, str) and token.startswith("--")]
    dropped = sorted({flag for flag in given if flag in options and not hasattr(args, options[flag])})
    if dropped:
        raise ValueError(
            f"{', '.join(dropped)} on the command line never reached slime's args: slime's own entry script parses "
            f"with a parser that drops flags it does not define. Start training through `{ENTRY_POINT} ...` "
            "(`fusedrl.slime_ext.train`), which adds the package's flags to slime's parser"
        )


def configures_package(args) -> bool:
    """Whether slime's args carry the package's flags or name one of its losses or hooks."""
    named = (
        getattr(args, "custom_loss_function_path", None) in policy.LOSS_PATHS + sfc.LOSS_PATHS,
        getattr(args, "custom_pg_loss_reducer_function_path", None) == aggregation.REDUCER_PATH,
        getattr(args, "rollout_function_path", None) == aggregation.ROLLOUT_FUNCTION_PATH,
        getattr(args, "custom_generate_function_path", None) == sfc.GENERATE_PATH,
    )
    return any(named) or any(hasattr(args, dest) for dest in fusedrl_defaults())


def check_at_first_use(args) -> None:
    """The startup checks, where a package loss or hook first runs inside slime's trainer.

    Refuses (ValueError naming the flag) a configuration the startup checks refuse, args that
    never saw the package's flags (slime's own parser drops them, so `--loss-aggregation ...`
    given to slime's `train.py` would silently not apply), and any setting the startup checks
    would have changed but slime or Megatron have already read (the per-token switch, the rollout,
    generate and reducer hooks). Checks each args object once.
    """
    checked = _CHECKED.get(id(args))
    if checked is not None and checked() is args:
        return
    defaults = fusedrl_defaults()
    missing = {dest: default for dest, default in defaults.items() if not hasattr(args, dest)}
    policy.validate_args(argparse.Namespace(**{**vars(args), **missing}))  # slime's flags, named first
    if len(missing) == len(defaults):
        dropped = ["--loss-aggregation"] + ([] if slime_options.defines(policy.FLAG) else [policy.FLAG])
        raise ValueError(
            f"{', '.join(dropped)} and the package's other flags are not on slime's args: slime's "
            f"parser drops flags it does not define, so given to slime's own train.py they never arrive. Start "
            f"training through `{ENTRY_POINT} ...` (or set them in --custom-config-path's YAML)"
        )
    for dest, default in missing.items():  # some given another way (--custom-config-path's YAML)
        setattr(args, dest, default)
    resolved = copy.copy(args)
    validate_fusedrl_args(resolved)
    for dest, value in vars(resolved).items():
        if getattr(args, dest, None) == value:
            continue
        if dest not in LATE_RESOLVABLE:
            raise ValueError(
                f"--{dest.replace('_', '-')} must be {value!r} for this configuration, got "
                f"{getattr(args, dest, None)!r}: slime reads it before the package's code first runs, so only the "
                f"startup checks can set it; give it on the command line or start through `{ENTRY_POINT} ...`"
            )
        setattr(args, dest, value)
    _CHECKED[id(args)] = weakref.ref(args)
