"""Which path runs: logged once, a late TRITON_INTERPRET caught with a clear error, and
`fusedrl.kernels` importable (float64 reference on CPU, a clear error on CUDA) without Triton."""

import logging
import os
import subprocess
import sys

import pytest
import torch
from device import ON_GPU

from fusedrl.kernels import segment_sum, token_stats
from fusedrl.kernels._dispatch import check_interpreter_numpy


def run_python(code: str, interpret: bool) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_interpreter_path_is_logged(caplog):
    with caplog.at_level(logging.INFO, logger="fusedrl.kernels"):
        token_stats(torch.randn(3, 5), torch.zeros(3, 1, dtype=torch.long))
        segment_sum(torch.randn(3), torch.ones(3), torch.zeros(3, dtype=torch.long), torch.ones(1))
    messages = " | ".join(record.getMessage() for record in caplog.records)
    # Once per op and path: earlier tests in the session may already have logged it.
    assert messages == "" or ("Triton GPU kernels" if ON_GPU else "Triton interpreter") in messages


LATE_INTERPRET = """
import os, torch
from fusedrl.kernels import token_stats
os.environ["TRITON_INTERPRET"] = "1"
try:
    token_stats(torch.randn(2, 3), torch.zeros(2, 1, dtype=torch.long))
except RuntimeError as error:
    print("ERROR:", error)
"""


def test_interpreter_switched_on_after_import_gets_a_clear_error():
    done = run_python(LATE_INTERPRET, interpret=False)
    assert done.returncode == 0, done.stderr
    assert "ERROR: TRITON_INTERPRET=1 was set after fusedrl.kernels was imported" in done.stdout
    assert "before importing" in done.stdout


CPU_FALLBACK = """
import logging, warnings, torch
logging.basicConfig(level=logging.INFO, format="%(message)s")
from fusedrl.kernels import token_stats, token_stats_reference
logits, ids = torch.randn(4, 7), torch.randint(0, 7, (4, 2))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for _ in range(3):
        stats = token_stats(logits, ids, with_entropy=True)
print("WARNINGS:", len(caught), caught[0].message)
assert torch.equal(stats.logp, token_stats_reference(logits, ids).logp)
"""


def test_cpu_without_interpreter_takes_the_reference_and_says_so_once():
    done = run_python(CPU_FALLBACK, interpret=False)
    assert done.returncode == 0, done.stderr
    assert "WARNINGS: 1 fusedrl.kernels.token_stats runs the float64 reference" in done.stdout
    assert done.stderr.count("runs the float64 reference") == 1  # the log line, once


WITHOUT_TRITON = """
import sys
sys.modules["triton"] = None  # hides triton: `import triton` raises ImportError
import torch
from fusedrl.kernels import segment_sum, token_stats, token_stats_reference
from fusedrl.kernels._dispatch import uses_triton
logits, ids = torch.randn(4, 7), torch.randint(0, 7, (4, 2))
assert torch.equal(token_stats(logits, ids).logp, token_stats_reference(logits, ids).logp)
print("SUM:", float(segment_sum(torch.ones(3), torch.ones(3), torch.zeros(3, dtype=torch.long), torch.ones(1))))
class FakeCuda:
    is_cuda = True
try:
    uses_triton(FakeCuda(), "token_stats")
except RuntimeError as error:
    print("ERROR:", error)
"""


def test_import_without_triton_falls_back_on_cpu_and_refuses_cuda():
    for interpret in (False, True):
        done = run_python(WITHOUT_TRITON, interpret=interpret)
        assert done.returncode == 0, done.stderr
        assert "SUM: 3.0" in done.stdout
        assert "ERROR: fusedrl.kernels.token_stats needs triton for CUDA tensors" in done.stdout


def test_interpreter_refuses_triton_before_3_8_beside_numpy_2_4():
    """Triton 3.6's interpreter turns scalar kernel arguments into Python ints with int(), which
    numpy >= 2.4 refuses; the kernels' loops would raise a TypeError deep in the interpreter, so
    the pairing is refused up front with the fix (the CI matrix runs 3.6.0 beside numpy 2.3)."""
    with pytest.raises(RuntimeError, match=r"triton 3\.6\.0 .* numpy 2\.4\.6 .*numpy<2\.4"):
        check_interpreter_numpy("3.6.0", "2.4.6")
    for triton_version, numpy_version in [("3.6.0", "2.3.5"), ("3.8.0", "2.4.6"), ("3.9.0", "2.5.1"), ("3.10.0rc1", "2.4.0")]:
        check_interpreter_numpy(triton_version, numpy_version)
