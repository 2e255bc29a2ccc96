"""One DSA layer of decode, alone: µs per layer for batch x q x context, latency_specialized's kernels vs XLA (auto),
against the layer's HBM floor (issue #7, item 5).

  python benchmarks/bench_dsa_layer.py [--batch 1 8 32] [--q 1 4] [--context 4096 32768 131072] [--out J] [--plot P]
  python benchmarks/bench_dsa_layer.py --from benchmarks/results/dsa_layer_h100.jsonl --plot P   (plot only)

What runs is the model's own DSA sublayer (``glm5_jax.attention.DSA``, the module the step calls) at the share of
one TP4 rank (16 heads), random FP8 weights and a random FP8 latent / pooled-key cache filled to --context
positions, the q new tokens written at the end: q_a / kv_a and q_b projections, the latent's FP8 cache write, the
indexer (its projections, pooled-key update, scores over every complete pool, top-512 pools + tail), the sparse
MLA over the 2,051 selected positions, W_UV and o_proj. Its input is the sublayer's normed input as the mHC
boundary hands it over (without the boundary's f16 copy: one conversion more than in the step at q = 1).

Each call gets its own random input rows, and the calls rotate over enough copies of the layer's weights and cache
that they are cold in the 60 MB L2, as in a step, where each of the 12 DSA layers reads its own once; the cache is
donated and chained (its update in place, as in the step). Timing: the device time of every kernel a call launches
(CUPTI; without it, host wall-clock of back-to-back calls), median of --repeats. Columns:
  us       device µs per layer call (the sum of its kernels' durations; launch gaps are not in it)
  core     the attention core: the indexer's scores, the selection, the sparse MLA and its split merge — what
           issue #7's goal (<= 10 µs per layer at B = 1, q = 4, 32K) and the published sparse-MLA decode time it
           cites are about (latency_specialized's kernels only; XLA's path is not split)
  proj     the weight-streaming kernels (q_a / kv_a, q_b, the indexer's, W_UK (mla_uk_kernel), W_UV, o_proj)
  glue     everything else (XLA fusions around the kernels)
  floor    the bytes the layer must read (its weights once; the selected FP8 latent rows per query token; the
           pooled keys once per sequence: glm5_jax.profiling.floor_bytes) at 4.3 TB/s
  launches kernels per call
  same     latency_specialized: the share of the indexer's selected pools that XLA's path selects too, for the
           same inputs (the FP8 scores kernel and XLA's f32 sums of the same products differ in the last bits:
           pools at the top-512 boundary can swap; the outputs then differ by those positions' weights)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from benchmarks import _timing  # noqa: E402
from glm5_jax import config as C  # noqa: E402
from glm5_jax import profiling  # noqa: E402
from glm5_jax import state as st  # noqa: E402
from glm5_jax.attention import StepCtx  # noqa: E402
from glm5_jax.layers import counters_scope, kernel_report, use_kernels  # noqa: E402
from glm5_jax.runtime import detect_platform  # noqa: E402
from glm5_jax.synthetic import random_caches, random_model, tp_rank_config  # noqa: E402
from pallas_kernels._common import maybe_interpret, on_gpu  # noqa: E402

L2_BYTES = 60 << 20
FAMILIES = (  # (column, kernel-name fragments) — a CUPTI kernel name is counted in the first family it matches
    ("core", ("glm5_indexer_scores", "glm5_topk", "glm5_sparse_mla", "glm5_mla_combine")),
    ("proj", ("glm5_fp8", "glm5_bf16_linear", "glm5_mla_uv", "glm5_mla_uk")),
)


def geometry(name: str) -> C.Glm5Config:
  """One DSA layer (and a dense MLP, unused) at the share of one TP4 rank; kernel-tiny for CPU smoke runs."""
  one = dict(num_hidden_layers=1, layer_types=(C.DSA,), mlp_layer_types=("dense",))
  if name == "tp4-rank":
    return tp_rank_config(C.Glm5Config(**one), 4).replace(vocab_size=1024)  # (no embedding / head is read here)
  return C.kernel_tiny().replace(**one)


def _is_attn(path) -> bool:
  return any(getattr(k, "key", None) == "self_attn" for k in path)


def attn_copy(params):
  """params with the DSA layer's leaves copied (new buffers); the others — the embedding, the unused MLP —
  shared."""
  return jax.tree.map_with_path(lambda path, x: jnp.array(x, copy=True) if _is_attn(path) else x, params)


def same_pools(a, b) -> float:
  """The mean share of b's selected pools (per token row; -1 = none) that a selects too."""
  a, b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
  shares = [len(set(x[x >= 0]) & set(y[y >= 0])) / max(1, int((y >= 0).sum())) for x, y in zip(a, b)]
  return float(np.mean(shares))


