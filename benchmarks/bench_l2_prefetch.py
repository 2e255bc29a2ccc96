"""Does prefetching the next kernel's weight into L2 from inside a latency-bound kernel shorten the next kernel?

The decode step is a chain of ~800 dependent launches; a weight-streaming kernel in it pays ~2-3 µs of ramp and
first bytes before streaming, and the latency-bound kernels between them (mHC boundary 7.1 µs × 90, the router's
top-k, the indexer's threshold) leave HBM idle. Here a stand-in for such a kernel — 128 CTAs that each issue their
share of ``prefetch_l2`` over the first P MB of the next kernel's weight, then spin for a
while (the boundary's work), and pass the activation x through (the data dependence) — runs before a consumer:

* ``xla``:   y = x @ W.T, W bf16 [N, K] (XLA's own GEMV: the KDA qkv projection's form, 50 MB at the real rank)
* ``bf16``:  pallas_kernels.linear.bf16_linear(x, W)
* ``fp8dq``: pallas_kernels.linear.fp8_dq_linear(x, W8, S) (W8 e4m3 [N, K], 128x128 block scales)

for P = 0 (no prefetch), and several P up to the whole weight. CUPTI kernel durations (µs per call), weights rotated
over enough copies to be cold in the 60 MB L2 at every call. Prints a table: the stand-in's µs, the consumer's µs
and the pair's sum, per P.

``--form tensor`` (session 55): the stand-in's CTAs issue TMA tensor L2 prefetches instead — [256, 256] boxes of
their rows, one thread each (``_common.issue_l2_prefetch``, what policy knob l2_prefetch issues from the step's
kernels) — and ``--cols`` takes every row's leading columns instead of leading rows (the column prefix
``layers.l2_budget`` takes: every CTA of the consumer starts from L2).

  python benchmarks/bench_l2_prefetch.py [--spin 600] [--mb 0,8,16,24,32,48] [--only xla,bf16,fp8dq]
                                         [--form bulk|tensor] [--cols]
"""

from __future__ import annotations

import argparse
import functools
import math
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
from jax.experimental.mosaic.gpu import utils as mgpu_utils  # noqa: E402
from pallas_kernels import linear as L  # noqa: E402
from pallas_kernels._common import interpreting, issue_l2_prefetch, mgpu_kernel  # noqa: E402

# The prefetch: cp.async.bulk.prefetch.L2 (sm_90+), a hint with no semantic effect and nothing to wait on, spread
# over the CTAs and their threads so that no one SM's copy unit issues a whole weight's requests. Measured in
# session 41 (BENCHMARKS.md): the stand-in's CTAs live ~1 µs longer per ~10 MB issued, and the consumer gains at
# most ~1.3 µs of 16 even with all 48 MB prefetched — not kept in the package's kernels. (Session 55's knobs use
# the TMA tensor form, _common.issue_l2_prefetch: --form tensor.)
PREFETCH_ALIGN = 16  # bytes: the bulk prefetch's size and address granularity


