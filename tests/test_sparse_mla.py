"""Tests of pallas_kernels/sparse_mla.py: FP8 latent cache format and the sparse MLA decode kernel.

CPU (< 90 s): quantize/dequantize round trip and scale rule; the reference against a naive numpy dense softmax
over the gathered dequantised rows; the Mosaic GPU kernel in GPU interpret mode against the reference (small
shapes, -1 padding interleaved and trailing, all-padding splits, several splits per row, H = 16 and 32);
CUDA cross-lowering of every real configuration (B in {1, 8, 32}, T in {1, 4, 8}, H in {16, 64},
W = 2051 padded to 2176, S = 65536).
GPU (`-m gpu`): real sizes natively against the reference.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tol
from helpers import barrier_counts, load, target_hidden_in_chunks, tiny_checkpoint

from glm5_jax.layers import KERNEL_DEFAULTS, PREFILL_FORM_KNOBS
from glm5_jax.runtime import DecodeConfig
from glm5_jax.speculative import Decoder
from pallas_kernels import sparse_mla as M
from pallas_kernels._common import cross_lower, maybe_interpret

SDS = jax.ShapeDtypeStruct
F8 = jnp.float8_e4m3fn
SCALE = 1.0 / 16


def make_inputs(seed, B, T, H, S, W, pad_frac=0.2, q_dtype=jnp.float32, trailing_pad=0, pooled=False):
  """Random absorbed queries, a quantised random latent cache (per-token magnitudes vary) and index lists with
  interleaved -1 padding (+ ``trailing_pad`` -1 at the end); index 0 of every row is valid. ``pooled``: the
  indexer's layout instead — selected pools of 4 consecutive positions (unselected: 4 × -1), then a tail of
  consecutive positions partly -1, as attention.Indexer.select builds it (the kernel's one-TMA-per-pool path)."""
  ks = jax.random.split(jax.random.key(seed), 6)
  q = (jax.random.normal(ks[0], (B, T, H, M.D_LATENT)) * 0.6).astype(q_dtype)
  mag = jax.random.uniform(ks[1], (B, S, 1), minval=0.1, maxval=2.0)
  c = jax.random.normal(ks[2], (B, S, M.D_LATENT)) * mag
  rows = M.quantize_latent(c)
  idx = jax.random.randint(ks[3], (B, T, W), 0, S, jnp.int32)
  idx = jnp.where(jax.random.uniform(ks[4], (B, T, W)) < pad_frac, -1, idx)
  idx = idx.at[:, :, 0].set(jax.random.randint(ks[5], (B, T), 0, S, jnp.int32))
  if pooled:
    n_pool, tail = (W - 3) // 4, W - 4 * ((W - 3) // 4)
    pools = jax.random.randint(ks[3], (B, T, n_pool), 0, S // 4 - 1, jnp.int32)
    pools = jnp.where(jax.random.uniform(ks[4], (B, T, n_pool)) < pad_frac, -1, pools).at[:, :, 0].set(0)
    tok = jnp.where(pools[..., None] >= 0, pools[..., None] * 4 + jnp.arange(4, dtype=jnp.int32), -1)
    tail_pos = S - tail - 1 + jnp.arange(tail, dtype=jnp.int32)
    tail_pos = jnp.where(jnp.arange(tail) < tail - 1, tail_pos, -1)  # the last tail slot is padding
    idx = jnp.concatenate([tok.reshape(B, T, -1), jnp.broadcast_to(tail_pos, (B, T, tail))], axis=-1)
  if trailing_pad:
    idx = idx.at[:, :, W - trailing_pad:].set(-1)
  return q, rows, idx


def np_sparse_mla(q, cache, idx, scale):
  """Naive numpy: per (b, t), dequantise the valid selected rows and run a dense float64 softmax."""
  q = np.asarray(q.astype(jnp.float32), np.float64)
  words = np.asarray(cache)
  packed, sc = words[..., :128], words[..., 128:132].view(np.float32)  # the row: 128 packed words, 4 scales
  # the packed words' bytes, little-endian [.., word i, byte k]: value 128k + i (plane-major)
  c8 = np.swapaxes(np.ascontiguousarray(packed).view(np.uint8).reshape(*packed.shape, 4), -1, -2).view(F8)
  c = np.asarray(c8.astype(np.float32), np.float64)  # [.., 4 groups, 128]
  c8 = c8.reshape(*packed.shape[:-1], 512)
  c = (c * np.asarray(sc, np.float64)[..., None]).reshape(c8.shape)
  idx = np.asarray(idx)
  B, T, H, D = q.shape
  out = np.zeros((B, T, H, D))
  for b, t in itertools.product(range(B), range(T)):
    rows = c[b, idx[b, t][idx[b, t] >= 0]]  # [n, D]
    s = q[b, t] @ rows.T * scale  # [H, n]
    p = np.exp(s - s.max(-1, keepdims=True))
    out[b, t] = (p / p.sum(-1, keepdims=True)) @ rows
  return out


def assert_kernel_close(got, *wants):
  """The attention kernels' tolerance (f16 operands, f32 accumulation) against each of ``wants``: elementwise and
  in norm."""
  for want in wants:
    np.testing.assert_allclose(got, want, **tol("kernel_bf16"))
    assert np.linalg.norm(got - want) <= 2e-3 * np.linalg.norm(want)


def check_form_gpu(q, cache, idx, knob: str, **kw):
  """A kernel form natively, the step's way (lean, the merge kernel): ``knob`` on within the kernels' tolerance of
  the reference and of the same call with it off."""
  ref = np.asarray(jax.jit(lambda *a: M.sparse_mla_decode_reference(*a, softmax_scale=SCALE))(q, cache, idx))
  run = lambda on: np.asarray(jax.jit(lambda *a: M.sparse_mla_decode(  # noqa: E731
      *a, softmax_scale=SCALE, lean=True, combine="kernel", **kw, **{knob: on}))(q, cache, idx))
  assert_kernel_close(run(True), ref, run(False))


# ------------------------------------------------------------------------------------------------------------
# cache format
# ------------------------------------------------------------------------------------------------------------
def test_quantize_latent_roundtrip():
  rng = np.random.default_rng(11)
  c = rng.standard_normal((3, 7, 512)) * rng.uniform(0.01, 30.0, (3, 7, 1))
  c[0, 0, :128] = 0.0  # an all-zero group takes the 1e-4 floor, not a 0 scale
  c[1, 2, 256:384] *= 1e-6  # a group below the floor
  row = M.quantize_latent(jnp.asarray(c, jnp.float32))
  assert row.dtype == jnp.int32 and row.shape == (3, 7, M.ROW_WORDS)
  packed, s = M.split_row(row)
  assert packed.shape == (3, 7, 128) and s.shape == (3, 7, 4) and s.dtype == jnp.float32
  assert np.all(np.asarray(row)[..., 132:] == 0)  # the padding words
  c8 = M.unpack_e4m3(packed)
  assert c8.dtype == F8 and c8.shape == c.shape
  # the packed words hold the e4m3 bytes little-endian, plane-major: value 128k + i in byte k of word i (byte
  # plane k = scale group k)
  raw = np.asarray(jax.lax.bitcast_convert_type(c8, jnp.uint8)).astype(np.int64)
  words = np.asarray(packed).astype(np.int64) & 0xFFFFFFFF
  planes = np.swapaxes(raw.reshape(3, 7, 4, 128), -1, -2)  # [.., word i, byte k]
  np.testing.assert_array_equal(words, (planes << np.array([0, 8, 16, 24])).sum(-1))
  np.testing.assert_array_equal(np.asarray(M.pack_e4m3(c8)), np.asarray(packed))
  g = np.abs(c.astype(np.float32)).reshape(3, 7, 4, 128)
  np.testing.assert_allclose(np.asarray(s), np.maximum(g.max(-1), 1e-4) / 448.0, rtol=1e-6)
  back = np.asarray(M.dequantize_latent(row), np.float64)
  sb = np.repeat(np.asarray(s, np.float64), 128, -1)
  # e4m3: half an ulp is 2^-4 relative for normals, 2^-10 x scale absolute in the subnormal range.
  assert np.all(np.abs(back - c) <= 2.0 ** -4 * np.abs(c) + 2.0 ** -10 * sb + 1e-12)
  # the group maximum maps to +-448 exactly
  c8f = np.abs(np.asarray(c8.astype(jnp.float32))).reshape(3, 7, 4, 128).max(-1)
  big = g.max(-1) >= 1e-4
  np.testing.assert_array_equal(c8f[big], 448.0)
  # bf16 input goes through the same path
  rb = M.quantize_latent(jnp.asarray(c, jnp.bfloat16))
  assert rb.dtype == jnp.int32 and rb.shape == row.shape


# ------------------------------------------------------------------------------------------------------------
# reference
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("B,T,H,S,W", [(1, 1, 16, 64, 20), (2, 4, 16, 128, 50), (1, 3, 64, 96, 33)])
def test_reference_vs_numpy(B, T, H, S, W):
  q, cache, idx = make_inputs(B * 100 + T * 10 + W, B, T, H, S, W, pad_frac=0.3)
  got = np.asarray(M.sparse_mla_decode_reference(q, cache, idx, softmax_scale=SCALE))
  np.testing.assert_allclose(got, np_sparse_mla(q, cache, idx, SCALE), **tol("kernel_f32"))


@pytest.mark.parametrize("B,T,H,S,W", [(1, 16, 16, 200, 70), (2, 9, 32, 96, 33)])
def test_grouped_form_equals_the_reference(B, T, H, S, W):
  """The prefill's XLA form (bf16 products over the gathered e4m3 bytes, the scale groups as query rows, the
  probabilities as hi + lo bf16 terms) against the f32 reference on the same bf16 queries."""
  seed = int(np.random.default_rng().integers(1 << 30))
  q, cache, idx = make_inputs(seed, B, T, H, S, W, pad_frac=0.3, q_dtype=jnp.bfloat16)
  got = np.asarray(M.sparse_mla_grouped(q, cache, idx, softmax_scale=SCALE))
  np.testing.assert_allclose(got, np.asarray(M.sparse_mla_decode_reference(q, cache, idx, softmax_scale=SCALE)),
                             **tol("kernel_f32"), err_msg=f"seed {seed}")
  with pytest.raises(ValueError, match="float32.*expected bfloat16"):
    M.sparse_mla_grouped(q.astype(jnp.float32), cache, idx, softmax_scale=SCALE)


# ------------------------------------------------------------------------------------------------------------
# kernel, GPU interpret mode
# ------------------------------------------------------------------------------------------------------------
INTERP_CASES = [
    # B, T, H, S, W, blocks_per_split, trailing_pad, q dtype, pooled indices
    (1, 1, 16, 256, 64, None, 0, jnp.float32, False),
    (2, 4, 16, 256, 200, 2, 0, jnp.float32, False),  # 4 blocks -> 2 splits of 2 blocks; W padded 200 -> 256
    (1, 2, 32, 256, 130, 1, 100, jnp.bfloat16, False),  # 2 head groups; trailing padding: the 3rd split is all -1
    (2, 2, 16, 512, 135, None, 0, jnp.float32, True),  # the indexer's pools of 4 + a partly padded tail
]


@pytest.mark.parametrize("B,T,H,S,W,nbs,trail,qdt,pooled", INTERP_CASES)
def test_kernel_interpret(B, T, H, S, W, nbs, trail, qdt, pooled):
  q, cache, idx = make_inputs(7 + B + T + W, B, T, H, S, W, q_dtype=qdt, trailing_pad=trail, pooled=pooled)
  if pooled:  # both gather paths run: whole pools (and all-padding groups) and single rows (the tail)
    g = np.asarray(idx)[..., :4 * (W // 4)].reshape(B, T, -1, 4)
    assert (g[..., 0] >= 0).any() and (g[..., 0] < 0).any() and (np.asarray(idx)[..., -1] < 0).all()
  ref = np.asarray(M.sparse_mla_decode_reference(q, cache, idx, softmax_scale=SCALE))
  with maybe_interpret(True):
    got = np.asarray(jax.jit(lambda *a: M.sparse_mla_decode(*a, softmax_scale=SCALE, blocks_per_split=nbs))(
        q, cache, idx))
  assert got.shape == (B, T, H, M.D_LATENT) and got.dtype == np.float32
  assert_kernel_close(got, ref)  # (f16 operands: q rescaled, c dequantised to f16; f32 accumulation)


@pytest.mark.parametrize("B,T,H,S,W,nbs,trail,pooled,lean", [(2, 4, 16, 256, 200, 2, 0, False, False),
                                                              (2, 2, 16, 512, 390, 3, 0, True, True),
                                                              (1, 2, 32, 256, 130, 1, 100, False, False)])
def test_two_warpgroups_interpret(B, T, H, S, W, nbs, trail, pooled, lean):
  """sparse_mla_decode(warpgroups=2) (policy mla_dequant_warpgroups): a second warpgroup converts byte planes 2
  and 3 of every block, the two meeting at the ready / free barriers — bit for bit the one-warpgroup kernel (the
  same operations on the same values), at several blocks per split (the free barrier's hand-over), with padding
  and lean; refused in the tcgen05 form and for other counts."""
  q, cache, idx = make_inputs(31 + B + T + W, B, T, H, S, W, trailing_pad=trail, pooled=pooled)
  run = lambda w: jax.jit(lambda *a: M.sparse_mla_decode(*a, softmax_scale=SCALE, blocks_per_split=nbs,  # noqa: E731
                                                         lean=lean, warpgroups=w))(q, cache, idx)
  with maybe_interpret(True):
    one, two = np.asarray(run(1)), np.asarray(run(2))
  assert np.abs(two).max() > 0
  np.testing.assert_array_equal(two, one)
  for kw in ({"warpgroups": 3}, {"warpgroups": 2, "mma": "tcgen05"}):
    with pytest.raises(ValueError, match="sparse_mla_decode: warpgroups = [23]; expected 1 or 2"):
      M.sparse_mla_decode(q, cache, idx, softmax_scale=SCALE, **kw)


@pytest.mark.parametrize("B,T,H,S,W,nbs,trail,pooled,wgs", [(2, 4, 16, 256, 200, 2, 0, False, 1),
                                                             (2, 2, 16, 512, 390, 3, 0, True, 2),
                                                             (1, 2, 32, 256, 130, 1, 100, False, 1)])
def test_scales_after_interpret(B, T, H, S, W, nbs, trail, pooled, wgs):
  """sparse_mla_decode(scales_after=True) (policy mla_scales_after): the latent's block scales applied after the
  MMAs, per 128-dimension group — within the kernels' tolerance of the reference and of the default kernel (another
  rounding: c exact, s · p rounded to f16), at several blocks per split, with padding, one and two warpgroups;
  refused in the tcgen05 form."""
  q, cache, idx = make_inputs(51 + B + T + W, B, T, H, S, W, trailing_pad=trail, pooled=pooled)
  ref = np.asarray(M.sparse_mla_decode_reference(q, cache, idx, softmax_scale=SCALE))
  run = lambda sa: jax.jit(lambda *a: M.sparse_mla_decode(  # noqa: E731
      *a, softmax_scale=SCALE, blocks_per_split=nbs, warpgroups=wgs, scales_after=sa))(q, cache, idx)
  with maybe_interpret(True):
    got, base = np.asarray(run(True)), np.asarray(run(False))
  assert_kernel_close(got, ref, base)
  assert not np.array_equal(got, base)  # (the other rounding: a form that changed nothing would not be this one)
  with pytest.raises(ValueError, match="scales_after=True in the tcgen05 form"):
    M.sparse_mla_decode(q, cache, idx, softmax_scale=SCALE, scales_after=True, mma="tcgen05")


def _group_cases(idx, S):
  """idx [B, T, W] (pooled lists) with groups of 4 slots (starting at slot 4) rewritten to reach each branch of
  the one-arrival gather (sparse_mla_decode(group_arrival=True)): a pool with a hole [a, -1, a + 2, a + 3] and a
  tail with trailing padding [a, a + 1, -1, -1] (one TMA of 4 rows, the holes masked), a run past the cache's end
  [S - 2, S - 1, -1, -1], a leading hole [-1, b, b + 1, b + 2] and two unrelated positions [c, d, -1, -1] (a TMA a
  row on the second barrier), an all-padding group, and a run ending at the last row [S - 4 .. S - 1]."""
  cases = [[40, -1, 42, 43], [60, 61, -1, -1], [S - 2, S - 1, -1, -1], [-1, 81, 82, 83], [90, 17, -1, -1],
           [-1, -1, -1, -1], [S - 4, S - 3, S - 2, S - 1]]
  for i, g in enumerate(cases):
    idx = idx.at[:, :, 4 * (i + 1):4 * (i + 2)].set(jnp.asarray(g, jnp.int32))
  return idx


@pytest.mark.parametrize("B,T,S,W,nbs,pooled,sa", [(1, 4, 256, 300, 2, True, True), (2, 2, 512, 390, 3, True, False),
                                                   (1, 2, 256, 200, 1, False, True)])
def test_group_arrival_interpret(B, T, S, W, nbs, pooled, sa):
  """sparse_mla_decode(group_arrival=True) (policy mla_group_arrival): the gathers' barrier counting a group of 4
  rows once — bit for bit the default kernel (the same rows in every valid slot; the padding slots, masked, may
  hold other rows) over lists with every kind of group (pooled lists with ``_group_cases``; random positions: the
  per-row path nearly everywhere), with and without the scales after the MMAs; refused in the tcgen05 form."""
  q, cache, idx = make_inputs(71 + B + T + W, B, T, 16, S, W, pooled=pooled)
  if pooled:
    idx = _group_cases(idx, S)
  run = lambda ga: jax.jit(lambda *a: M.sparse_mla_decode(  # noqa: E731
      *a, softmax_scale=SCALE, blocks_per_split=nbs, scales_after=sa, group_arrival=ga))(q, cache, idx)
  with maybe_interpret(True):
    got, base = np.asarray(run(True)), np.asarray(run(False))
  np.testing.assert_array_equal(got, base)
  ref = np.asarray(M.sparse_mla_decode_reference(q, cache, idx, softmax_scale=SCALE))
  np.testing.assert_allclose(got, ref, **tol("kernel_bf16"))
  with pytest.raises(ValueError, match="group_arrival=True in the tcgen05 form"):
    M.sparse_mla_decode(q, cache, idx, softmax_scale=SCALE, group_arrival=True, mma="tcgen05")


@pytest.mark.parametrize("B,T,H,S,W,nbs,qdt,sa,wgs", [(1, 1, 16, 256, 64, None, jnp.float32, True, 1),
                                                        (2, 2, 32, 256, 200, 2, jnp.bfloat16, False, 1),
                                                        (1, 2, 16, 512, 300, 2, jnp.float32, True, 2)])
def test_q_in_kernel_interpret(B, T, H, S, W, nbs, qdt, sa, wgs):
  """sparse_mla_decode(q_in_kernel=True) (policy mla_q_in_kernel): the query read as it is (f32 / bf16) and
  rescaled to f16 in each CTA's prologue — within the kernels' tolerance of the reference and of the default kernel
  (one head group: the same r, the division rounded in another place; two head groups, H = 32: an r each), with
  the scales before / after the MMAs (group-major queries: the K = 512 product as 4 MMAs) and two warpgroups;
  refused in the tcgen05 form."""
  q, cache, idx = make_inputs(91 + B + T + W, B, T, H, S, W, q_dtype=qdt)
  q = q * jnp.asarray(np.random.default_rng().uniform(0.05, 4.0), q.dtype)  # (the rescale at another magnitude)
  ref = np.asarray(M.sparse_mla_decode_reference(q, cache, idx, softmax_scale=SCALE))
  run = lambda qi: jax.jit(lambda *a: M.sparse_mla_decode(  # noqa: E731
      *a, softmax_scale=SCALE, blocks_per_split=nbs, scales_after=sa, warpgroups=wgs, q_in_kernel=qi))(q, cache, idx)
  with maybe_interpret(True):
    got, base = np.asarray(run(True)), np.asarray(run(False))
  assert np.abs(got).max() > 0
  assert_kernel_close(got, ref, base)
  with pytest.raises(ValueError, match="q_in_kernel=True in the tcgen05 form"):
    M.sparse_mla_decode(q, cache, idx, softmax_scale=SCALE, q_in_kernel=True, mma="tcgen05")


@pytest.mark.parametrize("B,T,H,S,W,nbs,stages,trail,pooled,lean,sa,ga,wgs", [
    (2, 2, 16, 256, 390, 7, 2, 0, False, False, True, False, 1),
    (1, 2, 16, 512, 390, 7, 3, 0, True, True, True, True, 1),
    (1, 2, 32, 256, 130, 3, None, 100, False, False, False, False, 1),
    (1, 2, 16, 512, 390, 7, 3, 0, True, True, True, False, 2)])
def test_gather_warpgroup_interpret(B, T, H, S, W, nbs, stages, trail, pooled, lean, sa, ga, wgs):
  """sparse_mla_decode(gather_warpgroup=True) (policy mla_gather_warpgroup): one more warpgroup issues the blocks'
  gathers into a ring of 2 or 3 slots, each slot refilled once the converting warpgroups have converted it — bit
  for bit the one-warpgroup kernel, at more blocks a split than slots (the ring wraps, the consumed barriers'
  phases), with padding, the scales after the MMAs, grouped arrivals (their own barrier, waited on by the
  gathering warpgroup), lean, and beside the dequantisation's second warpgroup (three warpgroups); refused in the
  tcgen05 form and for other slot counts."""
  q, cache, idx = make_inputs(7 + B + T + W, B, T, H, S, W, trailing_pad=trail, pooled=pooled)
  run = lambda **kw: np.asarray(jax.jit(lambda *a: M.sparse_mla_decode(  # noqa: E731
      *a, softmax_scale=SCALE, blocks_per_split=nbs, lean=lean, scales_after=sa, group_arrival=ga, **kw))(
          q, cache, idx))
  with maybe_interpret(True):
    one, got = run(), run(gather_warpgroup=True, stages=stages, warpgroups=wgs)
  assert np.abs(got).max() > 0
  np.testing.assert_array_equal(got, one)
  with pytest.raises(ValueError, match="gather_warpgroup=True in the tcgen05 form"):
    M.sparse_mla_decode(q, cache, idx, softmax_scale=SCALE, gather_warpgroup=True, mma="tcgen05")
  for kw in ({"stages": 4, "gather_warpgroup": True}, {"stages": 3}):
    with pytest.raises(ValueError, match="sparse_mla_decode: stages = [34]; expected 2 or 3, with gather_warpgroup"):
      M.sparse_mla_decode(q, cache, idx, softmax_scale=SCALE, **kw)


def test_gather_warpgroup_slots_fit_the_smem():
  """The gather ring's SMEM: 3 slots fit a CTA at a prefill chunk's 33 blocks a split with bf16 queries (2 are the
  default: 3 measured slower), not with q_in_kernel's f32 raw queries beside them — asked for there, refused, naming
  the bytes."""
  assert M._mla_smem(33, 16, 3, True, False, jnp.bfloat16) <= M.SMEM_BYTES
  assert M._mla_smem(33, 16, 3, True, True, jnp.float32) > M.SMEM_BYTES >= M._mla_smem(33, 16, 2, True, True,
                                                                                      jnp.float32)
  q, cache, idx = make_inputs(3, 1, 1, 16, 4096, 2051, pooled=True)
  with pytest.raises(ValueError, match=r"3 gather slots, 33 blocks a split and the queries' float32 need \d+ bytes"):
    M.sparse_mla_decode(q, cache, idx, softmax_scale=SCALE, blocks_per_split=33, gather_warpgroup=True, stages=3,
                        scales_after=True, q_in_kernel=True)


@pytest.mark.parametrize("B,T", [(1, 4)])
def test_two_warpgroups_cross_lower(B, T):
  """The two-warpgroup and scales-after forms (and both) at the real rank's shapes (16 heads, 2,051 positions;
  lean, the merge kernel: the step's form) lower for CUDA — each a module of its own. (B x T = 8 x 4 too until
  session 68: its grid differs only in size; the suite's ~10 s went to the one-grid KDA's tests.)"""
  args = (SDS((B, T, 16, 512), jnp.bfloat16), SDS((B, 65536, M.ROW_WORDS), jnp.int32), SDS((B, T, 2051), jnp.int32))
  forms = {"one": {}, "two": dict(warpgroups=2), "after": dict(scales_after=True),
           "both": dict(warpgroups=2, scales_after=True), "group": dict(scales_after=True, group_arrival=True),
           "q_in": dict(scales_after=True, q_in_kernel=True), "q_in_two": dict(warpgroups=2, q_in_kernel=True),
           "gather": dict(scales_after=True, gather_warpgroup=True),
           "gather_two": dict(scales_after=True, gather_warpgroup=True, warpgroups=2)}
  low = {f: cross_lower(lambda *a, kw=kw: M.sparse_mla_decode(*a, softmax_scale=SCALE, combine="kernel", lean=True,
                                                              **kw), *args).as_text() for f, kw in forms.items()}
  hashes = {f: [ln.split("kernel_hash = ")[1][:40] for ln in t.splitlines() if "glm5_sparse_mla" in ln]
            for f, t in low.items()}
  assert all(len(h) == 1 for h in hashes.values()) and len({h[0] for h in hashes.values()}) == len(forms), hashes


def test_prefill_form_cross_lower():
  """mla_prefill's form — a prefill chunk of 256 rows (and a verify step of 32 x 4), 2,051 positions, the merge
  kernel, no decode knob (lean, the mla_* forms: off in a chunk) — lowers for CUDA with the chunk's bf16 query; and
  a 512-row chunk's gather-warpgroup form (33 blocks a CTA, the 3-slot ring, lean, the scales after the MMAs)."""
  for B, T, kw in ((1, 256, {}), (32, 4, {}),
                   (1, 512, dict(gather_warpgroup=True, lean=True, scales_after=True))):
    args = (SDS((B, T, 16, 512), jnp.bfloat16), SDS((B, 32784, M.ROW_WORDS), jnp.int32), SDS((B, T, 2051), jnp.int32))
    text = cross_lower(lambda *a, kw=kw: M.sparse_mla_decode(*a, softmax_scale=SCALE, combine="kernel", **kw),
                       *args).as_text()
    assert "glm5_sparse_mla" in text and "glm5_mla_combine" in text


def test_prefill_attention_kernel_at_the_model_site(monkeypatch):
  """Policy knob mla_prefill (a prefill chunk's DSA attention through the sparse MLA kernel, GPU interpret mode)
  against XLA's grouped form at the model's site: kernel-tiny in bf16 with its FP8 latent cache, the target's chunk
  program (every decode kernel off, as in a prefill) over a 13-token prompt in two 8-row chunks (the second attends
  to the first's FP8 latents) — the trunk's hidden states within bf16 rounding; then Decoder.prefill with the knob
  on reports its site in the chunk. Every expert routed (4 of 4): the DSA layer is the last one, and its MoE's
  top-k would be the only discrete decision downstream of the attention (test_decode's W_UV test says why). With
  mla_gather_warpgroup (a form knob a chunk keeps) on and off: its site reported where each CTA runs several blocks
  — the index list unsplit (as at a real 512-row chunk: 33 blocks a CTA; here a 1-SM grid's split rule, 5 blocks)
  — and the hidden states bit for bit."""
  monkeypatch.setattr(M, "NUM_SMS", 1)
  m = load(tiny_checkpoint("kernel-tiny", 4, "fp8", n_routed_experts=4), "bfloat16")
  assert m.cfg.layer_types[-1] != "linear_attention"
  toks = np.random.default_rng().integers(0, 2000, (1, 13)).astype(np.int32)
  hs = {}
  for on in (False, "gather", True):
    # (every decode kernel off — a chunk's policy turns them off anyway — but the knobs of the kernel's forms,
    # which a chunk keeps: the step's lean build with the scales after the MMAs)
    off = {k: False for k in KERNEL_DEFAULTS if k not in PREFILL_FORM_KNOBS}
    pol = tuple(sorted({**off, "mla_prefill": bool(on), "mla_gather_warpgroup": on == "gather",
                        "kv_cache_dtype": "fp8"}.items()))
    dec = Decoder(m, DecodeConfig(max_context=64, q=2, capture_sizes=(1,), policy=pol), backend="latency_specialized",
                  prefill_chunk=8)
    hs[on], rep = target_hidden_in_chunks(dec, m, toks, 13, 8, dec.prefill_kernel_mode())
    assert (("mla_prefill", None) in rep) == bool(on), rep
    if on:  # (the forms the step's defaults take)
      assert {("lean_barriers", None), ("mla_scales_after", None)} <= set(rep), rep
    assert (("mla_gather_warpgroup", None) in rep) == (on == "gather"), rep
  np.testing.assert_array_equal(hs["gather"], hs[True])
  np.testing.assert_allclose(hs[True], hs[False], **tol("kernel_bf16"))
  assert np.linalg.norm(hs[True] - hs[False]) <= 1e-2 * np.linalg.norm(hs[False])
  dec.prefill([toks[0]])  # (the last policy's: the knob on)
  assert dec.prefill_sites["mla_prefill"]["sites"] > 0


def test_q_in_kernel_cross_lower():
  """The in-kernel query rescale lowers for CUDA with the step's f32 query (XLA's W_UKᵀ q at one row) and its q = 4
  verify's, in the step's form (lean, the merge kernel, the scales after the MMAs)."""
  for B, T in ((1, 1), (1, 4)):
    args = (SDS((B, T, 16, 512), jnp.float32), SDS((B, 65536, M.ROW_WORDS), jnp.int32), SDS((B, T, 2051), jnp.int32))
    text = cross_lower(lambda *a: M.sparse_mla_decode(*a, softmax_scale=SCALE, combine="kernel", lean=True,
                                                      scales_after=True, q_in_kernel=True), *args).as_text()
    assert "glm5_sparse_mla" in text and "stablehlo.reduce" not in text  # (no XLA reduction before the kernel)


@pytest.mark.parametrize("B,T,H,S,W,nbs,trail,pooled", [(1, 1, 16, 512, 300, None, 0, True),
                                                        (2, 2, 32, 512, 260, 1, 60, False),
                                                        (1, 2, 16, 1024, 520, 2, 0, True)])
def test_kernel_tcgen05_interpret(B, T, H, S, W, nbs, trail, pooled):
  """mma='tcgen05' (Blackwell: blocks of 128 positions, the latent dequantised one 128-dimension group at a time,
  S^T and O^T's groups as tcgen05 MMAs into tensor memory) in GPU interpret mode: the reference within the kernels'
  tolerance, as the wgmma form (the two differ by P's f16 rounding: a 128-position block's running max is not a
  64-position one's) — whole pools and single rows gathered, two head groups, an all-padding split, several blocks a
  split; the index width a multiple of its 128-position blocks."""
  q, cache, idx = make_inputs(5 + B + T + W, B, T, H, S, W, q_dtype=jnp.bfloat16, trailing_pad=trail, pooled=pooled)
  ref = np.asarray(M.sparse_mla_decode_reference(q, cache, idx, softmax_scale=SCALE))
  run = lambda mma: np.asarray(jax.jit(lambda *a: M.sparse_mla_decode(  # noqa: E731
      *a, softmax_scale=SCALE, blocks_per_split=nbs, mma=mma))(q, cache, idx))
  with maybe_interpret(True):
    hop, got = run("wgmma"), run("tcgen05")
  for out in (got, hop):
    np.testing.assert_allclose(out, ref, **tol("kernel_bf16"))
    assert np.linalg.norm(out - ref) <= 2e-3 * np.linalg.norm(ref)
  assert np.linalg.norm(got - hop) <= 2e-3 * np.linalg.norm(ref)
  for w in (W, 2051):
    wp = M.index_width(B, T, H, w, mma="tcgen05")
    assert wp >= w and wp % M.TC_KEYS == 0 and M.index_width(B, T, H, wp, mma="tcgen05") == wp


@pytest.mark.parametrize("B,T,H", [(1, 1, 16), (1, 4, 16), (8, 4, 16), (32, 1, 64)])
def test_cross_lower_tcgen05(B, T, H, monkeypatch):
  """The tcgen05 form lowers for CUDA at the real configurations, Mosaic's layout inference told the target is
  sm_100 (as benchmarks/step_census.py does for a B200)."""
  from jax.experimental.mosaic.gpu import utils as mgpu_utils  # noqa: PLC0415
  monkeypatch.setattr(mgpu_utils, "_infer_arch", lambda: (10, 0))
  args = (SDS((B, T, H, 512), jnp.bfloat16), SDS((B, 65536, M.ROW_WORDS), jnp.int32), SDS((B, T, 2051), jnp.int32))
  txt = cross_lower(lambda *a: M.sparse_mla_decode(*a, softmax_scale=SCALE, combine="kernel", transposed=True,
                                                   mma="tcgen05"), *args).as_text()
  assert "mosaic_gpu" in txt


@pytest.mark.parametrize("B,T,H,S,W,nbs", [(2, 1, 16, 256, 64, None), (1, 1, 32, 1024, 520, 1)])
def test_combine_forms_interpret(B, T, H, S, W, nbs):
  """The splits' merge as a Mosaic launch of its own (combine="kernel") == XLA's merge (to f32 rounding: another
  order of the adds) and the reference."""
  q, cache, idx = make_inputs(11 + B + T + W, B, T, H, S, W, q_dtype=jnp.float32)
  ref = np.asarray(M.sparse_mla_decode_reference(q, cache, idx, softmax_scale=SCALE))
  run = lambda c: np.asarray(jax.jit(lambda *a: M.sparse_mla_decode(  # noqa: E731
      *a, softmax_scale=SCALE, blocks_per_split=nbs, combine=c))(q, cache, idx))
  with maybe_interpret(True):
    xla = run("xla")
    got = run("kernel")
  np.testing.assert_allclose(got, xla, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(got, ref, **tol("kernel_bf16"))


def test_combine_rejects_bad_forms():
  q, cache, idx = make_inputs(3, 4, 5, 16, 1024, 600)
  with pytest.raises(ValueError, match="combine = 'fused', expected one of"):
    M.sparse_mla_decode(q, cache, idx, softmax_scale=SCALE, combine="fused")


def _gather_dequant(cache, rows):
  """The kernel's gather + dequantisation of one 64-row block alone: one copy per cache row (latent and scales),
  then ``_dequant_block`` -> [64, 512] f16, the latent dimensions in order."""
  from jax.experimental import pallas as pl  # noqa: PLC0415
  from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: PLC0415

  def body(c_g, idx_g, o_g, idx_s, c_s, c16_s, bar, gbar):
    plgpu.copy_gmem_to_smem(idx_g, idx_s, bar.at[0])
    plgpu.barrier_wait(bar.at[0])

    def row(j, carry):
      r = idx_s[0, j]
      plgpu.copy_gmem_to_smem(c_g.at[pl.ds(r, 1)], c_s.at[pl.ds(j, 1)], gbar.at[0])
      return carry
    jax.lax.fori_loop(0, M.BLOCK, row, None)
    plgpu.barrier_wait(gbar.at[0])
    M._dequant_block(c_s, c16_s)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(c16_s, o_g)
    plgpu.wait_smem_to_gmem(0)

  kern = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((M.BLOCK, M.D_LATENT), jnp.float16), scratch_types=[
      plgpu.SMEM((1, M.BLOCK), jnp.int32), plgpu.SMEM((M.BLOCK, M.ROW_WORDS), jnp.int32),
      plgpu.SMEM((M.BLOCK, M.D_LATENT), jnp.float16, transforms=M._F16_SW32),
      plgpu.Barrier(num_barriers=1), plgpu.Barrier(num_arrivals=M.BLOCK, num_barriers=1)])
  return kern(cache, rows.reshape(1, M.BLOCK))


def _check_gather_dequant():
  rng = np.random.default_rng(5)
  # (each 128-value group of a row at its own magnitude: a byte plane read with another group's scale shows)
  c = (rng.standard_normal((300, 4, 128)) * rng.uniform(0.01, 3.0, (300, 4, 1))).reshape(300, M.D_LATENT)
  c = c.astype(np.float32)
  c[7, :128] = rng.standard_normal(128) * 1e-7  # below the scale floor: e4m3 subnormal codes
  c[7, 5] = 0.0
  cache = M.quantize_latent(jnp.asarray(c))
  rows = jnp.asarray(np.r_[7, rng.integers(0, 300, M.BLOCK - 1)].astype(np.int32))
  got = np.asarray(jax.jit(_gather_dequant)(cache, rows), np.float32)
  want = np.asarray(M.dequantize_latent(cache[rows]))
  codes = np.asarray(jax.lax.bitcast_convert_type(M.unpack_e4m3(M.split_row(cache[7])[0]), jnp.uint8))
  assert ((codes & 0x78) == 0).sum() > 3  # subnormal codes (exponent 0) are exercised
  np.testing.assert_allclose(got, want.astype(np.float16).astype(np.float32), rtol=1e-3, atol=0)


def test_gather_dequant_block_interpret():
  """The building block where native and interpret mode parted (8-bit register loads): exact up to f16."""
  with maybe_interpret(True):
    _check_gather_dequant()


@pytest.mark.parametrize("NS", [1, 2, 33])
def test_combine_splits_is_the_weighted_merge(NS):
  """combine_splits (one variadic reduction, the online-softmax merge) == Σ_s 2^lse_s o_s / Σ_s 2^lse_s in float64,
  an all-padding split (lse ~ -1e30) weighing nothing."""
  rng = np.random.default_rng()
  o = rng.standard_normal((3, NS, 512, 16)).astype(np.float32)
  lse = (rng.standard_normal((3, NS, 16)) * 8).astype(np.float32)
  if NS > 1:
    lse[:, -1] = -1e30
  got = np.asarray(jax.jit(M.combine_splits)(jnp.asarray(o), jnp.asarray(lse)))
  w = np.exp2(lse.astype(np.float64) - lse.max(axis=1, keepdims=True))
  want = (o * w[:, :, None, :]).sum(1) / w.sum(1)[:, None, :]
  np.testing.assert_allclose(got, want, **tol("kernel_f32"))


def test_split_choice():
  # B = 1: one 64-position block per CTA (33 CTAs for W = 2051); B*T = 256: few splits
  assert M._pick_blocks_per_split(33, 1) == 1
  assert M._pick_blocks_per_split(34, 32) in (4, 5)
  assert M._pick_blocks_per_split(34, 256) == 17


def test_index_width_is_a_fixed_point():
  """An index list written at index_width's width (the select kernel's output) runs the same splits as the list
  it pads, and is not padded again: the width is a multiple of 64 · blocks per split, at least W, and maps to
  itself."""
  for B, T, H, W in itertools.product([1, 2, 8, 32], [1, 3, 4, 8], [16, 64], [11, 35, 64, 2051, 2054, 4099]):
    wp = M.index_width(B, T, H, W)
    assert wp >= W and wp % M.BLOCK == 0, (B, T, H, W, wp)
    assert M.index_width(B, T, H, wp) == wp and M.num_splits(B, T, H, wp) == M.num_splits(B, T, H, W), (B, T, H, W)


# ------------------------------------------------------------------------------------------------------------
# CUDA cross-lowering of the real configurations
# ------------------------------------------------------------------------------------------------------------
REAL = list(itertools.product([1, 8, 32], [1, 4, 8], [16, 64]))


@pytest.mark.parametrize("B,T,H", REAL)
def test_cross_lower_real(B, T, H):
  S, W = 65536, 2176  # 2051 real + padding to a multiple of 128 (vLLM's buffer width)
  args = (SDS((B, T, H, 512), jnp.bfloat16), SDS((B, S, M.ROW_WORDS), jnp.int32), SDS((B, T, W), jnp.int32))
  txt = cross_lower(lambda *a: M.sparse_mla_decode(*a, softmax_scale=SCALE), *args).as_text()
  assert "mosaic_gpu" in txt


@pytest.mark.parametrize("B,T,combine", [(1, 4, "kernel"), (8, 4, "kernel")])
def test_cross_lower_combine_forms(B, T, combine):
  args = (SDS((B, T, 16, 512), jnp.bfloat16), SDS((B, 65536, M.ROW_WORDS), jnp.int32), SDS((B, T, 2051), jnp.int32))
  txt = cross_lower(lambda *a: M.sparse_mla_decode(*a, softmax_scale=SCALE, combine=combine), *args).as_text()
  assert "mosaic_gpu" in txt


def test_lean_attention_tail_lowers_without_automatic_barriers(monkeypatch):
  """lean=True (policy knob lean_barriers): the attention, merge and W_UV kernels and the latent's norms kernel
  lower for CUDA at TP4's shapes without Mosaic GPU's automatic barriers — a fraction of the default build's
  bar.sync (the attention kernel keeps its commit_smem barriers; the merge needs none)."""
  args = (SDS((1, 1, 16, 512), jnp.bfloat16), SDS((1, 32784, M.ROW_WORDS), jnp.int32), SDS((1, 1, 2176), jnp.int32))
  uv = (SDS((1, 512, 16), jnp.float32), SDS((16, 512, 512), jnp.bfloat16))
  norms = (SDS((1, 1536 + 512), jnp.bfloat16), SDS((1536,), jnp.bfloat16), SDS((512,), jnp.bfloat16))
  got = {}
  for lean in (False, True):
    def tail(q, c, i, o_t, w, qkv, wq, wkv, lean=lean):
      o = M.sparse_mla_decode(q, c, i, softmax_scale=SCALE, combine="kernel", transposed=True, lean=lean)
      return o, M.mla_absorb_uv(o_t, w, dn=256, lean=lean), M.latent_norms(qkv, wq, wkv, eps=1e-6, lean=lean)
    got[lean] = barrier_counts(monkeypatch, ("glm5_sparse_mla", "glm5_mla_combine", "glm5_mla_uv", "glm5_latent_norms"),
                               tail, *args, *uv, *norms)
  assert 0 < 2 * got[True]["glm5_latent_norms"] < got[False]["glm5_latent_norms"], got
  for k in ("glm5_sparse_mla", "glm5_mla_uv"):
    assert 0 < got[True][k] < got[False][k] // 3, got
  assert got[True]["glm5_mla_combine"] == 0 < got[False]["glm5_mla_combine"], got


def test_layout_inference_naming_patch_lowers_identically(monkeypatch):
  """pallas_kernels._common numbers a module's values once per Mosaic GPU layout inference (jax's own naming
  printed every operation with a fresh numbering: ~30 % of a kernel's lowering) and hashes its frozen values once
  (~20 %): every variable of the attention and W_UV kernels gets jax's own name (ValueSite.__str__ of jax 0.11.2:
  the printed operation's first tokens), and the kernels lower to the same text — their serialised modules
  included — as with jax's naming and hashing. (The lowering memo is cleared so that both lowerings run the layout
  inference.)"""
  from jax._src.pallas.mosaic_gpu import pallas_call_registration as reg  # noqa: PLC0415
  from jax.experimental.mosaic.gpu import layout_inference as li  # noqa: PLC0415
  args = (SDS((1, 4, 16, 512), jnp.bfloat16), SDS((1, 32784, M.ROW_WORDS), jnp.int32), SDS((1, 4, 2176), jnp.int32),
          SDS((16, 512, 512), jnp.bfloat16))

  def tail(q, c, i, w):
    return M.mla_absorb_uv(M.sparse_mla_decode(q, c, i, softmax_scale=SCALE, combine="kernel", transposed=True), w,
                           dn=256)

  named, seen = li.ValueSite.__str__, []

  def checked(site):
    got = named(site)
    tag = {li.VariableType.OPERAND: "o", li.VariableType.RESULT: "r"}.get(site.type, "a")
    seen.append((got, f"{li._op_name_regex.match(str(site.operation)).group(0)}:{tag}-{site.index}"))
    return got

  kept, patched = reg.lowering.lower_unpipelined_jaxpr_to_module.kept, li.infer_layout
  assert patched.unmemoized is not patched
  kept.clear()
  with monkeypatch.context() as m:
    m.setattr(li.ValueSite, "__str__", checked)
    fast = cross_lower(tail, *args).as_text()
  assert len(seen) > 100 and [a for a, b in seen if a != b] == [], seen[:3]
  kept.clear()
  monkeypatch.setattr(li, "infer_layout", patched.unmemoized)
  # (and with the frozen values' plain hashes: pallas_kernels._common._cache_layout_hashes)
  from jax.experimental.mosaic.gpu import constraints as cs  # noqa: PLC0415
  cached = [c for c in [getattr(cs, n) for n in dir(cs)] + [li.ValueSite]
            if isinstance(c, type) and hasattr(vars(c).get("__hash__"), "plain")]
  assert {"Variable", "Equals", "ValueSite"} <= {c.__name__ for c in cached}, cached
  for c in cached:
    monkeypatch.setattr(c, "__hash__", c.__hash__.plain)
  slow = cross_lower(tail, *args).as_text()
  assert fast.count("mosaic_gpu_v2") == slow.count("mosaic_gpu_v2") >= 3 and fast == slow


def test_cross_lower_unpadded_width():
  args = (SDS((1, 4, 16, 512), jnp.float32), SDS((1, 65536, M.ROW_WORDS), jnp.int32), SDS((1, 4, 2051), jnp.int32))
  cross_lower(lambda *a: M.sparse_mla_decode(*a, softmax_scale=SCALE), *args)


# ------------------------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_gather_dequant_block_gpu():
  _check_gather_dequant()


@pytest.mark.blackwell
@pytest.mark.parametrize("B,T,H,S,W,nbs,pooled", [(1, 1, 16, 65536, 2051, None, True), (1, 4, 16, 65536, 2051, 2, False),
                                                  (8, 4, 16, 32768, 2051, None, True), (2, 8, 64, 8192, 2176, None, False)])
def test_kernel_tcgen05_blackwell(B, T, H, S, W, nbs, pooled):
  """The tcgen05 form natively on a Blackwell GPU against the reference, then W_UV's tcgen05 form on its merged
  O^T against W_UV's reference (the model's chain)."""
  q, cache, idx = make_inputs(B + T + H, B, T, H, S, W, q_dtype=jnp.bfloat16, trailing_pad=0 if pooled else W % 64,
                              pooled=pooled)
  ref = np.asarray(jax.jit(lambda *a: M.sparse_mla_decode_reference(*a, softmax_scale=SCALE))(q, cache, idx))
  got = np.asarray(jax.jit(lambda *a: M.sparse_mla_decode(*a, softmax_scale=SCALE, blocks_per_split=nbs,
                                                          mma="tcgen05"))(q, cache, idx))
  np.testing.assert_allclose(got, ref, **tol("kernel_bf16"))
  assert np.linalg.norm(got - ref) <= 2e-3 * np.linalg.norm(ref)
  if B * T <= M.UV_MAX_TOKENS:
    o_t, w_kv = uv_inputs(np.random.default_rng(B + T), B * T, H, H)
    want = jax.jit(lambda o, w: M.mla_absorb_uv_reference(o, w, dn=256))(o_t, w_kv)
    uv = jax.jit(lambda o, w: M.mla_absorb_uv(o, w, dn=256, mma="tcgen05"))(o_t, w_kv)
    np.testing.assert_allclose(np.asarray(uv, np.float32), np.asarray(want, np.float32), **tol("kernel_bf16"))


@pytest.mark.gpu
@pytest.mark.parametrize("B,T,H,S,W,nbs,pooled,lean", [(1, 1, 16, 65536, 2051, None, False, False),
                                                       (8, 4, 16, 65536, 2051, None, False, False),
                                                       (2, 8, 64, 8192, 2176, None, False, False),
                                                       (1, 4, 16, 65536, 2051, 4, False, False),
                                                       (1, 1, 16, 32768, 2051, None, True, False),
                                                       (8, 4, 16, 32768, 2051, None, True, False),
                                                       # a prefill chunk's 256 rows (policy mla_prefill)
                                                       (1, 256, 16, 32768, 2051, None, True, False),
                                                       # lean: without the automatic barriers (lean_barriers)
                                                       (1, 1, 16, 32768, 2051, None, True, True),
                                                       (1, 4, 16, 65536, 2051, 4, False, True),
                                                       (8, 4, 16, 32768, 2051, None, True, True)])
def test_kernel_gpu(B, T, H, S, W, nbs, pooled, lean):
  """Natively against the reference (lean: the kernel built without Mosaic's automatic barriers — also at 4
  blocks per CTA, where the double-buffered gathers and the dequantised block are rewritten — and bit for bit
  the default build, the merge kernel's too)."""
  q, cache, idx = make_inputs(B + T + H, B, T, H, S, W, q_dtype=jnp.bfloat16, trailing_pad=0 if pooled else W % 64,
                              pooled=pooled)
  ref = np.asarray(jax.jit(lambda *a: M.sparse_mla_decode_reference(*a, softmax_scale=SCALE))(q, cache, idx))

  def run(lean, combine="xla"):
    return np.asarray(jax.jit(lambda *a: M.sparse_mla_decode(*a, softmax_scale=SCALE, blocks_per_split=nbs,
                                                             lean=lean, combine=combine))(q, cache, idx))
  got = run(lean)
  np.testing.assert_allclose(got, ref, **tol("kernel_bf16"))
  assert np.linalg.norm(got - ref) <= 2e-3 * np.linalg.norm(ref)
  if lean:
    np.testing.assert_array_equal(got, run(False))
    np.testing.assert_array_equal(run(True, "kernel"), run(False, "kernel"))


@pytest.mark.gpu
def test_prefill_forms_gpu():
  """mla_prefill's site in the step's forms (a chunk keeps the form knobs: lean, the scales after the MMAs) and
  with one gather arrival per group, natively at a chunk's 256 rows against the reference."""
  q, cache, idx = make_inputs(77, 1, 256, 16, 32768, 2051, q_dtype=jnp.bfloat16, pooled=True)
  ref = np.asarray(jax.jit(lambda *a: M.sparse_mla_decode_reference(*a, softmax_scale=SCALE))(q, cache, idx))
  for kw in (dict(lean=True, scales_after=True), dict(lean=True, scales_after=True, group_arrival=True)):
    got = np.asarray(jax.jit(lambda *a, kw=kw: M.sparse_mla_decode(*a, softmax_scale=SCALE, combine="kernel",
                                                                   **kw))(q, cache, idx))
    np.testing.assert_allclose(got, ref, **tol("kernel_bf16"), err_msg=str(kw))
    assert np.linalg.norm(got - ref) <= 2e-3 * np.linalg.norm(ref), kw


@pytest.mark.gpu
@pytest.mark.parametrize("B,T,nbs", [(1, 1, None), (1, 4, None), (8, 4, None), (1, 4, 4)])
def test_two_warpgroups_gpu(B, T, nbs):
  """The two-warpgroup dequantisation natively (policy mla_dequant_warpgroups): bit for bit the one-warpgroup
  kernel (lean, pooled lists: the step's form), one and several blocks per split."""
  q, cache, idx = make_inputs(B + T + 40, B, T, 16, 32768, 2051, q_dtype=jnp.bfloat16, pooled=True)
  run = lambda w: np.asarray(jax.jit(lambda *a: M.sparse_mla_decode(  # noqa: E731
      *a, softmax_scale=SCALE, blocks_per_split=nbs, lean=True, combine="kernel", warpgroups=w))(q, cache, idx))
  one, two = run(1), run(2)
  assert np.abs(two).max() > 0
  np.testing.assert_array_equal(two, one)


@pytest.mark.gpu
@pytest.mark.parametrize("B,T,nbs,stages,wgs", [(1, 4, 4, 2, 1), (8, 4, None, None, 1), (1, 512, None, 3, 1),
                                                 (1, 512, None, 2, 1), (1, 512, None, 3, 2)])
def test_gather_warpgroup_gpu(B, T, nbs, stages, wgs):
  """The gather warpgroup natively (policy mla_gather_warpgroup): bit for bit the one-warpgroup kernel (lean, the
  scales after the MMAs, pooled lists: the step's form), several blocks a split, a prefill chunk's 512 rows with
  the 3- and 2-slot rings, and beside the dequantisation's second warpgroup."""
  q, cache, idx = make_inputs(B + T + 41, B, T, 16, 32768, 2051, q_dtype=jnp.bfloat16, pooled=True)
  run = lambda **kw: np.asarray(jax.jit(lambda *a: M.sparse_mla_decode(  # noqa: E731
      *a, softmax_scale=SCALE, blocks_per_split=nbs, lean=True, combine="kernel", scales_after=True, **kw))(
          q, cache, idx))
  one, got = run(), run(gather_warpgroup=True, stages=stages, warpgroups=wgs)
  assert np.abs(got).max() > 0
  np.testing.assert_array_equal(got, one)


@pytest.mark.gpu
@pytest.mark.parametrize("B,T,nbs,wgs", [(1, 1, None, 1), (1, 4, None, 2), (8, 4, None, 1), (1, 4, 4, 2)])
def test_scales_after_gpu(B, T, nbs, wgs):
  """The scales applied after the MMAs natively (policy mla_scales_after; one and two warpgroups): within the
  kernels' tolerance of the reference and of the default kernel."""
  q, cache, idx = make_inputs(B + T + 60, B, T, 16, 32768, 2051, q_dtype=jnp.bfloat16, pooled=True)
  check_form_gpu(q, cache, idx, "scales_after", blocks_per_split=nbs, warpgroups=wgs)


@pytest.mark.gpu
@pytest.mark.parametrize("B,T,H,qdt,wgs", [(1, 1, 16, jnp.float32, 1), (1, 4, 16, jnp.bfloat16, 1),
                                          (8, 4, 32, jnp.float32, 2), (1, 4, 16, jnp.float32, 2)])
def test_q_in_kernel_gpu(B, T, H, qdt, wgs):
  """The in-kernel query rescale natively (policy mla_q_in_kernel; lean, the step's form): within the kernels'
  tolerance of the reference and of the default kernel, one and two head groups, one and two warpgroups."""
  q, cache, idx = make_inputs(B + T + 90, B, T, H, 32768, 2051, q_dtype=qdt, pooled=True)
  q = q * jnp.asarray(np.random.default_rng().uniform(0.05, 4.0), q.dtype)
  check_form_gpu(q, cache, idx, "q_in_kernel", warpgroups=wgs, scales_after=True)


@pytest.mark.gpu
@pytest.mark.parametrize("B,T,nbs,wgs", [(1, 4, None, 1), (8, 4, None, 1), (1, 1, None, 2), (2, 2, 2, 1)])
def test_group_arrival_gpu(B, T, nbs, wgs):
  """The one-arrival gather natively (policy mla_group_arrival; with the scales after the MMAs, the default): bit
  for bit the default kernel over pooled lists with every kind of group (``_group_cases``)."""
  q, cache, idx = make_inputs(B + T + 70, B, T, 16, 32768, 2051, q_dtype=jnp.bfloat16, pooled=True)
  idx = _group_cases(idx, 32768)
  run = lambda ga: np.asarray(jax.jit(lambda *a: M.sparse_mla_decode(  # noqa: E731
      *a, softmax_scale=SCALE, blocks_per_split=nbs, lean=True, combine="kernel", warpgroups=wgs,
      scales_after=True, group_arrival=ga))(q, cache, idx))
  np.testing.assert_array_equal(run(True), run(False))


# ------------------------------------------------------------------------------------------------------------
# W_UV on the merged O^T (mla_absorb_uv)
# ------------------------------------------------------------------------------------------------------------
def uv_inputs(rng, BT, Hp, H, dn=256, dv=256):
  """A merged O^T [BT, 512, Hp] (the attention's convex combinations of latents: O(1) values) and a kv_b weight
  [H, dn + dv, 512] bf16 at a trained-like scale."""
  o_t = jnp.asarray(rng.standard_normal((BT, M.D_LATENT, Hp)), jnp.float32)
  return o_t, jnp.asarray(rng.standard_normal((H, dn + dv, M.D_LATENT)) * 0.05, jnp.bfloat16)


def test_uv_reference_is_the_models_chain():
  """mla_absorb_uv_reference == what attention.DSA runs after the attention (o transposed, the first H heads,
  rounded to the model's bf16, attention._per_head with W_UV = the weight's rows dn..), bit for bit."""
  from glm5_jax.attention import _per_head  # noqa: PLC0415
  o_t, w = uv_inputs(np.random.default_rng(), 3, 16, 12)
  o = jnp.swapaxes(o_t, 1, 2)[:, :12].reshape(1, 3, 12, M.D_LATENT)
  want = _per_head("bthr,hvr->bthv", o.astype(jnp.bfloat16), w[:, 256:]).reshape(3, 12, 256)
  np.testing.assert_array_equal(np.asarray(M.mla_absorb_uv_reference(o_t, w, dn=256), np.float32),
                                np.asarray(want, np.float32))


@pytest.mark.parametrize("BT,Hp,H,dn", [(1, 16, 16, 256), (3, 32, 24, 256), (8, 16, 16, 64)])
def test_uv_kernel_interpret(BT, Hp, H, dn):
  """The kernel (GPU interpret mode) against the reference: one and several tokens, a second head group (Hp = 32:
  the O^T columns at an offset) with padded heads (H < Hp), another dn (the weight's row offset)."""
  o_t, w = uv_inputs(np.random.default_rng(), BT, Hp, H, dn=dn)
  ref = M.mla_absorb_uv_reference(o_t, w, dn=dn)
  with maybe_interpret(True):
    got = jax.jit(functools.partial(M.mla_absorb_uv, dn=dn))(o_t, w)
  assert got.shape == (BT, H, 256) and got.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32), **tol("kernel_bf16"))


def _uv_x16_check(got, plain, dn_out=256):
  """x16's pair: the bf16 output bit for bit the kernel's without x16, the f16 one exactly linear._act of it."""
  from pallas_kernels import linear as L  # noqa: PLC0415
  out, out16 = got
  assert out16.dtype == jnp.float16 and out16.shape == out.shape
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(plain, np.float32))
  np.testing.assert_array_equal(np.asarray(out16), np.asarray(L._act(plain, jnp.float16)))


def test_uv_kernel_x16_interpret():
  """x16 (policy knob dq_f16): the output in f16 too, for o_proj's f16 kernel — the f16 copy exactly what
  linear._act makes of the bf16 output (its rounding done on the bits: XLA on the CPU would skip an f32 -> bf16 ->
  f32 round trip), the bf16 output unchanged; the reference's pair likewise."""
  o_t, w = uv_inputs(np.random.default_rng(), 2, 16, 16)
  o_t = o_t.at[0, :, 0].multiply(3e4)  # (head 0 of token 0 past f16's range: saturated at ±65,504 as _act does)
  with maybe_interpret(True):
    plain = jax.jit(functools.partial(M.mla_absorb_uv, dn=256))(o_t, w)
    got = jax.jit(functools.partial(M.mla_absorb_uv, dn=256, x16=True))(o_t, w)
  _uv_x16_check(got, plain)
  assert np.abs(np.asarray(got[1], np.float32)).max() == 65504 and np.abs(np.asarray(plain, np.float32)).max() > 7e4
  _uv_x16_check(M.mla_absorb_uv_reference(o_t, w, dn=256, x16=True), M.mla_absorb_uv_reference(o_t, w, dn=256))


@pytest.mark.parametrize("BT,Hp,H", [(1, 16, 16), (4, 16, 16), (1, 32, 24)])
def test_uv_kernel_tc05_interpret(BT, Hp, H):
  """mma="tcgen05" (Blackwell: 128 rows a CTA, the accumulator in TMEM, the O^T tiles through a ring of two) in GPU
  interpret mode against the reference as the wgmma form is, at TP4's shape (16 heads, dn = dv = 256) for one
  token and for several (the ring wraps), and for a second head group with padded heads."""
  o_t, w = uv_inputs(np.random.default_rng(), BT, Hp, H)
  ref = M.mla_absorb_uv_reference(o_t, w, dn=256)
  with maybe_interpret(True):
    got = jax.jit(functools.partial(M.mla_absorb_uv, dn=256, mma="tcgen05"))(o_t, w)
  assert got.shape == (BT, H, 256) and got.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32), **tol("kernel_bf16"))


