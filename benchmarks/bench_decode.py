"""Decode-step benchmark: ms per speculative step at a given geometry, against the HBM roofline.

  python benchmarks/bench_decode.py --geometry tp4-rank --batch 1 8 --q 1 4 --backend auto latency_specialized

Geometries: ``tp4-rank`` — the exact share of one TP4 rank of GLM-5.3-Flash (45 layers + MTP, heads / expert
and MLP widths / vocabulary divided by 4, replicated parts whole; ≈82 GB) run on ONE GPU, so without its
all-reduces (time those separately: benchmarks/bench_allreduce.py); ``kernel-tiny`` / ``oracle-tiny`` for CPU
smoke runs. Weights and caches are random (FP8 where the release is FP8), never zeros; the context is filled to
--context tokens. Each configuration is compiled ahead of time (reported), then timed over chained steps with the
state donated (median of --repeats runs of --steps steps). The roofline is ../shared/notes/performance.md §6:
bytes one TP4 rank must read per step at 4.3 TB/s (1.42 ms at B = 1, q = 1).
"""

from __future__ import annotations

import argparse
import collections
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
from glm5_jax import param_packing as pp  # noqa: E402
from glm5_jax.layers import KERNEL_DEFAULTS  # noqa: E402
from glm5_jax.sharding import make_mesh  # noqa: E402
from glm5_jax.speculative import Decoder, decode, parse_xla_option, warmup_all  # noqa: E402
from glm5_jax.runtime import DecodeConfig  # noqa: E402
from glm5_jax.synthetic import random_model, random_state, tp_rank_config  # noqa: E402

HBM = profiling.HBM_BYTES_PER_S
FATAL = object()  # prepare(): a run-time failure (a device fault poisons the CUDA context: nothing after it can run)


def roofline_bytes(b, q, ctx):
  """Bytes one TP4 rank must read per verify step (performance.md §6; BF16 KV, experts TP-sharded)."""
  experts = 288 * (1 - (1 - 8 / 288) ** (b * q)) * 25_171_968 * 42 / 4
  return 3862e6 + experts + b * (2 * 34 * 16 * 65536) + b * q * 11 * 2048 * 1024 + b * 11 * (ctx / 4) * 256


