"""pallas_kernels.prefetch (policy knob l2_prefetch_side): the L2 prefetch launch against its reference (the token:
each CTA's count of boxes asked for — interpret mode on CPU, natively on a GPU), its CUDA lowering at the model's
shapes, and its refusals."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import prefetch as P
from pallas_kernels._common import l2_prefetch_args, l2_prefetch_boxes, maybe_interpret

SDS = jax.ShapeDtypeStruct


@pytest.mark.parametrize("ctas", [1, 5, 66])
def test_kernel_is_the_reference(ctas):
  """Two targets (bf16 [3, 320, 384] merged to 960 rows, rows 200..700; FP8 [300, 256], its first 128 columns):
  the kernel's token — per CTA, the boxes it asked for — is the reference's, and the counts add up to the plan's
  boxes (every box dealt to exactly one CTA)."""
  rng = np.random.default_rng()
  a = jnp.asarray(rng.standard_normal((3, 320, 384)), jnp.bfloat16)
  b = jnp.asarray(rng.standard_normal((300, 256)), jnp.float32).astype(jnp.float8_e4m3fn)
  x = jnp.asarray(rng.standard_normal((1, 64)), jnp.float32)
  pf, plan = l2_prefetch_args(((a, ((200, 700),)), (b, None, 128)))
  with maybe_interpret():
    got = jax.jit(lambda x, *w: P.l2_prefetch(x, *w, plan=plan, ctas=ctas))(x, *pf)
  ref = P.l2_prefetch_reference(x, *pf, plan=plan, ctas=ctas)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
  assert int(np.asarray(ref)[:, 0].sum()) == 2 * 2 + 2 * 1  # (a: 2 row blocks x 2 column blocks; b: 2 x 1)


def test_lowers_for_cuda_at_the_model_shapes(monkeypatch):
  """A KDA layer's first weights at the real rank (f_a/g_a/b [320, 4096] bf16 whole, then q/k/v [3, 2048, 4096]
  bf16's leading columns within the 24 MiB budget) over 66 CTAs: each CTA's unrolled share of predicated TMA L2
  prefetches, as many as the plan deals it at most."""
  from glm5_jax.layers import l2_budget  # noqa: PLC0415
  from helpers import barrier_counts  # noqa: PLC0415
  args = (SDS((1, 4096), jnp.bfloat16), SDS((320, 4096), jnp.bfloat16), SDS((3, 2048, 4096), jnp.bfloat16))
  plans = []

  def f(x, fgb, qkv):
    pf, plan = l2_prefetch_args(l2_budget((fgb, qkv)))
    plans.append(plan)
    return P.l2_prefetch(x, *pf, plan=plan)
  got = barrier_counts(monkeypatch, ("glm5_l2_prefetch",), f, *args, needle="cp.async.bulk.prefetch")
  plan = plans[-1]
  assert plan[0] == (((0, 320),), 320, 4096, 4096) and plan[1][1:3] == (6144, 4096) and plan[1][3] % 256 == 0
  assert 0 < plan[1][3] < 4096  # (a column prefix of q/k/v: the budget's rest)
  slots = len(l2_prefetch_boxes(plan, 0, P.CTAS))
  assert got["glm5_l2_prefetch"] == slots, (got, slots)


def test_refuses_a_plan_that_is_not_the_weights():
  rng = np.random.default_rng()
  x = jnp.asarray(rng.standard_normal((1, 8)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((256, 256)), jnp.bfloat16)
  pf, plan = l2_prefetch_args(((w, None),))
  with pytest.raises(ValueError, match="2 weights for a plan of 1 targets"):
    P.l2_prefetch_reference(x, w, w, plan=plan)
  with pytest.raises(ValueError, match=r"a weight of shape \(128, 256\) for a plan target \[256, 256\]"):
    P.l2_prefetch_reference(x, w[:128], plan=plan)
  with pytest.raises(ValueError, match="ctas=0"):
    P.l2_prefetch_reference(x, *pf, plan=plan, ctas=0)
