"""Benchmark the DSA decode kernels on one GPU: sparse MLA over the FP8 latent cache and the indexer scores.

Sparse MLA: B in {1, 8}, T in {1, 4}, H = 16 (TP4), W = 2051 selected positions per query token, 512-d latent
(one 640-byte cache row per position: 512 e4m3 bytes + 4 fp32 scales + padding). The cache is made large
(>= 2^20 positions in total) and every call gets its own random index lists and queries, so the gathered rows are
mostly cold in the 60 MB L2 (as in decode, where 11 layers each read their own cache once per step). The index
lists have the indexer's layout: 512 random pools of 4 consecutive positions, then a 3-position tail (the kernel
gathers a pool with one TMA); ``--random-idx`` draws every position independently instead (one TMA per row).
Index lists of different query tokens are independent here; in real decode they overlap heavily, so T > 1 is
pessimistic.

Indexer: B in {1, 8}, T in {1, 4}, HI = 32, P pooled keys (132 B each) in {1024, 8192, 16384}, all visible;
every call reads its own copy of the pooled-key cache (cold L2).

Columns: "kern us" the Mosaic kernel alone (CUPTI device time), "call us" everything one call launches (query
prep, kernel, split combine), "xla us" the jitted pure-jnp reference, "GB/s" gathered bytes / call time.

Usage (GPU):  PYTHONPATH=. python3 benchmarks/bench_sparse_mla.py [--only mla,indexer,sweep] [--out FILE]
Without CUPTI it falls back to host wall-clock over back-to-back async calls (marked "wall").
"""

from __future__ import annotations

import argparse
import sys
import os
import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._timing import LINES as _LINES, MODE, log, time_calls  # noqa: E402
from pallas_kernels import indexer as I
from pallas_kernels import sparse_mla as M

L2_BYTES = 60 << 20
MIN_CACHE_POSITIONS = 1 << 20  # summed over the batch: >> L2
SCALE = 1.0 / 16
def kern_us(names, tag):
  ks = [t for n, t in names.items() if tag in n]
  return sum(ks) if ks else float("nan")


def relerr(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  fin = np.isfinite(b)
  return float(np.linalg.norm(a[fin] - b[fin]) / (np.linalg.norm(b[fin]) + 1e-30))


# ------------------------------------------------------------------------------------------------------------
# sparse MLA
# ------------------------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnums=(1, 2))
def _cache(key, B, S):
  c = jax.random.normal(key, (B, S, M.D_LATENT), jnp.float32)
  return M.quantize_latent(c)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5, 6))
