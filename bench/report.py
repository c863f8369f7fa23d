"""The run's outputs: one printed table, rows appended to a CSV, a PNG chart.

Records are long-format (one per case, phase and subject); the table pivots them to one line per
case and phase, showing the fused kernel's own figures and its ratios to every other subject.
"""

import csv
import datetime
import platform
import subprocess
from pathlib import Path

import torch

CSV_FIELDS = (
    "date", "device", "torch", "triton", "commit", "op",
    "tokens", "vocab", "dtype", "ids_per_row", "entropy", "temperature", "channels", "segments",
    "phase", "subject", "error", "bytes_moved", "floor_bytes", "peak_extra_bytes", "input_bytes",
    "time_ms", "gbps", "copy_gbps",
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


def append_csv(records, env, path: Path) -> Path:
    """Append to `path`; if it was written with other columns, start a dated file beside it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        with path.open() as existing:
            if next(csv.reader(existing), None) != list(CSV_FIELDS):
                path = path.with_name(f"{path.stem}-{env['date'].replace(':', '')}{path.suffix}")
    is_new = not path.exists()
    with path.open("a", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=CSV_FIELDS)
        if is_new:
            writer.writeheader()
        writer.writerows(csv_row(record, env) for record in records)
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


def plot(records, gpu: bool, path: Path) -> Path:
    """Bars per case and phase, one per subject: time (GPU) or bytes moved over the floor (CPU)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric = (lambda r: r["time_ms"]) if gpu else (lambda r: r["bytes_moved"] / r["floor_bytes"])
    groups = list(dict.fromkeys((r["case"].label, r["phase"]) for r in records))
    subjects = list(dict.fromkeys(r["subject"] for r in records))
    values = {(r["case"].label, r["phase"], r["subject"]): metric(r) for r in records}
    width = 0.8 / len(subjects)
    figure, axes = plt.subplots(figsize=(max(8, 0.6 * len(groups)), 5))
    for i, subject in enumerate(subjects):
        xs = [g for g, key in enumerate(groups) if (*key, subject) in values]
        ys = [values[(*groups[g], subject)] for g in xs]
        axes.bar([x + i * width for x in xs], ys, width, label=subject)
    axes.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))])
    axes.set_xticklabels([f"{label}\n{phase}" for label, phase in groups], rotation=90, fontsize=7)
    axes.set_yscale("log")
    axes.set_ylabel("median ms" if gpu else "bytes moved / floor")
    if not gpu:
        axes.axhline(1.0, color="black", linewidth=0.8)
    axes.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
