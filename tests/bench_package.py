"""The repository's `bench` package for the tests, imported without putting the repository root on
sys.path (which would also expose the top-level `kernels` folder)."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def import_bench():
    """The `bench` package (imported once, then taken from sys.modules)."""
    if "bench" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "bench", ROOT / "bench" / "__init__.py", submodule_search_locations=[str(ROOT / "bench")]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules["bench"] = module
        spec.loader.exec_module(module)
    return sys.modules["bench"]
