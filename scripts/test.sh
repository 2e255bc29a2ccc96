#!/usr/bin/env bash
# The README's test command: a virtual environment with the pinned dependencies, then the CPU suite on 2 workers.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3.12}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[test]"
# the CUDA PJRT plugin, for the tests that compile the step for an H200 without one (benchmarks/step_census.py;
# kept out of the environment: jax loads it only where a test puts it on the path); they skip without it
[ -d .cuda_plugin/jax_plugins ] || .venv/bin/python -m pip install -q --no-deps --target .cuda_plugin \
  jax-cuda13-pjrt==0.11.2 jax-cuda13-plugin==0.11.2 || echo "(no CUDA PJRT plugin: the compile-only tests skip)"
exec .venv/bin/python -m pytest -q -n 2 --dist worksteal --durations=${DURATIONS:-15} "$@"  # (worksteal: minutes-long tests do not leave a worker idle at the end)
