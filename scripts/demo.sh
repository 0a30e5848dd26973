#!/usr/bin/env bash
# Runs the demo (examples/quickstart.py) in a project-local virtualenv that this script creates and fills by itself.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
exec "$VENV/bin/python" examples/quickstart.py "$@"
