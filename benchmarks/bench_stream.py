"""How fast can a grid of CTAs stream FP8 weights from HBM by TMA, as a function of the weight's layout and box?

Why (session 70): the one-grid MoE streams ~57 MB per layer at one TP4 rank in 27.7 µs on an H100 (s69c's CUPTI
records: ~2.1 TB/s against ~3.35), and its in-kernel profile has the gate/up CTAs' loop at wait 13.4 + MMA 6.6 µs
per warpgroup — the stream, not the arithmetic. Every weight-streaming kernel of the package (the MoE's, the dense
FP8 / BF16 GEMVs) requests [bm, 128] boxes of a row-major [N, K] weight: bm rows of 128 contiguous bytes, 4 KB
apart (K = 4,096), and a CTA's next box of the same rows comes one step (~1.4 µs) later — each 128-byte piece a
DRAM access of its own. A weight stored tile by tile ([N/bm, K/128, bm, 128]: each box 8-16 KB contiguous) would
give the same kernels whole DRAM pages. This kernel does nothing but the stream (a ring of `stages` boxes per CTA,
each refilled as soon as it lands), so its time is the layout's.

Cases (each a grid of `split` K-splits x N/bm row tiles, every CTA `K / (128 · split)` steps, the weight rotated
over enough copies to miss L2; µs per call by CUPTI, the kernel's bytes / its time):
  rows     w [N, K] row-major, box [bm, bk] at (tile · bm, k · bk)     (the package's kernels today)
  tiled    w [N/bm, K/bk, bm, bk], box = one whole tile                 (the same bytes per step, contiguous)
  xla      jnp.sum over the row-major weight as int32 (XLA's own streaming reduction, for reference)

  moe      (--moe) the step's one-grid MoE itself, its weights row-major vs tile-major (linear.tile_major)

Usage (GPU):  PYTHONPATH=. python3 benchmarks/bench_stream.py [--mb 38] [--moe] [--out FILE]
CPU (no GPU): --lower-only cross-lowers every case's kernel for CUDA (what CI checks)."""

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

K = 4096  # the model's hidden size: the MoE gate/up's and most GEMVs' contraction


def _stream_body(layout: str, bm: int, bk: int, steps: int, stages: int, tiles: int):
  def body(w_ref, o_ref, w_s, bar):
    t = lax.axis_index("t")
    tile, sk = t % tiles, t // tiles

    def issue(i):
      kb = sk * steps + i
      src = (w_ref.at[pl.ds(tile * bm, bm), pl.ds(kb * bk, bk)] if layout == "rows" else w_ref.at[tile, kb])
      plgpu.copy_gmem_to_smem(src, w_s.at[i % stages], bar.at[i % stages])

    for i in range(min(stages, steps)):
      issue(i)
    for i in range(steps):  # nothing reads the slots: a landed box frees its slot at once
      plgpu.barrier_wait(bar.at[i % stages])
      if i + stages < steps:
        issue(i + stages)
    # the last box out again (one small store per CTA: the kernel has an output and its loads a consumer)
    plgpu.copy_smem_to_gmem(w_s.at[(steps - 1) % stages], o_ref.at[t])
    plgpu.wait_smem_to_gmem(0)
  return body


def stream(w, *, layout: str, bm: int, bk: int, split: int, stages: int):
  """One pass over the weight w (rows: [N, K] uint8; tiled: [N/bm, K/bk, bm, bk]) -> the CTAs' last boxes."""
  if layout == "rows":
    n, k = w.shape
  else:
    tn, tk, _, _ = w.shape
    n, k = tn * bm, tk * bk
  tiles, kb = n // bm, k // bk
  if kb % split:
    raise ValueError(f"bench_stream: split {split} must divide K / bk = {kb}")
  steps = kb // split
  kern = plgpu.kernel(
      _stream_body(layout, bm, bk, steps, stages, tiles),
      out_type=jax.ShapeDtypeStruct((tiles * split, bm, bk), w.dtype),
      scratch_types=[plgpu.SMEM((stages, bm, bk), w.dtype), plgpu.Barrier(num_barriers=stages)],
      grid=(tiles * split,), grid_names=("t",), kernel_name=f"stream_{layout}")
  return kern(w)


