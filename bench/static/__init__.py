"""`python -m bench --static`: a static Hopper cost model of every kernel variant, on CPU.

Each variant is compiled for sm_90 from the shipped host functions at production shape
(bench/static/launches.py, bench/static/compile.py) and its SASS read (bench/static/sass.py).
Reported per kernel: registers, local memory (spills), shared memory, CTAs per SM and occupancy,
and per element of the main loop: instructions, MUFU (ex2/lg2), barriers and shuffles; the widest
global load and store; and the ceiling, the bandwidth at which the SM runs out of either
instruction issue (4 warp-instructions per clock) or its ex2/lg2 unit (16 lanes per clock, a
quarter warp-instruction per clock), next to the 4.3 TB/s a device-to-device copy reaches on an
H200. A kernel under that line cannot be memory-bound. Each row names the Triton it was compiled
with: layouts, and so the counts, differ between versions.
"""

import collections
import csv
import itertools
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import NamedTuple

# H200 (sm_90): SMs, boost clock, warp-instructions issued per SM per clock, copy bandwidth.
SMS = 132
CLOCK_HZ = 1.98e9
ISSUE_PER_CLOCK = 4
MUFU_LANES_PER_CLOCK = 16  # the ex2/lg2 unit: 16 lanes per SM per clock (sm_90)
COPY_TBPS = 4.3
# Per-SM limits that bound occupancy.
REGISTERS_PER_SM = 65536
REGISTER_UNIT = 256  # registers are allocated per warp in units of 256
MAX_WARPS_PER_SM = 64
MAX_CTAS_PER_SM = 32
SHARED_PER_SM = 228 * 1024
SHARED_RESERVED_PER_CTA = 1024

TOKENS, VOCAB_LOCAL = 16384, 151936  # a 16k-token micro-batch of Qwen's vocabulary at tp = 1
SCORE_CENTERING_IDS = 129  # slime's --score-centering-top-k 128 head plus the sampled token
SEGMENT_TOKENS = 16384
COMPILE_TIMEOUT_S = 1200
STDERR_TAIL_LINES = 60


class Launch(NamedTuple):
    label: str
    call: str  # "module:function" called with kwargs in the compile process
    kwargs: dict


def token_stats_launch(phase: str, dtype: str, ids_per_row: int, entropy: bool, rows: bool) -> Launch:
    """One token_stats kernel variant at production shape."""
    label = f"token_stats {phase} {dtype} J={ids_per_row}" + " entropy" * entropy + " rows" * rows
    kwargs = dict(dtype=dtype, ids_per_row=ids_per_row, entropy=entropy, rows=rows, tokens=TOKENS, vocab=VOCAB_LOCAL)
    return Launch(label, f"bench.static.launches:token_stats_{phase}", kwargs)


def shipped_launches() -> list:
    """Every variant the wrappers can launch, at production shape: J = 1 (the sampled token) and
    9 (8 centering draws) for every switch, and J = 129 (slime's score centering: the sampled token
    and a top-128 head) on the response rows of fp32 and bf16 logits."""
    switches = list(itertools.product((False, True), (False, True)))  # (entropy, rows)
    launches = [
        token_stats_launch(phase, dtype, ids_per_row, entropy, rows)
        for phase in ("forward", "backward") for dtype in ("fp32", "bf16", "fp16") for ids_per_row in (1, 9)
        for entropy, rows in switches
    ] + [
        token_stats_launch(phase, dtype, SCORE_CENTERING_IDS, entropy, True)
        for phase in ("forward", "backward") for dtype in ("fp32", "bf16") for entropy in (False, True)
    ]  # fmt: skip
    for phase in ("forward", "backward"):
        for dtype in ("fp32", "bf16"):
            for channels in (1, 8):
                kwargs = dict(dtype=dtype, channels=channels, tokens=SEGMENT_TOKENS)
                label = f"segment_sum {phase} {dtype} C={channels}"
                launches.append(Launch(label, f"bench.static.launches:segment_sum_{phase}", kwargs))
    return launches


