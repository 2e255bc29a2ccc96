#!/usr/bin/env bash
# One device call: GPU tests, kernel benchmarks and the decode benchmark, logs under $OUT (or ./gpu_out).
# Usage on the device machine (repo root):  bash benchmarks/gpu_session.sh MODE [budget_seconds]
#   single  (nvidia-h200):    GPU tests, sparse-MLA/indexer benchmark, then the decode benchmark — one after another
#   pair    (nvidia-h200-x2): the same work split over the two GPUs (tests + kernel benchmarks on GPU 0, the
#                             real-geometry decode benchmark on GPU 1, concurrently)
#   tp2     (nvidia-h200-x2): all-reduce benchmark, TP2 == TP1 GPU tests, then the TP2 decode benchmark (12 real
#                             layers, profiled) with --collectives xla and graph
#   layers8 (nvidia-h200-x2): 8 layers of one TP4 rank, auto vs latency_specialized with profile; sparse-MLA and
#                             end-to-end kernel GPU tests on the other GPU
#   cmdbuf  (nvidia-h200-x2): the latency_specialized step of 8 layers under XLA command-buffer variants
#   full    (nvidia-h200-x2): the whole one-rank step, auto (GPU 0) and latency_specialized (GPU 1) side by side
#   verify  (nvidia-h200-x2): kernels not yet run natively, bench_mhc, bench_sparse_mla, end-to-end tests (GPU 0); the
#                             whole one-rank latency_specialized step with and without the fused mHC (GPU 1)
#   trace   (nvidia-h200-x2): the whole one-rank step traced (wall vs GPU time: gaps, host events), ls on GPU 0 and
#                             auto on GPU 1, then both at q = 4 with the per-component profile
#   launch  (nvidia-h200-x2): mHC GPU tests + the CUDA-graph launch experiment (bench_graph_launch.py) on GPU 0;
#                             the one-rank step with one vs two alternating executables, then mhc_finish off, then auto
#                             with one vs two executables, on GPU 1
#   mosaic  (nvidia-h200-x2): is the host-bound launch the Mosaic custom calls inside the CUDA graph? GPU 0: the
#                             one-rank step with the default command buffers, then with custom calls kept out of
#                             them (-CUSTOM_CALL); GPU 1: the synthetic launch experiment with Mosaic kernels in
#                             the chain, then the end-to-end kernel tests (router_topk natively)
#   host    (nvidia-h200):    the host-bound one-rank step alone on one GPU (nothing else running): latency_specialized
#                             q = 1 with parameters unpacked vs packed under 64 KiB (pack_params; optimised HLO kept
#                             to check XLA slices without copies), then with the mHC finish in XLA (90 fewer
#                             Mosaic calls, ~12.7 µs of host time each), the fused mHC off (180 fewer), then auto
#   profile (nvidia-h200):    mHC, weight-streaming and KDA GPU tests (with WITH_TESTS=1), bench_mhc (kernels per boundary),
#                             bench_topk (the radix variants), bench_cluster_exchange, then the one-rank latency_specialized
#                             step (defaults: packed parameters) at q = 1 and 4 with the CUPTI profile; every kernel's
#                             time (*.kernels.json) and the optimised HLO kept to read against each other offline
#   topk    (nvidia-h200):    the one-rank latency_specialized step at q = 1 with the indexer's top-k by radix
#                             selection (policy indexer_topk) vs XLA's sort, profiled; then both at q = 4 if time
#                             remains
#   q4      (nvidia-h200):    the mHC GPU tests (+ the trunk through the fused boundaries natively), the one-rank
#                             latency_specialized step at q = 1 (defaults, profiled, HLO kept), then at q = 4
#                             without and with the indexer's top-k by radix selection, then q = 1 with it, traced
#   defaults (nvidia-h200):   bench_linear at M = 1, 4, 8, 32, 64 (issue #8's table), then the current defaults at
#                             q = 4 and q = 1, profiled, then with the KDA gated norm in the kernel (kda_norm); the
#                             end-to-end kernel tests if time remains
#   dq      (nvidia-h200):    the FP8 kernels with the weight dequantised in registers and bf16 activations (policy
#                             fp8_dq): their GPU tests, bench_linear fp8 vs fp8dq and moe vs moedq at M = 1, 4, 8, the
#                             one-rank step at q = 1 and 4 with {"fp8_dq": true} (profiled), the e2e test natively
#   hostflags (nvidia-h200):  the synthetic launch program with Mosaic calls under XLA's command-buffer update modes
#                             (default, SKIP_TEMP, SKIP_PROFILED) + a VLOG of what XLA re-records per execution, then
#                             the one-rank q = 1 step under SKIP_PROFILED (the per-Mosaic-call host cost, issue #9)
#   s25     (nvidia-h200):    session 25's CPU work natively: the sparse MLA GPU tests (one-row cache format, pools
#                             gathered by one TMA) and the mHC ones (Sinkhorn split), bench_sparse_mla (pooled index
#                             lists, B up to 32), bench_mhc, then the one-rank step at q = 1 and 4, profiled
#   s27     (nvidia-h200):    session 26's CPU work natively: the weight-streaming GPU tests (x read unpadded, the TMA's
#                             zero fill) and the mHC ones (sums [40, M rounded up to 4]), then the one-rank step at
#                             q = 1 (kernel table + HLO kept) and q = 4, then the end-to-end greedy test if time remains
#   s27host (nvidia-h200):    where the host time of the CONCURRENT step goes: the one-rank step at q = 1 traced
#                             under CONCURRENT (the default), under CONCURRENT_REGIONS, under LHS, with parameters
#                             under 4 MiB packed (396 arguments instead of 866); a VLOG of command-buffer updates
#                             under CONCURRENT; the MoE plan sweep at M = 1 (4-stage rings at 3 CTAs per SM)
#   s28 (nvidia-h200):        session 27's kernels (top-k threshold, router, KDA in-place operands) natively, the
#                             step at q = 1 / 4 with kernel tables, bench_topk, the e2e greedy test
#   s28ab (nvidia-h200):      the fixed wide-f KDA GPU test; on one machine the q = 1 step now (memcpy candidates
#                             listed), session 27's tree (.carry/s27tree = `git archive 7283471`, run carries it) and
#                             now with the router / threshold kernels off
#   s28c (nvidia-h200):       the threshold kernel from 2 score rows only: q = 1 / 4 with kernel tables, B = 8 q = 4,
#                             B = 32 q = 1
#   s29b (nvidia-h200):       the top-k threshold kernel with 2 bits per pass: GPU tests, bench_topk, the step at
#                             q = 4, q = 1 (forced) and B = 8 q = 4 with it
#   s29c (nvidia-h200):       1 and 4 steps per call at q = 1 profiled with kernel tables and listings, then the
#                             steps_per_call GPU test
#   s32 (nvidia-h200):        the loop forms (session 31: unrolled straight-line kernels suspected slow): threshold /
#                             boundary GPU tests, bench_topk rolled vs unrolled, bench_kda_decode --q4, q = 1 +- boundary
#   s33a (nvidia-h200):       the GPU tests of every kernel built since session 31 (KDA token loop / conv,
#                             mhc_fused_sums, the grid-barrier boundary, PDL, rotating index queries, router_route,
#                             the sparse MLA's merge forms), bench_topk, bench_pdl (PDL inside the CUDA graph?),
#                             bench_mhc (narrow / sums / grid)
#   s44b (nvidia-h200):       s44a's chained MoE with the down CTAs reading the stored selection: GPU tests,
#                             bench_linear moerk vs moech, q = 1: defaults vs moe_chained (+ moe_chained_sum)
#   s50a (nvidia-h200):       the single-row MoE's slot table static (moe_static_table: the slot count a number,
#                             the down kernel's ids / weights staged into SMEM by TMA) and its selection's writer an
#                             extra CTA (moe_writer_cta): GPU tests, in-kernel profiles and bench_linear with / without,
#                             then q = 1 defaults vs each vs both (5 interleaved rounds)
#   s50b (nvidia-h200):       session 50's defaults (the one-launch selection) at q = 1 traced: events + kernel listing
#                             for benchmarks/sublayer_chain.py (is the DSA layer's q path now as long as the indexer's?)
#   s50c (nvidia-h200):       q = 1: defaults vs linear_fused_sum (at one row: the FP8 linears' K splits summed in
#                             the kernel), now that the DSA layer's query path may be its longest (5 interleaved
#                             rounds); then q = 4: session 50's defaults vs linear_fused_sum (3 rounds)
#   s49g (nvidia-h200):       the step's single-row MoE form (moe_rows) under plan variants (bench_linear
#                             --sweep-moerows: gate/up D splits, tiles, rings, the down kernel's groups)
#   s49f (nvidia-h200):       the dequantising FP8 GEMV at one row: every shape (qkv_a added), then the plan sweep of
#                             the DSA layer's linears (K splits 2..32; s48e: qkv_a 9.5 µs for 8.4 MB in the step)
#   s49e (nvidia-h200):       auto vs latency_specialized at q = 1 (no MTP pass at k = 0 since session 49; issue #9's
#                             ratio), then q = 4 with the defaults
#   s49c (nvidia-h200):       q = 1: defaults vs kda_gate_proj vs the bf16 GEMV kernel at one row with its split sums
#                             inside (bf16_linear forced + linear_fused_sum), 5 interleaved repeats — launch-count
#                             cuts (issue #14) last measured as ties on older defaults
#   s49d (nvidia-h200):       the kernel-tiny e2e GPU tests of topk_compact_kernel (alone and with topk_compact_fused)
#   s49b (nvidia-h200):       the indexer's compaction as one multi-CTA launch (topk_compact_kernel; with
#                             topk_compact_fused no threshold kernel at all) and pool_update's parameters in their
#                             stored dtype: GPU tests, bench_topk at 8,704 pools, then q = 1 defaults vs compact vs
#                             compact + fused (5 interleaved repeats)
#   s49a (nvidia-h200):       the boundary's second half on the 16 partial columns it reads: mHC GPU tests, its
#                             in-kernel profile, the boundary alone (M = 1, 4); the step's MoE form (moe_rows)
#                             profiled inside and alone; then the q = 1 defaults
#   s48e (nvidia-h200):       the new defaults (mla_uv_kernel + moe_rows) at q = 1 traced (events + kernel listing)
#   s48d (nvidia-h200):       mhc_post_finish's in-kernel profile with finer scopes, the boundary alone (M = 1, 4)
#   s48c (nvidia-h200):       q = 1: defaults vs mla_uv_kernel + moe_rows vs mla_uv_kernel (5 interleaved repeats)
#   s48a (nvidia-h200):       session 47's final commit natively: the plane-major latent cache (sparse MLA GPU tests,
#                             the defaults end to end), mla_absorb_uv's GPU tests + e2e (budget 590)
#   s48b (nvidia-h200):       q = 1: defaults vs mla_uv_kernel vs moe_rows (5 interleaved repeats)
#   s47e (nvidia-h200):       q = 1: defaults vs moe_rows (5 interleaved repeats)
#   s47d (nvidia-h200):       the kernel-tiny e2e test of indexer_pool_kernel (16-row prefill), then q = 1 defaults
#   s47c (nvidia-h200):       pool_update's GPU tests (the pooling's rows by TMA from the ring)
#   s47b (nvidia-h200):       pool_update at up to 16 rows natively (GPU tests, the probe, the e2e test), the linears'
#                             fused split sums' GPU tests, then q = 1: defaults vs linear_fused_sum (+ moe_rows) vs
#                             kda_gate_proj (5 interleaved repeats)
#   s47a (nvidia-h200):       session 46's final commit natively: pool_update / its row-copy probe, the end-to-end
#                             tests of indexer_pool_kernel and moe_rows, then q = 1 with the defaults
#   s46d (nvidia-h200):       pool_update's GPU tests at 1 / 4 / 8 / 16 rows (the gate scores through f32)
#   s46c (nvidia-h200):       pool_update at <= 8 rows natively; moe_rows: its GPU test, then q = 1 defaults vs it
#   s46b (nvidia-h200):       indexer_pool_kernel on by default: its GPU tests (whole output kept), then the q = 1
#                             step traced (events + kernel listing kept)
#   s46a (nvidia-h200):       the indexer's cache update as one launch (indexer_pool_kernel): its GPU tests, then q = 1
#                             defaults vs the knob (5 interleaved repeats), then the knob's step traced
#   s45d (nvidia-h200):       the new defaults (topk_threshold_exit on): their end-to-end GPU test, then q = 1
#   s45c (nvidia-h200):       q = 1: defaults vs topk_threshold_exit vs + dsa_index_keys_first (5 interleaved
#                             repeats), then the last traced (events + kernel listing kept)
#   s45b (nvidia-h200):       the threshold kernel's early exit (topk_threshold_exit): its GPU tests, bench_topk on
#                             f32 scores, then q = 1 defaults vs the knob (5 interleaved repeats; kernel listings kept)
#   s45a (nvidia-h200):       the q = 1 step's trace kept (device events + HLO) with the defaults, for reading each
#                             sublayer's kernel chain offline (benchmarks/sublayer_chain.py)
#   s44a (nvidia-h200):       the single-row MoE as ONE launch of two roles (fp8_moe_chained, knob moe_chained): its
#                             GPU tests and the end-to-end test with it, bench_linear moerk vs moech, then q = 1:
#                             defaults vs moe_chained (5 interleaved repeats, 80 steps)
#   s43d (nvidia-h200):       the new defaults (s43c's five knobs on): their end-to-end GPU tests, then q = 1
#   s43c (nvidia-h200):       q = 1: defaults vs four tied knobs at once (indexer_q_in_kernel, topk_keys_in_kernel,
#                             mla_combine_kernel, kda_conv), and with mhc_barrier_counters (5 interleaved repeats)
#   s43b (nvidia-h200):       the q = 1 step's trace kept (device events + HLO) and what ran during the measured
#                             critical path's longest waits
#   s43a (nvidia-h200):       the measured critical path (a trace's start / end times, each kernel's latest input)
#                             of the q = 1 step at 4 steps per call: defaults, then with indexer_q_in_kernel
#   s42d (nvidia-h200):       the select kernel with its scatter and tiles as loops (measured slower: 31.0 µs; the
#                             package keeps the unrolled form): GPU tests, bench_topk
#   s42c (nvidia-h200):       q = 1: defaults vs indexer_q_in_kernel (the index queries' rotation) and kda_conv (the
#                             KDA conv), both on the chain by GPU time; SELECT=1: also topk_select_kernel, all three
#   s42b (nvidia-h200):       topk_select_kernel (the indexer's selection in one launch: early-exit threshold, wgmma
#                             prefix counts, an inline scatter): GPU tests, q = 1 defaults vs it, then the defaults'
#                             end-to-end GPU test (moe_router_ranks on since s42a)
#   s42a (nvidia-h200):       the selection inside the MoE's gate/up kernel made cheaper (it delays each CTA's first
#                             weight request): router_warp_rows (one warp's reductions) and moe_router_ranks (a CTA
#                             only up to its slot's rank) — GPU tests, then q = 1 defaults vs each and both
#   s41c (nvidia-h200):       q = 1 with session 41's defaults (moe_router_in_kernel on) profiled at one step per
#                             call: the chain by GPU time launch by launch (*.critical_gpu.tsv), the kernel table
#   s41b (nvidia-h200):       moe_router_in_kernel (the router's selection inside the MoE's gate/up kernel): its GPU
#                             tests (unit, bf16 / f16; the end-to-end kernel-tiny decode), q = 1 defaults vs the knob
#                             (5 interleaved repeats, 80 steps), then auto vs latency_specialized at 4 steps per call
#   s41a (nvidia-h200):       L2 prefetch from a latency-bound kernel (bench_l2_prefetch: a 128-CTA stand-in that
#                             prefetches the first P MB of the next weight, spins, passes x on; XLA / bf16 / fp8dq
#                             consumers, P = 0..48 MB)
#   s40e (nvidia-h200):       the dq kernels in f16 (dq_f16) and the persistent MoE with it: GPU tests, the in-kernel
#                             profiles of warm calls (MoE, persistent bf16 / f16, mHC boundary), bench_linear moedq
#                             vs moep bf16 / f16, then q = 1: defaults vs dq_f16 vs dq_f16 + moe_persistent
#   s40d (nvidia-h200):       the in-kernel profiler (bench_kernel_profile: named scopes' times per warpgroup) on the
#                             MoE's two kernels, the persistent MoE and the mHC boundary, at the real shapes
#   s40c (nvidia-h200):       fp8_moe_balanced (the single-row MoE's two kernels with the work dealt out evenly): its
#                             GPU tests, bench_linear moedq vs moeb, then q = 1 defaults vs moe_balanced
#   s40b (nvidia-h200):       fp8_moe_persistent (the single-row MoE as one launch): its GPU test, bench_linear moedq
#                             vs moep at M = 1, then q = 1 defaults vs moe_persistent (5 interleaved repeats, 80 steps)
#   s40a (nvidia-h200):       the chain by GPU time weighed right (fusions sharing one kernel: its time): q = 1 and
#                             q = 4 profiled at one step per call, the chains launch by launch (*.critical_gpu.tsv)
#   s39c (nvidia-h200):       router_warp_rows' and topk_keys_in_kernel's GPU tests, q = 1: defaults vs each (and
#                             both), then q = 1 profiled at one step per call with the chain by GPU time weighed
#                             right (fusions sharing one kernel: its time), launch by launch (*.critical_gpu.tsv)
#   s39b (nvidia-h200):       topk_keys_in_kernel natively at the model's call site (and its kernel's GPU tests), then
#                             defaults vs topk_keys_in_kernel at q = 1 (5 interleaved repeats) and q = 4 (3)
#   s39a (nvidia-h200):       the first profile that sees every launch (q = 1 at one step per call: kernel table,
#                             the chain by GPU time, components against their floors); q = 4: defaults vs the three
#                             chain knobs; q = 1: defaults vs topk_keys_in_kernel
#   s38a (nvidia-h200):       kda_gate_proj's GPU tests, then q = 1: defaults vs kda_gate_proj (5 interleaved
#                             repeats), then the MoE rows-form GPU test at M = 1
#   s37c (nvidia-h200):       the threshold kernel fed the scores natively, the candidates' all-kernels == stock test,
#                             then q = 1: defaults vs topk_keys_in_kernel / mla_combine_kernel
#   s37b (nvidia-h200):       q = 1 profiled with linear_fused_sum (kernel table, the chain by GPU time), then the
#                             defaults the same way: where the rows form's time goes
#   s37a (nvidia-h200):       session 36's rows form (fused-sum kernels writing the token rows; the MoE's h / y rows)
#                             natively (GPU tests by node id), then q = 1 and 4: defaults vs linear_fused_sum (4 steps
#                             per call, 5 interleaved repeats)
#   s36a (nvidia-h200):       the barrier counters' and the fused split-K sums' GPU tests; the step's critical path (the longest kernel dependence
#                             chain) at q = 1 / 4 from the compiled HLO; q = 1 profiled (the chain by GPU time, the
#                             kernel table); the all-kernels step with the candidates on
#   s36b (nvidia-h200):       q = 1 at 4 steps per call: defaults vs mhc_barrier_counters / linear_fused_sum /
#                             indexer_q_in_kernel / topk_scan_mm
#   s35a (nvidia-h200):       the 2-/4-warpgroup threshold GPU tests and the all-kernels step with the candidates on
#                             (kda_conv, router_route), then q = 1 at 4 steps per call: defaults + a cumulative ladder
#                             of topk_threshold_4wg, kda_conv, topk_scan_mm + indexer_q_in_kernel
#   s34a (nvidia-h200):       session 34's leftovers natively (the warpgroup-reduction race and the rebuilt
#                             router_route / 2-4-warpgroup threshold kernel; kda_conv's and the rotating index
#                             queries' GPU tests with references that round as the model; mhc_fused_sums' tests),
#                             then q = 1 at 4 steps per call: defaults vs topk_threshold_4wg / kda_conv /
#                             topk_scan_mm / mla_combine_kernel (CANDIDATES overrides)
#   s34b (nvidia-h200):       q = 1 profiled with its kernel table (where the new defaults' launches and time go),
#                             then q = 4: defaults vs router_route (ROUTE=0: without it)
#   s34c (nvidia-h200):       auto vs latency_specialized at 4 steps per call (#9's 2x), then the defaults with
#                             xla_allow_excess_precision=false (bf16 intermediates rounded as HF does)
#   s33b (nvidia-h200):       q = 1 at 4 steps per call: defaults vs each candidate (CANDIDATES), then q = 4 with ALL_ON
#   s33c (nvidia-h200):       the end-to-end GPU tests gating the KDA defaults; q = 1 profiled (POLICY) with its table;
#                             bench_sparse_mla --only combine; auto vs latency_specialized at 4 steps per call
#   s32p (nvidia-h200):       q = 1 at 4 steps per call (session-32 defaults) profiled with its kernel table; auto vs
#                             latency_specialized at 4 steps per call (issue #9); bench_topk's matmul prefix sums
#   s32f (nvidia-h200):       the KDA token loop's / kda_conv's GPU tests, the all-kernels and KDA greedy tests with
#                             session 32's defaults (threshold at one row, mhc_narrow); mhc_fused_sums' GPU tests and
#                             bench_mhc (fused / narrow / sums)
#   s32g (nvidia-h200):       q = 1 and q = 4 at 4 steps per call: defaults vs + the KDA token loop with approx math
#                             (+ kda_conv), mhc_fused_sums; q = 4 +- mhc_narrow; bench_kda_decode --q4 (conv rows)
#   s32d (nvidia-h200):       mhc_narrow's GPU tests; q = 1 (threshold at one row) +- mhc_narrow; q = 4 +- the KDA token
#                             loop with approx math
#   s32b (nvidia-h200):       q = 1 at 4 steps per call: defaults, threshold (1 / 2 bits) at one row, kda token loop +
#                             approx math, mhc_narrow; q = 4 +- the KDA token loop (+ approx math)
#   s31b (nvidia-h200):       bench_mhc (the one-launch boundary alone); q = 4 at 4 steps per call, kda_norm vs defaults
#   s31 (nvidia-h200):        the one-launch boundary's GPU tests one by one (timed, tracebacks if stuck); q = 1 at 4
#                             steps per call: kda_norm vs defaults vs + mhc_boundary
#   s30 (nvidia-h200):        the 2-bit threshold kernel's and the one-launch mHC boundary's GPU tests; at 4 steps
#                             per call (GPU-bound), q = 1: the policy knobs A/B interleaved (mhc_boundary,
#                             threshold 1 / 2 bits at one row, kda_norm, kda_approx_math, split Sinkhorn)
#   s30b (nvidia-h200):       q = 4 at 1 vs 4 steps per call with / without the 2-bit threshold; q = 1 at 4 steps
#                             per call profiled with its kernel table
#   s30e (nvidia-h200):       auto vs latency_specialized at 1 and 4 steps per call, q = 1, interleaved (#9's 2x)
#   s30d (nvidia-h200):       q = 4 at 4 steps per call profiled + traced with its kernel table and listing
#   s30c (nvidia-h200):       bench_kda_decode --q4 (approx-math / gates-first variants); bench_mhc (the
#                             one-launch boundary alone); 4 vs 8 steps per call traced
#   s29d (nvidia-h200):       packed vs unpacked parameters at 4 / 8 steps per call; loop-invariant code motion
#                             off; q = 4 at 1 vs 4 steps per call
#   s29 (nvidia-h200):        steps_per_call: 1 vs 4 steps per call (a device-side loop) interleaved at q = 1, the
#                             steps_per_call GPU test, the same at q = 4, then q = 1 profiled with its kernel table
#   thr (nvidia-h200):        the top-k threshold kernel's GPU tests and bench_topk with it
#   s27b (nvidia-h200):       the q = 4 step with its kernel table, then batch27's runs
#   batch27 (nvidia-h200):    B = 8 q = 4 and B = 32 q = 1 with the trained-like router, then bench_kda_decode's matrix
#   s26     (nvidia-h200):    the MoE with the shared slot under the rebalanced plans (bench_linear, M = 1 and 4, + a
#                             plan sweep with the previous defaults), then the one-rank step with the session's
#                             defaults (CONCURRENT command-buffer schedule, MoE plans) at q = 1, q = 1 with the
#                             Sinkhorn split off the sublayer's path, q = 4, and B = 8 q = 1 if time remains
#   concurrent (nvidia-h200): XLA's CONCURRENT command-buffer schedule (graph nodes ordered by buffer dependencies
#                             only: independent small kernels may overlap): the GPU equivalence test, then the one-rank
#                             step at q = 1 and 4 under it (profiled), q = 1 with {"mhc_sinkhorn_split": true}, then
#                             q = 1 with the default schedule
#   rest    (nvidia-h200):    the end-to-end greedy test with fp8_dq natively, bench_kda_decode --q4 (issue #6's
#                             variants), then the stock XLA step at q = 4 (what the batch call ran out of time for)
#   glue    (nvidia-h200):    a short call: the grouped MoE's glue on the real token columns only (bench_linear, M = 1,
#                             4, 8), the one-rank step at q = 1 profiled, then bench_topk's chosen forms (session 24
#                             also compared a scatter-free compaction there: slower, removed)
#   rows    (nvidia-h200):    bench_linear's rows the defaults call ran out of time for (grouped MoE at M = 1..64, bf16
#                             at 32 and 64), the one-rank step at B = 8, q = 1 (profiled), then B = 1 with kda_norm
#   batch   (nvidia-h200):    the one-rank step at B = 8 (q = 1, 4) and B = 32 (q = 1), profiled: issue #9's batch
#                             sizes (the kernels' M grows to 8-32 rows), then bench_kda_decode's B x q matrix
#   hang    (nvidia-h200):    4 real layers at q = 4, every kernel family alone and all together as concurrent
#                             processes: which one stalls (LAYERS=N for more layers)
#   bisect  (nvidia-h200):    sparse-MLA GPU tests, the latency_specialized step of 8 layers of one TP4 rank with
#                             one kernel family at a time (finds a kernel that faults or hangs), then the
#                             end-to-end kernel tests if time remains
# Sections print as they finish; the decode benchmarks stop starting new configurations at the budget.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT="${OUT:-gpu_out}"; mkdir -p "$OUT"
MODE="${1:-single}"; BUDGET="${2:-480}"
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