def test_uv_kernel_tc05_x16_interpret():
  """mma="tcgen05" with x16: the bf16 output as without x16 (and within the reference's tolerance), the f16 copy
  exactly linear._act of it (saturated past f16's range)."""
  o_t, w = uv_inputs(np.random.default_rng(), 3, 16, 16)
  o_t = o_t.at[0, :, 0].multiply(3e4)  # (head 0 of token 0 past f16's range)
  with maybe_interpret(True):
    plain = jax.jit(functools.partial(M.mla_absorb_uv, dn=256, mma="tcgen05"))(o_t, w)
    got = jax.jit(functools.partial(M.mla_absorb_uv, dn=256, mma="tcgen05", x16=True))(o_t, w)
  _uv_x16_check(got, plain)
  assert np.abs(np.asarray(got[1], np.float32)).max() == 65504
  np.testing.assert_allclose(np.asarray(plain, np.float32), np.asarray(M.mla_absorb_uv_reference(o_t, w, dn=256),
                                                                      np.float32), **tol("kernel_bf16"))


def test_round_bf16_is_the_conversion():
  """_common.round_bf16 (the W_UV kernel's f16 copy rounds on the bits): f32 -> bf16 -> f32 for 10^5 random finite
  values across the range (a product past f32's range drawn again: its cast to f32 warned and gave inf), ±0, ±inf, values rounding past bf16's max (to inf, as the conversion does); a NaN stays
  NaN — also the GPU's canonical 0x7FFFFFFF, which the carry alone would turn into -0.0."""
  from pallas_kernels._common import round_bf16  # noqa: PLC0415
  rng = np.random.default_rng()
  # (the values: finite f32 across the exponent range — the top exponents' products beyond it drawn again)
  v = rng.standard_normal(100_000) * np.exp2(rng.integers(-126, 127, 100_000))
  v = np.where(np.abs(v) < 3.4e38, v, rng.standard_normal(100_000)).astype(np.float32)
  edge = np.array([0.0, -0.0, np.inf, -np.inf, 3.3961e38, -3.4e38, 1e-40, 65504.0], np.float32)
  x = jnp.asarray(np.concatenate([v, edge]))
  want = np.asarray(x.astype(jnp.bfloat16).astype(jnp.float32))
  np.testing.assert_array_equal(np.asarray(jax.jit(round_bf16)(x)).view(np.uint32), want.view(np.uint32))
  nans = jnp.asarray(np.array([0x7FFFFFFF, 0xFFFFFFFF, 0x7F800001, 0x7FC00000], np.uint32).view(np.float32))
  assert np.isnan(np.asarray(jax.jit(round_bf16)(nans))).all()


