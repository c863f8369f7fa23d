"""slime's real source, importable in the tests: `load()` puts the slime checkout named by
FUSEDRL_SLIME_SRC on `sys.path`, so the tests run slime's own loss wrapper, batch builder, rollout
conversion, log-prob path and argument parser instead of a re-implementation of them.

FUSEDRL_SLIME_SRC is a slime checkout root (holding the `slime/` package and `train.py`); CI
(`.ci/run`) points it at `../shared/upstream/slime`. A test module calls `require()` at import:
unset, the module skips with that reason; set to a folder that is not a slime checkout, it fails.
slime itself is imported (`load()`) only in the spawned workers that run it, so the stubs below
never reach the pytest process.

slime imports a few things a CPU test machine cannot: only those are stubbed, each at the import
boundary, and only when the real package is missing (an installed one is always used):

- `ray`: the cluster runtime. slime's actors are plain classes here (`ray.remote` returns what it
  decorates) and the object store is the identity (`ray.put` / `ray.get` hand the object back), so
  a test calls the actor methods that turn rollouts into training data in its own process.
- `httpx`: the HTTP client slime talks to SGLang servers with (`slime.utils.http_utils`); no test
  sends a request.
- `sglang_router`: SGLang's router, a compiled extension not installed on CPU; slime imports its
  `RouterArgs` to register the router flags.
- `megatron.training`: Megatron-LM's training package, not part of the `megatron-core` wheel up
  to 0.16 (megatron-core 0.19's wheel ships one that needs Python >= 3.12: where it does not import,
  it is stubbed too). `global_vars.set_args` / `get_args` keep the args as Megatron's do (slime's
  train actor sets them and hooks read them back); nothing else from it runs.
- `wandb`: experiment tracking (a network client), imported by slime's logging setup.
- `torch_memory_saver`: GPU memory offloading (CUDA only), imported by slime's train actor.
- `zstandard`: the compressor of the delta weight updater's disk format (`--update-weight-mode
  delta`), not among the test dependencies; no test writes that format.

slime picks its device through `slime.utils.accelerator` (CUDA or MUSA); `load()` registers and
selects a CPU backend there, through slime's own `register_accelerator` / `set_accelerator`.

`parse_known_args` stands in for `slime.utils.arguments.parse_args`, whose Megatron half needs
`megatron.training`: it runs everything of slime's parse that does not (see its docstring).

Any other name of a stubbed package resolves to a placeholder class that raises when called or
instantiated, naming the stub: a test that strays onto a stubbed path fails loudly, never quietly.
"""

import argparse
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types

import pytest

ENV_VAR = "FUSEDRL_SLIME_SRC"

# Stubbed package -> why a CPU test machine cannot import the real one.
STUBS = {
    "ray": "the Ray cluster runtime (actors and object store) is not installed on the CPU test machine",
    "httpx": "slime's HTTP client for SGLang servers; the tests send no request",
    "sglang_router": "SGLang's router is a compiled extension, not installed on CPU",
    "megatron.training": "Megatron-LM's training package is not part of the megatron-core wheel",
    "wandb": "experiment tracking client (network), imported by slime's logging setup",
    "torch_memory_saver": "GPU memory offloading, CUDA only",
    "zstandard": "the delta weight updater's compressor, not among the test dependencies",
}


def _placeholder(qualified: str, why: str) -> type:
    """A class standing for `qualified`: usable in annotations, as a base or in isinstance
    checks, but calling or instantiating it raises."""

    def refuse(*args, **kwargs):
        raise RuntimeError(f"{qualified} is stubbed by tests/test_slime/upstream_slime.py ({why}) and cannot run")

    return type(qualified.rpartition(".")[2], (), {"__init__": refuse, "__module__": qualified.rpartition(".")[0]})


class _StubModule(types.ModuleType):
    """A stubbed (sub)module: explicit attributes as set, any other name a placeholder."""

    def __init__(self, name: str, why: str):
        super().__init__(name, f"stub: {why}")
        self.__path__ = []  # a package, so its submodules import
        self.__why__ = why

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        value = _placeholder(f"{self.__name__}.{attr}", self.__why__)
        setattr(self, attr, value)
        return value