def compile_launches(launches, extra_path=()) -> list:
    """Records of every kernel the launches start, compiled in a fresh process without the
    interpreter (TRITON_INTERPRET changes what @triton.jit builds at import). The child's progress
    lines pass through to stderr as they come; its last lines are kept for the error message."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root, *map(str, extra_path), env.get("PYTHONPATH", "")])
    child = subprocess.Popen(
        [sys.executable, "-m", "bench.static.compile"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True,
    )  # fmt: skip
    tail = collections.deque(maxlen=STDERR_TAIL_LINES)
    relay = threading.Thread(target=_relay_progress, args=(child.stderr, tail), daemon=True)
    relay.start()
    child.stdin.write(json.dumps([launch._asdict() for launch in launches]))
    child.stdin.close()
    output = child.stdout.read()
    child.wait(timeout=COMPILE_TIMEOUT_S)
    relay.join()
    if child.returncode != 0:
        raise RuntimeError("compiling for sm_90 failed:\n" + "".join(tail))
    return json.loads(output)


def _relay_progress(stream, tail) -> None:
    """Copy the compiling child's progress lines to stderr; keep its other lines for an error."""
    for line in stream:
        if line.startswith("["):
            print(line, end="", file=sys.stderr, flush=True)
        else:
            tail.append(line)


