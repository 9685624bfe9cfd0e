#!/usr/bin/env bash
# The megatron-core tier on CPU: a virtual environment (.venv-megatron) with torch 2.13.0 (CPU),
# megatron-core (0.16.1 is the newest for Python 3.11; 0.19.x needs Python >= 3.12) and rlrecipes.
# megatron-core computes on CUDA only; on CPU its modules build (use_cpu_initialization), which is
# what tests/megatron_tier checks (names, shapes, HF weights loaded exactly).
#   bash scripts/setup_megatron_cpu.sh && .venv-megatron/bin/python -m pytest -q tests/megatron_tier
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/tier_venv.sh
VENV="${MEGATRON_VENV:-.venv-megatron}"
tier_venv "$VENV" test,megatron
"$PY" -W ignore -c "import megatron.core as m, torch; print(f'megatron-core {m.__version__} ready in $VENV (torch {torch.__version__})')"
