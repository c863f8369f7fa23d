#!/usr/bin/env bash
# Installs fusedrl and everything its tests need into the active virtual environment, CPU only.
#
# It refuses to run outside a virtual environment: it replaces the environment's torch and
# installs SGLang 0.5.23 with every dependency it declares (sglang-kernel, flashinfer, transformers,
# ...), which would break a training or serving environment it was run in by mistake.
#
# torch comes first and pinned: SGLang 0.5.23 pins torch 2.14.1 (a CUDA build that runs on CPU)
# and its config package needs the matching torchvision. Every install after it runs under
# .ci/test-constraints.txt (those two pins), so no dependency can pull another torch. One package
# is installed with --no-deps, verl 0.9.1 alone (the bench's `verl` subject, bench/rivals/): it
# declares its whole trainer stack (ray[default], wandb, datasets, peft, hydra-core, tensordict,
# ... and transformers < 5.11, which SGLang's 5.19 contradicts), while the kernel the bench loads in
# isolation (verl/utils/kernel/{kernels,linear_cross_entropy}.py, through verl/utils/device.py and
# verl/plugin/platform/) imports only torch, triton and packaging, all three installed before it.
#
# Two of SGLang's GPU-only dependencies are taken out again (SGLang's CPU server runs without them,
# tests/test_sglang/test_sglang_server*.py):
# - PyPI's `kernels` (the Hugging Face kernel hub; SGLang imports it only in its FlashAttention-3
#   path). It registers a setuptools `egg_info.writers` entry point, `kernels.lockfile`, which
#   this checkout's own `kernels/` folder shadows whenever setuptools runs from the checkout
#   without build isolation (tests/test_slime/test_install.py builds a wheel so): "No module named
#   'kernels.lockfile'".
# - `sgl-flash-mla`: megatron-core imports `flash_mla` when present and catches only ImportError,
#   but without a CUDA driver its library load raises OSError, so every megatron-core model import
#   (the slime tests) fails.
# `pip check` must report nothing but these two and verl's undeclared trainer stack.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if ! python -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)'; then
    echo "install-test-deps.sh: refusing to install outside a virtual environment ($(python -c 'import sys; print(sys.prefix)')):" >&2
    echo "it force-installs torch 2.14.1 and SGLang 0.5.23 with its dependencies. Make one first:" >&2
    echo "  python3 -m venv .venv && source .venv/bin/activate && bash .ci/install-test-deps.sh" >&2
    exit 2
fi
# torch.compile on CPU (tests/test_kernels/test_compile.py) builds inductor's C++, and the SGLang server tests
# build a stand-in libcuda.so.1 with gcc (tests/test_sglang/sglang_server.py): they need the compilers.
if ! command -v g++ >/dev/null || ! command -v gcc >/dev/null; then
    if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null; then
        apt-get update -qq && apt-get install -y -qq gcc g++
    else
        echo "install-test-deps.sh: torch.compile on CPU and the SGLang server tests need gcc and g++ (apt-get install gcc g++)" >&2
        exit 2
    fi
fi
constraints="$here/test-constraints.txt"
# Each install's seconds go to FUSEDRL_INSTALL_TIMES when set (a line "PART SECONDS" each), for the
# install's parts in CI's summary (.ci/run).
timed() {  # timed PART COMMAND...
    local part=$1 part_started=$SECONDS
    shift
    "$@"
    if [[ -n "${FUSEDRL_INSTALL_TIMES:-}" ]]; then
        echo "$part $((SECONDS - part_started))" >> "$FUSEDRL_INSTALL_TIMES"
    fi
}
timed torch python -m pip install -q -c "$constraints" torch torchvision
timed sglang python -m pip install -q -c "$constraints" sglang==0.5.23
timed fusedrl python -m pip install -q -c "$constraints" -e "$here/..[test,bench]"
timed verl python -m pip install -q -c "$constraints" --no-deps "verl==0.9.1"  # the pin of setup.py's bench-verl extra
python -c "import packaging, triton"  # all the isolated verl kernel imports besides torch
removed=(kernels sgl-flash-mla)
timed uninstall python -m pip uninstall -q -y "${removed[@]}"
broken="$(timed pip-check python -m pip check | grep -vxF -e "sglang 0.5.23 requires kernels, which is not installed." \
    -e "sglang 0.5.23 requires sgl-flash-mla, which is not installed." | grep -v "^verl 0\.9\.1 \(requires\|has requirement\) " || true)"
if [[ -n "$broken" ]]; then
    echo "install-test-deps.sh: pip check: $broken" >&2
    exit 1
fi
python -c "import torch; assert torch.__version__.startswith('2.14.1'), torch.__version__"
