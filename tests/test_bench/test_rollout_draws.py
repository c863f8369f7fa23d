"""`python -m bench --op token_draws` on CPU: the plugin's draws on the kernel (interpreted, its bytes
counted load by load) and on the torch path, beside SGLang's sampling and top-logprobs steps on the
same logits; the records, the table and the CSV."""

import csv

import pytest
from bench_package import import_bench

import_bench()
from bench import rollout_draws  # noqa: E402
from bench.__main__ import main as bench_main  # noqa: E402
from bench.rollout_draws import DrawCase  # noqa: E402

import torch  # noqa: E402

CPU = torch.device("cpu")
# One real vocabulary row (the floor's test), and a small batch of bf16 seeded rows.
CASES = [DrawCase(1, 151936, "fp32", 32, False), DrawCase(3, 4748, "bf16", 8, True), DrawCase(2, 300, "fp32", 0, False)]


@pytest.fixture(scope="module")
def records():
    return {(r["vocab"], r["subject"]): r for r in rollout_draws.run_cases(CASES, CPU, False, with_sglang=True)}


def test_every_subject_is_measured_and_k_zero_only_samples(records):
    subjects = ("kernel", "torch path", "sglang sample", "sglang top-logprobs")
    assert set(records) == {(v, s) for v in (151936, 4748) for s in subjects} | {(300, "sglang sample")}
    assert all(r["bytes_moved"] > 0 and r["ms"] is None for r in records.values())  # CPU: bytes, no time


def test_the_kernel_reads_the_row_once_and_holds_no_row_sized_buffer(records):
    """At V = 151936 in fp32 the kernel moves at most 1.1x the floor (one read of the row; its sums
    and the K re-read groups of 128 tokens come on top, counted load by load, caches not
    modelled), below the torch path's bytes, which writes and reads an fp32 copy of the row."""
    kernel, torch_path = records[(151936, "kernel")], records[(151936, "torch path")]
    row_bytes = 151936 * 4
    assert kernel["bytes_moved"] <= 1.1 * kernel["floor_bytes"]
    assert torch_path["bytes_moved"] > 2 * row_bytes > kernel["bytes_moved"]
    assert kernel["peak_extra_bytes"] < row_bytes / 10 < row_bytes <= torch_path["peak_extra_bytes"]


def test_cli_prints_the_table_and_appends_the_csv(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(rollout_draws, "grid", lambda gpu: [DrawCase(2, 300, "fp32", 4, True)])
    for _ in range(2):
        bench_main(["--device", "cpu", "--op", "token_draws", "--results-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "B=2 V=300 fp32 K=4 seeded" in out and "bytes/floor" in out
    with (tmp_path / "bench_draws_cpu.csv").open() as rows:
        written = list(csv.DictReader(rows))
    assert len(written) == 2 * 4 and {row["subject"] for row in written} >= {"kernel", "sglang sample"}