def prefetch_l2(ref, nbytes: int | None = None):
  """Hint the GPU to bring the first ``nbytes`` (default: all) of the contiguous GMEM ``ref`` (an array operand or
  a leading-dimension slice of one) into L2, split evenly over the calling warpgroup's 128 threads (each issues one
  bulk prefetch of nbytes / 128 bytes: a multiple of PREFETCH_ALIGN). Call it with each CTA's own share of a larger
  range. No effect in GPU interpret mode (no L2 to fill; the primitive has no interpreter)."""
  total = math.prod(ref.shape) * jnp.dtype(ref.dtype).itemsize
  nbytes = total if nbytes is None else int(nbytes)
  if not 0 < nbytes <= total or nbytes % (128 * PREFETCH_ALIGN):
    raise ValueError(f"prefetch_l2: {nbytes} bytes of a {total}-byte ref; expected a positive multiple of "
                     f"{128 * PREFETCH_ALIGN} (128 threads x {PREFETCH_ALIGN} B) up to the ref's size")
  if interpreting():
    return
  per = nbytes // 128

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
  def op(_, r):
    from jax._src.lib.mlir import ir  # noqa: PLC0415
    from jax._src.lib.mlir.dialects import arith, llvm  # noqa: PLC0415
    i32, i64 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64)
    tid = arith.remui(mgpu_utils.thread_idx(), mgpu_utils.c(128, i32))  # (i32: this warpgroup's thread)
    off = arith.muli(arith.extui(i64, tid), mgpu_utils.c(per, i64))
    addr = llvm.add(llvm.ptrtoint(i64, mgpu_utils.memref_ptr(r)), off,
                    overflow_flags=llvm.IntegerOverflowFlags.none)
    llvm.inline_asm(ir.Type.parse("!llvm.void"), [addr, mgpu_utils.c(per, i32)],
                    "cp.async.bulk.prefetch.L2.global [$0], $1;", "l,r", has_side_effects=True)

  op(ref)


CTAS = 128  # the stand-in's grid: the mHC boundary's (one CTA per 32 columns of D = 4096)


def _stand_in(rows_per_cta: int, spin: int, plan=()):
  """The latency-bound kernel: CTA g prefetches W's rows [g·r, (g+1)·r) (r = rows_per_cta; none when 0) — or, with
  a ``plan`` (``_common.l2_prefetch_args``), its share of the plan's TMA tensor prefetch boxes — spins ``spin``
  dependent iterations on a register vector (stored: not dead code), and CTA 0 copies x to the output."""
  def body(x_g, w_g, o_g, s_g, x_s, bar):
    g = lax.axis_index("g")
    if plan:
      issue_l2_prefetch((w_g,), plan, g, CTAS)
    elif rows_per_cta:
      prefetch_l2(w_g.at[pl.ds(g * rows_per_cta, rows_per_cta)])
    v = plgpu.broadcasted_iota(jnp.int32, (128,), 0, layout=plgpu.Layout.WG_STRIDED((128,), vec_size=1))
    v = lax.fori_loop(0, spin, lambda i, v: v * 0.999 + 0.001, v.astype(jnp.float32))
    s_g[g] = v

    @pl.when(g == 0)
    def _():
      plgpu.copy_gmem_to_smem(x_g, x_s, bar)
      plgpu.barrier_wait(bar)
      plgpu.copy_smem_to_gmem(x_s, o_g)
      plgpu.wait_smem_to_gmem(0)

  return body


@functools.partial(jax.jit, static_argnames=("rows_per_cta", "spin", "plan"))
def stand_in(x, w, *, rows_per_cta: int, spin: int, plan=()):
  xv = x.reshape(-1, 256)  # (TMA boxes: at most 256 per dimension)
  out = mgpu_kernel(_stand_in(rows_per_cta, spin, plan),
                    out_type=(jax.ShapeDtypeStruct(xv.shape, x.dtype), jax.ShapeDtypeStruct((CTAS, 128), jnp.float32)),
                    grid=(CTAS,), grid_names=("g",), kernel_name="stand_in",
                    scratch_types=[plgpu.SMEM(xv.shape, x.dtype), plgpu.Barrier(num_arrivals=1)])(xv, w)[0]
  return out.reshape(x.shape)


