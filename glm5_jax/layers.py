"""The sublayers of GLM-5.3-Flash as Flax NNX modules (the pure-JAX "stock" path).

Every module holds only parameters; caches travel as explicit pytrees (glm5_jax/state.py) so that the decode
step is a pure function of (params, state, tokens). All code here runs on ONE tensor-parallel shard inside
``jax.shard_map``: local sizes are read off the parameter shapes, and the row-parallel projections finish with
an explicit ``psum`` over the mesh axis ``TP``.

Parameters carry logical axis names (``axes=`` metadata); glm5_jax/sharding.py maps them to the mesh once.
Weights keep the checkpoint layout [out, in]; FP8 weights stay e4m3 with their 128×128 block scales and are
dequantised where they are used.

Shape alphabet: B batch, T new tokens, D hidden, N mHC streams, H heads, K key dim, V value dim, R kv_lora,
E experts, I intermediate, C conv channels, P pools.
"""

from __future__ import annotations

import contextlib
import functools
import math
import contextvars

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from glm5_jax.config import Glm5Config

TP = "tp"  # the mesh axis of tensor parallelism
HIGHEST = lax.Precision.HIGHEST

# Logical axis names (sharding.py maps them to the mesh).
VOCAB, EMBED, KDA_HD, KDA_H, MLA_HD, FFN = "vocab", "embed", "kda_heads_dim", "kda_heads", "mla_heads_dim", "ffn"


# The latency_specialized backend: which Pallas kernels replace XLA ops, fixed while a step is traced (the
# compiled step of each backend is cached under its own key, so the switch never leaks between programs).
_KERNELS: contextvars.ContextVar = contextvars.ContextVar("glm5_jax_kernels", default=None)
MAX_KERNEL_ROWS = 64  # the weight-streaming kernels take at most 64 token rows (decode); prefill stays in XLA


# (five knobs that each tied alone, turned on together after their joint A/B — each description ends with it)
_S43 = ("; with indexer_q_in_kernel, topk_keys_in_kernel, mla_combine_kernel, kda_conv and mhc_barrier_counters "
        "all on (session 43, s43c) the one-rank step at q = 1 4.25 -> 4.20 ms, faster in 4 of 4 paired rounds, "
        "1,375 -> 1,185 launches — on by default")

# (three prefill knobs adopted together after their joint A/B — each description ends with it)
_S78 = ("; with indexer_prefill, kda_handover and moe_prefill_rows all on (session 78, gpu_session.sh s78a: an H100, "
        "one TP4 rank's first 32 layers, 512-token chunks, two repeats each after a full-length warm-up) a 4K prompt "
        "577.0 -> 525.9 ms to the first token and 32K 4,285 -> 3,994 ms, every repeat apart; the chunk's kernels "
        "(its trace) MoE 27.3 -> 26.5 ms, the indexer's 2.7 -> 0.7 ms + its FP8 GEMM (1.7 ms) gone, KDA 10.3 -> 9.0 "
        "ms; 3,786 -> 2,880 kernels a chunk — on by default")

