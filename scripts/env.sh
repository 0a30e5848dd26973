# Sourced by demo.sh, test.sh and floor.sh: make sure $VENV (default .venv) holds the project with its dev extra.
# torch is pinned to the CPU build these machines carry; a loose requirement would pull GB of CUDA wheels.
# pip runs only when pyproject.toml or the extra pins ($PINS) changed since the last complete install (a stamp in
# $VENV records their hash), so a complete .venv works offline.
VENV="${VENV:-.venv}"
PINS="${PINS:-}"
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"
STAMP="$VENV/.installed-$(cat pyproject.toml <(echo "$PINS") | sha256sum | cut -c1-16)"
if [ ! -f "$STAMP" ] || [ ! -x "$VENV/bin/python" ]; then
  if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
  fi
  # shellcheck disable=SC2086  # PINS is a list of requirements
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "torch==2.13.0" -e ".[dev]" $PINS 2>&1 \
    | { grep -v "^WARNING: Location" || true; }
  rm -f "$VENV"/.installed-*
  touch "$STAMP"
fi
