"""Times the KDA decode kernel (pallas_kernels/kda_decode.py) against its jitted jnp reference on one GPU.

Each timed program is one jit with N calls Python-unrolled and chained through the (donated) state; the figure
is the GPU time per call from CUPTI (the kernels' durations: the KDA kernel alone for the kernel rows, every
kernel for the XLA reference). Wall-clock time of such a program is dispatch-bound — session 25 measured an
empty kernel at 17.5 µs per call that way — so wall time is only the fallback where CUPTI is unavailable.
State traffic per call = B*H*D*D*4 bytes read (the start slot) + T times that written (one slot per token); at
B = 1 the 4 MB of slots can stay in L2 between chained calls (the decode step's profile is the in-situ number).

  PYTHONPATH=. python3 benchmarks/bench_kda_decode.py [--quick]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._timing import _EXT, MODE  # noqa: E402
from pallas_kernels import kda_decode as kd  # noqa: E402

HBM_TBPS = 4.3  # measured H200 copy bandwidth (shared/notes/gpu_probe.md)
D = 128


def make_inputs(B, T, H, Q, norm, seed=0):
  rng = np.random.default_rng(seed)
  n = lambda *s: rng.standard_normal(s).astype(np.float32)
  bf = lambda x: jnp.asarray(x, jnp.bfloat16)
  dt = np.exp(rng.uniform(np.log(1e-3), np.log(0.1), (H, D)))
  args = (bf(n(B, T, H, D)), bf(n(B, T, H, D)), bf(n(B, T, H, D)), bf(n(B, T, H, D)), bf(n(B, T, H)),
          jnp.asarray(0.5 * n(H)), jnp.asarray(dt + np.log(-np.expm1(-dt)), jnp.float32),
          jnp.asarray(n(B, Q, H, D, D)), jnp.asarray(rng.integers(1, Q + 1, (B,)), jnp.int32))
  kw = dict(gate=bf(n(B, T, H, D)), norm_weight=jnp.asarray(1 + 0.1 * n(D))) if norm else {}
  return args, kw


def make_conv_inputs(B, T, H, Q, norm, seed=0, Kc=4):
  """kda_decode_conv's inputs (the conv-variant rows): q, k, v replaced by the raw qkv rows [B, T, 3, H, D], the conv
  history [B, Kc - 1, 3, H, D] (bf16) and the taps [Kc, 3, H, D] f32; the rest as make_inputs."""
  rng = np.random.default_rng(seed + 1)
  n = lambda *s: rng.standard_normal(s).astype(np.float32)
  args, kw = make_inputs(B, T, H, Q, norm, seed)
  conv = (jnp.asarray(n(B, T, 3, H, D), jnp.bfloat16), jnp.asarray(n(B, Kc - 1, 3, H, D), jnp.bfloat16),
          jnp.asarray(0.5 * n(Kc, 3, H, D)))
  return conv + args[3:], kw


def xla_conv_then_kernel(config):
  """The model without kda_conv: XLA's short conv + SiLU (the fusion on the critical path), then the kernel."""
  def fn(qkv, hist, w, *rest, **kw):
    return kd.kda_decode(*kd.short_conv_reference(qkv, hist, w), *rest, config=config, **kw)
  return fn


def empty_kernel(q, k, v, f, b, A_log, dt_bias, state, num_accepted, **_):
  """The kernel's launch shape with an empty body: same operands, grid (V/32, H, B) and aliased state."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu
  B, T, H, _ = q.shape

  @pl.run_state
  def run(refs):
    state_ref, o_ref = refs
    o_ref[...] = pl.kernel(lambda *refs: None, out_type=jax.ShapeDtypeStruct((B, T, H, D), jnp.float32),
                           mesh=plgpu.Mesh(grid=(D // 32, H, B), grid_names=("v", "h", "b")))(
                               q, k, v, f, b, A_log, dt_bias, num_accepted)
  new_state, o = run((state, jnp.zeros((B, T, H, D), jnp.float32)))
  return o, new_state


def _kernel_us(names: dict, only: str | None) -> float:
  """µs per call from CUPTI's {kernel name: µs}: the kernels whose name contains ``only`` (None: all)."""
  return sum(us for name, us in names.items() if only is None or only in name)


