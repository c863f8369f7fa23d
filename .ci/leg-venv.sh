# Sourced by CI's side legs (.ci/triton-matrix, .ci/megatron-core-newest): the leg's own small
# virtual environment, made in two steps so that .ci/run can take the slow one early.
#
#   leg_venv INSTALL_FUNCTION
#
# sets $venv to LEG_VENV (default: a fresh temporary folder's venv), makes it and runs
# INSTALL_FUNCTION PYTHON there unless an earlier call did (the marker file .deps-installed), then
# installs fusedrl from this checkout (--no-deps -e .). With LEG_STEP=deps it stops the leg after
# the dependencies: .ci/run does that for every leg on the second core while its own install runs
# on the first, and builds nothing in the checkout then (the editable install does).
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
    "$venv/bin/python" -m pip install -q --no-deps -e .
}
