"""Fused Triton kernels for policy-gradient losses: per-token statistics and segmented sums."""

from ._contract import TokenStats
from .reference import segment_sum_reference, token_logprobs_reference, token_stats_reference
from .linear_token_stats import linear_token_stats
from .segment_sum import segment_sum
from .token_stats import token_logprobs, token_stats

__all__ = [
    "linear_token_stats",
    "segment_sum",
    "segment_sum_reference",
    "TokenStats",
    "token_stats",
    "token_logprobs",
    "token_stats_reference",
    "token_logprobs_reference",
]
