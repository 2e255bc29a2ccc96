"""Tests of pallas_kernels/router.py: the MoE router's selection (sigmoid, bias, top-k, normalised weights).

CPU: the Mosaic GPU kernel in GPU interpret mode against the lax.top_k reference on fresh random logits (the
real 288 experts and a small E, ties, NaN / ±inf, rows of several tokens), the bad-input errors, the model's
Router through the kernel against the XLA path, and CUDA cross-lowering of the decode's row counts.
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


@pytest.mark.parametrize("M,E,k,kind,norm", [(1, 288, 8, "scores", True), (4, 288, 8, "ties", True),
                                             (5, 64, 4, "special", False), (2, 288, 8, "special", True)])
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


def test_model_router_through_the_kernel():
  """glm5_jax.layers.Router with the kernel (policy router_kernel) selects the experts of the XLA path (rank
  count) and of the stock path (sort), with the same weights."""
  from flax import nnx  # noqa: PLC0415
  from glm5_jax import config as C  # noqa: PLC0415
  from glm5_jax.layers import Router, use_kernels  # noqa: PLC0415
  cfg = C.oracle_tiny().replace(n_routed_experts=288, num_experts_per_tok=8)
  r = nnx.eval_shape(lambda: Router(cfg, jnp.float32))
  rng = np.random.default_rng()
  r.weight.set_value(jnp.asarray(rng.standard_normal((288, cfg.hidden_size)) * 0.05, jnp.float32))
  r.e_score_correction_bias.set_value(jnp.asarray(rng.standard_normal(288) * 0.01, jnp.float32))
  x = jnp.asarray(rng.standard_normal((3, 4, cfg.hidden_size)), jnp.float32)
  with use_kernels(None):
    want = jax.jit(r.__call__)(x)
  with maybe_interpret(True), use_kernels({"router_kernel": True}):
    got = jax.jit(r.__call__)(x)
  with use_kernels({"router_kernel": False}):
    xla = jax.jit(r.__call__)(x)
  assert got[0].shape == (3, 4, 8) and got[1].shape == (3, 4, 8)
  check(got, want)
  check(xla, want)


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
