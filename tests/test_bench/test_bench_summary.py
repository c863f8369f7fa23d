"""The run's closing lines and column legend (`bench/summary.py`), on records built by hand."""

from bench_package import import_bench

import_bench()
from bench.cases import Case, SegmentCase  # noqa: E402
from bench.summary import CPU_LEGEND, GPU_LEGEND, SUBJECT_LEGEND, conclusions, legend  # noqa: E402
from bench.workloads.linear_token_stats import LinearCase  # noqa: E402


def _record(case, phase, subject, error, bytes_moved=None, time_ms=None):
    return dict(case=case, phase=phase, subject=subject, error=error, bytes_moved=bytes_moved,
                floor_bytes=1000, peak_extra_bytes=0, input_bytes=1000, time_ms=time_ms, copy_gbps=4.0)  # fmt: skip


def test_cpu_conclusion_per_op_reads_forward_plus_backward_medians_and_worst_errors():
    small, large = Case(32, 1000, "fp32", 1, False), Case(128, 1000, "fp32", 1, False)
    records = [
        _record(small, "fwd", "fused", 9e-3, bytes_moved=9000),  # another phase: not read
        _record(small, "fwd+bwd", "fused", 1e-7, bytes_moved=1000),
        _record(large, "fwd+bwd", "fused", 3e-7, bytes_moved=1200),
        _record(small, "fwd+bwd", "eager", 2e-7, bytes_moved=2000),
        _record(large, "fwd+bwd", "eager", 1e-7, bytes_moved=3000),
        _record(SegmentCase(4096), "fwd", "fused", 0.0, bytes_moved=1000),
    ]
    token_line, segment_line = conclusions(records, gpu=False)
    assert token_line == ("token_stats fwd+bwd, 2 cases: fused moves 1.10x the floor, eager moves 2.50x the floor "
                          "(median); worst error fused 3e-07, eager 2e-07")  # fmt: skip
    assert segment_line.startswith("segment_sum fwd, 1 case: fused moves 1.00x the floor (median)")


def test_gpu_conclusion_names_copy_share_and_each_peers_time_ratio():
    case = Case(4096, 151936, "bf16", 1, False)
    records = [
        _record(case, "fwd+bwd", "fused", 1e-3, time_ms=0.0005),  # 1000 B in 0.5 us = 2 GB/s: 50% of a 4 GB/s copy
        _record(case, "fwd+bwd", "eager", 1e-3, time_ms=0.0015),
        _record(case, "fwd+bwd", "liger", 2e-3, time_ms=0.0010),
    ]
    (line,) = conclusions(records, gpu=True)
    assert line == ("token_stats fwd+bwd, 1 case: fused runs at 50% of copy bandwidth (median); eager takes 3.00x "
                    "its time; liger takes 2.00x its time; worst error fused 1e-03, eager 1e-03, liger 2e-03")  # fmt: skip


def test_lm_head_conclusion_counts_gemms_in_logits_sized_units():
    case = LinearCase(32, 1000, "fp32", 1, False, hidden=16)
    one_gemm = 2 * 32 * 1000 * 16
    records = [dict(_record(case, "fwd+bwd", name, 1e-7, bytes_moved=1000), gemm_flops=gemms * one_gemm)
               for name, gemms in (("fused", 4), ("eager", 3), ("one_pass", 3))]  # fmt: skip
    (line,) = conclusions(records, gpu=False)
    assert line.endswith("; GEMMs of the logits' size: fused 4.00, eager 3.00, one_pass 3.00")


def test_legend_has_a_line_per_column_family():
    assert legend(gpu=False).splitlines() == [f"  {line}" for line in CPU_LEGEND]
    assert legend(gpu=True).splitlines() == [f"  {line}" for line in GPU_LEGEND]
    assert legend(gpu=False, subject_table=True).splitlines()[-1] == f"  {SUBJECT_LEGEND[0]}"
