"""Each feature's slime flags and startup checks, one module per feature; `slime_ext.arguments`
registers and validates them all, in the order their dependencies require."""


def custom_loss_is(args, loss_paths) -> bool:
    """Whether slime's configured loss is a custom loss at one of these dotted paths."""
    return getattr(args, "loss_type", None) == "custom_loss" and getattr(args, "custom_loss_function_path", None) in loss_paths
