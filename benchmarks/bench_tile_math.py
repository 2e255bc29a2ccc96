"""Where a weight-streaming kernel's per-tile math goes: the dequantise-and-multiply of ONE 128-column FP8 block.

s50a / s51a's in-kernel profiles of the single-row MoE put ~0.9 µs (profiled) on each 128 x 128 weight tile's
"mma" scope — 7.4 µs of a gate/up CTA's ~15 and 3.6 of a down CTA's ~10 — and s51a showed that the down CTAs' data
arrives late and all at once, so this math is the kernels' tail. The PTX (BENCHMARKS.md session 51) of the bf16
form per tile and thread: 64 ``ld.shared.b16``, 64 ``cvt e4m3x2->f16x2``, 128 ``cvt.f32.f16``, 64 ``cvt
bf16x2.f32``, 16 ``wgmma m64n8k16`` and a wait. Which part costs what is measured here, with no HBM traffic: each
CTA loads one weight tile [bm, 128] e4m3 and one activation tile [mp, 128] into SMEM once, then repeats the tile
math ``--reps`` times in a rolled loop (as the kernels' steps do):

* ``bf16``:  linear._mma_tile's dq form: the tile loaded in the WGMMA layout, e4m3 -> f32 -> bf16, register-A
             wgmma, the accumulator read (the MoE and dense FP8 kernels' default, fp8_dq)
* ``f16``:   the same with f16 activations (e4m3x2 -> f16x2: policy dq_f16)
* ``wgmma``: the tile converted to bf16 ONCE before the loop; each rep only the register-A wgmma and its read
* ``wgmma_f16``: the same with the tile and x in f16 (so bf16 - wgmma and f16 - wgmma_f16 are each form's SMEM
             loads + conversion)
* ``hilo``:  the fp8 form (linear._mma_hi_lo: two fp8 wgmmas straight from SMEM, x as hi / lo e4m3 rows; no
             conversion; the pre-session-25 default)

for 1, 2 and 3 CTAs per SM (the MoE kernels' 288 CTAs are ~2.2 per SM). Prints ns per tile per CTA, (the rep loop's
kernel time minus a 1-rep kernel's) / (reps - 1), and tiles per µs per SM. CUPTI kernel durations.

  python benchmarks/bench_tile_math.py [--bm 64,128] [--per-sm 1,2,3] [--reps 64]
      [--only bf16,f16,wgmma,wgmma_f16,hilo]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._timing import MODE, log, time_calls, write_log  # noqa: E402
from pallas_kernels import linear as L  # noqa: E402
from pallas_kernels._common import interpreting, mgpu_kernel  # noqa: E402

VARIANTS = ("bf16", "f16", "wgmma", "wgmma_f16", "hilo")
F8 = jnp.float8_e4m3fn


def _x_dtype(variant: str):
  return {"bf16": jnp.bfloat16, "f16": jnp.float16, "wgmma": jnp.bfloat16, "wgmma_f16": jnp.float16,
          "hilo": F8}[variant]


def _body(variant: str, reps: int, bm: int, mp: int):
  """CTA g: W and x tiles into SMEM once, then ``reps`` tile maths summed into acc; o[g] = acc [bm, mp] f32."""
  def body(w_g, x_g, o_g, w_s, x_s, bar, *a_s):
    # (interpret mode cannot run a register-A wgmma: there the converted tile goes through the SMEM scratch a_s)
    a_s = a_s[0] if a_s else None
    g = lax.axis_index("g")
    plgpu.copy_gmem_to_smem(w_g, w_s, bar)
    plgpu.copy_gmem_to_smem(x_g, x_s, bar)
    plgpu.barrier_wait(bar)
    acc0 = plgpu.layout_cast(jnp.zeros((bm, mp), jnp.float32), plgpu.Layout.WGMMA)
    if variant.startswith("wgmma"):
      a = L._dequant_tile(w_s, a_s, x_s.dtype)  # once: the loop measures the multiply alone

      def step(i, acc):
        def mma(r):
          plgpu.wgmma(r, a, x_s.T)
          return r[...]
        return acc + pl.run_scoped(mma, plgpu.ACC((bm, mp), jnp.float32))
    else:  # (hilo: the dq=False form; bf16 / f16: dq with x's dtype)
      def step(i, acc):
        return acc + L._mma_tile(w_s, x_s, mp, variant != "hilo", a_s)
    o_g[g] = lax.fori_loop(0, reps, step, acc0)

  return body


@functools.partial(jax.jit, static_argnames=("variant", "reps", "ctas"))
def tile_math(w, x, *, variant: str, reps: int, ctas: int):
  """w [bm, 128] e4m3, x [mp, 128] (hilo: [2mp, 128] e4m3 hi | lo rows) -> [ctas, bm, mp] f32: every CTA's sum of
  ``reps`` identical tile products."""
  if variant not in VARIANTS:
    raise ValueError(f"variant={variant!r}: expected one of {VARIANTS}")
  bm = w.shape[0]
  mp = x.shape[0] // (2 if variant == "hilo" else 1)
  at = _x_dtype(variant)  # (the converted tile's dtype: x's)
  a_scratch = [plgpu.SMEM((bm, L.BLOCK), at, transforms=L._tr(at, L.BLOCK))] if (
      interpreting() and variant != "hilo") else []
  return mgpu_kernel(
      _body(variant, reps, bm, mp),
      out_type=jax.ShapeDtypeStruct((ctas, bm, mp), jnp.float32),
      grid=(ctas,), grid_names=("g",), kernel_name=f"tile_math_{variant}",
      scratch_types=[plgpu.SMEM(w.shape, F8, transforms=L._tr(F8, L.BLOCK)),
                     plgpu.SMEM(x.shape, x.dtype, transforms=L._tr(x.dtype, L.BLOCK)),
                     plgpu.Barrier(num_arrivals=2), *a_scratch],
  )(w, x)


def inputs(variant: str, bm: int, mp: int = 8, seed: int = 0):
  """(w [bm, 128] e4m3, x tile as the variant reads it, x's f32 value [mp, 128]): random, the 1 real row first."""
  rng = np.random.default_rng(seed)
  w = jnp.asarray(rng.uniform(-2, 2, (bm, L.BLOCK)), jnp.float32).astype(F8)
  xv = np.zeros((mp, L.BLOCK), np.float32)
  xv[0] = rng.standard_normal(L.BLOCK)
  if variant == "hilo":  # hi | lo e4m3 rows: x ~ hi + lo / LO_SCALE
    hi = jnp.asarray(xv).astype(F8)
    lo = ((jnp.asarray(xv) - hi.astype(jnp.float32)) * L.LO_SCALE).astype(F8)
    val = hi.astype(jnp.float32) + lo.astype(jnp.float32) / L.LO_SCALE
    return w, jnp.concatenate([hi, lo]), val
  x = jnp.asarray(xv).astype(_x_dtype(variant))
  return w, x, x.astype(jnp.float32)


def reference(w, xval, reps: int):
  """reps x (w @ x.T) in f32: [bm, mp]."""
  return reps * jnp.dot(w.astype(jnp.float32), xval.T, precision=lax.Precision.HIGHEST)


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--bm", default="64,128", help="weight tile rows (gate/up: 64, down: 128)")
  ap.add_argument("--per-sm", default="1,2,3", help="CTAs per SM (the grid: that many times the SM count)")
  ap.add_argument("--reps", type=int, default=64)
  ap.add_argument("--only", default=",".join(VARIANTS))
  ap.add_argument("--out", default=None)
  a = ap.parse_args()
  dev = jax.devices()[0]
  sms = getattr(dev, "core_count", None) or 132
  log(f"# jax {jax.__version__} {dev.device_kind} ({sms} SMs); timing: {MODE[0]}; {a.reps} reps per CTA, "
      "one 128-column block per rep, 1 real token row (mp = 8)")
  log("variant  bm  CTAs/SM  kernel us (reps)  kernel us (1)  ns/tile/CTA  tiles/us/SM  max err")
  for variant in a.only.split(","):
    for bm in (int(b) for b in a.bm.split(",")):
      w, x, xval = inputs(variant, bm)
      for per in (int(p) for p in a.per_sm.split(",")):
        ctas = per * sms
        run = {r: functools.partial(tile_math, variant=variant, reps=r, ctas=ctas) for r in (1, a.reps)}
        out = run[a.reps](w, x)
        err = float(jnp.max(jnp.abs(out[0] - reference(w, xval, a.reps))) /
                    (jnp.max(jnp.abs(reference(w, xval, a.reps))) + 1e-30))
        t_n = time_calls(run[a.reps], [(w, x)] * 8)[0]
        t_1 = time_calls(run[1], [(w, x)] * 8)[0]
        per_tile = (t_n - t_1) / (a.reps - 1) * 1e3
        log(f"{variant:7s} {bm:4d}  {per:7d}  {t_n:16.2f}  {t_1:13.2f}  {per_tile:11.1f}  "
            f"{per * 1e3 / per_tile:11.2f}  {err:.1e}")
  if a.out:
    write_log(a.out)


if __name__ == "__main__":
  main()