def test_uv_rejects_bad_input():
  o_t, w = (SDS((1, 512, 16), jnp.float32), SDS((16, 512, 512), jnp.bfloat16))
  with pytest.raises(ValueError, match=r"mla_absorb_uv: o_t \(1, 512, 16\) bfloat16"):
    jax.eval_shape(functools.partial(M.mla_absorb_uv, dn=256), SDS((1, 512, 16), jnp.bfloat16), w)
  with pytest.raises(ValueError, match=r"20 heads of 16 in o_t"):
    jax.eval_shape(functools.partial(M.mla_absorb_uv, dn=256), o_t, SDS((20, 512, 512), jnp.bfloat16))
  with pytest.raises(ValueError, match=r"dv = 250"):
    jax.eval_shape(functools.partial(M.mla_absorb_uv, dn=262), o_t, w)
  with pytest.raises(ValueError, match=rf"9 token rows; expected 1 .. {M.UV_MAX_TOKENS}"):
    jax.eval_shape(functools.partial(M.mla_absorb_uv, dn=256), SDS((9, 512, 16), jnp.float32), w)
  with pytest.raises(ValueError, match=r"mma='mfma', expected one of \('wgmma', 'tcgen05'\)"):
    jax.eval_shape(functools.partial(M.mla_absorb_uv, dn=256, mma="mfma"), o_t, w)
  # dv = 320: a multiple of the wgmma form's 64 rows, not of the tcgen05 form's 128
  jax.eval_shape(functools.partial(M.mla_absorb_uv, dn=192), o_t, w)
  with pytest.raises(ValueError, match=r"dv = 320; mma='tcgen05' needs dv a multiple of 128"):
    jax.eval_shape(functools.partial(M.mla_absorb_uv, dn=192, mma="tcgen05"), o_t, w)


