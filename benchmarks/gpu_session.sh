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
#   s57d, s57e (nvidia-h200): sessions 55-57's plan — a trace (s57d) and q = 4 with session 57's several-row
#                             boundary without wgmma, mhc_rows (s57e). Session 58 ran s57a (the pending knobs' GPU
#                             tests) and s57b (the q = 1 A/B of every pending knob); s57c (the ratio with s57b's
#                             winners, superseded by ratio) and s71a (session 71's A/B of knobs removed since) are in
#                             git history
#   ratio (nvidia-h200, needs_h200: the 45 layers' 82 GB): issue #9's ratio in one call — q = 1, auto vs the
#                             defaults (+ POLICY where given; session 74's default POLICY, kda_qkv_kernel, was 0.16 ms
#                             slower on an H100 in session 75: its kernel 25.5 µs in the step, 19.0 alone, beside the
#                             gates' fg_b GEMV — the H200's case: POLICY='{"kda_qkv_kernel": true, "kda_fg_b_kernel":
#                             true}', ~450 s with it), 5 interleaved repeats of 80 steps (s60d's form)
#   e2e (either):             the defaults' end-to-end GPU test (~185 s) and the kernels' GPU tests the defaults run
#                             natively first (the one-grid MoE, moe_h_rows, the row boundary, the counters): their own
#                             call — s60d's 240 s for tests and benchmark together cut the end-to-end test off
#   h100 (nvidia-h100-x1):    when no H200 is lent (sessions 59-60): the one-grid MoE / router / boundary GPU tests,
#                             the in-kernel profiles of the boundary, the MoE's two kernels and its one grid, then
#                             q = 1 on the first 32 layers (LAYERS): auto vs the defaults vs POLICY (default
#                             moe_one_grid off) — an H100's numbers, not the H200's
#   prefill (either; H100: LAYERS=32): the prefill MoE kernel's GPU tests (moe_prefill, session 62; SKIP_TESTS=1:
#                             none), then time to first token (bench_prefill.py) of 4K and 32K prompts (PROMPTS) in
#                             256-token chunks (CHUNKS: more), the defaults (XLA_MOE=1: also XLA's MoE, every expert
#                             over every token), each traced once at the first prompt length (kernel families by
#                             share; device events under $OUT/trace)
#   prefill_ab (either; H100: LAYERS=32): session 63's A/B of the prefill on one GPU — this tree (traced) vs the code
#                             in .carry/base (a git archive of the base commit; carry .carry), 4K and 32K prompts in
#                             256-token chunks, then this tree at 1,024, then the changed paths' tests natively
#   dsa (either):             issue #7's item 5 — one DSA layer of decode alone (benchmarks/bench_dsa_layer.py): µs per
#                             layer for B {1, 8, 32} x q {1, 4} x context {32K, 4K, 128K} (32K first: the goal's),
#                             latency_specialized's kernels (the attention core split out) vs XLA, against its floor
#   longctx (either):         the selection past 64K context (session 65: two stages of the fused compaction, knob
#                             topk_two_stage) — its GPU tests, bench_topk at 32K / 128K / 256K / 1M context's pools
#                             (XLA's sort vs the kernels), then one DSA layer (bench_dsa_layer) at 128K and 1M, B = 1
#   blackwell (a Blackwell kind, when one is lent): the tcgen05 forms' native tests (`-m blackwell`: the sparse MLA
#                             with W_UV, the indexer's cache update, the prefill MoE — session 65's CPU-built forms)
#   bigbatch (nvidia-h200, needs_h200: 82 GB + 19 GB of caches): B = 32, q = 4 — 128 token rows, past the decode
#                             kernels' 64, where the step's MoE is XLA's (every expert over every row) — vs moe_prefill's
#                             grouped FP8 kernels there
#   partrows (either; H100: LAYERS=32): session 66's policy knob linear_part_rows — its GPU tests and the balanced
#                             two-stage selection's, then q = 4: the defaults vs the knob (5 interleaved repeats), then
#                             one DSA layer at 128K / 1M context (the balanced chunks, the default since session 66)
#   mlawg (either; H100: LAYERS=32): session 66's sparse MLA dequantisation knobs — mla_dequant_warpgroups (a second
#                             warpgroup converting half of each block) and mla_scales_after (the block scales after
#                             the MMAs): their GPU tests, the in-kernel profiles of the four forms at B x q = 1 x 4
#                             and 8 x 4, then the step's A/B at q = 1 (the defaults vs each vs both), then q = 4
#   mlaforms (either):        the same two knobs measured alone with CUPTI (session 67): bench_sparse_mla --only forms
#                             (the kernel in its four forms, merge included, B x q = 1 x 1, 1 x 4, 8 x 4, 32 x 1), then
#                             one DSA layer at 32K (bench_dsa_layer: B 1 / 8, q 1 / 4; auto, the defaults, each knob)
#   s68a (either; H100: LAYERS=32): session 67's CPU-built work natively — the GPU tests of mla_group_arrival (one
#                             gather arrival per group of 4 rows), mhc_row_scalars (the one-row boundary's
#                             normalisation on scalars) and of the mHC boundaries (the early coef / parity loads),
#                             the in-kernel profiles (mlas_ / mlag_ at 1 x 4 and 8 x 4, mhc_row_lean / _scalars)
#   s68c (either; H100: LAYERS=32): then the sparse MLA's forms alone and the step's A/B at q = 1: the defaults vs
#                             mla_group_arrival vs mhc_row_scalars
#   s68b (either; H100: LAYERS=32): the row-form mHC boundary at the verify's 4 rows (policy mhc_rows: session 67's
#                             faster partials run once per row there) — the two forms' profiles at M = 4 (mhc4_lean,
#                             mhc_row4_lean), then the step's A/B at q = 4: the defaults vs mhc_rows
#   s68d (either; H100: LAYERS=32): session 68's one-grid KDA + o_proj (policy kda_o_grid) natively — its GPU test
#                             (the grid vs its two-launch form and the reference; a hang ends at the test's timeout),
#                             session 67's knobs' GPU tests (s68a's), then the step's A/B at q = 1: the defaults vs
#                             kda_o_grid (only if its test passed) vs mla_group_arrival vs mhc_row_scalars, then
#                             the in-kernel profiles of the KDA kernel and the grid (kda_1x1, kdao_1x1)
#   s71b (either; H100: LAYERS=32): kda_o_grid_spin — the grid's GPU tests (with the clock hold), the in-kernel
#                             profiles of the grid with the `loaded` count and with holds of 1,000 / 500 / 2,000
#                             cycles, then the step at q = 1: the defaults vs POLICY (kda_o_grid_spin), 9 repeats
#   s71c (either): s71b without the step's A/B (~200 s: what a short call can check) — the grid's GPU tests with the
#                             clock hold, then the in-kernel profiles
#   s72a (either; H100: LAYERS=32): session 72's W_UK kernel (policy mla_uk_kernel: the absorbed query as a Mosaic
#                             kernel instead of XLA's transposed f32 copy of W_UK + reduction at q = 4) and session
#                             73's bf16 gates' GPU tests, then the verify step's stack A/B (q = 4, 4 repeats): the
#                             defaults vs linear_fused_sum + mla_uk_kernel (the latter only if its test passed) vs
#                             that + mhc_rows (~350 s; a longer call: REPEATS=6 and POLICY='{...}' one more, e.g.
#                             the stack with bf16_balanced_splits)
#   pending (either; H100: LAYERS=32; ~200 s): what the CPU built and no GPU ran yet, in one call — now the bf16
#                             GEMV's in-kernel sums at 1 and 4 rows (GPU tests, passed in session 75; the KDA fg_b shape
#                             among them: a quick re-check on the new host), then q = 1: the defaults vs kda_qkv_kernel vs that + kda_fg_b_kernel (session 75: fg_b after the q/k/v
#                             kernel on its counters Ref, not beside it) (+ POLICY), 4 interleaved repeats. Earlier
#                             forms (session 75's: indexer_wq_kernel a tie; session 74's: mla_uk_kernel, mla_q_in_kernel,
#                             the q = 4 stack, all ties) are in git history; BENCHMARKS.md has their results
#   s75a (either; H100: LAYERS=32; ~150 s): why kda_qkv_kernel loses in the step (session 75's pending on an H100:
#                             2.77 -> 2.93 ms, while the kernel alone beats XLA's GEMV at one row, 19.0 vs 21.8 µs) —
#                             q = 1 traced with the defaults, then with POLICY (default kda_qkv_kernel); the events
#                             and kernel listings under $OUT/hlo for benchmarks/sublayer_chain.py --kind kda
#   s76a (either; H100: LAYERS=32; ~450 s): session 76's prefill attention kernel (policy mla_prefill: a chunk's DSA
#                             attention through the sparse MLA kernel instead of XLA's grouped form) — its GPU test
#                             at a chunk's 256 rows, then the prefill A/B (bench_prefill: 4K and 32K prompts,
#                             256-token chunks, traced; the defaults vs POLICY, default mla_prefill), then 512-token
#                             chunks for the 4K prompt (both policies) where the budget allows
#   s76b (either; H100: LAYERS=32; ~400 s): the prefill's chunk size (session 76's s76a: a 4K prompt in 512-token
#                             chunks 35 % faster than in 256) — bench_prefill for 4K and 32K prompts at CHUNKS (default
#                             256 512 1024), a process per chunk size, with POLICY (default: the defaults)
#   s76c (either; H100: LAYERS=32; ~200 s): the prefill's sparse MLA in the step's forms (a chunk keeps the form
#                             knobs since session 76: lean, scales after the MMAs) — their GPU test at 256 rows, then
#                             a 4K prompt (PROMPTS) in 512-token chunks: the defaults vs the plain form (s76b's)
#                             (+ POLICY, POLICY2: e.g. '{"mla_group_arrival": true}', '{"mla_dequant_warpgroups": true}')
#   s77a (either; H100: LAYERS=32; ~450 s): a 4K prompt (PROMPTS) in 512-token chunks, traced and split by component
#                             (bench_prefill --trace: the chunk program's kernels by the model's components): the
#                             defaults vs topk_prefill (+ POLICY), then 768-token chunks (CHUNKS2) where the budget
#                             allows, a process each
#   s77b (either; H100: LAYERS=32; ~400 s): mhc_prefill (the prefill's mHC sites in two XLA passes) — its model-site
#                             test, then 4K and 32K prompts (PROMPTS) in 512-token chunks, traced: the defaults vs
#                             the reference's order ({"mhc_prefill": false}; + POLICY)
#   s77e (either; H100: LAYERS=32; ~550 s): larger chunks with kda_handover (its hand-over has no concatenation of the
#                             sub-chunks' states: 768 / 1,024-token chunks compiled past 300 s without it) — a 4K and
#                             a 32K prompt at CHUNKS (default 1024 768), a process each; PXLA=xla_gpu_autotune_level=0
#                             compiles the chunk programs without XLA's autotuning (Decoder(prefill_compiler_options=))
#   s78a (either; H100: LAYERS=32; ~550 s): session 77's CPU-built prefill kernels — indexer_prefill (the indexer's
#                             scores as the scores kernel in token groups), kda_handover (the KDA sub-chunks' state
#                             hand-over as one launch) — and session 78's moe_prefill_rows (the prefill MoE's grouped
#                             launches write token rows): their GPU tests, then 4K and 32K prompts in 512-token
#                             chunks, traced: all three off vs the defaults (all three on since; + POLICY)
#   s78b (either; H100: LAYERS=32; ~550 s): 1,024-token chunks' first compile (s78's took ~5 min with XLA's fusion
#                             autotuner, ~75 s but 3x slower without any autotuning; one input_concatenate_fusion —
#                             the chunked KDA's kk reduction fused with K̃ — is the suspect): a 4K and a 32K prompt
#                             with POLICY (default {"kda_chunk_gemm": true}: that fusion gone) under XLA's defaults,
#                             then the defaults with PXLA (default xla_gpu_experimental_enable_fusion_autotuner=false)
#                             — each a process (CHUNKS: the chunk sizes, default 1024; FORMS=policy: only the first)
#   s79d (either; H100: LAYERS=32; ~450 s): session 79's bf16_products (the prefill's mHC and router logits as bf16
#                             products: no f32 copies of their operands) at the new defaults (2,048-token chunks, kda_chunk_gemm,
#                             mla_gather_warpgroup, the routing by counts, the hand-over unrolled): 4K and 32K prompts,
#                             traced: the defaults vs it (+ POLICY)
#   s82a (either; H100: LAYERS=32; ~550 s): the chunked KDA's pairwise GEMMs natively against the recurrence
#                             (test_chunked_kda_pairwise_gemm_gpu: its x6 ancestor failed in session 81 without
#                             naming the form) and the prefill MoE's GPU tests (with session 81's token-rows-as-M
#                             down launch, moe_prefill_tokens_m), then the 2,048-token prefill with session 81's
#                             defaults (moe_prefill_resident, mhc_prefill_sinkhorn and topk_prefill on) vs
#                             moe_prefill_tokens_m (if the tests passed), traced (+ POLICY);
#                             s78c, s79a, s80b and s81a (run in sessions 78-81) are in git history
#   s72b (either, ~200 s): the bf16 GEMV's K splits / row tiles at the verify's 4 rows, then at one (bench_linear
#                             --sweep-bf16 4,1: the KDA q/k/v at 2.07 TB/s in s71's q = 4 trace, 192 CTAs on 132 SMs;
#                             at one row the indexer's wq_b, XLA's GEMV on the DSA chain at 1.6 TB/s, 7.7 µs)
#   stream (either):         the GPU's practical weight-streaming rate (benchmarks/bench_stream.py: TMA boxes of a
#                             row-major vs a tile-major weight, 37 and 75 MB; session 70's H100: ~2.5-2.65 TB/s either
#                             way) — the ceiling the weight-streaming kernels are up against; ~30 s (run it before
#                             `ratio` on an H200: its 4.8 TB/s spec vs the 4.3 the roofline assumes)
#   Modes of past sessions (s25 .. s61b, s68e, s69a .. s69c and the one-off probes) are in git history: each BENCHMARKS.md
#   entry names its mode and date; check out that session's commit to rerun one.
# Sections print as they finish; the decode benchmarks stop starting new configurations at the budget.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT="${OUT:-gpu_out}"; mkdir -p "$OUT"
MODE="${1:-single}"; BUDGET="${2:-480}"
case "$MODE" in  # an unknown mode would run nothing and still spend the call's start-up: refuse it at once
  single|pair|tp2|tp4|profile|s57d|s57e|ratio|e2e|h100|prefill|prefill_ab|dsa|longctx|blackwell|bigbatch|partrows|mlawg|mlaforms|s68a|s68b|s68c|s68d|stream|s71b|s71c|s72a|s72b|s75a|s76a|s76b|s76c|s77a|s77b|s77e|s78a|s78b|s79d|s82a|pending) ;;
  *) echo "gpu_session.sh: unknown mode '$MODE' (single, pair, tp2, tp4, profile, s57d, s57e, ratio, e2e, h100, prefill, prefill_ab, dsa, longctx, blackwell, bigbatch, partrows, mlawg, mlaforms, s68a .. s68d, stream, s71b, s71c, s72a, s72b, s75a, s76a .. s76c, s77a, s77b, s77e, s78a, s78b, s79d, s82a, pending)"
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

