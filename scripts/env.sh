# Sourced by demo.sh, test.sh and floor.sh: make sure $VENV (default .venv) holds the project with its $EXTRA extra
# (default dev: what the tests need; demo.sh asks for ort, the package and ONNX Runtime only, in .venv-demo).
# torch is pinned to the CPU build these machines carry; a loose requirement would pull GB of CUDA wheels.
# pip runs only when pyproject.toml or the extra pins ($PINS) changed since the last complete install (a stamp in
# $VENV records their hash), so a complete .venv works offline. An install takes minutes: each step prints a line
# when it starts and when it ends (with its time), and pip prints a line per package it collects and installs.
VENV="${VENV:-.venv}"
EXTRA="${EXTRA:-dev}"
PINS="${PINS:-}"
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"
STAMP="$VENV/.installed-$(cat pyproject.toml <(echo "$EXTRA $PINS") | sha256sum | cut -c1-16)"
_env_step() {  # _env_step "what" command...: "[env] what ..." before, "[env] what: done in N s" after
  local what="$1" start=$SECONDS
  shift
  echo "[env] $what ..."
  "$@"
  echo "[env] $what: done in $((SECONDS - start)) s"
}
_env_pip() {  # pip's own lines (Collecting, Downloading, Installing...), without its notes about locations
  # shellcheck disable=SC2086  # PINS is a list of requirements
  "$VENV/bin/python" -m pip install --disable-pip-version-check --progress-bar off "torch==2.13.0" -e ".[$EXTRA]" $PINS \
    2>&1 | { grep --line-buffered -v "^WARNING: Location" || true; }
}
if [ ! -f "$STAMP" ] || [ ! -x "$VENV/bin/python" ]; then
  if [ ! -x "$VENV/bin/python" ]; then
    _env_step "creating the virtualenv $VENV ($PYTHON)" "$PYTHON" -m venv "$VENV"
  fi
  _env_step "installing torch 2.13.0 (CPU) and the project with its $EXTRA extra into $VENV${PINS:+ (with $PINS)}" _env_pip
  rm -f "$VENV"/.installed-*
  touch "$STAMP"
else
  echo "[env] $VENV is up to date with pyproject.toml: nothing to install"
fi
