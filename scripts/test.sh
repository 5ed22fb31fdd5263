#!/usr/bin/env bash
# Set up (idempotent) and run the default test tier. Extra args go to pytest,
# e.g. `bash scripts/test.sh -m slow`. pytest's exit 5 ("no tests collected") fails.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
.venv/bin/python -m pytest -q "$@"
rc=$?
if [ "$rc" -eq 5 ]; then echo "test.sh: pytest collected no tests: failing" >&2; exit 1; fi
exit "$rc"
