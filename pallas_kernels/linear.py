"""Weight-streaming linear kernels for decode (1..64 token rows) on Hopper, in Pallas Mosaic GPU.

Three kernels, each beside a pure-jnp reference with the same signature (fp32 math, Precision.HIGHEST):

* :func:`fp8_linear` / :func:`fp8_linear_reference`: ``y[M, N] = x[M, K] @ dequant(w[N, K]).T`` with FP8 e4m3
  weights and 128x128 block scales ``scale_inv[ceil(N/128), ceil(K/128)]`` (spec model.md §7).
* :func:`bf16_linear` / :func:`bf16_linear_reference`: skinny BF16 GEMV/GEMM (KDA projections, lm_head).
* :func:`fp8_moe` / :func:`fp8_moe_reference`: the routed experts of a few decode tokens (gate+up with the
  clamped SwiGLU, then down weighted by the routing weights), reading only the selected experts' weights; at one
  token row optionally as ONE grid whose CTAs run a gate/up item and then a down item (``one_grid``). (A
  one-launch persistent form, an evenly dealt form and a chained two-role form were measured slower and removed
  in session 53: BENCHMARKS.md sessions 40 and 44, and git history.)

Shape letters: M token rows (batch x draft tokens), N output features, K input features, E experts,
I expert intermediate size, D hidden size, k experts per token.

Design (why it looks like this):

* Decode is weight-bandwidth bound (<= 6 FLOP/B), so every kernel streams the weight exactly once with TMA into
  a multi-stage SMEM ring, as many bytes in flight per SM as fit, and splits K over CTAs when N alone would leave
  SMs idle (split-K partial sums are added by XLA in the epilogue).
* The weight is the wgmma M operand (rows = output features, 64/128-row tiles) and the tokens are the wgmma N
  operand (``mp`` = M rounded up to 8 rows: the TMA reads mp rows of the M-row input and fills the rows past M
  with zeros, so no padded copy is made), so tiny M costs no tensor-core waste. The kernel writes
  ``y.T`` per split ``[S, N, mp]`` and a small XLA epilogue sums, transposes and casts.
* FP8 path: activations are quantised (outside the kernel, fused by XLA) to TWO e4m3 terms with one scalar scale
  ``s``: ``x/s ~= hi + lo/16`` where ``lo = e4m3((x/s - hi) * 16)``. hi and lo are the two halves of the
  B tile (two wgmmas on the same weight tile), so the native fp8 x fp8 wgmma runs straight from SMEM (no register
  dequantisation, no f16 overflow risk) and the weight is still read once. hi+lo keeps ~8-9 significant bits,
  i.e. about bf16 precision (H200: relerr 6e-4 vs the fp32 dequantised reference; e4m3 alone gave 2.7e-2).
  ``hi`` is decoded with integer ops (:func:`e4m3_value`) because XLA GPU folds ``f32(f8(v))`` back to ``v``.
  The 128x128 weight block scale is applied AFTER the MMA: each 128-wide K block is accumulated in a fresh f32
  accumulator and added to the running sum times ``scale_inv[row_block, k_block]`` (exact, and it also bounds
  the precision loss of the tensor core's fp8 accumulation to one 128-K block, as DeepSeek-V3 does).
* All three kernels run in GPU interpret mode on CPU (A and B of every wgmma are in SMEM), and cross-lower.
* Blackwell (sm_100: no wgmma) — ``mma="tcgen05"`` of :func:`fp8_dq_linear` and :func:`bf16_linear`: the same
  kernels with each tile product as a ``tcgen05_mma`` issued by one thread into a tensor-memory accumulator
  [128, mp] (``_mma_tile``'s tcgen05 form): the dequantised weight tile through SMEM as A (a tcgen05 A operand
  lives in SMEM or TMEM, never in registers), x's token rows as the transposed B as on Hopper, rows padded to 16
  (tcgen05's smallest N with a TMA swizzle: ``MMA_ROWS``), 128-row tiles (an M = 64 MMA splits N over two lane
  groups: a 16-row B would need a 16-byte swizzle, which does not exist). FP8: one MMA per 128-K block into a
  fresh accumulator, read back for its block scale (exact, as on Hopper); BF16: the CTA's K range accumulated in
  TMEM, read once. The register sum is in tcgen05's layout (a row per thread) and goes through SMEM once into the
  WGMMA layout that the epilogues (split-K sums, token rows) take. Checked in interpret mode and compiled for
  sm_100a on a CPU (``benchmarks/step_census.py --target benchmarks/targets/b200.txtpb``); not yet on a GPU.

Measured on one H200 (benchmarks/bench_linear.py, CUPTI kernel time, cold weights), M=1: fp8 4096x4096 6.2 us
(2.7 TB/s), 1536x4096 3.6 us, 512x4096 2.3 us (a ~2 us launch + first-byte floor dominates small weights);
bf16 2048x4096 5.6 us (3.0 TB/s), lm_head 38720x4096 78 us (4.05 TB/s); MoE (8 experts, 50 MB) 17.7 us
(2.8 TB/s), M=32 (170 experts) 281 us (3.8 TB/s). The XLA glue (activation quantisation: a reduce + an
elementwise fusion; the split-K/transposition epilogue) adds ~1 us per fusion; in the model it fuses with the
neighbouring norm / residual ops, and :func:`quantize_activations` can be shared between linears.

Composition: :func:`quantize_activations` + :func:`fp8_linear_q` let a caller quantise an input once and feed
several FP8 linears that share it (q_a and kv_a; dense gate and up).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._common import (check_mma, counter_publish, counter_signal, counter_wait, interpreting,
                                    kernel_entry, mgpu_kernel, saturate_f16, tmem_to_wgmma, wg_barrier)

BLOCK = 128  # FP8 weight scale block (128x128) and the K width of one pipeline step
E4M3_MAX = 448.0
LO_SCALE = 16.0  # lo term is stored x16: the hi residual is <= 2^-4 |v|, so lo*16 never exceeds 448
NUM_SMS = 132  # H200
SMEM_BYTES = 227 * 1024  # static per-CTA budget checked by Mosaic at lowering
RESIDENT_PER_SM = 3  # MoE CTAs resident per SM when their count exceeds the SMs (rings sized to fit: plan_moe)
F8 = jnp.float8_e4m3fn


# ------------------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------------------
def _tr(dtype, minor: int):
  """Tiling + swizzle transforms of an SMEM wgmma operand tile whose minor dim has ``minor`` elements."""
  itemsize = jnp.dtype(dtype).itemsize
  sw = plgpu.find_swizzle(minor * itemsize * 8)
  return (plgpu.TilingTransform((8, sw // itemsize)), plgpu.SwizzleTransform(sw))


def _round_up(a: int, b: int) -> int:
  return -(-a // b) * b


MMA_ROWS = {"wgmma": 8, "tcgen05": 16}  # the token-row (MMA N) granularity of each form
MMA_BM = {"tcgen05": 128}  # the weight rows per CTA a form needs (wgmma: 64 or 128)


def _padded_rows(m: int, mma: str = "wgmma") -> int:
  """Token rows padded to the MMA's N granularity (wgmma 8, tcgen05 16: ``MMA_ROWS``)."""
  g = MMA_ROWS[mma]
  return max(g, _round_up(m, g))


def _tma_rows(x: jax.Array, mp: int) -> jax.Array:
  """x [m, K] for a kernel whose TMA reads mp = _padded_rows(m) rows of it: as it is where the TMA's zero fill
  covers the missing rows (m <= 8, or m == mp), zero-padded to mp rows otherwise — Mosaic tiles the GMEM array
  by the SMEM tile's 8 rows, and an m > 8 that is not a multiple of 8 cannot be tiled (it fails to lower)."""
  m = x.shape[0]
  return x if (m <= 8 or m == mp) else jnp.pad(x, ((0, mp - m), (0, 0)))


@dataclasses.dataclass(frozen=True)
class Plan:
  """Static tiling of one weight-streaming launch.

  bm: weight rows per CTA (wgmma M); bk: K per pipeline step; split: K splits (CTAs per row tile);
  stages: SMEM ring depth (loads in flight per CTA).
  """

  bm: int
  bk: int
  split: int
  stages: int


def _pick_split(tiles: int, kb: int, target_ctas: int) -> int:
  """Largest divisor of ``kb`` that keeps tiles * split <= target_ctas (so that all SMs stream)."""
  best = 1
  for d in range(1, kb + 1):
    if kb % d == 0 and tiles * d <= target_ctas:
      best = d
  return best


BALANCE_MAX_WAVES = 4  # _pick_split_balanced's CTAs at most, in multiples of the SMs


