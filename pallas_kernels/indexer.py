"""kpool indexer on the decode path with vLLM numerics (spec model.md §2, §3.6.3 steps 5-6; decode.md §1.3).

Shapes: B sequences, T query tokens per sequence, HI = 32 indexer heads, 128 = index head dim, P pool slots in
the pooled-key cache (P = ctx / 4).

* ``hadamard128``: orthonormal Walsh-Hadamard transform of the last dim (Sylvester ordering).
* ``quant_ue8m0_fp8``: per-128-vector FP8 e4m3 with a power-of-two (UE8M0) scale, after bf16 rounding.
* ``indexer_scores`` (Mosaic GPU) / ``indexer_scores_reference`` (jnp, f32):
    scores[b, t, j] = k_scale[b, j] · Σ_h w[b,t,h] · q_scale[b,t,h] · ReLU(q8[b,t,h] · k8[b,j]), j < n_valid[b,t]
                      -inf,                                                                j >= n_valid[b,t]
* ``topk_threshold`` (Mosaic GPU) / ``topk_threshold_reference`` (jnp): the k-th largest of each row of uint32
  keys (the monotone keys of ``glm5_jax.layers.topk_set_by_threshold``) and how many keys exceed it — the
  selection's threshold, where the XLA radix selection spent ~13 small kernels per call (4 passes of a
  [.., 256, N] compare-and-count, a count and an OR each). The prefix sum and the scatter of the selected indices
  stay in XLA (a per-thread scatter is not expressible in Mosaic GPU's warpgroup arrays).

Kernel design: the pooled keys are shared by all T tokens and all 32 heads of a sequence, so one CTA streams a
contiguous chunk of pooled keys of one sequence (blocks of 64 keys, double-buffered TMA) and scores them against
all T x 32 queries: an fp8 x fp8 wgmma per token (keys = M = 64, that token's 32 heads = N, K = 128, f32
accumulator), then ReLU, the per-head weight and the sum over heads in f32 on the CUDA cores (a row reduction of
the [64, 32] tile), the key scale and the causal mask. Blocks past every token's n_valid are not loaded (the
cache is allocated for the longest context; the actual context is usually shorter) and are written as -inf.
Blackwell (sm_100, no wgmma): ``mma="tcgen05"`` — blocks of 128 keys, each token's product a tcgen05 MMA into a
tensor-memory accumulator, relaid through SMEM into the WGMMA layout for the same epilogue (``_indexer_kernel``).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._common import (check_mma, kernel_entry, mgpu_kernel, order_key_u32, replicated_rows_layouts,
                                    tmem_to_wgmma, warp_split_layout)

HEAD_DIM = 128
FP8_MAX = 448.0
AMAX_FLOOR = 1e-4
BLOCK = 64  # pooled keys per wgmma (M)
# Blackwell (sm_100) has no wgmma: mma="tcgen05" issues tcgen05 MMAs into a tensor-memory accumulator, M = 128 (an
# M = 64 tcgen05 MMA splits N over two lane groups and constrains the swizzles; Mosaic refused it with N = 32)
TC_BLOCK = 128  # pooled keys (and rotated query rows) per tcgen05 MMA (M)
NUM_SMS = 132  # H200
_L = plgpu.Layout


# ------------------------------------------------------------------------------------------------ FWHT / quant
def hadamard128(x):
  """Orthonormal FWHT over the last dim (128): H128 · x / sqrt(128), H128 in Sylvester ordering (butterflies of
  width 1, 2, 4, ..., 64 as in vLLM ``_hadamard128``). x [..., 128] -> [..., 128] in x's float dtype (f32 math)."""
  n = x.shape[-1]
  assert n == HEAD_DIM, x.shape
  y = x.astype(jnp.float32)
  lead = y.shape[:-1]
  h = 1
  while h < n:
    # pairs (i, i + h) inside each 2h-block: (a, b) -> (a + b, a - b)
    y4 = y.reshape(*lead, n // (2 * h), 2, h)
    a, b = y4[..., 0, :], y4[..., 1, :]
    y = jnp.stack([a + b, a - b], axis=-2).reshape(*lead, n)
    h *= 2
  return (y * (1.0 / math.sqrt(n))).astype(x.dtype if jnp.issubdtype(x.dtype, jnp.floating) else jnp.float32)


def _pow2_ceil(x):
  """2^ceil(log2 x) for x > 0, exactly (frexp: x = m · 2^e, m in [0.5, 1); x is a power of two iff m == 0.5)."""
  m, e = jnp.frexp(x)
  return jnp.ldexp(jnp.ones_like(x), jnp.where(m == 0.5, e - 1, e))


def quant_ue8m0_fp8(y):
  """Per 128-vector FP8 with a UE8M0 (power-of-two) scale, vLLM ``fwht128_quant_fp8`` numerics.

  y [..., 128] -> (y8 [..., 128] float8_e4m3fn, s [...] f32): y <- bf16(y) (round to nearest even),
  s = 2^ceil(log2(max(max|y|, 1e-4) / 448)), y8 = e4m3(clip(y / s, -448, 448)); y ≈ y8 · s.
  The exponent is taken with frexp (exact), not a float log2 that can round across a power of two."""
  yb = jnp.asarray(y).astype(jnp.bfloat16).astype(jnp.float32)
  amax = jnp.max(jnp.abs(yb), axis=-1)
  s = _pow2_ceil(jnp.maximum(amax, AMAX_FLOOR) / FP8_MAX)
  y8 = jnp.clip(yb / s[..., None], -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
  return y8, s


# ------------------------------------------------------------------------------------------------ reference
def indexer_scores_reference(q8, q_scale, w, k8, k_scale, n_valid, **unused):
  """Pure-jnp f32 indexer scores.

  q8 [B, T, HI, 128] e4m3 (FWHT'd, quantised index queries), q_scale [B, T, HI] f32, w [B, T, HI] f32 (head
  weights, already x HI^-0.5 x 128^-0.5), k8 [B, P, 128] e4m3 (FWHT'd pooled keys), k_scale [B, P] f32,
  n_valid [B, T] int32 (complete pools visible to each query) -> scores [B, T, P] f32, -inf for j >= n_valid."""
  del unused
  # e4m3 x e4m3 products have at most 8 significant bits: exact in bf16 operands' products, summed in f32 — the
  # f32 math on tensor cores (as f32 HIGHEST, 17 GFLOP a DSA layer of a 256-token prefill chunk ran without
  # them). The heads last: the weighted ReLU's sum over them reads the products once, in order (heads first, XLA
  # wrote them a second time transposed: 270 MB a layer at that chunk).
  dots = jnp.einsum("bthd,bpd->btph", q8.astype(jnp.bfloat16), k8.astype(jnp.bfloat16),
                    preferred_element_type=jnp.float32)
  wq = (w.astype(jnp.float32) * q_scale.astype(jnp.float32))[:, :, None, :]
  s = jnp.sum(wq * jnp.maximum(dots, 0.0), axis=3) * k_scale.astype(jnp.float32)[:, None, :]
  P = k8.shape[1]
  return jnp.where(jnp.arange(P)[None, None, :] < n_valid[..., None], s, -jnp.inf)


# ------------------------------------------------------------------------------------------------ kernel
def _pick_blocks_per_cta(n_blocks: int, B: int) -> int:
  """64-key blocks per CTA: about 2 CTAs per SM over the (chunk, sequence) grid."""
  chunks = max(1, min(n_blocks, -(-2 * NUM_SMS // max(B, 1))))
  return -(-n_blocks // chunks)


def _rotated_fp8(qb_s, h_s, c: int):
  """Rows [64c, 64c + 64) of qb_s [.., 128] bf16 (SMEM, wgmma-tiled) -> (q [64, 128] f32, scale [64] f32) with
  quant_ue8m0_fp8(hadamard128(rows)) = (e4m3(q), scale) — q's values are exact in e4m3: convert them. The FWHT
  as one wgmma with the ±1 Sylvester matrix h_s (exact products; the f32 sums of up to 128 bf16 terms), then
  ``_ue8m0_rows``."""
  def mma(acc):
    plgpu.wgmma(acc, qb_s.at[pl.ds(c * BLOCK, BLOCK)], h_s.T)  # (H is symmetric)
    return acc[...]
  return _ue8m0_rows(pl.run_scoped(mma, plgpu.ACC((BLOCK, HEAD_DIM), jnp.float32)) * (1.0 / math.sqrt(HEAD_DIM)))


def _ue8m0_rows(y):
  """The rotated rows y [m, 128] f32 -> (q [m, 128] f32, scale [m] f32), quant_ue8m0_fp8's numerics: the bf16
  rounding, the row amax, the power-of-two scale from the amax's bits (exactly quant_ue8m0_fp8's
  2^ceil(log2(max(amax, 1e-4) / 448)): 448 = 1.75 · 2^8, so the exponent is the amax's minus 8, plus one when its
  mantissa exceeds 1.75) and the clipped quotient (a power-of-two divisor: exact)."""
  yb = y.astype(jnp.bfloat16).astype(jnp.float32)
  amax = jnp.maximum(jnp.max(jnp.abs(yb), axis=1), AMAX_FLOOR)  # [m] per row
  bits = lax.bitcast_convert_type(amax, jnp.int32)
  e = lax.shift_right_logical(bits, 23) - 8 + jnp.where((bits & 0x7FFFFF) > 0x600000, 1, 0)  # scale's exponent
  scale = lax.bitcast_convert_type(lax.shift_left(e, 23), jnp.float32)
  inv = lax.bitcast_convert_type(lax.shift_left(254 - e, 23), jnp.float32)  # 1 / scale, exactly
  return jnp.clip(yb * lax.broadcast_in_dim(inv, y.shape, (0,)), -FP8_MAX, FP8_MAX), scale


def _rotated_fp8_tc(qb_s, h_s, c: int, racc_t, mbar):
  """``_rotated_fp8`` for the tcgen05 form: rows [128c, 128c + 128) rotated by one tcgen05 MMA into the TMEM
  accumulator racc_t [128, 128] f32 (its tensor-core barrier mbar) -> (q, scale) in tcgen05's register layout (a
  row per thread: the row amax in-thread)."""
  plgpu.tcgen05_mma(racc_t, qb_s.at[pl.ds(c * TC_BLOCK, TC_BLOCK)], h_s.T, mbar, accumulate=False)
  plgpu.barrier_wait(mbar)
  y = plgpu.async_load_tmem(racc_t)
  plgpu.wait_load_tmem()
  return _ue8m0_rows(y * (1.0 / math.sqrt(HEAD_DIM)))


def _quantize_rows(qb_s, h_s, q_s, qs_s, rq: int, tc=None):
  """The scores kernel's own query preparation (``indexer_scores_q``): the rq rows of qb_s [rq, 128] bf16 (the
  raw index queries) -> q_s [rq, 128] e4m3 = quant_ue8m0_fp8(hadamard128(q)) and qs_s [rq] f32 their scales, per
  64-row chunk (``_rotated_fp8``) — or, ``tc`` = (TMEM accumulator [128, 128], its barrier), per 128-row chunk
  (``_rotated_fp8_tc``)."""
  m = BLOCK if tc is None else TC_BLOCK
  for c in range(rq // m):
    if tc is None:
      y8, scale = _rotated_fp8(qb_s, h_s, c)
    else:
      if c:  # (every warp's TMEM load of chunk c - 1 done before this MMA overwrites the accumulator)
        plgpu.commit_smem()
      y8, scale = _rotated_fp8_tc(qb_s, h_s, c, *tc)
    q_s[pl.ds(c * m, m), :] = plgpu.layout_cast(y8.astype(jnp.float8_e4m3fn), _L.WGMMA if tc is None else _L.TCGEN05)
    qs_s[pl.ds(c * m, m)] = scale
  plgpu.commit_smem()  # q_s is read by the scores' MMAs (the async proxy)


def _tc_scores(k_s, q_s, acc_t, mbar, t_s):
  """The tcgen05 form's scores tile: keys k_s [128, 128] e4m3 times one token's queries q_s [hi, 128] e4m3 (both
  K-major, as the wgmma's) into the TMEM accumulator acc_t [128, hi] f32 -> [128, hi] f32 in the WGMMA layout the
  epilogue takes, through the SMEM tile t_s [128, hi] (no register relayout from tcgen05's layout exists). The
  commit also holds every warp until its TMEM load is done, before the next MMA overwrites the accumulator."""
  plgpu.tcgen05_mma(acc_t, k_s, q_s.T, mbar, accumulate=False)  # (one thread issues it; arrives when done)
  plgpu.barrier_wait(mbar)
  acc = plgpu.async_load_tmem(acc_t)
  plgpu.wait_load_tmem()
  return tmem_to_wgmma(acc, t_s)


def _indexer_kernel(nbc: int, T: int, hi: int, rotate: bool = False, tc05: bool = False, groups: int = 1):
  """Kernel body: ``nbc`` blocks of 64 pooled keys per CTA (``tc05``: 128), T tokens x hi heads. ``groups`` > 1
  (``indexer_scores_rows``: a prefill chunk's rows): the query batch is the key batch's sequences x ``groups`` token
  groups of T tokens each — CTA batch index b reads its queries, weights, n_valid and output rows at b and the keys
  of sequence b // groups.

  GMEM refs: q_g [B, T * hi, 128] e4m3, wq_g [B, T, hi] f32 (w * q_scale), nv_g [B, T] int32,
  k8_g [B, Pp, 128] e4m3, ks_g [B, Pp] f32; out o_g [B, T, Pp] f32. ``rotate`` (``indexer_scores_q``): q_g is the
  raw queries [B, T * hi, 128] bf16, followed by h_g [128, 128] bf16 (the Sylvester matrix), and wq_g is w alone:
  each CTA rotates and quantises the queries itself (``_quantize_rows``). ``lean`` (built without Mosaic's
  automatic barriers: lean_barriers) needs no barrier of its own: o_s is rewritten each block only after
  ``wait_smem_to_gmem``, whose barrier holds every thread until its TMA store has read it; a slot's next gather
  comes after the commit that every thread passes once its reads of the slot — the wgmma's, the scales' — are
  done; the queries' SMEM is written once, before a commit.

  ``tc05``: the tcgen05 form (Blackwell): blocks of 128 keys, each token's scores one tcgen05 MMA into the TMEM
  accumulator acc_t [128, hi] (``_tc_scores``), relaid into the WGMMA layout through t_s [2, 128, hi] (a tile per
  token parity: a tile is rewritten two tokens later, after the commit of the token between, which every thread
  passes once done reading it — so ``lean`` needs nothing more here either); the rotation by 128-row tcgen05 MMAs
  into racc_t [128, 128]. Scratch after the wgmma form's: acc_t, its tensor-core barrier mbar, t_s[, racc_t]. Keys
  allocated as a multiple of 64 but not of 128: the last block loads its first 64 rows only (no pad of the
  cache); its other rows hold stale SMEM, in rows past every n_valid, which the mask replaces with -inf."""
  bk = TC_BLOCK if tc05 else BLOCK  # pooled keys per block (the MMA's M)

  def body(*refs):
    tc = ()
    if tc05:
      n_tc = 4 if rotate else 3
      refs, tc = refs[:-n_tc], refs[-n_tc:]
    if rotate:
      (q_g, h_g, wq_g, nv_g, k8_g, ks_g, o_g, q_s, k_s, ks_s, o_s, bar, kbar, qb_s, h_s, qs_s) = refs
    else:
      q_g, wq_g, nv_g, k8_g, ks_g, o_g, q_s, k_s, ks_s, o_s, bar, kbar = refs
    ch = lax.axis_index("c")
    b = lax.axis_index("b")
    kb = b if groups == 1 else b // groups  # (the keys' sequence)
    j_base = ch * (nbc * bk)
    nv = [nv_g[b, t] for t in range(T)]
    nv_max = nv[0]
    for t in range(1, T):
      nv_max = jnp.maximum(nv_max, nv[t])
    # Blocks of this CTA that some token can see; the rest are only written as -inf.
    n_live = jnp.clip(pl.cdiv(nv_max - j_base, bk), 0, nbc)
    kp = k8_g.shape[1]  # (keys allocated: a multiple of 64)

    def issue(k, slot):
      j0 = j_base + k * bk
      if kp % bk:  # (tcgen05: a live block starts below kp, so one that does not fit has 64 keys in memory)
        for n in (bk, BLOCK):
          @pl.when((j0 + bk <= kp) == (n == bk))
          def _():
            plgpu.copy_gmem_to_smem(k8_g.at[kb, pl.ds(j0, n)], k_s.at[slot, pl.ds(0, n)], kbar.at[slot])
            plgpu.copy_gmem_to_smem(ks_g.at[kb, pl.ds(j0, n)], ks_s.at[slot, pl.ds(0, n)], kbar.at[slot])
      else:
        plgpu.copy_gmem_to_smem(k8_g.at[kb, pl.ds(j0, bk)], k_s.at[slot], kbar.at[slot])
        plgpu.copy_gmem_to_smem(ks_g.at[kb, pl.ds(j0, bk)], ks_s.at[slot], kbar.at[slot])

    if rotate:  # (rows past T * hi: the TMA's zero fill)
      plgpu.copy_gmem_to_smem(q_g.at[b, pl.ds(0, qb_s.shape[0])], qb_s, bar.at[0])
      plgpu.copy_gmem_to_smem(h_g, h_s, bar.at[0])
    else:
      plgpu.copy_gmem_to_smem(q_g.at[b], q_s, bar.at[0])

    @pl.when(n_live > 0)
    def _():
      issue(0, 0)

    plgpu.barrier_wait(bar.at[0])
    wq = [plgpu.load(wq_g.at[b, t], layout=_L.WGMMA.reduce(0), optimized=False) for t in range(T)]
    if rotate:
      _quantize_rows(qb_s, h_s, q_s, qs_s, qb_s.shape[0], (tc[3], tc[1]) if tc05 else None)
      wq = [w * plgpu.load(qs_s.at[pl.ds(t * hi, hi)], layout=_L.WGMMA.reduce(0), optimized=False)
            for t, w in enumerate(wq)]
    rows = plgpu.broadcasted_iota(jnp.int32, (bk,), 0, layout=_L.WGMMA.reduce(1))

    def block(k, carry):
      slot = lax.rem(k, 2)
      j0 = j_base + k * bk

      @pl.when(k + 1 < n_live)
      def _():
        issue(k + 1, 1 - slot)

      @pl.when(k < n_live)
      def _():
        plgpu.barrier_wait(kbar.at[slot])
        kscale = plgpu.load(ks_s.at[slot], layout=_L.WGMMA.reduce(1), optimized=False)
        for t in range(T):
          if tc05:
            st = _tc_scores(k_s.at[slot], q_s.at[pl.ds(t * hi, hi)], tc[0], tc[1], tc[2].at[t % 2])
          else:
            def mma(acc):
              plgpu.wgmma(acc, k_s.at[slot], q_s.at[pl.ds(t * hi, hi)].T)  # fp8 operands must be K-major
              return acc[...]
            st = pl.run_scoped(mma, plgpu.ACC((BLOCK, hi), jnp.float32))  # [keys, heads]
          st = jnp.maximum(st, 0.0) * lax.broadcast_in_dim(wq[t], (bk, hi), (1,))
          sc = plgpu.layout_cast(st.sum(axis=1), _L.WGMMA.reduce(1)) * kscale
          o_s[t, :] = jnp.where(rows + j0 < nv[t], sc, -jnp.inf)

      @pl.when(k >= n_live)
      def _():
        for t in range(T):
          o_s[t, :] = plgpu.layout_cast(jnp.full((bk,), -jnp.inf, jnp.float32), _L.WGMMA.reduce(1))

      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(o_s, o_g.at[b, :, pl.ds(j0, bk)])
      # o_s is rewritten next block: its TMA store must have read it first (the wait ends in a warpgroup barrier)
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      return carry

    lax.fori_loop(0, nbc, block, None)
    plgpu.wait_smem_to_gmem(0)

  return body


@kernel_entry("blocks_per_cta", "padded", "align", "lean", "mma")
def indexer_scores(q8, q_scale, w, k8, k_scale, n_valid, *, blocks_per_cta: int | None = None, padded: bool = False,
                   align: int = 64, lean: bool = False, mma: str = "wgmma"):
  """Mosaic GPU indexer scores; same contract as ``indexer_scores_reference``.

  q8 [B, T, HI, 128] e4m3 (HI a multiple of 8), q_scale / w [B, T, HI] f32, k8 [B, P, 128] e4m3, k_scale [B, P]
  f32, n_valid [B, T] int32 -> scores [B, T, P] f32. The grid covers P rounded up to 64 · blocks_per_cta; blocks
  at or past n_valid (<= P) are never read, so the keys are padded only when P is not a multiple of 64 (the decode
  caches never are: glm5_jax.state.POOL_ALIGN) — a pad copies the whole key cache. ``padded``: the kernel's
  output as it is, [B, T, Pp >= P] (-inf past each token's n_valid: what the top-k threshold kernel reads with no
  slice in between), Pp a multiple of ``align`` (a multiple of 64: the threshold kernel takes rows of its lanes,
  128 per warpgroup; the grid grows by CTAs that only write -inf). ``lean`` (policy knob lean_barriers): built
  without Mosaic GPU's automatic warpgroup barriers (18 bar.sync, 4 lean; ``_indexer_kernel``).

  ``mma``: "wgmma" (Hopper) or "tcgen05" (Blackwell, sm_100: no wgmma there) — each token's scores one tcgen05
  MMA of 128 keys (M = 128: tcgen05's M = 64 splits N over two lane groups, which Mosaic refused here) into a
  tensor-memory accumulator, relaid into the WGMMA layout through SMEM for the same epilogue (``_indexer_kernel``).
  Its blocks (``blocks_per_cta``) are of 128 keys, so the padded width Pp is a multiple of 128 (and of ``align``)
  and may exceed the wgmma form's; the scores are the same. ``lean`` is honoured (no barrier of its own either)."""
  tc05 = check_mma(mma, "indexer_scores")
  wq = w.astype(jnp.float32) * q_scale.astype(jnp.float32)
  return _scores_call(q8, wq, k8, k_scale, n_valid, blocks_per_cta, rotate=False, padded=padded, align=align,
                      lean=lean, tc05=tc05)


def indexer_scores_q_reference(q, w, k8, k_scale, n_valid, **unused):
  """The indexer scores from the raw index queries q [B, T, HI, 128] (bf16: the wq_b projection's output): the
  FWHT and UE8M0 FP8 quantisation (``quant_ue8m0_fp8(hadamard128(q))``), then ``indexer_scores_reference``."""
  q8, qs = quant_ue8m0_fp8(hadamard128(q.astype(jnp.float32)))
  return indexer_scores_reference(q8, qs, w, k8, k_scale, n_valid, **unused)


@kernel_entry("blocks_per_cta", "padded", "align", "lean", "mma")
def indexer_scores_q(q, w, k8, k_scale, n_valid, *, blocks_per_cta: int | None = None, padded: bool = False,
                     align: int = 64, lean: bool = False, mma: str = "wgmma"):
  """Mosaic GPU version of ``indexer_scores_q_reference``: ``indexer_scores`` with the queries' FWHT and FP8
  quantisation inside the kernel (each CTA rotates the T · HI rows with one wgmma per 64 rows against the ±1
  Sylvester matrix and quantises them in registers: ``_quantize_rows``) instead of ~3 XLA kernels in front of it
  on the critical path (the rotation's butterflies, the amax, the conversion; ~8 µs per DSA layer on the H200,
  session 29's profile). q must be bf16 (the projection's output dtype: the wgmma reads it as is). ``lean``,
  ``mma`` as in ``indexer_scores`` (tcgen05: the rotation one tcgen05 MMA per 128 query rows, the T · HI rows
  padded to 128 by the TMA's zero fill, quantised in tcgen05's register layout)."""
  tc05 = check_mma(mma, "indexer_scores_q")
  if q.dtype != jnp.bfloat16:
    raise ValueError(f"indexer_scores_q: q {q.dtype}; expected bfloat16 (the wq_b projection's output: the "
                     "kernel's wgmma reads it as is — rotate other dtypes with indexer_scores)")
  return _scores_call(q, w.astype(jnp.float32), k8, k_scale, n_valid, blocks_per_cta, rotate=True, padded=padded,
                      align=align, lean=lean, tc05=tc05)


ROWS_TOKENS = 4  # tokens a CTA of indexer_scores_rows scores (x 32 heads: 128 query rows, two rotation MMAs)


@kernel_entry("tokens_per_cta", "blocks_per_cta", "padded", "align", "lean", "mma")
def indexer_scores_rows(q, w, k8, k_scale, n_valid, *, tokens_per_cta: int = ROWS_TOKENS,
                        blocks_per_cta: int | None = None, padded: bool = False, align: int = 64, lean: bool = False,
                        mma: str = "wgmma"):
  """``indexer_scores_q`` for any number of token rows (a prefill chunk's; same contract and reference,
  ``indexer_scores_q_reference``): the T tokens in groups of ``tokens_per_cta`` (T padded to a multiple of it with
  rows that see no pool), each group a batch entry of the scores kernel that reads its sequence's keys
  (``_indexer_kernel(groups=)``) — the decode form holds all T · HI query rows in every CTA's SMEM (2 MB at 512
  rows). Each CTA skips the key blocks past its tokens' complete pools; the scores of every (token, pool) are
  written once, [B, T, Pp] f32 — where XLA's reference writes [B, T, HI, P] f32 products for its head sum (541 MB
  a DSA layer of a 512-token chunk at a 32K cache)."""
  tc05 = check_mma(mma, "indexer_scores_rows")
  if q.dtype != jnp.bfloat16:
    raise ValueError(f"indexer_scores_rows: q {q.dtype}; expected bfloat16 (the wq_b projection's output)")
  B, T, HI, Dh = q.shape
  tt = int(tokens_per_cta)
  if tt < 1 or w.shape != (B, T, HI) or n_valid.shape != (B, T) or k8.shape[0] != B:
    raise ValueError(f"indexer_scores_rows: q {q.shape}, w {w.shape}, n_valid {n_valid.shape}, keys {k8.shape}, "
                     f"tokens_per_cta={tokens_per_cta}; expected [B, T, HI, 128], [B, T, HI], [B, T], [B, P, 128] "
                     "and a positive token group")
  G = -(-T // tt)
  pad = G * tt - T
  if pad:  # (rows that see no pool: -inf scores, sliced off)
    q = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
    w = jnp.pad(w, ((0, 0), (0, pad), (0, 0)))
    n_valid = jnp.pad(n_valid, ((0, 0), (0, pad)))
  out = _scores_call(q.reshape(B * G, tt, HI, Dh), w.astype(jnp.float32).reshape(B * G, tt, HI), k8, k_scale,
                     n_valid.reshape(B * G, tt), blocks_per_cta, rotate=True, padded=True, align=align, lean=lean,
                     tc05=tc05, groups=G)
  out = out.reshape(B, G * tt, -1)[:, :T]
  return out if padded else out[:, :, :k8.shape[1]]


def _sylvester128():
  h = np.ones((1, 1), np.float32)
  while h.shape[0] < HEAD_DIM:
    h = np.block([[h, h], [h, -h]])
  return h


def _scores_call(q, wq, k8, k_scale, n_valid, blocks_per_cta, rotate: bool, padded: bool = False, align: int = 64,
                 lean: bool = False, tc05: bool = False, groups: int = 1):
  B, T, HI, Dh = q.shape  # (groups > 1: B is the keys' sequences x groups)
  P = k8.shape[1]
  if Dh != HEAD_DIM or HI % 8:
    raise ValueError(f"indexer scores: q {q.shape}; expected [B, T, HI, {HEAD_DIM}] with HI a multiple of 8")
  if B != groups * k8.shape[0]:
    raise ValueError(f"indexer scores: q {q.shape} for keys {k8.shape} in {groups} token groups a sequence; expected "
                     f"{groups} x {k8.shape[0]} query batches")
  if tc05 and HI % 16:
    raise ValueError(f"indexer scores: q {q.shape}; mma='tcgen05' needs HI a multiple of 16 (the MMA's N)")
  if align % BLOCK:
    raise ValueError(f"indexer scores: align={align}; expected a multiple of {BLOCK}")
  bk = TC_BLOCK if tc05 else BLOCK  # keys per block
  n_blocks = -(-P // bk)
  nbc = blocks_per_cta or _pick_blocks_per_cta(n_blocks, B)
  nch = -(-n_blocks // nbc)
  step = math.lcm(nbc * bk, align) // (nbc * bk)  # (chunks per aligned span: the grid in whole spans)
  nch = -(-nch // step) * step
  Pp = nch * nbc * bk
  if P % BLOCK:
    # (the last block some token can see must be whole in memory; slots past n_valid are written as -inf. tcgen05:
    # to a multiple of 64 too — the kernel loads a last block of 64 keys as such)
    n64 = -(-P // BLOCK)
    k8 = jnp.pad(k8, ((0, 0), (0, n64 * BLOCK - P), (0, 0)))
    k_scale = jnp.pad(k_scale, ((0, 0), (0, n64 * BLOCK - P)))
  # fp8 wgmma operands: 128-byte rows (128 e4m3), 128-byte swizzle, both K-major
  tile8 = (plgpu.TilingTransform((8, 128)), plgpu.SwizzleTransform(128))
  tile16 = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))  # bf16: 64-column tiles of 128 bytes
  rq = -(-T * HI // bk) * bk if rotate else T * HI  # query rows in SMEM (the rotation: whole 64 / 128-row tiles)
  extra = [plgpu.SMEM((rq, HEAD_DIM), jnp.bfloat16, transforms=tile16),  # qb_s: the raw queries
           plgpu.SMEM((HEAD_DIM, HEAD_DIM), jnp.bfloat16, transforms=tile16),  # h_s: the Sylvester matrix
           plgpu.SMEM((rq,), jnp.float32)] if rotate else []  # qs_s: the queries' scales
  if tc05:  # acc_t, mbar, t_s[, racc_t] (_indexer_kernel)
    extra += [plgpu.TMEM((TC_BLOCK, HI), jnp.float32),
              plgpu.Barrier(num_arrivals=1, orders_tensor_core=True),
              plgpu.SMEM((2, TC_BLOCK, HI), jnp.float32)]
    extra += [plgpu.TMEM((TC_BLOCK, HEAD_DIM), jnp.float32)] if rotate else []
  kern = mgpu_kernel(
      _indexer_kernel(nbc, T, HI, rotate, tc05=tc05, groups=groups),
      out_type=jax.ShapeDtypeStruct((B, T, Pp), jnp.float32),
      scratch_types=[
          plgpu.SMEM((rq, HEAD_DIM), jnp.float8_e4m3fn, transforms=tile8),  # q_s
          plgpu.SMEM((2, bk, HEAD_DIM), jnp.float8_e4m3fn, transforms=tile8),  # k_s (double buffer)
          plgpu.SMEM((2, bk), jnp.float32),  # ks_s
          plgpu.SMEM((T, bk), jnp.float32),  # o_s
          plgpu.Barrier(num_arrivals=2 if rotate else 1, num_barriers=1),
          plgpu.Barrier(num_arrivals=2, num_barriers=2),
          *extra,
      ],
      grid=(nch, B),
      grid_names=("c", "b"),
      kernel_name="glm5_indexer_scores",
      compiler_params=plgpu.CompilerParams(approx_math=True, unsafe_no_auto_barriers=bool(lean)),
  )
  head = (q.reshape(B, T * HI, HEAD_DIM),) + ((jnp.asarray(_sylvester128(), jnp.bfloat16),) if rotate else ())
  out = kern(*head, wq, n_valid.astype(jnp.int32), k8, k_scale.astype(jnp.float32))
  return out if padded else out[:, :, :P]


# ------------------------------------------------------------------------------------------------ pooled-key update
# token rows per sequence the update kernel takes: a decode step's 1 + k and prefill chunks up to this. Session 46's
# kernel was right natively only up to 4 rows, for two Mosaic GPU store patterns that are wrong there and right in
# interpret mode: a register array stored into a strided SMEM view at an offset (its gate scores into a [T, 2, 128]
# tile's entry 1: wrong at 8 rows — test_rows_layout_copy, s47a) and single-row register stores at row offsets of
# the pooling's tile (every completed pool but a call's first wrong — s47b). Now the call's keys and gate scores
# are stored as whole contiguous tiles, and the pooling's rows all arrive by TMA from the ring once it is written.
POOL_MAX_TOKENS = 16


def _pool_geometry(T: int, kp: int) -> tuple[int, int]:
  """(G, NP): the positions [base, base + G) a call of T tokens can complete pools in (base = start rounded down to
  a pool) and their NP = G / kp pools."""
  G = kp * (-(-(kp - 1 + T) // kp))
  return G, G // kp


def pool_update_reference(kx, ring, pool8, pool_scale, start, valid, ln_w, ln_b, ape):
  """Pure-jnp form of the indexer's per-call cache update with an FP8 pooled-key cache (spec §3.6.3; the model's
  Indexer.keys + Indexer.update with vLLM's numerics).

  kx [B, T, >= 2·Di] the x_proj output in the model's dtype: the keys before their LayerNorm in columns [0, Di),
  the pool gate scores in [Di, 2·Di) (more columns after them are ignored: the head weights); ring [B, Rg, 2, Di]
  (the LayerNorm'd key and the gate score of position p in row p mod Rg, kx's dtype); pool8 [B, P, Di] e4m3,
  pool_scale [B, P] f32; start, valid [B] int32 (this call's tokens sit at start.., the first valid real);
  ln_w, ln_b [Di] (the keys' LayerNorm, eps 1e-6); ape [kp, Di] (the pool's positional gate bias).
  -> (ring, pool8, pool_scale): the call's real tokens in the ring, and every pool they complete (all kp
  positions < start + valid) pooled — per channel Σ_r softmax_r(gate + ape) · key over its kp positions — rotated
  (hadamard128) and quantised (quant_ue8m0_fp8) into its slot."""
  B, T, _ = kx.shape
  Rg, Di, kp = ring.shape[1], ring.shape[3], ape.shape[0]
  dt, f32 = kx.dtype, jnp.float32
  kr = kx[..., :Di].astype(f32)
  mu = jnp.mean(kr, -1, keepdims=True)
  var = jnp.mean(jnp.square(kr - mu), -1, keepdims=True)
  k = ((kr - mu) * lax.rsqrt(var + 1e-6) * ln_w.astype(f32) + ln_b.astype(f32)).astype(dt)
  ok = jnp.arange(T)[None] < valid[:, None]
  pos = start[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
  bq = jnp.arange(B)[:, None]
  new = jnp.stack([k, kx[..., Di:2 * Di]], axis=2).astype(ring.dtype)  # [B, T, 2, Di]
  ring = ring.at[bq, jnp.where(ok, pos % Rg, Rg)].set(new, mode="drop")
  # the pools this call can complete, read back from the updated ring (every position of [base, start + valid) is
  # in it, distinct mod Rg; positions past the call's tokens only feed pools that are not complete, never written)
  G, NP = _pool_geometry(T, kp)
  base = (start // kp) * kp
  kg = ring[bq, (base[:, None] + jnp.arange(G, dtype=jnp.int32)[None]) % Rg].astype(f32)  # [B, G, 2, Di]
  kc, gc = kg[:, :, 0].reshape(B, NP, kp, Di), kg[:, :, 1].reshape(B, NP, kp, Di)
  pi = jax.nn.softmax(gc + ape.astype(f32), axis=-2)
  pk = jnp.sum(pi * kc, axis=-2).astype(dt)
  k8, ks = quant_ue8m0_fp8(hadamard128(pk.astype(f32)))
  pj = base[:, None] // kp + jnp.arange(NP, dtype=jnp.int32)[None]
  slot = jnp.where((pj + 1) * kp <= (start + valid)[:, None], pj, pool8.shape[1])  # incomplete: dropped
  return ring, pool8.at[bq, slot].set(k8, mode="drop"), pool_scale.at[bq, slot].set(ks, mode="drop")


def _pool_kernel(T: int, kp: int, Rg: int, tc05: bool = False):
  """Kernel body of ``pool_update``: one CTA (one warpgroup) per sequence b. ``tc05``: the tcgen05 form
  (Blackwell) — the rotation one tcgen05 MMA of 128 rows (pk_s, qb_s, y8_s, sc_s 128 rows) into the TMEM
  accumulator racc_t, relaid through the f32 tile t_s into the WGMMA layout the rest keeps (scratch after the
  others: racc_t, its tensor-core barrier, t_s).

  GMEM refs: kx_g [B, T, C] bf16, lnw_g / lnb_g [128], ape_g [kp, 128] (f32, bf16 or f16: widened here), h_g [128,
  128] bf16 (±1), st_g / va_g [B] int32, then the caches it updates in place: ring_g [B, 2·Rg, 128] bf16 (the ring's
  [Rg, 2, 128] entries as rows: position p's key in row 2·(p mod Rg), its gate score in the next), p8_g [B, P, 128]
  e4m3, ps_g [B, P] f32. Scratch: kn_s [2, T, 128] (the call's tokens' keys, then gate scores), pos_s [2, kp, NP, 128]
  (the key / gate score of position base + i at [., i % kp, i // kp]: TMA'd from the ring after the call's rows are
  written), pk_s [64, 128] bf16 (the pooled keys' rows), qb_s / h_s (wgmma-tiled), y8_s [64, 128] e4m3, sc_s [64] f32,
  the loads' two barriers. Every register store into SMEM is of a whole contiguous tile at row 0 (the patterns that
  stored wrong natively: POOL_MAX_TOKENS's note)."""
  G, NP = _pool_geometry(T, kp)
  Di, f32, bf16 = HEAD_DIM, jnp.float32, jnp.bfloat16
  ROWS, ROW = replicated_rows_layouts(Di)
  M = TC_BLOCK if tc05 else BLOCK  # the rotation's rows (the MMA's M), of which NP are pools

  def load(ref, layout):
    return plgpu.load(ref, layout=layout, optimized=False)

  def cols(v, n):  # a [Di] row broadcast over n rows
    return plgpu.layout_cast(lax.broadcast_in_dim(v, (n, Di), (1,)), ROWS)

  def rows(v, n):  # a [n] column (a value per row) broadcast along the rows
    return plgpu.layout_cast(lax.broadcast_in_dim(v, (n, Di), (0,)), ROWS)

  def body(kx_g, lnw_g, lnb_g, ape_g, h_g, st_g, va_g, ring_g, p8_g, ps_g,
           kn_s, pos_s, pk_s, qb_s, h_s, y8_s, sc_s, bar_in, bar_ring, *tc):
    b = lax.axis_index("b")
    st, va = st_g[b], va_g[b]
    base = lax.div(st, kp) * kp
    plgpu.copy_gmem_to_smem(h_g, h_s, bar_in)  # the Sylvester matrix, in flight through the LayerNorm
    # The keys' LayerNorm (f32, as Indexer.keys), rounded to bf16: with the gate scores, the call's ring rows (kx's
    # columns read from GMEM as they are: a TMA of kx's [T, 256] box does not lower for every T — its 288-column
    # rows are not whole 64-column tiles)
    x = load(kx_g.at[b, :, pl.ds(0, Di)], ROWS).astype(f32)  # [T, Di]
    xc = x - rows(jnp.sum(x, axis=1) * (1.0 / Di), T)
    var = rows(jnp.sum(xc * xc, axis=1) * (1.0 / Di), T)
    k = xc * lax.rsqrt(var + 1e-6) * cols(load(lnw_g, ROW).astype(f32), T) + cols(load(lnb_g, ROW).astype(f32), T)
    kn_s[0] = k.astype(bf16)
    kn_s[1] = load(kx_g.at[b, :, pl.ds(Di, Di)], ROWS)
    plgpu.commit_smem()
    for t in range(T):
      @pl.when(t < va)
      def _(t=t):
        for j in range(2):
          plgpu.copy_smem_to_gmem(kn_s.at[j, pl.ds(t, 1)], ring_g.at[b, pl.ds(2 * lax.rem(st + t, Rg) + j, 1)])
    # The G positions' rows read back from the ring once the call's own are written there (a GMEM round trip:
    # overlaying them from kn_s in SMEM — single-row register stores at row offsets of pos_s — came out wrong
    # natively for every pool but a call's first, s47b)
    plgpu.wait_smem_to_gmem(0)
    for i in range(G):
      for j in range(2):
        plgpu.copy_gmem_to_smem(ring_g.at[b, pl.ds(2 * lax.rem(base + i, Rg) + j, 1)],
                                pos_s.at[j, i % kp, pl.ds(i // kp, 1)], bar_ring)
    plgpu.barrier_wait(bar_ring)
    plgpu.barrier_wait(bar_in)
    # Pooling (as Indexer.pool: jax.nn.softmax over the kp positions of each channel, then the weighted sum).
    a = [load(pos_s.at[1, r], ROWS).astype(f32) + cols(load(ape_g.at[r], ROW).astype(f32), NP)
         for r in range(kp)]
    m = functools.reduce(jnp.maximum, a)
    e = [jnp.exp(ar - m) for ar in a]
    s = functools.reduce(lambda u, v: u + v, e)
    pk = functools.reduce(lambda u, v: u + v, [(e[r] / s) * load(pos_s.at[0, r], ROWS).astype(f32)
                                               for r in range(kp)])
    pk_s[pl.ds(0, NP), :] = pk.astype(bf16)
    plgpu.commit_smem()
    # Rotation + FP8 (the scores kernel's own query form: _rotated_fp8) on a 64-row tile (tcgen05: 128) of which NP
    # are pools.
    row = plgpu.broadcasted_iota(jnp.int32, (M, Di), 0, layout=_L.WGMMA)
    qb_s[...] = jnp.where(row < NP, load(pk_s, _L.WGMMA), jnp.zeros((), bf16))
    plgpu.commit_smem()
    if tc05:
      racc_t, mbar, t_s = tc
      plgpu.tcgen05_mma(racc_t, qb_s, h_s.T, mbar, accumulate=False)  # (H is symmetric)
      plgpu.barrier_wait(mbar)
      acc = plgpu.async_load_tmem(racc_t)
      plgpu.wait_load_tmem()
      y8, scale = _ue8m0_rows(tmem_to_wgmma(acc, t_s) * (1.0 / math.sqrt(HEAD_DIM)))
    else:
      y8, scale = _rotated_fp8(qb_s, h_s, 0)
    y8_s[...] = plgpu.layout_cast(y8.astype(jnp.float8_e4m3fn), _L.WGMMA)
    sc_s[...] = scale
    plgpu.commit_smem()
    pj0, end = lax.div(base, kp), st + va
    for j in range(NP):
      @pl.when((pj0 + j + 1) * kp <= end)  # complete: into its slot
      def _():
        plgpu.copy_smem_to_gmem(y8_s.at[pl.ds(j, 1)], p8_g.at[b, pl.ds(pj0 + j, 1)])
        ps_g[b, pj0 + j] = sc_s[j]
    plgpu.wait_smem_to_gmem(0)

  return body


def _check_pool(kx, ring, pool8, pool_scale, start, valid, ln_w, ln_b, ape):
  B, T, C = kx.shape
  kp = ape.shape[0]
  Di = HEAD_DIM
  want = {"kx": ((B, T, C), jnp.bfloat16), "ring": ((B, ring.shape[1], 2, Di), jnp.bfloat16),
          "pool8": ((B, pool8.shape[1], Di), jnp.float8_e4m3fn), "pool_scale": ((B, pool8.shape[1]), jnp.float32),
          "start": ((B,), jnp.int32), "valid": ((B,), jnp.int32), "ln_w": ((Di,), None), "ln_b": ((Di,), None),
          "ape": ((kp, Di), None)}
  got = dict(kx=kx, ring=ring, pool8=pool8, pool_scale=pool_scale, start=start, valid=valid, ln_w=ln_w, ln_b=ln_b,
             ape=ape)
  floats = (jnp.float32, jnp.bfloat16, jnp.float16)
  for name, (shape, dtype) in want.items():
    a = got[name]
    if a.shape != shape or (a.dtype != dtype if dtype is not None else a.dtype not in floats):
      raise ValueError(f"pool_update: {name} {a.shape} {a.dtype}; expected {shape} {dtype or 'f32, bf16 or f16'}")
  if C < 2 * Di or C % 4:
    raise ValueError(f"pool_update: kx [.., {C}] columns; expected >= {2 * Di} (the keys, then the gate scores) and "
                     "a multiple of 4 (the kernel reads its rows as 8-byte vectors)")
  G, _ = _pool_geometry(T, kp)
  if T > POOL_MAX_TOKENS or ring.shape[1] < G:
    raise ValueError(f"pool_update: T={T} tokens with a ring of {ring.shape[1]} rows; expected T <= "
                     f"{POOL_MAX_TOKENS} and a ring of >= {G} rows (every position a call touches distinct)")


@kernel_entry("mma")
def pool_update(kx, ring, pool8, pool_scale, start, valid, ln_w, ln_b, ape, *, mma: str = "wgmma"):
  """Mosaic GPU version of ``pool_update_reference``: the indexer's whole per-call cache update — the keys'
  LayerNorm, the ring write, the pooling of every completed pool, its rotation and FP8 quantisation and the
  pool8 / pool_scale writes — as ONE launch (a CTA per sequence) updating the three caches in place (under a
  jit that donates them, the custom call aliases them: nothing copied). In XLA this chain was ~8 small kernels
  per DSA layer (LayerNorm, ring gather, softmax pooling, the Hadamard's butterflies, amax, FP8, two scatters)
  whose temporaries XLA's concurrent command buffer ordered behind the MLA latent's chain — the scores kernel
  waited ~12 µs per DSA layer for them (BENCHMARKS.md session 45). Needs bf16 kx / ring (the wgmma's operands),
  T <= POOL_MAX_TOKENS. The LayerNorm's and the rotation's f32 sums run in another order than XLA's: a key can
  round to the neighbouring bf16 (and an e4m3 element to its neighbour). ``mma``: "wgmma" (Hopper) or "tcgen05"
  (Blackwell, sm_100: no wgmma there) — the rotation one tcgen05 MMA of 128 rows into tensor memory, the same
  outputs (checked in GPU interpret mode and compiled for sm_100a on a CPU; not yet run on a Blackwell GPU)."""
  tc05 = check_mma(mma, "pool_update")
  _check_pool(kx, ring, pool8, pool_scale, start, valid, ln_w, ln_b, ape)
  B, T, _ = kx.shape
  kp, Rg = ape.shape[0], ring.shape[1]
  G, NP = _pool_geometry(T, kp)
  M = TC_BLOCK if tc05 else BLOCK
  tile16 = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
  f32 = jnp.float32
  # (the LayerNorm's affine and the pool bias in their stored dtype, widened to f32 in the kernel: an astype here
  # was 3 XLA launches per DSA layer and step, 36 of 1,003 at q = 1 with the MTP layer's — session 48's listing)
  inputs = (kx, ln_w, ln_b, ape, jnp.asarray(_sylvester128(), jnp.bfloat16), start.astype(jnp.int32),
            valid.astype(jnp.int32))

  @pl.run_state
  def run(refs):
    ring_ref, p8_ref, ps_ref = refs
    mgpu_kernel(
        lambda *r: _pool_kernel(T, kp, Rg, tc05)(*r[:7], ring_ref, p8_ref, ps_ref, *r[7:]),
        out_type=(),
        grid=(B,),
        grid_names=("b",),
        kernel_name="glm5_indexer_pool_update",
        scratch_types=[
            plgpu.SMEM((2, T, HEAD_DIM), jnp.bfloat16),  # kn_s
            plgpu.SMEM((2, kp, NP, HEAD_DIM), jnp.bfloat16),  # pos_s
            plgpu.SMEM((M, HEAD_DIM), jnp.bfloat16),  # pk_s
            plgpu.SMEM((M, HEAD_DIM), jnp.bfloat16, transforms=tile16),  # qb_s
            plgpu.SMEM((HEAD_DIM, HEAD_DIM), jnp.bfloat16, transforms=tile16),  # h_s
            plgpu.SMEM((M, HEAD_DIM), jnp.float8_e4m3fn),  # y8_s
            plgpu.SMEM((M,), f32),  # sc_s
            plgpu.Barrier(num_arrivals=1, num_barriers=1),
            plgpu.Barrier(num_arrivals=2 * G, num_barriers=1),
            *([plgpu.TMEM((TC_BLOCK, HEAD_DIM), f32),  # racc_t: the rotation's accumulator
               plgpu.Barrier(num_arrivals=1, orders_tensor_core=True),  # its MMA done
               plgpu.SMEM((TC_BLOCK, HEAD_DIM), f32)] if tc05 else []),  # t_s: the relay to the WGMMA layout
        ],
    )(*inputs)

  ring2, pool8, pool_scale = run((ring.reshape(B, 2 * Rg, HEAD_DIM), pool8, pool_scale))  # (a bitcast either way)
  return ring2.reshape(ring.shape), pool8, pool_scale


# ------------------------------------------------------------------------------------------------ top-k threshold
THRESHOLD_LANES = 128  # keys per row of the kernel's [N / 128, 128] view: one per thread of the warpgroup
THRESHOLD_MAX_KEYS = 136 * THRESHOLD_LANES  # 136 keys per thread in registers (17,408: 64K context's 16,448 pools)
assert THRESHOLD_MAX_KEYS % (4 * THRESHOLD_LANES) == 0  # (a row that fits one warpgroup fits four: the model's 4wg)
# Score rows from which the model uses the kernel. With its 32 passes unrolled a single row (one CTA's 32 serial
# warpgroup reductions) was 30 µs per call inside the one-rank step vs ~18 µs for XLA's radix passes (session 28);
# as a loop (7x less code) it is 21.6 µs alone vs 26.3 for the radix passes (bench_topk, 8,256 pools) and the
# one-rank step at q = 1, 4 steps per call 5.68 -> 5.46 ms (132 fewer launches; BENCHMARKS.md session 32). From 4
# rows it won either way (q = 4: indexer GPU time 1,170 -> 991 µs per step; 32 rows: 36-59 µs vs XLA's sort 64-141)
THRESHOLD_MIN_ROWS = 1


def topk_threshold_reference(keys, k: int, *, digit_bits: int = 1, unroll: bool = False):
  """keys [R, N] uint32, 1 <= k <= N (static) -> (t [R] uint32: the k-th largest key of each row, counted with
  multiplicity; n_gt [R] int32: how many keys of the row are > t). By a sort (digit_bits, unroll: the kernel's
  passes, no effect here)."""
  del digit_bits, unroll
  _check_threshold(keys, k)
  t = jnp.sort(keys, axis=-1)[:, keys.shape[1] - k]
  return t, jnp.sum(keys > t[:, None], axis=-1, dtype=jnp.int32)


def topk_selection_reference(keys, t, n_gt, k: int):
  """The set a threshold (t, n_gt) selects from keys [R, N] uint32 -> bool [R, N]: the keys > t and the first
  k - n_gt keys equal to t by index (lax.top_k's tie order) — what topk_set_by_threshold builds from it. Equal for
  the exact threshold (``topk_threshold_reference``) and the early-exit one (``topk_threshold(early_exit=True)``)."""
  t, n_gt = t[:, None], n_gt[:, None]
  eq = keys == t
  return (keys > t) | (eq & (jnp.cumsum(eq, axis=-1) <= k - n_gt))


def _check_threshold(keys, k, scores_ok: bool = False):
  R, N = keys.shape if keys.ndim == 2 else (None, None)
  ok = (jnp.uint32, jnp.float32) if scores_ok else (jnp.uint32,)
  if keys.ndim != 2 or keys.dtype not in ok:
    raise ValueError(f"topk_threshold: keys {keys.shape} {keys.dtype}, expected [R, N] uint32"
                     + (" (or f32 scores)" if scores_ok else ""))
  if not 1 <= k <= N:
    raise ValueError(f"topk_threshold: k = {k}, expected 1 <= k <= N = {N}")


def _exchange_warp_counts(c_s, p, parts, w=0, wgs: int = 1, xbar=None):
  """The sums over every warp of ``parts`` (per-warp counts [4], warp_split_layout's reductions): each warpgroup
  (w of wgs) stores its warps' parts in slot p % 2 of c_s [2, parts, 4 · wgs] int32, syncs its warps (and with
  several warpgroups arrives once on ``xbar`` and waits for the others), then reads every warp's. Two slots: a
  warp(group) one pass ahead writes the other slot, and cannot come back to this one before all have passed the
  barrier after reading it — the next pass's exchange therefore needs p + 1."""
  slot = lax.rem(p, 2)
  for j, v in enumerate(parts):
    c_s[slot, j, pl.ds(w * 4, 4)] = v
  plgpu.commit_smem()  # (its warpgroup barrier: the 4 warps' stores before anyone reads them / the one arrival)
  if xbar is not None:
    plgpu.barrier_arrive(xbar)
    plgpu.barrier_wait(xbar)
  return tuple(sum(c_s[slot, j, i] for i in range(4 * wgs)) for j in range(len(parts)))


def _threshold_kernel(k: int, digit_bits: int, unroll: bool, wgs: int = 1, from_scores: bool = False,
                      early_exit: bool = False):
  def body(u_g, t_g, n_g, u_s, *rest):
    r = lax.axis_index("r")
    keys = order_key_u32 if from_scores else (lambda x: x)
    if wgs == 1:
      (bar,) = rest
      plgpu.copy_gmem_to_smem(u_g.at[r], u_s, bar)
      plgpu.barrier_wait(bar)
      u = keys(u_s[...])  # [N / 128, 128]: N / 128 keys per thread, in registers for all passes
    else:  # this warpgroup's share of the rows, [nw, 4, 32]: warp i holds [:, i, :] (warp_split_layout)
      c_s, bar, xbar = rest
      w = lax.axis_index("wg")
      nw = u_s.shape[0] // wgs

      @pl.when(w == 0)
      def _():
        plgpu.copy_gmem_to_smem(u_g.at[r], u_s, bar)

      plgpu.barrier_wait(bar)
      u = keys(plgpu.load(u_s.at[pl.ds(w * nw, nw)], layout=warp_split_layout()))

    def count(x):
      """int32 x summed over the row: over the warpgroup (one warpgroup: Mosaic's reduction, its cross-warp step
      through Mosaic's SMEM scratch), or per warp ([4]: lanes and registers only) where several warpgroups would
      race on that scratch (warp_split_layout); ``total`` sums those."""
      return jnp.sum(x) if wgs == 1 else jnp.sum(jnp.sum(x, axis=2), axis=0)

    def total(p, *parts):
      """The sums over the row: this warpgroup's ``parts`` (int32 scalars), or with several warpgroups the sum of
      every warp's — each warpgroup publishes its warps' parts in slot p % 2 of c_s (two slots: a warpgroup that is
      one round ahead writes the other), syncs its warps, arrives (once per warpgroup), and reads all the warps'
      parts once every warpgroup has arrived."""
      return parts if wgs == 1 else _exchange_warp_counts(c_s, p, parts, w, wgs, xbar)

    t, n_gt = _threshold_search(u, k, early_exit, digit_bits, lambda p, *xs: total(p, *map(count, xs)),
                                unroll=unroll)

    def store():
      t_g[r] = jnp.broadcast_to(t, (THRESHOLD_LANES,))
      n_g[r] = jnp.broadcast_to(n_gt, (THRESHOLD_LANES,))

    if wgs == 1:
      store()
    else:
      pl.when(w == 0)(store)

  return body


@kernel_entry("k", "digit_bits", "unroll", "warpgroups", "early_exit", "lanes_out")
def topk_threshold(keys, k: int, *, digit_bits: int = 1, unroll: bool = False, warpgroups: int = 1,
                   early_exit: bool = False, lanes_out: bool = False):
  """Mosaic GPU version of ``topk_threshold_reference``: one CTA per row, the row's keys TMA'd into SMEM and held
  in registers; 32 / digit_bits passes (``_threshold_kernel``) and one count of the keys above the threshold.
  ``warpgroups`` (1, 2 or 4): the CTA's warpgroups, each holding 1 / warpgroups of the row's keys (a pass's
  compares spread over more threads; its counts per warp summed through SMEM: warp_split_layout). N must be a
  multiple of 128 · warpgroups (pad with 0, the smallest key: a pad never outranks a real key, and the k-th
  largest of the real keys is unchanged when k <= the real count) and at most THRESHOLD_MAX_KEYS (the
  registers). keys may also be the f32 scores themselves: the kernel then forms their keys in registers
  (``_common.order_key_u32``) — no XLA kernel between the scores kernel and this one (pad scores with -inf:
  never above a real score; equal to one only where fewer than k scores are finite, slots the caller masks by
  their score).

  ``early_exit``: the passes stop at the first candidate with exactly k keys at or above it; t is then one below
  that candidate and n_gt = k — not the k-th largest key, but the same selection: the top k are the keys > t and
  the first k - n_gt keys equal to t by index, as for the exact t (``topk_selection_reference`` states it).

  ``lanes_out``: t and n_gt as the kernel writes them, [R, 128] (each row's value in every lane) — what
  ``topk_compact`` reads, with no XLA slice between the two kernels."""
  from_scores = keys.dtype == jnp.float32
  _check_threshold(keys, k, scores_ok=True)
  R, N = keys.shape
  if digit_bits not in (1, 2):
    raise ValueError(f"topk_threshold: digit_bits = {digit_bits}, expected 1 or 2 (bits of the threshold per pass)")
  if warpgroups not in (1, 2, 4):
    raise ValueError(f"topk_threshold: warpgroups = {warpgroups}, expected 1, 2 or 4")
  if early_exit and unroll:
    raise ValueError("topk_threshold: early_exit=True with unroll=True (the early exit is a loop; unroll keeps "
                     "the old straight-line form for bench_topk's code-size comparison)")
  lanes = THRESHOLD_LANES * warpgroups
  if N % lanes or N > THRESHOLD_MAX_KEYS:
    raise ValueError(f"topk_threshold: N = {N} keys per row; the kernel takes a multiple of {lanes} up to "
                     f"{THRESHOLD_MAX_KEYS} (pad with 0)")
  nr = N // THRESHOLD_LANES
  row = lambda dt: jax.ShapeDtypeStruct((R, THRESHOLD_LANES), dt)
  view = (nr, THRESHOLD_LANES) if warpgroups == 1 else (nr, 4, THRESHOLD_LANES // 4)  # (several: per-warp sums)
  u_s = plgpu.SMEM(view, keys.dtype)
  if warpgroups == 1:
    scratch, threads = [u_s, plgpu.Barrier(num_arrivals=1)], {}
  else:  # (c_s: 2 slots x 2 counts x the warps; an exchange barrier of one arrival per warpgroup)
    scratch = [u_s, plgpu.SMEM((2, 2, 4 * warpgroups), jnp.int32), plgpu.Barrier(num_arrivals=1),
               plgpu.Barrier(num_arrivals=warpgroups)]
    threads = dict(num_threads=warpgroups, thread_name="wg")
  t, n_gt = mgpu_kernel(
      _threshold_kernel(int(k), int(digit_bits), bool(unroll), int(warpgroups), from_scores, bool(early_exit)),
      out_type=(row(jnp.uint32), row(jnp.int32)),
      grid=(R,),
      grid_names=("r",),
      kernel_name="glm5_topk_threshold",
      scratch_types=scratch,
      **threads,
  )(keys.reshape(R, *view))
  return (t, n_gt) if lanes_out else (t[:, 0], n_gt[:, 0])


# ------------------------------------------------------------------------------------------------ top-k select
# The selection's contract (topk_select_reference) and the pieces the compaction kernel below builds it from: the
# threshold's one-bit passes over a row in registers, the packed gt / eq flags and their prefix counts as two wgmmas.
# (A one-CTA kernel of the whole selection, topk_select, was slower than the threshold kernel + XLA's compaction —
# 19.8 vs 17.0 µs, session 42 — and was removed in session 53.)
SELECT_ROWS = 64  # key rows (of 128) per wgmma tile of the prefix counts
TC_SELECT_ROWS = 128  # key rows per tile of the tcgen05 form (M = 128, as the other tcgen05 forms)
_EQ_UNIT = 16384  # the eq flag's weight in the packed flags gt + 16384·eq (exact in bf16; the counts fit, below)
SELECT_MAX_K = _EQ_UNIT  # k below it: a count of keys above the threshold (< k) fits the packed counts' low field


def topk_select_reference(scores, tail_start, pos, *, k: int, kpool: int, n_tail: int, width: int):
  """scores [R, N] f32, tail_start / pos [R] int32 -> (idx [R, width] int32, js [R, k] int32).

  js: the set lax.top_k(scores, k) selects, in ascending index order, -1 where the score is not finite (the
  indexer's pools; -inf marks a pool no query may see). idx: the token positions the sparse MLA kernel reads —
  kpool · js + q for q < kpool (-1 for a -1 pool), then the n_tail tail positions tail_start + r (-1 past pos),
  then -1 up to width."""
  _check_select(scores, tail_start, pos, k, kpool, n_tail, width, "topk_select_reference")
  js = jnp.sort(lax.top_k(scores, k)[1], axis=-1)
  js = jnp.where(jnp.isfinite(jnp.take_along_axis(scores, js, axis=-1)), js, -1).astype(jnp.int32)
  tok = jnp.where(js[..., None] >= 0, js[..., None] * kpool + jnp.arange(kpool, dtype=jnp.int32), -1)
  tail = tail_start[:, None] + jnp.arange(n_tail, dtype=jnp.int32)
  tail = jnp.where(tail <= pos[:, None], tail, -1)
  idx = jnp.concatenate([tok.reshape(js.shape[0], -1), tail], axis=-1)
  return jnp.pad(idx, ((0, 0), (0, width - idx.shape[-1])), constant_values=-1), js


def _check_select(scores, tail_start, pos, k, kpool, n_tail, width, name: str = "topk_compact"):
  if scores.ndim != 2 or scores.dtype != jnp.float32:
    raise ValueError(f"{name}: scores {scores.shape} {scores.dtype}, expected f32 [R, N]")
  R, N = scores.shape
  if tail_start.shape != (R,) or pos.shape != (R,):
    raise ValueError(f"{name}: tail_start {tail_start.shape} and pos {pos.shape}, expected [{R}] each")
  if not 1 <= k <= N:
    raise ValueError(f"{name}: k = {k}, expected 1 <= k <= N = {N}")
  if kpool < 1 or n_tail < 0 or width < kpool * k + n_tail:
    raise ValueError(f"{name}: width {width} for k = {k} pools of {kpool} and {n_tail} tail positions; "
                     f"expected kpool >= 1, n_tail >= 0 and width >= {kpool * k + n_tail}")


def _order_key_u32_np(x) -> int:
  """``order_key_u32`` of one f32 value, on the host (a constant of the kernel)."""
  bits = int(np.asarray(x, np.float32).view(np.int32))
  return ((bits ^ 0x7FFFFFFF if bits < 0 else bits) & 0xFFFFFFFF) ^ 0x80000000


def _fill_triangles(upper_s, lower_s):
  """The prefix counts' constant wgmma operands (bf16 0 / 1): upper_s [R, C] strictly upper (i < j; a wgmma reads
  its first C rows: a register tile has >= 64), lower_s [64, 64] strictly lower. The caller commits them."""
  wg, i32 = _L.WGMMA, jnp.int32
  i0 = plgpu.broadcasted_iota(i32, upper_s.shape, 0, layout=wg)
  i1 = plgpu.broadcasted_iota(i32, upper_s.shape, 1, layout=wg)
  upper_s[...] = jnp.where(i0 < i1, 1.0, 0.0).astype(jnp.bfloat16)
  j0 = plgpu.broadcasted_iota(i32, lower_s.shape, 0, layout=wg)
  j1 = plgpu.broadcasted_iota(i32, lower_s.shape, 1, layout=wg)
  lower_s[...] = jnp.where(j1 < j0, 1.0, 0.0).astype(jnp.bfloat16)


def _threshold_search(u, k: int, early_exit: bool, digit_bits: int, sums, unroll: bool = False):
  """The threshold passes of the row's keys u (uint32, in registers) -> (thr, n_gt = #{u > thr}), for the
  threshold kernel and the compaction kernel's fused form alike: ``sums(p, *xs)`` -> the sums over the row of the
  int32 arrays xs (pass p's counts; p = the pass after the last for the final count: its exchange slot).

  The k-th largest key, digit by digit from the top: t keeps the largest prefix with #{u >= t} >= k. A pass is a
  compare per key and candidate and int32 sums over the row. digit_bits = 1: 32 passes of one candidate, each sum
  waiting on the previous pass. digit_bits = 2: 16 passes of the 3 candidates of a 2-bit digit — their counts n1 >=
  n2 >= n3 (each <= 17,408 < 2^16) from two independent sums, n1 + 65536 n2 packed in one int32 — half the
  dependent passes for 1.5x the compares. The passes are a loop, not Python-unrolled: unrolled they are ~7x the
  kernel's code (469 vs 69 KB of MLIR), straight-line code that one CTA runs once — every instruction a cold fetch
  (the suspect of session 31's ~135 µs cluster kernel; ``unroll`` keeps the old form to measure it). The keys stay
  in registers across iterations.

  ``early_exit``: stop at the first pass whose candidate has exactly k keys at or above it — that set IS the top
  k, so thr is one below that candidate (n_gt = k; a key equal to it is the (k+1)-th, no tie to take). With two
  bits, the largest candidate with >= k is then the one with exactly k (the counts fall with the candidate). On
  the indexer's scores the k-th and (k+1)-th keys part well before the last bit (in the step 13.9 -> 8.9 µs,
  session 45)."""
  i32, u32 = jnp.int32, jnp.uint32
  if digit_bits not in (1, 2):
    raise ValueError(f"threshold passes: digit_bits = {digit_bits}, expected 1 or 2")
  passes = 32 // digit_bits

  def one_pass(c):
    i, t, _ = c
    s = u32(32 - digit_bits) - i.astype(u32) * u32(digit_bits)  # the digit's low bit
    if digit_bits == 1:
      cand = t | lax.shift_left(u32(1), s)
      (n,) = sums(i, (u >= cand).astype(i32))
      return i + 1, jnp.where(n >= k, cand, t), jnp.where(n == k, i32(1), i32(0))
    c1, c2, c3 = (t | lax.shift_left(u32(d), s) for d in (1, 2, 3))
    # (nested selects: u >= c2 implies u >= c1; int32 values, as i1 register arrays do not combine)
    both, n3 = sums(i, jnp.where(u >= c2, i32(65537), jnp.where(u >= c1, i32(1), i32(0))),
                    jnp.where(u >= c3, i32(1), i32(0)))
    n1, n2 = both & i32(0xFFFF), lax.shift_right_logical(both, i32(16))
    t = jnp.where(n3 >= k, c3, jnp.where(n2 >= k, c2, jnp.where(n1 >= k, c1, t)))
    hit = (n1 == k) | (n2 == k) | (n3 == k)
    return i + 1, t, jnp.where(hit, i32(1), i32(0))

  c = (i32(0), u32(0), i32(0))  # (pass, prefix, exact hit)
  if unroll:  # (as before session 31: bench_topk's code-size comparison; no early exit)
    for _ in range(passes):
      c = one_pass(c)
  elif early_exit:
    c = lax.while_loop(lambda c: (c[0] < passes) & (c[2] == 0), one_pass, c)
  else:
    c = lax.fori_loop(0, passes, lambda _, c: one_pass(c), c)
  p_end, t, done = c
  thr = jnp.where(done == 1, t - u32(1), t) if early_exit else t
  (n_gt,) = sums(p_end, (u > thr).astype(i32))
  return thr, n_gt


def _threshold_passes(u, k: int, early_exit: bool, digit_bits: int = 1):
  """The compaction's fused threshold from the row's keys u (uint32, in registers): ``_threshold_search`` with each
  count a warpgroup reduction (``jnp.sum``: its own SMEM round) -> (thr, need: the keys equal to thr to take, first
  by index). (With two bits a pass, ``_threshold_passes_split``.)"""
  thr, n_gt = _threshold_search(u, k, early_exit, digit_bits, lambda p, *xs: tuple(jnp.sum(x) for x in xs))
  return thr, k - n_gt


def _threshold_passes_split(u, c_s, k: int, early_exit: bool, digit_bits: int):
  """``_threshold_passes`` with each pass's counts exchanged by hand: u the row's keys [N / 128, 4, 32] uint32 in
  warp_split_layout (warp i holds [:, i, :]), so a count is a per-warp sum (lanes and registers only) and a pass's
  counts — two with two bits a pass — meet in c_s [2, 2, 4] int32 behind ONE warpgroup barrier
  (``_exchange_warp_counts``), where Mosaic's warpgroup reduction is a round of its own per count: two bits a pass
  then halve the rounds, not just the passes."""
  def sums(p, *xs):  # ([4]: one count per warp)
    return _exchange_warp_counts(c_s, p, [jnp.sum(jnp.sum(x, axis=2), axis=0) for x in xs])

  thr, n_gt = _threshold_search(u, k, early_exit, digit_bits, sums)
  return thr, k - n_gt


def _tc_prefix_counts(f_s, upper, lower_s, acc_w, acc_c, mbar, t_s):
  """``_prefix_slots``' two products in the tcgen05 form (Blackwell): F [128, C] (f_s) · U (``upper``) into the TMEM
  accumulator acc_w and L128 · F (lower_s [128, 128] strictly lower) into acc_c, both [128, C] f32, each MMA issued by
  one thread and arriving on its own tensor-core barrier (mbar.at[0] / .at[1]: used once per CTA, phase 0) -> (within,
  col) [128, C] f32 in the WGMMA layout, relaid one after the other through the SMEM tile t_s [128, C] f32. The
  caller has committed f_s and the triangles (the async proxy). The commit between the two relayouts holds every
  thread until its read of t_s is done before t_s is rewritten (a lean kernel has no automatic barrier there)."""
  plgpu.tcgen05_mma(acc_w, f_s, upper, mbar.at[0], accumulate=False)
  plgpu.tcgen05_mma(acc_c, lower_s, f_s, mbar.at[1], accumulate=False)
  plgpu.barrier_wait(mbar.at[0])
  w = plgpu.async_load_tmem(acc_w, layout=_L.TCGEN05)  # (layouts given: fewer unknowns for Mosaic's inference)
  plgpu.wait_load_tmem()
  within = tmem_to_wgmma(w, t_s)
  plgpu.barrier_wait(mbar.at[1])
  c = plgpu.async_load_tmem(acc_c, layout=_L.TCGEN05)
  plgpu.wait_load_tmem()
  plgpu.commit_smem()  # (every thread's load of within from t_s done before t_s is rewritten)
  return within, tmem_to_wgmma(c, t_s)


def _prefix_slots(gt, eq, base, need, f_s, upper, lower_s, tc=None):
  """Slots of a tile's keys: a selected key's is #{gt before it} + min(#{eq before it}, need), gt = key > thr, eq =
  key == thr (int32 0 / 1 [64, C]), "before" in index order (row-major over the tile; ``base``: the packed counts
  of the keys before the tile). Both counts from one packed flag F = gt + 16384 · eq (0, 1 or 16384: exact in
  bf16, staged in f_s) by wgmma, f32 sums of 0/1 products (exact): within = F · U (``upper`` [C, C] strictly upper:
  the row's keys to the left), col = L · F (lower_s [64, 64] strictly lower: the tile's rows above), both exact
  integers below 2^24 (<= 127 + 16384 · 127 and 63 + 16384 · 63), col then summed along the row in int32 (exact;
  the gt count stays below k < 16384) -> (sel: selected 0 / 1, slot, packed F as int32). ``tc`` = (acc_w, acc_c,
  mbar, t_s): the tcgen05 form (``_tc_prefix_counts``: 128-row tiles, lower_s [128, 128]; col <= 127 + 16384 · 127,
  still exact)."""
  f32, i32 = jnp.float32, jnp.int32
  T, C = gt.shape
  packed = gt + eq * _EQ_UNIT
  f_s[...] = plgpu.layout_cast(packed.astype(f32).astype(jnp.bfloat16), _L.WGMMA)
  plgpu.commit_smem()

  def within_mm(acc):
    plgpu.wgmma(acc, f_s, upper)
    return acc[...]

  def col_mm(acc):
    plgpu.wgmma(acc, lower_s, f_s)
    return acc[...]

  if tc is None:
    within = pl.run_scoped(within_mm, plgpu.ACC((T, C), f32)).astype(i32)
    col = pl.run_scoped(col_mm, plgpu.ACC((T, C), f32)).astype(i32)
  else:
    within, col = (x.astype(i32) for x in _tc_prefix_counts(f_s, upper, lower_s, *tc))
  above = base + col.sum(axis=1)  # [64]: the packed counts of the keys in the rows above (int32: exact)
  before = lax.broadcast_in_dim(above, (T, C), (0,)) + within
  n_gt, n_eq = before & (_EQ_UNIT - 1), lax.shift_right_logical(before, 14)
  sel = gt + jnp.where(n_eq < need, eq, i32(0))  # (gt and eq exclusive: 0 / 1)
  return sel, n_gt + jnp.minimum(n_eq, need), packed


# ------------------------------------------------------------------------------------------------ top-k compaction
# The selection after the threshold kernel, as one launch of several CTAs per score row. The row is viewed as [N / L,
# L] (L = ``lanes`` keys per row, 32 or 128); CTA c owns the 64 rows 64c.. of it (64 · L keys), counts the selected
# keys before them itself (the packed gt / eq flags of the tiles above: no exchange between CTAs), forms its keys'
# slots with two wgmma prefix counts (_prefix_slots: F · U within a row, L64 · F down the tile), and stores each
# selected key's pool and its kpool token positions straight to GMEM (a thread per key: every slot below k has exactly
# one owner, so no -1 fill races with it); CTA 0 also writes the tail and the -1 padding up to the attention kernel's
# width. It replaces XLA's compaction after the threshold kernel — a blocked prefix sum (reduce-window), a slice, a
# select, the -1 buffer's copy, a scatter and the pad to the width: six launches and 9.4 µs on every DSA layer's q = 1
# chain (session 48's trace) — without a single CTA's latency (session 42's one-CTA selection: its threshold passes
# and both 64-row tiles of 128 keys in one CTA, 64 keys per thread each: 19.8 µs alone vs 17.0 for the threshold
# kernel + XLA).
# With L = 32 a thread holds 16 keys of its tile (5 CTAs at 32K context's 8,704 pools).
COMPACT_LANES = 32  # keys per row of the compaction's view (the default: 2,048 keys per CTA, 16 per thread)
_ENC_SLOT = 15  # a selected key's packed code: its index (bits 0..14), slot (15..28), non-finite flag (bit 29)
_ENC_NONFINITE = 1 << 29
assert THRESHOLD_MAX_KEYS <= 1 << _ENC_SLOT and SELECT_MAX_K << _ENC_SLOT <= _ENC_NONFINITE


def topk_compact_reference(scores, t, n_gt, tail_start, pos, *, k: int, kpool: int, n_tail: int, width: int, **_):
  """scores [R, N] f32, a threshold of their order keys (t [R] or [R, 128] uint32, n_gt [R] or [R, 128] int32: lane 0
  read — ``topk_threshold``'s, exact or early-exit; None and None: the exact one, as the kernel's fused form finds its
  own), tail_start / pos [R] int32 -> (idx [R, width], js [R, k]) int32, ``topk_select_reference``'s contract: the set
  the threshold selects (``topk_selection_reference``: lax.top_k's) in ascending index order, -1 for a non-finite
  score, expanded to kpool token positions each, then the tail and -1 up to width. (Keyword options of the kernel,
  ``lanes``, are accepted and ignored.)"""
  _check_select(scores, tail_start, pos, k, kpool, n_tail, width)
  R, N = scores.shape
  from pallas_kernels._common import order_key_u32  # noqa: PLC0415
  if t is None:  # (the kernel's fused form: its own threshold; the exact one selects the same set)
    t, n_gt = topk_threshold_reference(order_key_u32(scores), k)
  t, n_gt = (a if a.ndim == 1 else a[:, 0] for a in (t, n_gt))
  sel = topk_selection_reference(order_key_u32(scores), t, n_gt, k)
  slot = jnp.where(sel, jnp.cumsum(sel, axis=-1) - 1, k)  # (k: dropped)
  keys = jnp.broadcast_to(jnp.arange(N, dtype=jnp.int32), (R, N))
  js = jnp.full((R, k), -1, jnp.int32).at[jnp.arange(R)[:, None], slot].set(
      jnp.where(jnp.isfinite(scores), keys, -1), mode="drop")
  tok = jnp.where(js[..., None] >= 0, js[..., None] * kpool + jnp.arange(kpool, dtype=jnp.int32), -1)
  tail = tail_start[:, None] + jnp.arange(n_tail, dtype=jnp.int32)
  tail = jnp.where(tail <= pos[:, None], tail, -1)
  idx = jnp.concatenate([tok.reshape(R, -1), tail], axis=-1)
  return jnp.pad(idx, ((0, 0), (0, width - idx.shape[-1])), constant_values=-1), js


def _store_selected(enc, js_g, idx_g, *, kpool: int):
  """The GMEM stores of a CTA's selected keys (inline Mosaic GPU: a thread per element of enc [64, L] int32,
  WGMMA layout): for a code c >= 0 (key e, slot s, non-finite flag: _ENC_*), js_g[s] = e and idx_g[kpool · s + q]
  = kpool · e + q — or -1 for a non-finite score. js_g / idx_g: this score row's [k] and [width / 64, 64] int32."""
  from jax._src.lib.mlir import ir  # noqa: PLC0415
  from jax._src.lib.mlir.dialects import arith, memref, scf  # noqa: PLC0415
  from jax.experimental.mosaic.gpu import utils as mu  # noqa: PLC0415

  @plgpu.inline_mgpu(arg_types=(_L.WGMMA, plgpu.RefType(), plgpu.RefType()))
  def op(_, enc_a, js_ref, idx_ref):
    i32, index = ir.IntegerType.get_signless(32), ir.IndexType.get()
    c32, ci = (lambda v: mu.c(v, i32)), (lambda v: mu.c(v, index))  # noqa: E731

    def one(val, ix):
      del ix
      if_op = scf.IfOp(arith.cmpi(arith.CmpIPredicate.sge, val, c32(0)))
      with ir.InsertionPoint(if_op.then_block):
        e = arith.andi(val, c32((1 << _ENC_SLOT) - 1))
        s = arith.andi(arith.shrui(val, c32(_ENC_SLOT)), c32(SELECT_MAX_K - 1))
        bad = arith.cmpi(arith.CmpIPredicate.sge, val, c32(_ENC_NONFINITE))
        si = arith.index_cast(index, s)
        memref.store(arith.select(bad, c32(-1), e), js_ref, [si])
        for q in range(kpool):
          v = arith.select(bad, c32(-1), arith.addi(arith.muli(e, c32(kpool)), c32(q)))
          p = arith.addi(arith.muli(si, ci(kpool)), ci(q))
          memref.store(v, idx_ref, [arith.divui(p, ci(64)), arith.remui(p, ci(64))])
        scf.yield_([])

    enc_a.foreach(one)

  op(enc, js_g, idx_g)


def _store_selected_interpret(enc, enc_s, js_g, idx_g, *, kpool: int, rows: int):
  """``_store_selected`` for GPU interpret mode (no inline Mosaic GPU there): enc through SMEM, then one key of the
  tile's first ``rows`` rows (those that can be keys) at a time, each store a one-element slice — the same writes,
  slowly."""
  enc_s[...] = enc
  L = enc_s.shape[1]

  def one(i, carry):
    c = enc_s[i // L, i % L]

    @pl.when(c >= 0)
    def _():
      e, s = c & ((1 << _ENC_SLOT) - 1), (c >> _ENC_SLOT) & (SELECT_MAX_K - 1)
      bad = c >= _ENC_NONFINITE
      js_g[pl.ds(s, 1)] = jnp.full((1,), jnp.where(bad, -1, e), jnp.int32)
      for q in range(kpool):
        p = s * kpool + q
        idx_g[p // 64, pl.ds(p % 64, 1)] = jnp.full((1,), jnp.where(bad, -1, e * kpool + q), jnp.int32)

    return carry

  lax.fori_loop(0, rows * L, one, None)


def _compact_kernel(k: int, kpool: int, n_tail: int, width: int, nr: int, L: int, boxes, interpret: bool,
                    fused: bool = False, early_exit: bool = True, digit_bits: int = 1, tc05: bool = False):
  """``tc05``: the tcgen05 form (Blackwell): tiles of 128 rows (TC_SELECT_ROWS), the prefix counts as two tcgen05
  MMAs into TMEM (``_tc_prefix_counts``); scratch after the wgmma form's: acc_w, acc_c, their barriers (the
  relayout tile t_s is u_s's first 128 rows: the row's keys are all in registers by then)."""
  i32, u32 = jnp.int32, jnp.uint32
  k_ninf, k_pinf = (_order_key_u32_np(x) for x in (-np.inf, np.inf))  # (finite: the keys strictly between)
  head = kpool * k  # the selected pools' token positions: idx[:head]; the tail and the padding after
  T = TC_SELECT_ROWS if tc05 else SELECT_ROWS
  wg = _L.WGMMA

  split = fused and digit_bits == 2  # (the passes' counts exchanged by hand: _threshold_passes_split)

  def body(*refs):
    tc = None
    if tc05:
      refs, tc = refs[:-3], refs[-3:]
    s_g, t_g, n_g, *refs = refs if not fused else (refs[0], None, None, *refs[1:])
    s4_g, *refs = refs if split else (None, *refs)  # (the row again, as [N / 128, 4, 32]: the passes' view)
    ts_g, pos_g, idx_g, js_g, u_s, f_s, upper_s, lower_s, tail_s, bar, *rest = refs
    u4_s, c_s, *enc_s = rest if split else (None, None, *rest)
    if tc05:  # (the relayout tile: the row's first 128 rows, read by every thread before the packed flags' commit)
      tc = (*tc, u_s.at[pl.ds(0, T)])
    r, c = lax.axis_index("r"), lax.axis_index("c")
    for b0, n in boxes:  # (TMA boxes of at most 256 rows)
      plgpu.copy_gmem_to_smem(s_g.at[r, pl.ds(b0, n)], u_s.at[pl.ds(b0, n)], bar)
    if split:  # (N / 128 <= 136 rows: one box; the barrier counts it)
      plgpu.copy_gmem_to_smem(s4_g.at[r], u4_s, bar)
    _fill_triangles(upper_s, lower_s)  # (while the row arrives)
    plgpu.commit_smem()  # (the wgmma operands: the async proxy)
    if not fused:
      thr, need = t_g[r, 0], k - n_g[r, 0]  # (need: the keys equal to thr to take, first by index)

    @pl.when(c == 0)
    @jax.named_scope("tail")  # (the named scopes: regions of benchmarks/bench_kernel_profile.py)
    def _():  # the tail after the k pools' positions, then -1 up to the width (whole 64-wide rows: head % 64 == 0)
      ts, pos = ts_g[r], pos_g[r]
      p = (plgpu.broadcasted_iota(i32, (64, 64), 0, layout=wg) * 64
           + plgpu.broadcasted_iota(i32, (64, 64), 1, layout=wg))  # (the position after the head)
      t_pos = ts + p
      tail_s[...] = jnp.where((p < n_tail) & (t_pos <= pos), t_pos, -1)
      plgpu.commit_smem()
      n = (width - head) // 64
      plgpu.copy_smem_to_gmem(tail_s.at[pl.ds(0, n)], idx_g.at[r, pl.ds(head // 64, n)])

    with jax.named_scope("load"):
      plgpu.barrier_wait(bar)
    if fused:  # every CTA of the row the same passes over the same keys: the same (thr, need) in each
      with jax.named_scope("threshold"):
        if split:
          thr, need = _threshold_passes_split(order_key_u32(plgpu.load(u4_s, layout=warp_split_layout())), c_s, k,
                                              early_exit, digit_bits)
        else:
          row = u_s.at[pl.ds(0, nr)]
          # (tcgen05: the row's layout given — Mosaic's layout inference ran out of fuel searching for it there)
          vec = next(v for v in (4, 2, 1) if (nr * L // 128) % v == 0)
          u = plgpu.load(row, layout=_L.WG_STRIDED((nr, L), vec_size=vec), optimized=False) if tc05 else row[...]
          thr, need = _threshold_passes(order_key_u32(u), k, early_exit, digit_bits)
    rows = plgpu.broadcasted_iota(i32, (T, L), 0, layout=wg)

    def flags(b0):
      """The gt / eq flags (int32 0 / 1; rows past the row's end are not keys) of the tile from row b0, and the
      keys' finiteness."""
      ub = order_key_u32(plgpu.load(u_s.at[pl.ds(b0, T)], layout=wg, optimized=False))
      real = jnp.where(rows + b0 < nr, i32(1), i32(0))
      gt, eq = jnp.where(ub > thr, real, i32(0)), jnp.where(ub == thr, real, i32(0))
      fin = jnp.where(ub > u32(k_ninf), jnp.where(ub < u32(k_pinf), i32(1), i32(0)), i32(0))
      return gt, eq, fin

    def above(b, acc):  # the packed counts of the keys in the tiles before this CTA's (all whole: b < c)
      gt, eq, _ = flags(b * T)
      return acc + (gt + eq * _EQ_UNIT).sum(axis=1).sum()  # (row sums first: a whole-tile sum to a scalar failed Mosaic's layout inference)

    with jax.named_scope("base"):
      base = lax.fori_loop(0, c, above, i32(0))
    row0 = c * T
    with jax.named_scope("flags"):
      gt, eq, fin = flags(row0)
    with jax.named_scope("slots"):  # (the prefix counts: _prefix_slots)
      sel, slot, _ = _prefix_slots(gt, eq, base, need, f_s, upper_s.at[pl.ds(0, L)], lower_s, tc)
      key = (rows + row0) * L + plgpu.broadcasted_iota(i32, (T, L), 1, layout=wg)
      code = key + lax.shift_left(slot, _ENC_SLOT) + (1 - fin) * _ENC_NONFINITE
      enc = jnp.where(sel > 0, code, i32(-1))
    with jax.named_scope("store"):
      if interpret:
        _store_selected_interpret(enc, enc_s[0], js_g.at[r], idx_g.at[r], kpool=kpool, rows=min(T, nr))
      else:
        _store_selected(plgpu.layout_cast(enc, wg), js_g.at[r], idx_g.at[r], kpool=kpool)
      plgpu.wait_smem_to_gmem(0)

  return body


@kernel_entry("k", "kpool", "n_tail", "width", "lanes", "early_exit", "digit_bits", "lean", "mma")
def topk_compact(scores, t, n_gt, tail_start, pos, *, k: int, kpool: int, n_tail: int, width: int,
                 lanes: int = COMPACT_LANES, early_exit: bool = True, digit_bits: int = 1, lean: bool = False,
                 mma: str = "wgmma"):
  """Mosaic GPU version of ``topk_compact_reference`` (same contract; t / n_gt as ``topk_threshold(lanes_out=True)``
  writes them, [R, 128]): a grid of (R, ceil(N / (64 · lanes))) CTAs (``_compact_kernel``), each storing the
  selected keys of its 64 rows of ``lanes`` keys (32 or 128). N a multiple of 128 up to THRESHOLD_MAX_KEYS (pad
  with -inf), kpool · k and width multiples of 64, k < SELECT_MAX_K.

  t = n_gt = None: the fused form — every CTA finds the threshold itself from the row it holds (_threshold_passes,
  ``digit_bits`` 1 or 2 per pass; ``early_exit`` as topk_threshold's), so the selection is ONE launch with no
  threshold kernel before it: the passes run in parallel in the row's CTAs instead of in a launch of their own (its
  launch gap and the compaction's reload of the row leave the chain).

  ``lean`` (policy knob lean_barriers): built without Mosaic GPU's automatic warpgroup barriers (20 bar.sync in
  the fused 1-bit form, 10 lean; the 2-bit form's passes then cost the one barrier of their counts' exchange each,
  as designed, instead of five). Nothing else is needed: each SMEM buffer the threads write (the triangles, the
  tail, the packed flags, an exchange slot) is read only after a commit_smem, and an exchange slot is rewritten
  two passes later, after the commit of the pass between, which every thread reaches once done reading it.

  ``mma``: "wgmma" (Hopper) or "tcgen05" (Blackwell, sm_100: no wgmma there) — CTAs of 128 rows (TC_SELECT_ROWS:
  M = 128, as the other tcgen05 forms; 4,096 keys per CTA at lanes 32), the two prefix counts tcgen05 MMAs into
  tensor memory, relaid into the WGMMA layout the rest of the kernel keeps (``_tc_prefix_counts``). The same
  outputs; ``lean`` honoured (the relayout tile's rewrite behind a commit of its own)."""
  from pallas_kernels._common import interpreting  # noqa: PLC0415
  tc05 = check_mma(mma, "topk_compact")
  _check_select(scores, tail_start, pos, k, kpool, n_tail, width)
  R, N = scores.shape
  if N % THRESHOLD_LANES or N > THRESHOLD_MAX_KEYS:
    raise ValueError(f"topk_compact: N = {N} scores per row; the kernel takes a multiple of {THRESHOLD_LANES} up "
                     f"to {THRESHOLD_MAX_KEYS} (pad with -inf)")
  if width % 64 or (kpool * k) % 64 or k >= SELECT_MAX_K or width - kpool * k > 64 * 64:
    raise ValueError(f"topk_compact: width = {width}, kpool · k = {kpool * k}, k = {k}; expected the first two "
                     f"multiples of 64 (the index rows' TMA boxes), k < {SELECT_MAX_K} (the packed counts) and at "
                     "most 4,096 positions after the pools' (the tail tile)")
  if lanes not in (32, 128):
    raise ValueError(f"topk_compact: lanes = {lanes}, expected 32 or 128 keys per row of the kernel's view")
  fused = t is None
  if digit_bits not in (1, 2) or (digit_bits == 2 and not fused):
    raise ValueError(f"topk_compact: digit_bits = {digit_bits}; 1, or 2 in the fused form (t = n_gt = None: the "
                     "threshold kernel's own digit_bits sets a given threshold's)")
  if fused != (n_gt is None):
    raise ValueError("topk_compact: t and n_gt are both given (the threshold kernel's) or both None (the fused "
                     "form's own threshold)")
  for name, a, dt in () if fused else (("t", t, jnp.uint32), ("n_gt", n_gt, jnp.int32)):
    if a.shape != (R, THRESHOLD_LANES) or a.dtype != dt:
      raise ValueError(f"topk_compact: {name} {a.shape} {a.dtype}, expected [{R}, {THRESHOLD_LANES}] "
                       f"{jnp.dtype(dt).name} (topk_threshold(lanes_out=True))")
  L = int(lanes)
  nr = N // L
  rows = TC_SELECT_ROWS if tc05 else SELECT_ROWS  # key rows per CTA (the MMAs' M)
  nc = -(-nr // rows)
  boxes = tuple((b, min(256, nr - b)) for b in range(0, nr, 256))
  interp = interpreting()
  split = fused and digit_bits == 2
  tile = lambda w: (plgpu.TilingTransform((8, w)), plgpu.SwizzleTransform(2 * w))  # noqa: E731 (bf16, w <= 64)
  scratch = [
      plgpu.SMEM((nc * rows, L), jnp.float32),  # u_s: the row (whole 64 / 128-row tiles)
      plgpu.SMEM((rows, L), jnp.bfloat16, transforms=tile(min(L, 64))),  # f_s: the CTA's packed flags
      plgpu.SMEM((max(L, rows), L), jnp.bfloat16, transforms=tile(min(L, 64))),  # upper_s (first L rows)
      # lower_s (the A operand of L64 · F, L128 · F in the tcgen05 form: swizzled as F, the B operand, for the
      # MMA's K tiles to agree)
      plgpu.SMEM((rows, rows), jnp.bfloat16, transforms=tile(min(L, 64))),
      plgpu.SMEM((64, 64), jnp.int32),  # tail_s: the positions after the pools' (CTA 0)
      plgpu.Barrier(num_arrivals=len(boxes) + int(split)),
  ] + ([plgpu.SMEM((N // THRESHOLD_LANES, 4, 32), jnp.float32),  # u4_s: the row for the split passes
        plgpu.SMEM((2, 2, 4), jnp.int32)] if split else [])  # c_s: their counts' exchange
  scratch += [plgpu.SMEM((rows, L), jnp.int32)] if interp else []  # (interpret mode's scatter)
  if tc05:  # acc_w, acc_c (TMEM: within = F · U, col = L128 · F), their barriers (the relayout tile: u_s's)
    scratch += [plgpu.TMEM((rows, L), jnp.float32), plgpu.TMEM((rows, L), jnp.float32),
                plgpu.Barrier(num_arrivals=1, num_barriers=2, orders_tensor_core=True)]
  idx, js = mgpu_kernel(
      _compact_kernel(int(k), int(kpool), int(n_tail), int(width), nr, L, boxes, interp, fused, bool(early_exit),
                      int(digit_bits), tc05=tc05),
      out_type=(jax.ShapeDtypeStruct((R, width // 64, 64), jnp.int32), jax.ShapeDtypeStruct((R, k), jnp.int32)),
      grid=(R, nc),
      grid_names=("r", "c"),
      kernel_name="glm5_topk_compact",
      scratch_types=scratch,
      compiler_params=plgpu.CompilerParams(unsafe_no_auto_barriers=bool(lean)),
  )(scores.reshape(R, nr, L), *(() if fused else (t, n_gt)),
    *((scores.reshape(R, N // THRESHOLD_LANES, 4, 32),) if split else ()), tail_start.astype(jnp.int32),
    pos.astype(jnp.int32))
  return idx.reshape(R, width), js


# ------------------------------------------------------------------------------------------------ long rows
# A score row longer than the compaction kernel holds (THRESHOLD_MAX_KEYS: 64K context's pools; the model's native
# context is 1M tokens, 262,144 pools) is selected in two stages of the same one-launch kernel: the top k of each
# chunk of the row (the chunks as rows of their own), then the top k of the chunks' candidates. Exact: under
# lax.top_k's total order (larger, or equal at a lower index) the top k of the row are among the top k of their
# chunk, and the candidates, laid out chunk after chunk in ascending index order, break ties by index as the row
# does. Before it such a row was XLA's sort (83-262 µs of glue per DSA layer at 128K on an H100, session 64).
def chunked_select_plan(n: int, k: int, *, max_keys: int | None = None,
                        balanced: bool = True) -> tuple[int, int] | None:
  """(chunks C, keys per chunk W) for a two-stage selection of k of n keys: chunks of at most ``max_keys`` (a
  multiple of THRESHOLD_LANES, each at least k) covering n — C · W >= n, the excess padded with -inf — or None when
  the C · k candidates (padded to the lanes) would not fit one row of ``max_keys`` (default: THRESHOLD_MAX_KEYS).
  ``balanced`` (the default): more, shorter chunks — C ~ sqrt(n / k), so that a chunk's row and the candidates' row
  are about as long (each stage's passes run over fewer keys per thread; at 128K context 8 chunks of 4,224
  instead of 2 of 16,512); measured faster than the fewest chunks (balanced=False) at every length on an H100
  (bench_topk, session 66: one row 128K / 256K / 1M 22.8 / 25.7 / 36.0 vs 30.1 / 33.7 / 40.4 µs, four rows 24.5
  / 28.6 / 59.9 vs 33.7 / 37.6 / 78.1)."""
  L = THRESHOLD_LANES
  max_keys = THRESHOLD_MAX_KEYS if max_keys is None else max_keys
  fits = lambda C, W: W >= k and -(-C * k // L) * L <= max_keys  # noqa: E731
  C = max(1, -(-n // max_keys))
  if not fits(C, -(-n // (C * L)) * L):
    return None
  if balanced:
    C = next(c for c in range(max(C, round(math.sqrt(n / k))), C - 1, -1) if fits(c, -(-n // (c * L)) * L))
  return C, -(-n // (C * L)) * L


def topk_compact_chunked(scores, tail_start, pos, *, k: int, kpool: int, n_tail: int, width: int,
                         max_keys: int | None = None, balanced: bool = True, lanes: int = COMPACT_LANES,
                         early_exit: bool = True, digit_bits: int = 1, lean: bool = False, mma: str = "wgmma"):
  """``topk_select_reference``'s contract for rows of any length up to ``chunked_select_plan``'s: scores [R, N] f32
  -> (idx [R, width], js [R, k]) int32 — lax.top_k's set of each row in ascending index order, expanded to kpool
  token positions, the tail, -1 padding — from two launches of the fused ``topk_compact`` (its own threshold in
  every CTA; options as there) and two small XLA fusions:

  1. the rows as C chunks of W keys (``chunked_select_plan``; -inf past N) — C·R rows of the kernel: each chunk's
     top k (chunk-local indices ascending, -1 for a non-finite score);
  2. the candidates — the selected scores, chunk after chunk (-inf for a -1), their global indices beside them —
     as R rows of C·k keys: their top k, mapped back to the global indices; then the expansion to tokens and the
     tail (XLA).

  Exactly lax.top_k's set for finite scores (and for -inf masking, the model's: -1 past the finite ones). A
  selected NaN or +inf score becomes -1 in stage 1, so stage 2 weighs it as -inf: the list may then hold another
  pool in its place (the single-launch kernel would keep the slot, as -1). ``max_keys``: the chunks' size limit
  (default: the kernel's THRESHOLD_MAX_KEYS; smaller to test the two stages at small sizes); ``balanced``:
  ``chunked_select_plan``'s."""
  _check_select(scores, tail_start, pos, k, kpool, n_tail, width, "topk_compact_chunked")
  R, N = scores.shape
  max_keys = THRESHOLD_MAX_KEYS if max_keys is None else max_keys
  plan = chunked_select_plan(N, k, max_keys=max_keys, balanced=balanced)
  if plan is None or max_keys % THRESHOLD_LANES or max_keys > THRESHOLD_MAX_KEYS:
    raise ValueError(f"topk_compact_chunked: k = {k} of N = {N} keys in chunks of at most {max_keys} (a multiple of "
                     f"{THRESHOLD_LANES} up to {THRESHOLD_MAX_KEYS}): the chunks' {-(-N // max_keys)} x {k} candidates "
                     "must fit one chunk")
  C, W = plan
  ninf = jnp.float32(-jnp.inf)
  s = scores if C * W == N else jnp.pad(scores, ((0, 0), (0, C * W - N)), constant_values=ninf)
  kw = dict(k=k, kpool=kpool, n_tail=0, width=kpool * k + 64, lanes=lanes, early_exit=early_exit,
            digit_bits=digit_bits, lean=lean, mma=mma)  # (width: one -1 tail tile — the kernel writes >= one)
  z = jnp.zeros((R * C,), jnp.int32)
  _, j1 = topk_compact(s.reshape(R * C, W), None, None, z, z, **kw)
  j1 = j1.reshape(R, C, k)
  ok = j1 >= 0
  vals = jnp.where(ok, jnp.take_along_axis(s.reshape(R, C, W), jnp.maximum(j1, 0), axis=-1), ninf).reshape(R, C * k)
  gid = jnp.where(ok, j1 + W * jnp.arange(C, dtype=jnp.int32)[:, None], -1).reshape(R, C * k)
  n2 = -(-C * k // THRESHOLD_LANES) * THRESHOLD_LANES
  vals = jnp.pad(vals, ((0, 0), (0, n2 - C * k)), constant_values=ninf)
  z = jnp.zeros((R,), jnp.int32)
  _, j2 = topk_compact(vals, None, None, z, z, **kw)
  js = jnp.where(j2 >= 0, jnp.take_along_axis(gid, jnp.maximum(j2, 0), axis=-1), -1)
  tok = jnp.where(js[..., None] >= 0, js[..., None] * kpool + jnp.arange(kpool, dtype=jnp.int32), -1)
  tail = tail_start.astype(jnp.int32)[:, None] + jnp.arange(n_tail, dtype=jnp.int32)
  tail = jnp.where(tail <= pos.astype(jnp.int32)[:, None], tail, -1)
  idx = jnp.concatenate([tok.reshape(R, kpool * k), tail], axis=-1)
  return jnp.pad(idx, ((0, 0), (0, width - idx.shape[-1])), constant_values=-1), js
