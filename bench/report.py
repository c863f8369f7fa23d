"""The run's outputs: one printed table, rows appended to a CSV, a PNG chart.

Records are long-format (one per case, phase and subject); the table pivots them to one line per
case and phase, showing the fused kernel's own figures and its ratios to every other subject. The
chart shows one phase (forward + backward when measured) of every case: a row of panels per op, a
column per metric, the implementations side by side, within a bounded figure size.
"""

import csv
import datetime
import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

CSV_FIELDS = (
    "date", "device", "torch", "triton", "commit", "op",
    "tokens", "vocab", "dtype", "ids_per_row", "entropy", "temperature", "channels", "segments",
    "phase", "subject", "error", "bytes_moved", "floor_bytes", "peak_extra_bytes", "input_bytes",
    "time_ms", "gbps", "copy_gbps", "gemm_flops",
)  # fmt: skip
MIB = 1 << 20


def environment(device: torch.device) -> dict:
    """Where and with what the numbers were taken."""
    import triton

    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(
            ["git", "describe", "--always", "--dirty"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.processor() or platform.machine()}, Triton interpreter)"
    return dict(
        date=datetime.datetime.now().isoformat(timespec="seconds"),
        device=name,
        torch=torch.__version__,
        triton=triton.__version__,
        commit=commit,
    )


def gbps(record):
    """Achieved bandwidth counted from the minimal bytes of the phase."""
    return None if record["time_ms"] is None else record["floor_bytes"] / record["time_ms"] / 1e6


def csv_row(record, env) -> dict:
    case = record["case"]
    row = dict(env, **{k: v for k, v in record.items() if k != "case"}, gbps=gbps(record))
    row.update(op=case.op, **case.fields())
    return {field: row.get(field) for field in CSV_FIELDS}


