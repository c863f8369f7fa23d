"""The policy loss's flag (--pg-loss-type) and its startup checks of slime's flags.

A slime feature `fusedrl.slime_ext.losses.policy_loss` does not implement is refused here (a
custom pg_loss reducer: --loss-aggregation chooses it), never ignored; slime's off-policy
corrections (GSPO, OPSM, TIS and a custom TIS function, the mismatch metrics) run in the loss
(`slime_ext/corrections.py`), their settings checked here. Every flag read here is slime's
(slime/utils/arguments.py) or registered below.

Newer slime defines --pg-loss-type itself (choices ppo, reinforce; default None, slime's default
objective); the package then registers nothing and reads slime's flag, which slime's own policy
loss reads too. Where slime does not define it (slime 624b824) the package registers the same
definition, read by its policy loss alone.
"""

import math

from .. import slime_options
from . import custom_loss_is

LOSS_PATHS = ("fusedrl.slime_ext.losses.policy_loss", "fusedrl.slime_ext.losses.policy.policy_loss")
KL_TYPES = ("k1", "k2", "k3", "low_var_kl")
FLAG = "--pg-loss-type"
PACKAGE_LOSSES = "fusedrl.slime_ext.losses."
PG_LOSS_TYPES = ("ppo", "reinforce")


def uses_policy_loss(args) -> bool:
    """Whether slime's configured loss is the package's policy loss (either of its paths)."""
    return custom_loss_is(args, LOSS_PATHS)


def add_arguments(parser):
    """Register --pg-loss-type on slime's parser, unless the installed slime defines it."""
    if slime_options.defines(FLAG):
        return parser
    parser.add_argument(
        FLAG,
        choices=PG_LOSS_TYPES,
        default=None,
        help="Objective of fusedrl.slime_ext.losses.policy_loss: unset or ppo, slime's (PPO clip, or CISPO "
        "under --advantage-estimator cispo), or reinforce (ratio-free -A log pi). Only with that loss.",
    )
    return parser


def pg_loss_type(args) -> str:
    """The objective: reinforce (--pg-loss-type reinforce), cispo (advantage estimator cispo) or ppo."""
    if getattr(args, "pg_loss_type", None) == "reinforce":
        if args.advantage_estimator in ("gspo", "cispo"):
            raise ValueError(
                f"--pg-loss-type reinforce cannot combine with --advantage-estimator {args.advantage_estimator}"
            )
        return "reinforce"
    return "cispo" if args.advantage_estimator == "cispo" else "ppo"


def validate_args(args) -> None:
    """Startup checks of the policy loss's configuration; ValueError naming the flag."""
    if not uses_policy_loss(args):
        _reject_unread_pg_loss_type(args)
        return
    pg_loss_type(args)
    _check_corrections(args)
    if getattr(args, "custom_pg_loss_reducer_function_path", None) is not None:
        raise ValueError(
            f"--custom-pg-loss-reducer-function-path is not used by {LOSS_PATHS[0]}; choose --loss-aggregation instead"
        )
    if args.eps_clip_c is not None and not args.eps_clip_c > 1.0:
        raise ValueError(f"--eps-clip-c (dual-clip lower bound) must be > 1.0, got {args.eps_clip_c}")
    if args.use_kl_loss and args.kl_loss_type not in KL_TYPES:
        raise ValueError(f"--kl-loss-type must be one of {KL_TYPES}, got {args.kl_loss_type!r}")


def _check_corrections(args) -> None:
    """The off-policy corrections' settings: a TIS band (--tis-clip-low <= --tis-clip) when the
    TIS step runs, a finite --opsm-delta under --use-opsm."""
    if getattr(args, "use_tis", False) or getattr(args, "get_mismatch_metrics", False):
        low, high = float(args.tis_clip_low), float(args.tis_clip)
        if math.isnan(low) or math.isnan(high) or low > high:
            raise ValueError(f"--tis-clip-low ({args.tis_clip_low}) must be <= --tis-clip ({args.tis_clip}), neither NaN")
    if getattr(args, "use_opsm", False) and not math.isfinite(float(args.opsm_delta)):
        raise ValueError(f"--opsm-delta must be finite, got {args.opsm_delta}")


def _reject_unread_pg_loss_type(args) -> None:
    """--pg-loss-type reinforce where no loss reads it: any loss but the package's policy loss
    when the package registered the flag; the package's other losses (SFC) when slime defines it,
    since slime's own losses, and a user's custom loss, may then read slime's flag."""
    if getattr(args, "pg_loss_type", None) != "reinforce":
        return
    path = getattr(args, "custom_loss_function_path", None) if getattr(args, "loss_type", None) == "custom_loss" else None
    if slime_options.defines(FLAG) and not str(path).startswith(PACKAGE_LOSSES):
        return
    raise ValueError(
        f"--pg-loss-type reinforce is set but the loss is not {LOSS_PATHS[0]} "
        "(--loss-type custom_loss --custom-loss-function-path ...), the package's only loss that reads it"
    )
