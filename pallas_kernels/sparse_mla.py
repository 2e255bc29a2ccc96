"""Sparse MLA decode over an FP8 latent cache (DSA layers, spec model.md §3.6.2, decode.md §1.3 / §3).

Shapes: B sequences, T query tokens per sequence (1 plain decode, q = k+1 at spec verify), H heads on this rank
(16 at TP4, 64 at TP1), D = 512 latent, S cache positions, W selected positions per query token (index width,
2051 real, padded with -1).

The latent cache holds one row of ROW_WORDS = 160 int32 words per token: 512 e4m3 values as 128 words, plane-
major (value 128k + i in byte k of word i, little-endian: byte plane k is the k-th group of 128 values, the group
of scale k), then the 4 fp32 scales (one per 128 values) as their bit patterns, then 28 zero words (rows of 640
bytes: each row's TMA must land 128-byte aligned in shared memory). That is the FlashMLA ``fp8_ds_mla`` row
(latent bytes then scales) without its (all-zero for NoPE) rope part and with the bytes of each word taken from
the four scale groups — so that the kernel's byte planes are the latent's own column blocks (until session 47
value 4i + k sat in byte k of word i, and the queries and outputs went through a column permutation around the
kernel: an XLA transpose kernel on every DSA layer's critical path). One row per token is one TMA gather per
selected position: the kernel's blocks were bound by issuing the gathers one after another (latent and scales
as separate arrays took two per position). The kernel reads the bytes with 32-bit loads (8-bit register loads
from an untiled SMEM buffer gave wrong values natively on the H200 — see ``_dequant_block``).
``quantize_latent`` / ``dequantize_latent`` are the cache write / read paths; ``pack_e4m3`` / ``unpack_e4m3``
convert between the two views of the bytes and ``split_row`` takes a row apart. ``mla_absorb_uv`` (at the end)
applies W_UV to the merged output (Hopper's wgmma, or ``mma="tcgen05"`` for Blackwell); ``mla_absorb_uk`` makes
the absorbed query W_UKᵀ q before the attention (Hopper's wgmma).

The attention is the absorbed form: with q̂_h = W_UK_hᵀ q_h ∈ [512],
  o_h = Σ_{s ∈ I_t} softmax_s(q̂_h · c_s · softmax_scale) c_s,
c_s the dequantised latent. ``sparse_mla_decode`` is a Pallas Mosaic GPU kernel; ``sparse_mla_decode_reference``
the pure-jnp f32 definition with the same signature.

Kernel design (one CTA = one (query token, head group of 16, slice of the index list)):
* the selected rows are gathered by index (scalar index reads from SMEM) into a double-buffered SMEM block of
  64 positions, the next block in flight while the current one is computed: one TMA per group of 4 consecutive
  positions (an indexer pool: 4 × 640-byte rows) and one per row elsewhere (the tail, padding) — issued between
  blocks by the computing warpgroup, or (``gather_warpgroup``) by a second warpgroup into a ring of 2-3 blocks;
* the block is dequantised in registers with integer ops (each e4m3 byte b -> the f16 with bits
  (b & 0x80) << 8 | (b & 0x7F) << 7, which is exactly 2^-8 times the e4m3 value, subnormals included; (x) the
  per-row-per-128 scale x 256 in f32 -> f16) into a swizzled f16 tile whose columns are the latent dimensions
  in order (byte plane k of the 128 words: dimensions 128k .. 128k + 127, all of scale k);
* "transposed" orientation: keys are the wgmma M dimension (64) and the 16 heads of the token the N dimension,
  S^T [64, 16] = C [64, 512] @ Q^T, O^T [512, 16] += C^T [512, 64] @ P^T [64, 16]. Query tokens of one sequence
  select different positions, so their heads cannot share one M = 64 row tile of keys; putting heads on N
  (a multiple of 8) instead of padding 16 heads to 64 rows cuts the MMA work 4x and keeps the fp32
  accumulator at 64 registers per thread;
* online softmax (base 2) over blocks of 64 positions, fp32 accumulation, -1 indices masked;
* the index list is split over CTAs (W-split, "flash decoding"); each CTA writes its normalised partial output
  and log-sum-exp, and a merge (an XLA fusion or a kernel: ``combine``) combines them. The split size is chosen
  so that the grid has about two CTAs per SM (latency bound at B=1: 11 layers x ~1 MiB of gathered latent).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._common import (check_mma, kernel_entry, mgpu_kernel, round_bf16, saturate_f16,
                                    tmem_to_wgmma)

D_LATENT = 512
GROUP = 128  # values per fp32 scale
FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_FLOOR = 1e-4  # amax floor: an all-zero group gets scale 1e-4 / 448 instead of 0 (no 0/0)
BLOCK = 64  # positions per online-softmax block (= wgmma M)
WORDS = D_LATENT // 4  # packed e4m3 words per row
SCALES = D_LATENT // GROUP  # fp32 scales per row, after the packed words
assert WORDS == GROUP and SCALES == 4  # (byte plane k of the words = scale group k: pack_e4m3, _dequant_block)
# 128 packed words, 4 scales, 28 zero words: 640-byte rows, so that every per-row TMA lands 128-byte aligned in
# shared memory
ROW_WORDS = 160
HEADS_PER_CTA = 16  # wgmma N; O^T [512, 16] f32 = 64 registers per thread
NUM_SMS = 132  # H200
# The gathers: a block's 64 single-row TMAs (two per row before the scales moved into the row), issued one after
# another by one thread, bound the kernel (~9 µs per CTA for one block whether 33 or 132 CTAs run, sessions
# 24-25). The indexer selects pools of RUN consecutive positions, so most groups of RUN rows are one TMA; the
# group loop is unrolled so that the next groups' index loads overlap the current group's issue.
RUN = 4  # positions per indexer pool (index_kpool)
ISSUE_UNROLL = 4
_NEG = -1e30  # finite "minus infinity": a fully masked block must not produce inf - inf = NaN
_LOG2E = math.log2(math.e)
_L = plgpu.Layout


# ------------------------------------------------------------------------------------------------ cache format
def pack_e4m3(c8):
  """[..., 4n] float8_e4m3fn -> [..., n] int32, plane-major: value kn + i in byte k (bits 8k..8k + 7) of word i.
  As shifts and ors of the bytes, elementwise: XLA fuses the packing with the quantisation before it (a bitcast of
  [..., n, 4] bytes into words — the transposed layout it needs — was a fusion of its own per cache write)."""
  n = c8.shape[-1] // 4
  u = lax.bitcast_convert_type(c8, jnp.uint8).astype(jnp.uint32)
  w = functools.reduce(jnp.bitwise_or, [lax.shift_left(u[..., k * n:(k + 1) * n], jnp.uint32(8 * k)) for k in range(4)])
  return lax.bitcast_convert_type(w, jnp.int32)


def unpack_e4m3(w):
  """[..., n] int32 -> [..., 4n] float8_e4m3fn (the inverse of ``pack_e4m3``)."""
  return jnp.swapaxes(lax.bitcast_convert_type(w, jnp.float8_e4m3fn), -1, -2).reshape(*w.shape[:-1], w.shape[-1] * 4)


def quantize_latent(c):
  """c [..., 512] f32/bf16 -> cache rows [..., ROW_WORDS] int32 (512 e4m3 bytes as 128 plane-major words:
  ``pack_e4m3``, 4 f32 scales, zero words).

  One scale per 128 consecutive values: scale = max(amax, 1e-4) / 448, c8 = e4m3(clip(c / scale, -448, 448)),
  so the largest value of each group maps to ±448 (the e4m3 maximum) and c ≈ c8 · scale (relative error
  ≤ 2^-4 per value, the e4m3 mantissa)."""
  return pack_latent(*quantize_latent_groups(c))


def quantize_latent_groups(c):
  """c [..., 512] -> (c8 [..., 512] float8_e4m3fn, scale [..., 4] f32): ``quantize_latent`` before the packing.
  A bf16 c is quantised from its bf16 values (as vLLM and the latent_norms kernel do): XLA may otherwise keep the
  f32 value its producer computed (excess precision: the bf16 round trip dropped), moving the group maxima."""
  c = jnp.asarray(c)
  c = lax.reduce_precision(c.astype(jnp.float32), 8, 7) if c.dtype == jnp.bfloat16 else c.astype(jnp.float32)
  g = c.reshape(*c.shape[:-1], c.shape[-1] // GROUP, GROUP)
  amax = jnp.max(jnp.abs(g), axis=-1)
  scale = jnp.maximum(amax, SCALE_FLOOR) / FP8_MAX
  c8 = jnp.clip(g / scale[..., None], -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
  return c8.reshape(c.shape), scale


def pack_latent(c8, scale):
  """(c8 [..., 512] e4m3, scale [..., 4] f32) -> cache rows [..., ROW_WORDS] int32 (``quantize_latent``'s)."""
  pad = jnp.zeros((*c8.shape[:-1], ROW_WORDS - WORDS - SCALES), jnp.int32)
  return jnp.concatenate([pack_e4m3(c8), lax.bitcast_convert_type(scale, jnp.int32), pad], -1)


# ------------------------------------------------------------------------------ the latent's norms (q_a / kv_a)
# After the joint q_a / kv_a projection a DSA layer RMS-normalises both outputs — q_r feeds q_b and the indexer's
# queries, c the latent cache — and quantises c into its FP8 cache row. As XLA fusions that was ~7 launches
# between the projection and the indexer's query GEMV on the layer's critical path (s51b's trace: 13.1 -> 20.0 µs
# after the boundary's start: two sums of squares, the normalisations, the latent's amax, its quantisation and
# scales). ``latent_norms``: one launch, a CTA per token row (policy knob mla_latent_norms).
def latent_norms_reference(qkv, wq, wkv, *, eps: float):
  """qkv [M, Q + 512] (the joint q_a | kv_a output, bf16), wq [Q], wkv [512] -> (q_r [M, Q] bf16, c [M, 512]
  bf16, c8 [M, 512] e4m3, scale [M, 4] f32): HF's RMSNorm of each part (f32 normalisation, cast to bf16, times
  the weight in bf16) and ``quantize_latent_groups`` of c."""
  Q = qkv.shape[-1] - D_LATENT

  def rms(x, w):
    x = x.astype(jnp.float32)
    y = (x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)).astype(jnp.bfloat16)
    return w.astype(jnp.bfloat16) * y

  q_r, c = rms(qkv[:, :Q], wq), rms(qkv[:, Q:], wkv)
  return (q_r, c, *quantize_latent_groups(c))