def _pick_split_balanced(tiles: int, kb: int, sms: int = NUM_SMS) -> int:
  """The divisor of ``kb`` whose grid (tiles x split CTAs, at most BALANCE_MAX_WAVES x sms) loads the SMs most
  evenly: the fewest bytes on the busiest SM, ceil(ctas / sms) / ctas of the weight; on a tie a grid that keeps
  >= 90 % of the SMs streaming, then fewer splits (fewer partials to sum). _pick_split's largest split under 2 x
  sms can leave SMs with two CTAs beside SMs with one: the KDA q/k/v at 4 rows (48 row tiles x 4 splits = 192 CTAs
  on 132 SMs, 2.07 TB/s in session 71's trace) — here 8 splits (384 CTAs, 2.9 a SM)."""
  def key(d):
    ctas = tiles * d
    return round(-(-ctas // sms) / ctas, 12), ctas < 0.9 * sms, d

  ok = [d for d in range(1, kb + 1) if kb % d == 0 and (d == 1 or tiles * d <= BALANCE_MAX_WAVES * sms)]
  return min(ok, key=key)


def _pick_stages(steps: int, stage_bytes: int, ctas: int, max_stages: int | None, resident: int = 2,
                 reserve: int = 0) -> int:
  """As many stages as fit: one CTA per SM may use ~all SMEM; with more CTAs than SMs, up to ``resident`` per SM
  (the MoE kernels: 3, see plan_moe) share it. ``reserve``: SMEM bytes a CTA needs besides its ring."""
  per_sm = min(resident, -(-ctas // NUM_SMS))
  budget = ((SMEM_BYTES - 8 * 1024) if per_sm <= 1 else (SMEM_BYTES // per_sm - 4 * 1024)) - reserve
  st = max(1, min(steps, budget // stage_bytes))
  if max_stages is not None:
    st = max(1, min(st, max_stages))
  return st


def plan_linear(n: int, k: int, mp: int, kind: str, *, bm: int | None = None, bk: int | None = None,
                split: int | None = None, stages: int | None = None, target_ctas: int = 2 * NUM_SMS,
                mma: str = "wgmma", balanced: bool = False) -> Plan:
  """Default tiling for an [N, K] weight and ``mp`` padded token rows; ``kind`` is "fp8" (hi/lo e4m3
  activations), "fp8dq" (the weight dequantised in registers, bf16 activations) or "bf16".

  Any field can be overridden (the benchmark sweeps them). Constraints: N % bm == 0, K % bk == 0, bm in {64,128}.
  ``balanced``: the K splits by :func:`_pick_split_balanced` (the SMs' load) instead of the largest under
  ``target_ctas`` (policy knob bf16_balanced_splits, for the bf16 GEMV).
  ``mma`` "tcgen05": 128-row tiles, and the ring sized around the form's SMEM tiles (the dequantised A tile, the
  accumulator's relayout tile).
  """
  reserve = 0
  if check_mma(mma, "plan_linear"):
    bm = bm or MMA_BM[mma]
    reserve = bm * mp * 4 + (bm * BLOCK * 2 if kind == "fp8dq" else 0)
  if kind == "fp8":
    # hi+lo accumulators [bm, mp] x2 plus the running sum: keep them <= ~100 registers per thread.
    bm = bm or (128 if (mp <= 32 and n % 128 == 0) else 64)
    bk = BLOCK
    x_cols = 2 * mp
    w_bytes, x_bytes = 1, 1
  elif kind == "fp8dq":  # FP8 weight tile dequantised in registers, bf16 activations: one accumulator per step
    bm = bm or (128 if (mp <= 32 and n % 128 == 0) else 64)
    bk = BLOCK
    x_cols = mp
    w_bytes, x_bytes = 1, 2
  elif kind == "bf16":
    bm = bm or (128 if n % 128 == 0 else 64)  # (N % 64 != 0: the last row tile overlaps the one before it)
    # bk=256 was measured no faster for the lm_head at M<=8 and 15% slower at M=32 (fewer stages fit).
    bk = bk or 128
    x_cols = mp
    w_bytes, x_bytes = 2, 2
  else:
    raise ValueError(kind)
  fp8 = kind != "bf16"
  if k % bk or (n % bm if fp8 else n < bm):  # (bf16: a partial last row tile overlaps its neighbour)
    raise ValueError(f"[N={n}, K={k}]: K must be a multiple of {bk} and N " +
                     (f"a multiple of {bm}" if fp8 else f">= {bm}"))
  tiles, kb = -(-n // bm), k // bk
  split = split or (_pick_split_balanced(tiles, kb) if balanced else _pick_split(tiles, kb, target_ctas))
  if kb % split:
    raise ValueError(f"split={split} must divide K/bk={kb}")
  steps = kb // split
  stage_bytes = bm * bk * w_bytes + x_cols * bk * x_bytes
  st = _pick_stages(steps, stage_bytes, tiles * split, stages, reserve=reserve)
  return Plan(bm=bm, bk=bk, split=split, stages=st)


def _mma_hi_lo(w_s, x_s, mp: int, acc_hi, acc_lo):
  """One 128-K block: acc_hi = W @ hi.T, acc_lo = W @ lo.T (fresh zeroed accumulators) -> W @ (hi + lo/16).T."""
  plgpu.wgmma(acc_hi, w_s, x_s.at[pl.ds(0, mp)].T)
  plgpu.wgmma(acc_lo, w_s, x_s.at[pl.ds(mp, mp)].T)
  return acc_hi[...] + acc_lo[...] * (1.0 / LO_SCALE)


def _dequant_tile(w_s, a_s, dt=jnp.bfloat16):
  """An e4m3 weight tile [bm, 128] in SMEM -> the wgmma A operand in bf16 (or ``dt`` f16): in registers (a_s
  None), or stored into the SMEM tile a_s (the form GPU interpret mode runs). bf16 goes through f32: the H200's
  ptxas has no direct e4m3 -> bf16 conversion; f16 is one cvt per two values (e4m3x2 -> f16x2). e4m3 values are
  exact in both (3 mantissa bits, |v| <= 448)."""
  a = plgpu.load(w_s, layout=plgpu.Layout.WGMMA)
  a = a.astype(jnp.float16) if dt == jnp.float16 else a.astype(jnp.float32).astype(jnp.bfloat16)
  if a_s is None:
    return a
  a_s[...] = a
  plgpu.commit_smem()
  return a_s


DQ_DTYPES = ("bfloat16", "float16")


def _act(x, dt):
  """Activations (x, h) in the dq kernels' dtype ``dt``. f16 saturates at ±65,504: past it the conversion would
  give inf (bf16 keeps such values to 8 bits) — with the subnormal range's lost bits below 2^-14, the only bf16
  values f16 does not hold exactly. bf16 (and f32) unchanged."""
  if x.dtype == jnp.dtype(dt):  # (already converted: e.g. the mHC boundary's f16 x_in, saturated there)
    return x
  if jnp.dtype(dt) == jnp.float16:  # (clipped in f32: bf16 rounds 65,504 up to 65,536, which f16 does not hold)
    return saturate_f16(x)
  return x.astype(dt)


def _dq_dtype(dq_dtype: str, name: str):
  """The dq kernels' activation / dequantised-weight dtype: bf16 (the default), or f16 — each e4m3 weight element
  converted by one cvt per two values instead of e4m3 -> f32 -> bf16, x's bf16 values exact in f16 while |x| <=
  65,504 (past it they saturate there: ``_act``; below 2^-14 f16 subnormals keep fewer bits), f32 accumulation
  either way."""
  if dq_dtype not in DQ_DTYPES:
    raise ValueError(f"{name}: dq_dtype = {dq_dtype!r}, expected one of {DQ_DTYPES}")
  return jnp.dtype(dq_dtype)


def _a_smem(a_from: str | None) -> bool:
  """Whether the dequantised weight tile goes through SMEM: ``a_from`` "smem", or by default in GPU interpret
  mode (which cannot run a register-A wgmma); "regs" keeps it in registers."""
  a_from = a_from or ("smem" if interpreting() else "regs")
  if a_from not in ("regs", "smem"):
    raise ValueError(f"a_from={a_from!r}: expected 'regs' or 'smem'")
  return a_from == "smem"


def _mma_tile(w_s, x_s, mp: int, dq: bool, a_s=None, dt=None, tc=None):
  """One 128-K block with a fresh accumulator -> W @ x.T [bm, mp] f32: x as hi/lo e4m3 rows [2mp, 128] (two fp8
  wgmmas, :func:`_mma_hi_lo`), or (dq) the weight dequantised to x's dtype (bf16, or f16: ``dt``, by default the
  x tile's) times x rows [mp, 128]. ``tc`` = (TMEM accumulator [bm, mp] f32, its tensor-core barrier): the
  tcgen05 form (dq, A through the SMEM tile a_s) -> the block in tcgen05's register layout (a row per thread)."""
  bm = w_s.shape[0]
  if tc is not None:
    acc_t, bar_mma = tc
    a = _dequant_tile(w_s, a_s, dt or x_s.dtype)
    plgpu.tcgen05_mma(acc_t, a, x_s.T, bar_mma, accumulate=False)  # (one thread issues it; arrives when done)
    plgpu.barrier_wait(bar_mma)
    blk = plgpu.async_load_tmem(acc_t)
    plgpu.wait_load_tmem()  # (read before the next block's MMA overwrites the accumulator)
    return blk
  if not dq:
    return pl.run_scoped(functools.partial(_mma_hi_lo, w_s, x_s, mp),
                         plgpu.ACC((bm, mp), jnp.float32), plgpu.ACC((bm, mp), jnp.float32))
  a = _dequant_tile(w_s, a_s, dt or x_s.dtype)

  def mma(acc):
    plgpu.wgmma(acc, a, x_s.T)
    return acc[...]

  return pl.run_scoped(mma, plgpu.ACC((bm, mp), jnp.float32))


def _tc_scratch(bm: int, mp: int, barriers: int = 1):
  """The tcgen05 form's scratch: the TMEM accumulator, its tensor-core barrier(s), the SMEM relayout tile."""
  return [plgpu.TMEM((bm, mp), jnp.float32),
          plgpu.Barrier(num_arrivals=1, num_barriers=barriers, orders_tensor_core=True),
          plgpu.SMEM((bm, mp), jnp.float32)]


# ------------------------------------------------------------------------------------------------------------
# activation quantisation (XLA side; fuses with the producer of x)
# ------------------------------------------------------------------------------------------------------------
def e4m3_value(q: jax.Array) -> jax.Array:
  """f32 value of float8_e4m3fn codes computed with integer ops only.

  Why not ``q.astype(f32)``: with XLA GPU's default ``xla_allow_excess_precision`` the pair
  ``convert(convert(v, f8), f32)`` may be folded back to ``v`` (measured on the H200: the lo term became 0 and
  the error was that of plain e4m3). Bit decoding cannot be folded. NaN codes never occur here (inputs <= 448).
  """
  b = lax.bitcast_convert_type(q, jnp.uint8).astype(jnp.int32)
  mag = b & 0x7F
  e, man = mag >> 3, mag & 7
  sig = jnp.where(e == 0, man, man + 8).astype(jnp.float32)  # normal: (8 + m) 2^(e-10); subnormal: m 2^-9
  pow2 = lax.bitcast_convert_type((jnp.maximum(e, 1) - 10 + 127) << 23, jnp.float32)
  val = sig * pow2
  return jnp.where(b >= 128, -val, val)


def activation_scale(amax):
  """The activations' scale from their max |x|: amax / 448, or 1 for all zeros (f32). One definition for XLA and
  the kernels that recompute it from amax."""
  return jnp.where(amax > 0, amax / E4M3_MAX, 1.0).astype(jnp.float32)


def quantize_activations(x: jax.Array, rows: int | None = None):
  """Split x (any float dtype) into two e4m3 terms with one scalar scale.

  Args:
    x: [..., R, K] activations (R token rows).
    rows: pad R to this many rows (>= R, multiple of 8); default ``_padded_rows(R)``.
  Returns:
    xq: [..., 2*rows, K] float8_e4m3fn; rows [0, rows) hold hi, rows [rows, 2*rows) hold lo (zero padded), with
      ``x ~= s * (hi + lo / 16)``.
    s: f32 scalar scale (amax / 448; 1 for an all-zero x).
  """
  r = x.shape[-2]
  rows = rows or _padded_rows(r)
  xf = x.astype(jnp.float32)
  s = activation_scale(jnp.max(jnp.abs(xf)))
  v = jnp.clip(xf / s, -E4M3_MAX, E4M3_MAX)
  hi = v.astype(F8)
  lo = jnp.clip((v - e4m3_value(hi)) * LO_SCALE, -E4M3_MAX, E4M3_MAX).astype(F8)
  pad = [(0, 0)] * (x.ndim - 2) + [(0, rows - r), (0, 0)]
  return jnp.concatenate([jnp.pad(hi, pad), jnp.pad(lo, pad)], axis=-2), s


# ------------------------------------------------------------------------------------------------------------
# FP8 block-scaled linear
# ------------------------------------------------------------------------------------------------------------
def _fp8_linear_kernel(x_ref, w_ref, s_ref, *refs, mp: int, plan: Plan, tiles: int, steps: int, dq: bool = False,
                       fused_sum: bool = False, rows: bool = False, scales_first: bool = False, lean: bool = False,
                       tc05: bool = False, part_rows: bool = False):
  """One CTA = (row tile of bm weight rows, K split of `steps` 128-blocks); writes o[split, rows, :mp].
  x: hi|lo e4m3 rows [2mp, K] (two fp8 wgmmas per block), or (dq) bf16 rows [mp, K] times each weight tile
  dequantised to bf16 (``_mma_tile``; ``a_s``: the SMEM tile it goes through in interpret mode).
  ``fused_sum``: refs start with the split-K counters; ``rows``: the sum written as token rows (``_split_out``,
  ``_out_refs``). ``scales_first``: every step's block scale requested before the first weight tiles (ahead of
  the grid's weight stream, whose requests a later scalar load queues behind: ~4 µs in s51a's MoE profile),
  instead of the first ``stages`` just after them and each later one ``stages`` steps ahead. ``lean`` (built
  without Mosaic's automatic barriers: lean_barriers, with A from registers): the one barrier the ring needs — a
  slot is refilled only after every warp is done reading it (its dequantisation's loads, the wgmma's operands).
  ``tc05``: the tcgen05 form (``_mma_tile``; scratch a_s, then ``_tc_scratch``'s three). ``part_rows``: o is
  [split, m, N], this split's partial written as token rows (``_out_refs``)."""
  ctr_g, o_ref, y, (w_s, x_s, bar, *a_s) = _out_refs(refs, fused_sum, plan.split, rows, part_rows)
  tc, t_s = None, None
  if tc05:
    a_s, acc_t, bar_mma, t_s = a_s
    a_s, tc = [a_s], (acc_t, bar_mma)
  bm, stages = plan.bm, plan.stages
  t = lax.axis_index("t")
  tile, sk = t % tiles, t // tiles
  row0 = tile * bm
  kb0 = sk * steps
  nb = row0 // BLOCK  # bm <= 128 divides 128: one scale row per tile

  def issue(i):  # static i: TMA the weight tile and the activation tile of step i into its slot
    slot = i % stages
    k0 = (kb0 + i) * BLOCK
    plgpu.copy_gmem_to_smem(w_ref.at[pl.ds(row0, bm), pl.ds(k0, BLOCK)], w_s.at[slot], bar.at[slot])
    # (rows past x's real ones are out of bounds: the TMA fills them with zeros — no padded copy, _tma_rows)
    plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(0, x_s.shape[1]), pl.ds(k0, BLOCK)], x_s.at[slot], bar.at[slot])

  if scales_first:
    scales = [s_ref[nb, kb0 + i] for i in range(steps)]
  for i in range(stages):  # fill the ring: `stages` steps in flight from the start
    issue(i)
  if not scales_first:  # Scale loads are issued `stages` steps ahead so their GMEM latency hides behind the waits.
    scales = [s_ref[nb, kb0 + i] for i in range(min(stages, steps))]
  acc = None
  for i in range(steps):  # fully unrolled: static slots, steps <= K/128
    slot = i % stages
    if i + stages < steps and not scales_first:
      scales.append(s_ref[nb, kb0 + i + stages])
    plgpu.barrier_wait(bar.at[slot])
    blk = _mma_tile(w_s.at[slot], x_s.at[slot], mp, dq, a_s[0] if a_s else None, tc=tc)
    # Reading the accumulators waited for the wgmma (tcgen05: its barrier), so the slot is free again: refill it.
    if i + stages < steps:
      _refill(issue, i + stages, lean)
    # the 128x128 block scale after the MMA: exact, and it bounds the tensor core's fp8 accumulation to a block
    acc = blk * scales[i] if acc is None else acc + blk * scales[i]
  if tc05:
    acc = tmem_to_wgmma(acc, t_s)
  _split_out(o_ref, ctr_g, acc, sk=sk, tile=tile, row0=row0, bm=bm, split=plan.split, rows=y)


class _PartRows(NamedTuple):
  """``part_rows``' outputs in a kernel: every K split's partial as token rows o [split, m, N] f32, written through
  the SMEM tile y_s [m, bm] f32 (``_rows_out``)."""
  o: object
  y_s: object


def _out_refs(refs, fused_sum: bool, split: int, rows: bool, part_rows: bool = False):
  """A weight-streaming kernel's refs after its inputs -> (split-K counters or None, partials o or None, (y, y_s)
  or None, the remaining scratch refs). Order: [counters], [o: the partials, absent when ``rows`` with one split],
  [y: the token rows], scratch..., [y_s: the rows' SMEM tile, last]. ``part_rows`` (no counters, no rows): o is
  the partials as token rows [split, m, N], returned as the third value (a ``_PartRows`` with its SMEM tile, the
  last scratch) — what ``_split_out`` writes them by."""
  refs = list(refs)
  ctr_g = refs.pop(0) if fused_sum else None
  if part_rows:
    assert not (fused_sum or rows)
    o = refs.pop(0)
    return None, None, _PartRows(o, refs.pop()), refs
  o_ref = refs.pop(0) if not (rows and split == 1) else None
  y = (refs.pop(0), refs.pop()) if rows else None
  return ctr_g, o_ref, y, refs


def _rows_out(y, tot, *, row0, weight=None):
  """The tile's [bm, mp] sum as the m real token rows: y_g[r, row0:row0 + bm] = tot[:, r] (times ``weight(r)``
  if given) in y_g's dtype, through y_s [m, bm] (SMEM) and one TMA store. Column r is picked by a masked sum over
  the tile's columns (exact: one nonzero term; the WGMMA layout's row reduction, as the indexer's scores kernel
  reduces its heads), so no transposed store — which Mosaic GPU does not lower — and no XLA slice / transpose /
  cast kernel after the call: the consumer (the mHC boundary kernel, an XLA fusion) reads y as it is."""
  y_g, y_s = y
  col = plgpu.broadcasted_iota(jnp.int32, tot.shape, 1, layout=plgpu.Layout.WGMMA)
  for r in range(y_s.shape[0]):
    v = plgpu.layout_cast(jnp.sum(jnp.where(col == r, tot, 0.0), axis=1), plgpu.Layout.WGMMA.reduce(1))
    y_s[r, :] = _act(v if weight is None else v * weight(r), y_s.dtype)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(y_s, y_g.at[:, pl.ds(row0, y_s.shape[1])])
  plgpu.wait_smem_to_gmem(0)


def _gate_up_rows(y, weight, g, u, *, limit: float, slot, row0):
  """The gate/up kernel's rows form: a (slot, row tile)'s summed gate / up accumulators [bm, mp] -> h = silu(min(g,
  L)) · clip(u, −L, L) times the slot's routing weight of each token row, rounded to bf16 as the down kernel
  reads it: hq[slot, r, row0:row0 + bm] for the m real rows (``_rows_out``), no XLA kernel between the two MoE
  kernels."""
  gate = jnp.minimum(g, limit)
  _rows_out((y[0].at[slot], y[1]), gate * jax.nn.sigmoid(gate) * jnp.clip(u, -limit, limit), row0=row0,
            weight=weight)


def _split_reduce(cell, views, accs, finish, *, sk, split: int):
  """The K-split sum on a split-K counter ``cell`` (int32 [1] of the counters, zero): a CTA of split sk < split - 1
  stores its accumulators ``accs`` to ``views[j][sk]`` and signals; the last split's CTA — dispatched last, the
  others already running — waits for them (taking the counter back to zero for the next call), adds their
  partials from L2 and calls ``finish(*sums)``."""
  last = split - 1

  @pl.when(sk < last)
  def _():
    for v, a in zip(views, accs):
      v[sk] = a
    counter_signal(cell)

  @pl.when(sk == last)
  def _():
    counter_wait(cell, last, take=True)
    tots = []
    for v, tot in zip(views, accs):
      for s in range(last):  # the other splits' partials, from L2
        tot = tot + plgpu.load(v.at[s], layout=plgpu.Layout.WGMMA, optimized=False)
      tots.append(tot)
    finish(*tots)


def _split_out(o_ref, ctr_g, acc, *, sk, tile, row0, bm: int, split: int, rows=None):
  """A CTA's [bm, mp] accumulator of K split ``sk`` to o[sk, rows]; with split-K counters (``ctr_g``: int32
  [>= tiles], zero), the row tile's splits summed in the kernel (``_split_reduce`` on the tile's counter) and the
  sum written to o[split - 1]: no XLA reduction after the kernel. ``rows`` = (y_g [m, N], y_s [m, bm]): the sum
  (one split: acc itself) written as token rows instead (``_rows_out``; o holds the other splits' partials
  only)."""
  if isinstance(rows, _PartRows):  # (part_rows: this split's partial as the m token rows of o[sk])
    _rows_out((rows.o.at[sk], rows.y_s), acc, row0=row0)
    return

  def finish(tot):
    if rows is not None:
      _rows_out(rows, tot, row0=row0)
    else:
      o_ref[split - 1, pl.ds(row0, bm), :] = tot

  if ctr_g is None:
    if rows is not None:  # (one split: the tile's sum is this CTA's)
      finish(acc)
    else:
      o_ref[sk, pl.ds(row0, bm), :] = acc
    return
  _split_reduce(ctr_g.at[pl.ds(tile, 1)], [o_ref.at[:, pl.ds(row0, bm)]], [acc], finish, sk=sk, split=split)


def _fused_counters(counters, split: int, tiles: int, name: str):
  """``counters`` where the K splits are summed in the kernel (a Ref of :func:`splitk_counters`, more than one
  split, not interpret mode — which runs no counters: the XLA sum there), else None; a Ref of another shape, or
  more row tiles than it covers, is refused by name."""
  if counters is None or split == 1 or interpreting():
    return None
  if counters.shape != (SPLITK_COUNTERS,) or counters.dtype != jnp.int32 or tiles > ONE_GRID_BANKS:
    raise ValueError(f"{name}: counters {counters.shape} {counters.dtype} for {tiles} row tiles, expected "
                     f"splitk_counters()' int32 [{SPLITK_COUNTERS}] and at most {ONE_GRID_BANKS} tiles (the rest: "
                     "the one-grid MoE's banks, left non-zero between its calls)")
  return counters


def _split_sum(out, m: int, fused: bool, part_rows: bool = False):
  """[split, N, mp] kernel output -> [m, N] f32: the in-kernel sum (o[split - 1]), or XLA's over the splits;
  ``part_rows``: the output is [split, m, N] already (token rows), XLA's sum needs no transpose."""
  if part_rows:
    return out.sum(0)
  return out[-1, :, :m].T if fused else out[..., :m].sum(0).T


def _check_part_rows(part_rows: bool, m: int, name: str) -> bool:
  """``part_rows`` for ``m`` token rows: refused by name past ROWS_OUT_MAX (the rows are written one masked row sum
  each); the XLA sum after the kernel then reads [split, m, N]: no transpose kernel between it and the cast."""
  if part_rows and m > ROWS_OUT_MAX:
    raise ValueError(f"{name}: part_rows with {m} token rows; expected at most {ROWS_OUT_MAX} (one masked row sum "
                     "per row)")
  return bool(part_rows)


SPLITK_COUNTERS = 288  # counters in the Ref: a fused-sum call's row tiles use those below ONE_GRID_BANKS (224)
# the one-grid KDA + o_proj's two banks of hand-off counters (pallas_kernels.kda_decode.kda_decode_o_proj), past
# the one-grid MoE's two (224 .. 255): up to 16 K splits each
KDA_GRID_BANKS = 256
ROWS_OUT_MAX = 8  # token rows up to which a fused-sum kernel writes its sum as rows (a masked row sum per row)


def splitk_counters():
  """The split-K counters of the fused-sum linears (FP8 and BF16) of one traced program: one jax Ref (zeroed
  once — one fill per step), shared by the calls in order (each call's aliased operand), each leaving its cells
  below ONE_GRID_BANKS zero (the one-grid MoE's two banks above them alternate between its calls)."""
  return jax.new_ref(jnp.zeros((SPLITK_COUNTERS,), jnp.int32))


def _fused_form(counters, split: int, tiles: int, m: int, name: str):
  """A fused-sum request (``counters`` given) -> (the counters the kernel takes or None, whether it writes its sum
  as the m token rows): rows where the tile's sum is one CTA's — one split, or the last split's with usable
  counters (``_fused_counters``: not in interpret mode) — for up to ROWS_OUT_MAX rows."""
  if counters is None:
    return None, False
  ctr = _fused_counters(counters, split, tiles, name)
  return ctr, m <= ROWS_OUT_MAX and (split == 1 or ctr is not None)


def _out_types(split: int, n: int, mp: int, m: int, rows_dtype, part_rows: bool = False):
  """The weight-streaming kernels' outputs: the partials o [split, N, mp] f32 (one fewer — the last split's sum
  goes to the rows — with ``rows_dtype``; none with one split) and the rows y [m, N] rows_dtype; ``part_rows``:
  the partials as token rows [split, m, N] f32."""
  if part_rows:
    return jax.ShapeDtypeStruct((split, m, n), jnp.float32)
  if rows_dtype is None:
    return jax.ShapeDtypeStruct((split, n, mp), jnp.float32)
  y = jax.ShapeDtypeStruct((m, n), rows_dtype)
  return y if split == 1 else (jax.ShapeDtypeStruct((split - 1, n, mp), jnp.float32), y)


def _rows_result(out, split: int):
  """The rows y from a rows-form kernel's outputs (``_out_types``)."""
  return out if split == 1 else out[1]


def _fp8_launch(x_rows, w, scale_inv, *, mp: int, plan: Plan, dq: bool, a_smem: bool, name: str, counters=None,
                m: int = 0, rows_dtype=None, scales_first: bool = False, lean: bool = False, tc05: bool = False,
                part_rows: bool = False):
  """The FP8 linear kernel over x_rows ([2mp, K] e4m3 hi|lo, or [m <= mp, K] bf16 when dq) -> [split, N, mp] f32
  (with ``counters``, split-K counters: o[split - 1] holds the sum); with ``rows_dtype``, the m token rows'
  sum y [m, N] instead (``_out_types``: one split, or counters); with ``part_rows``, [split, m, N] f32."""
  n = w.shape[0]
  tiles = n // plan.bm
  steps = w.shape[1] // BLOCK // plan.split
  x_dtype, x_rows_n = (x_rows.dtype, mp) if dq else (F8, 2 * mp)
  a_scratch = ([plgpu.SMEM((plan.bm, BLOCK), x_dtype, transforms=_tr(x_dtype, BLOCK))] if a_smem else [])
  rows = rows_dtype is not None
  fused = counters is not None
  lean = lean and not a_smem  # (the SMEM-A form — interpret mode's — keeps the automatic barriers: a_s is rewritten)
  return mgpu_kernel(
      functools.partial(_fp8_linear_kernel, mp=mp, plan=plan, tiles=tiles, steps=steps, dq=dq, fused_sum=fused,
                        rows=rows, scales_first=scales_first, lean=lean, tc05=tc05, part_rows=part_rows),
      compiler_params=plgpu.CompilerParams(unsafe_no_auto_barriers=lean),
      out_type=_out_types(plan.split, n, mp, m, rows_dtype, part_rows),
      grid=(tiles * plan.split,),
      grid_names=("t",),
      kernel_name=name,
      scratch_types=[
          plgpu.SMEM((plan.stages, plan.bm, BLOCK), F8, transforms=_tr(F8, BLOCK)),
          plgpu.SMEM((plan.stages, x_rows_n, BLOCK), x_dtype, transforms=_tr(x_dtype, BLOCK)),
          plgpu.Barrier(num_arrivals=2, num_barriers=plan.stages),
          *a_scratch,
          *(_tc_scratch(plan.bm, mp) if tc05 else []),
          *([plgpu.SMEM((m, plan.bm), rows_dtype)] if rows else []),
          *([plgpu.SMEM((m, plan.bm), jnp.float32)] if part_rows else []),
      ],
  )(x_rows, w, scale_inv.astype(jnp.float32), *((counters,) if fused else ()))


def fp8_linear_q(xq: jax.Array, x_scale: jax.Array, m: int, w: jax.Array, scale_inv: jax.Array, *,
                 out_dtype=jnp.float32, plan: Plan | None = None) -> jax.Array:
  """FP8 linear on pre-quantised activations (from :func:`quantize_activations`).

  Args:
    xq: [2*mp, K] e4m3 (hi rows then lo rows); x_scale: f32 scalar; m: real token rows M <= mp.
    w: [N, K] float8_e4m3fn; scale_inv: [ceil(N/128), ceil(K/128)] f32.
  Returns: y [M, N] out_dtype.
  """
  two_mp, k = xq.shape
  mp = two_mp // 2
  n, k2 = w.shape
  if k != k2 or w.dtype != F8:
    raise ValueError(f"bad shapes/dtypes: xq {xq.shape} w {w.shape} {w.dtype}")
  if k % BLOCK or n % 64:
    raise NotImplementedError(f"fp8_linear needs K % 128 == 0 and N % 64 == 0, got N={n} K={k}")
  if mp > 64:
    raise NotImplementedError("fp8_linear_q takes <= 64 rows; fp8_linear chunks larger M")
  plan = plan or plan_linear(n, k, mp, "fp8")
  out = _fp8_launch(xq, w, scale_inv, mp=mp, plan=plan, dq=False, a_smem=False, name="glm5_fp8_linear")
  # Epilogue (one XLA fusion): add the K splits, back to [M, N], apply the activation scale.
  return (out[..., :m].sum(0).T * x_scale).astype(out_dtype)


@kernel_entry("out_dtype", "plan")
def fp8_linear(x: jax.Array, w: jax.Array, scale_inv: jax.Array, *, out_dtype=jnp.float32,
               plan: Plan | None = None) -> jax.Array:
  """y = x @ dequant(w).T with FP8 128x128 block-scaled weights.

  Args:
    x: [M, K] bf16 or f32 (M = B*q token rows; any M, chunked by 64).
    w: [N, K] float8_e4m3fn.
    scale_inv: [ceil(N/128), ceil(K/128)] f32; dequant W[r, c] = f32(w[r, c]) * scale_inv[r//128, c//128].
  Returns:
    y: [M, N] out_dtype.
  Needs K % 128 == 0 and N % 64 == 0 (true for every GLM-5.3 FP8 module).
  """
  m = x.shape[0]
  if m > 64:  # re-reads the weight per 64-row chunk; decode never gets here
    return jnp.concatenate([fp8_linear(x[i:i + 64], w, scale_inv, out_dtype=out_dtype, plan=plan)
                            for i in range(0, m, 64)], axis=0)
  xq, s = quantize_activations(x)
  return fp8_linear_q(xq, s, m, w, scale_inv, out_dtype=out_dtype, plan=plan)


@kernel_entry("out_dtype", "plan", "a_from", "dq_dtype", "scales_first", "lean", "mma", "part_rows")
def fp8_dq_linear(x: jax.Array, w: jax.Array, scale_inv: jax.Array, *, out_dtype=jnp.float32,
                  plan: Plan | None = None, a_from: str | None = None, counters=None,
                  dq_dtype: str = "bfloat16", scales_first: bool = False, lean: bool = False,
                  mma: str = "wgmma", part_rows: bool = False) -> jax.Array:
  """y = x @ dequant(w).T like :func:`fp8_linear` (same signature and reference), with the activations kept in
  bf16: no activation quantisation (fp8_linear's amax reduction + hi/lo quantisation: two XLA kernels of ~1.1 µs
  before every call, BENCHMARKS.md session 24) and bf16 · e4m3 products that are exact (hi/lo: ~9 significant
  bits of x). The price is the conversion of every weight element in registers.

  ``a_from``: "regs" (a register-A wgmma) or "smem" (the converted tile through SMEM: the only form GPU interpret
  mode runs, hence the default there; "regs" otherwise). Needs K % 128 == 0 and N % 64 == 0.

  ``counters``: the Ref of :func:`splitk_counters` — the K splits summed inside the kernel (its last split's CTAs
  add the others' partials) and, for up to ROWS_OUT_MAX token rows, written as y [M, N] in out_dtype itself
  (``_rows_out``): no XLA kernel after the call — the reduction, and the slice / transpose / cast a Mosaic
  consumer (the mHC boundary) cannot fuse. The counters need the GPU: in interpret mode (no counters) a K-split
  plan is summed by XLA; a one-split plan writes the rows there too.

  ``dq_dtype``: "bfloat16" or "float16" (``_dq_dtype``: x and the converted weight tiles in f16).

  ``scales_first``: each CTA requests all its block scales before its first weight tiles (``_fp8_linear_kernel``);
  the same sums, bit for bit.

  ``lean`` (policy knob lean_barriers): built without Mosaic GPU's automatic warpgroup barriers (one before each
  TMA load of the ring, two around each vector store of the epilogue), with the ring's refill barrier placed by
  hand; the same sums, bit for bit. The SMEM-A form (a_from "smem") ignores it.

  ``mma``: "wgmma" (Hopper) or "tcgen05" (Blackwell: the module docstring; A through SMEM, token rows padded to 16,
  128-row tiles — N % 128 == 0 — and the automatic barriers: ``a_from`` and ``lean`` do not apply).

  ``part_rows`` (2 .. ROWS_OUT_MAX token rows, the K splits summed by XLA): each split's partial written as the
  token rows [split, M, N] (one masked row sum per row, as the rows form) instead of the accumulator's [split, N,
  mp] — XLA's sum then reads rows and needs no transpose: one fusion with the cast where [split, N, mp] took a
  reduction and a transposing convert (two kernels after every call at q = 4). The same sums."""
  m = x.shape[0]
  dt = _dq_dtype(dq_dtype, "fp8_dq_linear")
  tc05 = check_mma(mma, "fp8_dq_linear")
  if m > 64:
    return jnp.concatenate([fp8_dq_linear(x[i:i + 64], w, scale_inv, out_dtype=out_dtype, plan=plan,
                                          a_from=a_from, counters=counters, dq_dtype=dq_dtype,
                                          scales_first=scales_first, lean=lean, mma=mma, part_rows=part_rows)
                            for i in range(0, m, 64)], axis=0)
  n, k = w.shape
  if x.shape[1] != k or w.dtype != F8:
    raise ValueError(f"bad shapes/dtypes: x {x.shape} w {w.shape} {w.dtype}")
  if k % BLOCK or n % MMA_BM.get(mma, 64):
    raise NotImplementedError(f"fp8_dq_linear (mma={mma}) needs K % 128 == 0 and N % {MMA_BM.get(mma, 64)} == 0, "
                              f"got N={n} K={k}")
  a_smem = tc05 or _a_smem(a_from)
  mp = _padded_rows(m, mma)
  plan = plan or plan_linear(n, k, mp, "fp8dq", mma=mma)
  if tc05 and plan.bm != MMA_BM[mma]:
    raise ValueError(f"fp8_dq_linear: mma='tcgen05' needs {MMA_BM[mma]}-row tiles, plan has bm={plan.bm}")
  counters, rows = _fused_form(counters, plan.split, n // plan.bm, m, "fp8_dq_linear")
  # (the fused form's rows, where it writes them, take precedence: no XLA sum at all)
  part_rows = _check_part_rows(part_rows, m, "fp8_dq_linear") and counters is None and not rows
  # x as it is where it can be (_tma_rows): the kernel's TMA reads mp rows and fills the rows past m with zeros
  # (no XLA pad kernel in front of every call: 135 of them per step at q = 1, ~300 at q = 4, ~1.2 µs each on the
  # H200, session 26)
  out = _fp8_launch(_tma_rows(_act(x, dt), mp), w, scale_inv, mp=mp, plan=plan, dq=True, a_smem=a_smem,
                    name="glm5_fp8_dq_linear", counters=counters, m=m, rows_dtype=out_dtype if rows else None,
                    scales_first=scales_first, lean=lean, tc05=tc05, part_rows=part_rows)
  if rows:
    return _rows_result(out, plan.split)
  return _split_sum(out, m, counters is not None, part_rows).astype(out_dtype)


def dequantize_fp8(w: jax.Array, scale_inv: jax.Array) -> jax.Array:
  """[R, C] e4m3 weight + [ceil(R/128), ceil(C/128)] scales -> f32 [R, C] (also works with leading dims)."""
  r, c = w.shape[-2:]
  s = jnp.repeat(jnp.repeat(scale_inv.astype(jnp.float32), BLOCK, axis=-2), BLOCK, axis=-1)[..., :r, :c]
  return w.astype(jnp.float32) * s


def fp8_linear_reference(x: jax.Array, w: jax.Array, scale_inv: jax.Array, *, out_dtype=jnp.float32) -> jax.Array:
  """Reference of :func:`fp8_linear`: fp32 dequant then an fp32 HIGHEST-precision dot. Shapes as there."""
  wd = dequantize_fp8(w, scale_inv)
  y = jnp.dot(x.astype(jnp.float32), wd.T, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
  return y.astype(out_dtype)


# ------------------------------------------------------------------------------------------------------------
# BF16 linear
# ------------------------------------------------------------------------------------------------------------
def _bf16_linear_kernel(x_ref, w_ref, *refs, plan: Plan, tiles: int, steps: int, fused_sum: bool = False,
                        rows: bool = False, tc05: bool = False, part_rows: bool = False):
  """One CTA = (row tile, K split); a single accumulator over the CTA's K range; writes o[split, rows, :mp].
  When bm does not divide N the last tile starts at N - bm (overlapping its neighbour, which writes the same
  values there): no out-of-bounds TMA box, the output keeps N rows; the offset stays a multiple of 8 rows, as
  the tiled SMEM copy needs, because N is. ``fused_sum``: refs start with the split-K counters; ``rows``: the sum
  written as token rows (``_split_out``, ``_out_refs``). ``tc05``: the tcgen05 form — the CTA's K range accumulated
  in TMEM, each MMA arriving on its slot's barrier when done (scratch: ``_tc_scratch`` with a barrier a slot).
  ``part_rows``: the partials as token rows [split, m, N] (``_out_refs``)."""
  ctr_g, o_ref, y, (w_s, x_s, bar, *tc) = _out_refs(refs, fused_sum, plan.split, rows, part_rows)
  bm, bk, stages = plan.bm, plan.bk, plan.stages
  n = w_ref.shape[0]
  t = lax.axis_index("t")
  tile, sk = t % tiles, t // tiles
  row0 = tile * bm if n % bm == 0 else jnp.minimum(tile * bm, n - bm)
  k_base = sk * steps * bk

  def issue(i):
    slot = i % stages
    k0 = k_base + i * bk
    plgpu.copy_gmem_to_smem(w_ref.at[pl.ds(row0, bm), pl.ds(k0, bk)], w_s.at[slot], bar.at[slot])
    plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(0, x_s.shape[1]), pl.ds(k0, bk)], x_s.at[slot], bar.at[slot])  # OOB: 0

  for i in range(stages):
    issue(i)

  # With >= 2 stages one wgmma stays in flight while the next tile is awaited, and the slot of the previous
  # step (whose wgmma has now finished) is refilled; with 1 stage the slot is refilled right after its wgmma.
  lag = 1 if stages >= 2 else 0

  def scope(acc):
    for i in range(steps):
      slot = i % stages
      plgpu.barrier_wait(bar.at[slot])
      plgpu.wgmma(acc, w_s.at[slot], x_s.at[slot].T)
      plgpu.wgmma_wait(lag)
      if i >= lag and i - lag + stages < steps:
        issue(i - lag + stages)
    return acc[...]

  def scope_tc05(acc_t, done, t_s):
    # the same ring; MMA i arrives on done[its slot] when it has finished (operands read, TMEM written). Every
    # arrival is waited exactly once, in order (the barriers' phases): MMA i - lag's before its slot's refill,
    # the last ones after the loop.
    for i in range(steps):
      slot = i % stages
      plgpu.barrier_wait(bar.at[slot])
      plgpu.tcgen05_mma(acc_t, w_s.at[slot], x_s.at[slot].T, done.at[slot], accumulate=i > 0)
      j = i - lag
      if j >= 0:
        plgpu.barrier_wait(done.at[j % stages])
        if j + stages < steps:
          issue(j + stages)
    for j in range(steps - lag, steps):
      plgpu.barrier_wait(done.at[j % stages])
    return tmem_to_wgmma(plgpu.async_load_tmem(acc_t), t_s)

  if tc05:
    acc = scope_tc05(*tc)
  else:
    acc = pl.run_scoped(scope, plgpu.ACC((bm, x_s.shape[1]), jnp.float32))
  _split_out(o_ref, ctr_g, acc, sk=sk, tile=tile, row0=row0, bm=bm, split=plan.split, rows=y)


@kernel_entry("out_dtype", "plan", "x_prefix", "mma", "part_rows", "balanced")
def bf16_linear(x: jax.Array, w: jax.Array, *, out_dtype=jnp.float32, plan: Plan | None = None,
                x_prefix: bool = False, counters=None, mma: str = "wgmma", part_rows: bool = False,
                balanced: bool = False) -> jax.Array:
  """y = x @ w.T for a BF16 weight (skinny GEMM: KDA projections, lm_head).

  Args:
    x: [M, K] (cast to bf16; M chunked by 64); w: [N, K] bf16. x_prefix: x may be [M, > K], its first K columns
      the input — read in place by the TMA when the width is a multiple of 64 (e.g. the KDA f_a | g_a inside the
      fgb_a output of a TP4 rank: 256 of 320 columns), else sliced first.
  Returns: y [M, N] out_dtype (fp32 accumulation).
  Needs K % 128 == 0, N % 8 == 0 and N >= 64 (e.g. the KDA layer's f_a | g_a | b, 272 rows).
  ``counters``: the K splits summed in the kernel (and the rows written by it), as :func:`fp8_dq_linear`'s.
  ``mma``: "wgmma" (Hopper) or "tcgen05" (Blackwell: 128-row tiles — N >= 128 — token rows padded to 16; the
  module docstring). ``part_rows``: the K splits' partials as token rows, as :func:`fp8_dq_linear`'s.
  ``balanced``: without ``plan``, the K splits that load the SMs most evenly (:func:`plan_linear`'s ``balanced``).
  """
  tc05 = check_mma(mma, "bf16_linear")
  m, kx = x.shape
  n, k = w.shape
  if kx != k and not (x_prefix and kx > k):
    raise ValueError(f"x {x.shape} vs w {w.shape} (x_prefix={x_prefix})")
  if kx != k and kx % 64:  # the TMA tiles the GMEM x by 64 columns: a ragged width is sliced first (XLA)
    x = x[:, :k]
  if m > 64:
    return jnp.concatenate([bf16_linear(x[i:i + 64], w, out_dtype=out_dtype, plan=plan, x_prefix=x_prefix,
                                        counters=counters, mma=mma, part_rows=part_rows, balanced=balanced)
                            for i in range(0, m, 64)], axis=0)
  n_min = MMA_BM.get(mma, 64)
  if n % 8 or n < n_min or k % 128:
    raise NotImplementedError(f"bf16_linear (mma={mma}) needs K % 128 == 0, N % 8 == 0 and N >= {n_min}, "
                              f"got N={n} K={k}")
  mp = _padded_rows(m, mma)
  plan = plan or plan_linear(n, k, mp, "bf16", mma=mma, balanced=balanced)
  if tc05 and plan.bm != MMA_BM[mma]:
    raise ValueError(f"bf16_linear: mma='tcgen05' needs {MMA_BM[mma]}-row tiles, plan has bm={plan.bm}")
  tiles = -(-n // plan.bm)
  steps = k // plan.bk // plan.split
  xp = _tma_rows(x.astype(jnp.bfloat16), mp)  # (the kernel's TMA zero-fills the rows up to mp)
  counters, rows = _fused_form(counters, plan.split, tiles, m, "bf16_linear")
  part_rows = _check_part_rows(part_rows, m, "bf16_linear") and counters is None and not rows
  kernel = functools.partial(_bf16_linear_kernel, plan=plan, tiles=tiles, steps=steps,
                             fused_sum=counters is not None, rows=rows, tc05=tc05, part_rows=part_rows)
  out = mgpu_kernel(
      kernel,
      out_type=_out_types(plan.split, n, mp, m, out_dtype if rows else None, part_rows),
      grid=(tiles * plan.split,),
      grid_names=("t",),
      kernel_name="glm5_bf16_linear",
      scratch_types=[
          plgpu.SMEM((plan.stages, plan.bm, plan.bk), jnp.bfloat16, transforms=_tr(jnp.bfloat16, plan.bk)),
          plgpu.SMEM((plan.stages, mp, plan.bk), jnp.bfloat16, transforms=_tr(jnp.bfloat16, plan.bk)),
          plgpu.Barrier(num_arrivals=2, num_barriers=plan.stages),
          *(_tc_scratch(plan.bm, mp, plan.stages) if tc05 else []),
          *([plgpu.SMEM((m, plan.bm), out_dtype)] if rows else []),
          *([plgpu.SMEM((m, plan.bm), jnp.float32)] if part_rows else []),
      ],
  )(xp, w.astype(jnp.bfloat16), *(() if counters is None else (counters,)))
  if rows:
    return _rows_result(out, plan.split)
  return _split_sum(out, m, counters is not None, part_rows).astype(out_dtype)


def bf16_linear_reference(x: jax.Array, w: jax.Array, *, out_dtype=jnp.float32, x_prefix: bool = False) -> jax.Array:
  """Reference of :func:`bf16_linear`: fp32 HIGHEST dot of the bf16 values. x [M, K] (x_prefix: [M, >= K], the
  first K columns), w [N, K] -> [M, N]."""
  x = x[:, :w.shape[1]] if x_prefix else x
  y = jnp.dot(x.astype(jnp.bfloat16).astype(jnp.float32), w.astype(jnp.float32).T,
              precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
  return y.astype(out_dtype)


# ------------------------------------------------------------------------------------------------------------
# FP8 routed experts
# ------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class MoePlan:
  """Tiling of :func:`fp8_moe`. gu_bm/gu_stages/gu_split: gate+up kernel rows per CTA / ring depth / D splits
  (1: the clamped SwiGLU runs in the kernel; > 1: partial sums, SwiGLU in the XLA glue that follows anyway);
  dn_bm/dn_groups/dn_stages: down kernel rows per CTA / expert groups (CTAs per row tile) / ring depth."""

  gu_bm: int
  gu_stages: int
  dn_bm: int
  dn_groups: int
  dn_stages: int
  gu_split: int = 1


def plan_moe(n_slots: int, inter: int, hidden: int, mp: int, *, gu_bm=None, gu_stages=None, gu_split=None,
             dn_bm=None, dn_groups=None, dn_stages=None, target_ctas: int = 2 * NUM_SMS, mma: str = "wgmma") -> MoePlan:
  """Default tiling for ``n_slots`` expert slots (the shared expert's included), I=inter, D=hidden, ``mp`` padded
  token rows.

  Both kernels stream, per CTA, a fixed number of weight bytes; the launch lasts as long as its most loaded SM.
  So the CTA counts aim at whole waves of co-resident CTAs (up to 3 per SM, rings sized to fit: 3 stages at
  mp = 8), not merely at >= 132: the step's M = 1 MoE has 9 slots (8 routed + the shared expert), and the
  previous rule (the largest split keeping <= 264 CTAs) gave the gate/up kernel 144 CTAs — 12 SMs streamed two
  CTAs' bytes while 120 idled for the second half (15.9 µs in the step vs 11.3 µs for 8 slots in 256 CTAs,
  session 26) — and the down kernel 8 expert groups for 9 slots, so that group 0 streamed twice the others' bytes.
  ``mma`` "tcgen05": 128-row tiles in both kernels, the rings sized around the form's SMEM tiles (not tuned on a
  Blackwell GPU)."""
  # gate+up: 64-row tiles; when the slots x tiles leave SMs idle (M=1: 9 slots x 8 tiles = 72 CTAs) split D:
  # the largest split that keeps every CTA resident at once (<= 3 per SM, rings sized to fit), so that no SM
  # streams a CTA more than the others after the rest have finished.
  tc05 = check_mma(mma, "plan_moe")
  if tc05:
    gu_bm, dn_bm = gu_bm or MMA_BM[mma], dn_bm or MMA_BM[mma]
  gu_bm = gu_bm or 64
  if inter % gu_bm:
    raise ValueError(f"I={inter} must be a multiple of {gu_bm}")
  gu_ctas = n_slots * (inter // gu_bm)
  db = hidden // BLOCK
  if gu_split is None:
    gu_split = 1 if gu_ctas >= NUM_SMS else _pick_split(gu_ctas, db, RESIDENT_PER_SM * NUM_SMS)
  if db % gu_split:
    raise ValueError(f"gu_split={gu_split} must divide D/128={db}")
  gu_stage_bytes = 2 * gu_bm * BLOCK + 2 * mp * BLOCK
  # Stages: as many as fit without a split (M=8: 6 stages 64 us vs 4 stages 71 us for the gate/up kernel);
  # with a split <= 4 (M=1: 4 stages were faster than 12 before the split existed; 11 us measured with it).
  if gu_stages is None and gu_split > 1:
    gu_stages = 4
  # (tcgen05: the dequantised A tile and the relayout tile besides the ring)
  reserve = (lambda bm: bm * BLOCK * 2 + bm * mp * 4) if tc05 else (lambda bm: 0)
  gu_st = _pick_stages(db // gu_split, gu_stage_bytes, gu_ctas * gu_split, gu_stages,
                       RESIDENT_PER_SM if gu_split > 1 else 2, reserve=reserve(gu_bm))
  # down: every CTA owns dn_bm hidden rows and loops over a 1/dn_groups share of the selected experts.
  dn_bm = dn_bm or (128 if (mp <= 32 and hidden % 128 == 0) else 64)
  if hidden % dn_bm:
    raise ValueError(f"D={hidden} must be a multiple of {dn_bm}")
  tiles = hidden // dn_bm
  resident = 2
  if dn_groups is None:
    dn_groups = max(1, min(n_slots, target_ctas // tiles))
    if -(-n_slots // dn_groups) == 2 and n_slots * tiles <= RESIDENT_PER_SM * NUM_SMS:
      # (M = 1: 9 slots) one slot per group instead of two in group 0; larger M keeps the deeper 2-per-SM
      # rings until a sweep says otherwise (bench_linear --sweep)
      dn_groups, resident = n_slots, RESIDENT_PER_SM
  dn_stage_bytes = dn_bm * BLOCK + 2 * mp * BLOCK
  steps_max = -(-n_slots // dn_groups) * (inter // BLOCK)
  dn_st = _pick_stages(max(steps_max, 1), dn_stage_bytes, tiles * dn_groups, dn_stages, resident,
                       reserve=reserve(dn_bm))
  return MoePlan(gu_bm=gu_bm, gu_stages=gu_st, dn_bm=dn_bm, dn_groups=dn_groups, dn_stages=dn_st,
                 gu_split=gu_split)


def _nth(vals, i):
  """vals[i] for a traced i among a static list's entries (a select per entry: register values, no memory)."""
  v = vals[0]
  for u in range(1, len(vals)):
    v = jnp.where(i == u, vals[u], v)
  return v


def _table_id(e, num_experts: int):
  """A router id read as a slot's expert: an id out of range (never from the router; its routing weight is masked
  to zero) reads expert 0."""
  return jnp.where((e >= 0) & (e < num_experts), e, 0)


def _slot_expert(ids_ref, s, *, table_k: int, shared: bool, num_experts: int):
  """The expert id of slot s. table_k = 0: ids_ref = eids [n_pad] (one per slot). table_k = k (a single token
  row): ids_ref = the row's k router ids — slot s is its (s − shared)-th expert (a static table, no XLA kernel to
  build it)."""
  if not table_k:
    return ids_ref[s]
  return _table_id(ids_ref[jnp.clip(s - int(shared), 0, table_k - 1)], num_experts)


def _moe_gate_up_kernel(*refs, mp: int, bm: int, stages: int, tiles: int, split: int, limit: float, shared: bool,
                        table_k: int, dq: bool = False, a_smem: bool = False, fused_sum: bool = False,
                        rows: bool = False, router: tuple | None = None, rows_weight: bool = True,
                        n_valid: int = 0, writer_t: int = 0, lean: bool = False, tc05: bool = False,
                        on_rows=None, on_select=None):
  """One CTA = (expert slot, bm rows of I, D split sk). split == 1: o = h [slots, I, mp] = SwiGLU(gate, up) in
  registers. split > 1: o = [split, slots, 2, I, mp] partial (gate, up) sums. Slots >= n_valid exit at once
  (their rows are left unwritten and masked by the caller). ``shared``: slot 0 is the shared expert, streamed
  from its own weight refs (wgs/sgs/wus/sus: one expert, no expert axis). ``dq``: x is bf16 [mp, D] (no amax
  operand) and each weight tile is dequantised to bf16 (``_mma_tile``; ``a_smem``: through a last SMEM scratch).
  ``rows`` (dq): h = SwiGLU times the slot's routing weights written as the down kernel's input rows hq [slots, m,
  I] bf16 (``_gate_up_rows``; the weights from an input after the shared expert's refs: the router's [1, k] with
  ``table_k``, else r [n_pad, mp]) — with ``fused_sum`` (split > 1) by the last D split's CTA of the (slot, row
  tile) on split-K counters (an input after the weights), the other splits' partials in o [split - 1, ...].
  ``rows_weight`` False: the rows without the routing weights (no weights input: the router's selection in the
  kernel, whose weights the down kernel applies). ``n_valid`` > 0: the count of valid
  slots as a static number (a single row's table: k + shared) instead of the nvalid input's GMEM read.
  ``writer_t``: the CTA that selects all k with their weights and stores them (``_router_in_kernel``'s writer): 0,
  or with the router's ranks form one CTA past the (slot, tile, split) grid that does only that — at t = 0 the
  writer was a shared-slot CTA that ran k rounds of 3 reductions and the stores before its own weight requests:
  s49a's profile had its first wait begin ~6.4 µs after the median CTA's, the kernel's last to finish. (Every
  step's block scales requested before the first weight tiles, session 52's moe_scale_prefetch, measured a tie
  twice: the tiles themselves arrive late, not their scales.) ``tc05`` (dq, a_smem): the tcgen05 form — scratch
  ``_tc_scratch``'s three before a_s; the sums in tcgen05's register layout through the loop, relaid out once
  after it. ``on_rows(slot)`` / ``on_select()`` (the one-grid MoE, ``_moe_one_grid_kernel``): called by the CTA
  that has just stored a (slot, row tile)'s h rows / the writer after storing the selection."""
  n_x = 1 if dq else 2  # x (and its amax)
  xq_ref, amax_ref = refs[0], (None if dq else refs[1])
  n_w = 10 if shared else 6
  if router is not None:  # (the router's logits and bias instead of its ids: one more input)
    eids_ref, refs = refs[n_x:n_x + 2], refs[:n_x] + refs[n_x + 1:]
  else:
    eids_ref = refs[n_x]
  nvalid_ref, wg_ref, sg_ref, wu_ref, su_ref = refs[n_x + 1:n_x + 6]
  wgs_ref, sgs_ref, wus_ref, sus_ref = refs[n_x + 6:n_x + n_w] if shared else (None,) * 4
  rest = list(refs[n_x + n_w:])
  rw_ref = rest.pop(0) if rows and rows_weight else None
  ctr_g, o_ref, y, rest = _out_refs(rest, fused_sum, split, rows)
  router_refs = [rest.pop(0) for _ in range(7)] if router is not None else None  # (outputs, then scratch first)
  a_s = rest.pop() if a_smem else None
  tc, t_s = (None, None) if not tc05 else (tuple(rest[-3:-1]), rest[-1])
  wg_s, wu_s, x_s, bar = rest[:-3] if tc05 else rest
  t = lax.axis_index("t")
  per_slot = tiles * split
  slot_id, rem = t // per_slot, t % per_slot
  tile, sk = rem % tiles, rem // tiles
  steps = xq_ref.shape[1] // BLOCK // split
  if router is not None:  # the router's selection in this CTA: the slot table from its registers (_router_in_kernel)
    with jax.named_scope("select"):
      eids_ref = _router_in_kernel(eids_ref, router_refs, router, writer=t == writer_t,
                                   rank=slot_id - int(shared), on_select=on_select)

  @pl.when(slot_id < (n_valid or nvalid_ref[0]))
  def _():
    e = _slot_expert(eids_ref, slot_id, table_k=table_k, shared=shared, num_experts=wg_ref.shape[0])
    row0 = tile * bm
    nb = row0 // BLOCK
    kb0 = sk * steps

    is_sh = slot_id == 0

    def issue(i):
      slot = i % stages
      k0 = (kb0 + i) * BLOCK

      def routed():
        plgpu.copy_gmem_to_smem(wg_ref.at[e, pl.ds(row0, bm), pl.ds(k0, BLOCK)], wg_s.at[slot], bar.at[slot])
        plgpu.copy_gmem_to_smem(wu_ref.at[e, pl.ds(row0, bm), pl.ds(k0, BLOCK)], wu_s.at[slot], bar.at[slot])

      def from_shared():  # the same two arrivals, from the shared expert's refs
        plgpu.copy_gmem_to_smem(wgs_ref.at[pl.ds(row0, bm), pl.ds(k0, BLOCK)], wg_s.at[slot], bar.at[slot])
        plgpu.copy_gmem_to_smem(wus_ref.at[pl.ds(row0, bm), pl.ds(k0, BLOCK)], wu_s.at[slot], bar.at[slot])

      if shared:
        pl.when(is_sh)(from_shared)
        pl.when(jnp.logical_not(is_sh))(routed)
      else:
        routed()
      plgpu.copy_gmem_to_smem(xq_ref.at[pl.ds(0, x_s.shape[1]), pl.ds(k0, BLOCK)], x_s.at[slot],
                              bar.at[slot])  # rows past x's: zeros from the TMA

    def raw_scales(i):  # step i's block scale loads: (gate, up[, the shared expert's gate, up])
      got = [sg_ref[e, nb, kb0 + i], su_ref[e, nb, kb0 + i]]
      return got + [sgs_ref[nb, kb0 + i], sus_ref[nb, kb0 + i]] if shared else got

    def scales(raw):  # (nothing computed on the loads before they are needed: no stall before the TMA issue)
      return [jnp.where(is_sh, raw[2 + c], raw[c]) for c in range(2)] if shared else raw

    with jax.named_scope("issue"):
      for i in range(min(stages, steps)):
        issue(i)

    def step(i, carry):  # a rolled loop: 32 unrolled steps x 4 wgmma scopes would be slow to lower
      acc_g, acc_u = carry
      slot = i % stages
      sg, su = scales(raw_scales(i))  # issued before the wait (the FMA at the step's end waits for them)
      with jax.named_scope("wait"):
        plgpu.barrier_wait(bar.at[slot])
      with jax.named_scope("mma"):
        g = _mma_tile(wg_s.at[slot], x_s.at[slot], mp, dq, a_s, tc=tc)
        u = _mma_tile(wu_s.at[slot], x_s.at[slot], mp, dq, a_s, tc=tc)
      pl.when(i + stages < steps)(lambda: _refill(issue, i + stages, lean))
      return acc_g + g * sg, acc_u + u * su

    zero = plgpu.layout_cast(jnp.zeros((bm, mp), jnp.float32),
                             plgpu.Layout.TCGEN05 if tc05 else plgpu.Layout.WGMMA)
    acc_g, acc_u = lax.fori_loop(0, steps, step, (zero, zero))
    if tc05:
      acc_g, acc_u = tmem_to_wgmma(acc_g, t_s), tmem_to_wgmma(acc_u, t_s)
    # the activations' scale, recomputed from their max: passing the scale itself made XLA compute it in a kernel
    # of its own (~1 µs per MoE layer), as its quantisation fusion and this call both read it
    sx = 1.0 if dq else activation_scale(amax_ref[0])
    if rows:
      def weight(r):  # the slot's routing weight for token row r (the shared slot: 1)
        if not table_k:
          return rw_ref[slot_id, r]
        j = jnp.clip(slot_id - int(shared), 0, table_k - 1)
        e_raw = eids_ref[j]
        w = jnp.where((e_raw >= 0) & (e_raw < wg_ref.shape[0]), rw_ref[0, j], 0.0)
        return jnp.where(is_sh, 1.0, w) if shared else w

      def out(g, u):
        _gate_up_rows(y, weight if rows_weight else None, g, u, limit=limit, slot=slot_id, row0=row0)
        if on_rows is not None:
          on_rows(slot_id)

      if ctr_g is None:
        out(acc_g, acc_u)
      else:  # (the gate and up partials of the (slot, row tile), summed on its counter)
        _split_reduce(ctr_g.at[pl.ds(slot_id * tiles + tile, 1)],
                      [o_ref.at[:, slot_id, j, pl.ds(row0, bm)] for j in (0, 1)], [acc_g, acc_u], out, sk=sk,
                      split=split)
    elif split == 1:
      gate = jnp.minimum(acc_g * sx, limit)
      up = jnp.clip(acc_u * sx, -limit, limit)
      o_ref[slot_id, pl.ds(row0, bm), :] = gate * jax.nn.sigmoid(gate) * up
    else:
      o_ref[sk, slot_id, 0, pl.ds(row0, bm), :] = acc_g * sx
      o_ref[sk, slot_id, 1, pl.ds(row0, bm), :] = acc_u * sx


def _refill(issue, i: int, lean: bool):
  """A weight-streaming kernel's ring refill: ``issue(i)`` into the slot the step just read — after a warpgroup
  barrier in a lean kernel (lean_barriers: Mosaic's automatic one before a TMA load is gone, and every warp must
  be done reading the slot, not only the thread that issues the copies)."""
  if lean:
    wg_barrier()
  issue(i)


def _router_in_kernel(lb_refs, router_refs, router: tuple, *, writer, rank, on_select=None):
  """The router's selection (pallas_kernels.router: the row's logits and bias staged into SMEM, rounds of
  reductions) inside a gate/up CTA of a single token row, before its first weight request — instead of a router
  kernel of its own on the MoE layer's critical path. router = (E, k, scaling, norm, ranks). (The selection with
  router._select_rows' warp-per-row reductions instead, policy router_warp_rows, was natively equal and slower in
  the step, session 42; removed in session 54.) ``router_refs``: the ids and weights outputs [1, k], then the
  scratch of ``router_scratch``. Every CTA selects all k with their weights, and the ``writer`` stores them for
  the down kernel and the glue; with ``ranks`` only the writer does, and every other CTA selects just the ranks
  up to its own (``rank``: its slot's rank among the routed experts, -1 for the shared slot: none), two
  reductions a round — a routed CTA then waits for rank + 1 rounds, not k rounds of three. Returns the slot table
  the CTA reads (slot s + shared = the s-th selected expert; with ``ranks`` the shared slot's CTAs leave it
  unwritten, which _slot_expert maps to an in-range id their shared weights never use)."""
  from pallas_kernels import router as kr  # noqa: PLC0415
  E, k, scaling, norm, ranks = router
  lg_ref, bg_ref = lb_refs
  rid_g, rw_g, l_s, b_s, ids_s, w_s, rbar = router_refs
  stage = lambda: kr._stage_row(lg_ref, bg_ref, l_s, b_s, rbar, 0, E)  # noqa: E731
  select = functools.partial(kr._select_row, l_s, b_s, E, k, scaling, norm)

  def store():  # the k ids and weights for the down kernel and the glue
    plgpu.copy_smem_to_gmem(ids_s.at[pl.ds(0, k)], rid_g.at[0])
    plgpu.copy_smem_to_gmem(w_s.at[pl.ds(0, k)], rw_g.at[0])
    plgpu.wait_smem_to_gmem(0)
    if on_select is not None:
      on_select()

  def select_all():
    stage()
    ids_v, w_v = select()
    ids_s[...] = ids_v
    w_s[...] = w_v
    plgpu.commit_smem()  # (its warpgroup barrier: the rows in SMEM before the TMA and every thread read them)

  if not ranks:
    select_all()
    pl.when(writer)(store)
    return ids_s

  @pl.when(writer)
  def _():
    select_all()
    store()

  @pl.when(jnp.logical_not(writer) & (rank >= 0))
  def _():
    stage()
    ids_s[...] = select(rounds=rank + 1)[0]
    plgpu.commit_smem()

  return ids_s


def router_scratch(E: int):
  """The gate/up kernel's scratch for ``_router_in_kernel`` (placed first: it is consumed from the front): the
  logits and bias [EP] f32, ids / weights [128], the staging barrier."""
  from pallas_kernels import router as kr  # noqa: PLC0415
  EP = -(-E // kr.LANES) * kr.LANES
  return [plgpu.SMEM((EP,), jnp.float32), plgpu.SMEM((EP,), jnp.float32), plgpu.SMEM((kr.LANES,), jnp.int32),
          plgpu.SMEM((kr.LANES,), jnp.float32), plgpu.Barrier(num_arrivals=2 * (-(-E // kr.BOX)))]


def _moe_down_kernel(*refs, mp: int, bm: int, stages: int, tiles: int, groups: int, shared: bool, table_k: int,
                     dq: bool = False, a_smem: bool = False, fused_sum: bool = False, rows: bool = False,
                     slot_weights: bool = False, n_valid: int = 0, stage_table: bool = False, lean: bool = False,
                     tc05: bool = False, part_rows: bool = False):
  """One CTA = (bm hidden rows, expert group g): o[g, rows, :mp] = sum over slots s = g, g+G, ... < n_valid and
  over I blocks of down_e[s][rows, blk] @ hq[s, :, blk].T (hi + lo/16) * block scale. Dynamic trip count.
  ``shared``: slot 0 is the shared expert (its own refs wds/sds). ``table_k``: as ``_slot_expert`` (the k ids
  are read once into registers; without it the slots' ids go to SMEM by one TMA). ``dq``: hq is bf16 h
  [slots, mp, I] and each weight tile is dequantised to bf16 (``a_smem``: through a last SMEM scratch).
  ``fused_sum`` / ``rows``: the groups' partials summed in the kernel on split-K counters (the groups as K splits;
  the last group's CTAs are dispatched last) / written as token rows, as ``_split_out``. ``slot_weights`` (with
  ``table_k``: one token row): hq holds h without the routing weights (the gate/up kernel's rows form with the
  router's selection inside it) and each slot's product is scaled by its weight here — the router's [1, k] f32
  (an input after the shared expert's refs; an id out of range weighs 0, the shared slot 1). ``n_valid`` > 0: the
  valid slots' count as a static number (with ``table_k``: k + shared) instead of the nvalid input's GMEM read
  before the first weight request. ``stage_table`` (with ``table_k``): the row's k ids (and weights) copied into
  SMEM by one TMA each and read there, instead of k (2k) scalar GMEM loads by every thread of every CTA (s49a's
  profile: the down CTAs' first wait began ~6 µs after their start, of a ~10 µs kernel). ``tc05``: as the gate/up
  kernel's (``_tc_scratch``'s three before a_s)."""
  n_in = (7 if shared else 5) + int(slot_weights)
  hq_ref, eids_ref, nvalid_ref, wd_ref, sd_ref = refs[:5]
  wds_ref, sds_ref = refs[5:7] if shared else (None, None)
  rw_ref = refs[n_in - 1] if slot_weights else None
  ctr_g, o_ref, y, rest = _out_refs(refs[n_in:], fused_sum, groups, rows, part_rows)
  a_s = rest.pop() if a_smem else None
  tc, t_s = None, None
  if tc05:
    *rest, acc_t, bar_mma, t_s = rest
    tc = (acc_t, bar_mma)
  if table_k:
    eid_s = ebar = None
    if stage_table:  # (the row's ids and weights in SMEM, their barrier)
      *rest, tid_s, tw_s, tbar = rest
    w_s, x_s, bar = rest
  else:
    w_s, x_s, eid_s, bar, ebar = rest
  t = lax.axis_index("t")
  g, tile = t // tiles, t % tiles
  row0 = tile * bm
  nb = row0 // BLOCK
  ib_n = hq_ref.shape[2] // BLOCK
  if table_k:  # the row's k ids as scalars (a select per step instead of an SMEM read)
    with jax.named_scope("table"):
      src_ids, src_w = eids_ref, (rw_ref.at[0] if slot_weights else None)
      if stage_table:  # one TMA each, then SMEM reads
        plgpu.copy_gmem_to_smem(eids_ref, tid_s, tbar.at[0])
        if slot_weights:
          plgpu.copy_gmem_to_smem(rw_ref.at[0], tw_s, tbar.at[0])
        plgpu.barrier_wait(tbar.at[0])
        src_ids, src_w = tid_s, tw_s
      raw = [src_ids[j] for j in range(table_k)]
      ids = [_table_id(e, wd_ref.shape[0]) for e in raw]
      if slot_weights:  # (and their weights, read once)
        wts = [jnp.where((e >= 0) & (e < wd_ref.shape[0]), src_w[j], 0.0) for j, e in enumerate(raw)]
  else:  # expert ids of all slots into SMEM once (cheap scalar reads in the loop, no GMEM latency per step)
    plgpu.copy_gmem_to_smem(eids_ref, eid_s, ebar.at[0])
  nvalid = n_valid or nvalid_ref[0]
  my_slots = jnp.maximum(nvalid - g + groups - 1, 0) // groups
  total = my_slots * ib_n
  if not table_k:
    plgpu.barrier_wait(ebar.at[0])

  def pick(vals, s):  # vals[s - shared] (the shared slot, j = -1, reads vals[0]: its weights come from wds/sds)
    return _nth(vals, s - int(shared))

  def slot_expert(s):
    if not table_k:
      return eid_s[s // 8, s % 8]
    return pick(ids, s)

  def where(j):
    s = g + groups * (j // ib_n)
    return s, j % ib_n, slot_expert(s)

  def issue(j):
    slot = j % stages
    s, ib, e = where(j)

    def routed():
      plgpu.copy_gmem_to_smem(wd_ref.at[e, pl.ds(row0, bm), pl.ds(ib * BLOCK, BLOCK)], w_s.at[slot], bar.at[slot])

    if shared:
      pl.when(s == 0)(lambda: plgpu.copy_gmem_to_smem(
          wds_ref.at[pl.ds(row0, bm), pl.ds(ib * BLOCK, BLOCK)], w_s.at[slot], bar.at[slot]))
      pl.when(s != 0)(routed)
    else:
      routed()
    # (h of the gate/up kernel's rows form has only the m real rows: the TMA zero-fills the rest up to mp)
    plgpu.copy_gmem_to_smem(hq_ref.at[s, pl.ds(0, x_s.shape[1]), pl.ds(ib * BLOCK, BLOCK)], x_s.at[slot],
                            bar.at[slot])

  def raw_scale(ib, e):  # the block scale loads of (I block ib, expert e)[, the shared expert's]
    return [sd_ref[e, nb, ib]] + ([sds_ref[nb, ib]] if shared else [])

  def block_scale(s, raw):  # slot s's scale from its loads, times the slot's routing weight
    scale = raw[0]
    if slot_weights:
      scale = scale * pick(wts, s)
    if shared:
      scale = jnp.where(s == 0, raw[1], scale)
    return scale

  with jax.named_scope("issue"):
    for p in range(stages):
      pl.when(p < total)(functools.partial(issue, p))

  def step(j, acc):
    slot = j % stages
    s, ib, e = where(j)
    with jax.named_scope("scale"):  # (the block scale's GMEM load: the scope shows whether its latency stalls)
      scale = block_scale(s, raw_scale(ib, e))
    with jax.named_scope("wait"):
      plgpu.barrier_wait(bar.at[slot])
    with jax.named_scope("mma"):
      blk = _mma_tile(w_s.at[slot], x_s.at[slot], mp, dq, a_s, tc=tc)
    pl.when(j + stages < total)(lambda: _refill(issue, j + stages, lean))
    return acc + blk * scale

  acc0 = plgpu.layout_cast(jnp.zeros((bm, mp), jnp.float32), plgpu.Layout.TCGEN05 if tc05 else plgpu.Layout.WGMMA)
  acc = lax.fori_loop(0, total, step, acc0)
  if tc05:
    acc = tmem_to_wgmma(acc, t_s)
  _split_out(o_ref, ctr_g, acc, sk=g, tile=tile, row0=row0, bm=bm, split=groups, rows=y)


# The one-grid MoE's counters in splitk_counters' Ref (one Ref per traced scope, zero-filled once per step): the
# gate/up D splits' sums use [0, slots x I/gu_bm) (with D splits) and the down phase's slot sums [ONE_GRID_SUMS,
# + D/dn_bm) — both self-resetting (each waiter takes its count back) — and the counters that many CTAs wait on
# without taking (a slot's h rows ready: its I/gu_bm row tiles' writers each add 1; the selection stored: the
# writer adds 1) alternate between two banks by call (``parity``): a call's CTA 0 zeroes the other bank, which the
# next call uses. So consecutive calls on one Ref must alternate their parity (layers._next_moe_parity), and the
# banks are left non-zero: the fused-sum linears' row tiles stop below ONE_GRID_BANKS (_fused_counters).
ONE_GRID_SUMS = 128
ONE_GRID_BANKS = 224
_ONE_GRID_BANK = 16  # per bank: up to 15 slots' h-ready counters, then the selection's (the bank's last)


def _one_grid_bank(parity: int) -> int:
  return ONE_GRID_BANKS + parity * _ONE_GRID_BANK


def _moe_down_phase(t, hq_ref, rid_ref, rw_ref, wd_ref, sd_ref, wds_ref, sds_ref, o_ref, y, w_s, h_s, bar, *,
                    mp: int, bm: int, stages: int, tiles: int, slots: int, shared: bool, k: int, lean: bool,
                    ctr=None, bank: int = 0, gu_tiles: int = 0, a_s=None):
  """The one-grid MoE's down role of CTA t = (slot g, bm hidden rows ``tile``): the slot's expert and routing weight
  from the stored selection (rid / rw [1, k]; the shared slot 0: its own refs, weight 1), its first ``stages``
  weight tiles requested, then — ``ctr`` given: on the GPU — the slot's h rows awaited (its I/64 gate/up row
  tiles' writers each raise the bank's slot counter), h's tiles requested, the slot's product over I summed, times
  the weight, and the slots of the row tile summed by the last slot's CTA (``_split_reduce`` on counter
  ONE_GRID_SUMS + tile) and written as the rows y. Without ``ctr`` (GPU interpret mode: no counters) the weighted
  product goes to o[g] and XLA sums the slots. ``a_s``: the dequantised weight tile's SMEM (interpret mode's form).
  Its product per I block is (W tile @ h.T) x the block scale, the routing weight applied once to the slot's sum
  (the two-kernel form folds it into every block's scale: the same up to f32 rounding)."""
  g, tile = t // tiles, t % tiles
  row0 = tile * bm
  nb = row0 // BLOCK
  ib_n = hq_ref.shape[2] // BLOCK
  E = wd_ref.shape[0]
  if ctr is not None:
    with jax.named_scope("wait_sel"):  # (the writer CTA, dispatched last, selects at once: ~5 µs in, normally
      # before this CTA's gate/up item ends)
      counter_wait(ctr.at[pl.ds(bank + _ONE_GRID_BANK - 1, 1)], 1)
  j = jnp.clip(g - int(shared), 0, k - 1)  # (the slot's rank among the routed experts)
  e_raw = rid_ref[0, j]
  e = _table_id(e_raw, E)
  wt = jnp.where((e_raw >= 0) & (e_raw < E), rw_ref[0, j], 0.0)
  is_sh = g == 0
  if shared:
    wt = jnp.where(is_sh, 1.0, wt)

  def issue_w(i):
    slot = i % stages

    def routed():
      plgpu.copy_gmem_to_smem(wd_ref.at[e, pl.ds(row0, bm), pl.ds(i * BLOCK, BLOCK)], w_s.at[slot], bar.at[slot])

    if shared:
      pl.when(is_sh)(lambda: plgpu.copy_gmem_to_smem(wds_ref.at[pl.ds(row0, bm), pl.ds(i * BLOCK, BLOCK)],
                                                     w_s.at[slot], bar.at[slot]))
      pl.when(jnp.logical_not(is_sh))(routed)
    else:
      routed()

  def issue_h(i):  # (h has the m real rows: the TMA zero-fills the rest up to mp)
    plgpu.copy_gmem_to_smem(hq_ref.at[g, pl.ds(0, h_s.shape[1]), pl.ds(i * BLOCK, BLOCK)], h_s.at[i % stages],
                            bar.at[i % stages])

  first = min(stages, ib_n)
  with jax.named_scope("issue"):
    for i in range(first):
      issue_w(i)
  if ctr is not None:
    with jax.named_scope("wait_h"):  # (the slot's h rows, TMA-stored by other CTAs: a proxy fence after)
      counter_wait(ctr.at[pl.ds(bank + g, 1)], gu_tiles, async_reads=True)
  for i in range(first):
    issue_h(i)

  def step(i, acc):
    slot = i % stages
    sc = sd_ref[e, nb, i]
    if shared:
      sc = jnp.where(is_sh, sds_ref[nb, i], sc)
    with jax.named_scope("wait"):
      plgpu.barrier_wait(bar.at[slot])
    with jax.named_scope("mma"):
      blk = _mma_tile(w_s.at[slot], h_s.at[slot], mp, True, a_s)

    def refill():
      if lean:
        wg_barrier()
      issue_w(i + stages)
      issue_h(i + stages)

    pl.when(i + stages < ib_n)(refill)
    return acc + blk * sc

  acc0 = plgpu.layout_cast(jnp.zeros((bm, mp), jnp.float32), plgpu.Layout.WGMMA)
  acc = lax.fori_loop(0, ib_n, step, acc0) * wt
  if ctr is None:
    o_ref[g, pl.ds(row0, bm), :] = acc
    return
  _split_reduce(ctr.at[pl.ds(ONE_GRID_SUMS + tile, 1)], [o_ref.at[:, pl.ds(row0, bm)]], [acc],
                lambda tot: _rows_out(y, tot, row0=row0), sk=g, split=slots)


def _h_rows_plan_why(m: int, dq: bool, plan, counters, router: bool) -> str:
  """Why fp8_moe(h_rows=True) cannot run ('' when it can)."""
  need = [(dq, "dq"), (1 < m <= ROWS_OUT_MAX, f"2..{ROWS_OUT_MAX} token rows (here {m})"),
          (plan.gu_split == 1, f"a plan of one D split (here {plan.gu_split})"),
          (counters is None, "no counters (with them the rows form is the counters')"),
          (not router, "no router in the kernel (its one-row form has its own rows: counters)")]
  return "; ".join(f"needs {what}" for ok, what in need if not ok)


def h_rows_why(m: int, n_slots: int, inter: int, d: int, mma: str = "wgmma") -> str:
  """Why fp8_moe(h_rows=True) cannot run a MoE of m token rows over n_slots slots (the shared one included) with
  its default plan ('' when it can): for a model's call site (policy knob moe_h_rows)."""
  return _h_rows_plan_why(m, True, plan_moe(n_slots, inter, d, _padded_rows(m, mma), mma=mma), None, False)


def _one_grid_refusal(parity, *, m, dq, router, writer, static, counters, tc05) -> str:
  """Why fp8_moe's one-grid form cannot take this call's options ('' when it can; the plan: _one_grid_plan_why)."""
  if isinstance(parity, bool) or parity not in (0, 1):
    return f"expected the call's parity, 0 or 1 (an int, alternating between consecutive calls), got {parity!r}"
  ok_ctr = counters is not None and counters.shape == (SPLITK_COUNTERS,) and counters.dtype == jnp.int32
  need = [(m == 1, f"one token row (here {m})"), (dq, "dq"), (router, "the router in its ranks form"),
          (writer, "writer_cta"), (static, "static_table"),
          (ok_ctr, f"splitk_counters()' int32 [{SPLITK_COUNTERS}] Ref (here "
                   f"{None if counters is None else (counters.shape, str(counters.dtype))})"),
          (not tc05, "wgmma (Hopper)")]
  return "; ".join(f"needs {what}" for ok, what in need if not ok)


def _one_grid_smem(plan, mp: int, dt_bytes: int, n_experts: int) -> int:
  """A one-grid CTA's SMEM bytes: the larger role's ring (the two are scoped) and the router's staging."""
  ring = max(plan.gu_stages * (2 * plan.gu_bm * BLOCK + mp * BLOCK * dt_bytes),
             plan.dn_stages * (plan.dn_bm * BLOCK + mp * BLOCK * dt_bytes))
  return ring + 2 * _round_up(n_experts, 128) * 4 + 2 * 128 * 4 + 4096


def _one_grid_plan_why(plan, n_slots: int, inter: int, d: int, mp: int, dt_bytes: int, n_experts: int) -> str:
  """Why the one-grid form cannot run this plan ('' when it can): its counters' ranges, and every CTA of the grid
  resident at once (the down roles wait for other CTAs' h rows) — by SMEM against the SM's 227 KB, 1 KB reserved
  per CTA. (Registers are not checked here: three CTAs per SM ran on an H100 in session 60.)"""
  gu_tiles, dn_tiles = inter // plan.gu_bm, d // plan.dn_bm
  grid = max(n_slots * gu_tiles * plan.gu_split, n_slots * dn_tiles) + 1
  smem = _one_grid_smem(plan, mp, dt_bytes, n_experts)
  need = [(n_slots < _ONE_GRID_BANK, f"at most {_ONE_GRID_BANK - 1} expert slots (here {n_slots})"),
          (plan.gu_split == 1 or n_slots * gu_tiles <= ONE_GRID_SUMS,
           f"slots x I/gu_bm <= {ONE_GRID_SUMS} with D splits (here {n_slots} x {gu_tiles})"),
          (dn_tiles <= ONE_GRID_BANKS - ONE_GRID_SUMS,
           f"D/dn_bm <= {ONE_GRID_BANKS - ONE_GRID_SUMS} (here {dn_tiles})"),
          ((227 * 1024 // (smem + 1024)) * NUM_SMS >= grid,
           f"its {grid} CTAs of ~{smem // 1024} KB of SMEM all resident on {NUM_SMS} SMs (plan {plan})")]
  return "; ".join(f"needs {what}" for ok, what in need if not ok)


def one_grid_why(m: int, k: int, n_experts: int, shared: bool, inter: int, d: int) -> str:
  """Why fp8_moe(one_grid=...) cannot run a MoE of this shape with its default plan ('' when it can): for a model's
  call site to decline the form with the reason (policy knob moe_one_grid) instead of raising."""
  if m != 1:
    return f"needs one token row (here {m})"
  if inter % BLOCK or d % BLOCK:
    return f"needs I and D multiples of {BLOCK} (here {inter}, {d})"
  n_slots, mp = min(n_experts, k) + int(shared), _padded_rows(1)
  plan = plan_moe(n_slots, inter, d, mp, gu_stages=3)
  return _one_grid_plan_why(plan, n_slots, inter, d, mp, 2, n_experts)


def _moe_one_grid_kernel(*refs, gu_kw: dict, n_gu_in: int, shared: bool, k: int, gu_grid: int, dn_grid: int,
                         writer_t: int, gu_tiles: int, dn_tiles: int, slots: int, m: int, mp: int, dt, out_dtype,
                         gu_bm: int, gu_stages: int, dn_bm: int, dn_stages: int, lean: bool, parity: int,
                         n_sel: int):
  """fp8_moe's one-grid form (``one_grid``): CTA t < gu_grid runs gate/up item t (``_moe_gate_up_kernel``'s rows
  form: its D splits summed on the counters, h written by each (slot, row tile)'s last split, which then raises
  the slot's h-ready counter), the writer CTA the selection (then raising the selection's counter), and CTA t <
  dn_grid then the down item t (``_moe_down_phase``: its weights requested at once, h awaited). Each role's SMEM
  ring is scoped (run_scoped), so the roles share it: ~58 KB a CTA, three resident per SM, and every CTA of the
  grid resident at once — which the counter waits need (_moe_one_grid checks the SMEM; the registers allowed three
  CTAs per SM on the H100 it ran on). ``n_sel``: the number of the router's scratch refs."""
  refs = list(refs)
  gu_in = refs[:n_gu_in]
  n_dn = 4 if shared else 2
  wd, sd, *sh = refs[n_gu_in:n_gu_in + n_dn]
  wds, sds = sh if shared else (None, None)
  rest = refs[n_gu_in + n_dn:]
  ctr = rest.pop(0)
  o_gu = rest.pop(0) if gu_kw["split"] > 1 else None  # (the D splits' partials)
  hq, rid, rw, o_dn, y_g = rest[:5]
  sel_scr, (gbar, dbar) = rest[5:5 + n_sel], rest[5 + n_sel:]
  t = lax.axis_index("t")
  # (the parity static — the build measured natively in session 60 — each parity its own module)
  bank, other = _one_grid_bank(parity), _one_grid_bank(1 - parity)

  @pl.when(t == 0)
  def _():  # (the other bank, for the next call: the previous call that used it is done)
    for i in range(_ONE_GRID_BANK):
      ctr[other + i] = jnp.int32(0)

  def gate_up(wg_s, wu_s, x_s, hy_s):
    _moe_gate_up_kernel(
        *gu_in, *([ctr, o_gu] if o_gu is not None else []), hq, rid, rw, *sel_scr, wg_s, wu_s, x_s, gbar, hy_s,
        **gu_kw,
        on_rows=lambda slot: counter_publish(ctr.at[pl.ds(bank + slot, 1)]),
        on_select=lambda: counter_publish(ctr.at[pl.ds(bank + _ONE_GRID_BANK - 1, 1)]))

  @pl.when((t < gu_grid) | (t == writer_t))
  def _():
    pl.run_scoped(gate_up, plgpu.SMEM((gu_stages, gu_bm, BLOCK), F8, transforms=_tr(F8, BLOCK)),
                  plgpu.SMEM((gu_stages, gu_bm, BLOCK), F8, transforms=_tr(F8, BLOCK)),
                  plgpu.SMEM((gu_stages, mp, BLOCK), dt, transforms=_tr(dt, BLOCK)), plgpu.SMEM((m, gu_bm), dt))

  def down(w_s, h_s, y_s):  # (its profile scopes under "down/": the gate/up role's are "select", "wait", "mma")
    with jax.named_scope("down"):
      _moe_down_phase(t, hq, rid, rw, wd, sd, wds, sds, o_dn, (y_g, y_s), w_s, h_s, dbar, mp=mp, bm=dn_bm,
                      stages=dn_stages, tiles=dn_tiles, slots=slots, shared=shared, k=k, lean=lean, ctr=ctr,
                      bank=bank, gu_tiles=gu_tiles)

  @pl.when(t < dn_grid)
  def _():
    pl.run_scoped(down, plgpu.SMEM((dn_stages, dn_bm, BLOCK), F8, transforms=_tr(F8, BLOCK)),
                  plgpu.SMEM((dn_stages, mp, BLOCK), dt, transforms=_tr(dt, BLOCK)),
                  plgpu.SMEM((m, dn_bm), out_dtype))


def _moe_one_grid(x_in, logits, bias, n_valid, gu_w, sh_gu, dn_w, sh_dn, counters, *, plan, m, mp, dt, k,
                  sel_static, sel_scratch, n_slots, n_pad, inter, d, limit, shared, lean, parity, out_dtype):
  """fp8_moe's one-grid launch (its checks done) -> (y [m, D] out_dtype, ids [1, k], weights [1, k])."""
  gu_tiles, split = inter // plan.gu_bm, plan.gu_split
  dn_tiles = d // plan.dn_bm
  gu_grid, dn_grid = n_slots * gu_tiles * split, n_slots * dn_tiles
  grid = max(gu_grid, dn_grid) + 1
  f32 = jnp.float32
  gu_kw = dict(mp=mp, bm=plan.gu_bm, stages=plan.gu_stages, tiles=gu_tiles, split=split, limit=limit,
               shared=shared, table_k=k, dq=True, a_smem=False, fused_sum=split > 1, rows=True, router=sel_static,
               rows_weight=False, n_valid=n_slots, writer_t=grid - 1, lean=lean)
  gu_out = (jax.ShapeDtypeStruct((split - 1, n_pad, 2, inter, mp), f32),) if split > 1 else ()
  outs = mgpu_kernel(
      functools.partial(_moe_one_grid_kernel, gu_kw=gu_kw, n_gu_in=len(x_in) + 3 + 4 + len(sh_gu), shared=shared,
                        k=k, gu_grid=gu_grid, dn_grid=dn_grid, writer_t=grid - 1, gu_tiles=gu_tiles,
                        dn_tiles=dn_tiles, slots=n_slots, m=m, mp=mp, dt=dt, out_dtype=out_dtype,
                        gu_bm=plan.gu_bm, gu_stages=plan.gu_stages, dn_bm=plan.dn_bm, dn_stages=plan.dn_stages,
                        lean=lean, parity=parity, n_sel=len(sel_scratch)),
      compiler_params=plgpu.CompilerParams(unsafe_no_auto_barriers=lean),
      out_type=(*gu_out, jax.ShapeDtypeStruct((n_pad, m, inter), dt), jax.ShapeDtypeStruct((1, k), jnp.int32),
                jax.ShapeDtypeStruct((1, k), f32), jax.ShapeDtypeStruct((n_slots - 1, d, mp), f32),
                jax.ShapeDtypeStruct((m, d), out_dtype)),
      grid=(grid,),
      grid_names=("t",),
      kernel_name="glm5_moe_one_grid",
      scratch_types=[*sel_scratch, plgpu.Barrier(num_arrivals=3, num_barriers=plan.gu_stages),
                     plgpu.Barrier(num_arrivals=2, num_barriers=plan.dn_stages)],
  )(*x_in, logits, bias, n_valid, *gu_w, *sh_gu, *dn_w, *sh_dn, counters)
  *_, rid, rw, _, y = outs
  return y, rid, rw


def _one_grid_down_launch(hq, rid, rw, dn_w, sh_dn, *, plan, mp, dt, n_slots, a_smem):
  """The one-grid form's down role as a launch of its own (GPU interpret mode: no counters): hq [slots, m, I]
  unweighted -> o [slots, D, mp] f32, slot g's product times its routing weight (XLA sums the slots)."""
  d = dn_w[0].shape[1]
  dn_tiles = d // plan.dn_bm
  shared = bool(sh_dn)

  def body(hq_ref, rid_ref, rw_ref, wd, sd, *rest):
    wds, sds = rest[:2] if shared else (None, None)
    o_ref, w_s, h_s, bar, *a_s = rest[2 if shared else 0:]
    _moe_down_phase(lax.axis_index("t"), hq_ref, rid_ref, rw_ref, wd, sd, wds, sds, o_ref, None, w_s, h_s, bar,
                    mp=mp, bm=plan.dn_bm, stages=plan.dn_stages, tiles=dn_tiles, slots=n_slots, shared=shared,
                    k=rid.shape[1], lean=False, a_s=a_s[0] if a_s else None)

  return mgpu_kernel(
      body, out_type=jax.ShapeDtypeStruct((n_slots, d, mp), jnp.float32), grid=(n_slots * dn_tiles,),
      grid_names=("t",), kernel_name="glm5_moe_one_grid_down",
      scratch_types=[plgpu.SMEM((plan.dn_stages, plan.dn_bm, BLOCK), F8, transforms=_tr(F8, BLOCK)),
                     plgpu.SMEM((plan.dn_stages, mp, BLOCK), dt, transforms=_tr(dt, BLOCK)),
                     plgpu.Barrier(num_arrivals=2, num_barriers=plan.dn_stages)] +
                    ([plgpu.SMEM((plan.dn_bm, BLOCK), dt, transforms=_tr(dt, BLOCK))] if a_smem else []),
  )(hq, rid, rw, *dn_w, *sh_dn)


def _distinct_ids(ids, num_experts: int, size: int):
  """jnp.unique(ids, size=size, fill_value=num_experts) for ids in [0, num_experts) (others are dropped), without
  a sort: the present experts [E] (one compare-and-reduce over ids), their inclusive running count, and slot s =
  #{e : count(e) <= s} — the (s+1)-th present expert in ascending order, or E past the last. At M = 4 the sort
  and its compaction were ~5 small XLA kernels per MoE layer (bench_linear, session 24). The running count is an
  [E, E] masked sum, not a cumsum: on the GPU a cumsum is a reduce-window kernel of its own, the sum fuses."""
  e = jnp.arange(num_experts, dtype=jnp.int32)
  present = jnp.any(ids[None, :] == e[:, None], axis=1).astype(jnp.int32)  # [E]
  below = (e[None, :] <= e[:, None]).astype(jnp.int32)  # [E (e), E (e')]: e' <= e
  count = jnp.sum(below * present[None, :], axis=1)  # [E] inclusive running count (exact integer sums)
  s = jnp.arange(size, dtype=jnp.int32)
  return jnp.sum((count[None, :] <= s[:, None]).astype(jnp.int32), axis=1)  # [size]


def _route(topk_ids, topk_weights, num_experts: int, n_slots: int, n_pad: int, mp: int):
  """Distinct selected experts and the [slot, token] routing-weight matrix (small XLA ops).

  Returns eids [n_pad] int32 (valid first, then 0; for a single row its k router ids as they are, which the
  kernels read as a static slot table: ``_slot_expert``), n_valid [1] int32, valid [n_pad] bool, r [n_pad, mp] f32.
  """
  m, k = topk_ids.shape
  ids = topk_ids.astype(jnp.int32)
  if m == 1:  # a top-k row has k distinct experts: slot j is the row's j-th expert, a static table — only the
    # ids and weights move (at B = 1, q = 1 this glue was 4 small XLA kernels per MoE layer; now the pads and
    # masks fuse into their consumers). n_valid stays k: an out-of-range id (never from the router) becomes
    # expert 0 with its weights masked to zero, as below.
    valid = jnp.pad((ids[0] >= 0) & (ids[0] < num_experts), (0, n_pad - k))
    r = jnp.pad(jnp.where(valid[:k], topk_weights[0].astype(jnp.float32), 0.0)[:, None],
                ((0, n_pad - k), (0, mp - 1)))
    return ids[0], np.full((1,), k, np.int32), valid, r
  uniq = _distinct_ids(ids.reshape(-1), num_experts, n_pad)
  valid = uniq < num_experts
  eids = jnp.where(valid, uniq, 0).astype(jnp.int32)
  n_valid = jnp.sum(valid.astype(jnp.int32)).reshape(1)
  hit = (ids[None, :, :] == uniq[:, None, None]) & valid[:, None, None]  # [n_pad, M, k]
  r = jnp.sum(jnp.where(hit, topk_weights.astype(jnp.float32)[None], 0.0), axis=-1)  # [n_pad, M]
  r = jnp.pad(r, ((0, 0), (0, mp - m)))
  return eids, n_valid, valid, r


def _route_with_shared(topk_ids, topk_weights, num_experts: int, n_slots: int, mp: int, shared: bool,
                       table_k: int):
  """``_route`` over n_slots routed slots, then (``shared``) the shared expert as slot 0 with weight 1 for the m
  real rows, the routed slots after it -> (eids, n_valid, valid, r, the slot count)."""
  eids, n_valid, valid, r = _route(topk_ids, topk_weights, num_experts, n_slots, _round_up(n_slots, 8), mp)
  if shared:
    m = topk_ids.shape[0]
    n_slots += 1
    pad = _round_up(n_slots, 8) - n_slots
    if not table_k:
      eids = jnp.pad(jnp.concatenate([jnp.zeros((1,), jnp.int32), eids[:n_slots - 1]]), (0, pad))
    valid = jnp.pad(jnp.concatenate([jnp.ones((1,), bool), valid[:n_slots - 1]]), (0, pad))
    r = jnp.pad(jnp.concatenate([(jnp.arange(mp) < m).astype(jnp.float32)[None], r[:n_slots - 1]]),
                ((0, pad), (0, 0)))
    n_valid = n_valid + 1
  return eids, n_valid, valid, r, n_slots


ROUTE_MAX_PAIRS = 64  # token rows x k up to which moe_route runs (its first-occurrence scan is quadratic)
_LANES = 128


def moe_route_reference(topk_ids, topk_weights, *, num_experts: int, n_pad: int, mp: int, shared: bool):
  """The slot table of ``fp8_moe`` for M > 1 rows in first-occurrence order: slot 0 = the shared expert when
  ``shared`` (weight 1 for the M rows), then each distinct expert in the order its first (row, j) pair appears
  (row-major). topk_ids [M, k] int32 (ids outside [0, num_experts) are dropped), topk_weights [M, k] f32 ->
  (eids [n_pad] int32 (0 past the valid slots), n_valid [4] int32 (all four = the valid slot count), r [n_pad,
  mp] f32: r[s, m] = the summed weight of row m's pairs routed to slot s, 0 elsewhere)."""
  M, k = topk_ids.shape
  ids = topk_ids.reshape(-1).astype(jnp.int32)
  P = M * k
  ok = (ids >= 0) & (ids < num_experts)
  i = jnp.arange(P)
  same = (ids[:, None] == ids[None, :]) & ok[:, None] & ok[None, :]
  first = jnp.min(jnp.where(same, i[None, :], P), axis=1)  # the first pair with my expert (P: dropped)
  new = ok & (first == i)
  sh = int(shared)
  slot_of_first = jnp.cumsum(new.astype(jnp.int32)) - 1 + sh
  slot = jnp.where(ok, slot_of_first[jnp.minimum(first, P - 1)], -1)  # [P]
  n_valid = jnp.sum(new.astype(jnp.int32)) + sh
  s = jnp.arange(n_pad)
  hit = slot[None, :] == s[:, None]  # [n_pad, P]
  eids = jnp.sum(jnp.where(hit & new[None, :], ids[None, :], 0), axis=1).astype(jnp.int32)
  row = (i // k)[None, :] == jnp.arange(mp)[:, None]  # [mp, P]
  r = jnp.sum(jnp.where(hit[:, None, :] & row[None], topk_weights.reshape(-1).astype(jnp.float32), 0.0), axis=-1)
  if shared:
    r = r.at[0].set((jnp.arange(mp) < M).astype(jnp.float32))
  return eids, jnp.broadcast_to(n_valid.astype(jnp.int32), (4,)), r


def route_tables(ids_at, w_at, M: int, k: int, E: int, mp: int, shared: bool):
  """moe_route's tables in registers from the (row, j) pairs' ids and weights read by ``ids_at(m, j)`` /
  ``w_at(m, j)`` (uniform scalars, e.g. SMEM loads) -> (eids [128] int32, the valid slot count (int32 scalar),
  r [128, mp] f32). Each pair's slot from the earlier pairs' (id, slot): uniform scalar compares (M·k (M·k − 1)
  / 2 of them), no cross-thread reduction; the tables are built with per-pair selects on [128] / [128, mp]
  registers. (Shared by moe_route and the router kernel that builds the tables itself, router.router_route.)"""
  vec = plgpu.Layout.WG_STRIDED((_LANES,), vec_size=1)
  tile = plgpu.Layout.WG_STRIDED((_LANES, mp), vec_size=1)
  slots = plgpu.broadcasted_iota(jnp.int32, (_LANES,), 0, layout=vec)
  row = plgpu.broadcasted_iota(jnp.int32, (_LANES, mp), 0, layout=tile)
  col = plgpu.broadcasted_iota(jnp.int32, (_LANES, mp), 1, layout=tile)
  eids = jnp.zeros((_LANES,), jnp.int32)
  r = jnp.zeros((_LANES, mp), jnp.float32)
  count = jnp.int32(int(shared))
  if shared:
    r = jnp.where(row == 0, jnp.where(col < M, 1.0, r), r)
  seen = []
  for m in range(M):
    for j in range(k):
      e, w = ids_at(m, j), w_at(m, j)
      ok = (e >= 0) & (e < E)
      slot = jnp.int32(-1)
      for e2, s2 in seen:
        slot = jnp.where(e == e2, s2, slot)
      new = ok & (slot < 0)
      slot = jnp.where(ok, jnp.where(new, count, slot), jnp.int32(-1))
      count = count + new.astype(jnp.int32)
      seen.append((e, slot))
      eids = jnp.where(slots == slot, e, eids)
      r = jnp.where(row == slot, jnp.where(col == m, r + w, r), r)
  return eids, count, r


def store_route_tables(eids, count, r, e_s, n_s, r_s, eids_g, nv_g, r_g):
  """route_tables' registers -> the outputs eids [n_pad], n_valid [4], r [n_pad, mp] (through SMEM and TMA; the
  caller waits for the stores)."""
  n_pad = eids_g.shape[0]
  e_s[...] = eids
  n_s[...] = jnp.broadcast_to(count, (_LANES,))
  r_s[...] = r
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(e_s.at[pl.ds(0, n_pad)], eids_g)
  plgpu.copy_smem_to_gmem(n_s.at[pl.ds(0, 4)], nv_g)
  plgpu.copy_smem_to_gmem(r_s.at[pl.ds(0, n_pad)], r_g)


def route_out_types(n_pad: int, mp: int):
  """(eids, n_valid, r) of moe_route / router_route."""
  return (jax.ShapeDtypeStruct((n_pad,), jnp.int32), jax.ShapeDtypeStruct((4,), jnp.int32),
          jax.ShapeDtypeStruct((n_pad, mp), jnp.float32))


def route_scratch(mp: int):
  """The SMEM staging of route_tables' outputs (e_s, n_s, r_s)."""
  return [plgpu.SMEM((_LANES,), jnp.int32), plgpu.SMEM((_LANES,), jnp.int32), plgpu.SMEM((_LANES, mp), jnp.float32)]


def route_shape(m: int, k: int, num_experts: int, shared: bool, mma: str = "wgmma") -> tuple[int, int]:
  """(n_pad, mp) of fp8_moe's slot tables for m token rows of k experts each (the shared expert a slot too), for
  its ``mma`` form (the token rows it pads to)."""
  return _round_up(min(num_experts, m * k) + int(shared), 8), _padded_rows(m, mma)


def _route_kernel(M: int, k: int, E: int, n_pad: int, mp: int, shared: bool):
  def body(ids_g, w_g, eids_g, nv_g, r_g, ids_s, w_s, e_s, n_s, r_s, bar):
    plgpu.copy_gmem_to_smem(ids_g, ids_s, bar)
    plgpu.copy_gmem_to_smem(w_g, w_s, bar)
    plgpu.barrier_wait(bar)
    eids, count, r = route_tables(lambda m, j: ids_s[m, j], lambda m, j: w_s[m, j], M, k, E, mp, shared)
    store_route_tables(eids, count, r, e_s, n_s, r_s, eids_g, nv_g, r_g)
    plgpu.wait_smem_to_gmem(0)

  return body


@kernel_entry("num_experts", "n_pad", "mp", "shared")
def moe_route(topk_ids, topk_weights, *, num_experts: int, n_pad: int, mp: int, shared: bool):
  """Mosaic GPU version of ``moe_route_reference`` (the same tables): one CTA, one launch — in XLA (``_route``
  with the shared slot prepended) the tables were ~7 small kernels per MoE layer at M = 4, on the critical path
  (session 27's profile: 1.0-1.3 µs each)."""
  M, k = topk_ids.shape
  if topk_weights.shape != (M, k) or M * k > ROUTE_MAX_PAIRS or M > mp or n_pad > _LANES or n_pad % 8:
    raise ValueError(f"moe_route: ids {topk_ids.shape}, weights {topk_weights.shape}, n_pad {n_pad}, mp {mp}; "
                     f"expected [M, k] both with M·k <= {ROUTE_MAX_PAIRS}, M <= mp, n_pad a multiple of 8 <= "
                     f"{_LANES}")
  i32, f32 = jnp.int32, jnp.float32
  return mgpu_kernel(
      _route_kernel(M, k, num_experts, n_pad, mp, shared),
      out_type=route_out_types(n_pad, mp),
      kernel_name="glm5_moe_route",
      scratch_types=[plgpu.SMEM((M, k), i32), plgpu.SMEM((M, k), f32), *route_scratch(mp),
                     plgpu.Barrier(num_arrivals=2)],
  )(topk_ids.astype(i32), topk_weights.astype(f32))


def _swiglu_of_splits(out, m: int, split: int, limit: float):
  """The gate/up kernel's output -> h [slots, I, m] f32 of the m real token columns: with D splits ([split, slots,
  2, I, mp] partial gate / up sums) the splits added and the clamped SwiGLU applied (in the XLA glue after the
  kernel); with one split ([slots, I, mp]) the kernel applied it already."""
  if split == 1:
    return out[..., :m]
  gu = out[..., :m].sum(0)  # [slots, 2, I, m]
  gate = jnp.minimum(gu[:, 0], limit)
  return jax.nn.silu(gate) * jnp.clip(gu[:, 1], -limit, limit)


@kernel_entry("swiglu_limit", "plan", "dq", "a_from", "route_kernel", "out_dtype", "dq_dtype", "router_select",
              "static_table", "writer_cta", "lean", "mma", "one_grid", "h_rows", "part_rows")
def fp8_moe(x, topk_ids, topk_weights, w_gate, s_gate, w_up, s_up, w_down, s_down, *, swiglu_limit: float,
            plan: MoePlan | None = None, shared=None, dq: bool = False, a_from: str | None = None,
            route_kernel: bool = False, tables=None, counters=None, out_dtype=jnp.float32,
            dq_dtype: str = "bfloat16", router: tuple | None = None, router_select: tuple | None = None,
            static_table: bool = False, writer_cta: bool = False, lean: bool = False, mma: str = "wgmma",
            one_grid: int | None = None, h_rows: bool = False, part_rows: bool = False):
  """Routed experts of a few decode tokens with FP8 128x128 block-scaled weights.

  Args:
    x: [M, D] bf16/f32 (M <= 64 token rows).
    topk_ids: [M, k] int32 expert ids; topk_weights: [M, k] f32 routing weights.
    w_gate, w_up: [E, I, D] float8_e4m3fn; s_gate, s_up: [E, ceil(I/128), ceil(D/128)] f32.
    w_down: [E, D, I] float8_e4m3fn; s_down: [E, ceil(D/128), ceil(I/128)] f32.
    swiglu_limit: L of the clamped SwiGLU.
    route_kernel: for M > 1 (and M·k <= ROUTE_MAX_PAIRS, else a ValueError), the slot tables from ``moe_route``
      (one Mosaic launch; slots in first-occurrence order) instead of XLA's ``_route`` (ascending expert order):
      the same sum up to the order in which the down kernel adds the experts. (M = 1 reads the router's ids as a
      static slot table either way.)
    tables: with route_kernel, moe_route's (eids, n_valid, r) for these ids and weights, computed already (the
      router kernel that builds them itself: router.router_route) — no moe_route launch here.
    counters: with dq, the Ref of :func:`splitk_counters` — for up to ROWS_OUT_MAX rows the gate/up kernel's D
      splits summed in it, which writes h (SwiGLU times the routing weights) as the down kernel's bf16 input
      rows, and the down kernel's expert groups summed in it, which writes y [M, D] out_dtype (``_split_out``'s
      rows): no XLA kernel between or after the two (in interpret mode, which runs no counters, only one-split /
      one-group plans take the rows form). With ``router``: h's rows without the routing weights (the gate/up
      kernel selects them), which scale each slot's product in the down kernel instead.
    out_dtype: y's dtype.
    dq_dtype: with dq, "bfloat16" or "float16" (x, h and the converted weight tiles: ``_dq_dtype``).
    router, router_select: for ONE token row, (logits [1, E] f32, bias [E] f32) and (k, scaling, norm[, ranks]) —
      the router after its logits (pallas_kernels.router.router_topk's selection; ``ranks``: each CTA selects only
      up to its own slot's rank, ``_router_in_kernel``) inside the
      gate/up kernel instead of a launch of its own before it; topk_ids and topk_weights are then None and the
      call returns (y, ids [1, k], weights [1, k]), router_topk's outputs.
    static_table: for ONE token row (a static slot table): both kernels take the valid slots' count (k + shared)
      as a static number instead of reading it from GMEM, and the down kernel copies the row's ids and weights
      into SMEM by one TMA each (k a multiple of 4: 16-byte copies) instead of 2k scalar GMEM loads per thread
      (``_moe_down_kernel(stage_table=True)``). Ignored for more rows.
    writer_cta: with ``router`` in its ranks form: the selection's writer (all k with their weights, stored for the
      down kernel and the caller) is one extra gate/up CTA that does nothing else, instead of the first CTA doing
      it before its own weight tiles (``_moe_gate_up_kernel(writer_t=...)``). Ignored otherwise.
    lean: both kernels built without Mosaic GPU's automatic warpgroup barriers (policy knob lean_barriers; one
      before each TMA load of the ring, two around each vector store), with the ring's refill barrier placed by
      hand (``_refill``); the selection's SMEM (the router's staging, its ids / weights) is read only after a
      commit_smem. The same sums, bit for bit. The SMEM-A form (a_from "smem") ignores it.
    mma: "wgmma" (Hopper) or "tcgen05" (Blackwell, with dq: both kernels' tile products as tcgen05 MMAs into
      tensor memory, 128-row tiles, token rows padded to 16 — the module docstring; ``a_from`` and ``lean`` do
      not apply).
    one_grid: None, or the call's parity (0 / 1, alternating between consecutive calls on one counters Ref): ONE
      token row with dq, ``router`` in its ranks form, ``writer_cta``, ``static_table`` and ``counters`` (with or
      without the shared expert; a plan whose CTAs all fit the SMs at once: ``one_grid_why``) — both kernels as ONE
      grid (``_moe_one_grid_kernel``): every CTA runs its gate/up item, then a
      down item, whose weight tiles it requests at once and whose h it awaits on its slot's counter, so the down
      weights stream during the gate/up tail instead of after a launch (in GPU interpret mode, which runs no
      counters, the down role is a launch of its own after the gate/up kernel and XLA's glue). The routing
      weight scales each slot's down sum (not each block's scale): the two kernels' rows form (``counters``) up to
      f32 rounding. Natively correct and faster on an H100 (BENCHMARKS.md, session 60).
    h_rows: with dq, 2..ROWS_OUT_MAX token rows and a plan of one D split (the verify's MoE), without counters: the
      gate/up kernel writes h's rows itself — the clamped SwiGLU times the routing weights, in bf16 (f16) — as the
      down kernel's input (``_gate_up_rows``), instead of XLA's glue fusion between the two kernels (policy knob
      moe_h_rows; ``h_rows_why`` says where it cannot run). The down kernel's groups are still summed by XLA.
    part_rows: up to ROWS_OUT_MAX token rows, the down kernel's groups summed by XLA (no counters): each group's
      partial written as token rows [groups, M, D] (as :func:`fp8_dq_linear`'s): XLA's sum and the cast after it
      are one fusion.
  Returns:
    y: [M, D] out_dtype = sum_j topk_weights[m, j] * down_e(silu(min(gate_e x, L)) * clip(up_e x, -L, L)),
    e = topk_ids[m, j].

  Only the distinct selected experts' weights are read, once each. ``shared`` = (w_gate [I, D], s_gate, w_up,
  s_up, w_down [D, I], s_down) of one shared expert (weight 1 for every token): it runs as slot 0 of the same two
  kernels, streamed from its own arrays (no stacking, one launch pair per MoE layer).
  Two kernels: gate+up with the fused clamped SwiGLU writes h [slots, I, M] f32 (when slots x I/64 < 132 CTAs,
  e.g. M=1, it splits D instead and the SwiGLU runs in the XLA glue that follows anyway); XLA applies the routing
  weights and quantises h (hi+lo e4m3, one scale) as [slots, 2M, I]; the down kernel sums over the experts per
  hidden row tile (a dynamic trip count: only the n_valid distinct experts are streamed).
  ``dq``: x and h stay bf16 and each weight tile is dequantised to bf16 in the kernels (as :func:`fp8_dq_linear`,
  ``a_from`` likewise): no amax reductions or hi/lo quantisations between the kernels, exact products.
  Needs I % 128 == 0 and D % 128 == 0.
  """
  m, d = x.shape
  e_num, inter, d2 = w_gate.shape
  dt = _dq_dtype(dq_dtype, "fp8_moe")
  if (router is None) != (router_select is None):
    raise ValueError("fp8_moe: router (logits, bias) and router_select (k, scaling, norm) go together")
  if router is not None:
    if len(router_select) not in (3, 4):
      raise ValueError(f"fp8_moe: router_select = {router_select!r}, expected (k, scaling, norm[, ranks])")
    (logits, bias), (k_r, scaling, norm, *opts) = router, router_select
    ranks = bool(opts[0]) if opts else False
    if m != 1 or logits.shape != (1, e_num) or bias.shape != (e_num,) or topk_ids is not None:
      raise ValueError(f"fp8_moe: router given with {m} token rows, logits {logits.shape}, bias {bias.shape} and "
                       f"topk_ids {None if topk_ids is None else topk_ids.shape}; expected one row, logits "
                       f"[1, {e_num}], bias [{e_num}] and no ids (the kernel selects them)")
    # placeholders with the selection's shapes: the slot table is static at one row (only n_valid = k is read)
    topk_ids, topk_weights = jnp.zeros((1, k_r), jnp.int32), jnp.zeros((1, k_r), jnp.float32)
  if d != d2 or w_down.shape != (e_num, d, inter) or w_up.shape != w_gate.shape:
    raise ValueError("inconsistent MoE weight shapes")
  if inter % BLOCK or d % BLOCK:
    raise NotImplementedError("fp8_moe needs I % 128 == 0 and D % 128 == 0")
  if m > 64:
    raise NotImplementedError("fp8_moe takes <= 64 token rows")
  k = topk_ids.shape[1]
  tc05 = check_mma(mma, "fp8_moe")
  if tc05 and not dq:
    raise ValueError("fp8_moe: mma='tcgen05' needs dq=True (the hi/lo form's fp8 products are wgmma only)")
  mp = _padded_rows(m, mma)
  n_slots = min(e_num, m * k)
  has_sh = shared is not None
  if has_sh and (shared[0].shape != (inter, d) or shared[4].shape != (d, inter)):
    raise ValueError(f"shared expert shapes {shared[0].shape} / {shared[4].shape}, expected {(inter, d)} / "
                     f"{(d, inter)}")
  # a single row: the kernels read the router's k ids themselves (slot s = id s − shared): the padded slot table
  # was an XLA kernel of its own (~0.9 µs per MoE layer at B = 1, q = 1, session 22's profile)
  table_k = k if m == 1 else 0
  in_kernel = route_kernel and m > 1  # the tables (shared slot included): one launch (moe_route checks its limits)
  if tables is not None and not in_kernel:
    raise ValueError(f"fp8_moe: slot tables given for {m} token row(s) with route_kernel={route_kernel}; they "
                     "replace moe_route's (route_kernel=True, more than one row)")
  if in_kernel:
    n_slots += int(has_sh)
    if tables is not None:
      eids, n_valid, r = tables
      want = ((_round_up(n_slots, 8),), (4,), (_round_up(n_slots, 8), mp))
      if tuple(a.shape for a in tables) != want:
        raise ValueError(f"fp8_moe: slot tables {[a.shape for a in tables]}, expected {list(want)} (route_shape)")
    else:
      eids, n_valid, r = moe_route(topk_ids, topk_weights, num_experts=e_num, n_pad=_round_up(n_slots, 8), mp=mp,
                                   shared=has_sh)
    valid = jnp.arange(_round_up(n_slots, 8)) < n_valid[0]
  else:
    eids, n_valid, valid, r, n_slots = _route_with_shared(topk_ids, topk_weights, e_num, n_slots, mp, has_sh,
                                                          table_k)
  n_pad = _round_up(n_slots, 8)
  # (one_grid: 3-stage gate/up rings, so that three CTAs fit an SM and the whole grid is resident: _moe_one_grid)
  plan = plan or plan_moe(n_slots, inter, d, mp, mma=mma, **({"gu_stages": 3} if one_grid is not None else {}))
  if tc05 and (plan.gu_bm, plan.dn_bm) != (MMA_BM[mma],) * 2:
    raise ValueError(f"fp8_moe: mma='tcgen05' needs {MMA_BM[mma]}-row tiles, plan has gu_bm={plan.gu_bm}, "
                     f"dn_bm={plan.dn_bm}")
  a_smem = tc05 or (_a_smem(a_from) and dq)
  tc_tiles = (lambda bm: _tc_scratch(bm, mp)) if tc05 else (lambda bm: [])
  if dq:  # bf16 (f16) rows as they are
    x_in = (_tma_rows(_act(x, dt), mp),)  # (the TMA zero-fills the rows up to mp)
    x_tile = plgpu.SMEM((plan.gu_stages, mp, BLOCK), dt, transforms=_tr(dt, BLOCK))
  else:
    xq, _ = quantize_activations(x, mp)
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)))  # (the same reduction as inside quantize_activations: one kernel)
    x_in = (xq, amax.reshape(1))
    x_tile = plgpu.SMEM((plan.gu_stages, 2 * mp, BLOCK), F8, transforms=_tr(F8, BLOCK))
  f32 = jnp.float32
  sh_gu = (shared[0], shared[1].astype(f32), shared[2], shared[3].astype(f32)) if has_sh else ()
  sh_dn = (shared[4], shared[5].astype(f32)) if has_sh else ()

  gu_tiles = inter // plan.gu_bm
  gu_out = ((n_pad, inter, mp) if plan.gu_split == 1 else (plan.gu_split, n_pad, 2, inter, mp))
  a_tile = lambda bm: ([plgpu.SMEM((bm, BLOCK), dt, transforms=_tr(dt, BLOCK))] if a_smem else [])
  # counters (dq): h written as the down kernel's bf16 rows by the gate/up kernel itself (its D splits summed on
  # the counters; the routing weights applied there: the router's with a static slot table, else r)
  gu_ctr, gu_rows = _fused_form(counters if dq else None, plan.gu_split, n_pad * gu_tiles, m, "fp8_moe")
  if h_rows:  # (the rows form of one D split needs no counters)
    why = _h_rows_plan_why(m, dq, plan, counters, router is not None)
    if why:
      raise ValueError(f"fp8_moe: h_rows: {why}")
    gu_rows = True
  gu_extra, gu_scratch = (), []
  if gu_rows:
    hq_t = jax.ShapeDtypeStruct((n_pad, m, inter), dt)
    gu_out = hq_t if plan.gu_split == 1 else (
        jax.ShapeDtypeStruct((plan.gu_split - 1, n_pad, 2, inter, mp), jnp.float32), hq_t)
    # (with the router in the kernel the weights are its own: the down kernel applies them — slot_weights)
    gu_extra = (() if router is not None else (topk_weights.astype(f32) if table_k else r,)) + \
        (() if gu_ctr is None else (gu_ctr,))
    gu_scratch = [plgpu.SMEM((m, plan.gu_bm), dt)]
  else:
    gu_out = jax.ShapeDtypeStruct(gu_out, jnp.float32)
  sel_in, sel_out, sel_scratch, sel_static = (eids,), (), [], None
  if router is not None:  # (the selection's outputs after h, its scratch first: _router_in_kernel)
    sel_in = (logits.astype(f32), bias.astype(f32))
    sel_out = (jax.ShapeDtypeStruct((1, k_r), jnp.int32), jax.ShapeDtypeStruct((1, k_r), f32))
    sel_scratch = router_scratch(e_num)
    sel_static = (e_num, int(k_r), float(scaling), bool(norm), ranks)
  # static_table: the valid slots' count of a single row's static table (k + shared) as a number in the kernels
  nv_static = n_slots if static_table and table_k else 0
  # writer_cta (the router's ranks form): one CTA past the grid selects all k, stores them and exits
  gu_grid = n_slots * gu_tiles * plan.gu_split
  writer_t = gu_grid if writer_cta and router is not None and ranks else 0
  lean_k = bool(lean) and not a_smem  # (the SMEM-A form — interpret mode's — keeps the automatic barriers)
  if one_grid is not None:
    why = _one_grid_refusal(one_grid, m=m, dq=dq, router=router is not None and ranks, writer=writer_t > 0,
                            static=nv_static > 0, counters=counters, tc05=tc05)
    why = why or _one_grid_plan_why(plan, n_slots, inter, d, mp, dt.itemsize, e_num)
    if why:
      raise ValueError(f"fp8_moe: one_grid={one_grid!r}: {why}")
    if not interpreting():
      if a_smem:
        raise ValueError(f"fp8_moe: one_grid needs the register-A form, a_from 'regs' (here {a_from!r})")
      return _moe_one_grid(
          x_in, logits.astype(f32), bias.astype(f32), n_valid, (w_gate, s_gate.astype(f32), w_up, s_up.astype(f32)),
          sh_gu, (w_down, s_down.astype(f32)), sh_dn, counters, plan=plan, m=m, mp=mp, dt=dt, k=int(k_r),
          sel_static=sel_static, sel_scratch=sel_scratch, n_slots=n_slots, n_pad=n_pad, inter=inter, d=d,
          limit=float(swiglu_limit), shared=has_sh, lean=lean_k, parity=int(one_grid), out_dtype=out_dtype)
  outs = mgpu_kernel(
      functools.partial(_moe_gate_up_kernel, mp=mp, bm=plan.gu_bm, stages=plan.gu_stages, tiles=gu_tiles,
                        split=plan.gu_split, limit=float(swiglu_limit), shared=has_sh, table_k=table_k, dq=dq,
                        a_smem=a_smem, fused_sum=gu_ctr is not None, rows=gu_rows, router=sel_static,
                        rows_weight=router is None, n_valid=nv_static, writer_t=writer_t, lean=lean_k,
                        tc05=tc05),
      compiler_params=plgpu.CompilerParams(unsafe_no_auto_barriers=lean_k),
      out_type=(gu_out if isinstance(gu_out, tuple) else (gu_out,)) + sel_out,
      grid=(gu_grid + int(writer_t > 0),),
      grid_names=("t",),
      kernel_name="glm5_moe_gate_up",
      scratch_types=[
          *sel_scratch,
          plgpu.SMEM((plan.gu_stages, plan.gu_bm, BLOCK), F8, transforms=_tr(F8, BLOCK)),
          plgpu.SMEM((plan.gu_stages, plan.gu_bm, BLOCK), F8, transforms=_tr(F8, BLOCK)),
          x_tile,
          plgpu.Barrier(num_arrivals=3, num_barriers=plan.gu_stages),
          *tc_tiles(plan.gu_bm),
          *a_tile(plan.gu_bm),
          *gu_scratch,
      ],
  )(*x_in, *sel_in, n_valid, w_gate, s_gate.astype(f32), w_up, s_up.astype(f32), *sh_gu, *gu_extra)
  outs = list(outs)
  if router is not None:  # the kernel's selection: the down kernel's slot table, the glue's routing weights
    rw = outs.pop()
    topk_ids = outs.pop()
    eids, _, valid, r, _ = _route_with_shared(topk_ids, rw, e_num, min(e_num, k_r), mp, has_sh, table_k)
  h = outs[0] if len(outs) == 1 else tuple(outs)

  # The glue works on the m real token columns only (the kernels' mp - m padding columns are zero inputs' outputs;
  # quantize_activations pads them back as zeros): at M = 1 that is 1/8 of the [.., mp] data the XLA fusions
  # between the two kernels would otherwise split-sum, SwiGLU, weight and reduce.
  dn_tiles = d // plan.dn_bm
  ring = [plgpu.SMEM((plan.dn_stages, plan.dn_bm, BLOCK), F8, transforms=_tr(F8, BLOCK))]
  if dq:  # h in bf16 (f16) [n_pad, mp (or the rows form's m), I]
    ring.append(plgpu.SMEM((plan.dn_stages, mp, BLOCK), dt, transforms=_tr(dt, BLOCK)))
  else:
    ring.append(plgpu.SMEM((plan.dn_stages, 2 * mp, BLOCK), F8, transforms=_tr(F8, BLOCK)))
  if one_grid is not None:  # (GPU interpret mode: the one grid's down role as a launch of its own, h unweighted)
    if gu_rows:  # (one D split: the gate/up kernel wrote h's rows [n_pad, m, I] itself, unweighted)
      hq = jnp.where(valid[:, None, None], h, 0.0).astype(dt)
    else:
      h = jnp.where(valid[:, None, None], _swiglu_of_splits(h, m, plan.gu_split, swiglu_limit), 0.0)
      hq = _act(jnp.swapaxes(h, 1, 2), dt)
    y = _one_grid_down_launch(hq, topk_ids, rw, (w_down, s_down.astype(f32)), sh_dn, plan=plan, mp=mp, dt=dt,
                              n_slots=n_slots, a_smem=a_smem)
    return y[:, :, :m].sum(0).T.astype(out_dtype), topk_ids, rw
  if gu_rows:  # h is the down kernel's input already (no XLA kernel between the two)
    hq, sh = (h if plan.gu_split == 1 else h[1]), 1.0
  else:
    h = _swiglu_of_splits(h, m, plan.gu_split, swiglu_limit)
    # Routing weights and re-quantisation of h (rows of unused slots were never written: mask them).
    hw = jnp.where(valid[:, None, None], h, 0.0) * r[:, None, :m]  # [n_pad, I, m]
    if dq:
      hq, sh = jnp.pad(_act(jnp.swapaxes(hw, 1, 2), dt), ((0, 0), (0, mp - m), (0, 0))), 1.0
    else:
      hq, sh = quantize_activations(jnp.swapaxes(hw, 1, 2), mp)  # [n_pad, 2mp, I]
  if table_k:
    ids_scratch, dn_eids = [plgpu.Barrier(num_arrivals=2, num_barriers=plan.dn_stages)], eids
  else:
    ids_scratch = [plgpu.SMEM((n_pad // 8, 8), jnp.int32),  # TMA boxes are <= 256 per dim: ids as rows of 8
                   plgpu.Barrier(num_arrivals=2, num_barriers=plan.dn_stages),
                   plgpu.Barrier(num_arrivals=1, num_barriers=1)]
    dn_eids = eids.reshape(n_pad // 8, 8)
  # (the activations' scale sh: 1 with dq, which the rows form needs — it writes the sum as it is)
  ctr, rows = _fused_form(counters if dq else None, plan.dn_groups, dn_tiles, m, "fp8_moe")
  part_rows = _check_part_rows(part_rows, m, "fp8_moe") and ctr is None and not rows
  slot_w = gu_rows and router is not None  # (h unweighted: the router's weights scale the down products)
  # static_table: the row's ids and weights into SMEM by one TMA each (16-byte multiples: k % 4 == 0)
  stage = bool(nv_static) and table_k % 4 == 0
  if stage:  # (the weights' SMEM is unused without slot_weights: the weights are in h then)
    ids_scratch += [plgpu.SMEM((table_k,), jnp.int32), plgpu.SMEM((table_k,), f32),
                    plgpu.Barrier(num_arrivals=1 + int(slot_w), num_barriers=1)]
  out = mgpu_kernel(
      functools.partial(_moe_down_kernel, mp=mp, bm=plan.dn_bm, stages=plan.dn_stages, tiles=dn_tiles,
                        groups=plan.dn_groups, shared=has_sh, table_k=table_k, dq=dq, a_smem=a_smem,
                        fused_sum=ctr is not None, rows=rows, slot_weights=slot_w, n_valid=nv_static,
                        stage_table=stage, lean=lean_k, tc05=tc05, part_rows=part_rows),
      compiler_params=plgpu.CompilerParams(unsafe_no_auto_barriers=lean_k),
      out_type=_out_types(plan.dn_groups, d, mp, m, out_dtype if rows else None, part_rows),
      grid=(dn_tiles * plan.dn_groups,),
      grid_names=("t",),
      kernel_name="glm5_moe_down",
      scratch_types=ring + ids_scratch + tc_tiles(plan.dn_bm) + a_tile(plan.dn_bm) + (
          [plgpu.SMEM((m, plan.dn_bm), out_dtype)] if rows else []) + (
          [plgpu.SMEM((m, plan.dn_bm), f32)] if part_rows else []),
  )(hq, dn_eids, n_valid, w_down, s_down.astype(f32), *sh_dn, *((rw,) if slot_w else ()),
    *(() if ctr is None else (ctr,)))
  if rows:
    y = _rows_result(out, plan.dn_groups)
    return (y, topk_ids, rw) if router is not None else y
  y = (_split_sum(out, m, ctr is not None, part_rows) * sh).astype(out_dtype)
  return (y, topk_ids, rw) if router is not None else y


def fp8_moe_reference(x, topk_ids, topk_weights, w_gate, s_gate, w_up, s_up, w_down, s_down, *,
                      swiglu_limit: float, shared=None):
  """Reference of :func:`fp8_moe` (same signature): fp32, one (token, expert) pair at a time (lax.map, so only
  one expert is dequantised at a time). Returns [M, D] f32."""
  if shared is not None:
    m = topk_ids.shape[0]
    routed = fp8_moe_reference(x, topk_ids, topk_weights, w_gate, s_gate, w_up, s_up, w_down, s_down,
                               swiglu_limit=swiglu_limit)
    one = [a[None] for a in shared]
    return routed + fp8_moe_reference(x, jnp.zeros((m, 1), jnp.int32), jnp.ones((m, 1), jnp.float32), *one,
                                      swiglu_limit=swiglu_limit)
  m, k = topk_ids.shape
  xf = x.astype(jnp.float32)
  hp = lax.Precision.HIGHEST

  def one(args):
    mi, e, wt = args
    xm = xf[mi]
    g = jnp.dot(dequantize_fp8(w_gate[e], s_gate[e]), xm, precision=hp)
    u = jnp.dot(dequantize_fp8(w_up[e], s_up[e]), xm, precision=hp)
    h = jax.nn.silu(jnp.minimum(g, swiglu_limit)) * jnp.clip(u, -swiglu_limit, swiglu_limit)
    return wt * jnp.dot(dequantize_fp8(w_down[e], s_down[e]), h, precision=hp)

  rows = jnp.repeat(jnp.arange(m), k)
  ys = lax.map(one, (rows, topk_ids.reshape(-1).astype(jnp.int32), topk_weights.reshape(-1).astype(jnp.float32)))
  return ys.reshape(m, k, -1).sum(1)