def _xla_option(text):
  """'name=value' -> (name, bool | int | float | str)."""
  try:
    return parse_xla_option(text)
  except ValueError as e:
    raise SystemExit(str(e)) from None


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--geometry", default="tp4-rank", choices=["tp4-rank", "real", "kernel-tiny", "oracle-tiny"],
                 help="real: the released geometry sharded over --tp GPUs (use --layers to fit it)")
  p.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs (a mesh over the first --tp devices)")
  p.add_argument("--collectives", default="graph", choices=["graph", "xla"],
                 help="with --tp > 1: how the all-reduces run (glm5_jax.sharding.COLLECTIVE_MODES)")
  p.add_argument("--layers", type=int, default=None, help="keep the first N layers (real / tp4-rank geometries)")
  p.add_argument("--batch", type=int, nargs="+", default=[1])
  p.add_argument("--q", type=int, nargs="+", default=[1, 4])
  p.add_argument("--backend", nargs="+", default=["auto", "latency_specialized"])
  p.add_argument("--context", type=int, default=32768)
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--accept", type=float, default=2.75, help="tokens per verify step assumed for tokens/s (q > 1)")
  p.add_argument("--out", default=None, help="append JSON lines of results here")
  p.add_argument("--budget-s", type=float, default=1e9, help="stop starting new configurations after this long")
  p.add_argument("--policy", nargs="+", default=["{}"], help="decode policy knobs as JSON (as in glm5-jax "
                 "check-deployment), e.g. '{\"sparse_mla\": false}'; several compare them in one process")
  p.add_argument("--interleave", action="store_true",
                 help="build every configuration first, then take their timed repeats in turn (A/B comparisons "
                      "that a drifting host speed does not bias); each keeps its own state on the device")
  p.add_argument("--compile-workers", type=int, default=4,
                 help="with --interleave: compile this many configurations at once (XLA's compile releases the GIL; "
                      "the lowerings stay one at a time): five policies cost about five lowerings and one compile")
  p.add_argument("--compile-tail-s", type=float, default=90.0,
                 help="with --compile-workers > 1: the seconds a configuration may take once started (its lowering, "
                      "compile, census and first calls); none starts unless the budget covers it")
  p.add_argument("--trace", action="store_true",
                 help="a jax.profiler trace of --steps steps (XLA command buffers kept on), summarised: device "
                      "span / busy / idle per step, the idle-gap histogram and the host's top events (where wall "
                      "time goes when it exceeds GPU time). Run it apart from --profile (both use CUPTI)")
  p.add_argument("--hlo-dir", default=None,
                 help="write each configuration's optimised HLO (gzip text) here: the kernel census by hand offline")
  p.add_argument("--profile", action="store_true",
                 help="per-component GPU time from CUPTI kernel records (named scopes -> glm5_jax.profiling)")
  p.add_argument("--autotune", nargs="+", default=["default"], choices=["default", "off"],
                 help="XLA GPU autotuning per compiled step (off = xla_gpu_autotune_level 0); both values compare "
                      "them in one process. The q > 1 step of the real geometry took > 350 s to compile with it on")
  p.add_argument("--fast-compile", action="store_true", help="same as --autotune off")
  p.add_argument("--pack-params", type=int, nargs="+", default=[pp.DEFAULT_BYTES],
                 help="Decoder(pack_params=N): parameters under N bytes reach the step packed (fewer arguments for "
                      "the host to parse per call); 0 = off; several values compare them in one process")
  p.add_argument("--executables", type=int, nargs="+", default=[1], choices=[1, 2],
                 help="2: alternate two loaded copies of the compiled step (each its own CUDA graph); both values "
                      "compare them in one process")
  p.add_argument("--steps-per-call", type=int, nargs="+", default=[1],
                 help="Decoder(steps_per_call=N): N speculative steps per call (one host launch per N steps); "
                      "ms/step is per speculative step (on a GPU the rolled loop runs inside the CUDA graph: "
                      "speculative.GPU_LOOP_OPTIONS)")
  p.add_argument("--unroll-steps", action="store_true", help="with --steps-per-call: N copies of the step instead "
                 "of a loop (N times the compile)")
  p.add_argument("--xla-option", action="append", default=[], metavar="NAME=VALUE",
                 help="an XLA debug option for the step's compile (repeatable), e.g. "
                      "xla_gpu_experimental_enable_triton_heroless_priority_fusion=false (names: XLA DebugOptions)")
  p.add_argument("--compile-cache", default=None, metavar="DIR",
                 help="reuse compiled steps across runs (glm5_jax.enable_compile_cache): a repeated configuration "
                      "on the same machine skips its compile")
  a = p.parse_args(argv)
  if a.trace and a.profile:  # session 35: the profile after a trace died ("activity records were dropped")
    p.error("--trace and --profile both use CUPTI in one process: the second loses records; run them apart")
  if a.profile and max(a.steps_per_call) > 1 and not a.unroll_steps:
    # session 37 (s37b): 355 of the 1,417 launches per step recorded at 4 steps per call — 1,420 / 4: the records
    # cover one pass of the rolled loop's body per call, so the per-step totals were a quarter of the step's
    p.error(f"--profile with --steps-per-call {max(a.steps_per_call)}: CUPTI records one iteration of the rolled "
            "steps loop per call (a quarter of the launches at 4); profile with --steps-per-call 1 or add "
            "--unroll-steps")
  if a.compile_cache:
    from glm5_jax.api import enable_compile_cache  # noqa: PLC0415
    enable_compile_cache(a.compile_cache)
  tunings = ["off"] if a.fast_compile else a.autotune
  extra_opts = dict(_xla_option(o) for o in a.xla_option)
  if a.trace:  # XLA turns command buffers off while a profiler runs: the trace must show the timed program
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_enable_command_buffers_during_profiling=true").strip()
  if a.tp > 1:
    from glm5_jax.sharding import configure_collectives  # noqa: PLC0415
    configure_collectives(a.collectives)
  t_start = time.time()
  policies = [tuple(sorted(json.loads(p).items())) for p in a.policy]
  base = C.Glm5Config(num_hidden_layers=a.layers) if a.layers else C.real()
  if a.geometry == "tp4-rank":
    cfg = tp_rank_config(base, 4)
  elif a.geometry == "real":
    cfg = base
  else:
    cfg = C.PRESETS[a.geometry]()
  # room for the warm-up call, every timed run and the profiled run on one state: a fresh state (new buffers)
  # makes the next step re-record XLA's command buffers (~50 µs per Mosaic kernel call), which must not be timed
  # + the trace and the profile runs, and up to 4 untimed first calls
  max_ctx = a.context + max(a.q) * max(a.steps_per_call) * (a.steps * (a.repeats + 2) + 4)
  max_ctx += (-max_ctx) % cfg.index_kpool
  t = time.time()
  model = random_model(cfg, dtype=jnp.bfloat16, fp8=cfg.fp8_block is not None, mesh=make_mesh(a.tp))
  jax.block_until_ready(jax.tree.leaves(model.params))
  nbytes = sum(x.nbytes for x in jax.tree.leaves(model.params))
  print(f"# {a.geometry} ({cfg.num_hidden_layers} layers, TP{a.tp}): {nbytes / 1e9:.2f} GB of random parameters in "
        f"{time.time() - t:.1f} s on "
        f"{jax.devices()[0].device_kind}; context {a.context}", flush=True)
  rows = []
  hdr = f"{'backend':>34} {'B':>3} {'q':>2} {'compile s':>9} {'ms/step':>9} {'tok/s/seq':>9} {'roofline ms':>11} {'% roof':>7}"
  print(hdr, flush=True)
  configs = [(q, backend, tune, b, ne, pk, spc, pol) for q in a.q for backend in a.backend for tune in tunings
             for b in a.batch for ne in a.executables for pk in a.pack_params for spc in a.steps_per_call
             for pol in policies]
  # auto ignores the kernel switches: its configurations that differ only in them are one configuration
  configs = list(dict.fromkeys(
      (q, be, *rest, pol if be != "auto" else tuple((k, v) for k, v in pol if k not in KERNEL_DEFAULTS))
      for q, be, *rest, pol in configs))

  def build(q, backend, tune, b, ne, pk, spc, policy):
    """A configuration's decoder and label, not compiled yet."""
    opts = ({"xla_gpu_autotune_level": 0} if tune == "off" else {}) | extra_opts
    label = backend + (" (no autotune)" if tune == "off" else "") + (" +xla opts" if extra_opts else "") + (" ×2 exec" if ne > 1 else "") + (" packed" if pk else "") + (f" {spc} steps/call" + (" unrolled" if a.unroll_steps else "") if spc > 1 else "") + (" " + json.dumps(dict(policy)) if len(policies) > 1 else "")
    dec = Decoder(model, DecodeConfig(max_context=max_ctx, q=q, capture_sizes=(b,), policy=policy),
                  backend=backend, compiler_options=opts, executables=ne, pack_params=pk, steps_per_call=spc,
                  unroll_steps=a.unroll_steps)
    return dict(q=q, backend=backend, b=b, ne=ne, pk=pk, spc=spc, policy=policy, label=label, dec=dec)

  def should_start(c, tail_s=0.0):
    """Within the budget? ``tail_s``: what a started configuration still costs after this check (its compile,
    when compiles run behind the lowerings: the budget must cover the last one)."""
    if time.time() - t_start + tail_s > a.budget_s:
      print(f"# budget reached: skipping {c['label']} B={c['b']} q={c['q']}", flush=True)
      return False
    return True

  def prepare(conf):
    """Build, compile and warm one configuration -> its context dict (None: skipped or failed to compile;
    FATAL: a run-time failure, after which nothing can run)."""
    c = build(*conf)
    if not should_start(c):
      return None
    return ready(c, warmup_all([c["dec"]], strict=False)[0])

  def ready(c, comp):
    """The rest of a configuration's preparation once warmup_all compiled it (``comp``: its Compiled): the
    program's census, a random state, the untimed first calls."""
    dec, b, q, label = c["dec"], c["b"], c["q"], c["label"]
    if comp.error is not None:  # report and go on: one backend failing must not hide the others' numbers
      print(f"{label:>34} {b:>3} {q:>2} compile failed: {type(comp.error).__name__}: {str(comp.error)[:300]}",
            flush=True)
      return None
    comp_s = comp.lower_s + comp.compile_s
    t_ready = time.time()
    backend, ne, pk, spc, policy = c["backend"], c["ne"], c["pk"], c["spc"], c["policy"]
    hlo = dec._aot[b].as_text()
    name = None
    if a.hlo_dir:
      import gzip  # noqa: PLC0415
      os.makedirs(a.hlo_dir, exist_ok=True)
      name = f"step_{a.geometry}_{backend}_b{b}_q{q}" + (f"_pack{pk}" if pk else "") + (f"_spc{spc}" if spc > 1 else "") + (
          "_" + "_".join(f"{k}-{v}" for k, v in policy) if policy else "")
      with gzip.open(os.path.join(a.hlo_dir, name + ".hlo.gz"), "wt") as fh:
        fh.write(hlo)
      with open(os.path.join(a.hlo_dir, name + ".kernels.tsv"), "w") as fh:  # (small: comes back from a device)
        fh.write(profiling.kernel_listing(hlo))
    cen = profiling.census(hlo)
    # the step's longest kernel chain: the launches that pay the graph's dependent-launch gap in series (#14)
    crit = profiling.critical_paths(hlo)[0]
    cen["critical"] = {k: crit[k] for k in ("computation", "kernels", "launches", "by_component")}
    if name:
      with open(os.path.join(a.hlo_dir, name + ".critical.tsv"), "w") as fh:
        fh.write("".join(f"{n}\t{c}\n" for n, c in crit["path"]))
    sites = dec.kernel_sites(b)
    if sites:
      print("# kernel sites: " + ", ".join(f"{k} {v['sites']}" + (f" (not at {sum(v['not_used'].values())}: "
                                           f"{'; '.join(v['not_used'])})" if v["not_used"] else "")
                                           for k, v in sorted(sites.items())), flush=True)
    print(f"# {label} B={b} q={q}: {cen['kernels']} kernel-level instructions {cen['by_kind']}, "
          f"{cen['while_loops']} loops" + (f" ({cen['outside_loops']} of them outside: once per call)"
                                            if "outside_loops" in cen else "")
          + f"; by component {cen['by_component']}", flush=True)
    print(f"# critical path: {crit['launches']} of the {crit['kernels']} kernels of {crit['computation']} in one "
          f"dependence chain; by component {crit['by_component']}", flush=True)
    t_census = time.time() - t_ready
    t = time.time()
    state = random_state(dec, b, a.context)
    t_state = time.time() - t
    t = time.time()
    try:
      state, out = decode(state)  # first call: one-off work (Mosaic GPU compiles its kernels here) outside the timing
      jax.block_until_ready(out.tokens)
      first = time.time() - t
      for _ in range(2 * ne - 1):  # each executable's first run goes op by op, its second records the CUDA graph
        state, out = decode(state)
      jax.block_until_ready(out.tokens)
      # where a configuration's preparation goes (s55b: ~45 s a configuration outside the compile, before the
      # random state's generators were shared)
      print(f"# first call {first:.1f} s; prepared in: lowering {comp.lower_s:.1f} s, XLA compile "
            f"{comp.compile_s:.1f} s, census {t_census:.1f} s, random state {t_state:.1f} s", flush=True)
    except Exception as e:  # a device fault poisons the CUDA context: nothing after it can run
      print(f"{label:>34} {b:>3} {q:>2} FAILED at run time: {type(e).__name__}: {str(e)[:400]}", flush=True)
      return FATAL
    return c | dict(state=state, out=out, comp=comp_s, hlo=hlo, name=name, cen=cen, sites=sites, first=first,
                    times=[], host=[])

  def time_once(c):
    """One timed repeat of ~--steps chained speculative steps (with steps_per_call > 1 each call is several
    steps: the times are per step)."""
    dec, spc = c["dec"], c["spc"]
    calls = _calls(dec, a.steps)
    state = _room(dec, c["state"], a.steps, a.context)
    t = time.perf_counter()
    for _ in range(calls):
      state, out = decode(state)
    c["host"].append((time.perf_counter() - t) / (calls * spc))  # the calls returned: the host's share of the step
    jax.block_until_ready(out.tokens)
    c["times"].append((time.perf_counter() - t) / (calls * spc))
    c["state"], c["out"], c["calls"] = state, out, calls

  def finish(c):
    """The idle call, trace / profile, the floors and the result row of a timed configuration."""
    dec, spc, b, q, backend, state = c["dec"], c["spc"], c["b"], c["q"], c["backend"], c["state"]
    ms = 1e3 * float(np.median(c["times"]))
    host_ms = 1e3 * float(np.median(c["host"]))
    # one call onto an idle GPU: the host's own cost of a call (argument handling, command-buffer checks, the
    # graph launch), apart from any wait behind the previous step that the chained calls above may include
    state = _room(dec, state, 5, a.context)
    idle = []
    for _ in range(5):
      jax.block_until_ready(state.io)
      t = time.perf_counter()
      state, out = decode(state)
      idle.append((time.perf_counter() - t) / spc)
    jax.block_until_ready(out.tokens)
    idle_ms = 1e3 * float(np.median(idle))
    print(f"# {c['label']} B={b} q={q} host: the {c['calls']} calls return after {host_ms:.2f} ms/step of "
          f"{ms:.2f} ms/step ({'host-bound' if host_ms > 0.9 * ms else 'the GPU is behind'}); one call onto an "
          f"idle GPU returns after {idle_ms:.2f} ms; repeats (ms/step) "
          f"{', '.join(f'{1e3 * t:.2f}' for t in c['times'])}", flush=True)
    trace = None
    name = c["name"]
    if a.trace:
      trace, state = _trace(dec, state, a.steps, a.context, c["hlo"],
                            events_path=os.path.join(a.hlo_dir, name + ".events.tsv.gz") if name else None)
    prof = _profile(dec, state, c["hlo"], a.steps, a.context, wall_ms=ms,
                    kernels_path=os.path.join(a.hlo_dir, name + ".kernels.json") if name else None) if a.profile else None
    state = prof.pop("state") if prof else state
    # per-component floor (bytes each component must move ÷ 4.3 TB/s) next to its measured GPU time (issue #9)
    floors = profiling.floor_bytes(cfg, model.params, batch=b, q=q, context=a.context, tp=a.tp)
    if prof:
      prof["floor_us"] = {k: f / profiling.HBM_BYTES_PER_S * 1e6 for k, f in floors.items()}
      print("#   component  floor µs  GPU µs  ×floor:  " + "   ".join(
          f"{k} {f:.0f} / {m:.0f} ({x:.1f}×)" for k, f, m, x in profiling.gap_table(floors, prof["us_per_step"])
          if f), flush=True)
    # the roofline formula is one TP4 rank of the real model: meaningless for the tiny geometries
    full = a.geometry == "tp4-rank" and not a.layers
    roof = 1e3 * roofline_bytes(b, q, a.context) / HBM if full else float("nan")
    tps = (a.accept if q > 1 else 1.0) / (ms / 1e3)
    row = dict(geometry=a.geometry, layers=cfg.num_hidden_layers, tp=a.tp, backend=backend,
               policy=dict(c["policy"]), executables=c["ne"], pack_params=c["pk"], steps_per_call=spc,
               unroll_steps=a.unroll_steps and spc > 1, interleaved=a.interleave,
               compiler_options=dec.compiler_options, xla_flags=os.environ.get("XLA_FLAGS", ""),
               nccl_proto=os.environ.get("NCCL_PROTO", ""), batch=b, q=q, context=a.context, compile_s=c["comp"],
               ms_per_step=ms, ms_repeats=[1e3 * t for t in c["times"]], tokens_per_s_per_seq=tps,
               accept_assumed=a.accept if q > 1 else 1.0,
               roofline_ms=roof, pct_roofline=100 * roof / ms, device=jax.devices()[0].device_kind,
               census=c["cen"], profile=prof, trace=trace, host_ms_per_step=host_ms, host_idle_call_ms=idle_ms,
               first_call_s=c["first"], kernel_sites=c["sites"],
               date=time.strftime("%Y-%m-%d"),
               run=time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t_start)))  # (the rows of one invocation)
    rows.append(row)
    print(f"{c['label']:>34} {b:>3} {q:>2} {c['comp']:>9.1f} {ms:>9.2f} {tps:>9.1f} {roof:>11.3f} "
          f"{row['pct_roofline']:>6.1f}%", flush=True)
    if a.out:
      with open(a.out, "a") as f:
        f.write(json.dumps(row) + "\n")

  if a.interleave:
    # every configuration built and warm first, then their timed repeats taken in turn: a drift of the host's
    # speed (measured session 28: the same program 4.5 -> 7.6 ms per step between machines, one idle call 5.2 to
    # 9.4 ms between runs) then lands on all of them alike
    # compiled behind one another's lowerings with --compile-workers > 1 (warmup_all); timed only once all are
    # built, so that no compile thread competes with a timed step's host work
    built = [build(*conf) for conf in configs]
    by_dec = {id(c["dec"]): c for c in built}
    ctxs, fatal = [], []

    def on_ready(comp):
      if fatal:  # a device fault: nothing after it can run (its compile finishes, unused)
        return
      c = ready(by_dec[id(comp.decoder)], comp)
      if c is FATAL:
        fatal.append(c)
      elif c is not None:
        ctxs.append(c)

    tail = a.compile_tail_s if a.compile_workers > 1 else 0.0
    warmup_all([c["dec"] for c in built], workers=a.compile_workers, strict=False, on_ready=on_ready,
               should_start=lambda d, b: not fatal and should_start(by_dec[id(d)], tail))
    if fatal:
      return rows
    for _ in range(a.repeats):
      for c in ctxs:
        time_once(c)
    for c in ctxs:
      finish(c)
    return rows
  # q outermost: the backends' numbers for one q come together when the budget cuts the run short
  for conf in configs:
    c = prepare(conf)
    if c is FATAL:
      return rows
    if c is None:
      continue
    for _ in range(a.repeats):
      time_once(c)
    finish(c)
    del c
  return rows


