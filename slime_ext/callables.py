"""Callables slime names or calls: loading its `--custom-*-path` hooks (a dotted path
`package.module.function`), and checking that a replacement takes every argument slime passes."""

import importlib
import inspect
from typing import Callable


def load_function(path: str):
    """The function at `path`, imported as slime imports its `--custom-*-path` hooks."""
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def check_signature(original: Callable, replacement: Callable, where: str) -> None:
    """Every parameter the original accepts must be accepted by the replacement under the same name
    and kind, otherwise slime's calls could bind differently (a slime version this package does not
    know)."""
    ours = inspect.signature(replacement).parameters
    for name, param in inspect.signature(original).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if name not in ours or ours[name].kind != param.kind:
            raise ValueError(
                f"{where}: slime's signature {inspect.signature(original)} has parameter {name!r} that the "
                f"replacement {inspect.signature(replacement)} does not take the same way"
            )
