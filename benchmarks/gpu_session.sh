#!/usr/bin/env bash
# One device call: GPU tests, kernel benchmarks and the decode benchmark, logs under $OUT (or ./gpu_out).
# Usage on the device machine (repo root):  bash benchmarks/gpu_session.sh MODE [budget_seconds]
#   single  (nvidia-h200):    GPU tests, sparse-MLA/indexer benchmark, then the decode benchmark — one after another
#   pair    (nvidia-h200-x2): the same work split over the two GPUs (tests + kernel benchmarks on GPU 0, the
#                             real-geometry decode benchmark on GPU 1, concurrently)
#   tp2     (nvidia-h200-x2): all-reduce benchmark, TP2 == TP1 GPU tests, then the TP2 decode benchmark (12 real
#                             layers, profiled) with --collectives xla and graph
#   tp4     (nvidia-h200-x4): issue #11 — the all-reduce at TP4, TP2 / TP4 == TP1 GPU tests, then the real model at
#                             TP4 (all 45 layers + MTP: 82 GB per GPU), B = 1 and 8, q = 1 and 4, latency_specialized
#                             vs auto, profiled (the all-reduce's share of the step)
#   profile (nvidia-h200):    mHC, weight-streaming and KDA GPU tests (with WITH_TESTS=1), bench_mhc (kernels per boundary),
#                             bench_topk (the radix variants), bench_cluster_exchange, then the one-rank latency_specialized
#                             step (defaults: packed parameters) at q = 1 and 4 with the CUPTI profile; every kernel's
#                             time (*.kernels.json) and the optimised HLO kept to read against each other offline
#   s54a, s54b (nvidia-h200): session 54's lean_barriers first: the lean kernels' GPU tests and the kernel-tiny
#                             step end to end (s54a), then the q = 1 step against the defaults (s54b)
#   s53a .. s53d (nvidia-h200): session 53's plan — see their comments below
#   Modes of past sessions (s25 .. s52b and the one-off probes) are in git history: each BENCHMARKS.md
#   entry names its mode and date; check out that session's commit to rerun one.
# Sections print as they finish; the decode benchmarks stop starting new configurations at the budget.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT="${OUT:-gpu_out}"; mkdir -p "$OUT"
MODE="${1:-single}"; BUDGET="${2:-480}"
case "$MODE" in  # an unknown mode would run nothing and still spend the call's start-up: refuse it at once
  single|pair|tp2|tp4|profile|s55a|s55b|s55c|s54a|s54b|s53a|s53b|s53c|s53d) ;;
  *) echo "gpu_session.sh: unknown mode '$MODE' (single, pair, tp2, tp4, profile, s55a .. s55c, s54a, s54b, s53a .. s53d)"
     exit 2 ;;
esac
t0=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - t0) )); }
nvidia-smi --query-gpu=index,name,memory.total,clocks.sm --format=csv

