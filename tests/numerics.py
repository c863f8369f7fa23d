"""Error measures shared by the parity tests; both sides are compared on CPU (a kernel's output may
be on the test device, its float64 truth is on CPU)."""

import torch


def rel_err(actual: torch.Tensor, truth: torch.Tensor) -> float:
    """Relative norm error against a float64 truth (absolute when the truth is near zero)."""
    actual, truth = actual.detach().cpu().double(), truth.detach().cpu().double()
    return float((actual - truth).norm() / truth.norm().clamp_min(1.0))


def assert_parity(actual: torch.Tensor, truth: torch.Tensor, tol: float, what: str = "") -> None:
    """`actual` matches the float64 `truth` element by element and as a whole.

    Element-wise: every entry within `tol` of the truth relative to the truth's largest magnitude
    (at least 1), so one wrong column cannot hide in a norm; `torch.testing.assert_close` reports
    the worst element. Norm-wise: `rel_err` under `tol`.
    """
    actual, truth = actual.detach().cpu().double(), truth.detach().cpu().double()
    scale = max(float(truth.abs().max()), 1.0) if truth.numel() else 1.0
    torch.testing.assert_close(actual, truth, rtol=tol, atol=tol * scale, msg=lambda m: f"{what}: {m}" if what else m)
    error = rel_err(actual, truth)
    assert error < tol, f"{what}: relative norm error {error:.3g} >= {tol}"
