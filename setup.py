"""Installs fusedrl: the three code folders become subpackages of one import name.

`kernels/` installs as `fusedrl.kernels` (not top-level `kernels`, which would shadow the PyPI
package of that name that transformers probes for), `slime_ext/` as `fusedrl.slime_ext` and
`sglang_plugin/` as `fusedrl.sglang_plugin`.

triton is a requirement on Linux, where its wheels exist: a CUDA build of torch brings it anyway
(pinned to the matching version), and a CPU-only torch does not, yet CPU tensors need it to run the
kernels through the Triton interpreter. triton itself requires no torch, so it never replaces the
torch already installed. Elsewhere the package runs its float64 eager reference on CPU.

Supported Triton: 3.6 through the newest (CI runs the kernel tests, interpreted and compiled for
sm_90, on 3.6.0, on the 3.8.0 that torch 2.14.1 pins, and on the newest; .ci/triton-matrix). The
floor was 3.1 until the kernels were tested on a range; nothing before 3.6 is tested. Triton 3.6's
interpreter (not its compiler) needs numpy < 2.4, which the package checks when it interprets.
"""

from setuptools import find_packages, setup

CODE_FOLDERS = {
    "fusedrl.kernels": "kernels",
    "fusedrl.slime_ext": "slime_ext",
    "fusedrl.sglang_plugin": "sglang_plugin",
}


def subpackages(code_folders):
    """{import name: folder} for every package under the code folders, nested ones included."""
    mapping = {}
    for name, folder in code_folders.items():
        mapping[name] = folder
        for nested in find_packages(folder):
            mapping[f"{name}.{nested}"] = f"{folder}/{nested.replace('.', '/')}"
    return mapping


SUBPACKAGES = subpackages(CODE_FOLDERS)

setup(
    name="fusedrl",
    version="0.1.0",
    description="Fused Triton kernels for policy-gradient losses of LLM RL, as a drop-in for slime",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=list(SUBPACKAGES),
    package_dir=SUBPACKAGES,
    install_requires=["torch>=2.4", "numpy", 'triton>=3.6; platform_system == "Linux"'],
    extras_require={
        "test": [
            "megatron-core>=0.16,<0.20",  # tested: 0.16.1 (the test stack), 0.19.2 (.ci/megatron-core-newest)
            "pytest>=8",
            "pytest-timeout",
            "hypothesis",
            "pytest-benchmark",
            "matplotlib",
            "pylatexenc",  # imported by slime's reward hub, which the training-loop test runs
        ],
        # liger-kernel: the bench's Liger subjects (its fused linear scaled cross entropy is new in 0.8.5)
        "bench": ["matplotlib", "pytest-benchmark", "liger-kernel>=0.8.5,<0.9"],
        # verl: the bench's `verl` subject, slime's --log-probs-backend triton. Apart from `bench`
        # because verl declares its whole trainer stack (ray, wandb, datasets, transformers < 5.11,
        # which SGLang's test stack contradicts) while the kernel needs torch, triton and packaging
        # only: install it with `pip install --no-deps verl==0.9.1` (bench/rivals/verl_import.py).
        "bench-verl": ["verl==0.9.1"],
    },
    entry_points={
        "sglang.srt.plugins": [
            "fusedrl_token_samples = fusedrl.sglang_plugin.plugin:register",
            "sglang_token_samples = fusedrl.sglang_plugin.plugin:register",
        ],
    },
)
