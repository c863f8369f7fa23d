"""Error measures shared by the parity tests; both sides are compared on CPU (a kernel's output may
be on the test device, its float64 truth is on CPU).

Errors are truly relative: divided by the truth's own size, whatever it is (a gradient norm of
0.02 divides by 0.02, not by 1). The only absolute number is `floor`, the size below which a truth
counts as zero; it is explicit, and the default (`FLOOR`) sits far below any quantity the tests
compare, so it matters only where the truth is exactly zero (a masked row's gradient), where the
error then reads as absolute in units of the floor.
"""

import statistics

import torch

FLOOR = 1e-30


def rel_err(actual: torch.Tensor, truth: torch.Tensor, floor: float = FLOOR) -> float:
    """||actual - truth|| / max(||truth||, floor), norms over all elements, against a float64 truth."""
    actual, truth = actual.detach().cpu().double(), truth.detach().cpu().double()
    return float((actual - truth).norm() / truth.norm().clamp_min(floor))


def assert_parity(actual: torch.Tensor, truth: torch.Tensor, tol: float, what: str = "", floor: float = FLOOR) -> None:
    """`actual` matches the float64 `truth` element by element and as a whole, both relative.

    Element-wise: every entry within `tol` times the truth's largest magnitude (at least `floor`),
    so one wrong column cannot hide in a norm; `torch.testing.assert_close` reports the worst
    element. Norm-wise: `rel_err` under `tol`.
    """
    actual, truth = actual.detach().cpu().double(), truth.detach().cpu().double()
    scale = max(float(truth.abs().max()), floor) if truth.numel() else floor
    torch.testing.assert_close(actual, truth, rtol=tol, atol=tol * scale, msg=lambda m: f"{what}: {m}" if what else m)
    error = rel_err(actual, truth, floor)
    assert error < tol, f"{what}: relative norm error {error:.3g} >= {tol}"


def max_err(actual: torch.Tensor, truth: torch.Tensor) -> float:
    """Largest element-wise absolute error against a float64 truth."""
    return float((actual.detach().cpu().double() - truth.detach().cpu().double()).abs().max())


def assert_no_worse_than(per_seed, what: str, bar: float = 2.0) -> None:
    """A path's error no worse than a baseline's over several seeds: the median over seeds of
    ours / (baseline + slack) at most `bar`.

    per_seed: one (our error, the baseline's error, slack) per seed, both errors against the same
    float64 truth; slack is the absolute error both may have for free (one rounding of the truth's
    largest value, say). Why a median over seeds: two equally accurate fp32 paths that round in a
    different order (a chunked GEMM, another exp) differ by a factor that one seed draws from a
    wide spread (0.1 to 4.5 over 12 seeds of tests/test_kernels/test_token_stats_scale.py's
    cases), and which way it falls depends on the machine's GEMM and vector-math rounding; the
    median of 8 seeds does not (0.01 to 0.75 there, slack included). A formulation that really
    loses accuracy (lse rounded into every probability) has medians of 5 to 80 at |logits| / T
    from 30 to 1000, although one seed of it can still fall under 1.
    """
    if len(per_seed) < 5:
        raise ValueError(f"assert_no_worse_than needs at least 5 seeds for a median, got {len(per_seed)}")
    ratios = [ours / (base + slack) for ours, base, slack in per_seed]
    median = statistics.median(ratios)
    shown = ", ".join(f"{ours:.2e}/{base:.2e}" for ours, base, _ in per_seed)
    assert median <= bar, f"{what}: median over {len(ratios)} seeds of our/baseline error {median:.2f} > {bar} ({shown})"
