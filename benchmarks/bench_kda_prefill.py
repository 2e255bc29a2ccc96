"""Times the prefill chunk's KDA hand-over kernel (pallas_kernels/kda_prefill.py) on one GPU.

The hand-over is the sequential part of a chunk's chunked KDA: S_{c+1} = R_c S_c + P_c over its n 32-token
sub-chunks, per head — one launch a KDA layer, ~85 µs of a 512-token chunk on an H100 (session 78's trace: 2.05 ms
a chunk for 24 layers). Each CTA keeps a [128, vb] block of a head's state in SMEM and accumulates R_c S_c as 128
rank-1 updates on the CUDA cores; this times the updates' unroll factor and the state columns a CTA at one TP4
rank's shapes (16 heads of 128 x 128 states; n = 16 / 32 sub-chunks: a 512- / 1,024-token chunk), against XLA's
chain (the reference: a scan of f32 products). Every configuration's outputs are checked against the rolled
kernel's (bit for bit: the same sums in the same order). Fresh random inputs per call (8 sets, back to back);
device time per call from CUPTI (the kernels' durations), wall-clock where CUPTI is unavailable.

  PYTHONPATH=. python3 benchmarks/bench_kda_prefill.py [--n 16 32] [--unroll 1 2 4 8 16] [--vb 16 32] [--out F]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._timing import MODE, log, time_calls, write_log  # noqa: E402
from pallas_kernels import kda_prefill as KP  # noqa: E402

HEADS, K = 16, 128  # one TP4 rank's KDA heads, the state's size


def _inputs(seed: int, n: int):
  """Hand-over matrices as kda_chunked forms them (a decaying identity minus a small product), offsets, a state."""
  k = jax.random.split(jax.random.key(seed), 4)
  decay = jax.random.uniform(k[0], (n, HEADS, 1, K), minval=0.5, maxval=1.0)
  Rt = jnp.eye(K)[None, None] * decay - jax.random.normal(k[1], (n, HEADS, K, K)) * 0.02
  return Rt, jax.random.normal(k[2], (n, HEADS, K, K)), jax.random.normal(k[3], (HEADS, K, K))


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--n", type=int, nargs="+", default=[16, 32], help="sub-chunks a chunk (chunk tokens / 32)")
  ap.add_argument("--unroll", type=int, nargs="+", default=[1, 2, 4, 8, 16])
  ap.add_argument("--vb", type=int, nargs="+", default=[16, 32])
  ap.add_argument("--out", default=None)
  a = ap.parse_args()
  log(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}, timing: {MODE[0]}; {HEADS} heads of {K} x {K} "
      f"f32 states")
  log(f"{'n':>3} {'vb':>3} {'unroll':>6} {'µs':>8} {'vs rolled':>9}  check")
  t0 = time.time()
  for n in a.n:
    sets = [jax.block_until_ready(_inputs(1000 * n + i, n)) for i in range(8)]
    ref = jax.jit(KP.kda_handover_reference)
    us_ref = time_calls(ref, sets)[0]
    log(f"{n:>3} {'-':>3} {'xla':>6} {us_ref:8.1f} {'':>9}  (the reference: XLA's scan)")
    for vb in a.vb:
      base_us, base_out = None, None
      for u in a.unroll:
        f = jax.jit(lambda *x, vb=vb, u=u: KP.kda_handover(*x, vb=vb, unroll=u))
        out = [np.asarray(o) for o in f(*sets[0])]
        if base_out is None:
          base_out = out
          e_ref, s_ref = (np.asarray(o) for o in ref(*sets[0]))
          err = max(float(np.abs(out[0] - e_ref).max()), float(np.abs(out[1] - s_ref).max()))
          check = f"max |kernel - xla| {err:.1e}"
        else:
          check = "bit for bit" if all(np.array_equal(x, y) for x, y in zip(out, base_out)) else "DIFFERS"
        us = time_calls(f, sets)[0]
        base_us = base_us or us
        log(f"{n:>3} {vb:>3} {u:>6} {us:8.1f} {us / base_us:9.2f}  {check}")
  log(f"# {time.time() - t0:.0f} s")
  if a.out:
    write_log(a.out)


if __name__ == "__main__":
  main()
