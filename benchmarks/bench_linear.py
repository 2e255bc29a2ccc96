"""Benchmark the weight-streaming decode kernels of pallas_kernels/linear.py against XLA on one GPU.

For each real per-TP4-rank shape and M token rows: device time per call (CUPTI kernel durations, so no host
dispatch is counted; weights rotate over enough copies that they are cold in the 60 MB L2), TB/s of weight bytes,
% of the 4.3 TB/s H200 roofline, and XLA (dequant + dot, jitted) for comparison.

  "kern us"  the Mosaic kernel(s) alone;  "call us"  everything one call launches (activation quantisation,
  kernel, split-K/transposition epilogue);  "xla us"  every kernel of the jitted XLA version.

Usage (GPU):  PYTHONPATH=. python3 benchmarks/bench_linear.py [--rows 1,8,32]
              [--only fp8,fp8dq,bf16,moe,moedq,moerk,moerows,moerows_st,moerows_wr,moerows_sw]
              [--sweep] [--budget-s 200] [--out results.txt]
Falls back to host wall-clock over many back-to-back async calls if CUPTI is unavailable (then dispatch-bound
for small shapes; marked "wall").
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import functools
import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._timing import LINES as _LINES, MODE, log, time_calls  # noqa: E402
from pallas_kernels import linear as L

HBM_BPS = 4.3e12
L2_BYTES = 60 << 20
F8 = jnp.float8_e4m3fn

FP8_SHAPES = [
    ("qkv_a", 2048, 4096), ("q_a", 1536, 4096), ("kv_a|sh_gate_up", 512, 4096), ("q_b", 4096, 1536),
    ("mla_o", 4096, 4096),
    ("dense_gate_up", 3072, 4096), ("dense_down", 4096, 3072), ("sh_down", 4096, 512),
]
BF16_SHAPES = [("kda_qkv", 6144, 4096), ("kda_o", 4096, 2048), ("kda_fgb_a", 272, 4096), ("indexer_x", 288, 4096),
               ("indexer_wq_b", 4096, 1536),  # (on the DSA layer's selection chain: 5.2 µs XLA in s51b's trace)
               ("lm_head", 38720, 4096)]
MOE = dict(E=288, I=512, D=4096, k=8, limit=10.0)

_T0 = time.time()
def mosaic_us(names: dict[str, float]) -> float | None:
  """Time of the Mosaic kernels among the per-name timings (XLA fusions are named after HLO ops)."""
  ks = {n: t for n, t in names.items() if "glm5_" in n}
  return sum(ks.values()) if ks else None


def n_copies(nbytes: int) -> int:
  """Enough weight copies that one pass over them is >= 4x L2 (each call sees cold weights)."""
  return int(min(64, max(4, math.ceil(4 * L2_BYTES / nbytes))))


# ------------------------------------------------------------------------------------------------------------
# inputs
# ------------------------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnums=(1,))
def quantized_weight(key, shape):
  """Random normal weight [..., R, C] quantised per 128x128 block (s = amax / 448) -> (e4m3, scale_inv)."""
  *lead, r, c = shape
  wf = jax.random.normal(key, shape, jnp.float32) * 0.02
  blk = wf.reshape(*lead, r // 128, 128, c // 128, 128)
  s = jnp.maximum(jnp.max(jnp.abs(blk), axis=(-3, -1)) / 448.0, 1e-12)
  q = (blk / s[..., :, None, :, None]).reshape(shape)
  return jnp.clip(q, -448, 448).astype(F8), s


def copies(a, n):
  return [a] + [jnp.array(a, copy=True) for _ in range(n - 1)]


def relerr(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / (np.linalg.norm(b) + 1e-30))


# ------------------------------------------------------------------------------------------------------------
# XLA baselines
# ------------------------------------------------------------------------------------------------------------
def xla_fp8(x, w, s):
  return jnp.dot(x.astype(jnp.bfloat16), L.dequantize_fp8(w, s).astype(jnp.bfloat16).T,
                 preferred_element_type=jnp.float32)


def xla_bf16(x, w):
  return jnp.dot(x.astype(jnp.bfloat16), w.T, preferred_element_type=jnp.float32)


def xla_moe(x, ids, tw, wg, sg, wu, su, wd, sd, *, limit):
  """Gather the selected experts per (token, slot), dequantise, einsum: what plain XLA would do."""
  xb = x.astype(jnp.bfloat16)
  deq = lambda w, s: L.dequantize_fp8(w[ids], s[ids]).astype(jnp.bfloat16)  # [M, k, R, C]
  g = jnp.einsum("md,mkid->mki", xb, deq(wg, sg), preferred_element_type=jnp.float32)
  u = jnp.einsum("md,mkid->mki", xb, deq(wu, su), preferred_element_type=jnp.float32)
  h = jax.nn.silu(jnp.minimum(g, limit)) * jnp.clip(u, -limit, limit)
  y = jnp.einsum("mki,mkdi->mkd", h.astype(jnp.bfloat16), deq(wd, sd), preferred_element_type=jnp.float32)
  return jnp.einsum("mkd,mk->md", y, tw)


# ------------------------------------------------------------------------------------------------------------
# benchmarks
# ------------------------------------------------------------------------------------------------------------
HEADER = (f"{'kernel':<6} {'shape':<22} {'M':>3} {'MB':>7} {'kern us':>8} {'TB/s':>5} {'%4.3':>5} "
          f"{'call us':>8} {'TB/s':>5} {'xla us':>8} {'xla TB/s':>8} {'x':>5} {'relerr':>8}  plan")


def row(kind, shape, m, nbytes, kern, call, xla, err, plan):
  k = kern if kern is not None else call
  f = lambda us: nbytes / (us * 1e-6) / 1e12 if us else float("nan")
  log(f"{kind:<6} {shape:<22} {m:>3} {nbytes / 1e6:7.1f} {k:8.1f} {f(k):5.2f} {100 * f(k) / 4.3:5.0f} "
      f"{call:8.1f} {f(call):5.2f} {xla if xla else float('nan'):8.1f} {f(xla):8.2f} "
      f"{(xla / call) if xla else float('nan'):5.1f} {err:8.1e}  {plan}")


def bench_fp8(name, n, k, m, plan=None, with_xla=True, check=True, kind="fp8", **opts):
  """kind "fp8": fp8_linear (hi/lo e4m3 activations); "fp8dq": fp8_dq_linear (bf16 activations, the weight
  dequantised in registers; opts: a_from)."""
  key = jax.random.key(n * 7 + k + m)
  w, s = quantized_weight(key, (n, k))
  x = jax.random.normal(jax.random.key(m), (m, k), jnp.float32).astype(jnp.bfloat16)
  nb = n * k
  r = n_copies(nb)
  ws, ss = copies(w, r), copies(s, r)
  fn = L.fp8_linear if kind == "fp8" else L.fp8_dq_linear
  f = jax.jit(functools.partial(fn, plan=plan, **opts))
  args = [(x, ws[i], ss[i]) for i in range(r)]
  err = relerr(f(x, w, s), jax.jit(L.fp8_linear_reference)(x, w, s)) if check else float("nan")
  call, names = time_calls(f, args)
  xla = time_calls(jax.jit(xla_fp8), args)[0] if with_xla else None
  p = plan or L.plan_linear(n, k, L._padded_rows(m), kind)
  label = kind + ("" if opts.get("a_from", "regs") == "regs" else "s")
  row(label, f"{name} {n}x{k}", m, nb, mosaic_us(names), call, xla, err, p)
  return names


def bench_bf16(name, n, k, m, plan=None, with_xla=True, check=True):
  w = (jax.random.normal(jax.random.key(n + k), (n, k), jnp.float32) * 0.02).astype(jnp.bfloat16)
  x = jax.random.normal(jax.random.key(m), (m, k), jnp.float32).astype(jnp.bfloat16)
  nb = 2 * n * k
  r = n_copies(nb)
  ws = copies(w, r)
  f = jax.jit(functools.partial(L.bf16_linear, plan=plan))
  args = [(x, ws[i]) for i in range(r)]
  err = relerr(f(x, w), jax.jit(L.bf16_linear_reference)(x, w)) if check else float("nan")
  call, names = time_calls(f, args)
  xla = time_calls(jax.jit(xla_bf16), args)[0] if with_xla else None
  p = plan or L.plan_linear(n, k, L._padded_rows(m), "bf16")
  row("bf16", f"{name} {n}x{k}", m, nb, mosaic_us(names), call, xla, err, p)
  return names


_MOE_W = None


def moe_weights():
  global _MOE_W
  if _MOE_W is None:
    e, i, d = MOE["E"], MOE["I"], MOE["D"]
    ks = jax.random.split(jax.random.key(123), 3)
    wg, sg = quantized_weight(ks[0], (e, i, d))
    wu, su = quantized_weight(ks[1], (e, i, d))
    wd, sd = quantized_weight(ks[2], (e, d, i))
    _MOE_W = (wg, sg, wu, su, wd, sd)
  return _MOE_W


def bench_moe(m, plan=None, with_xla=True, check=True, n_sets=12, dq=False, shared=True):
  """The routed experts of M token rows, + the shared expert as slot 0 (as the step runs it: 9 slots at M = 1)."""
  e, i, d, k = MOE["E"], MOE["I"], MOE["D"], MOE["k"]
  w = moe_weights()
  x = jax.random.normal(jax.random.key(m), (m, d), jnp.float32).astype(jnp.bfloat16)
  args, distinct = [], []
  for j in range(n_sets):
    kk = jax.random.key(1000 * m + j)
    ids = jnp.argsort(jax.random.uniform(kk, (m, e)), axis=1)[:, :k].astype(jnp.int32)
    tw = jax.random.uniform(jax.random.fold_in(kk, 1), (m, k), jnp.float32, 0.05, 0.5)
    sh = ()
    if shared:  # a shared expert per set too (each MoE layer of the step has its own: cold in L2)
      ks = jax.random.split(jax.random.fold_in(kk, 2), 3)
      sh = (tuple(quantized_weight(ks[0], (i, d))) + tuple(quantized_weight(ks[1], (i, d)))
            + tuple(quantized_weight(ks[2], (d, i))),)
    args.append((x, ids, tw, *w, *sh))
    distinct.append(len(np.unique(np.asarray(ids))) + int(shared))
  nb = int(np.mean(distinct) * 3 * i * d)

  def kern(x, ids, tw, *ws, **kw):
    return L.fp8_moe(x, ids, tw, *ws[:6], shared=ws[6] if shared else None, **kw)

  def ref(x, ids, tw, *ws, **kw):
    return L.fp8_moe_reference(x, ids, tw, *ws[:6], shared=ws[6] if shared else None, **kw)

  f = jax.jit(functools.partial(kern, swiglu_limit=MOE["limit"], plan=plan, dq=dq))
  err = float("nan")
  if check:
    err = relerr(f(*args[0]), jax.jit(functools.partial(ref, swiglu_limit=MOE["limit"]))(*args[0]))
  call, names = time_calls(f, args)
  xla = time_calls(jax.jit(functools.partial(xla_moe, limit=MOE["limit"])), [a[:9] for a in args])[0] \
      if with_xla else None
  slots = min(e, m * k) + int(shared)
  p, label = plan or L.plan_moe(slots, i, d, L._padded_rows(m)), ("moedq" if dq else "moe")
  row(label, f"E{e} I{i} D{d} ~{np.mean(distinct):.0f}exp", m, nb, mosaic_us(names), call, xla,
      err, p)
  log(f"#   per kernel (us): { {n: round(t, 1) for n, t in names.items() if 'glm5_' in n} }")
  return names


def bench_moe_router(form: str, n_sets=12, plan=None):
  """The single-row MoE with the router's selection in the kernel (moe_router_in_kernel with moe_router_ranks:
  fp8_moe(router=...) with XLA's glue and sum, "moerk"; the step's default form since session 48, its split sums in
  both kernels on split-K counters and the rows written, moe_rows: "moerows"; with static_table, policy
  moe_static_table: "moerows_st"; with writer_cta, policy moe_writer_cta: "moerows_wr"; both, the step's defaults
  since session 51: "moerows_sw"): random logits
  per set (the experts differ from set to set: cold in L2), the shared expert as slot 0. ``plan``: a MoePlan for
  fp8_moe's two kernels."""
  e, i, d, k = MOE["E"], MOE["I"], MOE["D"], MOE["k"]
  w = moe_weights()
  x = jax.random.normal(jax.random.key(1), (1, d), jnp.float32).astype(jnp.bfloat16)
  args = []
  for j in range(n_sets):
    kk = jax.random.key(5000 + j)
    logits = jax.random.normal(kk, (1, e), jnp.float32)
    bias = jax.random.uniform(jax.random.fold_in(kk, 1), (e,), jnp.float32, -0.05, 0.05)
    ks = jax.random.split(jax.random.fold_in(kk, 2), 3)
    sh = tuple(quantized_weight(ks[0], (i, d))) + tuple(quantized_weight(ks[1], (i, d))) + tuple(
        quantized_weight(ks[2], (d, i)))
    args.append((x, logits, bias, *w, sh))
  select = (k, 2.5, True, True)

  def kern(x, logits, bias, *ws):
    rows = dict(counters=L.splitk_counters(), out_dtype=jnp.bfloat16) if form.startswith("moerows") else {}
    rows.update({"moerows_st": {"static_table": True}, "moerows_wr": {"writer_cta": True},
                 "moerows_sw": {"static_table": True, "writer_cta": True}}.get(form, {}))
    return L.fp8_moe(x, None, None, *ws[:6], swiglu_limit=MOE["limit"], shared=ws[6], dq=True, plan=plan,
                     router=(logits, bias), router_select=select, **rows)[0]

  f = jax.jit(kern)
  ref = jax.jit(lambda *a: L.fp8_moe(a[0], None, None, *a[3:9], swiglu_limit=MOE["limit"], shared=a[9], dq=True,
                                     router=(a[1], a[2]), router_select=select)[0])
  err = relerr(f(*args[0]), ref(*args[0]))
  call, names = time_calls(f, args)
  nb = (k + 1) * 3 * i * d
  row(form, f"E{e} I{i} D{d} 9 slots", 1, nb, mosaic_us(names), call, None, err,
      plan or {"moerows": "gate/up + down, sums inside",
               "moerows_st": "moerows + static_table", "moerows_wr": "moerows + writer_cta",
               "moerows_sw": "moerows + both (the defaults)"}.get(
                   form, "gate/up + glue + down"))
  log(f"#   per kernel (us): { {n: round(t, 1) for n, t in names.items()} }")
  return names


