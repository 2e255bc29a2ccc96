"""What a dependent Mosaic GPU launch costs inside the decode step's CUDA graph, and whether Programmatic Dependent
Launch (PDL) hides it.

The one-rank step is ~1,500 launches, most of them small and each waiting for the one before it: every launch
pays its start-up (the grid's launch, the prologue's TMA loads) after its predecessor has drained. With PDL a
kernel calls ``griddepcontrol.launch_dependents``, so that the next kernel in the stream is launched while it
still runs; that kernel issues the loads that do not depend on its predecessor (its weights) and then blocks in
``griddepcontrol.wait`` until the predecessor has finished and its writes are visible. jax 0.11.2 exposes both
(``plgpu.griddepcontrol_launch_dependents`` / ``plgpu.griddepcontrol_wait``; a kernel that uses them is launched
with programmatic stream serialisation by Mosaic's runtime), and XLA has ``--xla_gpu_enable_pdl``. Whether a
Mosaic kernel recorded into XLA's command buffer (by stream capture, as a custom call) keeps the programmatic edge
to its predecessor is what this measures.

A chain of K kernels: x_{k+1} = x_k · 0.999 + 10⁻³ · w_k[:8], x [8, W] f32 the chain, w_k [64, W] f32 each
kernel's own "weights" (read by TMA: independent of the chain), one CTA per 128 columns. Variants:
  plain      — load w and x, wait, compute, store;
  pdl        — load w, griddepcontrol.wait, launch the dependents, load x, compute, store (w prefetched);
  pdl_early  — launch the dependents, load w, wait, load x, ... (the trigger first: waiting grids may cascade);
  pdl_step   — wait, launch the dependents, then plain's body: the decode step's form (policy pdl,
               pallas_kernels._common.with_pdl);
  xla        — the same arithmetic as XLA fusions (optimisation barriers keep one per step).
Printed per variant: µs per kernel of wall time over chained calls (one jitted call = the K kernels, XLA's CUDA
graph), GPU busy µs per kernel (CUPTI), and the chain's result against "plain" (it must be bit-identical: a
kernel that read its input before the predecessor wrote it would differ).

  python benchmarks/bench_pdl.py [--kernels 256] [--width 512] [--calls 50] [--uses-pdl-attr] [--out rows.jsonl]
  XLA_FLAGS=--xla_gpu_enable_pdl=true python benchmarks/bench_pdl.py        # (and =false; and without command
  XLA_FLAGS=--xla_gpu_enable_command_buffer= python benchmarks/bench_pdl.py # buffers: kernels launched one by one)
``--uses-pdl-attr`` also marks the pdl variants' custom calls ``uses_pdl`` in their backend config (the attribute
XLA's custom-call thunk reads to launch a kernel with PDL where it supports it) — an experiment: XLA may refuse
the unknown attribute, which is then reported.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402

from benchmarks._timing import _EXT  # noqa: E402

ROWS, WROWS, COLS = 8, 64, 128  # chain rows, weight rows, columns per CTA


def chain_kernel(x, w, *, mode: str):
  """x [8, W] f32, w [64, W] f32 -> x · 0.999 + 10⁻³ · w[:8] (one CTA per 128 columns); ``mode`` a variant."""
  W = x.shape[1]

  def body(x_g, w_g, o_g, x_s, w_s, o_s, bar_w, bar_x):
    j = lax.axis_index("g") * COLS
    if mode == "pdl_step":
      plgpu.griddepcontrol_wait()
      plgpu.griddepcontrol_launch_dependents()
    if mode == "pdl_early":
      plgpu.griddepcontrol_launch_dependents()  # the next kernel may launch now (it waits for this one to finish)
    plgpu.copy_gmem_to_smem(w_g.at[:, pl.ds(j, COLS)], w_s, bar_w)  # independent of the chain: before the wait
    if mode in ("pdl", "pdl_early"):
      plgpu.griddepcontrol_wait()  # the predecessor has finished and its writes are visible
    if mode == "pdl":
      plgpu.griddepcontrol_launch_dependents()
    plgpu.copy_gmem_to_smem(x_g.at[:, pl.ds(j, COLS)], x_s, bar_x)
    plgpu.barrier_wait(bar_w)
    plgpu.barrier_wait(bar_x)
    o_s[...] = x_s[...] * 0.999 + w_s[pl.ds(0, ROWS), :] * 1e-3
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_s, o_g.at[:, pl.ds(j, COLS)])
    plgpu.wait_smem_to_gmem(0)

  return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((ROWS, W), jnp.float32),
                      scratch_types=[plgpu.SMEM((ROWS, COLS), jnp.float32), plgpu.SMEM((WROWS, COLS), jnp.float32),
                                     plgpu.SMEM((ROWS, COLS), jnp.float32), plgpu.Barrier(num_arrivals=1),
                                     plgpu.Barrier(num_arrivals=1)],
                      grid=(W // COLS,), grid_names=("g",), kernel_name=f"{mode}_probe")(x, w)


def build(variant: str):
  def chain(x, ws):
    for w in ws:
      if variant == "xla":
        x = lax.optimization_barrier(x * 0.999 + w[:ROWS] * 1e-3)
      else:
        x = chain_kernel(x, w, mode=variant)
    return x

  return jax.jit(chain, donate_argnums=0)


@contextlib.contextmanager
def uses_pdl_attr(on: bool):
  """Add ``uses_pdl = true`` to the backend config of every Mosaic GPU custom call lowered inside (jax 0.11.2
  passes PDL only to Mosaic's own launcher, as a module attribute)."""
  if not on:
    yield
    return
  from jax._src.interpreters import mlir  # noqa: PLC0415
  from jax._src.lib.mlir import ir  # noqa: PLC0415
  orig = mlir.custom_call

  def custom_call(call_target_name, *args, backend_config=None, **kwargs):
    if call_target_name == "mosaic_gpu_v2" and isinstance(backend_config, dict):
      backend_config = dict(backend_config, uses_pdl=ir.BoolAttr.get(True))
    return orig(call_target_name, *args, backend_config=backend_config, **kwargs)

  mlir.custom_call = custom_call
  try:
    yield
  finally:
    mlir.custom_call = orig


def timed(f, x, ws, calls: int):
  """(wall µs per call, GPU busy µs per call, the chained result) over ``calls`` chained calls."""
  x = f(x, ws)
  jax.block_until_ready(x)
  t = time.perf_counter()
  for _ in range(calls):
    x = f(x, ws)
  jax.block_until_ready(x)
  wall = (time.perf_counter() - t) / calls * 1e6
  busy = float("nan")
  if _EXT is not None:
    _EXT._cupti_init()
    for _ in range(calls):
      x = f(x, ws)
    jax.block_until_ready(x)
    busy = sum(ms for _, ms in _EXT._cupti_get_timings(True)) * 1e3 / calls
  return wall, busy, x


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--kernels", type=int, default=256, help="chain length K (launches per call)")
  p.add_argument("--width", type=int, default=512, help="columns (CTAs = width / 128)")
  p.add_argument("--calls", type=int, default=50)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--variants", default="plain,pdl,pdl_early,pdl_step,xla")
  p.add_argument("--uses-pdl-attr", action="store_true")
  p.add_argument("--out", default=None, help="append one JSON line per variant")
  a = p.parse_args(argv)
  if a.width % COLS:
    raise SystemExit(f"--width {a.width}: expected a multiple of {COLS}")
  flags = os.environ.get("XLA_FLAGS", "")
  print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}, XLA_FLAGS={flags!r}, K = {a.kernels}, "
        f"{a.width // COLS} CTAs, uses_pdl attr: {a.uses_pdl_attr}, {time.strftime('%Y-%m-%d')}")
  print(f"{'variant':>8} {'compile s':>9} {'wall us/kernel':>14} {'GPU us/kernel':>13} {'repeats (wall)':>26} "
        f"{'vs plain':>9}")
  rng = np.random.default_rng()
  ws = [jnp.asarray(rng.standard_normal((WROWS, a.width)), jnp.float32) for _ in range(a.kernels)]
  x0 = np.asarray(rng.standard_normal((ROWS, a.width)), np.float32)
  ref = None
  for variant in a.variants.split(","):
    try:
      t = time.time()
      with uses_pdl_attr(a.uses_pdl_attr and variant.startswith("pdl")):
        f = build(variant).lower(jnp.asarray(x0), ws).compile()
      comp = time.time() - t
      once = np.asarray(f(jnp.asarray(x0), ws))  # one call from x0: the chain's result
      runs = [timed(f, jnp.asarray(x0), ws, a.calls) for _ in range(a.repeats)]
    except Exception as e:  # noqa: BLE001 (a variant the runtime refuses: report and go on)
      print(f"{variant:>8} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
      continue
    if variant == "plain":
      ref = once
    diff = "" if ref is None else ("same" if np.array_equal(once, ref) else f"{np.abs(once - ref).max():.1e}")
    wall = float(np.median([r[0] for r in runs])) / a.kernels
    busy = float(np.median([r[1] for r in runs])) / a.kernels
    reps = " / ".join(f"{r[0] / a.kernels:.2f}" for r in runs)
    print(f"{variant:>8} {comp:>9.1f} {wall:>14.2f} {busy:>13.2f} {reps:>26} {diff:>9}", flush=True)
    if a.out:
      with open(a.out, "a") as fh:
        fh.write(json.dumps(dict(variant=variant, xla_flags=flags, uses_pdl_attr=a.uses_pdl_attr, kernels=a.kernels,
                                 ctas=a.width // COLS, compile_s=comp, wall_us_per_kernel=wall,
                                 gpu_us_per_kernel=busy, same_as_plain=diff in ("", "same"),
                                 device=jax.devices()[0].device_kind, date=time.strftime("%Y-%m-%d"))) + "\n")


if __name__ == "__main__":
  main()