@pytest.mark.parametrize("BT,H", [(1, 16), (4, 16), (8, 64)])
def test_uv_cross_lower(BT, H):
  """CUDA lowering at the real shapes: TP4's 16 heads at q = 1 and 4, TP1's 64 at 8 rows."""
  f = functools.partial(M.mla_absorb_uv, dn=256)
  assert "glm5_mla_uv" in cross_lower(f, SDS((BT, 512, H), jnp.float32), SDS((H, 512, 512), jnp.bfloat16)).as_text()
  if BT == 1:  # x16 (policy knob dq_f16), lean: the f16 copy's integer rounding lowers too
    f = functools.partial(M.mla_absorb_uv, dn=256, x16=True, lean=True)
    txt = cross_lower(f, SDS((BT, 512, H), jnp.float32), SDS((H, 512, 512), jnp.bfloat16)).as_text()
    assert f"tensor<{BT}x{H}x256xf16>" in txt


@pytest.mark.gpu
@pytest.mark.parametrize("BT,Hp,H", [(1, 16, 16), (4, 16, 16), (8, 64, 64), (3, 32, 24)])
def test_uv_kernel_gpu(BT, Hp, H):
  """Natively against the reference (its f32 sums in XLA's order: within bf16 rounding), built without the
  automatic barriers too (lean: bit for bit the default build), and from the transposed attention output of the
  sparse MLA kernel itself: o_t = sparse_mla_decode(transposed=True) is the transpose of its default output."""
  o_t, w = uv_inputs(np.random.default_rng(), BT, Hp, H)
  got = jax.jit(functools.partial(M.mla_absorb_uv, dn=256))(o_t, w)
  ref = jax.jit(functools.partial(M.mla_absorb_uv_reference, dn=256))(o_t, w)
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32), **tol("kernel_bf16"))
  lean = jax.jit(functools.partial(M.mla_absorb_uv, dn=256, lean=True))(o_t, w)
  np.testing.assert_array_equal(np.asarray(lean, np.float32), np.asarray(got, np.float32))
  for lean_ in (False, True):  # x16 (policy knob dq_f16): the f16 copy of the same output
    _uv_x16_check(jax.jit(functools.partial(M.mla_absorb_uv, dn=256, lean=lean_, x16=True))(o_t, w), got)
  q, cache, idx = make_inputs(BT, 1, BT, 16, 32768, 2051, q_dtype=jnp.bfloat16, trailing_pad=2051 % 64)
  f = lambda tr: jax.jit(lambda *a: M.sparse_mla_decode(*a, softmax_scale=SCALE, combine="kernel",  # noqa: E731
                                                        transposed=tr))(q, cache, idx)
  o = np.asarray(f(False))
  np.testing.assert_array_equal(np.asarray(jnp.swapaxes(f(True), 1, 2)).reshape(o.shape), o)



