"""`python -m bench --static`: a static cost model of every kernel variant on each GPU arch, on CPU.

Each variant is compiled for each asked arch (`--arch`, default every one of bench/static/gpus.py:
sm_80 A100, sm_90 H200, sm_100 B200, sm_103 B300, sm_120 RTX 5090) from the shipped host
functions at production shape (bench/static/launches.py, bench/static/compile.py) and its SASS
read (bench/static/sass.py). Reported per kernel and arch: registers, local memory (spills), shared
memory, CTAs per SM and occupancy, and per element of the main loop: instructions, MUFU (ex2/lg2),
barriers and shuffles; the widest global load and store; and the ceiling, the bandwidth at which
that GPU's SMs run out of either instruction issue (4 warp-instructions per clock) or the ex2/lg2
unit, next to the device-to-device copy bandwidth of that GPU. A kernel under that line cannot be
memory-bound there. These are static figures, not timings. Each row names the Triton it was
compiled with (layouts, and so the counts, differ between versions); an arch the installed Triton
or its ptxas cannot compile for is listed by name, with the compiler's message.
"""

import collections
import csv
import itertools
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import NamedTuple

from .gpus import ARCHS, GPUS, ISSUE_PER_CLOCK, REGISTER_UNIT, REGISTERS_PER_SM, SHARED_RESERVED_PER_CTA, Gpu, parse_archs

HOPPER = GPUS["sm_90"]
TOKENS, VOCAB_LOCAL = 16384, 151936  # a 16k-token micro-batch of Qwen's vocabulary at tp = 1
SCORE_CENTERING_IDS = 129  # slime's --score-centering-top-k 128 head plus the sampled token
SEGMENT_TOKENS = 16384
DRAW_ROWS, DRAWS = 256, 32  # a decode step of 256 requests, 32 draws each (the plugin's K)
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
    for dtype, probs in (("fp32", False), ("bf16", False), ("fp32", True)):
        kwargs = dict(dtype=dtype, draws=DRAWS, rows=DRAW_ROWS, vocab=VOCAB_LOCAL, probs=probs)
        label = f"token_draws forward {dtype} K={DRAWS}" + " probs" * probs
        launches.append(Launch(label, "bench.static.launches:token_draws", kwargs))
    return launches


# Environment variables that point Triton at other NVIDIA tools than the ones it bundles. Imports
# set them behind the user's back (flashinfer.triton sets TRITON_PTXAS_BLACKWELL_PATH to any CUDA 13
# ptxas on PATH), and another ptxas allocates registers and stack differently: the model reads
# what Triton's own tools make of each kernel, whatever ran in the process before.
TOOL_OVERRIDES = re.compile(r"TRITON_[A-Z_]+_PATH")


def compile_env(extra_path=()) -> dict:
    """The compiling child's environment: this one without the interpreter switch or tool
    overrides, with the repository (and `extra_path`) importable."""
    env = {key: value for key, value in os.environ.items()
           if key != "TRITON_INTERPRET" and not TOOL_OVERRIDES.fullmatch(key)}  # fmt: skip
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root, *map(str, extra_path), env.get("PYTHONPATH", "")])
    return env