# The kernel switches of a latency_specialized trace: {name: (default, what it switches and what was measured)}
# (``glm5-jax knobs`` prints them). A switch left at its default may still decline a call site where XLA measured
# faster (kernel_enabled's ``prefer``: the bf16 GEMV at one token row, the radix top-k where radix_topk_plan says
# no); a switch the policy sets explicitly runs wherever it fits.
KNOBS = {
    "kda": (True,
        "the KDA decode recurrence as a Mosaic kernel (pallas_kernels.kda_decode): the fp32 state of every "
        "verified token written to its slot, in place"),
    "fp8_linear": (True,
        "the FP8 128x128 block-scaled linears as Mosaic weight-streaming kernels (pallas_kernels.linear)"),
    "fp8_moe": (True,
        "the routed + shared experts as two Mosaic kernels (gate/up with the clamped SwiGLU, down) streaming "
        "only the selected experts' FP8 weights (linear.fp8_moe)"),
    "sparse_mla": (True,
        "the DSA layers' attention over the indexer-selected positions of the FP8 latent cache as a Mosaic "
        "kernel (pallas_kernels.sparse_mla; needs kv_cache_dtype 'fp8')"),
    "bf16_linear": (True,
        "the skinny bf16 GEMV (KDA and indexer projections, router logits, MTP eh_proj, lm_head): at one "
        "token row XLA's GEMV is as fast once the glue is counted (BENCHMARKS.md, weight streaming; forced "
        "there the step went 5.93 -> 6.32 ms), but at q = 4 XLA's gemm fusions of the KDA projections took 35 "
        "+ 16 + 8.5 + 8 µs per layer (1.4 TB/s; session 23): from 2 rows"),
    "indexer": (True,
        "the indexer's scores over the FP8 pooled-key cache as a Mosaic kernel "
        "(pallas_kernels.indexer.indexer_scores; needs kv_cache_dtype 'fp8')"),
    "indexer_pool_kernel": (True,
        "with an FP8 pool cache and a bf16 model: the indexer's per-call cache update — the keys' LayerNorm, the "
        "ring write, the softmax pooling of every completed pool, its Hadamard rotation, UE8M0 FP8 quantisation "
        "and the pool8 / pool_scale writes — as ONE Mosaic launch per DSA layer updating the caches in place "
        "(pallas_kernels.indexer.pool_update) instead of ~8 XLA kernels whose temporaries XLA's concurrent "
        "command buffer ordered behind the MLA latent's chain: the scores kernel waited ~12 µs per DSA layer "
        "for the pooled keys (session 45's trace). The one-rank step at q = 1 4.14 -> 3.98 ms, faster in 4 of 4 "
        "paired rounds, 1,185 -> 1,097 launches, the DSA layer 92.4 -> 77.9 µs (BENCHMARKS.md session 46) — on by "
        "default. At up to 16 token rows per sequence (pallas_kernels.indexer.POOL_MAX_TOKENS; session 46's kernel "
        "took <= 4: at 8 and 16 its gate scores went wrong natively — a Mosaic GPU strided-store bug found by "
        "session 47's probe and avoided since); longer calls (prefill chunks) run XLA's update"),
    "mhc": (True,
        "the fused mHC boundary (pallas_kernels/mhc.py): native on the H200 since 2026-11-30 (one TP4 rank, B "
        "= 1, q = 1: 20.4 -> 16.6 ms per step, 2,805 -> 2,492 launches)"),
    "router_topk": (True,
        "the MoE router's top-8 of 288 by counting ranks instead of a sort (topk_by_rank; exact, the same "
        "ties as lax.top_k): on the H200 the router is ~7.6 µs per MoE layer with it, logits included "
        "(BENCHMARKS.md sessions 20-21)"),
    "indexer_topk": (True,
        "the indexer's top-512 pools as a set without a sort (topk_set_by_threshold: radix selection + one "
        "prefix sum + a scatter; exact, lax.top_k's set and ties); by default only where it measured faster "
        "than XLA's sort (radix_topk_plan)"),
    "mhc_finish": (True,
        "with mhc on: the boundary's last step (pre, post, 1/RMS from the summed partials, then x_in = "
        "RMSNorm(Σ pre_i X'_i)) as the Mosaic finish kernel (on) or as XLA fusions (off: 90 fewer Mosaic "
        "calls per step — each costs ~12.7 µs of host time inside the CUDA graph, BENCHMARKS.md session 19 — "
        "for more GPU time)"),
    "kda_norm": (False,
        "with kda on: the KDA output's gated RMSNorm inside the kernel (all 4 warpgroups of a head in one "
        "CTA, so 4x fewer CTAs stream the state) instead of an XLA fusion after it; measured slower (kernel "
        "3.2 -> 5.5 µs per layer, the step 5.65 -> 5.68 ms; BENCHMARKS.md session 24); again with session "
        "51's defaults 3.73 -> 3.77 ms at q = 1 (1 of 4 paired rounds faster, s51a)"),
    "kda_norm_partials": (True,
        "with kda on (not kda_norm): each KDA CTA also returns the sum of its o columns' squares "
        "(kda_decode(norm_partials=True): [B, T, H, 128 / block_v]), so the gated RMSNorm after the kernel is "
        "elementwise (kda_decode.gated_norm_from_partials: mean(o²) from the partials by explicit adds) and XLA "
        "can fuse it into the o_proj GEMV — in s50b's trace the norm was a fusion of its own on every KDA layer's "
        "chain (1.4 µs + a launch gap, x 34), between the KDA kernel and o_proj. kda_norm, the norm inside the "
        "kernel, needs a head's 4 warpgroups in one CTA and was slower (sessions 24, 51). Equal within f32 "
        "rounding (the squares summed in another order). Measured (s52c, q = 1): 3.86 -> 3.85 ms, faster in 4 of 4 "
        "paired rounds, 34 launches fewer; its GPU test passed natively in session 55: on by default since then"),
    "kda_approx_math": (True,
        "with kda on: the KDA kernel's gates and l2 norms with the GPU's approximate exp / reciprocal / rsqrt "
        "(KdaDecodeConfig(approx_math=True); within the kernel tolerance of the reference, its GPU tests). "
        "With kda_token_loop, issue #6's B = 1 q = 4 kernel 5.86 -> 4.74-4.81 µs (5.17 with the loop alone); "
        "the one-rank step at q = 4, 4 steps per call 8.68 -> 8.57 ms (BENCHMARKS.md session 32). On since "
        "session 34: its GPU tests (alone and with the token loop) and the kernel-tiny greedy test with both "
        "pass natively"),
    "kda_token_loop": (True,
        "with kda on: the KDA kernel's tokens as a loop carrying the state instead of unrolled "
        "(KdaDecodeConfig(token_loop=True): one copy of the per-token code, 95 vs 238 KB of MLIR at q = 4) — "
        "unrolled straight-line code runs once per CTA, every instruction a cold fetch (the suspect of "
        "session 31's slow unrolled kernels): the B = 1 q = 4 kernel 5.86 -> 5.17 µs alone, 4.74-4.81 with "
        "kda_approx_math (bench_kda_decode --q4, session 32). On since session 34: its GPU tests (q = 4 and 8, "
        "f32 / bf16, with approx math), the kernel-tiny greedy test and the all-kernels == stock test pass "
        "natively"),
    "kda_conv": (True,
        "with kda on: the short conv + SiLU of q / k / v inside the KDA kernel (kda_decode_conv: each CTA "
        "convolves its head's rows from one SMEM window of Kc - 1 history rows + the T new ones) instead of "
        "the XLA fusion between the qkv projection and the kernel (~2 µs + one launch per KDA layer, session "
        "29's profile). Natively equal to its reference (f32 and bf16, the reference compiled without XLA's "
        "excess precision; session 35); in the step 33 fewer launches but no measurable gain at q = 1 (4.78 "
        "vs 4.95 ms with topk_threshold_4wg, defaults 4.75; 5 interleaved repeats, session 35) — the conv "
        "fusion runs beside the f_a -> f_b projections, likely off the critical path (profiling."
        "critical_paths to check) — off. Again a tie where the chain by GPU time passes through the conv fusion "
        "(4.20 vs 4.20 ms, 33 launches fewer; session 42, s42c)" + _S43),
    "fp8_dq": (True,
        "with fp8_linear / fp8_moe on: each FP8 weight tile dequantised to bf16 in registers and bf16 "
        "activations (fp8_dq_linear, fp8_moe(dq=True)): no amax + hi/lo quantisation kernels before each "
        "call, exact products. The kernel alone is ~0.5 µs slower (the convert), the call faster at every "
        "real shape and M = 1..8 (q_a 7.0 -> 6.5 µs, kv_a 7.2 -> 4.6, MoE at M = 1 25.4 -> 23.2); the step "
        "5.41 -> 5.37 ms GPU busy at q = 1 (157 fewer launches), 9.08 -> 8.71 ms at q = 4 (BENCHMARKS.md "
        "session 25)"),
    "mhc_sinkhorn_split": (True,
        "with mhc_finish on: the mix (post + the Sinkhorn's 20 serial iterations, read only by the next "
        "boundary) as a one-CTA kernel of its own (mhc_sinkhorn) instead of the finish kernel's extra CTA, "
        "whose tail the sublayer waits for (finish 2.5 µs alone without it, 5.2 with). Under the CONCURRENT "
        "command-buffer schedule (the Decoder's GPU default) the Sinkhorn overlaps the sublayer: one TP4 "
        "rank, B = 1, q = 1 5.16 -> 4.56 ms per step on the H200 (BENCHMARKS.md session 26). Under the serial "
        "schedule it would be one more launch per boundary"),
    "topk_threshold": (True,
        "with indexer_topk on: the selection's threshold (the k-th largest key and how many keys exceed it) "
        "as one Mosaic kernel (pallas_kernels.indexer.topk_threshold, a CTA per score row) instead of the XLA "
        "radix passes (~13 small kernels per call); with it the radix selection replaces XLA's sort at every "
        "size the kernel holds (rows of up to 17,408 pools)"),
    "topk_threshold_2bit": (False,
        "with topk_threshold: 2 bits of the threshold per pass (16 dependent rounds of 3 candidates' counts "
        "instead of 32 of one; pallas_kernels.indexer._threshold_kernel): alone 21.6 -> 19.8 µs at one row, "
        "but in the step at q = 1 5.46 vs 5.53 ms (noise; session 32) — off. Since session 53 also the fused "
        "compaction's passes (topk_compact(t=None, digit_bits=2): every CTA of the row), where the default "
        "selection's one-bit passes sit on each DSA layer's chain (s51b's trace: the selection 12.3 µs, ~20 "
        "dependent warpgroup reductions before the early exit): two bits a pass, the pass's two counts summed per "
        "warp and exchanged through SMEM behind one barrier (indexer._threshold_passes_split) — half the rounds. "
        "Measured in s57b (session 58: one TP4 rank, B = 1, q = 1, 5 interleaved repeats, defaults 3.65 ms): 3.70 "
        "ms, +0.03 ms, faster in 1 of 4 paired rounds — off"),
    "topk_threshold_exit": (True,
        "with topk_threshold: the threshold kernel's passes stop at the first candidate with exactly k keys at "
        "or above it (pallas_kernels.indexer.topk_threshold early_exit=True: the same selection, the threshold "
        "then one below that candidate). The kernel ran 13.9 µs on the DSA layer's chain at q = 1 "
        "(32 dependent passes), 8.9 with the exit; alone 17.6 -> 14.1 µs (bench_topk, one row of 8,704 f32 "
        "scores); the q = 1 step 4.19 -> 4.14 and 4.36 -> 4.32 ms, faster in 8 of 8 paired rounds over two "
        "machine starts (session 45) — on"),
    "router_kernel": (True,
        "the MoE router after its logits — sigmoid, bias, top-k in lax.top_k's order, the selected weights "
        "normalised and scaled — as one Mosaic kernel (pallas_kernels.router) instead of three XLA kernels on "
        "the critical path (the keys, topk_by_rank's rank count and select)"),
    "dq_f16": (True,
        "with fp8_dq on: the dq kernels (fp8_dq_linear, fp8_moe) in f16 instead of bf16 — "
        "each e4m3 weight element converted by one cvt per two values (e4m3x2 -> f16x2) instead of e4m3 -> f32 -> "
        "bf16, x and h in f16 (x's bf16 values are exact in f16 while |x| < 65,504; h gains 3 bits). Session 40's "
        "in-kernel profile (first calls): the dequantise-and-multiply is ~40 % of a gate/up CTA's time and bounded "
        "the (since removed) persistent MoE's gate/up phase. Measured (session 41, s40e): its multiply 14.2 -> 11.8 "
        "µs per warpgroup, the q = 1 step 4.30 -> 4.28 ms (a tie); session 51 (s51b) with dsa_qkv_a_first: "
        "3.77 -> 3.69 ms, faster in 3 of 4 paired rounds (-0.05 ms) — 3 of 4 on both occasions, but f16 "
        "activations overflowed to inf above 65,504 where bf16 does not. Since session 51 every f16 activation "
        "conversion (x, h; pallas_kernels.linear._act) saturates at ±65,504 instead (CPU-built: its GPU test "
        "and a third measurement next) — off until then. Session 56 (benchmarks/step_census.py): those conversions "
        "were XLA kernels of their own, 67 per q = 1 step, 25 on its critical path (932 launches vs 865) — now the "
        "one-row mHC boundary and the W_UV kernel write their outputs in f16 as well (mhc_row_boundary(x16), "
        "mla_absorb_uv(x16)), which the FP8 kernels read: 865 launches, the defaults' critical path. Its GPU tests "
        "pass natively (s57a: the saturation bound, the boundary's and W_UV's f16 copies, the model site bit for "
        "bit); s57b (session 58: one TP4 rank, B = 1, q = 1, 5 interleaved repeats, defaults 3.65 ms): 3.65 ms, "
        "-0.03 ms, faster in 3 of 4 paired rounds — the third time 3 of 4: on by default "
        "since session 58"),
    "moe_router_in_kernel": (True,
        "with fp8_moe and router_kernel on, at one token row (fp8_moe's own form): the router's selection "
        "(pallas_kernels.router's top-k in lax.top_k's order, weights normalised and scaled) inside every CTA of "
        "the MoE's gate/up kernel before its first weight request (pallas_kernels.linear.fp8_moe(router=...)), "
        "instead of the router_topk launch between the logits and the MoE (5.3 µs per MoE layer on the q = 1 "
        "chain, session 40's profile) for a selection each CTA repeats. Equal ids, weights and output natively "
        "(unit and end-to-end GPU tests); the one-rank step at q = 1 4.28 -> 4.20 ms, faster in 4 of 4 paired "
        "rounds, 42 fewer launches (session 41)"),
    "moe_router_ranks": (True,
        "with moe_router_in_kernel: one gate/up CTA selects all k experts with their weights (and stores them); "
        "every other CTA only the ranks up to its own slot's, two reductions a round (pallas_kernels.linear."
        "_router_in_kernel) — the selection delayed each CTA's first weight request by ~4.8 µs (gate/up 13.9 -> "
        "18.7 µs per call, session 41's profile); a routed CTA of rank r then waits r + 1 rounds of 2 instead of k "
        "rounds of 3. Natively equal (its GPU tests, bf16); the one-rank step at q = 1 4.30 -> 4.19 ms, faster in 4 "
        "of 4 paired rounds (session 42, s42a)"),
    "moe_route": (True,
        "with fp8_moe on, at 2+ token rows: the MoE's slot tables (the distinct experts, the [slot, token] "
        "weights, the shared expert's slot) as one Mosaic launch (linear.moe_route) instead of ~7 small XLA "
        "kernels per MoE layer on the critical path (q = 4, session 27)"),
    "router_route": (True,
        "with fp8_moe, moe_route and router_kernel on, at 2-4 token rows: the router kernel builds "
        "moe_route's slot tables itself (pallas_kernels.router.router_route: one warpgroup, a warp per row, then "
        "the tables from the rows in SMEM) — one launch instead of two on the MoE layer's critical path (q = 4: ~4 "
        "µs each, session 28's profile). Its first form (a warpgroup per row) was wrong natively — the "
        "warpgroups' reductions shared Mosaic's one cross-warp SMEM scratch (session 34); the warp-per-row form "
        "passes its GPU tests natively, and the one-rank step at q = 4, 4 steps per call: 8.72 -> 8.32 ms (43 "
        "fewer launches; BENCHMARKS.md session 35)"),
    "mhc_narrow": (True,
        "with mhc on: mhc_post_pre over 32 columns per CTA (128 CTAs) and mhc_finish over 64 (64 CTAs) "
        "instead of 64 / 128: at M = 1 both run 64-row tiles for one real row; twice the CTAs halve each "
        "thread's floating-point work. The boundary chain alone 24.1 -> 20.8 µs at M = 1; the one-rank step "
        "at q = 1, 4 steps per call 5.27 -> 4.83 ms (7 interleaved repeats; BENCHMARKS.md session 32)"),
    "mhc_fused_sums": (False,
        "with mhc_finish on, at up to 4 token rows: mhc_finish and mhc_sinkhorn take mhc_post_pre's raw "
        "partials [G, 64, 40] and sum them in SMEM (pallas_kernels.mhc PARTS_MAX_ROWS) instead of an XLA "
        "reduction between the kernels — one launch fewer on the sublayer's critical path per boundary (~2 µs "
        "+ a dependent launch, session 29's profile); off until measured"),
    "mhc_grid_barrier": (True,
        "with mhc_finish and mhc_sinkhorn_split on, at up to 4 token rows: each mHC boundary as ONE launch of "
        "mhc_narrow's 128 CTAs with a grid barrier between mhc_post_pre's half and mhc_finish's "
        "(pallas_kernels.mhc.mhc_post_finish: a GMEM semaphore; the partials summed from L2, X' kept in SMEM) "
        "— one launch on the sublayer's critical path instead of two or three; the Sinkhorn stays a kernel of "
        "its own on the raw partials. Natively bit-identical to its two-launch form (GPU tests, session 34); "
        "the one-rank step at q = 1, 4 steps per call, 7 interleaved repeats: 5.32 -> 5.02 ms (−0.3 to −0.4 "
        "ms in every round; 1,507 -> 1,417 launches; BENCHMARKS.md session 34)"),
    "mla_latent_norms": (False,
        "with an FP8 latent cache, a bf16 model and the joint q_a / kv_a projection: both RMSNorms of its output "
        "and the latent's FP8 quantisation (group maxima, scales, e4m3) in one launch "
        "(pallas_kernels.sparse_mla.latent_norms: a CTA per token row) instead of ~7 XLA fusions between the "
        "projection and the indexer's query GEMV on the DSA layer's critical path (s51b's trace: 6.9 µs there); "
        "the cache row's packing stays with its scatter. Bit-identical in interpret mode and natively (s55a). "
        "With qkv_a_fused_sum: 55 launches fewer, a tie in s55b (3.88 vs 3.89 ms) and slower in s57b (session 58: "
        "one TP4 rank, B = 1, q = 1, 5 interleaved repeats, defaults 3.65 ms): 3.70 ms, "
        "+0.04 ms, faster in 1 of 4; alone, with today's defaults (the first 32 layers on an H100, session 70, "
        "s70a): 2.79 -> 2.80 ms, faster in 1 of 4, 24 launches fewer. Session 71's trace with qkv_a_fused_sum "
        "(s71a, H100): from q_a / kv_a's start to the indexer's query GEMV 12.6 -> 13.3 µs (the projection with its "
        "in-kernel sum 6.3 -> 8.9 µs, this kernel 3.8 µs), the DSA sublayer 65.7 -> 67.6 µs (against session 70's "
        "trace of the defaults, another host) — off"),
    "qkv_a_fused_sum": (False,
        "with fp8_dq on, on the GPU: the DSA layer's joint q_a / kv_a projection (16 K splits at one row) sums its "
        "splits inside the kernel (linear_fused_sum's split-K counters, at this call alone) and writes its rows — "
        "the XLA split sum after it (1.6 µs + a launch in s51b's trace) leaves the layer's critical path, and "
        "mla_latent_norms reads the rows directly. linear_fused_sum for every linear was a tie (sessions 47, 51); "
        "this is its one site on the DSA critical path. CPU-built (session 52); with mla_latent_norms a tie or "
        "slower (sessions 55, 58); in session 71's trace the projection with its sum 8.9 µs against 6.3 + the XLA "
        "sum's 2.0 — the last split waiting for 15 others (see mla_latent_norms) — off"),
    "lean_barriers": (True,
        "the kernels that have a lean form built without Mosaic GPU's automatic warpgroup barriers "
        "(CompilerParams(unsafe_no_auto_barriers): two bar.sync around every vector store to a ref and one before "
        "every TMA load) and with only the barriers their data flow needs, placed by hand — the kernels on the "
        "q = 1 step's chains that are latency-bound: the mHC boundary's one-launch forms "
        "(pallas_kernels.mhc.mhc_post_finish(lean=True): 46 bar.sync in the lowered kernel, 10 lean; "
        "mhc_row_boundary: 134 -> 16), on every sublayer's critical path (90 per step at q = 1); the DSA layer's "
        "selection chain (indexer_scores(_q): 18 -> 4; the fused topk_compact: 20 -> 10, its 2-bit form 25 -> 8 — "
        "a 2-bit pass then costs the one barrier of its counts' exchange, as designed, instead of five) and its "
        "attention tail (sparse_mla_decode: 43 -> 7, and one before each of a block's up to 64 gather TMAs; its "
        "merge 2 -> 0; mla_absorb_uv: 29 -> 3; with mla_latent_norms, latent_norms 59 -> 21); and the "
        "weight-streaming kernels (fp8_dq_linear 12 -> 4, the MoE's gate/up 63 -> 20 and down 22 -> 5 at one "
        "row: a slot of the TMA ring refilled after one barrier instead of one per copy, the epilogues' stores "
        "without). A latency-bound kernel pays for each barrier its warps meet; for the barriers placed by hand "
        "interpret mode proves nothing (it runs a CTA's threads in lockstep): "
        "the GPU tests compare each lean kernel with its default build bit for bit (the boundary: with its "
        "two-launch form; all pass natively, session 55). Measured (s55b, q = 1, 5 interleaved repeats): with "
        "mhc_row 3.89 -> 3.71 ms per step, faster in 4 of 4 paired rounds (alone 3.89 -> 3.91, faster in 3 of 4: "
        "the row boundary has the most barriers to lose); on by default since session 55"),
    "mhc_row": (True,
        "with mhc_grid_barrier on, at one token row (decode at q = 1): the boundary as "
        "pallas_kernels.mhc.mhc_row_boundary — D / 128 CTAs, each thread one column of every stream in "
        "registers: the mix 20 multiply-adds per thread, the 24 logits and 10 Gram entries per-thread products "
        "summed as the rows of one SMEM tile, the partial sums over 32 chunks instead of 128 — instead of "
        "mhc_post_finish's 64-row tiles for one real row (s48d's profile: the post mix 2.1, the partial stores "
        "1.2 and the sums 2.5 of its 6.3 µs). X' and x_in bit-identical to mhc_post_finish's in interpret mode; "
        "GPU tests pass natively (session 55). Measured (s55b, q = 1): 3.89 -> 3.81 ms per step alone (faster in "
        "3 of 4 paired rounds), 3.71 with lean_barriers (4 of 4); on by default since session 55"),
    "mhc_rows": (False,
        "with mhc_row on: the row form also at 2 to 4 token rows (mhc_row_boundary with M rows — the verify's 4 at "
        "q = 4 — instead of mhc_post_finish, whose logits are a wgmma over 64-row tiles): a column of every stream "
        "and row per thread, the rows as loops (unrolled, Mosaic's layout inference took 35 s to lower 4 rows; "
        "looped 4.1 s). The one form of the several-row boundary without wgmma, so on Blackwell the only kernel "
        "form there at q > 1 (the one-row kernel unchanged: its Mosaic module the same but for source locations). "
        "Interpret-mode equal to its reference (session 57); natively correct at 3 and 4 rows (its GPU tests, "
        "session 60) and slower than the grid form on Hopper: q = 4, an H100, the first 32 layers, 6.54 -> 6.67 ms "
        "(0 of 4 paired rounds faster, s60a) — off (Blackwell's form)"),
    "mhc_barrier_counters": (True,
        "with mhc_grid_barrier on: the boundaries' grid barriers on two int32 counters of one jax Ref per step "
        "(pallas_kernels.mhc.barrier_counters: boundary i meets on counter i % 2 and zeroes the other for boundary "
        "i + 1) instead of a pl.get_global semaphore, which XLA zero-fills before every call — 91 `copy s32[1]` "
        "graph nodes per step at q = 1 (session 35's kernel listing) become one 8-byte fill. The launches stay "
        "ordered through the Ref (each call's aliased operand). Natively correct (its GPU test, session 36); in "
        "the step at q = 1 a tie (4.64-4.66 vs 4.64-4.68 ms in the same rounds): the 91 fills were all off the "
        "critical path (815 launches either way; BENCHMARKS.md session 36)" + _S43),
    "mla_uv_kernel": (True,
        "with sparse_mla on, a bf16 model and <= 8 token rows: each head's attention output through W_UV as a "
        "Mosaic kernel (pallas_kernels.sparse_mla.mla_absorb_uv: a CTA per 64 outputs of a head, its W_UV slice "
        "by TMA, the merged O^T read as the merge leaves it, one wgmma chain per token) instead of XLA's "
        "transpose + reduction after the merge (1.9 + 3.0 µs on every DSA layer's chain, session 46's trace) — "
        "one launch fewer per DSA layer. Natively correct (its GPU tests; the kernel-tiny e2e at the model's "
        "site, s48a); the one-rank step at q = 1, 5 interleaved repeats: 4.35 -> 4.25 ms (s48b) and 4.34 -> "
        "4.23 (s48c), faster in 7 of 8 paired rounds (session 48)"),
    "mla_uk_kernel": (False,
        "with a bf16 model and <= 8 token rows: the absorbed query q̂_h = W_UK_hᵀ q_h as a Mosaic kernel "
        "(pallas_kernels.sparse_mla.mla_absorb_uk: a CTA per 64 outputs of a head, its W_UK columns by TMA, one "
        "wgmma chain per token over the head group's q rows) instead of attention._per_head's XLA reduction: at the "
        "verify's 4 rows XLA copies W_UK transposed in f32 first (8.4 MB, 12.8 µs) and reduces it (8.4 µs) on every "
        "DSA layer (session 71's q = 4 trace; 4.4 µs at q = 1) — beside the indexer's selection, off the layer's "
        "chain, so the gain is HBM traffic and launches: q = 4's step 1,242 -> 1,230 kernels, scratch 0.11 -> "
        "0.01 GB (compile-only census, session 72). Within bf16 rounding of the XLA form (the sums in another "
        "order); its GPU tests pass natively (session 74). With linear_fused_sum at q = 4 (gpu_session.sh "
        "pending, session 74: an H100, the first 32 layers, 3 interleaved repeats) 6.57 -> 6.61 ms, faster in 1 "
        "of 2 rounds — a tie, off"),
    "moe_rows": (True,
        "with fp8_moe, fp8_dq and moe_router_in_kernel at one token row: the MoE's two kernels sum their split "
        "partials in the kernel on the step's split-K counters (pallas_kernels.linear.splitk_counters) — the "
        "gate/up kernel's last D split writes h's bf16 rows without the routing weights (its CTAs select them), "
        "the down kernel scales each slot's product by its weight and its last expert group writes y's rows — "
        "instead of XLA's glue (split sum, SwiGLU, weights, pad: 2.1 µs) and sum (2.0 µs) on every MoE layer's "
        "chain (session 45's trace); linear_fused_sum's rows form for the MoE alone, which the router's "
        "selection in the kernel had excluded. Natively correct (its GPU test); the one-rank step at q = 1 4.00 -> "
        "3.95 ms, faster in 3 of 4 paired rounds, 82 launches fewer (session 46, s46c); 4.35 -> 4.26 (3 of 4, "
        "s48b); with mla_uv_kernel 4.34 -> 4.16 vs mla_uv_kernel alone 4.23 (4 of 4 paired rounds, s48c; session "
        "48) — on"),
    "moe_static_table": (True,
        "with fp8_moe at one token row (its static slot table: the router's k ids): both kernels take the valid "
        "slots' count (k + shared) as a number instead of a GMEM read, and the down kernel copies the row's ids "
        "and routing weights into SMEM by one TMA each (k a multiple of 4) instead of 2k scalar GMEM loads by every "
        "thread of its 288 CTAs before the first weight request (pallas_kernels.linear.fp8_moe(static_table=True)). "
        "s49a's in-kernel profile of the step's MoE form: the down CTAs' first wait began 6.35 µs (median) after "
        "their start — of a 10 µs kernel streaming 18.9 MB; the moerk form (ids by one TMA) ran its down kernel "
        "in 8.4 µs. Natively correct (its GPU tests, session 51); the MoE alone (bench_linear moerows_st) 27.5 -> "
        "26.1-26.6 µs; the one-rank step at q = 1, 5 interleaved repeats: 3.77 -> 3.78 ms alone (faster in 3 of 4 "
        "paired rounds), with moe_writer_cta 3.70 (4 of 4; s50a, session 51) — on"),
    "moe_one_grid": (True,
        "with moe_rows, moe_writer_cta and moe_static_table at one token row: the MoE's two kernels as ONE grid "
        "(pallas_kernels.linear.fp8_moe(one_grid=parity)) — each of its 288 CTAs (+ the selection's writer) runs "
        "its gate/up item, then "
        "requests its down item's weight tiles at once and waits only for its slot's h rows (a counter their "
        "writers raise), so the down weights stream during the gate/up tail instead of after a launch boundary "
        "(s51b's trace: gate/up 16.6 then down 10.5 µs, the down kernel ~4 µs slower in the step than alone, "
        "its first bytes ~6 µs in). Unlike session 44's chained form (removed), no extra CTAs: every CTA of the "
        "grid is resident at once (~58 KB of SMEM each, the rings of the two roles scoped: three per SM). "
        "Natively correct (its GPU tests, session 60: bit-equal call to call on alternating banks, within bf16 "
        "rounding of the two kernels). Measured on an H100 (the first 32 layers of the one-rank step, B = 1, q = 1, "
        "5 interleaved repeats, twice, the order swapped): 2.89 -> 2.82 and 2.91 -> 2.80 ms, faster in 4 of 4 "
        "paired rounds both times; 42 launches fewer per step (865 -> 823) — on"),
    "moe_h_rows": (True,
        "at 2..8 token rows (the verify's MoE) with one D split in the gate/up kernel (its slots x I/64 tiles fill "
        "the SMs): that kernel writes h's rows — the clamped SwiGLU times the routing weights, in the dq dtype — "
        "as the down kernel's input itself (pallas_kernels.linear.fp8_moe(h_rows=True): the rows form without "
        "counters, no CTA waits), instead of XLA's glue fusion between the two kernels (one launch on every MoE "
        "layer's chain at q = 4: the census' loop_pad_fusion). The down kernel's groups are still summed by XLA "
        "(session 60: in-kernel waits were slower at q = 4). Natively correct (its GPU test on the H200, session "
        "61); the one-rank step at q = 4 (the full 45 layers, 5 interleaved repeats, s60e): 7.53 -> 7.42 ms, faster "
        "in 4 of 4 paired rounds; 43 launches fewer (1,420 -> 1,377) — on"),
    "mla_dequant_warpgroups": (False,
        "with sparse_mla on (Hopper's wgmma form): each attention CTA as two warpgroups, the second converting byte "
        "planes 2-3 of every block of gathered FP8 latent rows to f16 while the first converts planes 0-1 and "
        "runs the attention (pallas_kernels.sparse_mla.sparse_mla_decode(warpgroups=2), meeting at two mbarriers "
        "a block). Session 66's in-kernel profile (H100, bench_kernel_profile mla_1x4 / mla_8x4): of a block's "
        "~7.5 µs, the dequantisation 4.75 (its int / f16 / f32 arithmetic 3.4, the load 0.5, the stores 0.5) on "
        "one warp per SM sub-partition; the attention at B = 1 is ~9.5 µs, at 32 query rows ~91. Bit for bit the "
        "one-warpgroup kernel (interpret mode). Natively correct (session 67: its GPU tests on an H100); the kernel "
        "alone with the merge (bench_sparse_mla --only forms, CUPTI, H100, µs one-warpgroup -> two; with "
        "mla_scales_after both ways): B x q = 1 x 1 8.0 -> 7.8 (6.2 -> 6.4), 1 x 4 9.4 -> 9.5 (7.7 -> 8.0), 8 x 4 "
        "91.3 -> 87.0 (82.3 -> 80.3), 32 x 1 91.7 -> 87.1 (82.4 -> 80.4): it pays only where a CTA runs several "
        "blocks (32 query rows), and one DSA layer at B = 8, q = 1 went 112.9 -> 113.9 µs; the q = 1 step a tie "
        "(2.92 -> 2.91 ms, 32 layers, 5 interleaved repeats) — off (the batch's gain ~2 %)"),
    "mla_gather_warpgroup": (True,
        "with sparse_mla on (Hopper's wgmma form), where each attention CTA runs 2 or more blocks of 64 positions (a "
        "prefill chunk: 33; decode at B = 8: 4; one sequence's decode step: 1 — there it does not run): one more "
        "warpgroup in each CTA issues every block's gathers of FP8 latent rows (a TMA per pool of 4 positions and "
        "the barrier's arrivals) into a ring of 2 slots while the first converts, multiplies and runs the softmax "
        "(pallas_kernels.sparse_mla.sparse_mla_decode(gather_warpgroup=True); with mla_dequant_warpgroups three "
        "warpgroups, two converting half a block each). One warpgroup issued block k + 1's 16 groups between block "
        "k's arithmetic — ~2.7 µs of a block's ~7.5 in session 67's H100 profile — on every block a CTA runs. Bit "
        "for bit the one-warpgroup kernel (interpret mode; natively its 5 GPU tests, session 79). The kernel alone "
        "(bench_sparse_mla --only gather, an H100): a prefill chunk's 512 rows over a hot 4K / 32K cache 725.9 / "
        "723.9 -> 388.3 / 382.1 µs (3 slots 452.8 / 457.2; beside mla_dequant_warpgroups 500.0 / 508.7), B x q = 8 "
        "x 4 81.2 -> 61.3, 1 x 1 6.2 -> 6.4 (one block: not run there). In the prefill (s79a, 3 slots then: 32 "
        "layers, 512-token chunks) the chunk's attention kernels 6.59 -> 4.09 ms, a 32K prompt 4,051.7 -> 3,991.8 "
        "ms (a 4K one 526.5 -> 536.7: two repeats, within the 4K rows' spread); on by default since session 79"),
    "mla_scales_after": (True,
        "with sparse_mla on (Hopper's wgmma form): the FP8 latent's per-128 block scales applied after the MMAs "
        "instead of to every dequantised value (pallas_kernels.sparse_mla.sparse_mla_decode(scales_after=True): "
        "S^T as four K = 128 MMAs, each group's product scaled per key, and O^T's four 128-row groups from P "
        "scaled per key): the dequantisation converts bytes only, by the GPU's e4m3x2 -> f16x2 conversion — no "
        "integer bit tricks, f32 conversion, multiply and f16 rounding per value (session 66's profile: the "
        "conversion was 3.4 µs of a block's ~7.5 on an H100; compile-only PTX of the kernel at B = 1, q = 4: "
        "3,430 -> 2,133 instructions, 255 -> 148 registers). Within the kernels' tolerance of the reference (c "
        "exact in f16, s · p rounded instead; the relative error against the f32 reference 2.3e-4 -> 1.6e-4). "
        "Session 67 on an H100: its GPU tests pass; the kernel alone with the merge (bench_sparse_mla --only forms, "
        "CUPTI, µs) B x q = 1 x 1 8.0 -> 6.2, 1 x 4 9.4 -> 7.7, 8 x 4 91.3 -> 82.3, 32 x 1 91.7 -> 82.4; the "
        "in-kernel span at 1 x 4 15.0 -> 11.3 µs (the dequantisation 5.1 -> 2.1); one DSA layer at 32K "
        "(bench_dsa_layer) B = 1 q = 1 86.1 -> 85.0, q = 4 108.0 -> 106.0, B = 8 q = 1 116.3 -> 112.9, q = 4 207.6 -> "
        "195.6; the step (32 layers, 5 interleaved repeats) a tie at q = 1 (2.92 -> 2.95 ms; 8 DSA layers x ~2 "
        "µs is within its noise) — on. Hopper's form only: Blackwell's tcgen05 form converts a group at a time"),
    "mhc_row_scalars": (False,
        "with mhc_row on, at one token row: the boundary's second half computes the normalisation — the 14 sums of "
        "the partials, pre and 1/RMS — on scalars in every thread's registers (pallas_kernels.mhc."
        "mhc_row_boundary(scalars=True)) instead of placing the sums transposed in SMEM (14 dependent load / store "
        "pairs behind a zero fill), arithmetic on [64]-lane per-row vectors for one real row, and a round trip of "
        "pre / 1/RMS through SMEM. Session 67's profile (H100): the sum 0.82 and the scales 0.52 µs of the "
        "boundary's ~6.5; PTX 1,053 -> 919 instructions, 4 barriers fewer. Bit for bit the vector form in "
        "interpret mode. Measured (s68d, session 68: an H100, the first 32 layers, q = 1, 5 interleaved repeats): "
        "2.84 -> 2.81 ms, -0.01 ms paired, faster in 2 of 4 rounds — a tie, off"),
    "mhc_ll_exchange": (True,
        "with mhc_row and mhc_barrier_counters on, at one token row: the boundary's 16 normalisation partials "
        "exchanged between its 32 CTAs by a low-latency protocol (pallas_kernels._common.ll_exchange: NCCL's LL "
        "within one GPU — each value with an epoch flag in one 8-byte word, one relaxed store, polled with relaxed "
        "loads of the words themselves) instead of the grid barrier and the partials' loads after it: session 67's "
        "profile (H100) had the barrier at 1.65 µs (a release after a fence over the TMA stores, acquire polls) and "
        "the partials' loads + sum at 0.82 of the boundary's ~6.5, on every one of the step's 90 boundaries. The "
        "polled values land in an SMEM tile that the same loads and reduction sum: bit for bit the barrier form "
        "(its GPU test). The words follow the two counters in the step's barrier Ref (zeroed once per run). "
        "GPU only (no interpreter for its inline PTX: in GPU interpret mode the boundary runs as its two halves "
        "either way). Natively bit for bit the barrier form (its GPU test, s69b); the boundary alone (H100, in-kernel "
        "profile) 6.59 -> 5.78 µs (barrier 1.60 + sums 0.85 -> exchange 1.40 + sums 0.35), yet the step a tie: "
        "q = 1, the first 32 layers, 5 interleaved repeats 2.82 -> 2.82 ms, -0.01 ms paired, faster in 2 of 4 "
        "rounds (s69b, session 69). Session 70: CUPTI's records in the step (s69c) 4.88 -> 4.44 µs per boundary, "
        "the chain's kernels 2,315 -> 2,281 µs per step; the step again a tie twice: 2.79 -> 2.76 ms (-0.02 "
        "paired, 2 of 4; s70a) and 2.68 -> 2.67 (9 repeats: -0.00 paired, 5 of 8; s70b). Session 71 (s71a, 9 "
        "repeats): with kda_sinkhorn_first, qkv_a_fused_sum and mla_latent_norms 2.79 -> 2.78 ms, -0.01 paired, "
        "faster in 6 of 8 (the DSA pair slower in that trace: its chain 65.7 -> 67.6 µs), the boundary 4.3-4.7 µs "
        "in its trace (4.6-4.9 in session 70's). Four A/Bs, none slower, each below its call's noise; the "
        "boundary's own time lower in every record (~0.4 µs x 90 a step: ~1 %) — on since session 71"),
    "mla_group_arrival": (False,
        "with sparse_mla on (Hopper's wgmma form): the attention kernel's gather barrier counts one arrival per "
        "group of 4 cache rows instead of 4 (pallas_kernels.sparse_mla.sparse_mla_decode(group_arrival=True)). In "
        "Pallas' Lane semantics every barrier arrival is made by all 128 threads of the warpgroup; a pool's 4 rows "
        "were one TMA (its arrive.expect_tx) plus 3 plain arrivals, so the issue of a block's 16 groups was 512 "
        "mbarrier operations each — session 67's in-kernel profile (H100, B x q = 1 x 4): issuing the first block's "
        "gathers 2.7 µs of the kernel's ~4.3 before its first block, the gathers' own wait then 0.12. Now a group "
        "whose valid positions sit where a run from its first one puts them (pools; the tail with trailing "
        "padding) is one TMA of 4 rows and one arrival; any other group loads its rows one TMA each on a second "
        "barrier, waits there and arrives once. Bit for bit the default kernel (interpret mode). Measured (s68d, "
        "session 68: an H100, the first 32 layers, q = 1, 5 interleaved repeats): 2.84 -> 2.87 ms, +0.01 ms "
        "paired, faster in 2 of 4 rounds — a tie, off"),
    "mla_q_in_kernel": (False,
        "with sparse_mla on (Hopper's wgmma form): the absorbed query read by the attention kernel as it is (f32, "
        "or bf16 from mla_uk_kernel) and rescaled to f16 in each CTA's prologue — its head group's amax, while the "
        "first block's gathers are in flight (pallas_kernels.sparse_mla.sparse_mla_decode(q_in_kernel=True)) — "
        "instead of _prepare_q's XLA reduction and scaled copy: two launches on every DSA layer's critical path "
        "(11 at q = 1, and the draft's passes; session 74's q = 1 census: the chain's reduce_max and convert). "
        "The same r at TP4's 16 heads (one head group), so the default kernel's outputs up to the division's "
        "rounding (interpret mode). Compile-only census (session 74): q = 1 734 -> 712 kernels, critical path 463 "
        "-> 441; q = 4 1,226 -> 1,198. Launches, not time, by the traces: in session 70's (q = 1) and 71's (q = 4, "
        "H100) the query's f16 copy ended 3.4 / 9.4 µs before the indexer's selection kernel, which the attention "
        "waits for — the layer's timed chain runs through the indexer. Natively correct (its GPU tests, 4 cases: "
        "one and two head groups, f32 and bf16 queries; session 74). Measured (gpu_session.sh pending, session 74: "
        "an H100, the first 32 layers, interleaved): q = 1 2.78 -> 2.81 ms, +0.05 paired, faster in 1 of 3 rounds; "
        "q = 4 with linear_fused_sum + mla_uk_kernel 6.61 -> 6.55 (faster in 2 of 2; the defaults 6.57) — ties "
        "as the traces said, off"),
    "kda_qkv_kernel": (False,
        "with bf16_linear on, at one token row: the KDA q/k/v projection (one TP4 rank: 6,144 x 4,096 bf16, 50 MB "
        "a layer, the largest GEMV of the step) through the bf16 GEMV kernel, its K splits summed inside on the "
        "step's counters (the rows written: no XLA sum), instead of XLA's GEMV — bf16_linear's one-row sites stay "
        "XLA's otherwise (ONE_ROW_GEMV). On the H200 (session 24's bench_linear) the kernel streamed this shape at "
        "3.65 TB/s against XLA's 2.77 at one row (13.8 vs 18.2 µs; XLA is faster at 4 rows than at one), ~4 µs on "
        "each of the 34 KDA layers' chains; forcing the kernel at every one-row site (bf16_linear explicit, with "
        "linear_fused_sum) was 0.20 ms slower on an H100 (session 74), where both sit at its ~2.6 TB/s ceiling. "
        "This site alone (session 75, an H100, the first 32 layers, q = 1, 4 interleaved repeats, gpu_session.sh "
        "pending): 2.77 -> 2.93 ms, faster in 0 of 3 paired rounds; with bf16_balanced_splits (384 CTAs) or "
        "kda_gates_first 2.93 / 2.94 (s75b). Its trace (s75a): the kernel 25.5 µs in the step against 19.0 alone "
        "(bench_linear, XLA's GEMV 21.8 alone, 19.3-20.3 in the step) — the KDA sublayer 38.0 -> 43.6 µs. Natively "
        "correct (the bf16 in-kernel sum's GPU tests) — off; its H200 case unmeasured"),
    "kda_fg_b_kernel": (False,
        "with bf16_linear on, at one token row, meant with kda_qkv_kernel: the KDA gates' second GEMV (fg_b: f_b and "
        "g_b block-diagonally, 4,096 x 256 bf16, 2 MB) through the bf16 GEMV kernel on the MAIN chain's split-K "
        "counters Ref, whose previous user is the q/k/v kernel — an aliased operand of both calls, so fg_b runs "
        "after that kernel (as XLA's schedule runs it after XLA's own q/k/v GEMV) instead of beside it. Session "
        "75's trace (H100, kda_qkv_kernel): fg_b and the Sinkhorn started with the q/k/v kernel and ran beside "
        "it, fg_b 7.5-8.0 µs instead of 2.4, the kernel 25.5 µs instead of 19.0 alone. On an H100 it cannot win "
        "(the kernel alone is only ~1.3 µs faster than XLA's GEMV in the step, and fg_b then follows it on the "
        "chain); on the H200 (XLA 18.2 vs the kernel 13.8 µs alone, session 24) it might. CPU-built (session "
        "75) — off until measured on an H200 (gpu_session.sh ratio, POLICY with kda_qkv_kernel)"),
    "indexer_wq_kernel": (False,
        "with bf16_linear on, at one token row: the indexer's query projection wq_b (1,536 -> 32 x 128, bf16, "
        "12.6 MB a DSA layer, replicated) through the bf16 GEMV kernel, its K splits summed inside on the step's "
        "counters (a side chain's bank), instead of XLA's GEMV — which sits on the DSA layer's timed chain (the "
        "indexer's: q_a norm -> wq_b -> scores -> selection -> attention; session 71's H100 trace: 7.0 µs, ~1.8 "
        "TB/s; session 67's one-layer profile 5.8 µs). As kda_qkv_kernel, for this site alone. Alone on an H100 "
        "(bench_linear --sweep-bf16, session 75) the kernel is no faster there: 5.8-6.2 µs by plan, XLA 5.7. The "
        "step (session 75, an H100, the first 32 layers, q = 1, 4 interleaved repeats): 2.77 -> 2.79 ms, faster "
        "in 1 of 3 paired rounds — a tie, off; its H200 case unmeasured"),
    "kda_loads_first": (True,
        "with kda on: the recurrence kernel's GMEM loads — the conv taps (kda_conv) and, in the token loop "
        "(kda_token_loop), every token's beta — issued with the state slice before the wait for its rows' TMAs "
        "(pallas_kernels.kda_decode.KdaDecodeConfig(loads_first=True)) instead of after it (the taps: an L2 round trip "
        "on every KDA layer's chain) and inside each token's iteration (a beta: one more per token). The same values, "
        "bit for bit. Found with kda_o_grid's profile (session 68, where the W_o stream queued them). The kernel "
        "alone (H100, in-kernel profile, B x T = 1 x 1) 4.90 -> 4.28 µs; the step (q = 1, the first 32 layers, 5 "
        "interleaved repeats, s69b, session 69) 2.82 -> 2.81 ms, faster in 3 of 4 paired rounds — on (where "
        "kda_o_grid does not take the layer: B > 2 or B x T > 8)"),
    "kda_o_grid": (True,
        "with kda, kda_conv and kda_norm_partials on and a bf16 o_proj: the KDA recurrence, the gated RMSNorm and "
        "the o_proj GEMV as ONE grid (pallas_kernels.kda_decode.kda_decode_o_proj) — the one-grid MoE's pattern: "
        "every o_proj CTA requests its whole W_o slice into SMEM (16.8 MB at TP4: 128 KB per CTA, 128 CTAs) once "
        "the recurrence's own loads are in (s68d, H100: requested at the kernel's start they queued the "
        "recurrence's loads behind them, 4.5 -> 10.9 µs, and the step was a tie, 2.84 -> 2.82 ms over 32 layers), "
        "the first B x H x 4 CTAs (64 at B = 1) run the recurrence as the KDA kernel does "
        "(each writing x' = w · o · sigmoid(gate) in bf16 and its sum of squares), and each o_proj CTA waits on a "
        "counter for its K split's heads only, then scales each head's product by that head's 1/RMS. On the "
        "H200's KDA chain (session 51's trace) the recurrence 4.6 µs, the norm 1.5 and o_proj 5.7 ran one after "
        "another, each after a dependent launch, the HBM idle during the first two. The norm's 1/RMS is applied "
        "after the product (the model's form rounds w · (o · inv) · sigmoid(gate) to bf16): within bf16 "
        "rounding. Every CTA must be resident at once: max(B x H x 4, o_proj's row tiles x K splits) <= the SMs "
        "(at TP4 B <= 2), and B x q <= 8. The grid runs on the step's counters (a counters scope: the trunk's "
        "fused-mHC layer loop, each MTP pass); without them (GPU interpret mode, a module called alone) the same "
        "two roles run as two launches. Natively bit for bit its two-launch form (s68d and a review's H100 "
        "stress run, session 68; s69b). The held stream (session 68) natively: the grid's span 18.9 -> 15.1 µs "
        "(H100, B x T = 1 x 1); the step (q = 1, the first 32 layers, 5 "
        "interleaved repeats) 2.82 -> 2.79 ms, -0.03 ms paired, faster in 3 of 4 rounds (s69b, session 69; "
        "s68d's stream at the start: -0.01, 3 of 4) — on: 823 -> 789 kernels at q = 1, critical path 531 -> 463"),
    "bf16_balanced_splits": (False,
        "with bf16_linear (the verify's rows: at one row XLA's GEMV is preferred): the bf16 GEMV's K splits chosen "
        "to load the SMs evenly (pallas_kernels.linear._pick_split_balanced: the fewest bytes on the busiest SM) "
        "instead of the largest split under 2 x 132 CTAs — which gives the KDA q/k/v (48 row tiles) 4 splits, 192 "
        "CTAs on 132 SMs: 60 SMs stream two CTAs' bytes, 72 one (2.07 TB/s at q = 4 in session 71's trace, XLA's "
        "one-row GEMV 2.54); balanced: 8 splits, 384 CTAs. Also the KDA o_proj's 8 -> 4 and the indexer's wq_b 6 "
        "-> 4 splits (128 CTAs, one an SM); the router, the gates and the lm_head unchanged. The same products, "
        "summed in another split order. Compile-only census at q = 4: 1,242 -> 1,276 kernels (+1 XLA fusion a KDA "
        "layer: the 8 splits' sum), the critical path unchanged (866). At one row under kda_qkv_kernel (session "
        "75, s75b, an H100): 2.93 ms with it, 2.93 without — no help there; bench_linear --sweep-bf16 (s72b, "
        "session 75, an H100) has every split of the KDA q/k/v within 19.1-19.7 µs at 4 rows — off until the "
        "verify step measures it (gpu_session.sh s72a)"),
    "linear_part_rows": (False,
        "at 2..8 token rows (the verify's, B x q), where XLA sums a weight-streaming kernel's K splits (bf16_linear, "
        "fp8_dq_linear, the MoE's down groups): each split's partial written as the token rows [split, M, N] "
        "(pallas_kernels.linear part_rows=True: one masked row sum per row, as the fused rows form) instead of the "
        "accumulator's [split, N, mp] — XLA's sum then needs no transpose, and the sum and the cast after it are "
        "one fusion where the transposing form took a reduction and a transposing convert (two kernels after the "
        "KDA o_proj, the DSA layer's q_b / o_proj, the dense MLP and every MoE layer at q = 4). The same partials "
        "(XLA sums them in another order on the GPU: f32 rounding apart). Compile-only census of the one-rank step "
        "at q = 4: 1,377 -> 1,269 kernels, critical path 1,002 -> 898; measured a tie on an H100 (its first 32 "
        "layers, q = 4, 5 interleaved repeats, session 66: 6.56 -> 6.57 ms with 1,071 -> 950 kernels, critical path "
        "749 -> 665 — XLA's small sums overlap the chain) — off"),
    "moe_writer_cta": (True,
        "with moe_router_in_kernel and moe_router_ranks: the router's writer — the CTA that selects all k experts "
        "with their weights and stores them — is one extra CTA of the MoE's gate/up kernel that does nothing else "
        "(pallas_kernels.linear.fp8_moe(writer_cta=True)), instead of the grid's first CTA, a shared-expert CTA "
        "that ran k rounds of 3 reductions and the stores before requesting its own weight tiles: s49a's in-kernel "
        "profile had the selection 3.64 µs per warpgroup (median) but 8.82 at its slowest, that CTA's first wait "
        "beginning 6.4 µs after the median's — the kernel's last CTA to finish. Natively correct (its GPU tests, "
        "session 51); the MoE alone 27.5 -> 26.1 µs (gate/up 17.3 -> 16.0); the one-rank step at q = 1, 5 "
        "interleaved repeats: 3.77 -> 3.72 ms (faster in 4 of 4 paired rounds), with moe_static_table 3.70 (4 of "
        "4; s50a, session 51) — on"),
    "dsa_qkv_a_first": (True,
        "not a kernel: an order in the DSA layer — the indexer's input projection (an XLA GEMV) and its cache "
        "update take the layer input through an optimization barrier with the FP8 q_a / kv_a kernel's output. "
        "In s50b's trace of the step q_a / kv_a took 9.2 µs per DSA layer against 4.5 alone, its 256 CTAs "
        "sharing the SMs with the indexer's GEMV. Under XLA's concurrent command buffer the barrier (no copy: its "
        "outputs are its inputs' buffers) does not hold the GEMV back; it changes the launch order — s51b's trace: "
        "q_a / kv_a 9.2 -> 5.5 µs, the indexer's GEMV 2.3 -> 6.0 beside it, the DSA sublayer 69.8 -> 67.2 µs. The "
        "same values. The one-rank step at q = 1, 5 interleaved repeats: 3.73 -> 3.68 ms (faster in 4 of 4 paired "
        "rounds, s51a), 3.75 -> 3.77 median but faster in 3 of 4 rounds on another host (s51b; session 51) — on"),
    "kda_o_grid_spin": (False,
        "with kda_o_grid: the grid's o_proj-only CTAs request their W_o slices (8.4 MB of the 16.8) after a fixed "
        "hold of kda_decode.W_DELAY_CYCLES SM cycles (~1 µs) instead of once every recurrence CTA's loads are in "
        "(the `loaded` count: 3.76 µs median in s69b's in-kernel profile, H100) — the recurrence's ~1 MB of loads "
        "are queued by then. In that profile W_o's last bytes, not x', were the grid's last arrival (the tile's "
        "barrier wait after the x' hand-off); started ~3 µs earlier the stream could end before x' is ready, if "
        "the recurrence's loads are not slowed behind it (all 16.8 MB at the start made them 4.5 -> 10.9 µs, s68d). "
        "The same values bit for bit (an order of requests); natively correct (its GPU tests, session 72). The "
        "step at q = 1 with a 1,000-cycle hold: 2.79 -> 2.78 ms, 4 of 8 paired rounds (s71b, H100: a tie); the "
        "grid alone spans 16.6 / 15.6 / 14.3 µs with the count / 1,000 / 2,000 cycles (one profile each): the hold "
        "is 2,000 since — off until the step says otherwise"),
    "fp8_scales_first": (True,
        "with fp8_linear + fp8_dq on: each CTA of the dense FP8 kernel (fp8_dq_linear: q_a / kv_a, q_b, o_proj, "
        "the dense MLP, the MTP's) requests all its steps' block scales before its first weight tiles, instead of "
        "the first `stages` just after them (and each later one `stages` steps ahead) — a scalar load issued "
        "after the grid's weight requests queues behind them (~4 µs in s51a's MoE profile) and the first step's "
        "FMA waits for it. The same sums, bit for bit (its GPU tests, s52a). The step at q = 1: 3.86 -> 3.85 ms, "
        "faster in 4 of 4 paired rounds (s52c, session 52; with dq_f16, kda_norm_partials and moe_scale_prefetch — "
        "since removed — 3.71 -> 3.68, 4 of 4, s52d)"),
    "linear_fused_sum": (False,
        "with fp8_linear + fp8_dq, or bf16_linear, on (and fp8_moe's two kernels with fp8_dq): each "
        "weight-streaming call's K splits (the MoE down kernel's expert groups) summed inside the kernel — the "
        "last split's CTA of a row tile, dispatched last, waits on a per-tile counter "
        "(pallas_kernels.linear.splitk_counters: one jax Ref per step, every call leaving it zero) and adds the "
        "other splits' partials from L2 — and, "
        "for up to 8 token rows, written as the [M, N] rows in the output dtype (linear._rows_out; the MoE "
        "gate/up kernel's h with the SwiGLU and routing weights applied, as the down kernel's bf16 input) "
        "instead of an XLA reduction after every call. Its first form (session 35: the sum in the kernel, the slice / "
        "transpose / cast left to XLA) was correct natively but left the step's critical path at 812 of 815 "
        "launches — a Mosaic consumer (the mHC boundary) cannot fuse the slice — and its time unchanged (4.71 vs "
        "4.64-4.68 ms, session 36). The rows form: the step's critical path 815 -> 715 launches, 1,417 -> 1,299 "
        "in all; at q = 1 4.61 vs 4.96 ms but round by round -0.35 / +0.32 ms (3 interleaved repeats: no measured "
        "win yet). Since session 47 the MoE at one token row keeps moe_router_in_kernel's form under it (moe_rows "
        "is the MoE's rows form with the selection inside); its FP8 GPU tests pass natively, and at q = 1 the step "
        "went 4.19 -> 4.25 ms (4.17 with moe_rows: 980 launches), 5 interleaved repeats (session 47, s47b): not "
        "clear. At q = 4 (session 60, s60a: an H100, the first 32 layers, 5 interleaved repeats) 351 launches fewer "
        "at the full rank (critical path 1,047 -> 804) yet 6.54 -> 6.99 ms, slower in 4 of 4 paired rounds: the "
        "last split waiting for up to 31 others costs more than XLA's reduction. Part of that was the counters "
        "Ref itself: every call threads it (an aliased operand), which ordered the sublayers' side branches — the "
        "KDA gates' GEMVs after the 24 µs q/k/v GEMV, the indexer's after the MLA's, the dense MLP's up after "
        "gate — on the main chain; since session 73 those take a second Ref (side_chain: q = 4's critical path "
        "657 -> 611 launches with mla_uk_kernel, compile-only), and the router's GEMV sums its splits too (the "
        "MoE chain's XLA reduction gone). Session 74 (gpu_session.sh pending; an H100, the first 32 layers): q = 4 "
        "with mla_uk_kernel 6.57 -> 6.61 ms, faster in 1 of 2 rounds — the session-60 penalty (+0.45 ms) gone, "
        "no gain; q = 1 with bf16_linear forced at one row 2.78 -> 2.98 ms, slower in 3 of 3 — off"),
    "indexer_q_in_kernel": (True,
        "with indexer on (an FP8 pool cache, bf16 projections): the index queries' FWHT and UE8M0 FP8 "
        "quantisation inside the scores kernel (indexer_scores_q: one wgmma with the ±1 Sylvester matrix per "
        "64 query rows, the scales from the amax's bits) instead of the XLA butterflies, amax and conversion "
        "in front of it — ~8 µs and 3 launches per DSA layer on the critical path (session 29's profile). "
        "Natively equal to its reference compiled as the model rounds (session 35: session 34's failure was "
        "the reference's — XLA on the GPU dropped quant_ue8m0_fp8's bf16 rounding, excess precision). In the "
        "step at q = 1 a tie (4.64-4.67 ms vs 4.64-4.68, session 36): the queries' path is not the DSA layer's "
        "longest (the critical path stays 815 launches) — off. Again a tie where the chain by GPU time passes "
        "through the queries' rotation (4.19 vs 4.20 ms, 44 launches fewer; session 42, s42c): the layer's "
        "other branches into the scores and attention kernels are as long" + _S43),
    "topk_keys_in_kernel": (True,
        "with topk_threshold on and the indexer's scores kernel: the threshold kernel reads the scores kernel's "
        "output as it is (f32, -inf past the complete pools) and forms the keys in registers "
        "(pallas_kernels._common.order_key_u32) instead of the XLA fusion between the two kernels (the mask, the "
        "order key, the pad to the kernel's lanes) — one launch fewer on each DSA layer's critical path (session "
        "36's chain: scores kernel -> that fusion -> threshold kernel); the scores kernel then pads its output to "
        "the threshold kernel's lanes (a cache of 8,768 padded pools refused the knob, session 39). Natively "
        "equal at the model's call site (session 39); in the step at q = 1 a tie: 4.32 vs 4.28 ms (with "
        "router_warp_rows 4.23; rounds spread ~0.1 ms; session 39)" + _S43),
    "topk_compact_kernel": (True,
        "with topk_threshold on and the indexer's scores kernel: the compaction after the threshold kernel — the "
        "selected pools' slots, their expansion to token positions, the tail and the -1 padding to the attention "
        "kernel's width — as ONE Mosaic launch of several CTAs per score row (pallas_kernels.indexer.topk_compact: "
        "each CTA 2,048 keys, the counts before them from the rows above, two wgmma prefix counts, the "
        "selected keys stored to GMEM by the thread holding them) instead of XLA's blocked prefix sum, slice, "
        "select, the -1 buffer's copy, scatter and pad: six launches and 9.4 µs on every DSA layer's q = 1 chain "
        "(session 48's trace), without a single-CTA selection's latency. Natively equal (its GPU tests, the "
        "kernel-tiny e2e); one row of 8,704 pools: the selection 13.9 -> 10.7 µs (bench_topk); the one-rank step at "
        "q = 1 4.04 -> 4.01 ms (5 interleaved rounds, s49b; session 50) — on, with topk_compact_fused"),
    "topk_compact_fused": (True,
        "with topk_compact_kernel: the threshold found by every compaction CTA itself from the row it holds "
        "(topk_compact(t=None): the threshold kernel's one-bit passes, the early exit as topk_threshold_exit) — the "
        "indexer's "
        "selection as ONE launch of ~5 CTAs per score row, where the threshold kernel's launch gap and the "
        "compaction's reload of the row sat on every DSA layer's chain; unlike the one-CTA selection (the passes "
        "and every tile: 19.8 µs alone, session 42) each CTA compacts 2,048 keys. Natively equal (its GPU tests, "
        "the kernel-tiny e2e); one row of 8,704 pools 9.9 µs (13.9 for the threshold kernel + XLA's compaction); "
        "the one-rank step at q = 1 4.04 -> 3.94 ms, faster in 5 of 5 interleaved rounds, 955 -> 888 launches "
        "(s49b; session 50) — on"),
    "topk_two_stage": (True,
        "with topk_threshold, topk_compact_kernel and topk_compact_fused on: a score row longer than the "
        "compaction kernel holds (THRESHOLD_MAX_KEYS = 17,408 pools: contexts past ~64K tokens; the model's native "
        "context is 1M, 262,144 pools) selected in two stages of the fused kernel "
        "(pallas_kernels.indexer.topk_compact_chunked: each chunk's top 512 as rows of their own, then the top 512 "
        "of the chunks' candidates — exact, ties by index) instead of XLA's sort, which took 83-262 µs of glue per "
        "DSA layer at 128K on an H100 (session 64, bench_dsa_layer); up to ~2.3M tokens (34 chunks' candidates in "
        "one row). Natively exact (test_compact_chunked_gpu, session 65); on an H100 the selection 39.1 -> 30.2 µs "
        "at 128K and 332 -> 79 µs at 1M with 4 rows, one DSA layer at 128K 120 -> 105 µs (q = 1) and 198 -> 129 µs "
        "(q = 4) — on. Since session 66 in balanced chunks (C ~ sqrt(pools / 512): 128K 8 chunks of 4,224 instead "
        "of 2 of 16,512; chunked_select_plan): the selection at 128K / 256K / 1M 30.1 / 33.7 / 40.4 -> 22.8 / 25.7 "
        "/ 36.0 µs for one row, 33.7 / 37.6 / 78.1 -> 24.5 / 28.6 / 59.9 for four (H100, bench_topk)"),
    "topk_threshold_4wg": (False,
        "with topk_threshold on: the threshold kernel's CTA as 4 warpgroups, each comparing a quarter of the "
        "row per pass, the counts summed through SMEM (pallas_kernels.indexer.topk_threshold warpgroups=4) — "
        "its 32 dependent passes were ~0.6 µs each on one warpgroup (21.6 µs alone at 8,256 pools, session "
        "32). Each warp sums its own keys (pallas_kernels._common.warp_split_layout: Mosaic's warpgroup "
        "reductions share one cross-warp SMEM scratch between warpgroups, a race — session 34) and the 4 x "
        "warpgroups per-warp counts meet in SMEM. Natively equal to its reference at 1 / 4 / 32 rows and 2 "
        "warpgroups (session 35); in the step at q = 1 a tie: 4.57 vs 4.76 ms and 4.95 vs 4.75 in two calls "
        "(session 35) — off"),
    "mla_combine_kernel": (True,
        "with sparse_mla on: the splits' partial outputs merged by one Mosaic launch after the attention kernel "
        "(pallas_kernels.sparse_mla combine='kernel': a CTA per 64-row tile and token, the splits' loads all "
        "in flight) instead of XLA's broadcast + variadic-reduce fusions (1.5 + 4.2 µs per DSA layer at q = 1, "
        "session 29's profile). Natively bit-identical to the merge inside the attention kernel that was measured "
        "slower (session 34; removed in session 53)" + _S43),
    "pdl": (False,
        "every Mosaic kernel of the step starts with griddepcontrol.wait + .launch_dependents (Programmatic "
        "Dependent Launch: a dependent kernel is launched and scheduled while its predecessor drains; "
        "pallas_kernels._common.pdl_mode). Not a kernel: a launch mode of all of them. Whether XLA's CUDA "
        "graph keeps the programmatic edges is benchmarks/bench_pdl.py's question. Natively correct (12 chained "
        "boundaries bit-identical, session 34); the one-rank step at q = 1 5.32 -> 5.38 ms (no gain: XLA's "
        "graph does not honour the programmatic edge) — off"),
    "moe_prefill": (True,
        "a prefill chunk's routed experts as grouped FP8 GEMMs (pallas_kernels.moe_prefill: the chunk's (token, "
        "expert) pairs sorted by expert into row tiles of one expert each, a CTA per (tile, weight rows) streaming "
        "its expert's FP8 weight once, dequantised in registers) instead of XLA's path, which runs every expert "
        "over every token (E / k = 36x the routed pairs' FLOPs at the release) after dequantising all 288 "
        "experts' weights to bf16 in HBM (1.2 GB per matrix per MoE layer of one TP4 rank). A kernel a prefill "
        "chunk runs (PREFILL_KNOBS, with mla_prefill); also a decode step's MoE past the decode kernels' 64 rows. "
        "Natively equal to fp8_moe_reference at the rank's shapes (its GPU tests, an H100, session 62); one TP4 rank's "
        "first 32 layers on an H100, 256-token chunks (benchmarks/bench_prefill.py): a 4K prompt 3.45 -> 1.99 s, "
        "32K 22.7 -> 10.7 s. On by default where the kernels run natively; in GPU interpret mode (the CPU: seconds "
        "a call) only when the policy asks for it"),
    "moe_prefill_rows": (True,
        "with moe_prefill: both grouped launches write their outputs as token rows (pallas_kernels.moe_prefill, "
        "rows=True: each CTA's [weight rows, tile rows] sums picked per token row into SMEM by masked row sums, as "
        "the decode kernels' linear._rows_out, and stored by one TMA) instead of [tiles, N, tile rows] arrays that "
        "XLA transposes — h before the down launch and y before the pairs' gather (in session 77's H100 trace of "
        "a 512-token chunk, one TP4 rank's first 32 layers: ~1.4 ms of the chunk's kernels for y's). The same "
        "values bit for bit (GPU interpret mode, and natively at the rank's shapes: its GPU tests, session 78). In "
        "s78a's trace the grouped kernels took 21.7 -> 22.5 ms a chunk (the masked row sums) and XLA's transposes "
        "(1.6 ms) went" + _S78),
    "moe_prefill_resident": (True,
        "with moe_prefill: the grouped down launch (K = the expert width, 512 at one TP4 rank) with each row tile's h "
        "held in SMEM (pallas_kernels.moe_prefill.fp8_grouped_linear(resident=...): a CTA loads its tile's [mp, K] h "
        "once and runs 8 weight row tiles through one TMA ring) instead of a CTA per weight row tile streaming the "
        "tile's h beside only K / 128 = 4 weight blocks — at a 2,048-token chunk's 64-row tiles 64 KB of h for 32 KB "
        "of weight, h re-read by all D / 64 = 64 CTAs of a tile: in session 80's H100 trace the down launch took 696 "
        "µs a layer against the gate / up launch's 548 for twice its weight bytes. The same values bit for bit (GPU "
        "interpret mode; the same blocks, scales and order of sums; natively at the rank's shapes: its GPU test). "
        "Hopper's form (wgmma). One TP4 rank's first 32 layers on an H100, 2,048-token chunks (s81a, session 81): "
        "the grouped kernels 37.5 -> 34.1 ms a chunk, a 4K / 32K prompt 261.3 / 2,043.6 -> 256.5 / 2,000.7 ms — on"),
    "moe_prefill_tokens_m": (False,
        "with moe_prefill_resident and moe_prefill_rows, at 64-row tiles (a 2,048-token chunk's): the resident down "
        "launch's MMAs with the tile's token rows as M — h's block as A from SMEM, the weight block dequantised into "
        "SMEM as B, transposed (pallas_kernels.moe_prefill.fp8_grouped_linear(tokens_m=True)) — so the accumulator "
        "is already [tokens, weight rows] and each weight tile is stored as it is, instead of 64 masked row sums a "
        "weight tile (linear._rows_out): in session 81's H100 trace the resident down launch streamed ~1.45 TB/s "
        "(586.5 µs a layer), the epilogue the suspect. The same products summed in another order (within f32 "
        "rounding in GPU interpret mode). CPU-built (session 81) — off until measured"),
    "mla_prefill": (True,
        "with an FP8 latent cache: DSA's attention of a prefill chunk (and of a decode step past the decode "
        "kernels' 64 token rows) through the sparse MLA decode kernel (pallas_kernels.sparse_mla.sparse_mla_decode: "
        "a CTA per (token, split) gathering its selected cache rows by TMA into SMEM, dequantised there, then the "
        "split merge kernel) instead of XLA's grouped form (sparse_mla_grouped), which writes every token's "
        "gathered rows to HBM — [256, 2,051, 512] e4m3 bytes a DSA layer at 256-token chunks, read back by two "
        "bf16 products: ~0.2 ms a product in session 64's H100 prefill trace. Within the kernels' tolerance of "
        "the XLA form at the model's site in GPU interpret mode, natively against the reference at a chunk's 256 "
        "rows; one TP4 rank's first 32 layers on an H100 (session 76, s76a): a 32K prompt in 256-token chunks "
        "6.92 -> 6.62 s to the first token, a 4K prompt 0.996 -> 0.968 s (a tie by the faster repeats), in "
        "512-token chunks 0.662 -> 0.581 s; the chunk's XLA GEMMs 10.3 -> 5.0 ms, the kernel 4.8 ms (~0.44 ms a "
        "DSA layer: 1 CTA an SM, each gathering its 64-row blocks one by one); in the step's forms (a chunk keeps "
        "PREFILL_FORM_KNOBS: lean, the scales after the MMAs) a 4K prompt in 512-token chunks 0.617 -> 0.597 s "
        "(s76c). On by default where the kernels run natively; in GPU interpret mode only when the policy asks for "
        "it"),
    "mhc_prefill": (True,
        "the mHC sites XLA runs — a prefill chunk's (and a decode step's where the fused boundary does not run) — "
        "in two passes over the streams: the input norm's per-row scale applied to the 24 mixing logits after "
        "their product (norm(X) · fnᵀ as rsqrt · (X · fnᵀ)), and the post mixing's 4-term sums written out, "
        "which XLA fuses with the rounding to bf16 and the next site's sum of squares. The reference's order (the "
        "stock path: HF's) writes the normalised f32 streams and reads them back, and runs the 4 x 4 mixing as a "
        "GEMM writing f32 streams for the next fusion: in session 77's H100 trace of a 512-token chunk (one TP4 "
        "rank's first 32 layers) 4.2 of the chunk's 5.6 ms of mHC kernels (a 16.8 MB bf16 stream set a site). "
        "The same sums rounded in another order (within the fp32 paths' tolerance of the reference's)"),
    "mhc_prefill_sinkhorn": (True,
        "the mHC sites XLA runs (a prefill chunk's; a decode step's where the fused boundary does not run): each "
        "token row's Sinkhorn normalisation of its 4 x 4 comb (a row softmax, then 20 alternating column / row "
        "normalisations) as one Mosaic GPU launch over the rows (pallas_kernels.mhc.sinkhorn_tokens: a CTA per 64 "
        "rows, per-row vectors — the decode boundary's _sinkhorn_rows) instead of the stock form, whose 19 unrolled "
        "normalisation pairs XLA runs as ~40 launches of ~3 µs a site: in session 80's H100 trace of a 4K prompt "
        "in 2,048-token chunks 2,681 reductions + 2,192 adds, ~5.8 ms a chunk of its 14.2 ms of mHC kernels. Each "
        "normalisation by 4 reciprocals instead of 16 divisions (within an ulp a step): within the f32 kernels' "
        "tolerance of the stock form (natively: its GPU test). Session 81 (s81a: an H100, 32 layers, 2,048-token "
        "chunks): a chunk's mHC kernels 14.1 -> 11.6 ms and 5,296 -> 2,992 launches, a 4K / 32K prompt 261.3 / "
        "2,043.6 -> 260.7 / 2,034.3 ms — on"),
    "bf16_products": (True,
        "XLA's f32 products of bf16 values at two prefill sites — the mHC's 24 mixing logits (with mhc_prefill: the "
        "streams times fn) and the router's logits past the GEMV kernel's rows (x times W_r) — as products of the "
        "bf16 operands with f32 sums (every product of two bf16 values exact in f32: the f32 product's terms, summed "
        "in another order) instead of f32 GEMMs that XLA feeds with f32 copies of both operands: session 79's H100 "
        "trace of a 512-token chunk (32 layers) had the mHC's `wrapped_convert` f32[512, 32, 512] at 955 µs a chunk "
        "(33.5 MB written and read back a site) and fn's f32 copy 150, the router's copies of x and W_r 137 + 94. "
        "Within the fp32 paths' tolerance of the f32 products. Not at one token row (a decode step's router, where "
        "XLA runs it: the GEMV kernel measured slower there — XLA's f32 GEMV stays, not measured with bf16 "
        "products). CPU-built (session 79); on since session 80: a 2,048-token chunk's busy time 135.9 -> 124.3 ms "
        "(its mHC kernels 21.5 -> 14.2 ms), a 32K prompt 2,277.9 -> 2,225.3 ms on an H100 (32 layers, same call)"),
    "kda_handover": (True,
        "a prefill chunk's KDA state hand-over between its 32-token sub-chunks (S_{c+1} = R_c S_c + P_c, every "
        "sub-chunk's entry state kept) as one Mosaic GPU launch a layer (pallas_kernels.kda_prefill.kda_handover: "
        "a CTA per head and 16 state columns, R_c streamed by TMA, f32 rank-1 updates on the CUDA cores) instead "
        "of XLA's unrolled chain of 2 launches a sub-chunk (32 a KDA layer of a 512-token chunk, ~3 ms of its "
        "kernels on an H100 in session 77's trace) and the concatenation of the entry states that a 768- or "
        "1,024-token chunk's compile may stall on. No wgmma: any GPU. CPU-built (session 77): GPU interpret mode "
        "against the recurrence, the CUDA lowering at a 512-token chunk's 16 sub-chunks x 16 heads; natively "
        "within the fp32 paths' tolerance of the reference (its GPU tests, session 78). Also what lets 768- and "
        "1,024-token chunks compile (~5 min with XLA's autotuning, one input_concatenate_fusion 2.5-3.5 min of "
        "it): a 4K prompt in 1,024-token chunks 394.7 ms, 32K 2,961 ms (s78b)" + _S78),
    "kda_chunk_gemm": (True,
        "a prefill chunk's chunked KDA (attention.kda_chunked) with its pairwise terms kk_ij = Σ_c k_ic k_jc e^(G_ic "
        "- G_jc) and qk's as two batched GEMMs of k and q scaled by e^(±(G - G_m)) about each 32-token sub-chunk's "
        "middle token (exponents within 16 x the gate's lower bound: 80 at the release's -5, finite in f32; "
        "declined past attention.PAIRWISE_GEMM_MAX_LOG) instead of the [C, C, K] tensor of pairwise exponents "
        "XLA builds and reduces (33.5 M exponentials a KDA layer of a 512-token chunk at one TP4 rank; session 78's "
        "H100 trace: fusion_14070 55 µs and input_reduce_fusion_103 38 µs a KDA layer) — and without XLA's "
        "horizontal fusion of that reduction with K̃, the one concatenate fusion a 1,024-token chunk program has "
        "and a 512-token one does not (the suspect of its ~5-minute compile). Within the fp32 paths' tolerance of "
        "the pairwise form (the products summed in another order). Session 79 (an H100, 32 layers): with it a "
        "1,024-token chunk program compiled in 116-130 s (294 s without, session 78) and a 2,048-token one in 90 s "
        "— 4K / 32K prompts 388.0 / 2,534.0 ms to the first token in 2,048-token chunks against 526.5 / 4,051.7 in "
        "512-token ones without it, on the same machine (PREFILL_CHUNK 2,048 since); at 512-token chunks with "
        "the since removed kda_chunk_x6 the chunk's KDA kernels 7.54 -> 6.22 ms (s79a's traces). On by default since "
        "session 79"),
    "indexer_prefill": (True,
        "with an FP8 pooled-key cache: the indexer's scores of a prefill chunk's rows (and of a decode step's past "
        "the decode kernel's 64) through the scores kernel in token groups (pallas_kernels.indexer."
        "indexer_scores_rows: 4 tokens x the index heads a CTA, its queries rotated and quantised in the kernel, "
        "the key blocks past its tokens' complete pools skipped) instead of XLA's FP8 product, which writes every "
        "head's scores in f32 for the weighted head sum to read back ([512, 32, 8,256] f32, 541 MB, a DSA layer of "
        "a 512-token chunk at a 32K cache) and scores every pool slot of the cache whatever the prompt's length "
        "(session 77's H100 trace: ~4 ms of a 512-token chunk's kernels around the indexer's scores at a 4K "
        "prompt). CPU-built (session 77): GPU interpret mode against the reference, the CUDA lowering at a chunk's "
        "512 rows; natively against the reference (its GPU tests, session 78)" + _S78),
    "topk_prefill": (True,
        "the indexer's top-512 pools of a prefill chunk's rows (and of a decode step past the decode selection's 64) "
        "as the fused one-launch selection (pallas_kernels.indexer.topk_compact: a grid of ~5 CTAs a row, each "
        "running the threshold's passes and writing its selected pools' token positions; its two stages past 64K "
        "context) on XLA's scores padded with -inf, instead of XLA's segmented radix sort of every row (~0.16 ms a "
        "DSA layer at 256 rows in session 76's H100 prefill trace). The set lax.top_k selects, in ascending order "
        "(XLA's list is in score order: the attention sums its rows in another order). CPU-built (session 76): "
        "the model's selection in GPU interpret mode, the form's CUDA lowering; a tie at 256-token chunks (session "
        "76). At 2,048-token chunks (s81a, session 81: an H100, 32 layers) the chunk's CUB segmented radix sorts "
        "(12.1 ms) go for the kernel's 4.2 ms, the chunk's busy time 124.8 -> 117.5 ms, a 4K / 32K prompt 261.3 / "
        "2,043.6 -> 248.5 / 1,928.1 ms — on"),
}
KERNEL_DEFAULTS = {name: default for name, (default, _) in KNOBS.items()}
# The knobs a prefill chunk's trace honours (kernels built for many token rows; Decoder.prefill_kernel_mode): every
# other kernel is a decode kernel of <= MAX_KERNEL_ROWS rows and stays off there — the chunk is XLA's otherwise.
PREFILL_KNOBS = ("moe_prefill", "moe_prefill_rows", "moe_prefill_resident", "moe_prefill_tokens_m", "mla_prefill",
                 "topk_prefill", "mhc_prefill", "mhc_prefill_sinkhorn", "bf16_products", "indexer_prefill",
                 "kda_handover", "kda_chunk_gemm")