def family_us(names: dict[str, float]) -> dict[str, float]:
  out = {"core": 0.0, "proj": 0.0, "glue": 0.0}
  for n, us in names.items():
    fam = next((f for f, frags in FAMILIES if any(s in n for s in frags)), "glue")
    out[fam] += us
  return out


def bench(model, cfg, B: int, q: int, ctx: int, backend: str, repeats: int, calls: int, seed: int,
          policy: dict | None = None):
  """-> (row dict, the pools selected for the first call's inputs [B, q, kp]). ``policy``: latency_specialized's
  kernel switches over the defaults (glm5_jax.layers.KNOBS)."""
  kpool = cfg.index_kpool
  S = -(-(ctx + q) // kpool) * kpool  # the cache's positions: the context and this call's q tokens
  layout = st.cache_layout(cfg, B, S, q, model.dtype, mtp=False, kv_fp8=True)  # (cfg: one DSA layer)
  cache_bytes = sum(math.prod(s.shape) * jnp.dtype(s.dtype).itemsize for s in jax.tree.leaves(st.cache_shapes(layout)))
  w_bytes = sum(x.nbytes for p, x in jax.tree.flatten_with_path(model.params)[0] if _is_attn(p))
  n_copies = max(1, min(12, math.ceil(3 * L2_BYTES / (cache_bytes + w_bytes))))
  key = jax.random.key(seed)
  rand_cache = lambda i: random_caches(layout, model.mesh, jax.random.fold_in(key, i))["layers"][0]

  params = [model.params] + [attn_copy(model.params) for _ in range(1, n_copies)]
  caches = [rand_cache(i) for i in range(n_copies)]
  D = cfg.hidden_size
  xs = [jax.random.normal(jax.random.fold_in(key, 10_000 + i), (B, q, D), jnp.float32).astype(model.dtype)
        for i in range(calls)]
  start = jnp.full((B,), ctx, jnp.int32)
  valid = jnp.full((B,), q, jnp.int32)
  n_acc = jnp.ones((B,), jnp.int32)
  cspec = jax.tree.map(lambda _: P(), caches[0])

  def layer(m, x, cache, start, valid, n_acc):
    with counters_scope():
      y, new, aux = m.layers[0].self_attn(x, cache, StepCtx(start, valid, n_acc, "extend"), model.dtype)
    return (y.astype(jnp.float32), aux["pools"]), new

  sm = model.shard_map(layer, (P(), cspec, P(), P(), P()), ((P(), P()), cspec))
  kernels = backend == "latency_specialized"
  policy = dict(policy or {}) if kernels else None
  arch = detect_platform(model.mesh.devices.flat)  # (Blackwell: the kernels' tcgen05 forms, as the step's)
  with maybe_interpret(None), use_kernels(policy, arch), kernel_report() as rep:
    f = jax.jit(sm, donate_argnums=(2,))
    t0 = time.perf_counter()
    compiled = f.lower(params[0], xs[0], caches[0], start, valid, n_acc).compile()
    compile_s = time.perf_counter() - t0
  ran = sorted({k for k, why in rep if why is None})
  state = {"i": 0, "caches": caches}

  def call(x):  # the layer copies in turn, each cache chained through its own calls (donated)
    i = state["i"] % n_copies
    state["i"] += 1
    (y, _), state["caches"][i] = compiled(params[i], x, state["caches"][i], start, valid, n_acc)
    return y

  # the first call's selection, for the comparison between backends (a fresh copy of cache 0: the timed calls
  # rewrite the same positions with other rows)
  (y0, pools0), _ = compiled(params[0], xs[0], rand_cache(0), start, valid, n_acc)
  if not np.isfinite(np.asarray(y0)).all():
    raise FloatingPointError(f"{backend}: the layer's output is not finite at B={B} q={q} context={ctx}")
  runs = [_timing.time_calls(call, [(x,) for x in xs], reps=1) for _ in range(repeats)]
  us, names = sorted(runs, key=lambda r: r[0])[len(runs) // 2]
  fam = family_us(names)
  launches = None
  if _timing.MODE[0] == "cupti":
    launches = _count_launches(call, xs)
  floors = profiling.floor_bytes(cfg, model.params, batch=B, q=q, context=ctx)
  floor_us = (floors.get("dsa", 0.0) + floors.get("indexer", 0.0)) / profiling.HBM_BYTES_PER_S * 1e6
  row = dict(bench="dsa_layer", backend=backend, policy=policy, batch=B, q=q, context=ctx, us=us, core_us=fam["core"],
             proj_us=fam["proj"], glue_us=fam["glue"], floor_us=floor_us, launches=launches, copies=n_copies,
             compile_s=compile_s, kernels=ran, timing=_timing.MODE[0], device=jax.devices()[0].device_kind,
             top_us={n: round(t, 2) for n, t in sorted(names.items(), key=lambda kv: -kv[1])[:16]},
             date=time.strftime("%Y-%m-%d"))
  for c in state["caches"]:
    jax.tree.map(lambda a: a.delete(), c)
  return row, np.asarray(pools0)


def _count_launches(call, xs) -> float:
  """Kernels launched per call (CUPTI's records over the calls)."""
  ext = _timing._EXT
  ext._cupti_init()
  jax.block_until_ready([call(x) for x in xs])
  return len(ext._cupti_get_timings(True)) / len(xs)


def plot(rows: list[dict], path: str):
  """µs per layer against the context, one panel per (B, q): latency_specialized (its attention core dashed), XLA's
  path, and the floor. A configuration measured more than once is drawn from its last row (a later session's code)."""
  import matplotlib  # noqa: PLC0415
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415
  rows = [r for r in rows if not r.get("policy")]  # (the defaults of their day: --policy A/B rows are not drawn)
  rows = list({(r["batch"], r["q"], r["backend"], r["context"]): r for r in rows}.values())
  cases = sorted({(r["batch"], r["q"]) for r in rows})
  fig, axes = plt.subplots(1, len(cases), figsize=(3.2 * len(cases), 3.2), sharey=True, squeeze=False)
  for ax, (B, q) in zip(axes[0], cases):
    sel = lambda b: sorted((r for r in rows if (r["batch"], r["q"], r["backend"]) == (B, q, b)),
                           key=lambda r: r["context"])
    ls, xla = sel("latency_specialized"), sel("auto")
    ctx = lambda rs: [r["context"] // 1024 for r in rs]
    ax.plot(ctx(xla), [r["us"] for r in xla], "o-", color="tab:gray", label="XLA (auto)")
    ax.plot(ctx(ls), [r["us"] for r in ls], "o-", color="tab:blue", label="latency_specialized")
    core = [r for r in ls if r["kernels"]]
    ax.plot(ctx(core), [r["core_us"] for r in core], "s--", color="tab:blue", alpha=0.6, label="its attention core")
    ax.plot(ctx(ls), [r["floor_us"] for r in ls], "k:", label="floor (4.3 TB/s)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_title(f"B = {B}, q = {q}")
    ax.set_xlabel("context (K tokens)")
  axes[0][0].set_ylabel("µs per DSA layer")
  axes[0][0].legend(fontsize=7)
  fig.suptitle(f"one DSA layer of decode, one TP4 rank ({rows[0]['device']})", fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--geometry", default="tp4-rank", choices=["tp4-rank", "kernel-tiny"])
  p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
  p.add_argument("--q", type=int, nargs="+", default=[1, 4])
  p.add_argument("--context", type=int, nargs="+", default=[4096, 32768, 131072])
  p.add_argument("--backend", nargs="+", default=["latency_specialized", "auto"],
                 choices=["latency_specialized", "auto"])
  p.add_argument("--policy", nargs="+", default=["{}"], metavar="JSON",
                 help="latency_specialized's kernel switches over the defaults, one configuration each (e.g. "
                 "'{}' '{\"mla_scales_after\": true}')")
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--calls", type=int, default=24, help="calls per timed run (each its own input rows)")
  p.add_argument("--budget-s", type=float, default=None, help="start no configuration after this many seconds")
  p.add_argument("--out", default=None, help="append one JSON line per configuration")
  p.add_argument("--plot", default=None, metavar="PNG", help="plot the rows of --from (or of this run) to PNG")
  p.add_argument("--from", dest="from_", default=None, metavar="JSONL", help="with --plot: rows of an earlier run "
                 "(nothing is timed)")
  a = p.parse_args(argv)
  if a.from_:
    with open(a.from_) as fh:
      rows = [json.loads(line) for line in fh if line.strip()]
    plot(rows, a.plot or os.path.splitext(a.from_)[0] + ".png")
    return rows
  if not on_gpu():
    print("# no GPU: the kernels run in Mosaic GPU interpret mode and the times are the CPU's (a smoke run)")
  policies = [json.loads(s) for s in a.policy]
  for pol in policies:
    if not isinstance(pol, dict):
      raise SystemExit(f"bench_dsa_layer: --policy takes JSON objects, got {pol!r}")
  cfg = geometry(a.geometry)
  model = random_model(cfg, mtp=False)
  t_start = time.perf_counter()
  hdr = (f"{'B':>3} {'q':>2} {'context':>7} {'backend':>20} {'us':>8} {'core':>7} {'proj':>7} {'glue':>7} "
         f"{'floor':>6} {'x floor':>7} {'launches':>8} {'same':>6}")
  print(f"# one DSA layer, {a.geometry} ({cfg.num_attention_heads} heads), {jax.devices()[0].device_kind}, "
        f"timing: {_timing.MODE[0]}")
  print(hdr)
  rows = []
  stop = False
  for ctx in a.context:
    for B in a.batch:
      for q in a.q:
        if stop or (a.budget_s is not None and time.perf_counter() - t_start > a.budget_s):
          if not stop:
            print(f"# --budget-s: stopped before B={B} q={q} context={ctx}")
          stop = True
          continue
        sel = {}
        runs = [(b, pol) for b in sorted(a.backend, key=lambda b: b != "auto")  # (auto first: compared with)
                for pol in (policies if b == "latency_specialized" else [None])]
        for backend, pol in runs:
          row, sel[backend] = bench(model, cfg, B, q, ctx, backend, a.repeats, a.calls, seed=B * 1000 + q + ctx,
                                    policy=pol)
          row["same_pools"] = same_pools(sel[backend], sel["auto"]) if backend != "auto" and "auto" in sel else None
          rows.append(row)
          split = backend == "latency_specialized" and _timing.MODE[0] == "cupti" and bool(row["kernels"])
          col = lambda k: f"{row[k]:7.1f}" if split else f"{'-':>7}"
          launches = "-" if row["launches"] is None else f"{row['launches']:.0f}"
          same = "" if row["same_pools"] is None else f"{row['same_pools']:6.3f}"
          print(f"{B:>3} {q:>2} {ctx:>7} {backend:>20} {row['us']:8.1f} {col('core_us')} {col('proj_us')} "
                f"{col('glue_us')} {row['floor_us']:6.1f} {row['us'] / row['floor_us']:7.2f} {launches:>8} {same}"
                + ("  (no kernel runs at these token rows: XLA's path)" if backend != "auto" and not row["kernels"]
                   else "") + (f"  {json.dumps(pol)}" if pol else ""), flush=True)
  if a.out:
    with open(a.out, "a") as fh:
      for r in rows:
        fh.write(json.dumps(r) + "\n")
  if a.plot and rows:
    plot(rows, a.plot)
  return rows


if __name__ == "__main__":
  main()
