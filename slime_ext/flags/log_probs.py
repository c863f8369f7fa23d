"""--fusedrl-keep-slime-log-probs: the package's aggregation flags on slime's own log-prob path.

By default the init hook puts slime's log-prob and entropy computation on the fused kernel, whose
values match slime's eager float32 computation to rounding, not bit for bit. With this switch the
init hook leaves that path alone, so a run through the package's entry point computes exactly what
plain slime computes, and `--loss-aggregation sample_mean` (the default, slime's own reducer)
gives a byte-identical pg_loss: the A/B baseline of an aggregation change. Refused with what needs
the fused kernel: the package's own losses (they call it themselves) and the fused LM head.
"""

from . import Switch
from .lm_head import CUSTOM_LOSS_PATHS, FLAG as LM_HEAD_FLAG, enabled as lm_head_enabled

FLAG = "--fusedrl-keep-slime-log-probs"
SWITCH = Switch(
    FLAG,
    help="Keep slime's own log-prob and entropy computation (the init hook does not put it on the fused "
    "kernel): with slime's policy_loss and the default --loss-aggregation sample_mean, pg_loss is "
    "byte-identical to plain slime's. Not with fusedrl's losses or --fusedrl-fused-lm-head.",
)
enabled = SWITCH.enabled  # whether slime's args ask to keep slime's own log-prob path
add_arguments = SWITCH.add_arguments  # register --fusedrl-keep-slime-log-probs on slime's parser


def validate_args(args) -> None:
    """Startup checks when the switch is on; ValueError naming the conflicting flag."""
    if not enabled(args):
        return
    if lm_head_enabled(args):
        raise ValueError(f"{FLAG} keeps slime's log-prob path, which {LM_HEAD_FLAG} replaces: give one of them")
    path = getattr(args, "custom_loss_function_path", None)
    if getattr(args, "loss_type", None) == "custom_loss" and path in CUSTOM_LOSS_PATHS:
        raise ValueError(
            f"{FLAG} keeps slime's log-prob path, but --custom-loss-function-path {path} computes its log-probs "
            "on the fused kernel itself: use slime's --loss-type policy_loss for the A/B"
        )