def _latent_norms_kernel(Q: int, eps: float):
  f32, bf16 = jnp.float32, jnp.bfloat16
  lq, lg = plgpu.Layout.WG_STRIDED((Q,), vec_size=1), plgpu.Layout.WG_STRIDED((GROUP,), vec_size=1)
  CH = 256 if Q % 256 == 0 else GROUP  # (a TMA box is at most 256 elements wide)

  def body(x_g, wq_g, wkv_g, qr_g, c_g, c8_g, sc_g, xq_s, xc_s, wq_s, wkv_s, qr_s, c_s, c8_s, sc_s, bar):
    m = lax.axis_index("m")
    for j in range(Q // CH):
      plgpu.copy_gmem_to_smem(x_g.at[m, pl.ds(j * CH, CH)], xq_s.at[pl.ds(j * CH, CH)], bar)
      plgpu.copy_gmem_to_smem(wq_g.at[pl.ds(j * CH, CH)], wq_s.at[pl.ds(j * CH, CH)], bar)
    for k in range(SCALES):  # the latent as its 4 scale groups, a row each
      plgpu.copy_gmem_to_smem(x_g.at[m, pl.ds(Q + k * GROUP, GROUP)], xc_s.at[k], bar)
      plgpu.copy_gmem_to_smem(wkv_g.at[pl.ds(k * GROUP, GROUP)], wkv_s.at[k], bar)
    plgpu.barrier_wait(bar)
    xq = plgpu.load(xq_s, layout=lq, optimized=False).astype(f32)
    rq = lax.rsqrt(jnp.sum(xq * xq) / float(Q) + eps)
    qr_s[...] = plgpu.load(wq_s, layout=lq, optimized=False) * (xq * rq).astype(bf16)
    xc = [plgpu.load(xc_s.at[k], layout=lg, optimized=False).astype(f32) for k in range(SCALES)]
    ss = jnp.sum(xc[0] * xc[0])
    for k in range(1, SCALES):
      ss = ss + jnp.sum(xc[k] * xc[k])
    rc = lax.rsqrt(ss / float(D_LATENT) + eps)
    for k in range(SCALES):
      c_s[k] = plgpu.load(wkv_s.at[k], layout=lg, optimized=False) * (xc[k] * rc).astype(bf16)
    plgpu.commit_smem()
    # the quantisation reads c back as stored: bf16 values (an f32 product left unrounded — GPU interpret mode's
    # XLA may drop a bf16 round trip — would move the group maxima and the scales)
    for k in range(SCALES):
      cf = plgpu.load(c_s.at[k], layout=lg, optimized=False).astype(f32)
      scale = jnp.maximum(jnp.max(jnp.abs(cf)), SCALE_FLOOR) / FP8_MAX
      c8_s[k] = jnp.clip(cf / scale, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
      sc_s[k] = scale
    plgpu.commit_smem()
    for j in range(Q // CH):
      plgpu.copy_smem_to_gmem(qr_s.at[pl.ds(j * CH, CH)], qr_g.at[m, pl.ds(j * CH, CH)])
    for k in range(SCALES):
      plgpu.copy_smem_to_gmem(c_s.at[k], c_g.at[m, pl.ds(k * GROUP, GROUP)])
      plgpu.copy_smem_to_gmem(c8_s.at[k], c8_g.at[m, pl.ds(k * GROUP, GROUP)])
    plgpu.copy_smem_to_gmem(sc_s, sc_g.at[m])
    plgpu.wait_smem_to_gmem(0)

  return body


@kernel_entry("eps", "lean")
def latent_norms(qkv, wq, wkv, *, eps: float, lean: bool = False):
  """Mosaic GPU version of ``latent_norms_reference`` (same signature and outputs): one launch, a CTA per token
  row, one warpgroup — each thread 12 of q_a's values and one value of each of the latent's 4 scale groups.
  ``lean`` (policy knob lean_barriers): built without Mosaic GPU's automatic warpgroup barriers (59 bar.sync, 21
  lean: the reductions' and the two commits'): every SMEM buffer is written once and read — by the threads or the
  TMA — only after a commit_smem."""
  M, K = qkv.shape
  Q = K - D_LATENT
  if qkv.dtype != jnp.bfloat16 or Q <= 0 or Q % GROUP or wq.shape != (Q,) or wkv.shape != (D_LATENT,):
    raise ValueError(f"latent_norms: qkv {qkv.shape} {qkv.dtype}, wq {wq.shape}, wkv {wkv.shape}; expected bf16 "
                     f"[M, Q + {D_LATENT}] with Q a positive multiple of {GROUP}, wq [Q], wkv [{D_LATENT}]")
  bf16, f32, f8 = jnp.bfloat16, jnp.float32, jnp.float8_e4m3fn
  kern = mgpu_kernel(
      _latent_norms_kernel(Q, float(eps)),
      out_type=(jax.ShapeDtypeStruct((M, Q), bf16), jax.ShapeDtypeStruct((M, D_LATENT), bf16),
                jax.ShapeDtypeStruct((M, D_LATENT), f8), jax.ShapeDtypeStruct((M, SCALES), f32)),
      scratch_types=[plgpu.SMEM((Q,), bf16), plgpu.SMEM((SCALES, GROUP), bf16), plgpu.SMEM((Q,), bf16),
                     plgpu.SMEM((SCALES, GROUP), bf16), plgpu.SMEM((Q,), bf16), plgpu.SMEM((SCALES, GROUP), bf16),
                     plgpu.SMEM((SCALES, GROUP), f8), plgpu.SMEM((SCALES,), f32),
                     plgpu.Barrier(num_arrivals=2 * (Q // (256 if Q % 256 == 0 else GROUP)) + 2 * SCALES)],
      grid=(M,),
      grid_names=("m",),
      kernel_name="glm5_latent_norms",
      compiler_params=plgpu.CompilerParams(unsafe_no_auto_barriers=bool(lean)),
  )
  return kern(qkv, wq.astype(bf16), wkv.astype(bf16))


def split_row(row):
  """cache rows [..., ROW_WORDS] int32 -> (packed e4m3 [..., 128] int32, scales [..., 4] f32)."""
  return row[..., :WORDS], lax.bitcast_convert_type(row[..., WORDS:WORDS + SCALES], jnp.float32)


def dequantize_latent(row):
  """cache rows [..., ROW_WORDS] int32 -> c [..., 512] f32 (the inverse of ``quantize_latent``)."""
  packed, scale = split_row(row)
  c8 = unpack_e4m3(packed)
  g = c8.astype(jnp.float32).reshape(*c8.shape[:-1], scale.shape[-1], -1)
  return (g * scale[..., None]).reshape(c8.shape)


# ------------------------------------------------------------------------------------------------ reference
def sparse_mla_decode_reference(q, cache, indices, *, softmax_scale):
  """Pure-jnp f32 sparse MLA decode over the dequantised FP8 latent cache.

  q [B, T, H, 512] (absorbed queries), cache [B, S, ROW_WORDS] int32 (``quantize_latent``'s rows), indices
  [B, T, W] int32 (-1 = padding; every (b, t) has at least one valid index)
  -> o [B, T, H, 512] f32 = Σ_s softmax_s(q·c_s · softmax_scale) c_s over the valid selected s."""
  B = q.shape[0]
  bi = jnp.arange(B)[:, None, None]
  ix = jnp.maximum(indices, 0)
  c = dequantize_latent(cache[bi, ix])  # [B, T, W, 512]
  s = jnp.einsum("bthd,btwd->bthw", q.astype(jnp.float32), c, precision=lax.Precision.HIGHEST)
  s = jnp.where((indices >= 0)[:, :, None, :], s * softmax_scale, -jnp.inf)
  p = jax.nn.softmax(s, axis=-1)
  return jnp.einsum("bthw,btwd->bthd", p, c, precision=lax.Precision.HIGHEST)


def sparse_mla_grouped(q, cache, indices, *, softmax_scale):
  """``sparse_mla_decode_reference``'s contract for bf16 queries, as two bf16 tensor-core products over the
  cache's own bytes: the selected rows' e4m3 values gathered as they are and taken as bf16 (exact), the queries'
  scale groups as separate rows (each group's 128 dimensions, the others zero: [B, T, G·H, 512]) so that one
  product gives every group's partial score, scaled and summed in f32; the probabilities times each group's scale
  split into two bf16 terms (hi + lo: ~16 bits of mantissa) for the product back onto the bytes, whose diagonal
  blocks are the output. The scores are exact products summed in f32 (bf16 q times e4m3 values) — the reference's
  math up to the order of the sums; the output within ~2^-16 of it per term. The form for many query rows (a
  prefill chunk in XLA): the reference's dequantised [B, T, W, 512] f32 gather was 1.07 GB a DSA layer at T = 256,
  W = 2,051, read by two f32 products (17 GFLOP without tensor cores) — session 63's compile-only listing.

  In a cache row, word w holds the e4m3 values of latent dimensions 128k + w in its byte k (``pack_e4m3``): the
  bytes as [.., 512] are in (w, k) order, and the queries are taken in the same order."""
  B, T, H, D = q.shape
  G = D // GROUP
  if q.dtype != jnp.bfloat16:
    raise ValueError(f"sparse_mla_grouped: q is {q.dtype}; expected bfloat16 (its products with the e4m3 values "
                     "are then exact in f32) — use sparse_mla_decode_reference for f32 queries")
  bi = jnp.arange(B)[:, None, None]
  packed, scale = split_row(cache[bi, jnp.maximum(indices, 0)])  # [B, T, W, 128] int32, [B, T, W, G] f32
  W = packed.shape[2]
  e = lax.bitcast_convert_type(packed, jnp.float8_e4m3fn).reshape(B, T, W, D).astype(jnp.bfloat16)  # (w, k) order
  eye = jnp.eye(G, dtype=jnp.bfloat16)
  qw = jnp.swapaxes(q.reshape(B, T, H, G, GROUP), -1, -2)  # [B, T, H, 128 (w), G (k)]
  q4 = (qw[:, :, :, None] * eye[:, None, :]).reshape(B, T, H * G, D)  # row (h, k): group k's dimensions only
  S = jnp.einsum("btnd,btrd->btnr", q4, e, preferred_element_type=jnp.float32).reshape(B, T, H, G, W)
  s = jnp.sum(S * jnp.swapaxes(scale, -1, -2)[:, :, None], axis=3)  # [B, T, H, W]
  s = jnp.where((indices >= 0)[:, :, None, :], s * softmax_scale, -jnp.inf)
  p = jax.nn.softmax(s, axis=-1)
  p4 = (p[:, :, :, None] * jnp.swapaxes(scale, -1, -2)[:, :, None]).reshape(B, T, H * G, W)  # row (h, k)
  hi = p4.astype(jnp.bfloat16)
  lo = (p4 - hi.astype(jnp.float32)).astype(jnp.bfloat16)
  o4 = (jnp.einsum("btnr,btrd->btnd", hi, e, preferred_element_type=jnp.float32)
        + jnp.einsum("btnr,btrd->btnd", lo, e, preferred_element_type=jnp.float32))
  o = jnp.sum(o4.reshape(B, T, H, G, GROUP, G) * eye.astype(jnp.float32)[:, None, :], axis=3)  # the diagonal
  return jnp.swapaxes(o, -1, -2).reshape(B, T, H, D)


# ------------------------------------------------------------------------------------------------ kernel
# Tiling + swizzle of every f16 wgmma operand: wgmma takes one swizzle for A and B, and P^T [64 keys, 16 heads]
# f16 has a 32-byte minor dimension, so all of q_s, c16_s and p_s use the 32-byte swizzle.
_F16_SW32 = (plgpu.TilingTransform((8, 16)), plgpu.SwizzleTransform(32))


def _pick_blocks_per_split(n_blocks: int, n_rows: int) -> int:
  """Blocks of 64 positions per CTA: about 2 CTAs per SM over the (token, head group, split) grid."""
  splits = max(1, min(n_blocks, -(-2 * NUM_SMS // max(n_rows, 1))))
  return -(-n_blocks // splits)


def _gather_block(rows_g, idx_s, k: int, dst_s, gbar, xbar=None):
  """Block k's cache rows (idx_s[k]: its positions, -1 padding) from rows_g [S, ROW_WORDS] into dst_s [n,
  ROW_WORDS] on one barrier of n arrivals, by groups of RUN: a group of consecutive positions (an indexer pool's
  tokens) is one TMA of RUN rows plus RUN - 1 plain arrivals; an all-padding group loads rows 0.. (masked later)
  the same way; any other group (the tail, interleaved padding) one TMA per row (-1 loads row 0, masked later).

  ``xbar`` (``sparse_mla_decode(group_arrival=True)``): gbar counts one arrival per group (n / RUN) — in Pallas'
  Lane semantics every arrival is all 128 threads', and session 67's profile had the issue of a block's 16 groups
  at 2.7 µs (4 arrivals a group: the TMA's and 3 plain ones). A group whose valid positions all sit where a run
  from its first one puts them (a pool; a tail with trailing padding; interleaved padding), its window inside the
  cache, is one TMA of RUN rows (the padding slots get the run's rows: masked later), as is an all-padding group
  (rows 0..); any other group loads its rows one TMA each on xbar (RUN arrivals), waits for them there and then
  arrives on gbar once."""
  grouped, S = xbar is not None, rows_g.shape[0]

  def group(gi, c):
    j = gi * RUN
    r = [idx_s[k, j + t] for t in range(RUN)]
    # one TMA of RUN rows: a whole run (grouped: the valid entries where a run from the first puts them, the
    # window inside the cache), or all padding
    run, none = ((r[0] >= 0) & (r[0] <= S - RUN)) if grouped else (r[0] >= 0), r[0] < 0
    for t in range(1, RUN):
      at_run = r[t] == r[0] + t
      run, none = run & ((at_run | (r[t] < 0)) if grouped else at_run), none & (r[t] < 0)
    whole = run | none

    @pl.when(whole)
    def _():
      plgpu.copy_gmem_to_smem(rows_g.at[pl.ds(jnp.where(none, 0, r[0]), RUN)], dst_s.at[pl.ds(j, RUN)], gbar)
      if not grouped:  # (the RUN arrivals a group of single rows makes)
        for _ in range(RUN - 1):
          plgpu.barrier_arrive(gbar)

    @pl.when(jnp.logical_not(whole))
    def _():  # (grouped: rare — no indexer list has such a group; the kernel takes any list)
      for t in range(RUN):
        plgpu.copy_gmem_to_smem(rows_g.at[pl.ds(jnp.maximum(r[t], 0), 1)], dst_s.at[pl.ds(j + t, 1)],
                                xbar if grouped else gbar)
      if grouped:
        plgpu.barrier_wait(xbar)
        plgpu.barrier_arrive(gbar)
    return c
  lax.fori_loop(0, dst_s.shape[0] // RUN, group, None, unroll=ISSUE_UNROLL)


def _plane_scale(full, k: int, times: float = 256.0):
  """Each row's scale k of whole gathered rows full [64, ROW_WORDS] int32 (WGMMA layout), times ``times`` (256 for
  ``_plane_f16``'s 2^-8-scaled values, 1 for its exact ones) -> [64] f32 (WGMMA.reduce(1)): word 128 + k taken by
  a masked row sum of the bits (one nonzero term: exact)."""
  col = plgpu.broadcasted_iota(jnp.int32, (BLOCK, 8), 1, layout=_L.WGMMA)
  bits = plgpu.layout_cast(jnp.where(col == k, full[:, WORDS:WORDS + 8], 0).sum(axis=1), _L.WGMMA.reduce(1))
  return lax.bitcast_convert_type(bits, jnp.float32) * times


def _plane_f16(full, k: int, cvt: bool = False):
  """Byte plane k of whole gathered rows full [64, ROW_WORDS] int32 -> [64, WORDS] f16, unscaled (see
  ``_dequant_block``): 2^-8 times the e4m3 values by integer operations on the bits, or (``cvt``) the e4m3 values
  themselves by the GPU's e4m3x2 -> f16x2 conversion — each byte truncated to int8 and reinterpreted as e4m3, one
  cvt per two values (compile-only PTX of a block's dequantisation, session 66: 1,030 instructions vs 1,702 by the
  integer route, 2,545 with the scale applied per value). Both exact (the e4m3 NaN codes, which the cache's clipped
  values never use, become 480 · 2^-8 by the integer route and NaN by the conversion)."""
  word = full[:, :WORDS]
  byte = lax.shift_right_logical(word, jnp.int32(8 * k)) if k else word
  if cvt:
    return lax.bitcast_convert_type(byte.astype(jnp.int8), jnp.float8_e4m3fn).astype(jnp.float16)
  byte = byte & 0xFF
  # (b & 0x80) << 8 | (b & 0x7F) << 7 in three operations: adding the sign bit to itself carries it one place up
  # (the same bits for all 256 bytes; the dequantisation's arithmetic is most of the kernel: session 66's profile)
  return lax.bitcast_convert_type(((byte + (byte & 0x80)) << 7).astype(jnp.int16), jnp.float16)


def _dequant_plane(full, k: int):
  """Byte plane k of whole gathered rows full [64, ROW_WORDS] int32 (WGMMA layout) -> [64, WORDS] f32: the latent
  dimensions 128k + w, times their row's scale k (see ``_dequant_block``)."""
  scale = lax.broadcast_in_dim(_plane_scale(full, k), (BLOCK, WORDS), (0,))
  return _plane_f16(full, k).astype(jnp.float32) * scale


def _dequant_block(c32_s, c16_s, planes=range(4), scales_after: bool = False):
  """One block of 64 gathered cache rows [64, ROW_WORDS] int32 -> c16_s [64, 512] f16, the latent dimensions in
  order (byte plane k of the words: dimensions 128k + w, the group of scale k).

  The gathered buffer is written row by row, so it stays untiled (hence optimized=False loads). Measured on the
  H200 (jax 0.11.2): such loads are right for whole rows but wrong when the ref is sliced at a column offset
  (16-byte chunks come back exchanged), so each row is loaded whole as one [64, ROW_WORDS] tile and split in
  registers (tile-aligned slices). Each byte b becomes the f16 with bits (b & 0x80) << 8 | (b & 0x7F) << 7 =
  2^-8 · e4m3(b) exactly (e4m3 subnormals land on f16 subnormals), so the scale is applied as scale · 256 in
  f32. Byte plane k is scale group k; each row's scale k is its word 128 + k, taken by a masked row sum of the
  bits (one nonzero term: exact) and read back as f32 — no value transpose, one scale per plane (the
  interleaved packing before session 47 needed a select chain over the four groups for every word). ``planes``: the
  byte planes this warpgroup converts (``_mla_kernel``'s two-warpgroup form splits them). ``scales_after``: the
  tile unscaled — the e4m3 values themselves, by the hardware conversion (``_plane_f16(cvt=True)``) — and the rows'
  4 scales ([64] f32 each) returned for the caller to apply after the MMAs: no f32 conversion and multiply per
  value."""
  with jax.named_scope("load"):  # (the sub-regions bench_kernel_profile times: session 66, dequant 4.5 µs a block)
    full = plgpu.load(c32_s, layout=_L.WGMMA, optimized=False)
  for k in planes:  # (the scale words and 4 zero words: a tile-aligned slice, in _dequant_plane)
    with jax.named_scope("convert"):
      h = _plane_f16(full, k, cvt=True) if scales_after else _dequant_plane(full, k).astype(jnp.float16)
      h = plgpu.layout_cast(h, _L.WGMMA)
    with jax.named_scope("store"):
      c16_s[:, pl.ds(k * WORDS, WORDS)] = h
  return [_plane_scale(full, k, times=1.0) for k in range(SCALES)] if scales_after else None


def _combine_tile(o_g, lse_g, out_g, bt, tile, ns: int):
  """One 64-row tile of token bt's O^T from its ns splits: out_g[bt, rows] = Σ_s 2^(lse_s − m) O_s / Σ_s 2^(lse_s
  − m), m = max_s lse_s (per head; an all-padding split's lse ~ −1e30 weighs 0). o_g [BT, NS, 512, H] / lse_g
  [BT, NS, H] f32 in GMEM (the splits' outputs); the loads are unrolled over the splits so that they are all in
  flight at once (a rolled loop would wait on each in turn)."""
  r0 = tile * BLOCK
  red = _L.WGMMA.reduce(0)
  lses = [plgpu.load(lse_g.at[bt, sp], layout=red, optimized=False) for sp in range(ns)]
  m = lses[0]
  for v in lses[1:]:
    m = jnp.maximum(m, v)
  acc = den = None
  for sp in range(ns):
    w = jnp.exp2(lses[sp] - m)
    o = plgpu.load(o_g.at[bt, sp, pl.ds(r0, BLOCK)], layout=_L.WGMMA, optimized=False)
    t = o * lax.broadcast_in_dim(w, o.shape, (1,))
    acc, den = (t, w) if acc is None else (acc + t, den + w)
  out_g[bt, pl.ds(r0, BLOCK)] = plgpu.layout_cast(acc / lax.broadcast_in_dim(den, acc.shape, (1,)), _L.WGMMA)


def _mla_kernel(nbs: int, hn: int, wgs: int = 1, scales_after: bool = False, group_arrival: bool = False,
                qscale: float = 1.0, q_in: bool = False, gather_wg: bool = False):
  """Kernel body for ``nbs`` blocks of 64 positions per CTA and ``hn`` heads per CTA.

  GMEM refs: q_g [BT, H, 512] f16 (rescaled), qm_g [BT] f32 (the rescale r, times ``qscale``: softmax_scale ·
  log2 e),
  c32_g [B, S, ROW_WORDS] int32 (cache rows: packed e4m3 + scales), idx_g [BT, Wp / 64, 64] int32;
  out o_g [BT, NS, 512, H] f32 (partial O^T, normalised), lse_g [BT, NS, H] f32 (base-2 log-sum-exp of the split).
  (A merge of the splits inside this kernel — its last splits' CTAs waiting at a semaphore — was slower in the
  step: the waiting CTAs hold SMs, session 34; removed in session 53.)

  ``wgs`` = 2 (``sparse_mla_decode(warpgroups=2)``): a second warpgroup converts byte planes 2 and 3 of every block
  while the first converts planes 0 and 1 — session 66's in-kernel profile (H100) had the dequantisation's
  arithmetic at 3.4 of a block's ~7.5 µs with one warpgroup, one warp per SM sub-partition (every ALU latency
  exposed). The first warpgroup does everything else as before. Per block: both wait for the gather; the second
  waits on ``free`` (the first's PV wgmma of the previous block done: it reads c16_s) before its stores, commits
  them to the async proxy and arrives on ``ready``; the first converts its planes, arrives on ``ready``, waits for
  both, runs QK / softmax / PV and arrives on ``free``. The same numbers as one warpgroup.

  ``scales_after`` (``sparse_mla_decode(scales_after=True)``): the block's latent tile stays unscaled
  (``_dequant_block``) and each row's 4 block scales are applied after the MMAs, one per 128-dimension group:
  S^T = Σ_g s_g ⊙ (C_g Q_g^T) (four K = 128 MMAs into four accumulators), O^T_g += C_g^T (s_g ⊙ P) (four MMAs, P
  scaled per row in f32 before its f16 rounding) — the dequantisation then converts bytes only, by the GPU's
  e4m3x2 -> f16x2 conversion (``_plane_f16(cvt=True)``). The same sums up to rounding: c is no longer rounded to
  f16 after its scale (it is exact), s_g · p is instead.

  ``group_arrival`` (``sparse_mla_decode(group_arrival=True)``): the gathers' barrier counts a group of RUN rows
  once (``_gather_block``'s ``xbar``: the scratch after gbar).

  ``q_in`` (``sparse_mla_decode(q_in_kernel=True)``): q_g is the absorbed query itself [BT, H, 512] (f32 or bf16)
  and there is no qm_g — each CTA rescales its heads' queries in its prologue (``_mla_q_prep``; scratch after the
  others: the raw queries [4·hn, 128] and the 4 TMAs' barrier), q_s holding the f16
  queries group-major [4·hn, 128] (row g·hn + h: head h's dimensions 128g ..).

  ``gather_wg`` (``sparse_mla_decode(gather_warpgroup=True)``): one more warpgroup (the last) issues the gathers —
  block k into slot k mod S of an S-slot ring (c32_s [S, 64, ROW_WORDS]), once the converting warpgroups (one, or
  two with ``wgs`` = 2) have converted block k - S out of it (``consumed``, the scratch after gbar and xbar: an
  arrival per block from each) — while the first converts, multiplies and runs the softmax. One warpgroup issues
  a block's 16 groups of TMAs (a condition on 4 SMEM indices, a TMA and its arrivals each: ~2.7 µs a block in
  session 67's H100 profile) between its blocks' arithmetic: a CTA that runs many blocks (a prefill chunk's 512
  token rows: 33 blocks a CTA, one CTA an SM) pays it on every one. The same numbers as one warpgroup (only who
  issues the copies changes)."""

  def body(*refs):
    q_g, *refs = refs
    qm_g, *refs = refs if not q_in else (None, *refs)
    c32_g, idx_g, o_g, lse_g, q_s, idx_s, c32_s, c16_s, p_s, bar, gbar, *rest = refs
    xbar, rest = (rest[0], rest[1:]) if group_arrival else (None, rest)
    consumed, rest = (rest[0], rest[1:]) if gather_wg else (None, rest)
    sync, qprep = (rest[:2], rest[2:]) if wgs == 2 else ((), rest)
    kw = dict(scales_after=scales_after, xbar=xbar, qscale=qscale, qprep=qprep or None)
    wg = lax.axis_index("wg") if wgs == 2 or gather_wg else None
    if gather_wg:  # (the last warpgroup)
      pl.when(wg == wgs)(lambda: _mla_gathers(q_g, c32_g, idx_s, c32_s, bar, gbar, consumed, xbar))
    if wgs == 1 and gather_wg:
      pl.when(wg == 0)(lambda: _mla_body(q_g, qm_g, c32_g, idx_g, o_g, lse_g, q_s, idx_s, c32_s, c16_s, p_s, bar,
                                         gbar, consumed=consumed, **kw))
      return
    if wgs == 1:
      return _mla_body(q_g, qm_g, c32_g, idx_g, o_g, lse_g, q_s, idx_s, c32_s, c16_s, p_s, bar, gbar, **kw)
    ready, free = sync
    S = c32_s.shape[0]

    @pl.when(wg == 0)
    def _():
      _mla_body(q_g, qm_g, c32_g, idx_g, o_g, lse_g, q_s, idx_s, c32_s, c16_s, p_s, bar, gbar,
                planes=range(SCALES // 2), ready=ready, free=free, consumed=consumed, **kw)

    @pl.when(wg == 1)
    def _():
      def block(k, carry):
        slot = lax.rem(k, S)
        plgpu.barrier_wait(gbar.at[slot])

        @pl.when(k > 0)
        def _():
          plgpu.barrier_wait(free)  # (the first warpgroup's PV of block k - 1 has read c16_s)

        with jax.named_scope("dequant"):
          _dequant_block(c32_s.at[slot], c16_s, planes=range(SCALES // 2, SCALES), scales_after=scales_after)
          plgpu.commit_smem()  # (the stores visible to the first warpgroup's wgmma: fence.proxy.async)
        plgpu.barrier_arrive(ready)
        if consumed is not None:  # (its reads of the slot done: the commit's warpgroup barrier)
          pl.when(k + S < nbs)(lambda: plgpu.barrier_arrive(consumed.at[slot]))
        return carry

      lax.fori_loop(0, nbs, block, None)

  return body


def _mla_gathers(q_g, c32_g, idx_s, c32_s, bar, gbar, consumed, xbar):
  """``_mla_kernel(gather_wg=True)``'s second warpgroup: once the index list is in (bar[1], its TMA issued by the
  first warpgroup's prologue), block k's gathers into slot k mod S — for k >= S after the converting warpgroups
  released the slot (consumed.at[slot]: block k - S converted)."""
  nbs, S = idx_s.shape[0], c32_s.shape[0]
  b = lax.axis_index("bt") // (q_g.shape[0] // c32_g.shape[0])
  plgpu.barrier_wait(bar.at[1])

  def produce(k, carry):
    slot = lax.rem(k, S)
    pl.when(k >= S)(lambda: plgpu.barrier_wait(consumed.at[slot]))
    _gather_block(c32_g.at[b], idx_s, k, c32_s.at[slot], gbar.at[slot], xbar)
    return carry

  lax.fori_loop(0, nbs, produce, None)


def _cta_heads(q_s, qprep) -> int:
  """A CTA's heads from its f16 query tile: [hn, 512], or group-major [4·hn, 128] with ``qprep``."""
  return q_s.shape[0] // SCALES if qprep else q_s.shape[0]


def _mla_prologue(q_g, idx_g, c32_g, q_s, idx_s, bar, qprep=None):
  """Both attention forms' start: the CTA's (head group, split, token row, sequence) from its grid position, its
  queries' TMA (on bar[0], awaited later; ``qprep``: the raw queries' 4 TMAs, one per 128-dimension group, into
  its first scratch on its barrier) and its split's index list (bar[1], awaited here: the gathers need it)."""
  nbs, hn = idx_s.shape[0], _cta_heads(q_s, qprep)
  hg, sp, bt = lax.axis_index("h"), lax.axis_index("s"), lax.axis_index("bt")
  b = bt // (q_g.shape[0] // c32_g.shape[0])
  if qprep:
    q32_s, qbar = qprep
    for g in range(SCALES):
      plgpu.copy_gmem_to_smem(q_g.at[bt, pl.ds(hg * hn, hn), pl.ds(g * GROUP, GROUP)], q32_s.at[pl.ds(g * hn, hn)],
                              qbar)
  else:
    plgpu.copy_gmem_to_smem(q_g.at[bt, pl.ds(hg * hn, hn)], q_s, bar.at[0])
  plgpu.copy_gmem_to_smem(idx_g.at[bt, pl.ds(sp * nbs, nbs)], idx_s, bar.at[1])
  with jax.named_scope("start_idx"):  # (bench_kernel_profile's regions of the ~4 µs before the first block)
    plgpu.barrier_wait(bar.at[1])
  return hg, sp, bt, b


def _mla_q_prep(q32_s, qbar, q_s):
  """``_mla_kernel(q_in=True)``'s query rescale, in the CTA's prologue (the XLA reduction and scaled copy of
  ``_prepare_q`` were two launches on the DSA layer's critical path): the raw queries q32_s [4·hn, 128] (group-major,
  f32 or bf16) -> q_s [4·hn, 128] f16 = q / r, r = max(amax, 1e-30) over the CTA's heads (its head group's, not
  the token's: the same where one head group holds them all, as at TP4's 16 heads; any positive r is exact here,
  the logits are s · r). Returns r."""
  plgpu.barrier_wait(qbar)
  x = plgpu.load(q32_s, layout=_L.WGMMA, optimized=False).astype(jnp.float32)
  # (the maximum as rows then their vector: one whole-array reduction of a WGMMA or 2-D strided array does not
  # lower, a reshaped SMEM ref does not run in interpret mode)
  r = jnp.maximum(jnp.abs(x).max(axis=1).max(), 1e-30)
  q_s[...] = plgpu.layout_cast((x / r).astype(jnp.float16), _L.WGMMA)
  plgpu.commit_smem()  # (the wgmma reads q_s)
  return r


def _mla_body(q_g, qm_g, c32_g, idx_g, o_g, lse_g, q_s, idx_s, c32_s, c16_s, p_s, bar, gbar, *,
              planes=range(SCALES), ready=None, free=None, scales_after: bool = False, xbar=None,
              qscale: float = 1.0, qprep=None, consumed=None):
  """``_mla_kernel``'s first (or only) warpgroup: the loads, the gathers, its byte planes of every block, the
  attention and the outputs. ``ready`` / ``free``: the two-warpgroup form's barriers (None: one warpgroup).
  ``scales_after``: as ``_mla_kernel``'s (p_s then holds the four scaled P tiles [4, 64, hn]; O^T is carried as
  its four 128-row groups). ``qprep``: (q32_s, qbar), ``_mla_kernel(q_in=True)``'s scratch (qm_g None;
  q_s group-major). ``consumed``: the gather warpgroup's form — no gathers issued here; block k's slot (k mod S)
  released by an arrival on consumed.at[slot] once its planes are converted (``_mla_gathers`` issues block k + S
  into it when every converting warpgroup has)."""
  nbs, hn = idx_s.shape[0], _cta_heads(q_s, qprep)
  hg, sp, bt, b = _mla_prologue(q_g, idx_g, c32_g, q_s, idx_s, bar, qprep)
  S = c32_s.shape[0]

  def issue(k, slot):
    _gather_block(c32_g.at[b], idx_s, k, c32_s.at[slot], gbar.at[slot], xbar)

  if consumed is None:
    with jax.named_scope("start_issue"):
      issue(0, 0)
  if qprep:  # (the first block's gather in flight meanwhile)
    with jax.named_scope("start_q"):
      qmul = _mla_q_prep(*qprep, q_s) * qscale
  else:
    qmul = qm_g[bt] * qscale
    with jax.named_scope("start_q"):
      plgpu.barrier_wait(bar.at[0])
  # the queries of scale group g, [hn, 128] (q_s group-major with qprep)
  q_group = (lambda g: q_s.at[pl.ds(g * hn, hn)]) if qprep else (lambda g: q_s.at[:, pl.ds(g * GROUP, GROUP)])

  def block(k, carry):
    o, m, l = carry  # (o: O^T [512, hn], or with scales_after its 4 row groups [128, hn])
    slot = lax.rem(k, S)

    if consumed is None:
      @pl.when(k + 1 < nbs)
      def _():
        issue(k + 1, 1 - slot)

    # (named scopes: the regions benchmarks/bench_kernel_profile.py times — a no-op unless profiling)
    with jax.named_scope("gather"):
      plgpu.barrier_wait(gbar.at[slot])
    with jax.named_scope("dequant"):
      # Warpgroup barrier: every warp is done with the previous block's PV wgmma before c16_s is overwritten.
      plgpu.commit_smem()
      scales = _dequant_block(c32_s.at[slot], c16_s, planes, scales_after)
      plgpu.commit_smem()
    if consumed is not None:  # (every thread's reads of the slot done: the commit's warpgroup barrier)
      pl.when(k + S < nbs)(lambda: plgpu.barrier_arrive(consumed.at[slot]))
    if ready is not None:  # (the second warpgroup's planes: its stores committed before its arrival)
      plgpu.barrier_arrive(ready)
      plgpu.barrier_wait(ready)
    rows = lambda v: lax.broadcast_in_dim(v, (BLOCK, hn), (0,))  # noqa: E731  (a per-key vector over the heads)

    def qk(acc):
      if qprep:  # (group-major queries: the K = 512 product as 4 MMAs of K = 128 into one accumulator)
        for g in range(SCALES):
          plgpu.wgmma(acc, c16_s.at[:, pl.ds(g * GROUP, GROUP)], q_group(g).T)
      else:
        plgpu.wgmma(acc, c16_s, q_s.T)
      return acc[...]

    def qk4(*accs):  # (scales_after: one K = 128 MMA per scale group, each into its own accumulator)
      for g, acc in enumerate(accs):
        plgpu.wgmma(acc, c16_s.at[:, pl.ds(g * GROUP, GROUP)], q_group(g).T)
      return [acc[...] for acc in accs]

    with jax.named_scope("qk"):
      if scales_after:
        parts = pl.run_scoped(qk4, *[plgpu.ACC((BLOCK, hn), jnp.float32) for _ in range(SCALES)])
        st = parts[0] * rows(scales[0])
        for g in range(1, SCALES):
          st = st + parts[g] * rows(scales[g])
      else:
        st = pl.run_scoped(qk, plgpu.ACC((BLOCK, hn), jnp.float32))  # S^T [keys, heads]
    with jax.named_scope("softmax"):
      iv = plgpu.load(idx_s.at[k], layout=_L.WGMMA.reduce(1), optimized=False)
      valid = lax.broadcast_in_dim(iv >= 0, (BLOCK, hn), (0,))
      st = jnp.where(valid, st * qmul, _NEG)  # base-2 logits
      m_new = plgpu.layout_cast(jnp.maximum(m, st.max(axis=0)), _L.WGMMA.reduce(0))
      alpha = jnp.exp2(m - m_new)
      p = plgpu.layout_cast(jnp.exp2(st - lax.broadcast_in_dim(m_new, (BLOCK, hn), (1,))), _L.WGMMA)
      l = plgpu.layout_cast(l * alpha + p.sum(axis=0), _L.WGMMA.reduce(0))
      if scales_after:
        o = tuple(plgpu.layout_cast(og * lax.broadcast_in_dim(alpha, og.shape, (1,)), _L.WGMMA) for og in o)
        for g in range(SCALES):
          p_s[g] = plgpu.layout_cast((p * rows(scales[g])).astype(jnp.float16), _L.WGMMA)
      else:
        o = plgpu.layout_cast(o * lax.broadcast_in_dim(alpha, o.shape, (1,)), _L.WGMMA)
        p_s[...] = plgpu.layout_cast(p.astype(jnp.float16), _L.WGMMA)
      plgpu.commit_smem()

    def pv(acc):
      plgpu.wgmma(acc, c16_s.T, p_s)
      return acc[...]

    def pv4(*accs):  # (scales_after: O^T's group g from the unscaled C_g and P scaled by the rows' scale g)
      for g, acc in enumerate(accs):
        plgpu.wgmma(acc, c16_s.at[:, pl.ds(g * GROUP, GROUP)].T, p_s.at[g])
      return [acc[...] for acc in accs]

    # run_scoped + add (not run_state(ACC.init(o))): GPU interpret mode cannot run wgmma under run_state.
    with jax.named_scope("pv"):
      if scales_after:
        parts = pl.run_scoped(pv4, *[plgpu.ACC((GROUP, hn), jnp.float32) for _ in range(SCALES)])
        o = tuple(og + part for og, part in zip(o, parts))
      else:
        o = o + pl.run_scoped(pv, plgpu.ACC((D_LATENT, hn), jnp.float32))
    if free is not None:  # (c16_s read: the second warpgroup may convert the next block into it)
      pl.when(k + 1 < nbs)(lambda: plgpu.barrier_arrive(free))
    return o, m_new, l

  zeros = lambda r: plgpu.layout_cast(jnp.zeros((r, hn), jnp.float32), _L.WGMMA)  # noqa: E731
  o0 = tuple(zeros(GROUP) for _ in range(SCALES)) if scales_after else zeros(D_LATENT)
  m0 = plgpu.layout_cast(jnp.full((hn,), _NEG, jnp.float32), _L.WGMMA.reduce(0))
  l0 = plgpu.layout_cast(jnp.zeros((hn,), jnp.float32), _L.WGMMA.reduce(0))
  o, m, l = lax.fori_loop(0, nbs, block, (o0, m0, l0))
  # l >= 1 always (the running max contributes exp2(0)), so no division by zero even for an all-padding split.
  with jax.named_scope("store"):
    for r0, og in (((g * GROUP, og) for g, og in enumerate(o)) if scales_after else ((0, o),)):
      o_g[bt, sp, pl.ds(r0, og.shape[0]), pl.ds(hg * hn, hn)] = plgpu.layout_cast(
          og / lax.broadcast_in_dim(l, og.shape, (1,)), _L.WGMMA)
    lse_g[bt, sp, pl.ds(hg * hn, hn)] = plgpu.layout_cast(m + jnp.log2(l), _L.WGMMA.reduce(0))



TC_KEYS = 128  # positions per block in the tcgen05 form (its MMAs' M: tcgen05 M = 64 does not lower for sm_100)


def _dequant_group(c32_s, cg_s, g: int):
  """Byte plane g (the latent dimensions 128g .. 128g + 127, scale group g) of the gathered rows c32_s [128,
  ROW_WORDS] int32 -> cg_s [128, 128] f16: ``_dequant_block``'s numerics, each 64-row half loaded whole (an untiled
  load sliced at a column offset is wrong natively; at a row offset it is a whole-row tile)."""
  for half in range(TC_KEYS // BLOCK):
    full = plgpu.load(c32_s.at[pl.ds(half * BLOCK, BLOCK)], layout=_L.WGMMA, optimized=False)
    cg_s[pl.ds(half * BLOCK, BLOCK), :] = plgpu.layout_cast(_dequant_plane(full, g).astype(jnp.float16), _L.WGMMA)


def _mla_kernel_tc05(nbs: int, hn: int, qscale: float = 1.0):
  """``_mla_kernel``'s tcgen05 form (Blackwell: no wgmma; sm_100 MMAs of M = 128): ``nbs`` blocks of 128 positions
  per CTA. The dequantised latent of a block would be 128 KB; it goes through shared memory one 128-dimension group
  at a time (cg_s, 32 KB: ``_dequant_group``), twice — S^T [128, hn] accumulated over the 4 groups' MMAs (C_g ·
  Q_g^T into the TMEM accumulator s_t), then after the softmax O^T's 4 row groups (C_g^T · P, one MMA each into
  its own TMEM accumulator). Every TMEM accumulator is relaid through the f32 tile t_s into the WGMMA layout, so the
  mask, the online softmax and O^T's rescaled sums are ``_mla_kernel``'s. One gather buffer (the block's rows are
  read by both passes). Scratch: q_s, idx_s, c32_s [128, ROW_WORDS], cg_s, p_s [128, hn], t_s, s_t, 4 o_t, the
  TMA barriers (q and idx; the gather: 128 arrivals) and the MMAs' barrier."""

  def body(q_g, qm_g, c32_g, idx_g, o_g, lse_g, q_s, idx_s, c32_s, cg_s, p_s, t_s, s_t, o_t0, o_t1, o_t2, o_t3, bar,
           gbar, mbar):
    o_ts = (o_t0, o_t1, o_t2, o_t3)
    hg, sp, bt, b = _mla_prologue(q_g, idx_g, c32_g, q_s, idx_s, bar)

    def issue(k):
      _gather_block(c32_g.at[b], idx_s, k, c32_s, gbar)

    def mma(acc_t, a, b_op, accumulate):
      plgpu.commit_smem()  # (the dequantised group, P: every thread's stores visible to the tensor core)
      plgpu.tcgen05_mma(acc_t, a, b_op, mbar, accumulate=accumulate)
      plgpu.barrier_wait(mbar)  # (done: cg_s may be rewritten, the accumulator read)

    def read(acc_t):
      acc = plgpu.async_load_tmem(acc_t)
      plgpu.wait_load_tmem()
      return tmem_to_wgmma(acc, t_s)

    qmul = qm_g[bt] * qscale
    plgpu.barrier_wait(bar.at[0])

    def block(k, carry):
      *o, m, l = carry
      issue(k)
      plgpu.barrier_wait(gbar)
      for g in range(SCALES):  # S^T = Σ_g C_g · Q_g^T
        _dequant_group(c32_s, cg_s, g)
        mma(s_t, cg_s, q_s.at[:, pl.ds(g * GROUP, GROUP)].T, g > 0)
      st = read(s_t)  # [128 keys, hn]
      iv = plgpu.load(idx_s.at[k], layout=_L.WGMMA.reduce(1), optimized=False)
      valid = lax.broadcast_in_dim(iv >= 0, (TC_KEYS, hn), (0,))
      st = jnp.where(valid, st * qmul, _NEG)  # base-2 logits
      m_new = plgpu.layout_cast(jnp.maximum(m, st.max(axis=0)), _L.WGMMA.reduce(0))
      alpha = jnp.exp2(m - m_new)
      p = plgpu.layout_cast(jnp.exp2(st - lax.broadcast_in_dim(m_new, (TC_KEYS, hn), (1,))), _L.WGMMA)
      l = plgpu.layout_cast(l * alpha + p.sum(axis=0), _L.WGMMA.reduce(0))
      p_s[...] = plgpu.layout_cast(p.astype(jnp.float16), _L.WGMMA)
      new = []
      for g in range(SCALES):  # O^T's rows of group g += C_g^T · P
        _dequant_group(c32_s, cg_s, g)
        mma(o_ts[g], cg_s.T, p_s, False)
        og = plgpu.layout_cast(o[g] * lax.broadcast_in_dim(alpha, o[g].shape, (1,)), _L.WGMMA)
        new.append(og + read(o_ts[g]))
      return (*new, m_new, l)

    o0 = plgpu.layout_cast(jnp.zeros((GROUP, hn), jnp.float32), _L.WGMMA)
    m0 = plgpu.layout_cast(jnp.full((hn,), _NEG, jnp.float32), _L.WGMMA.reduce(0))
    l0 = plgpu.layout_cast(jnp.zeros((hn,), jnp.float32), _L.WGMMA.reduce(0))
    *o, m, l = lax.fori_loop(0, nbs, block, (o0,) * SCALES + (m0, l0))
    for g in range(SCALES):
      o_g[bt, sp, pl.ds(g * GROUP, GROUP), pl.ds(hg * hn, hn)] = plgpu.layout_cast(
          o[g] / lax.broadcast_in_dim(l, o[g].shape, (1,)), _L.WGMMA)
    lse_g[bt, sp, pl.ds(hg * hn, hn)] = plgpu.layout_cast(m + jnp.log2(l), _L.WGMMA.reduce(0))

  return body


def _combine_kernel(ns: int):
  """The split combine as a launch of its own (``combine="kernel"``): a CTA per (64-row tile, token)."""

  def body(o_g, lse_g, out_g):
    _combine_tile(o_g, lse_g, out_g, lax.axis_index("bt"), lax.axis_index("t"), ns)

  return body


def _prepare_q(q):
  """q [B, T, H, 512] -> (f16 q / r, r) with r = amax per (b, t) (at least 1e-30): |q / r| <= 1 in f16. The
  kernels take r and multiply it by softmax_scale · log2 e themselves. Two XLA launches, the reduction and the
  scaled copy: the power of two above amax (exact scales, as r was until session 73) and the product with the
  softmax scale were one launch each more — XLA does not fuse a map of the reduction's result into the
  reduction, nor the map's transcendental functions into its input. r = amax rounds q / r once more in f32
  before its f16 rounding: 2^-24 against f16's 2^-11."""
  q = q.astype(jnp.float32)
  r = jnp.max(jnp.maximum(jnp.abs(q), 1e-30), axis=(-2, -1))  # (the floor inside the reduction's input)
  q16 = (q / r[..., None, None]).astype(jnp.float16)
  return q16, r


COMBINE_TILES = D_LATENT // BLOCK  # 64-row tiles of a token's O^T: the CTAs that combine its splits
COMBINES = ("xla", "kernel")


def _splits(B: int, T: int, H: int, W: int, blocks_per_split: int | None, bk: int = BLOCK) -> tuple[int, int]:
  """(blocks of ``bk`` positions per split, splits) of the index list for these shapes (bk: 64, or TC_KEYS in the
  tcgen05 form)."""
  n_blocks = -(-W // bk)
  nbs = blocks_per_split or _pick_blocks_per_split(n_blocks, B * T * (H // HEADS_PER_CTA))
  return nbs, -(-n_blocks // nbs)


def num_splits(B: int, T: int, H: int, W: int, blocks_per_split: int | None = None, mma: str = "wgmma") -> int:
  """The splits of the index list ``sparse_mla_decode`` runs for these shapes."""
  return _splits(B, T, H, W, blocks_per_split, TC_KEYS if check_mma(mma, "num_splits") else BLOCK)[1]


def index_width(B: int, T: int, H: int, W: int, blocks_per_split: int | None = None, mma: str = "wgmma") -> int:
  """The index list's width inside ``sparse_mla_decode`` for these shapes: W rounded up to whole splits (-1
  padded there). An index list already this wide is taken as it is (no pad: the top-k select kernel writes it
  so), and the splits are unchanged by the padding (a fixed point). ``mma``: the kernel's form (tcgen05: blocks of
  TC_KEYS positions)."""
  bk = TC_KEYS if check_mma(mma, "index_width") else BLOCK
  nbs, ns = _splits(B, T, H, W, blocks_per_split, bk)
  return ns * nbs * bk


SMEM_BYTES = 227 * 1024  # a Hopper CTA's shared memory (sm_90's 227 KB opt-in)
# the gather warpgroup's ring: a prefill chunk's 512 rows (33 blocks a CTA) 726 µs with one warpgroup, 388 with the
# gathers' warpgroup and 2 slots, 453 with 3 (benchmarks/bench_sparse_mla.py --only gather, an H100, session 79)
GATHER_SLOTS = 2


def blocks_per_cta(B: int, T: int, H: int, W: int, blocks_per_split: int | None = None) -> int:
  """The 64-position blocks each CTA of ``sparse_mla_decode`` (the wgmma form) runs for these shapes: 1 at one
  sequence's decode (the list split over ~2 CTAs an SM), 33 at a prefill chunk's 512 rows."""
  return _splits(B, T, H, W, blocks_per_split)[0]


def _mla_smem(nbs: int, hn: int, slots: int, scales_after: bool, q_in: bool, q_dtype) -> int:
  """The wgmma form's SMEM bytes (its scratch below; barriers not counted): q, the index list, the gather ring,
  the converted block, P, and with ``q_in`` the raw queries."""
  q_raw = SCALES * hn * GROUP * jnp.dtype(q_dtype).itemsize if q_in else 0
  return (hn * D_LATENT * 2 + nbs * BLOCK * 4 + slots * BLOCK * ROW_WORDS * 4 + BLOCK * D_LATENT * 2
          + (SCALES if scales_after else 1) * BLOCK * hn * 2 + q_raw)


@kernel_entry("softmax_scale", "blocks_per_split", "combine", "transposed", "lean", "mma", "warpgroups",
              "scales_after", "group_arrival", "q_in_kernel", "gather_warpgroup", "stages")
def sparse_mla_decode(q, cache, indices, *, softmax_scale, blocks_per_split: int | None = None,
                      combine: str = "xla", transposed: bool = False, lean: bool = False, mma: str = "wgmma",
                      warpgroups: int = 1, scales_after: bool = False, group_arrival: bool = False,
                      q_in_kernel: bool = False, gather_warpgroup: bool = False, stages: int | None = None):
  """Mosaic GPU sparse MLA decode; same contract as ``sparse_mla_decode_reference``.

  q [B, T, H, 512] f32/bf16 (H a multiple of 16), cache [B, S, ROW_WORDS] int32 (``quantize_latent``'s rows),
  indices [B, T, W] int32 (-1 padding, any W: padded here to a multiple of 64 * blocks_per_split)
  -> o [B, T, H, 512] f32. The dequantised latent must fit f16 (|c| < 65504; RMSNorm'd latents do).
  ``blocks_per_split``: 64-position blocks per CTA (default: about 2 CTAs per SM). ``combine``: how the splits'
  partial outputs merge — "xla" (``combine_splits``: XLA fusions after the kernel), "kernel" (``_combine_kernel``:
  one Mosaic launch after it). ``transposed``: return the merged O^T [B·T, 512, H] f32 as the merge leaves it (what
  ``mla_absorb_uv`` reads) instead of o. ``lean`` (policy knob lean_barriers): the attention and merge kernels built
  without Mosaic GPU's automatic warpgroup barriers (``CompilerParams(unsafe_no_auto_barriers)``: 43 bar.sync in the
  attention kernel's lowering, 7 lean — and one before each of a block's up to 64 gather TMAs, issued in a loop).
  Nothing else is needed: every SMEM store (the dequantised block, P) is followed by a commit_smem before the wgmma
  reads it; the gather into a slot and the dequantised block's store each come after a commit_smem that every
  thread passes once done reading that buffer's previous block (the double-buffered slot's dequant, the previous
  block's PV wgmma); the outputs are written once. ``mma``: "wgmma" (Hopper) or "tcgen05" (Blackwell, sm_100: no
  wgmma there) — ``_mla_kernel_tc05``: blocks of TC_KEYS = 128 positions, the MMAs into tensor memory; within the
  kernels' tolerance of the reference as the wgmma form (P's f16 rounding differs: a 128-position block's running
  max is not a 64-position one's; GPU interpret mode, compiled for sm_100a on a CPU, not yet run on a Blackwell
  GPU); ``lean`` is ignored there (built with the automatic barriers). ``warpgroups``: 1, or 2 — a second
  warpgroup per CTA converting half of every block's byte planes (``_mla_kernel``; policy knob
  mla_dequant_warpgroups); the wgmma form only. ``scales_after``: the latent's block scales applied after the
  MMAs (``_mla_kernel``; policy knob mla_scales_after), the dequantisation converting bytes only; the wgmma form
  only. ``group_arrival``: the gathers' barrier counts one arrival per group of RUN rows instead of RUN
  (``_gather_block``'s ``xbar``; policy knob mla_group_arrival); the same rows where the index list is valid, the
  same outputs; the wgmma form only. ``q_in_kernel``: q read as it is (f32 or bf16) and rescaled to f16 in each
  CTA's prologue (``_mla_q_prep``: r the amax of its head group's queries) instead of ``_prepare_q``'s two XLA
  launches before the kernel (policy knob mla_q_in_kernel); the same r where one head group holds every head (16
  heads, TP4), so the same outputs up to the division's rounding; the wgmma form only. ``gather_warpgroup``: a
  second warpgroup per CTA issues every block's gathers into a ring of ``stages`` slots (default GATHER_SLOTS: 2;
  3 measured slower) while the first converts and multiplies (``_mla_kernel``'s ``gather_wg``; policy knob
  mla_gather_warpgroup): the same outputs bit for bit; the wgmma form only (with ``warpgroups=2``: three
  warpgroups, the gathers', and the two converting half a block each)."""
  tc05 = check_mma(mma, "sparse_mla_decode")
  if gather_warpgroup and tc05:
    raise ValueError(f"sparse_mla_decode: gather_warpgroup=True in the tcgen05 form (mma = {mma!r}); it is the wgmma "
                     f"form's")
  if stages is not None and (not gather_warpgroup or stages not in (2, 3)):
    raise ValueError(f"sparse_mla_decode: stages = {stages!r}; expected 2 or 3, with gather_warpgroup=True (the "
                     f"other forms gather into 2 slots)")
  if warpgroups not in (1, 2) or (tc05 and warpgroups != 1):
    raise ValueError(f"sparse_mla_decode: warpgroups = {warpgroups!r}; expected 1 or 2 (2 in the wgmma form only: "
                     f"mma = {mma!r})")
  if tc05 and group_arrival:
    raise ValueError("sparse_mla_decode: group_arrival=True in the tcgen05 form (mma = 'tcgen05'); it is the wgmma "
                     "form's")
  if tc05 and scales_after:
    raise ValueError("sparse_mla_decode: scales_after=True in the tcgen05 form (mma = 'tcgen05'); it is the wgmma "
                     "form's (the tcgen05 form dequantises one 128-dimension group at a time already)")
  if tc05 and q_in_kernel:
    raise ValueError("sparse_mla_decode: q_in_kernel=True in the tcgen05 form (mma = 'tcgen05'); it is the wgmma "
                     "form's")
  B, T, H, Dl = q.shape
  if Dl != D_LATENT or cache.shape[-1] != ROW_WORDS or cache.dtype != jnp.int32:
    raise ValueError(f"sparse_mla_decode: q [.., {Dl}], cache {cache.shape} {cache.dtype}; expected q [.., "
                     f"{D_LATENT}] and int32 cache rows [B, S, {ROW_WORDS}] (quantize_latent)")
  if cache.shape[1] < RUN:  # an all-padding group of RUN indices loads rows 0 .. RUN - 1
    raise ValueError(f"sparse_mla_decode: a cache of {cache.shape[1]} positions; expected at least {RUN}")
  assert H % HEADS_PER_CTA == 0, H
  if combine not in COMBINES:
    raise ValueError(f"sparse_mla_decode: combine = {combine!r}, expected one of {COMBINES}")
  hn = HEADS_PER_CTA
  W = indices.shape[-1]
  bk = TC_KEYS if tc05 else BLOCK
  nbs, ns = _splits(B, T, H, W, blocks_per_split, bk)
  wp = ns * nbs * bk
  idx = jnp.pad(indices.astype(jnp.int32), ((0, 0), (0, 0), (0, wp - W)), constant_values=-1)
  idx = idx.reshape(B * T, wp // bk, bk)
  if q_in_kernel:  # (the kernel's TMA reads f32 or bf16 rows; anything else is widened first)
    qk = (q if q.dtype in (jnp.float32, jnp.bfloat16) else q.astype(jnp.float32)).reshape(B * T, H, D_LATENT)
    q_args = (qk,)
  else:
    q16, qr = _prepare_q(q)
    q_args = (q16.reshape(B * T, H, D_LATENT), qr.reshape(B * T))
  qscale = float(softmax_scale) * _LOG2E  # (the kernels' r · qscale: base-2 logits)
  f16 = jnp.float16
  parts = (jax.ShapeDtypeStruct((B * T, ns, D_LATENT, H), jnp.float32),
           jax.ShapeDtypeStruct((B * T, ns, H), jnp.float32))
  combined = jax.ShapeDtypeStruct((B * T, D_LATENT, H), jnp.float32)
  if tc05:
    kern = mgpu_kernel(
        _mla_kernel_tc05(nbs, hn, qscale),
        out_type=parts,
        scratch_types=[
            plgpu.SMEM((hn, D_LATENT), f16, transforms=_F16_SW32),  # q_s
            plgpu.SMEM((nbs, TC_KEYS), jnp.int32),  # idx_s
            plgpu.SMEM((TC_KEYS, ROW_WORDS), jnp.int32),  # c32_s: the block's gathered cache rows
            plgpu.SMEM((TC_KEYS, GROUP), f16, transforms=_F16_SW32),  # cg_s: one dequantised group
            plgpu.SMEM((TC_KEYS, hn), f16, transforms=_F16_SW32),  # p_s
            plgpu.SMEM((TC_KEYS, hn), jnp.float32),  # t_s: the relay to the WGMMA layout
            *[plgpu.TMEM((TC_KEYS, hn), jnp.float32) for _ in range(1 + SCALES)],  # s_t, O^T's 4 groups
            plgpu.Barrier(num_barriers=2),
            plgpu.Barrier(num_arrivals=TC_KEYS),
            plgpu.Barrier(num_arrivals=1, orders_tensor_core=True),
        ],
        grid=(H // hn, ns, B * T),
        grid_names=("h", "s", "bt"),
        kernel_name="glm5_sparse_mla",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )
  else:
    n_wg = warpgroups + bool(gather_warpgroup)
    two = dict(num_threads=n_wg, thread_name="wg") if n_wg > 1 else {}
    S = (stages or GATHER_SLOTS) if gather_warpgroup else 2
    if gather_warpgroup and _mla_smem(nbs, hn, S, scales_after, q_in_kernel, q_args[0].dtype) > SMEM_BYTES:
      raise ValueError(f"sparse_mla_decode: {S} gather slots, {nbs} blocks a split and the queries' "
                       f"{q_args[0].dtype} need {_mla_smem(nbs, hn, S, scales_after, q_in_kernel, q_args[0].dtype)} "
                       f"bytes of SMEM; a CTA has {SMEM_BYTES}")
    kern = mgpu_kernel(
        _mla_kernel(nbs, hn, warpgroups, bool(scales_after), bool(group_arrival), qscale, bool(q_in_kernel),
                    bool(gather_warpgroup)),
        out_type=parts,
        scratch_types=[
            # q_s (q_in_kernel: group-major [4·hn, 128], the same bytes)
            plgpu.SMEM((SCALES * hn, GROUP) if q_in_kernel else (hn, D_LATENT), f16, transforms=_F16_SW32),
            plgpu.SMEM((nbs, BLOCK), jnp.int32),  # idx_s (TMA boxes are <= 256 per dimension)
            plgpu.SMEM((S, BLOCK, ROW_WORDS), jnp.int32),  # c32_s: gathered cache rows (a ring of S slots)
            plgpu.SMEM((BLOCK, D_LATENT), f16, transforms=_F16_SW32),  # c16_s
            # p_s (scales_after: the 4 groups' scaled P)
            plgpu.SMEM((SCALES, BLOCK, hn) if scales_after else (BLOCK, hn), f16, transforms=_F16_SW32),
            plgpu.Barrier(num_barriers=2),
            # gbar (group_arrival: one arrival per group of RUN rows; then xbar, its irregular groups' rows)
            plgpu.Barrier(num_arrivals=BLOCK // RUN if group_arrival else BLOCK, num_barriers=S),
            *([plgpu.Barrier(num_arrivals=RUN)] if group_arrival else []),
            # (gather_warpgroup: consumed — a slot converted, an arrival from each converting warpgroup)
            *([plgpu.Barrier(num_arrivals=warpgroups, num_barriers=S)] if gather_warpgroup else []),
            # (two warpgroups: ready — both planes' halves stored, an arrival each; free — c16_s read by PV)
            *([plgpu.Barrier(num_arrivals=2), plgpu.Barrier(num_arrivals=1)] if warpgroups == 2 else []),
            # (q_in_kernel: the raw queries group-major, the 4 TMAs' barrier)
            *([plgpu.SMEM((SCALES * hn, GROUP), q_args[0].dtype), plgpu.Barrier(num_arrivals=SCALES)]
              if q_in_kernel else []),
        ],
        grid=(H // hn, ns, B * T),
        grid_names=("h", "s", "bt"),
        kernel_name="glm5_sparse_mla",
        compiler_params=plgpu.CompilerParams(approx_math=True, unsafe_no_auto_barriers=bool(lean)),
        **two,
    )
  o_part, lse = kern(*q_args, cache, idx)
  if combine == "xla":
    o = combine_splits(o_part, lse)  # [BT, 512, H] (O^T per token)
  else:
    o = mgpu_kernel(_combine_kernel(ns), out_type=combined, grid=(COMBINE_TILES, B * T), grid_names=("t", "bt"),
                    kernel_name="glm5_mla_combine",  # (lean: its only stores, the output's, are written once)
                    compiler_params=plgpu.CompilerParams(approx_math=True, unsafe_no_auto_barriers=bool(lean)))(
                        o_part, lse)
  if transposed:
    return o
  return jnp.swapaxes(o, 1, 2).reshape(B, T, H, D_LATENT)  # O^T per token -> [.., H, latent]


def combine_splits(o_part, lse):
  """The splits' partial outputs o_part [BT, NS, 512, H] f32 (each normalised over its own positions) and their
  log2-sum-exp2 lse [BT, NS, H] (~ -1e30 for an all-padding split) -> o [BT, 512, H] = Σ_s 2^lse_s o_s / Σ_s
  2^lse_s, as ONE variadic reduction over the splits carrying (running max, weight sum, weighted output): the
  online-softmax merge. In XLA the max, the exp2 weights and the weighted sum were three kernels per DSA layer on
  the critical path (session 27's profile). (As an einsum it would be a dot with the heads as a batch dimension,
  which XLA on the H200 made a ~14 µs Triton gemm fusion, session 25.)"""
  f32 = jnp.float32
  m0 = jnp.broadcast_to(lse.astype(f32)[:, :, None, :], o_part.shape)

  def merge(a, b):
    (ma, la, oa), (mb, lb, ob) = a, b
    m = jnp.maximum(ma, mb)
    # (an operand still at the initial -inf has weight 0: -inf - -inf would be NaN)
    ea = jnp.where(ma == -jnp.inf, 0.0, jnp.exp2(ma - m))
    eb = jnp.where(mb == -jnp.inf, 0.0, jnp.exp2(mb - m))
    return m, la * ea + lb * eb, oa * ea + ob * eb

  init = (jnp.array(-jnp.inf, f32), jnp.array(0.0, f32), jnp.array(0.0, f32))
  _, l, o = lax.reduce((m0, jnp.ones_like(o_part, f32), o_part.astype(f32)), init, merge, (1,))
  return o / l


# ------------------------------------------------------------------------------------------------ W_UV
# The attention's output per head through W_UV (o_h [512] -> [dv]) as a kernel reading the merge's O^T as it
# is: in XLA it was a transpose kernel (O^T -> O) and a reduction over the 4 MB weight, two launches after the
# merge on every DSA layer's critical path (1.9 + 3.0 µs, session 46's trace).
UV_MAX_TOKENS = 8  # token rows per launch: one accumulator and one O^T tile set per token (SMEM: 16 KB each)
KT = D_LATENT // BLOCK  # the contraction's K tiles of 64
UV_TC_ROWS = 128  # W_UV rows per CTA in the tcgen05 form (M = 64 would need a 16-byte swizzle for N = 16: none)
_BF16_SW32 = (plgpu.TilingTransform((8, 16)), plgpu.SwizzleTransform(32))  # (as _F16_SW32: one swizzle, A and B)


def mla_absorb_uv_reference(o_t, w_kv, *, dn: int, x16: bool = False):
  """o_t [BT, 512, Hp] f32 (the merged O^T per token: ``sparse_mla_decode(transposed=True)``), w_kv [H, dn + dv,
  512] bf16 (kv_b_proj's weight per head: W_UK rows, then W_UV's) -> [BT, H, dv] bf16: o_h rounded to bf16, then
  Σ_r o_h[r] · W_UV_h[v, r] in f32, rounded to bf16 — the model's attention.DSA chain (``_per_head``) for the first
  H <= Hp heads. ``x16``: (that, its f16 copy saturated at ±65,504 — the f16 dq kernels' input, policy dq_f16)."""
  H = w_kv.shape[0]
  o = jnp.swapaxes(o_t, 1, 2)[:, :H].astype(jnp.bfloat16).astype(jnp.float32)  # [BT, H, 512]
  w = w_kv[:, dn:].astype(jnp.float32)  # [H, dv, 512]
  out = jnp.sum(o[:, :, None, :] * w[None], axis=-1).astype(jnp.bfloat16)
  return (out, saturate_f16(out)) if x16 else out


def _uv_stage(o_g, ob_s, slot, bt, g0):
  """Token bt's O^T [512, 16] of the head group at g0, from GMEM in 64-row tiles (the 8 loads issued before their
  first use: all in flight at once), rounded to bf16 into the B operand's 8 K tiles ob_s[slot] [KT, 64, 16] (each
  stored whole: no register store at an offset into SMEM)."""
  o = [plgpu.load(o_g.at[bt, pl.ds(t * BLOCK, BLOCK), pl.ds(g0, HEADS_PER_CTA)], layout=_L.WGMMA,
                  optimized=False) for t in range(KT)]
  for t in range(KT):
    ob_s[slot, t] = plgpu.layout_cast(o[t].astype(jnp.bfloat16), _L.WGMMA)


def _uv_head(acc, col, head, v_s, v16_s, bt):
  """Token bt's [rows, 16] product (WGMMA layout) -> the head's own column (a masked row sum: one nonzero term,
  exact) into v_s[bt] in bf16 (and v16_s[bt] in f16 from the bf16-rounded value: x16)."""
  v = jnp.where(col == head, acc, 0.0).sum(axis=1)
  v_s[bt] = v.astype(jnp.bfloat16)
  if v16_s is not None:
    v16_s[bt] = saturate_f16(round_bf16(v))


def _uv_store(v_s, v16_s, out_g, out16_g, h, v0):
  """Every token's rows (v_s [BT, rows], and v16_s) to out[bt, h, v0:v0 + rows] by TMA, after a commit."""
  plgpu.commit_smem()
  rows = v_s.shape[1]
  for bt in range(v_s.shape[0]):
    plgpu.copy_smem_to_gmem(v_s.at[bt], out_g.at[bt, h, pl.ds(v0, rows)])
    if v16_s is not None:
      plgpu.copy_smem_to_gmem(v16_s.at[bt], out16_g.at[bt, h, pl.ds(v0, rows)])
  plgpu.wait_smem_to_gmem(0)


def _uv_kernel(BT: int, dn: int, x16: bool = False):
  """CTA (v-chunk c, head h): out[:, h, 64c .. 64c + 63] for every token. W_UV_h's [64, 512] rows by TMA (8 K
  tiles of 64, the wgmma A operand); each token's O^T [512, 16] of the head's group of 16 loaded from GMEM in
  64-row tiles (as the merge kernel reads its splits), rounded to bf16, each stored whole as one of the B
  operand's 8 K tiles (no register store at an offset into SMEM); acc [64, 16] =
  W_UV_h · O^T[:, group] holds the head's own column at h % 16 (the other 15: its weight on the group's other
  heads, unused — the MMA is free next to the weight's bytes), taken by a masked row sum (one nonzero term:
  exact) and stored by TMA (``x16``: also in f16, from the bf16-rounded value)."""

  def body(o_g, w_g, *refs):
    if x16:
      out_g, out16_g, w_s, ob_s, v_s, v16_s, bar = refs
    else:
      (out_g, w_s, ob_s, v_s, bar), out16_g, v16_s = refs, None, None
    c, h = lax.axis_index("c"), lax.axis_index("h")
    v0, g0 = c * BLOCK, (h // HEADS_PER_CTA) * HEADS_PER_CTA
    for t in range(KT):
      plgpu.copy_gmem_to_smem(w_g.at[h, pl.ds(dn + v0, BLOCK), pl.ds(t * BLOCK, BLOCK)], w_s.at[t], bar)
    for bt in range(BT):
      _uv_stage(o_g, ob_s, bt, bt, g0)
    plgpu.commit_smem()
    plgpu.barrier_wait(bar)
    col = plgpu.broadcasted_iota(jnp.int32, (BLOCK, HEADS_PER_CTA), 1, layout=_L.WGMMA)
    for bt in range(BT):
      def mma(acc, bt=bt):
        for t in range(KT):
          plgpu.wgmma(acc, w_s.at[t], ob_s.at[bt, t])
        return acc[...]

      acc = pl.run_scoped(mma, plgpu.ACC((BLOCK, HEADS_PER_CTA), jnp.float32))
      _uv_head(acc, col, h - g0, v_s, v16_s, bt)
    _uv_store(v_s, v16_s, out_g, out16_g, h, v0)

  return body


def _uv_kernel_tc05(BT: int, dn: int, x16: bool = False):
  """``_uv_kernel``'s tcgen05 form (Blackwell, no wgmma): CTA (v-chunk c, head h) -> out[:, h, 128c .. 128c + 127]
  (an M = 64 tcgen05 MMA splits N over two lane groups and N = 16 would then need a 16-byte swizzle, which does
  not exist: M = 128). The [128, 16] accumulator lives in TMEM; a token's 8 MMAs are issued by one thread, the
  last arriving on the tensor-core barrier when all are done. W_UV_h's [128, 512] rows (128 KB) leave no room for
  every token's O^T tiles at once (16 KB each, up to 8 tokens): they go through a ring of two, token bt's written
  (from its GMEM loads) while token bt - 1's MMAs run. Token bt - 1's result is read from TMEM before token bt's
  MMAs overwrite the one accumulator, and its epilogue (relayed into the WGMMA layout through an SMEM f32 tile —
  no register relayout from tcgen05's row-per-thread layout exists — then ``_uv_kernel``'s masked row sum, bf16
  rounding and f16 copy) runs while they do. Checked in GPU interpret mode and compiled for sm_100a on a CPU
  (compile-only b200 topology); not yet run on a GPU."""

  def body(o_g, w_g, *refs):
    if x16:
      out_g, out16_g, w_s, ob_s, v_s, v16_s, t_s, acc_t, bar, done = refs
    else:
      (out_g, w_s, ob_s, v_s, t_s, acc_t, bar, done), out16_g, v16_s = refs, None, None
    c, h = lax.axis_index("c"), lax.axis_index("h")
    v0, g0 = c * UV_TC_ROWS, (h // HEADS_PER_CTA) * HEADS_PER_CTA
    for t in range(KT):
      plgpu.copy_gmem_to_smem(w_g.at[h, pl.ds(dn + v0, UV_TC_ROWS), pl.ds(t * BLOCK, BLOCK)], w_s.at[t], bar)
    col = plgpu.broadcasted_iota(jnp.int32, (UV_TC_ROWS, HEADS_PER_CTA), 1, layout=_L.WGMMA)

    def stage(bt):
      # (slot bt % 2 was last read by token bt - 2's MMAs, whose barrier has been waited: free)
      _uv_stage(o_g, ob_s, bt % 2, bt, g0)
      plgpu.commit_smem()  # (every thread's tiles visible to the MMA's async proxy)

    def issue(bt):
      for t in range(KT):
        plgpu.tcgen05_mma(acc_t, w_s.at[t], ob_s.at[bt % 2, t], done if t == KT - 1 else None, accumulate=t > 0)

    def read():
      plgpu.barrier_wait(done)  # (one arrival per token, waited once, in order)
      acc = plgpu.async_load_tmem(acc_t)
      # (read before the next token's MMAs overwrite the accumulator: the wait ends with a warpgroup barrier, so
      # every thread's read is done before the one thread issues them)
      plgpu.wait_load_tmem()
      return acc

    def epilogue(bt, acc):
      # (relay slot bt % 2: slot reuse two tokens later is behind the commit_smem of the token between)
      _uv_head(tmem_to_wgmma(acc, t_s.at[bt % 2]), col, h - g0, v_s, v16_s, bt)

    stage(0)
    plgpu.barrier_wait(bar)
    issue(0)
    for bt in range(1, BT):
      stage(bt)  # (overlaps token bt - 1's MMAs)
      acc = read()
      issue(bt)
      epilogue(bt - 1, acc)  # (overlaps token bt's MMAs)
    epilogue(BT - 1, read())
    _uv_store(v_s, v16_s, out_g, out16_g, h, v0)

  return body


@kernel_entry("dn", "lean", "x16", "mma")
def mla_absorb_uv(o_t, w_kv, *, dn: int, lean: bool = False, x16: bool = False, mma: str = "wgmma"):
  """Mosaic GPU version of ``mla_absorb_uv_reference`` (same signature): a CTA per (64 output values, head), dv /
  64 · H CTAs (64 at TP4: 16 heads, dv = 256), each streaming its [64, 512] slice of W_UV once for all the
  launch's tokens (up to UV_MAX_TOKENS). The products of bf16 values are exact in the f32 accumulator; the sums
  run in another order than XLA's (the result within bf16 rounding of the reference). ``lean`` (policy knob
  lean_barriers): built without Mosaic GPU's automatic warpgroup barriers (29 bar.sync, 3 lean): each SMEM buffer
  is written once and read after a commit_smem (the O^T tiles by the wgmma, the outputs by the TMA). ``x16``
  (policy knob dq_f16): (out, out in f16) as the reference's — o_proj's f16 kernel input, no conversion kernel.
  ``mma``: "wgmma" (Hopper) or "tcgen05" (Blackwell, which has no wgmma: ``_uv_kernel_tc05``) — a CTA per (128
  output values, head), dv a multiple of 128, the accumulator in tensor memory; ``lean`` is ignored there (built
  with the automatic barriers: its ordering is not checked on a GPU yet)."""
  tc05 = check_mma(mma, "mla_absorb_uv")
  BT, Dl, Hp = o_t.shape
  H, rows, R = w_kv.shape
  dv = rows - dn
  if (Dl, R) != (D_LATENT, D_LATENT) or o_t.dtype != jnp.float32 or w_kv.dtype != jnp.bfloat16:
    raise ValueError(f"mla_absorb_uv: o_t {o_t.shape} {o_t.dtype}, w_kv {w_kv.shape} {w_kv.dtype}; expected o_t "
                     f"[BT, {D_LATENT}, Hp] f32 and bf16 w_kv [H, dn + dv, {D_LATENT}]")
  if Hp % HEADS_PER_CTA or not H <= Hp or dn < 0 or dv <= 0 or dv % BLOCK:
    raise ValueError(f"mla_absorb_uv: {H} heads of {Hp} in o_t, dn = {dn}, dv = {dv}; expected Hp a multiple of "
                     f"{HEADS_PER_CTA}, H <= Hp, dn >= 0 and dv a positive multiple of {BLOCK}")
  if not 1 <= BT <= UV_MAX_TOKENS:
    raise ValueError(f"mla_absorb_uv: {BT} token rows; expected 1 .. {UV_MAX_TOKENS}")
  if tc05 and dv % UV_TC_ROWS:
    raise ValueError(f"mla_absorb_uv: dv = {dv}; mma='tcgen05' needs dv a multiple of {UV_TC_ROWS} (its CTA's rows)")
  bf16, f16 = jnp.bfloat16, jnp.float16
  out = jax.ShapeDtypeStruct((BT, H, dv), bf16)
  if tc05:
    return mgpu_kernel(
        _uv_kernel_tc05(BT, dn, x16),
        out_type=(out, jax.ShapeDtypeStruct((BT, H, dv), f16)) if x16 else out,
        scratch_types=[
            plgpu.SMEM((KT, UV_TC_ROWS, BLOCK), bf16, transforms=_BF16_SW32),  # w_s: W_UV_h's 128 rows, K tiles
            plgpu.SMEM((2, KT, BLOCK, HEADS_PER_CTA), bf16, transforms=_BF16_SW32),  # ob_s: O^T ring, K tiles
            plgpu.SMEM((BT, UV_TC_ROWS), bf16),  # v_s: the outputs
            *([plgpu.SMEM((BT, UV_TC_ROWS), f16)] if x16 else []),  # v16_s: the outputs in f16 (x16)
            plgpu.SMEM((2, UV_TC_ROWS, HEADS_PER_CTA), jnp.float32),  # t_s: the relay to the WGMMA layout
            plgpu.TMEM((UV_TC_ROWS, HEADS_PER_CTA), jnp.float32),  # acc_t: the accumulator
            plgpu.Barrier(num_arrivals=KT),  # bar: W_UV_h's TMAs
            plgpu.Barrier(num_arrivals=1, orders_tensor_core=True),  # done: a token's MMAs
        ],
        grid=(dv // UV_TC_ROWS, H),
        grid_names=("c", "h"),
        kernel_name="glm5_mla_uv",
    )(o_t, w_kv)
  return mgpu_kernel(
      _uv_kernel(BT, dn, x16),
      out_type=(out, jax.ShapeDtypeStruct((BT, H, dv), f16)) if x16 else out,
      scratch_types=[
          plgpu.SMEM((KT, BLOCK, BLOCK), bf16, transforms=_BF16_SW32),  # w_s: W_UV_h's 64 rows, K tiles
          plgpu.SMEM((BT, KT, BLOCK, HEADS_PER_CTA), bf16, transforms=_BF16_SW32),  # ob_s: O^T, K tiles
          plgpu.SMEM((BT, BLOCK), bf16),  # v_s: the outputs
          *([plgpu.SMEM((BT, BLOCK), f16)] if x16 else []),  # v16_s: the outputs in f16 (x16)
          plgpu.Barrier(num_arrivals=KT),
      ],
      grid=(dv // BLOCK, H),
      grid_names=("c", "h"),
      kernel_name="glm5_mla_uv",
      compiler_params=plgpu.CompilerParams(unsafe_no_auto_barriers=bool(lean)),
  )(o_t, w_kv)


# ------------------------------------------------------------------------------------------------ W_UK
# The absorbed query q̂_h = W_UK_hᵀ q_h (q_h [dn] -> [512]) as a kernel. In XLA (attention._per_head) it is one
# reduction fusion over the 4 MB weight at one token row (4.4 µs, session 71's q = 1 trace), but at the verify's
# 4 rows XLA first copies W_UK transposed in f32 (an 8.4 MB `input_transpose_fusion` per DSA layer per step, 12.8
# µs) and then reduces it (8.4 µs): 21 µs of HBM traffic a DSA layer in the verify step (session 71's q = 4 trace;
# beside the indexer's selection, which ends later: off the layer's chain).
UK_HEADS = HEADS_PER_CTA  # q's heads per B operand: the CTA's head and the 15 others of its group (N = 16)
_BF16_SW128 = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))  # [.., 64] bf16 rows of 128 bytes


def mla_absorb_uk_reference(q, w_kv, *, dn: int):
  """q [BT, Hp, dn] bf16 (q_b_proj's output per head, Hp >= H: heads past H padding, unread), w_kv [H, dn + dv,
  512] bf16 (kv_b_proj's weight per head: W_UK's dn rows, then W_UV's) -> q̂ [BT, H, 512] bf16: Σ_n q_h[n] ·
  W_UK_h[n, r] in f32, rounded to bf16 — the model's attention.DSA absorption (``_per_head``, a few token rows)."""
  w = w_kv[:, :dn].astype(jnp.float32)  # [H, dn, 512]
  q = q[:, :w.shape[0]].astype(jnp.float32)
  return jnp.sum(q[..., :, None] * w, axis=-2).astype(jnp.bfloat16)


def _uk_kernel(BT: int, dn: int):
  """CTA (r-chunk c, head h): q̂[:, h, 64c .. 64c + 63] for every token. W_UK_h's [dn, 64] columns by TMA in K
  tiles of 64 rows ([64 n, 64 r] each, 128-byte rows: the wgmma A operand transposed — W_UK_hᵀ [64 r, dn]); each
  token's q rows of the head's group of 16 by TMA in K tiles ([16 heads, 64 n]: the B operand transposed, q^T
  [dn, 16]); acc [64, 16] = W_UK_hᵀ · q^T holds the head's own column at h % 16 (the other 15: its weight on the
  group's other heads, unused — the MMA is free next to the weight's bytes), taken by a masked row sum (one
  nonzero term: exact) and stored by TMA (``_uv_kernel``'s epilogue)."""
  kt = dn // BLOCK

  def body(q_g, w_g, out_g, w_s, q_s, v_s, bar):
    c, h = lax.axis_index("c"), lax.axis_index("h")
    r0, g0 = c * BLOCK, (h // UK_HEADS) * UK_HEADS
    for t in range(kt):  # (the weight first: its bytes are the kernel's time; q's tiles come from L2)
      plgpu.copy_gmem_to_smem(w_g.at[h, pl.ds(t * BLOCK, BLOCK), pl.ds(r0, BLOCK)], w_s.at[t], bar)
    for bt in range(BT):
      for t in range(kt):
        plgpu.copy_gmem_to_smem(q_g.at[bt, pl.ds(g0, UK_HEADS), pl.ds(t * BLOCK, BLOCK)], q_s.at[bt, t], bar)
    plgpu.barrier_wait(bar)
    col = plgpu.broadcasted_iota(jnp.int32, (BLOCK, UK_HEADS), 1, layout=_L.WGMMA)
    for bt in range(BT):
      def mma(acc, bt=bt):
        for t in range(kt):
          plgpu.wgmma(acc, w_s.at[t].transpose((1, 0)), q_s.at[bt, t].transpose((1, 0)))
        return acc[...]

      acc = pl.run_scoped(mma, plgpu.ACC((BLOCK, UK_HEADS), jnp.float32))
      _uv_head(acc, col, h - g0, v_s, None, bt)
    _uv_store(v_s, None, out_g, None, h, r0)

  return body


@kernel_entry("dn", "lean")
def mla_absorb_uk(q, w_kv, *, dn: int, lean: bool = False):
  """Mosaic GPU version of ``mla_absorb_uk_reference`` (same signature; Hopper's wgmma): a CTA per (64 outputs,
  head), 512 / 64 · H CTAs (128 at TP4: 16 heads), each streaming its [dn, 64] slice of W_UK once for all the
  launch's tokens (up to UV_MAX_TOKENS). q's heads Hp a multiple of UK_HEADS (the model pads them where H is not:
  the tiny presets), H <= Hp. The products of bf16 values are exact in the f32 accumulator; the sums run in
  another order than XLA's (the result within bf16 rounding of the reference). ``lean`` (policy knob lean_barriers): built
  without Mosaic GPU's automatic warpgroup barriers: every SMEM buffer is written once — the operands by TMA
  (waited on their barrier), the outputs after the MMAs and read after a commit_smem."""
  BT, Hp, n = q.shape
  H, rows, R = w_kv.shape
  if (q.dtype, w_kv.dtype) != (jnp.bfloat16, jnp.bfloat16) or R != D_LATENT or n != dn:
    raise ValueError(f"mla_absorb_uk: q {q.shape} {q.dtype}, w_kv {w_kv.shape} {w_kv.dtype}, dn = {dn}; expected "
                     f"bf16 q [BT, Hp, dn] and bf16 w_kv [H, dn + dv, {D_LATENT}]")
  if H > Hp or Hp % UK_HEADS or dn <= 0 or dn % BLOCK or rows < dn:
    raise ValueError(f"mla_absorb_uk: {Hp} heads in q, {H} in w_kv, dn = {dn} of {rows} rows; expected q's heads a "
                     f"multiple of {UK_HEADS}, at least w_kv's, and dn a positive multiple of {BLOCK}")
  if not 1 <= BT <= UV_MAX_TOKENS:
    raise ValueError(f"mla_absorb_uk: {BT} token rows; expected 1 .. {UV_MAX_TOKENS}")
  bf16, kt = jnp.bfloat16, dn // BLOCK
  return mgpu_kernel(
      _uk_kernel(BT, dn),
      out_type=jax.ShapeDtypeStruct((BT, H, D_LATENT), bf16),
      scratch_types=[
          plgpu.SMEM((kt, BLOCK, BLOCK), bf16, transforms=_BF16_SW128),  # w_s: W_UK_h's 64 columns, K tiles
          plgpu.SMEM((BT, kt, UK_HEADS, BLOCK), bf16, transforms=_BF16_SW128),  # q_s: q's group rows, K tiles
          plgpu.SMEM((BT, BLOCK), bf16),  # v_s: the outputs
          plgpu.Barrier(num_arrivals=kt * (1 + BT)),  # (every operand's TMA)
      ],
      grid=(D_LATENT // BLOCK, H),
      grid_names=("c", "h"),
      kernel_name="glm5_mla_uk",
      compiler_params=plgpu.CompilerParams(unsafe_no_auto_barriers=bool(lean)),
  )(q, w_kv)
