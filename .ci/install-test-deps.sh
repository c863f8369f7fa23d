#!/usr/bin/env bash
# Installs fusedrl and everything its tests need into the active virtual environment, CPU only.
#
# It refuses to run outside a virtual environment: it replaces the environment's torch and installs
# SGLang without its dependencies (`pip check` then reports them as missing), which would break a
# training or serving environment it was run in by mistake.
#
# torch comes first and pinned: SGLang 0.5.23 pins torch 2.14.1 (a CUDA build that runs on CPU)
# and its config package needs the matching torchvision. Everything after it is installed so that
# no dependency can pull another torch: SGLang and its CPU subset with --no-deps (its wheel
# requires CUDA-only packages), the rest against the torch already present.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if ! python -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)'; then
    echo "install-test-deps.sh: refusing to install outside a virtual environment ($(python -c 'import sys; print(sys.prefix)')):" >&2
    echo "it force-installs torch 2.14.1 and SGLang --no-deps. Make one first:" >&2
    echo "  python3 -m venv .venv && source .venv/bin/activate && bash .ci/install-test-deps.sh" >&2
    exit 2
fi
# torch.compile on CPU (tests/test_compile.py) builds inductor's C++: it needs a compiler.
if ! command -v g++ >/dev/null; then
    if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null; then
        apt-get update -qq && apt-get install -y -qq g++
    else
        echo "install-test-deps.sh: torch.compile on CPU needs a C++ compiler: install g++ (apt-get install g++)" >&2
        exit 2
    fi
fi
python -m pip install -q torch==2.14.1 torchvision==0.29.1
python -m pip install -q -e "$here/..[test,bench]"
python -m pip install -q --no-deps sglang==0.5.23
python -m pip install -q --no-deps -r "$here/sglang-cpu-requirements.txt"
python -c "import torch; assert torch.__version__.startswith('2.14.1'), torch.__version__"