gpu_tests() {  # $1: log name, $2: timeout s, $3: pytest -m expression, $4: -k expression, the rest: test files.
  # One summary line (and the failures) into gpu_tests.log; returns pytest's status (124: the timeout — a hang)
  local name=$1 limit=$2 marks=$3 expr=$4; shift 4
  timeout "$limit" python3 -m pytest -q -m "$marks" -p no:cacheprovider "$@" -k "$expr" > "/tmp/t_$name.log" 2>&1
  local rc=$?
  echo "== $name GPU tests (rc $rc): $(grep -E '(passed|failed|error)' "/tmp/t_$name.log" | tail -1)" \
    | tee -a "$OUT/gpu_tests.log"
  grep -E "FAILED|ERROR|Fatal|Mismatch" "/tmp/t_$name.log" | head -30 >> "$OUT/gpu_tests.log"
  [ "$rc" -ne 0 ] && grep -v -E "cuda_status|Source Location|^$|custom_call.cc" "/tmp/t_$name.log" | tail -150 \
    > "$OUT/t_$name.log"  # (what failed, in full)
  return $rc
}

keep() {  # the last $1 lines of a benchmark's output, without XLA's and CUDA's log noise
  grep -v -E "cuda_status|Source Location|^$|custom_call.cc|Warning|WARNING|^[WI][0-9]" | tail -"$1"
}

