"""The routed experts of a prefill chunk (many token rows) as grouped FP8 GEMMs, in Pallas Mosaic GPU.

Why: at prefill the model's XLA path runs every expert over every token of the chunk and combines them with a
dense [M, E] weight matrix (``glm5_jax.layers.Experts.partial``): E / k = 36× the FLOPs of the routed pairs at the
release's 288 experts, top-8, after dequantising every expert's FP8 weights to bf16 in HBM (1.2 GB per matrix per
MoE layer of one TP4 rank, written and read back: compiled for an H200, three `loop_convert_fusion`s of
bf16[288, 512, 4096] before three dense gemm fusions). A prefill chunk of M = 256 tokens routes only M·k = 2,048
(token, expert) pairs — ~7 per expert — so the work is ONE read of every expert's FP8 weights (the decode
kernels' bandwidth problem) plus the pairs' products.

Here the pairs are grouped by expert (in pair order, by counts — no sort) and laid out as row tiles of ``mp``
rows, each tile holding one expert's rows (the last tile of an expert zero-padded, ``route_rows``). A
launch runs a CTA per (row tile, bm weight rows) that streams its expert's FP8 rows once through a TMA ring,
dequantised in registers as the decode kernels do (``pallas_kernels.linear._mma_tile``: the weight as wgmma A, the
tile's token rows as N), with the 128×128 block scale applied per K block; tiles past the chunk's count exit at
once. Two launches: gate and up together on the same x tiles with the clamped SwiGLU applied (h in bf16, as
between the decode MoE kernels: ``fp8_grouped_gate_up``), then down (``fp8_grouped_linear``); XLA gathers the rows
in, weights them by the routing weights and adds them back per token (``fp8_moe_prefill``). Each launch writes its
output as the tiles' token rows ([T·mp, N], ``rows=True``, policy knob moe_prefill_rows: the tile's sums picked per
row into SMEM, one TMA store) or as [T, N, mp] for XLA to transpose.
Same contract and reference as ``pallas_kernels.linear.fp8_moe`` (``fp8_moe_reference``). Blackwell (sm_100, no
wgmma): ``mma="tcgen05"`` — 128 weight rows a CTA, each block's dequantised tile (through SMEM) one tcgen05 MMA into
a tensor-memory accumulator (``linear._mma_tile``'s tcgen05 form, as the decode MoE's); checked in GPU interpret
mode and compiled for sm_100a on a CPU, not yet run on a Blackwell GPU.

Shapes: M token rows, k experts per token, P = M·k pairs, E experts, I expert width, D hidden size, T row tiles
(a static bound: ceil(P / mp) + E), mp rows per tile, N / K a matrix's output / input features.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import linear as kl
from pallas_kernels._common import check_mma, kernel_entry, mgpu_kernel, tmem_to_wgmma

F8 = jnp.float8_e4m3fn
BLOCK = kl.BLOCK
TILE_ROWS = (16, 32, 64)  # rows per tile (the wgmma N): the smallest that holds the mean pairs per expert


def tile_rows(pairs: int, experts: int) -> int:
  """Rows per tile for ``pairs`` (token, expert) pairs over ``experts``: the smallest of TILE_ROWS holding the mean
  per expert (the padding of each expert's last tile is wasted MMA work; a larger tile re-reads fewer weights)."""
  mean = -(-pairs // experts)
  return next((r for r in TILE_ROWS if r >= mean), TILE_ROWS[-1])


def grouped_bm(mp: int) -> int:
  """The wgmma form's weight rows a CTA for mp-row tiles: 128 up to 32 rows a tile, 64 past it (the accumulator's
  registers, as the decode kernels' budget)."""
  return 128 if mp <= 32 else 64


def num_tiles(pairs: int, experts: int, mp: int) -> int:
  """The static bound on the row tiles: Σ_e ceil(c_e / mp) < P / mp + E."""
  return -(-pairs // mp) + experts


def route_rows(ids, num_experts: int, mp: int):
  """ids [M, k] int32 -> (row [M, k]: each (token, expert) pair's row in the tiled layout, tile_e [T]: each tile's
  expert, -1 past the used tiles). Expert e's c_e pairs fill ceil(c_e / mp) consecutive tiles from its first tile
  (an exclusive sum of the tiles before it), in pair order (token, then slot): a pair's rank among its expert's is
  the count of that expert in the tokens before it (an exclusive cumulative sum of the [M, E] per-token counts
  over the tokens) plus its repeats earlier in its own token's k slots (none from a top-k router: distinct
  experts) — no sort (a stable argsort of the M·k ids was XLA's sort kernel, ~32 µs a MoE layer of a 512-token
  chunk in session 78's H100 trace)."""
  M, k = ids.shape
  i32 = jnp.int32
  ids = ids.astype(i32)
  hit = ids[:, :, None] == jnp.arange(num_experts, dtype=i32)  # [M, k, E]
  per_token = jnp.sum(hit, axis=1, dtype=i32)  # [M, E]
  upto = jnp.cumsum(per_token, axis=0, dtype=i32)
  before = upto - per_token  # the expert's pairs in the tokens before
  # (the totals: the cumulative sum's last row — a column sum of its own was XLA's slowest routing kernel, ~15 µs a
  # MoE layer of a 512-token chunk in session 79's H100 trace)
  counts = upto[-1]
  same = ids[:, :, None] == ids[:, None, :]  # [M, k, k]: earlier slots of the token with the same expert
  repeats = jnp.sum(same & (jnp.arange(k)[None, :] < jnp.arange(k)[:, None])[None], axis=2, dtype=i32)
  rank = jnp.take_along_axis(before, ids, axis=1) + repeats
  tiles = (counts + mp - 1) // mp
  ends = jnp.cumsum(tiles)  # one past each expert's last tile
  row = (ends - tiles)[ids] * mp + rank
  T = num_tiles(M * k, num_experts, mp)
  t = jnp.arange(T, dtype=i32)
  # tile t belongs to the expert whose tile range holds it: the count of experts ending at or before t (empty
  # experts end where they start and are counted with those before)
  tile_e = jnp.sum(t[:, None] >= ends[None, :], axis=1, dtype=i32)
  return row, jnp.where(t < ends[-1], tile_e, -1)


def _grouped_kernel(tile_e_ref, x_ref, *refs, mp: int, bm: int, stages: int, n_tiles: int, steps: int,
                    limit: float | None, tc05: bool = False, rows: bool = False):
  """CTA t = (weight row tile t % n_tiles, row tile mt = t // n_tiles): o[mt, rows, :] = W_e[rows] · x_tile.T with
  e = tile_e[mt] — its ``steps`` 128-K blocks through a ``stages``-deep TMA ring (the weight tile(s) + the tile's
  token rows per slot), each dequantised (``linear._mma_tile``) into a fresh accumulator and added times its block
  scale. ``limit`` set: two weights (gate, up) on the same x tile and o = SwiGLU(gate, up) clamped at ``limit``, in
  o's dtype (the down launch's input). A tile without an expert (past the chunk's) exits at once. ``tc05``: the
  tcgen05 form (Blackwell) — each block one tcgen05 MMA of the dequantised tile (through a_s) into the TMEM
  accumulator, its block added in tcgen05's register layout, the sums relaid through the f32 tile t_s into the
  WGMMA layout for the epilogue (scratch after a_s: ``linear._tc_scratch``'s three). ``rows``: o is [T·mp, N], the
  tile's sums written as its mp token rows (``linear._rows_out``: through the SMEM tile y_s [mp, bm], the last
  scratch, and one TMA store) instead of o [T, N, mp] for XLA to transpose."""
  n_w = 1 if limit is None else 2
  ws, ss = refs[0:2 * n_w:2], refs[1:2 * n_w:2]
  o_ref, *rest = refs[2 * n_w:]
  y_s = None
  if rows:
    *rest, y_s = rest
  tc, t_s = (None, None) if not tc05 else (tuple(rest[-3:-1]), rest[-1])
  rest = rest[:-3] if tc05 else rest
  w_ss, (x_s, bar, *a_s) = rest[:n_w], rest[n_w:]
  t = lax.axis_index("t")
  tile, mt = t % n_tiles, t // n_tiles
  e = tile_e_ref[mt]
  row0 = tile * bm
  nb = row0 // BLOCK  # (bm divides 128: one scale row per weight tile)

  @pl.when(e >= 0)
  def _():
    def issue(i):
      slot = i % stages
      k0 = i * BLOCK
      for w_ref, w_s in zip(ws, w_ss):
        plgpu.copy_gmem_to_smem(w_ref.at[e, pl.ds(row0, bm), pl.ds(k0, BLOCK)], w_s.at[slot], bar.at[slot])
      plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(mt * mp, mp), pl.ds(k0, BLOCK)], x_s.at[slot], bar.at[slot])

    for i in range(min(stages, steps)):
      issue(i)

    def step(i, accs):  # (a rolled loop: steps = K / 128 is 32 for gate / up at the release's D)
      slot = i % stages
      scs = [s_ref[e, nb, i] for s_ref in ss]  # (issued before the wait: the FMAs below wait for them)
      plgpu.barrier_wait(bar.at[slot])
      blks = [kl._mma_tile(w_s.at[slot], x_s.at[slot], mp, True, a_s[0] if a_s else None, tc=tc) for w_s in w_ss]
      pl.when(i + stages < steps)(lambda: kl._refill(issue, i + stages, False))
      return tuple(acc + blk * sc for acc, blk, sc in zip(accs, blks, scs))

    zero = plgpu.layout_cast(jnp.zeros((bm, mp), jnp.float32), plgpu.Layout.TCGEN05 if tc05 else plgpu.Layout.WGMMA)
    accs = lax.fori_loop(0, steps, step, (zero,) * n_w)
    if tc05:
      accs = tuple(tmem_to_wgmma(a, t_s) for a in accs)
    if limit is None:
      out = accs[0]
    else:  # (the decode MoE's gate/up epilogue: linear._moe_gate_up_kernel)
      gate, up = jnp.minimum(accs[0], limit), jnp.clip(accs[1], -limit, limit)
      out = gate * jax.nn.sigmoid(gate) * up
    if rows:  # (the f32 sums picked per row, rounded once into y_s)
      kl._rows_out((o_ref.at[pl.ds(mt * mp, mp)], y_s), out, row0=row0)
    else:
      o_ref[mt, pl.ds(row0, bm), :] = out.astype(o_ref.dtype)


def _grouped_resident_kernel(tile_e_ref, x_ref, w_ref, s_ref, o_ref, *rest, mp: int, bm: int, stages: int,
                             n_groups: int, n_sub: int, steps: int, rows: bool = False, tokens_m: bool = False):
  """``_grouped_kernel``'s one-weight launch with the row tile's x resident in SMEM: CTA t = (weight row group g =
  t % n_groups, row tile mt = t // n_groups) loads x's [mp, K] tile once (``steps`` 128-K blocks on one barrier)
  and then runs its group's ``n_sub`` weight row tiles of bm rows one after another — their ``n_sub · steps``
  blocks through one TMA ring that runs on across the tiles (a tile's epilogue overlaps the next tile's loads),
  each tile summed in a fresh accumulator and written as ``_grouped_kernel`` writes it. The same blocks, scales
  and order of sums per output element: the streamed form's values bit for bit. Why: the down launch (K = I = 512
  at one TP4 rank) streamed each CTA's x tile beside only 4 weight blocks — 64 KB of x for 32 KB of weight at
  64-row tiles, re-read by all N / bm = 64 CTAs of the tile (session 80's H100 trace of a 2,048-token chunk: the
  down launch 696 µs a layer against gate / up's 548 for twice its weight bytes).

  ``tokens_m`` (mp = 64, ``rows``): each block's MMA with the tile's token rows as M — x's block as A from SMEM, the
  weight block dequantised into SMEM (a_s) as B, transposed — so the accumulator is already [tokens, weight rows]
  and the tile is stored as it is (one SMEM store, one TMA) instead of ``linear._rows_out``'s 64 masked row sums a
  weight tile (the suspect of the resident form's ~1.45 TB/s in session 81's trace). The same products, summed by the
  tensor cores in another order (within f32 rounding of the other forms)."""
  y_s = None
  if rows:
    *rest, y_s = rest
  w_s, x_s, bar, xbar, *a_s = rest
  t = lax.axis_index("t")
  g, mt = t % n_groups, t // n_groups
  e = tile_e_ref[mt]
  total = n_sub * steps

  @pl.when(e >= 0)
  def _():
    for kb in range(steps):  # (x's blocks first: every tile's first block waits for them)
      plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(mt * mp, mp), pl.ds(kb * BLOCK, BLOCK)], x_s.at[kb], xbar)

    def issue(j):
      slot = j % stages
      row = (g * n_sub + j // steps) * bm
      plgpu.copy_gmem_to_smem(w_ref.at[e, pl.ds(row, bm), pl.ds((j % steps) * BLOCK, BLOCK)], w_s.at[slot],
                              bar.at[slot])

    for j in range(min(stages, total)):
      issue(j)
    plgpu.barrier_wait(xbar)
    zero = plgpu.layout_cast(jnp.zeros((mp, bm) if tokens_m else (bm, mp), jnp.float32), plgpu.Layout.WGMMA)

    def block(slot, kb):  # one 128-K block's product with a fresh accumulator
      if not tokens_m:
        return kl._mma_tile(w_s.at[slot], x_s.at[kb], mp, True, a_s[0] if a_s else None)
      b_s = kl._dequant_tile(w_s.at[slot], a_s[0], x_s.dtype)  # (stored, then made visible to the tensor cores)

      def mma(acc):
        plgpu.wgmma(acc, x_s.at[kb], b_s.T)
        return acc[...]  # (waits for the MMA: a_s is free for the next block)

      return pl.run_scoped(mma, plgpu.ACC((mp, bm), jnp.float32))

    def tile(i, carry):
      row0 = (g * n_sub + i) * bm
      nb = row0 // BLOCK  # (bm divides 128: one scale row per weight tile)

      def step(kb, acc):  # (a rolled loop, as the streamed form's: the same sums, compiled alike)
        j = i * steps + kb
        slot = j % stages
        sc = s_ref[e, nb, kb]  # (issued before the wait: the FMAs below wait for it)
        plgpu.barrier_wait(bar.at[slot])
        blk = block(slot, kb)
        pl.when(j + stages < total)(functools.partial(kl._refill, issue, j + stages, False))
        return acc + blk * sc

      acc = lax.fori_loop(0, steps, step, zero)  # (K / 128 blocks: 4 for the down weight at the release)
      if tokens_m:  # (the tile as it is: token rows x weight rows; waits for its store before y_s is reused)
        y_s[...] = acc.astype(y_s.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(y_s, o_ref.at[pl.ds(mt * mp, mp), pl.ds(row0, bm)])
        plgpu.wait_smem_to_gmem(0)
      elif rows:  # (_rows_out waits for its TMA store: y_s is free for the next tile)
        kl._rows_out((o_ref.at[pl.ds(mt * mp, mp)], y_s), acc, row0=row0)
      else:
        o_ref[mt, pl.ds(row0, bm), :] = acc.astype(o_ref.dtype)
      return carry

    lax.fori_loop(0, n_sub, tile, jnp.int32(0))


def _check_grouped(x, tile_e, w, scale_inv, mp: int):
  rows, k = x.shape
  E, n, k2 = w.shape
  T = tile_e.shape[0]
  if w.dtype != F8 or x.dtype not in (jnp.bfloat16, jnp.float16) or k != k2 or tile_e.dtype != jnp.int32:
    raise ValueError(f"fp8_grouped_linear: x {x.shape} {x.dtype}, w {w.shape} {w.dtype}, tile_e {tile_e.dtype}; "
                     "expected bf16 / f16 x [T·mp, K], e4m3 w [E, N, K] and int32 tile_e [T]")
  if mp not in TILE_ROWS or rows != T * mp:
    raise ValueError(f"fp8_grouped_linear: {rows} rows of x for {T} tiles of mp = {mp}; expected mp in "
                     f"{TILE_ROWS} and T·mp rows")
  if k % BLOCK or n % BLOCK:
    raise ValueError(f"fp8_grouped_linear: N = {n}, K = {k}; expected multiples of {BLOCK}")
  want = (E, n // BLOCK, k // BLOCK)
  if scale_inv.shape != want:
    raise ValueError(f"fp8_grouped_linear: scale_inv {scale_inv.shape}, expected {want} (128x128 blocks)")


def _grouped_launch(x, tile_e, weights, *, mp: int, bm: int | None, stages: int | None, a_from: str | None,
                    limit: float | None, out_dtype, mma: str = "wgmma", rows: bool = False, resident: int = 0,
                    tokens_m: bool = False):
  """One grouped launch over ``weights`` = [(w [E, N, K] e4m3, scale_inv)] (one, or gate and up with ``limit``)
  -> [T·mp, N] in out_dtype. ``mma``: "wgmma" or "tcgen05" (128 weight rows a CTA, the tile through SMEM);
  ``rows``: the kernel writes the [T·mp, N] rows itself (else [T, N, mp], transposed by XLA); ``resident`` > 1:
  that many weight row tiles a CTA over x's tile held in SMEM (``_grouped_resident_kernel``)."""
  tc05 = check_mma(mma, "fp8_grouped_linear")
  for w, s in weights:
    _check_grouped(x, tile_e, w, s, mp)
  T = tile_e.shape[0]
  _, n, k = weights[0][0].shape
  if tc05 and bm not in (None, kl.MMA_BM[mma]):
    raise ValueError(f"fp8_grouped_linear: mma='tcgen05' needs {kl.MMA_BM[mma]} weight rows a CTA, bm = {bm}")
  bm = bm or (kl.MMA_BM[mma] if tc05 else grouped_bm(mp))
  steps = k // BLOCK
  a_smem = tc05 or kl._a_smem(a_from)
  n_tiles = n // bm
  n_w = len(weights)
  out_dtype = jnp.dtype(out_dtype)
  if resident > 1:
    return _resident_launch(x, tile_e, weights, mp=mp, bm=bm, stages=stages, a_smem=a_smem, out_dtype=out_dtype,
                            rows=rows, n_sub=resident, tc05=tc05, limit=limit, tokens_m=tokens_m)
  if tokens_m:
    raise ValueError("fp8_grouped_linear: tokens_m takes the resident form (resident > 1)")
  stage_bytes = n_w * bm * BLOCK + mp * BLOCK * x.dtype.itemsize
  # (reserved: the dequantised tile a_s; tcgen05: the relay tile t_s too)
  stages = stages or kl._pick_stages(steps, stage_bytes, n_tiles * T, None, 2,
                                     reserve=(bm * BLOCK * 2 if a_smem else 0) + (bm * mp * 4 if tc05 else 0)
                                     + (mp * bm * out_dtype.itemsize if rows else 0))
  o = mgpu_kernel(
      functools.partial(_grouped_kernel, mp=mp, bm=bm, stages=stages, n_tiles=n_tiles, steps=steps, limit=limit,
                        tc05=tc05, rows=rows),
      out_type=jax.ShapeDtypeStruct((T * mp, n) if rows else (T, n, mp), out_dtype),
      grid=(n_tiles * T,),
      grid_names=("t",),
      kernel_name="glm5_moe_prefill",
      scratch_types=[
          *[plgpu.SMEM((stages, bm, BLOCK), F8, transforms=kl._tr(F8, BLOCK)) for _ in weights],
          plgpu.SMEM((stages, mp, BLOCK), x.dtype, transforms=kl._tr(x.dtype, BLOCK)),
          plgpu.Barrier(num_arrivals=n_w + 1, num_barriers=stages),
          *([plgpu.SMEM((bm, BLOCK), x.dtype, transforms=kl._tr(x.dtype, BLOCK))] if a_smem else []),
          *(kl._tc_scratch(bm, mp) if tc05 else []),
          *([plgpu.SMEM((mp, bm), out_dtype)] if rows else []),
      ],
  )(tile_e, x, *[a for w, s in weights for a in (w, s.astype(jnp.float32))])
  return o if rows else jnp.swapaxes(o, 1, 2).reshape(T * mp, n)


RESIDENT_MAX_BYTES = 64 * 1024  # x's [mp, K] tile held in SMEM by the resident form at most (two CTAs an SM)


def resident_sub_tiles(n: int, k: int, mp: int, itemsize: int = 2) -> int:
  """The resident form's weight row tiles a CTA (``fp8_grouped_linear(resident=...)``) for an [N, K] weight and
  mp-row tiles, bm = ``grouped_bm(mp)`` weight rows each: the largest divisor of N / bm up to 8 (x's tile read by
  N / (8 · bm) CTAs instead of N / bm; 8 x 4 blocks a CTA at the release's down weight), 0 where x's [mp, K] tile
  exceeds RESIDENT_MAX_BYTES."""
  bm = grouped_bm(mp)
  if mp * k * itemsize > RESIDENT_MAX_BYTES or n % bm:
    return 0
  n_tiles = n // bm
  return max(d for d in range(1, min(8, n_tiles) + 1) if n_tiles % d == 0)


def _resident_launch(x, tile_e, weights, *, mp: int, bm: int, stages: int | None, a_smem: bool, out_dtype,
                     rows: bool, n_sub: int, tc05: bool, limit, tokens_m: bool = False):
  """``_grouped_launch``'s resident form (see ``_grouped_resident_kernel``): one weight, the wgmma form."""
  if tc05 or limit is not None or len(weights) != 1:
    raise ValueError("fp8_grouped_linear: resident > 1 takes one weight in the wgmma form (the down launch); got "
                     f"{len(weights)} weight(s), mma {'tcgen05' if tc05 else 'wgmma'}")
  if tokens_m and (mp != 64 or not rows):
    raise ValueError(f"fp8_grouped_linear: tokens_m takes 64-row tiles (the MMA's M) and rows=True; got mp = {mp}, "
                     f"rows = {rows}")
  a_smem = a_smem or tokens_m  # (tokens_m: the dequantised weight block is the MMA's B, in SMEM)
  (w, s), = weights
  T = tile_e.shape[0]
  _, n, k = w.shape
  steps = k // BLOCK
  n_tiles = n // bm
  if n_tiles % n_sub:
    raise ValueError(f"fp8_grouped_linear: resident = {n_sub} weight row tiles a CTA must divide N / bm = "
                     f"{n_tiles} (N = {n}, bm = {bm})")
  x_bytes = mp * k * x.dtype.itemsize
  if x_bytes > RESIDENT_MAX_BYTES:
    raise ValueError(f"fp8_grouped_linear: resident form with x's [{mp}, {k}] tile ({x_bytes} bytes) past "
                     f"RESIDENT_MAX_BYTES = {RESIDENT_MAX_BYTES}")
  n_groups = n_tiles // n_sub
  stages = stages or kl._pick_stages(n_sub * steps, bm * BLOCK, n_groups * T, None, 2,
                                     reserve=x_bytes + (bm * BLOCK * 2 if a_smem else 0)
                                     + (mp * bm * out_dtype.itemsize if rows else 0))
  o = mgpu_kernel(
      functools.partial(_grouped_resident_kernel, mp=mp, bm=bm, stages=stages, n_groups=n_groups, n_sub=n_sub,
                        steps=steps, rows=rows, tokens_m=tokens_m),
      out_type=jax.ShapeDtypeStruct((T * mp, n) if rows else (T, n, mp), out_dtype),
      grid=(n_groups * T,),
      grid_names=("t",),
      kernel_name="glm5_moe_prefill",
      scratch_types=[
          plgpu.SMEM((stages, bm, BLOCK), F8, transforms=kl._tr(F8, BLOCK)),
          plgpu.SMEM((steps, mp, BLOCK), x.dtype, transforms=kl._tr(x.dtype, BLOCK)),
          plgpu.Barrier(num_arrivals=1, num_barriers=stages),
          plgpu.Barrier(num_arrivals=steps),
          *([plgpu.SMEM((bm, BLOCK), x.dtype, transforms=kl._tr(x.dtype, BLOCK))] if a_smem else []),
          *([plgpu.SMEM((mp, bm), out_dtype)] if rows else []),
      ],
  )(tile_e, x, w, s.astype(jnp.float32))
  return o if rows else jnp.swapaxes(o, 1, 2).reshape(T * mp, n)


@kernel_entry("mp", "bm", "stages", "a_from", "out_dtype", "mma", "rows", "resident", "tokens_m")
def fp8_grouped_linear(x, tile_e, w, scale_inv, *, mp: int, bm: int | None = None, stages: int | None = None,
                       a_from: str | None = None, out_dtype=jnp.float32, mma: str = "wgmma", rows: bool = False,
                       resident: int = 0, tokens_m: bool = False):
  """x [T·mp, K] bf16 (or f16: the dequantised tiles in x's dtype) in row tiles of mp, tile_e [T] int32 (each
  tile's expert, -1: unused), w [E, N, K] e4m3 with scale_inv [E, N/128, K/128] f32 -> y [T·mp, N] in out_dtype
  (f32 accumulation) = each tile's rows times its expert's dequantised weight (the rows of unused tiles: garbage,
  never read). ``bm``:
  weight rows per CTA (64 or 128; default 128 up to 32 rows a tile, as the decode kernels' register budget);
  ``stages``: the ring's depth (default: as many K blocks as fit with two CTAs an SM); ``a_from``: as
  ``linear.fp8_dq_linear``'s (interpret mode: through SMEM). ``mma``: "wgmma" (Hopper) or "tcgen05" (Blackwell,
  sm_100: no wgmma there; bm 128, the dequantised tile through SMEM, the accumulator in tensor memory). ``rows``:
  the kernel writes y's rows itself (each tile's sums picked per token row into SMEM, one TMA store a CTA) instead
  of a [T, N, mp] array that XLA transposes — the same values. ``resident`` > 1 (wgmma; x's [mp, K] tile within
  RESIDENT_MAX_BYTES: ``resident_sub_tiles``): each CTA holds its row tile's x in SMEM and runs that many weight row
  tiles — x read once per ``resident`` tiles instead of once per tile; the same values bit for bit. ``tokens_m``
  (with ``resident``, 64-row tiles, ``rows``): the token rows as the MMA's M, the tile stored as it is
  (``_grouped_resident_kernel``) — the same products summed in another order."""
  return _grouped_launch(x, tile_e, [(w, scale_inv)], mp=mp, bm=bm, stages=stages, a_from=a_from, limit=None,
                         out_dtype=jnp.dtype(out_dtype), mma=mma, rows=rows, resident=resident, tokens_m=tokens_m)


@kernel_entry("swiglu_limit", "mp", "bm", "stages", "a_from", "mma", "rows")
def fp8_grouped_gate_up(x, tile_e, w_gate, s_gate, w_up, s_up, *, swiglu_limit: float, mp: int,
                        bm: int | None = None, stages: int | None = None, a_from: str | None = None,
                        mma: str = "wgmma", rows: bool = False):
  """``fp8_grouped_linear`` over the gate and up weights in one launch (each CTA streams both for its rows, on the
  same x tiles) with the clamped SwiGLU applied: h [T·mp, I] in x's dtype = silu(min(g, L)) · clip(u, −L, L)."""
  return _grouped_launch(x, tile_e, [(w_gate, s_gate), (w_up, s_up)], mp=mp, bm=bm, stages=stages, a_from=a_from,
                         limit=float(swiglu_limit), out_dtype=x.dtype, mma=mma, rows=rows)


@kernel_entry("swiglu_limit", "mp", "a_from", "mma", "rows", "down_resident", "down_tokens_m")
def fp8_moe_prefill(x, topk_ids, topk_weights, w_gate, s_gate, w_up, s_up, w_down, s_down, *, swiglu_limit: float,
                    mp: int | None = None, a_from: str | None = None, mma: str = "wgmma", rows: bool = False,
                    down_resident: bool = False, down_tokens_m: bool = False):
  """``linear.fp8_moe``'s contract for a prefill chunk (same reference, ``linear.fp8_moe_reference``): x [M, D],
  topk_ids / topk_weights [M, k], gate / up [E, I, D] and down [E, D, I] e4m3 with their [.., /128, /128] f32
  scales -> Σ_j w_j · expert_{ids_j}(x) [M, D] f32 (the routed experts: the caller adds the shared one). ``mp``:
  rows per tile (default ``tile_rows``); ``mma``: the grouped launches' form ("tcgen05" on Blackwell); ``rows``:
  both launches write their outputs as token rows (policy knob moe_prefill_rows), the same values without XLA's
  two transposes (h [T, I, mp] and y [T, D, mp]: in session 77's H100 trace of a 512-token chunk ~1.4 ms of its
  kernels for y's); ``down_resident``: the down launch in the resident form (``resident_sub_tiles``; policy knob
  moe_prefill_resident) — an error where it cannot run (tcgen05, or h's tile past RESIDENT_MAX_BYTES);
  ``down_tokens_m`` (with it, ``rows`` and 64-row tiles; policy knob moe_prefill_tokens_m): its MMAs with the token
  rows as M (``fp8_grouped_linear(tokens_m=True)``)."""
  M, D = x.shape
  k = topk_ids.shape[1]
  E, I = w_gate.shape[:2]
  if topk_ids.shape != (M, k) or topk_weights.shape != (M, k) or w_down.shape != (E, D, I):
    raise ValueError(f"fp8_moe_prefill: x {x.shape}, ids {topk_ids.shape}, weights {topk_weights.shape}, gate "
                     f"{w_gate.shape}, down {w_down.shape}; expected [M, D], [M, k] twice, [E, I, D] and [E, D, I]")
  mp = mp or tile_rows(M * k, E)
  row, tile_e = route_rows(topk_ids, E, mp)
  T = tile_e.shape[0]
  dt = x.dtype if x.dtype == jnp.float16 else jnp.bfloat16
  # Both directions as gathers through small int tables (a scatter of P ints each): the tiles' rows read their
  # tokens (a tile's pad rows token 0: finite, their products never read), and each token sums its k rows. As a
  # zero-filled [T·mp, D] buffer with the rows scattered in (54 MB a layer and chunk at the release, M = 256) and
  # a scatter-add into a zeroed [M, D] output, XLA zero-filled every MoE layer's row buffer in one multi-output
  # broadcast kernel before the chunk's first layer (session 63's compile-only listing).
  src = jnp.zeros((T * mp,), jnp.int32).at[row.reshape(-1)].set(
      jnp.arange(M * k, dtype=jnp.int32) // k, unique_indices=True)
  xs = x.astype(dt)[src]
  h = fp8_grouped_gate_up(xs, tile_e, w_gate, s_gate, w_up, s_up, swiglu_limit=swiglu_limit, mp=mp, a_from=a_from,
                          mma=mma, rows=rows)
  # each pair's product in bf16 (summed over the token's k pairs in f32 below): the [T·mp, D] rows (tiles padded,
  # T a static bound: 3.25x the pairs at the release's M = 256) are written by the kernel, transposed by XLA
  # (unless ``rows``) and gathered — in f32 9.2 GB of the chunk's 46 GB of kernel outputs at one TP4 rank
  # (session 63's listing)
  sub = 0
  if down_resident:
    sub = resident_sub_tiles(D, I, mp, jnp.dtype(dt).itemsize)
    if check_mma(mma, "fp8_moe_prefill") or sub < 2:
      raise ValueError(f"fp8_moe_prefill: down_resident needs the wgmma form and h's [{mp}, {I}] tile within "
                       f"RESIDENT_MAX_BYTES = {RESIDENT_MAX_BYTES} with N / bm > 1 (mma {mma!r})")
  y = fp8_grouped_linear(h, tile_e, w_down, s_down, mp=mp, a_from=a_from, out_dtype=jnp.bfloat16,
                         mma=mma, rows=rows, resident=sub, tokens_m=down_tokens_m)  # [T·mp, D]
  return jnp.sum(topk_weights.astype(jnp.float32)[..., None] * y[row], axis=1)  # (the gather fused into the sum)
