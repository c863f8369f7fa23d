"""Where the benchmark runs: the GPU when asked for (or seen), else the CPU through the Triton interpreter."""

import os
import sys

import torch


def pick_device(choice: str) -> torch.device:
    """The device to measure on; on CPU, switch Triton to its interpreter before triton is imported."""
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("triton was imported before TRITON_INTERPRET=1 could be set")
    os.environ["TRITON_INTERPRET"] = "1"
    return torch.device("cpu")
