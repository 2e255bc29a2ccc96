"""Benchmark the indexer's top-512 pool selection at decode sizes on one GPU: XLA's top_k (a sort: two kernels,
34.5 + 8.3 µs at 8,256 pools in the session 22 profile, 11 per step) against sort-free and cheaper-sort forms.

Rows: R = B · q score rows; N pools (8,256 at 32K context + room, 32,832 at 128K); k = 512. Strategies:
  top_k       lax.top_k (XLA: TopK -> a sort with a NaN-aware comparator and an index tie-break)
  radix       glm5_jax.layers.topk_set_by_threshold (radix selection + one prefix sum + a scatter; the decode
              step's policy knob indexer_topk), also with the prefix sum blocked and with 4-bit digits
              (session 24 also measured digits from histograms and a scatter-free compaction: slower, removed)
  sort_keys   lax.sort of one uint32 key in lax.top_k's total order (descending) with the indices as the
              payload, stable: the same indices in the same order as top_k, with the simplest comparator (a
              candidate for XLA's CUB radix sort, xla_gpu_enable_cub_radix_sort)
  kernel      the radix form with its threshold from the Mosaic kernel topk_threshold (one launch for the ~13
              radix passes); "unrolled": its passes as straight-line code, as before session 31 (the loop form
              is ~7x less code, which one CTA runs once)
  model xla   the model's default selection with its token index list (threshold kernel + XLA's compaction,
              expansion, tail and pad); "compact": the same list from the threshold kernel + topk_compact (one
              multi-CTA launch; N a multiple of 128); "compact fused": topk_compact alone, the threshold's passes in
              every CTA ("compact fused 2bit": two bits a pass); "two-stage": rows past the kernel's 17,408 keys
              as two launches of it (each chunk's top k, then the candidates'; knob topk_two_stage)
Each: µs of device time per call (CUPTI), kernels per call, and whether the selection equals top_k's (as a set;
sort_keys also in order).

Usage (GPU):  PYTHONPATH=. python3 benchmarks/bench_topk.py [--rows 1,4] [--pools 8256,32832] [--only A,B] [--out FILE]
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._timing import MODE, log, time_calls, write_log  # noqa: E402
from glm5_jax.layers import topk_set_by_threshold  # noqa: E402
from pallas_kernels._common import order_key  # noqa: E402

K = 512


def kernel_unrolled(v, bits):
  """The kernel form with topk_threshold's passes unrolled (traced with the option patched in)."""
  import functools  # noqa: PLC0415
  from pallas_kernels import indexer as ki  # noqa: PLC0415
  orig = ki.topk_threshold
  ki.topk_threshold = functools.partial(orig, unroll=True)
  try:
    return topk_set_by_threshold(v, K, scan_block=128, threshold_kernel=bits)
  finally:
    ki.topk_threshold = orig


def sort_keys(v, k):
  """lax.top_k(v, k)'s indices from one stable ascending sort of uint32 keys (descending in top_k's total order of
  f32 bit patterns; equal keys keep index order, top_k's tie order)."""
  u = lax.bitcast_convert_type(order_key(v), jnp.uint32) ^ jnp.uint32(0x80000000)  # ascending in v's order
  iota = lax.broadcasted_iota(jnp.int32, v.shape, v.ndim - 1)
  _, idx = lax.sort((~u, iota), dimension=v.ndim - 1, num_keys=1, is_stable=True)
  return idx[..., :k]


