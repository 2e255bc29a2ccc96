"""Where the time goes INSIDE the decode step's fixed-latency kernels: Mosaic GPU's in-kernel profiler.

The step is a chain of ~800 dependent launches whose kernel durations make it up (session 40's profile: 4,056 of a
~4.3 ms step at q = 1), and the large ones are far from their bytes' floor: the MoE's gate/up 13.5 µs for 37.7 MB,
down 8.4 for 18.9 MB, the mHC boundary 7.1 µs for ~0.8 MB. CUPTI gives a kernel's
duration only; with ``pallas_kernels._common.kernel_profile`` every warpgroup records the entry / exit times of
the body's ``jax.named_scope`` regions (``select`` / ``wait`` / ``mma`` / ``barrier`` / ...). This script runs
each kernel at the real TP4 rank's shapes (fresh random inputs) under the profiler and prints, per kernel and
region path: instances per warpgroup, when it begins after the kernel's first warpgroup starts (median / max over
warpgroups) and its time per warpgroup (median / max), and the kernel's span and CTA start spread (the launch
ramp). The profiler adds ~12 cycles per event: the spans are a little longer than CUPTI's durations.

Usage (GPU):  PYTHONPATH=. python3 benchmarks/bench_kernel_profile.py --dir /tmp/kprof [--cases moe,mhc,...]
              [--out table.txt]
"""

from __future__ import annotations

import argparse
import collections
import functools
import glob
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._timing import log, write_log  # noqa: E402
from glm5_jax import config as C  # noqa: E402
from pallas_kernels import linear as L  # noqa: E402
from pallas_kernels import mhc as km  # noqa: E402
from pallas_kernels._common import kernel_profile  # noqa: E402

MOE = dict(E=288, I=512, D=4096, k=8)


