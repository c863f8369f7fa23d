"""The option strings the installed slime's own parser defines, found by building it dry.

slime's `parse_args(add_custom_arguments=...)` registers the custom arguments first ("in front")
and its own argument groups after them, so while the package registers its flags nothing of
slime's is on the parser yet, and a flag both define would stop every parse with argparse's
"conflicting option string". The package asks the installed slime instead: its
`slime.utils.arguments.get_slime_extra_args_provider()` (no custom arguments) run on a scratch
parser gives every option slime's groups add, whatever slime's commit. A slime without that
provider, or not importable here, defines nothing the package can see (an empty set).
"""

import argparse
import functools
import importlib

ARGUMENTS_MODULE = "slime.utils.arguments"


def defined_options() -> frozenset:
    """Every option string slime's own argument groups register (empty: no slime to ask)."""
    provider = getattr(_arguments_module(), "get_slime_extra_args_provider", None)
    return frozenset() if provider is None else _dry_build(provider)


def defines(option: str) -> bool:
    """Whether the installed slime registers `option` (e.g. "--pg-loss-type") itself."""
    return option in defined_options()


def _arguments_module():
    try:
        return importlib.import_module(ARGUMENTS_MODULE)
    except ImportError:  # no slime here, or a `slime` module without slime's parser
        return None


@functools.lru_cache(maxsize=8)
def _dry_build(provider) -> frozenset:
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    provider()(parser)
    return frozenset(option for action in parser._actions for option in action.option_strings)
