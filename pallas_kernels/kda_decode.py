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

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import fragmented_array as mgpu_fa
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._common import (counter_signal, counter_wait, interpreting, kernel_entry, mgpu_kernel, profiled,
                                    replicated_rows_layouts, spin_cycles, tiled, with_pdl)

L2NORM_EPS = 1e-6
_DEBUG = False  # True: print the kernel jaxpr and Mosaic GPU module when lowering

__all__ = ["KdaDecodeConfig", "kda_decode", "kda_decode_reference", "kda_decode_naive", "kda_decode_conv",
           "kda_decode_conv_reference", "short_conv_reference", "kda_decode_o_proj", "kda_decode_o_proj_reference"]


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


def kda_decode_reference(q, k, v, f, b, A_log, dt_bias, state, num_accepted, *, lower_bound=-5.0,
                         gate=None, norm_weight=None, norm_eps=1e-5, b_offset=0):
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
  Returns (o [B, T, H, D] f32, new_state [B, Q, H, D, D] f32): slot t < T holds the state after token t,
  slots >= T are unchanged.
  """
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
                              lower_bound=-5.0, gate=None, norm_weight=None, norm_eps=1e-5, b_offset=0):
  """``kda_decode_reference`` after the short conv + SiLU (``short_conv_reference``): qkv [B, T, 3, H, D] the raw
  projection outputs, conv_hist [B, Kc - 1, 3, H, D], conv_weight [Kc, 3, H, D]; the rest as there."""
  q, k, v = short_conv_reference(qkv, conv_hist, conv_weight)
  return kda_decode_reference(q, k, v, f, b, A_log, dt_bias, state, num_accepted, lower_bound=lower_bound,
                              gate=gate, norm_weight=norm_weight, norm_eps=norm_eps, b_offset=b_offset)


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
  loads_first: every GMEM load of the recurrence issued before the wait for its rows' TMAs — the conv taps (after
    that wait otherwise: an L2 round trip on the chain) and, in the token loop, every token's beta (loaded inside
    its iteration otherwise: one more round trip per token, picked by index from values loaded up front here).
    The same values (policy knob kda_loads_first); always so in the one grid (``kda_decode_o_proj``), whose W_o
    stream would queue them.
  """
  block_v: int = 32
  wgs_per_cta: int | None = None
  prefetch: bool = True
  gates_first: bool = False
  approx_math: bool = False
  token_loop: bool = False
  loads_first: bool = False

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
               norm_partials: bool = False):
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
  norm_partials: each CTA also returns the sums of its o columns' squares, partials [B, T, H, D // block_v] f32
    (``norm_partials_reference``) as a last result: with them the gated RMSNorm after the kernel is elementwise
    (``gated_norm_from_partials``) and fuses into the o_proj GEMV — no norm kernel on the layer's chain. Not
    with the fused norm (gate=).
  Returns (o [B, T, H, D] f32, new_state [B, Q, H, D, D] f32): slot t < T holds the state after token t,
  slots >= T are untouched.
  """
  _check_shapes(q, k, v, f, b, A_log, dt_bias, state, num_accepted, gate, norm_weight)
  return _kda(q, k, v, f, b, A_log, dt_bias, state, num_accepted, lower_bound, gate, norm_weight, norm_eps,
              config or KdaDecodeConfig(), b_offset, conv=False, norm_partials=norm_partials)


@kernel_entry("lower_bound", "norm_eps", "config", "norm_partials")
def kda_decode_conv(qkv, conv_hist, conv_weight, f, b, A_log, dt_bias, state, num_accepted, *, lower_bound=-5.0,
                    gate=None, norm_weight=None, norm_eps=1e-5, config: KdaDecodeConfig | None = None, b_offset=0,
                    norm_partials: bool = False):
  """``kda_decode`` with the short conv + SiLU in the kernel (``kda_decode_conv_reference``'s contract): qkv
  [B, T, 3, H, D] the q | k | v projection output before the conv (a free reshape of the model's [B, T, 3C]),
  conv_hist [B, Kc - 1, 3, H, D] the inputs of the Kc - 1 positions before this call (the conv ring's rows, zeros
  before the sequence; qkv's dtype), conv_weight [Kc, 3, H, D] f32 (tap j multiplies position t - (Kc - 1) + j).
  Each CTA convolves its head's q / k rows and its v columns per token from one SMEM window (the Kc - 1 history
  rows, then this call's T rows) and rounds them to qkv's dtype as the model does: the XLA fusion between the qkv
  projection and the kernel (~2 µs + a dependent launch per KDA layer on the H200, session 29's profile) goes.
  Needs config.prefetch (the window is TMA'd). norm_partials as in ``kda_decode`` (one more result)."""
  Kc = _check_conv(qkv, conv_hist, conv_weight)
  B, T, _, H, D = qkv.shape
  rows = jax.ShapeDtypeStruct((B, T, H, D), qkv.dtype)
  _check_shapes(rows, rows, rows, f, b, A_log, dt_bias, state, num_accepted, gate, norm_weight)
  config = config or KdaDecodeConfig()
  if not config.prefetch:
    raise ValueError("kda_decode_conv: config.prefetch=False; the conv window is TMA'd into SMEM (prefetch=True)")
  return _kda(qkv, conv_hist, conv_weight.astype(jnp.float32), f, b, A_log, dt_bias, state, num_accepted,
              lower_bound, gate, norm_weight, norm_eps, config, b_offset, conv=Kc, norm_partials=norm_partials)


def _kda(q, k, v, f, b, A_log, dt_bias, state, num_accepted, lower_bound, gate, norm_weight, norm_eps,
         config: KdaDecodeConfig, b_offset, conv: int | bool, norm_partials: bool = False,
         o_proj: _OProj | None = None, o_args: tuple = ()):
  """The kernel call behind the entries. conv = Kc (kda_decode_conv): q, k, v are (qkv [B, T, 3, H, D],
  conv_hist [B, Kc - 1, 3, H, D], conv_weight [Kc, 3, H, D] f32); False: q, k, v [B, T, H, D] as they are.
  ``o_proj`` (``kda_decode_o_proj``): each CTA writes its gated columns x' = w · o · sigmoid(gate) in bf16 into x'
  [B·T, H·D] and its sums of squares instead of o (the gate: f's heads H .. 2H − 1; o_args[0] the norm weight);
  ``o_proj.grid``: as ONE grid with the o_proj GEMV's CTAs (``_o_proj_grid_kernel``; o_args: the norm weight, W_o,
  the counters). Returns (x', new_state, partials) / (y, new_state)."""
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
  gated_out = o_proj is not None  # (x' and the partials instead of o)
  if gated_out and (fuse_norm or wgs != 1):
    raise ValueError(f"kda_decode_o_proj: one warpgroup per CTA and no fused norm (wgs_per_cta = {wgs}, gate "
                     f"given: {fuse_norm})")
  norm_partials = norm_partials or gated_out
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

  def kernel(state_ref, q_ref, k_ref, v_ref, f_ref, b_ref, boff_ref, alog_ref, dtb_ref, na_ref, *more, idx=None,
             after_loads=None):
    *norm_refs, o_ref, ss_ref = more if norm_partials else (*more, None)
    # SMEM must be allocated collectively by the CTA's warpgroups (and pl.kernel takes no scratch_types).
    scratch = []
    if config.prefetch:  # per-head rows [T, D] of q, k, f, v (and gate): one TMA each, shared by the CTA
      f_rows = [plgpu.SMEM((T, D), f.dtype)]
      if conv:  # q, k, v: their conv windows [Kc - 1 + T, D] (history rows, then this call's), two TMAs each
        scratch += [plgpu.SMEM((Kc1 + T, D), q.dtype), plgpu.SMEM((Kc1 + T, D), q.dtype), *f_rows,
                    plgpu.SMEM((Kc1 + T, D), q.dtype)]
      else:
        scratch += [plgpu.SMEM((T, D), q.dtype), plgpu.SMEM((T, D), k.dtype), *f_rows, plgpu.SMEM((T, D), v.dtype)]
      scratch += [plgpu.SMEM((T, D), gate.dtype)] if norm_in_kernel else []
      scratch += [plgpu.SMEM((T, D), f.dtype)] if gated_out else []  # (the gate's rows: f's head H + h)
      scratch += [plgpu.Barrier(num_arrivals=len(scratch) + (3 if conv else 0))]
    if norm_in_kernel:  # o of the whole head for the RMS, and the barrier that publishes it
      scratch += [plgpu.SMEM((T, D), f32), plgpu.Barrier(num_arrivals=wgs)]
    refs = (state_ref, o_ref, q_ref, k_ref, v_ref, f_ref, b_ref, boff_ref, alog_ref, dtb_ref, na_ref, *norm_refs)
    # (a profiler region over the whole kernel: bench_kernel_profile's kda_ cases; the one grid names its own)
    with jax.named_scope("kda") if idx is None else contextlib.nullcontext():
      if scratch:
        pl.run_scoped(functools.partial(body, *refs, ss_ref=ss_ref, idx=idx, after_loads=after_loads), *scratch,
                      collective_axes="wg" if wgs > 1 else ())
      else:
        body(*refs, ss_ref=ss_ref, idx=idx, after_loads=after_loads)

  def body(state_ref, o_ref, q_ref, k_ref, v_ref, f_ref, b_ref, boff_ref, alog_ref, dtb_ref, na_ref, *rest,
           ss_ref=None, idx=None, after_loads=None):
    rest = list(rest)
    gate_ref, nw_ref = (rest.pop(0), rest.pop(0)) if norm_in_kernel else (None, None)
    if gated_out:
      nw_ref = rest.pop(0)
    wg = lax.axis_index("wg") if wgs > 1 else 0
    if idx is None:
      vi = lax.axis_index("v") * wgs + wg
      h = lax.axis_index("h")
      bi = lax.axis_index("b")
    else:  # (the one grid: this CTA's (v, h, b) from its index)
      vi, h, bi = idx
    v0 = pl.multiple_of(vi * BV, BV)
    cols = pl.ds(v0, BV)
    rows = lambda ref: ref.at[bi, :, h, :]  # [T, D] view of a [B, T, H, D] input
    f_rows = [rows(f_ref)]
    if conv:  # q_ref = qkv, k_ref = the conv history, v_ref = the conv weights: windows (history, new rows)
      win = lambda i: ((k_ref.at[bi, :, i, h, :], pl.ds(0, Kc1)), (q_ref.at[bi, :, i, h, :], pl.ds(Kc1, T)))
      srcs = [win(0), win(1), *f_rows, win(2)] + ([rows(gate_ref)] if norm_in_kernel else [])
    else:
      srcs = [rows(q_ref), rows(k_ref), *f_rows, rows(v_ref)] + ([rows(gate_ref)] if norm_in_kernel else [])
    if gated_out:  # the gate's rows: f's heads H .. 2H - 1 (the fg_b projection's output read in place)
      srcs.append(f_ref.at[bi, :, H + h, :])

    if config.prefetch:
      # All per-token inputs are requested before the first state store: plain loads issued after a GMEM
      # store cannot be hoisted above it (possible aliasing), which would serialise one load round trip per token.
      *smem, bar_in = rest[:len(srcs) + 1]
      rest = rest[len(srcs) + 1:]

      def issue():
        for src, dst in zip(srcs, smem):
          for part, at in (src if isinstance(src, tuple) else ((src, None),)):
            plgpu.copy_gmem_to_smem(part, dst if at is None else dst.at[at], bar_in)

      if wgs > 1:
        pl.when(wg == 0)(issue)
      else:
        issue()
      srcs = smem
    q_src, k_src, f_src, v_src = srcs[:4]

    S = plgpu.load(state_ref.at[bi, na_ref[bi] - 1, h, :, cols], layout=L_S, optimized=False)
    a = jnp.exp(alog_ref[h])
    dtb = load(dtb_ref.at[h], L_K)
    hb = boff_ref[0] + h  # this head's column of b
    betas = None if config.token_loop else [jax.nn.sigmoid(b_ref[bi, t, hb].astype(f32)) for t in range(T)]
    load_taps = lambda: [[load(v_ref.at[j, i, h], L_K) for i in (0, 1)] + [load(v_ref.at[j, 2, h, cols], L_V)]  # noqa
                         for j in range(conv)]
    early_loads = gated_out or config.loads_first
    b_raw = None  # (early_loads in the token loop: every token's raw beta, loaded up front)
    if early_loads:
      # (loads_first, and always in the one grid: every GMEM load of the recurrence issued before its rows' barrier
      # — after it each is a round trip on the chain, and in the grid behind the W_o stream: the conv taps, the
      # norm weight's columns, the betas)
      taps = load_taps() if conv else None
      b_raw = [b_ref[bi, t, hb] for t in range(T)] if config.token_loop else None
    if gated_out:
      nw_v = load(nw_ref.at[cols], L_V)
    if config.prefetch:
      plgpu.barrier_wait(bar_in)
    if after_loads is not None:  # (the one grid: this CTA's loads are in)
      after_loads()
    if norm_in_kernel:
      o_smem, bar_o = rest

    if conv and not early_loads:  # the taps, loaded once: tap j of q, k (K-vectors) and of this warpgroup's v
      taps = load_taps()  # columns (V-vectors)

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
      elif gated_out:  # x' = w · o · sigmoid(gate) in bf16: the o_proj GEMV's operand (its 1/RMS applied after)
        gt = load(srcs[4].at[t, cols], L_V)
        o_ref[bi * T + t, pl.ds(h * D + v0, BV)] = (nw_v * o * jax.nn.sigmoid(gt)).astype(o_ref.dtype)
      else:
        o_ref[bi, t, h, cols] = o
      if ss_ref is not None:  # (norm_partials: this CTA's share of the head's sum of squares)
        ss_ref[bi, t, h, vi] = jnp.sum(o * o)
      return S

    def beta_of(t):  # token t's beta in the loop (early_loads: from the values loaded up front)
      if b_raw is None:
        return jax.nn.sigmoid(b_ref[bi, t, hb].astype(f32))
      raw = b_raw[0]
      for i in range(1, T):
        raw = jnp.where(t == i, b_raw[i], raw)
      return jax.nn.sigmoid(raw.astype(f32))

    if config.token_loop:
      S = lax.fori_loop(0, T, lambda t, S: advance(t, S, beta_of(t), *gates(t)), S)
    else:
      early = [gates(t) for t in range(T)] if config.gates_first else None
      for t in range(T):  # unrolled: every slot index static, token t + 1's loads free to run ahead
        S = advance(t, S, betas[t], *(early[t] if early else gates(t)))

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
  params = profiled(plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane,
                                         unsafe_no_auto_barriers=True, approx_math=config.approx_math))
  b_off = jnp.asarray(b_offset, jnp.int32).reshape(1)
  inputs = (q, k, v, f, b, b_off, A_log.astype(f32), dt_bias.astype(f32), num_accepted.astype(jnp.int32))
  if norm_in_kernel:
    inputs += (gate, norm_weight)
  if gated_out:  # (the norm weight as stored: the kernel's load converts it — no f32 copy launched per step)
    inputs += (o_args[0],)
  rows_t = jax.ShapeDtypeStruct((B * T, H * D), jnp.bfloat16) if gated_out else jax.ShapeDtypeStruct((B, T, H, D), f32)
  ss_t = jax.ShapeDtypeStruct((B, T, H, NV), f32)
  name, body_fn, extra = "kda_decode", kernel, ()
  out_types = [rows_t] + ([ss_t] if norm_partials else [])
  if gated_out and o_proj.grid:  # the one grid: the KDA role on its first CTAs, the o_proj role beside it
    w_o, counters = o_args[1:]
    mesh = plgpu.Mesh(grid=(o_proj.ctas(B, H, NV, w_o.shape[0]),), grid_names=("t",))
    name, extra = "kda_o_proj", (w_o, counters)
    body_fn = functools.partial(_o_proj_grid_kernel, kernel, op=o_proj, B=B, T=T, H=H, NV=NV, eps=norm_eps)
    out_types += list(o_proj.y_types(B * T, w_o.shape[0]))

  @pl.run_state
  def run(refs):
    state_ref, *out_refs = refs
    # o (and the partials) are plain kernel outputs (copied into their refs, whose zero init XLA then drops as dead):
    # an uninitialised lax.empty buffer instead would add an AllocateBuffer custom call next to every kernel.
    outs = pl.kernel(with_pdl(functools.partial(body_fn, state_ref)), out_type=tuple(out_types),
                     mesh=mesh, compiler_params=params, name=name, debug=_DEBUG)(*inputs, *extra)
    for ref, val in zip(out_refs, outs):
      ref[...] = val

  new_state, o, *g = run((state, *[jnp.zeros(t.shape, t.dtype) for t in out_types]))
  if gated_out and o_proj.grid:  # (x', the partials, [the splits' partials], y)
    return g[-1], new_state
  if fuse_norm and not norm_in_kernel:
    o = _gated_rms_norm(o, gate, norm_weight, norm_eps)
  return (o, new_state, *g)


# --------------------------------------------------------------------------------------------------
# The KDA recurrence and the o_proj GEMV as ONE grid (policy knob kda_o_grid)
# --------------------------------------------------------------------------------------------------
# On the KDA layer's chain the recurrence (~5 µs, latency-bound: the HBM idles but for the 1 MB state) was followed
# by the gated RMSNorm (an XLA fusion) and the o_proj GEMV (16.8 MB of bf16 at TP4), each after a dependent launch.
# The MoE's one grid showed what pays: a second role whose bytes stream while the first role computes, and whose
# input nothing outside the grid reads. Here every o_proj CTA requests its whole weight slice into SMEM (W_o fits
# the SMs' SMEM: 128 KB a CTA at TP4) as soon as the recurrence's own loads are in (requested before them, the
# stream queued them: the recurrence 4.5 -> 10.9 µs, session 68's profile), the first CTAs run the recurrence as
# the KDA kernel does, and each o_proj CTA then waits for the heads of its K split only.
#
# The norm moves: its 1/RMS spans a head's 128 columns, which 4 CTAs hold. Each KDA CTA writes x' = w · o ·
# sigmoid(gate) (its own columns: all it needs) in bf16 and its sum of squares; the o_proj CTA takes one head per
# 128-wide K tile and scales that tile's product by the head's 1/RMS per token: y = Σ_h inv_h · (W_h x'_h). The
# model's unfused form rounds w · (o · inv) · sigmoid(gate) to bf16 instead — the same within bf16 rounding.
KDA_O_GRID_SMEM = 160 * 1024  # W_o's slice per o_proj CTA at most: the KDA role's windows and x' beside it
# kda_o_grid_spin's hold of the o_proj-only CTAs' W_o requests: ~1 µs at the H100 / H200's ~1.98 GHz boost clock —
# the recurrence CTAs' loads (issued ~0.2 µs in) queued ahead of the 8.4 MB those CTAs request. Session 72's
# in-kernel profiles (H100, B x q = 1 x 1, one trace each): the grid's span 16.6 µs with the `loaded` count, 15.6
# with a hold of 500 or 1,000 cycles, 14.3 with 2,000 (the recurrence 5.5 µs: no slower than with the count); the
# step with 1,000 a tie (2.79 -> 2.78 ms, 4 of 8)
W_DELAY_CYCLES = 2000
KDA_GRID_BANK = 16  # counters per bank (linear.KDA_GRID_BANKS: two banks): one per K split, the last `loaded`


@dataclasses.dataclass(frozen=True)
class _OProj:
  """The o_proj role's static plan: ``split`` K splits (H / split heads each, one 128-wide K tile per head), ``bm``
  output rows per CTA, ``grid`` (one launch with counters, else the x' kernel and ``_o_proj_launch``), the hand-off
  counters' bank ``parity``, the rows' ``out_dtype``."""

  split: int
  bm: int = 64
  grid: bool = False
  parity: int = 0
  out_dtype: object = jnp.float32
  w_delay: int = 0  # > 0: the o_proj-only CTAs request W_o after this many SM cycles, not on the `loaded` count

  def ctas(self, B: int, H: int, NV: int, N: int | None = None) -> int:
    """The one grid's CTAs: the KDA role's B·H·NV and the o_proj role's (N / bm)·split, on the same first CTAs."""
    return max(B * H * NV, (N or 0) // self.bm * self.split)

  def y_types(self, m: int, n: int):
    """The one grid's o_proj outputs: the splits' partials [split − 1, N, mp] (summed in the grid), y [m, N]."""
    from pallas_kernels import linear as kl  # noqa: PLC0415
    out = kl._out_types(self.split, n, kl._padded_rows(m), m, self.out_dtype)
    return out if isinstance(out, tuple) else (out,)


def o_proj_plan(H: int, D: int, N: int, *, bm: int = 64) -> int:
  """The fewest K splits (a divisor of H) whose W_o slice per CTA, bm rows x (H / split)·D bf16, fits
  KDA_O_GRID_SMEM."""
  for split in range(1, H + 1):
    if H % split == 0 and bm * (H // split) * D * 2 <= KDA_O_GRID_SMEM:
      return split
  raise ValueError(f"kda_decode_o_proj: no K split of {H} heads fits {KDA_O_GRID_SMEM} bytes of W_o per CTA")


def o_proj_grid_why(B: int, T: int, H: int, N: int, *, block_v: int = 32, bm: int = 64) -> str:
  """Why the one grid cannot run these shapes ('' when it can): every CTA must be resident at once (the o_proj
  CTAs wait for the KDA CTAs; one CTA per SM with its W_o slice in SMEM), at most 8 token rows (the rows
  written by masked row sums), N a multiple of bm."""
  from pallas_kernels import linear as kl  # noqa: PLC0415
  if B * T > kl.ROWS_OUT_MAX:
    return f"{B * T} token rows (B x T); the one grid writes at most {kl.ROWS_OUT_MAX}"
  if N % bm:
    return f"o_proj's {N} output rows, not a multiple of {bm}"
  ctas = _OProj(o_proj_plan(H, 128, N, bm=bm), bm).ctas(B, H, 128 // block_v, N)
  sms = _num_sms()
  if ctas > sms:
    return (f"{ctas} CTAs (the recurrence's B x H x {128 // block_v} = {B * H * 128 // block_v}, o_proj's "
            f"{N // bm} row tiles x K splits), more than the {sms} SMs that hold one each: not all resident")
  return ""


def _num_sms() -> int:
  """The SMs of this process's GPU (its PJRT core_count), or the H100 / H200's 132 where there is none (a CPU:
  interpret mode, compile-only lowering for the H200)."""
  from pallas_kernels import linear as kl  # noqa: PLC0415
  dev = jax.devices()[0]
  return int(getattr(dev, "core_count", 0) or kl.NUM_SMS) if dev.platform == "gpu" else kl.NUM_SMS


def _o_proj_issue(w_ref, w_s, wbar, *, row0, k0):
  """The o_proj CTA's whole W_o slice [bm, nk·128] into SMEM (nk tiles of one head's 128 columns), one barrier."""
  nk, bm, D = w_s.shape
  for j in range(nk):
    plgpu.copy_gmem_to_smem(w_ref.at[pl.ds(row0, bm), pl.ds(k0 + j * D, D)], w_s.at[j], wbar)


def _o_proj_tile(xo_ref, ss_ref, w_s, x_s, wbar, xbar, *, k0, h0, T: int, eps: float):
  """The o_proj CTA's product after the hand-off: x' [mp, 128] per head by TMA (rows past the m tokens zero-filled),
  each head's 1/RMS per token from the KDA CTAs' sums of squares (in the model's order: the partials added one
  after another, / D, + eps), the nk products W_h x'_h^T issued at once into their own accumulators -> [bm, mp]
  Σ_h inv_h · W_h x'_h^T (WGMMA layout)."""
  nk, bm, D = w_s.shape
  mp = x_s.shape[1]
  m, NV = xo_ref.shape[0], ss_ref.shape[-1]
  for j in range(nk):
    plgpu.copy_gmem_to_smem(xo_ref.at[pl.ds(0, mp), pl.ds(k0 + j * D, D)], x_s.at[j], xbar)
  invs = []
  for j in range(nk):  # (scalar loads: in flight with the TMAs)
    row = []
    for r in range(m):
      b, t = divmod(r, T)
      ssum = ss_ref[b, t, h0 + j, 0]
      for v in range(1, NV):
        ssum = ssum + ss_ref[b, t, h0 + j, v]
      row.append(lax.rsqrt(ssum * (1.0 / D) + eps))
    invs.append(row)
  with jax.named_scope("bars"):  # (W_o's slice: requested at the kernel's start; x': just now)
    plgpu.barrier_wait(wbar)
    plgpu.barrier_wait(xbar)

  def scope(*accs):
    for j, acc in enumerate(accs):
      plgpu.wgmma(acc, w_s.at[j], x_s.at[j].T)
    plgpu.wgmma_wait(0)
    return [acc[...] for acc in accs]

  with jax.named_scope("mma"):
    accs = pl.run_scoped(scope, *[plgpu.ACC((bm, mp), jnp.float32) for _ in range(nk)])
  col = plgpu.broadcasted_iota(jnp.int32, (bm, mp), 1, layout=plgpu.Layout.WGMMA)
  y = None
  for j, acc in enumerate(accs):
    sc = jnp.broadcast_to(invs[j][0], (bm, mp))
    for r in range(1, m):
      sc = jnp.where(col == r, invs[j][r], sc)
    y = acc * sc if y is None else y + acc * sc
  return y


def _o_proj_scratch(op: _OProj, nk: int, m: int):
  from pallas_kernels import linear as kl  # noqa: PLC0415
  bf16, mp = jnp.bfloat16, kl._padded_rows(m)
  return [plgpu.SMEM((nk, op.bm, 128), bf16, transforms=kl._tr(bf16, 128)),  # w_s: W_o's slice, a head a tile
          plgpu.SMEM((nk, mp, 128), bf16, transforms=kl._tr(bf16, 128)),  # x_s: x' of those heads
          plgpu.Barrier(num_arrivals=nk), plgpu.Barrier(num_arrivals=nk)]


def _o_proj_grid_kernel(kda_kernel, state_ref, q_ref, k_ref, v_ref, f_ref, b_ref, boff_ref, alog_ref, dtb_ref,
                        na_ref, nw_ref, w_ref, ctr_ref, xo_ref, ss_ref, *y_refs, op: _OProj, B: int, T: int, H: int,
                        NV: int, eps: float):
  """The one grid (``kda_decode_o_proj`` with counters): CTA t < B·H·NV runs the recurrence of (v, h, b) = (t % NV,
  t // NV % H, t // (NV·H)) as ``kda_decode`` (x' and its sums of squares out), then signals its K split's
  hand-off counter; CTA t < tiles·split is also o_proj's (row tile t % tiles, K split t // tiles): its W_o slice
  requested once every recurrence CTA's loads are in (the bank's last cell counts them; a recurrence CTA requests
  its own after its loads), the counter awaited (every KDA CTA of its heads), then ``_o_proj_tile`` and the
  splits' sum on the split-K counters (``linear._split_out``: y's rows written by the last split's CTA). The
  hand-off counters alternate between two banks by call (``op.parity``, as the one-grid MoE's): CTA 0 zeroes the
  other bank for the next call. Every CTA must be resident at once (``o_proj_grid_why``)."""
  from pallas_kernels import linear as kl  # noqa: PLC0415
  n_out = w_ref.shape[0]
  tiles, hps = n_out // op.bm, H // op.split
  t = lax.axis_index("t")
  assert op.parity in (0, 1) and op.split < KDA_GRID_BANK, op  # (a bank: a counter per K split, then `loaded`)
  bank = kl.KDA_GRID_BANKS + op.parity * KDA_GRID_BANK
  other = kl.KDA_GRID_BANKS + (1 - op.parity) * KDA_GRID_BANK
  tile, sk = t % tiles, t // tiles
  row0 = tile * op.bm
  is_o = t < tiles * op.split
  o_parts, y_g = (None, y_refs[0]) if op.split == 1 else y_refs

  def scoped(w_s, x_s, wbar, xbar, y_s):
    @pl.when(t == 0)
    def _():  # (the other bank, for the next call: the previous call that used it is done)
      for i in range(KDA_GRID_BANK):
        ctr_ref[other + i] = jnp.int32(0)

    n_kda = B * H * NV
    is_kda = t < n_kda
    # (the bank's last cell: the recurrence CTAs whose loads have landed)
    loaded = ctr_ref.at[pl.ds(bank + KDA_GRID_BANK - 1, 1)]
    issue = lambda: _o_proj_issue(w_ref, w_s, wbar, row0=row0, k0=sk * hps * 128)  # noqa: E731

    def loads_done():  # a recurrence CTA's own loads are in: count it, then request its W_o slice (requested only
      # after its recurrence instead, the grid took 16.8 vs 15.1 µs: s69b's profile, session 69)
      counter_signal(loaded)
      pl.when(is_o)(issue)

    # The W_o stream waits for the recurrence's loads: let loose at the start, its 16.8 MB ahead of them in the
    # memory system's queues made the recurrence 4.5 -> 10.9 µs (s68d's profile, H100: the grid no faster than the
    # three kernels). An o_proj-only CTA requests its slice once every recurrence CTA has its rows and state
    # (~1 µs in); the recurrence's arithmetic then runs under the stream (the profiler's regions:
    # bench_kernel_profile's kdao_ cases)
    @pl.when(is_o & jnp.logical_not(is_kda))
    def _():
      with jax.named_scope("loaded"):
        # (w_delay: a fixed hold instead — the count completed 3.8 µs in (median, s69b's profile), well after the
        # recurrence CTAs' ~1 MB of loads were queued, and W_o's stream, not x', was then the grid's last arrival)
        if op.w_delay:
          spin_cycles(op.w_delay)
        else:
          counter_wait(loaded, n_kda)
      with jax.named_scope("issue"):
        issue()

    @pl.when(is_kda)
    def _():
      vi, h, bi = t % NV, (t // NV) % H, t // (NV * H)
      with jax.named_scope("kda"):
        kda_kernel(state_ref, q_ref, k_ref, v_ref, f_ref, b_ref, boff_ref, alog_ref, dtb_ref, na_ref, nw_ref,
                   xo_ref, ss_ref, idx=(vi, h, bi), after_loads=loads_done)
      with jax.named_scope("signal"):
        counter_signal(ctr_ref.at[pl.ds(bank + h // hps, 1)])  # (after every thread's stores: its barrier first)

    @pl.when(is_o)
    def _():
      with jax.named_scope("wait"):
        counter_wait(ctr_ref.at[pl.ds(bank + sk, 1)], hps * NV * B, async_reads=True)  # (x' is read by TMA)
      with jax.named_scope("tile"):
        y = _o_proj_tile(xo_ref, ss_ref, w_s, x_s, wbar, xbar, k0=sk * hps * 128, h0=sk * hps, T=T, eps=eps)
      with jax.named_scope("out"):
        kl._split_out(o_parts, ctr_ref if op.split > 1 else None, y, sk=sk, tile=tile, row0=row0, bm=op.bm,
                      split=op.split, rows=(y_g, y_s))

  pl.run_scoped(scoped, *_o_proj_scratch(op, hps, B * T), plgpu.SMEM((B * T, op.bm), op.out_dtype))


def _o_proj_launch(xo, ss, w_o, *, op: _OProj, T: int, eps: float):
  """The o_proj role as a launch of its own after the x' kernel (GPU interpret mode, which runs no counters): the
  same tile (``_o_proj_tile``), each K split's partial [split, N, mp] summed by XLA -> y [m, N] op.out_dtype."""
  from pallas_kernels import linear as kl  # noqa: PLC0415
  m, H = xo.shape[0], ss.shape[2]
  n_out = w_o.shape[0]
  tiles, hps = n_out // op.bm, H // op.split

  def body(xo_ref, ss_ref, w_ref, o_ref, w_s, x_s, wbar, xbar):
    t = lax.axis_index("t")
    tile, sk = t % tiles, t // tiles
    _o_proj_issue(w_ref, w_s, wbar, row0=tile * op.bm, k0=sk * hps * 128)
    y = _o_proj_tile(xo_ref, ss_ref, w_s, x_s, wbar, xbar, k0=sk * hps * 128, h0=sk * hps, T=T, eps=eps)
    kl._split_out(o_ref, None, y, sk=sk, tile=tile, row0=tile * op.bm, bm=op.bm, split=op.split)

  out = mgpu_kernel(body, out_type=kl._out_types(op.split, n_out, kl._padded_rows(m), m, None),
                    grid=(tiles * op.split,), grid_names=("t",), kernel_name="glm5_kda_o_proj",
                    scratch_types=_o_proj_scratch(op, hps, m))(xo, ss, w_o)
  return kl._split_sum(out, m, False).astype(op.out_dtype)


def kda_decode_o_proj_reference(qkv, conv_hist, conv_weight, fg, b, A_log, dt_bias, state, num_accepted,
                                norm_weight, w_o, *, lower_bound=-5.0, norm_eps=1e-5, b_offset=0, block_v: int = 32,
                                out_dtype=jnp.float32):
  """``kda_decode_o_proj``'s contract in jnp: ``kda_decode_conv_reference``'s o (f = fg's first H heads), then y
  [B·T, N] = Σ_h inv_h · (W_o[:, h] · x'_h) with x' = bf16(w · o · sigmoid(gate)) (gate: fg's heads H .. 2H − 1)
  and inv_h = rsqrt((Σ_v ss_v) / D + eps) from the partial sums of squares of the kernel's block_v columns, added
  in order (``norm_partials_reference``) — the kernel's association; f32 products (HIGHEST). -> (y out_dtype,
  new_state)."""
  B, T, _, H, D = qkv.shape
  f32 = jnp.float32
  o, new_state = kda_decode_conv_reference(qkv, conv_hist, conv_weight, fg, b, A_log, dt_bias, state, num_accepted,
                                           lower_bound=lower_bound, b_offset=b_offset)
  gate = fg[:, :, H:2 * H].astype(f32)
  ss = norm_partials_reference(o, D // block_v)
  tot = ss[..., 0]
  for j in range(1, ss.shape[-1]):
    tot = tot + ss[..., j]
  inv = lax.rsqrt(tot * (1.0 / D) + norm_eps)  # [B, T, H]
  xg = (norm_weight.astype(f32) * o * jax.nn.sigmoid(gate)).astype(jnp.bfloat16).astype(f32)
  yh = jnp.einsum("bthd,nhd->bthn", xg, w_o.astype(f32).reshape(-1, H, D), precision=lax.Precision.HIGHEST)
  y = jnp.sum(yh * inv[..., None], axis=2).reshape(B * T, -1)
  return y.astype(out_dtype), new_state


@kernel_entry("lower_bound", "norm_eps", "config", "parity", "out_dtype", "w_delay")
def kda_decode_o_proj(qkv, conv_hist, conv_weight, fg, b, A_log, dt_bias, state, num_accepted, norm_weight, w_o,
                      counters=None, *, lower_bound=-5.0, norm_eps=1e-5, config: KdaDecodeConfig | None = None,
                      b_offset=0, parity: int = 0, out_dtype=jnp.float32, w_delay: int = 0):
  """The KDA layer from its q | k | v projection to o_proj's output (policy knob kda_o_grid):
  ``kda_decode_conv``'s recurrence, the gated RMSNorm and y = o_proj(x) as ONE launch (``_o_proj_grid_kernel``).

  qkv [B, T, 3, H, D], conv_hist, conv_weight, b, A_log, dt_bias, state, num_accepted as ``kda_decode_conv``'s;
  fg [B, T, 2H, D]: the forget-gate logits (heads 0 .. H − 1) and the output gate's (H .. 2H − 1) side by side —
  the fg_b projection's output, read in place; norm_weight [D] (the gated RMSNorm's); w_o [N, H·D] bf16 (o_proj's
  weight, this rank's columns). ``counters``: the step's split-K counters (``linear.splitk_counters``; the
  hand-off's two banks from KDA_GRID_BANKS, ``parity`` alternating by call); without them (or in GPU interpret
  mode, which runs no counters) the same two roles as two launches: the x' kernel, then ``_o_proj_launch``.
  -> (y [B·T, N] out_dtype: o_proj's rows before any all-reduce, new_state). ``kda_decode_o_proj_reference``'s
  numerics: the norm's 1/RMS applied per head after the product — within bf16 rounding of the model's order.
  A recurrence CTA requests its W_o slice once its own loads are in, the o_proj-only CTAs once every recurrence
  CTA's are — or, with ``w_delay`` > 0 (policy knob kda_o_grid_spin), that many SM clock cycles after they start."""
  from pallas_kernels import linear as kl  # noqa: PLC0415
  Kc = _check_conv(qkv, conv_hist, conv_weight)
  B, T, _, H, D = qkv.shape
  config = config or KdaDecodeConfig()
  if fg.shape != (B, T, 2 * H, D):
    raise ValueError(f"kda_decode_o_proj: fg {fg.shape}; expected [B, T, 2H, D] = {(B, T, 2 * H, D)} (the forget "
                     "gate's heads, then the output gate's)")
  if w_o.ndim != 2 or w_o.shape[1] != H * D or w_o.dtype != jnp.bfloat16 or norm_weight.shape != (D,):
    raise ValueError(f"kda_decode_o_proj: w_o {w_o.shape} {w_o.dtype}, norm_weight {norm_weight.shape}; expected "
                     f"bf16 [N, {H * D}] and [{D}]")
  if not config.prefetch or (config.wgs_per_cta or 1) != 1:
    raise ValueError(f"kda_decode_o_proj: config {config}; expected prefetch and one warpgroup per CTA")
  if B * T > kl.ROWS_OUT_MAX or w_o.shape[0] % 64:
    raise ValueError(f"kda_decode_o_proj: {B * T} token rows, {w_o.shape[0]} output rows; expected at most "
                     f"{kl.ROWS_OUT_MAX} and a multiple of 64")
  if isinstance(parity, bool) or parity not in (0, 1):
    raise ValueError(f"kda_decode_o_proj: parity = {parity!r}; expected the call's counter bank, 0 or 1")
  if isinstance(w_delay, bool) or not isinstance(w_delay, int) or w_delay < 0:
    raise ValueError(f"kda_decode_o_proj: w_delay = {w_delay!r}; expected SM clock cycles, an int >= 0 (0: the "
                     "`loaded` count)")
  rows = jax.ShapeDtypeStruct((B, T, H, D), qkv.dtype)
  _check_shapes(rows, rows, rows, fg, b, A_log, dt_bias, state, num_accepted, None, None)
  op = _OProj(o_proj_plan(H, D, w_o.shape[0]), grid=counters is not None and not interpreting(), parity=int(parity),
              out_dtype=jnp.dtype(out_dtype), w_delay=w_delay)
  if op.grid:
    why = o_proj_grid_why(B, T, H, w_o.shape[0], block_v=config.block_v)
    if why:
      raise ValueError(f"kda_decode_o_proj: the one grid cannot run here: {why}")
    if counters.shape != (kl.SPLITK_COUNTERS,) or counters.dtype != jnp.int32:
      raise ValueError(f"kda_decode_o_proj: counters {counters.shape} {counters.dtype}; expected "
                       f"linear.splitk_counters()' int32 [{kl.SPLITK_COUNTERS}]")
  args = (qkv, conv_hist, conv_weight.astype(jnp.float32), fg, b, A_log, dt_bias, state, num_accepted, lower_bound,
          None, None, norm_eps, config, b_offset)
  if op.grid:
    return _kda(*args, conv=Kc, o_proj=op, o_args=(norm_weight, w_o, counters))
  xo, new_state, ss = _kda(*args, conv=Kc, o_proj=op, o_args=(norm_weight,))
  return _o_proj_launch(xo, ss, w_o, op=op, T=T, eps=float(norm_eps)), new_state
