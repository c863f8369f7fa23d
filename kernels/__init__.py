"""Fused Triton kernels for policy-gradient losses (per-token statistics, segmented sums) and the
rollout side's K draws per row."""

import importlib
import sys


def _installed_package():
    """`fusedrl.kernels` when this folder is being imported under another name, else None.

    A checkout's root on sys.path (`python -m ...` run there) makes this folder importable as a
    top-level `kernels` too, a name transformers probes for. A second copy would register the
    `fusedrl::` torch ops again, and torch frees an op's first registration when it is registered
    twice: every later call through the first copy reads freed memory. So a second name gets the
    installed package itself (submodules included), and the ops are registered once per process.
    """
    if __name__ == "fusedrl.kernels":
        return None
    try:
        return importlib.import_module("fusedrl.kernels")
    except ImportError:  # not installed: this copy is the only one
        return None


_INSTALLED = _installed_package()
if _INSTALLED is not None:
    for _name, _module in list(sys.modules.items()):
        if _name == "fusedrl.kernels" or _name.startswith("fusedrl.kernels."):
            sys.modules[__name__ + _name[len("fusedrl.kernels") :]] = _module
else:
    from ._contract import TEMPERATURE_RANGE, TokenStats
    from .linear_token_loss import LinearTokenLoss, linear_token_loss
    from .linear_token_stats import linear_token_stats
    from .reference import (
        segment_sum_reference,
        token_draws_reference,
        token_logprobs_reference,
        token_stats_reference,
    )
    from .segment_sum import segment_sum
    from .token_draws import token_draws
    from .token_stats import token_logprobs, token_stats

__all__ = [
    "LinearTokenLoss",
    "TEMPERATURE_RANGE",
    "linear_token_loss",
    "linear_token_stats",
    "segment_sum",
    "segment_sum_reference",
    "TokenStats",
    "token_draws",
    "token_draws_reference",
    "token_stats",
    "token_logprobs",
    "token_stats_reference",
    "token_logprobs_reference",
]
