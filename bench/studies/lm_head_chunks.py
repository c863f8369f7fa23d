"""The fused LM head's chunk size, measured, and its cost at GPU shapes, projected:
`python -m bench.studies.lm_head_chunks`.

On CPU (the Triton interpreter) the peak extra memory and the GEMM flops (in GEMMs of the logits'
size) of the fused (recompute) path and of the one-pass path, with and without main_grad, are
measured for several chunk sizes beside the unfused path's, each next to the cost model of
`bench/workloads/linear_token_stats.py`; that model then projects every path to T = 16384,
V/tp = 151936, H = 4096 (a projection, not a measurement). bf16 on CPU adds what a GPU does not:
torch has no bf16 x bf16 -> fp32 in-place addmm there, so a GEMM summed in fp32 takes fp32 copies
of its operands, in blocks of at most a quarter of the chunk's elements (`add_product_fp32`: up to
C V bytes more than the model).
"""

import argparse
import sys
from dataclasses import replace

import torch

from ..cases import DTYPES
from ..device import pick_device
from ..harness.measure import profile
from ..subjects import Subject
from ..workloads.linear_token_stats import (
    CPU_HIDDEN,
    LinearCase,
    LinearWorkload,
    cost,
    run_fused,
    run_one_pass,
    run_one_pass_main_grad,
    run_unfused,
)

PROJECTION = dict(tokens=(4096, 16384), vocab=151936, hidden=4096)
CHUNK_STUDY = dict(tokens=128, vocab=18992, hidden=CPU_HIDDEN, chunks=(8, 16, 32, 64, 128))
GIB = 1 << 30


def chunk_study(dtype: str, study=CHUNK_STUDY):
    """Measured peak extra memory (fwd+bwd) per chunk size of the fused (recompute) path and of the
    one-pass path with and without main_grad, and of the unfused path: (the case, [(name, fwd+bwd
    figures, chunk rows or None, the path's cost-model key)])."""
    paths = [(Subject("fused", {"linear_token_stats": run_fused}), "fused"),
             (Subject("one pass", {"linear_token_stats": run_one_pass}), "one_pass"),
             (Subject("one pass+mg", {"linear_token_stats": run_one_pass_main_grad}), "one_pass_main_grad")]  # fmt: skip
    unfused = Subject("unfused", {"linear_token_stats": run_unfused})
    base = LinearCase(study["tokens"], study["vocab"], dtype, 1, False, hidden=study["hidden"])
    workload = LinearWorkload.make(base, torch.device("cpu"))
    rows = [("unfused", profile(unfused, workload, count_bytes=False)["fwd+bwd"], None, "unfused")]
    for chunk in study["chunks"]:
        workload.case = replace(base, chunk_rows=chunk)
        for subject, key in paths:
            rows.append((f"{subject.name} C={chunk}", profile(subject, workload, count_bytes=False)["fwd+bwd"], chunk, key))
    return base, rows


def _mib(nbytes) -> str:
    return f"{nbytes / (1 << 20):.2f}"


def format_chunk_study(base, rows) -> str:
    unfused_extra = 2 * base.input_bytes
    lines = [f"{base.dtype}: T={base.tokens} H={base.hidden} V={base.vocab} J=1; unfused logits + gradient = "
             f"{_mib(unfused_extra)} MiB",
             f"{'path':<20}{'extra MiB':>11}{'model MiB':>11}{'of unfused logits+grad':>24}{'GEMMs':>7}{'err':>10}"]  # fmt: skip
    one_gemm = 2 * base.tokens * base.vocab * base.hidden
    for name, figures, chunk, key in rows:
        model = cost(base.tokens, base.hidden, base.vocab, base.torch_dtype.itemsize, chunk or base.tokens)
        share = f"{100 * figures['peak_extra_bytes'] / unfused_extra:.1f}%"
        lines.append(f"{name:<20}{_mib(figures['peak_extra_bytes']):>11}{_mib(model[f'{key}_extra']):>11}{share:>24}"
                     f"{figures['gemm_flops'] / one_gemm:>7.0f}{figures['error']:>10.1e}")  # fmt: skip
    return "\n".join(lines)


PATHS = (  # (name, cost-model key prefix)
    ("unfused", "unfused"),
    ("fused (recompute)", "fused"),
    ("one pass", "one_pass"),
    ("one pass + main_grad", "one_pass_main_grad"),
)


def projection_rows():
    """(dtype, T, chunk, path, its cost figures, the unfused extra) at the issue's GPU shapes,
    default chunk, all rows selected."""
    from fusedrl.kernels.linear_token_stats import (
        default_chunk_rows,  # imports triton: after pick_device
    )

    vocab, hidden = PROJECTION["vocab"], PROJECTION["hidden"]
    for dtype in ("bf16", "fp32"):
        itemsize = DTYPES[dtype].itemsize
        for tokens in PROJECTION["tokens"]:
            chunk = default_chunk_rows(tokens, vocab, itemsize)
            c = cost(tokens, hidden, vocab, itemsize, chunk)
            for name, key in PATHS:
                flops, moved = c[f"{key}_flops"], c[f"{key}_bytes"]
                label = f"{name} (walk)" if key == "one_pass" and c["one_pass_walks"] else name
                yield dtype, tokens, chunk, label, dict(extra=c[f"{key}_extra"], flops=flops, moved=moved), c


def format_projection() -> str:
    """The cost model at the issue's GPU shapes, default chunk, for both dtypes and every path."""
    lines = ["projection (cost model, not a measurement): H = 4096, V/tp = 151936, default chunk C, all rows selected",
             f"{'dtype':<6}{'T':>7}{'C':>6}  {'path':<22}{'extra GiB':>10}{'of unfused logits+grad':>24}"
             f"{'GEMM TFLOP':>12}{'x 2TVH':>8}{'GB moved':>10}"]  # fmt: skip
    for dtype, tokens, chunk, name, figures, c in projection_rows():
        share = 100 * figures["extra"] / c["unfused_extra"]
        gemms = figures["flops"] / (2 * tokens * PROJECTION["vocab"] * PROJECTION["hidden"])
        lines.append(f"{dtype:<6}{tokens:>7}{chunk:>6}  {name:<22}{figures['extra'] / GIB:>10.2f}{share:>23.1f}%"
                     f"{figures['flops'] / 1e12:>12.1f}{gemms:>8.0f}{figures['moved'] / 1e9:>10.1f}")  # fmt: skip
    return "\n".join(lines)


def main(argv=None):
    """Chunk-size study (measured, CPU interpreter) and the projection to the GPU shapes."""
    parser = argparse.ArgumentParser(prog="python -m bench.studies.lm_head_chunks", description=main.__doc__)
    parser.add_argument("--dtype", nargs="+", choices=("fp32", "bf16"), default=["fp32", "bf16"])
    args = parser.parse_args(argv)
    pick_device("cpu")
    for dtype in args.dtype:
        print(format_chunk_study(*chunk_study(dtype)), end="\n\n")
    print(format_projection())


if __name__ == "__main__":
    sys.exit(main())
