"""Callables slime names or calls: loading its `--custom-*-path` hooks (a dotted path
`package.module.function`), checking that a replacement takes every argument slime passes, and
letting a replacement accept the optional keywords a newer slime adds."""

import functools
import importlib
import inspect
import logging
from typing import Callable

_logger = logging.getLogger(__name__)


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


def accept_newer_keywords(original: Callable, replacement: Callable, where: str, original_can_run: Callable[[], bool]):
    """`replacement`, taking also the parameters with defaults that slime's `original` has and it
    lacks (a newer slime's optional keyword), so a slime that grows one still installs.

    A call that passes such a keyword at its default runs the replacement without it. A call that
    passes anything else runs slime's `original` for that call (logged once per keyword), while
    `original_can_run()`; where it cannot (the fused LM head hands over hidden states, not logits)
    the call is refused naming the keyword. Parameters without a default, or ones that cannot be
    appended to the replacement's signature, are left for `check_signature` to refuse.
    """
    ours = inspect.signature(replacement)
    newer = [
        param
        for name, param in inspect.signature(original).parameters.items()
        if name not in ours.parameters
        and param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY)
        and param.default is not param.empty
    ]
    if not newer:
        return replacement
    kept = [param for param in ours.parameters.values() if param.kind != param.VAR_KEYWORD]
    variadic = [param for param in ours.parameters.values() if param.kind == param.VAR_KEYWORD]
    try:
        signature = ours.replace(parameters=kept + newer + variadic)
    except ValueError:  # e.g. a positional parameter after the replacement's keyword-only ones
        return replacement
    logged = set()

    @functools.wraps(replacement)
    def adapted(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        moved = [(param.name, bound.arguments[param.name]) for param in newer
                 if param.name in bound.arguments and not _is_default(bound.arguments[param.name], param.default)]  # fmt: skip
        if moved:
            name, value = moved[0]
            if not original_can_run():
                raise ValueError(
                    f"{where}: slime passed {name}={_short(value)}, a keyword the fused path does not serve, and "
                    "slime's own function cannot run on the hidden states that --fusedrl-fused-lm-head hands over: "
                    f"run without --fusedrl-fused-lm-head, or without the slime feature that sets {name}"
                )
            if name not in logged:
                logged.add(name)
                _logger.warning("fusedrl: %s: slime passed %s (not its default), so such calls run slime's own function", where, name)
            return original(*args, **kwargs)
        for param in newer:
            bound.arguments.pop(param.name, None)
        return replacement(*bound.args, **bound.kwargs)

    del adapted.__wrapped__  # its signature is the adapted one, not the replacement's
    adapted.__signature__ = signature
    return adapted


def _is_default(value, default) -> bool:
    """Whether a passed value is the parameter's default: the same object, or an equal plain value
    (never a tensor's elementwise comparison)."""
    if value is default:
        return True
    plain = (bool, int, float, str, bytes, type(None))
    return isinstance(value, plain) and type(value) is type(default) and value == default


def _short(value) -> str:
    """A value for a message: a tensor by shape and dtype, anything else by a repr cut to a line."""
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"<tensor of shape {tuple(value.shape)}, {value.dtype}>"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
