"""The slime integration's layering: the rollout side, the carried-data definitions and the flags
load without the kernels (Triton) or the losses, and only `slime_ext/megatron.py` reaches Megatron."""

import ast
import pathlib
import subprocess
import sys

import fusedrl.slime_ext

PACKAGE = pathlib.Path(fusedrl.slime_ext.__file__).parent
LIGHT_MODULES = (
    "fusedrl.slime_ext.rollout.sfc_draws",
    "fusedrl.slime_ext.rollout.prompt_groups",
    "fusedrl.slime_ext.carry",
    "fusedrl.slime_ext.arguments",
    "fusedrl.slime_ext.train",
)
HEAVY_PREFIXES = ("triton", "fusedrl.kernels", "fusedrl.slime_ext.losses", "megatron")


def test_rollout_side_and_flags_load_without_kernels_or_losses():
    code = (
        f"import sys, {', '.join(LIGHT_MODULES)}\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] == 'triton' or m.startswith({HEAVY_PREFIXES!r})))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def _megatron_references(path: pathlib.Path):
    """Imports of megatron modules and `sys.modules` look-ups of them in one source file."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [node.value] if node.value.startswith("megatron.") else []
        for name in names:
            if name.split(".")[0] == "megatron":
                yield f"{path.relative_to(PACKAGE)}:{node.lineno}: {name}"


def test_only_the_megatron_module_reaches_megatron():
    sources = sorted(p for p in PACKAGE.rglob("*.py") if p.name != "megatron.py" or p.parent != PACKAGE)
    assert len(sources) > 10
    assert [ref for path in sources for ref in _megatron_references(path)] == []
    assert list(_megatron_references(PACKAGE / "megatron.py"))  # the check sees what it looks for
