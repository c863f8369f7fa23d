"""Every flag of the package: registered on slime's parser and validated, in one place.

slime's parser drops flags it does not define, so the wrapper entry point (`slime_ext.train`)
hands `add_fusedrl_arguments` to `slime.utils.arguments.parse_args(add_custom_arguments=...)`
and runs `validate_fusedrl_args` on the parsed namespace before training starts. Each feature's
flags and checks live in `flags/`; the order they run in is carried by the data they pass on:
the aggregation checks take, as an argument, the mode the SFC checks say --sfc-loss-agg-mode
stands for. The policy-loss checks read slime's own flags only; so do the fused LM head's, besides
its own flag.
"""

from .flags import aggregation, lm_head, policy, sfc


def add_fusedrl_arguments(parser):
    """Register every feature's flags on slime's parser; returns the parser (slime's convention)."""
    for feature in (aggregation, sfc, lm_head):
        feature.add_arguments(parser)
    return parser


def validate_fusedrl_args(args) -> None:
    """Check every feature's flags against the parsed slime arguments; ValueError names the flag.

    Resolves what the flags imply (the aggregation mode, --calculate-per-token-loss, the rollout
    and reducer hooks to install); calling it again on the result changes nothing.
    """
    aggregation.validate_args(args, implied=sfc.validate_args(args))
    policy.validate_args(args)
    lm_head.validate_args(args)
