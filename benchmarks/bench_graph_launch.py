"""Why a large decode step is host-bound on the GPU: launching one XLA program of K small kernels, chained.

  python benchmarks/bench_graph_launch.py                 # K = 1200 steps (~2,400 kernels), A = 8 arguments
  XLA_FLAGS=--xla_gpu_enable_command_buffer= python benchmarks/bench_graph_launch.py   # without CUDA graphs

The one-rank decode step (BENCHMARKS.md, 2026-11-30) is ~2,400 small kernels with 1,855 arguments, its state
donated. XLA runs it as one CUDA graph; a trace showed `cuGraphLaunch` taking about a step's GPU time of host time
per step, and wall time = GPU time + ~3.5 ms. This script isolates that on a synthetic program with the same
shape — K dependent steps of small kernels (a reduction and an update, separated by optimisation barriers), a donated state
that keeps its address, A small read-only arguments — and times, over chained calls:
  wall ms/call, host ms/call (when the calls returned), GPU busy ms/call (CUPTI);
for the variants: one executable; two identical executables called alternately (deserialised copies: each has
its own CUDA graph, so a launch never waits on its own previous launch); the arguments pre-flattened and passed
to the loaded executable directly (no pytree / per-argument checks in Python).
If alternating executables brings wall time down to GPU time, the decode step should do the same.

`--mosaic-every N` makes every N-th step a small Pallas Mosaic GPU kernel (TMA in, scale, TMA out) instead of the
XLA reduction: the real step has 374 Mosaic GPU calls, which XLA records into its CUDA graph by stream capture.
The session-19 run found one executable of 2,401 XLA kernels launching with wall = GPU time (0.5 ms of host time),
while the real step's launch blocks; this isolates whether the Mosaic custom calls make the difference.
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
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental import serialize_executable  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402

from benchmarks._timing import _EXT  # noqa: E402
from glm5_jax import profiling  # noqa: E402


def mosaic_scale(x, c: float):
  """x * 0.999 + c in a Pallas Mosaic GPU kernel (one CTA per 128 columns: TMA load, scale, TMA store)."""
  R, W = x.shape

  def body(x_g, o_g, s, bar):
    j = lax.axis_index("g") * 128
    plgpu.copy_gmem_to_smem(x_g.at[:, pl.ds(j, 128)], s, bar)
    plgpu.barrier_wait(bar)
    s[...] = s[...] * 0.999 + c
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(s, o_g.at[:, pl.ds(j, 128)])
    plgpu.wait_smem_to_gmem(0)

  return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((R, W), x.dtype),
                      scratch_types=[plgpu.SMEM((R, 128), x.dtype), plgpu.Barrier(num_arrivals=1)],
                      grid=(W // 128,), grid_names=("g",), kernel_name="launch_probe")(x)


def build(K: int, A: int, width: int, mosaic_every: int = 0):
  """A jitted program: state [64, width] f32 (donated) through K reduce+update kernels (every ``mosaic_every``-th
  one a Mosaic GPU kernel instead); A small parameters [128] f32 each read once (their sum scales the update), so
  every argument is live."""

  def step(params, state):
    s = jnp.sum(jnp.stack([p[0] for p in params])) * 1e-9  # every argument read, in a kernel or two
    x = state
    for i in range(K):
      if mosaic_every and i % mosaic_every == mosaic_every - 1:
        x = mosaic_scale(x, 1e-3 * (i % 7))
        continue
      r = jnp.sum(x, axis=1, keepdims=True)  # a reduction: its own kernel
      x = jax.lax.optimization_barrier(x * 0.999 + r * (1e-6 + s) + 1e-3 * i)
    return x

  return jax.jit(step, donate_argnums=1)


def run(fns, params, state, calls: int, direct: bool):
  """Chained calls alternating over ``fns``; returns (wall ms, host ms) per call and the final state."""
  flat = jax.tree.leaves(params)
  t = time.perf_counter()
  for i in range(calls):
    f = fns[i % len(fns)]
    if direct:
      state = f(flat, state)
    else:
      state = f(params, state)
  host = (time.perf_counter() - t) / calls
  jax.block_until_ready(state)
  wall = (time.perf_counter() - t) / calls
  return 1e3 * wall, 1e3 * host, state


def gpu_busy(fns, params, state, calls, direct):
  if _EXT is None:
    return float("nan"), state
  _EXT._cupti_init()
  _, _, state = run(fns, params, state, calls, direct)
  recs = _EXT._cupti_get_timings(True)
  return sum(ms for _, ms in recs) / calls, state


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--kernels", type=int, nargs="+", default=[1200], help="steps K (~2 kernels each)")
  p.add_argument("--args", type=int, nargs="+", default=[8],
                 help="small read-only arguments (the real step has 1,855; XLA compiles 1,855 here slowly: minutes)")
  p.add_argument("--width", type=int, default=4096, help="state columns (kernel size: 64 x width f32)")
  p.add_argument("--calls", type=int, default=30)
  p.add_argument("--out", default=None, help="append one JSON line per row here (benchmarks/results/graph_launch_*)")
  p.add_argument("--mosaic-every", type=int, nargs="+", default=[0],
                 help="every N-th step a Mosaic GPU kernel (0: none; the real step: ~1 in 7)")
  a = p.parse_args(argv)
  if a.width % 128:
    raise SystemExit(f"--width {a.width}: expected a multiple of 128 (the Mosaic probe kernel's column tile)")
  run_id = f"{os.uname().nodename}-{os.getpid()}-{int(time.time())}"  # rows of one process compare (--out)
  dev = jax.devices()[0]
  print(f"# {dev.device_kind}, jax {jax.__version__}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
  print(f"{'K':>5} {'A':>5} {'mosaic':>6} {'kernels':>7} {'variant':>24} {'compile s':>9} {'wall ms':>8} {'host ms':>8} "
        f"{'GPU ms':>8} {'wall-GPU us/kernel':>18}")
  rng = np.random.default_rng()
  for K, A, me in [(K, A, me) for K in a.kernels for A in a.args for me in a.mosaic_every]:
    params = [jnp.asarray(rng.standard_normal(128), jnp.float32) for _ in range(A)]
    t = time.time()
    c1 = build(K, A, a.width, me).trace(params, jax.ShapeDtypeStruct((64, a.width), jnp.float32)).lower().compile()
    comp = time.time() - t
    nk = profiling.census(c1.as_text())["kernels"]  # kernel-level instructions of the compiled program
    c2 = serialize_executable.deserialize_and_load(*serialize_executable.serialize(c1))
    # direct: the loaded executable on flat buffers (what Compiled.__call__ does after flattening + checks)
    ex1 = c1._executable.xla_executable
    ex2 = c2._executable.xla_executable
    d1 = lambda flat, s, ex=ex1: ex.execute_sharded([*flat, s]).consume_with_handlers(  # noqa: E731
        [lambda bufs: bufs[0]])[0]
    d2 = lambda flat, s, ex=ex2: ex.execute_sharded([*flat, s]).consume_with_handlers(  # noqa: E731
        [lambda bufs: bufs[0]])[0]
    variants = [("one executable", [c1], False), ("two, alternating", [c1, c2], False),
                ("one, direct call", [d1], True), ("two, alternating, direct", [d1, d2], True)]
    state = jnp.asarray(rng.standard_normal((64, a.width)), jnp.float32)
    for name, fns, direct in variants:
      try:
        for f in fns:  # warm-up: the first run of each executable records its CUDA graph
          state = f(jax.tree.leaves(params) if direct else params, state)
        jax.block_until_ready(state)
        _, _, state = run(fns, params, state, 3, direct)
        walls, hosts = [], []
        for _ in range(3):
          w, h, state = run(fns, params, state, a.calls, direct)
          walls.append(w)
          hosts.append(h)
        g, state = gpu_busy(fns, params, state, a.calls, direct)
      except Exception as e:  # noqa: BLE001 (a variant the runtime refuses: report and go on)
        print(f"{K:>5} {A:>5} {me:>6} {nk:>7} {name:>24} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        state = jnp.asarray(rng.standard_normal((64, a.width)), jnp.float32)
        continue
      w, h = float(np.median(walls)), float(np.median(hosts))
      print(f"{K:>5} {A:>5} {me:>6} {nk:>7} {name:>24} {comp:>9.1f} {w:>8.3f} {h:>8.3f} {g:>8.3f} "
            f"{1e3 * (w - g) / nk:>18.2f}",
            flush=True)
      if a.out:
        with open(a.out, "a") as fh:
          fh.write(json.dumps(dict(call=run_id, xla_flags=os.environ.get("XLA_FLAGS", ""), steps=K, args=A,
                                   mosaic_every=me, kernels=nk, variant=name, compile_s=comp, wall_ms=w, host_ms=h,
                                   gpu_ms=g, device=dev.device_kind, date=time.strftime("%Y-%m-%d"))) + "\n")


if __name__ == "__main__":
  main()