def guarded(deadline, fn, *a, **kw):
  if time.time() > deadline:
    return None
  try:
    return fn(*a, **kw)
  except Exception as e:  # noqa: BLE001
    log(f"# FAILED {fn.__name__}{a}: {type(e).__name__}: {str(e)[:300]}")
    return None


def _sweep_fp8(deadline, name, n, k, m):
  mp = L._padded_rows(m)
  seen = {L.plan_linear(n, k, mp, "fp8")}
  for tc, st in [(132, None), (528, None), (264, 2), (1056, None), (132, 2)]:
    p = L.plan_linear(n, k, mp, "fp8", target_ctas=tc, stages=st)
    if p not in seen:
      seen.add(p)
      guarded(deadline, bench_fp8, name, n, k, m, plan=p, with_xla=False, check=False)


def _sweep_bf16(deadline, name, n, k, m):
  mp = L._padded_rows(m)
  seen = {L.plan_linear(n, k, mp, "bf16")}
  for bk, tc, st in [(256, 264, None), (64, 264, None), (128, 132, None), (128, 528, None), (128, 264, 3)]:
    p = L.plan_linear(n, k, mp, "bf16", bk=bk, target_ctas=tc, stages=st)
    if p not in seen:
      seen.add(p)
      guarded(deadline, bench_bf16, name, n, k, m, plan=p, with_xla=False, check=False)