# Decode knobs that choose a prefill kernel's form, not whether a kernel runs: a chunk keeps their policy values
# (mla_prefill runs the sparse MLA kernel in the forms the decode step runs it in, attention._mla_forms)
PREFILL_FORM_KNOBS = ("lean_barriers", "mla_dequant_warpgroups", "mla_scales_after", "mla_group_arrival",
                      "mla_q_in_kernel", "mla_gather_warpgroup")

# Knobs whose forms were measured slower than (or no faster than) the defaults on the H200 and removed with their
# kernels: a policy naming one is refused with the reason (git history and BENCHMARKS.md keep them).
REMOVED_KNOBS = {
    "moe_persistent": "the single-row MoE as one persistent launch: 33.5 vs 25.3 µs (session 40); removed in "
                      "session 53",
    "moe_balanced": "the persistent MoE's work dealt out evenly: a tie (session 40); removed in session 53",
    "moe_chained": "the single-row MoE as one launch of two roles: 4.16 -> 4.51 ms (session 44); removed in session 53",
    "moe_chained_sum": "moe_chained's in-kernel sum (session 44); removed in session 53",
    "topk_select_kernel": "the indexer's selection as one CTA: 19.8 vs 17.0 µs (session 42); removed in session 53",
    "topk_scan_mm": "the selection's prefix sums as a matmul: a tie (session 36); removed in session 53",
    "mla_combine_fused": "the sparse MLA's split merge inside the attention kernel: 5.32 -> 5.45 ms (session 34); "
                         "removed in session 53",
    "mhc_boundary": "the mHC boundary as a cluster of 8 CTAs: 33.8 vs 15.3 µs (session 32); removed in session 53",
    "kda_gate_proj": "the KDA gates' second projections in the KDA kernel: 4.03 -> 4.08 ms, slower in 5 of 5 rounds "
                     "(session 50); removed in session 53",
    "moe_scale_prefetch": "every MoE step's block scales requested up front: a tie twice (sessions 51, 52 — the "
                          "weight tiles arrive late, not their scales); removed in session 54",
    "router_warp_rows": "the router's selection with a warp per row (shuffles only): a tie as the router kernel "
                        "(session 39), slower inside the MoE's gate/up kernel (4.37 vs 4.30 ms, 0 of 4 rounds; "
                        "session 42); removed in session 54 (router_route keeps the warp-per-row selection)",
    "l2_prefetch": "the latency-bound kernels (the mHC boundaries, the KDA kernel, the indexer's scores) asking for "
                   "the next GEMVs' weights in L2: +0.20 ms per step at q = 1, faster in 0 of 4 paired rounds (s57b, "
                   "session 58); removed in session 59",
    "l2_prefetch_side": "l2_prefetch's L2 prefetches from launches of their own beside the critical chain: +0.18 ms "
                        "per step at q = 1, faster in 0 of 4 paired rounds (s57b, session 58); removed in session 59",
    "moe_down_prefetch": "the MoE's gate/up CTAs asking for their experts' down weights in L2: +0.10 ms per step at "
                         "q = 1, faster in 0 of 4 paired rounds (s57b, session 58); removed in session 59",
    "mhc_router": "the one-row mHC boundary computing the MoE router's logits as per-CTA partial sums (no router "
                  "GEMV): an H100, 32 layers, q = 1: 3.01 -> 3.08 ms (0 of 4 rounds), rebuilt a tie (2.98 vs 2.98, "
                  "session 59 — the gate/up selection 3.3 -> 6.9 µs adding the 32 partials); the H200's full step "
                  "3.50 -> 3.56 ms (0 of 4, s59a, session 60); removed in session 61",
    "boundary_qkv": "the one-row mHC boundary and the KDA q/k/v GEMV as one grid (the GEMV's CTAs streaming their "
                    "first weight tiles during the boundary, x_in awaited on a counter): natively correct, slower — "
                    "an H100, 32 layers, q = 1: 2.92 -> 3.00 ms (0 of 4 rounds, s61a); its trace (s61b): the grid "
                    "took 24.6 µs, the boundary + XLA's GEMV 6.0 + 19.2 (no overlap gained), and the KDA gates' "
                    "GEMVs, readers of x_in, now waited for the whole grid (+5 µs a layer); built and removed in "
                    "session 61",
    "boundary_qkv_rows": "boundary_qkv's GEMV in 64-row tiles without a K split, z's rows written by the grid: "
                         "2.92 -> 3.29 ms (0 of 4, s61a); built and removed in session 61",
    "boundary_router": "the one-row mHC boundary before a MoE sublayer and the router's logits GEMV as one grid (the "
                       "whole 2.4 MB weight in flight during the boundary, 8 K splits summed in the grid): 2.92 -> "
                       "3.01 ms (0 of 4 rounds, s61a, an H100, 32 layers); its trace (s61b): the grid 9.6 µs vs "
                       "the boundary 5.7 + XLA's router GEMV 2.5 — after x_in the in-grid GEMV's chain of "
                       "dependent GMEM round trips (the poll, x's TMA, the split sums' stores, waits and loads) "
                       "took ~4 µs; built and removed in session 61",
    "kda_gates_first": "the gates' GEMVs launched before the KDA q/k/v GEMV (an order): +0.03 ms (s57b, session 58) "
                       "and 2.79 -> 2.80 ms, faster in 0 of 8 rounds (s71b, session 72); removed in session 81",
    "kda_sinkhorn_first": "the KDA sublayer's Sinkhorn launched before its GEMVs (an order): 2.79 -> 2.82 ms, faster "
                          "in 4 of 8 rounds (s71a, session 71) — the Sinkhorn off the chain, the q/k/v GEMV slower "
                          "beside it; removed in session 81",
    "kda_chunk_x6": "a prefill chunk's chunked KDA products as lax.DotAlgorithmPreset.BF16_BF16_F32_X6 (six bf16 "
                    "tensor-core products an f32 one): within the fp32 paths' tolerance on the CPU, outside it "
                    "natively — XLA's GPU dots gave max abs 1.7e-4 against the per-token recurrence at a 512- and a "
                    "70-token chunk with random gates (test_chunked_kda_x6_products_gpu, an H100, session 81); never "
                    "timed; removed in session 81",
}

