"""Loading slime-style hooks: functions named by a dotted path `package.module.function`."""

import importlib


def load_function(path: str):
    """The function at `path`, imported as slime imports its `--custom-*-path` hooks."""
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)
