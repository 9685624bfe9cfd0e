# Sourced by the optional tiers' setup scripts: tier_venv VENV EXTRAS creates (or reuses) a virtual
# environment with torch ${TORCH_VERSION:-2.13.0} installed first (the CPU wheel here; an existing
# torch is kept) and then rlrecipes with EXTRAS; it sets PY to the venv's python.
tier_venv() {
  local venv="$1" extras="$2"
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  PY="$venv/bin/python"
  "$PY" -m pip install --quiet --upgrade pip
  "$PY" -c "import torch" >/dev/null 2>&1 || "$PY" -m pip install --quiet "torch==${TORCH_VERSION:-2.13.0}"
  "$PY" -m pip install --quiet -e ".[$extras]"
}
