"""Ahead-of-time compilation of the shipped kernels for Hopper (sm_90) on a machine without a GPU.

The interpreter runs kernels as NumPy and forgives what the real compiler rejects (type
mismatches of loop-carried values, unsupported ops); compiling to a cubin catches those here.
Kernels are compiled through the host functions' own launches (bench/static/launches.py), so the
signatures and specialisation cannot drift from what ships; `bench.static` runs the compiler in a
fresh process without TRITON_INTERPRET (set for the test session).
"""

from bench_package import import_bench

import_bench()
from bench.static import Launch, compile_launches, cost, shipped_launches  # noqa: E402


def compile_for_hopper(launches, extra_path=()):
    """Cost-model rows of every kernel the launches start (their modules found on sys.path or in
    `extra_path`); raises RuntimeError with the compiler's message when one fails to compile."""
    records = compile_launches(launches, extra_path=extra_path)
    failed = [f"{record['label']}: {record['error']}" for record in records if "error" in record]
    if failed:
        raise RuntimeError("compiling for sm_90 failed:\n" + "\n".join(failed))
    return [cost(record) for record in records]


def shipped(prefix: str, keep) -> list:
    """The shipped launches of one op whose kwargs pass `keep`."""
    return [launch for launch in shipped_launches() if launch.label.startswith(prefix) and keep(launch.kwargs)]


__all__ = ["Launch", "compile_for_hopper", "shipped"]