def _calls(dec, steps):
  """Calls that run about ``steps`` speculative steps (each call runs dec.steps_per_call of them)."""
  return max(1, steps // dec.steps_per_call)


def _room(dec, state, steps, context):
  """``state``, or where its cache cannot take ``steps`` more steps (not with main()'s sizing) a fresh one after
  one untimed step: a step on new buffers re-records XLA's command buffers and must not be measured."""
  if state.len_bound + dec.config.q * dec.steps_per_call * (_calls(dec, steps) + 1) > dec.config.max_context:
    state, out = decode(random_state(dec, state.batch, context))
    jax.block_until_ready(out.tokens)
  return state


def _trace(dec, state, steps, context, hlo=None, events_path=None):
  """jax.profiler trace of ``steps`` chained steps -> (profiling.trace_summary, state); with ``events_path`` the
  GPU's events (name, start ns, end ns, stream) go there as gzipped TSV, for reading against the saved HLO."""
  import glob  # noqa: PLC0415
  import tempfile  # noqa: PLC0415
  state = _room(dec, state, steps, context)
  d = tempfile.mkdtemp(prefix="glm5_trace_")
  opts = jax.profiler.ProfileOptions()
  opts.python_tracer_level = 0  # a traced Python call costs µs: it would inflate the host time being measured
  jax.profiler.start_trace(d, profiler_options=opts)
  for _ in range(_calls(dec, steps)):
    state, out = decode(state)
  jax.block_until_ready(out.tokens)
  jax.profiler.stop_trace()
  f = sorted(glob.glob(f"{d}/**/*.xplane.pb", recursive=True))[-1]
  if events_path:
    import gzip  # noqa: PLC0415
    from jax._src.lib import _profile_data  # noqa: PLC0415
    with gzip.open(events_path, "wt") as fh:
      fh.writelines(f"{n}\t{s}\t{e}\t{ln}\n" for n, s, e, ln in
                    profiling.device_events(_profile_data.ProfileData.from_file(f)))
  s = profiling.trace_summary(f, _calls(dec, steps) * dec.steps_per_call,
                              kmap=profiling.kernel_map(hlo) if hlo else None, hlo_text=hlo)
  if "span_ms" in s:
    print(f"#   trace: device span {s['span_ms']:.3f} ms/step, busy {s['busy_ms']:.3f}, idle {s['idle_ms']:.3f} in "
          f"{s['gaps_per_step']:.0f} gaps/step {s['gap_hist_per_step']}; largest gaps (µs) "
          f"{[round(g) for g in s['largest_gaps_us']]}", flush=True)
    if "wall_us_per_step" in s:  # concurrent kernels share the time they overlap: what each costs the wall
      print("#   trace, busy time by component (µs/step, overlaps shared): " + "  ".join(
          f"{k} {v:.0f}" for k, v in s["wall_us_per_step"].items()), flush=True)
      print("#   trace, kernels with the largest shares (µs/step): " + ", ".join(
          f"{k} {v:.0f}" for k, v in list(s["wall_top_us"].items())[:12]), flush=True)
    if (t := s.get("timeline")) and "error" not in t:  # the measured critical path of the last step
      print(f"#   trace, measured critical path of the last step: {t['span_us']:.0f} µs in {t['launches']} kernels "
            f"({t['matched']} matched, {t['unmatched']} kernel names not); kernel / wait µs by component: "
            + "  ".join(f"{k} {v['kernel_us']:.0f}/{v['wait_us']:.0f}" for k, v in t["by_component"].items())
            + f"; longest waits {t['longest_waits']}", flush=True)
      print("#   trace, what ran during the longest waits (waiting kernel: wait µs <- [running kernel, component, "
            "overlap µs]): " + "; ".join(f"{n} ({c}) {w}: {occ}" for n, c, w, occ in t["wait_occupants"][:8]),
            flush=True)
    elif t:
      print(f"#   trace, measured critical path: {t['error']}", flush=True)
  else:
    print(f"#   trace: no device events in {f}", flush=True)
  print("#   trace, host self time (ms/step, calls/step): " + "; ".join(
      f"{k} {v[0]:.3f} ({v[1]:.0f})" for k, v in s["host_top"].items()), flush=True)
  return s, state


def _profile(dec, state, hlo, steps, context, kernels_path=None, wall_ms=None):
  """GPU µs per step by component from CUPTI's kernel records over ``steps`` chained steps; with
  ``kernels_path``, every kernel's [µs/step, launches/step, component] is written there (for reading the
  profile against the saved HLO offline)."""
  from benchmarks._timing import _EXT  # noqa: PLC0415
  if _EXT is None:
    print("# --profile: CUPTI is not available here (needs the Mosaic GPU extension on a GPU)", flush=True)
    return None
  kmap = profiling.kernel_map(hlo)
  state = _room(dec, state, steps, context)
  _EXT._cupti_init()
  for _ in range(_calls(dec, steps)):
    state, out = decode(state)
  jax.block_until_ready(out.tokens)
  recs = _EXT._cupti_get_timings(True)
  steps = _calls(dec, steps) * dec.steps_per_call  # (per speculative step below)
  per, launches, unmatched = profiling.split(recs, kmap, steps)
  total = sum(per.values())
  static = profiling.census(hlo)["kernels"]  # (the program's kernel instructions: a step's, loop bodies once)
  print(f"#   GPU busy {total / 1e3:.3f} ms/step in {launches:.0f} kernel launches/step (CUPTI records "
        f"{launches / static:.0%} of the program's {static}); by component (µs/step):", flush=True)
  print("#   " + "  ".join(f"{c} {per[c]:.0f}" for c in profiling.COMPONENTS if per.get(c)), flush=True)
  by_name = collections.defaultdict(lambda: [0.0, 0])
  for name, ms in recs:
    by_name[name][0] += ms * 1e3 / steps
    by_name[name][1] += 1
  heavy = sorted(by_name.items(), key=lambda kv: -kv[1][0])
  # the longest chain by GPU time: each kernel instruction weighs its kernel's mean µs per launch (a Mosaic kernel
  # serving several sites: their mean) — with the chain's launches, what the step's wall time is made of
  per_launch = {k: v[0] / (v[1] / steps) for k, v in by_name.items()}
  ikern = profiling.instruction_kernels(hlo, known=set(by_name))  # (fusions sharing one kernel: its name)
  weights = {i: per_launch.get(k, 0.0) for i, k in ikern.items()}
  crit = profiling.critical_paths(hlo, weights=weights)[0]
  print(f"#   critical path by GPU time: {crit['critical']:.0f} µs in {crit['launches']} launches per step; "
        f"by component (launches) {crit['by_component']}", flush=True)
  chain_us = collections.Counter()
  for n, c in crit["path"]:
    chain_us[c] += weights.get(n, 0.0)
  print("#   the chain's kernel time by component (µs): " + "  ".join(f"{c} {u:.0f}" for c, u in chain_us.most_common()),
        flush=True)
  gap = None
  if wall_ms and crit["launches"]:  # what the chain's kernels leave of the step: the launches' gaps between them
    gap = (1e3 * wall_ms - crit["critical"]) / crit["launches"]
    print(f"#   the step's {1e3 * wall_ms:.0f} µs less the chain's kernels: {gap:.2f} µs per launch on the chain "
          "(the gap between dependent launches, if the chain is what the step waits for)", flush=True)
  if kernels_path:
    with open(kernels_path, "w") as f:
      json.dump({k: [v[0], v[1] / steps, profiling.classify_kernel(k, kmap)] for k, v in heavy}, f, indent=0)
    # the chain by GPU time, launch by launch (instruction, component, kernel, µs): small, comes back from a device
    with open(kernels_path.replace(".kernels.json", ".critical_gpu.tsv"), "w") as f:
      f.write("".join(f"{n}\t{c}\t{ikern.get(n)}\t{weights.get(n, 0.0):.2f}\n" for n, c in crit["path"]))
  heavy = heavy[:12]
  print("#   heaviest kernels (µs/step, launches/step): " + ", ".join(
      f"{k[:48]} {v[0]:.0f} ({v[1] / steps:.0f})" for k, v in heavy), flush=True)
  top = sorted(unmatched.items(), key=lambda kv: -kv[1])[:8]
  if top:
    print("#   unmatched kernels: " + ", ".join(f"{k[:60]} {v:.0f}" for k, v in top), flush=True)
  return dict(state=state, us_per_step=per, launches_per_step=launches, program_kernels=static,
              gpu_busy_ms=total / 1e3,
              critical_us=crit["critical"], critical_launches=crit["launches"], gap_us_per_chain_launch=gap,
              critical_us_by_component=dict(chain_us),
              unmatched_top=dict(top), heaviest={k: v[0] for k, v in heavy})


if __name__ == "__main__":
  main()
