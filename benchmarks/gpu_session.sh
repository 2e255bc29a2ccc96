#!/usr/bin/env bash
# One device call: GPU tests, kernel benchmarks and the decode benchmark, logs under $OUT (or ./gpu_out).
# Usage on the device machine (repo root):  bash benchmarks/gpu_session.sh [budget_seconds]
# Sections print as they finish; the decode benchmark stops starting new configurations at the budget.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT="${OUT:-gpu_out}"; mkdir -p "$OUT"
BUDGET="${1:-480}"
t0=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - t0) )); }
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
python3 -m pytest -q -m gpu -x tests 2>&1 | tail -25 | tee "$OUT/gpu_tests.log"
[ "$(left)" -gt 300 ] && timeout $(( $(left) - 240 )) python3 benchmarks/bench_sparse_mla.py --quick --out "$OUT/bench_sparse_mla.txt" 2>&1 | tail -30
[ "$(left)" -gt 240 ] && python3 benchmarks/bench_decode.py --geometry tp4-rank --batch 1 --q 1 4 \
  --backend latency_specialized auto --context 32768 --steps 10 --repeats 3 --fast-compile \
  --budget-s $(( $(left) - 200 )) --out "$OUT/decode.jsonl" 2>&1 | grep -v -i warn | tee "$OUT/bench_decode.log"
echo "total $(( $(date +%s) - t0 )) s"
