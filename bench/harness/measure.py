"""One measurement pass per (case, subject), shared by the CPU and GPU modes.

A pass runs the forward and then the backward once on a fresh copy of the input, under a memory
meter (and, on CPU, the byte counter), and checks the outputs and the gradient against the float64
reference. The GPU mode adds timings (`timing`). Each pass yields one record per phase.
"""

import contextlib

from ..cases import PHASES
from ..cpu_meters.aten_ops import tensor_bytes, tensors_in
from ..cpu_meters.traffic import count_traffic
from .flops import GemmFlops
from .memory import TensorTally, memory_meter
from .timing import copy_bandwidth, time_phases


def profile(subject, workload, count_bytes: bool):
    """Run forward then backward once; per phase: error, bytes moved (or None), peak extra memory,
    GEMM flops.

    Peak extra memory is what the phase allocates beyond what was live when it started, less the
    gradient it returns (every implementation must produce that). A gradient made in the forward
    and handed out by the backward (the one-pass LM head's) is that returned gradient in both
    phases: a tally of the forward's storages tells which returned tensors it made.
    """
    counter = count_traffic if count_bytes else contextlib.nullcontext
    x = workload.leaf()
    with memory_meter(x.device) as meter:
        with counter() as forward_traffic, GemmFlops() as forward_flops, TensorTally() as forward_storages:
            outputs = subject.run(x, workload)
        forward_peak, after_forward = meter.peak(), meter.live()
        made_in_forward = forward_storages.live_storages()
        meter.reset_peak()
        with counter() as backward_traffic, GemmFlops() as backward_flops:
            grad = workload.backward(x, outputs)
        backward_peak = meter.peak()
    forward_error, backward_error = workload.errors(outputs, grad)
    grad_bytes = tensor_bytes(grad)
    held_bytes = tensor_bytes([g for g in tensors_in(grad) if g.untyped_storage().data_ptr() in made_in_forward])
    forward_bytes = forward_traffic and forward_traffic.total
    backward_bytes = backward_traffic and backward_traffic.total
    return {
        "fwd": dict(error=forward_error, bytes_moved=forward_bytes, peak_extra_bytes=forward_peak,
                    gemm_flops=forward_flops.total),  # fmt: skip
        "bwd": dict(
            error=backward_error,
            bytes_moved=backward_bytes,
            peak_extra_bytes=backward_peak - after_forward - (grad_bytes - held_bytes),
            gemm_flops=backward_flops.total,
        ),
        "fwd+bwd": dict(
            error=max(forward_error, backward_error),
            bytes_moved=None if forward_bytes is None else forward_bytes + backward_bytes,
            peak_extra_bytes=max(forward_peak - held_bytes, backward_peak - grad_bytes),
            gemm_flops=forward_flops.total + backward_flops.total,
        ),
    }


def measure_case(workload, subjects, phases=PHASES, timing=False, unavailable=None):
    """Records (one per subject and phase) for the workload's case; with `timing`, GPU times and
    bandwidths. With `unavailable` (a `bench.subjects.Unavailable`), a peer that raises a
    RuntimeError on the case gets no record but a note there, and the run goes on."""
    case = workload.case
    copy_gbps = None
    if timing:
        copy_gbps = copy_bandwidth(workload.main_input)
    records = []
    for subject in subjects:
        if not subject.covers(case):
            continue
        try:
            metrics, times = _measure(subject, workload, phases, timing)
        except RuntimeError as error:  # NotImplementedError included
            if unavailable is None or not subject.peer:
                raise
            unavailable.add(subject, error, case)
            continue
        for phase in phases:
            record = dict(case=case, phase=phase, subject=subject.name, **metrics[phase])
            record.update(floor_bytes=case.floor_bytes(phase), input_bytes=case.input_bytes)
            record.update(time_ms=times.get(phase), copy_gbps=copy_gbps)
            records.append(record)
    return records


def _measure(subject, workload, phases, timing):
    """(the profile's figures by phase, GPU times by phase or empty)."""
    if timing:
        profile(subject, workload, count_bytes=False)  # warm-up: compilation, autotuning, caches
    metrics = profile(subject, workload, count_bytes=not timing)
    return metrics, time_phases(subject, workload, phases) if timing else {}
