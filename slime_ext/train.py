"""Entry point: `python -m fusedrl.slime_ext.train path/to/slime/train.py ARGS`.

slime's entry scripts (`train.py`, `train_async.py`) parse their flags with
`slime.utils.arguments.parse_args()`, which drops flags slime does not define, then call the
script's `train(args)`. This entry point loads the script as a module (its `__main__` block does
not run), parses ARGS with the package's flags added
(`parse_args(add_custom_arguments=add_fusedrl_arguments)`), checks them (a ValueError naming the
flag stops the run before any resource is allocated), and calls the script's `train(args)`.

It also makes `fusedrl.slime_ext.install` the init hook (--custom-megatron-init-path): the
package's carried data must be kept out of the model's forward and the log-prob path runs fused.
An init hook given on the command line is kept and called by `install` after its own work.

`--help` alone lists the package's flags (slime's own come with `path/to/train.py --help`); a
missing script or a Python without slime stop with a one-line error.
"""

import argparse
import importlib.util
import os
import sys

from .arguments import add_fusedrl_arguments, validate_fusedrl_args

PROG = "python -m fusedrl.slime_ext.train"
INSTALL_PATH = "fusedrl.slime_ext.install"
USAGE = f"{PROG} path/to/slime/train.py [slime and fusedrl flags]"


def help_parser() -> argparse.ArgumentParser:
    """The parser `--help` prints: the usage and every flag the package adds to slime's."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        usage=USAGE,
        description="Run one of slime's entry scripts (train.py, train_async.py) with fusedrl's flags "
        "added to slime's parser, checked at startup, and fusedrl.slime_ext.install as the init hook.",
        epilog="slime's own flags: " + PROG + " path/to/slime/train.py --help",
    )
    add_fusedrl_arguments(parser.add_argument_group("fusedrl flags"))
    return parser


def check_script_path(path: str) -> None:
    """The first argument names an existing Python file."""
    if not path.endswith(".py") or not os.path.isfile(path):
        raise ValueError(f"the first argument must be slime's entry script (an existing .py file), got {path!r}")


def load_script(path: str):
    """slime's entry script as a module, without running its `__main__` block."""
    check_script_path(path)
    directory = os.path.dirname(os.path.abspath(path))
    if directory not in sys.path:
        sys.path.insert(0, directory)  # as `python path/to/train.py` would
    spec = importlib.util.spec_from_file_location("fusedrl_slime_entry", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not callable(getattr(module, "train", None)):
        raise ValueError(f"{path} defines no train(args) function to run")
    return module


def check_slime_importable() -> None:
    """slime must be importable here: the entry script and the flag parser are slime's."""
    if "slime" not in sys.modules and importlib.util.find_spec("slime") is None:
        raise ValueError(
            "slime is not importable in this Python: install slime, or put its checkout on PYTHONPATH"
        )


def use_install_hook(args) -> None:
    """Make the package's init hook slime's, keeping a user hook to be called from it."""
    hook = getattr(args, "custom_megatron_init_path", None)
    if hook not in (None, INSTALL_PATH):
        args.fusedrl_user_init_path = hook
    args.custom_megatron_init_path = INSTALL_PATH


def validate(args) -> None:
    """Every startup check of the package's flags against slime's parsed arguments."""
    validate_fusedrl_args(args)
    use_install_hook(args)


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        help_parser().print_help()
        return
    try:
        if not argv:
            raise ValueError(f"no slime entry script given; usage: {USAGE} (--help lists fusedrl's flags)")
        check_script_path(argv[0])
        check_slime_importable()
        script = load_script(argv[0])
    except ValueError as error:  # a usage error: one line and exit status 2, as argparse's
        print(f"{PROG}: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    from slime.utils.arguments import parse_args

    sys.argv = [argv[0], *argv[1:]]
    args = parse_args(add_custom_arguments=add_fusedrl_arguments)
    validate(args)
    script.train(args)


if __name__ == "__main__":
    main()
