# Sourced by demo.sh and test.sh: make sure .venv exists and holds the project with its dev extra.
# torch is pinned to the CPU build these machines carry; a loose requirement would pull GB of CUDA wheels.
VENV="${VENV:-.venv}"
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "torch==2.13.0" -e ".[dev]" 2>&1 \
  | { grep -v "^WARNING: Location" || true; }
