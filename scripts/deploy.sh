#!/usr/bin/env bash
# The deploy environment: the current plain `onnxruntime` (the [deploy] extra) and no onnxruntime-training, in a venv
# of its own (.venv-deploy), running the tests of what does not train with ORT: ONNX and safetensors export, loading
# outside a Trainer, the format, the CLI and the callback (against Lightning's ModelCheckpoint). Run by .ci/run after
# the main suite; extra arguments go to pytest. On 2 cores: the venv ~3 min once (1.3 GB), the 58 tests ~1 min.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-deploy
EXTRA=deploy
PINS="pytest>=7 safetensors>=0.4 transformers==5.24.0"  # what these tests use beyond the extra
source scripts/env.sh
if "$VENV/bin/python" -c "import onnxruntime.training" 2>/dev/null; then
  echo "deploy.sh: $VENV holds onnxruntime-training; this environment is for the plain onnxruntime only" >&2
  exit 1
fi
echo "deploy tests on onnxruntime $("$VENV/bin/python" -c 'import onnxruntime; print(onnxruntime.__version__)')" \
  "(no onnxruntime-training)"
# Each file's tests run whole, except the one that makes ORT training artifacts (onnxruntime-training only): it is
# deselected here, by name, and runs in the main suite.
exec "$VENV/bin/python" -m pytest tests/export_cli/test_export.py tests/export_cli/test_export_tied.py \
  tests/export_cli/test_export_callback.py tests/export_cli/test_export_runtime.py \
  tests/export_cli/test_export_safetensors.py tests/export_cli/test_loading.py tests/export_cli/test_cli.py \
  tests/format/test_schema.py tests/conformance/test_callback_differential.py \
  --deselect tests/export_cli/test_export.py::test_torch_checkpoints_export_and_make_artifacts "$@"