prefill_traced() {  # $1: lines of the table to keep; the rest: the --policy configurations. A 4K and a 32K prompt
  # (PROMPTS) in 2,048-token chunks (CHUNK; the default since session 79 — sessions 77-79 ran 512), the first prompt
  # traced — the A/B form of sessions 77-79 — + POLICY
  local n=$1; shift
  timeout $(( $(left) - 5 )) python3 benchmarks/bench_prefill.py --geometry tp4-rank --layers ${LAYERS:-32} \
    --repeats 2 --out "$OUT/prefill.jsonl" --prompt ${PROMPTS:-4096 32768} --chunk ${CHUNK:-2048} --trace "$OUT/trace" \
    --policy "$@" ${POLICY:+"$POLICY"} 2>&1 | keep "$n" > "$OUT/bench_prefill.log"
}

rank1() {  # $1: result name; the rest: bench_decode.py options. The one-rank latency_specialized step, B = 1, 32K
  # (CW: XLA compiles at once with --interleave, default 4; CW=1 compiles one at a time)
  # LAYERS: keep the first N layers (an H100's 80 GB do not hold the 45 layers' 82 GB: 32 fit, 57.7 GB)
  local name=$1; shift
  timeout $(( $(left) - 5 )) python3 benchmarks/bench_decode.py --geometry tp4-rank ${LAYERS:+--layers $LAYERS} \
    --batch 1 --context 32768 \
    --steps 20 --repeats 3 --fast-compile --budget-s $(( $(left) - 60 )) --backend latency_specialized \
    --compile-cache .jax_cache --compile-workers "${CW:-4}" \
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
  s57e)  # (nvidia-h200) q = 4: session 57's row form of the boundary at the verify's 4 token rows (mhc_rows: no
    # wgmma, the only several-row form for Blackwell) against the defaults' grid form, 5 interleaved repeats
    rank1 s57e --q 4 --steps-per-call 4 --interleave --repeats 5 --steps 40 --policy '{}' '{"mhc_rows": true}'
    ;;
  ratio)  # (nvidia-h200, needs_h200) see the header
    rank1 ratio --q 1 --steps-per-call 4 --interleave --repeats 5 --steps 80 --backend auto latency_specialized \
      --policy '{}' ${POLICY:+"$POLICY"}
    # (the paired table in the call's output tail: auto's row against the defaults' is issue #9's ratio)
    python3 benchmarks/ab_table.py "$OUT/decode_ratio.jsonl" 2>&1 | tail -8
    ;;
  e2e)  # (either) see the header
    gpu_tests e2e_kernels 240 gpu "one_grid_gpu or h_rows_gpu or counters_gpu or row_boundary" \
      tests/test_linear_kernels.py tests/test_mhc.py
    gpu_tests e2e 420 "e2e_kernels" "all_kernels_equals_stock_fp8_cache and extra0" tests/test_decode.py
    ;;
  h100)  # (nvidia-h100-x1) see the header
    gpu_tests h100 200 gpu "one_grid_gpu or router_in_the_gate_up or row_boundary" tests/test_mhc.py \
      tests/test_linear_kernels.py
    timeout 150 python3 benchmarks/bench_kernel_profile.py --dir /tmp/kprof \
      --cases mhc_row_lean,moe_rows_lean,moe_one_grid --out "$OUT/kernel_profile.txt" > /dev/null 2>&1
    LAYERS=${LAYERS:-32} rank1 h100 --q 1 --steps-per-call 4 --interleave --repeats 5 --steps 80 \
      --backend auto latency_specialized --policy '{}' "${POLICY:-{\"moe_one_grid\": false\}}"
    ;;
  prefill)  # (either) see the header
    gpu_tests kda_chunked 90 "" chunked tests/test_model_units.py  # (the chunked KDA natively: its hand-over unrolled)
    [ -n "${SKIP_TESTS:-}" ] || gpu_tests moe_prefill 150 gpu "" tests/test_moe_prefill.py
    pl=${LAYERS:+--layers $LAYERS}
    pols=('{}'); [ -n "${XLA_MOE:-}" ] && pols+=('{"moe_prefill": false}')
    timeout $(( $(left) - 20 )) python3 benchmarks/bench_prefill.py --geometry tp4-rank $pl \
      --prompt ${PROMPTS:-4096 32768} --chunk ${CHUNKS:-256} --repeats 1 --policy "${pols[@]}" \
      --trace "$OUT/trace" --out "$OUT/prefill.jsonl" 2>&1 \
      | grep -v -E "cuda_status|Source Location|^$|custom_call.cc" | tail -30 > "$OUT/bench_prefill.log"
    ;;
  prefill_ab)  # (either; H100: LAYERS=32) see the header
    [ -d .carry/base/glm5_jax ] || { echo "prefill_ab: no .carry/base (git archive BASE glm5_jax pallas_kernels \
benchmarks checkpoints | tar -x -C .carry/base, then carry .carry)"; exit 2; }
    out=$(cd "$OUT" && pwd); pl="--geometry tp4-rank --layers ${LAYERS:-32} --prompt ${PROMPTS:-4096 32768} --repeats 1"
    echo "== this tree (traced)"; timeout 190 python3 benchmarks/bench_prefill.py $pl --chunk 256 --trace "$OUT/trace" \
      --out "$OUT/prefill_new.jsonl" 2>&1 | keep 12 | tee "$OUT/new.log"
    echo "== .carry/base"; (cd .carry/base && timeout 160 python3 benchmarks/bench_prefill.py $pl --chunk 256 \
      --out "$out/prefill_base.jsonl") 2>&1 | keep 6 | tee "$OUT/base.log"
    echo "== this tree, 1,024-token chunks"; timeout 140 python3 benchmarks/bench_prefill.py $pl --chunk 1024 \
      --out "$OUT/prefill_new1024.jsonl" 2>&1 | keep 6 | tee "$OUT/new1024.log"
    gpu_tests prefill_paths 70 "" "chunked or grouped or prefill" tests/test_model_units.py tests/test_sparse_mla.py \
      tests/test_moe_prefill.py
    ;;
  dsa)  # (either) see the header
    timeout $(( $(left) - 10 )) python3 benchmarks/bench_dsa_layer.py --context 32768 4096 131072 \
      --budget-s $(( $(left) - 90 )) --out "$OUT/dsa_layer.jsonl" 2>&1 \
      | grep -v -E "cuda_status|Source Location|^$|custom_call.cc|Warning|WARNING|^[WI][0-9]" | tee "$OUT/bench_dsa_layer.log"
    ;;
  longctx)  # (either) see the header
    gpu_tests longctx 150 gpu "chunked or two_stage" tests/test_indexer.py
    timeout 120 python3 benchmarks/bench_topk.py --rows 1,4 --pools 8704,32832,65600,262208 --f32-scores \
      --only "top_k,compact fused,two-stage,two-stage 2bit,two-stage balanced" > "$OUT/bench_topk.log" 2>&1
    timeout $(( $(left) - 10 )) python3 benchmarks/bench_dsa_layer.py --batch 1 --q 1 4 --context 131072 1048576 \
      --budget-s $(( $(left) - 60 )) --out "$OUT/dsa_layer.jsonl" 2>&1 \
      | grep -v -E "cuda_status|Source Location|^$|custom_call.cc|Warning|WARNING|^[WI][0-9]" | tee "$OUT/bench_dsa_layer.log"
    ;;
  partrows)  # (either; H100: LAYERS=32) see the header
    gpu_tests partrows 240 gpu "part_rows_gpu or compact_chunked_gpu" tests/test_linear_kernels.py tests/test_indexer.py
    rank1 partrows --q 4 --steps-per-call 4 --interleave --repeats 5 --steps 40 --policy '{}' \
      "${POLICY:-{\"linear_part_rows\": true\}}"
    [ "$(left)" -gt 150 ] && timeout $(( $(left) - 10 )) python3 benchmarks/bench_dsa_layer.py --batch 1 --q 1 4 \
      --context 131072 1048576 --budget-s $(( $(left) - 40 )) --out "$OUT/dsa_layer.jsonl" 2>&1 \
      | grep -v -E "cuda_status|Source Location|^$|custom_call.cc|Warning|WARNING|^[WI][0-9]" > "$OUT/bench_dsa_layer.log"
    ;;
  mlawg)  # (either; H100: LAYERS=32) see the header
    gpu_tests mlawg 240 gpu "two_warpgroups_gpu or scales_after_gpu" tests/test_sparse_mla.py
    timeout 150 python3 benchmarks/bench_kernel_profile.py --dir /tmp/kprof \
      --cases mla_1x4,mla2_1x4,mlas_1x4,mla2s_1x4,mla_8x4,mla2_8x4,mlas_8x4,mla2s_8x4 \
      --out "$OUT/kernel_profile_mla.txt" > /dev/null 2>&1
    rank1 mlawg --q 1 --steps-per-call 4 --interleave --repeats 5 --steps 80 --policy '{}' \
      '{"mla_dequant_warpgroups": true}' '{"mla_scales_after": true}' \
      '{"mla_dequant_warpgroups": true, "mla_scales_after": true}'
    [ "$(left)" -gt 200 ] && rank1 mlawg --q 4 --steps-per-call 4 --interleave --repeats 5 --steps 40 --policy '{}' \
      "${POLICY:-{\"mla_dequant_warpgroups\": true, \"mla_scales_after\": true\}}"
    ;;
  mlaforms)  # (either) see the header
    timeout 200 python3 benchmarks/bench_sparse_mla.py --only forms --out "$OUT/bench_sparse_mla_forms.log" \
      > /dev/null 2>&1
    timeout $(( $(left) - 10 )) python3 benchmarks/bench_dsa_layer.py --batch 1 8 --q 1 4 --context 32768 \
      --policy '{}' '{"mla_scales_after": true}' '{"mla_dequant_warpgroups": true, "mla_scales_after": true}' \
      --budget-s $(( $(left) - 60 )) --out "$OUT/dsa_layer.jsonl" 2>&1 \
      | grep -v -E "cuda_status|Source Location|^$|custom_call.cc|Warning|WARNING|^[WI][0-9]" | tee "$OUT/bench_dsa_layer.log"
    ;;
  s68a)  # (either; H100: LAYERS=32) see the header
    gpu_tests s68a 300 gpu "group_arrival_gpu or row_scalars_gpu or counters_gpu or x16_gpu or post_finish_gpu" \
      tests/test_sparse_mla.py tests/test_mhc.py
    timeout 120 python3 benchmarks/bench_kernel_profile.py --dir /tmp/kprof \
      --cases mlas_1x4,mlag_1x4,mlas_8x4,mlag_8x4,mhc_row_lean,mhc_row_scalars --out "$OUT/kernel_profile.txt" \
      > /dev/null 2>&1
    ;;
  s68c)  # (either; H100: LAYERS=32) see the header
    timeout 100 python3 benchmarks/bench_sparse_mla.py --only forms --out "$OUT/bench_sparse_mla_forms.log" \
      > /dev/null 2>&1
    [ "$(left)" -gt 200 ] && rank1 s68c --q 1 --steps-per-call 4 --interleave --repeats 5 --steps 80 --policy '{}' \
      '{"mla_group_arrival": true}' '{"mhc_row_scalars": true}'
    ;;
  s68d)  # (either; H100: LAYERS=32) see the header
    POL=('{}')  # (kda_o_grid in the A/B only if its GPU test passed: a hung grid would hang the step)
    gpu_tests s68d_kdao 150 gpu "o_grid_gpu" tests/test_kda_decode.py && POL+=('{"kda_o_grid": true}')
    gpu_tests s68d_s67 240 gpu "group_arrival_gpu or row_scalars_gpu or counters_gpu or x16_gpu or post_finish_gpu" \
      tests/test_sparse_mla.py tests/test_mhc.py
    rank1 s68d --q 1 --steps-per-call 4 --interleave --repeats 5 --steps 80 --policy "${POL[@]}" \
      '{"mla_group_arrival": true}' '{"mhc_row_scalars": true}'
    [ "${#POL[@]}" -gt 1 ] && [ "$(left)" -gt 70 ] && timeout $(( $(left) - 10 )) python3 \
      benchmarks/bench_kernel_profile.py --dir /tmp/kprof --cases kda_1x1,kdao_1x1 --out "$OUT/kernel_profile_kda.txt" \
      > /dev/null 2>&1
    ;;
  s71b|s71c)  # (either; s71b on an H100: LAYERS=32) see the header
    gpu_tests "$MODE" 200 gpu "o_grid_gpu" tests/test_kda_decode.py; ok=$?
    timeout 120 python3 benchmarks/bench_kernel_profile.py --dir /tmp/kprof \
      --cases kdao_1x1,kdaos_1x1,kdaos500_1x1,kdaos2000_1x1 --out "$OUT/kernel_profile_kda_spin.txt" > /dev/null 2>&1
    grep -E "^##|span|loaded|kda |issue|wait|tile|out" "$OUT/kernel_profile_kda_spin.txt" | head -60
    [ "$MODE" = s71b ] && [ "$ok" -eq 0 ] && rank1 s71b --q 1 --steps-per-call 4 --interleave --repeats 9 \
      --steps 80 --policy '{}' "${POLICY:-{\"kda_o_grid_spin\": true\}}"
    ;;
  s72a)  # (either; H100: LAYERS=32) see the header
    # (session 73: what a call holds once most of the session's device time went to refused starts — the new
    # kernels' GPU tests, then the verify step's stack; session 72's full form, the DSA layer's bench and five
    # single knobs, is in git history)
    gpu_tests s72a 120 gpu "uk_kernel_gpu or bf16_gates_gpu" tests/test_sparse_mla.py tests/test_kda_decode.py; ok=$?
    uk=$([ "$ok" -eq 0 ] && echo ', "mla_uk_kernel": true')
    rank1 s72a_q4 --q 4 --steps-per-call 4 --interleave --repeats "${REPEATS:-4}" --steps 40 --policy '{}' \
      "{\"linear_fused_sum\": true$uk}" "{\"linear_fused_sum\": true$uk, \"mhc_rows\": true}" ${POLICY:+"$POLICY"}
    ;;
  pending)  # (either; H100: LAYERS=32) see the header
    gpu_tests pending 120 gpu "bf16_linear_fused_sum_gpu" tests/test_linear_kernels.py
    rank1 pending_q1 --q 1 --steps-per-call 4 --interleave --repeats "${REPEATS:-4}" --steps 80 --policy '{}' \
      '{"kda_qkv_kernel": true}' '{"kda_qkv_kernel": true, "kda_fg_b_kernel": true}' ${POLICY:+"$POLICY"}
    ;;
  s75a)  # (either; H100: LAYERS=32) see the header
    rank1 s75a_defaults --q 1 --steps-per-call 4 --trace --hlo-dir "$OUT/hlo" --policy '{}'
    rank1 s75a_knob --q 1 --steps-per-call 4 --trace --hlo-dir "$OUT/hlo" --policy "${POLICY:-{\"kda_qkv_kernel\": true\}}"
    rm -f "$OUT"/hlo/*.hlo.gz
    ;;
  s76a)  # (either; H100: LAYERS=32) see the header
    gpu_tests mlapf 150 gpu "kernel_gpu and 256" tests/test_sparse_mla.py
    pl="--geometry tp4-rank --layers ${LAYERS:-32} --repeats 2 --out $OUT/prefill.jsonl"
    timeout $(( $(left) - 150 )) python3 benchmarks/bench_prefill.py $pl --prompt ${PROMPTS:-4096 32768} --chunk 256 \
      --policy '{}' "${POLICY:-{\"mla_prefill\": true\}}" --trace "$OUT/trace" 2>&1 | keep 30 > "$OUT/bench_prefill.log"
    [ "$(left)" -gt 160 ] && timeout $(( $(left) - 10 )) python3 benchmarks/bench_prefill.py $pl --prompt 4096 \
      --chunk 512 --policy '{}' "${POLICY:-{\"mla_prefill\": true\}}" 2>&1 | keep 20 > "$OUT/bench_prefill_512.log"
    tail -12 "$OUT/bench_prefill.log" "$OUT/bench_prefill_512.log" 2>/dev/null
    ;;
  s76b)  # (either; H100: LAYERS=32) see the header
    pl="--geometry tp4-rank --layers ${LAYERS:-32} --repeats 2 --out $OUT/prefill.jsonl"
    for c in ${CHUNKS:-256 512 1024}; do  # (a process each: a chunk size whose compile runs long loses only itself)
      [ "$(left)" -gt 60 ] || break
      timeout $(( $(left) - 10 )) python3 benchmarks/bench_prefill.py $pl --prompt ${PROMPTS:-4096 32768} --chunk "$c" \
        --policy "${POLICY:-{\}}" 2>&1 | keep 6 >> "$OUT/bench_prefill.log"
    done
    cat "$OUT/bench_prefill.log"
    ;;
  s76c)  # (either; H100: LAYERS=32) see the header
    gpu_tests mlaforms 90 gpu "prefill_forms_gpu" tests/test_sparse_mla.py
    timeout $(( $(left) - 5 )) python3 benchmarks/bench_prefill.py --geometry tp4-rank --layers ${LAYERS:-32} \
      --repeats 2 --out "$OUT/prefill.jsonl" --prompt ${PROMPTS:-4096} --policy '{}' \
      '{"lean_barriers": false, "mla_scales_after": false}' ${POLICY:+"$POLICY"} ${POLICY2:+"$POLICY2"} 2>&1 | keep 7
    ;;
  s77a)  # (either; H100: LAYERS=32) see the header
    pl="--geometry tp4-rank --layers ${LAYERS:-32} --repeats 2 --out $OUT/prefill.jsonl --prompt ${PROMPTS:-4096}"
    timeout $(( $(left) - 10 )) python3 benchmarks/bench_prefill.py $pl --chunk 512 --trace "$OUT/trace" \
      --policy '{}' '{"topk_prefill": true}' ${POLICY:+"$POLICY"} 2>&1 | keep 16 >> "$OUT/bench_prefill.log"
    for c in ${CHUNKS2:-768}; do
      [ "$(left)" -gt 150 ] || break
      timeout $(( $(left) - 10 )) python3 benchmarks/bench_prefill.py $pl --chunk "$c" 2>&1 | keep 6 \
        >> "$OUT/bench_prefill.log"
    done
    cat "$OUT/bench_prefill.log"
    ;;
  s77b)  # (either; H100: LAYERS=32) see the header
    gpu_tests mhcprefill 60 "" "prefill_form" tests/test_mhc.py
    prefill_traced 24 '{}' '{"mhc_prefill": false}'
    ;;
  s78a)  # (either; H100: LAYERS=32) see the header
    gpu_tests s78a 200 gpu "rows_gpu or kda_prefill_kernel_gpu or moe_prefill_gpu_real" tests/test_indexer.py \
      tests/test_kda_prefill.py tests/test_moe_prefill.py
    # (the three knobs' defaults since: '{}' below was session 77's defaults)
    prefill_traced 30 '{"indexer_prefill": false, "kda_handover": false, "moe_prefill_rows": false}' '{}'
    ;;
  s78b)  # (either; H100: LAYERS=32) see the header
    for c in ${CHUNKS:-1024}; do  # (a process each: a configuration whose compile runs long loses only itself)
      for form in ${FORMS:-policy xla}; do  # (FORMS=policy: the POLICY form only)
        [ "$(left)" -gt 100 ] || break
        if [ $form = policy ]; then opts=(--policy "${POLICY:-{\"kda_chunk_gemm\": true\}}")
        else opts=(--policy '{}' --prefill-xla-option "${PXLA:-xla_gpu_experimental_enable_fusion_autotuner=false}"); fi
        timeout $(( $(left) - 10 )) python3 benchmarks/bench_prefill.py --geometry tp4-rank --layers ${LAYERS:-32} \
          --repeats 2 --out "$OUT/prefill.jsonl" --prompt ${PROMPTS:-4096 32768} --chunk "$c" "${opts[@]}" 2>&1 \
          | keep 8 >> "$OUT/bench_prefill.log"
      done
    done
    cat "$OUT/bench_prefill.log"
    ;;
  s79d)  # (either; H100: LAYERS=32) see the header
    prefill_traced 30 '{}' '{"bf16_products": true}'
    ;;
  s82a)  # (either; H100: LAYERS=32) see the header
    gpu_tests kda_pairwise 300 gpu "pairwise_gemm_gpu or fp8_moe_prefill_gpu_real_shapes" tests/test_model_units.py \
      tests/test_moe_prefill.py; ok=$?
    res=(); [ "$ok" -eq 0 ] && res=('{"moe_prefill_tokens_m": true}')
    prefill_traced 30 '{}' "${res[@]}"
    ;;
  s77e)  # (either; H100: LAYERS=32) see the header
    for c in ${CHUNKS:-1024 768}; do  # (a process each: a chunk size whose compile runs long loses only itself)
      [ "$(left)" -gt 100 ] || break
      timeout $(( $(left) - 10 )) python3 benchmarks/bench_prefill.py --geometry tp4-rank --layers ${LAYERS:-32} \
        --repeats 2 --out "$OUT/prefill.jsonl" --prompt ${PROMPTS:-4096 32768} --chunk "$c" \
        ${PXLA:+--prefill-xla-option "$PXLA"} --policy "${POLICY:-{\"kda_handover\": true\}}" 2>&1 | keep 6 \
        >> "$OUT/bench_prefill.log"
    done
    cat "$OUT/bench_prefill.log"
    ;;
  s72b)  # (either) see the header
    timeout $(( $(left) - 10 )) python3 benchmarks/bench_linear.py --only none --sweep-bf16 4,1 \
      --budget-s $(( $(left) - 40 )) --out "$OUT/bench_linear_bf16_sweep.txt" 2>&1 | grep -E "^#|bf16" | tail -40
    ;;
  stream)  # (either) see the header
    for mb in 37.7 75; do
      timeout 120 python3 benchmarks/bench_stream.py --mb "$mb" --out "$OUT/stream_$mb.txt" 2>&1 \
        | grep -E "^\||^#" | tee -a "$OUT/stream.log"
    done
    ;;
  s68b)  # (either; H100: LAYERS=32) see the header
    timeout 90 python3 benchmarks/bench_kernel_profile.py --dir /tmp/kprof --cases mhc4_lean,mhc_row4_lean \
      --out "$OUT/kernel_profile_m4.txt" > /dev/null 2>&1
    rank1 s68b --q 4 --steps-per-call 4 --interleave --repeats 5 --steps 40 --policy '{}' '{"mhc_rows": true}'
    ;;
  blackwell)  # (a Blackwell kind) see the header
    gpu_tests blackwell $(( $(left) - 20 )) blackwell "" tests/test_sparse_mla.py tests/test_indexer.py \
      tests/test_moe_prefill.py
    ;;
  bigbatch)  # (nvidia-h200, needs_h200) see the header
    rank1 bigbatch --batch 32 --q 4 --steps 10 --repeats 3 --policy '{}' '{"moe_prefill": true}'
    ;;
  s57d)  # (nvidia-h200) the step traced at q = 1 with the defaults (POLICY: more) — the sublayer chains with the
    # one-row lean boundary (benchmarks/sublayer_chain.py on the events and kernels files)
    rank1 s57d --q 1 --steps-per-call 4 --trace --hlo-dir "$OUT/hlo" --policy "${POLICY:-{\}}"
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
