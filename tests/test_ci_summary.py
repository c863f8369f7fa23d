"""The closing lines of every CI log that say where its time went and how far it is from the budget:
`.ci/budget` (the run scaled to the slow reference machine by its install's seconds, against 30
minutes, after the install's parts) and the fixture set-ups (tests/fixture_times.py, printed by
`.ci/file-times --fixtures`), on made-up records and on a real pytest run in a generated folder."""

import json
import subprocess
import sys
from pathlib import Path

CI = Path(__file__).resolve().parents[1] / ".ci"
TESTS = Path(__file__).resolve().parent


def run(*command, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *map(str, command)], capture_output=True, text=True, timeout=120, **kwargs)


def test_the_budget_scales_the_run_by_the_install_and_names_what_is_left(tmp_path):
    parts = tmp_path / "parts"
    parts.write_text("torch 40\nsglang 120\npip-check 3\n")
    out = run(CI / "budget", 197, 1000, parts).stdout.splitlines()
    assert out[0] == "the install's parts: torch 40 s, sglang 120 s, pip-check 3 s"
    # 1000 s on a machine that installs in 197 s is 1000 * 493 / 197 = 2503 s on the reference
    assert out[1].startswith("CI budget: the whole run's 1000 s, scaled to the slow reference machine (install 493 s; this one's 197 s, x2.50)")
    assert out[1].endswith("is 2503 s of 1800 s: 703 s OVER")
    assert run(CI / "budget", 493, 1500).stdout.strip().endswith("is 1500 s of 1800 s: 300 s to spare")


def test_the_budget_refuses_what_it_cannot_scale():
    refused = run(CI / "budget", 0, 1000)
    assert refused.returncode != 0 and "install's seconds must be positive" in refused.stderr and "got 0 and 1000" in refused.stderr
    assert "usage: .ci/budget INSTALL_SECONDS WHOLE_RUN_SECONDS" in run(CI / "budget", 5).stderr


SLOW_FIXTURES = """
import time, pytest

@pytest.fixture(scope="module")
def slow_module():
    time.sleep(1.2)
    yield

@pytest.fixture
def quick():
    return 1

def test_a(slow_module, quick):
    pass

def test_b(slow_module, quick):
    pass
"""


def test_slow_fixture_set_ups_are_recorded_once_each_and_printed_slowest_first(tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_slow.py").write_text(SLOW_FIXTURES)
    times, report = tmp_path / "fixture-times.jsonl", tmp_path / "report.xml"
    environment = {"PYTHONPATH": str(TESTS), "FUSEDRL_FIXTURE_TIMES": str(times), "PATH": "/usr/bin:/bin"}
    result = run("-m", "pytest", "-q", "-p", "fixture_times", "-p", "no:cacheprovider", f"--junitxml={report}", tmp_path,
                 cwd=tmp_path, env=environment)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    records = [json.loads(line) for line in times.read_text().splitlines()]
    assert [(r["fixture"], r["scope"], r["at"]) for r in records] == [("slow_module", "module", "test_slow.py")]
    assert 1.2 <= records[0]["seconds"] < 60
    printed = run(CI / "file-times", report, "--fixtures", times).stdout.splitlines()
    assert printed[-3] == "=== fixture set-ups of a second or more, slowest first (both cores)"
    assert printed[-2].endswith(" s  slow_module (module) at test_slow.py") and printed[-1].endswith(" s  in 1 set-ups")