def _stub_root(name: str):
    for root in STUBS:
        if name == root or name.startswith(root + "."):
            return root
    return None


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves the stubbed packages (and any submodule of them) to `_StubModule`s. It sits first on
    `sys.meta_path` but answers only for the packages left in STUBS, which are missing or do not
    import here, so a really installed, working package always wins."""

    def find_spec(self, name, path=None, target=None):
        root = _stub_root(name)
        if root is None:
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        module = _StubModule(spec.name, STUBS[_stub_root(spec.name)])
        _FILL.get(spec.name, lambda module: None)(module)
        return module

    def exec_module(self, module):
        pass


def _fill_ray(module) -> None:
    def remote(*args, **kwargs):
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]  # @ray.remote on a class or function: the plain object
        return lambda target: target  # @ray.remote(num_gpus=...)

    module.remote = remote
    module.put = lambda value, **kwargs: value
    module.get = lambda ref, **kwargs: ref
    module.is_initialized = lambda: False


def _fill_megatron_global_vars(module) -> None:
    holder = {}

    def set_args(args):
        holder["args"] = args

    def get_args():
        if "args" not in holder:
            raise RuntimeError("megatron.training.global_vars.get_args() before set_args(args)")
        return holder["args"]

    module.set_args, module.get_args = set_args, get_args


_FILL = {"ray": _fill_ray, "megatron.training.global_vars": _fill_megatron_global_vars}


def require() -> str:
    """The slime checkout FUSEDRL_SLIME_SRC names (absolute). Unset, the calling test module is
    skipped with that reason; naming no slime checkout, it fails. Changes nothing else."""
    root = os.environ.get(ENV_VAR)
    if not root:
        pytest.skip(
            f"{ENV_VAR} is not set: point it at a slime checkout (the folder holding slime/ and train.py)",
            allow_module_level=True,
        )
    root = os.path.abspath(root)
    if not (os.path.isfile(os.path.join(root, "slime", "__init__.py")) and os.path.isfile(os.path.join(root, "train.py"))):
        raise RuntimeError(f"{ENV_VAR}={root!r} is not a slime checkout: slime/__init__.py and train.py must be there")
    return root


def _stub_missing_packages() -> None:
    """Register the stub finder once, for the packages that are missing or do not import."""
    if any(isinstance(finder, _StubFinder) for finder in sys.meta_path):
        return
    for name in list(STUBS):
        parent = name.rpartition(".")[0]
        if (not parent or importlib.util.find_spec(parent) is not None) and _installed(name):
            if name not in IMPORT_CHECKED or _imports(name):
                del STUBS[name]
    sys.meta_path.insert(0, _StubFinder())


# Installed packages that may still not import on this Python, tried before they are trusted.
IMPORT_CHECKED = {"megatron.training"}  # megatron-core 0.19's: `from typing import override` (Python >= 3.12)


def _imports(name: str) -> bool:
    """Whether `name` imports; a failed import leaves none of its modules behind."""
    try:
        importlib.import_module(name)
        return True
    except ImportError:
        for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[module]
        return False


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def load() -> str:
    """Make slime's source importable (stubs included); returns the checkout root. Idempotent.

    The stubs stay for the life of the process and would stand in for those packages for any
    code, so call it only in the spawned workers that run slime, never in the pytest process
    (where SGLang's own tests must see the packages as missing)."""
    root = require()
    _stub_missing_packages()
    if root not in sys.path:
        sys.path.insert(0, root)
    import slime

    if not os.path.abspath(slime.__file__).startswith(os.path.join(root, "slime")):
        raise RuntimeError(f"`import slime` found {slime.__file__}, not the checkout {ENV_VAR}={root}")
    _select_cpu_accelerator()
    return root


def _select_cpu_accelerator() -> None:
    """slime's device calls (`accelerator.current_device()`, ...) answer "cpu"."""
    import torch
    from slime.utils import accelerator

    class CPUAccelerator(accelerator.Accelerator):
        name = device_type = "cpu"
        communication_backend_name = "gloo"

        def is_available(self):
            return True

        def device(self, index=None):
            return torch.device("cpu")

        def device_name(self, index=None):
            return "cpu"

        def set_device(self, index):
            pass

        def current_device(self):
            return "cpu"

        def device_count(self):
            return 1

        def synchronize(self, device=None):
            pass

        def current_stream(self, device=None):
            return None

        def empty_cache(self):
            pass

        def mem_get_info(self, device=None):
            return (0, 0)

        def memory_allocated(self, device=None):
            return 0

        def memory_reserved(self, device=None):
            return 0

    accelerator.register_accelerator("cpu", CPUAccelerator, lambda: True, communication_backends=("gloo",))
    accelerator.set_accelerator(CPUAccelerator())


def parse_known_args(argv, add_custom_arguments=None):
    """`(args, unknown)`: slime's `parse_args(add_custom_arguments)` on `argv`, less what needs
    Megatron-LM's training package or an SGLang server.

    As slime does: its provider registers `add_custom_arguments`' flags first, then slime's own, on
    an `ArgumentParser(allow_abbrev=False)` parsed with `parse_known_args` (Megatron's
    `ignore_unknown_args=True`: `unknown` is what slime drops); the pre-parsed mode flags are
    merged in and `slime_validate_args` runs. Left out: Megatron's own flags and
    `validate_args`, SGLang's server flags and checks (slime parses them apart from these).
    """
    import sys

    from slime.utils import arguments

    parser = argparse.ArgumentParser(allow_abbrev=False)
    arguments.get_slime_extra_args_provider(add_custom_arguments)(parser)
    saved, sys.argv = sys.argv, ["train.py", *argv]  # slime's pre-parse reads sys.argv
    try:
        args, unknown = parser.parse_known_args(argv)
        for key, value in vars(arguments._pre_parse_mode()).items():
            setattr(args, key, value)
    finally:
        sys.argv = saved
    arguments.slime_validate_args(args)
    return args, unknown
