"""The decode step compiled for an H200 on a machine without a GPU: its kernel census and critical path (issue #14).

XLA compiles for a GPU it does not have through the CUDA PJRT plugin's compile-only topology, described by a
GpuTargetConfigProto (``benchmarks/targets/h200.txtpb``); the Mosaic GPU kernels are lowered for CUDA as on the
device, the step is built as ``bench_decode.py`` builds it (packed parameters, N steps per call, no autotuning)
from abstract weights — nothing is allocated. What the device's own compile reports as "kernel-level
instructions" and the critical path comes out here in ~30 s a configuration on a laptop-class CPU: session 56
checked it against the H200, whose compile of session 55's previous defaults (q = 1, 4 steps per call, s55b) was
899 kernels (749 fusions, 145 custom calls, 5 other), 572 of 887 on the critical path — the same numbers here.

Setup, once (~140 MB, no NVIDIA libraries needed; the directory is git-ignored):

  pip install --no-deps --target .cuda_plugin jax-cuda13-pjrt==0.11.2 jax-cuda13-plugin==0.11.2

Usage (several policies compare in one table; --listing-dir keeps each one's kernel listing and critical path):

  python benchmarks/step_census.py [--geometry tp4-rank] [--q 1 4] --policy '{}' '{"mla_latent_norms": true}'

--diff lists each configuration's kernels that differ from the first one's (how session 56 found dq_f16's 67
conversion kernels: "+42 moe f16[1,4096] .../jit(fp8_moe)/convert_element_type" ...).

--prefill 256 1024: the prefill's target chunk program instead (T tokens a chunk, the GPU's prefill kernels), with
the kernels a call launches — loop trips included: session 63 found a 256-token chunk launching 6,661 kernels, of
which 3,536 in the chunked KDA's scans (8 trips of 13 kernels per KDA layer), 3,972 after its rewrite.

--target benchmarks/targets/b200.txtpb compiles the step for a Blackwell B200 (sm_100a; ptxas runs here too): how
session 57 found that every kernel with a wgmma fails there (glm5_jax.layers.WGMMA_KNOBS, declined on such GPUs
since). A compile error is printed as Mosaic / ptxas report it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PLUGIN_DIR = os.path.join(ROOT, ".cuda_plugin")
TARGET = os.path.join(ROOT, "benchmarks", "targets", "h200.txtpb")
PLUGIN_SETUP = "pip install --no-deps --target .cuda_plugin jax-cuda13-pjrt==0.11.2 jax-cuda13-plugin==0.11.2"


def compile_only_devices(target: str = TARGET, plugin_dir: str | None = PLUGIN_DIR):
  """The devices of a one-GPU compile-only topology described by the GpuTargetConfigProto text file ``target``.
  The CUDA PJRT plugin must be importable (from ``plugin_dir``, put first on sys.path) before jax looks for
  plugins: call this before anything initialises a jax backend (jax itself stays on the CPU)."""
  if plugin_dir:
    sys.path.insert(0, plugin_dir)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # (the plugin only compiles here: no CUDA backend to start)
  import importlib.util  # noqa: PLC0415
  if importlib.util.find_spec("jax_plugins.xla_cuda13") is None:
    raise SystemExit(f"step_census: the CUDA PJRT plugin (jax_plugins.xla_cuda13) is not importable"
                     f"{f' from {plugin_dir}' if plugin_dir else ''}; install it once with: {PLUGIN_SETUP}")
  from jax.experimental import topologies  # noqa: PLC0415
  with open(target) as f:
    text = f.read()
  _mosaic_arch(text)
  return topologies.get_topology_desc("", platform="cuda", topology="1x1x1", target_config=text).devices


def _mosaic_arch(target_text: str):
  """Mosaic GPU's layout inference for the target's compute capability. It asks the default device (here the
  CPU, which has none) and then assumes sm_90 — which cannot place a Blackwell kernel's tensor-memory layouts
  (the tcgen05 forms: "Failed to infer a possible set of layouts"). The kernels' code is generated for the
  target all the same; only this guess is replaced, for this process."""
  import re  # noqa: PLC0415
  m = re.search(r"cuda_compute_capability\s*\{\s*major:\s*(\d+)\s*minor:\s*(\d+)", target_text)
  if m is None:
    raise SystemExit("step_census: the target names no cuda_compute_capability { major: .. minor: .. }")
  arch = (int(m.group(1)), int(m.group(2)))
  from jax.experimental.mosaic.gpu import utils as mgpu_utils  # noqa: PLC0415
  mgpu_utils._infer_arch = lambda: arch


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--geometry", default="tp4-rank", choices=["tp4-rank", "kernel-tiny"])
  p.add_argument("--q", type=int, nargs="+", default=[1])
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--layers", type=int, default=None, help="keep the first N layers (tp4-rank; as bench_prefill's and "
                 "bench_decode's --layers: the program an H100 runs)")
  p.add_argument("--steps-per-call", type=int, default=4, help="as bench_decode --steps-per-call (the loop body is "
                 "counted once: a step's kernels)")
  p.add_argument("--backend", default="latency_specialized", choices=["latency_specialized", "auto"])
  p.add_argument("--policy", nargs="+", default=["{}"], help="decode policy knobs as JSON, one per configuration")
  p.add_argument("--max-context", type=int, default=32784)
  p.add_argument("--pack-params", type=int, default=None, help="Decoder(pack_params=N) (default: bench_decode's)")
  p.add_argument("--target", default=TARGET, help="GpuTargetConfigProto text file of the GPU to compile for")
  p.add_argument("--plugin-dir", default=PLUGIN_DIR, help="where the CUDA PJRT plugin is installed (see above)")
  p.add_argument("--workers", type=int, default=2, help="XLA compiles at once (the lowerings run one at a time)")
  p.add_argument("--listing-dir", default=None, help="write each configuration's kernels.tsv and critical.tsv here")
  p.add_argument("--hlo", action="store_true", help="with --listing-dir: also write each configuration's compiled "
                 "HLO there (.hlo.txt: what a fusion the listing names holds)")
  p.add_argument("--out", default=None, help="append one JSON line per configuration here")
  p.add_argument("--prefill", type=int, nargs="+", default=None, metavar="T",
                 help="instead of the decode step: the prefill's target chunk program of T tokens a chunk (each T; "
                 "Decoder.prefill's, with the GPU's prefill kernels — layers.PREFILL_KNOBS — on unless --policy says "
                 "otherwise); the table then also counts the kernels a call launches (loop trips included)")
  p.add_argument("--diff", action="store_true", help="after the table: each configuration's kernels that differ from "
                 "the first of its q (by component, result type and JAX op; + added, - gone)")
  a = p.parse_args(argv)
  policies = [tuple(sorted(json.loads(s).items())) for s in a.policy]
  devices = compile_only_devices(a.target, a.plugin_dir)

  import concurrent.futures as cf  # noqa: PLC0415

  from glm5_jax import config as C  # noqa: PLC0415
  from glm5_jax import param_packing as pp  # noqa: PLC0415
  from glm5_jax import profiling  # noqa: PLC0415
  from glm5_jax import sharding as shd  # noqa: PLC0415
  from glm5_jax.runtime import DecodeConfig  # noqa: PLC0415
  from glm5_jax.speculative import Decoder  # noqa: PLC0415
  from glm5_jax.synthetic import abstract_model, tp_rank_config  # noqa: PLC0415

  cfg = {"kernel-tiny": C.kernel_tiny, "tp4-rank": lambda: tp_rank_config(
      C.Glm5Config(num_hidden_layers=a.layers) if a.layers else C.real(), 4)}[a.geometry]()
  model, params = abstract_model(cfg, mesh=shd.make_mesh(1, devices=devices))
  pack = pp.DEFAULT_BYTES if a.pack_params is None else a.pack_params
  print(f"# {a.geometry}: compiled for {devices[0].device_kind} (compile-only, {os.path.relpath(a.target, ROOT)}); "
        f"B={a.batch}, {a.steps_per_call} steps per call, {a.backend}", flush=True)
  rows, jobs, listings = [], [], []
  with cf.ThreadPoolExecutor(max(1, a.workers)) as pool:
    for T in a.prefill or ():
      for pol in policies:
        dec = Decoder(model, DecodeConfig(max_context=a.max_context, q=a.q[0], capture_sizes=(a.batch,), policy=pol),
                      backend=a.backend, prefill_chunk=T, compiler_options={"xla_gpu_autotune_level": 0})
        t = time.perf_counter()
        low = _lower_prefill(dec, params, a.batch, T)
        jobs.append((f"prefill {T}", pol, dec, time.perf_counter() - t,
                     pool.submit(lambda low=low, o=dec.compiler_options: (time.perf_counter(), low.compile(o)))))
    for q in a.q if not a.prefill else ():
      for pol in policies:
        dec = Decoder(model, DecodeConfig(max_context=a.max_context, q=q, capture_sizes=(a.batch,), policy=pol),
                      backend=a.backend, steps_per_call=a.steps_per_call, pack_params=pack,
                      compiler_options={"xla_gpu_autotune_level": 0})  # (bench_decode --fast-compile)
        t = time.perf_counter()
        with dec.kernel_mode(interpret=False):
          low = dec.trace_step(a.batch, params, interpret=False).lower(lowering_platforms=("cuda",))
        jobs.append((q, pol, dec, time.perf_counter() - t,
                     pool.submit(lambda low=low, o=dec.compiler_options: (time.perf_counter(), low.compile(o)))))
    for q, pol, dec, lower_s, fut in jobs:
      t0, exe = fut.result()
      hlo = exe.as_text()
      cen = profiling.census(hlo)
      crit = profiling.critical_paths(hlo)[0]
      row = dict(geometry=a.geometry, backend=a.backend, batch=a.batch, q=q, steps_per_call=a.steps_per_call,
                 launches=profiling.launches(hlo), temp_gb=_temp_gb(exe),
                 policy=dict(pol), kernels=cen["kernels"], by_kind=cen["by_kind"], by_component=cen["by_component"],
                 outside_loops=cen.get("outside_loops"), critical_launches=crit["launches"],
                 critical_by_component=crit["by_component"],
                 kernel_sites=({} if a.prefill else {k: v["sites"] for k, v in dec.kernel_sites(a.batch).items()}),
                 lower_s=round(lower_s, 1),
                 compile_s=round(time.perf_counter() - t0, 1), target=os.path.basename(a.target),
                 compiler_options=dec.compiler_options, date=time.strftime("%Y-%m-%d"))
      rows.append(row)
      listings.append(profiling.kernel_listing(hlo))
      if a.listing_dir:
        os.makedirs(a.listing_dir, exist_ok=True)
        name = (f"{a.geometry}_{q.replace(' ', '')}" if a.prefill else f"{a.geometry}_q{q}_spc{a.steps_per_call}") \
            + "".join(f"_{k}-{v}" for k, v in pol)
        with open(os.path.join(a.listing_dir, name + ".kernels.tsv"), "w") as fh:
          fh.write(profiling.kernel_listing(hlo))
        with open(os.path.join(a.listing_dir, name + ".critical.tsv"), "w") as fh:
          fh.write("".join(f"{n}\t{c}\n" for n, c in crit["path"]))
        if a.hlo:
          with open(os.path.join(a.listing_dir, name + ".hlo.txt"), "w") as fh:
            fh.write(hlo)
      if a.out:
        with open(a.out, "a") as fh:
          fh.write(json.dumps(row) + "\n")
  print(table(rows))
  if a.diff:
    print(diff(rows, listings))
  return rows


def _temp_gb(exe) -> float | None:
  """XLA's scratch for one call of the compiled program (GB; its memory analysis, None where it has none): what a
  configuration needs beyond its parameters, caches and io — e.g. whether a prefill chunk size fits."""
  try:
    m = exe.memory_analysis()
  except Exception:  # noqa: BLE001 (a backend without the analysis)
    return None
  return None if m is None else round(m.temp_size_in_bytes / 1e9, 2)


def _lower_prefill(dec, params, B: int, T: int):
  """The prefill's target chunk program (``speculative._prefill_target_fn_build``) lowered for CUDA on abstract
  caches, under the kernels a GPU runs there (Decoder.prefill_kernel_mode(interpret=False): the GPU's defaults)."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  from jax.sharding import NamedSharding  # noqa: PLC0415

  from glm5_jax import state as st  # noqa: PLC0415
  from glm5_jax.layers import compile_target  # noqa: PLC0415
  from glm5_jax.speculative import REP, _prefill_target_fn_build  # noqa: PLC0415

  sd = lambda s, d: jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(dec.model.mesh, REP))
  with dec.prefill_kernel_mode(interpret=False), compile_target(dec.platform):
    return _prefill_target_fn_build(dec, B, T).trace(
        params, st.abstract_caches(dec.layout(B), dec.model.mesh), sd((B, T), jnp.int32), sd((B,), jnp.int32),
        sd((B,), jnp.int32)).lower(lowering_platforms=("cuda",))