kernel_tables() {  # $@: the q values. Each profiled step's kernel table with every fusion's JAX op, read here (the
  # step's HLO is too large to come back: > 16 MiB), then the HLO dropped
  for q in "$@"; do
    for k in "$OUT"/hlo/*_q${q}_*.kernels.json; do
      [ -f "$k" ] && timeout 60 python3 benchmarks/kernel_table.py "$k" --hlo "${k%.kernels.json}.hlo.gz" \
        > "$OUT/kernel_table_$(basename "${k%.kernels.json}").txt" 2>&1
    done
  done
  rm -f "$OUT"/hlo/*.hlo.gz "$OUT"/hlo/*.kernels.json  # (the tables and the kernels.tsv listings come back)
}

pdl_probe() {  # bench_pdl: a chain of dependent Mosaic launches in the CUDA graph, with / without PDL: XLA's default
  # flags; PDL on in XLA with the custom calls marked uses_pdl; no command buffers (stream launches: does PDL work
  # at all here). Each a process (XLA reads its flags once)
  [ "$(left)" -gt 100 ] && timeout -k 9 80 python3 benchmarks/bench_pdl.py --out "$OUT/pdl.jsonl" \
    >> "$OUT/bench_pdl.log" 2>&1
  [ "$(left)" -gt 100 ] && XLA_FLAGS="--xla_gpu_enable_pdl=true" timeout -k 9 80 python3 benchmarks/bench_pdl.py \
    --uses-pdl-attr --variants plain,pdl,pdl_step --out "$OUT/pdl.jsonl" >> "$OUT/bench_pdl.log" 2>&1
  [ "$(left)" -gt 100 ] && XLA_FLAGS="--xla_gpu_enable_command_buffer=" timeout -k 9 80 python3 \
    benchmarks/bench_pdl.py --variants plain,pdl,pdl_step,xla --out "$OUT/pdl.jsonl" >> "$OUT/bench_pdl.log" 2>&1
}

gt() {  # $1: seconds at most, $2: test file or node id, $3: -k expression (GT_MARK: the -m expression, default gpu —
  # the end-to-end kernel tests of the defaults are marked e2e_kernels only). GPU tests with every test's outcome (-rA),
  # each call bounded by the budget left (-k 9: a kernel that never returns cannot hold the call); a selection of
  # no tests is logged too (session 36's -k matched the checkout's directory name and left an empty log)
  [ "$(left)" -gt 60 ] || return 0
  local t=$(( $1 < $(left) - 30 ? $1 : $(left) - 30 ))
  timeout -k 9 -s INT "$t" python3 -m pytest -q -rA -m "${GT_MARK:-gpu}" -p no:cacheprovider "$2" ${3:+-k "$3"} 2>&1 \
    | grep -E "^(PASSED|FAILED|XFAIL|XPASS|ERROR)|passed|failed|Interrupt|no tests ran|deselected" | head -40 \
    | sed "s|^|$(basename "$2"): |" | tee -a "$OUT/gpu_tests.log"
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
  hang)  # (nvidia-h200) which kernel family stalls the q = 4 step (session 22: the 45-layer q = 4 first call never
    # returned): 4 real layers (3 KDA + 1 DSA, the MTP layer) at q = 4, every family alone and all together, as
    # concurrent processes on the one GPU (memory grown on demand); each reports its first call or times out
    ALL="kda fp8_linear fp8_moe indexer sparse_mla mhc router_topk indexer_topk"
    RUN="all kda fp8_linear fp8_moe indexer sparse_mla mhc router_topk"  # (indexer_topk is off by default)
    for k in $RUN; do
      if [ "$k" = all ]; then pol="{}"; else
        pol="{$(for o in $ALL; do [ "$o" = "$k" ] && echo "\"$o\": true" || echo "\"$o\": false"; done | paste -sd,)}"; fi
      XLA_PYTHON_CLIENT_PREALLOCATE=false timeout $(( BUDGET - 40 )) python3 benchmarks/bench_decode.py \
        --geometry tp4-rank --layers "${LAYERS:-4}" --batch 1 --q 4 --backend latency_specialized --policy "$pol" \
        --context 32768 --steps 3 --repeats 1 --fast-compile > "$OUT/hang_$k.log" 2>&1 &
    done
    wait
    for k in $RUN; do
      echo "== $k: $(grep -E "first call|FAILED|Error|packed +1 +4" "$OUT/hang_$k.log" | tr '\n' ' ' | cut -c1-300)" \
        | tee -a "$OUT/bench_hang.log"
    done
    ;;
  bisect)  # which kernel family breaks the real-geometry step: each alone on 8 layers of one TP4 rank, q = 1
    # on nvidia-h200-x2 the families split over the two GPUs (GPU 0 also runs the kernels' GPU tests first)
    ngpu=$(nvidia-smi -L | wc -l)
    bisect_one() {  # $1 = GPU, $2.. = kernel families, each alone
      local g=$1; shift
      for k in "$@"; do
        pol="{$(for o in $ALL; do [ "$o" = "$k" ] && echo "\"$o\": true" || echo "\"$o\": false"; done | paste -sd,)}"
        [ "$(left)" -gt 100 ] || break
        CUDA_VISIBLE_DEVICES=$g timeout $(( $(left) > 170 ? 150 : $(left) - 20 )) python3 benchmarks/bench_decode.py \
          --geometry tp4-rank --layers 8 --batch 1 --q 1 --backend latency_specialized --policy "$pol" \
          --context 32768 --steps 5 --repeats 1 --fast-compile > /tmp/bisect_$k.log 2>&1
        rc=$?
        echo "== kernels: $k (rc $rc, GPU $g) $(grep -E "latency_specialized|FAILED|Error|fault" /tmp/bisect_$k.log | head -5)" \
          | tee -a "$OUT/bench_bisect_$g.log"
      done
    }
    ALL="kda fp8_linear fp8_moe indexer sparse_mla mhc router_topk indexer_topk"  # every policy switch: "none" = stock
    gpu_tests() {  # $1 = GPU
      for f in test_sparse_mla test_linear_kernels test_indexer; do
        CUDA_VISIBLE_DEVICES=$1 timeout 150 python3 -m pytest -v -m gpu -p no:cacheprovider tests/$f.py 2>&1 \
          | grep -E "PASSED|FAILED|ERROR|passed|failed|^E  " | head -40 >> "$OUT/gpu_tests.log"
      done
    }
    if [ "$ngpu" -ge 2 ]; then
      ( gpu_tests 0; bisect_one 0 kda fp8_linear ) &
      bisect_one 1 none sparse_mla indexer fp8_moe &
      wait
    else
      gpu_tests 0; bisect_one 0 none sparse_mla kda fp8_linear fp8_moe indexer
    fi
    # the end-to-end kernel tests (~4.5 min natively, mostly compilation) if the time is there
    [ "$(left)" -gt 300 ] && timeout $(( $(left) - 20 )) python3 -m pytest -v -m e2e_kernels -p no:cacheprovider \
      tests/test_decode.py 2>&1 | grep -E "PASSED|FAILED|ERROR|passed|failed|^E  " | head -30 | tee -a "$OUT/gpu_tests.log"
    ;;
  layers8)  # (nvidia-h200-x2) GPU 0: auto vs latency_specialized on 8 layers of one TP4 rank with the profile, one
    # kernel family alone, command buffers off; GPU 1: the sparse MLA GPU tests, then the end-to-end kernel tests
    b8() { CUDA_VISIBLE_DEVICES=0 timeout 170 python3 benchmarks/bench_decode.py --geometry tp4-rank --layers 8 \
      --batch 1 --q 1 --context 32768 --steps 20 --repeats 3 --fast-compile --profile "$@" 2>&1 \
      | grep -v -i warn | grep -v "^#.*GB of random" >> "$OUT/bench_layers8.log"; }
    (
      b8 --backend auto latency_specialized
      echo "## fp8_linear alone" >> "$OUT/bench_layers8.log"
      b8 --backend latency_specialized --policy '{"kda": false, "fp8_moe": false, "sparse_mla": false, "indexer": false}'
      echo "## command buffers off" >> "$OUT/bench_layers8.log"
      XLA_FLAGS="--xla_gpu_enable_command_buffer=" b8 --backend auto latency_specialized
    ) &
    (
      CUDA_VISIBLE_DEVICES=1 timeout 150 python3 -m pytest -v -m gpu -p no:cacheprovider tests/test_sparse_mla.py 2>&1 \
        | grep -E "PASSED|FAILED|ERROR|passed|failed|^E  " | head -30 >> "$OUT/gpu_tests.log"
      CUDA_VISIBLE_DEVICES=1 timeout $(( $(left) - 20 )) python3 -m pytest -v -m e2e_kernels -p no:cacheprovider \
        tests/test_decode.py 2>&1 | grep -E "PASSED|FAILED|ERROR|passed|failed|^E  " | head -30 >> "$OUT/gpu_tests.log"
    ) &
    wait
    ;;
  cmdbuf)  # (nvidia-h200-x2) why Mosaic calls cost ~50 µs of wall time each inside the step: latency_specialized on 8
    # layers of one TP4 rank under XLA command-buffer variants, two per GPU
    cb() { local g=$1 name=$2; shift 2
      echo "## $name: XLA_FLAGS=$*" > "$OUT/cb_$name.log"
      XLA_FLAGS="$*" CUDA_VISIBLE_DEVICES=$g timeout 200 python3 benchmarks/bench_decode.py --geometry tp4-rank --layers 8 \
        --batch 1 --q 1 --context 32768 --steps 20 --repeats 3 --fast-compile --profile --backend latency_specialized \
        2>&1 | grep -E "^ *latency|GPU busy|Error|FAILED" >> "$OUT/cb_$name.log"; }
    ( cb 0 default ""; cb 0 no_custom_call "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUDNN,DYNAMIC_SLICE_FUSION" ) &
    ( cb 1 trace_cache "--xla_cmd_buffer_trace_cache_size=1024"; cb 1 min_graph1 "--xla_gpu_graph_min_graph_size=1" ) &
    wait
    cat "$OUT"/cb_*.log
    ;;
  full)  # (nvidia-h200-x2) the whole TP4-rank step, B = 1, q = 1 then 4: auto on GPU 0, latency_specialized on GPU 1
    fb() { CUDA_VISIBLE_DEVICES=$1 timeout $(( BUDGET - 30 )) python3 benchmarks/bench_decode.py --geometry tp4-rank \
      --batch 1 --q 1 4 --context 32768 --steps 20 --repeats 3 --fast-compile --profile --backend $2 \
      --budget-s $(( BUDGET - 250 )) \
      --out "$OUT/decode_full.jsonl" > "$OUT/bench_full_$2.log" 2>&1; }
    fb 0 auto & fb 1 latency_specialized &
    wait
    for b in auto latency_specialized; do grep -v -i -E "warn|^\s*$" "$OUT/bench_full_$b.log" | tail -12; done
    ;;
  verify)  # (nvidia-h200-x2) GPU 0: the kernels not yet run natively (fused mHC, the MoE shared-expert slot), their
    # benchmark, the end-to-end kernel tests; GPU 1: the whole one-rank step, latency_specialized, then with mhc on
    (
      CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m pytest -v -m gpu -p no:cacheprovider tests/test_mhc.py \
        tests/test_linear_kernels.py -k "mhc or moe" 2>&1 | grep -E "PASSED|FAILED|ERROR|passed|failed|^E  " \
        | head -40 >> "$OUT/gpu_tests.log"
      CUDA_VISIBLE_DEVICES=0 timeout 90 python3 benchmarks/bench_mhc.py > "$OUT/bench_mhc.log" 2>&1
      CUDA_VISIBLE_DEVICES=0 timeout 150 python3 benchmarks/bench_sparse_mla.py --quick \
        > "$OUT/bench_sparse_mla.log" 2>&1  # issue #7 item 5
      CUDA_VISIBLE_DEVICES=0 timeout $(( $(left) - 20 )) python3 -m pytest -v -m e2e_kernels -p no:cacheprovider \
        tests/test_decode.py tests/test_mhc.py 2>&1 | grep -E "PASSED|FAILED|ERROR|passed|failed|^E  " \
        | head -30 >> "$OUT/gpu_tests.log"
    ) &
    (
      for pol in '{}' '{"mhc": true}'; do
        [ "$(left)" -gt 200 ] || break
        echo "## policy $pol" >> "$OUT/bench_full.log"
        CUDA_VISIBLE_DEVICES=1 timeout $(( $(left) - 20 )) python3 benchmarks/bench_decode.py --geometry tp4-rank \
          --batch 1 --q 1 --context 32768 --steps 20 --repeats 3 --fast-compile --profile \
          --backend latency_specialized --policy "$pol" --out "$OUT/decode_full.jsonl" 2>&1 \
          | grep -v -i -E "warn|^\s*$" >> "$OUT/bench_full.log"
      done
    ) &
    wait
    ;;
  trace)  # (nvidia-h200-x2) where the whole one-rank step's wall time goes beyond its GPU time: latency_specialized
    # (GPU 0) and auto (GPU 1), B = 1, q = 1, traced (device span / busy / gaps, the host's top events); then q = 4
    # profiled (per-component GPU time; the KDA kernel's in-step time at q = 4) while the budget lasts
    tb() { local g=$1 b=$2; shift 2
      CUDA_VISIBLE_DEVICES=$g timeout $(( $(left) - 15 )) python3 benchmarks/bench_decode.py --geometry tp4-rank \
        --batch 1 --context 32768 --steps 20 --repeats 3 --fast-compile --backend $b --budget-s $(( $(left) - 150 )) \
        --out "$OUT/decode_trace.jsonl" "$@" 2>&1 | grep -v -i -E "warn|^\s*$" >> "$OUT/bench_trace_$b.log"; }
    if [ "${TRACE_CMDBUF_OFF:-0}" = 1 ]; then  # then the same without XLA command buffers: are they used at all?
      ( tb 0 latency_specialized --q 1 --trace; XLA_FLAGS="--xla_gpu_enable_command_buffer=" tb 0 latency_specialized --q 1 ) &
      ( tb 1 auto --q 1 --trace; XLA_FLAGS="--xla_gpu_enable_command_buffer=" tb 1 auto --q 1 ) &
    else
      ( tb 0 latency_specialized --q 1 --trace; tb 0 latency_specialized --q 4 --profile ) &
      ( tb 1 auto --q 1 --trace; tb 1 auto --q 4 --profile ) &
    fi
    wait
    ;;
  launch)  # (nvidia-h200-x2) is the one-rank step's host time the CUDA-graph launch? GPU 0: the mixing-in-kernel mHC
    # GPU tests, the synthetic launch experiment with and without command buffers; GPU 1: the whole one-rank step,
    # one vs two alternating executables (optimised HLO kept), then with {"mhc_finish": false}, profiled
    (
      CUDA_VISIBLE_DEVICES=0 timeout 150 python3 -m pytest -v -m "gpu or e2e_kernels" -p no:cacheprovider \
        tests/test_mhc.py 2>&1 | grep -E "PASSED|FAILED|ERROR|passed|failed|^E  " | head -40 >> "$OUT/gpu_tests.log"
      CUDA_VISIBLE_DEVICES=0 timeout 200 python3 benchmarks/bench_graph_launch.py > "$OUT/bench_launch.log" 2>&1
      echo "## command buffers off" >> "$OUT/bench_launch.log"
      XLA_FLAGS="--xla_gpu_enable_command_buffer=" CUDA_VISIBLE_DEVICES=0 timeout 150 \
        python3 benchmarks/bench_graph_launch.py >> "$OUT/bench_launch.log" 2>&1
    ) &
    (
      lb() { CUDA_VISIBLE_DEVICES=1 timeout $(( $(left) - 15 )) python3 benchmarks/bench_decode.py --geometry tp4-rank \
        --batch 1 --q 1 --context 32768 --steps 20 --repeats 3 --fast-compile --budget-s $(( $(left) - 150 )) \
        --out "$OUT/decode_launch.jsonl" "$@" 2>&1 | grep -v -i -E "warn|^\s*$" >> "$OUT/bench_decode_launch.log"; }
      lb --backend latency_specialized --executables 1 2 --hlo-dir "$OUT"
      [ "$(left)" -gt 200 ] && lb --backend latency_specialized --policy '{"mhc_finish": false}' --profile
      [ "$(left)" -gt 200 ] && lb --backend auto --executables 1 2 --hlo-dir "$OUT"
    ) &
    wait
    ;;
  host)  # (nvidia-h200) see the header
    hb() { timeout $(( $(left) - 10 )) python3 benchmarks/bench_decode.py --geometry tp4-rank --batch 1 --q 1 \
      --context 32768 --steps 20 --repeats 3 --fast-compile --budget-s $(( $(left) - 130 )) \
      --out "$OUT/decode_host.jsonl" "$@" 2>&1 | grep -v -i -E "warn|^\s*$" >> "$OUT/bench_decode_host.log"; }
    hb --backend latency_specialized --pack-params 0 65536 --hlo-dir "$OUT" --trace  # trace: ParseArguments
    [ "$(left)" -gt 200 ] && hb --backend latency_specialized --policy '{"mhc_finish": false}'
    [ "$(left)" -gt 200 ] && hb --backend latency_specialized --policy '{"mhc": false}'
    [ "$(left)" -gt 200 ] && hb --backend auto --pack-params 65536
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
  topk)  # (nvidia-h200) see the header
    rank1 topk --q 1 --profile --policy '{"indexer_topk": true}' --hlo-dir "$OUT"
    [ "$(left)" -gt 200 ] && rank1 topk --q 1 --profile
    [ "$(left)" -gt 300 ] && rank1 topk --q 4 --profile --policy '{"indexer_topk": true}'
    [ "$(left)" -gt 300 ] && rank1 topk --q 4 --profile
    ;;
  q4)  # (nvidia-h200) see the header; Q1=0 skips the mHC tests/benchmarks and the q = 1 run; E2E=1 adds the
    # end-to-end kernel tests of the decode step
    [ "${Q1:-1}" = 1 ] && timeout 150 python3 -m pytest -v -m "gpu or e2e_kernels" -p no:cacheprovider tests/test_mhc.py 2>&1 \
      | grep -E "PASSED|FAILED|ERROR|passed|failed|^E  " | head -30 | tee "$OUT/gpu_tests.log"
    # the boundary's kernel times and compile seconds per boundary (session 22: the XLA Sinkhorn, ~4 s per site at
    # M >= 4, made the q = 4 step's compile exceed 8 minutes)
    [ "${Q1:-1}" = 1 ] && timeout 100 python3 benchmarks/bench_mhc.py --rows 1,4 > "$OUT/bench_mhc.log" 2>&1
    [ "${Q1:-1}" = 1 ] && timeout 100 python3 benchmarks/bench_mhc.py --compile --rows 1,4 >> "$OUT/bench_mhc.log" 2>&1
    # the indexer's top-512: XLA's sort (11 x 43 µs per step) vs radix selection vs one sort of simple keys (CUB?)
    [ "${Q1:-1}" = 1 ] && timeout 90 python3 benchmarks/bench_topk.py > "$OUT/bench_topk.log" 2>&1
    [ "${E2E:-0}" = 1 ] && timeout 200 python3 -m pytest -v -m e2e_kernels -p no:cacheprovider tests/test_decode.py 2>&1 \
      | grep -E "PASSED|FAILED|ERROR|passed|failed|^E  " | head -30 | tee -a "$OUT/gpu_tests.log"
    [ "${Q1:-1}" = 1 ] && rank1 q4 --q 1 --profile --hlo-dir "$OUT"
    [ "$(left)" -gt 230 ] && rank1 q4 --q 4 --profile
    [ "$(left)" -gt 230 ] && rank1 q4 --q 4 --profile --policy '{"indexer_topk": true}'
    # where the host time goes with indexer_topk on (session 21: 4.4 -> 6.7 ms per step at q = 1); no --profile
    # (the trace and the profile both use CUPTI)
    [ "$(left)" -gt 200 ] && rank1 q4 --q 1 --trace --policy '{"indexer_topk": true}'
    ;;
  batch)  # (nvidia-h200) see the header; rank1 runs B = 1 unless --batch is given again (argparse: the last wins)
    # (sessions 24-25 ran B = 8 and 32 with a random router that routed too few experts: re-measured here)
    rank1 batch --q 1 --batch 8 --profile
    [ "$(left)" -gt 200 ] && rank1 batch --q 4 --batch 8 --profile
    [ "$(left)" -gt 200 ] && rank1 batch --q 1 --batch 32 --profile
    # issue #6's KDA matrix (B 1/8/32 x q 1/4/8, CUPTI device time, floor column) if time remains
    [ "$(left)" -gt 80 ] && timeout $(( $(left) - 5 )) python3 benchmarks/bench_kda_decode.py --quick \
      --budget_s $(( $(left) - 30 )) > "$OUT/bench_kda.log" 2>&1
    ;;
  hostflags)  # (nvidia-h200) see the header
    for fl in "" "--xla_gpu_command_buffer_update_mode=SKIP_TEMP" "--xla_gpu_command_buffer_update_mode=SKIP_PROFILED"; do
      echo "## XLA_FLAGS=$fl" >> "$OUT/bench_launch.log"
      XLA_FLAGS="$fl" timeout 70 python3 benchmarks/bench_graph_launch.py --mosaic-every 7 --out "$OUT/graph_launch.jsonl" \
        >> "$OUT/bench_launch.log" 2>&1
    done
    # which commands XLA re-records per execution (the helper's reading of XLA: a Mosaic call is re-traced by
    # stream capture only when an allocation it touches moved)
    TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3,command_executor=1,command_buffer_cmd=1 \
      timeout 70 python3 benchmarks/bench_graph_launch.py --mosaic-every 7 --calls 10 > /tmp/vlog.txt 2>&1
    { echo "lines $(wc -l < /tmp/vlog.txt)"; grep -c -i "update command buffer" /tmp/vlog.txt;
      grep -i -E "updated_allocs|Updated [0-9]+ commands|Update command buffer" /tmp/vlog.txt | head -20;
      grep -i -E "command" /tmp/vlog.txt | sed -E 's/[0-9]+/N/g' | sort | uniq -c | sort -rn | head -25; } \
      > "$OUT/vlog_summary.txt"
    [ "$(left)" -gt 150 ] && XLA_FLAGS="--xla_gpu_command_buffer_update_mode=SKIP_PROFILED" rank1 skipprof --q 1
    ;;
  s27)  # (nvidia-h200) see the header
    for f in test_linear_kernels test_mhc; do
      timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider "tests/$f.py" 2>&1 \
        | grep -E "passed|failed|FAILED|^E  " | head -20 | sed "s/^/$f: /" | tee -a "$OUT/gpu_tests.log"
    done
    rank1 s27 --q 1 --profile --hlo-dir "$OUT/hlo"
    [ "$(left)" -gt 200 ] && rank1 s27 --q 4 --profile --hlo-dir "$OUT/hlo"
    kernel_tables 1 4
    # the end-to-end greedy test (kernel-tiny, every kernel natively, CONCURRENT by default now) if time remains
    [ "$(left)" -gt 120 ] && timeout $(( $(left) - 10 )) python3 -m pytest -q -m e2e_kernels -p no:cacheprovider \
      tests/test_decode.py 2>&1 | grep -E "passed|failed|FAILED|^E  " | head -20 | tee -a "$OUT/gpu_tests.log"
    ;;
  s27host)  # (nvidia-h200) see the header
    rank1 s27host --q 1 --trace
    # CONCURRENT_REGIONS: overlap only among small kernels (a graph closer to a chain: the driver's fast launch path
    # for straight-line graphs?); then LHS; then parameters under 4 MiB packed too (866 -> 396 parameter
    # arguments, +642 MB of copies; watch the GPU time for slices XLA copies instead of passing in place)
    [ "$(left)" -gt 150 ] && rank1 s27host --q 1 --xla-option xla_gpu_command_buffer_scheduling_mode=CONCURRENT_REGIONS
    [ "$(left)" -gt 150 ] && rank1 s27host --q 1 --trace --xla-option xla_gpu_command_buffer_scheduling_mode=LHS
    [ "$(left)" -gt 150 ] && rank1 s27host --q 1 --trace --pack-params 4194304
    # does the CONCURRENT step's command buffer get updated on every execution? (4 real layers; session 25's
    # VLOG showed none under LHS)
    [ "$(left)" -gt 100 ] && TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3,command_executor=1 \
      timeout 90 python3 benchmarks/bench_decode.py --geometry tp4-rank --layers 4 --batch 1 --q 1 --context 32768 \
      --steps 10 --repeats 1 --fast-compile --backend latency_specialized > /tmp/vlog.txt 2>&1 && \
      { grep -E "ms/step|packed" /tmp/vlog.txt | grep -v -i warn | tail -3; echo "lines $(wc -l < /tmp/vlog.txt)";
        grep -i -E "command" /tmp/vlog.txt | sed -E 's/[0-9]+/N/g' | sort | uniq -c | sort -rn | head -25; } \
        > "$OUT/vlog_concurrent.txt"
    [ "$(left)" -gt 70 ] && timeout $(( $(left) - 5 )) python3 benchmarks/bench_linear.py --rows 1 --only moedq \
      --sweep-moe 1 --budget-s $(( $(left) - 20 )) > "$OUT/bench_linear_moe.log" 2>&1
    ;;
  s29)  # (nvidia-h200) the host's launch cost paid once per several steps (Decoder(steps_per_call)): 1 vs 4 steps
    # per call at q = 1, interleaved on one host (the loop's WHILE / CONDITIONAL commands: speculative.
    # GPU_LOOP_OPTIONS, added by the Decoder), the steps_per_call GPU test (loop and unrolled vs single steps),
    # the same A/B at q = 4, then q = 1 profiled with its kernel table (session 28's router-bias memcpys gone?)
    rank1 s29i --q 1 --steps-per-call 1 4 --interleave
    [ "$(left)" -gt 150 ] && timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_decode.py \
      -k steps_per_call 2>&1 | grep -E "passed|failed|FAILED|^E  " | head -20 | tee -a "$OUT/gpu_tests.log"
    [ "$(left)" -gt 220 ] && rank1 s29i --q 4 --steps-per-call 1 4 --interleave
    [ "$(left)" -gt 130 ] && rank1 s29 --q 1 --profile --hlo-dir "$OUT/hlo" && kernel_tables 1
    ;;
  s29c)  # (nvidia-h200) where a loop of steps spends its GPU time: 1 and 4 steps per call at q = 1 profiled, each with
    # its kernel table and kernel listing (bench_decode --hlo-dir: *.kernels.tsv, to diff the loop body against one
    # step here), then the steps_per_call GPU test (interrupted with a traceback if it runs past its time)
    rank1 s29c --q 1 --steps-per-call 1 4 --profile --hlo-dir "$OUT/hlo" && kernel_tables 1
    [ "$(left)" -gt 60 ] && timeout -s INT $(( $(left) - 20 )) python3 -m pytest -v -m gpu -p no:cacheprovider \
      tests/test_decode.py -k steps_per_call 2>&1 | grep -v -E "^\s*$|warn" | tail -60 > "$OUT/gpu_tests.log"
    ;;
  s32)  # (nvidia-h200) session 31's code-size question: the one-launch boundary ran ~135 us per boundary in the step
    # as 3.1 MB of straight-line MLIR; its chunk loops and the threshold kernel's passes are loops now (unrolled
    # kept as options). The threshold and boundary GPU tests, bench_topk rolled vs unrolled, bench_mhc (the rolled
    # boundary alone), q = 1 at 4 steps per call: defaults vs the rolled boundary, then bench_kda_decode --q4 (the
    # token loop first) in what is left. First the hypothesis itself on a synthetic kernel (bench_code_size)
    timeout 90 python3 benchmarks/bench_code_size.py --out "$OUT/bench_code_size.log" > /dev/null 2>&1
    timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_indexer.py -k threshold 2>&1 \
      | grep -E "passed|failed|FAILED|^E  " | head -20 | tee -a "$OUT/gpu_tests.log"
    timeout -s INT 200 python3 -m pytest -q -m "gpu or e2e_kernels" -p no:cacheprovider tests/test_mhc.py \
      -k "boundary" --durations=3 > /tmp/t_boundary.log 2>&1
    grep -E "passed|failed|FAILED|^E  |Interrupt|s call" /tmp/t_boundary.log | head -20 | tee -a "$OUT/gpu_tests.log"
    timeout 120 python3 benchmarks/bench_topk.py --rows 1,4 --pools 8256 --only "radix scan128,kernel scan128,kernel \
unrolled scan128,kernel2 scan128,kernel2 unrolled scan128" --out "$OUT/bench_topk.log" > /dev/null 2>&1
    timeout -s INT 150 python3 benchmarks/bench_mhc.py --rows 1,4 --paths 1launch,fused,narrow --clusters 8,4 \
      > "$OUT/bench_mhc.log" 2>&1
    BOUNDARY=""
    grep -q " passed" /tmp/t_boundary.log && ! grep -q -E "failed|Interrupt" /tmp/t_boundary.log \
      && BOUNDARY='{"mhc_boundary":true}'
    [ "$(left)" -gt 220 ] && rank1 s32 --q 1 --steps-per-call 4 --interleave --repeats 7 --policy '{}' $BOUNDARY
    [ "$(left)" -gt 100 ] && timeout $(( $(left) - 10 )) python3 benchmarks/bench_kda_decode.py --q4 \
      --budget_s $(( $(left) - 60 )) > "$OUT/bench_kda_q4.log" 2>&1
    ;;
  s48a)  # (nvidia-h200) session 47's final commit natively: the FP8 latent cache's plane-major rows (the sparse MLA
    # kernel's dequant with one scale per byte plane, no column permutation around it) — the sparse MLA GPU tests
    # and the defaults end to end; the W_UV kernel (mla_absorb_uv, knob mla_uv_kernel): its GPU tests and the
    # kernel-tiny e2e test; then q = 1: defaults vs mla_uv_kernel vs moe_rows (5 interleaved repeats)
    timeout -k 9 -s INT 150 python3 -m pytest -q -rA -m gpu -p no:cacheprovider tests/test_sparse_mla.py \
      > "$OUT/mla_tests.log" 2>&1
    # (natively each kernel-tiny e2e test compiles for ~1-2.5 min: s47d's pool test took 151 s)
    timeout -k 9 -s INT 400 python3 -m pytest -q -rA -m "gpu or e2e_kernels" -p no:cacheprovider tests/test_decode.py \
      -k "mla_uv or (all_kernels_equals_stock and extra0)" > "$OUT/e2e_tests.log" 2>&1
    grep -h -E "^(PASSED|FAILED|ERROR)|passed|failed" "$OUT/mla_tests.log" "$OUT/e2e_tests.log"
    ;;
  s51a)  # (nvidia-h200) session 51, after s50b's trace (the DSA layer 69.8 µs: the selection branch now the longest;
    # q_a / kv_a 9.2 µs there vs 4.5 alone, sharing the SMs with the indexer's XLA GEMV) and s50a's profile (each
    # MoE step's scalar scale load ~1.2 µs behind the weight stream): moe_scale_prefetch's GPU tests, the MoE alone
    # (defaults vs prefetch, twice) and profiled, then q = 1: defaults vs moe_scale_prefetch vs dsa_qkv_a_first vs
    # kda_norm (last measured in session 24, when the KDA kernel was another) — 5 interleaved repeats
    timeout -k 9 -s INT 200 python3 -m pytest -q -rA -m gpu -p no:cacheprovider tests/test_linear_kernels.py \
      -k "with_rows_gpu" > "$OUT/moe_tests.log" 2>&1
    grep -h -E "^(PASSED|FAILED|ERROR)|passed|failed" "$OUT/moe_tests.log"
    for r in 1 2; do
      timeout -s INT 100 python3 benchmarks/bench_linear.py --rows 1 --only moerows_sw,moerows_pf \
        --out "$OUT/bench_linear_$r.txt" > "$OUT/bench_linear_$r.log" 2>&1
    done
    timeout -s INT 120 python3 benchmarks/bench_kernel_profile.py --dir /tmp/kprof \
      --cases moe_rows_sw,moe_rows_prefetch --out "$OUT/kernel_profile.txt" > "$OUT/bench_kernel_profile.log" 2>&1
    cat "$OUT"/bench_linear_*.txt "$OUT/kernel_profile.txt"
    [ "$(left)" -gt 200 ] && rank1 s51a --q 1 --steps-per-call 4 --interleave --repeats 5 --steps 80 --policy '{}' \
      '{"moe_scale_prefetch": true}' '{"dsa_qkv_a_first": true}' '{"kda_norm": true}'
    ;;
  s51b)  # (nvidia-h200) s51a: dsa_qkv_a_first 3.73 -> 3.68 ms (4 of 4 paired rounds), moe_scale_prefetch a tie, kda_norm
    # slower. Confirm dsa_qkv_a_first on another host, with dq_f16 on top (session 41: the MoE's multiply 17 % shorter,
    # the step a tie then), the scale prefetch's GPU tests, then dsa_qkv_a_first traced (the DSA chain by time)
    timeout -k 9 -s INT 120 python3 -m pytest -q -rA -m gpu -p no:cacheprovider tests/test_linear_kernels.py \
      -k "with_rows_gpu" > "$OUT/moe_tests.log" 2>&1
    grep -h -E "^(PASSED|FAILED|ERROR)|passed|failed" "$OUT/moe_tests.log"
    rank1 s51b --q 1 --steps-per-call 4 --interleave --repeats 5 --steps 80 --policy '{}' '{"dsa_qkv_a_first": true}' \
      '{"dsa_qkv_a_first": true, "dq_f16": true}'
    [ "$(left)" -gt 150 ] && rank1 s51b_trace --q 1 --steps-per-call 4 --trace --hlo-dir "$OUT/hlo" \
      --policy '{"dsa_qkv_a_first": true}'
    rm -f "$OUT"/hlo/*.hlo.gz
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
    # latency_specialized in one call with the winners (issue #9: 2x needs latency_specialized <= auto / 2).
    # kda_gates_first (session 53: the KDA gates' GEMVs launched before the qkv GEMV) against the defaults too
    rank1 s53b --q 1 --steps-per-call 4 --interleave --repeats 5 --steps 80 --policy '{}' \
      '{"mhc_row": true, "mla_latent_norms": true, "qkv_a_fused_sum": true, "kda_norm_partials": true, "dq_f16": true}' \
      '{"kda_gates_first": true}'
    [ "$(left)" -gt 250 ] && timeout $(( $(left) - 5 )) python3 benchmarks/bench_decode.py --geometry tp4-rank \
      --batch 1 --context 32768 --q 1 --steps 40 --repeats 3 --fast-compile --budget-s $(( $(left) - 60 )) \
      --backend auto latency_specialized --steps-per-call 4 --interleave --compile-cache .jax_cache \
      --policy '{"mhc_row": true, "mla_latent_norms": true}' --out "$OUT/decode_s53b_auto.jsonl" 2>&1 \
      | grep -v -i -E "warn|^\s*$" >> "$OUT/bench_decode_s53b_auto.log"
    ;;
  s53c)  # (nvidia-h200) the new forms inside the step: traced at q = 1 (sublayer_chain: the boundaries' and the DSA
    # layer's chains with mhc_row + mla_latent_norms) and profiled alone (where the row boundary's time goes)
    timeout -s INT 120 python3 benchmarks/bench_mhc.py --rows 1 --paths grid,row --out "$OUT/bench_mhc.txt" \
      > "$OUT/bench_mhc.log" 2>&1
    timeout -s INT 100 python3 benchmarks/bench_kernel_profile.py --dir /tmp/kprof --cases mhc,mhc_row \
      --out "$OUT/kernel_profile.txt" > "$OUT/bench_kernel_profile.log" 2>&1
    # the bf16 GEMVs at one row, XLA vs bf16_linear — the indexer's wq_b (12.6 MB) is on the DSA selection chain
    timeout -s INT 120 python3 benchmarks/bench_linear.py --rows 1 --only bf16 --out "$OUT/bench_linear.txt" \
      > "$OUT/bench_linear.log" 2>&1
    cat "$OUT/bench_mhc.txt" "$OUT/kernel_profile.txt" "$OUT/bench_linear.txt"
    rank1 s53c --q 1 --steps-per-call 4 --trace --hlo-dir "$OUT/hlo" \
      --policy '{"mhc_row": true, "mla_latent_norms": true, "qkv_a_fused_sum": true}'
    rm -f "$OUT"/hlo/*.hlo.gz
    ;;
  s52a)  # (nvidia-h200) session 51's CPU-built scale loads ahead of the weight stream: s51a's profile of the MoE down
    # kernel had scalar scale loads issued just after the CTAs' weight requests return ~4 µs later (queued behind the
    # grid's 18.9 MB). moe_scale_prefetch now requests them BEFORE the weight tiles (both MoE kernels);
    # fp8_scales_first does the same in the dense FP8 kernel (q_a / kv_a, q_b, o_proj, dense MLP: it loaded the
    # first `stages` scales after its tiles). GPU tests (bit-equal to the forms without), the MoE alone and
    # profiled, bench_tile_math (session 51: the per-tile math's parts, no HBM traffic), then q = 1: defaults vs
    # each, kda_norm_partials (the KDA norm elementwise: fused into o_proj?) and dq_f16 a third time (its f16
    # activations now saturate; 3 of 4 rounds faster in sessions 41 and 51) — 5 interleaved repeats
    timeout -k 9 -s INT 200 python3 -m pytest -q -rA -m gpu -p no:cacheprovider tests/test_linear_kernels.py \
      -k "with_rows_gpu or fp8_dq_linear_gpu or fp8_dq_linear_f16 or router_in_the_gate_up_kernel_gpu" \
      > "$OUT/tests.log" 2>&1
    # (the kernel-tiny e2e with every candidate on, these three among them: the gate before a default)
    timeout -k 9 -s INT 150 python3 -m pytest -q -rA -m gpu -p no:cacheprovider tests/test_decode.py \
      -k "all_kernels_equals_stock and candidates" >> "$OUT/tests.log" 2>&1
    grep -h -E "^(PASSED|FAILED|ERROR)|passed|failed" "$OUT/tests.log"
    timeout -s INT 100 python3 benchmarks/bench_linear.py --rows 1 --only moerows_sw,moerows_pf \
      --out "$OUT/bench_linear.txt" > "$OUT/bench_linear.log" 2>&1
    timeout -s INT 120 python3 benchmarks/bench_kernel_profile.py --dir /tmp/kprof \
      --cases moe_rows_sw,moe_rows_prefetch --out "$OUT/kernel_profile.txt" > "$OUT/bench_kernel_profile.log" 2>&1
    # the per-tile math without HBM traffic (bf16 / f16 dequantisation, the wgmma alone, the fp8 hi/lo form):
    # what the MoE kernels' ~0.9 µs "mma" scope per tile is made of
    timeout -s INT 150 python3 benchmarks/bench_tile_math.py --per-sm 1,2 --out "$OUT/tile_math.txt" \
      > "$OUT/tile_math.log" 2>&1
    cat "$OUT/bench_linear.txt" "$OUT/kernel_profile.txt" "$OUT/tile_math.txt"
    [ "$(left)" -gt 200 ] && rank1 s52a --q 1 --steps-per-call 4 --interleave --repeats 5 --steps 80 --policy '{}' \
      '{"moe_scale_prefetch": true}' '{"fp8_scales_first": true}' '{"kda_norm_partials": true}' '{"dq_f16": true}'
    ;;
  s52b)  # (nvidia-h200) after s52a: the winners together (edit the policy below to s52a's result) at q = 1 and
    # q = 4 (session 50: 7.66 ms), then auto vs latency_specialized in one call at q = 1 (issue #9's ratio on one
    # host: 2x needs latency_specialized <= auto / 2)
    rank1 s52b --q 1 --steps-per-call 4 --interleave --repeats 5 --steps 80 --policy '{}' \
      '{"moe_scale_prefetch": true, "fp8_scales_first": true, "kda_norm_partials": true}'
    [ "$(left)" -gt 200 ] && rank1 s52b_q4 --q 4 --steps-per-call 4 --interleave --repeats 3 --steps 40 \
      --policy '{}' '{"moe_scale_prefetch": true, "fp8_scales_first": true, "kda_norm_partials": true}'
    [ "$(left)" -gt 200 ] && timeout $(( $(left) - 5 )) python3 benchmarks/bench_decode.py --geometry tp4-rank \
      --batch 1 --context 32768 --q 1 --steps 40 --repeats 3 --fast-compile --budget-s $(( $(left) - 60 )) \
      --backend auto latency_specialized --steps-per-call 4 --interleave --compile-cache .jax_cache \
      --out "$OUT/decode_s52b_auto.jsonl" 2>&1 | grep -v -i -E "warn|^\s*$" >> "$OUT/bench_decode_s52b_auto.log"
    ;;
  s51sass)  # (nvidia-h200) session 51: where the MoE kernels' "mma" scope goes (s50a's profile: ~0.9 µs per 128 x 128
    # weight tile in both kernels — 7.4 of gate/up's ~15 µs per CTA — while the e4m3 -> f32 -> bf16 convert was only
    # ~1/6 of it with f16 in session 41): the SASS of the step's MoE form (static table + writer CTA) and of the
    # mHC boundary (6-7 µs per sublayer in s50b's trace), read off-line (instruction mix of the tile loop: the fp8
    # tile's SMEM loads in the WGMMA layout, the converts, the wgmma waits)
    MOSAIC_GPU_DUMP_SASS=1 MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_TO="$OUT/sass" timeout -s INT 150 \
      python3 benchmarks/bench_linear.py --rows 1 --only moerows_wr --out "$OUT/bench_linear_sass.txt" \
      > "$OUT/bench_linear_sass.log" 2>&1
    MOSAIC_GPU_DUMP_SASS=1 MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_TO="$OUT/sass_mhc" timeout -s INT 150 \
      python3 benchmarks/bench_mhc.py --rows 1 --paths 1launch > "$OUT/bench_mhc_sass.log" 2>&1
    tail -5 "$OUT/bench_linear_sass.log" "$OUT/bench_mhc_sass.log"; ls -la "$OUT/sass" "$OUT/sass_mhc" | head -40
    (cd "$OUT" && tar czf sass.tgz sass sass_mhc && rm -rf sass sass_mhc)
    ;;
  s50a)  # (nvidia-h200) session 50: s49a's profile of the step's MoE form had the down kernel's first wait begin
    # 6.35 µs (median) after its CTAs started, of a ~10 µs kernel — before it: the nvalid read, 8 id + 8 weight scalar
    # GMEM loads by every thread of 288 CTAs, the first TMA issues. moe_static_table: the slot count a number, the
    # ids / weights staged into SMEM by one TMA each. And the gate/up kernel's slowest CTA, the selection's writer
    # (a shared-slot CTA: k rounds of 3 reductions + stores before its weights; its first wait 6.4 µs after the
    # median's): moe_writer_cta makes it an extra CTA that only selects and stores. GPU tests (bit-equal to the
    # form without), the in-kernel profiles (new scopes "table", "issue"), bench_linear alone (twice each), the step
    timeout -k 9 -s INT 200 python3 -m pytest -q -rA -m gpu -p no:cacheprovider tests/test_linear_kernels.py \
      -k "with_rows_gpu" > "$OUT/moe_tests.log" 2>&1
    grep -h -E "^(PASSED|FAILED|ERROR)|passed|failed" "$OUT/moe_tests.log"
    timeout -s INT 120 python3 benchmarks/bench_kernel_profile.py --dir /tmp/kprof \
      --cases moe_rows,moe_rows_static,moe_rows_writer --out "$OUT/kernel_profile.txt" \
      > "$OUT/bench_kernel_profile.log" 2>&1
    for r in 1 2; do
      timeout -s INT 100 python3 benchmarks/bench_linear.py --rows 1 --only moerows,moerows_st,moerows_wr \
        --out "$OUT/bench_linear_$r.txt" > "$OUT/bench_linear_$r.log" 2>&1
    done
    cat "$OUT/kernel_profile.txt" "$OUT"/bench_linear_*.txt
    [ "$(left)" -gt 200 ] && rank1 s50a --q 1 --steps-per-call 4 --interleave --repeats 5 --steps 80 --policy '{}' \
      '{"moe_static_table": true}' '{"moe_writer_cta": true}' '{"moe_static_table": true, "moe_writer_cta": true}'
    ;;
  s50b)  # (nvidia-h200) session 50's defaults at q = 1 traced (as s48e): with the indexer's selection one launch
    # (9.9 µs alone vs 13.9 + the XLA compaction's gaps), which of the DSA layer's branches into the attention kernel
    # is now the longest — the selection's, or the queries' (q_b -> W_UK reduction -> the f16 scaling)?
    rank1 s50b --q 1 --steps-per-call 4 --trace --hlo-dir "$OUT/hlo" --policy '{}'
    rm -f "$OUT"/hlo/*.hlo.gz
    ;;
  s50c)  # (nvidia-h200) with the indexer's selection one launch, s49b's static critical path no longer passes through
    # the indexer (561 kernels: kda 170, dsa 154 = 14 per DSA layer — its query path: qkv_a + split sum, norm, q_b +
    # split sum, W_UK, the f16 scaling, attention, merge, W_UV, o_proj + split sum). linear_fused_sum sums the FP8
    # linears' K splits in the kernel (at one row the MoE keeps moe_rows; bf16 sites are XLA's GEMV): 3 launches
    # fewer per DSA layer on that path. Last measured when the selection was the longest branch (session 47: unclear)
    rank1 s50c --q 1 --steps-per-call 4 --interleave --repeats 5 --steps 80 --policy '{}' '{"linear_fused_sum": true}'
    # then q = 4 with session 50's defaults (the one-launch selection at the verify's 4 score rows: 15.3 -> 12.0 µs
    # alone; s49e's 7.66 ms ran before it), against linear_fused_sum there too (the KDA layers' bf16 GEMV kernels
    # from 2 rows: 2 split sums per KDA layer on the q = 4 chain, whose static path was kda 340 of 1,093 in s49e)
    [ "$(left)" -gt 200 ] && rank1 s50c_q4 --q 4 --steps-per-call 4 --interleave --repeats 3 --steps 40 \
      --policy '{}' '{"linear_fused_sum": true}'
    ;;
  s49c)  # (nvidia-h200) launch-count cuts that tied on older defaults, against today's: kda_gate_proj (68 launches
    # fewer: the KDA gates' f_b / g_b projections in the kernel; session 37: 4.60 vs 4.89 ms, rounds ±0.4) and the bf16
    # GEMV kernel forced at one token row with its K splits summed inside (bf16_linear + linear_fused_sum: the KDA
    # o_proj's XLA GEMV ran 5.7 µs at 2.9 TB/s in s48e's trace, the XLA split sum after our kernel gone)
    rank1 s49c --q 1 --steps-per-call 4 --interleave --repeats 5 --steps 80 --policy '{}' '{"kda_gate_proj": true}' \
      '{"bf16_linear": true, "linear_fused_sum": true}'
    ;;
  s49g)  # (nvidia-h200) the MoE sublayer is the largest gap left (s48e: gate/up 17.7 + down 10.3 µs in the step for
    # 56.6 MB, ~1.06 ms per step above the bytes' floor); plan_moe's M = 1 defaults date from the XLA-glue form
    # (session 26): the step's form (moe_rows: selection inside, sums inside) under gate/up splits 2 / 4 / 8, 128-row
    # tiles, 4-stage rings and other down groupings — alone, cold weights; the err column checks each variant
    timeout -s INT $(( $(left) - 10 )) python3 benchmarks/bench_linear.py --rows 1 --only moerows --sweep-moerows \
      --budget-s $(( $(left) - 30 )) --out "$OUT/bench_linear_moe.txt" > "$OUT/bench_linear_moe.log" 2>&1
    cat "$OUT/bench_linear_moe.txt"
    ;;
  s49f)  # (nvidia-h200) the DSA layer's first kernel on its chain, the fused q_a | kv_a FP8 GEMV, ran 9.5 µs for 8.4
    # MB in s48e's trace (0.9 TB/s; 16 K splits of 2 weight tiles each, then XLA's split sum 2.1 µs): every fp8dq
    # shape at one row, then the K-split / ring sweep of qkv_a, q_b and mla_o
    timeout -s INT $(( $(left) - 10 )) python3 benchmarks/bench_linear.py --rows 1 --only fp8dq --sweep-dq 1 \
      --budget-s $(( $(left) - 30 )) --out "$OUT/bench_linear.txt" > "$OUT/bench_linear.log" 2>&1
    cat "$OUT/bench_linear.txt"
    ;;
  s49e)  # (nvidia-h200) issue #9's ratio with session 49's code: at q = 1 (k = 0) the step no longer runs the MTP pass
    # (speculative._first_drafts: its cache was write-only there — a DSA + MoE layer per step, in auto too), so auto
    # and latency_specialized at q = 1 interleaved (as s41b: 4 steps per call), then q = 4 with today's defaults
    # (last measured in session 39: 8.21 ms; most changes since were for one token row)
    timeout $(( $(left) - 5 )) python3 benchmarks/bench_decode.py --geometry tp4-rank --batch 1 --q 1 --context 32768 \
      --steps 40 --repeats 3 --fast-compile --budget-s $(( $(left) - 150 )) --backend auto latency_specialized \
      --steps-per-call 4 --interleave --compile-cache .jax_cache --out "$OUT/decode_s49auto.jsonl" 2>&1 \
      | grep -v -i -E "warn|^\s*$" >> "$OUT/bench_decode_s49auto.log"
    [ "$(left)" -gt 150 ] && rank1 s49e_q4 --q 4 --steps-per-call 4 --repeats 3 --steps 40 --policy '{}'
    ;;
  s49b)  # (nvidia-h200) session 49: the compaction after the threshold kernel as ONE multi-CTA launch (policy knob
    # topk_compact_kernel: s48e's trace has XLA's prefix sum, slice, select, scatter and pad at 9.4 µs on every DSA
    # layer's chain; topk_compact_fused: the threshold's passes in every compaction CTA, no threshold kernel) and
    # pool_update taking the LayerNorm's affine / pool bias as stored (36 XLA converts fewer per step, a default).
    # GPU tests (the kernel from the exact / early-exit / its own threshold; at the model's site; pool_update with
    # bf16 parameters), bench_topk on the model's padded row (8,704 pools: the model's XLA path with its index list
    # vs the kernels), then q = 1 defaults vs compact vs compact + fused (the e2e tests: s49d)
    timeout -k 9 -s INT 200 python3 -m pytest -q -rA -m gpu -p no:cacheprovider tests/test_indexer.py \
      -k "compact or pool_update" > "$OUT/indexer_tests.log" 2>&1
    grep -h -E "^(PASSED|FAILED|ERROR)|passed|failed" "$OUT/indexer_tests.log"
    timeout -s INT 120 python3 benchmarks/bench_topk.py --rows 1,4 --pools 8704 --f32-scores \
      --only "kernel exit scan128,model xla,compact,compact fused,compact128" --out "$OUT/bench_topk.txt" \
      > "$OUT/bench_topk.log" 2>&1
    cat "$OUT/bench_topk.txt"
    timeout -s INT 90 python3 benchmarks/bench_kernel_profile.py --dir /tmp/kprof --cases compact,compact_fused \
      --out "$OUT/kernel_profile.txt" > "$OUT/bench_kernel_profile.log" 2>&1
    cat "$OUT/kernel_profile.txt"
    [ "$(left)" -gt 300 ] && rank1 s49b --q 1 --steps-per-call 4 --interleave --repeats 5 --steps 80 --policy '{}' \
      '{"topk_compact_kernel": true}' '{"topk_compact_kernel": true, "topk_compact_fused": true}'
    ;;
  s49d)  # (nvidia-h200) the kernel-tiny end-to-end GPU tests of topk_compact_kernel, alone and fused (~170 s each
    # natively: s48a's two e2e tests took 339 s)
    timeout -k 9 -s INT $(( $(left) - 10 )) python3 -m pytest -q -rA -m "gpu or e2e_kernels" -p no:cacheprovider \
      tests/test_decode.py -k "all_kernels_equals_stock and compact" > "$OUT/e2e_tests.log" 2>&1
    grep -h -E "^(PASSED|FAILED|ERROR)|passed|failed" "$OUT/e2e_tests.log"
    ;;
  s49a)  # (nvidia-h200) session 48: mhc_post_finish's second half sums only the 16 partial columns it reads (the
    # Gram entries, then a copy of the pre logits at PRE_COPY) instead of all 40 — s48d's profile: the sums' loads
    # + reduction ~30 % of the launch (6.34 µs alone at M = 1, 10.64 at M = 4). Its GPU tests (one launch == two,
    # bit for bit; vs the reference), the profile and the boundary alone; the step's MoE form profiled inside
    # (the selection in its gate/up kernel) and alone; then the q = 1 defaults
    timeout -k 9 -s INT 150 python3 -m pytest -q -rA -m gpu -p no:cacheprovider tests/test_mhc.py \
      > "$OUT/mhc_tests.log" 2>&1
    grep -h -E "^(PASSED|FAILED|ERROR)|passed|failed" "$OUT/mhc_tests.log"
    timeout -s INT 150 python3 benchmarks/bench_kernel_profile.py --dir /tmp/kprof --cases mhc,moe_rows \
      --out "$OUT/kernel_profile.txt" > "$OUT/bench_kernel_profile.log" 2>&1
    timeout -s INT 150 python3 benchmarks/bench_mhc.py --rows 1,4 --paths grid --out "$OUT/bench_mhc.txt" \
      > "$OUT/bench_mhc.log" 2>&1
    # the step's MoE alone (s48e: gate/up 17.7 + down 10.3 µs in the step): XLA glue form vs the rows form
    timeout -s INT 150 python3 benchmarks/bench_linear.py --rows 1 --only moerk,moerows --out "$OUT/bench_linear.txt" \
      > "$OUT/bench_linear.log" 2>&1
    cat "$OUT/kernel_profile.txt" "$OUT/bench_mhc.txt" "$OUT/bench_linear.txt"
    [ "$(left)" -gt 200 ] && rank1 s49a --q 1 --steps-per-call 4 --repeats 3 --steps 80 --policy '{}'
    ;;
  s48e)  # (nvidia-h200) the new defaults (mla_uv_kernel + moe_rows on) at q = 1 traced: events + kernel listing kept
    # for benchmarks/sublayer_chain.py (each sublayer's chain, the MoE's without its XLA glue and sum)
    rank1 s48e --q 1 --steps-per-call 4 --trace --hlo-dir "$OUT/hlo" --policy '{}'
    rm -f "$OUT"/hlo/*.hlo.gz
    ;;
  s48d)  # (nvidia-h200) where the mHC boundary's 7.5 µs go (90 per step at q = 1: ~0.68 ms, the largest fixed cost
    # on the chain): mhc_post_finish's in-kernel profile with finer scopes (load / mix / logits / partials /
    # barrier / sum / pre / normed), then the boundary alone at 1 and 4 rows
    timeout -s INT 150 python3 benchmarks/bench_kernel_profile.py --dir /tmp/kprof --cases mhc \
      --out "$OUT/kernel_profile.txt" > "$OUT/bench_kernel_profile.log" 2>&1
    timeout -s INT 150 python3 benchmarks/bench_mhc.py --rows 1,4 --paths grid --out "$OUT/bench_mhc.txt" \
      > "$OUT/bench_mhc.log" 2>&1
    cat "$OUT/kernel_profile.txt" "$OUT/bench_mhc.txt"
    ;;
  s48c)  # (nvidia-h200) s48b: mla_uv_kernel -0.10 ms (4 of 5 paired) and moe_rows -0.09 (4 of 5) on a slow host
    # (defaults 4.35): q = 1 defaults vs both vs mla_uv_kernel, 5 interleaved repeats
    rank1 s48c --q 1 --steps-per-call 4 --interleave --repeats 5 --steps 80 --policy '{}' \
      '{"mla_uv_kernel": true, "moe_rows": true}' '{"mla_uv_kernel": true}'
    ;;
  s48b)  # (nvidia-h200) q = 1: defaults vs mla_uv_kernel vs moe_rows (5 interleaved repeats, 80 steps)
    rank1 s48b --q 1 --steps-per-call 4 --interleave --repeats 5 --steps 80 --policy '{}' '{"mla_uv_kernel": true}' \
      '{"moe_rows": true}'
    ;;
  s47e)  # (nvidia-h200) moe_rows a third time (s46c: -0.05 ms, 3 of 4 paired rounds; s47b with linear_fused_sum:
    # -0.02, 4 of 4, where linear_fused_sum alone was +0.06): q = 1 defaults vs moe_rows, 5 interleaved repeats
    rank1 s47e --q 1 --steps-per-call 4 --interleave --repeats 5 --steps 80 --policy '{}' '{"moe_rows": true}'
    ;;
  s47d)  # (nvidia-h200) s47c: pool_update's GPU tests all pass (1 / 4 / 8 / 16 rows). The kernel-tiny e2e test of the
    # knob (a 13-token prefill in one 16-row chunk through the kernel, three verify steps), then q = 1 defaults
    timeout -k 9 -s INT 330 python3 -m pytest -q -rA -m "gpu or e2e_kernels" -p no:cacheprovider tests/test_decode.py \
      -k "indexer_pool_kernel" > "$OUT/e2e_tests.log" 2>&1
    grep -h -E "^(PASSED|FAILED|ERROR)|passed|failed" "$OUT/e2e_tests.log"
    [ "$(left)" -gt 110 ] && rank1 s47d --q 1 --steps-per-call 4 --repeats 3 --steps 80 --policy '{}'
    ;;
  s47c)  # (nvidia-h200) s47b: the pooled keys still wrong at 8 / 16 rows — every completed pool but the call's first
    # (the T <= 4 tests never complete a second): its rows from single-row register stores at row offsets. Now the
    # pooling's rows all come by TMA from the ring after the call's rows are written: pool_update's GPU tests
    timeout -k 9 -s INT 100 python3 -m pytest -q -rA -m gpu -p no:cacheprovider tests/test_indexer.py \
      -k "pool_update_gpu" > "$OUT/pool_tests.log" 2>&1
    grep -h -E "^(PASSED|FAILED|ERROR|XFAIL|XPASS)|passed|failed" "$OUT"/*_tests.log
    ;;
  s47b)  # (nvidia-h200) s47a's probe: the ring rows' bug is a strided register store into SMEM at 8 rows; pool_update
    # now stores whole contiguous tiles and takes up to 16 rows — its GPU tests (1 / 4 / 8 / 16 rows), the probe
    # (its strided 8-row cases strict xfails), the kernel-tiny e2e with 16-row prefill chunks; the linears' in-kernel
    # split sums (linear_fused_sum, the MoE now keeping the router in its gate/up kernel under it): GPU tests; then
    # q = 1: defaults vs linear_fused_sum vs + moe_rows vs kda_gate_proj (5 interleaved repeats)
    # (first run, 311 s: the ring right at 8 / 16 rows, the pooled keys wrong there — 3 and 5 pooling rows; the e2e
    # test killed at 150 s; the fused-sum tests passed. Now: the pooling on 4 / 8 rows, its GPU tests, then q = 1)
    timeout -k 9 -s INT 100 python3 -m pytest -q -rA -m gpu -p no:cacheprovider tests/test_indexer.py \
      -k "pool_update_gpu" > "$OUT/pool_tests.log" 2>&1
    grep -h -E "^(PASSED|FAILED|ERROR|XFAIL|XPASS)|passed|failed" "$OUT"/*_tests.log
    [ "$(left)" -gt 300 ] && rank1 s47b --q 1 --steps-per-call 4 --interleave --repeats 5 --steps 80 --policy '{}' \
      '{"linear_fused_sum": true}' '{"linear_fused_sum": true, "moe_rows": true}' '{"kda_gate_proj": true}'
    ;;
  s47a)  # (nvidia-h200) session 46's final commit natively: pool_update's GPU tests at <= 4 rows (3 sequences of 3,
    # 32 of 1 new), the probe of its 8 / 16-row gate bug (test_rows_layout_copy: which load / store pattern fails),
    # the kernel-tiny bf16 end-to-end test of the knob, and moe_rows end to end; then q = 1 with the defaults
    timeout -k 9 -s INT 150 python3 -m pytest -q -rA -p no:cacheprovider tests/test_indexer.py \
      -k "pool_update_gpu or rows_layout_copy" > "$OUT/pool_tests.log" 2>&1
    timeout -k 9 -s INT 330 python3 -m pytest -q -rA -m "gpu or e2e_kernels" -p no:cacheprovider tests/test_decode.py \
      -k "indexer_pool_kernel or (all_kernels_equals_stock and moe_rows)" > "$OUT/e2e_tests.log" 2>&1
    grep -h -E "^(PASSED|FAILED|ERROR)|passed|failed" "$OUT/pool_tests.log" "$OUT/e2e_tests.log"
    [ "$(left)" -gt 150 ] && rank1 s47a --q 1 --steps-per-call 4 --repeats 3 --steps 80 --policy '{}'
    ;;
  s46d)  # (nvidia-h200) s46c: pool_update's ring rows wrong natively at 8 rows too — every wrong element a gate score
    # (stored as loaded, bf16 from GMEM), the keys (through f32) right. Its GPU tests at 1 / 4 / 8 / 16 rows: with
    # the gates through f32 (commit 354d646's package), then 4 rows at a time — both still wrong at 8 and 16 rows;
    # the kernel takes <= 4 since (as the command runs now: the tests at <= 4 rows)
    timeout -k 9 -s INT 120 python3 -m pytest -q -rA -m gpu -p no:cacheprovider tests/test_indexer.py -k pool_update \
      > "$OUT/pool_tests.log" 2>&1
    grep -h -E "^(PASSED|FAILED|ERROR)|passed|failed|Mismatched|^E .*\[" "$OUT/pool_tests.log" | head -30
    ;;
  s46c)  # (nvidia-h200) s46b: pool_update wrote wrong ring rows natively at 16 token rows (1 / 4 rows pass): the
    # kernel now takes <= 8 (prefill chunks stay in XLA) — its GPU tests with 8 rows; then the MoE's rows form with
    # the router in the gate/up kernel (moe_rows: h's rows unweighted, the weights in the down kernel, y's rows):
    # its GPU test, then q = 1 defaults vs moe_rows (5 interleaved repeats)
    timeout -k 9 -s INT 100 python3 -m pytest -q -rA -m gpu -p no:cacheprovider tests/test_indexer.py -k pool_update \
      > "$OUT/pool_tests.log" 2>&1
    timeout -k 9 -s INT 120 python3 -m pytest -q -rA -m gpu -p no:cacheprovider tests/test_linear_kernels.py \
      -k with_rows_gpu > "$OUT/moe_rows_tests.log" 2>&1
    grep -h -E "^(PASSED|FAILED|ERROR)|passed|failed" "$OUT/pool_tests.log" "$OUT/moe_rows_tests.log"
    [ "$(left)" -gt 280 ] && rank1 s46c --q 1 --steps-per-call 4 --interleave --repeats 5 --steps 80 --policy '{}' \
      '{"moe_rows": true}'
    ;;
  s46b)  # (nvidia-h200) s46a: indexer_pool_kernel 4.14 -> 3.98 ms at q = 1 (faster in 4 of 4 paired rounds) — on by
    # default now. Its GPU tests with their whole output (s46a: the 16-token case failed an element tolerance that
    # did not allow one e4m3 step; the kernel-tiny bf16 steps left no line in the log), then the new defaults'
    # q = 1 step traced (events + kernel listing kept: the DSA layer's chain with the update off the path)
    timeout -k 9 -s INT 150 python3 -m pytest -q -rA -m gpu -p no:cacheprovider tests/test_indexer.py -k pool_update \
      > "$OUT/pool_tests.log" 2>&1
    timeout -k 9 -s INT 240 python3 -m pytest -q -rA -m "gpu or e2e_kernels" -p no:cacheprovider tests/test_decode.py \
      -k indexer_pool_kernel > "$OUT/pool_e2e.log" 2>&1
    echo "e2e rc $?" >> "$OUT/pool_e2e.log"
    tail -5 "$OUT/pool_tests.log" "$OUT/pool_e2e.log"
    [ "$(left)" -gt 150 ] && rank1 s46b --q 1 --steps-per-call 4 --trace --hlo-dir "$OUT/hlo" --policy '{}'
    rm -f "$OUT"/hlo/*.hlo.gz
    ;;
  s46a)  # (nvidia-h200) session 45's DSA chain: the scores kernel waited ~12 µs for the indexer's pooled-key chain
    # (~8 XLA kernels, their temporaries ordered behind the MLA latent's chain). The whole cache update as ONE launch
    # writing the caches in place (indexer_pool_kernel): its GPU tests (the kernel against the reference compiled as
    # the model rounds; kernel-tiny bf16 steps against XLA's update), then q = 1: defaults vs the knob (5
    # interleaved repeats, kernel listings kept), then the knob's step traced (events kept: sublayer_chain.py)
    GT_MARK="gpu" gt 200 tests/test_indexer.py "pool_update"
    GT_MARK="gpu or e2e_kernels" gt 150 tests/test_decode.py "indexer_pool_kernel"
    rank1 s46a --q 1 --steps-per-call 4 --interleave --repeats 5 --steps 80 --hlo-dir "$OUT/hlo" --policy '{}' \
      '{"indexer_pool_kernel": true}'
    [ "$(left)" -gt 150 ] && rank1 s46a2 --q 1 --steps-per-call 4 --trace --hlo-dir "$OUT/hlo" \
      --policy '{"indexer_pool_kernel": true}'
    rm -f "$OUT"/hlo/*.hlo.gz
    ;;
  s45d)  # (nvidia-h200) topk_threshold_exit on by default (s45b / s45c: faster in 8 of 8 paired rounds): the defaults'
    # end-to-end GPU test (every kernel against the stock path's tokens), then the q = 1 step with the defaults
    GT_MARK="gpu or e2e_kernels" gt 330 tests/test_decode.py "all_kernels_equals_stock and extra0"
    [ "$(left)" -gt 130 ] && rank1 s45d --q 1 --steps-per-call 4 --repeats 3 --steps 80 --policy '{}'
    ;;
  s45c)  # (nvidia-h200) s45b: topk_threshold_exit -0.06 ms paired (4 of 4). s45a's DSA chain read with s45b's kernel
    # listing: the indexer's key chain (LayerNorm -> pooling / Hadamard slices -> amax -> FP8 -> pooled-key write)
    # ran only after the MLA latent's chain, the scores kernel waiting for it ~11 µs: the chain traced first
    # (dsa_index_keys_first, the same values) — does XLA's schedule follow? (No: the same compiled program; the
    # knob was removed after this run — the command as it ran needs commit 644dfc1's package)
    X='"topk_threshold_exit": true'
    rank1 s45c --q 1 --steps-per-call 4 --interleave --repeats 5 --steps 80 --policy '{}' "{$X}" \
      "{$X, \"dsa_index_keys_first\": true}"
    [ "$(left)" -gt 150 ] && rank1 s45c2 --q 1 --steps-per-call 4 --trace --hlo-dir "$OUT/hlo" \
      --policy "{$X, \"dsa_index_keys_first\": true}"
    rm -f "$OUT"/hlo/*.hlo.gz
    ;;
  s45b)  # (nvidia-h200) s45a's DSA chain: scores 4.2 -> threshold 13.9 (32 dependent passes) -> XLA compaction 9.4
    # -> sparse MLA. The threshold kernel's passes stopping at the first candidate with exactly k keys at or above
    # it (knob topk_threshold_exit): natively, alone (f32 scores: the indexer's kernel writes f32), in the step
    GT_MARK="gpu" gt 200 tests/test_indexer.py "early_exit"
    timeout 120 python3 benchmarks/bench_topk.py --rows 1,4 --pools 8704 --f32-scores \
      --only "kernel scan128,kernel exit scan128,kernel2 scan128,kernel2 exit scan128" > "$OUT/bench_topk.log" 2>&1
    rank1 s45b --q 1 --steps-per-call 4 --interleave --repeats 5 --steps 80 --hlo-dir "$OUT/hlo" --policy '{}' \
      '{"topk_threshold_exit": true}'
    rm -f "$OUT"/hlo/*.hlo.gz
    ;;
  s45a)  # (nvidia-h200) session 43's boundary-to-boundary table named each sublayer's chain by hand from a trace
    # since lost; the DSA layer (93 µs, floor ~15) had "3 branches of ~30 small kernels". The trace and HLO kept
    rank1 s45a --q 1 --steps-per-call 4 --trace --hlo-dir "$OUT/hlo" --policy '{}'
    rm -f "$OUT"/hlo/*.kernels.tsv
    ;;
  s44b)  # (nvidia-h200) s44a: the chained MoE 34.2 µs alone vs 24.2 + glue, the step 4.16 -> 4.51 ms — the down
    # CTAs dispatched late (as gate/up CTAs retire) ran the router's selection (~5 µs) before their first weight
    # request. Now they read the writer's stored selection (a counter it raises by G2, each down CTA taking 1).
    # GPU tests (with the slots summed in the kernel: moe_chained_sum), alone, then q = 1: defaults vs both
    gt 150 "tests/test_linear_kernels.py" "chained"
    timeout -s INT 100 python3 benchmarks/bench_linear.py --rows 1 --only moerk,moech > "$OUT/bench_linear.log" 2>&1
    set -- '{}'
    grep -q "PASSED.*chained_gpu\[bfloat16\]" "$OUT/gpu_tests.log" && set -- "$@" '{"moe_chained": true}' \
      '{"moe_chained": true, "moe_chained_sum": true}'
    [ $# -eq 3 ] && [ "$(left)" -gt 200 ] && rank1 s44b --q 1 --steps-per-call 4 --interleave --repeats 4 \
      --steps 80 --policy "$@"
    ;;
  s44a)  # (nvidia-h200) s43's timeline: the MoE sublayer is 40 % of the step, its chain gate/up 18.1 -> glue 2.3 ->
    # down 8.4 -> sum 1.4 µs, each launch cold at its start and in a tail at its end. fp8_moe_chained (knob
    # moe_chained): the two kernels and the glue as one launch of two roles, the down weights requested during the
    # gate/up tail. Its GPU tests, the end-to-end test with it, alone (bench_linear moerk vs moech), then q = 1
    gt 150 "tests/test_linear_kernels.py" "chained"
    GT_MARK="gpu or e2e_kernels" gt 150 tests/test_decode.py "all_kernels_equals_stock and chained"
    timeout -s INT 100 python3 benchmarks/bench_linear.py --rows 1 --only moerk,moech > "$OUT/bench_linear.log" 2>&1
    set -- '{}'
    grep -q "PASSED.*chained_gpu\[bfloat16\]" "$OUT/gpu_tests.log" && set -- "$@" '{"moe_chained": true}'
    [ $# -eq 2 ] && [ "$(left)" -gt 200 ] && rank1 s44a --q 1 --steps-per-call 4 --interleave --repeats 5 \
      --steps 80 --policy "$@"
    ;;
  s43d)  # (nvidia-h200) s43c's five knobs on by default now: the defaults' end-to-end GPU tests (every kernel
    # against the stock path, then with the remaining candidates), then the q = 1 step with the new defaults
    GT_MARK="gpu or e2e_kernels" gt 330 tests/test_decode.py "all_kernels_equals_stock"
    [ "$(left)" -gt 150 ] && rank1 s43d --q 1 --steps-per-call 4 --repeats 3 --steps 80 --policy '{}'
    ;;
  s43c)  # (nvidia-h200) s43b's trace of one q = 1 step: a DSA layer is ~90 µs boundary to boundary, its three
    # branches (index queries; index keys + pool cache; MLA queries + W_UK) about as long, then the selection and
    # the attention on one chain. Four knobs that each tied alone, each shortening a different part of that layer
    # (the queries' rotation, the threshold kernel's keys, the MLA split merge) or the KDA layer's conv, all at
    # once — and with the grid barriers' counters in one Ref (91 semaphore fills fewer)
    C4='"indexer_q_in_kernel": true, "topk_keys_in_kernel": true, "mla_combine_kernel": true, "kda_conv": true'
    rank1 s43c --q 1 --steps-per-call 4 --interleave --repeats 5 --steps 80 --policy '{}' "{$C4}" \
      "{$C4, \"mhc_barrier_counters\": true}"
    ;;
  s43b)  # (nvidia-h200) s43a: the measured critical path of the q = 1 step is 4.07 ms, 3.1 of kernels and 0.96 of
    # waits — kernels that started ~14-17 µs after their last input ended (the MoE's pad fusion, the router's
    # logits reduction). What ran during those waits (the trace's events and the HLO kept, for reading offline)
    rank1 s43b --q 1 --steps-per-call 4 --trace --hlo-dir "$OUT/hlo" --policy '{}'
    rm -f "$OUT"/hlo/*.kernels.tsv
    ;;
  s43a)  # (nvidia-h200) session 42: three knobs that take XLA kernels off the chain by GPU time tie (ten such ties
    # since session 36): the chain by weights is not where the step's time runs. The measured critical path from
    # a trace instead (profiling.timeline_critical_path: each kernel's latest-ending input, back from the last
    # kernel of the last step): q = 1 at 4 steps per call, defaults, then with indexer_q_in_kernel (a branch of the
    # DSA layer shortened: which branch does the path take then)
    rank1 s43a1 --q 1 --steps-per-call 4 --trace --hlo-dir "$OUT/hlo" --policy '{}' '{"indexer_q_in_kernel": true}'
    rm -f "$OUT"/hlo/*.hlo.gz "$OUT"/hlo/*.kernels.json
    ;;
  s42d)  # (nvidia-h200) s42c: the select kernel alone 19.8 µs vs 17.0 for the threshold kernel + XLA's compaction
    # (R = 1): its scatter now a loop over SMEM rows and its tiles a loop (the unrolled form was 16x the threshold
    # kernel's code, run once by one CTA: cold instruction fetches). Natively right still, and its time
    gt 100 "tests/test_indexer.py" "select_kernel_gpu"
    timeout 100 python3 benchmarks/bench_topk.py --rows 1,4 --pools 8704 \
      --only "kernel scan128,select,select noexit" > "$OUT/bench_topk.log" 2>&1
    ;;
  s42c)  # (nvidia-h200) s41c's chain by GPU time runs through the index queries' XLA rotation (the wq_b GEMV ->
    # butterflies' slice / concatenate -> amax -> e4m3 convert -> scores kernel: ~9.9 µs after the GEMV per DSA
    # layer), which indexer_q_in_kernel moves into the scores kernel (session 36: a tie when the launch-count chain
    # did not pass there); likewise the KDA layer's chain through the XLA conv + SiLU fusion (1.95 µs) between the
    # qkv GEMV and the KDA kernel, which kda_conv moves into the kernel (session 35: a tie, same reasoning).
    # q = 1: defaults vs each; with SELECT=1 (s42b's topk_select_kernel natively right) also the select kernel
    # alone and all three
    # (first the select kernel alone, s42b: +0.13 ms per step with it — where does its time go)
    timeout 150 python3 benchmarks/bench_topk.py --rows 1,4 --pools 8704 \
      --only "kernel scan128,select,select noexit" > "$OUT/bench_topk.log" 2>&1
    set -- '{}' '{"indexer_q_in_kernel": true}' '{"kda_conv": true}'
    [ "${SELECT:-0}" = 1 ] && set -- "$@" '{"topk_select_kernel": true}' \
      '{"topk_select_kernel": true, "indexer_q_in_kernel": true, "kda_conv": true}'
    rank1 s42c1 --q 1 --steps-per-call 4 --interleave --repeats 5 --steps 80 --policy "$@"
    ;;
  s42b)  # (nvidia-h200) s42a: moe_router_ranks on (4.30 -> 4.19 ms). topk_select_kernel: the indexer's selection
    # (threshold, compaction, expansion, tail, pad) in ONE launch instead of the threshold kernel + ~7 XLA kernels
    # (23.8 µs per DSA layer on the q = 1 chain): its GPU tests (the inline scatter runs natively only), q = 1
    # defaults vs the knob, then the defaults end to end natively (s42a's selection missed it: not marked gpu)
    gt 200 "tests/test_indexer.py" "select_kernel"
    set -- '{}'
    grep -q "PASSED.*test_select_kernel_at_the_model_site\[True" "$OUT/gpu_tests.log" \
      && ! grep -q "FAILED.*select_kernel" "$OUT/gpu_tests.log" && set -- "$@" '{"topk_select_kernel": true}'
    [ $# -ge 2 ] && [ "$(left)" -gt 240 ] && rank1 s42b1 --q 1 --steps-per-call 4 --interleave --repeats 5 \
      --steps 80 --policy "$@"
    GT_MARK="gpu or e2e_kernels" gt 200 "tests/test_decode.py" "all_kernels_equals_stock and extra0"
    ;;
  s42a)  # (nvidia-h200) s41b/c: moe_router_in_kernel on (4.20 ms), but every gate/up CTA now runs the router's 8
    # rounds of 3 warpgroup reductions before its first weight request (gate/up 13.9 -> 18.7 µs). Two cheaper forms
    # of that selection: router_warp_rows (reductions inside one warp), moe_router_ranks (a CTA only up to its rank)
    gt 240 "tests/test_linear_kernels.py" "router_in_the_gate_up"
    set -- '{}'
    grep -q "PASSED.*router_in_the_gate_up_kernel_gpu\[bfloat16-True-False\]" "$OUT/gpu_tests.log" \
      && set -- "$@" '{"router_warp_rows": true}'
    grep -q "PASSED.*router_in_the_gate_up_kernel_gpu\[bfloat16-False-True\]" "$OUT/gpu_tests.log" \
      && set -- "$@" '{"moe_router_ranks": true}'
    grep -q "PASSED.*router_in_the_gate_up_kernel_gpu\[bfloat16-True-True\]" "$OUT/gpu_tests.log" \
      && set -- "$@" '{"router_warp_rows": true, "moe_router_ranks": true}'
    [ $# -ge 2 ] && [ "$(left)" -gt 240 ] && rank1 s42a1 --q 1 --steps-per-call 4 --interleave --repeats 5 \
      --steps 80 --policy "$@"
    gt 200 "tests/test_decode.py" "all_kernels_equals_stock and extra0"  # (the defaults end to end, natively)
    ;;
  s41c)  # (nvidia-h200) s41b: moe_router_in_kernel on by default (4.20 ms). The chain by GPU time with it (s40a's
    # method) for the next session's choice
    rank1 s41p1 --q 1 --profile --hlo-dir "$OUT/hlo" && kernel_tables 1
    rm -f "$OUT"/hlo/*.kernels.tsv "$OUT"/hlo/*.critical.tsv  # (keep the returned files within 8)
    ;;
  s41b)  # (nvidia-h200) s40a: the router's top-k is its own 5.3 µs launch on the q = 1 chain (43 MoE layers).
    # moe_router_in_kernel runs it inside every gate/up CTA instead: natively equal (unit + end to end), then timed
    gt 200 "tests/test_linear_kernels.py" "router_in_the_gate_up"
    gt 200 "tests/test_decode.py" "all_kernels_equals_stock and router_in_kernel"
    set -- '{}'
    grep -q "PASSED.*router_in_the_gate_up_kernel_gpu\[bfloat16\]" "$OUT/gpu_tests.log" \
      && grep -q "PASSED.*router_in_kernel" "$OUT/gpu_tests.log" && set -- "$@" '{"moe_router_in_kernel": true}'
    [ $# -eq 2 ] && [ "$(left)" -gt 200 ] && rank1 s41b1 --q 1 --steps-per-call 4 --interleave --repeats 5 \
      --steps 80 --policy "$@"
    # issue #9's 2x against auto at its own best (4 steps per call: never measured; auto was 7.70 ms at one)
    [ "$(left)" -gt 200 ] && timeout $(( $(left) - 5 )) python3 benchmarks/bench_decode.py --geometry tp4-rank \
      --batch 1 --q 1 --context 32768 --steps 40 --repeats 3 --fast-compile --budget-s $(( $(left) - 60 )) \
      --backend auto latency_specialized --steps-per-call 4 --interleave --compile-cache .jax_cache \
      --out "$OUT/decode_s41auto.jsonl" 2>&1 | grep -v -i -E "warn|^\s*$" >> "$OUT/bench_decode_s41auto.log"
    ;;
  s41a)  # (nvidia-h200) s40a: the chain is its kernels' durations, each weight-streaming one ~2-3 µs of ramp and
    # first bytes, the latency-bound ones (mHC 7.1 µs x 90) leaving HBM idle. Does a prefetch of the next kernel's
    # weight into L2 from the latency-bound kernel shorten the next one?
    timeout -s INT $(( $(left) - 20 )) python3 benchmarks/bench_l2_prefetch.py --spin 0,800 --mb 0,8,16,24,32,48 \
      --out "$OUT/bench_l2_prefetch.txt" > "$OUT/bench_l2_prefetch.log" 2>&1
    ;;
  s40e)  # (nvidia-h200) s40d (first calls only: clocks ramping): the persistent MoE's gate/up phase is bound by its
    # dequantise-and-multiply (mma 14.3 µs of 29.4 per warpgroup), the two-kernel MoE's mma ~40 % of each CTA. The
    # f16 dequantisation (one cvt per two values) natively, profiled on warm calls, and alone
    gt 200 "tests/test_linear_kernels.py" "persistent_gpu or f16_gpu"
    timeout -s INT 150 python3 benchmarks/bench_kernel_profile.py --dir /tmp/kprof --out "$OUT/kernel_profile.txt" \
      > "$OUT/bench_kernel_profile.log" 2>&1
    timeout -s INT 120 python3 benchmarks/bench_linear.py --rows 1 --only moedq,moep > "$OUT/bench_linear.log" 2>&1
    set -- '{}'
    grep -q "PASSED.*f16_gpu\[q_a-1\]" "$OUT/gpu_tests.log" && set -- "$@" '{"dq_f16": true}'
    [ $# -eq 2 ] && grep -q "PASSED.*persistent_gpu\[float16\]" "$OUT/gpu_tests.log" \
      && set -- "$@" '{"dq_f16": true, "moe_persistent": true}'
    [ $# -ge 2 ] && [ "$(left)" -gt 240 ] && rank1 s40e1 --q 1 --steps-per-call 4 --interleave --repeats 5 \
      --steps 80 --policy "$@"
    ;;
  s40d)  # (nvidia-h200) s40b / s40c: neither the persistent MoE nor the balanced ranges beat the two kernels; a
    # kernel of ~10-40 MB streams at ~2.9 TB/s and the mHC boundary takes 7.1 µs for ~0.8 MB. Where inside them?
    timeout -s INT $(( $(left) - 20 )) python3 benchmarks/bench_kernel_profile.py --dir /tmp/kprof \
      --out "$OUT/kernel_profile.txt" > "$OUT/bench_kernel_profile.log" 2>&1
    tar czf "$OUT/kprof_traces.tar.gz" -C /tmp kprof 2>/dev/null
    ;;
  s40c)  # (nvidia-h200) s40b: the persistent MoE is correct but 33.5 µs (one warpgroup per SM). Its balanced ranges
    # without the barriers: fp8_moe_balanced's GPU tests (3 / 2 CTAs per SM, 4 stages), alone, then in the step
    gt 200 "tests/test_linear_kernels.py" "balanced"
    timeout -s INT 120 python3 benchmarks/bench_linear.py --rows 1 --only moedq,moeb > "$OUT/bench_linear.log" 2>&1
    set -- '{}'
    grep -q "PASSED.*balanced_gpu\[3-None\]" "$OUT/gpu_tests.log" && set -- "$@" '{"moe_balanced": true}'
    [ $# -eq 2 ] && [ "$(left)" -gt 200 ] && rank1 s40c1 --q 1 --steps-per-call 4 --interleave --repeats 5 \
      --steps 80 --policy "$@"
    ;;
  s40b)  # (nvidia-h200) s40a: at q = 1 the chain's kernels are 4,056 µs of the step, MoE 1,101 of them (gate/up 13.9
    # + glue + down 8.7 µs per layer, both grids 288 CTAs on 132 SMs). The persistent MoE natively (its GPU test:
    # one launch == three launches == the reference, counters left zero), alone (bench_linear), then in the step
    gt 240 "tests/test_linear_kernels.py" "persistent"
    timeout -s INT 120 python3 benchmarks/bench_linear.py --rows 1 --only moedq,moep > "$OUT/bench_linear.log" 2>&1
    set -- '{}'
    grep -q "PASSED.*persistent_gpu" "$OUT/gpu_tests.log" && set -- "$@" '{"moe_persistent": true}'
    [ $# -eq 2 ] && [ "$(left)" -gt 200 ] && rank1 s40b1 --q 1 --steps-per-call 4 --interleave --repeats 5 \
      --steps 80 --policy "$@"
    ;;
  s40a)  # (nvidia-h200) session 39: ten knobs' A/Bs tie; s39a's chain by GPU time weighed every fusion after a
    # shared kernel's first instance 0. With that fixed: which kernels' durations make up the step's chain, at
    # q = 1 and q = 4 (one step per call: CUPTI sees every launch), launch by launch in *.critical_gpu.tsv
    rank1 s40p1 --q 1 --profile --hlo-dir "$OUT/hlo" && kernel_tables 1
    [ "$(left)" -gt 240 ] && rank1 s40p4 --q 4 --profile --hlo-dir "$OUT/hlo" && kernel_tables 4
    rm -f "$OUT"/hlo/*.kernels.tsv "$OUT"/hlo/*.critical.tsv  # (keep the returned files within 8)
    ;;
  s39c)  # (nvidia-h200) s39b: topk_keys_in_kernel could not run at 80 steps of room (8,768 padded pools, not a
    # multiple of the threshold kernel's 128 lanes: the scores kernel now pads to them); router_warp_rows is new.
    # Their GPU tests, then q = 1 (4 steps per call, 80 per repeat, 5 interleaved repeats): defaults vs each knob
    # whose tests passed, and both; then, if time remains, q = 1 profiled at one step per call — the chain by GPU
    # time weighed right (fusions sharing one kernel: its time), launch by launch in *.critical_gpu.tsv
    gt 90 "tests/test_router_kernel.py" "kernel_gpu"
    gt 60 "tests/test_indexer.py" "keys_formed"
    ok() { grep -q "PASSED.*$1" "$OUT/gpu_tests.log" && ! grep -q -E "(FAILED|ERROR).*$1" "$OUT/gpu_tests.log"; }
    set -- '{}'
    ok "keys_formed" && set -- "$@" '{"topk_keys_in_kernel": true}'
    ok "kernel_gpu.*True" && set -- "$@" '{"router_warp_rows": true}'
    [ $# -eq 3 ] && set -- "$@" '{"topk_keys_in_kernel": true, "router_warp_rows": true}'
    [ "$(left)" -gt 200 ] && rank1 s39c1 --q 1 --steps-per-call 4 --interleave --repeats 5 --steps 80 --policy "$@"
    [ "$(left)" -gt 200 ] && rank1 s39p2 --q 1 --profile --hlo-dir "$OUT/hlo" && kernel_tables 1
    rm -f "$OUT"/hlo/*.kernels.tsv  # (the listing: s39a's; keep the returned files few)
    ;;
  s39b)  # (nvidia-h200) s39a: topk_keys_in_kernel 4.42 vs 4.56 ms at q = 1 (one interleaved run: 4 repeats). The gate
    # before it becomes a default: the model's call site natively (the scores kernel's padded output read by the
    # threshold kernel: indices and pools equal to the XLA fusion's), then more repeats at q = 1 and q = 4
    gt 150 "tests/test_indexer.py" "keys_formed or from_scores"
    # (80 steps per repeat, not 20: s39a's rounds spread +-0.15 ms at 20 — as much as the effect measured)
    [ "$(left)" -gt 220 ] && rank1 s39b1 --q 1 --steps-per-call 4 --interleave --repeats 5 --steps 80 --policy '{}' \
      '{"topk_keys_in_kernel": true}'
    [ "$(left)" -gt 180 ] && rank1 s39b4 --q 4 --steps-per-call 4 --interleave --repeats 3 --steps 40 --policy '{}' \
      '{"topk_keys_in_kernel": true}'
    ;;
  s39a)  # (nvidia-h200) session 37's profiles recorded a quarter of the step's launches (CUPTI sees one pass of the
    # rolled steps loop per call): q = 1 profiled at one step per call — every kernel's µs per launch, the chain by
    # GPU time, each component against its floor (bench_decode prints them). Then q = 4 at 4 steps per call,
    # defaults vs the three chain knobs (kda_gate_proj + kda_conv + linear_fused_sum: at q = 4 the KDA layer's
    # chain is 9 launches — bf16_linear kernels with XLA split-K sums — against 5 at q = 1, where s38b measured a
    # tie), 4 interleaved repeats; then q = 1: defaults vs topk_keys_in_kernel (its threshold kernel passed natively
    # in session 38; never timed). The later configurations compile with their unchanged kernels' Mosaic modules
    # kept (_memoize_kernel_lowerings): compare their compile s with the first's
    rank1 s39p1 --q 1 --profile --hlo-dir "$OUT/hlo" && kernel_tables 1
    [ "$(left)" -gt 220 ] && rank1 s39q4 --q 4 --steps-per-call 4 --interleave --repeats 4 --policy '{}' \
      '{"kda_gate_proj": true, "kda_conv": true, "linear_fused_sum": true}'
    [ "$(left)" -gt 150 ] && rank1 s39c --q 1 --steps-per-call 4 --interleave --repeats 4 --policy '{}' \
      '{"topk_keys_in_kernel": true}'
    ;;
  s38b)  # (nvidia-h200) s38a: kda_gate_proj took 68 launches off the step but none off its critical path (815: the
    # KDA layer's qkv path — qkv kernel -> split-K sum -> conv fusion -> KDA kernel — is as long). The two together:
    # q = 1, 4 interleaved repeats: defaults vs kda_gate_proj + kda_conv (+ linear_fused_sum: the qkv sum in the
    # kernel too); then why the MoE rows-form test failed (its assertion, with the traceback)
    [ "$(left)" -gt 200 ] && rank1 s38b --q 1 --steps-per-call 4 --interleave --repeats 4 --policy '{}' \
      '{"kda_gate_proj": true, "kda_conv": true}' '{"kda_gate_proj": true, "kda_conv": true, "linear_fused_sum": true}'
    [ "$(left)" -gt 60 ] && timeout -k 9 $(( $(left) - 20 )) python3 -m pytest -q -m gpu -p no:cacheprovider \
      --tb=short "tests/test_linear_kernels.py::test_fp8_moe_fused_rows_gpu[1]" > "$OUT/moe_rows_test.log" 2>&1
    ;;
  s38a)  # (nvidia-h200) session 37's kda_gate_proj natively (the KDA kernel forming f and the gate logits from the
    # fgb_a rows: its GPU tests), then q = 1 at 4 steps per call, 5 interleaved repeats: defaults vs kda_gate_proj
    # (the KDA layer's chain 6 -> 4 launches: 815 -> 747 expected); then the MoE rows-form test that s37a's
    # compile (the weights closed over: jit constants) cut
    gt 200 "tests/test_kda_decode.py::test_f_proj_kernel_matches_reference_gpu"
    set --
    grep -q "PASSED.*f_proj_kernel" "$OUT/gpu_tests.log" && ! grep -q -E "(FAILED|ERROR).*f_proj_kernel" \
      "$OUT/gpu_tests.log" && set -- '{"kda_gate_proj": true}'
    [ "$(left)" -gt 200 ] && rank1 s38a --q 1 --steps-per-call 4 --interleave --repeats 5 --policy '{}' "$@"
    gt 150 "tests/test_linear_kernels.py::test_fp8_moe_fused_rows_gpu[1]"
    ;;
  s37c)  # (nvidia-h200) session 36's other CPU work natively: the threshold kernel fed the scores
    # (topk_keys_in_kernel), the all-kernels == stock step with the candidates on (kda_conv, router_route, the
    # barrier counters, linear_fused_sum's rows form, topk_keys_in_kernel); then q = 1, 5 interleaved repeats:
    # defaults vs topk_keys_in_kernel and mla_combine_kernel (each one launch fewer on every DSA layer's chain)
    gt 120 "tests/test_indexer.py::test_threshold_kernel_from_scores_gpu"
    gt 300 tests/test_decode.py "all_kernels_equals_stock and candidates"
    set --
    grep -q "PASSED.*from_scores_gpu" "$OUT/gpu_tests.log" && ! grep -q -E "(FAILED|ERROR).*from_scores_gpu" \
      "$OUT/gpu_tests.log" && set -- '{"topk_keys_in_kernel": true}'
    [ "$(left)" -gt 200 ] && rank1 s37c --q 1 --steps-per-call 4 --interleave --repeats 5 --policy '{}' "$@" \
      '{"mla_combine_kernel": true}'
    ;;
  s37b)  # (nvidia-h200) where linear_fused_sum's rows form spends its time: q = 1 profiled (CUPTI) with its kernel
    # table and the chain by GPU time, the defaults the same way — do the in-kernel sums' waiting CTAs (the last
    # split's, spinning on the counters) cost what the 100 launches off the critical path save? (s37a: 815 -> 715
    # launches on the chain, −0.35 / +0.32 ms in two rounds)
    [ "$(left)" -gt 200 ] && rank1 s37p --q 1 --steps-per-call 4 --profile --hlo-dir "$OUT/hlo" \
      --policy '{"linear_fused_sum": true}' && kernel_tables 1
    mkdir -p "$OUT/hlo_defaults" && [ "$(left)" -gt 150 ] && rank1 s37p0 --q 1 --steps-per-call 4 --profile \
      --hlo-dir "$OUT/hlo_defaults" && for k in "$OUT"/hlo_defaults/*_q1_*.kernels.json; do
        [ -f "$k" ] && timeout 60 python3 benchmarks/kernel_table.py "$k" --hlo "${k%.kernels.json}.hlo.gz" \
          > "$OUT/kernel_table_defaults_$(basename "${k%.kernels.json}").txt" 2>&1; done
    rm -f "$OUT"/hlo_defaults/*.hlo.gz "$OUT"/hlo_defaults/*.kernels.json
    ;;
  s37a)  # (nvidia-h200) session 36's rows form natively: the fused-sum kernels writing their sums as the token rows
    # (FP8 linear at M = 1; the MoE's gate/up -> h rows and down -> y rows at M = 1 and 4), then q = 1 at 4 steps
    # per call, interleaved: defaults vs linear_fused_sum (the rows form). The tests by node id: session 36's -k
    # "... and not 4 and not 12" selected nothing on the device (pytest 8 matches -k words against the parent
    # nodes' names too: the checkout's directory) — and the A/B only after a " passed" line with no failure
    # (ROWS=0 leaves it out)
    gt 240 "tests/test_linear_kernels.py::test_fp8_moe_fused_rows_gpu"
    gt 120 "tests/test_linear_kernels.py::test_fp8_dq_linear_fused_sum_gpu[1]"
    if [ "${ROWS:-1}" = 1 ] && grep -q " passed" "$OUT/gpu_tests.log" && ! grep -q -E "FAILED|ERROR|Interrupt" \
        "$OUT/gpu_tests.log"; then set -- '{"linear_fused_sum": true}'
    else set --; fi
    [ "$(left)" -gt 150 ] && rank1 s37a --q 1 4 --steps-per-call 4 --interleave --repeats 5 --policy '{}' "$@"
    ;;
  s36a)  # (nvidia-h200) the barrier counters natively (mhc_barrier_counters' chain test); where the step's wall
    # time goes, statically and measured: q = 1 and q = 4 compiled with their
    # HLO kept (the .critical.tsv beside each .kernels.tsv: the longest dependence chain of kernels, issue #14),
    # q = 1 profiled apart (CUPTI: the chain weighted by each kernel's µs per launch) with its kernel table; then
    # the all-kernels == stock step with the candidates on (kda_conv, router_route: s35a's 150 s were too few)
    gt 120 tests/test_mhc.py "counters_gpu"
    gt 150 tests/test_linear_kernels.py "fused_sum_gpu"
    [ "$(left)" -gt 200 ] && rank1 s36c --q 1 4 --steps-per-call 4 --repeats 3 --hlo-dir "$OUT/hlo"
    rm -f "$OUT"/hlo/*.hlo.gz
    [ "$(left)" -gt 200 ] && rank1 s36p --q 1 --steps-per-call 4 --profile --hlo-dir "$OUT/hlo" && kernel_tables 1
    gt 300 tests/test_decode.py "all_kernels_equals_stock and candidates"
    ;;
  s36b)  # (nvidia-h200) q = 1 at 4 steps per call, 5 interleaved repeats: defaults vs mhc_barrier_counters (if
    # s36a's counters_gpu test passed; COUNTERS=0 leaves it out), linear_fused_sum, indexer_q_in_kernel, topk_scan_mm
    # (FUSED_SUM=0 leaves linear_fused_sum out, if its GPU test failed)
    set --
    [ "${COUNTERS:-1}" = 1 ] && set -- "$@" '{"mhc_barrier_counters": true}'
    [ "${FUSED_SUM:-1}" = 1 ] && set -- "$@" '{"linear_fused_sum": true}'
    [ "$(left)" -gt 200 ] && rank1 s36b --q 1 --steps-per-call 4 --interleave --repeats 5 --policy '{}' "$@" \
      '{"indexer_q_in_kernel": true}' '{"topk_scan_mm": true}'
    ;;
  s35a)  # (nvidia-h200) what s34a's budget left out: the 2- and 4-warpgroup threshold kernels' GPU tests, the
    # all-kernels == stock step with the candidates on (kda_conv, router_route); then q = 1 at 4 steps per call,
    # 5 interleaved repeats, a cumulative ladder: defaults, + topk_threshold_4wg, + kda_conv, + topk_scan_mm and
    # indexer_q_in_kernel (each rung's GPU tests passed)
    gt 80 tests/test_indexer.py "threshold_kernel_gpu and (8704 or 16896 or 1024)"
    gt 150 tests/test_decode.py "all_kernels_equals_stock and candidates"
    set -- '{"topk_threshold_4wg": true}' '{"topk_threshold_4wg": true, "kda_conv": true}' \
      '{"topk_threshold_4wg": true, "kda_conv": true, "topk_scan_mm": true, "indexer_q_in_kernel": true}'
    [ "$(left)" -gt 200 ] && rank1 s35a --q 1 --steps-per-call 4 --interleave --repeats 5 --policy '{}' "$@"
    ;;
  s34a)  # (nvidia-h200) what session 34 left unmeasured natively (its rebuilt kernels' and fixed references' GPU
    # tests), then the q = 1 A/B of the candidates (4 steps per call, 7 interleaved repeats; CANDIDATES overrides)
    gt 80 tests/test_router_kernel.py "concurrent_warpgroup or router_route_gpu"
    gt 60 tests/test_kda_decode.py "conv_kernel_matches_reference_gpu"
    gt 120 tests/test_indexer.py "threshold_kernel_gpu or rotating_queries"
    gt 60 tests/test_mhc.py "sum_raw_partials"
    if [ -n "${CANDIDATES:-}" ]; then eval "set -- $CANDIDATES"; else set -- '{"topk_threshold_4wg": true}' \
      '{"kda_conv": true}' '{"topk_scan_mm": true}' '{"mla_combine_kernel": true}'; fi
    [ "$(left)" -gt 200 ] && rank1 s34a --q 1 --steps-per-call 4 --interleave --repeats 7 --policy '{}' "$@"
    ;;
  s34b)  # (nvidia-h200) where the new defaults' step goes: q = 1 profiled with its kernel table (the 1,417 launches
    # and ~5.0 ms), then q = 4: the defaults vs router_route (sites at 2-4 token rows; ROUTE=0 leaves it out)
    [ "$(left)" -gt 200 ] && rank1 s34p --q 1 --steps-per-call 4 --profile --hlo-dir "$OUT/hlo" \
      ${POLICY:+--policy "$POLICY"} && kernel_tables 1
    if [ "${ROUTE:-1}" = 1 ]; then set -- '{"router_route": true}'; else set --; fi
    [ "$(left)" -gt 150 ] && rank1 s34q4 --q 4 --steps-per-call 4 --interleave --repeats 5 --policy '{}' "$@"
    ;;
  s34c)  # (nvidia-h200) auto vs latency_specialized at 4 steps per call (issue #9's 2x: auto was last measured at
    # one step per call), then the defaults with xla_allow_excess_precision=false (bf16 intermediates rounded)
    [ "$(left)" -gt 200 ] && timeout $(( $(left) - 5 )) python3 benchmarks/bench_decode.py --geometry tp4-rank \
      --batch 1 --q 1 --context 32768 --steps 20 --repeats 3 --fast-compile --budget-s $(( $(left) - 100 )) \
      --backend auto latency_specialized --steps-per-call 4 --interleave --compile-cache .jax_cache \
      --out "$OUT/decode_s34auto.jsonl" 2>&1 | grep -v -i -E "warn|^\s*$" >> "$OUT/bench_decode_s34auto.log"
    [ "$(left)" -gt 200 ] && rank1 s34x --q 1 --steps-per-call 4 --repeats 5 \
      --xla-option xla_allow_excess_precision=false
    ;;
  s33a)  # (nvidia-h200) every kernel built since session 31 natively, the A/B's first candidates first, each with its
    # own timeout (-k 9: a grid barrier that never opened cannot hold the call): the one-launch mHC boundary
    # (mhc_grid_barrier) and a PDL chain (pdl), the sparse MLA's merge forms (mla_combine_*), the 4-warpgroup
    # threshold kernel and the rotating index queries, router_route; then bench_pdl (PDL inside the CUDA graph?);
    # then the KDA kernel's tests (token loop, approx math, the conv inside: issue #6's default), the finish /
    # Sinkhorn summing raw partials (mhc_fused_sums); bench_topk and bench_mhc with what is left
    gt 150 tests/test_mhc.py "post_finish or pdl_chain"
    gt 120 tests/test_sparse_mla.py "combine_forms"
    gt 150 tests/test_indexer.py "rotating or threshold_kernel_gpu and (False-4 or False-2)"
    gt 100 tests/test_router_kernel.py "router_route"
    pdl_probe
    gt 200 tests/test_kda_decode.py ""
    gt 120 tests/test_mhc.py "sum_raw_partials"
    [ "$(left)" -gt 100 ] && timeout -k 9 60 python3 benchmarks/bench_topk.py --rows 1,4 --pools 8256 \
      --only "kernel scan128,kernel wg4 scan128,kernel2 scan128,kernel2 wg4 scan128" --out "$OUT/bench_topk.log" \
      > /dev/null 2>&1
    [ "$(left)" -gt 100 ] && timeout -k 9 -s INT 90 python3 benchmarks/bench_mhc.py --rows 1,4 \
      --paths narrow,sums,grid > "$OUT/bench_mhc.log" 2>&1
    ;;
  s33b)  # (nvidia-h200) the step A/B at q = 1, 4 steps per call, 7 interleaved repeats (~5 configurations fit one
    # call: split a longer list over two calls): defaults, each candidate
    # alone (those whose GPU tests s33a passed: set CANDIDATES to their policies), then q = 4 with ALL_ON (the
    # winners and the q >= 2 candidates, e.g. router_route: at q = 1 it has no site and an explicit knob without
    # one is refused)
    # (CANDIDATES: shell words, e.g. CANDIDATES="'{\"mhc_fused_sums\": true}' '{\"topk_scan_mm\": true}'")
    # (the default list: the largest expected effects first — the A/B stops starting configurations at the budget)
    if [ -n "${CANDIDATES:-}" ]; then eval "set -- $CANDIDATES"; else set -- '{"mhc_grid_barrier": true}' \
      '{"pdl": true}' '{"mla_combine_fused": true}' '{"topk_threshold_4wg": true}' '{"mhc_fused_sums": true}' \
      '{"kda_token_loop": true, "kda_approx_math": true, "kda_conv": true}' '{"indexer_q_in_kernel": true}' \
      '{"topk_scan_mm": true}'; fi
    rank1 s33b --q 1 --steps-per-call 4 --interleave --repeats 7 --policy '{}' "$@"
    [ "$(left)" -gt 200 ] && [ -n "${ALL_ON:-}" ] && rank1 s33c --q 4 --steps-per-call 4 --interleave --repeats 7 \
      --policy '{}' "$ALL_ON"
    ;;
  s33c)  # (nvidia-h200) the end-to-end GPU tests that gate the KDA defaults (token loop + approx math, the conv
    # inside: the all-kernels and KDA greedy tests), then q = 1 with the new defaults profiled (kernel table)
    timeout -s INT 330 python3 -m pytest -q -m "gpu or e2e_kernels" -p no:cacheprovider tests/test_decode.py \
      -k "all_kernels_equals_stock or kda_kernel_equals_reference_greedy and True-True or kda_conv_in_the_kernel" \
      --durations=4 2>&1 | grep -E "passed|failed|FAILED|^E  |Interrupt|s call" | head -20 | tee -a "$OUT/gpu_tests.log"
    [ "$(left)" -gt 200 ] && rank1 s33p --q 1 --steps-per-call 4 --profile --hlo-dir "$OUT/hlo" \
      ${POLICY:+--policy "$POLICY"} && kernel_tables 1
    [ "$(left)" -gt 100 ] && timeout -k 9 -s INT 90 python3 benchmarks/bench_sparse_mla.py --only combine \
      --out "$OUT/bench_sparse_mla_combine.log" > /dev/null 2>&1
    # auto vs latency_specialized at 4 steps per call (issue #9's 2x; auto was last measured at one per call)
    [ "$(left)" -gt 200 ] && timeout $(( $(left) - 5 )) python3 benchmarks/bench_decode.py --geometry tp4-rank \
      --batch 1 --q 1 --context 32768 --steps 20 --repeats 3 --fast-compile --budget-s $(( $(left) - 100 )) \
      --backend auto latency_specialized --steps-per-call 4 --interleave --compile-cache .jax_cache \
      ${POLICY:+--policy "$POLICY"} --out "$OUT/decode_s33q.jsonl" 2>&1 | grep -v -i -E "warn|^\s*$" \
      >> "$OUT/bench_decode_s33q.log"
    ;;
  s32f)  # (nvidia-h200) session 32's candidates natively before they become defaults: the KDA kernel's GPU tests
    # (the token loop, alone and with approx math, has never run natively; bench_kda_decode times, it does not
    # compare), every kernel family end to end vs the stock path with the session-32 defaults (threshold kernel at
    # one row, mhc_narrow), the KDA greedy test with the token loop + approx math (session 32's first try: 150 s was
    # too short for these two compiles)
    # (the short conv inside the KDA kernel, kda_conv, too: its kernel GPU tests and a greedy case); the kernel
    # tests first (cheap), the end-to-end tests in what is left, bench_mhc last
    timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kda_decode.py 2>&1 \
      | grep -E "passed|failed|FAILED|^E  " | head -20 | tee -a "$OUT/gpu_tests.log"
    # the mHC finish / Sinkhorn summing the raw partials (mhc_fused_sums)
    timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_mhc.py -k "sum_raw_partials" 2>&1 \
      | grep -E "passed|failed|FAILED|^E  " | head -20 | tee -a "$OUT/gpu_tests.log"
    # the index queries rotated in the scores kernel (indexer_q_in_kernel)
    timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_indexer.py -k "rotating" 2>&1 \
      | grep -E "passed|failed|FAILED|^E  " | head -20 | tee -a "$OUT/gpu_tests.log"
    timeout -s INT $(( $(left) > 420 ? 400 : $(left) - 20 )) python3 -m pytest -q -m "gpu or e2e_kernels" \
      -p no:cacheprovider tests/test_decode.py \
      -k "all_kernels_equals_stock or kda_kernel_equals_reference_greedy and True-True or kda_conv_in_the_kernel" \
      --durations=4 2>&1 | grep -E "passed|failed|FAILED|^E  |Interrupt|s call" | head -20 | tee -a "$OUT/gpu_tests.log"
    [ "$(left)" -gt 60 ] && timeout -s INT $(( $(left) - 10 )) python3 benchmarks/bench_mhc.py --rows 1,4 \
      --paths fused,narrow,sums > "$OUT/bench_mhc.log" 2>&1
    ;;
  s32g)  # (nvidia-h200) the step A/Bs of session 32's KDA candidates (if s32f passed), then q = 4 +- mhc_narrow
    # (on by default since session 32 at every M; measured at q = 1 only) and bench_kda_decode --q4 (conv rows first)
    rank1 s32g --q 1 --steps-per-call 4 --interleave --repeats 7 --policy '{}' \
      '{"kda_token_loop": true, "kda_approx_math": true}' \
      '{"kda_token_loop": true, "kda_approx_math": true, "kda_conv": true}' '{"mhc_fused_sums": true}' \
      '{"indexer_q_in_kernel": true}' '{"topk_scan_mm": true}'
    [ "$(left)" -gt 200 ] && rank1 s32h --q 4 --steps-per-call 4 --interleave --repeats 7 --policy '{}' \
      '{"kda_token_loop": true, "kda_approx_math": true, "kda_conv": true, "mhc_fused_sums": true,
        "indexer_q_in_kernel": true, "topk_scan_mm": true}' '{"mhc_narrow": false}'
    [ "$(left)" -gt 60 ] && timeout $(( $(left) - 10 )) python3 benchmarks/bench_kda_decode.py --q4 \
      --budget_s $(( $(left) - 40 )) > "$OUT/bench_kda_q4.log" 2>&1
    # the code-size hypothesis on a synthetic kernel (session 32's s32 run lost it to the 90 s timeout: the log is
    # now written row by row)
    [ "$(left)" -gt 60 ] && timeout $(( $(left) - 10 )) python3 benchmarks/bench_code_size.py \
      --out "$OUT/bench_code_size.log" > /dev/null 2>&1
    ;;
  s32p)  # (nvidia-h200) q = 1 at 4 steps per call with the session-32 defaults (mhc_narrow, the threshold kernel
    # at one row), profiled and traced with its kernel table and listing: session 29's table had mhc_finish at 8.4 us
    # in the step vs 2.5 alone — which kernels run beside it; then auto vs latency_specialized (issue #9's 2x)
    rank1 s32p --q 1 --steps-per-call 4 --profile --hlo-dir "$OUT/hlo" && kernel_tables 1
    [ "$(left)" -gt 200 ] && timeout $(( $(left) - 5 )) python3 benchmarks/bench_decode.py --geometry tp4-rank \
      --batch 1 --q 1 --context 32768 --steps 20 --repeats 3 --fast-compile --budget-s $(( $(left) - 100 )) \
      --backend auto latency_specialized --steps-per-call 4 --interleave --compile-cache .jax_cache \
      --out "$OUT/decode_s32q.jsonl" 2>&1 | grep -v -i -E "warn|^\s*$" >> "$OUT/bench_decode_s32q.log"
    # the compaction's prefix sums as a matmul (topk_scan_mm) vs XLA's reduce-window, alone
    [ "$(left)" -gt 60 ] && timeout $(( $(left) - 10 )) python3 benchmarks/bench_topk.py --rows 1,4 --pools 8256 \
      --only "radix scan128,radix scan mm128,kernel scan128,kernel scan mm128" --out "$OUT/bench_topk.log" \
      > /dev/null 2>&1
    ;;
  s32d)  # (nvidia-h200) what s32b ran out of time for: mhc_narrow's GPU tests (the 32 / 64-column CTAs natively;
    # s32b's run of all 13 kernel tests passed its 120 s timeout), q = 1 at 4 steps per call with the threshold
    # kernel at one row (s32b: 5.68 -> 5.46 ms) +- mhc_narrow, then q = 4 +- the KDA token loop with approx math
    timeout -s INT 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_mhc.py \
      -k "kernels_gpu and (cols9 or cols10 or cols11 or cols12)" > /tmp/t_n.log 2>&1
    grep -E "passed|failed|FAILED|^E  |Interrupt" /tmp/t_n.log | head -20 | tee -a "$OUT/gpu_tests.log"
    NARROW=""
    grep -q " passed" /tmp/t_n.log && ! grep -q -E "failed|Interrupt" /tmp/t_n.log \
      && NARROW='{"topk_threshold":true,"mhc_narrow":true}'
    rank1 s32d --q 1 --steps-per-call 4 --interleave --repeats 7 --policy '{"topk_threshold": true}' $NARROW
    [ "$(left)" -gt 150 ] && rank1 s32e --q 4 --steps-per-call 4 --interleave --repeats 7 --policy '{}' \
      '{"kda_token_loop": true, "kda_approx_math": true}'
    ;;
  s32b)  # (nvidia-h200) the loop forms inside the step, q = 1 at 4 steps per call, interleaved: defaults, the
    # rolled threshold kernel (1 / 2 bits) at one score row, the KDA token loop with approx math (s32: 4.74-4.81
    # vs 5.86 us at q = 4), mhc_narrow (s32: boundary chain 24.1 -> 20.8 us alone); then q = 4 with the KDA forms.
    # (The rolled one-launch boundary measured 33.8 us alone vs 15.3 for the fused path in s32: not in the A/B.)
    # First the mHC kernels' GPU tests (mhc_narrow's 32 / 64-column CTAs natively: new swizzle and TMA boxes)
    timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_mhc.py -k "kernels_gpu" 2>&1 \
      | grep -E "passed|failed|FAILED|^E  " | head -20 | tee -a "$OUT/gpu_tests.log"
    rank1 s32b --q 1 --steps-per-call 4 --interleave --repeats 7 --policy '{}' '{"topk_threshold": true}' \
      '{"topk_threshold": true, "topk_threshold_2bit": true}' '{"kda_token_loop": true, "kda_approx_math": true}' \
      '{"mhc_narrow": true}'
    # (7 repeats each: a repeat costs ~0.4 s, a configuration's compile ~40 s; session 31's 3 spread 0.2-0.8 ms)
    [ "$(left)" -gt 200 ] && rank1 s32c --q 4 --steps-per-call 4 --interleave --repeats 7 --policy '{}' \
      '{"kda_token_loop": true, "kda_approx_math": true}' '{"kda_token_loop": true}'
    ;;
  s31)  # (nvidia-h200) the one-launch boundary's GPU tests one at a time (session 30: M = 1, 4, 8 passed, M = 64 ran
    # into the 150 s timeout: a hang or a slow compile?), each timed, a traceback of every thread after 100 s;
    # then q = 1 at 4 steps per call: kda_norm (session 30: -0.26 ms) vs the defaults vs + the boundary if it passed
    for t in "test_boundary_gpu[64-False]" "test_trunk_with_fused_boundaries_as_accurate_as_stock"; do
      s=$(date +%s)
      timeout -s INT 140 python3 -m pytest -q -m "gpu or e2e_kernels" -p no:cacheprovider -o faulthandler_timeout=100 \
        "tests/test_mhc.py::$t" > /tmp/t_b.log 2>&1
      echo "== $t: $(( $(date +%s) - s )) s: $(grep -E 'passed|failed|Interrupt' /tmp/t_b.log | tail -1)" \
        | tee -a "$OUT/gpu_tests.log"
      grep -v -E "^\s*$" /tmp/t_b.log | tail -120 >> "$OUT/t_boundary.log"
    done
    BOUNDARY=""
    grep -q "trunk.*passed" "$OUT/gpu_tests.log" && BOUNDARY='{"kda_norm":true,"mhc_boundary":true}'
    rank1 s31 --q 1 --steps-per-call 4 --interleave --policy '{"kda_norm": true}' '{}' $BOUNDARY
    ;;
  s31b)  # (nvidia-h200) session 31: the one-launch boundary passed its GPU tests but made the q = 1 step 5.78 ->
    # 18.04 ms (~135 us per boundary): the kernel alone (bench_mhc: slow kernel or slow cluster scheduling?), then
    # q = 4 at 4 steps per call (the product's mode), kda_norm vs defaults interleaved
    timeout -s INT 150 python3 benchmarks/bench_mhc.py --rows 1,4 > "$OUT/bench_mhc.log" 2>&1
    rank1 s31b --q 4 --steps-per-call 4 --interleave --policy '{"kda_norm": true}' '{}'
    ;;
  s30)  # (nvidia-h200) the kernel knobs again where the GPU, not the host, sets the pace: 4 steps per call (session
    # 29: 7.57 -> 5.31 ms per step at q = 1, the host returning after ~2 ms/step). Knobs decided while the step
    # was host-bound (the threshold kernel at one score row, kda_norm, the split Sinkhorn) may flip: fewer launches
    # count now. First the 2-bit threshold kernel's GPU tests
    timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_indexer.py -k threshold 2>&1 \
      | grep -E "passed|failed|FAILED|^E  " | head -20 | tee -a "$OUT/gpu_tests.log"
    # the one-launch boundary (a cluster of 8 CTAs meeting at a cluster barrier): its GPU tests first, with a
    # traceback if they hang; the step A/B includes it only if they passed
    timeout -s INT 150 python3 -m pytest -q -m "gpu or e2e_kernels" -p no:cacheprovider tests/test_mhc.py \
      -k "boundary or trunk" > /tmp/t_boundary.log 2>&1
    grep -E "passed|failed|FAILED|^E  |Interrupt" /tmp/t_boundary.log | head -20 | tee -a "$OUT/gpu_tests.log"
    BOUNDARY=""
    grep -q " passed" /tmp/t_boundary.log && ! grep -q -E "failed|Interrupt" /tmp/t_boundary.log \
      && BOUNDARY='{"mhc_boundary":true}'  # (no space: one word unquoted)
    rank1 s30 --q 1 --steps-per-call 4 --interleave --policy '{}' $BOUNDARY \
      '{"topk_threshold": true}' '{"topk_threshold": true, "topk_threshold_2bit": true}' '{"kda_norm": true}' \
      '{"kda_approx_math": true}' '{"mhc_sinkhorn_split": false}'
    ;;
  s30b)  # (nvidia-h200) q = 4 (k = 3 drafts, the product's mode) at 1 vs 4 steps per call, with and without the
    # 2-bit threshold kernel, interleaved; then the best at q = 1 profiled with its kernel table and listing
    rank1 s30b --q 4 --steps-per-call 1 4 --interleave --policy '{}' '{"topk_threshold_2bit": true}'
    [ "$(left)" -gt 150 ] && rank1 s30p --q 1 --steps-per-call 4 --profile --hlo-dir "$OUT/hlo" && kernel_tables 1
    ;;
  s30e)  # (nvidia-h200) issue #9's goal (latency_specialized >= 2x auto at B = 1, q = 1) on one host: auto and
    # latency_specialized at 1 and 4 steps per call, interleaved (the stock path gains from the loop too)
    timeout $(( $(left) - 5 )) python3 benchmarks/bench_decode.py --geometry tp4-rank --batch 1 --q 1 --context 32768 \
      --steps 20 --repeats 3 --fast-compile --budget-s $(( $(left) - 100 )) --backend auto latency_specialized \
      --steps-per-call 1 4 --interleave --compile-cache .jax_cache --out "$OUT/decode_s30e.jsonl" 2>&1 \
      | grep -v -i -E "warn|^\s*$" >> "$OUT/bench_decode_s30e.log"
    ;;
  s30d)  # (nvidia-h200) q = 4 at 4 steps per call profiled and traced, with its kernel table and listing (the
    # product's mode: which glue kernels the KDA / DSA / MoE layers launch at 4 token rows)
    rank1 s30d --q 4 --steps-per-call 4 --profile --hlo-dir "$OUT/hlo" && kernel_tables 4
    ;;
  s30c)  # (nvidia-h200) issue #6's last goal (<= 5 us per KDA layer at B = 1, q = 4: 5.75 in session 27): the
    # kernel's approximate-math and gates-first variants; then where 8 steps per call lost to 4 (session 29: 6.25
    # vs 5.31 ms per step, both GPU-bound): both traced (device busy / idle gaps per step)
    timeout 200 python3 benchmarks/bench_kda_decode.py --q4 --budget_s 150 > "$OUT/bench_kda_q4.log" 2>&1
    # one mHC boundary alone: stock vs the default kernels vs the one-launch cluster kernel (mhc_boundary)
    timeout -s INT 150 python3 benchmarks/bench_mhc.py --rows 1,4 > "$OUT/bench_mhc.log" 2>&1
    [ "$(left)" -gt 200 ] && rank1 s30t --q 1 --steps-per-call 4 8 --trace
    ;;
  s29d)  # (nvidia-h200) the loop's 500 hoisted parameter slices (session 29: XLA moves the packed parameters'
    # slices out of the loop, ~500 kernels per call): packed vs unpacked parameters at 4 and 8 steps per call,
    # interleaved; the same loop with XLA's loop-invariant code motion off; then q = 4 at 1 vs 4 steps per call
    rank1 s29d --q 1 --pack-params 65536 0 --steps-per-call 4 8 --interleave
    [ "$(left)" -gt 150 ] && rank1 s29e --q 1 --steps-per-call 4 \
      --xla-option xla_disable_hlo_passes=while-loop-invariant-code-motion
    [ "$(left)" -gt 150 ] && rank1 s29f --q 4 --steps-per-call 1 4 --interleave
    ;;
  s29b)  # (nvidia-h200) the threshold kernel with 2 bits per pass: its GPU tests, bench_topk against 1 bit and XLA,
    # the q = 4 step with it (policy topk_threshold_2bit) and B = 8 q = 4 (32 score rows)
    timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_indexer.py -k threshold 2>&1 \
      | grep -E "passed|failed|FAILED|^E  " | head -20 | tee -a "$OUT/gpu_tests.log"
    [ "$(left)" -gt 100 ] && timeout 120 python3 benchmarks/bench_topk.py --rows 1,4,32 --pools 8256,16448 \
      --only "radix scan128,kernel scan128,kernel2 scan128" --out "$OUT/bench_topk.log" > /dev/null 2>&1
    [ "$(left)" -gt 200 ] && rank1 s29b --q 4 --interleave --policy '{}' '{"topk_threshold_2bit": true}'
    [ "$(left)" -gt 200 ] && rank1 s29b --q 1 --interleave --policy '{}' '{"topk_threshold": true}' \
      '{"topk_threshold": true, "topk_threshold_2bit": true}'
    [ "$(left)" -gt 180 ] && rank1 s29b --q 4 --batch 8 --profile --policy '{"topk_threshold_2bit": true}'
    ;;
  s28c)  # (nvidia-h200) the threshold kernel from 2 score rows only (XLA's radix passes at one): q = 1 / 4 with
    # kernel tables (the memcpy candidates: copies and fusions that launched no kernel), then B = 8 q = 4 and
    # B = 32 q = 1 (32 score rows: the threshold kernel instead of XLA's sort)
    rank1 s28c --q 1 --profile --hlo-dir "$OUT/hlo"
    [ "$(left)" -gt 200 ] && rank1 s28c --q 4 --profile --hlo-dir "$OUT/hlo"
    kernel_tables 1 4
    [ "$(left)" -gt 150 ] && rank1 s28c --q 4 --batch 8 --profile
    [ "$(left)" -gt 150 ] && rank1 s28c --q 1 --batch 32 --profile
    ;;
  s28ab)  # (nvidia-h200) q = 1 regressed 4.50 -> 5.14 ms with session 27's kernels (host-bound): the fixed
    # wide-f GPU test, then on one machine the step now (copies listed), session 27's tree (.carry/s27tree =
    # `git archive 7283471`, carried) and now with the router / threshold kernels off
    timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kda_decode.py -k "wide_f" 2>&1 \
      | grep -E "passed|failed|FAILED|^E  " | head -20 | tee -a "$OUT/gpu_tests.log"
    rank1 new --q 1 --profile --hlo-dir "$OUT/hlo"
    kernel_tables 1
    [ -d .carry/s27tree ] && [ "$(left)" -gt 150 ] && (cd .carry/s27tree && timeout $(( $(left) - 5 )) python3 \
      benchmarks/bench_decode.py --geometry tp4-rank --batch 1 --context 32768 --steps 20 --repeats 3 --fast-compile \
      --backend latency_specialized --q 1 --profile --out "$OUT/decode_s27tree.jsonl" 2>&1 \
      | grep -v -i -E "warn|^\s*$" >> "$OUT/bench_decode_s27tree.log")
    [ "$(left)" -gt 150 ] && rank1 off --q 1 --profile --policy '{"topk_threshold": false, "router_kernel": false}'
    [ "$(left)" -gt 200 ] && rank1 batch28 --q 4 --batch 8 --profile
    ;;
  s28)  # (nvidia-h200) session 27's CPU work natively: the new kernels' GPU tests, the step at q = 1 / 4 (kernel
    # tables read here), bench_topk with the threshold kernel, then the e2e greedy test
    timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_indexer.py tests/test_router_kernel.py \
      tests/test_kda_decode.py tests/test_linear_kernels.py -k "threshold or route or wide or prefix" 2>&1 \
      | grep -E "passed|failed|FAILED|^E  " | head -20 | tee -a "$OUT/gpu_tests.log"
    rank1 s28 --q 1 --profile --hlo-dir "$OUT/hlo"
    [ "$(left)" -gt 200 ] && rank1 s28 --q 4 --profile --hlo-dir "$OUT/hlo"
    kernel_tables 1 4
    [ "$(left)" -gt 60 ] && timeout $(( $(left) - 5 )) python3 benchmarks/bench_topk.py --rows 1,4,32 \
      --pools 8256,16448 --only "top_k,radix scan128,kernel scan128" --out "$OUT/bench_topk.log" > /dev/null 2>&1
    [ "$(left)" -gt 120 ] && timeout $(( $(left) - 10 )) python3 -m pytest -q -m e2e_kernels -p no:cacheprovider \
      tests/test_decode.py 2>&1 | grep -E "passed|failed|FAILED|^E  " | head -20 | tee -a "$OUT/gpu_tests.log"
    # issue #6: the KDA kernel's variants at B = 1, T = 1 / 4 (approx_math new)
    [ "$(left)" -gt 60 ] && timeout $(( $(left) - 5 )) python3 benchmarks/bench_kda_decode.py --q4 \
      --budget_s $(( $(left) - 30 )) > "$OUT/bench_kda_q4.log" 2>&1
    ;;
  thr)  # (nvidia-h200) the top-k threshold kernel: its GPU tests, then bench_topk with it against the XLA forms
    timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_indexer.py -k threshold 2>&1 \
      | grep -E "passed|failed|FAILED|^E  " | head -20 | tee -a "$OUT/gpu_tests.log"
    [ "$(left)" -gt 40 ] && timeout $(( $(left) - 5 )) python3 benchmarks/bench_topk.py --rows 1,4,32 \
      --pools 8256,16448 --only "top_k,radix scan128,kernel scan128" --out "$OUT/bench_topk.log" 2>&1 \
      | grep -v -i warn | tail -20
    ;;
  s27b)  # (nvidia-h200) the q = 4 step with its kernel table (the pads gone?), then batch27's runs
    rank1 s27b --q 4 --profile --hlo-dir "$OUT/hlo"
    kernel_tables 4
    [ "$(left)" -gt 200 ] && rank1 s27b --q 4 --batch 8 --profile
    [ "$(left)" -gt 200 ] && rank1 s27b --q 1 --batch 32 --profile
    [ "$(left)" -gt 80 ] && timeout $(( $(left) - 5 )) python3 benchmarks/bench_kda_decode.py --quick \
      --budget_s $(( $(left) - 30 )) > "$OUT/bench_kda.log" 2>&1
    ;;
  batch27)  # (nvidia-h200) see the header
    rank1 batch27 --q 4 --batch 8 --profile
    [ "$(left)" -gt 200 ] && rank1 batch27 --q 1 --batch 32 --profile
    [ "$(left)" -gt 80 ] && timeout $(( $(left) - 5 )) python3 benchmarks/bench_kda_decode.py --quick \
      --budget_s $(( $(left) - 30 )) > "$OUT/bench_kda.log" 2>&1
    ;;
  s26)  # (nvidia-h200) see the header
    timeout 150 python3 benchmarks/bench_linear.py --rows 1,4 --only moedq --sweep-moe 1,4 --budget-s 120 \
      --out "$OUT/bench_linear_moe.txt" > "$OUT/bench_linear_moe.log" 2>&1
    rank1 s26 --q 1 --profile
    [ "$(left)" -gt 200 ] && rank1 s26 --q 1 --profile --policy '{"mhc_sinkhorn_split": true}'
    [ "$(left)" -gt 200 ] && rank1 s26 --q 4 --profile
    [ "$(left)" -gt 190 ] && rank1 s26 --q 1 --batch 8 --profile
    ;;
  s26b)  # (nvidia-h200) the new defaults (+ mhc_sinkhorn_split) at q = 4, then B = 8 q = 1 if time remains
    rank1 s26b --q 4 --profile
    [ "$(left)" -gt 150 ] && rank1 s26b --q 1 --batch 8 --profile
    ;;
  s25)  # (nvidia-h200) see the header
    for f in test_sparse_mla test_mhc; do
      timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider "tests/$f.py" 2>&1 \
        | grep -E "passed|failed|FAILED|^E  " | head -20 | sed "s/^/$f: /" | tee -a "$OUT/gpu_tests.log"
    done
    timeout 100 python3 benchmarks/bench_sparse_mla.py --quick --only mla --out "$OUT/bench_sparse_mla.txt" \
      > "$OUT/bench_sparse_mla.log" 2>&1
    timeout 80 python3 benchmarks/bench_mhc.py --rows 1,4 > "$OUT/bench_mhc.log" 2>&1
    rank1 s25 --q 1 --profile --hlo-dir "$OUT/hlo"  # every kernel + the HLO: benchmarks/kernel_table.py offline
    [ "$(left)" -gt 200 ] && rank1 s25 --q 4 --profile --hlo-dir "$OUT/hlo"
    ;;
  concurrent)  # (nvidia-h200) see the header
    timeout 300 python3 -m pytest -v -m gpu -p no:cacheprovider tests/test_decode.py -k concurrent 2>&1 \
      | grep -E "PASSED|FAILED|ERROR|passed|failed|^E  " | tee -a "$OUT/gpu_tests.log"
    for q in 1 4; do
      [ "$(left)" -gt 150 ] && rank1 concurrent --q $q --profile \
        --xla-option xla_gpu_command_buffer_scheduling_mode=CONCURRENT
    done
    # the Sinkhorn as its own kernel, off the sublayer's path (policy knob mhc_sinkhorn_split)
    [ "$(left)" -gt 150 ] && rank1 concurrent --q 1 --profile --policy '{"mhc_sinkhorn_split": true}' \
      --xla-option xla_gpu_command_buffer_scheduling_mode=CONCURRENT
    # the default schedule in this call, for the comparison (wall ms: GPU busy sums kernel durations, which
    # overlap under CONCURRENT)
    [ "$(left)" -gt 150 ] && rank1 concurrent --q 1
    ;;
  stepvlog)  # (nvidia-h200) does XLA re-record the real step's command buffer every execution? 4 real layers, q = 1
    TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3,command_executor=1 timeout $(( BUDGET - 5 )) \
      python3 benchmarks/bench_decode.py --geometry tp4-rank --layers 4 --batch 1 --q 1 --context 32768 --steps 10 \
      --repeats 1 --fast-compile --backend latency_specialized > /tmp/vlog.txt 2>&1
    { grep -E "ms/step|packed" /tmp/vlog.txt | grep -v -i warn | tail -3; echo "lines $(wc -l < /tmp/vlog.txt)";
      grep -i -E "command" /tmp/vlog.txt | sed -E 's/[0-9]+/N/g' | sort | uniq -c | sort -rn | head -25; } \
      > "$OUT/vlog_step.txt"
    ;;
  rest)  # (nvidia-h200) see the header
    timeout 200 python3 -m pytest -v -m e2e_kernels -p no:cacheprovider tests/test_decode.py -k fp8_dq 2>&1 \
      | grep -E "PASSED|FAILED|ERROR|passed|failed|^E  " | tee -a "$OUT/gpu_tests.log"
    timeout 100 python3 benchmarks/bench_kda_decode.py --q4 --budget_s 70 > "$OUT/bench_kda.log" 2>&1
    [ "$(left)" -gt 150 ] && rank1 auto --q 4 --backend auto --profile
    ;;
  dq)  # (nvidia-h200) see the header
    timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_linear_kernels.py -k "dq or shared_slot" 2>&1 \
      | grep -E "passed|failed|FAILED|^E  " | head -30 > "$OUT/gpu_tests.log"
    timeout 150 python3 benchmarks/bench_linear.py --only fp8,fp8dq,moe,moedq --rows 1,4,8 --budget-s 130 \
      --out "$OUT/bench_linear_dq.txt" > "$OUT/bench_linear_dq.log" 2>&1
    rank1 dq --q 1 --profile --policy '{"fp8_dq": true}'
    [ "$(left)" -gt 200 ] && rank1 dq --q 4 --profile --policy '{"fp8_dq": true}'
    [ "$(left)" -gt 120 ] && timeout $(( $(left) - 10 )) python3 -m pytest -v -m e2e_kernels -p no:cacheprovider \
      tests/test_decode.py -k fp8_dq 2>&1 | grep -E "PASSED|FAILED|ERROR|passed|failed|^E  " | tee -a "$OUT/gpu_tests.log"
    # the KDA kernel's q = 4 cost per token: its variants (gates_first, BV = 64) if time remains (issue #6)
    [ "$(left)" -gt 70 ] && timeout $(( $(left) - 5 )) python3 benchmarks/bench_kda_decode.py --q4 --budget_s 50 \
      > "$OUT/bench_kda.log" 2>&1
    ;;
  glue)  # (nvidia-h200) see the header
    timeout 60 python3 benchmarks/bench_linear.py --only moe --rows 1,4,8 --budget-s 40 \
      --out "$OUT/bench_linear_moe.txt" > "$OUT/bench_linear_moe.log" 2>&1
    rank1 glue --q 1 --profile
    [ "$(left)" -gt 25 ] && timeout $(( $(left) - 5 )) python3 benchmarks/bench_topk.py --rows 1,4 \
      --pools 8256,16448 --only "top_k,radix scan128,radix bits4 scan128" > "$OUT/bench_topk.log" 2>&1
    ;;
  rows)  # (nvidia-h200) see the header
    timeout 140 python3 benchmarks/bench_linear.py --only moe --rows 1,4,8,32,64 --budget-s 110 \
      --out "$OUT/bench_linear_moe.txt" > "$OUT/bench_linear_moe.log" 2>&1
    timeout 70 python3 benchmarks/bench_linear.py --only bf16 --rows 32,64 --budget-s 50 \
      --out "$OUT/bench_linear_bf16.txt" > "$OUT/bench_linear_bf16.log" 2>&1
    rank1 batch8 --batch 8 --q 1 --profile
    [ "$(left)" -gt 150 ] && rank1 kda_norm --q 1 --profile --policy '{"kda_norm": true}'
    ;;
  defaults)  # (nvidia-h200) see the header
    timeout 200 python3 benchmarks/bench_linear.py --rows 1,4,8,32,64 --budget-s 170 --out "$OUT/bench_linear.txt" \
      > "$OUT/bench_linear.log" 2>&1
    rank1 defaults --q 4 --profile
    [ "$(left)" -gt 200 ] && rank1 defaults --q 1 --profile
    # (session 23 ran {"bf16_linear": true} here: 6.32 vs 5.93 ms at q = 1) the gated norm inside the KDA kernel
    [ "$(left)" -gt 200 ] && rank1 defaults --q 1 --profile --policy '{"kda_norm": true}'
    [ "$(left)" -gt 230 ] && rank1 defaults --q 4 --profile --policy '{"kda_norm": true}'
    [ "$(left)" -gt 150 ] && timeout $(( $(left) - 15 )) python3 -m pytest -v -m e2e_kernels -p no:cacheprovider \
      tests/test_decode.py 2>&1 | grep -E "PASSED|FAILED|ERROR|passed|failed|^E  " | head -30 | tee -a "$OUT/gpu_tests.log"
    ;;
  mosaic)  # (nvidia-h200-x2) see the header
    (
      lb() { CUDA_VISIBLE_DEVICES=0 timeout $(( $(left) - 15 )) python3 benchmarks/bench_decode.py --geometry tp4-rank \
        --batch 1 --q 1 --context 32768 --steps 20 --repeats 3 --fast-compile --budget-s $(( $(left) - 150 )) \
        --out "$OUT/decode_mosaic.jsonl" "$@" 2>&1 | grep -v -i -E "warn|^\s*$" >> "$OUT/bench_decode_mosaic.log"; }
      echo "## default command buffers" >> "$OUT/bench_decode_mosaic.log"
      lb --backend latency_specialized
      echo "## XLA_FLAGS=--xla_gpu_enable_command_buffer=-CUSTOM_CALL" >> "$OUT/bench_decode_mosaic.log"
      [ "$(left)" -gt 200 ] && XLA_FLAGS="--xla_gpu_enable_command_buffer=-CUSTOM_CALL" lb --backend latency_specialized
    ) &
    (
      CUDA_VISIBLE_DEVICES=1 timeout 150 python3 benchmarks/bench_graph_launch.py --mosaic-every 0 7 \
        --out "$OUT/graph_launch.jsonl" > "$OUT/bench_launch.log" 2>&1
      echo "## custom calls out of the command buffers" >> "$OUT/bench_launch.log"
      XLA_FLAGS="--xla_gpu_enable_command_buffer=-CUSTOM_CALL" CUDA_VISIBLE_DEVICES=1 timeout 100 \
        python3 benchmarks/bench_graph_launch.py --mosaic-every 7 >> "$OUT/bench_launch.log" 2>&1
      CUDA_VISIBLE_DEVICES=1 timeout $(( $(left) - 20 )) python3 -m pytest -v -m e2e_kernels -p no:cacheprovider \
        tests/test_decode.py 2>&1 | grep -E "PASSED|FAILED|ERROR|passed|failed|^E  " | head -30 >> "$OUT/gpu_tests.log"
    ) &
    wait
    ;;
  *) echo "unknown mode $MODE (single | pair | tp2 | layers8 | cmdbuf | full | verify | trace | launch | mosaic | host | profile | topk | q4 | defaults | rows | glue | dq | batch | rest | hostflags | stepvlog | s25 | concurrent | hang | bisect)"; exit 2 ;;
esac
for f in "$OUT"/gpu_tests.log "$OUT"/bench_*.log "$OUT"/allreduce.log; do [ -f "$f" ] && { echo "=== $f"; grep -v -E "cuda_status|Source Location|^$|custom_call.cc" "$f" | tail -45; }; done
# the device tool returns at most 8 files (s39a lost its 9th): past 7, everything goes back as one archive
if [ "$(find "$OUT" -type f | wc -l)" -gt 8 ]; then
  (cd "$OUT" && tar czf /tmp/gpu_out.tgz . && find . -mindepth 1 -delete && mv /tmp/gpu_out.tgz ./gpu_out.tgz)
  echo "== more than 8 files: returned as gpu_out.tgz"
fi
echo "total $(( $(date +%s) - t0 )) s"
