"""KDA (Kimi Delta Attention) multi-token decode recurrence: Pallas Mosaic GPU kernel + pure-jnp reference.

Spec: model.md §3.5 (steps 3-7), decode.md §1.2 (one recurrent-state slot per verify position).

Per sequence b, head h and token t (all fp32), with the state S in the HF layout [K, V]:

  g     = lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias[h]))     per key channel, in (lower_bound, 0)
  alpha = exp(g);  beta = sigmoid(b)
  q     = l2norm(q) * D**-0.5;  k = l2norm(k);   l2norm(x) = x / sqrt(sum(x^2) + 1e-6)
  S     = diag(alpha) S;  r = S^T k;  delta = beta * (v - r);  S = S + k delta^T;  o = S^T q

The recurrence starts from slot num_accepted[b] - 1 and writes the state after token t into slot t.
``kda_decode_conv`` takes q, k, v one step earlier — the qkv projection's rows and the short conv's history and
taps — and computes q, k, v = silu(Σ_j w_j x[t - Kc + 1 + j]) (rounded to the rows' dtype) in the kernel.

Kernel design (`kda_decode`):
  * One warpgroup owns a [K=128, BV] column slice of one (b, h) state (BV = 32 by default, like fla's BV): the
    slice lives in registers for the whole T-token loop, is read once from GMEM and written once per slot. The
    V dimension is split over D // BV warpgroups, which sit either in one CTA (needed for the fused norm: the
    per-head RMS spans all of V) or in separate CTAs (more SMs busy at small B).
  * Register layout of the slice: K over 16 lanes x 8 registers, V over 4 warps x 2 lanes x 4-vectors. So the
    two reductions over K per token (S^T k and S^T q) stay inside a warp (8 in-thread adds + 4 shuffle rounds),
    and GMEM loads/stores are 16-byte vectors. Everything is elementwise + reductions: no dot_general.
  * The state update is in place: the kernel runs under `pl.run_state` and writes the state ref it closes
    over, so under `jax.jit(..., donate_argnums=...)` the custom call aliases the state operand
    (`output_operand_aliases`) and XLA copies nothing.
  * The per-head q/k/f/v(/gate) rows of all T tokens are TMA-copied into SMEM at the start (one barrier), so
    no GMEM load sits behind a state store inside the token loop.
  * Lane lowering semantics (explicit layouts); no automatic barriers: warpgroups share only the prefetched
    rows and the per-head o buffer of the fused norm, both ordered by mbarriers.

Measured on one H200 (benchmarks/bench_kda_decode.py, H=16, bf16 inputs, in-graph per call): B=32 T=4 fused
norm ~100 us (1.7 TB/s of state traffic, 2.1x the XLA reference); at B <= 8 every variant sits near a ~18 us
per-call floor that an empty kernel with the same operands also shows (launch / framework cost, not the kernel).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import fragmented_array as mgpu_fa
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._common import interpreting, kernel_entry, replicated_rows_layouts, tiled, with_pdl

L2NORM_EPS = 1e-6
_DEBUG = False  # True: print the kernel jaxpr and Mosaic GPU module when lowering

__all__ = ["KdaDecodeConfig", "kda_decode", "kda_decode_reference", "kda_decode_naive", "kda_decode_conv",
           "kda_decode_conv_reference", "short_conv_reference"]


# --------------------------------------------------------------------------------------------------
# Shared pieces
# --------------------------------------------------------------------------------------------------
def _check_b_offset(b, H, b_offset):
  # A static offset is checked here (the references run unjitted); a traced one — the TP rank's axis_index, and
  # always inside the jitted kernel entry — is the caller's to keep in range: the kernel would read past the row,
  # the reference's dynamic_slice would clamp.
  if isinstance(b_offset, (int, np.integer)) and not 0 <= b_offset <= b.shape[2] - H:
    raise ValueError(f"b_offset={b_offset} must be in [0, {b.shape[2] - H}] for b with {b.shape[2]} columns "
                     f"and H={H}")


def _check_shapes(q, k, v, f, b, A_log, dt_bias, state, num_accepted, gate, norm_weight):
  B, T, H, D = q.shape
  for name, x in (("k", k), ("v", v)):
    if x.shape != (B, T, H, D):
      raise ValueError(f"{name} must be [B, T, H, D] = {(B, T, H, D)}, got {x.shape}")
  if f.ndim != 4 or f.shape[:2] != (B, T) or f.shape[2] < H or f.shape[3] != D:
    raise ValueError(f"f must be [B, T, >= H, D] with B={B} T={T} H={H} D={D} (heads past H ignored), got {f.shape}")
  if b.ndim != 3 or b.shape[:2] != (B, T) or b.shape[2] < H:
    raise ValueError(f"b must be [B, T, >= H] with B={B} T={T} H={H} (b_offset picks the H columns), got {b.shape}")
  if A_log.shape != (H,) or dt_bias.shape != (H, D):
    raise ValueError(f"A_log must be [H], dt_bias [H, D]; got {A_log.shape}, {dt_bias.shape}")
  if state.ndim != 5 or state.shape[0] != B or state.shape[2:] != (H, D, D) or state.shape[1] < T:
    raise ValueError(f"state must be [B, Q >= T, H, D, D] with B={B} T={T} H={H} D={D}, got {state.shape}")
  if state.dtype != jnp.float32:
    raise ValueError(f"state must be float32, got {state.dtype}")
  if num_accepted.shape != (B,):
    raise ValueError(f"num_accepted must be [B], got {num_accepted.shape}")
  if (gate is None) != (norm_weight is None):
    raise ValueError("gate and norm_weight must be given together (fused gated RMSNorm)")
  if gate is not None and (gate.shape != (B, T, H, D) or norm_weight.shape != (D,)):
    raise ValueError(f"gate must be [B, T, H, D], norm_weight [D]; got {gate.shape}, {norm_weight.shape}")
  return B, T, H, D, state.shape[1]


def _gated_rms_norm(o, gate, norm_weight, eps):
  """o, gate: [..., D]; norm_weight: [D]. fp32 result: w * o / sqrt(mean(o^2) + eps) * sigmoid(gate)."""
  o = o.astype(jnp.float32)
  return _gated_scale(o, lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + eps), gate, norm_weight)


def _gated_scale(o, inv, gate, norm_weight):
  """The gated norm's elementwise tail: w * (o * inv) * sigmoid(gate), o f32, inv its rows' 1/RMS [..., 1]."""
  return norm_weight.astype(jnp.float32) * (o * inv) * jax.nn.sigmoid(gate.astype(jnp.float32))


def norm_partials_reference(o, nv: int):
  """o [..., D] -> [..., nv]: the sums of o² over each of nv consecutive column blocks (the kernel's
  ``norm_partials``: one per CTA of a head)."""
  o = o.astype(jnp.float32)
  return jnp.sum(jnp.square(o.reshape(*o.shape[:-1], nv, o.shape[-1] // nv)), axis=-1)


def gated_norm_from_partials(o, partials, gate, norm_weight, eps):
  """``_gated_rms_norm`` (the model's gated RMSNorm after the kernel) from the kernel's ``norm_partials`` [..., nv]
  instead of a reduction over o: mean(o²) = (p_0 + p_1 + ...) / D as explicit adds, so the whole norm is
  elementwise and XLA fuses it into its consumer's fusion (the o_proj GEMV) — no norm kernel of its own between
  the KDA kernel and the projection."""
  o = o.astype(jnp.float32)
  ss = partials[..., 0]
  for j in range(1, partials.shape[-1]):
    ss = ss + partials[..., j]
  return _gated_scale(o, lax.rsqrt(ss * (1.0 / o.shape[-1]) + eps)[..., None], gate, norm_weight)


# --------------------------------------------------------------------------------------------------
# Pure-jnp reference (vectorised over B and H, loops over the T <= 8 tokens)
# --------------------------------------------------------------------------------------------------
def _own_heads(f, b, H, b_offset):
  """f [B, T, >= H, D] -> its first H heads; b [B, T, >= H] -> the H columns from b_offset (traced)."""
  _check_b_offset(b, H, b_offset)
  return f[:, :, :H], lax.dynamic_slice_in_dim(b, jnp.asarray(b_offset, jnp.int32), H, axis=2)


def gate_projections(rows, f_proj, H: int):
  """The KDA gates' second low-rank projections (f_b, g_b) per head, as the model computes them: rows [B, T, >= 2r]
  (f_a in columns 0..r-1, g_a in r..2r-1: the fgb_a projection output), f_proj [2, H·D, 2r] (the model's fg_b
  weight: f_b block-diagonally on f_a's columns, g_b on g_a's) -> (f, gate) [B, T, H, D] f32, each rounded to
  the rows' dtype first (the projection's output dtype in the model)."""
  r = _check_f_proj(rows, f_proj, H)
  D = f_proj.shape[1] // H
  f32, hi = jnp.float32, lax.Precision.HIGHEST
  x = rows.astype(f32)
  f = jnp.einsum("btr,nr->btn", x[..., :r], f_proj[0, :, :r].astype(f32), precision=hi)
  g = jnp.einsum("btr,nr->btn", x[..., r:2 * r], f_proj[1, :, r:].astype(f32), precision=hi)
  B, T = rows.shape[:2]
  return tuple(a.astype(rows.dtype).astype(f32).reshape(B, T, H, D) for a in (f, g))


def _check_f_proj(rows, f_proj, H: int) -> int:
  """The low-rank rows and the block-diagonal f_b / g_b weight of ``f_proj``; returns the rank r."""
  if f_proj.ndim != 3 or f_proj.shape[0] != 2 or f_proj.shape[2] % 2 or f_proj.shape[1] % H:
    raise ValueError(f"f_proj must be [2, H·D, 2r] (f_b | g_b block-diagonally, this device's H={H} heads), got "
                     f"{f_proj.shape}")
  r = f_proj.shape[2] // 2
  if rows.ndim != 3 or rows.shape[2] < 2 * r:
    raise ValueError(f"with f_proj the f argument is the low-rank rows [B, T, >= 2r = {2 * r}] (f_a | g_a), got "
                     f"{rows.shape}")
  if rows.dtype != f_proj.dtype:
    raise ValueError(f"the low-rank rows ({rows.dtype}) and f_proj ({f_proj.dtype}) must share a dtype")
  return r


def kda_decode_reference(q, k, v, f, b, A_log, dt_bias, state, num_accepted, *, lower_bound=-5.0,
                         gate=None, norm_weight=None, norm_eps=1e-5, b_offset=0, f_proj=None):
  """KDA decode recurrence over T tokens, pure jnp (fp32 math).

  q, k, v: [B, T, H, D] (bf16 or f32), after the short conv + SiLU, before l2-norm.
  f: [B, T, >= H, D] forget-gate logits (f_b(f_a(x)), before dt_bias): heads 0 .. H-1 (more may follow — the
    gate's, in the same projection output — and are ignored: the kernel reads the array in place, no slice).
  b: [B, T, >= H] beta logits: head h at column b_offset + h (b_offset: an int or a traced int32 scalar — this
    TP rank's heads inside the replicated projection output, read in place).
  A_log: [H] f32.  dt_bias: [H, D] f32.
  state: [B, Q, H, D, D] f32, one slot per verify position (Q >= T), layout [K, V].
  num_accepted: [B] int32 in [1, Q]; the recurrence starts from slot num_accepted - 1.
  gate, norm_weight: optional fused gated RMSNorm, gate [B, T, H, D] logits, norm_weight [D].
  f_proj: optional [2, H·D, 2r], the f_b / g_b projections (``gate_projections``): f is then the low-rank rows
    [B, T, >= 2r] and the gate logits [B, T, H, D] f32 come back as a third result (not with the fused norm).
  Returns (o [B, T, H, D] f32, new_state [B, Q, H, D, D] f32): slot t < T holds the state after token t,
  slots >= T are unchanged.
  """
  if f_proj is not None:
    if gate is not None:
      raise ValueError("f_proj returns the gate logits for the norm after the kernel; the fused norm (gate=) "
                       "takes them as an input: not both")
    f, g = gate_projections(f, f_proj, q.shape[2])
    return (*kda_decode_reference(q, k, v, f, b, A_log, dt_bias, state, num_accepted, lower_bound=lower_bound,
                                  b_offset=b_offset), g)
  B, T, H, D, Q = _check_shapes(q, k, v, f, b, A_log, dt_bias, state, num_accepted, gate, norm_weight)
  f, b = _own_heads(f, b, H, b_offset)
  f32 = jnp.float32
  hi = lax.Precision.HIGHEST  # the reference must not drop to TF32 on GPU
  q, k, v, f, b = (x.astype(f32) for x in (q, k, v, f, b))
  # Gates and normalisations for all tokens at once: [B, T, H, D] / [B, T, H].
  g = lower_bound * jax.nn.sigmoid(jnp.exp(A_log.astype(f32))[:, None] * (f + dt_bias.astype(f32)))
  alpha = jnp.exp(g)
  beta = jax.nn.sigmoid(b)
  q = q * lax.rsqrt(jnp.sum(q * q, axis=-1, keepdims=True) + L2NORM_EPS) * (D ** -0.5)
  k = k * lax.rsqrt(jnp.sum(k * k, axis=-1, keepdims=True) + L2NORM_EPS)

  s = state[jnp.arange(B), num_accepted.astype(jnp.int32) - 1]  # [B, H, K, V]
  outs, states = [], []
  for t in range(T):
    s = s * alpha[:, t, :, :, None]
    r = jnp.einsum("bhkv,bhk->bhv", s, k[:, t], precision=hi)
    delta = beta[:, t, :, None] * (v[:, t] - r)
    s = s + k[:, t, :, :, None] * delta[:, :, None, :]
    outs.append(jnp.einsum("bhkv,bhk->bhv", s, q[:, t], precision=hi))
    states.append(s)
  o = jnp.stack(outs, axis=1)  # [B, T, H, V]
  new_state = lax.dynamic_update_slice_in_dim(state, jnp.stack(states, axis=1), 0, axis=1)
  if gate is not None:
    o = _gated_rms_norm(o, gate, norm_weight, norm_eps)
  return o, new_state


def kda_decode_naive(q, k, v, f, b, A_log, dt_bias, state, num_accepted, *, lower_bound=-5.0,
                     gate=None, norm_weight=None, norm_eps=1e-5, b_offset=0):
  """Literal per-sequence, per-token, per-head recurrence in numpy float64 (the oracle for the reference).

  Same arguments and results as `kda_decode_reference` (results as float64 numpy arrays).
  """
  f, b = _own_heads(jnp.asarray(f), jnp.asarray(b), q.shape[2], b_offset)
  q, k, v, f, b, A_log, dt_bias, state = (np.asarray(jnp.asarray(x, jnp.float32), np.float64)
                                          for x in (q, k, v, f, b, A_log, dt_bias, state))
  num_accepted = np.asarray(num_accepted)
  if gate is not None:
    gate, norm_weight = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (gate, norm_weight))
  B, T, H, D = q.shape
  o = np.zeros((B, T, H, D))
  new_state = state.copy()
  for bi in range(B):
    for h in range(H):
      S = state[bi, num_accepted[bi] - 1, h].copy()  # [K, V]
      for t in range(T):
        g = lower_bound / (1.0 + np.exp(-np.exp(A_log[h]) * (f[bi, t, h] + dt_bias[h])))
        beta = 1.0 / (1.0 + np.exp(-b[bi, t, h]))
        qt = q[bi, t, h] / np.sqrt(np.sum(q[bi, t, h] ** 2) + L2NORM_EPS) * D ** -0.5
        kt = k[bi, t, h] / np.sqrt(np.sum(k[bi, t, h] ** 2) + L2NORM_EPS)
        S = np.exp(g)[:, None] * S
        delta = beta * (v[bi, t, h] - S.T @ kt)
        S = S + np.outer(kt, delta)
        ot = S.T @ qt
        if gate is not None:
          ot = norm_weight * ot / np.sqrt(np.mean(ot ** 2) + norm_eps) / (1.0 + np.exp(-gate[bi, t, h]))
        o[bi, t, h] = ot
        new_state[bi, t, h] = S
  return o, new_state


def _check_conv(qkv, conv_hist, conv_weight):
  if qkv.ndim != 5 or qkv.shape[2] != 3:
    raise ValueError(f"qkv must be [B, T, 3, H, D] (the q | k | v projection output, before the short conv), got "
                     f"{qkv.shape}")
  B, T, _, H, D = qkv.shape
  if conv_hist.ndim != 5 or conv_hist.shape[0] != B or conv_hist.shape[2:] != (3, H, D):
    raise ValueError(f"conv_hist must be [B, Kc - 1, 3, H, D] with B={B} H={H} D={D}, got {conv_hist.shape}")
  Kc = conv_hist.shape[1] + 1
  if conv_weight.shape != (Kc, 3, H, D):
    raise ValueError(f"conv_weight must be [Kc, 3, H, D] = {(Kc, 3, H, D)} (Kc - 1 = {Kc - 1} history rows), got "
                     f"{conv_weight.shape}")
  if conv_hist.dtype != qkv.dtype:
    raise ValueError(f"conv_hist ({conv_hist.dtype}) and qkv ({qkv.dtype}) must share a dtype (one SMEM window)")
  return Kc


def short_conv_reference(qkv, conv_hist, conv_weight):
  """The KDA short conv + SiLU of ``kda_decode_conv``, as the model computes it: qkv [B, T, 3, H, D] (this call's
  projection outputs), conv_hist [B, Kc - 1, 3, H, D] (the inputs of the Kc - 1 positions before, zeros before
  the sequence), conv_weight [Kc, 3, H, D] (tap j multiplies position t - (Kc - 1) + j) -> (q, k, v) [B, T, H, D]
  f32, each rounded to qkv's dtype first (the model's activations)."""
  Kc = _check_conv(qkv, conv_hist, conv_weight)
  T = qkv.shape[1]
  f32 = jnp.float32
  full = jnp.concatenate([conv_hist.astype(f32), qkv.astype(f32)], axis=1)  # [B, Kc - 1 + T, 3, H, D]
  acc = sum(full[:, j:j + T] * conv_weight[j].astype(f32) for j in range(Kc))
  zc = jax.nn.silu(acc).astype(qkv.dtype).astype(f32)
  return zc[:, :, 0], zc[:, :, 1], zc[:, :, 2]


def kda_decode_conv_reference(qkv, conv_hist, conv_weight, f, b, A_log, dt_bias, state, num_accepted, *,
                              lower_bound=-5.0, gate=None, norm_weight=None, norm_eps=1e-5, b_offset=0,
                              f_proj=None):
  """``kda_decode_reference`` after the short conv + SiLU (``short_conv_reference``): qkv [B, T, 3, H, D] the raw
  projection outputs, conv_hist [B, Kc - 1, 3, H, D], conv_weight [Kc, 3, H, D]; the rest as there."""
  q, k, v = short_conv_reference(qkv, conv_hist, conv_weight)
  return kda_decode_reference(q, k, v, f, b, A_log, dt_bias, state, num_accepted, lower_bound=lower_bound,
                              gate=gate, norm_weight=norm_weight, norm_eps=norm_eps, b_offset=b_offset,
                              f_proj=f_proj)


# --------------------------------------------------------------------------------------------------
# Pallas Mosaic GPU kernel
# --------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class KdaDecodeConfig:
  """Tuning knobs of the kernel.

  block_v: V columns of one (b, h) state owned by one warpgroup (32 or 64; D // block_v warpgroups per head).
  wgs_per_cta: warpgroups per CTA (a divisor of D // block_v). None: all of a head's warpgroups in one CTA
    when the fused norm is requested (its RMS spans all of V), else one warpgroup per CTA (more SMs busy).
    With fewer than D // block_v warpgroups per CTA the gated norm runs as a small XLA epilogue instead.
  prefetch: TMA the per-head q/k/f/v(/gate) rows of all T tokens into SMEM at the start (True), or load each
    token's vectors straight from GMEM inside the token loop (False).
  gates_first: compute every token's gates and normalised q / k (which do not depend on the state) before the
    state recurrence instead of inside each token's step — the same operations, so the same results; an
    experiment on where q = 4's ~1 µs per extra token goes (BENCHMARKS.md session 23-24).
  approx_math: the GPU's approximate exp / reciprocal / rsqrt (Mosaic's approx_math) for the gates (two exps and
    a sigmoid's division per key channel and token) and the l2 norms instead of the IEEE sequences — an
    experiment on issue #6's per-token chain at B = 1 (~1.1 µs per extra token); results within the kernel_f32
    tolerance of the reference.
  token_loop: the T tokens as a loop carrying the state (lax.fori_loop) instead of unrolled. Unrolled, each CTA
    runs T copies of the per-token code once — straight-line code, every instruction a cold fetch (the suspect of
    session 31's slow unrolled kernels); a loop fetches one copy. An experiment on issue #6's per-token cost.
  """
  block_v: int = 32
  wgs_per_cta: int | None = None
  prefetch: bool = True
  gates_first: bool = False
  approx_math: bool = False
  token_loop: bool = False

  def __post_init__(self):
    if self.block_v not in (32, 64):
      raise ValueError(f"block_v must be 32 or 64, got {self.block_v}")
    if self.token_loop and self.gates_first:
      raise ValueError("token_loop computes each token's gates inside its iteration; gates_first needs them unrolled")


@functools.lru_cache(maxsize=None)
def _layouts(D: int, BV: int):
  """Register layouts: state slice [D, BV], K-vectors [D], V-vectors [BV], per-head rows [T, D] (norm)."""
  if D != 128:
    raise NotImplementedError(f"the kernel layout assumes D == 128 (16 lanes x 8 registers over K), got {D}")
  # [128, BV] -> warps own BV/4 columns; inside a warp 16 lanes x 8 registers cover K and 2 lanes x 4-vectors
  # cover 8 columns (x BV/32 registers): K-reductions never leave the warp, GMEM accesses are 16-byte vectors.
  s = mgpu_fa.TiledLayout(mgpu_fa.Tiling(((D, BV), (D, BV // 4), (16, 8), (4,))), warp_dims=(-6,),
                          lane_dims=(-3, -2), vector_dim=-1, _check_canonical=False).canonicalize()
  # [T, 128] rows for the norm epilogue: a warp holds whole rows (32 lanes x 4-vectors), warps replicate.
  rows, row = replicated_rows_layouts(D)
  return dict(S=tiled(s), K=tiled(s.reduce([1])), V=tiled(s.reduce([0])), ROWS=rows, ROW=row)


@kernel_entry("lower_bound", "norm_eps", "config", "norm_partials")
def kda_decode(q, k, v, f, b, A_log, dt_bias, state, num_accepted, *, lower_bound=-5.0,
               gate=None, norm_weight=None, norm_eps=1e-5, config: KdaDecodeConfig | None = None, b_offset=0,
               f_proj=None, norm_partials: bool = False):
  """KDA decode recurrence over T tokens as one Pallas Mosaic GPU kernel; same contract as the reference.

  q, k, v: [B, T, H, D] (bf16 or f32), after the short conv + SiLU, before l2-norm.
  f: [B, T, >= H, D] forget-gate logits (f_b(f_a(x)), before dt_bias), any float dtype; heads past H ignored.
  b: [B, T, >= H] beta logits, head h at column b_offset + h (an int or traced int32 scalar). Both are read in
    place from the projections' outputs (an XLA slice before a custom call is a kernel of its own).
  A_log: [H] f32.  dt_bias: [H, D] f32.
  state: [B, Q, H, D, D] f32, one slot per verify position (Q >= T), layout [K, V]. Updated in place when
    the caller donates it (jax.jit(..., donate_argnums=...)); otherwise XLA copies it once.
  num_accepted: [B] int32 in [1, Q]; the recurrence starts from slot num_accepted - 1 (not range-checked).
  gate, norm_weight: optional fused gated RMSNorm, gate [B, T, H, D] logits, norm_weight [D].
  lower_bound, norm_eps: Python floats (static).  config: tuning knobs (KdaDecodeConfig).
  f_proj: optional [2, H·D, 2r] bf16/f16, the f_b / g_b projections block-diagonally (the model's fg_b weight,
    this device's heads; ``gate_projections``): f is then the low-rank rows [B, T, >= 2r] (f_a | g_a: the fgb_a
    projection's output, read in place, T <= 8) and each CTA forms its head's f = f_a · W_fᵀ and gate logits
    g_a · W_gᵀ itself — two wgmmas on [D, r] weight tiles, rounded to the rows' dtype as the model's projection —
    and returns them as a third result, gate [B, T, H, D] f32, for the norm after the kernel: the XLA GEMV and
    gate fusion between fgb_a and the kernel go (issue #14: the KDA layer's small projections). Not with the
    fused norm (gate=); needs config.prefetch and one warpgroup per CTA.
  norm_partials: each CTA also returns the sums of its o columns' squares, partials [B, T, H, D // block_v] f32
    (``norm_partials_reference``) as a last result: with them the gated RMSNorm after the kernel is elementwise
    (``gated_norm_from_partials``) and fuses into the o_proj GEMV — no norm kernel on the layer's chain. Not
    with the fused norm (gate=).
  Returns (o [B, T, H, D] f32, new_state [B, Q, H, D, D] f32): slot t < T holds the state after token t,
  slots >= T are untouched.
  """
  if f_proj is not None:
    _check_f_proj(f, f_proj, q.shape[2])
    _check_shapes(q, k, v, jax.ShapeDtypeStruct(q.shape, f.dtype), b, A_log, dt_bias, state, num_accepted, gate,
                  norm_weight)
  else:
    _check_shapes(q, k, v, f, b, A_log, dt_bias, state, num_accepted, gate, norm_weight)
  return _kda(q, k, v, f, b, A_log, dt_bias, state, num_accepted, lower_bound, gate, norm_weight, norm_eps,
              config or KdaDecodeConfig(), b_offset, conv=False, f_proj=f_proj, norm_partials=norm_partials)


@kernel_entry("lower_bound", "norm_eps", "config", "norm_partials")
def kda_decode_conv(qkv, conv_hist, conv_weight, f, b, A_log, dt_bias, state, num_accepted, *, lower_bound=-5.0,
                    gate=None, norm_weight=None, norm_eps=1e-5, config: KdaDecodeConfig | None = None, b_offset=0,
                    f_proj=None, norm_partials: bool = False):
  """``kda_decode`` with the short conv + SiLU in the kernel (``kda_decode_conv_reference``'s contract): qkv
  [B, T, 3, H, D] the q | k | v projection output before the conv (a free reshape of the model's [B, T, 3C]),
  conv_hist [B, Kc - 1, 3, H, D] the inputs of the Kc - 1 positions before this call (the conv ring's rows, zeros
  before the sequence; qkv's dtype), conv_weight [Kc, 3, H, D] f32 (tap j multiplies position t - (Kc - 1) + j).
  Each CTA convolves its head's q / k rows and its v columns per token from one SMEM window (the Kc - 1 history
  rows, then this call's T rows) and rounds them to qkv's dtype as the model does: the XLA fusion between the qkv
  projection and the kernel (~2 µs + a dependent launch per KDA layer on the H200, session 29's profile) goes.
  Needs config.prefetch (the window is TMA'd). f_proj and norm_partials as in ``kda_decode`` (each one more
  result, in that order)."""
  Kc = _check_conv(qkv, conv_hist, conv_weight)
  B, T, _, H, D = qkv.shape
  rows = jax.ShapeDtypeStruct((B, T, H, D), qkv.dtype)
  if f_proj is not None:
    _check_f_proj(f, f_proj, H)
  _check_shapes(rows, rows, rows, f if f_proj is None else rows, b, A_log, dt_bias, state, num_accepted, gate,
                norm_weight)
  config = config or KdaDecodeConfig()
  if not config.prefetch:
    raise ValueError("kda_decode_conv: config.prefetch=False; the conv window is TMA'd into SMEM (prefetch=True)")
  return _kda(qkv, conv_hist, conv_weight.astype(jnp.float32), f, b, A_log, dt_bias, state, num_accepted,
              lower_bound, gate, norm_weight, norm_eps, config, b_offset, conv=Kc, f_proj=f_proj,
              norm_partials=norm_partials)


PROJ_ROWS = 8  # f_proj: the low-rank rows' tile (the wgmma N; the TMA zero-fills the rows past T)


def f_proj_why(rows, f_proj, T: int, *, fused_norm: bool = False, config: KdaDecodeConfig | None = None):
  """Why ``kda_decode(f_proj=...)`` cannot run with these low-rank rows [B, T, C], weight and options (None: it
  can) — the kernel's refusal and the model's policy (kda_gate_proj's ``fits``) in one place."""
  config = config or KdaDecodeConfig()
  wgs = config.wgs_per_cta or (128 // config.block_v if fused_norm else 1)
  r = f_proj.shape[-1] // 2
  return ("the fused norm (gate=): f_proj returns the gate for the norm after the kernel" if fused_norm else
          "config.prefetch=False: the projections' tiles are TMA'd" if not config.prefetch else
          f"{wgs} warpgroups per CTA: one (each would project the same rows into one SMEM tile)" if wgs != 1 else
          f"T={T} token rows: at most {PROJ_ROWS} (one wgmma N tile)" if T > PROJ_ROWS else
          f"rows {rows.dtype} / f_proj {f_proj.dtype}: bf16 or f16 both (the wgmma operands)"
          if rows.dtype != f_proj.dtype or f_proj.dtype not in (jnp.bfloat16, jnp.float16) else
          f"rank {r}: a multiple of 64" if r % 64 else
          # (a lowering constraint of the TMA: interpret mode, which has none, runs the model's tiny geometries)
          f"low-rank rows of {rows.shape[-1]} columns: a multiple of 16 (the TMA's tiles)"
          if rows.shape[-1] % 16 and not interpreting() else None)


def _project_rows(fa_s, ga_s, wf_s, wg_s, f_s, g_s, T: int, dtype):
  """f_proj's projections in a CTA: f_s[t] = W_f · f_a[t] and g_s[t] = W_g · g_a[t] for t < T (wgmma: the [D, r]
  weight tiles as A, the [8, r] token rows transposed as B -> [D, 8] f32), each rounded to the rows' dtype as the
  model's projection output. Column t is picked by a masked row sum (exact: one nonzero term) and stored as one
  SMEM row, which the token loop loads as a K-vector — no transposed store (Mosaic GPU does not lower one)."""
  def mma(acc_f, acc_g):
    plgpu.wgmma(acc_f, wf_s, fa_s.T)
    plgpu.wgmma(acc_g, wg_s, ga_s.T)
    plgpu.wgmma_wait(0)
    return acc_f[...], acc_g[...]

  D = wf_s.shape[0]
  acc = pl.run_scoped(mma, plgpu.ACC((D, PROJ_ROWS), jnp.float32), plgpu.ACC((D, PROJ_ROWS), jnp.float32))
  col = plgpu.broadcasted_iota(jnp.int32, (D, PROJ_ROWS), 1, layout=plgpu.Layout.WGMMA)
  for a, out in zip(acc, (f_s, g_s)):
    for t in range(T):
      row = plgpu.layout_cast(jnp.sum(jnp.where(col == t, a, 0.0), axis=1), plgpu.Layout.WGMMA.reduce(1))
      out[t, :] = row.astype(dtype).astype(jnp.float32)
  plgpu.commit_smem()  # (a warpgroup barrier: the rows are read back in another layout, by other threads)


def _kda(q, k, v, f, b, A_log, dt_bias, state, num_accepted, lower_bound, gate, norm_weight, norm_eps,
         config: KdaDecodeConfig, b_offset, conv: int | bool, f_proj=None, norm_partials: bool = False):
  """The kernel call behind both entries. conv = Kc (kda_decode_conv): q, k, v are (qkv [B, T, 3, H, D],
  conv_hist [B, Kc - 1, 3, H, D], conv_weight [Kc, 3, H, D] f32); False: q, k, v [B, T, H, D] as they are.
  f_proj: f is the low-rank rows and the kernel projects them (``kda_decode``); returns (o, state, gate)."""
  if conv:
    B, T, _, H, D = q.shape
  else:
    B, T, H, D = q.shape
  Kc1 = conv - 1 if conv else 0  # history rows in front of each conv window
  BV = config.block_v
  NV = D // BV  # warpgroups per (b, h)
  fuse_norm = gate is not None
  wgs = config.wgs_per_cta or (NV if fuse_norm else 1)
  if NV % wgs:
    raise ValueError(f"wgs_per_cta={wgs} must divide D // block_v = {NV}")
  norm_in_kernel = fuse_norm and wgs == NV
  if norm_partials and fuse_norm:
    raise ValueError("norm_partials: the sums for a norm after the kernel; gate= fuses the norm: not both")
  proj = f_proj is not None
  if proj:
    r = f_proj.shape[2] // 2
    if why := f_proj_why(f, f_proj, T, fused_norm=fuse_norm, config=config):
      raise ValueError(f"kda_decode(f_proj=...): {why}")
    # 32-byte swizzled tiles of 16 elements: the TMA tiles the whole rows array [B, T, C] by them, and C — 2r + every
    # head's b column — is a multiple of 16, not of 64 (272 on a TP4 rank's share of the real model); a wgmma's
    # operands share one swizzle
    tr = (plgpu.TilingTransform((8, 16)), plgpu.SwizzleTransform(32))
  lay = _layouts(D, BV)
  L_S, L_K, L_V = lay["S"], lay["K"], lay["V"]
  f32 = jnp.float32
  lower_bound = float(lower_bound)
  norm_eps = float(norm_eps)
  q_scale = float(D) ** -0.5

  def load(ref, layout):
    # optimized=False: the "optimized" transfer path only exists for SMEM; GMEM gets plain vector loads.
    return plgpu.load(ref, layout=layout, optimized=False).astype(f32)

  def over_k(x):  # K-vector [D] -> [D, BV], constant along V
    return plgpu.layout_cast(lax.broadcast_in_dim(x, (D, BV), (0,)), L_S)

  def over_v(x):  # V-vector [BV] -> [D, BV], constant along K
    return plgpu.layout_cast(lax.broadcast_in_dim(x, (D, BV), (1,)), L_S)

  def kernel(state_ref, q_ref, k_ref, v_ref, f_ref, b_ref, boff_ref, alog_ref, dtb_ref, na_ref, *more):
    *more, ss_ref = more if norm_partials else (*more, None)
    *more, o_ref, gout_ref = more if proj else (*more, None)
    *norm_refs, w_ref = more if proj else (*more, None)
    # SMEM must be allocated collectively by the CTA's warpgroups (and pl.kernel takes no scratch_types).
    scratch = []
    if config.prefetch:  # per-head rows [T, D] of q, k, f, v (and gate): one TMA each, shared by the CTA
      f_rows = [] if proj else [plgpu.SMEM((T, D), f.dtype)]  # (f_proj: f is formed in the CTA)
      if conv:  # q, k, v: their conv windows [Kc - 1 + T, D] (history rows, then this call's), two TMAs each
        scratch += [plgpu.SMEM((Kc1 + T, D), q.dtype), plgpu.SMEM((Kc1 + T, D), q.dtype), *f_rows,
                    plgpu.SMEM((Kc1 + T, D), q.dtype)]
      else:
        scratch += [plgpu.SMEM((T, D), q.dtype), plgpu.SMEM((T, D), k.dtype), *f_rows, plgpu.SMEM((T, D), v.dtype)]
      scratch += [plgpu.SMEM((T, D), gate.dtype)] if norm_in_kernel else []
      scratch += [plgpu.Barrier(num_arrivals=len(scratch) + (3 if conv else 0) + (4 if proj else 0))]
    if norm_in_kernel:  # o of the whole head for the RMS, and the barrier that publishes it
      scratch += [plgpu.SMEM((T, D), f32), plgpu.Barrier(num_arrivals=wgs)]
    if proj:  # f_a / g_a rows [8, r], the head's W_f / W_g tiles [D, r], and the projected f / gate rows [T, D]
      scratch += [plgpu.SMEM((PROJ_ROWS, r), f.dtype, transforms=tr), plgpu.SMEM((PROJ_ROWS, r), f.dtype, transforms=tr),
                  plgpu.SMEM((D, r), f.dtype, transforms=tr), plgpu.SMEM((D, r), f.dtype, transforms=tr),
                  plgpu.SMEM((T, D), f32), plgpu.SMEM((T, D), f32)]
    refs = (state_ref, o_ref, q_ref, k_ref, v_ref, f_ref, b_ref, boff_ref, alog_ref, dtb_ref, na_ref, *norm_refs)
    if scratch:
      pl.run_scoped(functools.partial(body, *refs, w_ref=w_ref, gout_ref=gout_ref, ss_ref=ss_ref), *scratch,
                    collective_axes="wg" if wgs > 1 else ())
    else:
      body(*refs, ss_ref=ss_ref)

  def body(state_ref, o_ref, q_ref, k_ref, v_ref, f_ref, b_ref, boff_ref, alog_ref, dtb_ref, na_ref, *rest,
           w_ref=None, gout_ref=None, ss_ref=None):
    rest = list(rest)
    gate_ref, nw_ref = (rest.pop(0), rest.pop(0)) if norm_in_kernel else (None, None)
    if proj:
      *rest, fa_s, ga_s, wf_s, wg_s, fp_s, gp_s = rest
    wg = lax.axis_index("wg") if wgs > 1 else 0
    vi = lax.axis_index("v") * wgs + wg
    h = lax.axis_index("h")
    bi = lax.axis_index("b")
    v0 = pl.multiple_of(vi * BV, BV)
    cols = pl.ds(v0, BV)
    rows = lambda ref: ref.at[bi, :, h, :]  # [T, D] view of a [B, T, H, D] input
    f_rows = [] if proj else [rows(f_ref)]
    if conv:  # q_ref = qkv, k_ref = the conv history, v_ref = the conv weights: windows (history, new rows)
      win = lambda i: ((k_ref.at[bi, :, i, h, :], pl.ds(0, Kc1)), (q_ref.at[bi, :, i, h, :], pl.ds(Kc1, T)))
      srcs = [win(0), win(1), *f_rows, win(2)] + ([rows(gate_ref)] if norm_in_kernel else [])
    else:
      srcs = [rows(q_ref), rows(k_ref), *f_rows, rows(v_ref)] + ([rows(gate_ref)] if norm_in_kernel else [])

    if config.prefetch:
      # All per-token inputs are requested before the first state store: plain loads issued after a GMEM
      # store cannot be hoisted above it (possible aliasing), which would serialise one load round trip per token.
      *smem, bar_in = rest[:len(srcs) + 1]
      rest = rest[len(srcs) + 1:]

      def issue():
        for src, dst in zip(srcs, smem):
          for part, at in (src if isinstance(src, tuple) else ((src, None),)):
            plgpu.copy_gmem_to_smem(part, dst if at is None else dst.at[at], bar_in)
        if proj:  # (the rows past T: out of bounds, zero-filled by the TMA)
          plgpu.copy_gmem_to_smem(f_ref.at[bi, pl.ds(0, PROJ_ROWS), pl.ds(0, r)], fa_s, bar_in)
          plgpu.copy_gmem_to_smem(f_ref.at[bi, pl.ds(0, PROJ_ROWS), pl.ds(r, r)], ga_s, bar_in)
          plgpu.copy_gmem_to_smem(w_ref.at[0, pl.ds(h * D, D), pl.ds(0, r)], wf_s, bar_in)
          plgpu.copy_gmem_to_smem(w_ref.at[1, pl.ds(h * D, D), pl.ds(r, r)], wg_s, bar_in)

      if wgs > 1:
        pl.when(wg == 0)(issue)
      else:
        issue()
      srcs = smem
    if proj:
      (q_src, k_src, v_src), f_src = srcs[:3], fp_s
    else:
      q_src, k_src, f_src, v_src = srcs[:4]

    S = plgpu.load(state_ref.at[bi, na_ref[bi] - 1, h, :, cols], layout=L_S, optimized=False)
    a = jnp.exp(alog_ref[h])
    dtb = load(dtb_ref.at[h], L_K)
    hb = boff_ref[0] + h  # this head's column of b
    betas = None if config.token_loop else [jax.nn.sigmoid(b_ref[bi, t, hb].astype(f32)) for t in range(T)]
    if config.prefetch:
      plgpu.barrier_wait(bar_in)
    if proj:
      _project_rows(fa_s, ga_s, wf_s, wg_s, fp_s, gp_s, T, f.dtype)
    if norm_in_kernel:
      o_smem, bar_o = rest

    if conv:  # the taps, loaded once: tap j of q, k (K-vectors) and of this warpgroup's v columns (V-vectors)
      taps = [[load(v_ref.at[j, i, h], L_K) for i in (0, 1)] + [load(v_ref.at[j, 2, h, cols], L_V)]
              for j in range(conv)]

    def conv_row(src, i, t, at=()):  # silu(Σ_j w_j · x[t - Kc + 1 + j]) rounded to qkv's dtype, as the model
      acc = None
      for j in range(conv):
        term = load(src.at[(t + j, *at)], L_V if at else L_K) * taps[j][i]
        acc = term if acc is None else acc + term
      return jax.nn.silu(acc).astype(q.dtype).astype(f32)

    def gates(t):  # token t's inputs that do not depend on the state
      if conv:
        qt, kt, vt = conv_row(q_src, 0, t), conv_row(k_src, 1, t), conv_row(v_src, 2, t, (cols,))
      else:
        qt, kt, vt = load(q_src.at[t], L_K), load(k_src.at[t], L_K), load(v_src.at[t, cols], L_V)
      ft = load(f_src.at[t], L_K)
      alpha = jnp.exp(lower_bound * jax.nn.sigmoid(a * (ft + dtb)))
      # Every warp holds all of K for its columns, so these full reductions need no SMEM.
      kt = kt * lax.rsqrt(jnp.sum(kt * kt) + L2NORM_EPS)
      qt = qt * (lax.rsqrt(jnp.sum(qt * qt) + L2NORM_EPS) * q_scale)
      return qt, kt, vt, alpha

    def advance(t, S, beta, qt, kt, vt, alpha):  # token t: the state after it, stored to slot t; its output
      # Both reductions read the state as it came in: with S' = diag(alpha) S, r = S'^T k = S^T (alpha k) and
      # o = (S' + k delta^T)^T q = S^T (alpha q) + (k . q) delta. The two run side by side and the state's chain
      # per token is one reduction + one FMA instead of scale -> reduce -> update -> reduce: with one warpgroup
      # per SM nothing hides the latency of a dependent step (q = 4 took ~1 µs per token, BENCHMARKS.md).
      # Equal to the reference up to fp32 rounding (another association of the same products).
      r = jnp.sum(S * over_k(alpha * kt), axis=0)
      oq = jnp.sum(S * over_k(alpha * qt), axis=0)
      delta = beta * (vt - r)
      S = S * over_k(alpha) + over_k(kt) * over_v(delta)
      o = oq + jnp.sum(kt * qt) * delta
      state_ref[bi, t, h, :, cols] = S
      if norm_in_kernel:
        o_smem[t, cols] = o
      else:
        o_ref[bi, t, h, cols] = o
      if ss_ref is not None:  # (norm_partials: this CTA's share of the head's sum of squares)
        ss_ref[bi, t, h, vi] = jnp.sum(o * o)
      return S

    if config.token_loop:
      S = lax.fori_loop(0, T, lambda t, S: advance(t, S, jax.nn.sigmoid(b_ref[bi, t, hb].astype(f32)), *gates(t)),
                        S)
    else:
      early = [gates(t) for t in range(T)] if config.gates_first else None
      for t in range(T):  # unrolled: every slot index static, token t + 1's loads free to run ahead
        S = advance(t, S, betas[t], *(early[t] if early else gates(t)))

    if proj:  # this CTA's columns of the gate logits, for the norm after the kernel
      for t in range(T):
        gout_ref[bi, t, h, cols] = plgpu.load(gp_s.at[t, cols], layout=L_V, optimized=False)

    if norm_in_kernel:
      # The RMS spans all of V: every warpgroup publishes its o columns to SMEM (mbarrier arrive = release),
      # warpgroup 0 waits (acquire) and finishes the whole head.
      plgpu.barrier_arrive(bar_o)

      @pl.when(wg == 0)
      def _():
        plgpu.barrier_wait(bar_o)
        o_all = plgpu.load(o_smem, layout=lay["ROWS"], optimized=False)  # [T, D]
        g_all = load(srcs[4], lay["ROWS"])
        w = load(nw_ref, lay["ROW"])
        inv = lax.rsqrt(jnp.sum(o_all * o_all, axis=1) * (1.0 / D) + norm_eps)  # [T]
        inv = plgpu.layout_cast(lax.broadcast_in_dim(inv, (T, D), (0,)), lay["ROWS"])
        w = plgpu.layout_cast(lax.broadcast_in_dim(w, (T, D), (1,)), lay["ROWS"])
        o_ref[bi, :, h, :] = w * (o_all * inv) * jax.nn.sigmoid(g_all)

  if wgs > 1:
    mesh = plgpu.Mesh(grid=(NV // wgs, H, B), grid_names=("v", "h", "b"), num_threads=wgs, thread_name="wg")
  else:
    mesh = plgpu.Mesh(grid=(NV, H, B), grid_names=("v", "h", "b"))
  params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane, unsafe_no_auto_barriers=True,
                                approx_math=config.approx_math)
  b_off = jnp.asarray(b_offset, jnp.int32).reshape(1)
  inputs = (q, k, v, f, b, b_off, A_log.astype(f32), dt_bias.astype(f32), num_accepted.astype(jnp.int32))
  if norm_in_kernel:
    inputs += (gate, norm_weight)
  rows_t = jax.ShapeDtypeStruct((B, T, H, D), f32)
  ss_t = jax.ShapeDtypeStruct((B, T, H, NV), f32)
  if proj:
    inputs += (f_proj,)

  @pl.run_state
  def run(refs):
    state_ref, *out_refs = refs
    # o (and the gate) are plain kernel outputs (copied into their refs, whose zero init XLA then drops as dead):
    # an uninitialised lax.empty buffer instead would add an AllocateBuffer custom call next to every kernel.
    outs = pl.kernel(with_pdl(functools.partial(kernel, state_ref)), out_type=tuple(out_types),
                     mesh=mesh, compiler_params=params, name="kda_decode", debug=_DEBUG)(*inputs)
    for ref, val in zip(out_refs, outs):
      ref[...] = val

  out_types = [rows_t] * (2 if proj else 1) + ([ss_t] if norm_partials else [])
  new_state, o, *g = run((state, *[jnp.zeros(t.shape, t.dtype) for t in out_types]))
  if fuse_norm and not norm_in_kernel:
    o = _gated_rms_norm(o, gate, norm_weight, norm_eps)
  return (o, new_state, *g)
