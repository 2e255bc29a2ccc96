"""Tests of pallas_kernels/moe_prefill.py: a prefill chunk's routed experts as grouped FP8 GEMMs.

CPU: the row tiles' layout against a plain construction; the kernel in Mosaic GPU interpret mode against
linear.fp8_moe_reference (skewed routing: an expert over several tiles, experts with no rows); CUDA lowering at the
release's per-rank shapes; the Decoder's prefill with policy knob moe_prefill against XLA's path at the model's
site, and the refusal where the kernel cannot run. GPU (`-m gpu`): the release's shapes natively.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tol
from helpers import load, tiny_checkpoint
from test_linear_kernels import MOE_REAL, moe_inputs

from glm5_jax.layers import KERNEL_DEFAULTS
from glm5_jax.runtime import DecodeConfig
from glm5_jax.speculative import Decoder
from pallas_kernels import linear as L
from pallas_kernels import moe_prefill as P
from pallas_kernels._common import cross_lower, maybe_interpret

F8 = jnp.float8_e4m3fn
SDS = jax.ShapeDtypeStruct


def skewed_ids(rng, m, e, k, hot, cold):
  """[M, k] distinct experts per token: expert ``hot`` in most rows (several tiles), the ``cold`` ones in none."""
  allowed = np.array([x for x in range(e) if x not in cold])
  ids = np.stack([rng.permutation(allowed)[:k] for _ in range(m)])
  for r in range(m - 2):  # hot in every row but the last two
    if hot not in ids[r]:
      ids[r, rng.integers(k)] = hot
  return jnp.asarray(ids, jnp.int32)


def _grouped_case(mp, i, d, m=40, e=12, k=3):
  """Fresh MoE inputs (the hot expert over several tiles, two experts without rows) laid out in mp-row tiles ->
  (fp8_moe_prefill's arguments, tile_e, random_rows(n): [T·mp, n] bf16 tile rows, used: the used tiles' rows)."""
  rng = np.random.default_rng()
  x, _, tw, wg, sg, wu, su, wd, sd = moe_inputs(jax.random.key(int(rng.integers(1 << 30))), m, e, i, d, k)
  ids = skewed_ids(rng, m, e, k, hot=1, cold=(0, e - 1))
  tile_e = P.route_rows(ids, e, mp)[1]
  random_rows = lambda n: jnp.asarray(rng.standard_normal((tile_e.shape[0] * mp, n)), jnp.bfloat16)  # noqa: E731
  used = np.asarray(tile_e).repeat(mp) >= 0  # (unused tiles' rows: never written, never read)
  return (x, ids, tw, wg, sg, wu, su, wd, sd), tile_e, random_rows, used


@pytest.mark.parametrize("dupes", [False, True])
def test_route_rows_tiles_each_expert_in_order(dupes):
  """route_rows (no sort) lays the pairs out as the stable argsort by expert did: each expert's pairs consecutive in
  pair order from its first tile's start, its tiles after the experts before it, unused tiles -1; every row
  distinct. ``dupes``: a token naming one expert in two slots (not a top-k router's output) still gets two rows,
  in slot order."""
  rng = np.random.default_rng()
  m, e, k, mp = 37, 9, 3, 16
  ids = np.array(skewed_ids(rng, m, e, k, hot=4, cold=(2, 7)))
  if dupes:
    ids[5, 2] = ids[5, 0]
  row, tile_e = (np.asarray(a) for a in P.route_rows(jnp.asarray(ids), e, mp))
  flat = ids.reshape(-1)
  order = np.argsort(flat, kind="stable")  # (the reference: the pairs sorted by expert, then by pair index)
  want_rows, want_tiles, start = np.empty(m * k, np.int64), [], 0
  for x in range(e):
    pairs = order[flat[order] == x]
    want_rows[pairs] = start + np.arange(len(pairs))
    n = -(-len(pairs) // mp)
    want_tiles += [x] * n
    start += n * mp
  np.testing.assert_array_equal(row.reshape(-1), want_rows)
  assert len(set(row.reshape(-1).tolist())) == m * k and len(tile_e) == P.num_tiles(m * k, e, mp)
  np.testing.assert_array_equal(tile_e, want_tiles + [-1] * (len(tile_e) - len(want_tiles)))
  assert want_tiles.count(4) >= 2 and 2 not in want_tiles and 7 not in want_tiles


def test_fp8_moe_prefill_interpret_equals_reference():
  """The hot expert over three 16-row tiles, two experts without rows, 128-row weight tiles (bm), 3 K blocks."""
  m, e, i, d, k, mp = 40, 12, 128, 384, 3, 16
  rng = np.random.default_rng()
  x, _, tw, wg, sg, wu, su, wd, sd = moe_inputs(jax.random.key(int(rng.integers(1 << 30))), m, e, i, d, k)
  ids = skewed_ids(rng, m, e, k, hot=1, cold=(0, e - 1))
  with maybe_interpret(True):
    y = P.fp8_moe_prefill(x, ids, tw, wg, sg, wu, su, wd, sd, swiglu_limit=1.0, mp=mp)
  ref = L.fp8_moe_reference(x, ids, tw, wg, sg, wu, su, wd, sd, swiglu_limit=1.0)
  np.testing.assert_allclose(np.asarray(y), np.asarray(ref), **tol("kernel_bf16"))


@pytest.mark.parametrize("mp,bm,mma", [(16, None, "wgmma"), (32, 64, "wgmma"), (16, None, "tcgen05")])
def test_grouped_rows_form_is_the_tiled_form(mp, bm, mma):
  """rows=True (policy knob moe_prefill_rows): each launch writes its [T·mp, N] token rows itself (masked row sums
  into SMEM, one TMA store a CTA) — bit for bit what XLA's transpose of the [T, N, mp] form gives, the gate/up
  launch's h (bf16, after the SwiGLU) and the down launch's y (f32 and bf16), in GPU interpret mode; 16- and 32-row
  tiles, 128 and 64 weight rows a CTA, the tcgen05 form (its sums relaid into the WGMMA layout first)."""
  i, d = 128, 256
  (_, _, _, wg, sg, wu, su, wd, sd), tile_e, random_rows, used = _grouped_case(mp, i, d)
  xs, hs = random_rows(d), random_rows(i)
  kw = {"mp": mp, "bm": None if mma == "tcgen05" else bm, "mma": mma}
  def outputs(rows):
    h = P.fp8_grouped_gate_up(xs, tile_e, wg, sg, wu, su, swiglu_limit=1.0, rows=rows, **kw)
    y32 = P.fp8_grouped_linear(hs, tile_e, wd, sd, rows=rows, **kw)
    y16 = P.fp8_grouped_linear(hs, tile_e, wd, sd, out_dtype=jnp.bfloat16, rows=rows, **kw)
    return [np.asarray(a.astype(jnp.float32))[used] for a in (h, y32, y16)]
  with maybe_interpret(True):
    want, got = outputs(False), outputs(True)
  for a, b in zip(got, want):
    np.testing.assert_array_equal(a, b)
  assert np.isfinite(want[1]).all() and np.abs(want[1]).max() > 0


@pytest.mark.parametrize("mp,rows,stages", [(16, True, None), (64, False, 3)])
def test_grouped_resident_form_is_the_streamed_form(mp, rows, stages):
  """resident > 1 (policy knob moe_prefill_resident, the down launch): each CTA holds its row tile's x in SMEM and
  runs several weight row tiles through one ring that runs on across them — bit for bit the streamed form (the same
  blocks, scales and order of sums), in GPU interpret mode: 16-row tiles with 128 weight rows a CTA and the rows
  form, 64-row tiles with 64 and a ring shallower than a CTA's tiles (the ring wrapping across them); the whole
  fp8_moe_prefill with down_resident likewise; a request that cannot run is refused by name."""
  i, d = 256, 512
  args, tile_e, random_rows, used = _grouped_case(mp, i, d)
  wd, sd = args[7:]
  hs = random_rows(i)
  sub = P.resident_sub_tiles(d, i, mp)
  assert sub == d // P.grouped_bm(mp) == 8 // (2 if mp <= 32 else 1), sub  # (all of N's weight tiles a CTA)
  f32 = lambda a: np.asarray(a.astype(jnp.float32))[used]  # noqa: E731
  with maybe_interpret(True):
    want = P.fp8_grouped_linear(hs, tile_e, wd, sd, mp=mp, out_dtype=jnp.bfloat16, rows=rows)
    got = P.fp8_grouped_linear(hs, tile_e, wd, sd, mp=mp, out_dtype=jnp.bfloat16, rows=rows, resident=sub,
                               stages=stages)
    np.testing.assert_array_equal(f32(got), f32(want))
    assert np.abs(f32(want)).max() > 0
    if mp == 16:
      y0 = P.fp8_moe_prefill(*args, swiglu_limit=1.0, mp=mp, rows=rows)
      y1 = P.fp8_moe_prefill(*args, swiglu_limit=1.0, mp=mp, rows=rows, down_resident=True)
      np.testing.assert_array_equal(np.asarray(y1), np.asarray(y0))
  with pytest.raises(ValueError, match="must divide N / bm"):
    P.fp8_grouped_linear(hs, tile_e, wd, sd, mp=mp, resident=3)
  with pytest.raises(ValueError, match="down_resident needs the wgmma form"):
    P.fp8_moe_prefill(*args, swiglu_limit=1.0, mp=mp, mma="tcgen05", down_resident=True)


def test_grouped_tokens_m_form_equals_the_resident_form():
  """tokens_m (policy knob moe_prefill_tokens_m: the resident down launch's MMAs with the 64 token rows as M, the
  dequantised weight block through SMEM as B, the tile stored as it is) in GPU interpret mode: f32 outputs within
  f32 rounding of the resident form (the same products summed in another order), and its CUDA lowering at a
  2,048-token chunk's real rank; refused where it cannot run."""
  i, d, mp = 256, 512, 64
  args, tile_e, random_rows, used = _grouped_case(mp, i, d)
  wd, sd = args[7:]
  hs = random_rows(i)
  sub = P.resident_sub_tiles(d, i, mp)
  with maybe_interpret(True):
    want = P.fp8_grouped_linear(hs, tile_e, wd, sd, mp=mp, rows=True, resident=sub)
    got = P.fp8_grouped_linear(hs, tile_e, wd, sd, mp=mp, rows=True, resident=sub, tokens_m=True)
  want, got = np.asarray(want)[used], np.asarray(got)[used]
  np.testing.assert_allclose(got, want, **tol("kernel_f32"))
  assert np.abs(want).max() > 0
  with pytest.raises(ValueError, match="tokens_m takes 64-row tiles"):
    P.fp8_grouped_linear(hs[:tile_e.shape[0] * 16], tile_e, wd, sd, mp=16, rows=True, resident=4, tokens_m=True)
  with pytest.raises(ValueError, match="tokens_m takes the resident form"):
    P.fp8_grouped_linear(hs, tile_e, wd, sd, mp=mp, rows=True, tokens_m=True)
  E, I, D, K = (MOE_REAL[c] for c in "EIDk")
  M = 2048
  args = (SDS((M, D), jnp.bfloat16), SDS((M, K), jnp.int32), SDS((M, K), jnp.float32), SDS((E, I, D), F8),
          SDS((E, I // 128, D // 128), jnp.float32), SDS((E, I, D), F8), SDS((E, I // 128, D // 128), jnp.float32),
          SDS((E, D, I), F8), SDS((E, D // 128, I // 128), jnp.float32))
  txt = cross_lower(lambda *a: P.fp8_moe_prefill(*a, swiglu_limit=10.0, rows=True, down_resident=True,
                                                 down_tokens_m=True), *args).as_text()
  assert txt.count("glm5_moe_prefill") >= 2

def test_fp8_moe_prefill_tcgen05_interpret():
  """mma='tcgen05' (Blackwell: 128 weight rows a CTA, each block one tcgen05 MMA into tensor memory, the sums relaid
  into the WGMMA layout) in GPU interpret mode: the wgmma form's output bit for bit (the same blocks summed in the
  same order) and the reference within the bf16 kernels' tolerance — the hot expert over several 16-row tiles,
  experts without rows."""
  m, e, i, d, k, mp = 40, 12, 128, 384, 3, 16
  rng = np.random.default_rng()
  x, _, tw, wg, sg, wu, su, wd, sd = moe_inputs(jax.random.key(int(rng.integers(1 << 30))), m, e, i, d, k)
  ids = skewed_ids(rng, m, e, k, hot=1, cold=(0, e - 1))
  args = (x, ids, tw, wg, sg, wu, su, wd, sd)
  with maybe_interpret(True):
    hop = P.fp8_moe_prefill(*args, swiglu_limit=1.0, mp=mp)
    got = P.fp8_moe_prefill(*args, swiglu_limit=1.0, mp=mp, mma="tcgen05")
  np.testing.assert_array_equal(np.asarray(got), np.asarray(hop))
  ref = L.fp8_moe_reference(*args, swiglu_limit=1.0)
  np.testing.assert_allclose(np.asarray(got), np.asarray(ref), **tol("kernel_bf16"))
  with pytest.raises(ValueError, match="mma='tcgen05' needs 128 weight rows a CTA, bm = 64"):
    P.fp8_grouped_linear(x[:32].astype(jnp.bfloat16), jnp.zeros((2,), jnp.int32), wg, sg, mp=16, bm=64, mma="tcgen05")


@pytest.mark.parametrize("m", [256, 2048])
def test_fp8_moe_prefill_lowers_for_blackwell(m, monkeypatch):
  """The tcgen05 form lowers for CUDA at the release's per-rank shapes (16- and 64-row tiles), Mosaic's layout
  inference told the target is sm_100 (as benchmarks/step_census.py does for a B200)."""
  from jax.experimental.mosaic.gpu import utils as mgpu_utils  # noqa: PLC0415
  monkeypatch.setattr(mgpu_utils, "_infer_arch", lambda: (10, 0))
  E, I, D, k = (MOE_REAL[c] for c in "EIDk")
  args = (SDS((m, D), jnp.bfloat16), SDS((m, k), jnp.int32), SDS((m, k), jnp.float32), SDS((E, I, D), F8),
          SDS((E, I // 128, D // 128), jnp.float32), SDS((E, I, D), F8), SDS((E, I // 128, D // 128), jnp.float32),
          SDS((E, D, I), F8), SDS((E, D // 128, I // 128), jnp.float32))
  txt = cross_lower(lambda *a: P.fp8_moe_prefill(*a, swiglu_limit=10.0, mma="tcgen05"), *args).as_text()
  assert "glm5_moe_prefill" in txt


def test_fp8_grouped_linear_rejects_bad_shapes():
  x = jnp.zeros((48, 256), jnp.bfloat16)
  w, s = jnp.zeros((4, 128, 256), F8), jnp.zeros((4, 1, 2), jnp.float32)
  with pytest.raises(ValueError, match="48 rows of x for 2 tiles of mp = 16"):
    P.fp8_grouped_linear(x, jnp.zeros((2,), jnp.int32), w, s, mp=16)
  with pytest.raises(ValueError, match=r"scale_inv \(4, 2, 2\), expected \(4, 1, 2\)"):
    P.fp8_grouped_linear(x, jnp.zeros((3,), jnp.int32), w, jnp.zeros((4, 2, 2)), mp=16)
  with pytest.raises(ValueError, match="expected mp in"):
    P.fp8_grouped_linear(x, jnp.zeros((6,), jnp.int32), w, s, mp=8)


@pytest.mark.parametrize("m,rows", [(256, False), (2048, False), (512, True), (2048, True)])
def test_fp8_moe_prefill_lowers_at_the_real_rank(m, rows):
  """16-row tiles (~7 pairs an expert at 256 rows, 14 at 512), 64-row tiles (~57 at 2,048); ``rows``: the token rows
  written by the kernels — no transpose left to XLA — and the down launch in the resident form
  (moe_prefill_resident)."""
  E, I, D, k = (MOE_REAL[c] for c in "EIDk")
  args = (SDS((m, D), jnp.bfloat16), SDS((m, k), jnp.int32), SDS((m, k), jnp.float32), SDS((E, I, D), F8),
          SDS((E, I // 128, D // 128), jnp.float32), SDS((E, I, D), F8), SDS((E, I // 128, D // 128), jnp.float32),
          SDS((E, D, I), F8), SDS((E, D // 128, I // 128), jnp.float32))
  txt = cross_lower(lambda *a: P.fp8_moe_prefill(*a, swiglu_limit=10.0, rows=rows, down_resident=rows),
                    *args).as_text()
  assert txt.count("glm5_moe_prefill") >= 2 and ("stablehlo.transpose" in txt) == (not rows)


def _prefill_caches(m, policy, prompt):
  dec = Decoder(m, DecodeConfig(max_context=64, q=1, capture_sizes=(1,), policy=policy), backend="latency_specialized",
                prefill_chunk=16)
  return dec, dec.prefill([prompt])


def test_prefill_moe_kernel_at_the_model_site():
  """kernel-tiny (FP8 experts, bf16; no MTP layer: its MoE is the same code) prefilled with a 16-token prompt in
  one chunk (16 · 4 pairs over 16 experts: the MoE's many-row path) with every decode kernel off: moe_prefill on runs the grouped
  kernel in each MoE layer where XLA ran every expert over every token — the layers' caches within the bf16
  kernels' tolerance of XLA's; with moe_prefill_resident (the down launch's resident form) bit for bit the same."""
  m = load(tiny_checkpoint("kernel-tiny", 6, "fp8", mtp=False), "bfloat16")
  prompt = np.random.default_rng().integers(0, 2000, 16)
  off = {k: False for k in KERNEL_DEFAULTS}
  states = []
  for on, res in ((False, False), (True, False), (True, True)):
    dec, state = _prefill_caches(m, tuple(sorted({**off, "moe_prefill": on, "moe_prefill_rows": on,
                                                  "moe_prefill_resident": res, "kv_cache_dtype": "auto"}.items())),
                                 prompt)
    states.append(state)
    # (the target's two MoE layers in each traced chunk; with the kernels' rows form, and the down launch's
    # resident form)
    for knob, want in (("moe_prefill", on), ("moe_prefill_rows", on), ("moe_prefill_resident", res)):
      assert (dec.prefill_sites.get(knob, {}).get("sites", 0) > 0) == want
  # (the resident down launch: the same caches bit for bit)
  for u, v in zip(*(jax.tree.leaves(s.caches["layers"]) for s in states[1:])):
    np.testing.assert_array_equal(np.asarray(v), np.asarray(u))
  states = states[:2]
  # (the layers' caches: every MoE layer's routing sees the same inputs in both runs but the last one's, whose
  # output, kernel rounding apart, may pick other experts after a near tie there — it reaches only the final hidden
  # states: the first token, and an MTP layer's cache)
  a, b = (jax.tree.leaves(s.caches["layers"]) for s in states)
  assert len(a) == len(b)
  for u, v in zip(a, b):
    if jnp.issubdtype(u.dtype, jnp.floating):
      u, v = np.asarray(u, np.float32), np.asarray(v, np.float32)
      np.testing.assert_allclose(v, u, atol=tol("kernel_bf16")["atol"] * max(1.0, float(np.abs(u).max())),
                                 rtol=tol("kernel_bf16")["rtol"])


def test_prefill_moe_kernel_request_that_cannot_run_is_refused():
  """moe_prefill asked for explicitly on a model whose experts are not FP8 128x128 blocks: the prefill says why
  (a requested path never falls back silently); the decode step has no site of it and is not refused."""
  m = load(tiny_checkpoint("oracle-tiny", 0, "float32"))
  dec = Decoder(m, DecodeConfig(max_context=64, q=2, capture_sizes=(1,), policy=(("interpret", True),
                                                                                 ("moe_prefill", True),
                                                                                 ("kv_cache_dtype", "auto"))),
                backend="latency_specialized", prefill_chunk=16)
  with pytest.raises(ValueError, match=r"prefill kernel\(s\) \['moe_prefill'\] .*FP8 128x128-block expert weights"):
    dec.prefill([np.arange(20) % 50 + 1])


@pytest.mark.gpu
@pytest.mark.parametrize("m", [256, 512, 2048])
def test_fp8_moe_prefill_gpu_real_shapes(m):
  """Natively at the release's per-rank shapes against the reference; the rows form (moe_prefill_rows) and the
  resident down launch (moe_prefill_resident) bit for bit the tiled one; at 64-row tiles the resident launch's
  token-rows-as-M form (moe_prefill_tokens_m) against the reference."""
  E, I, D, k = (MOE_REAL[c] for c in "EIDk")
  x, ids, tw, wg, sg, wu, su, wd, sd = moe_inputs(jax.random.key(m), m, E, I, D, k)
  y = P.fp8_moe_prefill(x, ids, tw, wg, sg, wu, su, wd, sd, swiglu_limit=10.0)
  ref = jax.jit(lambda *a: L.fp8_moe_reference(*a, swiglu_limit=10.0))(x, ids, tw, wg, sg, wu, su, wd, sd)
  np.testing.assert_allclose(np.asarray(y), np.asarray(ref), **tol("kernel_bf16"))
  rows = P.fp8_moe_prefill(x, ids, tw, wg, sg, wu, su, wd, sd, swiglu_limit=10.0, rows=True)
  np.testing.assert_array_equal(np.asarray(rows), np.asarray(y))
  res = P.fp8_moe_prefill(x, ids, tw, wg, sg, wu, su, wd, sd, swiglu_limit=10.0, rows=True, down_resident=True)
  np.testing.assert_array_equal(np.asarray(res), np.asarray(y))
  if P.tile_rows(m * k, E) == 64:  # (the token rows as the MMA's M: the same products in another order)
    tm = P.fp8_moe_prefill(x, ids, tw, wg, sg, wu, su, wd, sd, swiglu_limit=10.0, rows=True, down_resident=True,
                           down_tokens_m=True)
    np.testing.assert_allclose(np.asarray(tm), np.asarray(ref), **tol("kernel_bf16"))


@pytest.mark.blackwell
@pytest.mark.parametrize("m", [256, 2048])
def test_fp8_moe_prefill_tcgen05_blackwell(m):
  """The tcgen05 form natively on a Blackwell GPU at the release's per-rank shapes, against the reference."""
  E, I, D, k = (MOE_REAL[c] for c in "EIDk")
  x, ids, tw, wg, sg, wu, su, wd, sd = moe_inputs(jax.random.key(m), m, E, I, D, k)
  y = P.fp8_moe_prefill(x, ids, tw, wg, sg, wu, su, wd, sd, swiglu_limit=10.0, mma="tcgen05")
  ref = jax.jit(lambda *a: L.fp8_moe_reference(*a, swiglu_limit=10.0))(x, ids, tw, wg, sg, wu, su, wd, sd)
  np.testing.assert_allclose(np.asarray(y), np.asarray(ref), **tol("kernel_bf16"))
