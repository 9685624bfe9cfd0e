#!/usr/bin/env bash
# Install rlrecipes and its test tools into the current Python environment.
# torch is installed first and pinned (2.13.0, CPU build here): an unpinned torch requirement
# with no torch present would pull several GB of CUDA wheels. On an accelerator host install the
# torch (+ torch_npu) build for your device first; this script then keeps it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m pip install --quiet "torch==${TORCH_VERSION:-2.13.0}"
fi
"$PY" -m pip install --quiet -e ".[test]"
"$PY" -c "import rlrecipes, torch; print(f'rlrecipes {rlrecipes.__version__} ready (torch {torch.__version__})')"
