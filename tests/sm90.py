"""Ahead-of-time compilation of Triton kernels for Hopper (sm_90) on a machine without a GPU.

The interpreter runs kernels as NumPy and forgives what the real compiler rejects (type
mismatches of loop-carried values, unsupported ops); compiling to a cubin catches those here.
The compiler runs in a fresh process because TRITON_INTERPRET=1 (set for the test session)
changes what `@triton.jit` and `triton.language` are at import time.
"""

import json
import os
import subprocess
import sys

_COMPILE_JOBS = """
import importlib, json, sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile as triton_compile
for job in json.loads(sys.stdin.read()):
    kernel = getattr(importlib.import_module(job["module"]), job["kernel"])
    signature = dict(job["signature"], **{name: "constexpr" for name in job["constexprs"]})
    source = ASTSource(fn=kernel, signature=signature, constexprs=job["constexprs"])
    compiled = triton_compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": job["num_warps"]})
    assert compiled.asm["cubin"], job
"""


def compile_for_hopper(jobs):
    """Compile every job ({module, kernel, signature, constexprs, num_warps}) to an sm_90 cubin.

    Raises AssertionError with the compiler's message when any job fails.
    """
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE_JOBS],
        input=json.dumps(jobs),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
