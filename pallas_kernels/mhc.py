"""Fused mHC layer boundary (spec model.md §3.2 mHC pre, §3.3 mHC post): two Mosaic GPU kernels per site.

Shapes: M token rows (B · T) per launch, at most 64; N = 4 residual streams; D hidden (4096); K = N · D (16384)
the flattened streams; G = D / 64 column chunks (one CTA each). The residual is kept as X [M, N·D] bf16
(stream-major, the spec's flatten order). A site hands the *next* boundary ``mix`` = (post_t [N, C] f32: its post,
comb_t [N·N, C] f32: its Sinkhorn-normalised comb, comb[i, j] in row N·i + j), transposed: column m
is token row m, C = M rounded up to 64 (columns M.. are padding). Transposed, each per-token quantity is one SMEM
row — one load or store of a per-row vector in the kernels instead of a masked extraction from / a select chain
into a [64, 16] tile (``mix_from_rows`` / ``mix_rows`` convert).

A boundary between sublayers (the post of one site fused with the pre of the next, as vLLM's
``MHCFusedPostPreOp``) is two Mosaic launches and one XLA reduction instead of ~11 XLA kernels (measured on the
H200 at M = 1 with the Sinkhorn still an XLA fusion: 6.2 + 1.8 + 3.4 + 3.6 µs, BENCHMARKS.md session 21):

1. ``mhc_post_pre`` (kernel, G CTAs): for its 64 columns of every stream, X'_j = post_j · y + Σ_i comb[i, j] · X_i
   in f32, rounded to bf16 (skipped at the first site, which has no previous sublayer: X' = X); the partial
   mixing logits part[g, :, :24] = X'_chunk · fn_chunkᵀ (bf16 × bf16 wgmma, f32 accumulation: the products are
   exact, as in the f32 reference) and the partial Gram matrix of the four streams part[g, :, 24 + k] =
   Σ_d X'_i[d] X'_j[d] for the k-th pair i <= j, then a copy of the 4 pre logits (columns 34..37: with the Gram
   entries, the 16 columns the normalisation reads) — one array, so that one XLA reduction sums the G partials
   (f32, on the CUDA cores) into tot [64, 40] (rows M.. padding).
2. ``mhc_finish`` (kernel, D / 128 + 1 CTAs): from tot (transposed: one row per quantity), ‖x‖² is the Gram
   trace, so the logits are m = (fn · x) · rsqrt(mean(x²) + eps). The first D / 128 CTAs compute per row pre (a
   sigmoid of the scaled logits) and the variance of the sublayer input u = Σ_i pre_i X'_i from the Gram matrix,
   mean(u²) = preᵀ Gram pre / D — the variance of the f32 u, as vLLM's fused kernel computes it (HF takes it from
   the bf16-rounded u); then x_in = w · bf16(bf16(u) · rinv), the weighted RMSNorm of the sublayer input with
   the stock path's rounding points, for their 128 columns. The last CTA, in parallel, computes post and the
   comb logits' softmax + 20 Sinkhorn iterations (a rolled loop on per-row vectors) and stores both for the next
   boundary.

The same boundary in ONE launch (policy knob mhc_grid_barrier, on by default): ``mhc_post_finish`` (mhc_post_pre's
128 narrow CTAs, then a grid barrier — a GMEM semaphore — then mhc_finish's normalisation of each CTA's own columns
from the partials in L2); the Sinkhorn then runs as ``mhc_sinkhorn`` off the sublayer's critical path. (A cluster
form, 8 CTAs exchanging their partials through GMEM, was bound by its CTAs' serial chunks — 33.8 vs 15.3 µs,
session 32 — and was removed in session 53.) At one token row,
``mhc_row_boundary`` is mhc_post_finish with a column of every stream per thread instead of 64-row tiles.

References with the same signatures: ``mhc_post_pre_reference`` and ``mhc_finish_reference`` (pure jnp, f32; the
latter on ``mhc_mix_reference``: pre / post from tot with the stock path's ``hc_pre_post``).

Kernel notes: the token rows are the wgmma M dimension (64, rows past M are never stored), so per-token values
(post, comb, pre, r) are per-row vectors broadcast along the columns. Inputs arrive by TMA boxes of M rows into
untiled SMEM and are read back as whole tiles (column-offset slices of untiled SMEM loads were measured wrong
on the H200, see sparse_mla._dequant_block); X' is written twice — into a swizzled tile for the wgmma and an
untiled one for the TMA store of its M rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._common import (LL_HEAD, counter_signal, counter_wait, fence_async_writes, interpreting,
                                    kernel_entry, ll_epoch, ll_exchange, mgpu_kernel, saturate_f16, tiled,
                                    wg_barrier)

N = 4  # residual streams
MIX = 24  # mixing logits: pre 4, post 4, comb 16
ROWS = 64  # token rows per launch (wgmma M)
DC = 64  # columns per CTA of each stream in mhc_post_pre (``cols``: 32 or 64)
DC_FIN = 128  # columns per CTA in mhc_finish (``cols``: 64 or 128)
# (narrower CTAs — twice as many — halve each thread's floating-point work: at M = 1 the kernels run 64-row tiles
# for one real row; policy knob mhc_narrow, on by default: the step at q = 1 5.27 -> 4.83 ms, session 32)
GRAM = N * (N + 1) // 2  # distinct Gram entries (i <= j), in the order of _PAIRS
PART = 40  # columns of the partial-sums array: MIX logits, GRAM entries, a copy of the N pre logits, 2 zeros
PRE_COPY = MIX + GRAM  # (34) columns PRE_COPY.. repeat columns 0..N-1, the pre logits: the normalisation's 14 sums
# (the Gram entries and the pre logits) are then the 16 columns MIX.. of every chunk's row — mhc_post_finish's
# second half loads those instead of all 40 (session 48's in-kernel profile: its partial sums' loads and reduction
# were ~30 % of the launch)
_PAIRS = [(i, j) for i in range(N) for j in range(i, N)]
_L = plgpu.Layout
def _bf16_swizzled(cols: int):
  """The wgmma operand transforms of a bf16 tile ``cols`` wide (rows of 2·cols bytes, swizzled as wide)."""
  return (plgpu.TilingTransform((8, cols)), plgpu.SwizzleTransform(2 * cols))


def _check(x, D, what):
  M = x.shape[0]
  if not 1 <= M <= ROWS:
    raise ValueError(f"{what}: {M} token rows, expected 1..{ROWS} per launch (the caller splits larger batches)")
  if D % DC_FIN:
    raise ValueError(f"{what}: hidden size {D} must be a multiple of {DC_FIN}")


def mix_from_rows(post, comb):
  """(post [M, N], comb [M, N·N]) per token row -> the kernels' transposed ``mix`` (post_t [N, C], comb_t
  [N·N, C]), C = M rounded up to a multiple of 64, zero padded."""
  M = post.shape[0]
  C = -(-M // ROWS) * ROWS
  return tuple(jnp.pad(a.astype(jnp.float32).T, ((0, 0), (0, C - M))) for a in (post, comb))


def mix_rows(mix, M: int):
  """The transposed ``mix`` -> (post [M, N], comb [M, N·N]) of the first M token rows."""
  return mix[0][:, :M].T, mix[1][:, :M].T


# ------------------------------------------------------------------------------------------------ references
def mhc_post_pre_reference(X, y, mix, fn, *, first: bool = False, cols: int = DC):
  """X [M, N·D] bf16 residual, y [M, D] bf16 sublayer output, mix = (post_t [N, 64], comb_t [N·N, 64]) f32 of
  the previous site (``mhc_finish``'s, transposed), fn [24, N·D] bf16 -> (X' [M, N·D] bf16, part [G, 64, 40]
  f32: per column chunk (``cols`` columns of each stream, G = D / cols) the 24 partial mixing logits, the 10
  partial Gram entries, a copy of the 4 pre logits (PRE_COPY) and 2 zero columns). ``first``: no previous sublayer
  (y and mix are ignored, X' = X).
  Rows M.. of part are padding (unspecified)."""
  M, K = X.shape
  D = K // N
  G = D // cols
  Xs = X.astype(jnp.float32).reshape(M, N, D)
  if first:
    Xn = Xs.astype(jnp.bfloat16)
  else:
    post, comb = mix_rows(mix, M)
    comb = comb.reshape(M, N, N)
    s = comb[:, 0, :, None] * Xs[:, :1]  # Σ_i comb[i, j] X_i summed in order i = 0..3, then + post_j · y
    for i in range(1, N):
      s = s + comb[:, i, :, None] * Xs[:, i:i + 1]
    Xn = (post[..., None] * y.astype(jnp.float32)[:, None, :] + s).astype(jnp.bfloat16)
  xf = Xn.astype(jnp.float32).reshape(M, N, G, cols)
  fnc = fn.astype(jnp.float32).reshape(MIX, N, G, cols)
  pm = jnp.einsum("mngc,kngc->gmk", xf, fnc, precision=lax.Precision.HIGHEST)
  gram = jnp.stack([jnp.einsum("mgc,mgc->gm", xf[:, i], xf[:, j], precision=lax.Precision.HIGHEST)
                    for i, j in _PAIRS], axis=-1)
  pad = ((0, 0), (0, ROWS - M), (0, 0))
  part = jnp.concatenate([pm, gram, pm[..., :N], jnp.zeros((*gram.shape[:2], PART - PRE_COPY - N), pm.dtype)],
                         axis=-1)
  return Xn.reshape(M, K), jnp.pad(part, pad)


def mhc_mix_reference(tot, coef, D: int, *, eps: float, hc_norm_eps: float, norm_eps: float, post_mult: float):
  """The site's pre / post / 1-over-RMS from the summed partials (the stock path's math, ``hc_pre_post``): tot
  [M, 40] f32 = the partials of ``mhc_post_pre`` summed over the column chunks, coef [27] f32 the site's mHC base
  [24] then scale [3] (``HyperConnection.base_scale``) -> (pre [M, N], rinv [M] = 1/RMS of the sublayer input u,
  post [M, N]). mean(u²) = preᵀ Gram pre / D (clamped at 0: it can round below where the weighted streams nearly
  cancel), the variance of the f32 u as vLLM's fused kernel takes it. (comb: ``_comb_reference``.)"""
  from glm5_jax.layers import hc_pre_post  # noqa: PLC0415 (the stock path's mixing math: one definition)
  gram = _gram(tot)
  pre, post = hc_pre_post(tot[:, :2 * N] * _logit_norm(gram, D, hc_norm_eps), coef[MIX:], coef[:MIX], N, eps,
                          post_mult)
  # (an elementwise sum, not an einsum: XLA keeps it in the glue's one fusion instead of a tiny dot kernel)
  var = jnp.maximum(jnp.sum(pre[:, :, None] * gram * pre[:, None, :], axis=(1, 2)) / D, 0.0)
  return pre, lax.rsqrt(var + norm_eps), post


def _gram(tot):
  """tot [M, 40] -> the symmetric Gram matrix of the four streams [M, N, N]."""
  idx = {p: k for k, p in enumerate(_PAIRS)}
  gp = tot[:, MIX:]
  return jnp.stack([jnp.stack([gp[:, idx[min(i, j), max(i, j)]] for j in range(N)], -1) for i in range(N)], -2)


def _logit_norm(gram, D, hc_norm_eps):
  """rsqrt(mean(x²) + eps) [M, 1] of the flattened streams: ‖x‖² is the Gram trace."""
  return lax.rsqrt(sum(gram[:, i, i] for i in range(N)) / (N * D) + hc_norm_eps)[:, None]


def _comb_reference(tot, coef, D: int, *, iters: int, eps: float, hc_norm_eps: float):
  """comb [M, N·N] f32 (row-major comb[i, j] at N·i + j): the Sinkhorn of the site's comb logits from the summed
  partials tot [M, 40], with the stock path's ``sinkhorn_comb``."""
  from glm5_jax.layers import sinkhorn_comb  # noqa: PLC0415
  mc = tot[:, 2 * N:MIX] * _logit_norm(_gram(tot), D, hc_norm_eps)
  return sinkhorn_comb(mc, coef[MIX + 2], coef[2 * N:MIX], N, iters, eps).reshape(-1, N * N)


