"""The fused mHC boundary (pallas_kernels/mhc.py): kernels == references (GPU interpret mode on CPU, natively on
a GPU), CUDA cross-lowering at the real geometry, the fused boundary == the stock post + pre + RMSNorm, and the
whole trunk with the fused boundaries == the stock trunk."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import tol
from glm5_jax import config as C
from glm5_jax.layers import HyperConnection, RMSNorm, kernel_report, use_kernels
from helpers import barrier_counts, load, tiny_checkpoint
from pallas_kernels import mhc as K
from pallas_kernels._common import cross_lower, maybe_interpret, on_gpu

BF16_ULP = dict(rtol=2.0 ** -7, atol=1e-5)  # one bf16 rounding apart (FMA contraction, order of the 4 terms;
# the atol covers cancellation to ~1e-6 from O(1) terms)


CONSTS = dict(iters=20, eps=1e-6, hc_norm_eps=1e-6, norm_eps=1e-5, post_mult=2.0)


def _inputs(M, D, seed):
  """X, y, mix = (post_t [4, C], comb_t [16, C]) of a previous site (transposed, as mhc_finish returns them), fn,
  and the site's base / scale / norm weight."""
  rng = np.random.default_rng(seed)
  X = jnp.asarray(rng.standard_normal((M, 4 * D)) * rng.uniform(0.2, 3.0, (M, 1)), jnp.bfloat16)
  y = jnp.asarray(rng.standard_normal((M, D)), jnp.bfloat16)
  post = rng.uniform(0, 2, (M, 4)).astype(np.float32)  # post in (0, 2)
  c = rng.uniform(0, 1, (M, 4, 4))
  comb = (c / c.sum(1, keepdims=True)).reshape(M, 16).astype(np.float32)  # doubly-stochastic-ish comb
  fn = jnp.asarray(rng.standard_normal((24, 4 * D)) * 0.02, jnp.bfloat16)
  coef = jnp.asarray(np.concatenate([rng.standard_normal(24), rng.uniform(0.5, 2, 3)]), jnp.float32)  # base, scale
  w = jnp.asarray(rng.standard_normal(D), jnp.bfloat16)
  return X, y, K.mix_from_rows(jnp.asarray(post), jnp.asarray(comb)), fn, coef, w


def _check_kernels(M, D, first, seed=0, interpret=None, approx=False, split=False, narrow=True, cols=(64, 128),
                   parts=False):
  """mhc_post_pre and mhc_finish vs their references; the finish on the summed partials of a real post+pre
  (realistic logits and Gram entries) and random mHC parameters. ``approx``: the finish kernel with the GPU's
  approximate math, held to the same tolerances. ``split``: the finish without its Sinkhorn CTA + mhc_sinkhorn
  (policy knob mhc_sinkhorn_split), held to the same. ``narrow``: the sums as the model passes them, [40, M
  rounded up to 4] (the kernels' TMA fills the other columns with zeros); else [40, 64] with NaN padding.
  ``cols``: columns per CTA of mhc_post_pre and mhc_finish ((32, 64): policy knob mhc_narrow). ``parts``: the
  finish / Sinkhorn kernels take mhc_post_pre's raw partials (its kernel output) and sum them themselves (policy
  knob mhc_fused_sums); the reference sums the same partials."""
  X, y, mix, fn, coef, w = _inputs(M, D, seed)
  ref = K.mhc_post_pre_reference(X, y, mix, fn, first=first, cols=cols[0])
  tot = jnp.sum(ref[1][:, :M], axis=0)
  if narrow:
    tot_t = jnp.pad(tot.T, ((0, 0), (0, -M % 4)))
  else:
    tot_t = jnp.pad(tot.T, ((0, 0), (0, K.ROWS - M)), constant_values=np.nan)  # padding columns: never read
  with maybe_interpret(interpret):
    got = jax.jit(lambda *a: K.mhc_post_pre(*a, first=first, cols=cols[0]))(X, y, mix, fn)
    if parts:  # the kernel's own partials (padding rows as it leaves them: never read)
      tot_t = got[1]
    if split:
      fin = jax.jit(lambda *a: K.mhc_finish(*a, **CONSTS, approx_math=approx, sinkhorn=False, cols=cols[1]))(
          ref[0], tot_t, coef, w)
      mix_consts = {k: v for k, v in CONSTS.items() if k != "norm_eps"}
      post, comb = jax.jit(lambda *a: K.mhc_sinkhorn(*a, D=D, **mix_consts, approx_math=approx,
                                                     rows=M if parts else None))(tot_t, coef)
    else:
      fin, post, comb = jax.jit(lambda *a: K.mhc_finish(*a, **CONSTS, approx_math=approx, cols=cols[1]))(
          ref[0], tot_t, coef, w)
  ref_fin, ref_post, ref_comb = K.mhc_finish_reference(ref[0], tot_t, coef, w, **CONSTS)
  f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
  np.testing.assert_allclose(f32(got[0]), f32(ref[0]), **BF16_ULP)
  # the partial logits / Gram entries: f32 sums of exact bf16 products (X' may differ by one rounding)
  for sl in (slice(0, K.MIX), slice(K.MIX, K.MIX + K.GRAM)):  # partial logits, partial Gram entries
    r = f32(ref[1])[:, :M, sl]
    np.testing.assert_allclose(f32(got[1])[:, :M, sl], r, atol=2e-3 * np.abs(r).max(), rtol=0)
  # post (transposed: a column per token row; columns M.. padding): f32 math in another order (and the GPU's
  # exp / rsqrt) than XLA's
  assert post.shape == ref_post.shape == (4, K.ROWS) and comb.shape == ref_comb.shape == (16, K.ROWS)
  np.testing.assert_allclose(f32(post)[:, :M], f32(ref_post)[:, :M], atol=2e-5, rtol=2e-5)
  # comb: the same softmax + 20 Sinkhorn iterations with the sums of 4 in another order (and the GPU's exp)
  np.testing.assert_allclose(f32(comb)[:, :M], f32(ref_comb)[:, :M], atol=2e-5, rtol=2e-5)
  # x_in = w · bf16(bf16(u) · rinv): pre / rinv one f32 rounding apart, and u one rounding apart (FMA
  # contraction), move bf16(u) by one ulp and x_in by up to a second (seen natively: 1 of 262,144 at M = 64)
  np.testing.assert_allclose(f32(fin), f32(ref_fin), **{**BF16_ULP, "rtol": 2 * BF16_ULP["rtol"]})
  assert np.mean(f32(fin) != f32(ref_fin)) < 0.02


@pytest.mark.parametrize("M,D,first,split,narrow,cols,parts", [
    (1, 256, False, False, True, (64, 128), False), (5, 256, False, False, False, (64, 128), False),
    (5, 256, True, False, True, (64, 128), False), (64, 128, False, False, True, (64, 128), False),
    (3, 256, False, True, True, (64, 128), True), (4, 256, False, True, False, (64, 128), False),
    (1, 256, False, True, True, (32, 64), True), (6, 256, True, False, True, (32, 64), False),  # (mhc_narrow)
    (4, 512, True, False, True, (64, 128), True)])  # (parts: mhc_fused_sums)
