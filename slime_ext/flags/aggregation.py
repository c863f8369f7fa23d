"""The --loss-aggregation flags: registered on slime's parser, resolved and checked at startup.

The modes are defined in `slime_ext/aggregation.py` (train side). Resolving a mode may install a
slime hook: `constant` and `prompt_mean` with slime's own policy loss install the package's pg_loss
reducer, and `prompt_mean` puts the package's rollout wrapper (`rollout/prompt_groups.py`) in place
of --rollout-function-path. `token_mean` needs --calculate-per-token-loss, which the flag itself turns
on while slime's parser runs (Megatron validates it inside that parse, before any check here).
Another feature's flag may stand for a mode (--sfc-loss-agg-mode): it comes in as an `Implied`
choice, which the caller can only have by running that feature's checks first.
"""

import argparse
import math
from typing import NamedTuple, Optional

MODES = ("sample_mean", "prompt_mean", "token_mean", "constant")
SAMPLE_MODES = ("sample_mean", "prompt_mean")  # weigh samples (refuse slime's per-token path)
REDUCER_MODES = ("prompt_mean", "constant")  # through the package's pg_loss reducer on slime's policy_loss
REDUCER_PATH = "fusedrl.slime_ext.aggregation.get_pg_loss_reducer"
ROLLOUT_FUNCTION_PATH = "fusedrl.slime_ext.rollout.prompt_groups.generate_rollout"


class Implied(NamedTuple):
    """The mode (and divisor) another flag stands for, and that flag as the user gave it."""

    mode: str
    divisor: Optional[float]
    flag: str


