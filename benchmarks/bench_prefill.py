"""Prefill benchmark (time to first token): ``Decoder.prefill`` of one long prompt at a given geometry.

  python benchmarks/bench_prefill.py --geometry tp4-rank --prompt 4096 32768 --chunk 256 1024 \\
      --policy '{}' '{"moe_prefill": true}'

What a prefill is: the prompt through the target in chunks of --chunk tokens (one compiled program a chunk size),
the first token, then the MTP layer over the prompt and the first k drafts (q = 1 + k). Geometries as in
bench_decode.py: ``tp4-rank`` — one TP4 rank's share of GLM-5.3-Flash on ONE GPU (~82 GB of random weights, FP8
where the release is FP8; no all-reduces), ``kernel-tiny`` for a CPU smoke run. Each configuration prefills a
warm-up prompt of one chunk first (compiling the chunk programs) and one untimed prompt of the full length, then
--repeats random prompts (fresh caches each: a prefill starts from none); the median is reported.

The floor of a chunk: every parameter read once (the chunk's M·k routed pairs touch ~every expert at M >= 256:
~1.9 GB of experts per MoE layer of one rank) at 4.3 TB/s, or its FLOPs (2 per active parameter per token: the
rank's ~4.6 B active parameters) at 989 TFLOP/s of dense bf16, whichever is longer; attention's FLOPs are left out
(they grow with the context: the floor is a lower bound). The XLA MoE runs every expert over every token of the
chunk (E / k = 36x the routed FLOPs, after dequantising every expert to bf16 in HBM); policy knob moe_prefill runs
the routed pairs as grouped FP8 GEMMs (pallas_kernels/moe_prefill.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from glm5_jax import config as C  # noqa: E402
from glm5_jax import profiling  # noqa: E402
from glm5_jax.runtime import DecodeConfig  # noqa: E402
from glm5_jax.speculative import PREFILL_CHUNK, Decoder, parse_xla_option  # noqa: E402
from glm5_jax.synthetic import random_model, tp_rank_config  # noqa: E402

BF16_FLOPS = 989e12  # H200 / H100 SXM dense bf16 tensor-core peak


def active_params(cfg) -> int:
  """Parameters a token reads (one rank's share at the config's widths): everything but the experts it is not
  routed to, and the embedding table (one row)."""
  from flax import nnx  # noqa: PLC0415

  from glm5_jax.model import Glm5Model  # noqa: PLC0415
  abstract = nnx.eval_shape(lambda: Glm5Model(cfg, jnp.bfloat16, fp8=cfg.fp8_block is not None, mtp=False))
  total = routed = 0
  for path, v in nnx.to_flat_state(nnx.state(abstract)):
    n = int(np.prod(v.get_value().shape))
    names = "/".join(map(str, path))
    if "embed" in names:
      continue
    total += n
    if "experts" in names and "shared" not in names:
      routed += n
  return total - routed + routed * cfg.num_experts_per_tok // cfg.n_routed_experts


def chunk_floor_ms(model, cfg, tokens: int, active: int) -> float:
  """The chunk's lower bound: its parameters read once at HBM bandwidth, or its FLOPs at the bf16 peak."""
  nbytes = sum(x.nbytes for x in jax.tree.leaves(model.params))
  return 1e3 * max(nbytes / profiling.HBM_BYTES_PER_S, 2.0 * active * tokens / BF16_FLOPS)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--geometry", default="tp4-rank", choices=["tp4-rank", "kernel-tiny"])
  p.add_argument("--layers", type=int, default=None, help="keep the first N layers (tp4-rank)")
  p.add_argument("--prompt", type=int, nargs="+", default=[4096], help="prompt lengths (tokens)")
  p.add_argument("--chunk", type=int, nargs="+", default=[PREFILL_CHUNK],
                 help=f"prefill chunk sizes (Decoder.prefill_chunk; default the Decoder's, {PREFILL_CHUNK})")
  p.add_argument("--k", type=int, default=3, help="draft tokens (the MTP pass over the prompt runs when k > 0)")
  p.add_argument("--backend", nargs="+", default=["latency_specialized"])
  p.add_argument("--policy", nargs="+", default=["{}"], help="decode policy knobs as JSON")
  p.add_argument("--prefill-xla-option", action="append", default=[], metavar="NAME=VALUE",
                 help="an XLA option the chunk programs compile with (Decoder(prefill_compiler_options=)), e.g. "
                 "xla_gpu_autotune_level=0 (768 / 1,024-token chunks compiled past 300 s with XLA's autotuning); "
                 "repeatable")
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--out", default=None, help="append JSON lines of results here")
  p.add_argument("--trace", default=None, metavar="DIR",
                 help="after each configuration's timing, trace one prefill of the first prompt length: print where "
                 "the GPU's time goes (kernel families by wall share) and keep its device events here (gzipped TSV: "
                 "name, start ns, end ns, stream — to read against the chunk program's kernel listing, written beside "
                 "them as .kernels.tsv.gz)")
  a = p.parse_args(argv)
  xla_options = dict(parse_xla_option(o) for o in a.prefill_xla_option)
  base = C.Glm5Config(num_hidden_layers=a.layers) if a.layers else C.real()
  cfg = tp_rank_config(base, 4) if a.geometry == "tp4-rank" else C.kernel_tiny()
  t = time.time()
  model = random_model(cfg, dtype=jnp.bfloat16, fp8=cfg.fp8_block is not None)
  jax.block_until_ready(jax.tree.leaves(model.params))
  active = active_params(cfg)
  print(f"# {a.geometry} ({cfg.num_hidden_layers} layers): random parameters in {time.time() - t:.1f} s on "
        f"{jax.devices()[0].device_kind}; {active / 1e9:.2f} B active parameters a token", flush=True)
  print(f"{'backend':>22} {'policy':>24} {'prompt':>7} {'chunk':>6} {'first s':>8} {'ms (median)':>12} "
        f"{'tokens/s':>9} {'ms/chunk':>9} {'floor ms/chunk':>14}", flush=True)
  rng = np.random.default_rng(0)
  for backend in a.backend:
    for pol_text in a.policy:
      policy = tuple(sorted(json.loads(pol_text).items()))
      for chunk in a.chunk:
        # one decoder (one max_context: the caches' shapes) for every prompt: its chunk programs compiled once
        ctx = max(a.prompt) + 1 + a.k + 16
        ctx += (-ctx) % cfg.index_kpool
        dec = Decoder(model, DecodeConfig(max_context=ctx, q=1 + a.k, capture_sizes=(1,), policy=policy),
                      backend=backend, prefill_chunk=chunk, prefill_compiler_options=xla_options)
        for n in a.prompt:
          t = time.time()  # (the chunk programs compiled by a one-chunk prompt, the first time: n's programs)
          jax.block_until_ready(dec.prefill([rng.integers(1, cfg.vocab_size - 1, min(n, chunk))]).next_tokens)
          first_s = time.time() - t
          # one untimed prompt of the full length: each configuration's first timed prefill ran 20-45 % slower
          # than the next (sessions 76-77, an H100: 809 vs 556 ms at 4K) — the clocks and the allocator settle
          jax.block_until_ready(dec.prefill([rng.integers(1, cfg.vocab_size - 1, n)]).next_tokens)
          times = []
          for _ in range(a.repeats):
            prompt = rng.integers(1, cfg.vocab_size - 1, n)
            t = time.perf_counter()
            jax.block_until_ready(dec.prefill([prompt]).next_tokens)
            times.append(1e3 * (time.perf_counter() - t))
          ms = float(np.median(times))
          chunks = -(-n // dec.prefill_rows(n))
          floor = chunk_floor_ms(model, cfg, min(chunk, n), active)
          print(f"{backend:>22} {pol_text:>24} {n:>7} {chunk:>6} {first_s:>8.1f} {ms:>12.1f} {1e3 * n / ms:>9.0f} "
                f"{ms / chunks:>9.2f} {floor:>14.2f}", flush=True)
          summary = None
          if a.trace and n == a.prompt[0]:
            summary = trace_prefill(dec, rng.integers(1, cfg.vocab_size - 1, n), chunks, os.path.join(
                a.trace, f"prefill_{a.geometry}_{backend}_p{n}_c{chunk}"
                + "".join(f"_{k}-{v}" for k, v in policy) + ".events.tsv.gz"))
          if a.out:
            with open(a.out, "a") as f:
              f.write(json.dumps(dict(
                  bench="prefill", geometry=a.geometry, layers=cfg.num_hidden_layers,
                  device=jax.devices()[0].device_kind, backend=backend, policy=dict(policy), prompt=n, chunk=chunk,
                  **({"prefill_compiler_options": xla_options} if xla_options else {}), k=a.k, first_s=first_s, ms=ms,
                  ms_all=times, tokens_per_s=1e3 * n / ms, chunks=chunks, floor_ms_per_chunk=floor, trace=summary,
                  date=time.strftime("%Y-%m-%d"))) + "\n")


def trace_prefill(dec, prompt, chunks: int, events_path: str, top: int = 24) -> dict:
  """One prefill of ``prompt`` under jax.profiler -> a summary (ms per chunk: device span, busy, idle; kernels
  launched per chunk; the kernel families — numbered instances folded — with the largest wall shares, µs per
  chunk: concurrent kernels share the time they overlap); the device events go to ``events_path``."""
  import collections  # noqa: PLC0415
  import glob  # noqa: PLC0415
  import gzip  # noqa: PLC0415
  import tempfile  # noqa: PLC0415

  from jax._src.lib import _profile_data  # noqa: PLC0415

  d = tempfile.mkdtemp(prefix="glm5_prefill_trace_")
  opts = jax.profiler.ProfileOptions()
  opts.python_tracer_level = 0
  jax.profiler.start_trace(d, profiler_options=opts)
  jax.block_until_ready(dec.prefill([prompt]).next_tokens)
  jax.profiler.stop_trace()
  pd = _profile_data.ProfileData.from_file(sorted(glob.glob(f"{d}/**/*.xplane.pb", recursive=True))[-1])
  ev = profiling.device_events(pd)
  os.makedirs(os.path.dirname(os.path.abspath(events_path)), exist_ok=True)
  with gzip.open(events_path, "wt") as fh:
    fh.writelines(f"{n}\t{s}\t{e}\t{ln}\n" for n, s, e, ln in ev)
  if not ev:
    print(f"#   trace: no device events ({events_path})", flush=True)
    return {"device_events": 0}
  busy, _ = profiling._union_busy([(s, e) for _, s, e, _ in ev])
  span = max(e for _, _, e, _ in ev) - min(s for _, s, _, _ in ev)
  share, _ = profiling.wall_shares([(n, s, e) for n, s, e, _ in ev])
  fam, count = collections.Counter(), collections.Counter()
  for n, ns in share.items():
    fam[profiling.event_kind(n)] += ns / 1e3 / chunks
  for n, _, _, _ in ev:
    count[profiling.event_kind(n)] += 1
  out = dict(span_ms_per_chunk=span / 1e6 / chunks, busy_ms_per_chunk=busy / 1e6 / chunks,
             kernels_per_chunk=len(ev) / chunks,
             top_us_per_chunk={k: (round(v, 1), count[k] / chunks) for k, v in fam.most_common(top)})
  print(f"#   trace ({chunks} chunks): device span {out['span_ms_per_chunk']:.2f} ms a chunk, busy "
        f"{out['busy_ms_per_chunk']:.2f}, {out['kernels_per_chunk']:.0f} kernels a chunk; events: {events_path}",
        flush=True)
  print("#   trace, kernel families by wall share (µs a chunk, launches a chunk): " + ", ".join(
      f"{k} {v:.0f} ({c:.0f})" for k, (v, c) in out["top_us_per_chunk"].items()), flush=True)
  # by component: the kernels named after the target chunk program's instructions (the MTP pass's, the first
  # token's and library kernels — cuBLAS, CUB — match none: "unmatched")
  t = time.perf_counter()
  hlo = chunk_program_hlo(dec, dec.config.capture_size_for(1), dec.prefill_rows(len(prompt)))
  kmap = profiling.kernel_map(hlo)
  # (the chunk program's kernel listing beside the events: what each fusion the trace names computes — its result
  # shape and op_name — for reading a GPU compile's kernels that a compile-only listing names differently)
  with gzip.open(events_path.replace(".events.tsv.gz", "") + ".kernels.tsv.gz", "wt") as fh:
    fh.write(profiling.kernel_listing(hlo))
  per, _, unmatched = profiling.split([(n, (e - s) / 1e6) for n, s, e, _ in ev], kmap, chunks)
  per["other"] = per.get("other", 0.0) - sum(unmatched.values())  # (split files the unmatched under "other")
  per["unmatched"] = sum(unmatched.values())
  out["components_us_per_chunk"] = {k: round(v, 1) for k, v in sorted(per.items(), key=lambda kv: -kv[1])}
  out["unmatched_top"] = {k: round(v, 1) for k, v in collections.Counter(unmatched).most_common(8)}
  print(f"#   trace by component (kernel time, µs a chunk; the chunk program's HLO in "
        f"{time.perf_counter() - t:.1f} s): " + ", ".join(f"{k} {v:.0f}" for k, v in
                                                         out["components_us_per_chunk"].items()), flush=True)
  print("#   unmatched kernels (µs a chunk): " + ", ".join(f"{k[:60]} {v:.0f}" for k, v in
                                                           out["unmatched_top"].items()), flush=True)
  return out


def chunk_program_hlo(dec, B: int, T: int) -> str:
  """The compiled text of the decoder's target chunk program of B x T tokens — the executable its prefill ran: the
  arguments are built as Decoder.prefill builds them (same shapes, dtypes and shardings), so jax's caches return
  the compiled program rather than compiling it again."""
  from jax.sharding import NamedSharding  # noqa: PLC0415

  from glm5_jax import state as st  # noqa: PLC0415
  from glm5_jax.speculative import REP, _prefill_target_fn  # noqa: PLC0415
  put = lambda x: jax.device_put(x, NamedSharding(dec.model.mesh, REP))
  args = (dec.model.params, st.init_caches(dec.layout(B), dec.model.mesh), put(np.zeros((B, T), np.int32)),
          put(np.zeros(B, np.int32)), put(np.full(B, T, np.int32)))
  with dec.prefill_kernel_mode():
    return _prefill_target_fn(dec, B, T).lower(*args).compile().as_text()


if __name__ == "__main__":
  main()
