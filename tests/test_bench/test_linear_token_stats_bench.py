"""The LM-head benchmark: its measurements on small cases, its cost model, its command line."""

import csv
import os
import subprocess
import sys

import torch

from bench_package import ROOT, import_bench

import_bench()
from bench.harness.measure import profile  # noqa: E402
from bench.report import format_subject_table  # noqa: E402
from bench.studies.lm_head_chunks import chunk_study, format_chunk_study, format_projection  # noqa: E402
from bench.subjects import make_subjects  # noqa: E402
from bench.workloads.linear_token_stats import LinearCase, LinearWorkload, cost  # noqa: E402

LM_HEAD_SUBJECTS = ("fused", "eager", "one_pass", "one_pass_main_grad")


def test_measured_chunk_memory_follows_the_cost_model():
    """fwd+bwd peak extra of the fused path: the model's chunk of logits plus per-row bookkeeping
    (partials, gathered rows: under 16 KiB here; the recompute path's float64 merge of its slices'
    partials, under 64 bytes per row and slice), growing with the chunk; the unfused path holds
    its logits and their gradient."""
    study = dict(tokens=32, vocab=1000, hidden=16, chunks=(4, 8, 32))
    base, rows = chunk_study("fp32", study)
    (_, unfused, _, _), *chunked = rows
    assert unfused["peak_extra_bytes"] >= 2 * base.input_bytes
    extras = {}
    for _, figures, chunk, key in chunked:
        model = cost(base.tokens, base.hidden, base.vocab, 4, chunk)[f"{key}_extra"]
        slices = -(-base.tokens // chunk) if key == "fused" else 0  # the slices' columns divide V here
        assert model <= figures["peak_extra_bytes"] <= model + (16 << 10) + 64 * slices * base.tokens
        assert figures["error"] < 1e-5
        extras.setdefault(key, []).append(figures["peak_extra_bytes"])
    assert set(extras) == {"fused", "one_pass", "one_pass_main_grad"}
    assert all(values == sorted(values) for values in extras.values())
    table = format_chunk_study(base, rows)
    assert "fused C=8" in table and "one pass+mg C=8" in table


def test_cost_model_terms():
    tokens, hidden, vocab = 1000, 64, 5000
    fp32, bf16 = cost(tokens, hidden, vocab, 4, 250), cost(tokens, hidden, vocab, 2, 250)
    assert fp32["fused_flops"] * 3 == fp32["unfused_flops"] * 4  # one extra GEMM of three
    assert fp32["fused_extra"] == 250 * vocab * 4  # the fp32 hidden-state sums are the returned gradient
    assert bf16["fused_extra"] == 250 * vocab * 2 + tokens * hidden * 4  # chunk + fp32 [T, H] sums, no [V, H]
    assert fp32["unfused_extra"] == 2 * tokens * vocab * 4
    rows, weight, logits = tokens * hidden * 4, vocab * hidden * 4, tokens * vocab * 4
    one_chunk = cost(tokens, hidden, vocab, 4, tokens)
    assert one_chunk["fused_bytes"] - one_chunk["unfused_bytes"] == rows + weight + logits + 2 * rows
    assert fp32["fused_bytes"] - one_chunk["fused_bytes"] == 3 * 4 * rows + 3 * 2 * rows  # 4 slices of 1250 columns
    assert fp32["one_pass_flops"] == fp32["unfused_flops"]  # three GEMMs, as the unfused path
    assert one_chunk["one_pass_bytes"] == one_chunk["unfused_bytes"]  # one chunk: the unfused path's bytes
    assert fp32["one_pass_bytes"] == fp32["one_pass_main_grad_bytes"]  # several chunks: fp32 sums either way
    assert fp32["one_pass_extra"] == 250 * vocab * 4 and bf16["one_pass_extra"] == 250 * vocab * 2 + vocab * hidden * 4
    assert cost(tokens, hidden, vocab, 2, tokens)["one_pass_extra"] == tokens * vocab * 2  # one chunk: no sums
    assert bf16["one_pass_main_grad_extra"] == 250 * vocab * 2  # the chunk alone: no fp32 buffer of its own


def test_cost_model_one_pass_walks_the_vocabulary_above_the_buffer_budget():
    """At H = 4096, V/tp = 151936 the bf16 one pass's fp32 [V, H] sum (2.32 GiB) exceeds the 1 GiB
    budget over several chunks: the recompute path's figures; not with one chunk, fp32 or main_grad."""
    tokens, hidden, vocab = 16384, 4096, 151936
    bf16, fp32 = cost(tokens, hidden, vocab, 2, 768), cost(tokens, hidden, vocab, 4, 768)
    assert bf16["one_pass_walks"] and not fp32["one_pass_walks"]
    for figure in ("flops", "bytes", "extra"):
        assert bf16[f"one_pass_{figure}"] == bf16[f"fused_{figure}"]
    assert bf16["one_pass_main_grad_flops"] == bf16["unfused_flops"] == fp32["one_pass_flops"]
    assert not cost(tokens, hidden, vocab, 2, tokens)["one_pass_walks"]
    assert "not a measurement" in format_projection()


def test_one_pass_subjects_count_three_gemms_and_hold_one_chunk():
    """Counted over a whole forward + backward (torch's FlopCounterMode): the one-pass subjects run
    the unfused path's 6 T V H GEMM flops, all in the forward, the recompute path 8 T V H. Peak
    extra memory, bf16: the recompute path and the one pass into main_grad one chunk of logits plus
    bookkeeping; the one pass over several chunks, that and the fp32 [V, H] sums; over one chunk,
    the chunk alone."""
    tokens, vocab, hidden, chunk = 32, 2000, 16, 8
    case = LinearCase(tokens, vocab, "bf16", 2, True, 0.7, hidden, chunk_rows=chunk)
    workload = LinearWorkload.make(case, torch.device("cpu"))
    subjects, _ = make_subjects(LM_HEAD_SUBJECTS, torch.device("cpu"))
    figures = {subject.name: profile(subject, workload, count_bytes=False) for subject in subjects}
    one_gemm = 2 * tokens * vocab * hidden
    assert {name: f["fwd+bwd"]["gemm_flops"] // one_gemm for name, f in figures.items()} == {
        "fused": 4, "eager": 3, "one_pass": 3, "one_pass_main_grad": 3
    }
    assert figures["one_pass"]["fwd"]["gemm_flops"] == 3 * one_gemm  # all of it in the forward
    assert figures["one_pass"]["bwd"]["gemm_flops"] == 0
    # the chunk of bf16 logits and, on CPU, the fp32 copies a GEMM summed in fp32 takes, in blocks
    # of a quarter of the chunk's elements (torch has no bf16 x bf16 -> fp32 addmm there)
    chunk_bytes, upcast, bookkeeping = chunk * vocab * 2, chunk * vocab, 16 << 10
    accumulator = vocab * hidden * 4
    extra = {name: f["fwd+bwd"]["peak_extra_bytes"] for name, f in figures.items()}
    assert chunk_bytes <= extra["one_pass_main_grad"] <= chunk_bytes + upcast + bookkeeping
    assert chunk_bytes + accumulator <= extra["one_pass"] <= chunk_bytes + upcast + accumulator + bookkeeping
    assert chunk_bytes <= extra["fused"] <= chunk_bytes + upcast + bookkeeping < accumulator
    assert extra["one_pass_main_grad"] < extra["eager"] / 2  # a quarter of the rows, at 3-4 bytes a logit, of 4
    for name, f in figures.items():
        assert f["fwd+bwd"]["error"] <= figures["eager"]["fwd+bwd"]["error"] * 1.05 + 1e-6, name
    records = [dict(case=case, phase="fwd+bwd", subject=name, time_ms=None, **f["fwd+bwd"]) for name, f in figures.items()]
    table = format_subject_table(records)
    assert "one_pass_main_grad" in table and "4.00" in table and "3.00" in table
    one_chunk = LinearWorkload.make(LinearCase(tokens, vocab, "bf16", 2, True, 0.7, 64, chunk_rows=tokens), torch.device("cpu"))
    (one_pass,) = [subject for subject in subjects if subject.name == "one_pass"]
    single = profile(one_pass, one_chunk, count_bytes=False)["fwd+bwd"]["peak_extra_bytes"]
    assert tokens * vocab * 2 <= single <= tokens * vocab * 3 + bookkeeping < vocab * 64 * 4  # no [V, H] sums


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
    assert {row["subject"] for row in rows} == set(LM_HEAD_SUBJECTS)
    assert {int(row["gemm_flops"]) for row in rows if row["phase"] == "fwd+bwd"} == {6 * 8 * 300 * 256, 8 * 8 * 300 * 256}
    assert "per subject, forward + backward:" in done.stdout
    assert "one pass + main_grad" in done.stdout  # the projection
    assert all(float(row["error"]) < 1e-5 for row in rows)