class PerTokenSwitch(argparse.Action):
    """Stores the flag's value and, for the values in `per_token_values`, turns on
    --calculate-per-token-loss in the same parse: slime's parse_args runs Megatron's validate_args
    before any check of the package could set it."""

    def __init__(self, option_strings, dest, per_token_values=(), **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.per_token_values = tuple(per_token_values)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        if values in self.per_token_values:
            namespace.calculate_per_token_loss = True


def add_arguments(parser):
    """Register the aggregation flags on slime's parser."""
    parser.add_argument(
        "--loss-aggregation",
        choices=MODES,
        default=None,
        action=PerTokenSwitch,
        per_token_values=["token_mean"],
        help="How pg_loss is aggregated (ScaleRL): sample_mean (slime's default), prompt_mean "
        "(DAPO), token_mean (sets --calculate-per-token-loss) or constant (Dr.GRPO). Default: "
        "sample_mean, or token_mean when --calculate-per-token-loss is given.",
    )
    parser.add_argument(
        "--loss-aggregation-divisor",
        type=float,
        metavar="L",
        default=None,
        help="L for --loss-aggregation constant: each sample contributes sum(loss * mask) / L "
        "(e.g. the maximum response length). Finite and > 0; ignored by the other modes.",
    )
    parser.add_argument(
        "--loss-aggregation-strict-prompt-scale",
        action="store_true",
        help="prompt_mean only: multiply the weights by N / P (rollouts / prompt groups of the "
        "step) so the loss is the strict DAPO / ScaleRL (1 / P) sum over groups of the group "
        "token mean, instead of P / N times it. Ignored by the other modes.",
    )
    parser.add_argument(
        "--loss-aggregation-inner-rollout-function-path",
        default=None,
        metavar="PATH",
        help="prompt_mean only: the rollout function the package's rollout wrapper calls. "
        "Default: the --rollout-function-path given (the wrapper takes its place).",
    )
    return parser


def mode_of(args) -> str:
    """The resolved --loss-aggregation mode of slime's args."""
    mode = args.loss_aggregation
    if mode not in MODES:
        raise ValueError(f"--loss-aggregation must be one of {MODES}, got {mode!r}")
    return mode


def validate_args(args, implied: Optional[Implied]) -> None:
    """Resolve the mode and check its flags at startup; ValueError naming the flag otherwise.

    `implied` is what another feature's flag says the mode must be (None: nothing). Calling it
    again on the resulting args changes nothing.
    """
    if implied is not None:
        _apply(args, implied)
    per_token = bool(getattr(args, "calculate_per_token_loss", False))
    if args.loss_aggregation is None:
        args.loss_aggregation = "token_mean" if per_token else "sample_mean"
    mode = mode_of(args)
    if mode == "constant":
        _check_divisor(args.loss_aggregation_divisor)
        if per_token:
            raise ValueError(
                "--loss-aggregation constant divides each sample by --loss-aggregation-divisor and is "
                "incompatible with --calculate-per-token-loss (which divides by the token count)"
            )
    if mode in SAMPLE_MODES and per_token:
        raise ValueError(
            f"--loss-aggregation {mode} weighs samples, but --calculate-per-token-loss selects slime's "
            "per-token mean: use --loss-aggregation token_mean for that"
        )
    if mode == "token_mean" and not per_token:
        raise ValueError(
            "--loss-aggregation token_mean runs on slime's per-token path, but --calculate-per-token-loss is off: "
            "Megatron validates that flag inside slime's parse, so set it there (the flag does when parsed by "
            "slime's parser with the package's flags, as fusedrl.slime_ext.train parses)"
        )
    _check_pg_loss_path(args, mode)
    if mode == "prompt_mean":
        _check_groups_can_fit_steps(args)
        _install_rollout_wrapper(args)


def _apply(args, implied: Implied) -> None:
    """Set the mode (and divisor) `implied` stands for, refusing a different one given explicitly."""
    current = getattr(args, "loss_aggregation", None)
    if current is not None and current != implied.mode:
        raise ValueError(f"{implied.flag} means --loss-aggregation {implied.mode}, got --loss-aggregation {current}")
    given = getattr(args, "loss_aggregation_divisor", None)
    if implied.divisor is not None and given is not None and float(given) != implied.divisor:
        raise ValueError(f"{implied.flag} means --loss-aggregation-divisor {implied.divisor}, got {given}")
    args.loss_aggregation = implied.mode
    if implied.divisor is not None:
        args.loss_aggregation_divisor = implied.divisor


def _check_divisor(divisor) -> None:
    if divisor is None or not math.isfinite(float(divisor)) or float(divisor) <= 0.0:
        raise ValueError(
            f"--loss-aggregation-divisor must be finite and > 0 under --loss-aggregation constant, got {divisor!r}"
        )


def _check_pg_loss_path(args, mode: str) -> None:
    """Make sure the configured loss actually applies the mode.

    slime's own `policy_loss` applies prompt_mean and constant through the package's pg_loss
    reducer (--custom-pg-loss-reducer-function-path, installed here; the loss type stays
    `policy_loss`, so slime keeps reusing the training forward's log-probs); sample_mean is slime's
    own reducer and token_mean slime's per-token path, neither needing a hook."""
    reducer = getattr(args, "custom_pg_loss_reducer_function_path", None)
    loss_type = getattr(args, "loss_type", None)
    if reducer == REDUCER_PATH and mode == "sample_mean":
        raise ValueError(
            f"--custom-pg-loss-reducer-function-path {REDUCER_PATH} is not for --loss-aggregation sample_mean: "
            "slime's own reducer is sample_mean (leave the reducer path unset)"
        )
    if mode == "prompt_mean" and loss_type not in ("policy_loss", "custom_loss"):
        raise ValueError(
            "--loss-aggregation prompt_mean weighs pg_loss, which only slime's --loss-type policy_loss (through the "
            "package's pg_loss reducer) and the package's losses (--loss-type custom_loss) compute, got "
            f"--loss-type {loss_type}"
        )
    if mode in REDUCER_MODES and loss_type == "policy_loss":
        if reducer is None:
            args.custom_pg_loss_reducer_function_path = REDUCER_PATH
        elif reducer != REDUCER_PATH:
            raise ValueError(
                f"--loss-aggregation {mode} with --loss-type policy_loss needs --custom-pg-loss-reducer-"
                f"function-path {REDUCER_PATH}, got {reducer}"
            )


def _check_groups_can_fit_steps(args) -> None:
    """prompt_mean's denominators are summed per prompt group by the package's rollout wrapper, so
    slime must call it (no --load-debug-rollout-data), and slime's cut of the rollout into steps of
    --global-batch-size rollouts must be able to keep each group whole. With slime's rollout a group
    is --n-samples-per-prompt consecutive rollouts; the wrapper checks each rollout's actual groups
    (`rollout/prompt_groups.py`)."""
    if getattr(args, "load_debug_rollout_data", None) is not None:
        raise ValueError(
            "--loss-aggregation prompt_mean cannot run with --load-debug-rollout-data: slime then loads saved "
            "samples instead of calling the rollout function, so the package's rollout wrapper never computes "
            "the prompt-group denominators"
        )
    batch, group = getattr(args, "global_batch_size", None), args.n_samples_per_prompt
    if batch is not None and batch % group != 0:
        raise ValueError(
            f"--loss-aggregation prompt_mean needs every prompt group inside one training step, but --global-batch-size "
            f"{batch} is not a multiple of --n-samples-per-prompt {group} (--rollout-batch-size "
            f"{args.rollout_batch_size}, --num-steps-per-rollout {getattr(args, 'num_steps_per_rollout', None)}): "
            "slime cuts each rollout into steps of --global-batch-size rollouts in rollout order, so some group "
            "would be split between two steps"
        )


def _install_rollout_wrapper(args) -> None:
    inner = args.loss_aggregation_inner_rollout_function_path
    if args.rollout_function_path != ROLLOUT_FUNCTION_PATH:
        if inner is not None and inner != args.rollout_function_path:
            raise ValueError(
                f"--loss-aggregation-inner-rollout-function-path {inner} conflicts with --rollout-function-path "
                f"{args.rollout_function_path}: give the rollout function once"
            )
        args.loss_aggregation_inner_rollout_function_path = args.rollout_function_path
        args.rollout_function_path = ROLLOUT_FUNCTION_PATH
    elif inner is None:
        raise ValueError(
            f"--rollout-function-path {ROLLOUT_FUNCTION_PATH} needs --loss-aggregation-inner-rollout-"
            "function-path (the rollout function it wraps)"
        )