def ctas_per_sm(registers: int, num_warps: int, shared_bytes: int) -> int:
    per_warp = -(-registers * 32 // REGISTER_UNIT) * REGISTER_UNIT
    by_registers = REGISTERS_PER_SM // (per_warp * num_warps)
    by_warps = MAX_WARPS_PER_SM // num_warps
    by_shared = SHARED_PER_SM // (shared_bytes + SHARED_RESERVED_PER_CTA)
    return min(by_registers, by_warps, by_shared, MAX_CTAS_PER_SM)


def unrolled_trips(record: dict) -> int:
    """Source-loop trips per trip of the SASS main loop (the compiler's unroll factor).

    The kernel's first tensor argument is the streamed one: its loads are the loop's widest, and
    one source trip loads `block_elements` (the launched tile: the product of its BLOCK*
    constexprs) / threads of its elements per thread.
    """
    loop = record["loop"]
    if not loop["found_loop"] or loop["widest_load"] == 0:
        return 1
    per_trip_bits = record["block_elements"] / (32 * record["num_warps"]) * record["stream_bits"]
    return max(1, round(loop["widest_loads"] * loop["widest_load"] / per_trip_bits))


def ceilings(instructions_per_element: float, mufu_per_element: float, bytes_per_element: float) -> dict:
    """TB/s at which instruction issue and the ex2/lg2 unit run out, the lower of the two, and
    which one that is."""
    lanes = SMS * CLOCK_HZ
    issue = lanes * ISSUE_PER_CLOCK * 32 / instructions_per_element * bytes_per_element / 1e12
    mufu = lanes * MUFU_LANES_PER_CLOCK / mufu_per_element * bytes_per_element / 1e12 if mufu_per_element else float("inf")
    return dict(issue_tbps=issue, mufu_tbps=mufu, ceiling_tbps=min(issue, mufu), bound="issue" if issue <= mufu else "ex2")


def cost(record: dict) -> dict:
    """One table row: the model's figures for one compiled kernel."""
    resources, loop = record["resources"], record["loop"]
    per_thread = record["block_elements"] / (32 * record["num_warps"]) * unrolled_trips(record)
    shared = max(resources["shared"], record["dynamic_shared"])
    ctas = ctas_per_sm(resources["registers"], record["num_warps"], shared)
    per_element = loop["instructions"] / per_thread
    mufu_per_element = loop["mufu"] / per_thread
    bytes_per_element = (loop["load_bits"] + loop["store_bits"]) / 8 / per_thread
    bounds = ceilings(per_element, mufu_per_element, bytes_per_element)
    op, phase = (record["label"].split() + ["", ""])[:2]  # "token_stats forward bf16 ..."
    return dict(
        variant=record["label"],
        kernel=record["kernel"],
        triton=record["triton"],
        op=op,
        phase={"forward": "fwd", "backward": "bwd"}.get(phase, ""),
        dtype=record["kwargs"].get("dtype", ""),
        ids_per_row=record["kwargs"].get("ids_per_row", ""),
        entropy=record["kwargs"].get("entropy", ""),
        registers=resources["registers"],
        local_bytes=resources["local"] + resources["stack"],
        spill_instructions=loop["local_accesses"],
        shared_bytes=shared,
        ctas_per_sm=ctas,
        occupancy=ctas * record["num_warps"] / MAX_WARPS_PER_SM,
        loop=loop["found_loop"],
        unrolled=unrolled_trips(record),
        elements_per_thread=per_thread,
        instructions_per_element=per_element,
        mufu_per_element=mufu_per_element,
        barriers_per_element=loop["barriers"] / per_thread,
        shuffles_per_element=loop["shuffles"] / per_thread,
        widest_load_bits=loop["widest_load"],
        widest_store_bits=loop["widest_store"],
        bytes_per_element=bytes_per_element,
        **bounds,
        ceiling_over_copy=bounds["ceiling_tbps"] / COPY_TBPS,
        loop_instructions=";".join(map(str, record["loop_sizes"])),  # per trip of each loop, in address order
    )


COLUMNS = [
    ("variant", "{}", 46), ("kernel", "{}", 30), ("registers", "{}", 4), ("local_bytes", "{}", 7),
    ("occupancy", "{:.1%}", 6), ("instructions_per_element", "{:.1f}", 5), ("mufu_per_element", "{:.2f}", 7),
    ("barriers_per_element", "{:.3f}", 6), ("shuffles_per_element", "{:.2f}", 7),
    ("widest_load_bits", "{}", 7), ("widest_store_bits", "{}", 7), ("ceiling_tbps", "{:.2f}", 6), ("bound", "{}", 5),
]  # fmt: skip
HEADERS = ["variant", "kernel", "regs", "local B", "occup", "ins/el", "mufu/el", "bar/el", "shfl/el", "ld bits", "st bits",
           "TB/s", "bound"]


def table(rows) -> str:
    """Fixed-width text table of the model's rows, with the copy line it is compared to."""
    lines = ["  ".join(f"{head:>{width}}" if i > 1 else f"{head:<{width}}" for i, (head, (_, _, width)) in enumerate(zip(HEADERS, COLUMNS)))]
    for row in rows:
        cells = [fmt.format(row[key]) for key, fmt, _ in COLUMNS]
        lines.append("  ".join(f"{cell:>{w}}" if i > 1 else f"{cell:<{w}}" for i, (cell, (_, _, w)) in enumerate(zip(cells, COLUMNS))))
    versions = sorted({row["triton"] for row in rows})
    lines += [
        "regs: registers per thread; local B: local-memory (spill) bytes per thread; occup: resident warps of the 64 an SM holds",
        "per element of the main loop: ins/el instructions, mufu/el ex2/lg2 operations, bar/el barriers, shfl/el shuffles",
        "ld bits / st bits: the widest global load / store, in bits per thread (128: 16-byte vector access; 0: none)",
        f"TB/s: the ceiling, the lower of instruction issue ({ISSUE_PER_CLOCK} warp-instructions/clock) and the ex2 unit "
        f"({MUFU_LANES_PER_CLOCK} lanes/clock), {SMS} SMs x {CLOCK_HZ / 1e9:.2f} GHz, vs {COPY_TBPS} TB/s device-to-device "
        f"copy on an H200; bound: which of the two sets it; triton {', '.join(versions)}",
    ]  # fmt: skip
    return "\n".join(lines)


def write_csv(rows, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def run(results_dir: Path, ops=("token_stats", "segment_sum")) -> list:
    """Compile every shipped variant of `ops`, print the table, write results_dir/static.csv."""
    launches = [launch for launch in shipped_launches() if launch.label.split()[0] in ops]
    rows = [cost(record) for record in compile_launches(launches)]
    print(table(rows))
    write_csv(rows, results_dir / "static.csv")
    print(f"wrote {results_dir / 'static.csv'}")
    return rows
