"""All-reduce latency at decode message sizes, inside jit + shard_map, the way the decode step issues them.

  python benchmarks/bench_allreduce.py --tp 2 --rows 1 4 8 32 --variants default nccl-LL nccl-LL128 xla-one-shot

Each variant runs in a fresh process (NCCL and XLA read their settings at start-up). A program chains --chain
dependent all-reduces of a [rows, 4096] bf16 message (what one sublayer output is), each followed by the small
elementwise op a layer would apply; the same chain without the collective is timed too, and the difference per
link is the all-reduce's cost. Median of --repeats runs of --calls back-to-back calls; the host never blocks inside
a run. A decode step of one TP4 rank has 2 per layer × 45 + 1 (lm_head argmax gather) + ~3 per MTP pass.
NVLink multicast stays off (NCCL_NVLS_ENABLE=0 is forced): it can take the host's GPUs down.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

VARIANTS = {
    "default": {},
    "nccl-LL": {"NCCL_PROTO": "LL"},
    "nccl-LL128": {"NCCL_PROTO": "LL128"},
    "nccl-Simple": {"NCCL_PROTO": "Simple"},
    "nccl-LL-2ch": {"NCCL_PROTO": "LL", "NCCL_MAX_NCHANNELS": "2"},
    "xla-one-shot": {"XLA_FLAGS+": "--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=true"},
    "no-command-buffer": {"XLA_FLAGS+": "--xla_gpu_enable_command_buffer="},
    # collectives are not in XLA's default command-buffer types: each psum ends the step's CUDA graph
    "cb-collectives": {"XLA_FLAGS+": "--xla_gpu_enable_command_buffer=+COLLECTIVES"},
    "cb-collectives-LL": {"NCCL_PROTO": "LL", "XLA_FLAGS+": "--xla_gpu_enable_command_buffer=+COLLECTIVES"},
    "cb-coll-one-shot": {"XLA_FLAGS+": "--xla_gpu_enable_command_buffer=+COLLECTIVES "
                                      "--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=true"},
}


def child(a):
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  from jax.sharding import Mesh, PartitionSpec as P  # noqa: PLC0415

  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  import glm5_jax.sharding  # noqa: F401, PLC0415  (GSPMD switch: Shardy segfaults on shard_map at TP >= 2 in 0.11.2)

  devs = jax.devices()[:a.tp]
  if len(devs) < a.tp:
    raise SystemExit(f"--tp {a.tp} needs {a.tp} devices, found {len(jax.devices())}")
  mesh = Mesh(np.array(devs), ("tp",))

  def chain(with_ar):
    def body(x):
      for i in range(a.chain):
        x = x * jnp.bfloat16(0.5) + jnp.bfloat16(i % 7)  # the per-layer elementwise work between all-reduces
        if with_ar:
          x = jax.lax.psum(x, "tp")
      return x
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"), check_vma=False))

  out = []
  for rows in a.rows:
    x = jax.device_put(np.random.default_rng(rows).standard_normal((a.tp * rows, 4096)).astype(jnp.bfloat16),
                       jax.sharding.NamedSharding(mesh, P("tp")))
    res = {}
    for with_ar in (True, False):
      f = chain(with_ar)
      y = f(x)
      jax.block_until_ready(y)
      if with_ar:
        res["finite"] = bool(np.isfinite(np.asarray(y, np.float32)).all())
      ts = []
      for _ in range(a.repeats):
        t = time.perf_counter()
        for _ in range(a.calls):
          y = f(y)
        jax.block_until_ready(y)
        ts.append((time.perf_counter() - t) / a.calls)
      res["with" if with_ar else "without"] = float(np.median(ts))
    us = (res["with"] - res["without"]) / a.chain * 1e6
    row = dict(variant=a.child, tp=a.tp, rows=rows, kib=rows * 4096 * 2 / 1024, us_per_allreduce=us,
               us_per_link_with=res["with"] / a.chain * 1e6, us_per_link_without=res["without"] / a.chain * 1e6,
               finite=res["finite"], device=devs[0].device_kind, date=time.strftime("%Y-%m-%d"))
    out.append(row)
    print(json.dumps(row), flush=True)


def check_sum(a):
  """psum on the devices == the sum of the shards on the host (bf16 message, f32 compare)."""
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  from jax.sharding import Mesh, PartitionSpec as P  # noqa: PLC0415

  mesh = Mesh(np.array(jax.devices()[:a.tp]), ("tp",))
  x = np.random.default_rng(0).standard_normal((a.tp, 8, 4096)).astype(np.float32)
  f = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "tp"), mesh=mesh, in_specs=P("tp"), out_specs=P("tp"),
                            check_vma=False))
  y = np.asarray(f(jax.numpy.asarray(x.reshape(a.tp * 8, 4096), jax.numpy.bfloat16)), np.float32)
  want = x.astype(jax.numpy.bfloat16).astype(np.float32).sum(0)
  err = float(np.abs(y.reshape(a.tp, 8, 4096) - want[None]).max())
  print(json.dumps({"variant": a.child, "check_max_abs_err": err}), flush=True)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--tp", type=int, default=2)
  p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 32])
  p.add_argument("--chain", type=int, default=90, help="dependent all-reduces per program (a step has ~90)")
  p.add_argument("--calls", type=int, default=20)
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--variants", nargs="+", default=list(VARIANTS))
  p.add_argument("--out", default=None, help="append JSON lines here")
  p.add_argument("--timeout", type=float, default=120, help="seconds per variant")
  p.add_argument("--child", default=None, help=argparse.SUPPRESS)
  a = p.parse_args(argv)
  if a.child:
    check_sum(a)
    return child(a)
  rows = []
  print(f"{'variant':>18} {'rows':>4} {'KiB':>5} {'µs/AR':>7} {'µs/link':>8} {'µs/link w/o AR':>14}", flush=True)
  for v in a.variants:
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1")
    for k, val in VARIANTS[v].items():
      if k == "XLA_FLAGS+":
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + val).strip()
      else:
        env[k] = val
    cmd = [sys.executable, os.path.abspath(__file__), "--child", v, "--tp", str(a.tp), "--chain", str(a.chain),
           "--calls", str(a.calls), "--repeats", str(a.repeats), "--rows", *map(str, a.rows)]
    try:
      r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout)
    except subprocess.TimeoutExpired:
      print(f"{v:>18} timed out after {a.timeout:.0f} s (hang?)", flush=True)
      continue
    got = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    if r.returncode != 0 and not got:
      err = (r.stderr.strip().splitlines() or ["?"])[-1]
      print(f"{v:>18} failed (rc {r.returncode}): {err[:200]}", flush=True)
      continue
    for g in got:
      if "check_max_abs_err" in g:
        print(f"{v:>18} psum == host sum: max |err| {g['check_max_abs_err']:.3g}", flush=True)
        continue
      rows.append(g)
      print(f"{v:>18} {g['rows']:>4} {g['kib']:>5.0f} {g['us_per_allreduce']:>7.1f} {g['us_per_link_with']:>8.1f} "
            f"{g['us_per_link_without']:>14.1f}", flush=True)
      if a.out:
        with open(a.out, "a") as f:
          f.write(json.dumps(g) + "\n")
  return rows


if __name__ == "__main__":
  main()
