"""What a fresh install gets: the package metadata (triton on Linux, the license) and the test
dependency script's refusal to touch an environment that is not a virtual environment."""

import importlib.metadata
import os
import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]


def test_triton_is_a_linux_requirement_and_torch_stays_unpinned():
    # A CPU-only torch brings no triton; the interpreter path needs it, so the package asks for it
    # where its wheels exist, without pinning torch (a training image keeps its own).
    requirements = {req.name: req for req in map(Requirement, importlib.metadata.requires("fusedrl"))}
    triton = requirements["triton"]
    assert triton.marker is not None and triton.marker.evaluate({"platform_system": "Linux"})
    assert not triton.marker.evaluate({"platform_system": "Darwin", "extra": ""})
    assert str(requirements["torch"].specifier) == ">=2.4"


def test_license_is_apache_2():
    assert importlib.metadata.metadata("fusedrl")["License"] == "Apache-2.0"
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")


def test_install_script_refuses_outside_a_virtual_environment(tmp_path):
    # The script pins torch and installs SGLang without its dependencies: run by mistake in a
    # training environment, it would replace that environment's torch. It must stop before pip.
    base_python = Path(sys.base_prefix) / "bin" / "python3"
    (tmp_path / "python").symlink_to(base_python)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
    env["PATH"] = f"{tmp_path}{os.pathsep}{env['PATH']}"
    done = subprocess.run(
        ["bash", str(ROOT / ".ci" / "install-test-deps.sh")], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert "refusing to install outside a virtual environment" in done.stderr
    assert "python3 -m venv" in done.stderr
    assert "pip" not in done.stdout


def test_a_regular_install_ships_every_subpackage(tmp_path):
    # An editable install finds nested folders through the parent's path; a wheel holds only the
    # packages setup.py lists, so a folder missing there would import here and fail for users.
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(ROOT)],
        check=True, capture_output=True, timeout=300,
    )
    (wheel,) = tmp_path.glob("fusedrl-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        shipped = {Path(name).parent for name in archive.namelist() if name.endswith("__init__.py")}
    for folder in ("kernels", "slime_ext", "sglang_plugin"):
        for init in (ROOT / folder).rglob("__init__.py"):
            assert Path("fusedrl") / init.parent.relative_to(ROOT) in shipped, init