def mhc_finish_reference(Xn, tot_t, coef, w, *, iters: int, eps: float, hc_norm_eps: float, norm_eps: float,
                         post_mult: float, approx_math: bool = False):
  """Xn [M, N·D] bf16 (X' of ``mhc_post_pre``), tot_t [40, C] f32 (its partials summed over the column chunks,
  transposed: column m is token row m; columns M.. are padding; C = 64, or M rounded up to 4), coef [27]
  (base, scale), w [D] -> (x_in [M, D] bf16 = w · bf16(bf16(u) · rinv), mix = (post_t [N, 64] f32: this site's
  post, comb_t [N·N, 64] f32: its Sinkhorn-normalised comb; columns M.. zero)). u = Σ_i pre_i · X'_i in f32 (the
  stock path's RMSNorm rounding, with rinv from the Gram matrix); comb from the stock path's ``sinkhorn_comb``
  (``iters`` iterations). tot_t may also be mhc_post_pre's raw partials [G, 64, 40] (``partial_sums_t``).
  ``approx_math`` is the kernel's option (exact math here)."""
  M, K = Xn.shape
  D = K // N
  tot = (partial_sums_t(tot_t, M) if tot_t.ndim == 3 else tot_t[:, :M]).T
  pre, rinv, post = mhc_mix_reference(tot, coef, D, eps=eps, hc_norm_eps=hc_norm_eps, norm_eps=norm_eps,
                                      post_mult=post_mult)
  u = jnp.einsum("mn,mnd->md", pre, Xn.astype(jnp.float32).reshape(M, N, D), precision=lax.Precision.HIGHEST)
  xn = (u.astype(jnp.bfloat16).astype(jnp.float32) * rinv[:, None]).astype(jnp.bfloat16)
  comb = _comb_reference(tot, coef, D, iters=iters, eps=eps, hc_norm_eps=hc_norm_eps)
  return w.astype(jnp.bfloat16) * xn, *mix_from_rows(post, comb)


# ------------------------------------------------------------------------------------------------ kernels
def _row_vector(ref, k):
  """Row k of a [rows, 64] f32 SMEM ref (one quantity per row, a column per token row) as a per-row vector [64]."""
  return plgpu.load(ref.at[k], layout=_L.WGMMA.reduce(1), optimized=False)


def _bcast(v, cols):
  return lax.broadcast_in_dim(v, (ROWS, cols), (0,))


def _post_mix(xs, yv, post, comb, cols):
  """X'_j = post_j · y + Σ_i comb[i, j] · X_i (i in order) in f32, rounded once to bf16 (kept as f32 values):
  xs the N stream tiles [64, cols] f32, yv the sublayer output tile, post / comb per-row vectors."""
  xn = []
  for j in range(N):
    s = _bcast(comb[j], cols) * xs[0]
    for i in range(1, N):
      s = s + _bcast(comb[N * i + j], cols) * xs[i]
    xn.append((_bcast(post[j], cols) * yv + s).astype(jnp.bfloat16).astype(jnp.float32))
  return xn


def _stage_streams(xn, xw_s, xu_s):
  """X' into xw_s (swizzled: the wgmma A operand) and, unless None, xu_s (untiled: the TMA store of M rows)."""
  for j in range(N):
    xb = plgpu.layout_cast(xn[j].astype(jnp.bfloat16), _L.WGMMA)
    xw_s[j] = xb
    if xu_s is not None:
      xu_s[j] = xb
  plgpu.commit_smem()


def _gram_vectors(xn):
  """The partial Gram entries Σ_d X'_i X'_j (i <= j, in _PAIRS order) of the tiles xn, as per-row vectors."""
  return [plgpu.layout_cast((xn[i] * xn[j]).sum(axis=1), _L.WGMMA.reduce(1)) for i, j in _PAIRS]


def _pre_logits(pm):
  """The N pre logits (columns 0..N-1 of the logits tile pm [64, 24]) as per-row vectors (masked row sums: exact,
  one nonzero term each)."""
  cm = plgpu.broadcasted_iota(jnp.int32, (ROWS, MIX), 1, layout=_L.WGMMA)
  return [plgpu.layout_cast(jnp.sum(jnp.where(cm == i, pm, 0.0), axis=1), _L.WGMMA.reduce(1)) for i in range(N)]


def _gram_tile(gks, pre):
  """The Gram per-row vectors, then the pre logits' (PRE_COPY), as the [64, 16] tile of the partials' columns
  MIX.. (a select per entry)."""
  col = plgpu.broadcasted_iota(jnp.int32, (ROWS, PART - MIX), 1, layout=_L.WGMMA)
  gram = jnp.zeros((ROWS, PART - MIX), jnp.float32)
  for k, gk in enumerate([*gks, *pre]):
    gram = jnp.where(col == k, _bcast(gk, PART - MIX), gram)
  return plgpu.layout_cast(gram, _L.WGMMA)


def _gram_scale(gp, D, hc_norm_eps):
  """The summed Gram per-row vectors (_PAIRS order) -> (the symmetric [N][N] Gram, the logits' scale
  r = rsqrt(mean(x²) + eps), ‖x‖² being the Gram trace)."""
  idx = {p: k for k, p in enumerate(_PAIRS)}
  gram = [[gp[idx[min(i, j), max(i, j)]] for j in range(N)] for i in range(N)]
  ss = gram[0][0] + gram[1][1] + gram[2][2] + gram[3][3]
  return gram, lax.rsqrt(ss / float(N * D) + hc_norm_eps)


def _pre_rinv(S, gram, r, base, sc0, D, eps, norm_eps):
  """pre_i = σ(S_i · r · scale + base_i) + eps and 1/RMS of u = Σ_i pre_i X'_i from the Gram matrix (mean(u²) =
  preᵀ Gram pre / D, clamped at 0), per row."""
  pre = [jax.nn.sigmoid(S[i] * r * sc0 + base[i]) + eps for i in range(N)]
  var = None
  for i in range(N):
    for j in range(N):
      t = pre[i] * gram[i][j] * pre[j]
      var = t if var is None else var + t
  return pre, lax.rsqrt(jnp.maximum(var / float(D), 0.0) + norm_eps)


def _post_pre_kernel(M: int, D: int, first: bool, DC: int):  # (DC: this launch's columns per CTA)
  def body(*refs):
    if first:  # no previous sublayer: X' = X, nothing to mix or store
      x_g, fn_g, part_g, x_s, fn_s, xw_s, bar = refs
    else:
      x_g, y_g, post_g, comb_g, fn_g, xo_g, part_g, x_s, y_s, post_s, comb_s, fn_s, xw_s, xu_s, bar = refs
    g = lax.axis_index("g")
    d0 = g * DC
    for i in range(N):
      plgpu.copy_gmem_to_smem(x_g.at[pl.ds(0, M), pl.ds(i * D + d0, DC)], x_s.at[i, pl.ds(0, M)], bar)
      plgpu.copy_gmem_to_smem(fn_g.at[:, pl.ds(i * D + d0, DC)], fn_s.at[i], bar)
    if not first:
      plgpu.copy_gmem_to_smem(y_g.at[pl.ds(0, M), pl.ds(d0, DC)], y_s.at[pl.ds(0, M)], bar)
      plgpu.copy_gmem_to_smem(post_g, post_s, bar)
      plgpu.copy_gmem_to_smem(comb_g, comb_s, bar)
    with jax.named_scope("load"):
      plgpu.barrier_wait(bar)

    with jax.named_scope("mix"):
      with jax.named_scope("xs"):
        xs = [plgpu.load(x_s.at[i], layout=_L.WGMMA, optimized=False).astype(jnp.float32) for i in range(N)]
      if first:
        xn = xs  # bf16 values already
      else:
        with jax.named_scope("rows"):
          post = [_row_vector(post_s, k) for k in range(N)]  # (transposed mix: one SMEM row per quantity)
          comb = [_row_vector(comb_s, k) for k in range(N * N)]
          yv = plgpu.load(y_s, layout=_L.WGMMA, optimized=False).astype(jnp.float32)
        with jax.named_scope("math"):
          xn = _post_mix(xs, yv, post, comb, DC)
      with jax.named_scope("stage"):
        _stage_streams(xn, xw_s, None if first else xu_s)
    if not first:
      for j in range(N):
        plgpu.copy_smem_to_gmem(xu_s.at[j, pl.ds(0, M)], xo_g.at[pl.ds(0, M), pl.ds(j * D + d0, DC)])

    def logits(acc):
      for j in range(N):
        plgpu.wgmma(acc, xw_s.at[j], fn_s.at[j].T)
      return acc[...]

    with jax.named_scope("logits"):
      pm = pl.run_scoped(logits, plgpu.ACC((ROWS, MIX), jnp.float32))
    with jax.named_scope("partials"):
      with jax.named_scope("pm"):
        part_g[g, :, pl.ds(0, MIX)] = plgpu.layout_cast(pm, _L.WGMMA)
      with jax.named_scope("gram"):
        gt = _gram_tile(_gram_vectors(xn), _pre_logits(pm))
      with jax.named_scope("gstore"):
        part_g[g, :, pl.ds(MIX, PART - MIX)] = gt
    if not first:
      with jax.named_scope("store_wait"):
        plgpu.wait_smem_to_gmem(0)

  return body


@kernel_entry("first", "cols")
def mhc_post_pre(X, y, mix, fn, *, first: bool = False, cols: int = DC):
  """Mosaic GPU version of ``mhc_post_pre_reference`` (same signature and outputs; with ``first`` X' is X itself):
  a CTA per ``cols`` columns of every stream (32 or 64)."""
  M, K = X.shape
  D = K // N
  _check(X, D, "mhc_post_pre")
  if cols not in (32, 64):
    raise ValueError(f"mhc_post_pre: cols = {cols}, expected 32 or 64 columns per CTA")
  DC = cols
  if fn.shape != (MIX, K) or X.dtype != jnp.bfloat16:
    raise ValueError(f"mhc_post_pre: fn {fn.shape} / X {X.dtype}, expected fn [{MIX}, {K}] and a bf16 residual")
  G = D // DC
  bf16, f32 = jnp.bfloat16, jnp.float32
  part = jax.ShapeDtypeStruct((G, ROWS, PART), f32)
  x_s = plgpu.SMEM((N, ROWS, DC), bf16)  # the M rows of each stream's chunk (untiled: TMA boxes of M rows)
  fn_s = plgpu.SMEM((N, MIX, DC), bf16, transforms=_bf16_swizzled(DC))  # wgmma B (as fn_sᵀ)
  xw_s = plgpu.SMEM((N, ROWS, DC), bf16, transforms=_bf16_swizzled(DC))  # X' as the wgmma A operand
  common = dict(grid=(G,), grid_names=("g",))
  if first:
    kern = mgpu_kernel(_post_pre_kernel(M, D, True, DC), out_type=part, kernel_name="glm5_mhc_pre", **common,
                       scratch_types=[x_s, fn_s, xw_s, plgpu.Barrier(num_arrivals=2 * N)])
    return X, kern(X, fn.astype(bf16))
  kern = mgpu_kernel(
      _post_pre_kernel(M, D, False, DC), out_type=(jax.ShapeDtypeStruct((M, K), bf16), part),
      kernel_name="glm5_mhc_post_pre", **common,
      scratch_types=[
          x_s,
          plgpu.SMEM((ROWS, DC), bf16),  # y_s
          plgpu.SMEM((N, ROWS), f32),  # post_s (transposed mix: a row per quantity)
          plgpu.SMEM((N * N, ROWS), f32),  # comb_s
          fn_s, xw_s,
          plgpu.SMEM((N, ROWS, DC), bf16),  # xu_s: X' untiled, for the TMA store of M rows
          plgpu.Barrier(num_arrivals=2 * N + 3),
      ])
  post, comb = mix
  if post.shape != (N, ROWS) or comb.shape != (N * N, ROWS):
    raise ValueError(f"mhc_post_pre: mix = (post {post.shape}, comb {comb.shape}), expected the transposed "
                     f"({(N, ROWS)}, {(N * N, ROWS)}) of mhc_finish (mix_from_rows)")
  return kern(X, y.astype(bf16), post.astype(f32), comb.astype(f32), fn.astype(bf16))