def _sweep_bf16_splits(deadline, name, n, k, m):
  """The bf16 GEMV's K splits and row tiles at ``m`` rows (the verify's 4: bf16_linear runs at every bf16 site there).
  Session 71's q = 4 trace had the KDA q/k/v call (6144 x 4096: 48 row tiles x 4 splits = 192 CTAs on 132 SMs)
  at 2.07 TB/s against XLA's one-row GEMV of it at 2.54: 60 SMs hold two CTAs, 72 one. More splits (or 64-row
  tiles) make 384 CTAs — 2.9 a SM — at the cost of more partials for the split sum ("call us")."""
  mp = L._padded_rows(m)
  seen = set()
  kb = k // 128
  # (the default plan first, with XLA beside it; then policy knob bf16_balanced_splits' plan; then fixed forms)
  variants = [{}, {"balanced": True}] + [dict(bm=bm, split=sp) for bm, sp in
                                          [(128, 8), (128, 16), (64, 4), (64, 8), (128, 2), (64, 2)] if kb % sp == 0]
  for kw in variants:
    p = L.plan_linear(n, k, mp, "bf16", **kw)
    if p not in seen:
      seen.add(p)
      guarded(deadline, bench_bf16, name, n, k, m, plan=p, with_xla=not kw, check=not kw)


