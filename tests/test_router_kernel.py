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
