#!/usr/bin/env bash
# Set up (idempotent), then test. With no arguments: `ruff check .` (any finding fails), the
# default tier (pyproject addopts: not slow, not dist; gpu tests skip without CUDA), then the
# dist tier (-m dist, torchrun on CPU); fails if any of them fails. With arguments: one pytest
# run with them, e.g. `bash scripts/test.sh -m slow`. pytest's exit 5 ("no tests collected")
# fails too.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
PY=.venv/bin/python

pytest_() {
  "$PY" -m pytest -q "$@"
  local rc=$?
  if [ "$rc" -eq 5 ]; then echo "test.sh: pytest collected no tests: failing" >&2; return 1; fi
  return "$rc"
}

if [ "$#" -gt 0 ]; then
  pytest_ "$@"
  exit $?
fi
failed=()
"$PY" -m ruff check . || failed+=("ruff check")
pytest_ || failed+=("default tier")
pytest_ -m dist || failed+=("dist tier")
if [ "${#failed[@]}" -gt 0 ]; then
  echo "test.sh: failed: ${failed[*]}" >&2
  exit 1
fi