def _normed_input(x_s, w_s, o_s, o_g, pre, rinv, M, d0, o16=None):
  """x_in = w · bf16(bf16(Σ_i pre_i X'_i) · rinv) for this CTA's columns (x_s [N, 64, C]; pre: N per-row vectors,
  rinv a per-row vector), stored to o_g's M rows at column d0 (the caller waits for the store). ``o16`` = (o16_s,
  o16_g): x_in in f16 too (saturated at ±65,504: linear._act's), from the stored bf16 each thread reads back."""
  C = o_s.shape[-1]
  u = _bcast(pre[0], C) * plgpu.load(x_s.at[0], layout=_L.WGMMA, optimized=False).astype(jnp.float32)
  for i in range(1, N):
    u = u + _bcast(pre[i], C) * plgpu.load(x_s.at[i], layout=_L.WGMMA, optimized=False).astype(jnp.float32)
  xn = (u.astype(jnp.bfloat16).astype(jnp.float32) * _bcast(rinv, C)).astype(jnp.bfloat16)
  wv = plgpu.load(w_s, layout=_L.WGMMA.reduce(0), optimized=False)
  o_s[...] = plgpu.layout_cast(lax.broadcast_in_dim(wv, (ROWS, C), (1,)) * xn, _L.WGMMA)
  if o16 is not None:  # (the same layout as the store: each thread reads back its own elements)
    xb = plgpu.load(o_s, layout=_L.WGMMA, optimized=False).astype(jnp.float32)
    o16[0][...] = plgpu.layout_cast(saturate_f16(xb), _L.WGMMA)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(o_s.at[pl.ds(0, M)], o_g.at[pl.ds(0, M), pl.ds(d0, C)])
  if o16 is not None:
    plgpu.copy_smem_to_gmem(o16[0].at[pl.ds(0, M)], o16[1].at[pl.ds(0, M), pl.ds(d0, C)])


def _sinkhorn_rows(mc, iters: int, eps: float):
  """The stock ``sinkhorn_comb`` on per-row vectors: mc = the 16 scaled comb logits (row-major c[i][j] at N·i + j),
  each a [64] vector -> the 16 comb entries. A row softmax + eps, a column normalisation, then iters - 1 rolled
  (row, column) normalisation pairs: unrolled, the 20 iterations were ~2,000 straight-line vector ops, and the
  kernel that ran them took 63 µs a call (session 19) — instruction fetch, not arithmetic. Each normalisation
  multiplies by 4 reciprocals instead of 16 divisions (IEEE division is a multi-instruction sequence; within
  1 ulp of the stock c / s per step): the Sinkhorn CTA made the finish kernel 3.6 -> 7.0 µs (session 23)."""
  c = [mc[N * i:N * i + N] for i in range(N)]

  def col_norm(c):
    r = [1.0 / (c[0][j] + c[1][j] + c[2][j] + c[3][j] + eps) for j in range(N)]
    return [[c[i][j] * r[j] for j in range(N)] for i in range(N)]

  def row_norm(c):
    r = [1.0 / (c[i][0] + c[i][1] + c[i][2] + c[i][3] + eps) for i in range(N)]
    return [[c[i][j] * r[i] for j in range(N)] for i in range(N)]

  sm = []
  for i in range(N):  # softmax over j, max-subtracted as jax.nn.softmax
    mx = jnp.maximum(jnp.maximum(c[i][0], c[i][1]), jnp.maximum(c[i][2], c[i][3]))
    ex = [jnp.exp(c[i][j] - mx) for j in range(N)]
    rt = 1.0 / (ex[0] + ex[1] + ex[2] + ex[3])
    sm.append([ex[j] * rt + eps for j in range(N)])
  c = col_norm(sm)

  def body(_, flat):
    c = col_norm(row_norm([list(flat[N * i:N * i + N]) for i in range(N)]))
    return tuple(v for row in c for v in row)

  return list(lax.fori_loop(0, iters - 1, body, tuple(v for row in c for v in row)))


def _each_row(M: int, loop: bool, f):
  """f(m) for the token rows m < M: as a rolled loop (``loop``: one copy of the code — unrolled, Mosaic's layout
  inference grew faster than M, 3.7 / 10.4 / 35 s to lower the row boundary at 1 / 2 / 4 rows), else unrolled."""
  if loop:
    lax.fori_loop(0, M, lambda m, c: (f(m), c)[1], None)
  else:
    for m in range(M):
      f(m)


def _sum_partials_t(rows_of, Gp: int, M: int, place, t_s, ts_s, explicit: bool = False, loop: bool = False):
  """The raw partials summed over the column chunks for M token rows — ``rows_of(m, c)``: the [64, C] ref of
  chunks 64c.. of token row m (SMEM or GMEM; Gp a multiple of 64, chunks past G zero; C = 40, or the 16 columns
  MIX.. where only the normalisation reads them), the tiles added, a sum over the tile's rows into ts_s [M, C] —
  and ``place``'s (quantity k, loaded column j) pairs put as t_s[k, m] = ts_s[m, j] in t_s's transposed [40, 64]
  layout, a scalar at a time (columns M.. zero): the form the finish / Sinkhorn arithmetic reads, one row per
  quantity. ``explicit`` (a kernel built without Mosaic's automatic barriers: lean_barriers): the two barriers
  those would have given here — the zero fill lands before any thread's scalar stores into t_s, and every row of
  ts_s before the scalar reads of entries other threads stored. (Every thread stores every t_s[k, m] itself, the
  same value, so its own later loads need no barrier.) ``loop``: the rows as a loop (the multi-row row form)."""
  t_s[...] = jnp.zeros((PART, ROWS), jnp.float32)  # the padding token columns
  if explicit:
    wg_barrier()
  def row_place(m):
    for k, j in place:
      t_s[k, m] = ts_s[m, j]

  _each_row(M, loop, lambda m: _partial_row_sums(rows_of, Gp, m, ts_s))
  if explicit:
    wg_barrier()
  _each_row(M, loop, row_place)


