"""`.ci/peak-rss`, the memory line of every CI log, on a small process tree of known parts: a
spawned worker holding 256 MiB, a process named like SGLang's server with a child of its own, and
the root."""

import importlib.machinery
import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import pytest

PEAK_RSS = Path(__file__).resolve().parents[1] / ".ci" / "peak-rss"
WORKER_BYTES = 256 * 2**20

TREE = f"""
import multiprocessing, subprocess, sys, time

def hold():
    block = bytearray({WORKER_BYTES})
    block[::4096] = b"x" * len(block[::4096])
    time.sleep(60)

if __name__ == "__main__":
    worker = multiprocessing.get_context("spawn").Process(target=hold)
    worker.start()
    child = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
    server = subprocess.Popen([sys.executable, "-c", child, "sglang.launch_server"])
    print("ready", flush=True)
    time.sleep(60)
"""


def load_peak_rss():
    loader = importlib.machinery.SourceFileLoader("peak_rss", str(PEAK_RSS))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("peak_rss", loader))
    loader.exec_module(module)
    return module


@pytest.fixture
def tree(tmp_path):
    script = tmp_path / "tree.py"  # a file: spawned children import their target from it
    script.write_text(TREE)
    root = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert root.stdout.readline().strip() == "ready"
        time.sleep(3)  # the worker fills its block, the server-like process starts its child
        yield root
    finally:
        subprocess.run(["pkill", "-KILL", "-s", str(root.pid)], check=False)
        root.wait()


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="reads /proc (Linux)")
def test_the_tree_is_summed_by_part(tree):
    peak_rss = load_peak_rss()
    sums = peak_rss.tree_memory(tree.pid)
    workers_pss, workers_rss, workers = sums[peak_rss.WORKERS]
    # the spawned worker (and any helper it starts); its block is its own, so PSS counts it whole
    assert workers >= 1 and workers_rss >= workers_pss >= WORKER_BYTES
    assert sums[peak_rss.SGLANG][2] == 2  # the server-like process and its child
    assert sums[peak_rss.REST][2] >= 1  # the root (and multiprocessing's resource tracker)


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="reads /proc (Linux)")
def test_the_file_names_the_tree_peak_with_its_parts_and_the_workers_peak(tree, tmp_path):
    out = tmp_path / "peak"
    sampler = subprocess.Popen([sys.executable, str(PEAK_RSS), str(tree.pid), str(out)])
    try:
        deadline = time.monotonic() + 20
        while not out.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        tree_line, workers_line = out.read_text().splitlines()
    finally:
        sampler.kill()
        sampler.wait()
    assert tree_line.startswith("peak memory (PSS) of the CI process tree: ") and "processes, 0 min in: " in tree_line
    assert "spawned test workers 0.3 GiB" in tree_line and "SGLang servers " in tree_line and "the rest " in tree_line
    assert workers_line.startswith("peak memory (PSS) of the spawned test workers: 0.3 GiB, RSS 0.3 GiB (")
