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

Measured (session 70, an H100, BENCHMARKS.md): the layout changes nothing — 36.7 MB in 14.6 µs either way (2.5
TB/s; 74 MB 2.63 TB/s, XLA's reduction 2.1-2.4), and the step's one-grid MoE with its weights tile-major (fp8_moe
taught both layouts, commit 0745d27) 28.0 -> 27.5 µs, bit for bit: ~2.5-2.65 TB/s is what a TMA stream of this
size reaches on that GPU (~78 % of its 3.35 TB/s), the MoE's 56.6 MB at 2.0 TB/s. The layout support was not kept.

Usage (GPU):  PYTHONPATH=. python3 benchmarks/bench_stream.py [--mb 38] [--out FILE]
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


def last_boxes(w, bm: int, bk: int, split: int) -> np.ndarray:
  """What ``stream`` returns for the row-major weight w [N, K] (whatever layout it streamed): CTA t = (K split
  t // tiles, row tile t % tiles) ends on its split's last [bm, bk] box -> [CTAs, bm, bk]."""
  w = np.asarray(w)
  tiles, steps = w.shape[0] // bm, w.shape[1] // bk // split
  return np.stack([w[t % tiles * bm:(t % tiles + 1) * bm, ((t // tiles + 1) * steps - 1) * bk:][:, :bk]
                   for t in range(tiles * split)])


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


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--mb", type=float, default=37.7, help="bytes per call (MB): the MoE gate/up's 9 x 2 x 512 x 4,096")
  ap.add_argument("--copies", type=int, default=5, help="weight copies rotated over: at least 150 MB in all (the "
                  "H100's / H200's L2 is 50 MB)")
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--lower-only", action="store_true", help="cross-lower every case for CUDA and stop (CPU)")
  ap.add_argument("--out", default=None)
  a = ap.parse_args(argv)
  n = int(a.mb * 1e6 / K) // 256 * 256
  copies = max(a.copies, -(-150_000_000 // (n * K)))
  if a.lower_only:
    for name, layout, bm, bk, split, stages in CASES:
      shape = (n, K) if layout == "rows" else (n // bm, K // bk, bm, bk)
      f = jax.jit(functools.partial(stream, layout=layout, bm=bm, bk=bk, split=split, stages=stages))
      f.trace(jax.ShapeDtypeStruct(shape, jnp.uint8)).lower(lowering_platforms=("cuda",))
      print(f"lowered: {name}")
    return
  dev = jax.devices()[0]
  log(f"# jax {jax.__version__}, {dev.device_kind}; {n} x {K} uint8 = {n * K / 1e6:.1f} MB per call, "
      f"{copies} copies rotated, {MODE[0]} time, median of {a.reps}")
  log("| case | CTAs | steps | µs / call | TB/s |")
  log("| --- | --- | --- | --- | --- |")
  rng = np.random.default_rng()
  base = [jnp.asarray(rng.integers(0, 256, (n, K), dtype=np.uint8)) for _ in range(copies)]
  for name, layout, bm, bk, split, stages in CASES:
    ws = base if layout == "rows" else [jax.block_until_ready(tile_major(w, bm, bk)) for w in base]
    f = jax.jit(functools.partial(stream, layout=layout, bm=bm, bk=bk, split=split, stages=stages))
    us, _ = time_calls(f, [(w,) for w in ws] * 4, reps=a.reps)
    if not np.array_equal(np.asarray(f(ws[0])), last_boxes(base[0], bm, bk, split)):
      raise SystemExit(f"bench_stream: {name}: a CTA streamed the wrong bytes")
    del ws
    log(f"| {name} | {n // bm * split} | {K // bk // split} | {us:.1f} | {n * K / us / 1e6:.2f} |")
  us, _ = time_calls(jax.jit(lambda w: jnp.sum(w.astype(jnp.int32))), [(w,) for w in base] * 4, reps=a.reps)
  log(f"| xla: jnp.sum over the row-major weight | - | - | {us:.1f} | {n * K / us / 1e6:.2f} |")
  if a.out:
    write_log(a.out)


if __name__ == "__main__":
  main()