def _mla_call_inputs(key, B, T, H, S, W, pooled=True):
  k1, k2 = jax.random.split(key)
  q = (jax.random.normal(k1, (B, T, H, M.D_LATENT)) * 0.3).astype(jnp.bfloat16)
  if not pooled:
    return q, jax.random.randint(k2, (B, T, W), 0, S, jnp.int32)
  n_pool = (W - 3) // 4  # the indexer's top pools expanded to their 4 positions, then the tail
  pools = jax.random.randint(k2, (B, T, n_pool), 0, S // 4 - 1, jnp.int32)
  tok = (pools[..., None] * 4 + jnp.arange(4, dtype=jnp.int32)).reshape(B, T, -1)
  tail = jnp.broadcast_to(S - 4 + jnp.arange(W - 4 * n_pool, dtype=jnp.int32), (B, T, W - 4 * n_pool))
  return q, jnp.concatenate([tok, tail], axis=-1)


MLA_HEADER = (f"{'B':>2} {'T':>2} {'H':>3} {'W':>5} {'nbs':>4} {'MB':>6} {'kern us':>8} {'call us':>8} {'GB/s':>6} "
              f"{'xla us':>8} {'xla GB/s':>8} {'x':>5} {'relerr':>8}")


def bench_mla(B, T, H=16, W=2051, nbs=None, with_xla=True, n_calls=16, pooled=True, combine="xla", form=None,
              S=None):
  """``form``: the kernel's keyword switches (warpgroups, scales_after), named in the last column. ``S``: cache
  positions per sequence (default: >= 2^20 in all, cold in L2; a prefill chunk's cache is small and hot)."""
  form = dict(form or {})
  S = S or max(min(65536, MIN_CACHE_POSITIONS), MIN_CACHE_POSITIONS // B)
  cache = _cache(jax.random.key(B * 31 + T), B, S)
  sets = [(*_mla_call_inputs(jax.random.key(1000 + i), B, T, H, S, W, pooled),) for i in range(n_calls)]
  args = [(q, cache, idx) for q, idx in sets]
  f = jax.jit(functools.partial(M.sparse_mla_decode, softmax_scale=SCALE, blocks_per_split=nbs, combine=combine,
                                **form))
  ref = jax.jit(functools.partial(M.sparse_mla_decode_reference, softmax_scale=SCALE))
  err = relerr(f(*args[0]), ref(*args[0]))
  call, names = time_calls(f, args)
  kern = kern_us(names, "glm5_sparse_mla")
  xla = time_calls(ref, args)[0] if with_xla else float("nan")
  nbytes = B * T * W * M.ROW_WORDS * 4  # the gathered cache rows (640 B each, 528 of them data; before session 25: 528)
  gbs = lambda us: nbytes / (us * 1e-6) / 1e9
  nb = nbs or M._pick_blocks_per_split(-(-W // M.BLOCK), B * T * (H // M.HEADS_PER_CTA))
  log(f"{B:>2} {T:>2} {H:>3} {W:>5} {nb:>4} {nbytes / 1e6:6.2f} {kern:8.1f} {call:8.1f} {gbs(call):6.0f} "
      f"{xla:8.1f} {gbs(xla):8.0f} {xla / call:5.1f} {err:8.1e}" + ("" if combine == "xla" else f"  {combine}")
      + "".join(f" {k}={v}" for k, v in form.items()) + (f" S={S}" if S < MIN_CACHE_POSITIONS // B else ""))
  return call


# ------------------------------------------------------------------------------------------------------------
# indexer
# ------------------------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnums=(1, 2))
def _pool_cache(key, B, P):
  return I.quant_ue8m0_fp8(I.hadamard128(jax.random.normal(key, (B, P, 128), jnp.float32)))


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _idx_queries(key, B, T, P, hi=32):
  k1, k2 = jax.random.split(key)
  q8, qs = I.quant_ue8m0_fp8(I.hadamard128(jax.random.normal(k1, (B, T, hi, 128))))
  w = jax.random.normal(k2, (B, T, hi)) * (hi ** -0.5 * 128 ** -0.5)
  return q8, qs, w, jnp.full((B, T), P, jnp.int32)


IDX_HEADER = (f"{'B':>2} {'T':>2} {'P':>6} {'nbc':>4} {'MB':>6} {'kern us':>8} {'call us':>8} {'GB/s':>6} "
              f"{'xla us':>8} {'xla GB/s':>8} {'x':>5} {'relerr':>8}")


def bench_indexer(B, T, P, nbc=None, with_xla=True):
  nbytes = B * P * 132
  n = int(min(128, max(4, math.ceil(4 * L2_BYTES / nbytes))))
  caches = [_pool_cache(jax.random.key(i), B, P) for i in range(n)]
  q8, qs, w, nv = _idx_queries(jax.random.key(7), B, T, P)
  args = [(q8, qs, w, k8, ks, nv) for k8, ks in caches]
  f = jax.jit(functools.partial(I.indexer_scores, blocks_per_cta=nbc))
  ref = jax.jit(I.indexer_scores_reference)
  err = relerr(f(*args[0]), ref(*args[0]))
  call, names = time_calls(f, args)
  kern = kern_us(names, "glm5_indexer")
  xla = time_calls(ref, args)[0] if with_xla else float("nan")
  gbs = lambda us: nbytes / (us * 1e-6) / 1e9
  nb = nbc or I._pick_blocks_per_cta(-(-P // I.BLOCK), B)
  log(f"{B:>2} {T:>2} {P:>6} {nb:>4} {nbytes / 1e6:6.2f} {kern:8.1f} {call:8.1f} {gbs(call):6.0f} "
      f"{xla:8.1f} {gbs(xla):8.0f} {xla / call:5.1f} {err:8.1e}")


# ------------------------------------------------------------------------------------------------------------
def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--only", default="mla,indexer,sweep,combine",
                  help="sections: mla, combine, sweep, indexer, and forms (the kernel's forms: warpgroups=2, "
                       "scales_after, both, scales_after with group_arrival — with the merge kernel, as the step "
                       "runs it), gather (the gather warpgroup's 2- and 3-slot rings against the step's form, also at "
                       "a prefill chunk's 512 rows)")
  ap.add_argument("--out", default=None)
  ap.add_argument("--quick", action="store_true", help="fewer configurations")
  ap.add_argument("--random-idx", action="store_true",
                  help="sparse MLA index lists of independent random positions (one gather per row) instead of "
                       "the indexer's pools of 4 consecutive positions")
  a = ap.parse_args()
  pooled = not a.random_idx
  only = set(a.only.split(","))
  log(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}, timing: {MODE[0]}")
  t0 = time.time()
  try:
    if "mla" in only:
      log(f"\n## sparse MLA decode (H=16 per rank, W=2051, FP8 latent cache; index lists: "
          f"{'pools of 4' if pooled else 'random positions'})")
      log(MLA_HEADER)
      for B, T in ([(1, 1), (1, 4), (8, 4), (32, 1)] if a.quick else [(1, 1), (1, 4), (8, 1), (8, 4), (32, 1)]):
        bench_mla(B, T, pooled=pooled)
    if "combine" in only:  # the splits' merge: XLA's fusions or a Mosaic launch after the kernel
      log("\n## sparse MLA: the splits' merge (\"call\" = every launch of the call; last column: the form)")
      log(MLA_HEADER)
      for B, T in [(1, 1), (1, 4), (2, 8), (8, 4)]:
        for combine in ("xla", "kernel"):
          bench_mla(B, T, with_xla=False, pooled=pooled, combine=combine)
    if "forms" in only:  # session 66's dequantisation forms (policy knobs mla_dequant_warpgroups, mla_scales_after)
      log("\n## sparse MLA: the dequantisation's forms (merge kernel; last column: the form)")
      log(MLA_HEADER)
      forms = [dict(lean=True, **f) for f in ({}, {"warpgroups": 2}, {"scales_after": True},
                                              {"warpgroups": 2, "scales_after": True},
                                              {"scales_after": True, "group_arrival": True})]  # (lean: as the step)
      for B, T in [(1, 1), (1, 4), (8, 4), (32, 1)]:
        for form in forms:
          bench_mla(B, T, with_xla=False, pooled=pooled, combine="kernel", form=form)
    if "gather" in only:  # session 79's gather warpgroup (policy knob mla_gather_warpgroup): the step's form vs it
      log("\n## sparse MLA: the gathers from a second warpgroup (merge kernel, lean, scales after; last column: the "
          "form; S=: a prefill chunk's hot 4K / 32K cache)")
      log(MLA_HEADER)
      for B, T, S in [(1, 512, 4096), (1, 512, 32768), (1, 1, None), (8, 4, None)]:  # (prefill first)
        for form in ({}, {"gather_warpgroup": True, "stages": 2}, {"gather_warpgroup": True, "stages": 3},
                     {"gather_warpgroup": True, "warpgroups": 2})[:None if T > 4 else 1] + (
                         ({"gather_warpgroup": True},) if T <= 4 else ()):
          bench_mla(B, T, with_xla=False, pooled=pooled, combine="kernel", S=S,
                    form=dict(lean=True, scales_after=True, **form))
    if "sweep" in only:
      log("\n## sparse MLA: blocks of 64 positions per CTA (W split)")
      log(MLA_HEADER)
      sweep = [(1, 1, (2, 4))] if a.quick else [(1, 1, (1, 2, 4, 9)), (1, 4, (1, 2, 4)), (8, 4, (2, 4, 9))]
      for B, T, nbss in sweep:
        for nbs in nbss:
          bench_mla(B, T, nbs=nbs, with_xla=False, pooled=pooled)
    if "indexer" in only:
      log("\n## indexer scores (HI=32, all pools visible)")
      log(IDX_HEADER)
      cfgs = [(1, 1, 8192), (1, 4, 16384), (8, 4, 8192)] if a.quick else \
          [(1, 1, 8192), (1, 4, 1024), (1, 4, 8192), (1, 4, 16384), (8, 1, 16384), (8, 4, 8192)]
      for B, T, P in cfgs:
        bench_indexer(B, T, P)
  finally:
    log(f"# {time.time() - t0:.0f} s")
    if a.out:
      with open(a.out, "w") as fh:
        fh.write("\n".join(_LINES) + "\n")


if __name__ == "__main__":
  main()
