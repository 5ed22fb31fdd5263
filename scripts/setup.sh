#!/usr/bin/env bash
# Set up nlq in ./.venv (idempotent). Usage: bash scripts/setup.sh
# - CPU machines: installs the CPU build of torch 2.13.0 before anything else, so that
#   the plain `torch` requirement is already satisfied and pip never pulls a CUDA build.
# - GPU machines: install your CUDA torch into the venv first (see README); it is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${NLQ_VENV:-.venv}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip_() { "$VENV/bin/python" -m pip -q --disable-pip-version-check "$@" 2>&1 | grep -v "^WARNING: Location" || true; }
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && [ -z "${NLQ_CPU_TORCH:-}" ]; then
    echo "setup: a GPU is present and the venv has no torch: installing the default (CUDA) torch build"
    pip_ install "torch>=2.5"
  else
    echo "setup: installing the CPU build of torch (torch==${NLQ_TORCH_VERSION:-2.13.0}, CPU wheel index as fallback)"
    pip_ install "torch==${NLQ_TORCH_VERSION:-2.13.0}" \
      || pip_ install "torch==${NLQ_TORCH_VERSION:-2.13.0}" --index-url https://download.pytorch.org/whl/cpu
  fi
fi
pip_ install -e ".[dev]"
"$VENV/bin/python" -c "import torch, nlq; print(f'setup: nlq {nlq.__version__}, torch {torch.__version__}, cuda={torch.cuda.is_available()}')"
