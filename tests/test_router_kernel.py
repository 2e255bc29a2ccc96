"""Tests of pallas_kernels/router.py: the MoE router's selection (sigmoid, bias, top-k, normalised weights).

CPU: the Mosaic GPU kernel in GPU interpret mode against the lax.top_k reference on fresh random logits (the
real 288 experts and a small E, ties, NaN / ±inf, rows of several tokens), the bad-input errors, and CUDA
cross-lowering of the decode's row counts (the model's Router through the kernel: tests/test_model_units.py).
GPU (`-m gpu`): the same comparisons natively.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tol

from pallas_kernels import router as R
from pallas_kernels._common import cross_lower, maybe_interpret

SDS = jax.ShapeDtypeStruct


def make_logits(rng, M, E, kind):
  x = rng.standard_normal((M, E)).astype(np.float32) * rng.uniform(0.5, 4)
  if kind == "ties":  # a few levels: equal scores everywhere (lax.top_k takes the lower index first)
    x = (rng.integers(-3, 4, (M, E)) / 2).astype(np.float32)
  elif kind == "special":
    specials = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0], np.float32)
    hit = rng.random((M, E)) < 0.05
    x[hit] = specials[rng.integers(0, len(specials), hit.sum())]
  bias = (rng.standard_normal(E) * 0.01).astype(np.float32)
  if kind == "ties":
    bias[:] = 0.0
  return jnp.asarray(x), jnp.asarray(bias)


def check(got, want):
  np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
  np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), **tol("kernel_f32"))


@pytest.mark.parametrize("M,E,k,kind,norm", [
    (1, 288, 8, "scores", True), (4, 288, 8, "ties", True), (5, 64, 4, "special", False), (2, 288, 8, "special", True)])
def test_kernel_interpret(M, E, k, kind, norm):
  logits, bias = make_logits(np.random.default_rng(), M, E, kind)
  want = R.router_topk_reference(logits, bias, k=k, scaling=2.5, norm=norm)
  with maybe_interpret(True):
    got = jax.jit(lambda l, b: R.router_topk(l, b, k=k, scaling=2.5, norm=norm))(logits, bias)
  check(got, want)


def test_rejects_bad_input():
  logits, bias = jnp.zeros((2, 288), jnp.float32), jnp.zeros((288,), jnp.float32)
  with pytest.raises(ValueError, match="k = 6 of E = 288"):
    R.router_topk(logits, bias, k=6, scaling=1.0, norm=True)
  with pytest.raises(ValueError, match="f32 logits"):
    R.router_topk(logits.astype(jnp.bfloat16), bias, k=8, scaling=1.0, norm=True)
  with pytest.raises(ValueError, match="bias"):
    R.router_topk(logits, bias[:100], k=8, scaling=1.0, norm=True)


@pytest.mark.parametrize("M", [1, 4, 8, 32, 64])
def test_cross_lower(M):
  f = lambda l, b: R.router_topk(l, b, k=8, scaling=2.5, norm=True)
  assert "mosaic_gpu" in cross_lower(f, SDS((M, 288), jnp.float32), SDS((288,), jnp.float32)).as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("M,kind", [(1, "scores"), (4, "ties"), (32, "special")])
def test_kernel_gpu(M, kind):
  logits, bias = make_logits(np.random.default_rng(), M, 288, kind)
  want = jax.jit(lambda l, b: R.router_topk_reference(l, b, k=8, scaling=2.5, norm=True))(logits, bias)
  got = jax.jit(lambda l, b: R.router_topk(l, b, k=8, scaling=2.5, norm=True))(logits, bias)
  check(got, want)


# ------------------------------------------------------------------------------------------------ router_route
def check_route(got, want):
  """The selection as ``check``; the slot tables (ids, slots, n_valid) exactly, the routing weights as w."""
  check(got[:2], want[:2])
  np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(want[2]))  # eids
  np.testing.assert_array_equal(np.asarray(got[3]), np.asarray(want[3]))  # n_valid
  np.testing.assert_allclose(np.asarray(got[4]), np.asarray(want[4]), **tol("kernel_f32"))  # r


def route_kw(M, E, k, shared):
  from pallas_kernels import linear as L  # noqa: PLC0415
  n_pad, mp = L.route_shape(M, k, E, shared)
  return dict(k=k, scaling=2.5, norm=True, num_experts=E, n_pad=n_pad, mp=mp, shared=shared)


@pytest.mark.parametrize("M,E,k,kind,shared", [(2, 288, 8, "scores", True), (4, 288, 8, "ties", True),
                                               (3, 64, 4, "special", False), (4, 288, 8, "same", False)])
def test_router_route_interpret(M, E, k, kind, shared):
  """The router kernel building moe_route's slot tables itself (one warpgroup, a warp per row; the tables once all
  rows are in) == router_topk_reference then moe_route_reference; "same": identical rows (every expert shared)."""
  x, b = make_logits(np.random.default_rng(), M, E, "scores" if kind == "same" else kind)
  if kind == "same":
    x = jnp.broadcast_to(x[:1], x.shape)
  kw = route_kw(M, E, k, shared)
  with maybe_interpret(True):
    got = jax.jit(lambda a, c: R.router_route(a, c, **kw))(x, b)
  check_route(got, R.router_route_reference(x, b, **kw))


def test_router_route_tables_feed_fp8_moe():
  """fp8_moe with router_route's tables == fp8_moe with moe_route's (the same tables: bit for bit)."""
  from pallas_kernels import linear as L  # noqa: PLC0415
  from test_linear_kernels import _shared_expert, moe_inputs  # noqa: PLC0415
  m, i, d, e, k = 3, 256, 384, 16, 4
  x, _, _, *w = moe_inputs(jax.random.key(60), m, e, i, d, k)
  logits, bias = make_logits(np.random.default_rng(), m, e, "scores")
  sh = _shared_expert(jax.random.key(61), i, d)
  kw = route_kw(m, e, k, True)
  with maybe_interpret(True):
    ids, tw, *tables = jax.jit(lambda a, c: R.router_route(a, c, **kw))(logits, bias)
    moe = jax.jit(lambda *a, tables=None: L.fp8_moe(*a, swiglu_limit=1.0, dq=True, route_kernel=True, shared=sh,
                                                    tables=tables))
    y = moe(x, ids, tw, *w, tables=tuple(tables))
    y0 = moe(x, ids, tw, *w)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(y0))
  with pytest.raises(ValueError, match="slot tables given for 1 token row"):
    L.fp8_moe(x[:1], ids[:1], tw[:1], *w, swiglu_limit=1.0, dq=True, route_kernel=True, shared=sh,
              tables=tuple(tables))


def test_router_route_rejects_bad_input():
  x, b = make_logits(np.random.default_rng(0), 5, 288, "scores")
  with pytest.raises(ValueError, match=r"expected 2..4 token rows"):
    R.router_route(x, b, **route_kw(5, 288, 8, True))
  with pytest.raises(ValueError, match=r"expected 2..4 token rows"):
    R.router_route(x[:1], b, **route_kw(1, 288, 8, True))
  with pytest.raises(ValueError, match="num_experts 256"):
    R.router_route(x[:2], b, **{**route_kw(2, 288, 8, True), "num_experts": 256})


@pytest.mark.parametrize("M", [2, 4])
def test_router_route_cross_lower(M):
  kw = route_kw(M, 288, 8, True)
  assert "mosaic_gpu" in cross_lower(lambda a, c: R.router_route(a, c, **kw), SDS((M, 288), jnp.float32),
                                     SDS((288,), jnp.float32)).as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("M,kind,shared", [(2, "scores", True), (4, "ties", True), (4, "special", False),
                                           (3, "scores", True)])
def test_router_route_gpu(M, kind, shared):
  """(natively: a warp per row — the first form, a warpgroup per row, mixed the rows here: session 34)"""
  x, b = make_logits(np.random.default_rng(), M, 288, kind)
  kw = route_kw(M, 288, 8, shared)
  got = jax.jit(lambda a, c: R.router_route(a, c, **kw))(x, b)
  check_route(got, jax.jit(lambda a, c: R.router_route_reference(a, c, **kw))(x, b))


# ------------------------------------------------------------------- the platform fact behind NATIVE_WRONG
def _wg_reductions(x, rounds: int):
  """A minimal kernel: W warpgroups of one CTA, warpgroup w reducing row w of x [W, N <= 256] f32 (max, min, sum,
  ``rounds`` times over, each round's input shifted by the last round's results so that no round can be hoisted)
  -> [W, 3]: the pattern of router_route's and the multi-warpgroup threshold kernel's first forms, alone."""
  from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: PLC0415
  W, N = x.shape
  vec = plgpu.Layout.WG_STRIDED((N,), vec_size=1)
  out = plgpu.Layout.WG_STRIDED((128,), vec_size=1)

  def body(x_g, o_g, x_s, o_s, bar):
    w = jax.lax.axis_index("wg")
    plgpu.copy_gmem_to_smem(x_g.at[w], x_s.at[w], bar.at[w])
    plgpu.barrier_wait(bar.at[w])
    v = plgpu.load(x_s.at[w], layout=vec)

    def step(_, c):
      mx, mn, sm = c
      u = v + (mx - mn) * 0.0 + sm * 0.0  # depends on the last round: a loop-carried reduction per round
      return jnp.max(u), jnp.min(u), jnp.sum(u)

    mx, mn, sm = jax.lax.fori_loop(0, rounds, step, (jnp.float32(0), jnp.float32(0), jnp.float32(0)))
    lane = plgpu.broadcasted_iota(jnp.int32, (128,), 0, layout=out)
    o_s[w] = jnp.where(lane == 0, mx, jnp.where(lane == 1, mn, jnp.where(lane == 2, sm, 0.0)))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_s.at[w], o_g.at[w])
    plgpu.wait_smem_to_gmem(0)

  res = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((W, 128), jnp.float32), grid=(1,), grid_names=("c",),
                     num_threads=W, thread_name="wg",
                     scratch_types=[plgpu.SMEM((W, N), jnp.float32), plgpu.SMEM((W, 128), jnp.float32),
                                    plgpu.Barrier(num_arrivals=1, num_barriers=W)])(x)
  return res[:, :3]


def _wg_inputs(rng, W=4, N=256):
  # rows of very different ranges: a warpgroup that read another's partials returns that row's max / min / sum
  return jnp.asarray(rng.standard_normal((W, N)).astype(np.float32) * 10.0 ** np.arange(W)[:, None])


def _wg_want(x):
  x = np.asarray(x)
  return np.stack([x.max(1), x.min(1), x.sum(1, dtype=np.float32)], axis=1)


def _assert_wg_sums(got, x):
  # an f32 sum of N terms in any order is within N·eps·Σ|x| of the exact one (cancellation makes a relative
  # tolerance on the sum itself flaky); a warpgroup summing another row (10x apart) is far outside it
  x = np.asarray(x, np.float64)
  bound = x.shape[1] * np.finfo(np.float32).eps * np.abs(x).sum(1)
  np.testing.assert_array_less(np.abs(got - x.sum(1)), bound)


def test_concurrent_warpgroup_reductions_interpret():
  """Interpret mode runs the warpgroups one after another: each gets its own row's reductions."""
  x = _wg_inputs(np.random.default_rng())
  with maybe_interpret(True):
    got = np.asarray(jax.jit(lambda a: _wg_reductions(a, 8))(x))
  np.testing.assert_array_equal(got[:, :2], _wg_want(x)[:, :2])
  _assert_wg_sums(got[:, 2], x)


@pytest.mark.gpu
@pytest.mark.xfail(strict=True, reason="jax 0.11.2 Mosaic GPU: warpgroup-semantics reductions put their "
                   "cross-warp scratch at one SMEM offset for every warpgroup (lowering._reduce_lowering_rule_wg), "
                   "so concurrent warpgroups race — why router_route and topk_threshold_4wg reduce per warp "
                   "(_common.warp_split_layout / warp_rows_layout); an XPASS here means a jax that fixed it")
def test_concurrent_warpgroup_reductions_gpu():
  x = _wg_inputs(np.random.default_rng())
  got = np.asarray(jax.jit(lambda a: _wg_reductions(a, 64))(x))
  np.testing.assert_array_equal(got[:, :2], _wg_want(x)[:, :2])
  _assert_wg_sums(got[:, 2], x)


def test_concurrent_warpgroup_reductions_lower_for_cuda():
  assert "mosaic_gpu" in cross_lower(lambda a: _wg_reductions(a, 64), SDS((4, 256), jnp.float32)).as_text()