def _sweep_fp8dq(deadline, name, n, k, m):
  """Plan variants of the dequantising FP8 GEMV (the step's default form): K splits from 2 to 32 (with the XLA
  split sum in "call us"), shallower / deeper rings. s48e's trace: the DSA layer's fused q_a | kv_a call (2048 x
  4096, 16 splits: 256 CTAs of 2 weight tiles each) ran 9.5 µs in the step for 8.4 MB, first on the layer's chain."""
  mp = L._padded_rows(m)
  seen = {L.plan_linear(n, k, mp, "fp8dq")}
  guarded(deadline, bench_fp8, name, n, k, m, plan=None, with_xla=False, check=False, kind="fp8dq")
  kb = k // L.BLOCK
  for split, st in [(2, None), (4, None), (8, None), (16, None), (32, None), (8, 2), (4, 3)]:
    if kb % split:
      continue
    p = L.plan_linear(n, k, mp, "fp8dq", split=split, stages=st)
    if p not in seen:
      seen.add(p)
      guarded(deadline, bench_fp8, name, n, k, m, plan=p, with_xla=False, check=False, kind="fp8dq")


def _sweep_moe(deadline, m, dq=True):
  """Plan variants of the step's MoE (shared slot included): the previous defaults, deeper / shallower splits and
  groupings of the down kernel."""
  e, i, d, k = MOE["E"], MOE["I"], MOE["D"], MOE["k"]
  mp = L._padded_rows(m)
  slots = min(e, m * k) + 1
  seen = {L.plan_moe(slots, i, d, mp)}
  variants = ([dict(gu_split=2, gu_stages=4, dn_groups=8, dn_stages=6),  # session 25's defaults at M = 1
               dict(gu_split=8), dict(gu_split=4, gu_stages=4), dict(dn_bm=64, dn_groups=slots),
               dict(dn_groups=3), dict(dn_groups=slots, dn_stages=4)] if m == 1 else
              [dict(dn_groups=11), dict(dn_groups=11, dn_stages=4), dict(dn_groups=16), dict(gu_bm=128),
               dict(gu_stages=4), dict(dn_bm=64)])
  plans = [L.plan_moe(slots, i, d, mp, **kw) for kw in variants]
  if m == 1:  # 4-stage rings at 3 CTAs per SM (3 x ~74 KB fits the SM's 228 KB; plan_moe's budget stops at 3)
    plans.append(dataclasses.replace(L.plan_moe(slots, i, d, mp), gu_stages=4, dn_stages=4))
  for p in plans:
    if p not in seen:
      seen.add(p)
      guarded(deadline, bench_moe, m, plan=p, with_xla=False, check=False, n_sets=8, dq=dq)


