"""Does straight-line kernel code cost more than its arithmetic on the H200? A synthetic Mosaic GPU kernel runs the
same K steps of 8 independent FMA chains per thread either Python-unrolled (K copies of the code: straight-line,
each instruction run once) or as a loop (one copy run K times), on 1 CTA and on 132 (one per SM).

Why: session 31's one-launch mHC boundary, unrolled (3.1 MB of MLIR), ran ~135 µs per call in the decode step where
its work is a few µs; decode kernels are latency-bound and most of their CTAs run their code once. If the unrolled
rows here grow with K far faster than the loop rows, instruction fetch is the cost and the rule "loops, not
unrolled once-per-CTA code" (pallas_kernels/__init__.py) is measured, not guessed.

Columns: K, form, CTAs, device µs per call (CUPTI), ns per step, KB of the lowered module (MLIR text).

Usage (GPU):  PYTHONPATH=. python3 benchmarks/bench_code_size.py [--steps 256,1024,4096] [--out FILE]
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
from jax.experimental.pallas import mosaic_gpu as plgpu

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._timing import MODE, log, time_calls, write_log  # noqa: E402

SHAPE = (8, 128)  # 8 values per thread of one warpgroup (TMA boxes: <= 256 per dimension)


def _coef(i):
  """Step i's multiplier and addend (distinct per step, so that no two steps are the same instruction)."""
  return 1.0 + (i % 97) * 1e-6, (i % 89) * 1e-3


def fma_chain(x, steps: int, unroll: bool):
  """x [CTAs, 8, 128] f32 -> x after ``steps`` of x = x * a_i + b_i, in a Mosaic GPU kernel (a CTA per row)."""
  C = x.shape[0]

  def body(x_g, o_g, x_s, bar):
    c = lax.axis_index("c")
    plgpu.copy_gmem_to_smem(x_g.at[c], x_s, bar)
    plgpu.barrier_wait(bar)
    v = x_s[...]
    if unroll:
      for i in range(steps):
        a, b = _coef(i)
        v = v * a + b
    else:
      def step(i, v):
        a = 1.0 + (i % 97).astype(jnp.float32) * 1e-6
        b = (i % 89).astype(jnp.float32) * 1e-3
        return v * a + b
      v = lax.fori_loop(0, steps, step, v)
    x_s[...] = v
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(x_s, o_g.at[c])
    plgpu.wait_smem_to_gmem(0)

  return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((C, *SHAPE), jnp.float32), grid=(C,), grid_names=("c",),
                      scratch_types=[plgpu.SMEM(SHAPE, jnp.float32), plgpu.Barrier(num_arrivals=1)],
                      kernel_name="glm5_code_size_probe")(x)


def reference(x, steps: int):
  for i in range(steps):
    a, b = _coef(i)
    x = x * np.float32(a) + np.float32(b)
  return x


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--steps", default="256,1024,2048")
  p.add_argument("--ctas", default="1,132")
  p.add_argument("--out", default=None)
  a = p.parse_args(argv)
  rng = np.random.default_rng(0)
  log(f"# straight-line vs looped kernel code, {jax.devices()[0].device_kind}, timing: {MODE[0]}, "
      f"{time.strftime('%Y-%m-%d')}")
  log(f"{'K':>6} {'form':>8} {'CTAs':>5} {'dev us':>8} {'ns/step':>8} {'MLIR KB':>8}  same as numpy")
  for K in [int(k) for k in a.steps.split(",")]:
    for C in [int(c) for c in a.ctas.split(",")]:
      sets = [(jnp.asarray(rng.uniform(-1, 1, (C, *SHAPE)), jnp.float32),) for _ in range(4)]
      for unroll in (False, True):
        f = jax.jit(lambda x, unroll=unroll: fma_chain(x, K, unroll))
        kb = len(f.trace(*sets[0]).lower().as_text()) // 1000
        got = np.asarray(f(*sets[0]))
        ok = np.allclose(got, reference(np.asarray(sets[0][0]), K), rtol=1e-5, atol=1e-5)
        dev, _ = time_calls(f, sets)
        log(f"{K:>6} {'unrolled' if unroll else 'loop':>8} {C:>5} {dev:>8.2f} {1e3 * dev / K:>8.2f} {kb:>8}  "
            f"{'yes' if ok else 'NO'}")
        if a.out:  # after every row: a timeout (the unrolled compiles grow with K) keeps what was measured
          write_log(a.out)


if __name__ == "__main__":
  main()