def test_kernels_interpret(M, D, first, split, narrow, cols, parts):
  _check_kernels(M, D, first, seed=M, interpret=True, split=split, narrow=narrow, cols=cols, parts=parts)


@pytest.mark.gpu
@pytest.mark.parametrize("M,D,first,approx,split,cols", [
    (1, 4096, False, False, False, (64, 128)), (1, 4096, True, False, False, (64, 128)),
    (8, 4096, False, False, False, (64, 128)), (37, 4096, False, False, False, (64, 128)),
    (64, 4096, False, False, False, (64, 128)), (1, 4096, False, True, False, (64, 128)),
    (64, 4096, False, True, False, (64, 128)), (1, 4096, False, True, True, (64, 128)),
    (37, 4096, False, False, True, (64, 128)),
    (1, 4096, False, True, True, (32, 64)), (1, 4096, True, True, True, (32, 64)),  # (mhc_narrow)
    (8, 4096, False, True, True, (32, 64)), (64, 4096, False, True, True, (32, 64))])
def test_kernels_gpu(M, D, first, approx, split, cols):
  _check_kernels(M, D, first, seed=M, approx=approx, split=split, cols=cols)
  if M in (1, 8):  # the sums 64 columns wide (NaN padding) as well as narrow (the TMA's zero fill)
    _check_kernels(M, D, first, seed=M, approx=approx, split=split, narrow=False, cols=cols)


@pytest.mark.gpu
@pytest.mark.parametrize("M,first,split,cols", [(1, False, True, (32, 64)), (1, True, True, (32, 64)),
                                                (4, False, True, (32, 64)), (3, False, False, (64, 128)),
                                                (4, False, True, (64, 128))])
def test_kernels_sum_raw_partials_gpu(M, first, split, cols):
  """mhc_fused_sums natively: the finish and Sinkhorn kernels sum mhc_post_pre's partials (G = 64 or 128 column
  chunks: one or two 64-row tiles) themselves."""
  _check_kernels(M, 4096, first, seed=M, approx=True, split=split, cols=cols, parts=True)


GRID_CONSTS = dict(eps=1e-6, hc_norm_eps=1e-6, norm_eps=1e-5)


