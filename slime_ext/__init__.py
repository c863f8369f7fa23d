"""fusedrl's slime extensions.

`--custom-megatron-init-path fusedrl.slime_ext.install` patches slime's log-prob path onto the
fused kernel (see `patching`). Importing this package stays cheap: `install` and `uninstall` load
`patching` (and through it torch and the kernels) only when first looked up.
"""

_LAZY = {"install": "patching", "uninstall": "patching"}

__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        from importlib import import_module

        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
