"""The two tiers of the kernel parity tests.

The default tier, which every `pytest` run takes, holds one case per kernel branch and per shape
class that breaks things (V = 1, V below, at and above a block, odd V, J = 1, repeated ids,
several id chunks, masked rows, -inf, every dtype): minutes through the Triton interpreter. The
full tier, `FUSEDRL_FULL=1`, adds the cross-products of those axes (vocabulary sizes, J,
temperatures, entropy on and off, low-precision dtypes): too slow for the interpreter, seconds on
a GPU, where `.ci/device-check` runs it. A full-tier case is a `pytest.param` marked `full`; a run
without the variable deselects them and says how many it left out (tests/conftest.py).
"""

import itertools
import os

import pytest

FULL_ENV = "FUSEDRL_FULL"


def full_tier() -> bool:
    """Whether this run takes the full tier: FUSEDRL_FULL is "1" (unset or "0": the default tier)."""
    value = os.environ.get(FULL_ENV, "0")
    if value not in ("0", "1"):
        raise pytest.UsageError(f"{FULL_ENV} must be 0 (the default tier) or 1 (the full tier), got {value!r}")
    return value == "1"


def with_full_tier(default: list, *axes) -> list:
    """`default`'s cases, then every other combination of `axes` as a full-tier case."""
    extra = [case for case in itertools.product(*axes) if case not in default]
    return list(default) + [pytest.param(*case, marks=pytest.mark.full) for case in extra]