def tile_major(w, bm: int, bk: int):
  """[N, K] -> [N/bm, K/bk, bm, bk]: each TMA box's bytes contiguous (what a load-time re-layout would store)."""
  n, k = w.shape
  return w.reshape(n // bm, bm, k // bk, bk).transpose(0, 2, 1, 3)


CASES = [  # (name, layout, bm, bk, split, stages): 280 CTAs each at the default size (the MoE grid's ~288)
    ("rows 64x128 (the MoE's box)", "rows", 64, 128, 2, 4),
    ("tiled 64x128", "tiled", 64, 128, 2, 4),
    ("rows 128x128 (the dense FP8 box)", "rows", 128, 128, 4, 3),
    ("tiled 128x128", "tiled", 128, 128, 4, 3),
    ("rows 64x256", "rows", 64, 256, 2, 3),
    ("tiled 64x256", "tiled", 64, 256, 2, 3),
    ("rows 64x128, 8 stages", "rows", 64, 128, 2, 8),
    ("tiled 64x128, 8 stages", "tiled", 64, 128, 2, 8),
]


def moe_ab(reps: int, n_sets: int = 12, e: int = 288, i: int = 512, d: int = 4096, k: int = 8):
  """The real rank's single-row MoE as the step calls it (the one grid with the router's selection inside: 288
  experts, top-8 + the shared expert, I = 512, D = 4,096, f16 dequantisation, lean) with its weights row-major and
  tile-major (pallas_kernels.linear.tile_major at the plan's 64 / 128-row tiles): µs per call, and whether the two
  outputs are equal bit for bit."""
  from pallas_kernels import linear as L  # noqa: PLC0415
  rng = np.random.default_rng()

  key = [jax.random.key(int(rng.integers(1 << 30)))]

  def q8(shape):  # random e4m3 weights (within its ±448) and positive block scales (never zeros)
    key[0], kk = jax.random.split(key[0])
    w = jnp.clip(jax.random.normal(kk, shape, jnp.float32) * 64, -448, 448).astype(jnp.float8_e4m3fn)
    *lead, r, c = shape
    return w, jnp.asarray(rng.uniform(1e-4, 2e-4, (*lead, r // 128, c // 128)).astype(np.float32))

  ws = (*q8((e, i, d)), *q8((e, i, d)), *q8((e, d, i)))
  plan = L.plan_moe(k + 1, i, d, 8, gu_stages=3)
  tiles = (plan.gu_bm, None, plan.gu_bm, None, plan.dn_bm, None)
  tm = lambda a, bm: a if bm is None else L.tile_major(a, bm)  # noqa: E731
  tws = tuple(tm(a, bm) for a, bm in zip(ws, tiles))
  x = jnp.asarray(rng.standard_normal((1, d), np.float32)).astype(jnp.bfloat16)
  sets = []
  for _ in range(n_sets):
    sh = (*q8((i, d)), *q8((i, d)), *q8((d, i)))
    lg = jnp.asarray(rng.standard_normal((1, e), np.float32))
    bias = jnp.asarray(rng.uniform(-0.05, 0.05, e).astype(np.float32))
    sets.append((lg, bias, sh, tuple(tm(a, bm) for a, bm in zip(sh, tiles))))

  def call(x, lg, bias, *w):
    return L.fp8_moe(x, None, None, *w[:6], swiglu_limit=10.0, shared=w[6:], dq=True, dq_dtype="float16",
                     router=(lg, bias), router_select=(k, 2.5, True, True), counters=L.splitk_counters(),
                     out_dtype=jnp.float32, static_table=True, writer_cta=True, lean=True, one_grid=0)[0]

  f = jax.jit(call)
  rows = {}
  for name, w, pick in (("row-major", ws, 2), ("tile-major", tws, 3)):
    rows[name] = time_calls(f, [(x, s_[0], s_[1], *w, *s_[pick]) for s_ in sets], reps=reps)[0]
  same = all(bool(jnp.array_equal(f(x, s_[0], s_[1], *ws, *s_[2]), f(x, s_[0], s_[1], *tws, *s_[3])))
             for s_ in sets[:3])
  nb = (k + 1) * 3 * i * d
  log("")
  log(f"# the step's single-row MoE (one grid, router inside; {nb / 1e6:.1f} MB of FP8 weights a call, "
      f"{n_sets} sets of logits and shared experts rotated): outputs equal bit for bit: {same}")
  log("| MoE weights | µs / call | TB/s (weights) |")
  log("| --- | --- | --- |")
  for name, us in rows.items():
    log(f"| {name} | {us:.1f} | {nb / us / 1e6:.2f} |")


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--mb", type=float, default=37.7, help="bytes per call (MB): the MoE gate/up's 9 x 2 x 512 x 4,096")
  ap.add_argument("--copies", type=int, default=5, help="weight copies rotated over (past the 50 MB L2)")
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--lower-only", action="store_true", help="cross-lower every case for CUDA and stop (CPU)")
  ap.add_argument("--moe", action="store_true", help="also the step's one-grid MoE, row-major vs tile-major")
  ap.add_argument("--out", default=None)
  a = ap.parse_args(argv)
  n = int(a.mb * 1e6 / K) // 256 * 256
  if a.lower_only:
    for name, layout, bm, bk, split, stages in CASES:
      shape = (n, K) if layout == "rows" else (n // bm, K // bk, bm, bk)
      f = jax.jit(functools.partial(stream, layout=layout, bm=bm, bk=bk, split=split, stages=stages))
      f.trace(jax.ShapeDtypeStruct(shape, jnp.uint8)).lower(lowering_platforms=("cuda",))
      print(f"lowered: {name}")
    return
  dev = jax.devices()[0]
  log(f"# jax {jax.__version__}, {dev.device_kind}; {n} x {K} uint8 = {n * K / 1e6:.1f} MB per call, "
      f"{a.copies} copies rotated, {MODE[0]} time, median of {a.reps}")
  log("| case | CTAs | steps | µs / call | TB/s |")
  log("| --- | --- | --- | --- | --- |")
  rng = np.random.default_rng()
  base = [jnp.asarray(rng.integers(0, 256, (n, K), dtype=np.uint8)) for _ in range(a.copies)]
  for name, layout, bm, bk, split, stages in CASES:
    ws = base if layout == "rows" else [jax.block_until_ready(tile_major(w, bm, bk)) for w in base]
    f = jax.jit(functools.partial(stream, layout=layout, bm=bm, bk=bk, split=split, stages=stages))
    us, _ = time_calls(f, [(w,) for w in ws] * 4, reps=a.reps)
    # CTA t = (K split t // tiles, row tile t % tiles) ends on its split's last box: check the first and last CTA's
    got, tiles, steps = np.asarray(f(ws[0])), n // bm, K // bk // split
    for t in (0, tiles * split - 1):
      r0, k0 = t % tiles * bm, ((t // tiles + 1) * steps - 1) * bk
      if not np.array_equal(got[t], np.asarray(base[0][r0:r0 + bm, k0:k0 + bk])):
        raise SystemExit(f"bench_stream: {name}: CTA {t} streamed the wrong bytes")
    del ws
    log(f"| {name} | {n // bm * split} | {K // bk // split} | {us:.1f} | {n * K / us / 1e6:.2f} |")
  us, _ = time_calls(jax.jit(lambda w: jnp.sum(w.astype(jnp.int32))), [(w,) for w in base] * 4, reps=a.reps)
  log(f"| xla: jnp.sum over the row-major weight | - | - | {us:.1f} | {n * K / us / 1e6:.2f} |")
  del base
  if a.moe:
    moe_ab(a.reps)
  if a.out:
    write_log(a.out)


if __name__ == "__main__":
  main()