# ------------------------------------------------------------------------------------------------------------
# W_UK: the absorbed query (mla_absorb_uk)
# ------------------------------------------------------------------------------------------------------------
def uk_inputs(rng, BT, H, dn=256, dv=256, Hp=None):
  """q_b_proj's output per head [BT, Hp, dn] bf16 (O(1) values; Hp >= H, default H) and a kv_b weight [H, dn + dv,
  512] bf16 at a trained-like scale."""
  q = jnp.asarray(rng.standard_normal((BT, Hp or H, dn)), jnp.bfloat16)
  return q, jnp.asarray(rng.standard_normal((H, dn + dv, M.D_LATENT)) * 0.05, jnp.bfloat16)


def test_uk_reference_is_the_models_chain():
  """mla_absorb_uk_reference == attention._per_head's W_UK absorption (the weight's first dn rows per head), bit
  for bit."""
  from glm5_jax.attention import _per_head  # noqa: PLC0415
  q, w = uk_inputs(np.random.default_rng(), 3, 12)
  want = _per_head("bthn,hnr->bthr", q.reshape(1, 3, 12, 256), w[:, :256]).reshape(3, 12, M.D_LATENT)
  np.testing.assert_array_equal(np.asarray(M.mla_absorb_uk_reference(q, w, dn=256), np.float32),
                                np.asarray(want, np.float32))


