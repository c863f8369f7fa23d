# Sourced by CI's side legs (.ci/triton-matrix, .ci/megatron-core-newest): the leg's own small
# virtual environment, made in two steps so that .ci/run can take the slow one early.
#
#   leg_venv INSTALL_FUNCTION
#
# sets $venv to LEG_VENV (default: a fresh temporary folder's venv), makes it and runs
# INSTALL_FUNCTION PYTHON there unless an earlier call did (the marker file .deps-installed), then
# installs fusedrl (--no-deps) from a copy of this checkout's files beside the venv (tracked and
# untracked, not the ignored ones): its build writes only into the copy, never into the checkout,
# so a leg can install and run on the second core while the main environment's editable install
# builds in the checkout on the first (.ci/run). With LEG_STEP=deps it stops after the
# dependencies (.ci/run installs every leg's first, then runs them).
#
#   leg_torch PYTHON
#
# (for INSTALL_FUNCTION) gives the venv of PYTHON the legs' torch, LEG_TORCH_SPEC (CPU build), with
# its dependencies. With LEG_TORCH set (.ci/run) they are installed once into that folder
# (pip --target) and each leg's venv reads them through a .pth file: every leg pins the same torch,
# whose unpacking is most of a leg's install (about 17 s of a core each). Without it, into the venv.
LEG_TORCH_SPEC="torch==2.13.0"
leg_torch() {
    local python=$1
    if [[ -z "${LEG_TORCH:-}" ]]; then
        "$python" -m pip install -q "$LEG_TORCH_SPEC"
        return
    fi
    if [[ ! -f "$LEG_TORCH/.installed" ]]; then
        "$python" -m pip install -q --target "$LEG_TORCH" "$LEG_TORCH_SPEC"
        touch "$LEG_TORCH/.installed"
    fi
    "$python" -c 'import sys, sysconfig; print(sys.argv[1], file=open(sysconfig.get_path("purelib") + "/leg-torch.pth", "w"))' "$LEG_TORCH"
}
leg_venv() {
    local install=$1
    venv="${LEG_VENV:-$(mktemp -d)/venv}"
    if [[ ! -f "$venv/.deps-installed" ]]; then
        python3 -m venv "$venv"
        "$install" "$venv/bin/python"
        touch "$venv/.deps-installed"
    fi
    if [[ "${LEG_STEP:-}" == deps ]]; then
        exit 0
    fi
    local copy
    copy="$(dirname "$venv")/fusedrl-src"
    rm -rf "$copy" && mkdir -p "$copy"
    git ls-files -z --cached --others --exclude-standard | tar --null --ignore-failed-read -T - -cf - | tar -xf - -C "$copy"
    "$venv/bin/python" -m pip install -q --no-deps "$copy"
}