def append_csv(records, env, path: Path, fields=CSV_FIELDS, row=csv_row) -> Path:
    """Append `row(record, env)` for each record to `path` (columns `fields`); if it was written
    with other columns, start a dated file beside it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        with path.open() as existing:
            if next(csv.reader(existing), None) != list(fields):
                path = path.with_name(f"{path.stem}-{env['date'].replace(':', '')}{path.suffix}")
    is_new = not path.exists()
    with path.open("a", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=fields)
        if is_new:
            writer.writeheader()
        writer.writerows(row(record, env) for record in records)
    return path


def _ratio(numerator, denominator, digits=2):
    if numerator is None or denominator in (None, 0):
        return "-"
    return f"{numerator / denominator:.{digits}f}"


def _percent(value, total):
    return "-" if value is None else f"{100 * value / total:.2f}%"


def _error(record):
    return "-" if record is None else f"{record['error']:.1e}"


def _columns(gpu: bool, peers):
    """(header, cell) pairs; a cell gets {subject: record} for one case and phase."""
    fused = lambda by: by["fused"]  # noqa: E731
    if gpu:
        columns = [
            ("fused ms", lambda by: f"{fused(by)['time_ms']:.3f}"),
            ("GB/s", lambda by: f"{gbps(fused(by)):.0f}"),
            ("of copy", lambda by: _percent(gbps(fused(by)), fused(by)["copy_gbps"])),
            ("extra MiB", lambda by: f"{fused(by)['peak_extra_bytes'] / MIB:.1f}"),
        ]
        columns += [
            (f"x {peer}", lambda by, p=peer: _ratio(by[p]["time_ms"], fused(by)["time_ms"]) if p in by else "-")
            for peer in peers
        ]
        return columns + [("err fused", lambda by: _error(fused(by)))]
    columns = [
        ("err fused", lambda by: _error(fused(by))),
        ("err eager", lambda by: _error(by.get("eager"))),
        ("bytes/floor", lambda by: _ratio(fused(by)["bytes_moved"], fused(by)["floor_bytes"], 3)),
    ]
    columns += [
        (f"{peer}/fused bytes", lambda by, p=peer: _ratio(by[p]["bytes_moved"], fused(by)["bytes_moved"]) if p in by else "-")
        for peer in peers
    ]
    columns += [
        (f"extra {name}", lambda by, n=name: _percent(by[n]["peak_extra_bytes"], by[n]["input_bytes"]) if n in by else "-")
        for name in ("fused", "eager")
    ]
    return columns


def format_table(records, gpu: bool) -> str:
    """One line per case and phase, fused figures and ratios to the other subjects."""
    groups = {}
    for record in records:
        groups.setdefault((record["case"], record["phase"]), {})[record["subject"]] = record
    peers = [s for s in dict.fromkeys(r["subject"] for r in records) if s != "fused"]
    columns = [("case", None), ("phase", None)] + _columns(gpu, peers)
    lines = [[header for header, _ in columns]]
    for (case, phase), by_subject in groups.items():
        lines.append([case.label, phase] + [cell(by_subject) for _, cell in columns[2:]])
    widths = [max(len(line[i]) for line in lines) for i in range(len(columns))]
    text = ["  ".join(cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths))) for line in lines]
    text.insert(1, "-" * len(text[0]))
    return "\n".join(text)


def format_subject_table(records) -> str:
    """For the cases that run GEMMs (the LM head): one line per case and subject, forward + backward:
    GEMM flops counted (and in units of 2 T V H, one GEMM of the logits' size), peak extra memory (and
    as a share of the `eager` subject's, the unfused path), error, time and GEMM flops over it. Empty
    when no case has GEMMs."""
    shown = [r for r in records if r["phase"] == "fwd+bwd"]
    with_gemms = {id(r["case"]) for r in shown if r.get("gemm_flops")}
    eager = {id(r["case"]): r for r in shown if r["subject"] == "eager"}
    lines = [["case", "subject", "GEMM GFLOP", "x 2TVH", "extra MiB", "of eager", "err", "ms", "TFLOP/s"]]
    for record in shown:
        case = record["case"]
        if id(case) not in with_gemms:
            continue
        one_gemm = 2 * case.tokens * case.vocab * case.hidden
        base = eager.get(id(case))
        lines.append([
            case.label, record["subject"], f"{record['gemm_flops'] / 1e9:.4f}", f"{record['gemm_flops'] / one_gemm:.2f}",
            f"{record['peak_extra_bytes'] / MIB:.2f}", "-" if base is None else _percent(record["peak_extra_bytes"],
                                                                                      base["peak_extra_bytes"]),
            f"{record['error']:.1e}", "-" if record["time_ms"] is None else f"{record['time_ms']:.3f}",
            "-" if record["time_ms"] is None else f"{record['gemm_flops'] / record['time_ms'] / 1e9:.1f}",
        ])  # fmt: skip
    if len(lines) == 1:
        return ""
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    text = ["  ".join(cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths)))
            for line in lines]  # fmt: skip
    text.insert(1, "-" * len(text[0]))
    return "per subject, forward + backward:\n" + "\n".join(text)


@dataclass(frozen=True)
class Metric:
    """One column of the chart: what a record shows there and how to read it."""

    title: str
    axis_label: str
    value: Callable  # record -> float, or None where the record has no such figure
    log: bool
    reference: Optional[float] = None  # x of a dashed vertical line to read the values against


def _bytes_over_floor(record):
    return None if record["bytes_moved"] is None else record["bytes_moved"] / record["floor_bytes"]


def _of_copy(record):
    return None if record["time_ms"] is None else 100 * gbps(record) / record["copy_gbps"]


EXTRA_MEMORY = Metric("extra memory", "peak allocation beyond the inputs, % of the input\n(less is better)",
                      lambda r: 100 * r["peak_extra_bytes"] / r["input_bytes"], log=False)
ACCURACY = Metric("accuracy", "relative error against float64 (log)\n(less is better; dashed: fp32 tolerance)",
                  lambda r: r["error"], log=True, reference=1e-5)
CPU_METRICS = (
    Metric("memory traffic", "bytes moved / minimum bytes (log)\n(less is better; dashed: the floor)",
           _bytes_over_floor, log=True, reference=1.0),
    EXTRA_MEMORY,
    ACCURACY,
)
GPU_METRICS = (
    Metric("time", "median milliseconds (log)\n(less is better)", lambda r: r["time_ms"], log=True),
    Metric("bandwidth", "minimum bytes / time, % of a device copy\n(more is better; dashed: copy speed)",
           _of_copy, log=False, reference=100.0),
    EXTRA_MEMORY,
    ACCURACY,
)
PHASE_NAMES = {"fwd": "forward", "bwd": "backward", "fwd+bwd": "forward + backward"}
OP_TITLES = {"token_stats": "token statistics (token_stats)", "segment_sum": "aggregation\n(segment_sum)"}
SUBJECT_STYLES = {"fused": ("#1f5fa8", "o"), "eager": ("#e07b1a", "s"), "compile": ("#3a9a3a", "^"),
                  "liger": ("#8a4fb5", "D"), "megatron": ("#c0392b", "v"), "one_pass": ("#17becf", "P"),
                  "one_pass_main_grad": ("#7f7f7f", "X"), "verl": ("#b8860b", "*"),
                  "verl_main_grad": ("#6b8e23", "d"), "liger_flce": ("#d35fb7", "p"), "liger_scaled": ("#5b3a8a", "h")}
# Figure geometry in inches: the plotting area grows with the cases up to a bound, then rows get
# denser (and their labels smaller, down to a floor) instead of the figure taller.
ROW_INCHES, MAX_ROWS_INCHES, FRAME_INCHES = 0.3, 13.0, 2.2
LABEL_COLUMN_INCHES, METRIC_INCHES = 2.4, 3.3
LABEL_POINTS = (5.0, 9.0)  # smallest and largest case-label font sizes


def chart_phase(records) -> str:
    """The phase the chart shows: a whole training step when it was measured."""
    phases = list(dict.fromkeys(r["phase"] for r in records))
    return "fwd+bwd" if "fwd+bwd" in phases else phases[0]


def figure(records, gpu: bool, env: dict):
    """The chart: a row of panels per op and a column per metric, cases down the side, one marker per
    implementation; title, legend and the run's metadata (device, versions, commit, date, dtypes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phase = chart_phase(records)
    shown = [r for r in records if r["phase"] == phase]
    metrics = GPU_METRICS if gpu else CPU_METRICS
    cases = {}
    for record in shown:
        cases.setdefault(record["case"].op, {})[record["case"]] = None
    subjects = list(dict.fromkeys(r["subject"] for r in shown))
    rows = sum(len(op_cases) for op_cases in cases.values())
    rows_inches = min(MAX_ROWS_INCHES, ROW_INCHES * max(rows, 4 * len(cases)) + 0.5 * len(cases))
    label_points = min(LABEL_POINTS[1], max(LABEL_POINTS[0], 0.6 * 72 * rows_inches / rows))
    fig = plt.figure(figsize=(LABEL_COLUMN_INCHES + METRIC_INCHES * len(metrics), FRAME_INCHES + rows_inches),
                     layout="constrained")  # fmt: skip
    grid = fig.subplots(len(cases), len(metrics), squeeze=False, sharey="row",
                        gridspec_kw={"height_ratios": [max(4, len(c) + 1) for c in cases.values()]})  # fmt: skip
    for axes_row, (op, op_cases) in zip(grid, cases.items()):
        _draw_op(axes_row, op, list(op_cases), shown, subjects, metrics, label_points)
    for axes_row in grid:
        _plain_ticks_on_narrow_log_axes(axes_row)
    for axes, metric in zip(grid[0], metrics):
        axes.set_title(metric.title, fontsize=11, fontweight="bold")
    for axes, metric in zip(grid[-1], metrics):
        axes.set_xlabel(metric.axis_label, fontsize=9)
    handles = [plt.Line2D([], [], color=SUBJECT_STYLES[s][0], marker=SUBJECT_STYLES[s][1], linestyle="", label=s)
               for s in subjects]  # fmt: skip
    fig.legend(handles=handles, loc="outside lower center", ncols=len(subjects), fontsize=10, frameon=False)
    where = "GPU: CUDA-event timings" if gpu else "CPU: bytes counted in the Triton interpreter, no timings"
    dtypes = " ".join(dict.fromkeys(r["case"].dtype for r in shown))
    fig.suptitle(f"fusedrl fused kernels vs eager PyTorch and peers, {PHASE_NAMES[phase]} ({where})\n"
                 f"{env['device']}  |  torch {env['torch']}, triton {env['triton']}  |  commit {env['commit']}  |  "
                 f"{env['date']}  |  dtypes: {dtypes}", fontsize=11)  # fmt: skip
    return fig


def _plain_ticks_on_narrow_log_axes(axes_row):
    """Log axes spanning less than two decades get plain ticks (1, 1.5, 2, 3 ...) instead of powers."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    for axes in axes_row:
        low, high = axes.get_xlim()
        if axes.get_xscale() == "log" and high / low < 100:
            axes.xaxis.set_major_locator(LogLocator(subs=(1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 7.0)))
            axes.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
            axes.xaxis.set_minor_formatter(NullFormatter())


def _draw_op(axes_row, op, op_cases, records, subjects, metrics, label_points):
    """One op's panels: case i on row i (top down), subjects side by side within the row."""
    by_key = {(r["case"], r["subject"]): r for r in records}
    offsets = {s: 0.5 * (i - (len(subjects) - 1) / 2) / max(1, len(subjects)) for i, s in enumerate(subjects)}
    for column, (axes, metric) in enumerate(zip(axes_row, metrics)):
        for subject in subjects:
            points = [(metric.value(by_key[case, subject]), row + offsets[subject])
                      for row, case in enumerate(op_cases) if (case, subject) in by_key]  # fmt: skip
            points = [(x, y) for x, y in points if x is not None and (x > 0 or not metric.log)]
            color, marker = SUBJECT_STYLES[subject]
            axes.scatter([x for x, _ in points], [y for _, y in points], color=color, marker=marker, s=28, zorder=3)
        if metric.log:
            axes.set_xscale("log")
        if metric.reference is not None:
            axes.axvline(metric.reference, color="black", linewidth=0.8, linestyle="--", zorder=2)
        axes.set_ylim(len(op_cases) - 0.5, -0.5)
        axes.set_yticks(range(len(op_cases)))
        axes.set_yticklabels([case.label for case in op_cases], fontsize=label_points)
        axes.grid(axis="x", color="#dddddd", linewidth=0.6, zorder=0)
        for row in range(0, len(op_cases), 2):
            axes.axhspan(row - 0.5, row + 0.5, color="#f4f4f4", zorder=0)
        axes.tick_params(axis="x", labelsize=8)
        if column == 0:
            axes.set_ylabel(OP_TITLES.get(op, op), fontsize=10)


def plot(records, gpu: bool, env: dict, path: Path) -> Path:
    """Write the chart of `records` to `path` (PNG)."""
    import matplotlib.pyplot as plt

    fig = figure(records, gpu, env)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
