"""What the run's table says, in words: a legend of its columns and one closing line per op.

The closing line reads the forward + backward records of every case of an op (each phase when
that one was not measured): on a GPU the fused kernel's median share of copy bandwidth and each
peer's median time as a multiple of the fused one; on CPU each subject's median bytes moved over
the floor. Both name the worst error of each subject against float64, the
figure that says whether the speed came at a price.
"""

import statistics

from .report import gbps

CPU_LEGEND = (
    "err: worst relative error against float64 over the case's outputs (fwd) or gradients (bwd)",
    "bytes/floor: bytes the fused path moves over the minimum the phase must move (1.00 = at the floor)",
    "<peer>/fused bytes: bytes a peer moves over the fused path's",
    "extra: peak memory allocated beyond the inputs and the returned gradient, as a share of the input",
)
GPU_LEGEND = (
    "fused ms: median time; GB/s: the phase's minimum bytes over that time; of copy: that over a device-to-device copy",
    "extra MiB: peak memory allocated beyond the inputs and the returned gradient",
    "x <peer>: the peer's time over the fused kernel's (above 1: fused is faster)",
    "err fused: worst relative error against float64 over the case's outputs (fwd) or gradients (bwd)",
)


SUBJECT_LEGEND = (
    "per subject (LM head): GEMM GFLOP counted over forward + backward (aten GEMMs, and Triton tl.dot tiles under the "
    "interpreter only: on a GPU verl's Triton GEMMs count nothing); x 2TVH: that in GEMMs of the logits' size; "
    "extra MiB / of eager: peak extra memory, and as a share of the unfused path's; TFLOP/s: GEMM GFLOP over ms (GPU)",
)


def legend(gpu: bool, subject_table: bool = False) -> str:
    """The tables' columns, one line each (`subject_table`: the LM head's per-subject table too)."""
    lines = (GPU_LEGEND if gpu else CPU_LEGEND) + (SUBJECT_LEGEND if subject_table else ())
    return "\n".join(f"  {line}" for line in lines)


def _phase_shown(records) -> str:
    phases = {record["phase"] for record in records}
    return "fwd+bwd" if "fwd+bwd" in phases else sorted(phases)[0]


def _by_subject(records) -> dict:
    grouped = {}
    for record in records:
        grouped.setdefault(record["subject"], []).append(record)
    return grouped


def _median(values) -> float:
    return statistics.median(values) if values else float("nan")


def _worst_errors(by_subject) -> str:
    return ", ".join(f"{name} {max(r['error'] for r in rows):.0e}" for name, rows in by_subject.items())


def _gpu_line(by_subject) -> str:
    fused = {id(r["case"]): r for r in by_subject["fused"]}
    share = _median([100 * gbps(r) / r["copy_gbps"] for r in fused.values()])
    parts = [f"fused runs at {share:.0f}% of copy bandwidth (median)"]
    for name, rows in by_subject.items():
        if name != "fused":
            ratios = [r["time_ms"] / fused[id(r["case"])]["time_ms"] for r in rows if id(r["case"]) in fused]
            parts.append(f"{name} takes {_median(ratios):.2f}x its time")
    return "; ".join(parts)


def _cpu_line(by_subject) -> str:
    parts = []
    for name, rows in by_subject.items():
        rows = [r for r in rows if r["bytes_moved"] is not None]
        if rows:
            parts.append(f"{name} moves {_median([r['bytes_moved'] / r['floor_bytes'] for r in rows]):.2f}x the floor")
    return ", ".join(parts) + " (median)" if parts else "no bytes counted"


def _gemm_figures(by_subject) -> str:
    """`; GEMMs of the logits' size: fused 4.00, eager 3.00` where the records count GEMM flops."""
    parts = []
    for name, rows in by_subject.items():
        counted = [r["gemm_flops"] / (2 * r["case"].tokens * r["case"].vocab * r["case"].hidden) for r in rows
                   if r.get("gemm_flops")]  # fmt: skip
        if counted:
            parts.append(f"{name} {_median(counted):.2f}")
    return f"; GEMMs of the logits' size: {', '.join(parts)}" if parts else ""


def conclusions(records, gpu: bool) -> list:
    """One line per op, e.g. `token_stats fwd+bwd, 6 cases: fused moves 1.00x the floor, eager 2.65x
    the floor (median); worst error fused 3e-07, eager 2e-07`."""
    lines = []
    by_op = {}
    for record in records:
        by_op.setdefault(record["case"].op, []).append(record)
    for op, op_records in by_op.items():
        phase = _phase_shown(op_records)
        shown = [record for record in op_records if record["phase"] == phase]
        by_subject = _by_subject(shown)
        cases = len({id(record["case"]) for record in shown})
        figures = _gpu_line(by_subject) if gpu else _cpu_line(by_subject)
        line = f"{op} {phase}, {cases} case{'s' * (cases != 1)}: {figures}; worst error {_worst_errors(by_subject)}"
        lines.append(line + _gemm_figures(by_subject))
    return lines
