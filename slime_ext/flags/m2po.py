"""--fusedrl-m2po-tau: M2PO's second-moment trust region on the package's policy loss, registered
on slime's parser and checked at startup (the loss: `slime_ext/m2po.py`, docs/slime.md).

M2PO replaces the policy loss's pg_loss by -M * pi_theta / pi_behav * A, the ratio to the policy
that sampled the token (the rollout log-probs) and no clip, M the trust region's mask. What would
change that objective without a word is refused here, naming the flag:

- slime's TIS step (--use-tis, --custom-tis-function-path, --get-mismatch-metrics, under which
  slime applies it too): it multiplies pg_loss by a second ratio to the same sampler, so the
  objective would weigh the sampler mismatch twice;
- --use-opsm: a second, sequence-level trust region that drops tokens by the old policy's ratio,
  on top of the one M2PO selects;
- --advantage-estimator gspo (a sequence-level ratio in place of the token's) and cispo (a
  stop-gradient weight on log pi): objectives of their own, which M2PO's pg_loss would replace;
- --pg-loss-type reinforce: ratio-free, which M2PO's pg_loss would replace;
- --eps-clip-c: dual clip bounds the PPO clip's loss, and M2PO has no clip to bound.

--fusedrl-m2-tis-tau is the threshold of AReaL's variant (`slime_ext/m2_tis.py`), a TIS function
for slime's own policy loss and the package's, read by that function alone: refused without it as
--custom-tis-function-path, or without --use-tis / --get-mismatch-metrics (slime calls no TIS
function then), and the function refused without the flag.

slime does not define the flags; were a slime to define them, `arguments.add_fusedrl_arguments`
would refuse them by name rather than register them twice (the package cannot know slime's meaning).
"""

import math

from .policy import LOSS_PATHS, pg_loss_type, uses_policy_loss

FLAG = "--fusedrl-m2po-tau"
TIS_FLAG = "--fusedrl-m2-tis-tau"
TIS_FUNCTION_PATH = "fusedrl.slime_ext.m2_tis.m2_trust_region_tis"


def add_arguments(parser):
    """Register --fusedrl-m2po-tau on slime's parser; returns the parser (slime's convention)."""
    parser.add_argument(
        FLAG,
        type=float,
        metavar="TAU",
        default=None,
        help="M2PO (arXiv 2510.01161) on fusedrl.slime_ext.losses.policy_loss: pg_loss = -M * pi/pi_rollout * A "
        "without clip, M masking the micro-batch's tokens with the largest (log pi - log pi_rollout)^2 among "
        "those a PPO clip would act on until their mean is <= TAU (the paper uses 0.04). Finite and > 0. "
        "Default: off.",
    )
    parser.add_argument(
        TIS_FLAG,
        type=float,
        metavar="TAU",
        default=None,
        help=f"AReaL's M2 trust region as slime's TIS function (--use-tis --custom-tis-function-path {TIS_FUNCTION_PATH}): "
        "the micro-batch's loss-masked tokens with the largest (log pi_old - log pi_rollout)^2 masked until their "
        "mean is <= TAU, the rest weighted by slime's clamped TIS ratio. Finite and > 0. Default: off.",
    )
    return parser


def tis_tau(args):
    """AReaL's variant's threshold (None: not given)."""
    return getattr(args, "fusedrl_m2_tis_tau", None)


def tau(args):
    """The trust region's threshold (None: M2PO off)."""
    return getattr(args, "fusedrl_m2po_tau", None)


def enabled(args):
    """The flag, when M2PO is on (the recompute path's reason under the fused LM head), else None."""
    return FLAG if tau(args) is not None else None


def _validate_tis_variant(args) -> None:
    """AReaL's variant: its threshold and its TIS function go together, and slime must call it."""
    value, path = tis_tau(args), getattr(args, "custom_tis_function_path", None)
    if value is None:
        if path == TIS_FUNCTION_PATH:
            raise ValueError(f"--custom-tis-function-path {path} needs {TIS_FLAG} (its tau)")
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{TIS_FLAG} must be finite and > 0, got {value!r}")
    if path != TIS_FUNCTION_PATH:
        raise ValueError(f"{TIS_FLAG} {value} is read only by --custom-tis-function-path {TIS_FUNCTION_PATH}, got {path!r}")
    if not (getattr(args, "use_tis", False) or getattr(args, "get_mismatch_metrics", False)):
        raise ValueError(f"{TIS_FLAG} {value} needs --use-tis: slime calls its TIS function only under it (or --get-mismatch-metrics)")


def validate_args(args) -> None:
    """Startup checks when the flags are given; ValueError naming them and the conflicting flag."""
    _validate_tis_variant(args)
    value = tau(args)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{FLAG} must be finite and > 0, got {value!r}")
    if not uses_policy_loss(args):
        raise ValueError(
            f"{FLAG} {value} is set but the loss is not {LOSS_PATHS[0]} (--loss-type custom_loss "
            "--custom-loss-function-path ...), the only loss that reads it"
        )
    conflict = _conflict(args)
    if conflict is not None:
        given, why = conflict
        raise ValueError(f"{FLAG} {value} cannot run with {given}: {why}")


def _conflict(args):
    """(the conflicting flag as given, why) for the first setting M2PO's objective would change."""
    ratio = "M2PO's pg_loss already carries the ratio to the sampler (rollout log-probs)"
    switches = (
        ("use_tis", "--use-tis", f"slime's TIS step would weigh pg_loss by a second ratio to the sampler; {ratio}"),
        ("get_mismatch_metrics", "--get-mismatch-metrics",
         f"slime applies its TIS step under it too, weighing pg_loss by a second ratio to the sampler; {ratio}"),
        ("use_opsm", "--use-opsm", "OPSM's sequence-level masking would act on top of the M2 trust region"),
    )  # fmt: skip
    for dest, flag, why in switches:
        if getattr(args, dest, False):
            return flag, why
    path = getattr(args, "custom_tis_function_path", None)
    if path is not None:
        return f"--custom-tis-function-path {path}", f"a TIS function reweights the ratio M2PO's pg_loss carries; {ratio}"
    estimator = getattr(args, "advantage_estimator", None)
    if estimator in ("gspo", "cispo"):
        objective = "a sequence-level ratio" if estimator == "gspo" else "a clipped stop-gradient weight on log pi"
        return f"--advantage-estimator {estimator}", f"its objective ({objective}) would be replaced by M2PO's token ratio"
    if pg_loss_type(args) == "reinforce":
        return "--pg-loss-type reinforce", "the ratio-free objective would be replaced by M2PO's ratio objective"
    if getattr(args, "eps_clip_c", None) is not None:
        return f"--eps-clip-c {args.eps_clip_c}", "dual clip bounds the PPO clip's loss, and M2PO's objective has no clip"
    return None
