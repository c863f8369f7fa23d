"""Test-session setup: where the kernels under test run (tests/device.py), and the `device` fixture.

Default: CPU tensors exercise the Triton kernels through the Triton interpreter. Without
TRITON_INTERPRET=1 the public functions take the eager reference on CPU tensors, and the parity
tests would compare the reference with itself; so the interpreter is switched on before anything
imports triton. With FUSEDRL_TEST_DEVICE=cuda the kernels run compiled on the GPU instead, on the
tensors each test moves to `device`.
"""

import os

import pytest
import torch
from device import DEVICE, ON_GPU
from distributed import begin_test
from fixture_times import pytest_fixture_setup  # noqa: F401 (the hook: each slow fixture set-up's seconds, for CI)
from tiers import FULL_ENV, full_tier

if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
elif not torch.cuda.is_available():
    raise RuntimeError("FUSEDRL_TEST_DEVICE=cuda but torch sees no GPU")


_LEFT_OUT = pytest.StashKey[int]()  # how many full-tier cases this run deselected


def pytest_configure(config):
    config.addinivalue_line("markers", f"full: a case of the full tier, run only under {FULL_ENV}=1 (tests/tiers.py)")
    config.addinivalue_line(
        "markers",
        "host_bookkeeping: checks the host code's memory or GEMM bookkeeping around the kernels, which no "
        "Triton version changes; CI's Triton-matrix legs (.ci/triton-matrix) leave it to the main run",
    )
    config.stash[_LEFT_OUT] = 0


def pytest_collection_modifyitems(config, items):
    """Without FUSEDRL_FULL=1, deselect the full tier's cases (counted for the closing line)."""
    if full_tier():
        return
    left_out = [item for item in items if item.get_closest_marker("full")]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = [item for item in items if not item.get_closest_marker("full")]
    config.stash[_LEFT_OUT] = len(left_out)


@pytest.fixture
def device() -> torch.device:
    """Where a test puts the kernels' inputs: CUDA under FUSEDRL_TEST_DEVICE=cuda, else CPU."""
    return DEVICE


@pytest.fixture(autouse=True)
def _pools_taken_by_this_test():
    """Marks the start of each test, so the distributed pools it takes outlive any eviction within it."""
    begin_test()
    yield


def skip_groups(reports) -> list:
    """(reason, test files, tests, paths) per distinct skip reason, the largest group first.

    A module skipped whole (its collection report) counts as a test file, a skipped test as a
    test; the reason is pytest's, without its "Skipped: " prefix.
    """
    groups = {}
    for report in reports:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        group = groups.setdefault(reason.removeprefix("Skipped: "), {"files": 0, "tests": 0, "paths": []})
        group["files" if report.when == "collect" else "tests"] += 1
        path = report.nodeid.split("::")[0]
        if path not in group["paths"]:
            group["paths"].append(path)
    rows = [(reason, group["files"], group["tests"], group["paths"]) for reason, group in groups.items()]
    return sorted(rows, key=lambda row: (-row[1] - row[2], row[0]))


def pytest_terminal_summary(terminalreporter):
    """End the run with the number of full-tier cases left out, and one line per group of skipped
    tests and its reason, which names the variable or package that would enable them: pytest shows
    skip reasons only under -rs, so a run without FUSEDRL_SLIME_SRC would otherwise pass quietly
    with fewer tests than CI's."""
    left_out = terminalreporter.config.stash[_LEFT_OUT]
    if left_out:
        terminalreporter.write_line(
            f"the full tier: {left_out} cases not run ({FULL_ENV}=1 runs them; docs/testing.md#the-two-tiers)"
        )
    groups = skip_groups(terminalreporter.stats.get("skipped", []))
    if not groups:
        return
    terminalreporter.write_line("skipped, and what would enable them:")
    for reason, files, tests, paths in groups:
        counts = " and ".join(f"{n} {noun}{'' if n == 1 else 's'}" for n, noun in ((files, "test file"), (tests, "test")) if n)
        shown = ", ".join(paths[:2]) + (", ..." if len(paths) > 2 else "")
        terminalreporter.write_line(f"  {counts} ({shown}): {reason}")