# Kernels that pass in GPU interpret mode but compute wrong results natively (their GPU tests fail): the policy
# refuses them outside interpret mode, with this reason, until rebuilt — interpret mode runs one warpgroup after
# another and ignores register layouts, so it cannot see these bugs (session 34's native runs).
NATIVE_WRONG: dict[str, str] = {
    # knob -> why (its GPU test's failure). Empty since session 35: indexer_q_in_kernel's failure (session 34) was
    # its reference's — XLA on the GPU skipped a bf16 rounding (excess precision); against a reference compiled
    # as the model rounds (conftest.rounding_reference) its GPU tests pass natively.
}


# Where the radix top-512 beats XLA's sort on the H200, and in which form (bench_topk, µs; session 24):
#   1 row:  8,256 pools — sort 55.6, radix 33.5, radix with a 128-blocked prefix sum 25.4;
#          16,448 — sort 67.7, radix 47.6, blocked 49.8 (512-blocked 45.7);  24,640 — sort 36 vs radix 66 (s. 23)
#   4 rows: 8,256 — sort 60.3, radix 36.0, blocked 30.6;  16,448 — sort 76.3, radix 110, blocked 112, 4-bit
#          digits + blocked 56.9 (the 8-bit compare-and-count pass is [.., 256, N]: it grows with rows × pools)
# XLA's sort switches algorithm past ~16K pools per row and then wins; digits from histograms never won.
RADIX_TOPK_MAX_POOLS = 16448
RADIX_TOPK_MAX_SCORES = 4 * 16448  # rows × pools
RADIX_TOPK_8BIT_MAX_SCORES = 4 * 8256  # past this the 4-bit digits' 8 passes of [.., 16, N] beat 4 of [.., 256, N]


