"""Child process of `--static`: compile launches for each asked arch through Triton's own launch path.

Run as `python -m bench.static.compile` with TRITON_INTERPRET unset and a JSON object on stdin:
"archs" (e.g. ["sm_80", "sm_90"]), "sass" (read the SASS, or only the resource usage) and
"launches" ({"label", "call": "module:function", "kwargs"}); prints a JSON list with one record per
kernel launched and arch, or per launch and arch that failed to compile ({"label", "arch",
"error"}: the arch named, not skipped; Triton 3.6's bundled nvdisasm, for one, compiles sm_103
but cannot read its SASS). No GPU is needed: a stand-in driver answers each arch in
turn to Triton's device queries, and `JITFunction.run` is made to compile (warmup) instead of
launch, so the binder specialises the real arguments exactly as a launch would.
"""

import importlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction

from .sass import count_main_loop, loop_sizes, parse_resources, parse_sass

TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


class _TargetGpu:
    """Answers Triton's device queries as one GPU of `capability` would; launches nothing. The
    device index is the capability, so Triton's per-device binders (each made for the target
    current at its creation) never serve one arch's kernels to another."""

    capability = 90

    def get_current_device(self):
        return self.capability

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", self.capability, 32)


def _capture_launches(into: list):
    launch = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = launch(self, *args, grid=grid, warmup=True, **kwargs)
        constexprs = {p.name: kwargs[p.name] for p in self.params if p.is_constexpr and p.name in kwargs}
        streamed = next(arg for arg in args if hasattr(arg, "dtype"))  # the first tensor argument
        into.append((self.fn.__name__, kwargs.get("num_warps", 4), constexprs, streamed.dtype.itemsize * 8, kernel))
        return kernel

    JITFunction.run = compile_only


def _run_tool(tool: str, flags: list, cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        done = subprocess.run([str(TOOLS / tool), *flags, file.name], capture_output=True, text=True, check=True)
    return done.stdout


def _cuobjdump(cubin: bytes, flag: str) -> str:
    return _run_tool("cuobjdump", [flag], cubin)


def _disassemble(cubin: bytes) -> str:
    """The cubin's SASS: nvdisasm without its dataflow analysis (-ndf), about 70% of the time
    `cuobjdump -sass` takes, with the same instructions (the sm_90 table is identical)."""
    return _run_tool("nvdisasm", ["-c", "-ndf"], cubin)


def _record(label, arch, sass, name, num_warps, constexprs, stream_bits, kernel) -> dict:
    cubin = kernel.asm["cubin"]
    resources = parse_resources(_cuobjdump(cubin, "-res-usage"))
    blocks = [int(value) for key, value in constexprs.items() if key.startswith("BLOCK")]
    if not blocks:
        raise ValueError(f"{name}: no BLOCK* constexpr, so the elements one trip streams are unknown")
    record = dict(
        label=label,
        arch=arch,
        kernel=name,
        num_warps=num_warps,
        block_elements=math.prod(blocks),
        triton=triton.__version__,
        stream_bits=stream_bits,
        constexprs={key: value if isinstance(value, (bool, int)) else str(value) for key, value in constexprs.items()},
        dynamic_shared=int(kernel.metadata.shared),
        resources=resources._asdict(),
    )
    if sass:  # the disassembly is most of a record's time: the spill check needs only the resources
        instructions = parse_sass(_disassemble(cubin))
        record.update(loop=count_main_loop(instructions)._asdict(), loop_sizes=loop_sizes(instructions))
    return record


def _compile(launch: dict, arch: str, sass: bool, target: _TargetGpu, captured: list) -> list:
    """Records of the kernels `launch` starts, compiled for `arch`; one error record if Triton or
    ptxas cannot compile it for that arch, or the bundled tools cannot read its SASS."""
    module, function = launch["call"].split(":")
    target.capability = int(arch.removeprefix("sm_"))
    captured.clear()
    try:
        getattr(importlib.import_module(module), function)(**launch["kwargs"])
    except Exception as error:  # Triton's or ptxas's refusal of this arch: reported by name, the run goes on
        message = (str(error).strip().splitlines() or [""])[-1]
        return [dict(label=launch["label"], arch=arch, error=f"{type(error).__name__}: {message}"[:500])]
    try:
        return [dict(_record(launch["label"], arch, sass, *entry), kwargs=launch["kwargs"]) for entry in captured]
    except subprocess.CalledProcessError as error:  # compiled, but the bundled tools cannot read this arch's SASS
        message = (error.stderr.strip().splitlines() or [""])[-1]
        return [dict(label=launch["label"], arch=arch, error=f"{' '.join([Path(error.cmd[0]).name, *error.cmd[1:-1]])}: {message}"[:500])]


def main():
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("bench.static.compile needs TRITON_INTERPRET unset (it compiles, not interprets)")
    results, sys.stdout = sys.stdout, sys.stderr  # Triton prints ptxas's refusals: they must not mix with the JSON
    target = _TargetGpu()
    driver.set_active(target)
    records, captured = [], []
    _capture_launches(captured)
    job = json.loads(sys.stdin.read())
    launches, archs = job["launches"], job["archs"]
    started = time.perf_counter()
    for number, launch in enumerate(launches, 1):
        for arch in archs:
            records += _compile(launch, arch, job["sass"], target, captured)
        elapsed = time.perf_counter() - started
        print(f"[{number}/{len(launches)}] compiled {launch['label']} for {','.join(archs)}; {elapsed:.0f} s elapsed",
              file=sys.stderr, flush=True)  # fmt: skip
    json.dump(records, results)


if __name__ == "__main__":
    main()
