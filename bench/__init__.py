"""Benchmarks of the fused kernels against the eager path they replace and against peer kernels.

`python -m bench` (from the repository root) measures on the GPU when there is one (times, GB/s,
fraction of copy bandwidth, peak extra memory, speedups) and otherwise runs scaled-down cases
through the Triton interpreter (error against float64, bytes moved against the floor and against
the eager path, peak extra memory). See `python -m bench --help`.
"""