def radix_topk_plan(rows: int, pools: int) -> tuple[dict, bool]:
  """(topk_set_by_threshold's options for ``rows`` score rows of ``pools`` pools, whether it measured faster than
  XLA's sort there)."""
  form = {"digit_bits": 8 if rows * pools <= RADIX_TOPK_8BIT_MAX_SCORES else 4, "scan_block": 128}
  return form, pools <= RADIX_TOPK_MAX_POOLS and rows * pools <= RADIX_TOPK_MAX_SCORES


# Knobs whose kernels issue Hopper's warpgroup MMA (wgmma: sm_90a only) -> the kernels. Blackwell's tensor cores
# (sm_100, sm_103) take tcgen05 MMAs with their accumulators in tensor memory instead, and ptxas refuses every
# wgmma there ("Instruction 'wgmma.mma_async with floating point types' not supported on .target 'sm_100a'":
# the kernel-tiny step compiled for a B200 on a CPU, benchmarks/step_census.py --target
# benchmarks/targets/b200.txtpb, session 57). Those with a tcgen05 form (TCGEN05_KNOBS, below: the GEMVs, the MoE,
# the indexer's scores, session 58, the selection's compaction, the indexer's cache update, the prefill MoE, the
# sparse MLA and W_UV after it, session 65) run in it there; the step declines the others,
# with WGMMA_REASON, and runs the XLA path at their sites (now only the one-grid MoE, whose two kernels run there
# instead). The rest compile there (the KDA
# recurrence, the mHC boundary's row form — one token row, up to 4 with mhc_rows — and the Sinkhorn, the router
# kernels, the indexer's threshold, the MLA merge); the other mHC forms (mhc_post_pre / mhc_post_finish: the
# logits as a wgmma) are declined through knob mhc (model.fused_mhc).
WGMMA_KNOBS = {
    "fp8_linear": "fp8_linear / fp8_dq_linear",
    "fp8_moe": "the MoE's gate/up and down kernels",
    "moe_one_grid": "the MoE's two kernels as one grid",
    "kda_o_grid": "the KDA recurrence and o_proj as one grid (its o_proj role)",
    "bf16_linear": "bf16_linear",
    "sparse_mla": "the sparse MLA attention",
    "mla_uv_kernel": "W_UV (mla_absorb_uv)",
    "mla_uk_kernel": "W_UK (mla_absorb_uk)",
    "indexer": "the indexer's scores",
    "indexer_pool_kernel": "the indexer's cache update (the pooled keys' Hadamard rotation)",
    "topk_compact_kernel": "the selection's compaction (its prefix counts)",
    "moe_prefill": "the prefill MoE's grouped GEMMs",
    "mla_prefill": "the sparse MLA attention at many token rows",
    "topk_prefill": "the selection's compaction at many token rows (its prefix counts)",
    "indexer_prefill": "the indexer's scores at many token rows",
}
WGMMA_REASON = ("needs Hopper's wgmma (sm_90a), which {arch} does not have (Blackwell's tcgen05 MMA: no form of "
                "this kernel that runs there yet)")
# The WGMMA_KNOBS kernels with a tcgen05 form (pallas_kernels.linear and .indexer, mma="tcgen05": the accumulator
# in tensor memory, A through SMEM, 128-row tiles, token rows padded to 16): on Blackwell they run in it instead of
# being declined. Built and checked on a CPU (GPU interpret mode; compiled for sm_100a by step_census.py); not yet run
# on a Blackwell GPU. fp8_linear's form is the dq kernel's (fp8_dq on: the hi/lo fp8 wgmma has none).
TCGEN05_KNOBS = {
    "fp8_linear": "fp8_dq_linear (with fp8_dq on)",
    "fp8_moe": "the MoE's gate/up and down kernels (with fp8_dq on)",
    "bf16_linear": "bf16_linear",
    "indexer": "the indexer's scores (index heads a multiple of 16)",
    "topk_compact_kernel": "the selection's compaction (its prefix counts: tcgen05 MMAs of 128 key rows)",
    "indexer_pool_kernel": "the indexer's cache update (the pooled keys' rotation: one tcgen05 MMA of 128 rows)",
    "moe_prefill": "the prefill MoE's grouped GEMMs (128 weight rows a CTA, the dequantised tile through SMEM)",
    "sparse_mla": "the sparse MLA attention (blocks of 128 positions, the latent dequantised a 128-dimension group "
                  "at a time)",
    "mla_uv_kernel": "W_UV (128 rows of W_UV a CTA)",
    "mla_prefill": "the sparse MLA attention at many token rows (sparse_mla's tcgen05 form)",
    "topk_prefill": "the selection's compaction at many token rows (topk_compact's tcgen05 form)",
    "indexer_prefill": "the indexer's scores at many token rows (the scores kernel's tcgen05 form, 16 heads a "
                       "multiple)",
}


def has_wgmma(arch: str | None) -> bool:
  """Whether kernels compiled for ``arch`` (runtime.detect_platform's names; None or "cpu": the CUDA lowering's
  default target, sm_90, and GPU interpret mode) may issue wgmma: Hopper only."""
  return arch in (None, "cpu") or arch == "sm_90"


def has_tcgen05(arch: str | None) -> bool:
  """Whether kernels compiled for ``arch`` may issue tcgen05 MMAs: data-centre Blackwell (sm_100, sm_103)."""
  return arch in ("sm_100", "sm_103")


def gemv_mma(n_out: int, fits: bool, why: str, *, fp8: bool = False) -> tuple[dict, bool, str]:
  """A weight-streaming kernel's site with ``n_out`` weight rows, whose shapes ``fits`` (else ``why``) -> (its
  ``mma`` keyword for this trace's GPU — {} for Hopper's wgmma, the default —, fits, why) with what that form adds:
  the tcgen05 form (Blackwell) takes 128-row tiles (FP8 N % 128 == 0: one scale row a tile; BF16 N >= 128), and
  FP8 only as the dq kernels (fp8_dq on: the hi/lo kernels issue wgmma)."""
  arch = kernel_arch()
  if not has_tcgen05(arch) or not fits:
    return {}, fits, why
  if not (n_out % 128 == 0 if fp8 else n_out >= 128):
    need = "N % 128 == 0" if fp8 else "N >= 128"
    return {}, False, f"the tcgen05 form (on {arch}) takes 128-row tiles: {need} (here N = {n_out})"
  if fp8 and not kernel_switch("fp8_dq"):
    return {}, False, f"fp8_dq off: the hi/lo kernels issue wgmma, which {arch} does not have"
  return {"mma": "tcgen05"}, True, why


@contextlib.contextmanager
def use_kernels(policy: dict | None, arch: str | None = None):
  """Trace the enclosed code with the Pallas kernels switched by ``policy`` over KERNEL_DEFAULTS (other keys of
  the policy are ignored here); None: no kernels (the stock path). ``arch``: the GPU the step is compiled for
  (runtime.detect_platform: "sm_90", "sm_100", ...; None or "cpu": Hopper's, the CUDA lowering's default) — on one
  without wgmma the WGMMA_KNOBS kernels without a tcgen05 form it runs (TCGEN05_KNOBS) are declined at every site,
  with WGMMA_REASON."""
  # (merged switches, the names the policy sets explicitly: those ignore kernel_enabled's ``prefer``, the arch)
  tok = _KERNELS.set(None if policy is None else ({**KERNEL_DEFAULTS, **policy}, frozenset(policy), arch))
  try:
    yield
  finally:
    _KERNELS.reset(tok)


def _wgmma_form(row: bool, form: str):
  """The mHC boundary's forms other than the row form issue wgmma: model.fused_mhc sends no boundary here on a GPU
  without it — reaching one is a bug of that check, raised instead of left to ptxas."""
  if not row and not has_wgmma(kernel_arch()):
    raise AssertionError(f"the mHC boundary reached {form} (wgmma) on {kernel_arch()}: model.fused_mhc should have "
                         "declined it")


_TARGET: contextvars.ContextVar = contextvars.ContextVar("glm5_jax_target", default=None)


@contextlib.contextmanager
def compile_target(platform: str | None):
  """Trace the enclosed code for ``platform`` (runtime.detect_platform's: "sm_90", "cpu", ...; None: the default
  backend's) whatever the backend — what ``unroll_loops`` decides by. The Decoder's abstract traces set it (a
  compile-only census for an H200 on a CPU, the stock backend included, unrolls as the H200 does)."""
  tok = _TARGET.set(platform)
  try:
    yield
  finally:
    _TARGET.reset(tok)


def unroll_loops() -> bool:
  """Whether the model's small sequential loops (the mHC Sinkhorn's iterations, the chunked KDA's state hand-over)
  are unrolled: on a GPU each loop trip costs ~10-16 µs of control flow around kernels of a few µs; on the CPU
  unrolling only lengthens XLA's compile (90 Sinkhorn sites doubled it). The platform is the one the traced code
  is compiled for: ``compile_target``'s, else a kernel policy's (``use_kernels``' arch), else the default
  backend's."""
  got = _KERNELS.get()
  arch = _TARGET.get() or (None if got is None else got[2])
  return (arch or jax.default_backend()) != "cpu"


def kernel_arch() -> str | None:
  """The GPU the traced step is compiled for (``use_kernels``'s arch; None outside a policy or when unset)."""
  got = _KERNELS.get()
  return None if got is None else got[2]


def declined_on(arch: str | None, name: str) -> bool:
  """Whether knob ``name``'s kernel cannot run on ``arch``: it issues wgmma (WGMMA_KNOBS), the GPU has none, and
  the kernel has no tcgen05 form the GPU runs (TCGEN05_KNOBS)."""
  return name in WGMMA_KNOBS and not has_wgmma(arch) and not (name in TCGEN05_KNOBS and has_tcgen05(arch))


def _arch_declines(name: str) -> bool:
  return declined_on(kernel_arch(), name)


_REPORT: contextvars.ContextVar = contextvars.ContextVar("glm5_jax_kernel_report", default=None)


def kernel_switch(name: str) -> bool:
  """Whether the switch ``name`` is on in the active policy, without a report entry (for planning a call site
  whose own kernel_enabled decision depends on another kernel being available)."""
  got = _KERNELS.get()
  return got is not None and bool(got[0].get(name)) and not _arch_declines(name)


def kernel_enabled(name: str, rows: int | None = None, *, fits: bool = True, why: str = "", prefer: bool = True,
                   prefer_why: str = "") -> bool:
  """Whether the kernel ``name`` runs at this call site of the trace: on in the policy, ``rows`` (token rows,
  when given) within the weight-streaming kernels' MAX_KERNEL_ROWS, ``fits`` (the site's shape/dtype condition;
  ``why`` says what it needs), and ``prefer`` (XLA measured faster at this site: ``prefer_why``) unless the policy
  sets the switch explicitly. The decision and its reason go to the active ``kernel_report``."""
  got = _KERNELS.get()
  if got is None:
    return False
  pol, explicit, arch = got
  if not pol.get(name):
    reason = "off in the policy"
  elif _arch_declines(name):
    reason = WGMMA_REASON.format(arch=arch)
  elif rows is not None and rows > MAX_KERNEL_ROWS:
    reason = f"{rows} token rows > {MAX_KERNEL_ROWS}"
  elif not fits:
    reason = why or "the call site's shapes do not fit the kernel"
  elif name in NATIVE_WRONG and not _interpreting():
    reason = NATIVE_WRONG[name]
  elif not prefer and name not in explicit:
    reason = prefer_why or "XLA is faster at this site (the policy can force the kernel)"
  else:
    reason = None
  rep = _REPORT.get()
  if rep is not None:
    rep.append((name, reason))
  return reason is None


