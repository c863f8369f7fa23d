"""verl's linear cross-entropy (`verl/utils/kernel/linear_cross_entropy.py` and `kernels.py` of the
installed `verl` package), imported without the rest of verl.

`import verl` runs verl's package `__init__`, which imports its trainer stack (DataProto: tensordict,
ray, ...); the bench installs verl with `--no-deps` (.ci/install-test-deps.sh says why), so that
import fails. The kernel itself needs only torch, triton and packaging: `kernels.py` imports
`verl.utils.device`, which imports `verl.plugin.platform`, and nothing else of verl. So the parent
packages `verl`, `verl.utils` and `verl.utils.kernel` are registered as empty packages whose search
path is the installed folder (their `__init__` files are not run), and the two kernel modules are
then loaded from the installed files with importlib under their own names.

On CPU the host functions' `assert`s are compiled out (`compile(..., optimize=1)`): they check
`tensor.is_cuda` before launching, and with them verl cannot run in the Triton interpreter. Its
other asserts are preconditions the LM-head workload meets (2-D contiguous inputs on one device)
but one, `hidden % 128 == 0`, which its subject checks itself (`lm_heads.verl_refusal`). The
kernels are Triton functions, compiled from their source by Triton, so they are unchanged. On a
GPU the files are loaded as they are.
"""

import importlib.util
import sys
import types
from pathlib import Path

PARENTS = ("verl", "verl.utils", "verl.utils.kernel")
KERNEL_MODULES = ("verl.utils.kernel.kernels", "verl.utils.kernel.linear_cross_entropy")


def _installed_root() -> Path:
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("verl is not installed (pip install --no-deps verl==0.9.1)")
    return Path(next(iter(spec.submodule_search_locations)))


def _load(name: str, path: Path, strip_asserts: bool):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    code = compile(path.read_text(), str(path), "exec", optimize=1 if strip_asserts else 0)
    sys.modules[name] = module
    try:
        exec(code, module.__dict__)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def linear_cross_entropy(strip_asserts: bool):
    """verl's `linear_cross_entropy(hidden, weight, labels, temperature, reduction, dist_process_group)
    -> (logprobs, entropy)`, loaded once per process (a second call returns the first load)."""
    loaded = sys.modules.get(KERNEL_MODULES[-1])
    if loaded is not None:
        return loaded.linear_cross_entropy
    root = _installed_root()
    for name in PARENTS:
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = [str(root.joinpath(*name.split(".")[1:]))]
            sys.modules[name] = package
    for name in KERNEL_MODULES:
        module = _load(name, root.joinpath(*name.split(".")[1:]).with_suffix(".py"), strip_asserts)
    return module.linear_cross_entropy
