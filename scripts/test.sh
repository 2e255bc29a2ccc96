#!/usr/bin/env bash
# The README's test command: a virtual environment with the pinned dependencies, then the CPU suite on 2 workers.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3.12}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[test]"
exec .venv/bin/python -m pytest -q -n 2 --dist worksteal --durations=${DURATIONS:-15} "$@"  # (worksteal: minutes-long tests do not leave a worker idle at the end)