def kernel_kinds(listing: str):
  """A kernel listing (profiling.kernel_listing) -> Counter of (component, result type, JAX op without the
  instruction's numbering): what stays the same kernel across two compiles of similar programs."""
  import collections  # noqa: PLC0415
  import re  # noqa: PLC0415
  out = collections.Counter()
  for line in listing.splitlines():
    f = line.split("\t")
    if len(f) >= 6:
      out[(f[3], f[4], re.sub(r"\.\d+", "", f[5])[-110:])] += 1
  return out


def diff(rows, listings) -> str:
  """Each configuration's kernel kinds against the first configuration of its q: '+n' added, '-n' gone."""
  out, first = [], {}
  for r, lst in zip(rows, listings):
    base = first.setdefault(r["q"], kernel_kinds(lst))
    got = kernel_kinds(lst)
    if got == base:
      continue
    out.append(f"# q = {r['q']} {json.dumps(r['policy'])} against the first configuration:")
    for k in sorted(set(base) | set(got), key=lambda k: (k[0], k[2])):
      d = got[k] - base[k]
      if d:
        out.append(f"  {d:+5d}  {k[0]:<8} {k[1][:60]:<60} {k[2]}")
  return "\n".join(out)


def table(rows) -> str:
  """Markdown: one configuration a row — kernels by kind, the critical path, the change against the first row of
  its q, kernels by component."""
  out = ["| q | policy | kernels | Δ | launches a call | scratch GB | fusion / custom-call / other | critical path | "
         "by component |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  first = {}
  for r in rows:
    base = first.setdefault(r["q"], r["kernels"])
    k = r["by_kind"]
    comps = ", ".join(f"{c} {n}" for c, n in sorted(r["by_component"].items(), key=lambda kv: -kv[1]))
    out.append(f"| {r['q']} | `{json.dumps(r['policy'])}` | {r['kernels']} | {r['kernels'] - base:+d} | "
               f"{r.get('launches')} | {r.get('temp_gb')} | "
               f"{k.get('fusion', 0)} / {k.get('custom-call', 0)} / "
               f"{r['kernels'] - k.get('fusion', 0) - k.get('custom-call', 0)} | {r['critical_launches']} | {comps} |")
  return "\n".join(out)


if __name__ == "__main__":
  main()
