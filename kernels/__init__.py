"""Fused Triton kernels for the per-token statistics of policy-gradient losses."""

from ._contract import TokenStats
from .reference import token_logprobs_reference, token_stats_reference
from .token_stats import token_logprobs, token_stats

__all__ = [
    "TokenStats",
    "token_stats",
    "token_logprobs",
    "token_stats_reference",
    "token_logprobs_reference",
]
