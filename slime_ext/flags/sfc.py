"""The --sfc-* flags: registered on slime's parser and checked at startup.

When the SFC loss is configured, the checks install SFC's rollout side as slime's
--custom-generate-function-path (moving a user's generate function behind it) and its refusal
counts as slime's --custom-rollout-log-function-path (moving a user's log function behind it),
refuse the modes whose tokens can have no age (a replayed rollout: its weight versions are
another job's), and return the --loss-aggregation mode --sfc-loss-agg-mode stands for, for the
aggregation checks to apply.
"""

import math
from typing import Optional

from ..rollout.refusals import LOG_PATH, USER_LOG_ATTR
from . import check_rollout_temperature, custom_loss_is
from .aggregation import Implied, PerTokenSwitch

LOSS_PATHS = ("fusedrl.slime_ext.losses.sfc_loss", "fusedrl.slime_ext.losses.sfc.sfc_loss")
GENERATE_PATH = "fusedrl.slime_ext.rollout.sfc_draws.generate"
# --sfc-loss-agg-mode -> (--loss-aggregation, --loss-aggregation-divisor)
AGG_MODES = {"sample-mean": ("sample_mean", None), "token-mean": ("token_mean", None), "token-sum": ("constant", 1.0)}
FLAGS = (
    "sfc_num_auxiliary_token_samples", "sfc_kl_beta", "sfc_loss_agg_mode", "sfc_inner_generate_function_path",
    "sfc_max_refused_frac", "sfc_m2_tau",
)  # fmt: skip
# slime's flags that train on a rollout dumped by another job (its tokens' weight versions are that job's)
REPLAY_FLAGS = {
    "--load-debug-rollout-data": "load_debug_rollout_data",
    "--load-forge-rollout-data": "load_forge_rollout_data",
}


def uses_sfc(args) -> bool:
    """Whether slime's configured loss is the SFC loss."""
    return custom_loss_is(args, LOSS_PATHS)


def add_arguments(parser):
    """Register the --sfc-* flags on slime's parser."""
    parser.add_argument(
        "--sfc-num-auxiliary-token-samples",
        type=int,
        metavar="K",
        default=None,
        help="K: auxiliary draws per generated token requested from the SGLang plugin for SFC (>= 1). "
        "Required with the SFC loss.",
    )
    parser.add_argument(
        "--sfc-kl-beta",
        type=float,
        metavar="BETA0",
        default=None,
        help="beta0 of SFC's KL pull toward the sampler: a token of age a (optimizer steps since its "
        "weights were pushed) gets beta0 / sqrt(a), fresh tokens 0. Required with the SFC loss.",
    )
    parser.add_argument(
        "--sfc-loss-agg-mode",
        choices=sorted(AGG_MODES),
        default=None,
        action=PerTokenSwitch,
        per_token_values=[flag for flag, (mode, _) in AGG_MODES.items() if mode == "token_mean"],
        help="Aggregation of SFC's per-token loss: sample-mean (--loss-aggregation sample_mean), "
        "token-mean (token_mean, sets --calculate-per-token-loss) or token-sum (constant with divisor 1). "
        "Default: --loss-aggregation.",
    )
    parser.add_argument(
        "--sfc-inner-generate-function-path",
        default=None,
        metavar="PATH",
        help="The generate function SFC's rollout wrapper calls (default: slime's "
        "slime.rollout.sglang_rollout.generate; a --custom-generate-function-path given is moved here).",
    )
    parser.add_argument(
        "--sfc-max-refused-frac",
        type=float,
        metavar="FRAC",
        default=None,
        help="The largest fraction of a rollout's training samples SFC's rollout side may refuse (an engine no "
        "push has reached, a malformed answer) before the job stops with the causes; every refusal is logged as "
        "sfc/refused_* rollout metrics. Default 0: any refusal stops the job.",
    )
    parser.add_argument(
        "--sfc-m2-tau",
        type=float,
        metavar="TAU",
        default=None,
        help="M2PO's second-moment trust region on the SFC loss: the centered-score term of the micro-batch's "
        "tokens with the largest (log pi - log pi_rollout)^2, among those a PPO clip would act on, masked until "
        "their mean is <= TAU (the KL term stays on every token). Finite and > 0. Default: off.",
    )
    return parser


