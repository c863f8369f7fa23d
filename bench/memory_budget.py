"""Whether the chosen cases fit the machine, checked before anything is allocated.

The largest case bounds the run's memory: cases run one after the other and free their inputs.
The estimate is generous on purpose (the eager baseline keeps several logits-sized buffers), so a
refusal means the run would have swapped or been killed, not that it was close.
"""

import os

import torch

# Share of the memory available now that a run may plan to use.
USABLE_FRACTION = 0.5
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


def oversized_message(cases, available: int):
    """None when the largest case fits in USABLE_FRACTION of `available` bytes, else why it does not."""
    if not cases:
        return None
    largest = max(cases, key=estimated_peak_bytes)
    needed = estimated_peak_bytes(largest)
    if needed <= USABLE_FRACTION * available:
        return None
    return (
        f"case {largest.label} needs about {needed / 1e9:.1f} GB (estimate), more than "
        f"{USABLE_FRACTION:.0%} of the {available / 1e9:.1f} GB available on this machine; "
        "choose smaller -T/--tokens or -V/--vocab values"
    )