def compile_launches(launches, archs=("sm_90",), sass=True, extra_path=()) -> list:
    """Records of every kernel the launches start, compiled for each of `archs` in a fresh process
    without the interpreter (TRITON_INTERPRET changes what @triton.jit builds at import); a launch
    an arch cannot compile gives a record with "error" instead. Without `sass`, a record holds the
    resource usage only (registers, spills, shared memory), not the loop counts. The child's
    progress lines pass through to stderr as they come; its last lines are kept for the error
    message."""
    child = subprocess.Popen(
        [sys.executable, "-m", "bench.static.compile"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=compile_env(extra_path), text=True,
    )  # fmt: skip
    tail = collections.deque(maxlen=STDERR_TAIL_LINES)
    relay = threading.Thread(target=_relay_progress, args=(child.stderr, tail), daemon=True)
    relay.start()
    child.stdin.write(json.dumps(dict(archs=list(archs), sass=sass, launches=[launch._asdict() for launch in launches])))
    child.stdin.close()
    output = child.stdout.read()
    child.wait(timeout=COMPILE_TIMEOUT_S)
    relay.join()
    if child.returncode != 0:
        raise RuntimeError(f"compiling for {','.join(archs)} failed:\n" + "".join(tail))
    return json.loads(output)


def _relay_progress(stream, tail) -> None:
    """Copy the compiling child's progress lines to stderr; keep its other lines for an error."""
    for line in stream:
        if line.startswith("["):
            print(line, end="", file=sys.stderr, flush=True)
        else:
            tail.append(line)


def ctas_per_sm(registers: int, num_warps: int, shared_bytes: int, gpu: Gpu = HOPPER) -> int:
    per_warp = -(-registers * 32 // REGISTER_UNIT) * REGISTER_UNIT
    by_registers = REGISTERS_PER_SM // (per_warp * num_warps)
    by_warps = gpu.max_warps_per_sm // num_warps
    by_shared = gpu.shared_per_sm // (shared_bytes + SHARED_RESERVED_PER_CTA)
    return min(by_registers, by_warps, by_shared, gpu.max_ctas_per_sm)


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


def ceilings(instructions_per_element: float, mufu_per_element: float, bytes_per_element: float, gpu: Gpu = HOPPER) -> dict:
    """TB/s at which `gpu`'s instruction issue and its ex2/lg2 unit run out, the lower of the two,
    and which one that is."""
    issue = gpu.sms * gpu.clock_hz * ISSUE_PER_CLOCK * 32 / instructions_per_element * bytes_per_element / 1e12
    mufu = gpu.ex2_per_second / mufu_per_element * bytes_per_element / 1e12 if mufu_per_element else float("inf")
    return dict(issue_tbps=issue, mufu_tbps=mufu, ceiling_tbps=min(issue, mufu), bound="issue" if issue <= mufu else "ex2")


def cost(record: dict) -> dict:
    """One table row: the model's figures for one kernel compiled for one arch (with its SASS)."""
    resources, loop, gpu = record["resources"], record["loop"], GPUS[record["arch"]]
    per_thread = record["block_elements"] / (32 * record["num_warps"]) * unrolled_trips(record)
    shared = max(resources["shared"], record["dynamic_shared"])
    ctas = ctas_per_sm(resources["registers"], record["num_warps"], shared, gpu)
    per_element = loop["instructions"] / per_thread
    mufu_per_element = loop["mufu"] / per_thread
    bytes_per_element = (loop["load_bits"] + loop["store_bits"]) / 8 / per_thread
    bounds = ceilings(per_element, mufu_per_element, bytes_per_element, gpu)
    op, phase = (record["label"].split() + ["", ""])[:2]  # "token_stats forward bf16 ..."
    return dict(
        variant=record["label"],
        arch=record["arch"],
        gpu=gpu.name,
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
        occupancy=ctas * record["num_warps"] / gpu.max_warps_per_sm,
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
        copy_tbps=gpu.copy_tbps,
        ceiling_over_copy=bounds["ceiling_tbps"] / gpu.copy_tbps,
        loop_instructions=";".join(map(str, record["loop_sizes"])),  # per trip of each loop, in address order
    )


COLUMNS = [
    ("variant", "{}", 46), ("arch", "{}", 6), ("kernel", "{}", 30), ("registers", "{}", 4), ("local_bytes", "{}", 7),
    ("occupancy", "{:.1%}", 6), ("instructions_per_element", "{:.1f}", 5), ("mufu_per_element", "{:.2f}", 7),
    ("barriers_per_element", "{:.3f}", 6), ("shuffles_per_element", "{:.2f}", 7),
    ("widest_load_bits", "{}", 7), ("widest_store_bits", "{}", 7), ("ceiling_tbps", "{:.2f}", 6),
    ("ceiling_over_copy", "{:.2f}", 6), ("bound", "{}", 5),
]  # fmt: skip
HEADERS = ["variant", "arch", "kernel", "regs", "local B", "occup", "ins/el", "mufu/el", "bar/el", "shfl/el", "ld bits",
           "st bits", "TB/s", "/copy", "bound"]  # fmt: skip
LEFT_ALIGNED = 3  # variant, arch, kernel


def _line(cells) -> str:
    return "  ".join(f"{cell:<{w}}" if i < LEFT_ALIGNED else f"{cell:>{w}}" for i, (cell, (_, _, w)) in enumerate(zip(cells, COLUMNS)))


def gpu_lines(archs) -> list:
    """One line per arch: the GPU its rows are read against, the figures and where they come from."""
    lines = []
    for arch in archs:
        gpu = GPUS[arch]
        copy = "measured" if gpu.copy_measured else "assumed at the H200's measured share of the specification"
        lines.append(f"{arch}: {gpu.name}, {gpu.sms} SMs x {gpu.clock_hz / 1e9:.2f} GHz, ex2 {gpu.ex2_lanes_per_clock} "
                     f"lanes/clock, {gpu.memory_tbps} TB/s memory, copy {gpu.copy_tbps} TB/s ({copy}); {gpu.source}")  # fmt: skip
    return lines


def table(rows) -> str:
    """Fixed-width text table of the model's rows, with the GPUs and copy lines they are read against."""
    lines = [_line(HEADERS)] + [_line([fmt.format(row[key]) for key, fmt, _ in COLUMNS]) for row in rows]
    versions = sorted({row["triton"] for row in rows})
    lines += [
        "static figures from the SASS, not timings. regs: registers per thread; local B: local-memory (spill) bytes per "
        "thread; occup: resident warps of those an SM holds",
        "per element of the main loop: ins/el instructions, mufu/el ex2/lg2 operations, bar/el barriers, shfl/el shuffles",
        "ld bits / st bits: the widest global load / store, in bits per thread (128: 16-byte vector access; 0: none)",
        f"TB/s: the ceiling, the lower of instruction issue ({ISSUE_PER_CLOCK} warp-instructions/clock per SM) and the ex2 "
        "unit of the arch's GPU; /copy: the ceiling over that GPU's device-to-device copy (under 1: cannot be "
        f"memory-bound there); bound: which of the two sets it; triton {', '.join(versions)}",
        *gpu_lines(dict.fromkeys(row["arch"] for row in rows)),
    ]  # fmt: skip
    return "\n".join(lines)


def write_csv(rows, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


# The ops whose kernels the static model covers (`python -m bench --static` without --op).
OPS = ("token_stats", "segment_sum", "token_draws")


def run(results_dir: Path, ops=OPS, archs=ARCHS) -> list:
    """Compile every shipped variant of `ops` for each of `archs`, print the table, write
    results_dir/static.csv; then name each variant and arch that did not compile (or whose SASS
    the bundled tools cannot read), with the tool's message, and exit non-zero if there is one."""
    launches = [launch for launch in shipped_launches() if launch.label.split()[0] in ops]
    records = compile_launches(launches, archs)
    failed = [record for record in records if "error" in record]
    rows = [cost(record) for record in records if "error" not in record]
    if rows:
        print(table(rows))
        write_csv(rows, results_dir / "static.csv")
        print(f"wrote {results_dir / 'static.csv'}")
    for record in failed:
        print(f"no row: {record['label']} for {record['arch']}: {record['error']}")
    if failed:
        raise SystemExit(f"python -m bench --static: {len(failed)} variant-arch pair(s) not compiled or not readable (listed above)")
    return rows
