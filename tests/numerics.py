"""Error measures shared by the parity tests."""

import torch


def rel_err(actual: torch.Tensor, truth: torch.Tensor) -> float:
    """Relative norm error against a float64 truth (absolute when the truth is near zero)."""
    truth = truth.detach().double()
    return float((actual.detach().double() - truth).norm() / truth.norm().clamp_min(1.0))
