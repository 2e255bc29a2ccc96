"""MoE router selection (spec model.md §3.7, the router of a MoE layer after its logits): Mosaic GPU kernel + jnp
reference.

Shapes: M token rows, E routed experts (288), k experts per token (8).

  s = sigmoid(logits);  ids = top_k(s + bias, k) (lax.top_k's order: ties to the lower index, NaN above +inf)
  w = s[ids];  w = w / (w_0 + w_1 + ... + w_{k-1} + 1e-20) when norm;  w = w · scaling

``router_topk`` does all of it in one launch (one CTA, one warpgroup, per token row). In XLA it was three
kernels after the logits' GEMV on the decode's critical path — the keys, a [E, E] rank count and a [k, E] select
(``glm5_jax.layers.topk_by_rank``: 1.3 + 1.4 + 1.7 µs per MoE layer on the H200, session 27's profile).

Kernel design: the row's E logits and the bias are TMA'd (boxes of <= 256) into SMEM vectors padded to a multiple
of 128 (pads: logit -inf, never selected), held in registers (E / 128 per thread); k rounds of three warpgroup
reductions — the largest key not yet taken (the keys are lax.top_k's total order of the f32 bit patterns, as
``topk_by_rank``), the lowest index holding it, and its s (a masked sum with one nonzero term: exact) — then the
normalisation on k scalars in rank order (the same adds as the XLA path) and one 4k-byte TMA store per output.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._common import kernel_entry, mgpu_kernel, order_key, warp_rows_layout

LANES = 128  # threads of the warpgroup: E is padded to a multiple
BOX = 256  # TMA box limit per dimension
NORM_EPS = 1e-20
_INT_MIN = -2 ** 31
_NONE = 2 ** 30  # an index above any expert: "no candidate" in the lowest-index reduction


def _check(logits, bias, k):
  M, E = logits.shape if logits.ndim == 2 else (None, None)
  if logits.ndim != 2 or logits.dtype != jnp.float32 or bias.shape != (E,) or bias.dtype != jnp.float32:
    raise ValueError(f"router_topk: logits {logits.shape} {logits.dtype}, bias {bias.shape} {bias.dtype}; "
                     "expected f32 logits [M, E] and an f32 bias [E]")
  if not 1 <= k <= min(E, LANES) or k % 4 or E % 4:
    raise ValueError(f"router_topk: k = {k} of E = {E} experts; the kernel takes k a multiple of 4 up to "
                     f"min(E, {LANES}) and E a multiple of 4 (16-byte TMA rows)")
  return M, E


def router_topk_reference(logits, bias, *, k: int, scaling: float, norm: bool):
  """logits [M, E] f32, bias [E] f32 -> (ids [M, k] int32, w [M, k] f32), by lax.top_k (the stock router's math:
  glm5_jax.layers.Router with the sort)."""
  _check(logits, bias, k)
  s = jax.nn.sigmoid(logits)
  _, ids = lax.top_k(s + bias, k)
  w = jnp.take_along_axis(s, ids, axis=-1)
  if norm:
    tot = w[:, 0:1]
    for j in range(1, k):
      tot = tot + w[:, j:j + 1]
    w = w / (tot + NORM_EPS)
  return ids.astype(jnp.int32), w * scaling


def _stage_row(l_g, b_g, l_s, b_s, bar, m, E: int):
  """Row m of the logits and the bias into l_s / b_s [EP] (TMA boxes of <= 256; the pads written first — logit
  -inf, bias 0 — and made visible to the TMA before it writes the real entries beside them); waits for them."""
  EP = l_s.shape[0]
  vec = plgpu.Layout.WG_STRIDED((EP,), vec_size=1)
  l_s[...] = plgpu.layout_cast(jnp.full((EP,), -jnp.inf, jnp.float32), vec)
  b_s[...] = plgpu.layout_cast(jnp.zeros((EP,), jnp.float32), vec)
  plgpu.commit_smem()
  for c0 in range(0, E, BOX):
    n = min(BOX, E - c0)
    plgpu.copy_gmem_to_smem(l_g.at[m, pl.ds(c0, n)], l_s.at[pl.ds(c0, n)], bar)
    plgpu.copy_gmem_to_smem(b_g.at[pl.ds(c0, n)], b_s.at[pl.ds(c0, n)], bar)
  plgpu.barrier_wait(bar)


def _select_row(l_s, b_s, E: int, k: int, scaling: float, norm: bool, rounds=None):
  """One row's selection from its staged logits / bias -> (ids [128] int32, w [128] f32) registers, the first k
  entries meaningful: k rounds of the largest key not yet taken, the lowest index holding it and its s; then the
  normalisation on the k weights in rank order and the scaling. ``rounds`` (an int32 scalar, at most k): only the
  ids of the first ``rounds`` ranks, two reductions a round (no weights: w is None) — what a caller that needs
  one rank's expert waits for."""
  EP = l_s.shape[0]
  vec = plgpu.Layout.WG_STRIDED((EP,), vec_size=1)
  out = plgpu.Layout.WG_STRIDED((LANES,), vec_size=1)
  s = jax.nn.sigmoid(plgpu.load(l_s, layout=vec))
  key = order_key(s + plgpu.load(b_s, layout=vec))
  iota = plgpu.broadcasted_iota(jnp.int32, (EP,), 0, layout=vec)
  taken = jnp.where(iota >= E, 1, 0)  # (int32 masks: i1 arrays do not combine in registers)
  slot = plgpu.broadcasted_iota(jnp.int32, (LANES,), 0, layout=out)

  def pick(taken):
    cand = jnp.where(taken != 0, jnp.int32(_INT_MIN), key)
    top = jnp.max(cand)
    # the lowest index with the top key among those not taken (a key can equal the taken marker: -NaN)
    idx = jnp.min(jnp.where(taken != 0, jnp.int32(_NONE), jnp.where(cand == top, iota, jnp.int32(_NONE))))
    return idx, iota == idx

  zeros = plgpu.layout_cast(jnp.zeros((LANES,), jnp.int32), out)
  if rounds is not None:
    def select_id(j, carry):
      taken, ids_v = carry
      idx, hit = pick(taken)
      return jnp.where(hit, 1, taken), jnp.where(slot == j, idx, ids_v)

    return lax.fori_loop(0, rounds, select_id, (taken, zeros))[1], None

  def select(j, carry):  # the j-th expert: a loop, not k unrolled copies (code each CTA runs once)
    taken, ids_v, w_v, tot = carry
    idx, hit = pick(taken)
    v = jnp.sum(jnp.where(hit, s, 0.0))  # one nonzero term: exact (a where: no NaN leaks in)
    # (the k weights summed in rank order, as the XLA path: 0 + w_0 + w_1 + ...)
    return jnp.where(hit, 1, taken), jnp.where(slot == j, idx, ids_v), jnp.where(slot == j, v, w_v), tot + v

  _, ids_v, w_v, tot = lax.fori_loop(0, k, select, (taken, zeros, zeros.astype(jnp.float32), jnp.float32(0)))
  if norm:
    w_v = w_v / (tot + NORM_EPS)
  return ids_v, w_v * scaling


