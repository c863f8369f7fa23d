"""What each benchmarked op computes: its cases' inputs, float64 truth and error check, one module per op.

`WORKLOADS` maps an op's name (a case's `op`) to its workload class; the harness measures whatever
workload it is handed and knows none of them.
"""

from .linear_token_stats import LinearWorkload
from .segment_sum import SegmentWorkload
from .token_stats import TokenWorkload

WORKLOADS = {"token_stats": TokenWorkload, "segment_sum": SegmentWorkload, "linear_token_stats": LinearWorkload}
