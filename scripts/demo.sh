#!/usr/bin/env bash
# Runs the demo (examples/quickstart.py) in a virtualenv of its own (.venv-demo) that this script creates and fills
# by itself with what the demo needs: torch, the package and its ort extra (ONNX Runtime training and onnx); not the
# dev extra the tests need (scripts/test.sh, .venv). Each install step prints a line when it starts and ends.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-demo
EXTRA=ort
source scripts/env.sh
exec "$VENV/bin/python" examples/quickstart.py "$@"
