"""slime's real source, importable in the tests: `load()` puts the slime checkout named by
FUSEDRL_SLIME_SRC on `sys.path`, so the tests run slime's own loss wrapper, batch builder, rollout
conversion, log-prob path and argument parser instead of a re-implementation of them.

FUSEDRL_SLIME_SRC is a slime checkout root (holding the `slime/` package and `train.py`); CI
(`.ci/run`) points it at `../shared/upstream/slime`. A test module calls `require()` at import:
unset, the module skips with that reason; set to a folder that is not a slime checkout, it fails.
slime itself is imported (`load()`) only in the spawned workers that run it, so the stubs never
reach the pytest process.

slime imports a few things a CPU test machine cannot (Ray, sglang_router, Megatron-LM's training
package, wandb, ...) and knows no CPU device: `load()` stubs those at the import boundary, only when
missing, and selects a CPU backend in slime's device registry (`stand_ins.install_import_stubs`,
`stand_ins.select_cpu_accelerator`; every stand-in lives in bench/slime_loop/stand_ins.py).

`parse_known_args` stands in for `slime.utils.arguments.parse_args`, whose Megatron half needs
`megatron.training`: it runs everything of slime's parse that does not (see its docstring);
`parse_args` is the same with slime's signature, for the package's entry point to call.

A newer slime's parser, for the tests of the flags: `stand_ins.use_newer_flags()`.
"""

import argparse
import os
import sys

import pytest

from . import stand_ins

ENV_VAR = "FUSEDRL_SLIME_SRC"


def require() -> str:
    """The slime checkout FUSEDRL_SLIME_SRC names (absolute). Unset, the calling test module is
    skipped with that reason; naming no slime checkout, it fails. Changes nothing else."""
    root = os.environ.get(ENV_VAR)
    if not root:
        pytest.skip(
            f"{ENV_VAR} is not set: point it at a slime checkout (the folder holding slime/ and train.py)",
            allow_module_level=True,
        )
    root = os.path.abspath(root)
    if not (os.path.isfile(os.path.join(root, "slime", "__init__.py")) and os.path.isfile(os.path.join(root, "train.py"))):
        raise RuntimeError(f"{ENV_VAR}={root!r} is not a slime checkout: slime/__init__.py and train.py must be there")
    return root


def load() -> str:
    """Make slime's source importable (stubs included); returns the checkout root. Idempotent.

    The stubs stay for the life of the process and would stand in for those packages for any
    code, so call it only in the spawned workers that run slime, never in the pytest process
    (where SGLang's own tests must see the packages as missing)."""
    root = require()
    stand_ins.install_import_stubs()
    if root not in sys.path:
        sys.path.insert(0, root)
    import slime

    if not os.path.abspath(slime.__file__).startswith(os.path.join(root, "slime")):
        raise RuntimeError(f"`import slime` found {slime.__file__}, not the checkout {ENV_VAR}={root}")
    stand_ins.select_cpu_accelerator()
    return root


def parse_known_args(argv, add_custom_arguments=None, with_sglang=False):
    """`(args, unknown)`: slime's `parse_args(add_custom_arguments)` on `argv`, less what needs
    Megatron-LM's training package (and, unless `with_sglang`, SGLang's server flags).

    As slime does: its provider registers `add_custom_arguments`' flags first, then slime's own, on
    an `ArgumentParser(allow_abbrev=False)` parsed with `parse_known_args` (Megatron's
    `ignore_unknown_args=True`: `unknown` is what slime drops); the pre-parsed mode flags are
    merged in and `slime_validate_args` runs. `with_sglang`: slime's SGLang half too, its own
    parser of the `--sglang-*` flags from SGLang's `ServerArgs` (the router's flags left out:
    there is no router) merged in and its `validate_args` run, as `parse_args` does. Left out:
    Megatron's own flags and `validate_args`; `unknown` is what slime's main parser leaves to
    Megatron and to SGLang.
    """
    from slime.utils import arguments

    if with_sglang:
        from slime.backends.sglang_utils import arguments as sglang_arguments

    parser = argparse.ArgumentParser(allow_abbrev=False)
    arguments.get_slime_extra_args_provider(add_custom_arguments)(parser)
    saved, sys.argv = sys.argv, ["train.py", *argv]  # slime's pre-parse and SGLang half read sys.argv
    try:
        args, unknown = parser.parse_known_args(argv)
        for key, value in vars(arguments._pre_parse_mode()).items():
            setattr(args, key, value)
        if with_sglang:
            for key, value in vars(sglang_arguments.sglang_parse_args()).items():
                setattr(args, key, value)
    finally:
        sys.argv = saved
    validated = arguments.slime_validate_args(args)
    if validated is not None:  # newer slime validates a copy and returns (args, restore_plan)
        args, _restore_plan = validated
    if with_sglang:
        sglang_arguments.validate_args(args)
    return args, unknown


def parse_args(add_custom_arguments=None):
    """slime's `parse_args(add_custom_arguments)` as `parse_known_args` runs it, on `sys.argv[1:]`;
    slime drops what its parser does not define."""
    return parse_known_args(sys.argv[1:], add_custom_arguments)[0]
