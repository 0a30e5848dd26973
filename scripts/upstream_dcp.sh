#!/usr/bin/env bash
# PyTorch's own DCP test files, run with our storage swapped in for FileSystemWriter/FileSystemReader, and again
# with DCP's own storage as the control (a test failing in both is the environment's, not ours). Not part of the
# test suite: it needs a PyTorch source checkout, which CI does not have.
#
#   scripts/upstream_dcp.sh /path/to/pytorch [ours|stock|both] [--cpu]
#
# --cpu also lifts the tests' "needs N GPUs" gates, so the DTensor cases written for GPUs run on CPU with gloo.
# Prints passed / failed / skipped per file; the pytest output and JUnit files go to $UPSTREAM_DCP_OUT (a
# temporary folder unless set). $UPSTREAM_DCP_FILES: some of the files only (paths under
# test/distributed/checkpoint, space-separated); $PYTHON: the interpreter (default: the project's .venv, which
# also needs `expecttest`, imported by torch's test helpers). The swap is scripts/upstream_dcp_shim/sitecustomize.py
# (ours); the tests are theirs and stay in their checkout.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
SRC="$(cd "${1:?usage: $0 /path/to/pytorch [ours|stock|both] [--cpu]}" && pwd)"
MODE="${2:-both}"
CPU=0
[[ "${3:-}" == "--cpu" ]] && CPU=1
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
[[ -x "$PYTHON" ]] || PYTHON=python
OUT="${UPSTREAM_DCP_OUT:-$(mktemp -d)}"
FILES=(test_file_system_checkpoint_cpu.py test_dtensor_resharding.py test_format_utils.py test_save_load_api.py
       e2e/test_e2e_save_and_load.py)
[[ -n "${UPSTREAM_DCP_FILES:-}" ]] && read -r -a FILES <<<"$UPSTREAM_DCP_FILES"  # a subset, space-separated
case "$MODE" in both) STORAGES=(ours stock) ;; ours|stock) STORAGES=("$MODE") ;; *) echo "mode: ours, stock or both" >&2; exit 2 ;; esac

for storage in "${STORAGES[@]}"; do
  for file in "${FILES[@]}"; do
    name="${file//\//_}"
    (cd "$SRC" && UPSTREAM_DCP_STORAGE="$storage" UPSTREAM_DCP_CPU="$CPU" \
       PYTHONPATH="$ROOT:$ROOT/scripts/upstream_dcp_shim${PYTHONPATH:+:$PYTHONPATH}" \
       timeout 1800 "$PYTHON" -m pytest -p no:cacheprovider -p no:logging -q -rfEs --tb=short \
       --junitxml="$OUT/$storage-$name.xml" "test/distributed/checkpoint/$file" >"$OUT/$storage-$name.log" 2>&1) || true
  done
done

"$PYTHON" - "$OUT" "${STORAGES[@]}" -- "${FILES[@]}" <<'EOF'
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

out, rest = Path(sys.argv[1]), sys.argv[2:]
storages, files = rest[:rest.index("--")], rest[rest.index("--") + 1:]
print(f"{'file':40} " + " ".join(f"{s + ' pass/fail/skip':>22}" for s in storages))
for file in files:
    cells = []
    for storage in storages:
        xml = out / f"{storage}-{file.replace('/', '_')}.xml"
        if not xml.exists():
            cells.append("no result (see log)")
            continue
        suite = ET.parse(xml).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        total, failed = int(suite.get("tests", 0)), int(suite.get("failures", 0)) + int(suite.get("errors", 0))
        skipped = int(suite.get("skipped", 0))
        cells.append(f"{total - failed - skipped}/{failed}/{skipped}")
    print(f"{file:40} " + " ".join(f"{c:>22}" for c in cells))
print(f"logs and JUnit files: {out}")
EOF
