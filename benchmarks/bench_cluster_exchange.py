"""Can the CTAs of one Mosaic GPU kernel exchange partial sums, and what does it cost? (GPU only.)

The mHC boundary is three launches today (``mhc_post_pre``, an XLA reduction of its [G, 64, 40] partial sums,
``mhc_finish``; ~15 µs per boundary, 90 per step, BENCHMARKS.md session 23) because the finish needs the sum of
every CTA's partials. One kernel could do it if its CTAs — a cluster, co-scheduled by the hardware — exchange
their [64, 40] partials through global memory: each CTA stores its partial, ``fence.acq_rel.cluster``, arrives on
a cluster barrier and waits for all, fences again, then reads and sums every partial. GPU interpret mode cannot
show whether that is correct (it does not order a ClusterBarrier against GMEM across CTAs: every CTA but the last
read uninitialised partials there) and cross-lowering only shows that it compiles, so this measures it natively:

  exchange    one launch: C CTAs (a cluster) store, synchronise, read back and sum; each writes the total
  no fences   the same without the two fences (is the barrier alone enough on the H200?)
  two-launch  today's pattern: one kernel stores the partials, an XLA reduction sums them

For each: µs of device time per call (CUPTI), kernels per call, and whether every CTA's total equals the sum of
the partials (to float rounding: XLA may sum in another order).

Usage (GPU):  PYTHONPATH=. python3 benchmarks/bench_cluster_exchange.py [--clusters 2,4,8,16] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._timing import MODE, log, time_calls, write_log  # noqa: E402

ROWS, COLS = 64, 40  # the mHC partials: 64 token rows (wgmma M) x 40 sums
_L = plgpu.Layout


def _fence():
  """fence.acq_rel.cluster: orders this thread's GMEM accesses with the cluster barrier's arrive / wait."""

  @plgpu.inline_mgpu()
  def fence(ctx):
    del ctx
    mgpu_utils.inline_ptx("fence.acq_rel.cluster;", has_side_effects=True)

  fence()


def exchange(x, *, fences: bool = True):
  """x [C, 64, 40] f32 (one partial per CTA) -> (partials as stored [C, 64, 40], totals [C, 64, 40]: each CTA's
  sum of all C partials in the order 0..C-1), one launch of a cluster of C CTAs."""
  C = x.shape[0]

  def body(x_g, part_g, tot_g, cbar):
    c = lax.axis_index("c")
    part_g[c] = plgpu.load(x_g.at[c], layout=_L.WGMMA, optimized=False) * 2.0  # "compute" a partial
    if fences:
      _fence()
    plgpu.barrier_arrive(cbar)
    plgpu.barrier_wait(cbar)
    if fences:
      _fence()
    tot = plgpu.load(part_g.at[0], layout=_L.WGMMA, optimized=False)
    for j in range(1, C):
      tot = tot + plgpu.load(part_g.at[j], layout=_L.WGMMA, optimized=False)
    tot_g[c] = tot

  out = jax.ShapeDtypeStruct((C, ROWS, COLS), jnp.float32)
  return plgpu.kernel(body, out_type=(out, out), grid=(C,), grid_names=("c",), cluster=(C,), cluster_names=("cl",),
                      scratch_types=[plgpu.ClusterBarrier(collective_axes=("cl",))],
                      kernel_name="glm5_probe_cluster_exchange")(x)


def two_launch(x):
  """Today's pattern: a kernel of C CTAs stores its partials, XLA sums them."""
  C = x.shape[0]

  def body(x_g, part_g):
    c = lax.axis_index("c")
    part_g[c] = plgpu.load(x_g.at[c], layout=_L.WGMMA, optimized=False) * 2.0

  part = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((C, ROWS, COLS), jnp.float32), grid=(C,),
                      grid_names=("c",), kernel_name="glm5_probe_partials")(x)
  return part, jnp.sum(part, axis=0)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--clusters", default="2,4,8,16")
  p.add_argument("--out", default=None)
  a = p.parse_args(argv)
  if jax.devices()[0].platform != "gpu":
    raise SystemExit("bench_cluster_exchange runs natively only (GPU interpret mode does not model the exchange)")
  rng = np.random.default_rng(0)
  log(f"# CTA exchange through GMEM in one launch, {jax.devices()[0].device_kind}, timing: {MODE[0]}, "
      f"{time.strftime('%Y-%m-%d')}")
  log(f"{'C':>3} {'variant':>12} {'dev us':>8} {'kernels':>8}  correct")
  for C in [int(c) for c in a.clusters.split(",")]:
    sets = [(jnp.asarray(rng.standard_normal((C, ROWS, COLS)), jnp.float32),) for _ in range(4)]
    want = np.sum(2.0 * np.asarray(sets[0][0]), axis=0, dtype=np.float32)
    for name, fn in (("exchange", exchange), ("no fences", lambda x: exchange(x, fences=False)),
                     ("two-launch", two_launch)):
      try:
        f = jax.jit(fn)
        _, tot = f(*sets[0])  # [C, 64, 40] (every CTA's total) or [64, 40]
        ok = bool(np.allclose(np.asarray(tot), want, rtol=1e-6, atol=1e-5))
        dev, names = time_calls(f, sets)
        log(f"{C:>3} {name:>12} {dev:>8.2f} {len(names):>8}  {'yes' if ok else 'NO'}")
      except Exception as e:  # noqa: BLE001 (a cluster size the launch refuses is a result too)
        log(f"{C:>3} {name:>12} failed: {type(e).__name__}: {str(e).splitlines()[0][:150]}")
  if a.out:
    write_log(a.out)


if __name__ == "__main__":
  main()