def _uk_check(got, ref):
  """Within bf16 rounding of the reference (the same f32 products summed in another order): each value at most
  one bf16 ulp of its magnitude away (plus the f32 sums' own difference, ~1e-7 of the terms' ~1: a sum that
  cancels to ~1e-5 rounds to bf16 a few of its ulps apart), most of them equal."""
  g, r = np.asarray(got, np.float32), np.asarray(ref, np.float32)
  assert got.shape == ref.shape and got.dtype == jnp.bfloat16
  np.testing.assert_allclose(g, r, **tol("kernel_bf16"))
  assert (np.abs(g - r) <= np.abs(r) * 2.0 ** -7 + 1e-5).all() and (g == r).mean() > 0.9


@pytest.mark.parametrize("BT,Hp,H,dn", [(1, 16, 16, 256), (4, 32, 32, 256), (8, 16, 16, 128), (2, 32, 20, 256)])
def test_uk_kernel_interpret(BT, Hp, H, dn):
  """The kernel (GPU interpret mode) against the reference: one token and the verify's 4 with a second head group
  (h // 16 = 1: the q rows at an offset), the 8-row limit with another dn (2 K tiles), q's heads padded past the
  weight's (H < Hp: the tiny presets' form; the pad's values never read)."""
  q, w = uk_inputs(np.random.default_rng(), BT, H, dn=dn, Hp=Hp)
  if Hp > H:
    q = q.at[:, H:].set(jnp.nan)
  with maybe_interpret(True):
    got = jax.jit(functools.partial(M.mla_absorb_uk, dn=dn))(q, w)
  _uk_check(got, M.mla_absorb_uk_reference(q, w, dn=dn))


