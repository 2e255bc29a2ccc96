"""Benchmark one mHC layer boundary (the previous sublayer's post + this site's pre + the sublayer RMSNorm) at the
real width (4 streams × 4096), fused kernels (pallas_kernels/mhc.py) vs the stock XLA formulation, on one GPU.

Paths: "stock" (XLA), "fused" (the kernels: mhc_post_pre, a reduction, mhc_finish, mhc_sinkhorn, 64 / 128 columns
per CTA), "narrow" (the same with twice the CTAs, each half as wide: policy mhc_narrow, the default since session
32), "sums" (narrow, the finish and Sinkhorn summing the raw partials: policy mhc_fused_sums — no reduction),
"grid" (policy
mhc_grid_barrier, up to 4 rows: the boundary as one launch of 128 CTAs with a grid barrier, then mhc_sinkhorn on
its raw partials; with it, its kernel alone as one launch and as its two halves), "row" (policy mhc_row, one row:
"grid" with a column of every stream per thread, 32 CTAs — mhc_row_boundary; with it, its kernel alone).
Columns: "dev us" device time of one boundary (CUPTI kernel durations), "kernels" launches per boundary,
"chain us" wall time per boundary inside one jitted chain of 16 boundaries (XLA command buffers on, steady
state: the gaps between kernels count, as in the decode step), and the floor: bytes one boundary must move
(X in and out, y, fn, the normed output) at 4.3 TB/s.

Usage (GPU):  PYTHONPATH=. python3 benchmarks/bench_mhc.py [--rows 1,4,8,32,64] [--paths stock,fused,grid,row]
              [--out results.txt]
       --compile: instead, seconds to compile a chain of 16 boundaries (and of each part alone, 16 times) per M —
       the whole q = 4 step once took over 8 minutes to compile (session 22)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._timing import MODE, log, time_calls, write_log  # noqa: E402
from glm5_jax import config as C  # noqa: E402
from glm5_jax.layers import HyperConnection, RMSNorm, use_kernels  # noqa: E402
from pallas_kernels import mhc as km  # noqa: E402

HBM_BPS = 4.3e12
D, N, CHAIN = 4096, 4, 16


def _site(seed):
  cfg = C.real()
  rng = np.random.default_rng(seed)
  hc = nnx.eval_shape(lambda: HyperConnection(cfg, jnp.bfloat16))
  hc.fn.set_value(jnp.asarray(rng.standard_normal((24, N * D)) * 0.02, jnp.bfloat16))
  hc.base_scale.set_value(jnp.asarray(np.concatenate([rng.standard_normal(24), rng.uniform(0.5, 2, 3)]), jnp.float32))
  norm = nnx.eval_shape(lambda: RMSNorm(D, jnp.bfloat16, cfg.rms_norm_eps))
  norm.weight.set_value(jnp.asarray(rng.uniform(0.5, 1.5, D), jnp.bfloat16))
  return hc, norm


def stock(hc, norm, X2, y, mix):
  M = X2.shape[0]
  post, comb = HyperConnection.unpack(mix, (M,))
  Xn = HyperConnection.post(X2.reshape(M, N, D), y, post, comb)
  u, post, comb = hc.pre(Xn)
  return Xn.reshape(M, N * D), norm(u, jnp.bfloat16), km.mix_from_rows(post, comb.reshape(M, 16))


def fused(hc, norm, X2, y, mix):
  """The kernel path (mhc_post_pre, the XLA reduction, mhc_finish without the Sinkhorn + mhc_sinkhorn) with 64 /
  128 columns per CTA (the default until session 32)."""
  with use_kernels({"mhc_narrow": False}):
    return hc.fused(X2, (y, mix), norm)


def narrow(hc, norm, X2, y, mix):
  """The fused path with twice the CTAs, each half as wide (policy mhc_narrow: post_pre 32 columns per CTA, the
  finish 64)."""
  with use_kernels({"mhc_narrow": True}):
    return hc.fused(X2, (y, mix), norm)


def sums(hc, norm, X2, y, mix):
  """narrow, with mhc_finish and mhc_sinkhorn summing mhc_post_pre's raw partials (policy mhc_fused_sums: up to 4
  token rows; more rows fall back to the XLA reduction)."""
  with use_kernels({"mhc_narrow": True, "mhc_fused_sums": True}):
    return hc.fused(X2, (y, mix), norm)


def grid(hc, norm, X2, y, mix):
  """The boundary as one launch with a grid barrier (policy mhc_grid_barrier: mhc_post_finish, mhc_sinkhorn)."""
  with use_kernels({"mhc_grid_barrier": True}):
    return hc.fused(X2, (y, mix), norm)


def row(hc, norm, X2, y, mix):
  """The grid-barrier boundary in its one-token-row form (policy mhc_row: mhc_row_boundary, mhc_sinkhorn)."""
  with use_kernels({"mhc_grid_barrier": True, "mhc_row": True}):
    return hc.fused(X2, (y, mix), norm)


def compile_times(hc, norm, rows):
  """Seconds to compile CHAIN unrolled boundaries (stock, fused) and CHAIN copies of each fused kernel at M rows
  (session 22, before the Sinkhorn moved into mhc_finish: 16 boundaries at M = 4 took 64.9 s, their 16 XLA
  Sinkhorn fusions alone 36.0 s; the stock chain 17.6 s)."""
  log(f"# compile seconds for {CHAIN} boundaries / {CHAIN} copies of a part, {jax.devices()[0].device_kind}")
  log(f"{'M':>3} {'stock':>7} {'fused':>7} {'post_pre':>9} {'finish':>7}")
  eps = dict(eps=hc.eps, hc_norm_eps=hc.norm_eps)
  for M in rows:
    X2 = jax.ShapeDtypeStruct((M, N * D), jnp.bfloat16)
    y = jax.ShapeDtypeStruct((M, D), jnp.bfloat16)
    mix = (jax.ShapeDtypeStruct((N, km.ROWS), jnp.float32), jax.ShapeDtypeStruct((16, km.ROWS), jnp.float32))
    tot = jax.ShapeDtypeStruct((64, 40), jnp.float32)

    def chain(X2, y, mix, f):
      for _ in range(CHAIN):
        X2, y, mix = f(hc, norm, X2, y, mix)
      return X2, mix

    def post_pre(X2, y, mix):
      for _ in range(CHAIN):
        X2, part = km.mhc_post_pre(X2, y, mix, hc.fn[...])
        y = part[0, :M, :1].astype(jnp.bfloat16) + y
      return X2, y

    def finish(X2, tot):
      w = norm.weight[...]
      for _ in range(CHAIN):
        x, post, comb = km.mhc_finish(X2, tot.T, hc.base_scale[...], w, iters=hc.iters, **eps, norm_eps=norm.eps,
                                      post_mult=hc.post_mult)
        w = w + x[0]
        tot = tot.at[:, 4:8].add(post.T).at[:, 8:24].add(comb.T)
      return x, tot

    out = []
    for f, args in ((lambda *a: chain(*a, stock), (X2, y, mix)), (lambda *a: chain(*a, fused), (X2, y, mix)),
                    (post_pre, (X2, y, mix)), (finish, (X2, tot))):
      t = time.perf_counter()
      jax.jit(f).trace(*args).lower().compile()
      out.append(time.perf_counter() - t)
    log(f"{M:>3} " + " ".join(f"{v:>{w}.1f}" for v, w in zip(out, (7, 7, 9, 7))))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--rows", default="1,4,8,32,64")
  p.add_argument("--out", default=None)
  p.add_argument("--compile", action="store_true", help="compile times instead of run times (see the docstring)")
  p.add_argument("--paths", default="stock,fused,narrow,sums,grid", help="comma-separated paths, in this "
                 "order (and the fused path's kernels alone after them when 'fused' is among them)")
  a = p.parse_args(argv)
  paths = {"stock": stock, "fused": fused, "narrow": narrow, "sums": sums, "grid": grid, "row": row}
  names = a.paths.split(",")
  if unknown := set(names) - set(paths):
    raise SystemExit(f"--paths: unknown {sorted(unknown)}; known: {sorted(paths)}")
  hc, norm = _site(0)
  if a.compile:
    from pallas_kernels._common import maybe_interpret  # noqa: PLC0415 (interpret mode off a GPU: script check)
    with maybe_interpret():
      compile_times(hc, norm, [int(r) for r in a.rows.split(",")])
    if a.out:
      write_log(a.out)
    return
  rng = np.random.default_rng(1)
  log(f"# mHC boundary, D = {N}×{D}, {jax.devices()[0].device_kind}, timing: {MODE[0]}, "
      f"{time.strftime('%Y-%m-%d')}")
  log(f"{'M':>3} {'path':>6} {'dev us':>8} {'kernels':>8} {'chain us':>9} {'floor us':>9}")
  for M in [int(r) for r in a.rows.split(",")]:
    sets = []
    for _ in range(8):
      X2 = jnp.asarray(rng.standard_normal((M, N * D)), jnp.bfloat16)
      y = jnp.asarray(rng.standard_normal((M, D)), jnp.bfloat16)
      c = rng.uniform(0, 1, (M, 4, 4))
      post = rng.uniform(0, 2, (M, 4)).astype(np.float32)
      comb = (c / c.sum(1, keepdims=True)).reshape(M, 16).astype(np.float32)
      sets.append((X2, y, km.mix_from_rows(jnp.asarray(post), jnp.asarray(comb))))
    floor = (2 * M * N * D * 2 + M * D * 2 * 2 + 24 * N * D * 2) / HBM_BPS * 1e6
    for name, f in ((n, paths[n]) for n in names):
      if name == "grid" and M > km.PARTS_MAX_ROWS:  # (the model runs the kernels path there: not a grid row)
        log(f"{M:>3} {name:>6}   (the grid-barrier boundary takes up to {km.PARTS_MAX_ROWS} token rows)")
        continue
      if name == "row" and M != 1:
        log(f"{M:>3} {name:>6}   (the one-row boundary takes one token row)")
        continue
      one = jax.jit(lambda X2, y, mix, f=f: f(hc, norm, X2, y, mix))
      dev, kernels = time_calls(one, sets)

      @jax.jit
      def chain(X2, y, mix, f=f):
        for _ in range(CHAIN):  # unrolled, as the decode step's layer loop
          X2, x, mix = f(hc, norm, X2, y, mix)
          y = x  # the next "sublayer output"
        return X2, mix

      jax.block_until_ready(chain(*sets[0]))
      t = time.perf_counter()
      for i in range(20):
        out = chain(*sets[i % len(sets)])
      jax.block_until_ready(out)
      wall = (time.perf_counter() - t) / 20 / CHAIN * 1e6
      log(f"{M:>3} {name:>6} {dev:>8.1f} {len(kernels):>8} {wall:>9.1f} {floor:>9.2f}")
    if "fused" in names:
      finish_parts(hc, norm, sets, M)
    if "grid" in names and M <= km.PARTS_MAX_ROWS:
      grid_alone(hc, norm, sets, M)
    if "row" in names and M == 1:
      grid_alone(hc, norm, sets, M, km.mhc_row_boundary)
  if a.out:
    write_log(a.out)


def grid_alone(hc, norm, sets, M, kern=km.mhc_post_finish):
  """A grid-barrier boundary kernel alone (mhc_post_finish, or mhc_row_boundary; device µs per call): one launch
  with the grid barrier vs its two halves as two launches — what the barrier costs, against the launch it saves."""
  for launches in (1, 2):
    f = jax.jit(lambda X2, y, mix, launches=launches: kern(
        X2, y, mix, hc.fn[...], hc.base_scale[...], norm.weight[...], eps=hc.eps, hc_norm_eps=hc.norm_eps,
        norm_eps=norm.eps, approx_math=True, launches=launches))
    dev, kernels = time_calls(f, sets)
    log(f"#   M = {M}: {kern.__name__}, {launches} launch(es): {dev:.2f} µs ({len(kernels)} kernels)")


def finish_parts(hc, norm, sets, M):
  """The boundary's two kernels alone (device µs per call), and mhc_finish with the GPU's approximate math: its
  time and how far its outputs move (post / comb: max relative difference; x_in: the share of bf16 values that
  differ) from the exact-math kernel's."""
  pp = jax.jit(lambda X2, y, mix: km.mhc_post_pre(X2, y, mix, hc.fn[...]))
  dev, _ = time_calls(pp, sets)
  log(f"#   M = {M}: mhc_post_pre {dev:.2f} µs")
  fins = [(Xn, jnp.sum(part, axis=0).T) for Xn, part in (pp(*s) for s in sets)]
  outs = {}
  for approx in (False, True):
    fin = jax.jit(lambda Xn, t, approx=approx: km.mhc_finish(
        Xn, t, hc.base_scale[...], norm.weight[...], iters=hc.iters, eps=hc.eps, hc_norm_eps=hc.norm_eps,
        norm_eps=norm.eps, post_mult=hc.post_mult, approx_math=approx))
    dev, _ = time_calls(fin, fins)
    outs[approx] = [np.asarray(o, np.float32) for o in fin(*fins[0])]
    log(f"#   M = {M}: mhc_finish approx_math={approx} {dev:.2f} µs")
  # the split form (policy knob mhc_sinkhorn_split): the finish without its Sinkhorn CTA, and the mix alone
  consts = dict(iters=hc.iters, eps=hc.eps, hc_norm_eps=hc.norm_eps, post_mult=hc.post_mult, approx_math=True)
  fin_x = jax.jit(lambda Xn, t: km.mhc_finish(Xn, t, hc.base_scale[...], norm.weight[...], norm_eps=norm.eps,
                                              sinkhorn=False, **consts))
  dev, _ = time_calls(fin_x, fins)
  log(f"#   M = {M}: mhc_finish(sinkhorn=False) {dev:.2f} µs (the sublayer's wait with mhc_sinkhorn_split)")
  sk = jax.jit(lambda Xn, t: km.mhc_sinkhorn(t, hc.base_scale[...], D=Xn.shape[1] // km.N, **consts))
  dev, _ = time_calls(sk, fins)
  log(f"#   M = {M}: mhc_sinkhorn {dev:.2f} µs (off the critical path where independent kernels overlap)")
  (x0, p0, c0), (x1, p1, c1) = outs[False], outs[True]
  rel = max(float(np.max(np.abs(a[:, :M] - b[:, :M]) / np.maximum(np.abs(a[:, :M]), 1e-30))) for a, b in
            ((p0, p1), (c0, c1)))
  log(f"#   M = {M}: approx_math vs exact: post/comb max rel diff {rel:.2e}, x_in values differing "
      f"{np.mean(x0 != x1):.4f}")


if __name__ == "__main__":
  main()
