"""Imports point one way: no module of the package (kernels, slime_ext, sglang_plugin) or of the
benchmark imports, directly or through others, a module that imports it back, counting imports
inside functions too (a function-level import must not be a way around a cycle), the kernels
import nothing of slime or SGLang, and the package nothing of the benchmark.

The graph is read from the source (every `import` and `from ... import` statement), so it covers
modules that cannot be imported here (the SGLang hooks without SGLang, say)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kernels", "slime_ext", "sglang_plugin", "bench")


def module_files():
    """Dotted module name (as the repository's folders name them) -> file."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _own_name(name: str) -> str:
    """`fusedrl.slime_ext.x` as the repository's folders name it: `slime_ext.x`."""
    return name.removeprefix("fusedrl.")


def imported_modules(module: str, path: Path, modules) -> set:
    """The package's modules that `module` imports anywhere in its source."""
    here = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(_own_name(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = _own_name(node.module or "")
            for alias in node.names:  # `from package import submodule` imports the submodule
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {name for name in found if name in modules and name != module}


def import_graph():
    modules = module_files()
    return {module: imported_modules(module, path, modules) for module, path in modules.items()}


def cycles(graph) -> list:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph[node]):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_kernels_import_nothing_of_the_integrations():
    graph = import_graph()
    for module, imported in graph.items():
        if module.startswith("kernels"):
            assert {name for name in imported if not name.startswith("kernels")} == set(), module


def test_the_package_imports_nothing_of_the_benchmark():
    """The package never reaches the benchmark's modules, so neither the test-only stand-ins nor
    the loop's support (bench/slime_loop/) that the tests share with the stale-rollouts study."""
    graph = import_graph()
    for module, imported in graph.items():
        if not module.startswith("bench"):
            assert {name for name in imported if name.startswith("bench")} == set(), module


@pytest.mark.parametrize(
    "edges, expected",
    [
        ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
        ({"a": {"b"}, "b": {"a"}, "c": {"a"}}, [["a", "b"]]),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"d"}}, [["a", "b", "c"]]),
    ],
)
def test_cycle_finder(edges, expected):
    assert cycles(edges) == expected


def test_graph_sees_function_level_imports(tmp_path):
    (tmp_path / "a.py").write_text("def f():\n    from . import b\n")
    modules = {"pkg.a": tmp_path / "a.py", "pkg.b": tmp_path / "b.py"}
    assert imported_modules("pkg.a", modules["pkg.a"], modules) == {"pkg.b"}