def _check_post_finish(M, D, first, seed=0, interpret=None, launches=None, row=False, lean=False):
  """mhc_post_finish (the boundary in one launch with a grid barrier; interpreted, its two halves) — or with
  ``row`` mhc_row_boundary (policy knob mhc_row: one token row, a column per thread) — vs its reference: X' as
  mhc_post_pre's, x_in as mhc_finish's (one bf16 rounding apart, rarely two), the token rows' partials as
  mhc_post_pre's over 32 (row: 128) columns, the rows past G zero (row: their token rows 0..M-1, the ones it
  defines).
  Returns the kernel's outputs."""
  X, y, mix, fn, coef, w = _inputs(M, D, seed)
  kern, refer, cols = ((K.mhc_row_boundary, K.mhc_row_boundary_reference, K.ROW_COLS) if row else
                       (K.mhc_post_finish, K.mhc_post_finish_reference, K.GRID_COLS))
  ref = refer(X, y, mix, fn, coef, w, first=first, **GRID_CONSTS)
  with maybe_interpret(interpret):
    got = jax.jit(lambda *a: kern(*a, first=first, approx_math=True, launches=launches, lean=lean, **GRID_CONSTS))(
        X, y, mix, fn, coef, w)
  f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
  np.testing.assert_allclose(f32(got[0]), f32(ref[0]), **BF16_ULP)
  np.testing.assert_allclose(f32(got[1]), f32(ref[1]), **{**BF16_ULP, "rtol": 2 * BF16_ULP["rtol"]})
  assert np.mean(f32(got[1]) != f32(ref[1])) < 0.02
  G = D // cols
  assert got[2].shape == ref[2].shape == (-(-G // K.ROWS) * K.ROWS, K.ROWS, K.PART)
  for sl in (slice(0, K.MIX), slice(K.MIX, K.MIX + K.GRAM), slice(K.PRE_COPY, K.PART)):  # logits, Gram, pre copy
    r = f32(ref[2])[:G, :M, sl]
    np.testing.assert_allclose(f32(got[2])[:G, :M, sl], r, atol=2e-3 * np.abs(r).max(), rtol=0)
  assert not np.any(f32(got[2])[G:, :M] if row else f32(got[2])[G:])  # the zero rows the second half sums over
  return got


@pytest.mark.parametrize("M,D,first", [(1, 256, False), (3, 512, True), (4, 1024, False)])
def test_post_finish_interpret(M, D, first):
  """(G = 8, 16 and 32 column chunks: the second half sums 64 rows, the rest zeros written by the first)"""
  _check_post_finish(M, D, first, seed=M, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("M,first,row,lean", [
    (1, False, False, False), (1, True, False, False), (4, False, False, False), (2, False, False, False),
    (1, False, True, False), (1, True, True, False), (4, False, True, False), (3, True, True, False),
    # lean: built without the automatic barriers (policy lean_barriers)
    (1, False, False, True), (1, True, False, True), (4, False, False, True), (1, False, True, True),
    (1, True, True, True), (4, False, True, True), (3, True, True, True)])
def test_post_finish_gpu(M, first, row, lean):
  """The one-launch form natively (128 CTAs meeting at the grid barrier; row: mhc_row_boundary's 32) against the
  reference, and bit for bit against its two halves as two launches (the same arithmetic without the barrier: a
  partial read before another CTA wrote it would differ; lean: a read before another thread of the CTA wrote
  too); twice, so the second launch's semaphore starts from zero again."""
  one = [_check_post_finish(M, 4096, first, seed=M + s, launches=1, row=row, lean=lean) for s in (0, 1)]
  two = _check_post_finish(M, 4096, first, seed=M, launches=2, row=row)
  for a, b in zip(one[0], two):
    np.testing.assert_array_equal(np.asarray(a, np.float32)[:M] if a.ndim == 2 else np.asarray(a)[:, :M],
                                  np.asarray(b, np.float32)[:M] if b.ndim == 2 else np.asarray(b)[:, :M])


@pytest.mark.parametrize("M,D,first", [(1, 256, False), (1, 512, True), (1, 1024, False), (4, 512, False),
                                       (3, 256, True)])
def test_row_boundary_interpret(M, D, first):
  """(G = 2, 4 and 8 chunks of 128 columns; interpreted as its two halves; M > 1: policy knob mhc_rows)"""
  _check_post_finish(M, D, first, seed=D + M, interpret=True, row=True)


def _x16_pair(D, first, seed, M=1, row=False, **kw):
  """The one-launch boundary (M = 1 or ``row``: mhc_row_boundary, else mhc_post_finish) with x16 and without on the
  same inputs (GPU interpret mode on the CPU: its two halves)."""
  X, y, mix, fn, coef, w = _inputs(M, D, seed)
  X = X.at[0, :8].set(jnp.asarray([7e4, -9e4, 3e-6, -2e-7, 1e5, 0.5, -0.25, 6e4], jnp.bfloat16))  # saturating / tiny
  kern = K.mhc_row_boundary if M == 1 or row else K.mhc_post_finish
  run = lambda x16: jax.jit(lambda *a: kern(*a, first=first, approx_math=True, x16=x16, **kw,  # noqa: E731
                                            **GRID_CONSTS))(X, y, mix, fn, coef, w)
  return run(False), run(True)


@pytest.mark.parametrize("first,M,row", [(False, 1, True), (True, 1, True), (False, 3, False), (True, 3, True)])
def test_boundary_x16_interpret(first, M, row):
  """x16 (policy knob dq_f16): the boundary's x_in also in f16 — exactly linear._act(x_in, f16) (the conversion
  the dq kernels would do), and every other output bit for bit the boundary's without it; the row form (one row,
  and 3 rows: policy knob mhc_rows) and the grid form (mhc_post_finish, 3 rows)."""
  from pallas_kernels import linear as L  # noqa: PLC0415
  with maybe_interpret(True):
    off, on = _x16_pair(256, first, seed=5, M=M, row=row)
  x_in, x_in16 = on[1]
  assert x_in16.dtype == jnp.float16 and np.abs(np.asarray(x_in, np.float32)).max() > 0
  for a, b in ((on[0], off[0]), (x_in, off[1]), (on[2], off[2])):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  np.testing.assert_array_equal(np.asarray(x_in16), np.asarray(L._act(off[1], jnp.float16)))


@pytest.mark.gpu
@pytest.mark.parametrize("lean,M", [(False, 1), (True, 1), (False, 4), (True, 4)])
def test_boundary_x16_gpu(lean, M):
  """x16 natively at the real width, one launch (the grid barrier; lean: without the automatic barriers; M = 1
  the row form, 4 the grid form): the f16 copy is linear._act of x_in, the rest bit for bit without it."""
  from pallas_kernels import linear as L  # noqa: PLC0415
  off, on = _x16_pair(4096, False, seed=6, M=M, launches=1, lean=lean)
  # (the partials' token rows past M are padding the kernel never writes: natively whatever the memory held —
  # s57a, session 58, compared them and failed on rows 1..63 at M = 1)
  for a, b in ((on[0], off[0]), (on[1][0], off[1]), (on[2][:, :M], off[2][:, :M])):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  np.testing.assert_array_equal(np.asarray(on[1][1]), np.asarray(L._act(off[1], jnp.float16)))


def test_row_boundary_refuses():
  """More than PARTS_MAX_ROWS token rows, or a width that is not whole CTAs of 128 columns: refused by name."""
  X, y, mix, fn, coef, w = _inputs(5, 256, 0)
  with pytest.raises(ValueError, match=r"mhc_row_boundary: 5 token rows"):
    K.mhc_row_boundary(X, y, mix, fn, coef, w, **GRID_CONSTS)
  X, y, mix, fn, coef, w = _inputs(1, 192, 0)
  with pytest.raises(ValueError, match=r"hidden size 192; expected 1 to 4 rows and a multiple of 128"):
    K.mhc_row_boundary(X, y, mix, fn, coef, w, **GRID_CONSTS)


@pytest.mark.parametrize("row", [False, True])
def test_lean_boundaries_lower_without_automatic_barriers(monkeypatch, row):
  """lean=True (policy knob lean_barriers): the one-launch boundary (grid form, or row: mhc_row_boundary) lowers
  for CUDA at the real width without Mosaic GPU's automatic barriers — two around every vector store to a ref,
  one before every TMA load — keeping the explicit ones it needs (_sum_partials_t's, the counters' grid barrier's,
  commit_smem's): a fraction of the default build's bar.sync. (Whether the explicit ones suffice is the GPU tests'
  question: interpret mode runs a CTA's threads in lockstep.)"""
  args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), _inputs(1, 4096, 0))
  kern = K.mhc_row_boundary if row else K.mhc_post_finish
  name = "glm5_mhc_row_boundary" if row else "glm5_mhc_post_finish"
  got = {}
  for lean in (False, True):
    def f(X, y, mix, fn, coef, w, lean=lean):
      return kern(X, y, mix, fn, coef, w, approx_math=True, launches=1, counters=K.barrier_counters(), parity=0,
                  lean=lean, **GRID_CONSTS)
    got[lean] = barrier_counts(monkeypatch, (name,), f, *args)[name]
  assert 0 < got[True] < got[False] // 3, got


def test_row_boundary_lowers_for_cuda():
  """At the real width: a first site, then a later one — lean with x16 (policy knobs lean_barriers and dq_f16:
  the step's build before an FP8 sublayer, x_in in f16 too) — and one with its normalisation on scalars (policy
  knob mhc_row_scalars), on barrier_counters' Ref (each launch aliasing it)."""
  args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), _inputs(1, 4096, 0))

  def two(X, y, mix, fn, coef, w):
    ref = K.barrier_counters()
    a = K.mhc_row_boundary(X, y, mix, fn, coef, w, first=True, approx_math=True, launches=1, counters=ref,
                           parity=0, **GRID_CONSTS)
    b = K.mhc_row_boundary(a[0], y, mix, fn, coef, w, approx_math=True, launches=1, counters=ref, parity=1,
                           lean=True, x16=True, **GRID_CONSTS)
    # (and the same with its normalisation on scalars: policy knob mhc_row_scalars — a module of its own)
    return b, K.mhc_row_boundary(b[0], y, mix, fn, coef, w, approx_math=True, launches=1, counters=ref, parity=0,
                                 lean=True, x16=True, scalars=True, **GRID_CONSTS)
  calls = [line for line in cross_lower(two, *args).as_text().splitlines() if "@mosaic_gpu_v2" in line]
  assert len(calls) == 3 and all("output_operand_alias" in line for line in calls)
  assert "tensor<1x4096xf16>" in calls[1] and "tensor<1x4096xf16>" not in calls[0]
  hashes = [line.split("kernel_hash = ")[1][:40] for line in calls]
  assert len(set(hashes)) == 3, hashes


def test_boundary_rows_lower_for_cuda():
  """At the real width, the verify's 4 token rows: the grid form (mhc_post_finish) and the row form (policy knob
  mhc_rows), lean with x16. (Apart from test_row_boundary_lowers_for_cuda: the suite's two workers share them.)"""
  args4 = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), _inputs(4, 4096, 0))  # the grid form
  low = cross_lower(lambda *a: K.mhc_post_finish(*a, approx_math=True, launches=1, lean=True, x16=True,
                                                 **GRID_CONSTS)[1], *args4)
  assert "tensor<4x4096xf16>" in low.as_text()
  # and the row form at 4 token rows (policy knob mhc_rows), lean, with x16
  low = cross_lower(lambda *a: K.mhc_row_boundary(*a, approx_math=True, launches=1, lean=True, x16=True,
                                                  **GRID_CONSTS)[1], *args4)
  assert "tensor<4x4096xf16>" in low.as_text() and "glm5_mhc_row_boundary" in low.as_text()


@pytest.mark.parametrize("first,x16,D", [(False, True, 512), (True, False, 256), (False, False, 1024)])
def test_row_scalars_interpret(first, x16, D):
  """mhc_row_boundary(scalars=True) (policy knob mhc_row_scalars): the normalisation's sums, pre and 1/RMS on
  scalars — every output bit for bit the per-row-vector form's (interpreted as its two halves); more than one
  token row refused by name."""
  X, y, mix, fn, coef, w = _inputs(1, D, D + 7)
  run = lambda sc: jax.jit(lambda *a: K.mhc_row_boundary(  # noqa: E731
      *a, first=first, approx_math=True, x16=x16, scalars=sc, **GRID_CONSTS))(X, y, mix, fn, coef, w)
  with maybe_interpret(True):
    got, want = run(True), run(False)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  X4, y4, *_ = _inputs(2, D, 1)
  with pytest.raises(ValueError, match="scalars=True takes one token row; got 2"):
    K.mhc_row_boundary(X4, y4, mix, fn, coef, w, scalars=True, **GRID_CONSTS)


