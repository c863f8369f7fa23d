"""The LM-head benchmark: its measurements on small cases, its cost model, its command line."""

import csv
import os
import subprocess
import sys

from bench_package import ROOT, import_bench

import_bench()
from bench.studies.lm_head_chunks import chunk_study, format_chunk_study, format_projection
from bench.workloads.linear_token_stats import cost  # noqa: E402


def test_measured_chunk_memory_follows_the_cost_model():
    """fwd+bwd peak extra of the fused path: the model's chunk of logits plus per-row bookkeeping
    (partials, gathered rows: under 16 KiB here), growing with the chunk; the unfused path holds
    its logits and their gradient."""
    study = dict(tokens=32, vocab=2000, hidden=16, chunks=(4, 8, 32))
    base, rows = chunk_study("fp32", study)
    (_, unfused, _), *fused = rows
    assert unfused["peak_extra_bytes"] >= 2 * base.input_bytes
    extras = []
    for _, figures, chunk in fused:
        model = cost(base.tokens, base.hidden, base.vocab, 4, chunk)["fused_extra"]
        assert model <= figures["peak_extra_bytes"] <= model + (16 << 10)
        assert figures["error"] < 1e-5
        extras.append(figures["peak_extra_bytes"])
    assert extras == sorted(extras)
    assert "fused C=8" in format_chunk_study(base, rows)


def test_cost_model_terms():
    tokens, hidden, vocab = 1000, 64, 5000
    fp32, bf16 = cost(tokens, hidden, vocab, 4, 250), cost(tokens, hidden, vocab, 2, 250)
    assert fp32["fused_flops"] * 3 == fp32["unfused_flops"] * 4  # one extra GEMM of three
    assert fp32["fused_extra"] == 250 * vocab * 4  # the fp32 accumulator is the returned gradient
    assert bf16["fused_extra"] == 250 * vocab * 2 + vocab * hidden * 4  # chunk + fp32 accumulator
    assert fp32["unfused_extra"] == 2 * tokens * vocab * 4
    one_chunk = cost(tokens, hidden, vocab, 4, tokens)
    layer, logits, weight = (tokens + vocab) * hidden * 4, tokens * vocab * 4, vocab * hidden * 4
    assert one_chunk["fused_bytes"] - one_chunk["unfused_bytes"] == layer + logits + 2 * weight - weight
    assert fp32["fused_bytes"] - one_chunk["fused_bytes"] == 3 * 3 * weight + 2 * 3 * weight
    assert "not a measurement" in format_projection()


def test_cli_runs_the_lm_head_op(tmp_path):
    command = [sys.executable, "-m", "bench", "--device", "cpu", "--op", "linear_token_stats", "-T", "8", "-V", "300",
               "--dtype", "fp32", "-J", "2", "--entropy", "on", "--results-dir", str(tmp_path)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "lm D=256 T=8 V=300 fp32 J=2 +H" in done.stdout
    with (tmp_path / "bench_cpu.csv").open() as results:
        rows = list(csv.DictReader(results))
    assert {row["op"] for row in rows} == {"linear_token_stats"}
    assert {row["subject"] for row in rows} == {"fused", "eager"}
    assert all(float(row["error"]) < 1e-5 for row in rows)
