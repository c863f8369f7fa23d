"""The package's losses for slime's `--loss-type custom_loss --custom-loss-function-path P`.

`fusedrl.slime_ext.losses.policy_loss`: slime's policy-gradient loss on the fused kernel, pg_loss
aggregated by --loss-aggregation (losses/policy.py).
`fusedrl.slime_ext.losses.sfc_loss`: score-function centering for stale rollouts (losses/sfc.py).
"""

from .policy import policy_loss
from .sfc import sfc_loss

__all__ = ["policy_loss", "sfc_loss"]