@pytest.mark.gpu
@pytest.mark.parametrize("first,lean", [(False, True), (True, True), (False, False)])
def test_row_scalars_gpu(first, lean):
  """The scalar normalisation natively at the real width, one launch on the barrier counters: bit for bit the
  per-row-vector form (the same operations in the same order; x_in and its f16 copy, X', the partials)."""
  X, y, mix, fn, coef, w = _inputs(1, 4096, 11)
  run = lambda sc: jax.jit(lambda *a: K.mhc_row_boundary(  # noqa: E731
      *a, first=first, approx_math=True, launches=1, lean=lean, x16=True, counters=K.barrier_counters(),
      scalars=sc, **GRID_CONSTS))(X, y, mix, fn, coef, w)
  got, want = run(True), run(False)
  for a, b in ((got[0], want[0]), (got[1][0], want[1][0]), (got[1][1], want[1][1]), (got[2][:, :1], want[2][:, :1])):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def _ll_chain(seed: int, ll: bool, n: int = 4):
  """n one-row boundaries at the real width in one program on one barrier_counters(ll=ll) Ref (parities 0, 1, ...),
  each reading the previous one's X' and a fresh sublayer output, lean with x16 (the step's build); ``ll``: their
  partial sums by the low-latency exchange (policy knob mhc_ll_exchange) -> (each boundary's outputs, the Ref)."""
  X, y, mix, fn, coef, w = _inputs(1, 4096, seed)
  ys = jax.random.normal(jax.random.key(seed), (n, 1, 4096), jnp.float32).astype(jnp.bfloat16)

  def chain(X, ys, mix, fn, coef, w):
    ref = K.barrier_counters(ll=ll)
    outs = []
    for i in range(n):
      got = K.mhc_row_boundary(X, ys[i], mix, fn, coef, w, first=i == 0, approx_math=True, launches=1, counters=ref,
                               parity=i % 2, lean=True, x16=True, ll=ll, **GRID_CONSTS)
      outs.append(got)
      X = got[0]
    return outs, ref[...]
  return jax.jit(chain)(X, ys, mix, fn, coef, w)


def test_row_ll_lowers_for_cuda():
  """mhc_row_boundary(ll=True) (policy knob mhc_ll_exchange) cross-lowers — at D = 512 (4 CTAs: 64 of the 128
  threads poll, the tile's padding rows not a whole vector store: the paths the real width, which ptx_census and the
  step census compile, does not take): two boundaries on one barrier_counters(ll=True) Ref, each launch aliasing it,
  one module for both; bad calls refused by name before anything runs (a Ref without the exchange's words, several
  token rows). (The barrier form at this width is not lowered again: 9.8 s of the CPU suite, session 80.)"""
  args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), _inputs(1, 512, 0))

  def two(X, y, mix, fn, coef, w):  # (the second launch the same module: one lowering)
    ref = K.barrier_counters(ll=True)
    a = K.mhc_row_boundary(X, y, mix, fn, coef, w, approx_math=True, launches=1, counters=ref, parity=0, lean=True,
                           x16=True, ll=True, **GRID_CONSTS)
    return K.mhc_row_boundary(a[0], y, mix, fn, coef, w, approx_math=True, launches=1, counters=ref, parity=1,
                              lean=True, x16=True, ll=True, **GRID_CONSTS)
  calls = [ln for ln in cross_lower(two, *args).as_text().splitlines() if "@mosaic_gpu_v2" in ln]
  assert len(calls) == 2 and all("output_operand_alias" in ln for ln in calls)
  assert len({ln.split("kernel_hash = ")[1][:40] for ln in calls}) == 1, calls
  X, y, mix, fn, coef, w = _inputs(1, 4096, 0)
  with pytest.raises(ValueError, match=rf"counters = barrier_counters\(ll=True\), int32 \[{2 + K.LL_WORDS}\] "
                     r"\(here \(2,\)\)"):
    K.mhc_row_boundary(X, y, mix, fn, coef, w, launches=1, counters=K.barrier_counters(), ll=True, **GRID_CONSTS)
  X2, y2, *_ = _inputs(2, 4096, 0)
  with pytest.raises(ValueError, match=r"ll=True takes one token row \(here 2\)"):
    K.mhc_row_boundary(X2, y2, mix, fn, coef, w, launches=1, counters=K.barrier_counters(ll=True), ll=True,
                       **GRID_CONSTS)


@pytest.mark.gpu
def test_row_ll_gpu():
  """The low-latency exchange natively: a chain of 4 boundaries (a first site, then three with fresh sublayer
  outputs) bit for bit the same chain on the grid barrier — X', x_in and its f16 copy, the partials' defined row —
  run twice with other inputs (a new Ref each run: the epochs start again); after a run the epoch has counted
  the 4 exchanges and the grid barriers' counters are zero (the LL boundaries zero the next one's as theirs do)."""
  for seed in (3, 4):
    got, ref = _ll_chain(seed, True)
    want, _ = _ll_chain(seed, False)
    for g, r in zip(got, want):
      for a, b in ((g[0], r[0]), (g[1][0], r[1][0]), (g[1][1], r[1][1]), (g[2][:, :1], r[2][:, :1])):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    ref = np.asarray(ref)
    assert ref[:3].tolist() == [0, 0, 4], ref[:4]


def _counter_chain(M, n, counters: bool, row: bool = False, lean: bool = False):
  """n boundaries in one program, each reading the previous one's X' (one launch each; ``counters``: their grid
  barriers on barrier_counters' Ref, parities 0, 1, 0, ...; ``row``: mhc_row_boundary's) -> ([(X', x_in, part)
  per boundary], the counters after the chain or None)."""
  X, y, mix, fn, coef, w = _inputs(M, 4096, M)
  kern = K.mhc_row_boundary if row else K.mhc_post_finish

  def chain(X, y, mix, fn, coef, w):
    ref = K.barrier_counters() if counters else None
    outs = []
    for i in range(n):
      got = kern(X, y, mix, fn, coef, w, approx_math=True, launches=1, **GRID_CONSTS, counters=ref, parity=i % 2,
                 lean=lean)
      outs.append(got)
      X = got[0]
    return outs, (ref[...] if counters else None)
  return jax.jit(chain)(X, y, mix, fn, coef, w)


@pytest.mark.gpu
@pytest.mark.parametrize("M,row,lean", [(1, False, False), (4, False, False), (1, True, False), (1, False, True),
                                        (1, True, True)])
