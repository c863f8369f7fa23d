"""The package's slime flags: every feature registers and checks its own, composed here once.

slime's parser drops flags it does not define, so the wrapper entry point (`slime_ext.train`)
hands `add_fusedrl_arguments` to `slime.utils.arguments.parse_args(add_custom_arguments=...)`
and runs `validate_fusedrl_args` on the parsed namespace before training starts.
"""

from . import aggregation
from .losses import sfc

# sfc first: --sfc-loss-agg-mode decides --loss-aggregation before aggregation fills its default.
FEATURES = (sfc, aggregation)


def add_fusedrl_arguments(parser):
    """Register every feature's flags on slime's parser; returns the parser (slime's convention)."""
    for feature in FEATURES:
        feature.add_arguments(parser)
    return parser


def validate_fusedrl_args(args) -> None:
    """Check every feature's flags against the parsed slime arguments; ValueError names the flag."""
    for feature in FEATURES:
        feature.validate_args(args)