def _consumers(only):
  xla = lambda x, w, s: jnp.einsum("md,nd->mn", x, w, preferred_element_type=jnp.float32)  # noqa: E731
  bf16 = lambda x, w, s: L.bf16_linear(x, w)  # noqa: E731
  fp8dq = lambda x, w, s: L.fp8_dq_linear(x, w, s)  # noqa: E731
  table = {"xla": (xla, jnp.bfloat16), "bf16": (bf16, jnp.bfloat16), "fp8dq": (fp8dq, jnp.float8_e4m3fn)}
  return {k: table[k] for k in only}


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--n", type=int, default=6144, help="the weight's rows (6144 x 4096: the KDA qkv of a TP4 rank)")
  ap.add_argument("--k", type=int, default=4096)
  ap.add_argument("--spin", type=str, default="0,600", help="the stand-in's spin iterations (comma list)")
  ap.add_argument("--mb", type=str, default="0,8,16,24,32,48", help="MB of W to prefetch (0: none; capped at W)")
  ap.add_argument("--only", type=str, default="xla,bf16,fp8dq")
  ap.add_argument("--rows", type=int, default=1, help="token rows of x")
  ap.add_argument("--form", choices=["bulk", "tensor"], default="bulk",
                  help="bulk: cp.async.bulk.prefetch.L2 by 128 threads (session 41); tensor: TMA tensor boxes")
  ap.add_argument("--cols", action="store_true", help="(tensor) every row's leading columns instead of leading rows")
  ap.add_argument("--out", type=str, default=None)
  a = ap.parse_args()
  dev = jax.devices()[0]
  log(f"# jax {jax.__version__} {dev.device_kind}; timing: {MODE[0]}; W [{a.n}, {a.k}], x [{a.rows}, {a.k}] bf16")
  log("consumer  W MB  spin  pf MB  stand-in us  consumer us  pair us  consumer TB/s")
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((a.rows, a.k)), jnp.bfloat16)
  for name, (fn, wdt) in _consumers(a.only.split(",")).items():
    item = jnp.dtype(wdt).itemsize
    wmb = a.n * a.k * item / 2**20
    sets = max(4, int(np.ceil(4 * 60 / wmb)))  # one pass over the copies >= 4x L2: each call's W is cold
    ws = []
    for j in range(sets):
      w = jax.random.normal(jax.random.key(j), (a.n, a.k), jnp.float32) * 0.05
      s = jax.random.uniform(jax.random.key(100 + j), (a.n // 128, a.k // 128), jnp.float32, 0.5, 2.0)
      ws.append((w.astype(wdt), s))
    for spin in (int(v) for v in a.spin.split(",")):
      done = set()
      for mb in (float(v) for v in a.mb.split(",")):
        rows = min(a.n, int(mb * 2**20 / (a.k * item)))
        r = rows // CTAS
        r -= r % 8  # (a multiple of 8 rows: the bytes per thread a multiple of 16 for any K % 128 == 0)
        if (mb and r == 0) or r in done:
          continue  # (nothing to prefetch, or a P capped at the weight's size already measured)
        done.add(r)

        plan = ()
        if a.form == "tensor" and r:  # the same bytes as boxes: leading rows, or (--cols) leading columns
          nc = min(a.k, max(256, int(r * CTAS * a.k / a.n) // 256 * 256)) if a.cols else a.k
          rr = ((0, a.n),) if a.cols else ((0, r * CTAS),)
          plan = ((rr, a.n, a.k, nc),)  # (_common.l2_prefetch_args' plan of W [n, k]: row ranges, rows, cols, prefix)

        @jax.jit
        def pair(x, w, s, r=r, spin=spin, plan=plan):
          return fn(stand_in(x, w, rows_per_cta=r, spin=spin, plan=plan), w, s)

        tot, per = time_calls(pair, [(x, w, s) for w, s in ws])
        si = sum(v for k, v in per.items() if k.startswith("stand_in"))
        co = tot - si
        log(f"{name:8s} {wmb:5.1f} {spin:5d} {r * CTAS * a.k * item / 2**20:6.1f} {si:12.2f} {co:12.2f} "
            f"{tot:8.2f} {wmb * 2**20 / co / 1e6 if co else 0:10.2f}")
        log(f"#   per kernel: { {k: round(v, 2) for k, v in per.items()} }")
  if a.out:
    write_log(a.out)


if __name__ == "__main__":
  main()
