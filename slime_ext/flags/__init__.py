"""Each feature's slime flags and startup checks, one module per feature; `slime_ext.arguments`
registers and validates them all, in the order their dependencies require."""

from typing import NamedTuple

# `fusedrl.kernels.TEMPERATURE_RANGE`, the temperatures the fused kernels answer, restated so that
# the flags load without the kernels (tests/test_slime/test_slime_layering.py); a test keeps the two
# equal (tests/test_slime/test_slime_features_args.py).
TEMPERATURE_RANGE = (1e-6, 1e6)


def check_rollout_temperature(args, where: str) -> None:
    """slime's --rollout-temperature reaches the fused kernels, which answer the temperatures in
    `fusedrl.kernels.TEMPERATURE_RANGE`: refused at startup, naming the flag, not at every step."""
    temperature = getattr(args, "rollout_temperature", 1.0)
    low, high = TEMPERATURE_RANGE
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not low <= temperature <= high:
        raise ValueError(
            f"--rollout-temperature must lie in [{low:g}, {high:g}] {where} (the temperatures the fused "
            f"kernels answer), got {temperature!r}"
        )


def custom_loss_is(args, loss_paths) -> bool:
    """Whether slime's configured loss is a custom loss at one of these dotted paths."""
    return getattr(args, "loss_type", None) == "custom_loss" and getattr(args, "custom_loss_function_path", None) in loss_paths


class Switch(NamedTuple):
    """An on/off flag of the package (`store_true`): its option string and help."""

    flag: str
    help: str

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    def enabled(self, args) -> bool:
        """Whether slime's args have the switch on (absent: off)."""
        return bool(getattr(args, self.dest, False))

    def add_arguments(self, parser):
        """Register the switch on slime's parser; returns the parser (slime's convention)."""
        parser.add_argument(self.flag, action="store_true", help=self.help)
        return parser
