"""The ``glm5-jax`` command line.

  glm5-jax demo                      speculative decoding of a prompt with the built-in tiny checkpoint
  glm5-jax generate CKPT --prompt …  prompt -> tokens (text via the checkpoint's tokenizer.json when present)
  glm5-jax bench CKPT                decode-step timing table of a checkpoint
  glm5-jax convert CKPT OUT          Hugging Face checkpoint -> orbax (restorable onto any TP size)
  glm5-jax check-deployment …        the unsupported() reasons of a deployment
  glm5-jax memory                    per-device parameter and cache bytes of the real geometry at TP4
  glm5-jax knobs [--json]            the decode policy knobs: defaults and what each switches
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np


def _decoder(args, model):
  from glm5_jax.speculative import Decoder, parse_xla_option  # noqa: PLC0415
  from glm5_jax.runtime import DecodeConfig  # noqa: PLC0415

  cfg = DecodeConfig(max_context=args.max_context, q=1 + args.k, capture_sizes=tuple(args.capture_sizes),
                     policy=tuple(sorted(json.loads(args.policy).items())))
  pack = {} if args.pack_params is None else dict(pack_params=args.pack_params)
  chunk = {} if args.prefill_chunk is None else dict(prefill_chunk=args.prefill_chunk)
  opts = dict(parse_xla_option(o) for o in args.xla_option)
  return Decoder(model, cfg, backend=args.backend, temperature=args.temperature, top_p=args.top_p,
                 compiler_options=opts or None, steps_per_call=_steps_per_call(args, model),
                 **chunk, **pack)


# latency_specialized on one GPU: 4 speculative steps per call by default — the host launches once per 4 steps
# instead of setting the pace (one TP4 rank, B = 1, q = 1: 7.57 -> 5.31 ms per step; 8 per call measured slower;
# BENCHMARKS.md session 29). Elsewhere one: on the CPU the host is not the bottleneck, and the loop with the
# all-reduces inside the CUDA graph (TP > 1) is verified on CPU only so far (--steps-per-call asks for it).
GPU_STEPS_PER_CALL = 4


def _steps_per_call(args, model) -> int:
  if args.steps_per_call is not None:
    return args.steps_per_call
  gpu = model.mesh.devices.flat[0].platform == "gpu"
  return GPU_STEPS_PER_CALL if (gpu and model.tp == 1 and args.backend == "latency_specialized") else 1


def _add_decode_args(p):
  p.add_argument("--k", type=int, default=3, help="draft tokens per step (q = 1 + k)")
  p.add_argument("--max-context", type=int, default=1024)
  p.add_argument("--capture-sizes", type=int, nargs="+", default=[1])
  p.add_argument("--backend", default="auto", choices=["auto", "latency_specialized"])
  p.add_argument("--temperature", type=float, default=0.0)
  p.add_argument("--top-p", type=float, default=1.0)
  p.add_argument("--stream", action="store_true", help="print the text (or the ids) as the tokens arrive")
  p.add_argument("--ignore-eos", action="store_true",
                 help="generate --max-new-tokens whatever comes (default: stop at the checkpoint's eos_token_id)")
  p.add_argument("--tp", type=int, default=1)
  p.add_argument("--steps-per-call", type=int, default=None,
                 help="speculative steps per decode call (one host launch per N steps; Decoder(steps_per_call)); "
                      f"default {GPU_STEPS_PER_CALL} for latency_specialized on one GPU, else 1")
  p.add_argument("--policy", default="{}", help="decode policy knobs as JSON, e.g. '{\"mhc_finish\": false}'")
  p.add_argument("--prefill-chunk", type=int, default=None,
                 help="prompt tokens per prefill call (one compiled program per chunk size; larger chunks pay a "
                      "chunk's fixed cost — its launches, the prefill MoE's stream of every expert — fewer times); "
                      "default: the Decoder's, glm5_jax.speculative.PREFILL_CHUNK (2048)")
  p.add_argument("--pack-params", type=int, default=None,
                 help="pass parameters under this many bytes packed into one buffer per dtype (0 = off; default: "
                      "the Decoder's, glm5_jax.param_packing.DEFAULT_BYTES)")
  p.add_argument("--collectives", default=None, choices=["graph", "xla"],
                 help="how TP all-reduces run (glm5_jax.sharding.COLLECTIVE_MODES; default graph); only with --tp > 1")
  p.add_argument("--dtype", default=None, choices=[None, "float32", "bfloat16"])
  p.add_argument("--xla-option", action="append", default=[], metavar="NAME=VALUE",
                 help="an XLA option for the step's compile (repeatable), over the Decoder's GPU defaults "
                      "(glm5_jax.speculative.GPU_COMPILE_DEFAULTS), e.g. "
                      "xla_gpu_command_buffer_scheduling_mode=LHS")
  p.add_argument("--compile-cache", default=os.environ.get("GLM5_JAX_COMPILE_CACHE"), metavar="DIR",
                 help="keep compiled programs in DIR and reuse them in later runs (glm5_jax.enable_compile_cache; "
                      "default: $GLM5_JAX_COMPILE_CACHE, else off)")
  p.add_argument("--compile-cache-min-s", type=float, default=1.0, metavar="S",
                 help="with --compile-cache: write only programs that took at least S seconds to compile "
                      "(default 1.0; 0 writes every program)")


def _tokenizer(path):
  f = os.path.join(path, "tokenizer.json")
  if not os.path.exists(f):
    return None
  from tokenizers import Tokenizer  # noqa: PLC0415
  return Tokenizer.from_file(f)


class _TextStream:
  """Prints a sequence's text as its tokens arrive: the tokenizer decodes everything so far and the new suffix is
  printed, held back while it ends in U+FFFD (a character whose bytes span tokens not all here yet) or the text so
  far changed (a merge that re-spells it); without a tokenizer, the ids."""

  def __init__(self, tok, out=None):
    self.tok, self.out, self.ids, self.shown = tok, out or sys.stdout, [], ""

  def add(self, ids):
    self.ids += ids
    if self.tok is None:
      if ids:
        print(" ".join(map(str, ids)), end=" ", file=self.out, flush=True)
      return
    text = self.tok.decode(self.ids)
    if text.startswith(self.shown) and not text.endswith("\ufffd"):
      print(text[len(self.shown):], end="", file=self.out, flush=True)
      self.shown = text

  def close(self):
    if self.tok is not None:  # (whatever was held back)
      text = self.tok.decode(self.ids)
      print(text[len(self.shown):] if text.startswith(self.shown) else "", file=self.out, flush=True)
    else:
      print(file=self.out, flush=True)


def _run_generation(args, path, prompt_ids, tok=None):
  import glm5_jax  # noqa: PLC0415

  if args.compile_cache:
    cache = glm5_jax.enable_compile_cache(args.compile_cache, min_compile_s=args.compile_cache_min_s)
    print(f"compile cache: {cache}")
  t0 = time.perf_counter()
  model = glm5_jax.load_model(path, dtype=args.dtype, tp=args.tp)
  dec = _decoder(args, model)
  eos = () if args.ignore_eos else model.cfg.eos_token_id  # (the checkpoint's end-of-sequence ids)
  t1 = time.perf_counter()
  dec.warmup([dec.config.capture_size_for(1)])
  k = dec.config.q - 1
  out, steps, acc_steps, accepted, call_times = [], 0, 0, 0, []
  shown = _TextStream(tok) if args.stream else None
  s = time.perf_counter()
  # Decoder.stream issues each call before reading the previous one's tokens, so the time between two chunks is
  # one call's (steady state); near max_context the last steps run one per call (Decoder.for_next_call)
  for i, chunk in enumerate(dec.stream([prompt_ids], args.max_new_tokens, eos_id=eos)):
    now = time.perf_counter()
    new = chunk.tokens[0]
    if i == 0:
      t2 = now  # (the prefill and its first token)
    else:
      call_times.append((now - s) / chunk.steps)
      steps += chunk.steps
      # the acceptance from the calls the sequence ran through (the last one's tokens are cut at the end)
      if len(out) + len(new) < args.max_new_tokens and not (new and new[-1] in eos):
        acc_steps += chunk.steps
        accepted += len(new) - chunk.steps  # (each step commits its accepted drafts + 1)
    out += new
    if shown is not None:
      if i == 0:
        print(f"streaming ({'text' if tok is not None else 'token ids'}):", flush=True)
      shown.add(new)
    s = now
  if shown is not None:
    shown.close()
  print(f"prompt ({len(prompt_ids)} tokens): {list(map(int, prompt_ids))}")
  end = ", end of sequence" if out and out[-1] in eos else ""
  print(f"generated ({len(out)} tokens{end}): {out}")
  if tok is not None:
    print("text:", tok.decode(out))
  rate = accepted / (acc_steps * k) if k and acc_steps else float("nan")
  med = 1e3 * float(np.median(call_times)) if call_times else float("nan")
  print(f"steps: {steps}  tokens/step: {(len(out) - 1) / max(steps, 1):.2f}  draft acceptance: {rate:.1%} (k={k})")
  print(f"step time: median {med:.2f} ms on {model.mesh.devices.flat[0].platform} (TP{model.tp}, backend "
        f"{dec.backend})  load {t1 - t0:.1f} s  warm-up + prefill {t2 - t1:.1f} s")
  return out


def cmd_demo(args):
  from checkpoints.make_tiny import builtin_checkpoint  # noqa: PLC0415

  path = builtin_checkpoint(args.preset)
  print(f"built-in checkpoint: {args.preset} (random weights, MTP layer included) at {path}")
  rng = np.random.default_rng(args.seed)
  import json as _json  # noqa: PLC0415
  vocab = _json.load(open(os.path.join(path, "config.json")))["text_config"]["vocab_size"]
  prompt = rng.integers(0, vocab, args.prompt_len)
  _run_generation(args, path, prompt)


def cmd_generate(args):
  tok = _tokenizer(args.checkpoint)
  if args.prompt_ids:
    ids = [int(x) for x in args.prompt_ids.split(",")]
  elif tok is not None:
    ids = tok.encode(args.prompt).ids
  else:
    raise SystemExit(f"{args.checkpoint} has no tokenizer.json: pass --prompt-ids 1,2,3")
  _run_generation(args, args.checkpoint, np.asarray(ids), tok)


def cmd_convert(args):
  import glm5_jax  # noqa: PLC0415

  model = glm5_jax.load_model(args.checkpoint, dtype=args.dtype, progress=True)
  glm5_jax.save_model(model, args.out)
  print(f"saved {args.out} (orbax; restore with glm5_jax.load_model({args.out!r}, tp=N))")


def cmd_check(args):
  from glm5_jax import config as C  # noqa: PLC0415
  from glm5_jax.runtime import DeploymentConfig, specialized_decode_config, unsupported  # noqa: PLC0415

  model = C.Glm5Config.from_json(args.checkpoint) if args.checkpoint else C.PRESETS[args.preset]()
  dep = DeploymentConfig(
      model=model, tensor_parallel_size=args.tp, kv_cache_dtype=args.kv_cache_dtype,
      num_speculative_tokens=args.k, speculative_method="mtp" if args.k else None,
      max_model_len=args.max_context, capture_sizes=tuple(args.capture_sizes), platform=args.platform,
      additional_config={"decode_backend": args.backend, "policy": json.loads(args.policy)})
  reasons = unsupported(dep)
  print(f"platform: {dep.current_platform()}  backend: {args.backend}")
  if reasons:
    print(f"{len(reasons)} reason(s) the specialized decode cannot run:")
    for r in reasons:
      print("  -", r)
  else:
    spec = specialized_decode_config(dep)
    print("supported:", spec)
    if args.kernels and spec is not None:
      _print_kernel_sites(model, spec, args.tp)
  return 1 if reasons and args.backend == "latency_specialized" else 0


def _print_kernel_sites(cfg, spec, tp):
  """Trace the step of one TP rank (abstract weights: nothing allocated, no GPU needed) and print which kernels
  run at how many call sites, and why not elsewhere."""
  import dataclasses  # noqa: PLC0415

  from glm5_jax.speculative import Decoder  # noqa: PLC0415
  from glm5_jax.synthetic import abstract_model, tp_rank_config  # noqa: PLC0415

  model, params = abstract_model(tp_rank_config(cfg, tp), fp8=cfg.fp8_block is not None)
  spec = dataclasses.replace(spec, capture_sizes=spec.capture_sizes[:1])
  dec = Decoder(model, spec, backend="latency_specialized")
  with dec.kernel_mode(interpret=False):
    dec.trace_step(spec.capture_sizes[0], params, interpret=False)
  print(f"kernel call sites of one TP{tp} rank's step (B={spec.capture_sizes[0]}, q={spec.q}):")
  for name, v in sorted(dec.kernel_sites().items()):
    why = "; ".join(f"{r} ({n})" for r, n in v["not_used"].items())
    print(f"  {name:<12} {v['sites']:>4} site(s)" + (f"   not used: {why}" if why else ""))


def cmd_memory(args):
  import jax.numpy as jnp  # noqa: PLC0415
  from flax import nnx  # noqa: PLC0415

  from glm5_jax import config as C, sharding as shd, state as st  # noqa: PLC0415
  from glm5_jax.model import Glm5Model  # noqa: PLC0415

  cfg = C.real()
  abstract = nnx.eval_shape(lambda: Glm5Model(cfg, jnp.bfloat16, fp8=True))
  _, astate = nnx.split(abstract)
  pb = shd.param_bytes_per_device(astate, args.tp)
  layout = st.cache_layout(cfg, args.batch, args.max_context, 1 + args.k, jnp.bfloat16, mtp=True)
  cb = st.cache_bytes_per_device(layout, args.tp)
  gb = 1e9
  print(f"GLM-5.3-Flash at TP{args.tp}, batch {args.batch}, max_context {args.max_context}, q {1 + args.k}:")
  print(f"  parameters per device: {pb / gb:8.2f} GB")
  print(f"  caches per device:     {cb / gb:8.2f} GB")
  print(f"  total per device:      {(pb + cb) / gb:8.2f} GB of 141 GB (H200): {'fits' if pb + cb < 141e9 else 'does NOT fit'}")


def cmd_knobs(args):
  """Every decode policy knob: its default and what it switches (with what was measured)."""
  import json  # noqa: PLC0415
  import textwrap  # noqa: PLC0415

  from glm5_jax.layers import KNOBS  # noqa: PLC0415
  other = {"kv_cache_dtype": ("fp8", "the KV cache's dtype: 'fp8' (FP8 latent / pooled-key caches: what the sparse "
                                     "MLA and indexer kernels read; the default of latency_specialized, 'auto' that "
                                     "of the stock backend) or 'auto' (the model's dtype)"),
           "interpret": (False, "run the Mosaic GPU kernels in GPU interpret mode (CPU: tests, notebooks)")}
  rows = {**KNOBS, **other}
  # NAME arguments: the knobs whose names contain any of them (70 knobs: `glm5-jax knobs kda` lists the KDA
  # layer's); --on / --off: those on / off by default. A name that matches nothing is an error naming it.
  missing = [n for n in args.names if not any(n in k for k in rows)]
  if missing:
    raise SystemExit(f"glm5-jax knobs: no knob name contains {', '.join(map(repr, missing))} (see `glm5-jax knobs` "
                     f"for all {len(rows)})")
  rows = {k: v for k, v in rows.items() if (not args.names or any(n in k for n in args.names))
          and (args.default is None or v[0] is args.default)}
  if args.json:
    print(json.dumps({k: {"default": d, "doc": doc} for k, (d, doc) in rows.items()}, indent=1))
    return
  print("decode policy knobs (--policy '{\"name\": value}'; latency_specialized only, except kv_cache_dtype and "
        "interpret):")
  for k, (d, doc) in rows.items():
    print(f"\n  {k} = {json.dumps(d)}")
    print(textwrap.fill(doc, width=100, initial_indent="      ", subsequent_indent="      "))


def main(argv=None):
  p = argparse.ArgumentParser(prog="glm5-jax", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = p.add_subparsers(dest="cmd", required=True)
  d = sub.add_parser("demo", help="speculative decoding with the built-in tiny checkpoint")
  d.add_argument("--preset", default="kernel-tiny", choices=["kernel-tiny", "oracle-tiny"])
  d.add_argument("--prompt-len", type=int, default=24)
  d.add_argument("--max-new-tokens", type=int, default=32)
  d.add_argument("--seed", type=int, default=0)
  _add_decode_args(d)
  d.set_defaults(fn=cmd_demo, max_context=256)
  g = sub.add_parser("generate", help="prompt -> tokens")
  g.add_argument("checkpoint")
  g.add_argument("--prompt", default="")
  g.add_argument("--prompt-ids", default="")
  g.add_argument("--max-new-tokens", type=int, default=32)
  _add_decode_args(g)
  g.set_defaults(fn=cmd_generate)
  c = sub.add_parser("convert", help="Hugging Face -> orbax")
  c.add_argument("checkpoint")
  c.add_argument("out")
  c.add_argument("--dtype", default=None)
  c.set_defaults(fn=cmd_convert)
  k = sub.add_parser("check-deployment", help="print the unsupported() reasons of a deployment")
  k.add_argument("--checkpoint", default=None, help="a checkpoint directory (config.json); default: --preset")
  k.add_argument("--preset", default="real", choices=["real", "kernel-tiny", "oracle-tiny"])
  k.add_argument("--tp", type=int, default=4)
  k.add_argument("--k", type=int, default=3)
  k.add_argument("--max-context", type=int, default=65536)
  k.add_argument("--capture-sizes", type=int, nargs="+", default=[1, 2, 4, 8])
  k.add_argument("--kv-cache-dtype", default="fp8")
  k.add_argument("--backend", default="latency_specialized")
  k.add_argument("--platform", default=None, help="override the detected platform (sm_90, sm_100, cpu, ...)")
  k.add_argument("--policy", default="{}", help="policy knobs as JSON, e.g. '{\"interpret\": true}'")
  k.add_argument("--kernels", action="store_true",
                 help="also trace one rank's step (abstract weights) and list the kernels that would run where")
  k.set_defaults(fn=cmd_check)
  m = sub.add_parser("memory", help="per-device bytes of the real geometry (no allocation)")
  m.add_argument("--tp", type=int, default=4)
  m.add_argument("--batch", type=int, default=1)
  m.add_argument("--max-context", type=int, default=65536)
  m.add_argument("--k", type=int, default=3)
  m.set_defaults(fn=cmd_memory)
  n = sub.add_parser("knobs", help="the decode policy knobs: defaults and what each switches")
  n.add_argument("names", nargs="*", metavar="NAME", help="only the knobs whose names contain one of these")
  n.add_argument("--json", action="store_true")
  state = n.add_mutually_exclusive_group()
  state.add_argument("--on", dest="default", action="store_const", const=True, help="only those on by default")
  state.add_argument("--off", dest="default", action="store_const", const=False, help="only those off by default")
  n.set_defaults(fn=cmd_knobs)
  b = sub.add_parser("bench", help="decode-step timing table (see benchmarks/bench_decode.py)")
  b.add_argument("rest", nargs=argparse.REMAINDER)
  b.set_defaults(fn=lambda a: _bench(a.rest))
  args = p.parse_args(argv)
  if getattr(args, "tp", 1) > 1 and hasattr(args, "collectives"):
    _collectives(args.collectives)
  return args.fn(args) or 0


def _collectives(mode):
  """Set the all-reduce mode before anything starts the GPU backend. Asked for explicitly and too late: an error;
  the default and too late (main() called from a session that already used JAX): said, not silently skipped."""
  from jax._src import xla_bridge  # noqa: PLC0415
  from glm5_jax.sharding import configure_collectives  # noqa: PLC0415
  if mode is None and xla_bridge.backends_are_initialized():
    print("note: JAX's backends are already running, so the all-reduces use XLA's defaults (collectives mode "
          "'graph' must be set before the first JAX computation)", file=sys.stderr)
    return
  configure_collectives(mode or "graph")


def _bench(rest):
  import runpy  # noqa: PLC0415
  here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  script = os.path.join(here, "benchmarks", "bench_decode.py")
  if not os.path.exists(script):
    raise SystemExit("benchmarks/bench_decode.py is part of the source checkout, not of an installed wheel")
  sys.argv = [script] + list(rest)
  runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
  sys.exit(main())