def _index_list(js, R, N):
  """js [R, K] (-1 = none) -> the model's token index list: 4 positions per pool, the 3-position tail, -1 up to
  the attention kernel's width (what Indexer.select hands the sparse MLA kernel after XLA's compaction)."""
  pos = jnp.full((R,), 4 * N - 2, jnp.int32)
  tok = jnp.where(js[..., None] >= 0, js[..., None] * 4 + jnp.arange(4, dtype=jnp.int32), -1).reshape(R, -1)
  tail = ((pos + 1) // 4 * 4)[:, None] + jnp.arange(3, dtype=jnp.int32)
  idx = jnp.concatenate([tok, jnp.where(tail <= pos[:, None], tail, -1)], axis=-1)
  return jnp.pad(idx, ((0, 0), (0, WIDTH - idx.shape[-1])), constant_values=-1)


def _model_xla(v):
  """The model's default path at q = 1 (session 48): the threshold kernel on the scores (keys formed in the kernel,
  early exit), XLA's compaction, the expansion to tokens, the tail and the pad — js, with the list computed."""
  js = topk_set_by_threshold(v, K, scan_block=128, threshold_kernel=True, kernel_scores=v, threshold_exit=True)
  return js, _index_list(js, *v.shape)


def _compact(v, lanes: int, fused: bool = False, digit_bits: int = 1):
  """The threshold kernel (lanes_out) + the multi-CTA compaction kernel (policy knob topk_compact_kernel) — js,
  with the list the kernel writes; ``fused``: the compaction kernel alone, its CTAs finding the threshold
  themselves (knob topk_compact_fused), ``digit_bits`` a pass (2: knob topk_threshold_2bit)."""
  from pallas_kernels import indexer as I  # noqa: PLC0415
  R, N = v.shape
  pos = jnp.full((R,), 4 * N - 2, jnp.int32)
  t, n = (None, None) if fused else I.topk_threshold(v, K, early_exit=True, lanes_out=True)
  idx, js = I.topk_compact(v, t, n, (pos + 1) // 4 * 4, pos, k=K, kpool=4, n_tail=3, width=WIDTH, lanes=lanes,
                           digit_bits=digit_bits)
  return js, idx


def _chunked(v, digit_bits: int = 1, balanced: bool = False):  # (balanced: the default since session 66)
  """A row longer than the compaction kernel holds (past 64K context: 16,448+ pools) in two stages of the fused
  compaction (policy knob topk_two_stage: pallas_kernels.indexer.topk_compact_chunked) — js, with its list."""
  from pallas_kernels import indexer as I  # noqa: PLC0415
  R, N = v.shape
  pos = jnp.full((R,), 4 * N - 2, jnp.int32)
  idx, js = I.topk_compact_chunked(v, (pos + 1) // 4 * 4, pos, k=K, kpool=4, n_tail=3, width=WIDTH, lean=True,
                                   digit_bits=digit_bits, balanced=balanced)
  return js, idx


WIDTH = -(-(4 * K + 3) // 64) * 64  # the sparse MLA kernel's index width (2,112)

STRATEGIES = {
    "top_k": lambda v: lax.top_k(v, K)[1],
    "radix": lambda v: topk_set_by_threshold(v, K),
    # the prefix sum blocked (11 µs of the radix form's ~35 at 8,256 pools was its one cumsum, session 23)
    "radix scan128": lambda v: topk_set_by_threshold(v, K, scan_block=128),
    "radix scan512": lambda v: topk_set_by_threshold(v, K, scan_block=512),
    # 8 passes over 16 thresholds instead of 4 over 256
    "radix bits4 scan128": lambda v: topk_set_by_threshold(v, K, digit_bits=4, scan_block=128),
    "sort_keys": lambda v: sort_keys(v, K),
    # the threshold (k-th key, #{key > it}) from the Mosaic kernel pallas_kernels.indexer.topk_threshold instead
    # of the radix passes (the decode step's policy knob topk_threshold; rows of up to 17,408 pools)
    "kernel scan128": lambda v: topk_set_by_threshold(v, K, scan_block=128, threshold_kernel=True),
    # the kernel with 2 bits of the threshold per pass (16 passes of 3 candidates; pallas_kernels.indexer)
    "kernel2 scan128": lambda v: topk_set_by_threshold(v, K, scan_block=128, threshold_kernel=2),
    # the kernel's passes stopping at the first candidate with exactly k keys at or above it (policy knob
    # topk_threshold_exit; it stops only where the k-th and (k+1)-th scores differ: --f32-scores)
    "kernel exit scan128": lambda v: topk_set_by_threshold(v, K, scan_block=128, threshold_kernel=True,
                                                           threshold_exit=True),
    "kernel2 exit scan128": lambda v: topk_set_by_threshold(v, K, scan_block=128, threshold_kernel=2,
                                                            threshold_exit=True),
    # the kernel's CTA as 4 warpgroups, each a quarter of the row (policy knob topk_threshold_4wg)
    "kernel wg4 scan128": lambda v: topk_set_by_threshold(v, K, scan_block=128, threshold_kernel=True,
                                                          threshold_warpgroups=4),
    "kernel2 wg4 scan128": lambda v: topk_set_by_threshold(v, K, scan_block=128, threshold_kernel=2,
                                                           threshold_warpgroups=4),
    # the model's whole selection (the token index list included) as it runs by default, and with the compaction
    # as one multi-CTA kernel after the threshold kernel (policy knob topk_compact_kernel; N a multiple of 128:
    # --pools 8704, the scores kernel's padded row at 32K context), its CTAs 2,048 or 8,192 keys
    "model xla": _model_xla,
    "compact": lambda v: _compact(v, 32),
    "compact128": lambda v: _compact(v, 128),
    "compact fused": lambda v: _compact(v, 32, fused=True),
    "compact fused 2bit": lambda v: _compact(v, 32, fused=True, digit_bits=2),
    # past the kernel's 17,408 keys (128K context: 32,832 pools; 1M: 262,208): two stages (knob topk_two_stage)
    "two-stage": _chunked,
    "two-stage 2bit": lambda v: _chunked(v, 2),
    # more, shorter chunks: C ~ sqrt(N / k), each stage's row about as long (128K: 8 of 4,224, then 4,096)
    "two-stage balanced": lambda v: _chunked(v, balanced=True),
    "kernel unrolled scan128": lambda v: kernel_unrolled(v, 1),
    "kernel2 unrolled scan128": lambda v: kernel_unrolled(v, 2),
}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--rows", default="1,4")
  p.add_argument("--pools", default="8256,32832")
  p.add_argument("--only", default=None, help="comma-separated strategy names (default: all)")
  p.add_argument("--f32-scores", action="store_true", help="scores as f32, not rounded to bf16 (the indexer's "
                 "scores kernel writes f32: ties at the k-th score are rare there, frequent after bf16 rounding)")
  p.add_argument("--out", default=None)
  a = p.parse_args(argv)
  rng = np.random.default_rng(0)
  log(f"# indexer top-{K} selection, {jax.devices()[0].device_kind}, timing: {MODE[0]}, {time.strftime('%Y-%m-%d')}")
  log(f"{'R':>3} {'N':>6} {'strategy':>26} {'dev us':>8} {'kernels':>8}  same as top_k")
  for R in [int(x) for x in a.rows.split(",")]:
    for N in [int(x) for x in a.pools.split(",")]:
      # Σ_h w_h·ReLU(q_h·K): non-negative, with exact ties (zeros) and a masked tail of incomplete pools
      sets = []
      for _ in range(4):
        s = np.maximum(rng.standard_normal((R, N)), 0).astype(np.float32) * rng.uniform(0.5, 2, (R, 1))
        s[:, N - 3:] = -np.inf
        # rounded to bf16: ties inside the top-k (their order is top_k's index order)
        sets.append((jnp.asarray(s) if a.f32_scores else jnp.asarray(s, jnp.bfloat16).astype(jnp.float32),))
      ref = np.asarray(jax.jit(STRATEGIES["top_k"])(*sets[0]))
      names = a.only.split(",") if a.only else list(STRATEGIES)
      if unknown := set(names) - set(STRATEGIES):
        raise SystemExit(f"--only: unknown strategies {sorted(unknown)}; known: {sorted(STRATEGIES)}")
      variants = [(name, name, {}) for name in names]
      # (sort_keys with xla_gpu_enable_cub_radix_sort on and off: no different, session 23)
      for name, label, opts in variants:
        try:
          fn = jax.jit(STRATEGIES[name]).trace(*sets[0]).lower().compile(opts or None)
        except ValueError as e:  # (the threshold kernel past its row size says so)
          log(f"{R:>3} {N:>6} {label:>26}  n/a: {e}")
          continue
        out = fn(*sets[0])
        if isinstance(out, tuple):  # (js, the index list): the list must be js's expansion too
          got = np.asarray(out[0])
          lists_ok = np.array_equal(np.asarray(out[1]), np.asarray(_index_list(out[0], R, N)))
        else:
          got, lists_ok = np.asarray(out), True
        same = lists_ok and all(set(got[r][got[r] >= 0]) == set(ref[r]) for r in range(R))
        if name == "sort_keys":  # (the same order too)
          same = same and np.array_equal(got, ref)
        dev, names = time_calls(fn, sets)
        log(f"{R:>3} {N:>6} {label:>26} {dev:>8.1f} {len(names):>8}  {'yes' if same else 'NO'}")
  if a.out:
    write_log(a.out)


if __name__ == "__main__":
  main()
