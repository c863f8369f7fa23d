"""The benchmark's own instruments and its CPU run.

The byte counter is checked on hand-written kernels and operators whose traffic is known exactly;
the allocation tally on allocations of known size; the CPU run end to end through `python -m bench`
on small shapes, with the fused kernels' fp32 errors under the parity tolerance. The
pytest-benchmark entries time the CPU passes through the Triton interpreter (nothing to do with GPU
speed) so runs can be compared across commits; pytest.ini disables their timing by default
(`pytest tests/test_bench/test_bench_measure.py --benchmark-enable --benchmark-only` times them).
"""

import csv
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import triton
import triton.language as tl
from bench_package import ROOT, import_bench


import_bench()
from bench.cases import Case, SegmentCase  # noqa: E402
from bench.workloads.linear_token_stats import LinearCase  # noqa: E402
from bench.harness.measure import measure_case, profile  # noqa: E402
from bench.report import format_table  # noqa: E402
from bench.harness.memory import TensorTally  # noqa: E402
from bench.workloads import WORKLOADS  # noqa: E402
from bench.subjects import make_subjects  # noqa: E402
from bench.cpu_meters.traffic import count_traffic  # noqa: E402


@triton.jit
def _scaled_copy(src_ptr, dst_ptr, scale_ptr, n, BLOCK: tl.constexpr):
    """dst[i] = src[i] * scale for i < n; every program also reads the one scale."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_range = offsets < n
    scale = tl.load(scale_ptr)
    values = tl.load(src_ptr + offsets, mask=in_range)
    tl.store(dst_ptr + offsets, (values * scale).to(dst_ptr.dtype.element_ty), mask=in_range)


@triton.jit
def _row_sums(src_ptr, out_ptr, cols, stride, BLOCK: tl.constexpr):
    """out[r] = sum of row r's first `cols` entries, the row read once in BLOCK-wide steps."""
    row = tl.program_id(0).to(tl.int64)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, cols, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        acc += tl.load(src_ptr + row * stride + offsets, mask=offsets < cols, other=0.0).to(tl.float32)
    tl.store(out_ptr + row, tl.sum(acc, axis=0))


def test_counts_exact_bytes_of_kernels_with_masked_tails():
    n, block = 1000, 256  # 4 programs, the last with 232 of 256 lanes masked off
    src = torch.randn(n).to(torch.float16)
    dst = torch.empty(n, dtype=torch.float32)
    scale = torch.tensor([3.0], dtype=torch.float64)
    matrix = torch.randn(5, 40)[:, :37]  # rows of 37 read in blocks of 16: 3 steps, 11 lanes masked
    sums = torch.empty(5)
    with count_traffic() as traffic:
        _scaled_copy[(triton.cdiv(n, block),)](src, dst, scale, n, BLOCK=block)
        _row_sums[(5,)](matrix, sums, 37, matrix.stride(0), BLOCK=16)
    copy, rows = traffic.kernels["_scaled_copy"], traffic.kernels["_row_sums"]
    assert (copy.read, copy.written, copy.calls) == (2 * n + 8 * 4, 4 * n, 1)
    assert (rows.read, rows.written, rows.calls) == (4 * 5 * 37, 4 * 5, 1)
    assert traffic.total == copy.total + rows.total  # the interpreter's argument copies are not counted
    assert torch.equal(dst, src.float() * 3) and torch.allclose(sums, matrix.sum(1), atol=1e-6)


def test_counts_operators_by_what_they_touch():
    a, b = torch.randn(64, 32), torch.randn(64, 32)
    index = torch.randint(0, 32, (64, 2))
    out = torch.empty(64, 32)
    with count_traffic() as traffic:
        torch.add(a, b)  # reads two, writes one
        a.t().unsqueeze(0).view(-1, 64)  # views move nothing
        a.gather(1, index)  # reads only the gathered elements (and the index)
        out.copy_(a)  # does not read its destination
        torch.mul(a, 2.0, out=out)  # nor does an out= argument (and a Python scalar is no memory)
    ops = traffic.operators
    full = 64 * 32 * 4
    assert (ops["aten.add"].read, ops["aten.add"].written) == (2 * full, full)
    assert (ops["aten.gather"].read, ops["aten.gather"].written) == (64 * 2 * (4 + 8), 64 * 2 * 4)
    assert (ops["aten.copy_"].read, ops["aten.copy_"].written) == (full, full)
    assert (ops["aten.mul"].read, ops["aten.mul"].written) == (full, full)
    assert set(ops) == {"aten.add", "aten.gather", "aten.copy_", "aten.mul"}