def _fp8(key, shape):
  """Block-quantised e4m3 weights with [.., ceil(r/128), ceil(c/128)] scales (random, never zeros)."""
  w = jax.random.normal(key, shape, jnp.float32) * 0.05
  s = jnp.abs(w).reshape(*shape[:-2], shape[-2] // 128, 128, shape[-1] // 128, 128).max(axis=(-3, -1)) / 448.0
  q = (w / jnp.repeat(jnp.repeat(s, 128, -2), 128, -1)).astype(jnp.float8_e4m3fn)
  return q, s


def moe_inputs(seed):
  e, i, d, k = MOE["E"], MOE["I"], MOE["D"], MOE["k"]
  ks = jax.random.split(jax.random.key(seed), 9)
  wg, sg = _fp8(ks[0], (e, i, d))
  wu, su = _fp8(ks[1], (e, i, d))
  wd, sd = _fp8(ks[2], (e, d, i))
  x = jax.random.normal(ks[3], (1, d), jnp.float32).astype(jnp.bfloat16)
  ids = jax.random.permutation(ks[4], e)[:k].reshape(1, k).astype(jnp.int32)
  tw = jax.random.uniform(ks[5], (1, k), jnp.float32, 0.05, 0.5)
  sh = (*_fp8(ks[6], (i, d)), *_fp8(ks[7], (i, d)), *_fp8(ks[8], (d, i)))
  return (x, ids, tw, wg, sg, wu, su, wd, sd), sh


def mhc_inputs(seed, M: int = 1):
  cfg, N, D = C.real(), km.N, MOE["D"]
  rng = np.random.default_rng(seed)
  X = jnp.asarray(rng.standard_normal((M, N * D)), jnp.bfloat16)
  y = jnp.asarray(rng.standard_normal((M, D)), jnp.bfloat16)
  mix = (jnp.asarray(rng.uniform(0.1, 1.0, (N, km.ROWS)), jnp.float32),
         jnp.asarray(rng.uniform(0.0, 0.5, (N * N, km.ROWS)), jnp.float32))
  fn = jnp.asarray(rng.standard_normal((km.MIX, N * D)) * 0.02, jnp.bfloat16)
  coef = jnp.asarray(np.concatenate([rng.standard_normal(km.MIX), rng.uniform(0.5, 2, 3)]), jnp.float32)
  w = jnp.asarray(rng.uniform(0.5, 1.5, D), jnp.bfloat16)
  consts = dict(eps=cfg.hc_eps, hc_norm_eps=cfg.rms_norm_eps, norm_eps=cfg.rms_norm_eps)
  return (X, y, mix, fn, coef, w), consts


def cases(names):
  """name -> (a function of no arguments that runs the kernel(s) once, jitted)."""
  out = {}
  if any(n.startswith("moe") for n in names):
    args, sh = moe_inputs(0)
    if "moe" in names:
      f = jax.jit(lambda a, s: L.fp8_moe(*a, swiglu_limit=10.0, shared=s, dq=True))
      out["moe"] = lambda: f(args, sh)
  # the step's single-row form: the selection in the gate/up kernel, the sums inside (moe_rows); _static: with
  # static_table (policy moe_static_table: the slot count a number, the down kernel's table staged in SMEM);
  # _writer: writer_cta (policy moe_writer_cta: the selection stored by an extra gate/up CTA)
  forms = {"moe_rows": {}, "moe_rows_static": {"static_table": True}, "moe_rows_writer": {"writer_cta": True},
           "moe_rows_sw": {"static_table": True, "writer_cta": True},
           "moe_rows_lean": {"static_table": True, "writer_cta": True, "lean": True},
           # (policy moe_one_grid: both kernels as one grid — each CTA a gate/up item, then a down item)
           "moe_one_grid": {"static_table": True, "writer_cta": True, "lean": True, "one_grid": 0}}
  for name, extra in forms.items():
    if name not in names:
      continue
    (x, _, _, wg, sg, wu, su, wd, sd), sh = moe_inputs(0)
    kk = jax.random.key(7)
    logits = jax.random.normal(kk, (1, MOE["E"]), jnp.float32)
    bias = jax.random.uniform(jax.random.fold_in(kk, 1), (MOE["E"],), jnp.float32, -0.05, 0.05)
    r = jax.jit(functools.partial(lambda x, lg, b, ws, s, extra: L.fp8_moe(
        x, None, None, *ws, swiglu_limit=10.0, shared=s, dq=True, router=(lg, b),
        router_select=(MOE["k"], 2.5, True, True), counters=L.splitk_counters(), out_dtype=jnp.bfloat16,
        **extra)[0], extra=extra))
    out[name] = functools.partial(r, x, logits, bias, (wg, sg, wu, su, wd, sd), sh)
  if any(n.startswith("compact") for n in names):  # the indexer's compaction at 32K context (8,704 pools), q = 1
    from pallas_kernels import indexer as I  # noqa: PLC0415
    rng = np.random.default_rng(2)
    sc = np.maximum(rng.standard_normal((1, 8704)), 0).astype(np.float32)
    sc[:, 8256:] = -np.inf  # (the scores kernel's padding past the complete pools)
    sc, pos = jnp.asarray(sc), jnp.full((1,), 4 * 8256 - 2, jnp.int32)
    kw = dict(k=512, kpool=4, n_tail=3, width=2112)
    if "compact" in names:  # after the threshold kernel (topk_compact_kernel)
      ca = jax.jit(lambda v, p: I.topk_compact(v, *I.topk_threshold(v, 512, early_exit=True, lanes_out=True),
                                               (p + 1) // 4 * 4, p, **kw))
      out["compact"] = lambda: ca(sc, pos)
    if "compact_fused" in names:  # its CTAs finding the threshold themselves (topk_compact_fused)
      cf = jax.jit(lambda v, p: I.topk_compact(v, None, None, (p + 1) // 4 * 4, p, **kw))
      out["compact_fused"] = lambda: cf(sc, pos)
  # the sparse MLA attention (one TP4 rank's 16 heads, 2,051 selected positions of a 32K cache, pooled index
  # lists as the indexer gives them): B x T query rows — mla_1x4 the verify at B = 1, mla_8x4 the batch case
  # (32 rows: ~90 µs, 9x its gathered bytes on an H100, session 66's bench_dsa_layer); its forms by prefix: mla2_
  # two warpgroups (policy mla_dequant_warpgroups), mlas_ the scales after the MMAs (mla_scales_after, the default
  # since session 67), mla2s_ both, mlag_ the scales after + one gather arrival per group (mla_group_arrival)
  forms = {"mla_": {}, "mla2_": dict(warpgroups=2), "mlas_": dict(scales_after=True),
           "mla2s_": dict(warpgroups=2, scales_after=True), "mlag_": dict(scales_after=True, group_arrival=True)}
  for name in names:
    for prefix, kw in forms.items():
      if name.startswith(prefix):
        out[name] = _mla_case(*(int(v) for v in name[len(prefix):].split("x")), **kw)
  if "mhc" in names:
    margs, consts = mhc_inputs(1)
    h = jax.jit(lambda a: km.mhc_post_finish(*a, **consts, approx_math=True))
    out["mhc"] = lambda: h(margs)
  if "mhc_row" in names:  # (policy mhc_row: one token row, a column per thread)
    margs, consts = mhc_inputs(1)
    hr = jax.jit(lambda a: km.mhc_row_boundary(*a, **consts, approx_math=True))
    out["mhc_row"] = lambda: hr(margs)
  if "mhc_row_lean" in names:  # the step's form (lean, x16, the barrier counters)
    margs, consts = mhc_inputs(1)
    hl = jax.jit(lambda a: km.mhc_row_boundary(*a, **consts, approx_math=True, lean=True, x16=True,
                                               counters=km.barrier_counters()))
    out["mhc_row_lean"] = lambda: hl(margs)
  if "mhc_row_ll" in names:  # the step's form with the low-latency exchange (policy mhc_ll_exchange)
    margs, consts = mhc_inputs(1)
    hx = jax.jit(lambda a: km.mhc_row_boundary(*a, **consts, approx_math=True, lean=True, x16=True,
                                               counters=km.barrier_counters(ll=True), ll=True))
    out["mhc_row_ll"] = lambda: hx(margs)
  if "mhc_row_scalars" in names:  # the step's form with the normalisation on scalars (policy mhc_row_scalars)
    margs, consts = mhc_inputs(1)
    hs = jax.jit(lambda a: km.mhc_row_boundary(*a, **consts, approx_math=True, lean=True, x16=True,
                                               counters=km.barrier_counters(), scalars=True))
    out["mhc_row_scalars"] = lambda: hs(margs)
  # the verify's 4 token rows (q = 4) as the step builds them (lean, x16, counters): the grid form (the default,
  # wgmma over 64-row tiles) and the row form (policy mhc_rows: the rows as loops)
  if "mhc4_lean" in names:
    m4, consts = mhc_inputs(4, M=4)
    h4 = jax.jit(lambda a: km.mhc_post_finish(*a, **consts, approx_math=True, lean=True, x16=True,
                                              counters=km.barrier_counters()))
    out["mhc4_lean"] = lambda: h4(m4)
  if "mhc_row4_lean" in names:
    m4, consts = mhc_inputs(4, M=4)
    hr4 = jax.jit(lambda a: km.mhc_row_boundary(*a, **consts, approx_math=True, lean=True, x16=True,
                                                counters=km.barrier_counters()))
    out["mhc_row4_lean"] = lambda: hr4(m4)
  # the KDA recurrence as the step runs it (kda_conv, norm partials), and with the gated norm and o_proj as one grid
  # (policy kda_o_grid: kdao_BxT, on the step's counters), B sequences of T tokens, one TP4 rank's 16 heads
  for name in names:  # (kdaf_: the kernel with loads_first — the default since session 69; kda_ without it)
    if name.startswith(("kda_", "kdaf_", "kdao_", "kdaos")):
      out[name] = _kda_case(name)
  return out


def _kda_case(name: str, H: int = 16, N: int = 4096):
  """kda_BxT / kdao_BxT -> a function of no arguments running it once (random inputs, never zeros). kdaosN_BxT: the
  grid with its o_proj-only CTAs' W_o requests held N SM cycles (kda_o_grid_spin; kdaos_BxT: W_DELAY_CYCLES)."""
  from pallas_kernels import kda_decode as kd  # noqa: PLC0415
  B, T = (int(v) for v in name.split("_")[1].split("x"))
  ks = jax.random.split(jax.random.key(13), 8)
  bf16, f32 = jnp.bfloat16, jnp.float32
  n = lambda i, shape, s=1.0: (s * jax.random.normal(ks[i], shape, f32))  # noqa: E731
  args = (n(0, (B, T, 3, H, 128)).astype(bf16), n(1, (B, 3, 3, H, 128)).astype(bf16), n(2, (4, 3, H, 128), 0.5),
          n(3, (B, T, 2 * H, 128)), n(4, (B, T, 272)).astype(bf16), n(5, (H,), 0.5), n(6, (H, 128), 0.1) - 4.0,
          n(7, (B, max(T, 4), H, 128, 128)), jnp.ones((B,), jnp.int32))
  cfg = kd.KdaDecodeConfig(token_loop=True, approx_math=True)
  if name.startswith(("kda_", "kdaf_")):
    if name.startswith("kdaf_"):
      cfg = kd.KdaDecodeConfig(token_loop=True, approx_math=True, loads_first=True)
    f = jax.jit(lambda *a: kd.kda_decode_conv(*a, b_offset=16, config=cfg, norm_partials=True))
    return lambda: f(*args)
  nw, w_o = 1.0 + n(0, (128,), 0.1), n(1, (N, H * 128), 0.05).astype(bf16)
  ctr = L.splitk_counters()
  calls = [0]
  tag = name.split("_")[0]
  delay = (int(tag[5:]) if tag[5:] else kd.W_DELAY_CYCLES) if tag.startswith("kdaos") else 0

  def run():
    calls[0] ^= 1  # (the banks alternate by call, as in the step)
    return jax.jit(lambda *a: kd.kda_decode_o_proj(*a, ctr, b_offset=16, config=cfg, parity=calls[0],
                                                   w_delay=delay))(*args, nw, w_o)
  return run


def _mla_case(B: int, T: int, S: int = 32768, H: int = 16, W: int = 2051, warpgroups: int = 1,
              scales_after: bool = False, group_arrival: bool = False):
  """sparse_mla_decode over random FP8 cache rows and pooled index lists (the indexer's 512 pools of 4 + the tail:
  the incomplete last pool's 3 positions, as Indexer.select lists them for a query at S - 2; each query token its
  own list) -> a function of no arguments running it once."""
  from pallas_kernels import sparse_mla as ks  # noqa: PLC0415
  key = jax.random.key(11)
  k1, k2, k3 = jax.random.split(key, 3)
  cache = ks.quantize_latent(jax.random.normal(k1, (B, S, ks.D_LATENT), jnp.float32).astype(jnp.bfloat16))
  q = jax.random.normal(k2, (B, T, H, ks.D_LATENT), jnp.float32)
  pools = jax.vmap(lambda k: jax.random.choice(k, S // 4 - 1, (512,), replace=False))(
      jax.random.split(k3, B * T)).reshape(B, T, 512)
  tok = (jnp.sort(pools, -1)[..., None] * 4 + jnp.arange(4)).reshape(B, T, 2048)
  tail = jnp.broadcast_to(S - 4 + jnp.arange(3), (B, T, 3))
  idx = jnp.concatenate([tok, tail], -1).astype(jnp.int32)[..., :W]
  f = jax.jit(lambda q, c, i: ks.sparse_mla_decode(q, c, i, softmax_scale=1 / 16, combine="kernel", lean=True,
                                                    warpgroups=warpgroups, scales_after=scales_after,
                                                    group_arrival=group_arrival))
  return lambda: f(q, cache, idx)


def regions(trace):
  """A Chrome trace of one call -> (per warpgroup: [(path, begin µs, end µs)], the warpgroups' first timestamps)."""
  by_tid = collections.defaultdict(list)
  for ev in trace["traceEvents"]:
    by_tid[(ev["pid"], ev["tid"])].append(ev)
  spans, starts = {}, {}
  for tid, evs in by_tid.items():
    evs.sort(key=lambda e: e["ts"])
    stack, out = [], []
    for ev in evs:
      if ev["ph"] == "B":
        stack.append((ev["name"], ev["ts"]))
      elif stack:
        name, t0 = stack.pop()
        out.append(("/".join([n for n, _ in stack] + [name]), t0, ev["ts"]))
    spans[tid] = out
    starts[tid] = evs[0]["ts"] if evs else None
  return spans, starts


def summarise(kernel, files):
  """One table per kernel over the calls' traces (the last call's, the earlier ones compile and warm)."""
  trace = json.load(open(sorted(files)[-1]))
  spans, starts = regions(trace)
  if not spans:
    log(f"{kernel}: no events")
    return
  t0 = min(s for s in starts.values() if s is not None)
  t_end = max(e for v in spans.values() for _, _, e in v)
  first = sorted(s - t0 for s in starts.values() if s is not None)
  log(f"\n{kernel}: {len(spans)} warpgroups, span {t_end - t0:.2f} µs (first scope entry -> last exit), warpgroup "
      f"starts after the first: median {np.median(first):.2f} / max {max(first):.2f} µs")
  rows = collections.defaultdict(lambda: {"n": [], "begin": [], "dur": []})
  for v in spans.values():
    per = collections.defaultdict(lambda: [0, None, 0.0])
    for path, b, e in v:
      c = per[path]
      c[0] += 1
      c[1] = b - t0 if c[1] is None else min(c[1], b - t0)
      c[2] += e - b
    for path, (n, b, dur) in per.items():
      rows[path]["n"].append(n)
      rows[path]["begin"].append(b)
      rows[path]["dur"].append(dur)
  log(f"  {'region':<28} {'per wg':>7} {'begins µs med/max':>18} {'µs per wg med/max':>18}")
  for path, r in sorted(rows.items(), key=lambda kv: np.median(kv[1]["begin"])):
    log(f"  {path:<28} {np.median(r['n']):7.0f} {np.median(r['begin']):8.2f} / {max(r['begin']):7.2f} "
        f"{np.median(r['dur']):8.2f} / {max(r['dur']):7.2f}")


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--dir", required=True, help="folder for the profiler's traces")
  ap.add_argument("--cases", default="moe,moe_rows,mhc")
  ap.add_argument("--out", default=None)
  a = ap.parse_args(argv)
  names = a.cases.split(",")
  log(f"# jax {jax.__version__} {jax.devices()[0].device_kind}: in-kernel profiles of each case's second call (the "
      "first compiles and warms the clocks)")
  with kernel_profile(a.dir) as d:
    fns = cases(names)
    for name in names:
      # a kernel's trace file is named once, when it is lowered: the first call's dump takes the name and the
      # later ones are refused ("profile already exists"). So: call, drop that dump, call again, read.
      before = set(glob.glob(os.path.join(d, "*-trace.json")))
      for _ in range(3):
        jax.block_until_ready(fns[name]())  # (warm: clocks up, weights' pages touched)
      for f in set(glob.glob(os.path.join(d, "*-trace.json"))) - before:
        os.remove(f)
      jax.block_until_ready(fns[name]())
      new = sorted(set(glob.glob(os.path.join(d, "*-trace.json"))) - before)
      by_kernel = collections.defaultdict(list)
      for f in new:
        by_kernel[os.path.basename(f).rsplit("-", 2)[0]].append(f)
      log(f"\n## {name}: {sum(map(len, by_kernel.values()))} traces ({', '.join(sorted(by_kernel))})")
      for kernel, files in sorted(by_kernel.items()):
        summarise(kernel, files)
  if a.out:
    write_log(a.out)


if __name__ == "__main__":
  main()