def test_uk_rejects_bad_input():
  q, w = SDS((1, 16, 256), jnp.bfloat16), SDS((16, 512, 512), jnp.bfloat16)
  f = functools.partial(M.mla_absorb_uk, dn=256)
  with pytest.raises(ValueError, match=r"mla_absorb_uk: q \(1, 16, 256\) float32"):
    jax.eval_shape(f, SDS((1, 16, 256), jnp.float32), w)
  with pytest.raises(ValueError, match=r"16 heads in q, 32 in w_kv"):
    jax.eval_shape(f, q, SDS((32, 512, 512), jnp.bfloat16))
  with pytest.raises(ValueError, match=r"4 heads in q, 4 in w_kv, dn = 256 of 512 rows; expected q's heads a "
                     r"multiple of 16, at least w_kv's"):
    jax.eval_shape(f, SDS((1, 4, 256), jnp.bfloat16), SDS((4, 512, 512), jnp.bfloat16))
  assert jax.eval_shape(f, q, SDS((4, 512, 512), jnp.bfloat16)).shape == (1, 4, 512)  # (12 padded heads of q)
  with pytest.raises(ValueError, match=r"dn = 96"):
    jax.eval_shape(functools.partial(M.mla_absorb_uk, dn=96), SDS((1, 16, 96), jnp.bfloat16), w)
  with pytest.raises(ValueError, match=rf"9 token rows; expected 1 .. {M.UV_MAX_TOKENS}"):
    jax.eval_shape(f, SDS((9, 16, 256), jnp.bfloat16), w)


