"""Startup checks of slime's flags for the package's policy loss (it registers no flags of its own).

slime features `fusedrl.slime_ext.losses.policy_loss` does not implement are refused here (GSPO,
OPSM, TIS / mismatch metrics, score centering, a custom pg_loss reducer), never ignored.
"""

LOSS_PATH = "fusedrl.slime_ext.losses.policy_loss"
KL_TYPES = ("k1", "k2", "k3", "low_var_kl")
UNSUPPORTED_FLAGS = ("use_opsm", "use_tis", "get_mismatch_metrics", "use_score_centering")


def pg_loss_type(args) -> str:
    """slime's choice of objective: reinforce (--pg-loss-type reinforce), cispo (advantage
    estimator cispo) or ppo."""
    if getattr(args, "pg_loss_type", None) == "reinforce":
        if args.advantage_estimator in ("gspo", "cispo"):
            raise ValueError(
                f"--pg-loss-type reinforce cannot combine with --advantage-estimator {args.advantage_estimator}"
            )
        return "reinforce"
    return "cispo" if args.advantage_estimator == "cispo" else "ppo"


def validate_args(args) -> None:
    """Startup checks when this loss is configured; ValueError naming the flag."""
    if getattr(args, "loss_type", None) != "custom_loss" or getattr(args, "custom_loss_function_path", None) != LOSS_PATH:
        return
    pg_loss_type(args)
    if args.advantage_estimator == "gspo":
        raise ValueError(f"--advantage-estimator gspo (sequence-level ratio) is not implemented by {LOSS_PATH}")
    for flag in UNSUPPORTED_FLAGS:
        if getattr(args, flag, False):
            raise ValueError(f"--{flag.replace('_', '-')} is not implemented by {LOSS_PATH}")
    if getattr(args, "custom_pg_loss_reducer_function_path", None) is not None:
        raise ValueError(
            f"--custom-pg-loss-reducer-function-path is not used by {LOSS_PATH}; choose --loss-aggregation instead"
        )
    if args.eps_clip_c is not None and not args.eps_clip_c > 1.0:
        raise ValueError(f"--eps-clip-c (dual-clip lower bound) must be > 1.0, got {args.eps_clip_c}")
    if args.use_kl_loss and args.kl_loss_type not in KL_TYPES:
        raise ValueError(f"--kl-loss-type must be one of {KL_TYPES}, got {args.kl_loss_type!r}")