def _store_row(ids_v, w_v, ids_s, w_s, ids_g, w_g, m, k: int):
  """The row's k ids and weights through SMEM to row m of the outputs (the caller waits for the stores)."""
  ids_s[...] = ids_v
  w_s[...] = w_v
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(ids_s.at[pl.ds(0, k)], ids_g.at[m])
  plgpu.copy_smem_to_gmem(w_s.at[pl.ds(0, k)], w_g.at[m])


def _router_kernel(E: int, k: int, scaling: float, norm: bool):
  def body(l_g, b_g, ids_g, w_g, l_s, b_s, ids_s, w_s, bar):
    m = lax.axis_index("m")
    _stage_row(l_g, b_g, l_s, b_s, bar, m, E)
    ids_v, w_v = _select_row(l_s, b_s, E, k, scaling, norm)
    _store_row(ids_v, w_v, ids_s, w_s, ids_g, w_g, m, k)
    plgpu.wait_smem_to_gmem(0)

  return body


@kernel_entry("k", "scaling", "norm")
def router_topk(logits, bias, *, k: int, scaling: float, norm: bool):
  """Mosaic GPU version of ``router_topk_reference`` (same signature and outputs; ids equal, w to the last ulp of
  the GPU's sigmoid): one CTA per token row, its warpgroup's reductions (each a cross-warp SMEM exchange and a
  barrier: 3 per selected expert, k rounds — ~5.2 µs per call at one row on the H200, session 39's profile).
  (Its rows as one CTA with a warp each — router_route's selection, ``_select_rows`` — were natively equal and no
  faster in the step, sessions 39 and 42: policy router_warp_rows, removed in session 54.)"""
  M, E = _check(logits, bias, k)
  EP = -(-E // LANES) * LANES
  f32 = jnp.float32
  return mgpu_kernel(
      _router_kernel(E, int(k), float(scaling), bool(norm)),
      out_type=(jax.ShapeDtypeStruct((M, k), jnp.int32), jax.ShapeDtypeStruct((M, k), f32)),
      grid=(M,),
      grid_names=("m",),
      kernel_name="glm5_router_topk",
      scratch_types=[plgpu.SMEM((EP,), f32), plgpu.SMEM((EP,), f32), plgpu.SMEM((LANES,), jnp.int32),
                     plgpu.SMEM((LANES,), f32), plgpu.Barrier(num_arrivals=2 * (-(-E // BOX)))],
  )(logits, bias)


# ----------------------------------------------------------------------------------------- router + slot tables
ROUTE_MAX_ROWS = 4  # token rows up to which router_route runs: a warp per row of one warpgroup (warp_rows_layout)


def router_route_reference(logits, bias, *, k: int, scaling: float, norm: bool, num_experts: int, n_pad: int,
                           mp: int, shared: bool):
  """``router_topk_reference`` then ``linear.moe_route_reference`` on its ids and weights -> (ids [M, k] int32, w
  [M, k] f32, eids [n_pad] int32, n_valid [4] int32, r [n_pad, mp] f32)."""
  from pallas_kernels import linear as kl  # noqa: PLC0415
  ids, w = router_topk_reference(logits, bias, k=k, scaling=scaling, norm=norm)
  return ids, w, *kl.moe_route_reference(ids, w, num_experts=num_experts, n_pad=n_pad, mp=mp, shared=shared)


def _rows_scratch(EP: int):
  """l_s, b_s [4, EP] f32 and ids_s, w_s [4, 128]: router_route's SMEM (a warp per row)."""
  R = ROUTE_MAX_ROWS
  return [plgpu.SMEM((R, EP), jnp.float32), plgpu.SMEM((R, EP), jnp.float32), plgpu.SMEM((R, LANES), jnp.int32),
          plgpu.SMEM((R, LANES), jnp.float32)]


def _stage_rows(l_g, b_g, l_s, b_s, bar, M: int, E: int):
  """The M rows' logits and the bias (in every row of b_s) into [4, EP] SMEM tiles: pads first (logit -inf —
  never selected — bias 0; rows past M: all pads), made visible to the TMA before it writes beside them; waits."""
  R, EP = l_s.shape
  l_s[...] = jnp.full((R, EP), -jnp.inf, jnp.float32)
  b_s[...] = jnp.zeros((R, EP), jnp.float32)
  plgpu.commit_smem()
  for c0 in range(0, E, BOX):
    n = min(BOX, E - c0)
    for m in range(M):
      plgpu.copy_gmem_to_smem(l_g.at[m, pl.ds(c0, n)], l_s.at[m, pl.ds(c0, n)], bar)
      plgpu.copy_gmem_to_smem(b_g.at[pl.ds(c0, n)], b_s.at[m, pl.ds(c0, n)], bar)
  plgpu.barrier_wait(bar)


def _route_rows(l_g, b_g, ids_g, w_g, l_s, b_s, ids_s, w_s, bar, M: int, E: int, k: int, scaling: float,
                norm: bool):
  """Stage the M rows, select (a warp per row), and store each row's k ids / weights to ids_g / w_g through ids_s
  / w_s [4, 128] (left there for router_route's tables; the caller waits for the stores)."""
  _stage_rows(l_g, b_g, l_s, b_s, bar, M, E)
  ids_v, w_v = _select_rows(l_s, b_s, E, k, scaling, norm)
  ids_s[...] = ids_v
  w_s[...] = w_v
  plgpu.commit_smem()  # (its warpgroup barrier: every warp's row in SMEM before anyone reads them)
  for m in range(M):
    plgpu.copy_smem_to_gmem(ids_s.at[m, pl.ds(0, k)], ids_g.at[m])
    plgpu.copy_smem_to_gmem(w_s.at[m, pl.ds(0, k)], w_g.at[m])


def _select_rows(l_s, b_s, E: int, k: int, scaling: float, norm: bool):
  """``_select_row`` for the 4 rows of l_s / b_s [4, EP] at once, row m on warp m (warp_rows_layout) -> (ids [4,
  128] int32, w [4, 128] f32) registers, the first k entries of each row meaningful. The same selection, adds and
  order as _select_row (row-wise maxima / minima / sums instead of the warpgroup's). The
  first form ran a warpgroup per row, and Mosaic GPU's warpgroup reductions — their cross-warp scratch one SMEM
  slot shared by the CTA's warpgroups — mixed the rows natively (session 34; tests/test_router_kernel.py: the
  race)."""
  R, EP = l_s.shape
  rows = warp_rows_layout()
  s = jax.nn.sigmoid(plgpu.load(l_s, layout=rows))
  key = order_key(s + plgpu.load(b_s, layout=rows))
  iota = plgpu.broadcasted_iota(jnp.int32, (R, EP), 1, layout=rows)
  taken = jnp.where(iota >= E, 1, 0)
  slot = plgpu.broadcasted_iota(jnp.int32, (R, LANES), 1, layout=rows)
  wide = lambda v, n: lax.broadcast_in_dim(v, (R, n), (0,))  # a row's value to each of its n columns

  def pick(taken):
    cand = jnp.where(taken != 0, jnp.int32(_INT_MIN), key)
    top = jnp.max(cand, axis=1)
    idx = jnp.min(jnp.where(taken != 0, jnp.int32(_NONE), jnp.where(cand == wide(top, EP), iota, jnp.int32(_NONE))),
                  axis=1)
    return idx, iota == wide(idx, EP)

  zeros = plgpu.layout_cast(jnp.zeros((R, LANES), jnp.int32), rows)
  def select(j, carry):
    taken, ids_v, w_v, tot = carry
    idx, hit = pick(taken)
    v = jnp.sum(jnp.where(hit, s, 0.0), axis=1)
    return (jnp.where(hit, 1, taken), jnp.where(slot == j, wide(idx, LANES), ids_v),
            jnp.where(slot == j, wide(v, LANES), w_v), tot + v)

  _, ids_v, w_v, tot = lax.fori_loop(0, k, select, (taken, zeros, zeros.astype(jnp.float32),
                                                    jnp.zeros((R,), jnp.float32)))
  if norm:
    w_v = w_v / wide(tot + NORM_EPS, LANES)
  return ids_v, w_v * scaling


def _router_route_kernel(M: int, E: int, k: int, scaling: float, norm: bool, mp: int, shared: bool):
  from pallas_kernels import linear as kl  # noqa: PLC0415

  def body(l_g, b_g, ids_g, w_g, eids_g, nv_g, r_g, l_s, b_s, ids_s, w_s, e_s, n_s, r_s, bar):
    _route_rows(l_g, b_g, ids_g, w_g, l_s, b_s, ids_s, w_s, bar, M, E, k, scaling, norm)
    eids, count, r = kl.route_tables(lambda i, j: ids_s[i, j], lambda i, j: w_s[i, j], M, k, E, mp, shared)
    kl.store_route_tables(eids, count, r, e_s, n_s, r_s, eids_g, nv_g, r_g)
    plgpu.wait_smem_to_gmem(0)

  return body


@kernel_entry("k", "scaling", "norm", "num_experts", "n_pad", "mp", "shared")
def router_route(logits, bias, *, k: int, scaling: float, norm: bool, num_experts: int, n_pad: int, mp: int,
                 shared: bool):
  """Mosaic GPU version of ``router_route_reference``: ``router_topk``'s selection for M <= ROUTE_MAX_ROWS token
  rows (one warpgroup, a warp per row: ``_select_rows``) and then ``linear.moe_route``'s slot tables from them —
  one launch instead of two on the MoE layer's critical path at q >= 2."""
  from pallas_kernels import linear as kl  # noqa: PLC0415
  M, E = _check(logits, bias, k)
  if not 2 <= M <= ROUTE_MAX_ROWS or num_experts != E or M > mp or n_pad > LANES or n_pad % 8:
    raise ValueError(f"router_route: logits {logits.shape}, num_experts {num_experts}, n_pad {n_pad}, mp {mp}; "
                     f"expected 2..{ROUTE_MAX_ROWS} token rows of num_experts logits, M <= mp, n_pad a multiple "
                     f"of 8 <= {LANES} (one row: router_topk, whose ids are the slot table)")
  EP = -(-E // LANES) * LANES
  f32, i32 = jnp.float32, jnp.int32
  return mgpu_kernel(
      _router_route_kernel(M, E, int(k), float(scaling), bool(norm), int(mp), bool(shared)),
      out_type=(jax.ShapeDtypeStruct((M, k), i32), jax.ShapeDtypeStruct((M, k), f32),
                *kl.route_out_types(n_pad, mp)),
      grid=(1,),
      grid_names=("c",),
      kernel_name="glm5_router_route",
      scratch_types=[*_rows_scratch(EP), *kl.route_scratch(mp),
                     plgpu.Barrier(num_arrivals=2 * M * (-(-E // BOX)))],
  )(logits, bias)
