"""L2 prefetch as a launch of its own, beside the decode step's critical chain (policy knob l2_prefetch_side).

A decode step at one token row leaves HBM idle through its latency-bound kernels (the mHC boundary, the KDA
recurrence, the DSA layer's selection). ``l2_prefetch`` asks the memory system to bring the weights of the GEMVs
that follow such a kernel into L2 (TMA ``cp.async.bulk.prefetch.tensor`` L2 prefetches, dealt out over its CTAs
by ``_common.issue_l2_prefetch``), and it is a kernel of its own on purpose: session 41 measured that a CTA lives
until its bulk prefetches have been processed (a stand-in for the mHC boundary that prefetched 16 MB lived 1.55
-> 4.68 µs), so prefetches issued from a kernel on the critical chain lengthen that chain. This one hangs off the
chain: its operand ``after`` (an activation ready when the window opens, e.g. the boundary's input) orders its
launch, and its token is an input of the next mHC boundary kernel, which only waits for it
(``glm5_jax.layers.side_tokens``), by when it is long done — under XLA's CONCURRENT command-buffer schedule it
runs on a stream of its own, as the mHC Sinkhorn does. (The token must reach a kernel: session 55 joined it to the
chain through an optimization barrier only, and XLA deleted every launch — benchmarks/step_census.py, session
56.) Its CTAs hold one warpgroup and no shared memory: they sit beside the chain's kernels on the SMs.

``l2_prefetch_reference`` is its reference: the token, each CTA's count of boxes asked for.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._common import issue_l2_prefetch, kernel_entry, l2_prefetch_boxes, mgpu_kernel

CTAS = 66  # half the H200's SMs: enough TMA units to issue ~20 MB within a few µs, room beside the chain's CTAs
LANES = 128  # the token's row per CTA (one warpgroup's strided vector)


def _check(weights, plan, ctas: int):
  if len(weights) != len(plan) or not weights:
    raise ValueError(f"l2_prefetch: {len(weights)} weights for a plan of {len(plan)} targets; expected the "
                     "same number, at least one (_common.l2_prefetch_args)")
  for w, (ranges, R, C, nc) in zip(weights, plan):
    if w.shape != (R, C):
      raise ValueError(f"l2_prefetch: a weight of shape {w.shape} for a plan target [{R}, {C}]")
  if not 1 <= ctas <= 1024:
    raise ValueError(f"l2_prefetch: ctas={ctas}; expected 1..1024")


def l2_prefetch_reference(after, *weights, plan, ctas: int = CTAS):
  """-> token [ctas, LANES] int32: row c = how many of ``plan``'s boxes CTA c asks for. (Nothing is moved.)"""
  del after
  _check(weights, plan, ctas)
  n = [sum(bool(v) for *_, v in l2_prefetch_boxes(plan, c, ctas)) for c in range(ctas)]
  return jnp.broadcast_to(jnp.asarray(n, jnp.int32)[:, None], (ctas, LANES))


@kernel_entry("plan", "ctas")
def l2_prefetch(after, *weights, plan, ctas: int = CTAS):
  """Mosaic GPU version of ``l2_prefetch_reference``: ``ctas`` CTAs each issue their share of ``plan``'s L2
  prefetch boxes of ``weights`` (2D [R, C] views; ``_common.l2_prefetch_args``) and store how many they asked
  for. ``after`` (any array) is read by nobody: it only orders the launch after its producer. A no-op but for the
  token in GPU interpret mode."""
  _check(weights, plan, ctas)
  vec = plgpu.Layout.WG_STRIDED((LANES,), vec_size=1)

  def body(after_g, *refs):
    *w_refs, tok_g = refs
    c = lax.axis_index("c")
    issue_l2_prefetch(w_refs, plan, c, ctas)
    n = sum(v.astype(jnp.int32) for *_, v in l2_prefetch_boxes(plan, c, ctas))
    tok_g[c] = plgpu.layout_cast(jnp.full((LANES,), 0, jnp.int32) + n, vec)

  return mgpu_kernel(body, out_type=jax.ShapeDtypeStruct((ctas, LANES), jnp.int32), grid=(ctas,),
                     grid_names=("c",), kernel_name="glm5_l2_prefetch")(after, *weights)
