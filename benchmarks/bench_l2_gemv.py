"""How much faster is a decode GEMV whose weight is already in L2? (The H200's L2: 50 MB.)

Chains of n XLA GEMVs y_{i+1} = y_i + 1e-3 · tile(W_i y_i) in one jit (x [K] bf16, one token row): "cold" — n
distinct weights (n · MB far past L2: each link reads its W from HBM); "warm" — one weight for every link (after
the first, each link reads it from L2). µs per link = (the chain's time − one link's) / (n − 1), wall time of the
call (median of repeats), the link's small update fusion included in both. The L2 prefetch knobs rested on the gap
between the two (BENCHMARKS.md session 55; measured slower in session 58, removed in session 59).

  python benchmarks/bench_l2_gemv.py [--shapes 2048x4096,4096x2048,3072x4096,6144x4096] [--n 24] [--reps 30]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np


def chain(ws, x, reuse: int):
  """n links over the weights ws (reuse = n: ws[0] every time)."""
  y = x
  for i in range(reuse or len(ws)):
    out = jnp.dot(ws[0] if reuse else ws[i], y, preferred_element_type=jnp.float32)
    y = (jnp.tile(out, -(-y.shape[0] // out.shape[0]))[: y.shape[0]] * 1e-3 + y).astype(y.dtype)
  return y


def median_s(f, *args, reps: int) -> float:
  f(*args).block_until_ready()
  ts = []
  for _ in range(reps):
    t = time.perf_counter()
    f(*args).block_until_ready()
    ts.append(time.perf_counter() - t)
  return float(np.median(ts))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--shapes", default="2048x4096,4096x2048,3072x4096,6144x4096", help="W [N x K] bf16, comma list")
  ap.add_argument("--n", type=int, default=24, help="links per chain")
  ap.add_argument("--reps", type=int, default=30)
  a = ap.parse_args(argv)
  print(f"# jax {jax.__version__}, {jax.devices()[0].device_kind}; {a.n} links per chain, median of {a.reps}")
  print("| W (bf16) | MB | cold µs / link (HBM) | warm µs / link (L2) | warm / cold |")
  print("| --- | --- | --- | --- | --- |")
  key = jax.random.key(int(np.random.default_rng().integers(1 << 30)))
  for shape in a.shapes.split(","):
    n_out, n_in = (int(v) for v in shape.split("x"))
    ws = [jax.random.normal(jax.random.fold_in(key, i), (n_out, n_in), jnp.bfloat16) for i in range(a.n)]
    x = jax.random.normal(key, (n_in,), jnp.bfloat16)
    one = median_s(jax.jit(lambda ws, x: chain(ws, x, 1)), ws[:1], x, reps=a.reps)
    cold = (median_s(jax.jit(lambda ws, x: chain(ws, x, 0)), ws, x, reps=a.reps) - one) / (a.n - 1)
    warm = (median_s(jax.jit(lambda ws, x: chain(ws, x, a.n)), ws[:1], x, reps=a.reps) - one) / (a.n - 1)
    print(f"| {n_out} × {n_in} | {n_out * n_in * 2 / 1e6:.1f} | {1e6 * cold:.1f} | {1e6 * warm:.1f} | "
          f"{warm / cold:.2f} |", flush=True)


if __name__ == "__main__":
  main()
