"""The prefill chunk's KDA hand-over kernel (pallas_kernels/kda_prefill.py): kernel == reference in GPU interpret
mode on CPU and natively on a GPU, its CUDA lowering at a 512-token chunk of the real geometry, bad shapes named."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tol
from pallas_kernels import kda_prefill as KP
from pallas_kernels._common import cross_lower, maybe_interpret

SDS = jax.ShapeDtypeStruct


def _inputs(n, B, K, V):
  """Hand-over matrices as kda_chunked forms them (a decaying identity minus a small product: the state neither
  blows up nor vanishes over the chain), their offsets and an entry state, all fresh random."""
  rng = np.random.default_rng()
  Rt = np.eye(K)[None, None] * rng.uniform(0.5, 1.0, (n, B, 1, K)) - rng.standard_normal((n, B, K, K)) * 0.02
  P = rng.standard_normal((n, B, K, V))
  S0 = rng.standard_normal((B, K, V))
  return tuple(jnp.asarray(a, jnp.float32) for a in (Rt, P, S0))


@pytest.mark.parametrize("n,B,V,vb", [(3, 2, 32, 16), (1, 1, 16, 16), (5, 1, 128, 32)])
def test_kda_prefill_kernel_interpret(n, B, V, vb):
  """Each sub-chunk's entry state and the final state == the reference chain (f32 rank-1 updates against XLA's
  f32 product: the fp32 paths' tolerance); one sub-chunk; state blocks of 32 columns."""
  args = _inputs(n, B, 128, V)
  e_ref, s_ref = KP.kda_handover_reference(*args)
  with maybe_interpret(True):
    e, s = KP.kda_handover(*args, vb=vb)
  assert e.shape == (n, B, 128, V) and s.shape == (B, 128, V)
  np.testing.assert_array_equal(np.asarray(e[0]), np.asarray(args[2]))  # (the first entry: S0 as given)
  np.testing.assert_allclose(np.asarray(e), np.asarray(e_ref), **tol("fp32_paths"))
  np.testing.assert_allclose(np.asarray(s), np.asarray(s_ref), **tol("fp32_paths"))


@pytest.mark.parametrize("unroll", [4, 8])
def test_kda_prefill_kernel_unrolled_interpret(unroll):
  """The rank-1 updates unrolled (kda_handover(unroll=)): the same sums in the same order — bit for bit the rolled
  loop's entry and final states."""
  args = _inputs(3, 2, 128, 32)
  with maybe_interpret(True):
    rolled = [np.asarray(a) for a in KP.kda_handover(*args, unroll=1)]
    got = [np.asarray(a) for a in KP.kda_handover(*args, unroll=unroll)]
  for a, b in zip(got, rolled):
    np.testing.assert_array_equal(a, b)


def test_kda_prefill_kernel_refuses_bad_shapes():
  ok = (SDS((2, 1, 128, 128), jnp.float32), SDS((2, 1, 128, 64), jnp.float32), SDS((1, 128, 64), jnp.float32))
  with pytest.raises(ValueError, match=r"K a multiple of 64"):
    jax.eval_shape(KP.kda_handover, SDS((2, 1, 96, 96), jnp.float32), SDS((2, 1, 96, 64), jnp.float32),
                   SDS((1, 96, 64), jnp.float32))
  with pytest.raises(ValueError, match=r"vb=12"):
    jax.eval_shape(lambda *a: KP.kda_handover(*a, vb=12), *ok)
  with pytest.raises(ValueError, match=r"S0 \(1, 128, 32\)"):
    jax.eval_shape(KP.kda_handover, *ok[:2], SDS((1, 128, 32), jnp.float32))
  for bad in (0, 3, 2.0):
    with pytest.raises(ValueError, match=r"unroll=.*expected a positive divisor of K = 128"):
      jax.eval_shape(lambda *a, u=bad: KP.kda_handover(*a, unroll=u), *ok)


@pytest.mark.parametrize("n", [16, 32])
def test_kda_prefill_kernel_cross_lower(n):
  """Lowers for CUDA at one TP4 rank's 16 KDA heads of 128 x 128 states, 16 and 32 sub-chunks (a 512- and a
  1,024-token chunk); and unrolled by 8."""
  args = (SDS((n, 16, 128, 128), jnp.float32), SDS((n, 16, 128, 128), jnp.float32), SDS((16, 128, 128), jnp.float32))
  assert "glm5_kda_handover" in cross_lower(KP.kda_handover, *args).as_text()
  if n == 16:
    assert "glm5_kda_handover" in cross_lower(lambda *a: KP.kda_handover(*a, unroll=8), *args).as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("n,B", [(16, 16), (3, 2)])
def test_kda_prefill_kernel_gpu(n, B):
  """Natively: a 512-token chunk's 16 sub-chunks x one rank's 16 heads, and a short chain — the reference's
  tolerance; unrolled by 4 and 8, bit for bit the rolled loop."""
  args = _inputs(n, B, 128, 128)
  e_ref, s_ref = jax.jit(KP.kda_handover_reference)(*args)
  e, s = KP.kda_handover(*args, unroll=1)
  np.testing.assert_allclose(np.asarray(e), np.asarray(e_ref), **tol("fp32_paths"))
  np.testing.assert_allclose(np.asarray(s), np.asarray(s_ref), **tol("fp32_paths"))
  for unroll in (4, 8):
    eu, su = KP.kda_handover(*args, unroll=unroll)
    np.testing.assert_array_equal(np.asarray(eu), np.asarray(e))
    np.testing.assert_array_equal(np.asarray(su), np.asarray(s))