def _partial_row_sums(rows_of, Gp: int, m, ts_s):
  """Token row m's partials summed over the column chunks into ts_s[m]: ``rows_of(m, c)``'s [64, C] tiles (chunks
  64c..) added, then a sum over the tile's rows."""
  acc = None
  with jax.named_scope("loads"):
    for c in range(Gp // ROWS):
      x = plgpu.load(rows_of(m, c), layout=_L.WGMMA, optimized=False)
      acc = x if acc is None else acc + x
  with jax.named_scope("reduce"):
    ts_s[m] = acc.sum(axis=0)


# The normalisation's 14 sums from the 16 columns MIX.. of the partials (Gram entries, then the pre logits' copy at
# PRE_COPY) — 8 values per thread and tile instead of 20, the same tiles and reduction: the same sums.
_FIN_PLACE = [(MIX + k, k) for k in range(GRAM)] + [(i, PRE_COPY - MIX + i) for i in range(N)]


def _finish_kernel(M: int, D: int, iters: int, eps: float, hc_norm_eps: float, norm_eps: float, post_mult: float,
                   normalise: bool = True, sinkhorn: bool = True, DC_FIN: int = DC_FIN, parts: tuple | None = None):
  """CTAs 0..G-1 (G = D / DC_FIN; ``normalise``) each compute the site's pre and 1/RMS of u per row from the summed
  partials (a few dozen flops per row, on per-row vectors: as ``mhc_mix_reference``), then Σ pre_i X'_i + RMSNorm
  of their DC_FIN columns. The next CTA (``sinkhorn``) computes post and the Sinkhorn of comb for the next boundary
  and stores both: in parallel with the normalisation instead of an XLA fusion of its own after it (~3.4 µs per
  boundary at M = 1, and one Triton compilation per call site: the 45-layer step at q = 4 took over 8 minutes to
  compile, session 22). Either part alone is a kernel too (``mhc_finish(sinkhorn=False)`` + ``mhc_sinkhorn``:
  the Sinkhorn off the sublayer's critical path where the CUDA graph lets independent kernels overlap).
  The sums arrive transposed ([40, 64]: one SMEM row per quantity), so each per-row vector is one row load —
  extracting 18 columns of a [64, 40] tile by masked row sums cost ~2 µs per call on the H200 (session 21).
  ``parts`` = (Ms, Gp): the kernel takes mhc_post_pre's raw partials [G, 64, 40] instead and sums them itself —
  for each of the Ms token rows one TMA of its [Gp, 40] column chunks (Gp = G rounded up to 64; the rows past G
  zero-filled), chunk tiles added, a sum over the tile's rows, the [40] sums stored to SMEM and copied, a scalar at
  a time, into the transposed [40, 64] layout above: the XLA reduction between mhc_post_pre and this kernel (a
  launch on the sublayer's critical path per boundary) goes."""
  G = D // DC_FIN if normalise else 0

  def body(*refs):
    # inputs, outputs, scratch — each part's own (normalise: x, w, x_in; sinkhorn: post, comb)
    it = iter(refs)
    take = lambda n: [next(it) for _ in range(n)]  # noqa: E731
    x_g, t_g, c_g, w_g = take(4) if normalise else [None, *take(2), None]
    o_g = next(it) if normalise else None
    post_g, comb_g = take(2) if sinkhorn else (None, None)
    x_s, t_s, w_s, o_s = take(4) if normalise else [None, next(it), None, None]
    p_s, cb_s = take(2) if sinkhorn else (None, None)
    pt_s, ts_s = take(2) if parts else (None, None)
    bar_t = next(it)
    bar_x = next(it) if normalise else None
    g = lax.axis_index("g")
    d0 = g * DC_FIN
    if parts:  # each token row's column-chunk partials [Gp, 40] (rows past G: zeros)
      for m in range(parts[0]):
        plgpu.copy_gmem_to_smem(t_g.at[pl.ds(0, parts[1]), m], pt_s.at[m], bar_t)
    else:
      plgpu.copy_gmem_to_smem(t_g.at[:, pl.ds(0, ROWS)], t_s, bar_t)  # columns past t_g's: zeros (_check_sums)

    if normalise:
      @pl.when(g < G)
      def _():
        for i in range(N):
          plgpu.copy_gmem_to_smem(x_g.at[pl.ds(0, M), pl.ds(i * D + d0, DC_FIN)], x_s.at[i, pl.ds(0, M)], bar_x)
        plgpu.copy_gmem_to_smem(w_g.at[pl.ds(d0, DC_FIN)], w_s, bar_x)

    base = [c_g[k] for k in range(MIX)]  # scalars (GMEM loads while the copies fly)
    sc = [c_g[MIX + k] for k in range(3)]
    plgpu.barrier_wait(bar_t)
    if parts:
      # only the quantities this kernel reads (the normalisation: the pre logits and the Gram entries, 14; the
      # Sinkhorn: the post / comb logits and the Gram)
      need = sorted(({*range(N)} if normalise else set()) | ({*range(N, MIX)} if sinkhorn else set())
                    | {*range(MIX, MIX + GRAM)})
      Ms, Gp = parts
      _sum_partials_t(lambda m, c: pt_s.at[m, pl.ds(c * ROWS, ROWS)], Gp, Ms, [(k, k) for k in need], t_s, ts_s)

    def rows(ks):
      return [plgpu.load(t_s.at[k], layout=_L.WGMMA.reduce(1), optimized=False) for k in ks]

    gram, r = _gram_scale(rows(range(MIX, MIX + GRAM)), D, hc_norm_eps)

    if normalise:
      @pl.when(g < G)
      def _():
        pre, rinv = _pre_rinv(rows(range(N)), gram, r, base, sc[0], D, eps, norm_eps)
        plgpu.barrier_wait(bar_x)
        _normed_input(x_s, w_s, o_s, o_g, pre, rinv, M, d0)

    if sinkhorn:
      @pl.when(g == G)
      def _():
        S = [None] * N + rows(range(N, MIX))
        post = [post_mult * jax.nn.sigmoid(S[N + i] * r * sc[1] + base[N + i]) for i in range(N)]
        comb = _sinkhorn_rows([S[k] * r * sc[2] + base[k] for k in range(2 * N, MIX)], iters, eps)
        # transposed mix: each per-row vector is one SMEM row (a [64, 16] tile built by selects cost more); the
        # padding columns M.. hold whatever the padding sums give (a padding row never mixes into a real one)
        for k, v in enumerate(post):
          p_s[k] = v
        for k, v in enumerate(comb):
          cb_s[k] = v
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(p_s, post_g)
        plgpu.copy_smem_to_gmem(cb_s, comb_g)

    plgpu.wait_smem_to_gmem(0)

  return body


def _check_sums(tot_t, coef, iters, what):
  # tot_t [40, C]: C = ROWS, or the real token columns rounded up to 4 (16-byte rows, as the TMA needs): the
  # kernels' TMA reads ROWS columns and fills those past C with zeros (no XLA pad of the sums to ROWS)
  ok = tot_t.ndim == 2 and tot_t.shape[0] == PART and 0 < tot_t.shape[1] <= ROWS and tot_t.shape[1] % 4 == 0
  if not ok or coef.shape != (MIX + 3,):
    raise ValueError(f"{what}: tot_t {tot_t.shape}, coef {coef.shape}; expected [{PART}, C] (C <= {ROWS}, a "
                     f"multiple of 4), [{MIX + 3}] (base, scale)")
  if iters < 1:
    raise ValueError(f"{what}: iters = {iters}, expected >= 1 Sinkhorn iterations")


PARTS_MAX_ROWS = 4  # token rows up to which the finish / Sinkhorn kernels sum the raw partials themselves (SMEM)


def _check_parts(part, M, coef, iters, what):
  """The raw-partials form of tot_t: part [G, 64, 40] f32 (mhc_post_pre's) for M <= PARTS_MAX_ROWS token rows
  -> (M, Gp): the static shape of the kernel's partials buffer (G rounded up to 64)."""
  if part.ndim != 3 or part.shape[1:] != (ROWS, PART) or not 1 <= part.shape[0] <= 2 * ROWS:
    # (G <= 128, two 64-row tiles: the real width's narrow post_pre; more would not fit SMEM beside the streams)
    raise ValueError(f"{what}: partials {part.shape}; expected mhc_post_pre's [G, {ROWS}, {PART}] (G <= {2 * ROWS})")
  if not 1 <= M <= PARTS_MAX_ROWS:
    raise ValueError(f"{what}: {M} token rows with raw partials; the kernel sums them for 1..{PARTS_MAX_ROWS} rows "
                     "(more: sum them first, [40, C])")
  if coef.shape != (MIX + 3,) or iters < 1:
    raise ValueError(f"{what}: coef {coef.shape}, iters {iters}; expected [{MIX + 3}] (base, scale), >= 1")
  return M, -(-part.shape[0] // ROWS) * ROWS


def _parts_scratch(parts):
  return [plgpu.SMEM((parts[0], parts[1], PART), jnp.float32),  # pt_s: each token row's column-chunk partials
          plgpu.SMEM((parts[0], PART), jnp.float32)] if parts else []  # ts_s: their sums


def partial_sums_t(part, M: int):
  """mhc_post_pre's partials [G, 64, 40] -> their sum over the column chunks for the M real rows, transposed
  [40, M] (the references' view of the raw-partials form; the model's XLA form is layers._chunk_sums)."""
  return jnp.sum(part[:, :M].astype(jnp.float32), axis=0).T


_MIX_OUT = (jax.ShapeDtypeStruct((N, ROWS), jnp.float32), jax.ShapeDtypeStruct((N * N, ROWS), jnp.float32))
_MIX_SCRATCH = [plgpu.SMEM((N, ROWS), jnp.float32),  # p_s (transposed: a row per quantity)
                plgpu.SMEM((N * N, ROWS), jnp.float32)]  # cb_s


@kernel_entry("iters", "eps", "hc_norm_eps", "norm_eps", "post_mult", "approx_math", "sinkhorn", "cols")
def mhc_finish(Xn, tot_t, coef, w, *, iters: int, eps: float, hc_norm_eps: float, norm_eps: float,
               post_mult: float, approx_math: bool = False, sinkhorn: bool = True, cols: int = DC_FIN):
  """Mosaic GPU version of ``mhc_finish_reference`` (same signature and outputs). ``approx_math``: the GPU's
  approximate exp / reciprocal / rsqrt (ulp-level differences; bench_mhc measures what it saves). ``sinkhorn``
  False: x_in alone (one CTA fewer; ``mhc_sinkhorn`` computes the mix as a kernel of its own). ``cols``: columns
  normalised per CTA (64 or 128). ``tot_t`` may be mhc_post_pre's raw partials [G, 64, 40] instead of their
  sums (M <= PARTS_MAX_ROWS token rows): the kernel sums them."""
  M, K = Xn.shape
  D = K // N
  _check(Xn, D, "mhc_finish")
  if cols not in (64, 128):
    raise ValueError(f"mhc_finish: cols = {cols}, expected 64 or 128 columns per CTA")
  DC_FIN = cols
  parts = _check_parts(tot_t, M, coef, iters, "mhc_finish") if tot_t.ndim == 3 else None
  if not parts:
    _check_sums(tot_t, coef, iters, "mhc_finish")
  bf16, f32 = jnp.bfloat16, jnp.float32
  x_in = jax.ShapeDtypeStruct((M, D), bf16)
  kern = mgpu_kernel(
      _finish_kernel(M, D, int(iters), float(eps), float(hc_norm_eps), float(norm_eps), float(post_mult),
                     sinkhorn=bool(sinkhorn), DC_FIN=DC_FIN, parts=parts),
      out_type=(x_in, *_MIX_OUT) if sinkhorn else x_in,
      scratch_types=[
          plgpu.SMEM((N, ROWS, DC_FIN), bf16),  # x_s
          plgpu.SMEM((PART, ROWS), f32),  # t_s
          plgpu.SMEM((DC_FIN,), bf16),  # w_s
          plgpu.SMEM((ROWS, DC_FIN), bf16),  # o_s
          *(_MIX_SCRATCH if sinkhorn else []),
          *_parts_scratch(parts),
          plgpu.Barrier(num_arrivals=parts[0] if parts else 1),  # bar_t: the sums (every CTA; a TMA per row)
          plgpu.Barrier(num_arrivals=N + 1),  # bar_x: the streams and w (the normalising CTAs)
      ],
      grid=(D // DC_FIN + int(bool(sinkhorn)),),
      grid_names=("g",),
      kernel_name="glm5_mhc_finish",
      compiler_params=plgpu.CompilerParams(approx_math=bool(approx_math)),
  )
  return kern(Xn, tot_t.astype(f32), coef.astype(f32), w.astype(bf16))


@kernel_entry("D", "iters", "eps", "hc_norm_eps", "post_mult", "approx_math", "rows")
def mhc_sinkhorn(tot_t, coef, *, D: int, iters: int, eps: float, hc_norm_eps: float, post_mult: float,
                 approx_math: bool = False, rows: int | None = None):
  """The mix half of ``mhc_finish`` as a one-CTA kernel: tot_t [40, C] (summed partials, transposed), coef [27]
  -> mix = (post_t [N, 64], comb_t [N·N, 64]) f32, as ``mhc_finish_reference`` returns them. With
  ``mhc_finish(sinkhorn=False)`` the boundary's sublayer no longer waits for the Sinkhorn's 20 serial iterations
  — only the next boundary reads the mix — wherever the CUDA graph runs independent kernels concurrently (XLA's
  CONCURRENT command-buffer schedule); in a serial schedule it is one more launch. ``tot_t`` may be
  mhc_post_pre's raw partials [G, 64, 40] for ``rows`` <= PARTS_MAX_ROWS token rows (then required): the kernel
  sums them."""
  if tot_t.ndim == 3:
    if rows is None:
      raise ValueError("mhc_sinkhorn: raw partials need rows= (the token rows to sum)")
    parts = _check_parts(tot_t, int(rows), coef, iters, "mhc_sinkhorn")
  else:
    parts = None
    _check_sums(tot_t, coef, iters, "mhc_sinkhorn")
  if D % DC_FIN:
    raise ValueError(f"mhc_sinkhorn: hidden size {D} must be a multiple of {DC_FIN}")
  f32 = jnp.float32
  kern = mgpu_kernel(
      _finish_kernel(ROWS, int(D), int(iters), float(eps), float(hc_norm_eps), 0.0, float(post_mult),
                     normalise=False, parts=parts),
      out_type=_MIX_OUT,
      scratch_types=[plgpu.SMEM((PART, ROWS), f32), *_MIX_SCRATCH, *_parts_scratch(parts),
                     plgpu.Barrier(num_arrivals=parts[0] if parts else 1)],
      grid=(1,),
      grid_names=("g",),
      kernel_name="glm5_mhc_sinkhorn",
      compiler_params=plgpu.CompilerParams(approx_math=bool(approx_math)),
  )
  return kern(tot_t.astype(f32), coef.astype(f32))


# ---------------------------------------------------------------------------------- one launch, grid barrier
# The boundary as ONE launch over mhc_post_pre's narrow grid (issue #14): each of G = D / 32 CTAs runs
# mhc_post_pre's body over its 32 columns of every stream (X' stays in its SMEM), stores its partials, and meets
# the others at a grid-wide barrier (a GMEM semaphore: every CTA adds 1 with release semantics, then polls until
# it reads G, with acquire); then it sums the G partials of its token rows (plain loads from GMEM/L2: 20 KB per
# row at the real width) and writes the RMSNorm'd sublayer input for its 32 columns from the X' in its own SMEM —
# mhc_finish's arithmetic. One launch on the sublayer's critical path per boundary instead of mhc_post_pre ->
# (reduction) -> mhc_finish; the mix for the next boundary (mhc_sinkhorn on the raw partials) stays off it.
# No CTA runs more chunks than mhc_post_pre's (the removed cluster form's did). The barrier needs every CTA
# resident at once: G <= GRID_MAX_CTAS (the H200 has 132 SMs; ~80 KB of SMEM per CTA leaves 2 per SM), and no
# other kernel in the step spins, so a CTA that waits for an SM gets one. GPU interpret mode (jax 0.11.2) runs
# neither GMEM semaphores nor concurrently resident CTAs, so there the two halves run as two launches of the
# same code (``launches=2``); the GPU tests hold the one-launch form to the two-launch one, bit for bit.
GRID_COLS = 32  # columns of each stream per CTA (mhc_narrow's mhc_post_pre)
GRID_MAX_CTAS = 128  # CTAs the grid barrier may wait for (every one resident at once)


def _grid_rows(D: int, cols: int = GRID_COLS) -> tuple[int, int]:
  """(G CTAs of ``cols`` columns, Gp rows of the partials: G rounded up to 64 — the second half sums 64-row tiles,
  zero rows past G)."""
  G = D // cols
  return G, -(-G // ROWS) * ROWS


def mhc_post_finish_reference(X, y, mix, fn, coef, w, *, first: bool = False, eps: float, hc_norm_eps: float,
                              norm_eps: float, approx_math: bool = False, launches: int | None = None,
                              cols: int = GRID_COLS, x16: bool = False):
  """X [M, N·D] bf16, y [M, D] bf16, mix = (post_t [N, 64], comb_t [N·N, 64]) of the previous site, fn [24, N·D]
  bf16, coef [27] f32 (base, scale), w [D] -> (X' [M, N·D] bf16 (X itself when ``first``), x_in [M, D] bf16 =
  w · bf16(bf16(u) · rinv), part [Gp, 64, 40] f32: ``mhc_post_pre_reference``'s partials over 32 columns per CTA
  (G = D / 32 chunks) then Gp - G zero rows, Gp = G rounded up to 64). x_in is ``mhc_finish_reference``'s on
  those partials. ``approx_math`` / ``launches`` are the kernel's options (exact math here); ``cols``: columns per
  chunk (ROW_COLS: ``mhc_row_boundary``'s). ``x16``: x_in as (bf16, its f16 copy saturated at ±65,504)."""
  del approx_math, launches
  M = X.shape[0]
  G, Gp = _grid_rows(X.shape[1] // N, cols)
  Xn, part = mhc_post_pre_reference(X, y, mix, fn, first=first, cols=cols)
  part = jnp.pad(part, ((0, Gp - G), (0, 0), (0, 0)))
  x_in = mhc_finish_reference(Xn, partial_sums_t(part, M), coef, w, iters=1, eps=eps, hc_norm_eps=hc_norm_eps,
                              norm_eps=norm_eps, post_mult=1.0)[0]
  if x16:
    x_in = (x_in, saturate_f16(x_in))
  return Xn, x_in, part


def _normalise_from_partials(part_g, coef, x_s, w_s, o_s, t_s, ts_s, xin_g, bar_w, M, D, d0, eps, hc_norm_eps,
                             norm_eps, explicit: bool = False, o16=None):
  """The second half: the M token rows' partials part_g [Gp, 64, 40] (GMEM) summed over the column chunks — two
  64-row tiles per row at the real width, a sum over the tile's rows, the 14 sums the normalisation reads placed
  in t_s's transposed [40, 64] layout a scalar at a time (as mhc_finish's raw-partials form) — then pre and 1/RMS
  per row and x_in = w · bf16(bf16(Σ_i pre_i X'_i) · rinv) for this CTA's columns from X' in x_s [N, 64, 32].
  ``coef``: ``_coef_scalars``' values, loaded at the kernel's start."""
  base, sc0 = coef
  with jax.named_scope("sum"):
    _sum_partials_t(lambda m, c: part_g.at[pl.ds(c * ROWS, ROWS), m, pl.ds(MIX, PART - MIX)], part_g.shape[0], M,
                    _FIN_PLACE, t_s, ts_s, explicit)
  with jax.named_scope("pre"):
    gram, r = _gram_scale([_row_vector(t_s, k) for k in range(MIX, MIX + GRAM)], D, hc_norm_eps)
    pre, rinv = _pre_rinv([_row_vector(t_s, k) for k in range(N)], gram, r, base, sc0, D, eps, norm_eps)
  plgpu.barrier_wait(bar_w)
  with jax.named_scope("normed"):
    _normed_input(x_s, w_s, o_s, xin_g, pre, rinv, M, d0, o16)
  with jax.named_scope("store_wait"):
    plgpu.wait_smem_to_gmem(0)


# The one-row boundary's partial sums by the low-latency exchange (policy knob mhc_ll_exchange): each CTA's 16
# normalisation partials (columns MIX..) as (value, flag) words after the two counters of barrier_counters(ll=True).
LL_WIDTH = PART - MIX  # 16 values a CTA
LL_WORDS = LL_HEAD + 2 * LL_WIDTH * GRID_MAX_CTAS  # (mhc_row_boundary refuses a grid of more CTAs)


def barrier_counters(ll: bool = False):
  """The two int32 counters the grid-barrier boundaries of one traced program share (a jax Ref, zeroed once:
  one 8-byte fill per step instead of pl.get_global's per call — 91 `copy s32[1]` graph nodes per step at q = 1,
  session 35's kernel listing). Boundary i (parity p = i % 2) meets on counter p, which boundary i - 1 zeroed, and
  its CTA 0 zeroes counter 1 - p for boundary i + 1: boundary i - 1 finished before boundary i started (boundary i
  reads its output), and boundary i + 1 starts after boundary i finishes. The Ref's buffer is each launch's
  aliased operand, so XLA keeps the boundaries in this order. ``ll``: LL_WORDS more words after the two, the
  one-row boundaries' low-latency exchange (``mhc_row_boundary(ll=True)``: its epoch and (value, flag) pairs)."""
  return jax.new_ref(jnp.zeros((2 + (LL_WORDS if ll else 0),), jnp.int32))


def _coef_scalars(c_g):
  """The normalisation's coefficients from coef (GMEM): (the N pre biases, the pre logits' scale) — loaded at a
  kernel's start, where their L2 round trip overlaps the first half, instead of after the partials' sum (session
  67's PTX: the loads sat between the sum and the pre / 1/RMS arithmetic, on the boundary's critical path)."""
  return [c_g[k] for k in range(N)], c_g[MIX]


def _grid_barrier(ctr_g, par_g, g, G: int, lean: bool = False, parity=None):
  """The one-launch boundaries' grid barrier over G CTAs: on counter par_g[0] of barrier_counters' Ref (CTA 0
  zeroing the other counter for the next boundary), or — ctr_g None — on a pl.get_global semaphore (zeroed for
  each launch: an XLA fill per call). ``lean`` (no automatic barriers): the warpgroup barrier before the
  semaphore's signal that Mosaic would have put there (counter_signal has its own). ``parity``: par_g[0] loaded
  at the kernel's start (its L2 round trip then overlaps the first half instead of preceding the signal)."""
  with jax.named_scope("barrier"):
    if ctr_g is None:
      if lean:
        wg_barrier()
      sem = pl.get_global(plgpu.SemaphoreType.REGULAR)
      plgpu.semaphore_signal(sem, 1, memory_scope="gpu")
      plgpu.semaphore_wait(sem, G, decrement=False, memory_scope="gpu")
      return
    p = par_g[0] if parity is None else parity

    @pl.when(g == 0)
    def _():  # the previous boundary's counter, for the next one (barrier_counters)
      ctr_g[1 - p] = jnp.int32(0)

    counter_signal(ctr_g.at[pl.ds(p, 1)])  # (_common: semaphore ops on a plain int32 ref)
    counter_wait(ctr_g.at[pl.ds(p, 1)], G)


def _check_grid_args(what: str, X, fn, coef, w, mix, first: bool, parity: int, launches: int | None) -> int:
  """The one-launch boundaries' shared argument checks (the shapes and dtypes, the previous mix, the barrier
  counter's parity) -> the number of launches: ``launches``, or 2 in GPU interpret mode (no grid barrier there)
  and 1 on a GPU."""
  K = X.shape[1]
  D = K // N
  if fn.shape != (MIX, K) or X.dtype != jnp.bfloat16 or coef.shape != (MIX + 3,) or w.shape != (D,):
    raise ValueError(f"{what}: fn {fn.shape}, X {X.dtype}, coef {coef.shape}, w {w.shape}; expected fn "
                     f"[{MIX}, {K}], a bf16 residual, coef [{MIX + 3}] and w [{D}]")
  if not first and (mix[0].shape != (N, ROWS) or mix[1].shape != (N * N, ROWS)):
    raise ValueError(f"{what}: mix = (post {mix[0].shape}, comb {mix[1].shape}), expected the transposed "
                     f"({(N, ROWS)}, {(N * N, ROWS)}) of mhc_finish (mix_from_rows)")
  if parity not in (0, 1):
    raise ValueError(f"{what}: parity = {parity!r}, expected 0 or 1 (the boundary's index % 2)")
  launches = launches or (2 if interpreting() else 1)
  if launches not in (1, 2):
    raise ValueError(f"{what}: launches = {launches}, expected 1 (grid barrier) or 2")
  return launches


def _post_finish_kernel(M: int, D: int, first: bool, eps: float, hc_norm_eps: float, norm_eps: float,
                        counters: bool = False, lean: bool = False, x16: bool = False):
  """The one-launch body: mhc_post_pre's (``_post_pre_kernel``, 32 columns) with its refs, zero rows G.. of the
  partials, the grid barrier, then ``_normalise_from_partials`` on the X' this CTA staged (untiled: xu_s, or x_s
  — X itself — at the first site). ``counters``: the barrier on counter p of the counters' Ref (inputs after w:
  the Ref, then p as int32 [1]; ``barrier_counters``) instead of a pl.get_global semaphore — p an operand, not
  a constant of the kernel, so both parities run one compiled kernel. ``x16``: x_in in f16 too (an output after
  x_in; its SMEM tile after o_s)."""
  G, Gp = _grid_rows(D)
  pp = _post_pre_kernel(M, D, first, GRID_COLS)
  n_in = 2 if first else 5

  def body(*refs):
    pp_in, (c_g, w_g) = refs[:n_in], refs[n_in:n_in + 2]
    ctr_g, par_g = refs[n_in + 2:n_in + 4] if counters else (None, None)
    it = iter(refs[n_in + 2 + 2 * counters:])
    take = lambda n: [next(it) for _ in range(n)]  # noqa: E731
    pp_out = take(1 if first else 2)  # ([xo_g,] part_g)
    xin_g = next(it)
    xin16_g = next(it) if x16 else None
    pp_scratch = take(4 if first else 8)
    w_s, o_s = take(2)
    o16 = (next(it), xin16_g) if x16 else None
    t_s, ts_s, bar_w = take(3)
    part_g = pp_out[-1]
    g = lax.axis_index("g")
    d0 = g * GRID_COLS
    plgpu.copy_gmem_to_smem(w_g.at[pl.ds(d0, GRID_COLS)], w_s, bar_w)  # in flight through the first half
    coef, parity = _coef_scalars(c_g), (par_g[0] if counters else None)  # (in flight too: used after the barrier)
    with jax.named_scope("post_pre"):
      pp(*pp_in, *pp_out, *pp_scratch)
    for k in range(-(-(Gp - G) // G)):  # the zero rows, spread over the CTAs
      row = G + g + k * G

      @pl.when(row < Gp)
      def _():
        part_g[row] = plgpu.layout_cast(jnp.zeros((ROWS, PART), jnp.float32), _L.WGMMA)

    _grid_barrier(ctr_g, par_g, g, G, lean, parity)
    x_s = pp_scratch[0] if first else pp_scratch[6]  # X' (untiled [N, 64, 32]): X itself at the first site
    with jax.named_scope("normalise"):
      _normalise_from_partials(part_g, coef, x_s, w_s, o_s, t_s, ts_s, xin_g, bar_w, M, D, d0, eps, hc_norm_eps,
                               norm_eps, lean, o16)

  return body


def _finish_half_kernel(M: int, D: int, eps: float, hc_norm_eps: float, norm_eps: float, x16: bool = False):
  """The second half as a launch of its own (``launches=2``): X' and the partials from GMEM. ``x16`` as
  ``_post_finish_kernel``'s."""

  def body(xn_g, part_g, c_g, w_g, *refs):
    rest = list(refs)
    xin_g, xin16_g = rest.pop(0), (rest.pop(0) if x16 else None)
    x_s, w_s, o_s = rest[:3]
    o16 = (rest.pop(3), xin16_g) if x16 else None
    t_s, ts_s, bar_w = rest[3:]
    d0 = lax.axis_index("g") * GRID_COLS
    for i in range(N):
      plgpu.copy_gmem_to_smem(xn_g.at[pl.ds(0, M), pl.ds(i * D + d0, GRID_COLS)], x_s.at[i, pl.ds(0, M)], bar_w)
    plgpu.copy_gmem_to_smem(w_g.at[pl.ds(d0, GRID_COLS)], w_s, bar_w)
    _normalise_from_partials(part_g, _coef_scalars(c_g), x_s, w_s, o_s, t_s, ts_s, xin_g, bar_w, M, D, d0, eps,
                             hc_norm_eps, norm_eps, o16=o16)

  return body


def _finish_half_scratch(M: int, arrivals: int, x16: bool = False):
  return [plgpu.SMEM((GRID_COLS,), jnp.bfloat16),  # w_s
          plgpu.SMEM((ROWS, GRID_COLS), jnp.bfloat16),  # o_s
          *([plgpu.SMEM((ROWS, GRID_COLS), jnp.float16)] if x16 else []),  # o16_s: x_in in f16 (x16)
          plgpu.SMEM((PART, ROWS), jnp.float32),  # t_s: the sums, transposed
          plgpu.SMEM((M, PART - MIX), jnp.float32),  # ts_s: each row's sums of the 16 columns MIX..
          plgpu.Barrier(num_arrivals=arrivals)]  # bar_w: w (and, launched alone, X')


@kernel_entry("first", "eps", "hc_norm_eps", "norm_eps", "approx_math", "launches", "parity", "lean", "x16")
def mhc_post_finish(X, y, mix, fn, coef, w, *, first: bool = False, eps: float, hc_norm_eps: float,
                    norm_eps: float, approx_math: bool = False, launches: int | None = None, counters=None,
                    parity: int = 0, lean: bool = False, x16: bool = False):
  """Mosaic GPU version of ``mhc_post_finish_reference`` (same signature and outputs): the boundary's post, pre
  logits and Gram, and the sublayer input's RMSNorm in ONE launch of D / 32 CTAs with a grid barrier between the
  halves, for up to PARTS_MAX_ROWS token rows (decode's few; more: mhc_post_pre + mhc_finish). ``launches``: 1
  (the default on a GPU) or 2 — mhc_post_pre(cols=32) then the second half as a kernel of its own, the same
  arithmetic with no barrier: the default in GPU interpret mode, which cannot run the barrier, and the GPU
  tests' reference for the one-launch form. ``counters``: the Ref of ``barrier_counters`` — the barrier on its
  counter ``parity`` (0 / 1: this boundary's index % 2) instead of a semaphore XLA zero-fills before each call
  (one launch only; the two-launch form has no barrier). ``lean`` (policy knob lean_barriers): the one-launch
  kernel built without Mosaic GPU's automatic warpgroup barriers (``CompilerParams(unsafe_no_auto_barriers)``: two
  around every vector store to a ref, one before every TMA load — 46 bar.sync in this kernel at the real width,
  10 left: commit_smem's, wait_smem_to_gmem's, the reductions' and the grid barrier's), with the few it needs
  besides placed explicitly (``_sum_partials_t``, ``_grid_barrier``); no effect on the two-launch form.
  ``x16``: x_in as (bf16, f16) — the f16 copy saturated at ±65,504, what the dq kernels' ``linear._act`` would make
  of it (policy knob dq_f16: no conversion kernel between the boundary and the sublayer's FP8 kernels)."""
  M, K = X.shape
  D = K // N
  _check(X, D, "mhc_post_finish")
  G, Gp = _grid_rows(D)
  if M > PARTS_MAX_ROWS or G > GRID_MAX_CTAS:
    raise ValueError(f"mhc_post_finish: {M} token rows, hidden size {D}; expected up to {PARTS_MAX_ROWS} rows and "
                     f"up to {GRID_MAX_CTAS * GRID_COLS} columns (one CTA per {GRID_COLS}, all resident at once)")
  launches = _check_grid_args("mhc_post_finish", X, fn, coef, w, mix, first, parity, launches)
  bf16, f32 = jnp.bfloat16, jnp.float32
  consts = (float(eps), float(hc_norm_eps), float(norm_eps))
  params = dict(grid=(G,), grid_names=("g",), compiler_params=plgpu.CompilerParams(approx_math=bool(approx_math)))
  x_in = jax.ShapeDtypeStruct((M, D), bf16)
  x_ins = (x_in, jax.ShapeDtypeStruct((M, D), jnp.float16)) if x16 else (x_in,)
  pp_in = (X, fn.astype(bf16)) if first else (X, y.astype(bf16), *(a.astype(f32) for a in mix), fn.astype(bf16))
  if launches == 2:
    Xn, part = mhc_post_pre(X, y, mix, fn, first=first, cols=GRID_COLS)
    part = jnp.pad(part, ((0, Gp - G), (0, 0), (0, 0)))
    fin = mgpu_kernel(_finish_half_kernel(M, D, *consts, x16), out_type=x_ins if x16 else x_in,
                      kernel_name="glm5_mhc_finish_half",
                      scratch_types=[plgpu.SMEM((N, ROWS, GRID_COLS), bf16),  # x_s: X' (its M rows)
                                     *_finish_half_scratch(M, N + 1, x16)], **params)
    got = fin(Xn, part, coef.astype(f32), w.astype(bf16))
    return Xn, (tuple(got) if x16 else got), part
  x_s = plgpu.SMEM((N, ROWS, GRID_COLS), bf16)
  fn_s = plgpu.SMEM((N, MIX, GRID_COLS), bf16, transforms=_bf16_swizzled(GRID_COLS))
  xw_s = plgpu.SMEM((N, ROWS, GRID_COLS), bf16, transforms=_bf16_swizzled(GRID_COLS))
  if first:  # mhc_post_pre's scratch, in its order
    pp_scratch = [x_s, fn_s, xw_s, plgpu.Barrier(num_arrivals=2 * N)]
  else:
    pp_scratch = [x_s, plgpu.SMEM((ROWS, GRID_COLS), bf16), plgpu.SMEM((N, ROWS), f32), plgpu.SMEM((N * N, ROWS), f32),
                  fn_s, xw_s, plgpu.SMEM((N, ROWS, GRID_COLS), bf16), plgpu.Barrier(num_arrivals=2 * N + 3)]
  part = jax.ShapeDtypeStruct((Gp, ROWS, PART), f32)
  outs = (part, *x_ins) if first else (jax.ShapeDtypeStruct((M, K), bf16), part, *x_ins)
  params["compiler_params"] = plgpu.CompilerParams(approx_math=bool(approx_math), unsafe_no_auto_barriers=bool(lean))
  kern = mgpu_kernel(_post_finish_kernel(M, D, bool(first), *consts, counters=counters is not None, lean=bool(lean),
                                         x16=x16),
                     out_type=outs, scratch_types=[*pp_scratch, *_finish_half_scratch(M, 1, x16)],
                     kernel_name="glm5_mhc_post_finish", **params)
  ctr = () if counters is None else (counters, jnp.full((1,), parity, jnp.int32))
  got = tuple(kern(*pp_in, coef.astype(f32), w.astype(bf16), *ctr))
  Xn, got = (X, got) if first else (got[0], got[1:])
  part, x_in = got[0], (tuple(got[1:]) if x16 else got[1])
  return Xn, x_in, part


# ------------------------------------------------------------------------------------ one token row, one launch
# The grid-barrier boundary at M = 1 (decode at q = 1, issue #14's remainder): mhc_post_finish runs 64-row tiles
# for one real row — s48d's in-kernel profile had the post mix (2.1 µs), the partial stores (1.2) and the partial
# sums over 128 CTAs (2.5) as most of its 6.3 µs. Here each thread owns one column of every stream (ROW_COLS = 128
# per CTA, G = D / 128 CTAs: 32 at the real width) and keeps it in registers: the mix is 20 multiply-adds per thread
# (WG_STRIDED [128] vectors), the 24 logits and 10 Gram entries are per-thread products stored as the rows of a
# [64, 128] f32 SMEM tile and summed along its rows (one tile load and row reduction instead of a wgmma over
# 64-row tiles), the CTA's 40 partials one 160-byte TMA store into token row 0 of mhc_post_pre's partials format
# (so mhc_sinkhorn reads them unchanged). After the grid barrier each CTA sums the 16 columns the normalisation
# reads over G = 32 chunks (one 64-row tile: half the loads of the 128-CTA form), and writes its 128 columns of
# x_in from the X' still in its registers. GPU interpret mode runs the two halves as two launches (``launches=2``),
# the second reading X' back from GMEM; the GPU tests hold the one-launch form to it bit for bit.
ROW_COLS = 128  # columns of each stream per CTA: one per thread of the warpgroup
_ROW_RED = MIX + GRAM + N  # rows of the per-thread quantities: 24 logits, 10 Gram entries, the pre logits' copy


def _red_layout():
  """The register layout of the partials' transposing sum, red_s [64, 128] f32: warp w holds rows 16w .. 16w + 15,
  lane l row l // 8 of each 4-row group and columns 4 (l % 8) .. + 3 of each 32-column group (4-vectors). A warp's
  load then reads four whole 128-byte row segments (no bank conflicts; in the WGMMA layout a half-warp's 8-byte
  loads put 4 rows on the same 8 banks: session 67's profile, the sum 1.2 µs of the partials' 1.9), and a row's sum
  is in-thread adds and 3 shuffle rounds (no cross-warp step)."""
  from jax.experimental.mosaic.gpu import fragmented_array as fa  # noqa: PLC0415
  return tiled(fa.TiledLayout(fa.Tiling(((ROWS, ROW_COLS), (16, ROW_COLS), (4, 32), (1, 4))), warp_dims=(-8,),
                              lane_dims=(-4, -3), vector_dim=-1, _check_canonical=False))


def _row_layout():
  return plgpu.Layout.WG_STRIDED((ROW_COLS,), vec_size=1)


def _row_load(ref):
  """A [ROW_COLS] SMEM row as one value per thread (f32)."""
  return plgpu.load(ref, layout=_row_layout(), optimized=False).astype(jnp.float32)


def _row_mixed(x_s, y_s, post_s, comb_s, first: bool, m: int = 0):
  """X'_j = post_j · y + Σ_i comb[i, j] · X_i for this thread's column of token row m (``_post_mix``'s order; token
  row m of the transposed mix is its column m), rounded to bf16 and kept as f32; X itself when ``first``."""
  xs = [_row_load(x_s.at[i, m]) for i in range(N)]
  if first:
    return xs
  yv = _row_load(y_s.at[m])
  post = [post_s[j, m] for j in range(N)]
  comb = [comb_s[k, m] for k in range(N * N)]
  xn = []
  for j in range(N):
    s = comb[j] * xs[0]
    for i in range(1, N):
      s = s + comb[N * i + j] * xs[i]
    xn.append((post[j] * yv + s).astype(jnp.bfloat16).astype(jnp.float32))
  return xn


def _row_partials(xn, fn_s, red_s, v_s):
  """This CTA's 40 partials (mhc_post_pre's columns: logits, Gram entries, the pre logits' copy, 2 zeros) into
  v_s[:40]: each thread's products stored as the rows of red_s [64, 128] f32, the tile summed along its rows (rows
  40.. are never read back as partials)."""
  # every fn value loaded before the first product is stored: ptxas keeps an SMEM load behind the SMEM stores
  # before it (it cannot tell fn_s from red_s), so interleaved, each logit's four loads waited for the previous
  # logit's stores — 24 serial load round trips (session 67's profile: the partials 2.56 µs on an H100)
  fv = [[_row_load(fn_s.at[j, m]) for j in range(N)] for m in range(MIX)]
  for m in range(MIX):
    acc = xn[0] * fv[m][0]
    for j in range(1, N):
      acc = acc + xn[j] * fv[m][j]
    red_s[m] = acc
    if m < N:
      red_s[PRE_COPY + m] = acc
  for k, (i, j) in enumerate(_PAIRS):
    red_s[MIX + k] = xn[i] * xn[j]
  zero = jnp.zeros((ROW_COLS,), jnp.float32)
  for k in range(_ROW_RED, PART):
    red_s[k] = zero
  plgpu.commit_smem()  # (every thread's column before the tile load)
  with jax.named_scope("tile"):  # (bench_kernel_profile: the transposing sum's share of the partials)
    tile = plgpu.load(red_s, layout=_red_layout(), optimized=False)
    v_s[...] = tile.sum(axis=1)
    plgpu.commit_smem()


def _norm_columns(part_g):
  """The normalisation's 16 partial columns MIX.. of the chunks 64c.. of token row m in part_g [Gp, 64, 40]: the
  ``rows_of(m, c)`` of ``_sum_partials_t``."""
  return lambda m, c: part_g.at[pl.ds(c * ROWS, ROWS), m, pl.ds(MIX, PART - MIX)]


def _row_scalar_sums(part_g, ts_s, explicit: bool, rows_of=None):
  """One token row's normalisation sums as scalars: the partials' 16 columns MIX.. summed over the chunks (as
  ``_sum_partials_t`` sums token row 0: the same values) into ts_s[0], read back by every thread -> {quantity k:
  its sum} (the Gram entries MIX.., the pre logits 0..N-1). ``rows_of``: as ``_row_normalised``'s."""
  _partial_row_sums(rows_of or _norm_columns(part_g), part_g.shape[0], 0, ts_s)
  if explicit:
    wg_barrier()  # (every thread reads entries other threads stored)
  return {k: ts_s[0, j] for k, j in _FIN_PLACE}


def _row_normalised(part_g, coef, xns, w_s, o_s, t_s, ts_s, sc_s, D, eps, hc_norm_eps, norm_eps,
                    explicit: bool = False, o16_s=None, scalars: bool = False, rows_of=None):
  """The second half for the M = len(xns) token rows: the normalisation's 16 partial columns summed over the chunks
  (one 64-row tile per row, ``_sum_partials_t``), pre and 1/RMS as per-row vectors (``_gram_scale`` / ``_pre_rinv``,
  as every form), read back as scalars (column m), then x_in = w · bf16(bf16(Σ_i pre_i X'_i) · rinv) for this
  thread's column of each row into o_s [M, 128] (the caller stores it) — and with ``o16_s`` x_in in f16 as well
  (saturated at ±65,504: what the dq kernels' ``linear._act`` makes of it).

  ``scalars`` (one token row; ``mhc_row_boundary(scalars=True)``): the 14 sums read back as scalars and pre /
  1/RMS computed on them in every thread's registers — the same operations in the same order as on the per-row
  vectors — instead of placing the sums transposed (14 dependent SMEM load / store pairs), [64]-vector arithmetic
  for one real row and a round trip of pre / 1/RMS through sc_s (session 67's profile: the sum and the scales
  0.82 + 0.52 µs of the boundary's ~6.5).

  ``rows_of`` (``mhc_row_boundary(ll=True)``): the 16 columns' [64, 16] tiles from elsewhere — the same values as
  part_g's (the low-latency exchange's SMEM copy), summed by the same loads and reduction: the same sums."""
  M = xns.rows if callable(xns) else len(xns)
  rows_of = rows_of or _norm_columns(part_g)
  if scalars:  # (one row: mhc_row_boundary checks)
    tot = _row_scalar_sums(part_g, ts_s, explicit, rows_of)
    with jax.named_scope("scales"):
      gram, r = _gram_scale([tot[k] for k in range(MIX, MIX + GRAM)], D, hc_norm_eps)
      pre, rinv = _pre_rinv([tot[k] for k in range(N)], gram, r, *coef, D, eps, norm_eps)
    scale = lambda i, m: pre[i] if i < N else rinv  # noqa: E731
  else:
    _sum_partials_t(rows_of, part_g.shape[0], M, _FIN_PLACE, t_s, ts_s, explicit, loop=callable(xns))
    plgpu.commit_smem()
    with jax.named_scope("scales"):
      gram, r = _gram_scale([_row_vector(t_s, k) for k in range(MIX, MIX + GRAM)], D, hc_norm_eps)
      pre, rinv = _pre_rinv([_row_vector(t_s, k) for k in range(N)], gram, r, *coef, D, eps, norm_eps)
      for i in range(N):
        sc_s[i] = pre[i]
      sc_s[N] = rinv
      plgpu.commit_smem()
    scale = lambda i, m: sc_s[i, m]  # noqa: E731

  def row(m, xn):
    u = scale(0, m) * xn[0]
    for i in range(1, N):
      u = u + scale(i, m) * xn[i]
    xb = (u.astype(jnp.bfloat16).astype(jnp.float32) * scale(N, m)).astype(jnp.bfloat16)
    wv = plgpu.load(w_s, layout=_row_layout(), optimized=False)
    o_s[m] = wv * xb
    if o16_s is not None:  # (from the stored bf16: its own column, read back by the thread that wrote it — XLA on
      # the CPU, GPU interpret mode, keeps wv * xb in f32 until the store rounds it)
      o16_s[m] = plgpu.layout_cast(saturate_f16(_row_load(o_s.at[m])), _row_layout())

  # (several rows: a loop, X' of row m read back from SMEM)
  with jax.named_scope("xin"):
    _each_row(M, callable(xns), lambda m: row(m, xns(m) if callable(xns) else xns[m]))
    plgpu.commit_smem()


class _SmemRows:
  """X' of token row m read back from an [N, M, ROW_COLS] SMEM ref (the bf16 values the kernel keeps in f32: the
  same numbers) — the multi-row boundary's loops use it instead of values held in registers across rows."""

  def __init__(self, ref, rows: int):
    self.ref, self.rows = ref, rows

  def __call__(self, m):
    return [_row_load(self.ref.at[i, m]) for i in range(N)]


def _row_scratch(first: bool, x16: bool = False, M: int = 1):
  bf16, f32 = jnp.bfloat16, jnp.float32
  return [plgpu.SMEM((N, M, ROW_COLS), bf16),  # x_s: X's columns (TMA boxes of the M rows)
          plgpu.SMEM((N, MIX, ROW_COLS), bf16),  # fn_s: fn's columns of every stream (untiled)
          plgpu.SMEM((M, ROW_COLS), bf16),  # y_s
          plgpu.SMEM((N, ROWS), f32),  # post_s (the transposed mix)
          plgpu.SMEM((N * N, ROWS), f32),  # comb_s
          plgpu.SMEM((ROW_COLS,), bf16),  # w_s
          plgpu.SMEM((N, M, ROW_COLS), bf16),  # xu_s: X' for its TMA store
          plgpu.SMEM((ROWS, ROW_COLS), f32),  # red_s: the per-thread products, a row per quantity
          plgpu.SMEM((ROWS,), f32),  # v_s: zeros for the padding chunks, then the CTA's partials (40 used)
          plgpu.SMEM((M, ROW_COLS), bf16),  # o_s: x_in
          plgpu.SMEM((PART, ROWS), f32),  # t_s: the sums, transposed
          plgpu.SMEM((M, PART - MIX), f32),  # ts_s
          plgpu.SMEM((N + 1, ROWS), f32),  # sc_s: pre and 1/RMS (per-row vectors; column m read back)
          *([plgpu.SMEM((M, ROW_COLS), jnp.float16)] if x16 else []),  # o16_s: x_in in f16 (x16)
          plgpu.Barrier(num_arrivals=N + (0 if first else 3)),  # bar_x: X (y, the previous mix)
          plgpu.Barrier(num_arrivals=N + 1)]  # bar_fn: fn, w


def _row_first_half(x_g, y_g, post_g, comb_g, fn_g, w_g, xo_g, part_g, scratch, D: int, first: bool, g):
  """Loads, the mix, X' stored (unless ``first``), the CTA's partials stored into token rows 0..M-1 of chunk g
  and zeros into those of the padding chunks G.. -> X' of each row (f32 per-thread vectors). Waits for its
  stores. The mix waits only for X, y and the previous mix (bar_x); fn's 24 KB per CTA (and w) arrive behind them
  (bar_fn), and the padding chunks' zeros go out before anything else is computed."""
  x_s, fn_s, y_s, post_s, comb_s, w_s, xu_s, red_s, v_s = scratch[:9]
  bar_x, bar_fn = scratch[-2:]
  G, Gp = _grid_rows(D, ROW_COLS)
  M = x_s.shape[1]
  d0 = g * ROW_COLS
  for i in range(N):
    plgpu.copy_gmem_to_smem(x_g.at[pl.ds(0, M), pl.ds(i * D + d0, ROW_COLS)], x_s.at[i], bar_x)
  if not first:
    plgpu.copy_gmem_to_smem(y_g.at[pl.ds(0, M), pl.ds(d0, ROW_COLS)], y_s, bar_x)
    plgpu.copy_gmem_to_smem(post_g, post_s, bar_x)
    plgpu.copy_gmem_to_smem(comb_g, comb_s, bar_x)
  for i in range(N):
    plgpu.copy_gmem_to_smem(fn_g.at[:, pl.ds(i * D + d0, ROW_COLS)], fn_s.at[i], bar_fn)
  plgpu.copy_gmem_to_smem(w_g.at[pl.ds(d0, ROW_COLS)], w_s, bar_fn)
  v_s[...] = plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), _L.WGMMA.reduce(1))
  plgpu.commit_smem()
  for k in range(-(-(Gp - G) // G)):  # the token rows of the padding chunks, spread over the CTAs
    row = G + g + k * G

    @pl.when(row < Gp)
    def _():
      for m in range(M):
        plgpu.copy_smem_to_gmem(v_s.at[pl.ds(0, PART)], part_g.at[row, m])
  plgpu.barrier_wait(bar_x)
  # one row: X' stays in registers; several (policy knob mhc_rows): loops over the rows, X' read back from SMEM
  loop = M > 1
  xns = _SmemRows(x_s if first else xu_s, M) if loop else None

  def mixed(m):
    xn = _row_mixed(x_s, y_s, post_s, comb_s, first, m)
    if not first:
      for j in range(N):
        xu_s[j, m] = xn[j].astype(jnp.bfloat16)
    return xn

  with jax.named_scope("mix"):
    if not loop:
      xns = [mixed(0)]
    elif not first:  # (first: X' is X, read back from x_s)
      _each_row(M, True, mixed)
  if not first:
    plgpu.commit_smem()
    for j in range(N):
      plgpu.copy_smem_to_gmem(xu_s.at[j], xo_g.at[pl.ds(0, M), pl.ds(j * D + d0, ROW_COLS)])
  plgpu.barrier_wait(bar_fn)

  def partials(m, xn):
    # (the previous stores from v_s — the zeros, the previous row's partials — have read it: the issuing thread
    # waits, and _row_partials' first commit holds every thread until it has)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    with jax.named_scope("products"):  # (bench_kernel_profile's sub-regions: session 59's partials 2.7 µs)
      _row_partials(xn, fn_s, red_s, v_s)
    plgpu.copy_smem_to_gmem(v_s.at[pl.ds(0, PART)], part_g.at[g, m])

  with jax.named_scope("partials"):
    _each_row(M, loop, lambda m: partials(m, xns(m) if loop else xns[m]))
    with jax.named_scope("stores"):
      plgpu.wait_smem_to_gmem(0)
  return xns


def _row_kernel(D: int, first: bool, eps: float, hc_norm_eps: float, norm_eps: float, counters: bool, half: int,
                lean: bool = False, x16: bool = False, M: int = 1, scalars: bool = False, ll: bool = False):
  """M token rows (up to PARTS_MAX_ROWS). ``half``: 0 the whole boundary (one launch, grid barrier), 1 / 2 its
  halves as launches of their own. ``lean``: built without Mosaic's automatic barriers (lean_barriers): every SMEM
  store here is followed by a ``commit_smem`` before another thread or the TMA reads it, and a buffer another
  thread read is rewritten only behind a commit every reader passed after its reads: v_s (rewritten after the zero
  rows' and each row's partials' TMA stores read it) only behind _row_partials' first commit, which the issuing
  thread reaches after waiting for those reads; red_s (each row's products) after the previous row's closing
  commit, which every thread reaches after its tile load; xu_s / x_s rows are read back only by the thread that
  wrote that column. The barriers it needs besides: _sum_partials_t's and
  _grid_barrier's (``explicit``). ``x16``: x_in in f16 too (an output after x_in, its SMEM tile before the
  barriers). ``ll`` (one launch with counters, one row): the partials' 16 normalisation columns exchanged by
  ``ll_exchange`` (on the words after the counters) into an SMEM tile [Gp, 16] (the last scratch; its rows G..
  zeroed first, as part_g's) instead of the grid barrier and their loads from L2 — the same tile values, the same
  sums."""
  G, Gp = _grid_rows(D, ROW_COLS)
  consts = (D, eps, hc_norm_eps, norm_eps)

  def body(*refs):
    it = iter(refs)
    take = lambda n: [next(it) for _ in range(n)]  # noqa: E731
    g = lax.axis_index("g")
    d0 = g * ROW_COLS
    if half == 2:  # X' (or X), the partials, coef, w -> x_in (and x_in in f16)
      xn_g, part_g, c_g, w_g, xin_g = take(5)
      xin16_g = next(it) if x16 else None
      x_s, w_s, o_s, t_s, ts_s, sc_s = take(6)
      o16_s = next(it) if x16 else None
      bar = next(it)
      for i in range(N):
        plgpu.copy_gmem_to_smem(xn_g.at[pl.ds(0, M), pl.ds(i * D + d0, ROW_COLS)], x_s.at[i], bar)
      plgpu.copy_gmem_to_smem(w_g.at[pl.ds(d0, ROW_COLS)], w_s, bar)
      plgpu.barrier_wait(bar)
      xns = _SmemRows(x_s, M) if M > 1 else [[_row_load(x_s.at[i, 0]) for i in range(N)]]
      _row_normalised(part_g, _coef_scalars(c_g), xns, w_s, o_s, t_s, ts_s, sc_s, *consts, o16_s=o16_s,
                      scalars=scalars)
      plgpu.copy_smem_to_gmem(o_s, xin_g.at[pl.ds(0, M), pl.ds(d0, ROW_COLS)])
      if x16:
        plgpu.copy_smem_to_gmem(o16_s, xin16_g.at[pl.ds(0, M), pl.ds(d0, ROW_COLS)])
      plgpu.wait_smem_to_gmem(0)
      return
    if first:
      x_g, fn_g = take(2)
      y_g = post_g = comb_g = None
    else:
      x_g, y_g, post_g, comb_g, fn_g = take(5)
    c_g, w_g = take(2) if half == 0 else (None, take(1)[0])
    ctr_g, par_g = take(2) if counters else (None, None)
    xo_g = None if first else next(it)
    part_g = next(it)
    xin_g = next(it) if half == 0 else None
    xin16_g = next(it) if half == 0 and x16 else None
    scratch = list(it)
    tile_s = scratch.pop() if ll else None
    if ll:  # zeros in its padding chunks' rows (G..), as in part_g — the whole tile where those rows are not a
      # multiple of 128 values (a vector store's unit; G < 8: widths below the real one): the exchange's stores into
      # rows 0..G-1 come after the first half's commits (a warpgroup barrier each), behind every thread's zeros
      pad = (Gp - G) * LL_WIDTH % 128 == 0
      tile_s[pl.ds(G if pad else 0, Gp - G if pad else Gp)] = jnp.zeros((Gp - G if pad else Gp, LL_WIDTH),
                                                                          jnp.float32)
    # (read after the barrier: loaded here, their L2 round trips overlap the first half — _coef_scalars)
    coef = _coef_scalars(c_g) if half == 0 else None
    parity = par_g[0] if counters and half == 0 else None
    words = ctr_g.at[pl.ds(2, LL_WORDS)] if ll else None
    epoch = ll_epoch(words) if ll else None  # (as the coefficients: its L2 round trip under the first half)
    xns = _row_first_half(x_g, y_g, post_g, comb_g, fn_g, w_g, xo_g, part_g, scratch, D, first, g)
    if half == 1:
      return
    rows_of = None
    if ll:
      with jax.named_scope("exchange"):
        @pl.when(g == 0)
        def _():  # (the grid barriers' counter for the next boundary, as _grid_barrier's CTA 0 zeroes it)
          ctr_g[1 - parity] = jnp.int32(0)

        ll_exchange(words, scratch[8], tile_s, epoch, src0=MIX, width=LL_WIDTH, parts=G)
        wg_barrier()  # (every thread's polled values in tile_s before the tile loads)
      rows_of = lambda m, c: tile_s.at[pl.ds(c * ROWS, ROWS)]  # noqa: E731
    else:
      fence_async_writes()  # (the partials went out by TMA; the other CTAs read them with plain loads)
      _grid_barrier(ctr_g, par_g, g, G, lean, parity)
    w_s, o_s, t_s, ts_s, sc_s = scratch[5], *scratch[9:13]
    o16_s = scratch[13] if x16 else None
    with jax.named_scope("normalise"):
      _row_normalised(part_g, coef, xns, w_s, o_s, t_s, ts_s, sc_s, *consts, lean, o16_s=o16_s, scalars=scalars,
                      rows_of=rows_of)
      with jax.named_scope("store"):
        plgpu.copy_smem_to_gmem(o_s, xin_g.at[pl.ds(0, M), pl.ds(d0, ROW_COLS)])
        if x16:
          plgpu.copy_smem_to_gmem(o16_s, xin16_g.at[pl.ds(0, M), pl.ds(d0, ROW_COLS)])
        plgpu.wait_smem_to_gmem(0)

  return body


def mhc_row_boundary_reference(X, y, mix, fn, coef, w, *, first: bool = False, eps: float, hc_norm_eps: float,
                               norm_eps: float, approx_math: bool = False, launches: int | None = None,
                               x16: bool = False):
  """``mhc_post_finish_reference`` over ROW_COLS-column chunks (G = D / 128, partials [Gp = 64, 64, 40]): M token
  rows. Of the kernel's partials only token rows 0..M-1 are defined (the other rows are padding, as everywhere).
  ``x16``: x_in as (bf16, its f16 copy saturated at ±65,504)."""
  return mhc_post_finish_reference(X, y, mix, fn, coef, w, first=first, eps=eps, hc_norm_eps=hc_norm_eps,
                                   norm_eps=norm_eps, approx_math=approx_math, launches=launches, cols=ROW_COLS,
                                   x16=x16)


@kernel_entry("first", "eps", "hc_norm_eps", "norm_eps", "approx_math", "launches", "parity", "lean", "x16",
              "scalars", "ll")
def mhc_row_boundary(X, y, mix, fn, coef, w, *, first: bool = False, eps: float, hc_norm_eps: float,
                     norm_eps: float, approx_math: bool = False, launches: int | None = None, counters=None,
                     parity: int = 0, lean: bool = False, x16: bool = False, scalars: bool = False,
                     ll: bool = False):
  """Mosaic GPU version of ``mhc_row_boundary_reference`` (``mhc_post_finish``'s signature and outputs, M <=
  PARTS_MAX_ROWS token rows: one by default, more under policy knob mhc_rows): ONE launch of D / 128 CTAs, one column
  of every stream and token row per thread (no wgmma: the form that compiles for Blackwell), a grid barrier between
  the halves (``counters`` / ``parity`` as in mhc_post_finish). ``launches=2`` (the default in GPU interpret mode):
  the halves as two launches, no barrier. ``lean`` as in mhc_post_finish (this kernel: 134 bar.sync, 16 left — its 38
  one-row stores of per-thread products each had two). ``x16``: x_in as (bf16, f16) — the f16 copy saturated at
  ±65,504, what the dq kernels' ``linear._act`` would make of it (policy knob dq_f16: no conversion kernel between
  the boundary and the sublayer's FP8 kernels). ``scalars`` (one token row; policy knob mhc_row_scalars): the
  normalisation's sums, pre and 1/RMS as scalars in registers (``_row_normalised``). ``ll`` (one token row, one
  launch, ``counters`` = ``barrier_counters(ll=True)``; policy knob mhc_ll_exchange): the partial sums exchanged by
  the low-latency protocol (``_common.ll_exchange``) instead of the grid barrier — the same outputs bit for bit;
  in GPU interpret mode (two launches, no barrier) it changes nothing."""
  M, K = X.shape
  D = K // N
  G, Gp = _grid_rows(D, ROW_COLS)
  if scalars and M != 1:
    raise ValueError(f"mhc_row_boundary: scalars=True takes one token row; got {M}")
  if not 1 <= M <= PARTS_MAX_ROWS or D % ROW_COLS or not 1 <= G <= GRID_MAX_CTAS:
    raise ValueError(f"mhc_row_boundary: {M} token rows, hidden size {D}; expected 1 to {PARTS_MAX_ROWS} rows and a "
                     f"multiple of {ROW_COLS} up to {GRID_MAX_CTAS * ROW_COLS} columns")
  launches = _check_grid_args("mhc_row_boundary", X, fn, coef, w, mix, first, parity, launches)
  if ll and launches == 1:
    n_ctr = None if counters is None else counters.shape
    if M != 1 or n_ctr != (2 + LL_WORDS,):
      raise ValueError(f"mhc_row_boundary: ll=True takes one token row (here {M}) and counters = "
                       f"barrier_counters(ll=True), int32 [{2 + LL_WORDS}] (here {n_ctr})")
  ll = bool(ll) and launches == 1
  bf16, f32 = jnp.bfloat16, jnp.float32
  consts = (float(eps), float(hc_norm_eps), float(norm_eps))
  params = dict(grid=(G,), grid_names=("g",), compiler_params=plgpu.CompilerParams(approx_math=bool(approx_math)))
  pp_in = (X, fn.astype(bf16)) if first else (X, y.astype(bf16), *(a.astype(f32) for a in mix), fn.astype(bf16))
  part = jax.ShapeDtypeStruct((Gp, ROWS, PART), f32)
  x_in = jax.ShapeDtypeStruct((M, D), bf16)
  x_ins = (x_in, jax.ShapeDtypeStruct((M, D), jnp.float16)) if x16 else (x_in,)
  xo = () if first else (jax.ShapeDtypeStruct((M, K), bf16),)
  if launches == 2:
    h1 = mgpu_kernel(_row_kernel(D, bool(first), *consts, False, 1, M=M),
                     out_type=(*xo, part), scratch_types=_row_scratch(first, M=M), kernel_name="glm5_mhc_row_first",
                     **params)
    got = h1(*pp_in, w.astype(bf16))
    Xn, part = (X, got[0]) if first else got
    h2 = mgpu_kernel(_row_kernel(D, bool(first), *consts, False, 2, x16=x16, M=M, scalars=bool(scalars)),
                     out_type=x_ins if x16 else x_in,
                     kernel_name="glm5_mhc_row_second",
                     scratch_types=[plgpu.SMEM((N, M, ROW_COLS), bf16), plgpu.SMEM((ROW_COLS,), bf16),
                                    plgpu.SMEM((M, ROW_COLS), bf16), plgpu.SMEM((PART, ROWS), f32),
                                    plgpu.SMEM((M, PART - MIX), f32), plgpu.SMEM((N + 1, ROWS), f32),
                                    *([plgpu.SMEM((M, ROW_COLS), jnp.float16)] if x16 else []),
                                    plgpu.Barrier(num_arrivals=N + 1)], **params)
    got = h2(Xn, part, coef.astype(f32), w.astype(bf16))
    return Xn, (tuple(got) if x16 else got), part
  params["compiler_params"] = plgpu.CompilerParams(approx_math=bool(approx_math), unsafe_no_auto_barriers=bool(lean))
  kern = mgpu_kernel(_row_kernel(D, bool(first), *consts, counters is not None, 0, lean=bool(lean), x16=x16, M=M,
                                 scalars=bool(scalars), ll=ll),
                     out_type=(*xo, part, *x_ins),
                     scratch_types=[*_row_scratch(first, x16, M), *([plgpu.SMEM((Gp, LL_WIDTH), f32)] if ll else [])],
                     kernel_name="glm5_mhc_row_boundary", **params)
  ctr = () if counters is None else (counters, jnp.full((1,), parity, jnp.int32))
  got = tuple(kern(*pp_in, coef.astype(f32), w.astype(bf16), *ctr))
  Xn, got = (X, got) if first else (got[0], got[1:])
  part, x_in = got[0], (tuple(got[1:]) if x16 else got[1])
  return Xn, x_in, part


# ------------------------------------------------------------------------------------ prefill: the Sinkhorn alone
def sinkhorn_tokens_reference(mc_t, *, iters: int, eps: float):
  """mc_t [N·N, R] f32: each token row's 16 scaled comb logits (mc · scale + base, transposed: column r is token
  row r, entry N·i + j is c[i][j]) -> comb_t [N·N, R] f32, the Sinkhorn-normalised comb
  (``glm5_jax.layers.sinkhorn_comb``: a row softmax + eps, then iters alternating column / row normalisations)."""
  from glm5_jax.layers import sinkhorn_comb  # noqa: PLC0415 (the model's own normalisation)
  R = mc_t.shape[1]
  c = sinkhorn_comb(mc_t.T, jnp.float32(1.0), jnp.zeros((N * N,), jnp.float32), N, iters, eps)  # [R, N, N]
  return c.reshape(R, N * N).T


def _sinkhorn_tokens_kernel(iters: int, eps: float):
  """CTA g: token columns g·64.. of mc_t -> comb_t — one TMA in, ``_sinkhorn_rows`` on per-row [64] vectors (the
  decode boundary's Sinkhorn, reciprocals times entries: within an ulp a step of the stock c / s), one TMA out."""

  def body(mc_g, comb_g, m_s, c_s, bar):
    c0 = lax.axis_index("g") * ROWS
    plgpu.copy_gmem_to_smem(mc_g.at[:, pl.ds(c0, ROWS)], m_s, bar)
    plgpu.barrier_wait(bar)
    rows = [plgpu.load(m_s.at[k], layout=_L.WGMMA.reduce(1), optimized=False) for k in range(N * N)]
    for k, v in enumerate(_sinkhorn_rows(rows, iters, eps)):
      c_s[k] = v
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(c_s, comb_g.at[:, pl.ds(c0, ROWS)])
    plgpu.wait_smem_to_gmem(0)

  return body


@kernel_entry("iters", "eps", "approx_math")
def sinkhorn_tokens(mc_t, *, iters: int, eps: float, approx_math: bool = False):
  """``sinkhorn_tokens_reference`` as one launch of R / 64 CTAs (R a multiple of 64: pad the columns), for the mHC
  sites XLA runs at many token rows (a prefill chunk): there the stock form's 19 unrolled normalisation pairs were
  ~40 tiny XLA kernels a site (session 80's H100 trace of a 2,048-token chunk: 2,681 reductions + 2,192 adds of
  ~3 µs for two chunks, ~5.8 ms a chunk). ``approx_math``: the GPU's approximate exp / reciprocal."""
  if mc_t.ndim != 2 or mc_t.shape[0] != N * N or mc_t.shape[1] % ROWS or mc_t.dtype != jnp.float32:
    raise ValueError(f"sinkhorn_tokens: mc_t {mc_t.shape} {mc_t.dtype}; expected f32 [{N * N}, R] with R a multiple "
                     f"of {ROWS}")
  R = mc_t.shape[1]
  f32 = jnp.float32
  return mgpu_kernel(
      _sinkhorn_tokens_kernel(int(iters), float(eps)),
      out_type=jax.ShapeDtypeStruct((N * N, R), f32),
      scratch_types=[plgpu.SMEM((N * N, ROWS), f32), plgpu.SMEM((N * N, ROWS), f32), plgpu.Barrier(num_arrivals=1)],
      grid=(R // ROWS,),
      grid_names=("g",),
      kernel_name="glm5_mhc_sinkhorn_tokens",
      compiler_params=plgpu.CompilerParams(approx_math=bool(approx_math)),
  )(mc_t)