def test_post_finish_counters_gpu(M, row, lean):
  """The grid barrier on barrier_counters' Ref (policy knob mhc_barrier_counters) natively: a chain of 5
  boundaries bit for bit equal to the same chain on pl.get_global semaphores, and the counters left as the
  scheme says — the last boundary's (parity 0) at G, the other zeroed by it for the next. (row: mhc_row_boundary,
  whose partials define token row 0 only; lean: both chains built without the automatic barriers.)"""
  got, ctr = _counter_chain(M, 5, True, row, lean)
  want, _ = _counter_chain(M, 5, False, row, lean)
  for g, r in zip(got, want):
    for a, b in zip(g, r):
      a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
      np.testing.assert_array_equal(a[:, :M] if row and a.ndim == 3 else a, b[:, :M] if row and b.ndim == 3 else b)
  assert np.asarray(ctr).tolist() == [4096 // (K.ROW_COLS if row else K.GRID_COLS), 0]


def test_post_finish_counters_lower_for_cuda():
  """The counters form cross-lowers: one Ref (jax.new_ref) in the program, each boundary's launch taking its
  buffer as an aliased operand (so XLA keeps them in order) and no pl.get_global scratch; a parity other than 0 / 1
  is refused by name."""
  args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), _inputs(1, 4096, 0))

  def two(X, y, mix, fn, coef, w):
    ref = K.barrier_counters()
    a = K.mhc_post_finish(X, y, mix, fn, coef, w, launches=1, counters=ref, parity=0, **GRID_CONSTS)
    return K.mhc_post_finish(a[0], y, mix, fn, coef, w, launches=1, counters=ref, parity=1, **GRID_CONSTS)
  txt = cross_lower(two, *args).as_text()
  calls = [line for line in txt.splitlines() if "@mosaic_gpu_v2" in line]
  assert len(calls) == 2 and all(line.endswith("tensor<2xi32>)") for line in calls)  # (not a [1] scratch)
  assert all("output_operand_alias" in line for line in calls)
  X, y, mix, fn, coef, w = _inputs(1, 256, 0)
  with pytest.raises(ValueError, match=r"parity = 2, expected 0 or 1"):
    K.mhc_post_finish(X, y, mix, fn, coef, w, launches=1, parity=2, **GRID_CONSTS)


def test_comb_is_the_stock_sinkhorn():
  """The finish reference's comb (from the summed partials) == the comb of the stock mixing (hc_mix on all 24
  normalised logits), bit for bit."""
  from glm5_jax.layers import hc_mix  # noqa: PLC0415
  X, y, mix, fn, coef, w = _inputs(3, 256, 5)
  Xn, part = K.mhc_post_pre_reference(X, y, mix, fn)
  tot = jnp.sum(part[:, :3], axis=0)
  comb = K.mhc_finish_reference(Xn, jnp.pad(tot.T, ((0, 0), (0, K.ROWS - 3))), coef, w, **CONSTS)[2]
  ss = np.trace(np.asarray(K._gram(tot)), axis1=1, axis2=2)
  m = tot[:, :K.MIX] * jax.lax.rsqrt(jnp.asarray(ss) / (4 * 256) + 1e-6)[:, None]
  ref = hc_mix(m, coef[K.MIX:], coef[:K.MIX], 4, 20, 1e-6, 2.0)[2]
  np.testing.assert_array_equal(np.asarray(comb)[:, :3].T, np.asarray(ref).reshape(3, 16))


