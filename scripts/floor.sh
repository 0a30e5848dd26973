#!/usr/bin/env bash
# The smoke suite (tests marked `smoke`) on the oldest Lightning we support: the floor pinned in pyproject.toml,
# installed in a venv of its own (.venv-floor). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
FLOOR="$(sed -n 's/^ *"pytorch-lightning>=\([0-9.]*\)".*/\1/p' pyproject.toml)"
[ -n "$FLOOR" ] || { echo "floor.sh: no pytorch-lightning>=X.Y.Z in pyproject.toml" >&2; exit 1; }
VENV=.venv-floor
PINS="pytorch-lightning==$FLOOR lightning==$FLOOR"
source scripts/env.sh
echo "smoke suite on pytorch-lightning and lightning $FLOOR"
exec "$VENV/bin/python" -m pytest -m smoke "$@"