def _interpreting() -> bool:
  from pallas_kernels._common import interpreting  # noqa: PLC0415
  return interpreting()


@contextlib.contextmanager
def kernel_report():
  """Collect [(kernel, None if it runs at the site else why not)] for every kernel site traced inside."""
  rep: list = []
  tok = _REPORT.set(rep)
  try:
    yield rep
  finally:
    _REPORT.reset(tok)


_COUNTERS: contextvars.ContextVar = contextvars.ContextVar("glm5_step_counters", default=None)


@contextlib.contextmanager
def counters_scope():
  """The kernels traced inside share the step's counters (jax Refs, each created by its first user: one zero fill
  per step): the mHC grid barriers' pair (policy knob mhc_barrier_counters; boundary i gets parity i % 2 in trace
  order — the order the Ref's aliasing keeps on the device) and the linears' split-K counters (linear_fused_sum,
  moe_rows; moe_one_grid's call i on its bank i % 2). The trunk's layer loop opens one, and each MTP pass its own."""
  tok = _COUNTERS.set({"barrier": None, "parity": 0, "splitk": None, "splitk_side": None, "moe_parity": 0,
                       "kda_parity": 0})
  try:
    yield
  finally:
    _COUNTERS.reset(tok)


def _counters_enabled(knob: str) -> bool:
  """Whether ``knob`` (a counters-based kernel form) runs at this site: on the GPU, inside a counters scope —
  outside one (a module called alone) it is not a site of the knob at all."""
  if _COUNTERS.get() is None:
    return False
  return kernel_enabled(knob, fits=not _interpreting(), why="GPU interpret mode runs no counters (GMEM semaphores)")


def _next_barrier_counters(km, rows: int):
  """(the scope's grid-barrier counters Ref, this boundary's parity), the parity flipped for the next. ``rows``: the
  boundary's token rows — the scope's first boundary sizes the Ref (with mhc_ll_exchange at one row, the exchange
  words after the two counters; a verify step's several-row boundaries keep the two alone)."""
  cell = _COUNTERS.get()
  if cell["barrier"] is None:
    cell["barrier"] = km.barrier_counters(ll=kernel_switch("mhc_ll_exchange") and rows == 1)
  out = (cell["barrier"], cell["parity"])
  cell["parity"] ^= 1
  return out


_SIDE: contextvars.ContextVar = contextvars.ContextVar("glm5_side_chain", default=False)


@contextlib.contextmanager
def side_chain():
  """The GEMVs traced inside are a sublayer's side branch — the KDA gates' (beside the q/k/v projection), the
  indexer's (beside the MLA's q_a / q_b), the dense MLP's up (beside gate): under linear_fused_sum their K splits
  are summed on the scope's second split-K counters Ref. Every call on a Ref takes it as an aliased operand and
  returns it, which orders the calls on it: on one Ref the gates' two GEMVs ran after the 24 µs q/k/v GEMV instead
  of beside it (session 73's q = 4 critical path). A chain's own calls stay ordered on its Ref, as they must (each
  leaves its cells zero for the next)."""
  tok = _SIDE.set(True)
  try:
    yield
  finally:
    _SIDE.reset(tok)


def _splitk_counters(kl):
  """The scope's split-K counters Ref (pallas_kernels.linear.splitk_counters): the main chain's, or inside
  ``side_chain`` the side branches' own."""
  cell = _COUNTERS.get()
  key = "splitk_side" if _SIDE.get() else "splitk"
  if cell[key] is None:
    cell[key] = kl.splitk_counters()
  return cell[key]


DQ_F16_ROWS = ("at 2+ token rows the f16 inputs would be XLA conversions (+14 launches at q = 4): measured at "
               "one token row only (the policy can force it)")


def _next_moe_parity() -> int:
  """The one-grid MoE's counter bank for this call (policy knob moe_one_grid): 0, 1, 0, ... in trace order."""
  cell = _COUNTERS.get()
  out = cell["moe_parity"]
  cell["moe_parity"] ^= 1
  return out


def kda_grid_counters() -> dict:
  """The one-grid KDA + o_proj's counters at this site (policy knob kda_o_grid): the scope's split-K counters and
  this call's bank (0, 1, 0, ... in trace order) where they run — on the GPU, inside a counters scope — else {}
  (the kernel's two-launch form: GPU interpret mode, a module called alone)."""
  cell = _COUNTERS.get()
  if cell is None or _interpreting():
    return {}
  from pallas_kernels import linear as kl  # noqa: PLC0415
  out = {"counters": _splitk_counters(kl), "parity": cell["kda_parity"]}
  cell["kda_parity"] ^= 1
  return out


def _dq_dtype(rows: int) -> dict:
  """The dq kernels' dtype option at this site: f16 under the policy knob dq_f16 (by default at one token row,
  where the mHC boundary and W_UV write the f16 inputs: DQ_F16_ROWS), else bf16 (their default)."""
  return {"dq_dtype": "float16"} if kernel_enabled("dq_f16", rows, prefer=rows == 1, prefer_why=DQ_F16_ROWS) else {}


def balanced_splits() -> dict:
  """bf16_linear's ``balanced`` option (policy knob bf16_balanced_splits) at a site where the kernel runs."""
  return {"balanced": True} if kernel_enabled("bf16_balanced_splits") else {}


def _split_sums(kl, rows: int) -> dict:
  """Where a weight-streaming call's K splits are summed, as its options: in the kernel on the scope's split-K
  counters (policy knob linear_fused_sum), else by XLA after it — over token rows where ``part_rows`` says so."""
  return {"counters": _splitk_counters(kl)} if _counters_enabled("linear_fused_sum") else part_rows(rows)


def part_rows(rows: int) -> dict:
  """The weight-streaming kernels' ``part_rows`` option at a site of ``rows`` token rows (policy knob
  linear_part_rows): their K splits' partials as token rows where XLA sums them — from 2 rows up to the rows
  form's ROWS_OUT_MAX (at one row the accumulator's [split, N, 1] is already a row: nothing to gain)."""
  from pallas_kernels import linear as kl  # noqa: PLC0415
  fits = 2 <= rows <= kl.ROWS_OUT_MAX
  return {"part_rows": True} if kernel_enabled(
      "linear_part_rows", rows, fits=fits, why=f"{rows} token rows (2 to {kl.ROWS_OUT_MAX}: at one row the "
      "partials are rows already)") else {}


def f16_copies(rows: int) -> bool:
  """Whether the kernels before the dq kernels (the one-row mHC boundary, W_UV) also write their outputs in f16
  for them at a site of ``rows`` token rows: where ``_dq_dtype`` takes f16 (policy knob dq_f16; by default at one
  row only), no switch report of its own."""
  got = _KERNELS.get()
  return kernel_switch("dq_f16") and (rows == 1 or "dq_f16" in got[1])


def param(shape, dtype, axes):
  """A parameter of the given shape; created abstractly under nnx.eval_shape, zeros otherwise."""
  assert len(axes) == len(shape), (shape, axes)
  return nnx.Param(jnp.zeros(shape, dtype), axes=tuple(axes))


def mm(x, w, dtype):
  """x [..., in] @ w[out, in]^T in the compute dtype (HIGHEST precision: fp32 means fp32)."""
  return jnp.einsum("...i,oi->...o", x.astype(dtype), w.astype(dtype), precision=HIGHEST)


def dequant(w, scale, block, dtype):
  """W ≈ f32(W8) · scale_inv[r//b0, c//b1] over the last two dims (partial edge blocks allowed)."""
  if scale is None:
    return w.astype(dtype)
  b0, b1 = block
  r, c = w.shape[-2:]
  s = jnp.repeat(jnp.repeat(scale, b0, axis=-2), b1, axis=-1)[..., :r, :c]
  return (w.astype(jnp.float32) * s).astype(dtype)


def rms_norm(x, w, eps, dtype):
  """HF's RMSNorm: normalise in fp32, cast to the compute dtype, scale by w."""
  x32 = x.astype(jnp.float32)
  y = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  y = y.astype(dtype)
  return y if w is None else w.astype(dtype) * y


def swiglu_clamped(g, u, limit):
  """silu(min(g, L)) · clip(u, −L, L): the gate is clamped above only (spec §2)."""
  return jax.nn.silu(jnp.minimum(g, limit)) * jnp.clip(u, -limit, limit)