@pytest.mark.parametrize("M", [1, 4, 64])  # (one row, the q = 4 rows, the most rows; 8 and 32 share their code)
def test_cross_lower_real(M):
  """The mHC kernels at the real width. (At M = 4 the default forms lower inside the real-geometry step at q = 4,
  tests/test_step_lowering.py: here only the raw-partials forms and the grid-barrier boundary alone.)"""
  X, y, mix, fn, coef, w = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), _inputs(M, 4096, 0))
  for first in (False, True) if M != 4 else ():
    for cols in (64, 32) if M == 1 and not first else (64,):  # (32: policy knob mhc_narrow, at decode's M = 1)
      assert "mosaic_gpu" in cross_lower(lambda *a: K.mhc_post_pre(*a, first=first, cols=cols), X, y, mix,
                                         fn).as_text()
  tot_t = jax.ShapeDtypeStruct((K.PART, -(-M // 4) * 4), jnp.float32)  # as the model passes the sums
  # the finish with the Sinkhorn's CTA (mhc_sinkhorn_split off), approximate math as the model runs it
  for approx in {1: (True,), 4: (), 64: (True,)}[M]:
    assert "mosaic_gpu" in cross_lower(lambda *a: K.mhc_finish(*a, **CONSTS, approx_math=approx), X, tot_t, coef,
                                       w).as_text()
  if M in (1, 64):  # the split form (policy knob mhc_sinkhorn_split): x_in alone, then the mix
    for cols in (128, 64) if M == 1 else (128,):  # (64: policy knob mhc_narrow)
      assert "mosaic_gpu" in cross_lower(lambda *a: K.mhc_finish(*a, **CONSTS, approx_math=True, sinkhorn=False,
                                                                 cols=cols), X, tot_t, coef, w).as_text()
    mix_consts = {k: v for k, v in CONSTS.items() if k != "norm_eps"}
    assert "mosaic_gpu" in cross_lower(lambda *a: K.mhc_sinkhorn(*a, D=4096, **mix_consts, approx_math=True), tot_t,
                                       coef).as_text()
  if M <= K.PARTS_MAX_ROWS:  # the raw partials summed in the kernels (policy knob mhc_fused_sums; narrow: G = 128)
    part = jax.ShapeDtypeStruct((4096 // 32, K.ROWS, K.PART), jnp.float32)
    mix_consts = {k: v for k, v in CONSTS.items() if k != "norm_eps"}
    assert "mosaic_gpu" in cross_lower(lambda *a: K.mhc_finish(*a, **CONSTS, approx_math=True, sinkhorn=False,
                                                               cols=64), X, part, coef, w).as_text()
    assert "mosaic_gpu" in cross_lower(lambda *a: K.mhc_sinkhorn(*a, D=4096, **mix_consts, approx_math=True,
                                                                 rows=M), part, coef).as_text()
  if M <= K.PARTS_MAX_ROWS:  # the boundary in one launch with a grid barrier (policy knob mhc_grid_barrier)
    for first in (False, True) if M == 1 else (False,):
      assert "mosaic_gpu" in cross_lower(lambda *a: K.mhc_post_finish(*a, first=first, approx_math=True, launches=1,
                                                                      **GRID_CONSTS), X, y, mix, fn, coef,
                                         w).as_text()


def test_bad_shapes_named():
  X, y, mix, fn, coef, w = _inputs(65, 128, 0)
  with pytest.raises(ValueError, match="65 token rows, expected 1..64"):
    K.mhc_post_pre(X, y, mix, fn)
  X, y, mix, fn, coef, w = _inputs(3, 128, 0)
  with pytest.raises(ValueError, match=r"mix = \(post \(4, 32\)"):
    K.mhc_post_pre(X, y, (mix[0][:, :32], mix[1]), fn)
  with pytest.raises(ValueError, match=r"tot_t \(3, 40\)"):
    K.mhc_finish(X, jnp.zeros((3, K.PART)), coef, w, **CONSTS)
  with pytest.raises(ValueError, match=r"tot_t \(40, 3\).*a multiple of 4"):  # rows of 12 bytes: no TMA
    K.mhc_finish(X, jnp.zeros((K.PART, 3)), coef, w, **CONSTS)
  with pytest.raises(ValueError, match=r"coef \(24,\)"):
    K.mhc_finish(X, jnp.zeros((K.PART, K.ROWS)), coef[:24], w, **CONSTS)
  with pytest.raises(ValueError, match="iters = 0, expected >= 1"):
    K.mhc_finish(X, jnp.zeros((K.PART, K.ROWS)), coef, w, **{**CONSTS, "iters": 0})
  # the raw-partials form (mhc_fused_sums): up to PARTS_MAX_ROWS token rows, [G, 64, 40], rows= for the Sinkhorn
  part = jnp.zeros((4, K.ROWS, K.PART))
  X5, *_ = _inputs(5, 128, 0)
  with pytest.raises(ValueError, match="5 token rows with raw partials"):
    K.mhc_finish(X5, part, coef, w, **CONSTS)
  with pytest.raises(ValueError, match=r"partials \(4, 64, 24\)"):
    K.mhc_finish(X, part[..., :24], coef, w, **CONSTS)
  mix_consts = {k: v for k, v in CONSTS.items() if k != "norm_eps"}
  with pytest.raises(ValueError, match="need rows="):
    K.mhc_sinkhorn(part, coef, D=128, **mix_consts)
  # the one-launch boundary with a grid barrier: up to PARTS_MAX_ROWS rows, one resident CTA per 32 columns
  with pytest.raises(ValueError, match="5 token rows, hidden size 128"):
    K.mhc_post_finish(X5, *_inputs(5, 128, 0)[1:], **GRID_CONSTS)
  X8k, y8k, mix8k, fn8k, coef8k, w8k = _inputs(1, 8192, 0)
  with pytest.raises(ValueError, match="hidden size 8192; expected up to 4 rows and up to 4096 columns"):
    K.mhc_post_finish(X8k, y8k, mix8k, fn8k, coef8k, w8k, **GRID_CONSTS)
  with pytest.raises(ValueError, match="launches = 3"):
    K.mhc_post_finish(X, y, mix, fn, coef, w, launches=3, **GRID_CONSTS)


def _site(D, seed):
  cfg = C.kernel_tiny().replace(hidden_size=D)
  hc = nnx.eval_shape(lambda: HyperConnection(cfg, jnp.bfloat16))
  rng = np.random.default_rng(seed)
  hc.fn.set_value(jnp.asarray(rng.standard_normal((24, 4 * D)) * 0.05, jnp.bfloat16))
  hc.base_scale.set_value(jnp.asarray(np.concatenate([rng.standard_normal(24), rng.uniform(0.5, 2, 3)]), jnp.float32))
  norm = nnx.eval_shape(lambda: RMSNorm(D, jnp.bfloat16, cfg.rms_norm_eps))
  norm.weight.set_value(jnp.asarray(rng.uniform(0.5, 1.5, D), jnp.bfloat16))
  return hc, norm


@pytest.mark.parametrize("M,first,finish_kernel", [(3, False, True), (3, True, True), (70, False, True),
                                                   (3, False, False), (3, True, False), (3, False, "split"),
                                                   (3, False, "narrow"), (3, False, "sums"), (3, False, "grid"),
                                                   (1, True, "grid"), (1, False, "row"), (1, True, "row")])
def test_fused_boundary_equals_stock(M, first, finish_kernel):
  """post (previous sublayer) + pre + RMSNorm, fused kernels vs the stock XLA formulation; 70 rows = 2 launches.
  finish_kernel False: the boundary's last step in XLA (policy knob mhc_finish off: one Mosaic call per boundary
  instead of two); "split": the finish kernel without the mix + mhc_sinkhorn (policy knob mhc_sinkhorn_split);
  "narrow": "split" with half as
  many columns per CTA (policy knob mhc_narrow); "sums": "narrow" with the kernels summing the raw partials
  (policy knob mhc_fused_sums); "grid": the boundary as one launch with a grid barrier (policy knob
  mhc_grid_barrier; interpreted as its two halves) + mhc_sinkhorn on its raw partials; "row": "grid" in its
  one-token-row form (policy knob mhc_row: a column per thread)."""
  D = 256
  hc, norm = _site(D, M)
  X, y, mix, _, _, _ = _inputs(M, D, M + 1)
  post, comb = HyperConnection.unpack(mix, (M,))
  Xs = X.reshape(M, 4, D)
  Xref = Xs if first else HyperConnection.post(Xs, y, post, comb)
  u, post_ref, comb_ref = hc.pre(Xref)
  xin_ref = norm(u, jnp.bfloat16)
  policy = {"mhc_finish": bool(finish_kernel),
            "mhc_sinkhorn_split": finish_kernel in ("split", "narrow", "sums", "grid", "row"),
            "mhc_narrow": finish_kernel in ("narrow", "sums"), "mhc_fused_sums": finish_kernel == "sums",
            "mhc_grid_barrier": finish_kernel in ("grid", "row"), "mhc_row": finish_kernel == "row"}
  with maybe_interpret(True), use_kernels(policy), kernel_report() as rep:
    Xn, xin, mix_new = jax.jit(lambda X, y, mix: hc.fused(X, None if first else (y, mix), norm))(X, y, mix)
  assert (("mhc_finish", "off in the policy") in rep) != bool(finish_kernel)
  assert (("mhc_sinkhorn_split", None) in rep) == (finish_kernel in ("split", "narrow", "sums", "grid", "row"))
  assert (("mhc_grid_barrier", None) in rep) == (finish_kernel in ("grid", "row"))
  assert (("mhc_row", None) in rep) == (finish_kernel == "row")
  assert (("mhc_narrow", None) in rep) == (finish_kernel in ("narrow", "sums"))
  assert (("mhc_fused_sums", None) in rep) == (finish_kernel == "sums")
  f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
  np.testing.assert_allclose(f32(Xn).reshape(M, 4, D), f32(Xref), **BF16_ULP)
  p, c = HyperConnection.unpack(mix_new, (M,))
  np.testing.assert_allclose(f32(p), f32(post_ref), **tol("fp32_paths"))
  np.testing.assert_allclose(f32(c), f32(comb_ref), **tol("fp32_paths"))
  # x_in: the variance of the f32 u (vLLM) instead of the bf16 u (HF, the stock path): within bf16 rounding
  np.testing.assert_allclose(f32(xin), f32(xin_ref), **tol("kernel_bf16"))
  assert np.mean(f32(xin) != f32(xin_ref)) < 0.05


@pytest.mark.parametrize("M", [1, 70])
def test_prefill_form_equals_reference(M):
  """Policy knob mhc_prefill (the XLA sites' two-pass form: the norm's scale after the logits' product, the post
  mixing's sums written out) against the reference's order, in f32 at one site: the same streams, logits-derived
  pre / post / comb and sublayer input within the fp32 paths' tolerance; the post mixing is no product in its
  lowering (the reference's einsum is the GEMM that wrote f32 streams between two fusions)."""
  D = 256
  hc, _ = _site(D, M)
  X, y, mix, _, _, _ = _inputs(M, D, M + 7)
  post, comb = HyperConnection.unpack(mix, (M,))
  Xs, y = X.reshape(M, 4, D).astype(jnp.float32), y.astype(jnp.float32)
  out, text = {}, {}
  for on in (False, True):  # (a fresh function each: jax's trace cache does not see the policy)
    # (the XLA forms alone: the Sinkhorn kernel, on by default, has its own test below)
    with use_kernels({"mhc_prefill": on, "mhc_prefill_sinkhorn": False}), kernel_report() as rep:
      out[on] = jax.jit(lambda Xs, y: hc.pre(HyperConnection.post(Xs, y, post, comb)))(Xs, y)
      text[on] = jax.jit(lambda Xs, y: HyperConnection.post(Xs, y, post, comb)).lower(Xs, y).as_text()
    assert (("mhc_prefill", None) in rep) == on, rep
  for a, b in zip(out[True], out[False]):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), **tol("fp32_paths"))
  assert "dot_general" in text[False] and "dot_general" not in text[True]


@pytest.mark.parametrize("M", [1, 70])
def test_prefill_bf16_logits_equal_the_f32_product(M):
  """Policy knob bf16_products (with mhc_prefill): the mixing logits as the bf16 streams times the bf16 fn with f32
  sums — pre / post / comb within the fp32 paths' tolerance of the f32 product's, the sublayer input within bf16
  rounding; the product in its lowering takes the bf16 operands (no f32 copy of the streams). Declined, saying
  why, for f32 streams."""
  from helpers import has_bf16_product  # noqa: PLC0415
  D = 256
  hc, _ = _site(D, M + 3)
  X, _, _, _, _, _ = _inputs(M, D, M + 11)
  Xs = X.reshape(M, 4, D)
  out, text = {}, {}
  for on in (False, True):
    with use_kernels({"mhc_prefill": True, "bf16_products": on, "mhc_prefill_sinkhorn": False}), \
        kernel_report() as rep:
      out[on] = jax.jit(hc.pre)(Xs)
      text[on] = jax.jit(hc.pre).lower(Xs).as_text()
    assert (("bf16_products", None) in rep) == on, rep
  u1, u0 = (np.asarray(out[b][0].astype(jnp.float32)) for b in (True, False))
  np.testing.assert_allclose(u1, u0, **tol("kernel_bf16"))
  for a, b in zip(out[True][1:], out[False][1:]):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), **tol("fp32_paths"))
  assert has_bf16_product(text[True]) and not has_bf16_product(text[False])
  with use_kernels({"mhc_prefill": True, "bf16_products": True, "mhc_prefill_sinkhorn": False}), \
      kernel_report() as rep:
    jax.eval_shape(hc.pre, Xs.astype(jnp.float32))
  assert [r for k, r in rep if k == "bf16_products"] == ["bf16 streams and fn (here float32 and bfloat16)"], rep


def test_prefill_sinkhorn_kernel_at_one_site():
  """Policy knob mhc_prefill_sinkhorn (the Sinkhorn of the sites XLA runs as one kernel over the token rows: 70 rows,
  two CTAs, the second padded) at one f32 site in GPU interpret mode: pre, post and the sublayer input as without
  it (the same XLA), comb within the f32 kernels' tolerance of the stock form; the report names the site, and the
  lowering has the kernel where the stock form's unrolled normalisations were."""
  D, M = 256, 70
  hc, _ = _site(D, M + 5)
  X, _, _, _, _, _ = _inputs(M, D, M + 13)
  Xs = X.reshape(M, 4, D).astype(jnp.float32)
  out, text = {}, {}
  for on in (False, True):  # (a fresh function each: jax's trace cache does not see the policy)
    with use_kernels({"mhc_prefill": True, "mhc_prefill_sinkhorn": on}), kernel_report() as rep:
      with maybe_interpret(on):
        out[on] = jax.jit(lambda Xs: hc.pre(Xs))(Xs)
      text[on] = cross_lower(lambda Xs: hc.pre(Xs), Xs).as_text()
    assert (("mhc_prefill_sinkhorn", None) in rep) == on, rep
  np.testing.assert_array_equal(np.asarray(out[True][0]), np.asarray(out[False][0]))
  np.testing.assert_array_equal(np.asarray(out[True][1]), np.asarray(out[False][1]))
  np.testing.assert_allclose(np.asarray(out[True][2]), np.asarray(out[False][2]), **tol("kernel_f32"))
  assert "glm5_mhc_sinkhorn_tokens" in text[True] and "glm5_mhc_sinkhorn_tokens" not in text[False]

def test_prefill_form_at_the_model_site():
  """mhc_prefill at the model's sites: kernel-tiny in f32, the target's chunk program (every other knob off) over a
  13-token prompt in two 8-row chunks — the trunk's hidden states within the fp32 paths' tolerance of the
  reference's order, also with the Sinkhorn as the kernel (mhc_prefill_sinkhorn, GPU interpret mode);
  Decoder.prefill with the knobs on reports their sites. Every expert routed (4 of 4), fewer
  positions than the indexer's top-k and the caches in the model's f32 (kv_cache_dtype "auto"): no discrete decision
  a rounding difference could flip — with the FP8 caches a cached value can round to the neighbouring e4m3 step: a
  CI run of session 77 saw a later token's hidden state 2.7e-4 apart (eight draws here: at most 1.5e-5 with the FP8
  caches, 8.6e-6 with f32 ones)."""
  from glm5_jax.layers import KERNEL_DEFAULTS  # noqa: PLC0415
  from glm5_jax.runtime import DecodeConfig  # noqa: PLC0415
  from glm5_jax.speculative import Decoder  # noqa: PLC0415
  from helpers import target_hidden_in_chunks  # noqa: PLC0415
  m = load(tiny_checkpoint("kernel-tiny", 4, "fp8", n_routed_experts=4), "float32")
  toks = np.random.default_rng().integers(0, 2000, (1, 13)).astype(np.int32)
  hs = {}
  for on in (False, True, "sinkhorn"):  # ("sinkhorn": with mhc_prefill_sinkhorn's kernel, in GPU interpret mode)
    pol = {**{k: False for k in KERNEL_DEFAULTS}, "mhc_prefill": bool(on), "kv_cache_dtype": "auto"}
    if on == "sinkhorn":
      pol |= {"mhc_prefill_sinkhorn": True, "interpret": True}
    dec = Decoder(m, DecodeConfig(max_context=64, q=2, capture_sizes=(1,), policy=tuple(sorted(pol.items()))),
                  backend="latency_specialized", prefill_chunk=8)
    hs[on], rep = target_hidden_in_chunks(dec, m, toks, 13, 8, dec.prefill_kernel_mode())
    assert (("mhc_prefill", None) in rep) == bool(on) and (("mhc_prefill_sinkhorn", None) in rep) == (
        on == "sinkhorn"), rep
  np.testing.assert_allclose(hs[True], hs[False], **tol("fp32_paths"))
  np.testing.assert_allclose(hs["sinkhorn"], hs[False], **tol("fp32_paths"))
  dec.prefill([toks[0]])  # (the last policy's: both knobs on)
  for knob in ("mhc_prefill", "mhc_prefill_sinkhorn"):  # (the trunk's sites: two a layer)
    assert dec.prefill_sites[knob]["sites"] == 2 * m.cfg.num_hidden_layers, knob


@pytest.mark.gpu
def test_pdl_chain_gpu():
  """Programmatic Dependent Launch natively (pallas_kernels._common.pdl_mode, policy knob pdl): a chain of 12
  fused boundaries (post_pre -> finish -> next post_pre ..., each kernel reading its predecessor's output) with
  every kernel starting with griddepcontrol gives bit for bit the chain without — a kernel that ran ahead of its
  predecessor's writes would not."""
  from pallas_kernels._common import pdl_mode  # noqa: PLC0415
  D, M = 4096, 1
  hc, norm = _site(D, 7)
  X, y, mix, _, _, _ = _inputs(M, D, 8)

  def chain(X, y, mix):
    for _ in range(12):
      X, y, mix = hc.fused(X, (y, mix), norm)
    return X, y, mix

  outs = []
  for pdl in (False, True):
    with pdl_mode(pdl), use_kernels({}):
      outs.append(jax.jit(chain)(X, y, mix))
  for a, b in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1])):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.e2e_kernels
