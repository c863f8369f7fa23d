"""A checkout's root on sys.path makes `kernels/` importable as a top-level `kernels` too (transformers
probes that name). The second name must be the installed `fusedrl.kernels`, not a second copy: a
copy would register the `fusedrl::` torch ops again, and torch frees an op's first registration,
so later calls through the first copy read freed memory (seen as `vector::reserve` errors and a
segfault in a full test run)."""

import os
import pathlib
import subprocess
import sys

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]

PROBE = """
import importlib, sys, torch
import torch._library.custom_ops as custom_ops
{first}
libraries = {{name: lib for name, lib in custom_ops.OPDEF_TO_LIB.items() if name.startswith("fusedrl::")}}
{second}
import fusedrl.kernels as kernels
assert sys.modules["kernels"] is kernels, sys.modules["kernels"]
for name in ("token_stats", "segment_sum", "token_draws", "linear_token_stats", "_contract"):
    assert sys.modules["kernels." + name] is sys.modules["fusedrl.kernels." + name], name
now = {{name: lib for name, lib in custom_ops.OPDEF_TO_LIB.items() if name.startswith("fusedrl::")}}
assert len(now) == 7 and all(now[name] is lib for name, lib in libraries.items()), (libraries, now)
logits = torch.randn(4, 37, requires_grad=True)
stats = kernels.token_stats(logits, torch.randint(0, 37, (4, 2)), with_entropy=True)
total = kernels.segment_sum(stats.logp[:, 0] + stats.entropy, torch.ones(4), torch.tensor([0, 0, 1, 1]), torch.ones(2))
total.sum().backward()
print("OK", bool(torch.isfinite(logits.grad).all()))
"""


def run_at_repo_root(first: str, second: str) -> subprocess.CompletedProcess:
    """`python -c` in the repository root: its directory is sys.path[0], as under `python -m`."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    code = PROBE.format(first=first, second=second)
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300
    )


def test_top_level_name_after_the_package_is_the_package_and_registers_nothing():
    result = run_at_repo_root("import fusedrl.kernels", "importlib.import_module('kernels')")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "OK True"


def test_top_level_name_first_is_the_package_too():
    result = run_at_repo_root("import kernels", "import fusedrl.kernels")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "OK True"