@pytest.mark.parametrize("BT,H", [(1, 16), (4, 16), (8, 64)])
def test_uk_cross_lower(BT, H):
  """CUDA lowering at the real shapes: TP4's 16 heads at q = 1 and 4, TP1's 64 at 8 rows (lean: without the
  automatic barriers, which the default build has)."""
  args = SDS((BT, H, 256), jnp.bfloat16), SDS((H, 512, 512), jnp.bfloat16)
  for lean in (False, True):
    txt = cross_lower(functools.partial(M.mla_absorb_uk, dn=256, lean=lean), *args).as_text()
    assert "glm5_mla_uk" in txt and f"tensor<{BT}x{H}x512xbf16>" in txt


@pytest.mark.gpu
@pytest.mark.parametrize("BT,H", [(1, 16), (4, 16), (8, 64), (3, 32)])
def test_uk_kernel_gpu(BT, H):
  """Natively against the reference (its f32 sums in XLA's order: within bf16 rounding), and built without the
  automatic barriers (lean: bit for bit the default build)."""
  q, w = uk_inputs(np.random.default_rng(), BT, H)
  got = jax.jit(functools.partial(M.mla_absorb_uk, dn=256))(q, w)
  _uk_check(got, jax.jit(functools.partial(M.mla_absorb_uk_reference, dn=256))(q, w))
  lean = jax.jit(functools.partial(M.mla_absorb_uk, dn=256, lean=True))(q, w)
  np.testing.assert_array_equal(np.asarray(lean, np.float32), np.asarray(got, np.float32))


def _latent_inputs(seed, M_rows, Q):
  rng = np.random.default_rng(seed)
  qkv = jnp.asarray(rng.standard_normal((M_rows, Q + M.D_LATENT)) * rng.uniform(0.1, 5.0, (M_rows, 1)),
                    jnp.bfloat16)
  return (qkv, jnp.asarray(rng.uniform(0.5, 1.5, Q), jnp.bfloat16),
          jnp.asarray(rng.uniform(0.5, 1.5, M.D_LATENT), jnp.bfloat16))


def _check_latent_norms(outs, ref, exact: bool):
  """q_r / c within one bf16 rounding (exact in interpret mode: the same sums there), c8 within one e4m3 step
  of the reference's (its scale within f32 rounding: the group maxima are the same bf16 values when c is)."""
  f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
  if exact:
    for a, b in zip(outs, ref):
      np.testing.assert_array_equal(f32(a), f32(b))
    return
  for a, b in zip(outs[:2], ref[:2]):
    np.testing.assert_allclose(f32(a), f32(b), rtol=2.0 ** -7, atol=0)
    assert np.mean(f32(a) != f32(b)) < 0.01
  np.testing.assert_allclose(f32(outs[3]), f32(ref[3]), rtol=2.0 ** -7)
  deq = [f32(c8).reshape(-1, 4, 128) * f32(sc)[..., None] for c8, sc in ((outs[2], outs[3]), (ref[2], ref[3]))]
  step = 2.0 ** -3 * np.abs(deq[1]).max(-1, keepdims=True)
  assert np.all(np.abs(deq[0] - deq[1]) <= step)


@pytest.mark.parametrize("M_rows,Q", [(1, 256), (3, 1536)])
def test_latent_norms_interpret(M_rows, Q):
  """latent_norms (policy mla_latent_norms) in GPU interpret mode == latent_norms_reference, bit for bit, at the
  kernel-tiny and the real q_lora_rank; the FP8 half packs into quantize_latent's cache rows."""
  args = _latent_inputs(M_rows + Q, M_rows, Q)
  ref = M.latent_norms_reference(*args, eps=1e-6)
  with maybe_interpret(True):
    got = jax.jit(functools.partial(M.latent_norms, eps=1e-6))(*args)
  _check_latent_norms(got, ref, exact=True)
  np.testing.assert_array_equal(np.asarray(M.pack_latent(got[2], got[3])), np.asarray(M.quantize_latent(ref[1])))


def test_latent_norms_rejects_bad_input():
  qkv, wq, wkv = _latent_inputs(0, 1, 256)
  with pytest.raises(ValueError, match=r"latent_norms: qkv \(1, 768\) float32"):
    M.latent_norms(qkv.astype(jnp.float32), wq, wkv, eps=1e-6)
  with pytest.raises(ValueError, match=r"wq \(128,\)"):
    M.latent_norms(qkv, wq[:128], wkv, eps=1e-6)


@pytest.mark.parametrize("M_rows", [1, 4])
def test_latent_norms_cross_lower(M_rows):
  """At the real widths (q_lora_rank 1536, the 512 latent) for q = 1 and q = 4."""
  args = (SDS((M_rows, 2048), jnp.bfloat16), SDS((1536,), jnp.bfloat16), SDS((512,), jnp.bfloat16))
  assert "mosaic_gpu" in cross_lower(functools.partial(M.latent_norms, eps=1e-6), *args).as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("M_rows", [1, 4])
def test_latent_norms_gpu(M_rows):
  """Natively against the reference; built without Mosaic's automatic barriers (lean: policy lean_barriers), bit
  for bit the same."""
  args = _latent_inputs(M_rows, M_rows, 1536)
  got = jax.jit(functools.partial(M.latent_norms, eps=1e-6))(*args)
  _check_latent_norms(got, M.latent_norms_reference(*args, eps=1e-6), exact=False)
  lean = jax.jit(functools.partial(M.latent_norms, eps=1e-6, lean=True))(*args)
  for a, b in zip(lean, got):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