def _sweep_moerows(deadline):
  """Plan variants of the step's single-row MoE in its default form (moe_rows: the router's selection in the
  gate/up kernel, both kernels' split sums inside on the split-K counters) — plan_moe's M = 1 defaults were chosen
  for the earlier form with XLA's glue (session 26): gate/up D splits 2 / 4 / 8, 128-row gate/up tiles, 4-stage
  rings, the down kernel's groups and 64-row tiles. s48e: gate/up 17.7 + down 10.3 µs in the step for 56.6 MB."""
  i, d, k = MOE["I"], MOE["D"], MOE["k"]
  base = L.plan_moe(k + 1, i, d, L._padded_rows(1))
  plans = [base] + [L.plan_moe(k + 1, i, d, 8, **kw) for kw in (
      dict(gu_split=2), dict(gu_split=8), dict(gu_bm=128), dict(dn_bm=64), dict(dn_groups=3), dict(dn_stages=2))]
  plans += [dataclasses.replace(base, gu_stages=4), dataclasses.replace(base, dn_stages=4),
            dataclasses.replace(L.plan_moe(k + 1, i, d, 8, gu_split=8), gu_stages=4)]
  seen = set()
  for p in plans:
    if p not in seen:
      seen.add(p)
      guarded(deadline, bench_moe_router, "moerows", n_sets=8, plan=p)


