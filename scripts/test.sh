#!/usr/bin/env bash
# Runs the whole test suite in a project-local virtualenv that this script creates and fills by itself, on two
# pytest-xdist workers (docs/testing.md, "pytest-xdist": each file on one worker, every rank launcher's file on the
# same one); TEST_WORKERS=0 runs it in one process, and extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
echo "[test] pytest on ${TEST_WORKERS:-2} worker(s) (TEST_WORKERS=0: one process) ..."
exec "$VENV/bin/python" -m pytest -n "${TEST_WORKERS:-2}" "$@"
