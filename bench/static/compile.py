"""Child process of `--static`: compile launches for sm_90 through Triton's own launch path.

Run as `python -m bench.static.compile` with TRITON_INTERPRET unset and a JSON list of launches
({"label", "call": "module:function", "kwargs"}) on stdin; prints a JSON list with one record per
kernel launched. No GPU is needed: a stand-in driver answers "sm_90" to Triton's device queries,
and `JITFunction.run` is made to compile (warmup) instead of launch, so the binder specialises the
real arguments exactly as a launch would.
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


class _Hopper:
    """Answers Triton's device queries as one sm_90 GPU would; launches nothing."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


def _capture_launches(into: list):
    launch = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = launch(self, *args, grid=grid, warmup=True, **kwargs)
        constexprs = {p.name: kwargs[p.name] for p in self.params if p.is_constexpr and p.name in kwargs}
        streamed = next(arg for arg in args if hasattr(arg, "dtype"))  # the first tensor argument
        into.append((self.fn.__name__, kwargs.get("num_warps", 4), constexprs, streamed.dtype.itemsize * 8, kernel))
        return kernel

    JITFunction.run = compile_only


def _cuobjdump(cubin: bytes, flag: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        done = subprocess.run([str(TOOLS / "cuobjdump"), flag, file.name], capture_output=True, text=True, check=True)
    return done.stdout


def _record(label, name, num_warps, constexprs, stream_bits, kernel) -> dict:
    cubin = kernel.asm["cubin"]
    resources = parse_resources(_cuobjdump(cubin, "-res-usage"))
    instructions = parse_sass(_cuobjdump(cubin, "-sass"))
    counts = count_main_loop(instructions)
    blocks = [int(value) for key, value in constexprs.items() if key.startswith("BLOCK")]
    if not blocks:
        raise ValueError(f"{name}: no BLOCK* constexpr, so the elements one trip streams are unknown")
    return dict(
        label=label,
        kernel=name,
        num_warps=num_warps,
        block_elements=math.prod(blocks),
        triton=triton.__version__,
        stream_bits=stream_bits,
        constexprs={key: value if isinstance(value, (bool, int)) else str(value) for key, value in constexprs.items()},
        dynamic_shared=int(kernel.metadata.shared),
        resources=resources._asdict(),
        loop=counts._asdict(),
        loop_sizes=loop_sizes(instructions),
    )


def main():
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("bench.static.compile needs TRITON_INTERPRET unset (it compiles, not interprets)")
    driver.set_active(_Hopper())
    records, captured = [], []
    _capture_launches(captured)
    launches = json.loads(sys.stdin.read())
    started = time.perf_counter()
    for number, launch in enumerate(launches, 1):
        module, function = launch["call"].split(":")
        getattr(importlib.import_module(module), function)(**launch["kwargs"])
        records += [dict(_record(launch["label"], *entry), kwargs=launch["kwargs"]) for entry in captured]
        captured.clear()
        elapsed = time.perf_counter() - started
        print(f"[{number}/{len(launches)}] compiled {launch['label']} for sm_90; {elapsed:.0f} s elapsed",
              file=sys.stderr, flush=True)  # fmt: skip
    json.dump(records, sys.stdout)


if __name__ == "__main__":
    main()