def sweep(deadline):
  """Plan variants for tuning the defaults (no XLA, no correctness check), most informative first."""
  log("\n# sweep (plan variants)")
  log(HEADER)
  _sweep_fp8(deadline, "mla_o", 4096, 4096, 1)
  _sweep_bf16(deadline, "lm_head", 38720, 4096, 1)
  _sweep_moe(deadline, 1)
  _sweep_moe(deadline, 4)
  _sweep_fp8(deadline, "q_a", 1536, 4096, 1)
  _sweep_bf16(deadline, "kda_qkv", 6144, 4096, 1)
  _sweep_moe(deadline, 32)
  _sweep_fp8(deadline, "mla_o", 4096, 4096, 32)
  _sweep_bf16(deadline, "lm_head", 38720, 4096, 32)
  _sweep_fp8(deadline, "kv_a", 512, 4096, 1)
  _sweep_fp8(deadline, "dense_down", 4096, 3072, 8)
  _sweep_moe(deadline, 8)


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--rows", default="1,8,32")
  ap.add_argument("--only", default="fp8,fp8dq,bf16,moe,moedq")
  ap.add_argument("--sweep", action="store_true")
  ap.add_argument("--sweep-moe", default="", help="only the MoE plan sweep (dq, shared slot) at these rows, e.g. 1,4")
  ap.add_argument("--sweep-moerows", action="store_true", help="the step's single-row MoE form (moe_rows) under "
                  "plan variants")
  ap.add_argument("--sweep-dq", default="", help="the dequantising FP8 GEMV's plan sweep for the DSA layer's linears "
                  "(qkv_a, q_b, mla_o) at these rows, e.g. 1")
  ap.add_argument("--sweep-bf16", default="", help="the bf16 GEMV's K splits / row tiles for the KDA q/k/v, o_proj, "
                  "the indexer's wq_b and the router at these rows, e.g. 4")
  ap.add_argument("--budget-s", type=float, default=1e9)
  ap.add_argument("--out", default=None)
  a = ap.parse_args(argv)
  deadline = _T0 + a.budget_s
  rows = [int(r) for r in a.rows.split(",")]
  only = set(a.only.split(","))
  log(f"# jax {jax.__version__} {jax.devices()[0].device_kind}; timing: {MODE[0]}")
  log(HEADER)
  first = True
  if "fp8" in only:
    for m in rows:
      for name, n, k in FP8_SHAPES:
        names = guarded(deadline, bench_fp8, name, n, k, m)
        if first and names:
          log(f"# kernel names of one fp8_linear call: {names}")
          first = False
  if "fp8dq" in only:  # the weight dequantised in registers, bf16 activations (policy knob fp8_dq)
    for m in rows:
      for name, n, k in FP8_SHAPES:
        names = guarded(deadline, bench_fp8, name, n, k, m, kind="fp8dq")
        if m == rows[0] and name == FP8_SHAPES[0][0] and names:
          log(f"# kernel names of one fp8_dq_linear call: {names}")
    for name, n, k in FP8_SHAPES[:1]:  # the converted tile through SMEM instead (the interpret-mode form)
      guarded(deadline, bench_fp8, name, n, k, rows[0], kind="fp8dq", a_from="smem")
  if "bf16" in only:
    for m in rows:
      for name, n, k in BF16_SHAPES:
        guarded(deadline, bench_bf16, name, n, k, m)
  # moedq: bf16 x and h, the weight tiles dequantised in registers (fp8_dq)
  for kind in ("moe", "moedq"):
    if kind in only:
      for m in rows:
        names = guarded(deadline, bench_moe, m, dq=kind != "moe")
        if names:
          log(f"# kernel us per {kind} call: { {n: round(t, 1) for n, t in names.items()} }")
  # the single-row MoE, router in the kernel: XLA glue / rows (/ with static_table / writer_cta / both)
  for kind in ("moerk", "moerows", "moerows_st", "moerows_wr", "moerows_sw"):
    if kind in only:
      guarded(deadline, bench_moe_router, kind)
  if a.sweep:
    sweep(deadline)
  if a.sweep_moerows:
    log("\n# moerows plan sweep (the step's single-row MoE)")
    _sweep_moerows(deadline)
  if a.sweep_dq:
    log("\n# fp8dq plan sweep (the DSA layer's linears)")
    for m in [int(r) for r in a.sweep_dq.split(",")]:
      for name, n, k in (("qkv_a", 2048, 4096), ("q_b", 4096, 1536), ("mla_o", 4096, 4096)):
        _sweep_fp8dq(deadline, name, n, k, m)
  if a.sweep_bf16:
    log("\n# bf16 plan sweep (K splits, row tiles)")
    log(HEADER)
    for m in [int(r) for r in a.sweep_bf16.split(",")]:
      for name, n, k in (("kda_qkv", 6144, 4096), ("kda_o", 4096, 2048), ("indexer_wq_b", 4096, 1536),
                         ("router", 288, 4096)):
        _sweep_bf16_splits(deadline, name, n, k, m)
  if a.sweep_moe:
    log("\n# MoE plan sweep (dq, shared slot)")
    log(HEADER)
    for m in [int(r) for r in a.sweep_moe.split(",")]:
      _sweep_moe(deadline, m)
  log(f"# done in {time.time() - _T0:.0f} s")
  if a.out:
    with open(a.out, "w") as fh:
      fh.write("\n".join(_LINES) + "\n")


if __name__ == "__main__":
  sys.exit(main())