def validate_args(args) -> Optional[Implied]:
    """Check the SFC configuration at startup (ValueError naming the flag), install the rollout
    wrapper, and return the aggregation --sfc-loss-agg-mode stands for (None when not given or
    when the loss is not SFC). Calling it again changes nothing."""
    if not uses_sfc(args):
        _reject_unused_flags(args)
        return None
    num_draws = args.sfc_num_auxiliary_token_samples
    if num_draws is None or isinstance(num_draws, bool) or int(num_draws) != num_draws or num_draws < 1:
        raise ValueError(f"--sfc-num-auxiliary-token-samples must be an integer >= 1 with the SFC loss, got {num_draws!r}")
    beta = args.sfc_kl_beta
    if beta is None or not math.isfinite(float(beta)) or float(beta) < 0:
        raise ValueError(f"--sfc-kl-beta must be finite and >= 0 with the SFC loss, got {beta!r}")
    refused = args.sfc_max_refused_frac
    if refused is not None and not 0 <= float(refused) < 1:
        raise ValueError(f"--sfc-max-refused-frac must be in [0, 1), got {refused!r}")
    tau = args.sfc_m2_tau
    if tau is not None and not (math.isfinite(float(tau)) and float(tau) > 0):
        raise ValueError(f"--sfc-m2-tau must be finite and > 0, got {tau!r}")
    _check_untruncated_sampling(args)
    _reject_ratio_corrections(args)
    _reject_replayed_rollouts(args)
    _install_generate_wrapper(args)
    _install_rollout_log(args)
    mode = args.sfc_loss_agg_mode
    return None if mode is None else Implied(*AGG_MODES[mode], flag=f"--sfc-loss-agg-mode {mode}")


def _reject_unused_flags(args) -> None:
    for flag in FLAGS:
        if getattr(args, flag, None) is not None:
            raise ValueError(
                f"--{flag.replace('_', '-')} is set but the loss is not SFC (--loss-type custom_loss "
                f"--custom-loss-function-path {LOSS_PATHS[0]})"
            )


def _reject_ratio_corrections(args) -> None:
    """slime's importance-ratio corrections: the SFC loss has no ratio, so it would not apply them."""
    flags = {"--use-tis": "use_tis", "--get-mismatch-metrics": "get_mismatch_metrics", "--use-opsm": "use_opsm"}
    given = [flag for flag, dest in flags.items() if getattr(args, dest, False)]
    given += ["--advantage-estimator gspo"] if getattr(args, "advantage_estimator", None) == "gspo" else []
    if given:
        raise ValueError(
            f"{given[0]} corrects an importance ratio, which the SFC loss ({LOSS_PATHS[0]}) does not have: "
            "it would not apply it; use the policy loss for slime's off-policy corrections"
        )


def _reject_replayed_rollouts(args) -> None:
    """A rollout replayed from a dump, or none generated at all: no token age this job can measure."""
    for flag, dest in REPLAY_FLAGS.items():
        if getattr(args, dest, None):
            raise ValueError(
                f"{flag} {getattr(args, dest)} replays a dumped rollout: its tokens carry the weight versions of "
                "the job that dumped it, which this job's pushes number anew (1, 2, ...), so SFC's ages would be "
                "measured from the wrong push; the SFC loss trains on rollouts this job generates"
            )
    if getattr(args, "debug_train_only", False):
        raise ValueError(
            "--debug-train-only pushes no weights and generates no rollout, so SFC's tokens can have no age; "
            "the SFC loss trains on rollouts this job generates"
        )


def _check_untruncated_sampling(args) -> None:
    """The draws and the sampled token must come from the distribution the loss centers on."""
    expected = (
        ("rollout_top_p", 1.0, "sampling must be untruncated"),
        ("rollout_top_k", -1, "sampling must be untruncated"),
        ("entropy_coef", 0.0, "SFC has no entropy term"),
    )
    for name, value, why in expected:
        got = getattr(args, name, value)
        if got != value:
            raise ValueError(f"--{name.replace('_', '-')} must be {value} with the SFC loss ({why}), got {got!r}")
    check_rollout_temperature(args, "with the SFC loss")


def _install_generate_wrapper(args) -> None:
    current = getattr(args, "custom_generate_function_path", None)
    if current is not None and current != GENERATE_PATH:
        inner = args.sfc_inner_generate_function_path
        if inner is not None and inner != current:
            raise ValueError(
                f"--sfc-inner-generate-function-path {inner} conflicts with --custom-generate-function-path "
                f"{current}: give the generate function once"
            )
        args.sfc_inner_generate_function_path = current
    args.custom_generate_function_path = GENERATE_PATH


def _install_rollout_log(args) -> None:
    """The refusal counts through slime's rollout log function, a user's own one run after them."""
    current = getattr(args, "custom_rollout_log_function_path", None)
    if current is not None and current != LOG_PATH:
        setattr(args, USER_LOG_ATTR, current)
    args.custom_rollout_log_function_path = LOG_PATH
