"""Which path a call takes: the Triton kernels on GPU, the Triton interpreter on CPU, or the float64
reference; and Triton itself, which is optional.

Triton decides at kernel-definition time (when `fusedrl.kernels` is imported) whether its kernels
are compiled or interpreted, so the interpreter must be switched on before that import; setting
`TRITON_INTERPRET=1` later is caught here with an error that says so, instead of Triton's
`0 active drivers`. Without Triton installed, CPU tensors take the float64 reference and CUDA
tensors are refused with an error that says Triton is needed. Each path is logged once.
"""

import logging
import os
import warnings

import numpy
import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch ships no triton: define the kernels, never launch them
    triton = tl = None

log = logging.getLogger("fusedrl.kernels")

_INTERPRETED_AT_IMPORT = os.environ.get("TRITON_INTERPRET") == "1"
_LOGGED_PATHS = set()


class _TritonAbsent:
    """Stands in for `triton` and `triton.language` so that kernel definitions still import.

    `jit` leaves the function as it is and `constexpr` serves the annotations and constants;
    nothing else exists, and `uses_triton` sends no call to a kernel while Triton is absent.
    """

    @staticmethod
    def constexpr(value=None):
        return value

    @staticmethod
    def jit(fn):
        return fn


if triton is None:
    triton = tl = _TritonAbsent()


def triton_installed() -> bool:
    return not isinstance(triton, _TritonAbsent)


def uses_triton(tensor: torch.Tensor, op: str) -> bool:
    """True when `op` on `tensor` runs the Triton kernels (compiled on CUDA, interpreted on CPU).

    False means the float64 reference (CPU tensors while TRITON_INTERPRET is not 1). Raises RuntimeError
    for CUDA tensors without Triton and for an interpreter switched on after import.
    """
    interpret_now = os.environ.get("TRITON_INTERPRET") == "1"
    if tensor.is_cuda:
        if not triton_installed():
            raise RuntimeError(
                f"fusedrl.kernels.{op} needs triton for CUDA tensors, and triton is not installed: "
                "pip install triton (it comes with CUDA builds of torch)"
            )
        _announce(op, "Triton GPU kernels")
        return True
    if interpret_now and not _INTERPRETED_AT_IMPORT:
        raise RuntimeError(
            "TRITON_INTERPRET=1 was set after fusedrl.kernels was imported, so its Triton kernels "
            "were built for a GPU; set TRITON_INTERPRET=1 in the environment before importing "
            "fusedrl or triton (e.g. at the top of the notebook or on the command line)"
        )
    if interpret_now and triton_installed():
        check_interpreter_numpy(triton.__version__, numpy.__version__)
        _announce(op, "Triton interpreter (CPU)")
        return True
    _announce(op, "float64 reference (CPU; set TRITON_INTERPRET=1 to run the kernels)", warn=True)
    return False


def _release(version: str) -> tuple:
    """(major, minor) of a version string such as '3.6.0' or '2.4.0rc1'."""
    return tuple(int("".join(ch for ch in part if ch.isdigit()) or 0) for part in version.split(".")[:2])


def check_interpreter_numpy(triton_version: str, numpy_version: str) -> None:
    """Refuse, with the fix, the one pairing whose interpreter cannot run a loop: Triton before
    3.8 converts a kernel's scalar arguments (1-element arrays) to Python ints with `int()`, which
    numpy 2.4 refuses for arrays that are not 0-dimensional; so any `range` over an argument
    raises deep inside the interpreter. Compiled kernels are unaffected."""
    if _release(triton_version) < (3, 8) and _release(numpy_version) >= (2, 4):
        raise RuntimeError(
            f"the Triton interpreter of triton {triton_version} cannot run kernels beside numpy {numpy_version} "
            "(it converts scalar arguments with int(), which numpy >= 2.4 refuses): "
            "pip install 'numpy<2.4', or triton >= 3.8"
        )


def _announce(op: str, path: str, warn: bool = False) -> None:
    """Log the first call of `op` on `path`; the silent CPU fallback also warns, once.

    Not while torch.compile traces (a logging call would break the graph): the path a compiled
    graph takes is the one the same call takes eagerly.
    """
    if (op, path) in _LOGGED_PATHS or torch.compiler.is_compiling():
        return
    _LOGGED_PATHS.add((op, path))
    log.info("fusedrl.kernels.%s runs the %s", op, path)
    if warn:
        warnings.warn(f"fusedrl.kernels.{op} runs the {path}", stacklevel=4)
