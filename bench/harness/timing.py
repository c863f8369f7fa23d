"""Median times per phase, warm-up excluded, the setup of each run (a forward before a timed
backward, picking the next input copy) outside the timed span.

On a GPU each run is timed with CUDA events after the L2 is flushed (as `triton.testing.do_bench`
does), and the inputs are rotated between copies that together exceed the L2 several times, so no
run is served from cache. The same code runs on CPU with a wall clock (no flush), which is how the
GPU path is exercised by the CPU tests.
"""

import itertools
import math
import statistics
import time

import torch

WARMUP_MS, REPEAT_MS = 25, 100
MIN_RUNS, MAX_RUNS = 5, 100
CPU_CACHE_BYTES = 32 << 20  # nominal last-level cache on CPU, where only the rotation depends on it


def _cache_bytes(device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).L2_cache_size
    return CPU_CACHE_BYTES


def _synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rotation(tensor: torch.Tensor) -> int:
    """Copies of an input needed so that together they are 4x the cache (at most 8)."""
    nbytes = tensor.numel() * tensor.element_size()
    return max(1, min(8, math.ceil(4 * _cache_bytes(tensor.device) / nbytes)))


def _run_once(timed, state, device, flush):
    """Run `timed(state)`; returns a function giving its milliseconds (read after a synchronize)."""
    if device.type == "cuda":
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        timed(state)
        end.record()
        return lambda: start.elapsed_time(end)
    began = time.perf_counter()
    timed(state)
    elapsed = (time.perf_counter() - began) * 1e3
    return lambda: elapsed


def median_ms(setup, timed, device) -> float:
    """Median milliseconds of `timed(setup())` over enough runs to fill REPEAT_MS, after WARMUP_MS."""
    flush = torch.empty(2 * _cache_bytes(device), dtype=torch.int8, device=device) if device.type == "cuda" else None

    def runs(count):
        return [_run_once(timed, setup(), device, flush) for _ in range(count)]

    _synchronize(device)
    began = time.perf_counter()
    runs(3)
    _synchronize(device)
    estimate_ms = max((time.perf_counter() - began) * 1e3 / 3, 1e-3)
    runs(max(1, int(WARMUP_MS / estimate_ms)))
    timings = runs(max(MIN_RUNS, min(MAX_RUNS, int(REPEAT_MS / estimate_ms))))
    _synchronize(device)
    return statistics.median(elapsed() for elapsed in timings)


def copy_bandwidth(tensor: torch.Tensor) -> float:
    """GB/s of a same-device copy of `tensor` (bytes read + bytes written): the practical peak."""
    sources = itertools.cycle([tensor.clone() for _ in range(rotation(tensor))])
    target = torch.empty_like(tensor)
    ms = median_ms(lambda: next(sources), target.copy_, tensor.device)
    return 2 * tensor.numel() * tensor.element_size() / ms / 1e6


def time_phases(subject, workload, phases):
    """Median milliseconds of `subject` per phase: forward, backward alone (after an untimed
    forward), forward + backward."""
    inputs = workload.main_input
    leaves = itertools.cycle([workload.leaf() for _ in range(rotation(inputs))])

    def forward(x):
        return subject.run(x, workload)

    def forward_untimed():
        x = next(leaves)
        return x, forward(x)

    def forward_backward(x):
        return workload.backward(x, forward(x))

    plans = {
        "fwd": (lambda: next(leaves), forward),
        "bwd": (forward_untimed, lambda state: workload.backward(*state)),
        "fwd+bwd": (lambda: next(leaves), forward_backward),
    }
    return {phase: median_ms(*plans[phase], inputs.device) for phase in phases}