def time_per_call(fn, args, kw, n_calls, reps, only=None):
  """fn(*args, **kw) -> (o, state); returns (median per-call GPU µs — CUPTI, the kernels named ``only`` — or wall
  µs where CUPTI is unavailable, compile + warm-up seconds)."""
  def chain(state, *rest):
    outs = []
    for _ in range(n_calls):
      o, state = fn(*rest[:7], state, rest[7], **dict(zip(kw, rest[8:])))
      outs.append(o)  # every o stays live, so XLA cannot drop any of the reference's work
    return state, outs
  step = jax.jit(chain, donate_argnums=(0,))
  state, rest = args[7], (*args[:7], args[8], *kw.values())
  t0 = time.perf_counter()
  state, _ = step(state, *rest)  # compile + warm up
  jax.block_until_ready(state)
  t_compile = time.perf_counter() - t0
  ts = []
  for _ in range(reps):
    if MODE[0] == "cupti":
      try:
        _EXT._cupti_init()
        state, outs = step(state, *rest)
        jax.block_until_ready((state, outs))
        names: dict[str, float] = {}
        for name, ms in _EXT._cupti_get_timings(True):
          names[name] = names.get(name, 0.0) + ms * 1e3
        ts.append(_kernel_us(names, only))
        continue
      except Exception as e:  # noqa: BLE001
        print(f"# CUPTI failed ({type(e).__name__}: {e}); wall-clock from now on", flush=True)
        MODE[0] = "wall"
    t0 = time.perf_counter()
    state, outs = step(state, *rest)
    jax.block_until_ready((state, outs))
    ts.append((time.perf_counter() - t0) * 1e6)
  return statistics.median(ts) / n_calls, t_compile


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--quick", action="store_true", help="fewer variants")
  ap.add_argument("--budget_s", type=float, default=150.0, help="stop starting new rows after this long")
  ap.add_argument("--n_calls", type=int, default=10, help="chained calls per timed program")
  ap.add_argument("--q4", action="store_true",
                  help="only B = 1, T = 1 and 4: the default kernel (1 WG/CTA) and its variants (issue #6's goal)")
  a = ap.parse_args()
  print("jax", jax.__version__, jax.devices()[0].device_kind, flush=True)
  if jax.default_backend() != "gpu":
    # No GPU: one smoke row in interpret mode, to keep the script itself tested. Timings are meaningless.
    from pallas_kernels._common import maybe_interpret
    args, kw = make_inputs(1, 2, 2, 4, True)
    with maybe_interpret():
      us, _ = time_per_call(kd.kda_decode, args, kw, n_calls=2, reps=1)
    print(f"CPU smoke run (interpret mode) ok: {us:.0f} us per call; run on a GPU for real numbers")
    return 0
  H, Q = 16, 8  # Q state slots: up to q = 8 tokens
  cfg = kd.KdaDecodeConfig
  variants = [
      ("kernel+norm (4 WG/CTA fused, TMA)", True, functools.partial(kd.kda_decode, config=None)),
      ("kernel+norm (4 WG/CTA fused, no TMA)", True, functools.partial(kd.kda_decode, config=cfg(prefetch=False))),
      ("kernel (1 WG/CTA, TMA)", False, functools.partial(kd.kda_decode, config=None)),
      ("reference+norm (XLA)", True, kd.kda_decode_reference),
  ]
  extras = [
      ("kernel+norm (1 WG/CTA, XLA norm)", True, functools.partial(kd.kda_decode, config=cfg(wgs_per_cta=1))),
      ("kernel+norm (BV=64, 2 WG/CTA fused)", True, functools.partial(kd.kda_decode, config=cfg(block_v=64))),
      ("kernel (1 WG/CTA, BV=64)", False, functools.partial(kd.kda_decode, config=cfg(block_v=64))),
      ("kernel (1 WG/CTA, gates first)", False, functools.partial(kd.kda_decode, config=cfg(gates_first=True))),
      ("kernel (1 WG/CTA, approx math)", False, functools.partial(kd.kda_decode, config=cfg(approx_math=True))),
      ("kernel (1 WG/CTA, approx, gates 1st)", False,
       functools.partial(kd.kda_decode, config=cfg(approx_math=True, gates_first=True))),
      ("kernel (1 WG/CTA, token loop)", False, functools.partial(kd.kda_decode, config=cfg(token_loop=True))),
      ("kernel (1 WG/CTA, token loop, approx)", False,
       functools.partial(kd.kda_decode, config=cfg(token_loop=True, approx_math=True))),
      # policy kda_conv: the short conv inside the kernel vs XLA's conv fusion + the kernel (every kernel counted)
      ("conv in kernel (loop, approx)", False,
       functools.partial(kd.kda_decode_conv, config=cfg(token_loop=True, approx_math=True))),
      ("XLA conv + kernel (loop, approx)", False, xla_conv_then_kernel(cfg(token_loop=True, approx_math=True))),
      ("conv in kernel", False, functools.partial(kd.kda_decode_conv, config=None)),
      ("XLA conv + kernel", False, xla_conv_then_kernel(None)),
  ]
  if a.quick:  # the model's default (kda_norm off: 1 WG per CTA, the norm in XLA) and the XLA reference
    variants = [variants[2], variants[3]]
  t_start = time.time()
  print(f"H={H} D={D} Q={Q}, bf16 q/k/v/f/b/gate, f32 state; us per call ({MODE[0]}: GPU time of the kernels in a "
        "jit of N chained calls)")
  print(f"{'variant':38s} {'B':>3s} {'T':>2s} {'us':>9s} {'GB/s':>8s} {'%4.3TB/s':>9s} {'floor us':>9s} {'x floor':>8s}",
        flush=True)

  def row(name, norm, fn, B, T):
    if time.time() - t_start > a.budget_s:
      print(f"{name:38s} {B:3d} {T:2d}   (skipped: time budget)", flush=True)
      return
    args, kw = (make_conv_inputs if "conv" in name else make_inputs)(B, T, H, Q, norm)
    try:
      # the Mosaic kernel alone for kernel rows (no state copies or glue); every kernel where the row's label
      # includes XLA work (the reference, the kernel + XLA norm)
      only = None if fn is kd.kda_decode_reference or "XLA" in name else "mosaic_gpu"
      us, t_compile = time_per_call(fn, args, kw, n_calls=a.n_calls, reps=10, only=only)
    except Exception as e:  # keep the table going; report the failure in its row
      print(f"{name:38s} {B:3d} {T:2d}   FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
      return
    if not us > 0:
      print(f"{name:38s} {B:3d} {T:2d}   FAILED: no kernel named {only!r} in the CUPTI timings", flush=True)
      return
    state_bytes = B * H * D * D * 4 * (1 + T)  # the start slot read + one slot written per token
    gbs = state_bytes / us / 1e3
    floor = state_bytes / (HBM_TBPS * 1e6)  # µs at the measured copy bandwidth (issue #6: within 2x at B = 32)
    print(f"{name:38s} {B:3d} {T:2d} {us:9.2f} {gbs:8.0f} {100 * gbs / (HBM_TBPS * 1e3):8.1f}% {floor:9.2f} "
          f"{us / floor:8.2f}  (compile {t_compile:.1f} s)", flush=True)

  # Launch + framework floor: same operands, grid and in-place aliasing, empty body.
  row("empty kernel (same operands/grid)", False, empty_kernel, 1, 1)
  if a.q4:
    for T in (1, 4):
      # (the token loop first: session 31's code-size question, measured first within the budget)
      unfused = [e for e in extras if not e[1]]
      # (the conv rows first: session 32's new variants; then the token loop)
      order = lambda e: (0 if "conv" in e[0] else 1 if "token loop" in e[0] else 2)  # noqa: E731
      for name, norm, fn in [variants[2]] + sorted(unfused, key=order):
        row(name, norm, fn, 1, T)
    print(f"total {time.time() - t_start:.0f} s", flush=True)
    return 0
  for B in (1, 8, 32):
    for T in (1, 4, 8):  # issue #6's matrix: B in {1, 8, 32} x q in {1, 4, 8}
      for name, norm, fn in variants:
        row(name, norm, fn, B, T)
  if not a.quick:
    for B, T in ((1, 1), (32, 4), (8, 4)):
      for name, norm, fn in extras:
        row(name, norm, fn, B, T)
  print(f"total {time.time() - t_start:.0f} s", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
