# shellcheck shell=bash
# Shared by scripts/test and scripts/demo: logging and the .venv bootstrap.

log() { printf '==> %s\n' "$*" >&2; }
die() { printf '%s: %s\n' "$(basename "$0")" "$*" >&2; exit 1; }

# ensure_venv SPEC: create .venv when missing, then install SPEC ('.[server]' or '.[dev]') into it.
ensure_venv() {
    local spec=$1
    # Check for the interpreter, not the directory: a failed `venv` leaves a husk behind.
    if [[ ! -x .venv/bin/python ]]; then
        local python=${PYTHON:-python3}
        command -v "$python" >/dev/null || die "$python not found; install Python >= 3.11"
        "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
            || die "$python is $("$python" -V 2>&1); this project needs Python >= 3.11 (set PYTHON=...)"
        log "creating .venv with $("$python" -V 2>&1)"
        "$python" -m venv .venv || {
            rm -rf .venv
            die "could not create .venv (Debian/Ubuntu: sudo apt-get install python3-venv)"
        }
    fi
    # Always install: it is quick when nothing changed, and new dependencies land on pull.
    .venv/bin/python -m pip install --quiet --disable-pip-version-check -e "$spec"
}