def test_trunk_with_fused_boundaries_as_accurate_as_stock():
  """kernel-tiny in bf16 (2 layers: 4 fused boundaries + the final post; dense MLPs, 5 tokens, so no MoE
  routing or indexer selection can flip on a rounding difference), fused mHC kernels vs the stock bf16 trunk,
  both against the f32 model: the fused path (the default kernels: each boundary one grid-barrier launch, run as
  its two halves in interpret mode) is as close to f32 as the stock bf16 path."""
  from glm5_jax import api  # noqa: PLC0415
  path = tiny_checkpoint("kernel-tiny", 4, "fp8", num_hidden_layers=2, mlp_layer_types=["dense"] * 2)
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, 2000, (2, 5)), jnp.int32)
  fused = {k: False for k in ("kda", "fp8_linear", "fp8_moe", "sparse_mla", "indexer")} | {"mhc": True}
  hidden = {}
  # (the finish in XLA — mhc_finish off — is checked per boundary in test_fused_boundary_equals_stock)
  for name, dtype, policy in (("f32", "float32", None), ("stock", "bfloat16", None), ("fused", "bfloat16", fused)):
    m = load(path, dtype)
    cache = api.init_cache(m, 2, 64)
    fn = api._build_extend(m, (2, 64, 1), "all")  # a fresh trace per policy
    with use_kernels(policy), maybe_interpret(None if on_gpu() else True):
      out, _ = fn(m.params, cache.caches, tokens, cache.lengths, jnp.full((2,), 5, jnp.int32), cache.n_acc)
    hidden[name] = np.asarray(out["hidden"], np.float32)
  err = {k: np.linalg.norm(hidden[k] - hidden["f32"]) / np.linalg.norm(hidden["f32"]) for k in ("stock", "fused")}
  assert err["fused"] <= 1.25 * err["stock"], err
  assert np.linalg.norm(hidden["fused"] - hidden["stock"]) / np.linalg.norm(hidden["stock"]) < 0.03