tests_and_kernels() {
  # one process per file: a device fault in one kernel's tests must not hide the others' results
  for f in test_kda_decode test_linear_kernels test_indexer test_sparse_mla test_mhc test_decode; do
    timeout 300 python3 -m pytest -v -m "gpu or e2e_kernels" -p no:cacheprovider "tests/$f.py" > /tmp/t_$f.log 2>&1
    echo "== $f (rc $?): $(grep -E '(passed|failed|error)' /tmp/t_$f.log | tail -1)" | tee -a "$OUT/gpu_tests.log"
    grep -E "PASSED|FAILED|ERROR|Fatal|Segmentation|MISALIGNED" /tmp/t_$f.log | grep -v "^E " | head -40 >> "$OUT/gpu_tests.log"
    { echo "######## $f"; grep -v -E "cuda_status|Source Location|^$|custom_call.cc" /tmp/t_$f.log | tail -300; } >> "$OUT/tests_full.log"
  done
  if grep -l -E "MISALIGNED|ILLEGAL" /tmp/t_*.log > /dev/null 2>&1; then  # name the faulting kernel
    for f in $(grep -l -E "MISALIGNED|ILLEGAL" /tmp/t_*.log); do
      t=$(basename "$f" .log); t=${t#t_}
      echo "######## compute-sanitizer $t" >> "$OUT/tests_full.log"
      timeout 150 compute-sanitizer --tool memcheck --print-limit 3 python3 -m pytest -q -x -m "gpu or e2e_kernels" \
        -p no:cacheprovider "tests/$t.py" 2>&1 | grep -E "=========|Invalid|Misaligned|at 0x|by thread|kernel|passed|failed" \
        | head -40 >> "$OUT/tests_full.log"
    done
  fi
  [ "$(left)" -gt 200 ] && timeout 90 python3 benchmarks/bench_mhc.py > "$OUT/bench_mhc.log" 2>&1
  [ "$(left)" -gt 200 ] && timeout $(( $(left) - 150 )) python3 benchmarks/bench_sparse_mla.py --quick \
    > "$OUT/bench_sparse_mla.log" 2>&1
  echo "== sparse MLA / indexer benchmark done"
}

rank1() {  # $1: result name; the rest: bench_decode.py options. The one-rank latency_specialized step, B = 1, 32K
  local name=$1; shift
  timeout $(( $(left) - 5 )) python3 benchmarks/bench_decode.py --geometry tp4-rank --batch 1 --context 32768 \
    --steps 20 --repeats 3 --fast-compile --budget-s $(( $(left) - 60 )) --backend latency_specialized \
    --compile-cache .jax_cache \
    --out "$OUT/decode_$name.jsonl" "$@" 2>&1 | grep -v -i -E "warn|^\s*$" >> "$OUT/bench_decode_$name.log"
}

decode_bench() {  # $1: seconds to stop starting configurations
  python3 benchmarks/bench_decode.py --geometry tp4-rank --batch 1 --q 1 4 --backend auto latency_specialized \
    --context 32768 --steps 20 --repeats 3 --fast-compile --profile --budget-s "$1" --out "$OUT/decode.jsonl" 2>&1 \
    | grep -v -i warn > "$OUT/bench_decode.log"
  echo "== decode benchmark done"
}

case "$MODE" in
  single)
    tests_and_kernels
    [ "$(left)" -gt 240 ] && decode_bench $(( $(left) - 200 ))
    ;;
  pair)
    CUDA_VISIBLE_DEVICES=0 tests_and_kernels &
    CUDA_VISIBLE_DEVICES=1 decode_bench $(( BUDGET - 200 )) &
    wait
    ;;
  tp2)  # all-reduce variants first (issue #10: never measured before session 19), then TP2 == TP1 GPU tests, then
    # the TP2 decode step of 12 real layers (latency_specialized vs auto), with collectives in the CUDA graph
    timeout 260 python3 benchmarks/bench_allreduce.py --tp 2 --timeout 60 --variants default nccl-LL nccl-LL128 \
      xla-one-shot cb-collectives cb-collectives-LL cb-coll-one-shot --out "$OUT/allreduce.jsonl" 2>&1 \
      | tee "$OUT/allreduce.log"
    timeout 330 python3 -m pytest -v -m gpu -p no:cacheprovider tests/test_tp_gpu.py 2>&1 \
      | grep -E "PASSED|FAILED|ERROR|passed|failed|^E " | head -40 | tee "$OUT/gpu_tests.log"
    for cm in xla graph; do  # glm5_jax.sharding.COLLECTIVE_MODES
      [ "$(left)" -gt 150 ] || break
      echo "## --collectives $cm" >> "$OUT/bench_decode_tp2.log"
      timeout $(( $(left) - 10 )) python3 benchmarks/bench_decode.py --geometry real --tp 2 --collectives $cm \
        --layers 12 --batch 1 --q 1 --backend latency_specialized auto --context 32768 --steps 20 --repeats 3 \
        --fast-compile --profile --budget-s $(( $(left) - 100 )) --out "$OUT/decode_tp2.jsonl" 2>&1 | grep -v -i warn \
        >> "$OUT/bench_decode_tp2.log"
    done
    ;;
  tp4)  # (nvidia-h200-x4) see the header. The step at 4 steps per call on one host call, as on one GPU; the all-reduces
    # in the CUDA graph (--collectives graph, the default at --tp > 1)
    timeout 200 python3 benchmarks/bench_allreduce.py --tp 4 --timeout 45 --variants default cb-collectives \
      cb-coll-one-shot --out "$OUT/allreduce.jsonl" 2>&1 | tee "$OUT/allreduce.log"
    timeout 300 python3 -m pytest -v -m gpu -p no:cacheprovider tests/test_tp_gpu.py 2>&1 \
      | grep -E "PASSED|FAILED|ERROR|passed|failed|^E " | head -40 | tee "$OUT/gpu_tests.log"
    for b in 1 8; do
      [ "$(left)" -gt 150 ] || break
      timeout $(( $(left) - 10 )) python3 benchmarks/bench_decode.py --geometry real --tp 4 --batch $b --q 1 4 \
        --backend latency_specialized auto --context 32768 --steps 20 --repeats 3 --steps-per-call 4 \
        --fast-compile --budget-s $(( $(left) - 100 )) --out "$OUT/decode_tp4.jsonl" 2>&1 | grep -v -i warn \
        >> "$OUT/bench_decode_tp4.log"
    done
    # the GPU time by component — the all-reduce's share — from CUPTI (one step per call: a rolled loop is refused)
    [ "$(left)" -gt 150 ] && timeout $(( $(left) - 10 )) python3 benchmarks/bench_decode.py --geometry real --tp 4 \
      --batch 1 --q 1 --backend latency_specialized --context 32768 --steps 20 --repeats 3 --fast-compile --profile \
      --budget-s $(( $(left) - 60 )) --out "$OUT/decode_tp4.jsonl" 2>&1 | grep -v -i warn >> "$OUT/bench_decode_tp4.log"
    ;;
  profile)  # (nvidia-h200) see the header
    [ -n "${WITH_TESTS:-}" ] && for f in test_mhc test_linear_kernels test_kda_decode; do
      timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/$f.py 2>&1 \
        | grep -E "passed|failed|FAILED|^E  " | head -20 | sed "s/^/$f: /" >> "$OUT/gpu_tests.log"; done
    timeout 80 python3 benchmarks/bench_mhc.py --rows 1,4 > "$OUT/bench_mhc.log" 2>&1
    timeout 120 python3 benchmarks/bench_topk.py --pools 8256,16448 > "$OUT/bench_topk.log" 2>&1
    # can one kernel's CTAs exchange the mHC partials (a one-launch boundary)? (interpret mode cannot tell)
    timeout 60 python3 benchmarks/bench_cluster_exchange.py > "$OUT/bench_cluster_exchange.log" 2>&1
    timeout $(( $(left) - 10 )) python3 benchmarks/bench_decode.py --geometry tp4-rank --batch 1 --q 1 4 \
      --context 32768 --steps 20 --repeats 3 --fast-compile --budget-s $(( $(left) - 130 )) \
      --backend latency_specialized --profile --hlo-dir "$OUT" --out "$OUT/decode_profile.jsonl" 2>&1 \
      | grep -v -i -E "warn|^\s*$" >> "$OUT/bench_decode_profile.log"
    ;;
  s55a)  # (nvidia-h200) session 55: every pending candidate's GPU tests in one call — s54a's (lean_barriers) and
    # s53a's (mhc_row, latent_norms, kda_norm_partials, the f16 saturation), the 2-bit compaction (in
    # compact_kernel_gpu), the two model-site tests natively, and the kernel-tiny step with lean_barriers
    timeout -k 9 -s INT 150 python3 -m pytest -q -rA -m gpu -p no:cacheprovider tests/test_mhc.py -k "post_finish" \
      > "$OUT/tests.log" 2>&1
    timeout -k 9 -s INT 120 python3 -m pytest -q -rA -m gpu -p no:cacheprovider \
      "tests/test_sparse_mla.py::test_kernel_gpu[1-1-16-32768-2051-None-True-True]" \
      "tests/test_sparse_mla.py::test_kernel_gpu[1-4-16-65536-2051-4-False-True]" \
      "tests/test_sparse_mla.py::test_uv_kernel_gpu[1-16-16]" "tests/test_sparse_mla.py::test_uv_kernel_gpu[4-16-16]" \
      "tests/test_sparse_mla.py::test_latent_norms_gpu[1]" "tests/test_sparse_mla.py::test_latent_norms_gpu[4]" \
      "tests/test_indexer.py::test_kernel_rotating_queries_gpu[1-1-8192]" \
      "tests/test_indexer.py::test_compact_kernel_gpu[1-8704-512-3-2112-32]" \
      "tests/test_indexer.py::test_compact_kernel_gpu[4-8704-512-6-2112-32]" >> "$OUT/tests.log" 2>&1
    timeout -k 9 -s INT 150 python3 -m pytest -q -rA -m gpu -p no:cacheprovider \
      "tests/test_linear_kernels.py::test_fp8_dq_linear_gpu[q_a-1-regs]" "tests/test_linear_kernels.py::test_fp8_dq_linear_gpu[mla_o-1-regs]" \
      "tests/test_linear_kernels.py::test_fp8_dq_linear_gpu[dense_down-8-regs]" \
      "tests/test_linear_kernels.py::test_router_in_the_gate_up_kernel_with_rows_gpu[bfloat16-second5]" \
      "tests/test_linear_kernels.py::test_fp8_moe_shared_slot_gpu[4-True-regs]" \
      "tests/test_linear_kernels.py::test_fp8_dq_linear_f16_saturates_gpu" >> "$OUT/tests.log" 2>&1
    timeout -k 9 -s INT 120 python3 -m pytest -q -rA -p no:cacheprovider tests/test_kda_decode.py -k "norm_partials" \
      tests/test_model_units.py::test_mhc_row_at_the_model_site \
      tests/test_model_units.py::test_mla_latent_norms_at_the_model_site >> "$OUT/tests.log" 2>&1
    timeout -k 9 -s INT $(( $(left) - 20 )) python3 -m pytest -q -rA -m "gpu or e2e_kernels" -p no:cacheprovider \
      "tests/test_decode.py::test_latency_specialized_all_kernels_equals_stock_fp8_cache[lean]" >> "$OUT/tests.log" 2>&1
    grep -h -E "^(PASSED|FAILED|ERROR)|passed|failed" "$OUT/tests.log"
    ;;
  s55b)  # (nvidia-h200) q = 1, 5 interleaved repeats: the defaults against every pending candidate at once (most
    # likely first: the budget drops the last) — lean_barriers, mhc_row (+ lean: 134 -> 16 barriers),
    # mla_latent_norms + qkv_a_fused_sum, kda_gates_first, topk_threshold_2bit (+ lean: its design holds lean), all
    rank1 s55b --q 1 --steps-per-call 4 --interleave --repeats 5 --steps 80 --policy '{}' \
      '{"lean_barriers": true}' '{"mhc_row": true, "lean_barriers": true}' '{"mhc_row": true}' \
      '{"mla_latent_norms": true, "qkv_a_fused_sum": true}' '{"kda_gates_first": true}' \
      '{"topk_threshold_2bit": true, "lean_barriers": true}' \
      '{"lean_barriers": true, "mhc_row": true, "mla_latent_norms": true, "qkv_a_fused_sum": true, "kda_gates_first": true, "topk_threshold_2bit": true}'
    ;;
  s55c)  # (nvidia-h200) issue #9's ratio in one call with s55b's winners (edit POLICY), 3 interleaved repeats
    timeout $(( $(left) - 5 )) python3 benchmarks/bench_decode.py --geometry tp4-rank \
      --batch 1 --context 32768 --q 1 --steps 40 --repeats 3 --fast-compile --budget-s $(( $(left) - 60 )) \
      --backend auto latency_specialized --steps-per-call 4 --interleave --compile-cache .jax_cache \
      --policy "${POLICY:-{\}}" --out "$OUT/decode_s55c.jsonl" 2>&1 | grep -v -i -E "warn|^\s*$" >> "$OUT/bench_decode_s55c.log"
    ;;
  s54a)  # (nvidia-h200) session 54's lean_barriers: the kernels on the q = 1 step's chains built without Mosaic GPU's
    # automatic warpgroup barriers (the mHC boundary 46 -> 10 bar.sync, mhc_row 134 -> 16, the indexer's scores
    # 18 -> 5 and compaction 20 -> 10, the sparse MLA 43 -> 7 plus one per gather TMA, W_UV 29 -> 3, the FP8 GEMV
    # and the MoE's kernels), their explicit barriers checked natively: each lean kernel bit for bit its default
    # build (the boundary: its two-launch form), and the kernel-tiny step with lean_barriers emitting the stock
    # path's tokens
    timeout -k 9 -s INT 120 python3 -m pytest -q -rA -m gpu -p no:cacheprovider \
      "tests/test_mhc.py::test_post_finish_gpu[1-False-False-True]" "tests/test_mhc.py::test_post_finish_gpu[1-True-False-True]" \
      "tests/test_mhc.py::test_post_finish_gpu[4-False-False-True]" "tests/test_mhc.py::test_post_finish_gpu[1-False-True-True]" \
      "tests/test_mhc.py::test_post_finish_gpu[1-False-True-False]" "tests/test_mhc.py::test_post_finish_counters_gpu[1-False-True]" \
      "tests/test_mhc.py::test_post_finish_counters_gpu[1-True-True]" > "$OUT/tests.log" 2>&1
    timeout -k 9 -s INT 100 python3 -m pytest -q -rA -m gpu -p no:cacheprovider \
      "tests/test_sparse_mla.py::test_kernel_gpu[1-1-16-32768-2051-None-True-True]" \
      "tests/test_sparse_mla.py::test_kernel_gpu[1-4-16-65536-2051-4-False-True]" \
      "tests/test_sparse_mla.py::test_uv_kernel_gpu[1-16-16]" "tests/test_sparse_mla.py::test_uv_kernel_gpu[4-16-16]" \
      "tests/test_indexer.py::test_kernel_rotating_queries_gpu[1-1-8192]" \
      "tests/test_indexer.py::test_compact_kernel_gpu[1-8704-512-3-2112-32]" \
      "tests/test_indexer.py::test_compact_kernel_gpu[4-8704-512-6-2112-32]" >> "$OUT/tests.log" 2>&1
    timeout -k 9 -s INT 150 python3 -m pytest -q -rA -m gpu -p no:cacheprovider \
      "tests/test_linear_kernels.py::test_fp8_dq_linear_gpu[q_a-1-regs]" "tests/test_linear_kernels.py::test_fp8_dq_linear_gpu[mla_o-1-regs]" \
      "tests/test_linear_kernels.py::test_fp8_dq_linear_gpu[dense_down-8-regs]" \
      "tests/test_linear_kernels.py::test_router_in_the_gate_up_kernel_with_rows_gpu[bfloat16-second5]" \
      "tests/test_linear_kernels.py::test_fp8_moe_shared_slot_gpu[4-True-regs]" >> "$OUT/tests.log" 2>&1
    timeout -k 9 -s INT $(( $(left) - 20 )) python3 -m pytest -q -rA -m "gpu or e2e_kernels" -p no:cacheprovider \
      "tests/test_decode.py::test_latency_specialized_all_kernels_equals_stock_fp8_cache[lean]" >> "$OUT/tests.log" 2>&1
    grep -h -E "^(PASSED|FAILED|ERROR)|passed|failed" "$OUT/tests.log"
    ;;
  s54b)  # (nvidia-h200) q = 1, 5 interleaved repeats: defaults vs lean_barriers, and mhc_row with and without it
    # (the row form has the most barriers to lose: 134 -> 16)
    rank1 s54b --q 1 --steps-per-call 4 --interleave --repeats 5 --steps 80 --policy '{}' \
      '{"lean_barriers": true}' '{"mhc_row": true}' '{"mhc_row": true, "lean_barriers": true}'
    ;;
  s53a)  # (nvidia-h200) session 52's two CPU-built launch cutters natively. mhc_row: the one-token-row mHC boundary
    # (mhc_row_boundary: 32 CTAs with a column of every stream per thread instead of mhc_post_finish's 128 CTAs of
    # 64-row tiles for one real row; s48d: the post mix 2.1 + partial stores 1.2 + sums 2.5 of its 6.3 µs).
    # mla_latent_norms: the DSA layer's q_a / kv_a RMSNorms and the latent's FP8 quantisation as one launch
    # (latent_norms) instead of ~7 XLA fusions on its critical path (s51b's trace: 6.9 µs there), and with it
    # qkv_a_fused_sum (the projection's K splits summed in its kernel: no XLA split sum before latent_norms). Their
    # GPU tests with those s52a did not run (kda_norm_partials natively; the f16 saturation test with its tolerance
    # fixed), then q = 1, 5 interleaved repeats: defaults vs each (the boundary alone: s53c)
    timeout -k 9 -s INT 150 python3 -m pytest -q -rA -m gpu -p no:cacheprovider \
      "tests/test_mhc.py::test_post_finish_gpu[1-False-True]" "tests/test_mhc.py::test_post_finish_gpu[1-True-True]" \
      "tests/test_mhc.py::test_post_finish_counters_gpu[1-True]" > "$OUT/tests.log" 2>&1
    timeout -k 9 -s INT 100 python3 -m pytest -q -rA -m gpu -p no:cacheprovider tests/test_sparse_mla.py \
      -k "latent_norms_gpu" >> "$OUT/tests.log" 2>&1
    timeout -k 9 -s INT 100 python3 -m pytest -q -rA -p no:cacheprovider tests/test_kda_decode.py \
      -k "norm_partials_interpret" >> "$OUT/tests.log" 2>&1
    timeout -k 9 -s INT 80 python3 -m pytest -q -rA -m gpu -p no:cacheprovider tests/test_linear_kernels.py \
      -k "saturates" >> "$OUT/tests.log" 2>&1
    grep -h -E "^(PASSED|FAILED|ERROR)|passed|failed" "$OUT/tests.log"
    [ "$(left)" -gt 200 ] && rank1 s53a --q 1 --steps-per-call 4 --interleave --repeats 5 --steps 80 --policy '{}' \
      '{"mhc_row": true}' '{"mla_latent_norms": true}' '{"mla_latent_norms": true, "qkv_a_fused_sum": true}'
    ;;
  s53b)  # (nvidia-h200) after s53a: its winners with the knobs s52c/s52d had faster in 3-4 of 4 rounds
    # (kda_norm_partials, dq_f16; edit the policy to s53a's result) against the defaults at q = 1, then auto vs
    # latency_specialized in one call with the winners (s53d; issue #9: 2x needs latency_specialized <= auto / 2).
    # Session 53's two CPU-built orders / forms against the defaults too: kda_gates_first (the KDA gates' GEMVs
    # launched before the qkv GEMV) and topk_threshold_2bit (the fused selection's passes two bits at a time)
    rank1 s53b --q 1 --steps-per-call 4 --interleave --repeats 5 --steps 80 --policy '{}' \
      '{"mhc_row": true, "mla_latent_norms": true, "qkv_a_fused_sum": true, "kda_norm_partials": true, "dq_f16": true}' \
      '{"kda_gates_first": true}' '{"topk_threshold_2bit": true}'
    ;;
  s53d)  # (nvidia-h200) issue #9's ratio in one call: auto vs latency_specialized with s53a / s53b's winners (edit
    # the policy to them)
    timeout $(( $(left) - 5 )) python3 benchmarks/bench_decode.py --geometry tp4-rank \
      --batch 1 --context 32768 --q 1 --steps 40 --repeats 3 --fast-compile --budget-s $(( $(left) - 60 )) \
      --backend auto latency_specialized --steps-per-call 4 --interleave --compile-cache .jax_cache \
      --policy '{"mhc_row": true, "mla_latent_norms": true}' --out "$OUT/decode_s53d.jsonl" 2>&1 \
      | grep -v -i -E "warn|^\s*$" >> "$OUT/bench_decode_s53d.log"
    ;;
  s53c)  # (nvidia-h200) the new forms inside the step: traced at q = 1 (sublayer_chain: the boundaries' and the DSA
    # layer's chains with mhc_row + mla_latent_norms) and profiled alone (where the row boundary's time goes).
    # First the GPU tests of the fused compaction with two bits a pass (topk_threshold_2bit, session 53)
    timeout -k 9 -s INT 120 python3 -m pytest -q -rA -m gpu -p no:cacheprovider tests/test_indexer.py \
      -k "compact_kernel_gpu or compact_kernel_at_the_model_site" > "$OUT/tests.log" 2>&1
    grep -h -E "^(PASSED|FAILED|ERROR)|passed|failed" "$OUT/tests.log"
    timeout -s INT 120 python3 benchmarks/bench_mhc.py --rows 1 --paths grid,row --out "$OUT/bench_mhc.txt" \
      > "$OUT/bench_mhc.log" 2>&1
    # the selection alone, one and two bits a pass (topk_threshold_2bit, session 53)
    timeout -s INT 90 python3 benchmarks/bench_topk.py --rows 1,4 --pools 8704 --f32-scores \
      --only "compact fused,compact fused 2bit" --out "$OUT/bench_topk.txt" > "$OUT/bench_topk.log" 2>&1
    timeout -s INT 100 python3 benchmarks/bench_kernel_profile.py --dir /tmp/kprof --cases mhc,mhc_row \
      --out "$OUT/kernel_profile.txt" > "$OUT/bench_kernel_profile.log" 2>&1
    # the bf16 GEMVs at one row, XLA vs bf16_linear — the indexer's wq_b (12.6 MB) is on the DSA selection chain
    timeout -s INT 120 python3 benchmarks/bench_linear.py --rows 1 --only bf16 --out "$OUT/bench_linear.txt" \
      > "$OUT/bench_linear.log" 2>&1
    cat "$OUT/bench_mhc.txt" "$OUT/bench_topk.txt" "$OUT/kernel_profile.txt" "$OUT/bench_linear.txt"
    rank1 s53c --q 1 --steps-per-call 4 --trace --hlo-dir "$OUT/hlo" \
      --policy '{"mhc_row": true, "mla_latent_norms": true, "qkv_a_fused_sum": true}'
    rm -f "$OUT"/hlo/*.hlo.gz
    ;;
esac
for f in "$OUT"/gpu_tests.log "$OUT"/bench_*.log "$OUT"/allreduce.log; do [ -f "$f" ] && { echo "=== $f"; grep -v -E "cuda_status|Source Location|^$|custom_call.cc" "$f" | tail -45; }; done
# the device tool returns at most 8 files (s39a lost its 9th): past 7, everything goes back as one archive
if [ "$(find "$OUT" -type f | wc -l)" -gt 8 ]; then
  (cd "$OUT" && tar czf /tmp/gpu_out.tgz . && find . -mindepth 1 -delete && mv /tmp/gpu_out.tgz ./gpu_out.tgz)
  echo "== more than 8 files: returned as gpu_out.tgz"
fi
echo "total $(( $(date +%s) - t0 )) s"