class Linear(nnx.Module):
  """y = x W^T with W [out, in] (BF16/F32, or FP8 E4M3 + fp32 block scales ``scale`` = weight_scale_inv)."""

  def __init__(self, n_in, n_out, dtype, axes, *, fp8_block=None):
    self.fp8_block = fp8_block
    if fp8_block is not None:
      self.weight = param((n_out, n_in), jnp.float8_e4m3fn, axes)
      self.scale = param((-(-n_out // fp8_block[0]), -(-n_in // fp8_block[1])), jnp.float32, axes)
    else:
      self.weight = param((n_out, n_in), dtype, axes)
      self.scale = None

  def w(self, dtype):
    return dequant(self.weight[...], None if self.scale is None else self.scale[...], self.fp8_block, dtype)

  def __call__(self, x, dtype, *, fused_sum: str | None = None, x16=None, one_row: str | None = None):
    """``fused_sum``: a site knob that turns linear_fused_sum's in-kernel K-split sum on at this call alone.
    ``x16``: x already in f16 (the mHC boundary's copy, policy knob dq_f16): the f16 dq kernel reads it instead of
    converting x (no conversion kernel before it); anything else reads x. ``one_row``: an unquantised weight's
    one-token-row knob (``_dense``)."""
    rows = x.size // x.shape[-1]
    n_out, n_in = self.weight.shape
    tiles = n_in % 128 == 0 and n_out % 64 == 0
    why = f"weight {n_out}x{n_in} (the kernels need in % 128 == 0 and out % 64 == 0)"
    mma, tiles, why = gemv_mma(n_out, tiles, why, fp8=True)  # (Blackwell: the dq kernel's tcgen05 form, or none)
    if self.scale is not None and kernel_enabled("fp8_linear", rows, fits=tiles, why=why):
      from pallas_kernels import linear as kl  # noqa: PLC0415 (kernels only where the backend asks for them)
      if kernel_enabled("fp8_dq", rows):  # linear_fused_sum: the K splits summed in the kernel (split-K counters)
        site = fused_sum is not None and _counters_enabled(fused_sum)  # (first: reported even under the global)
        fused = {"counters": _splitk_counters(kl)} if site or _counters_enabled("linear_fused_sum") else {}
        # fp8_scales_first: each CTA's block scales requested ahead of its weight tiles
        first = {"scales_first": True} if kernel_enabled("fp8_scales_first", rows) else {}
        # lean_barriers: built without Mosaic's automatic barriers (the ring's refill barrier placed by hand)
        lean = {"lean": True} if kernel_enabled("lean_barriers") else {}
        f16 = _dq_dtype(rows)
        fn = functools.partial(kl.fp8_dq_linear, **fused, **f16, **first, **lean, **mma,
                               **({} if fused else part_rows(rows)))
        x = x16 if f16 and x16 is not None else x
      else:
        fn = kl.fp8_linear
      return fn(x.reshape(rows, n_in), self.weight[...], self.scale[...],
                out_dtype=dtype).reshape(*x.shape[:-1], n_out)
    if self.scale is None:
      return _dense(x, self.weight[...], dtype, one_row=one_row)
    return mm(x, self.w(dtype), dtype)


def concat_fits(outs, fp8_block) -> bool:
  """Whether matrices with ``outs`` rows can be one ConcatLinear: always unquantised; FP8 only when every part
  is whole scale blocks."""
  return fp8_block is None or all(o % fp8_block[0] == 0 for o in outs)


ONE_ROW_GEMV = "1 token row: XLA's GEMV is as fast (policy bf16_linear: true forces the kernel)"


def _dense(x, w, dtype, *, prefix: bool = False, one_row: str | None = None):
  """x [..., in] @ w[out, in]^T for an unquantised weight: the bf16 GEMV kernel where the policy runs it and the
  shapes fit, else XLA (``mm``). prefix: x [..., >= in], its first ``in`` columns are the input (a wider
  producer's output read in place: a slice before the kernel's custom call is an XLA kernel of its own).
  one_row: a site knob (kda_qkv_kernel, kda_fg_b_kernel, indexer_wq_kernel) that takes the kernel at one token row
  too — where XLA's GEMV is preferred otherwise — with its K splits summed inside on the step's counters where they
  run (the GPU), else by XLA."""
  n_out, n_in = w.shape
  if x.shape[-1] != n_in and not (prefix and x.shape[-1] > n_in):
    raise ValueError(f"x [..., {x.shape[-1]}] for a weight {w.shape} (prefix={prefix})")
  rows = x.size // x.shape[-1]
  tiles = n_in % 128 == 0 and n_out % 8 == 0 and n_out >= 64
  why = (f"weight {n_out}x{n_in} (the kernel needs in % 128 == 0, out % 8 == 0 and out >= 64)" if not tiles
         else f"{w.dtype} weights (the kernel streams bf16)")
  mma, tiles, why = gemv_mma(n_out, tiles, why)
  fits = tiles and w.dtype == jnp.bfloat16
  site = one_row is not None and kernel_enabled(
      one_row, rows, fits=rows == 1 and fits and kernel_switch("bf16_linear"),
      why=f"one token row (here {rows}: from 2 the kernel runs anyway) and bf16_linear's kernel on and fitting ({why})")
  if kernel_enabled("bf16_linear", rows, fits=fits, why=why, prefer=rows > 1 or site, prefer_why=ONE_ROW_GEMV):
    from pallas_kernels import linear as kl  # noqa: PLC0415
    counters = site and _COUNTERS.get() is not None and not _interpreting()  # (the GPU, in a counters scope)
    sums = {"counters": _splitk_counters(kl)} if counters else _split_sums(kl, rows)
    return kl.bf16_linear(x.reshape(rows, x.shape[-1]), w, out_dtype=dtype, x_prefix=prefix, **sums,
                          **mma, **balanced_splits()).reshape(*x.shape[:-1], n_out)
  return mm(x[..., :n_in], w, dtype)


class ConcatLinear(Linear):
  """Replicated linears on the same input stored as one weight [Σ outs, in] (BF16/F32, or FP8 with the block
  scales' rows concatenated the same way): one GEMV — one FP8 kernel call — instead of one per matrix -> a tuple
  of outputs. Each matrix on its own was a separate XLA kernel of ~2 µs at decode (BENCHMARKS.md session 20), or
  a Mosaic call plus its epilogue. Only for replicated outputs (a TP split of the concatenated rows would not give
  each device its own rows of every matrix: sharded ones use StackedLinear). The checkpoint keeps the matrices
  under their own names (``checkpoint.CONCATS``)."""

  def __init__(self, n_in, outs: tuple[int, ...], dtype, axes, *, fp8_block=None):
    if axes[0] is not None:
      raise ValueError(f"ConcatLinear rows must be replicated, got axes {axes}")
    if not concat_fits(outs, fp8_block):
      raise ValueError(f"ConcatLinear of FP8 matrices with {outs} rows: each must be a multiple of the scale block "
                       f"{fp8_block[0]} (its scale rows are concatenated)")
    super().__init__(n_in, sum(outs), dtype, axes, fp8_block=fp8_block)
    self.outs = tuple(outs)

  def __call__(self, x, dtype, **kw):
    y = self.joint(x, dtype, **kw)
    cuts = [sum(self.outs[:i]) for i in range(1, len(self.outs))]
    return tuple(jnp.split(y, cuts, axis=-1))

  def joint(self, x, dtype, **kw):
    """The outputs side by side, unsplit: [..., Σ outs] (for consumers that read their columns in place)."""
    return super().__call__(x, dtype, **kw)


class StackedLinear(nnx.Module):
  """S linears of the same shape on the same input, stored as one weight [S, out, in] (BF16/F32): one GEMV reads
  them in one pass -> y [..., S · out_local] (the S outputs side by side, each this device's shard). For the KDA
  q/k/v projections: on the H200 XLA ran them as three 5.9 µs GEMVs (2.9 TB/s of 16.8 MB each, one TP4 rank)
  per layer, BENCHMARKS.md session 20. The checkpoint keeps the S matrices under their own names
  (``checkpoint.STACKS``). Block-diagonal use (``checkpoint.BLOCKDIAGS``): S matrices [out, r] on S different
  inputs, entry s = matrix s in input columns s·r.. and zeros elsewhere, applied to the S inputs side by side —
  the KDA f_b and g_b in one GEMV (the zeros add 1 MB of bf16 per TP4 rank and layer at rank 128)."""

  def __init__(self, n_in, n_out, stack: int, dtype, axes):
    self.weight = param((stack, n_out, n_in), dtype, (None, *axes))

  def __call__(self, x, dtype, *, prefix: bool = False, one_row: str | None = None):
    """prefix: x's first n_in columns are the input; one_row: the call's one-token-row knob (``_dense``)."""
    S, n_out, n_in = self.weight.shape
    # (the shard is contiguous)
    return _dense(x, self.weight[...].reshape(S * n_out, n_in), dtype, prefix=prefix, one_row=one_row)


class RMSNorm(nnx.Module):
  def __init__(self, dim, dtype, eps):
    self.weight = param((dim,), dtype, (None,))
    self.eps = eps

  def __call__(self, x, dtype):
    return rms_norm(x, self.weight[...], self.eps, dtype)


# ---------------------------------------------------------------------------------------------------- mHC
def hc_mix(m, scale, base, n, iters, eps, post_mult):
  """Spec §3.2 steps 3-6: normalised mixing logits m [..., 24] (pre, post, comb) -> (pre [..., n],
  post [..., n], comb [..., n, n]) with comb Sinkhorn-normalised (the softmax is the first row normalisation)."""
  return (*hc_pre_post(m, scale, base, n, eps, post_mult),
          sinkhorn_comb(m[..., 2 * n:], scale[2], base[2 * n:], n, iters, eps))


def hc_pre_post(m, scale, base, n, eps, post_mult):
  """Spec §3.2 steps 3-4: (pre [..., n], post [..., n]) from the mixing logits m [..., ≥ 2n]."""
  pre = jax.nn.sigmoid(m[..., :n] * scale[0] + base[:n]) + eps
  post = post_mult * jax.nn.sigmoid(m[..., n:2 * n] * scale[1] + base[n:2 * n])
  return pre, post


def sinkhorn_comb(mc, scale, base, n, iters, eps):
  """Spec §3.2 step 6: comb logits mc [..., n·n] (normalised, before the site's scale / base) -> comb
  [..., n, n]: a row softmax, then iters alternating column / row normalisations (the first column one here)."""
  c = (mc * scale + base).reshape(*mc.shape[:-1], n, n)
  c = jax.nn.softmax(c, axis=-1) + eps
  c = c / (jnp.sum(c, axis=-2, keepdims=True) + eps)

  def sinkhorn(_, c):
    c = c / (jnp.sum(c, axis=-1, keepdims=True) + eps)
    return c / (jnp.sum(c, axis=-2, keepdims=True) + eps)

  # Unrolled on accelerators (the 19 tiny steps fuse into a few kernels; a loop costs ~10 µs per iteration
  # there); rolled on CPU, where unrolling 90 sites doubles XLA's compile time for the same result.
  return lax.fori_loop(0, iters - 1, sinkhorn, c, unroll=unroll_loops())


def _chunk_sums(part, M: int):
  """The mHC kernels' partials [G, 64, 40] -> their sum over the column chunks for the M real rows only,
  transposed as the finish / Sinkhorn kernels take it: [40, Mp], Mp = M rounded up to 4 (16-byte rows: the
  kernels' TMA reads 64 columns and fills the rest with zeros). It reads G·M·40 floats instead of the whole
  [G, 64, 40] (655 KB per boundary; the all-rows reduction was 1.8 µs per boundary at M = 1, session 24); at
  M = 4 (q = 4) there is no pad at all — padded to 64 rows the reduction was a pad fusion + a reduction fusion per
  boundary (session 26's q = 4 profile: 90 + 90 launches); at M = 1 the pad to 4 rows is on the input side, fused
  into the reduction."""
  Mp = -(-M // 4) * 4
  return jnp.sum(jnp.pad(part[:, :M], ((0, 0), (0, Mp - M), (0, 0))) if Mp > M else part[:, :M], axis=0).T


class HyperConnection(nnx.Module):
  """One mHC site: 24 mixing logits from the 4 flattened streams, Sinkhorn-normalised 4×4 ``comb``."""

  def __init__(self, cfg: Glm5Config, dtype):
    self.fn = param((cfg.hc_mix, cfg.hc_dim), dtype, (None, None))
    # the checkpoint's base [24] and scale [3] (hc_*_base, hc_*_scale) in one vector: the fused boundary's finish
    # kernel reads both as one operand (as two packed slices XLA copied both per call: 180 copies of ~1 µs per
    # step on the H200, BENCHMARKS.md session 21); it stays a step argument of its own (param_packing.KEEP_WHOLE)
    self.base_scale = param((cfg.hc_mix + 3,), jnp.float32, (None,))
    self.n, self.iters, self.eps, self.norm_eps, self.post_mult = (
        cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps, cfg.hc_post_mult)

  @property
  def base(self):
    return self.base_scale[...][:-3]

  @property
  def scale(self):
    return self.base_scale[...][-3:]

  def mix(self, m):
    """m [..., 24] -> (pre [..., N], post [..., N], comb [..., N, N]) f32."""
    n = self.n
    # mhc_prefill_sinkhorn (the sites XLA runs: a prefill chunk's): the Sinkhorn as one kernel over the token rows
    # instead of the stock form's 19 unrolled normalisation pairs, ~40 tiny XLA kernels a site
    if not kernel_enabled("mhc_prefill_sinkhorn", fits=n == 4, why=f"{n} residual streams (the kernel takes 4)",
                          prefer=not _interpreting(), prefer_why="GPU interpret mode: seconds a call (the policy can "
                          "ask for it)"):
      return hc_mix(m, self.scale, self.base, n, self.iters, self.eps, self.post_mult)
    from pallas_kernels import mhc as km  # noqa: PLC0415
    R = math.prod(m.shape[:-1])
    Rp = -(-R // km.ROWS) * km.ROWS  # (the kernel's 64-row CTAs)
    mc = (m[..., 2 * n:] * self.scale[2] + self.base[2 * n:]).reshape(R, n * n)
    comb_t = km.sinkhorn_tokens(jnp.pad(mc, ((0, Rp - R), (0, 0))).T, iters=self.iters, eps=self.eps)
    return (*hc_pre_post(m, self.scale, self.base, n, self.eps, self.post_mult),
            comb_t[:, :R].T.reshape(*m.shape[:-1], n, n))

  def pre(self, X):
    """X [B, T, N, D] -> (u [B, T, D] in X's dtype, post [B, T, N] f32, comb [B, T, N, N] f32)."""
    flat = X.reshape(*X.shape[:-2], -1).astype(jnp.float32)
    if kernel_enabled("mhc_prefill"):
      # the input norm's per-row scale after the product (the same sum, rounded once more): the normalised f32
      # streams are never written — as norm(X) · fnᵀ XLA wrote and read them back at every site (2 x 33.5 MB of
      # f32 for a 512-token chunk's 16.8 MB of bf16 streams, session 77)
      rinv = lax.rsqrt(jnp.mean(flat * flat, axis=-1, keepdims=True) + self.norm_eps)
      fn = self.fn[...]
      bf16 = jnp.bfloat16
      if kernel_enabled("bf16_products", fits=X.dtype == bf16 and fn.dtype == bf16,
                        why=f"bf16 streams and fn (here {X.dtype} and {fn.dtype})"):
        # bf16 values times bf16 values are exact in f32: the product of the bf16 operands with f32 sums is the f32
        # product's, summed in another order — without the f32 copy of the streams the f32 GEMM reads
        m = jnp.einsum("...k,mk->...m", X.reshape(flat.shape), fn, preferred_element_type=jnp.float32) * rinv
      else:
        m = jnp.einsum("...k,mk->...m", flat, fn.astype(jnp.float32), precision=HIGHEST) * rinv
    else:  # (the reference's order: HF's normalised streams, then the projection)
      flat = flat * lax.rsqrt(jnp.mean(flat * flat, axis=-1, keepdims=True) + self.norm_eps)
      m = jnp.einsum("...k,mk->...m", flat, self.fn[...].astype(jnp.float32), precision=HIGHEST)
    pre, post, c = self.mix(m)
    u = jnp.einsum("...n,...nd->...d", pre, X.astype(jnp.float32), precision=HIGHEST)
    return u.astype(X.dtype), post, c

  @staticmethod
  def post(X, y, post, comb):
    """X'_m = post_m · y + Σ_n comb[n, m] · X_n, rounded once to X's dtype."""
    if kernel_switch("mhc_prefill"):  # (pre's kernel_enabled decided it: no condition but the policy's)
      # the 4-term sums written out: one elementwise pass that XLA fuses with the rounding and the next site's sum
      # of squares — the einsum below is a GEMM writing the f32 streams for that fusion to read back
      N = X.shape[-2]
      Xf, yf = X.astype(jnp.float32), y.astype(jnp.float32)
      out = jnp.stack([post[..., m, None] * yf + sum(comb[..., n, m, None] * Xf[..., n, :] for n in range(N))
                       for m in range(N)], axis=-2)
    else:
      out = post[..., :, None] * y[..., None, :].astype(jnp.float32) + jnp.einsum(
          "...nm,...nd->...md", comb, X.astype(jnp.float32), precision=HIGHEST)
    return out.astype(X.dtype)

  # -------------------------------------------------------------- fused boundary (pallas_kernels/mhc.py)
  def fused(self, X2, pending, norm: "RMSNorm", x16: bool = False):
    """The kernel path of a boundary: the previous sublayer's post fused with this site's pre and the sublayer
    RMSNorm. X2 [M, N·D] bf16 residual *before* the previous post; pending = (y [M, D], mix) of the previous
    sublayer, or None at the first site -> (X2' [M, N·D] after the post, x_in [M, D] = norm(u), mix = (post_t
    [N, C], comb_t [N·N, C]) f32: this site's post and comb for the next boundary, transposed — a column per token
    row, C = M rounded up to 64, pallas_kernels.mhc.mix_rows reads them back). Rows beyond 64 go in chunks of 64
    (a chunk's mix is its 64 columns). ``x16`` (policy knob dq_f16, for a sublayer whose FP8 kernels read x in
    f16): x_in as (bf16, f16) where the boundary kernel writes both (the one-launch forms), else x_in alone (the
    sublayer's kernels convert it)."""
    from pallas_kernels import mhc as km  # noqa: PLC0415
    M, R = X2.shape[0], km.ROWS
    if M > R:
      parts = [self.fused(X2[i:i + R], None if pending is None else
                          (pending[0][i:i + R], tuple(a[:, i:i + R] for a in pending[1])), norm)
               for i in range(0, M, R)]
      return (jnp.concatenate([p[0] for p in parts], axis=0), jnp.concatenate([p[1] for p in parts], axis=0),
              tuple(jnp.concatenate([p[2][j] for p in parts], axis=1) for j in range(2)))
    y, mix = pending if pending is not None else (None, None)
    # approximate reciprocal / exp / rsqrt in the kernels (like the sparse MLA and indexer kernels): 5.15 -> 4.84
    # µs per finish call alone on the H200, post/comb within 9.2e-7 relative of the exact kernel, x_in
    # bit-identical (bench_mhc, session 24); the GPU tests hold it to the exact kernel's tolerances
    consts = dict(iters=self.iters, eps=self.eps, hc_norm_eps=self.norm_eps, post_mult=self.post_mult,
                  approx_math=True)
    coef, D = self.base_scale[...], X2.shape[1] // km.N
    split = kernel_switch("mhc_finish") and kernel_switch("mhc_sinkhorn_split")
    # mhc_row (one token row; up to PARTS_MAX_ROWS with mhc_rows): a column of every stream per thread, D / 128
    # CTAs at the grid barrier; else mhc_post_finish's D / 32
    row_rows = M == 1 or (1 < M <= km.PARTS_MAX_ROWS and kernel_switch("mhc_rows"))
    row_form = kernel_switch("mhc_row") and row_rows and D % km.ROW_COLS == 0
    cols = km.ROW_COLS if row_form else km.GRID_COLS
    grid_fits = split and M <= km.PARTS_MAX_ROWS and D // cols <= km.GRID_MAX_CTAS
    if kernel_enabled("mhc_grid_barrier", fits=grid_fits,
                      why=f"needs mhc_finish and mhc_sinkhorn_split on, up to {km.PARTS_MAX_ROWS} token rows (here "
                      f"{M}) and a hidden size up to {km.GRID_MAX_CTAS * cols} (here {D})"):
      # the boundary in ONE launch (a grid barrier between the post + pre logits and the RMSNorm'd sublayer
      # input); the Sinkhorn of comb for the next boundary from its raw partials, off the critical path
      kernel_enabled("mhc_finish"), kernel_enabled("mhc_sinkhorn_split")
      counters, parity = (_next_barrier_counters(km, M) if _counters_enabled("mhc_barrier_counters") else (None, 0))
      # mhc_row: at one token row, a column of every stream per thread (no 64-row tiles for one real row)
      row = kernel_enabled("mhc_row", fits=row_rows and D % km.ROW_COLS == 0,
                           why=f"one token row (here {M}; up to {km.PARTS_MAX_ROWS} with mhc_rows) and a hidden size "
                           f"a multiple of {km.ROW_COLS} (here {D})")
      if M > 1:
        kernel_enabled("mhc_rows", fits=row, why="mhc_row declined here")
      _wgmma_form(row, "mhc_post_finish")
      # lean_barriers: the boundary built without Mosaic's automatic barriers, its own where the data needs them
      lean = kernel_enabled("lean_barriers")
      # mhc_row_scalars: the one-row boundary's normalisation (the 14 sums, pre, 1/RMS) on scalars in registers
      scalars = kernel_enabled("mhc_row_scalars", fits=row and M == 1,
                               why=f"the row form at one token row (here {M} rows, row form {row})")
      # mhc_ll_exchange: the one-row boundary's partial sums by the low-latency exchange instead of its grid barrier
      words = counters is not None and counters.shape[0] > 2  # (the Ref sized by the scope's first boundary)
      ll = kernel_enabled("mhc_ll_exchange", fits=row and M == 1 and words,
                          why=f"the row form at one token row on the step's barrier counters with the exchange's "
                          f"words (here {M} rows, row form {row}, counters {counters is not None}, words {words})")
      Xn, x_in, part = (km.mhc_row_boundary if row else km.mhc_post_finish)(
          X2, y, mix, self.fn[...], coef, norm.weight[...], first=pending is None, norm_eps=norm.eps, eps=self.eps,
          hc_norm_eps=self.norm_eps, approx_math=True, counters=counters, parity=parity, lean=lean,
          **({"x16": True} if x16 else {}), **({"scalars": True} if scalars else {}), **({"ll": True} if ll else {}))
      return Xn, x_in, km.mhc_sinkhorn(part, coef, D=D, rows=M, **consts)
    narrow = kernel_enabled("mhc_narrow", fits=D % km.DC_FIN == 0, why=f"hidden size {D}")
    _wgmma_form(False, "mhc_post_pre")
    Xn, part = km.mhc_post_pre(X2, y, mix, self.fn[...], first=pending is None, cols=32 if narrow else km.DC)
    # mhc_fused_sums: the finish / Sinkhorn kernels sum the raw partials themselves (no XLA reduction between the
    # kernels on the sublayer's critical path)
    raw = kernel_switch("mhc_finish") and kernel_enabled(
        "mhc_fused_sums", fits=M <= km.PARTS_MAX_ROWS,
        why=f"{M} token rows (the kernels sum the partials of up to {km.PARTS_MAX_ROWS} rows in SMEM)")
    tot_t = part if raw else _chunk_sums(part, M)
    if kernel_enabled("mhc_finish"):
      finish = functools.partial(km.mhc_finish, cols=64 if narrow else km.DC_FIN)
      if kernel_enabled("mhc_sinkhorn_split"):
        x_in = finish(Xn, tot_t, coef, norm.weight[...], norm_eps=norm.eps, sinkhorn=False, **consts)
        return Xn, x_in, km.mhc_sinkhorn(tot_t, coef, D=D, rows=M if raw else None, **consts)
    else:
      finish = km.mhc_finish_reference
    x_in, post_t, comb_t = finish(Xn, tot_t, coef, norm.weight[...], norm_eps=norm.eps, **consts)
    return Xn, x_in, (post_t, comb_t)

  @staticmethod
  def unpack(mix, lead):
    """The transposed mix of ``fused`` -> (post [*lead, N], comb [*lead, N, N]) of its first prod(lead) rows."""
    from pallas_kernels import mhc as km  # noqa: PLC0415
    post, comb = km.mix_rows(mix, math.prod(lead))
    return post.reshape(*lead, km.N), comb.reshape(*lead, km.N, km.N)


# ---------------------------------------------------------------------------------------------------- MLPs
class MLP(nnx.Module):
  """Dense clamped-SwiGLU MLP (layers 0-2) and the shared expert; column/row parallel on I."""

  def __init__(self, cfg: Glm5Config, inter, dtype, fp8_block):
    D = cfg.hidden_size
    self.gate_proj = Linear(D, inter, dtype, (FFN, EMBED), fp8_block=fp8_block)
    self.up_proj = Linear(D, inter, dtype, (FFN, EMBED), fp8_block=fp8_block)
    self.down_proj = Linear(inter, D, dtype, (EMBED, FFN), fp8_block=fp8_block)
    self.limit = cfg.swiglu_limit

  def partial(self, x, dtype, *, x16=None):
    """This shard's contribution (the caller psums it)."""
    with side_chain():  # (up beside gate, also under linear_fused_sum)
      up = self.up_proj(x, dtype, x16=x16)
    h = swiglu_clamped(self.gate_proj(x, dtype, x16=x16), up, self.limit)
    return self.down_proj(h, dtype)

  def __call__(self, x, dtype, *, x16=None):
    """``x16``: x's f16 copy for the f16 dq kernels (``Linear``)."""
    return lax.psum(self.partial(x, dtype, x16=x16), TP)


def topk_by_rank(v, k: int, values=None):
  """lax.top_k(v, k)'s indices [..., k] int32 without a sort: each entry's rank = how many entries beat it (larger,
  or equal at a lower index — lax.top_k's order for ties), then the index of rank r for r < k. One compare-and-
  count over [..., N, N] and one select over [..., k, N]: a reduction fusion or two instead of an XLA sort (every
  GPU top_k is a sort, ~10 µs at decode sizes). For small N (the router's 288). Compared as lax.top_k does, in
  its total order of f32 bit patterns (NaN above +inf, -NaN below -inf, +0 above -0): the same selection for any
  input, NaN scores included (the NaN then reaches the output and the step flags the row).

  ``values`` [..., N] (optional): also returns take_along_axis(values, ids), exactly — from the same select (one
  nonzero term per sum), so XLA makes it one reduction with the indices instead of a gather after them."""
  from pallas_kernels._common import order_key  # noqa: PLC0415 (shared with the router kernel)
  N = v.shape[-1]
  key = order_key(v)
  idx = jnp.arange(N, dtype=jnp.int32)
  ke, kj = key[..., :, None], key[..., None, :]  # [..., N (entry), N (rival)]
  beats = (kj > ke) | ((kj == ke) & (idx[None, :] < idx[:, None]))
  rank = jnp.sum(beats, axis=-1, dtype=jnp.int32)  # [..., N], a permutation of 0..N-1
  at = rank[..., None, :] == jnp.arange(k, dtype=jnp.int32)[:, None]  # [..., k, N]: one True per row
  ids = jnp.sum(jnp.where(at, idx, 0), axis=-1, dtype=jnp.int32)
  if values is None:
    return ids
  # (where, not a product: a NaN or inf elsewhere in the row must not leak into the picked value)
  return ids, jnp.sum(jnp.where(at, values[..., None, :], jnp.zeros((), values.dtype)), axis=-1)


def exclusive_prefix_sum(x, block: int | str | None = None):
  """Σ_{j < i} x[..., j] along the last axis (int). block None: one jnp.cumsum (XLA GPU: one reduce-window
  fusion, 11 µs for 8,256 entries in the indexer's top-k, session 23); block b: a cumsum within blocks of b and
  one over the N / b block totals — the same sums, less work (still a reduce-window fusion: 11.3 µs per DSA layer
  in session 29's q = 1 profile). (The sums within blocks as one matmul with a triangle of ones were a tie or
  slower in the step, session 36, and were removed.)"""
  if block is None:
    return jnp.cumsum(x, axis=-1) - x
  N = x.shape[-1]
  pad = (-N) % block
  xb = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)]).reshape(*x.shape[:-1], -1, block)
  within = jnp.cumsum(xb, axis=-1)
  tot = within[..., -1]
  inc = within + (jnp.cumsum(tot, axis=-1) - tot)[..., None]
  return inc.reshape(*x.shape[:-1], -1)[..., :N] - x


def topk_set_by_threshold(v, k: int, *, digit_bits: int = 8, scan_block: int | None = None,
                          threshold_kernel: int = 0, threshold_warpgroups: int = 1, kernel_scores=None,
                          threshold_exit: bool = False):
  """The SET lax.top_k(v, k) selects, without a sort, as indices [..., k] int32 in ascending index order (an
  unselected slot can only arise for k > N: -1). For large N (the indexer's top-512 of up to max_context / 4
  pools), where ``topk_by_rank``'s N × N count is too much work and XLA's GPU sort is ~58 µs per call
  (BENCHMARKS.md, session 20).

  1. The k-th largest key T, exactly, by radix selection on the 32-bit monotone key (``topk_by_rank``'s total
     order), ``digit_bits`` per pass: each pass counts #{key >= t} for the 2^digit_bits candidate thresholds of
     the next digit at once ([..., 2^digit_bits, N] compare-and-count: one reduction) and keeps the largest t
     with a count >= k. (Digits from a histogram of the still-matching entries — a scatter-add, O(N) per pass —
     measured slower on the H200 at every size, bench_topk session 24, and were removed.) With
     ``threshold_kernel`` (1 or 2; True = 1): T and #{key > T} from one Mosaic kernel instead
     (``pallas_kernels.indexer.topk_threshold``: a CTA per row, 32 / threshold_kernel passes over the row in
     registers; ``threshold_warpgroups``: its warpgroups per CTA, each holding a share of the row) — ~13 XLA
     kernels fewer. ``kernel_scores`` [prod(lead), Np >= N] f32: what the kernel reads instead of v's keys —
     the scores kernel's padded output (v's values, then -inf; rows laid out as v's), whose keys the kernel forms
     itself: no XLA kernel in front of it. Np a multiple of 128 · threshold_warpgroups. ``threshold_exit``: the
     kernel's passes stop once a candidate has exactly k keys at or above it (T is then one below it and
     #{key > T} = k: step 2 takes no tie).
  2. Selected: key > T, and of the entries equal to T the first k - #{key > T} by index (lax.top_k's tie
     order); the count of selected entries up to each index from ONE prefix sum (the two prefix counts packed in
     one int32; ``scan_block``: exclusive_prefix_sum's blocking), then one scatter of each selected index to its
     slot. (Finding the s-th selected index by a [..., k, N] compare-and-count instead of the scatter measured
     3-40 µs slower per call, bench_topk session 24.)"""
  N = v.shape[-1]
  lead = v.shape[:-1]
  from pallas_kernels._common import order_key_u32  # noqa: PLC0415 (shared with the threshold kernel)
  u = order_key_u32(v)  # order_key's order as unsigned compares
  kk = min(k, N)
  if 32 % digit_bits:
    raise ValueError(f"digit_bits={digit_bits}: the compare-and-count passes need a divisor of 32")
  if kernel_scores is not None and not threshold_kernel:
    raise ValueError("topk_set_by_threshold: kernel_scores without threshold_kernel (only the kernel reads them)")
  if threshold_kernel:
    from pallas_kernels import indexer as ki  # noqa: PLC0415 (kernels import lazily)
    rows_ = math.prod(lead)
    lanes = ki.THRESHOLD_LANES * threshold_warpgroups  # (pads: key 0, the smallest — never above a real key)
    if kernel_scores is not None:
      if kernel_scores.shape[0] != rows_ or kernel_scores.shape[1] < N or kernel_scores.dtype != jnp.float32:
        raise ValueError(f"topk_set_by_threshold: kernel_scores {kernel_scores.shape} {kernel_scores.dtype}, "
                         f"expected f32 [{rows_}, >= {N}] (the scores kernel's padded output)")
      up = kernel_scores
    else:
      up = jnp.pad(u.reshape(rows_, N), ((0, 0), (0, (-N) % lanes)))
    t, n_gt = (a.reshape(lead) for a in ki.topk_threshold(up, kk, digit_bits=int(threshold_kernel),
                                                           warpgroups=threshold_warpgroups,
                                                           early_exit=threshold_exit))
  elif threshold_exit:
    raise ValueError("topk_set_by_threshold: threshold_exit without threshold_kernel (the kernel's early exit)")
  else:
    t = jnp.zeros(lead, jnp.uint32)  # invariant: #{u >= t} >= kk
    digits = jnp.arange(1 << digit_bits, dtype=jnp.uint32)
    for shift in range(32 - digit_bits, -1, -digit_bits):
      cand = t[..., None] | (digits << jnp.uint32(shift))  # [..., 2^b] thresholds, increasing
      cnt = jnp.sum(u[..., None, :] >= cand[..., :, None], axis=-1, dtype=jnp.int32)  # non-increasing in the digit
      d = jnp.sum(cnt >= kk, axis=-1, dtype=jnp.int32) - 1  # the largest digit keeping >= kk entries (>= 0)
      t = t | (d.astype(jnp.uint32) << jnp.uint32(shift))
    n_gt = jnp.sum(u > t[..., None], axis=-1, dtype=jnp.int32)
  gt, eq = u > t[..., None], u == t[..., None]
  need_eq = kk - n_gt  # >= 1 where T is an entry's key; 0 after the kernel's early exit (the top k are > T)
  g32, e32 = gt.astype(jnp.int32), eq.astype(jnp.int32)
  if N < 1 << 15:  # both exclusive prefix counts from one prefix sum, packed in an int32
    both = exclusive_prefix_sum(g32 + (e32 << 16), scan_block)
    n_gt, n_eq = both & 0xFFFF, both >> 16
  else:  # (they would not fit: two)
    n_gt, n_eq = exclusive_prefix_sum(g32, scan_block), exclusive_prefix_sum(e32, scan_block)
  sel = gt | (eq & (n_eq < need_eq[..., None]))
  slot = jnp.where(sel, n_gt + jnp.minimum(n_eq, need_eq[..., None]), k)  # k = dropped
  rows = math.prod(lead)
  out = jnp.full((rows, k), -1, jnp.int32).at[jnp.arange(rows)[:, None], slot.reshape(rows, N)].set(
      jnp.broadcast_to(jnp.arange(N, dtype=jnp.int32), (rows, N)), mode="drop")
  return out.reshape(*lead, k)


class Router(nnx.Module):
  def __init__(self, cfg: Glm5Config, dtype):
    self.weight = param((cfg.n_routed_experts, cfg.hidden_size), dtype, (None, EMBED))
    self.e_score_correction_bias = param((cfg.n_routed_experts,), jnp.float32, (None,))
    self.top_k, self.scaling, self.norm = cfg.num_experts_per_tok, cfg.routed_scaling_factor, cfg.norm_topk_prob

  def kernel_fits(self, E: int) -> tuple[bool, str]:
    """(whether the router kernels take E experts of top-k, why not)."""
    k = self.top_k
    return (E % 4 == 0 and k % 4 == 0 and k <= min(E, 128),
            f"k = {k} of E = {E} experts (the kernel takes k and E multiples of 4, k <= 128)")

  def with_tables(self, x, *, n_pad: int, mp: int, shared: bool):
    """x [M, D] (2 <= M <= router.ROUTE_MAX_ROWS) -> (ids [M, k], weights [M, k], fp8_moe's slot tables (eids,
    n_valid, r)) from ONE kernel: the router kernel's selection and moe_route's tables (router.router_route)."""
    from pallas_kernels import router as kr  # noqa: PLC0415
    logits = self.logits(x).astype(jnp.float32)
    ids, w, *tables = kr.router_route(logits, self.e_score_correction_bias[...].astype(jnp.float32), k=self.top_k,
                                      scaling=float(self.scaling), norm=bool(self.norm),
                                      num_experts=logits.shape[-1], n_pad=n_pad, mp=mp, shared=shared)
    return ids, w, tuple(tables)

  def __call__(self, x):
    """x [..., D] -> (ids [..., k] int32, weights [..., k] f32). fp32 logits; the bias only selects."""
    logits = self.logits(x)
    E, k = logits.shape[-1], self.top_k
    rows = math.prod(logits.shape[:-1])  # the [rows, E, E] comparison is for decode batches, not prefill
    fits, why = self.kernel_fits(E)
    if kernel_enabled("router_kernel", rows, fits=fits, why=why):
      from pallas_kernels import router as kr  # noqa: PLC0415
      ids, w = kr.router_topk(logits.reshape(rows, E).astype(jnp.float32),
                              self.e_score_correction_bias[...].astype(jnp.float32), k=k,
                              scaling=float(self.scaling), norm=bool(self.norm))
      return ids.reshape(*logits.shape[:-1], k), w.reshape(*logits.shape[:-1], k)
    s = jax.nn.sigmoid(logits)
    biased = s + self.e_score_correction_bias[...]
    if kernel_enabled("router_topk", rows):
      ids, w = topk_by_rank(biased, self.top_k, s)
      # the k terms summed as explicit adds in rank order (elementwise: XLA fuses them into the consumer instead
      # of a reduction kernel; a reduction may associate them differently: an ulp in the renormalised weights)
      tot = functools.reduce(jnp.add, [w[..., j:j + 1] for j in range(self.top_k)])
    else:
      _, ids = lax.top_k(biased, self.top_k)
      w = jnp.take_along_axis(s, ids, axis=-1)
      tot = jnp.sum(w, axis=-1, keepdims=True)
    if self.norm:
      w = w / (tot + 1e-20)
    return ids.astype(jnp.int32), w * self.scaling

  def logits(self, x):
    """x [..., D] -> f32 [..., E]: f32(x) · f32(W)ᵀ. With bf16 x and W the bf16 GEMV kernel computes the same
    products exactly (f32 accumulation, another summation order); at q = 4 XLA's gemm fusion of this took 10.9 µs
    per MoE layer (0.47 ms per step, session 23); the kernel streams bf16 weights at ~3 TB/s (BENCHMARKS.md)."""
    w = self.weight[...]
    (E, D), rows = w.shape, x.size // x.shape[-1]
    ok = x.dtype == w.dtype == jnp.bfloat16 and D % 128 == 0 and E % 8 == 0 and E >= 64
    why = (f"bf16 router input and weight with D % 128 == 0, E % 8 == 0, E >= 64 ({x.dtype}, {w.dtype}, {D}, {E}; "
           "other dtypes would round x or W)")
    mma, ok, why = gemv_mma(E, ok, why)
    if kernel_enabled("bf16_linear", rows, fits=ok, prefer=rows > 1, prefer_why=ONE_ROW_GEMV, why=why):
      from pallas_kernels import linear as kl  # noqa: PLC0415
      # (under linear_fused_sum the K splits summed in the kernel, as every linear's: XLA's reduction between the
      # GEMV and router_route was a launch on the MoE sublayer's chain at q = 4, 42 a step)
      return kl.bf16_linear(x.reshape(rows, D), w, **_split_sums(kl, rows), **mma,
                            **balanced_splits()).reshape(*x.shape[:-1], E)
    # (not at one token row — a decode step's router, where XLA's f32 GEMV stays: not measured with bf16 products)
    if rows > 1 and kernel_enabled("bf16_products", fits=x.dtype == w.dtype == jnp.bfloat16,
                                   why=f"bf16 router input and weight (here {x.dtype} and {w.dtype})"):
      # (bf16 times bf16 is exact in f32: the f32 product's terms in another order, without f32 copies of x and W)
      return jnp.einsum("...d,ed->...e", x, w, preferred_element_type=jnp.float32)
    return jnp.einsum("...d,ed->...e", x.astype(jnp.float32), w.astype(jnp.float32), precision=HIGHEST)


class Experts(nnx.Module):
  """The routed experts, stacked: gate/up [E, I, D], down [E, D, I] (FP8 + [E, I/128, D/128] scales)."""

  def __init__(self, cfg: Glm5Config, dtype, fp8_block):
    E, I, D = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    self.fp8_block = fp8_block

    def w(shape, axes):
      if fp8_block is None:
        return param(shape, dtype, axes), None
      sshape = (shape[0], -(-shape[1] // fp8_block[0]), -(-shape[2] // fp8_block[1]))
      return param(shape, jnp.float8_e4m3fn, axes), param(sshape, jnp.float32, axes)

    self.gate_proj, self.gate_scale = w((E, I, D), (None, FFN, EMBED))
    self.up_proj, self.up_scale = w((E, I, D), (None, FFN, EMBED))
    self.down_proj, self.down_scale = w((E, D, I), (None, EMBED, FFN))
    self.limit = cfg.swiglu_limit

  def _w(self, name, ids, dtype):
    w = getattr(self, name)[...]
    s = getattr(self, name.replace("_proj", "_scale"))
    w = w if ids is None else w[ids]
    s = None if s is None else (s[...] if ids is None else s[...][ids])
    return dequant(w, s, self.fp8_block, dtype)

  def partial(self, x, ids, weights, dtype):
    """x [M, D], ids/weights [M, k] -> this shard's Σ_j w_j · expert_{ids_j}(x) [M, D] (f32)."""
    M, k = ids.shape
    E = self.gate_proj.shape[0]
    if M * k < E:  # decode: read only the selected experts' weights
      g = jnp.einsum("md,mkid->mki", x.astype(dtype), self._w("gate_proj", ids, dtype), precision=HIGHEST)
      u = jnp.einsum("md,mkid->mki", x.astype(dtype), self._w("up_proj", ids, dtype), precision=HIGHEST)
      h = swiglu_clamped(g, u, self.limit)
      y = jnp.einsum("mki,mkdi->mkd", h, self._w("down_proj", ids, dtype), precision=HIGHEST)
      return jnp.einsum("mkd,mk->md", y.astype(jnp.float32), weights, precision=HIGHEST)
    # many tokens (prefill): the routed pairs as grouped FP8 GEMMs where the policy runs them (moe_prefill) ...
    I, D = self.gate_proj.shape[1:]
    fits = tuple(self.fp8_block or ()) == (128, 128) and I % 128 == 0 and D % 128 == 0
    if kernel_enabled("moe_prefill", fits=fits,
                      why=f"FP8 128x128-block expert weights with I, D multiples of 128 (here {self.fp8_block}, "
                      f"I = {I}, D = {D})", prefer=not _interpreting(),
                      prefer_why="GPU interpret mode: seconds a call (the policy can ask for it)"):
      from pallas_kernels import moe_prefill as kp  # noqa: PLC0415
      # (Blackwell: the grouped GEMMs' tcgen05 form)
      mma = {"mma": "tcgen05"} if has_tcgen05(kernel_arch()) else {}
      rows = kernel_enabled("moe_prefill_rows")
      mp = kp.tile_rows(M * k, E)
      resident = kernel_enabled("moe_prefill_resident", fits=not mma and kp.resident_sub_tiles(D, I, mp) > 1,
                                why="the grouped down launch's wgmma form with h's row tile within "
                                "moe_prefill.RESIDENT_MAX_BYTES")
      tokens_m = kernel_enabled("moe_prefill_tokens_m", fits=resident and rows and mp == 64,
                                why=f"moe_prefill_resident and moe_prefill_rows with 64-row tiles (here {mp}: "
                                f"{M} tokens x {k} over {E} experts)")
      return kp.fp8_moe_prefill(x, ids, weights, self.gate_proj[...], self.gate_scale[...], self.up_proj[...],
                                self.up_scale[...], self.down_proj[...], self.down_scale[...],
                                swiglu_limit=float(self.limit), rows=rows, down_resident=resident,
                                down_tokens_m=tokens_m, **mma)
    # ... else every expert over every token, combined with a dense [M, E] weight matrix
    comb = jnp.zeros((M, E), jnp.float32).at[jnp.arange(M)[:, None], ids].add(weights)
    g = jnp.einsum("md,eid->mei", x.astype(dtype), self._w("gate_proj", None, dtype), precision=HIGHEST)
    u = jnp.einsum("md,eid->mei", x.astype(dtype), self._w("up_proj", None, dtype), precision=HIGHEST)
    h = swiglu_clamped(g, u, self.limit)
    y = jnp.einsum("mei,edi->med", h, self._w("down_proj", None, dtype), precision=HIGHEST)
    return jnp.einsum("med,me->md", y.astype(jnp.float32), comb, precision=HIGHEST)


class MoE(nnx.Module):
  def __init__(self, cfg: Glm5Config, dtype, fp8_block):
    self.gate = Router(cfg, dtype)
    self.experts = Experts(cfg, dtype, fp8_block)
    self.shared_experts = (MLP(cfg, cfg.moe_intermediate_size * cfg.n_shared_experts, dtype, fp8_block)
                           if cfg.n_shared_experts else None)

  def __call__(self, x, dtype, *, return_ids=False, x16=None):
    """x [B, T, D] -> [B, T, D]; one psum for routed + shared. ``x16``: x's f16 copy (the mHC boundary's, policy
    knob dq_f16): the f16 MoE kernels read it instead of converting x; the router reads x."""
    lead = x.shape[:-1]
    xf = x.reshape(-1, x.shape[-1])
    ex = self.experts
    rows, k, E = xf.shape[0], self.gate.top_k, ex.gate_proj.shape[0]
    mma, moe_fits, moe_why = gemv_mma(ex.gate_proj.shape[1], ex.fp8_block is not None
                                      and ex.gate_proj.shape[1] % 128 == 0, "FP8 expert weights with I % 128 == 0",
                                      fp8=True)  # (Blackwell: the tcgen05 form)
    moe_kernel = kernel_enabled("fp8_moe", rows, fits=moe_fits, why=moe_why)
    tables, in_gate_up = None, False
    if moe_kernel:
      from pallas_kernels import linear as kl  # noqa: PLC0415
      from pallas_kernels import router as kr  # noqa: PLC0415
      se = self.shared_experts  # (config: 0 or 1 shared expert, of the routed width) slot 0 of the same kernels
      sew = None if se is None else (se.gate_proj.weight[...], se.gate_proj.scale[...], se.up_proj.weight[...],
                                     se.up_proj.scale[...], se.down_proj.weight[...], se.down_proj.scale[...])
      dq = kernel_enabled("fp8_dq", xf.shape[0])
      f16 = _dq_dtype(xf.shape[0]) if dq else {}
      xk = x16.reshape(xf.shape) if f16 and x16 is not None else xf  # (the kernels' x)
      fits, why = self.gate.kernel_fits(E)
      # moe_router_in_kernel: at one token row the router's selection inside fp8_moe's gate/up kernel (every CTA
      # selects for itself before its first weight request): no router kernel between the logits and the MoE.
      # It takes precedence over linear_fused_sum's MoE form (whose kernels take the router's output): the MoE's
      # own rows form with the selection inside is moe_rows.
      in_gate_up = kernel_enabled(
          "moe_router_in_kernel", rows, fits=rows == 1 and fits and kernel_switch("router_kernel"),
          why=f"one token row (here {rows}), router_kernel on and fitting ({why})")
      # linear_fused_sum: the down kernel's expert groups summed in it and written as the token rows — in the
      # model's dtype where no all-reduce follows (one device per TP group: what the psum would sum, rounded once),
      # in f32 before a real one (the partial sums stay f32, as the XLA form's)
      fused = {}
      if dq and not in_gate_up and _counters_enabled("linear_fused_sum"):
        fused = dict(counters=_splitk_counters(kl), out_dtype=dtype if lax.axis_size(TP) == 1 else jnp.float32)
    with jax.named_scope("router"):
      if moe_kernel and not in_gate_up:
        route = rows > 1 and kernel_enabled("moe_route", fits=rows * k <= kl.ROUTE_MAX_PAIRS,
                                            why=f"{rows} token rows x {k} experts > {kl.ROUTE_MAX_PAIRS} pairs")
        # router_route: the router kernel builds moe_route's slot tables too (one launch instead of two)
        if route and kernel_switch("router_kernel") and kernel_enabled(
            "router_route", fits=fits and rows <= kr.ROUTE_MAX_ROWS,
            why=f"{rows} token rows (the kernel takes 2..{kr.ROUTE_MAX_ROWS}), or {why}"):
          kernel_enabled("router_kernel", rows)  # (its site: the fused kernel runs its selection)
          n_pad, mp = kl.route_shape(rows, k, E, self.shared_experts is not None, **mma)
          ids, w, tables = self.gate.with_tables(xf, n_pad=n_pad, mp=mp, shared=self.shared_experts is not None)
      if in_gate_up:
        kernel_enabled("router_kernel", rows)  # (its site: the gate/up kernel runs its selection)
        logits = self.gate.logits(xf).astype(jnp.float32)
      elif tables is None:
        ids, w = self.gate(xf)
    if moe_kernel:
      # moe_static_table: a single row's slot count static in both kernels, its ids / weights staged into SMEM
      static = kernel_enabled("moe_static_table", rows, fits=rows == 1, why=f"one token row (here {rows})")
      # lean_barriers: both kernels built without Mosaic's automatic barriers
      moe = functools.partial(kl.fp8_moe, w_gate=ex.gate_proj[...], s_gate=ex.gate_scale[...], w_up=ex.up_proj[...],
                              s_up=ex.up_scale[...], w_down=ex.down_proj[...], s_down=ex.down_scale[...],
                              swiglu_limit=ex.limit, shared=sew, dq=dq, static_table=static,
                              lean=kernel_enabled("lean_barriers"), **fused, **f16, **mma)
      if in_gate_up:
        # moe_router_ranks: each CTA selects only up to its slot's rank
        ranks = kernel_enabled("moe_router_ranks", rows)
        bias = self.gate.e_score_correction_bias[...].astype(jnp.float32)
        select = (k, float(self.gate.scaling), bool(self.gate.norm), ranks)
        # moe_rows: both kernels' split sums on the step's split-K counters — h's rows written by the gate/up
        # kernel (the routing weights then scale the down products), y's rows by the down kernel: no XLA kernel
        # between or after them (in the model's dtype where no all-reduce follows, f32 before one)
        rows_form = {}
        if dq and _counters_enabled("moe_rows"):
          rows_form = dict(counters=_splitk_counters(kl), out_dtype=dtype if lax.axis_size(TP) == 1 else jnp.float32)
        # moe_writer_cta: the selection's writer one extra gate/up CTA (moe_router_ranks' form)
        writer = kernel_enabled("moe_writer_cta", rows, fits=ranks, why="moe_router_ranks off (every CTA "
                                "selects all k: no writer slower than the others)")
        # moe_one_grid: the two kernels as one grid (its counters' banks alternate by call: the parity)
        grid_why = kl.one_grid_why(rows, k, E, sew is not None, ex.gate_proj.shape[1], ex.gate_proj.shape[2])
        if kernel_enabled("moe_one_grid", rows, fits=bool(rows_form) and writer and static and ranks and not grid_why,
                          why=grid_why or "moe_rows (on the GPU: counters), moe_writer_cta, moe_static_table and "
                                          "moe_router_ranks"):
          rows_form["one_grid"] = _next_moe_parity()
        y, ids, _ = moe(xk, None, None, router=(logits, bias), router_select=select, writer_cta=writer,
                        **rows_form)
      else:
        # moe_h_rows: at a few token rows with one D split the gate/up kernel writes h's rows (weighted) itself
        h_why = "needs fp8_dq, and linear_fused_sum off"
        if dq and not fused:
          h_why = kl.h_rows_why(rows, min(E, rows * k) + int(sew is not None), ex.gate_proj.shape[1],
                                ex.gate_proj.shape[2], **mma)
        h_rows = kernel_enabled("moe_h_rows", rows, fits=not h_why, why=h_why)
        y = moe(xk, ids, w, route_kernel=route, tables=tables, **({"h_rows": True} if h_rows else {}),
                **({} if fused else part_rows(rows)))
      y = lax.psum(y, TP).astype(dtype).reshape(*lead, -1)
      return (y, ids.reshape(*lead, -1)) if return_ids else y
    y = ex.partial(xf, ids, w, dtype)
    if self.shared_experts is not None:
      y = y + self.shared_experts.partial(xf, dtype).astype(jnp.float32)
    y = lax.psum(y, TP).astype(dtype).reshape(*lead, -1)
    return (y, ids.reshape(*lead, -1)) if return_ids else y