@pytest.mark.skipif(bool(__import__("os").environ.get("MOSAIC_GPU_DUMP_TO")),
                    reason="MOSAIC_GPU_DUMP_TO: every lowering writes its own dump files, so none is kept")
def test_a_kernel_is_lowered_once_per_process():
  """Two programs calling the same kernel entry with the same shapes: the second parses the kept Mosaic module
  (pallas_kernels._common._memoize_kernel_lowerings) and holds the same custom call, bit for bit; another shape is
  lowered anew. (Without the memo every program lowers its kernels again: seconds each.)"""
  from jax._src.pallas.mosaic_gpu import lowering as mgpu_lowering  # noqa: PLC0415
  kept = mgpu_lowering.lower_unpipelined_jaxpr_to_module.kept
  mix_consts = {k: v for k, v in CONSTS.items() if k != "norm_eps"}
  rows = int(np.random.default_rng().choice([12, 20, 28]))  # (a width the rest of the suite does not lower)
  sink = lambda t, c: K.mhc_sinkhorn(t, c, D=4096, **mix_consts, approx_math=True)  # noqa: E731
  coef = jax.ShapeDtypeStruct((K.MIX + 3,), jnp.float32)
  tot = jax.ShapeDtypeStruct((K.PART, rows), jnp.float32)

  def calls(txt):
    return [line.split("stablehlo.custom_call", 1)[1].split(" : ", 1)[0] for line in txt.splitlines()
            if "@mosaic_gpu_v2" in line]
  n = len(kept)
  first = calls(cross_lower(sink, tot, coef).as_text())
  assert len(kept) == n + 1 and len(first) == 1
  second = calls(cross_lower(lambda t, c: jax.tree.map(lambda a: a * 2, sink(t + 1, c)), tot, coef).as_text())
  assert len(kept) == n + 1 and second == first  # (another program, the same kernel: its kept module)
  other = jax.ShapeDtypeStruct((K.PART, rows + 4), jnp.float32)
  assert calls(cross_lower(sink, other, coef).as_text()) != first and len(kept) == n + 2


def test_sinkhorn_tokens_interpret_equals_reference():
  """The prefill's Sinkhorn kernel (policy mhc_prefill_sinkhorn): R / 64 CTAs of per-row vectors against the model's
  own sinkhorn_comb (the stock form) within f32 kernel tolerance, in GPU interpret mode — logits spread wide enough
  that the softmax saturates in some rows; every output's columns summing to 1 (the last normalisation), its
  entries in [0, 1]; a shape it cannot take is refused by name."""
  rng = np.random.default_rng()
  R = 128
  mc = jnp.asarray(rng.standard_normal((K.N * K.N, R)) * rng.choice([0.5, 3.0, 12.0], size=(1, R)), jnp.float32)
  with maybe_interpret(True):
    got = K.sinkhorn_tokens(mc, iters=20, eps=1e-6)
  want = K.sinkhorn_tokens_reference(mc, iters=20, eps=1e-6)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), **tol("kernel_f32"))
  c = np.asarray(got).T.reshape(R, K.N, K.N)
  np.testing.assert_allclose(c.sum(axis=-2), 1.0, atol=1e-4)
  assert (c >= 0).all() and (c <= 1 + 1e-6).all()
  with pytest.raises(ValueError, match="R a multiple of 64"):
    K.sinkhorn_tokens(mc[:, :100], iters=20, eps=1e-6)


def test_sinkhorn_tokens_lowers_for_cuda():
  """The prefill's Sinkhorn kernel lowers for CUDA at a 2,048-token chunk's rows."""
  txt = cross_lower(lambda a: K.sinkhorn_tokens(a, iters=20, eps=1e-6),
                    jax.ShapeDtypeStruct((K.N * K.N, 2048), jnp.float32)).as_text()
  assert "glm5_mhc_sinkhorn_tokens" in txt


@pytest.mark.gpu
def test_sinkhorn_tokens_gpu():
  """The prefill's Sinkhorn kernel natively at a 2,048-token chunk's rows against the stock form (XLA's), within
  the f32 kernels' tolerance."""
  rng = np.random.default_rng()
  mc = jnp.asarray(rng.standard_normal((K.N * K.N, 2048)) * rng.choice([0.5, 3.0, 12.0], size=(1, 2048)),
                   jnp.float32)
  got = K.sinkhorn_tokens(mc, iters=20, eps=1e-6)
  want = jax.jit(lambda a: K.sinkhorn_tokens_reference(a, iters=20, eps=1e-6))(mc)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), **tol("kernel_f32"))