def test_tally_tracks_live_and_peak_allocations():
    with TensorTally() as tally:
        big = torch.empty(1000, dtype=torch.float32)
        small = big[:10] + 1  # a new 40-byte tensor; the view itself allocates nothing
        del big
        after_free = tally.live()
        tally.reset_peak()
        medium = torch.zeros(100, dtype=torch.float64)
    assert after_free == 40
    assert tally.peak() == 40 + 800
    del small, medium


def _fused_and_eager():
    return make_subjects(["fused", "eager"], torch.device("cpu"))[0]


@pytest.mark.parametrize("case", [Case(24, 1500, "fp32", 3, True), SegmentCase(3000, channels=3, sample_tokens=200),
                                  LinearCase(20, 1500, "fp32", 3, True, hidden=16, chunk_rows=6),
                                  LinearCase(12, 700, "fp32", 1, False, hidden=8)], ids=lambda case: case.label)  # fmt: skip
def test_pass_measures_every_phase_of_both_paths(case):
    # The targets (bytes near the floor, eager moving more) are reported, not asserted; what must
    # hold is that no path moves less than the floor, errors are at fp32 parity, and the phases add up.
    workload = WORKLOADS[case.op].make(case, torch.device("cpu"))
    for metrics in (profile(subject, workload, count_bytes=True) for subject in _fused_and_eager()):
        assert metrics["fwd"]["bytes_moved"] + metrics["bwd"]["bytes_moved"] == metrics["fwd+bwd"]["bytes_moved"]
        for phase, figures in metrics.items():
            assert figures["error"] < 1e-5
            assert figures["bytes_moved"] >= case.floor_bytes(phase)
            assert figures["peak_extra_bytes"] >= 0


@pytest.fixture
def private_process_group():
    """The megatron subject initialises a one-process group and megatron's parallel state; undo
    both so later tests in this process start from a clean slate."""
    was_initialized = dist.is_initialized()
    yield
    if not was_initialized and dist.is_initialized():
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def test_timed_path_runs_end_to_end_on_cpu(private_process_group):
    # The GPU mode's code (timing with rotated inputs, copy bandwidth, the GPU table) with a wall
    # clock instead of CUDA events: it must run for every subject kind, megatron's in-place
    # backward included (each timed backward gets its own forward).
    subjects, _ = make_subjects(["fused", "eager", "megatron"], torch.device("cpu"))
    records = []
    for case in (Case(4, 64, "fp32", 1, False), SegmentCase(200, sample_tokens=50)):
        records += measure_case(WORKLOADS[case.op].make(case, torch.device("cpu")), subjects, timing=True)
    assert {r["subject"] for r in records} == {"fused", "eager", "megatron"}
    assert all(r["time_ms"] > 0 and r["copy_gbps"] > 0 and r["bytes_moved"] is None for r in records)
    assert "x megatron" in format_table(records, gpu=True)


def test_cpu_run_prints_table_and_writes_results(tmp_path):
    # one V (above a block, not a multiple of one): the kernels' vocabulary boundaries are the
    # parity tests'; here the grid's product, the table and the files
    command = [sys.executable, "-m", "bench", "--device", "cpu", "-T", "8", "16", "-V", "1030",
               "--dtype", "fp32", "bf16", "-J", "1", "3", "--entropy", "both", "--results-dir", str(tmp_path)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the command switches it on
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "err fused" in done.stdout and "bytes/floor" in done.stdout
    assert "left" in done.stderr and "Traceback" not in done.stderr  # progress with an estimate
    assert len(list(tmp_path.glob("bench_cpu_*.png"))) == 1
    with (tmp_path / "bench_cpu.csv").open() as results:
        rows = list(csv.DictReader(results))
    fused = [row for row in rows if row["subject"] == "fused"]
    assert len(fused) == 3 * (2 * 1 * 2 * 2 * 2 + 2)  # phases x token grid (T x V x dtype x J x entropy), + one aggregation case per T
    assert all(float(row["error"]) < 1e-5 for row in fused if row["dtype"] == "fp32")
    assert all(float(row["bytes_moved"]) >= float(row["floor_bytes"]) for row in fused)


@pytest.mark.benchmark(group="CPU pass through the Triton interpreter (not GPU timings)")
@pytest.mark.parametrize("subject", ["fused", "eager"])
def test_benchmark_cpu_token_stats_pass(benchmark, subject):
    case = Case(32, 4748, "fp32", 1, False)
    workload = WORKLOADS[case.op].make(case, torch.device("cpu"))
    (chosen,) = make_subjects([subject], torch.device("cpu"))[0]
    metrics = benchmark.pedantic(profile, args=(chosen, workload, True), rounds=2, iterations=1)
    both = metrics["fwd+bwd"]
    benchmark.extra_info.update(bytes_over_floor=both["bytes_moved"] / case.floor_bytes("fwd+bwd"),
                                error=both["error"], peak_extra_bytes=both["peak_extra_bytes"])  # fmt: skip
    assert both["error"] < 1e-5
