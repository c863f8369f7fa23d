"""Whether the chosen cases fit the machine, checked before anything is allocated.

The largest case bounds the run's memory: cases run one after the other and free their inputs.
The estimate counts the logits-sized buffers alive at the eager baseline's peak (its backward with
the entropy), so a refusal means the run would have swapped, been killed or run out of device
memory part way, not that it was close.
"""

import os

import torch

# Share of the memory available now that a run may plan to use: on CPU half, since running out
# there swaps or wakes the OOM killer for the whole machine; on a GPU most of what is free.
USABLE_FRACTION = {"cpu": 0.5, "cuda": 0.9}
# Logits-sized buffers of a token-statistics case: the input, the measured copy and the gradient in
# the logits' dtype; up to five fp32 temporaries of the eager baseline (tempered copy, log-softmax,
# softmax, their product, a gradient).
SAME_DTYPE_BUFFERS, FP32_BUFFERS = 3, 5
# Aggregation cases: values, their copy and gradient, and the eager path's per-sample products.
SEGMENT_BUFFERS = 6


def estimated_peak_bytes(case) -> int:
    """A generous estimate of the most memory measuring `case` holds at once."""
    if case.op == "token_stats":
        elements = case.tokens * case.vocab
        return elements * (SAME_DTYPE_BUFFERS * case.torch_dtype.itemsize + FP32_BUFFERS * 4)
    return SEGMENT_BUFFERS * case.input_bytes + case.floor_bytes("fwd+bwd")


def available_bytes(device: torch.device) -> int:
    """Memory free for the run now: free device memory on a GPU, MemAvailable (or free pages) on CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def oversized_message(cases, available: int, device_type: str):
    """None when the largest case fits in the usable share of `available` bytes, else why not."""
    if not cases:
        return None
    largest = max(cases, key=estimated_peak_bytes)
    needed = estimated_peak_bytes(largest)
    fraction = USABLE_FRACTION[device_type]
    if needed <= fraction * available:
        return None
    where = "in RAM on this machine" if device_type == "cpu" else "on this GPU"
    return (
        f"case {largest.label} needs about {needed / 1e9:.1f} GB (estimate), more than "
        f"{fraction:.0%} of the {available / 1e9:.1f} GB available {where}; "
        "choose smaller -T/--tokens or -V/--vocab values"
    )
