"""The two attention sublayers: KDA (gated delta rule, 34 layers) and DSA (NoPE MLA + kpool indexer, 11 + MTP).

Both run on one TP shard (local heads) and take an explicit cache plus a :class:`StepCtx` that says where the
new tokens go:

* ``mode="extend"`` (prefill, chunked continuation): T tokens of which ``valid[b]`` are real per sequence,
  starting at ``start[b]``. KDA uses the chunked (WY) form and keeps only the final state (slot 0).
* ``mode="verify"`` (the speculative step): all T = q tokens are real; KDA runs the per-token recurrence and
  stores the state after every token in its slot, so that a rejection costs nothing (spec/decode.md §1.2).

Either mode starts KDA from slot ``n_acc[b] − 1``; the short-conv inputs (a ring), the MLA latent cache, the
indexer pool cache and the tail ring are written by position, so tokens that a later step rejects are simply
overwritten.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from glm5_jax.config import Glm5Config
from glm5_jax.layers import (EMBED, HIGHEST, KDA_H, KDA_HD, MLA_HD, TP, ConcatLinear, Linear,
                             RMSNorm, concat_fits, f16_copies, has_tcgen05, kda_grid_counters, kernel_arch,
                             kernel_enabled, kernel_switch, param, StackedLinear, radix_topk_plan, rms_norm,
                             side_chain, topk_set_by_threshold, unroll_loops)


@dataclasses.dataclass(frozen=True)
class StepCtx:
  """Where this call's tokens sit. Arrays are [B] int32; mode is static (which kernels run is decided by the
  trace's kernel policy: glm5_jax.layers.use_kernels)."""

  start: jax.Array  # position of the first new token (= committed length)
  valid: jax.Array  # number of real tokens among the T of this call
  n_acc: jax.Array  # positions of the previous verify committed (1 after a prefill)
  mode: str = "extend"


jax.tree_util.register_dataclass(StepCtx, data_fields=["start", "valid", "n_acc"], meta_fields=["mode"])


def _positions(ctx: StepCtx, T):
  pos = ctx.start[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
  ok = jnp.arange(T)[None] < ctx.valid[:, None]
  return pos, ok


def _conv_history(conv, start, Kc: int):
  """The KDA short-conv history from its ring: conv [B, W, ...] holds the raw input of position p in row p mod W
  -> [B, Kc−1, C3] (the trailing dims flattened), the inputs of positions start−Kc+1 .. start−1 (zero before the
  sequence).

  Why a ring: a rejected draft's input sits at a position ≥ the next step's start, so it is never read and the
  next step overwrites it — rollback costs nothing. Every row of the updated ring is its old row or one new input
  (an elementwise select on the row index: _conv_ring_write), so XLA can update the donated cache in place; the
  former sliding window (rows shifted by one per step) made it copy every KDA layer's conv cache first (34 copy
  kernels a step on the H200). W = Kc − 1 + q keeps the Kc − 1 rows read and the q rows written distinct."""
  W = conv.shape[1]
  conv = conv.reshape(*conv.shape[:2], -1)
  p = start[:, None] - (Kc - 1) + jnp.arange(Kc - 1, dtype=start.dtype)[None]  # [B, Kc-1]
  hist = jnp.take_along_axis(conv, (p % W)[..., None], axis=1)
  return jnp.where((p >= 0)[..., None], hist, jnp.zeros((), conv.dtype))


def _conv_ring_write(conv, z, start, valid):
  """conv [B, W, ...] ring <- z [B, T, ...], the inputs of positions start .. start+T−1 of which the first
  ``valid`` are real (each row takes the latest real position it holds, if any; others keep their value)."""
  W, T = conv.shape[1], z.shape[1]
  start = start[:, None]
  last = start + valid[:, None] - 1  # the last real position of this call
  pr = last - (last - jnp.arange(W, dtype=start.dtype)[None]) % W  # the latest position <= last in row r
  zi = jnp.clip(pr - start, 0, T - 1)
  tail = (1,) * (conv.ndim - 2)
  rows = jnp.take_along_axis(z, zi.reshape(*zi.shape, *tail), axis=1)
  return jnp.where((pr >= start).reshape(*pr.shape, *tail), rows, conv)


def _scatter_rows(cache, rows, pos, ok):
  """cache [B, S, ...] <- rows [B, T, ...] at pos [B, T] where ok; others dropped (out of range)."""
  S = cache.shape[1]
  idx = jnp.where(ok, pos, S)  # S is out of bounds: mode="drop" ignores the write
  b = jnp.broadcast_to(jnp.arange(cache.shape[0])[:, None], idx.shape)
  return cache.at[b, idx].set(rows.astype(cache.dtype), mode="drop")


# ==================================================================================================== KDA
def l2norm(x):
  return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


# the largest |G_i − G_m| (log-decay between a sub-chunk's token and its middle one) whose e^{±·} stay finite and
# normal in f32 (e^88 ≈ 1.7e38): kda_chunked's pairwise products as GEMMs need (C / 2) · |lower bound| within it
PAIRWISE_GEMM_MAX_LOG = 80.0


def kda_chunked(q, k, v, g, beta, S0, chunk=32, handover_kernel: bool = False, pairwise_gemm: bool = False):
  """Chunked (WY) form of the gated delta rule; equals the per-token recurrence.

  q, k [B, T, H, K] (already l2-normalised, q scaled), v [B, T, H, V], g [B, T, H, K] log-decay (≤ 0),
  beta [B, T, H], S0 [B, H, K, V] -> (o [B, T, H, V], S_T [B, H, K, V]), all f32.
  Within a chunk (C tokens, cumulative log-decay G_t) entering with state S: δ = (I + M)^-1 (β ⊙ (v − (k ⊙ e^{G_t})
  S)) with M_ij = β_i Σ_c k_ic k_jc e^{G_ic − G_jc} (j < i); o_t = (q_t ⊙ e^{G_t}) S + Σ_{j≤t} (q_t ⊙ e^{G_t − G_j})·k_j
  δ_j. Pairwise exponents are formed only for j ≤ t, so nothing overflows however long the chunk decays.

  Everything but the state's hand-over is computed for all chunks at once: with U = (I + M)^-1 (β ⊙ v) and
  W = (I + M)^-1 (β ⊙ k ⊙ e^G), δ = U − W S; the chunk's exit state is S' = e^{G_C} ⊙ S + K̃ᵀ δ = (e^{G_C} − K̃ᵀW) S
  + K̃ᵀU (K̃ = k ⊙ e^{G_C − G}), so the sequential part is one [K, K] x [K, V] product and an add per chunk
  (unrolled on accelerators); the outputs follow from the entry states in one batched product,
  o = (q ⊙ e^G − QK W) S + QK U. As a scan of the whole chunk step (session 62's form) a 256-token prefill chunk
  ran 8 loop iterations of 13 kernels per KDA layer (3,536 launches and 272 loop trips per chunk at the rank's
  34 KDA layers, compiled for an H200). ``handover_kernel`` (policy knob kda_handover): the hand-over chain as one
  Mosaic GPU launch (pallas_kernels.kda_prefill.kda_handover) instead of n dependent XLA products and adds.
  The products are f32 (HIGHEST, which XLA runs on a GPU's CUDA cores — cuBLAS's FFMA GEMMs; as
  lax.DotAlgorithmPreset.BF16_BF16_F32_X6, six bf16 tensor-core products each, XLA's GPU dots were outside the fp32
  paths' tolerance natively: layers.REMOVED_KNOBS["kda_chunk_x6"]), the triangular solve too.
  ``pairwise_gemm`` (policy knob kda_chunk_gemm): the pairwise terms kk_ij = Σ_c k_ic k_jc e^{G_ic − G_jc} (and qk's)
  as batched products of k ⊙ e^{G − G_m} and k ⊙ e^{G_m − G} about the sub-chunk's middle token m instead of the
  [C, C, K] tensor of pairwise exponents: every factor's exponent is within (C / 2) · max|g|, which the caller keeps
  to PAIRWISE_GEMM_MAX_LOG (the safe gate's −5 at 32-token sub-chunks: 80) — finite, and each causal term (j <= i)
  the product of two finite factors whose exact value is at most 1 (those below f32's range flush toward 0, as e^{G_i
  − G_j} itself would); the anti-causal entries may overflow and are discarded by a select, never multiplied.
  """
  B, T, H, K = q.shape
  V = v.shape[-1]
  C = min(chunk, T)
  n = -(-T // C)
  pad = n * C - T
  if pad:  # padded tokens: no decay (g = 0) and no write (β = 0) leave the state unchanged
    zp = lambda a: jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
    q, k, v, g, beta = zp(q), zp(k), zp(v), zp(g), zp(beta)
  # [B, n·C, H, X] -> [B, n, H, C, X]: chunks and heads batched, the chunk's tokens as the matrices' rows
  per_chunk = lambda a: jnp.swapaxes(a.reshape(B, n, C, H, -1), 2, 3)
  qc, kc, vc, gc = map(per_chunk, (q, k, v, g))
  bc = per_chunk(beta[..., None])  # [B, n, H, C, 1]
  mm = functools.partial(jnp.einsum, precision=HIGHEST)
  G = jnp.cumsum(gc, axis=3)  # [B, n, H, C, K]
  causal = jnp.tril(jnp.ones((C, C), bool))[:, :, None]
  if pairwise_gemm:
    Gm = G[:, :, :, C // 2:C // 2 + 1]  # [B, n, H, 1, K]: the middle token's
    kr = kc * jnp.exp(Gm - G)  # (k_j ⊙ e^{G_m − G_j})
    kk, qk = (jnp.where(causal[..., 0], mm("bnhic,bnhjc->bnhij", a * jnp.exp(G - Gm), kr), 0.0) for a in (kc, qc))
  else:
    E = jnp.exp(jnp.where(causal, G[:, :, :, :, None] - G[:, :, :, None, :], -jnp.inf))  # [B, n, H, i, j, K]
    kk = mm("bnhic,bnhjc,bnhijc->bnhij", kc, kc, E)
    qk = mm("bnhic,bnhjc,bnhijc->bnhij", qc, kc, E)  # (causal: E is 0 above the diagonal)
  A = jnp.where(jnp.tril(jnp.ones((C, C), bool), -1), kk * bc, 0.0) + jnp.eye(C, dtype=kk.dtype)
  eG = jnp.exp(G)
  UW = jax.scipy.linalg.solve_triangular(A, bc * jnp.concatenate([vc, kc * eG], -1), lower=True,
                                         unit_diagonal=True)  # [B, n, H, C, V + K]
  U, W = UW[..., :V], UW[..., V:]
  last = G[:, :, :, -1]  # [B, n, H, K]
  Kt = kc * jnp.exp(last[:, :, :, None] - G)
  P = mm("bnhck,bnhcv->bnhkv", Kt, U)
  chunks_first = lambda a: jnp.moveaxis(a, 1, 0)
  if handover_kernel:
    from pallas_kernels import kda_prefill as kp  # noqa: PLC0415
    # the hand-over's matrix transposed, (e^{G_C} − K̃ᵀW)ᵀ: the kernel reads a column of it as a row
    RtT = jnp.eye(K, dtype=P.dtype) * jnp.exp(last)[..., None, :] - mm("bnhcj,bnhck->bnhjk", W, Kt)
    heads = lambda a: chunks_first(a).reshape(n, B * H, *a.shape[3:])  # [n, B·H, K, X]
    entry, S = kp.kda_handover(heads(RtT), heads(P), S0.reshape(B * H, K, V))
    entry, S = jnp.moveaxis(entry.reshape(n, B, H, K, V), 0, 1), S.reshape(B, H, K, V)
  else:
    # the hand-over's matrix e^{G_C} − K̃ᵀW [B, n, H, K, K], chunks first (each step's operands contiguous)
    Rt = jnp.eye(K, dtype=P.dtype) * jnp.exp(last)[..., None] - mm("bnhck,bnhcj->bnhkj", Kt, W)

    def hand_over(S, xs):
      R_c, P_c = xs
      return mm("bhkj,bhjv->bhkv", R_c, S) + P_c, S

    S, entry = lax.scan(hand_over, S0, (chunks_first(Rt), chunks_first(P)),
                        unroll=n if unroll_loops() else 1)
    entry = jnp.moveaxis(entry, 0, 1)  # [B, n, H, K, V]: each chunk's entry state
  o = mm("bnhck,bnhkv->bnhcv", qc * eG - mm("bnhij,bnhjk->bnhik", qk, W), entry) + mm("bnhij,bnhjv->bnhiv", qk, U)
  return jnp.swapaxes(o, 2, 3).reshape(B, n * C, H, V)[:, :T], S


class KDA(nnx.Module):
  """Kimi Delta Attention (spec §3.5), heads split over TP; f_a/g_a (and b, sliced per device) replicated."""

  def __init__(self, cfg: Glm5Config, dtype):
    D, H, Kd, r, Kc = cfg.hidden_size, cfg.linear_num_heads, cfg.linear_head_dim, cfg.kda_gate_rank, \
        cfg.linear_conv_kernel_dim
    HD = H * Kd
    self.qkv_proj = StackedLinear(D, HD, 3, dtype, (KDA_HD, EMBED))  # q_proj, k_proj, v_proj
    self.q_conv1d = param((HD, 1, Kc), jnp.float32, (KDA_HD, None, None))
    self.k_conv1d = param((HD, 1, Kc), jnp.float32, (KDA_HD, None, None))
    self.v_conv1d = param((HD, 1, Kc), jnp.float32, (KDA_HD, None, None))
    # f_a_proj, g_a_proj and b_proj (all heads: each device slices its own; b's 64 rows are 0.5 MB) in one GEMV
    self.fgb_a_proj = ConcatLinear(D, (r, r, H), dtype, (None, EMBED))
    # f_b_proj and g_b_proj block-diagonally on [f_a | g_a]: one GEMV for both (checkpoint.BLOCKDIAGS)
    self.fg_b_proj = StackedLinear(2 * r, HD, 2, dtype, (KDA_HD, None))
    self.A_log = param((H,), jnp.float32, (KDA_H,))
    self.dt_bias = param((HD,), jnp.float32, (KDA_HD,))
    self.o_norm = RMSNorm(Kd, dtype, cfg.rms_norm_eps)
    self.o_proj = Linear(HD, D, dtype, (EMBED, KDA_HD))
    self.head_dim, self.kernel, self.lower_bound, self.eps = Kd, Kc, cfg.linear_lower_bound, cfg.rms_norm_eps

  def __call__(self, x, cache, ctx: StepCtx, dtype):
    """x [B, T, D] -> (y [B, T, D], new cache). cache: conv [B, Wc, 3C] (C local channels), ssm [B, Q, H, K, V]."""
    B, T, _ = x.shape
    Kd, Kc = self.head_dim, self.kernel

    def gates():
      # f_a | g_a | b (b of all heads) side by side; f_b and g_b read the f_a | g_a columns in place, and the KDA
      # kernel reads f and this rank's b columns in place: each XLA slice before a custom call was a kernel of its
      # own (at q = 4 three per KDA layer: [M, 256], f [M, 2048], b [M, 16]; session 27's profile)
      # fg in the projection's dtype: the KDA kernels and their references widen it as they read it (XLA's f32
      # copy was a launch per KDA layer and step, 34 at the full rank: session 73's listing)
      with side_chain():  # (beside the q/k/v GEMV, also under linear_fused_sum)
        fgb = self.fgb_a_proj.joint(x, dtype)  # [B, T, 2r + all heads]
      # kda_fg_b_kernel: fg_b through the bf16 kernel on the MAIN chain's counters Ref — an aliased operand of the
      # q/k/v kernel's call before it (kda_qkv_kernel), so it runs after that kernel instead of beside it (session
      # 75's trace: beside it, 7.5 µs instead of 2.4, the q/k/v kernel 25.5 instead of 19.0; layers.KNOBS)
      with contextlib.nullcontext() if kernel_switch("kda_fg_b_kernel") and B * T == 1 else side_chain():
        return fgb, self.fg_b_proj(fgb, dtype, prefix=True, one_row="kda_fg_b_kernel")  # [B, T, 2C]: f | gate

    # (the gates after the qkv projection and conv: an order that put the gates first measured no faster —
    # layers.REMOVED_KNOBS["kda_gates_first"])
    z = self.qkv_proj(x, dtype, one_row="kda_qkv_kernel")  # [B, T, 3C]: this device's q | k | v channels
    C3 = z.shape[-1]
    H = C3 // (3 * Kd)
    w = jnp.concatenate([self.q_conv1d[...], self.k_conv1d[...], self.v_conv1d[...]], 0)[:, 0, :]  # [3C, Kc]
    conv4 = cache["conv"]  # [B, Wc, 3, C]: q|k|v kept apart so that TP splits each of them
    # the barrier orders the history read before the ring's in-place update (else XLA copies the cache first); the
    # update stays in the cache's own 4-D shape (through a reshape XLA wrote a temporary and copied it back)
    hist, conv4 = lax.optimization_barrier((_conv_history(conv4, ctx.start, Kc), conv4))
    full = jnp.concatenate([hist.astype(jnp.float32), z.astype(jnp.float32)], axis=1)  # [B, Kc-1+T, 3C]
    new_conv = _conv_ring_write(conv4, z.astype(conv4.dtype).reshape(B, T, *conv4.shape[2:]), ctx.start, ctx.valid)
    acc = sum(full[:, j:j + T] * w[:, j].astype(jnp.float32) for j in range(Kc))
    zc = jax.nn.silu(acc).astype(dtype).astype(jnp.float32)
    q, k, v = (a.reshape(B, T, H, Kd) for a in jnp.split(zc, 3, axis=-1))
    fgb, fg = gates()
    f, gate = (a.reshape(B, T, H, Kd) for a in jnp.split(fg.astype(jnp.float32), 2, axis=-1))
    b_off = self.fgb_a_proj.outs[0] + self.fgb_a_proj.outs[1] + lax.axis_index(TP) * H  # this rank's first b
    # (in the projection's dtype: the kernel and its reference take the sigmoid in f32 themselves)
    b = lax.dynamic_slice_in_dim(fgb, b_off, H, axis=-1)
    A_log, dt_bias = self.A_log[...], self.dt_bias[...].reshape(H, Kd)
    ssm = cache["ssm"]
    normed = False  # o already through the gated RMSNorm (inside the KDA kernel)
    if ctx.mode == "verify":
      from pallas_kernels import kda_decode as kda_ops  # noqa: PLC0415 (kernels import lazily: GPU-only deps)
      if kernel_enabled("kda", fits=Kd == 128, why=f"KDA head dim {Kd} (the kernel takes 128)"):
        # kda_norm: the gated RMSNorm in the kernel (a head's 4 warpgroups in one CTA: 4x fewer CTAs) instead of
        # the XLA fusion after it — measured slower (layers.KERNEL_DEFAULTS), kept as an A/B knob
        norm = (dict(gate=gate, norm_weight=self.o_norm.weight[...], norm_eps=self.eps)
                if kernel_enabled("kda_norm") else {})
        approx, loop = kernel_enabled("kda_approx_math"), kernel_enabled("kda_token_loop")
        # kda_loads_first: the recurrence's GMEM loads (conv taps, the token loop's betas) before its rows' barrier
        first = kernel_enabled("kda_loads_first")
        config = kda_ops.KdaDecodeConfig(approx_math=approx, token_loop=loop, loads_first=first) \
            if approx or loop or first else None
        fg4 = fg.reshape(B, T, 2 * H, Kd)
        # kda_norm_partials: the kernel also returns its CTAs' sums of o's squares, so that the gated RMSNorm below
        # is elementwise and XLA fuses it into the o_proj GEMV (no norm kernel between the KDA kernel and o_proj)
        partials = kernel_enabled("kda_norm_partials", fits=not norm, why="kda_norm on (the norm in the kernel)")
        conv_fits = hist.dtype == z.dtype
        # kda_o_grid: the recurrence, the gated norm and o_proj as ONE grid (the o_proj CTAs' weights streaming
        # into SMEM while the recurrence runs): y straight from the kernel
        wo = self.o_proj.weight
        if wo.dtype != jnp.bfloat16 or self.o_proj.scale is not None:
          grid_why = f"{wo.dtype} o_proj (the grid streams a bf16 one)"
        elif not (partials and conv_fits and kernel_switch("kda_conv")):
          grid_why = "needs kda_conv and kda_norm_partials on (and the conv cache in the activations' dtype)"
        else:
          grid_why = kda_ops.o_proj_grid_why(B, T, H, wo.shape[0])
        if kernel_enabled("kda_o_grid", B * T, fits=not grid_why, why=grid_why):
          kernel_enabled("kda_conv")  # (its site: the grid runs the conv in its recurrence)
          # kda_o_grid_spin: the o_proj-only CTAs' W_o requests after a fixed hold, not every recurrence CTA's loads
          spin = {"w_delay": kda_ops.W_DELAY_CYCLES} if kernel_enabled("kda_o_grid_spin") else {}
          y, new_ssm = kda_ops.kda_decode_o_proj(
              z.reshape(B, T, 3, H, Kd), hist.reshape(B, Kc - 1, 3, H, Kd), w.T.reshape(Kc, 3, H, Kd), fg4, fgb,
              A_log, dt_bias, ssm, ctx.n_acc, self.o_norm.weight[...], wo[...], lower_bound=self.lower_bound,
              norm_eps=self.eps, config=config, b_offset=b_off,
              out_dtype=dtype if lax.axis_size(TP) == 1 else jnp.float32, **kda_grid_counters(), **spin)
          y = lax.psum(y.reshape(B, T, -1), TP).astype(dtype)
          return y, {"conv": new_conv, "ssm": new_ssm}
        if kernel_enabled("kda_conv", fits=conv_fits,
                          why=f"conv cache {hist.dtype} vs activations {z.dtype} (the kernel's window is one dtype)"):
          # the short conv + SiLU in the kernel: z and the history rows as they are (free reshapes), the taps as
          # [Kc, 3, H, Kd] (a transpose of parameters: loop-invariant, hoisted out of a multi-step call)
          o, new_ssm, *g = kda_ops.kda_decode_conv(
              z.reshape(B, T, 3, H, Kd), hist.reshape(B, Kc - 1, 3, H, Kd), w.T.reshape(Kc, 3, H, Kd), fg4, fgb,
              A_log, dt_bias, ssm, ctx.n_acc, lower_bound=self.lower_bound, b_offset=b_off, **norm, config=config,
              norm_partials=partials)
        else:
          o, new_ssm, *g = kda_ops.kda_decode(q, k, v, fg4, fgb, A_log, dt_bias, ssm, ctx.n_acc,
                                              lower_bound=self.lower_bound, b_offset=b_off, **norm, config=config,
                                              norm_partials=partials)
        ss = g.pop() if partials else None
        normed = bool(norm)
        if partials:
          o = kda_ops.gated_norm_from_partials(o, ss, gate, self.o_norm.weight[...], self.eps)
          normed = True
      else:
        o, new_ssm = kda_ops.kda_decode_reference(q, k, v, f, b, A_log, dt_bias, ssm, ctx.n_acc,
                                                  lower_bound=self.lower_bound)
    else:
      gl = self.lower_bound * jax.nn.sigmoid(jnp.exp(A_log)[:, None] * (f + dt_bias))
      ok = (jnp.arange(T)[None] < ctx.valid[:, None])[..., None]
      gl = jnp.where(ok[..., None], gl, 0.0)
      beta = jnp.where(ok, jax.nn.sigmoid(b.astype(jnp.float32)), 0.0)
      qn = l2norm(q) * (Kd ** -0.5)
      S0 = jax.vmap(lambda s, i: s[i])(ssm, ctx.n_acc - 1)
      from pallas_kernels import kda_prefill as kp  # noqa: PLC0415
      from pallas_kernels._common import interpreting  # noqa: PLC0415
      ho = kernel_enabled("kda_handover", fits=Kd % 64 == 0 and Kd % kp.VB == 0,
                          why=f"head dim {Kd} (the kernel's state rows: a multiple of 64)", prefer=not interpreting(),
                          prefer_why="GPU interpret mode: seconds a call (the policy can ask for it)")
      span = 16 * abs(self.lower_bound)  # (kda_chunked's 32-token sub-chunks: 16 tokens either side of the middle)
      pg = kernel_enabled("kda_chunk_gemm", fits=span <= PAIRWISE_GEMM_MAX_LOG,
                          why=f"a gate lower bound of {self.lower_bound}: e^(16 x {abs(self.lower_bound)}) past "
                          f"e^{PAIRWISE_GEMM_MAX_LOG:.0f} (f32's range)")
      o, S = kda_chunked(qn, l2norm(k), v, gl, beta, S0, handover_kernel=ho, pairwise_gemm=pg)
      new_ssm = ssm.at[:, 0].set(S)
    if not normed:
      o = rms_norm(o, self.o_norm.weight[...].astype(jnp.float32), self.eps, jnp.float32) * jax.nn.sigmoid(gate)
    y = lax.psum(self.o_proj(o.astype(dtype).reshape(B, T, H * Kd), dtype), TP)
    return y, {"conv": new_conv, "ssm": new_ssm}


# ==================================================================================================== DSA
class Indexer(nnx.Module):
  """The kpool-4 pooled indexer (spec §3.6.3); replicated on every TP rank."""

  def __init__(self, cfg: Glm5Config, dtype):
    D, HI, Di = cfg.hidden_size, cfg.index_n_heads, cfg.index_head_dim
    self.wq_b = Linear(cfg.q_lora_rank, HI * Di, dtype, (None, None))
    # wk, index_kpool_compress_gate and weights_proj: the three matrices that read the layer input, in one GEMV
    self.x_proj = ConcatLinear(D, (Di, Di, HI), dtype, (None, EMBED))
    self.k_norm_weight = param((Di,), dtype, (None,))
    self.k_norm_bias = param((Di,), dtype, (None,))
    self.index_kpool_compress_ape = param((cfg.index_kpool, Di), dtype, (None, None))
    self.n_heads, self.head_dim, self.kpool, self.top_pools = HI, Di, cfg.index_kpool, cfg.index_pools_topk

  def project(self, x, dtype):
    """x [B, T, D] -> (key pre-norm kr [B, T, Di], pool gate score γ [B, T, Di], head weights [B, T, HI]), in
    dtype: the inputs of ``keys`` and ``scores``."""
    with side_chain():  # (beside the MLA's q_a / kv_a GEMV, also under linear_fused_sum)
      return self.x_proj(x, dtype)

  def keys(self, kr, gam):
    """Per-token indexer key (LayerNorm'd, eps 1e-6) and pool gate score from ``project``: [B, T, Di] each
    (f32)."""
    dtype = kr.dtype
    kr = kr.astype(jnp.float32)
    mu = jnp.mean(kr, -1, keepdims=True)
    var = jnp.mean(jnp.square(kr - mu), -1, keepdims=True)
    k = (kr - mu) * lax.rsqrt(var + 1e-6) * self.k_norm_weight[...].astype(jnp.float32) + \
        self.k_norm_bias[...].astype(jnp.float32)
    k = k.astype(dtype).astype(jnp.float32)
    return k, gam.astype(jnp.float32)

  def pool(self, k4, g4):
    """k4, g4 [..., kpool, Di] -> pooled key Σ_r softmax_r(γ + ape) k (per channel)."""
    pi = jax.nn.softmax(g4 + self.index_kpool_compress_ape[...].astype(jnp.float32), axis=-2)
    return jnp.sum(pi * k4, axis=-2)

  def project_update(self, x, cache, ctx: StepCtx, dtype):
    """x [B, T, D] -> (head weights [B, T, HI], the updated indexer caches {ring, pool8 / pool_scale | pool}):
    ``project`` + ``keys`` + ``update``, or with an FP8 pool cache where the policy runs it (knob
    indexer_pool_kernel) the whole update as one Mosaic launch on the projection's output
    (pallas_kernels.indexer.pool_update)."""
    B, T, _ = x.shape
    if "pool8" in cache:
      from pallas_kernels import indexer as ki  # noqa: PLC0415
      ring = cache["ring"]
      fits = dtype == jnp.bfloat16 and ring.dtype == jnp.bfloat16 and T <= ki.POOL_MAX_TOKENS
      if kernel_enabled("indexer_pool_kernel", B * T, fits=fits,
                        why=f"a bf16 model and ring (here {jnp.dtype(dtype).name}, {ring.dtype}) and <= "
                        f"{ki.POOL_MAX_TOKENS} tokens per sequence (here {T})"):
        with side_chain():  # (beside the MLA's q_a / kv_a GEMV, also under linear_fused_sum)
          kx = self.x_proj.joint(x, dtype)  # [B, T, 2·Di + HI]: the kernel reads the key and gate columns in place
        # (Blackwell: the rotation's tcgen05 form)
        mma = {"mma": "tcgen05"} if has_tcgen05(kernel_arch()) else {}
        ring, pool8, pool_scale = ki.pool_update(
            kx, ring, cache["pool8"], cache["pool_scale"], ctx.start, ctx.valid, self.k_norm_weight[...],
            self.k_norm_bias[...], self.index_kpool_compress_ape[...], **mma)
        return kx[..., 2 * self.head_dim:], {"ring": ring, "pool8": pool8, "pool_scale": pool_scale}
    kr, gam, hw = self.project(x, dtype)
    k, gam = self.keys(kr, gam)
    return hw, self.update(k, gam, cache, ctx, dtype)

  def update(self, k, gam, cache, ctx: StepCtx, dtype):
    """Write completed pools into the pool cache and this call's keys into the tail ring."""
    B, T, Di = k.shape
    kp = self.kpool
    ring, pools = cache["ring"], cache.get("pool")  # ring [B, Rg, 2, Di]: key, gate score
    Rg = ring.shape[1]
    base = (ctx.start // kp) * kp
    G = kp * (-(-(kp - 1 + T) // kp))
    i = jnp.arange(G, dtype=jnp.int32)[None]
    pos = base[:, None] + i  # [B, G]
    from_ring = pos < ctx.start[:, None]
    t = pos - ctx.start[:, None]
    from_new = (t >= 0) & (t < ctx.valid[:, None])
    tc = jnp.clip(t, 0, T - 1)
    bq = jnp.arange(B)[:, None]
    take = lambda a, ix: a[bq, ix]
    old = take(ring, pos % Rg).astype(jnp.float32)  # [B, G, 2, Di]: one gather for keys and gate scores
    kc = jnp.where(from_ring[..., None], old[:, :, 0], jnp.where(from_new[..., None], take(k, tc), 0.0))
    gc = jnp.where(from_ring[..., None], old[:, :, 1], jnp.where(from_new[..., None], take(gam, tc), 0.0))
    pk = self.pool(kc.reshape(B, G // kp, kp, Di), gc.reshape(B, G // kp, kp, Di)).astype(dtype)
    end = ctx.start + ctx.valid
    pj = base[:, None] // kp + jnp.arange(G // kp, dtype=jnp.int32)[None]
    complete = (pj + 1) * kp <= end[:, None]
    out = {}
    if "pool8" in cache:  # vLLM numerics: Hadamard-rotated pooled keys in FP8 with a power-of-two scale
      from pallas_kernels import indexer as ki  # noqa: PLC0415
      k8, ks = ki.quant_ue8m0_fp8(ki.hadamard128(pk.astype(jnp.float32)))
      out["pool8"] = _scatter_rows(cache["pool8"], k8, pj, complete)
      out["pool_scale"] = _scatter_rows(cache["pool_scale"], ks, pj, complete)
    else:
      out["pool"] = _scatter_rows(pools, pk, pj, complete)
    # ring: only the last Rg real positions are distinct mod Rg (and they cover the open pool)
    npos, ok = _positions(ctx, T)
    ok = ok & (npos >= (end - Rg)[:, None])
    bidx = jnp.broadcast_to(jnp.arange(B)[:, None], npos.shape)
    slot = jnp.where(ok, npos % Rg, Rg)
    ring = ring.at[bidx, slot].set(jnp.stack([k, gam], axis=2).astype(ring.dtype), mode="drop")  # one scatter
    return dict(out, ring=ring)

  def scores(self, hw, q_r, icache, pos, dtype, *, padded: bool = False):
    """hw [B, T, HI] (the head weights from ``project``) -> [B, T, P] = Σ_h (w_h · HI^-½) · ReLU(q_h·K_j · Di^-½)
    over every pool slot (masked by the caller). With an FP8 pool cache: q and the keys are Hadamard-rotated and
    FP8 (UE8M0 scales), as vLLM scores them. ``padded``: (the scores, the scores kernel's output as it is where
    the kernel runs — [B, T, Pp >= P], -inf past each token's complete pools, which the top-k threshold kernel
    reads whole: policy knob topk_keys_in_kernel — else None)."""
    B, T, _ = hw.shape
    with side_chain():  # (beside the MLA's q_b GEMV, also under linear_fused_sum)
      q_raw = self.wq_b(q_r, dtype, one_row="indexer_wq_kernel").reshape(B, T, self.n_heads, self.head_dim)
    qI = q_raw.astype(jnp.float32)
    w = hw.astype(jnp.float32) * (self.n_heads ** -0.5)
    if "pool8" in icache:
      from pallas_kernels import indexer as ki  # noqa: PLC0415
      n_valid = (pos + 1) // self.kpool
      args = (w * (self.head_dim ** -0.5), icache["pool8"], icache["pool_scale"], n_valid)
      # (Blackwell: the scores' tcgen05 form, whose MMA takes the heads as N: a multiple of 16)
      mma = {"mma": "tcgen05"} if has_tcgen05(kernel_arch()) else {}
      if kernel_enabled("indexer", B * T, fits=not mma or self.n_heads % 16 == 0,
                        why=f"{self.n_heads} index heads (the scores' tcgen05 form takes a multiple of 16)"):
        # the padded output's width: whole rows of the threshold kernel's lanes where it reads them as they are
        # (topk_keys_in_kernel; session 39: a 32K + 320-position cache gave 8,768 padded pools, not a multiple of
        # 128, and the knob could not run)
        # (the threshold kernel reads the output as it is under topk_compact_kernel too)
        align = ki.THRESHOLD_LANES * (4 if kernel_switch("topk_threshold_4wg") else 1) \
            if kernel_switch("topk_keys_in_kernel") or kernel_switch("topk_compact_kernel") \
            else 64
        n_pools = icache["pool8"].shape[1]
        plan = ki.chunked_select_plan(n_pools, min(self.top_pools, n_pools)) \
            if -(-n_pools // ki.THRESHOLD_LANES) * ki.THRESHOLD_LANES > ki.THRESHOLD_MAX_KEYS else None
        if plan is not None and kernel_switch("topk_two_stage"):  # (whole chunks: no pad before the selection)
          align = math.lcm(align, ki.THRESHOLD_LANES * plan[0])
        # indexer_q_in_kernel: the queries' FWHT + FP8 quantisation inside the scores kernel (its wgmma reads the
        # bf16 projection output as is) instead of ~3 XLA kernels in front of it
        if kernel_enabled("indexer_q_in_kernel", fits=q_raw.dtype == jnp.bfloat16,
                          why=f"{q_raw.dtype} index queries (the kernel rotates bf16 ones)"):
          raw = ki.indexer_scores_q(q_raw, *args, padded=True, align=align, lean=kernel_enabled("lean_barriers"),
                                    **mma)
        else:
          raw = ki.indexer_scores(*ki.quant_ue8m0_fp8(ki.hadamard128(qI)), *args, padded=True, align=align,
                                  lean=kernel_enabled("lean_barriers"), **mma)
        sc = raw[..., :icache["pool8"].shape[1]]
        return (sc, raw) if padded else sc
      from pallas_kernels._common import interpreting  # noqa: PLC0415
      # indexer_prefill (a prefill chunk's rows, past the decode kernel's 64): the scores kernel over token groups
      # of a few rows, each CTA rotating its own queries, instead of XLA's FP8 product, which writes every head's
      # scores [B, T, HI, P] in f32 for the head sum to read back
      if kernel_enabled("indexer_prefill", fits=q_raw.dtype == jnp.bfloat16 and (not mma or self.n_heads % 16 == 0),
                        why=f"{q_raw.dtype} index queries with {self.n_heads} heads (the kernel rotates bf16 ones; "
                        "its tcgen05 form takes a multiple of 16 heads)", prefer=not interpreting(),
                        prefer_why="GPU interpret mode: seconds a call (the policy can ask for it)"):
        raw = ki.indexer_scores_rows(q_raw, *args, padded=True, lean=kernel_enabled("lean_barriers"),
                                     **mma)
        sc = raw[..., :icache["pool8"].shape[1]]
        return (sc, raw) if padded else sc
      sc = ki.indexer_scores_reference(*ki.quant_ue8m0_fp8(ki.hadamard128(qI)), *args)
      return (sc, None) if padded else sc
    # (records why the kernel does not run here)
    kernel_enabled("indexer", fits=False, why="a bf16/f32 pooled-key cache (the kernel reads the FP8 one: policy "
                   "kv_cache_dtype 'fp8')")
    pools = icache["pool"]
    dots = jnp.einsum("bthd,bpd->bthp", qI, pools.astype(jnp.float32), precision=HIGHEST) * (self.head_dim ** -0.5)
    sc = jnp.einsum("bth,bthp->btp", w, jnp.maximum(dots, 0.0), precision=HIGHEST)
    return (sc, None) if padded else sc

  def select(self, scores, pos, shared=None, extra_tail=0, *, raw=None, width=None):
    """Top pools expanded to tokens + the always-selected tail -> (idx [B, T, W] (−1 pad), pools [B, T, kp]).

    ``shared`` = (pools [B, kp] (−1 = none), tail_start [B]) reuses a first draft step's choice: the tail then
    runs from ``tail_start`` to the query (``extra_tail`` more slots than the usual kpool − 1). ``raw``: the scores
    kernel's padded output behind ``scores`` (``scores(padded=True)``), or None. ``width``: W -> the width the
    attention kernel pads the list to (pallas_kernels.sparse_mla.index_width), which the compaction kernel
    (topk_compact_kernel) then writes directly: idx is then [B, T, width(W)], the same list -1 padded."""
    kp = self.kpool
    if shared is None:
      n_complete = (pos + 1) // kp  # [B, T]
      P = scores.shape[-1]
      masked = jnp.where(jnp.arange(P)[None, None] < n_complete[..., None], scores, -jnp.inf)
      kk = min(self.top_pools, P)
      R = masked.shape[0] * masked.shape[1]  # score rows (decode: B·T; prefill's > 64 sort)
      form, pays = radix_topk_plan(R, P)
      from pallas_kernels import indexer as ki  # noqa: PLC0415
      thr_fits = -(-P // ki.THRESHOLD_LANES) * ki.THRESHOLD_LANES <= ki.THRESHOLD_MAX_KEYS
      n_tail = kp - 1 + extra_tail
      Pr = None if raw is None else raw.shape[-1]
      W = kp * kk + n_tail
      wp = -(-(W if width is None else width(W)) // 64) * 64  # (the attention kernel's width of the list)
      # the list the compaction kernel writes: k < SELECT_MAX_K, kp · k a multiple of 64, <= 4,096 positions after
      list_fits = kk < ki.SELECT_MAX_K and (kp * kk) % 64 == 0 and wp - kp * kk <= 64 * 64
      # a row past the kernel's keys (past 64K context): the one-launch selection in two stages (topk_two_stage)
      chunked = not thr_fits and Pr is not None and all(kernel_switch(n) for n in (
          "topk_two_stage", "topk_compact_kernel", "topk_compact_fused")) and not kernel_switch("topk_threshold_4wg") \
          and ki.chunked_select_plan(Pr, kk) is not None and list_fits
      thr_pays = (thr_fits or chunked) and R >= ki.THRESHOLD_MIN_ROWS and kernel_switch("topk_threshold")
      if kernel_enabled("indexer_topk", R, prefer=pays or thr_pays,
                        prefer_why=f"{R} rows x {P} pools: XLA's sort measured faster than the XLA radix passes "
                        "(layers.radix_topk_plan; the topk_threshold kernel is off or does not fit; policy "
                        "indexer_topk: true forces the radix selection)"):
        thr = kernel_enabled("topk_threshold", fits=thr_fits or chunked,
                             why=f"{P} pools per score row (the kernel holds up to {ki.THRESHOLD_MAX_KEYS}; past it "
                             "two stages of the fused compaction: knobs topk_two_stage, topk_compact_kernel and "
                             "topk_compact_fused on, topk_threshold_4wg off, the scores kernel's output)",
                             prefer=R >= ki.THRESHOLD_MIN_ROWS,
                             prefer_why=f"{R} score rows, below pallas_kernels.indexer.THRESHOLD_MIN_ROWS = "
                             f"{ki.THRESHOLD_MIN_ROWS}: XLA's radix passes measured faster there")
        two = kernel_enabled("topk_threshold_2bit", fits=thr, why="the topk_threshold kernel does not run here")
        if thr and not thr_fits and kernel_enabled("topk_two_stage", R):  # (chunked: every condition checked)
          # (Blackwell: the compaction's tcgen05 form)
          cmma = {"mma": "tcgen05"} if has_tcgen05(kernel_arch()) else {}
          idx, js = ki.topk_compact_chunked(
              raw.reshape(R, Pr), (n_complete * kp).reshape(R), pos.reshape(R).astype(jnp.int32), k=kk, kpool=kp,
              n_tail=n_tail, width=wp, early_exit=kernel_enabled("topk_threshold_exit"), digit_bits=2 if two else 1,
              lean=kernel_enabled("lean_barriers"), **cmma)
          return idx.reshape(*pos.shape, wp), js.reshape(*pos.shape, kk)
        # (THRESHOLD_MAX_KEYS is a multiple of 4 x 128: the rows that fit one warpgroup fit four)
        wgs = 4 if kernel_enabled("topk_threshold_4wg", fits=thr, why="the topk_threshold kernel does not run "
                                  "here") else 1
        # topk_compact_kernel: the threshold kernel as the model runs it (on the scores kernel's padded output), then
        # the compaction, the expansion to tokens, the tail and the pad to the attention kernel's width as ONE
        # multi-CTA launch (pallas_kernels.indexer.topk_compact) instead of 6 XLA kernels after the threshold
        lanes = ki.THRESHOLD_LANES * wgs  # (the threshold kernel's row: a multiple of its lanes)
        if kernel_enabled("topk_compact_kernel", fits=bool(thr) and Pr is not None and Pr % lanes == 0
                          and Pr <= ki.THRESHOLD_MAX_KEYS and list_fits,
                          why=f"needs the threshold kernel on, the scores kernel's output (here {Pr} padded pools; a "
                          f"multiple of {lanes} up to {ki.THRESHOLD_MAX_KEYS}), k = {kk} < {ki.SELECT_MAX_K} with "
                          f"{kp} · k a multiple of 64, and at most 4,096 positions after the pools' (here "
                          f"{wp - kp * kk})"):
          raw2 = raw.reshape(R, Pr)
          ex = kernel_enabled("topk_threshold_exit", fits=thr, why="the topk_threshold kernel does not run here")
          # topk_compact_fused: every compaction CTA runs the threshold's passes itself — one launch, no threshold
          # kernel before it (its passes on one warpgroup; topk_threshold_2bit: two bits a pass there too)
          if kernel_enabled("topk_compact_fused", fits=wgs == 1,
                            why="the threshold's passes on one warpgroup (topk_threshold_4wg off)"):
            t = n_gt = None
          else:
            t, n_gt = ki.topk_threshold(raw2, kk, digit_bits=2 if two else 1, warpgroups=wgs, early_exit=ex,
                                        lanes_out=True)
          ts = (n_complete * kp).reshape(R)
          # (Blackwell: the compaction's tcgen05 form — its prefix counts tcgen05 MMAs of 128 rows)
          cmma = {"mma": "tcgen05"} if has_tcgen05(kernel_arch()) else {}
          idx, js = ki.topk_compact(raw2, t, n_gt, ts, pos.reshape(R).astype(jnp.int32), k=kk, kpool=kp,
                                    n_tail=n_tail, width=wp, early_exit=ex,
                                    digit_bits=2 if two and t is None else 1, lean=kernel_enabled("lean_barriers"),
                                    **cmma)
          return idx.reshape(*pos.shape, wp), js.reshape(*pos.shape, kk)
        # topk_keys_in_kernel: the threshold kernel reads the scores kernel's padded output ([R, Pp], -inf past
        # the complete pools, as ``masked``) and forms the keys itself — no XLA kernel between the two kernels
        if kernel_enabled("topk_keys_in_kernel", fits=bool(thr) and Pr is not None and Pr % lanes == 0
                          and Pr <= ki.THRESHOLD_MAX_KEYS,
                          why=f"needs the threshold kernel on and the scores kernel's output (here {Pr} padded "
                          f"pools; a multiple of {lanes} up to {ki.THRESHOLD_MAX_KEYS})"):
          form = {**form, "kernel_scores": raw.reshape(-1, Pr)}
        # lax.top_k's set, ascending
        ex = kernel_enabled("topk_threshold_exit", fits=thr, why="the topk_threshold kernel does not run here")
        js = topk_set_by_threshold(masked, kk, **form, threshold_kernel=(2 if two else 1) if thr else 0,
                                   threshold_warpgroups=wgs, threshold_exit=ex)
        vals = jnp.take_along_axis(masked, js, axis=-1)
      else:
        # topk_prefill (a prefill chunk's rows, past the decode selection's 64): the fused one-launch selection
        # (topk_compact: the threshold's passes in every CTA of a row) on XLA's scores padded with -inf to its
        # lanes — or its two stages past its keys — instead of XLA's segmented sort of every row
        Pp = -(-P // ki.THRESHOLD_LANES) * ki.THRESHOLD_LANES
        two_stage = not thr_fits and ki.chunked_select_plan(Pp, kk) is not None
        from pallas_kernels._common import interpreting  # noqa: PLC0415
        if kernel_enabled("topk_prefill", fits=list_fits and (thr_fits or two_stage),
                          why=f"k = {kk} < {ki.SELECT_MAX_K} with {kp} · k a multiple of 64, at most 4,096 positions "
                          f"after the pools' (here {wp - kp * kk}) and {P} pools a row within the two stages' reach",
                          prefer=not interpreting(),
                          prefer_why="GPU interpret mode: seconds a call (the policy can ask for it)"):
          sp = jnp.pad(masked.reshape(R, P), ((0, 0), (0, Pp - P)), constant_values=-jnp.inf)
          ts, pr = (n_complete * kp).reshape(R).astype(jnp.int32), pos.reshape(R).astype(jnp.int32)
          kw = dict(k=kk, kpool=kp, n_tail=n_tail, width=wp, lean=kernel_enabled("lean_barriers"),
                    **({"mma": "tcgen05"} if has_tcgen05(kernel_arch()) else {}))
          idx, js = (ki.topk_compact(sp, None, None, ts, pr, **kw) if thr_fits
                     else ki.topk_compact_chunked(sp, ts, pr, **kw))
          return idx.reshape(*pos.shape, wp), js.reshape(*pos.shape, kk)
        vals, js = lax.top_k(masked, kk)
      js = jnp.where(jnp.isfinite(vals), js, -1).astype(jnp.int32)
      tail_start = n_complete * kp
    else:
      js = jnp.broadcast_to(shared[0][:, None], (*pos.shape, shared[0].shape[-1]))
      tail_start = jnp.broadcast_to(shared[1][:, None], pos.shape)
    tok = js[..., None] * kp + jnp.arange(kp, dtype=jnp.int32)
    tok = jnp.where(js[..., None] >= 0, tok, -1).reshape(*js.shape[:-1], -1)
    r = jnp.arange(kp - 1 + extra_tail, dtype=jnp.int32)
    tail = tail_start[..., None] + r
    tail = jnp.where(tail <= pos[..., None], tail, -1)
    return jnp.concatenate([tok, tail], axis=-1), js


ABSORB_ROWS = 8  # token rows up to which _per_head sums products instead of a dot (one verify of q <= 8 at B = 1)
# token rows from which DSA's attention over the FP8 cache in XLA (no kernel: a prefill chunk, the stock path) with
# bf16 queries runs as bf16 tensor-core products over the gathered e4m3 bytes (sparse_mla.sparse_mla_grouped)
# instead of dequantising every selected row to f32 for every query row (the reference's form, kept for decode's
# few rows: the auto backend's step as measured)
GROUPED_ATTN_ROWS = 16


def _mla_forms(rows, tc05: bool, blocks: int = 1) -> dict:
  """The sparse MLA kernel's form options from the policy's knobs (``rows``: the decode site's token rows, within
  its row limit; None at mla_prefill's site, which has none; ``blocks``: the blocks of 64 positions each CTA runs,
  ``sparse_mla.blocks_per_cta``)."""
  why = lambda what: f"the tcgen05 form (Blackwell) {what}"  # noqa: E731
  # mla_dequant_warpgroups: a second warpgroup per CTA converting half of each block's FP8 latent (Hopper)
  wgs = 2 if kernel_enabled("mla_dequant_warpgroups", rows, fits=not tc05, why=why("has one warpgroup")) else 1
  return dict(
      # lean_barriers: the attention, merge and W_UV kernels without Mosaic's automatic barriers
      lean=kernel_enabled("lean_barriers"),
      warpgroups=wgs,
      # mla_gather_warpgroup: a second warpgroup per CTA issuing the blocks' gathers into a ring (Hopper)
      gather_warpgroup=kernel_enabled(
          "mla_gather_warpgroup", rows, fits=not tc05 and blocks >= 2,
          why=why("has its own gather") if tc05 else "each CTA runs one block of positions: nothing to overlap"),
      # mla_scales_after: the latent's block scales applied after the MMAs (the dequantisation converts bytes only)
      scales_after=kernel_enabled("mla_scales_after", rows, fits=not tc05,
                                  why=why("dequantises one group at a time already")),
      # mla_group_arrival: the gathers' barrier counts a group of 4 rows once (not 4 x 128 thread arrivals)
      group_arrival=kernel_enabled("mla_group_arrival", rows, fits=not tc05, why=why("has its own gather")),
      # mla_q_in_kernel: the query's f16 rescale in the kernel's prologue (not two XLA launches before it)
      q_in_kernel=kernel_enabled("mla_q_in_kernel", rows, fits=not tc05, why=why("takes the rescaled query")))


def _per_head(eq, x, w):
  """The MLA absorption x [B, T, H, a] · w (per head) -> [B, T, H, b], for the two contractions of DSA ("bthn,hnr->
  bthr": W_UK, "bthr,hvr->bthv": W_UV). For a few token rows (B·T <= ABSORB_ROWS) as an f32 product and a sum —
  one reduction fusion streaming the per-head weights — instead of a dot with the heads as a batch dimension,
  which XLA on the H200 may emit as a Triton gemm fusion of ~14 µs whatever the rows (session 25's profiles: 12
  launches a step at B·T = 1, 4 and 32). The reduction re-reads the 4 MB weight per row (from L2), so more rows
  keep the dot. Same result dtype either way."""
  # the contracted axis of w (the other is the output's)
  axis = {"bthn,hnr->bthr": -2, "bthr,hvr->bthv": -1}.get(eq)
  if axis is None:
    raise ValueError(f"_per_head: unknown contraction {eq!r}")
  if x.shape[0] * x.shape[1] > ABSORB_ROWS:
    return jnp.einsum(eq, x, w, precision=HIGHEST)
  f32 = jnp.float32
  xe = x.astype(f32)[..., :, None] if axis == -2 else x.astype(f32)[..., None, :]
  return jnp.sum(xe * w.astype(f32), axis=axis).astype(jnp.result_type(x, w))


class DSA(nnx.Module):
  """NoPE MLA over indexer-selected positions (absorbed form), heads split over TP; q_a/kv_a replicated."""

  def __init__(self, cfg: Glm5Config, dtype, fp8_block):
    D, H, R, dn, dv = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim
    # q_a and kv_a read the same input: one weight (one GEMV / FP8 kernel call) where the FP8 scale blocks allow
    # (the release: 1536 + 512 rows); the checkpoint's two matrices otherwise
    if concat_fits((cfg.q_lora_rank, R), fp8_block):
      self.qkv_a_proj = ConcatLinear(D, (cfg.q_lora_rank, R), dtype, (None, EMBED), fp8_block=fp8_block)
    else:
      self.q_a_proj = Linear(D, cfg.q_lora_rank, dtype, (None, EMBED), fp8_block=fp8_block)
      self.kv_a_proj_with_mqa = Linear(D, R, dtype, (None, EMBED), fp8_block=fp8_block)
    self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, dtype, cfg.rms_norm_eps)
    self.q_b_proj = Linear(cfg.q_lora_rank, H * cfg.qk_head_dim, dtype, (MLA_HD, None), fp8_block=fp8_block)
    self.kv_a_layernorm = RMSNorm(R, dtype, cfg.rms_norm_eps)
    self.kv_b_proj = Linear(R, H * (dn + dv), dtype, (MLA_HD, None))
    self.o_proj = Linear(H * dv, D, dtype, (EMBED, MLA_HD), fp8_block=fp8_block)
    self.indexer = Indexer(cfg, dtype)
    self.dn, self.dv, self.scale = dn, dv, cfg.softmax_scale

  def __call__(self, x, cache, ctx: StepCtx, dtype, *, shared=None, extra_tail=0, x16=None):
    """x [B, T, D] -> (y [B, T, D], new cache, aux {"idx": [B, T, W], "pools": [B, T, kp]}). ``x16``: x's f16 copy
    (the mHC boundary's, policy knob dq_f16) for the f16 q_a / kv_a kernel; the indexer reads x."""
    B, T, _ = x.shape
    dn, dv = self.dn, self.dv
    fp8 = "latent8" in cache
    # mla_latent_norms: q_a / kv_a's joint output RMS-normalised (both parts) and the latent quantised into its
    # FP8 cache row by one kernel instead of ~7 XLA fusions on the layer's critical path
    joint = hasattr(self, "qkv_a_proj")
    R = self.kv_a_layernorm.weight.shape[0]
    norms = kernel_enabled(
        "mla_latent_norms", B * T, fits=fp8 and joint and dtype == jnp.bfloat16 and R == 512
        and self.q_a_layernorm.eps == self.kv_a_layernorm.eps,
        why=f"an FP8 latent cache (here {fp8}), the joint q_a / kv_a projection (here {joint}), a bf16 model (here "
        f"{jnp.dtype(dtype).name}), a 512-wide latent (here {R}) and one RMSNorm eps")
    # qkv_a_fused_sum: the projection's K splits summed in its kernel (no XLA split sum on the critical path)
    if norms:
      qa = self.qkv_a_proj.joint(x, dtype, fused_sum="qkv_a_fused_sum", x16=x16)  # [B, T, Q + R], normalised below
    elif joint:
      qa, ca = self.qkv_a_proj(x, dtype, fused_sum="qkv_a_fused_sum", x16=x16)
    else:
      qa, ca = self.q_a_proj(x, dtype, x16=x16), self.kv_a_proj_with_mqa(x, dtype, x16=x16)
    x_ix = x  # the indexer's input
    if kernel_enabled("dsa_qkv_a_first", B * T):
      # the indexer's projection (XLA's GEMV) and cache update take x through a barrier with q_a / kv_a's output.
      # Under XLA's concurrent command buffer that orders the launches (q_a / kv_a's kernel first), not the
      # execution: s51b's trace has q_a / kv_a 9.2 -> 5.5 µs (4.5 alone), the indexer's GEMV beside it
      # (layers.KNOBS["dsa_qkv_a_first"])
      x_ix, qa = lax.optimization_barrier((x, qa))
    row8 = None  # the latent's FP8 cache rows [B, T, ROW_WORDS] where the kernel quantised it
    if norms:
      from pallas_kernels import sparse_mla as ks  # noqa: PLC0415
      q_r, c, c8, sc = ks.latent_norms(qa.reshape(B * T, -1), self.q_a_layernorm.weight[...],
                                       self.kv_a_layernorm.weight[...], eps=self.q_a_layernorm.eps,
                                       lean=kernel_enabled("lean_barriers"))
      q_r, c, row8 = q_r.reshape(B, T, -1), c.reshape(B, T, R), ks.pack_latent(c8, sc).reshape(B, T, -1)
    else:
      q_r = self.q_a_layernorm(qa, dtype)
      c = self.kv_a_layernorm(ca, dtype)  # [B, T, R], the cached latent
    q = self.q_b_proj(q_r, dtype)
    H = q.shape[-1] // dn
    q = q.reshape(B, T, H, dn)
    wkv = self.kv_b_proj.w(dtype).reshape(H, dn + dv, -1)
    w_uk, w_uv = wkv[:, :dn], wkv[:, dn:]
    pos, ok = _positions(ctx, T)
    amma = {"mma": "tcgen05"} if has_tcgen05(kernel_arch()) else {}  # (Blackwell: the attention's tcgen05 forms)
    o = o16 = None  # [B, T, H, dv]: from the W_UV kernel where it runs (o16: its f16 copy, dq_f16)
    if fp8:  # FP8 E4M3 latent cache rows with one fp32 scale per 128 values (written as the token arrives)
      from pallas_kernels import sparse_mla as ks  # noqa: PLC0415
      lat = {"latent8": _scatter_rows(cache["latent8"], ks.quantize_latent(c) if row8 is None else row8, pos, ok)}
    else:
      lat = {"latent": _scatter_rows(cache["latent"], c, pos, ok)}
    with jax.named_scope("indexer"):
      hw, icache = self.indexer.project_update(x_ix, cache, ctx, dtype)
      if shared is None:
        sc, raw = self.indexer.scores(hw, q_r, icache, pos, dtype, padded=True)
        width = None
        if fp8 and kernel_switch("sparse_mla"):  # (the list as wide as the attention kernel reads it)
          from pallas_kernels import sparse_mla as ks  # noqa: PLC0415
          width = functools.partial(ks.index_width, B, T, -(-H // 16) * 16, **amma)
        idx, js = self.indexer.select(sc, pos, raw=raw, width=width)
      else:
        idx, js = self.indexer.select(None, pos, shared=shared, extra_tail=extra_tail)
    q_hat = self._absorb_uk(q, wkv, w_uk)  # absorbed query [B, T, H, R]
    if fp8:
      from pallas_kernels._common import interpreting  # noqa: PLC0415
      if kernel_enabled("sparse_mla", B * T):
        hp = -H % 16  # the kernel packs 16 heads per CTA: pad with zero queries (sliced off below)
        qk = jnp.pad(q_hat, ((0, 0), (0, 0), (0, hp), (0, 0))) if hp else q_hat
        # the splits' merge: a Mosaic launch of its own (mla_combine_kernel), else XLA fusions
        combine = "kernel" if kernel_enabled("mla_combine_kernel") else "xla"
        # mla_uv_kernel: W_UV as a kernel reading the merge's O^T as it is (no XLA transpose + reduction after it)
        dv_unit = ks.UV_TC_ROWS if amma else ks.BLOCK  # (a CTA's rows of W_UV: 128 in the tcgen05 form)
        uv = kernel_enabled("mla_uv_kernel", B * T, fits=wkv.dtype == jnp.bfloat16 and B * T <= ks.UV_MAX_TOKENS
                            and dv % dv_unit == 0,
                            why=f"bf16 kv_b weights (here {wkv.dtype}), <= {ks.UV_MAX_TOKENS} token rows (here "
                            f"{B * T}) and dv a multiple of {dv_unit} (here {dv})")
        forms = _mla_forms(B * T, bool(amma), ks.blocks_per_cta(B, T, H + hp, idx.shape[-1]))
        lean = forms["lean"]
        o_lat = ks.sparse_mla_decode(qk, lat["latent8"], idx, softmax_scale=self.scale, combine=combine,
                                     transposed=uv, **forms, **amma)
        if uv:  # dq_f16: also in f16 for o_proj's f16 kernel (no conversion kernel between them)
          o = ks.mla_absorb_uv(o_lat, wkv, dn=dn, lean=lean, x16=f16_copies(B * T), **amma)
          o, o16 = o if isinstance(o, tuple) else (o, None)
          o = o.reshape(B, T, H, dv)
        else:
          o_lat = o_lat[:, :, :H]
      elif kernel_enabled("mla_prefill", prefer=not interpreting(),
                          prefer_why="GPU interpret mode: seconds a call (the policy can ask for it)"):
        # a prefill chunk (or a step past the decode kernels' rows): the same attention kernel, a CTA per (token,
        # split) gathering its own rows into SMEM — XLA's grouped form writes every token's gathered rows to HBM
        # and reads them back twice. Its forms as the policy's knobs say (a chunk keeps them: PREFILL_FORM_KNOBS)
        hp = -H % 16
        qk = jnp.pad(q_hat, ((0, 0), (0, 0), (0, hp), (0, 0))) if hp else q_hat
        o_lat = ks.sparse_mla_decode(qk, lat["latent8"], idx, softmax_scale=self.scale, combine="kernel",
                                     **_mla_forms(None, bool(amma), ks.blocks_per_cta(B, T, H + hp, idx.shape[-1])),
                                     **amma)[:, :, :H]
      else:
        grouped = B * T >= GROUPED_ATTN_ROWS and q_hat.dtype == jnp.bfloat16
        attend = ks.sparse_mla_grouped if grouped else ks.sparse_mla_decode_reference
        o_lat = attend(q_hat, lat["latent8"], idx, softmax_scale=self.scale)
    else:
      # (records why the kernel does not run here)
      kernel_enabled("sparse_mla", fits=False, why="a bf16/f32 latent cache (the kernel reads the FP8 one: policy "
                     "kv_cache_dtype 'fp8')")
      cs = lat["latent"][jnp.arange(B)[:, None, None], jnp.maximum(idx, 0)].astype(dtype)  # [B, T, W, R]
      s = jnp.einsum("bthr,btwr->bthw", q_hat.astype(jnp.float32), cs.astype(jnp.float32), precision=HIGHEST)
      s = jnp.where((idx >= 0)[:, :, None, :], s * self.scale, -jnp.inf)
      p = jax.nn.softmax(s, axis=-1)
      o_lat = jnp.einsum("bthw,btwr->bthr", p, cs.astype(jnp.float32), precision=HIGHEST)
    if o is None:
      o = _per_head("bthr,hvr->bthv", o_lat.astype(dtype), w_uv)
    y = lax.psum(self.o_proj(o.reshape(B, T, H * dv), dtype,
                             x16=None if o16 is None else o16.reshape(B, T, H * dv)), TP)
    new = dict(cache, **lat, **icache)
    return y, new, {"idx": idx, "pools": js}

  def _absorb_uk(self, q, wkv, w_uk):
    """q [B, T, H, dn] -> q̂ [B, T, H, R] = W_UK_hᵀ q_h per head: the Mosaic kernel (policy knob mla_uk_kernel)
    or XLA's ``_per_head``."""
    from pallas_kernels import sparse_mla as ks  # noqa: PLC0415
    B, T, H, dn = q.shape
    R = wkv.shape[-1]
    bf16 = jnp.bfloat16
    if not kernel_enabled("mla_uk_kernel", B * T, fits=q.dtype == bf16 and wkv.dtype == bf16 and B * T <= ks.
                          UV_MAX_TOKENS and dn % ks.BLOCK == 0 and R == ks.D_LATENT,
                          why=f"a bf16 model (here q {q.dtype}, kv_b {wkv.dtype}), <= {ks.UV_MAX_TOKENS} token rows "
                          f"(here {B * T}), dn a multiple of {ks.BLOCK} (here {dn}) and a {ks.D_LATENT}-wide latent "
                          f"(here {R})"):
      return _per_head("bthn,hnr->bthr", q, w_uk)
    hp = -H % ks.UK_HEADS  # (the kernel reads q's heads in groups of 16: the tiny presets' 4 padded, unread)
    qh = q.reshape(B * T, H, dn)
    if hp:
      qh = jnp.pad(qh, ((0, 0), (0, hp), (0, 0)))
    return ks.mla_absorb_uk(qh, wkv, dn=dn, lean=kernel_enabled("lean_barriers")).reshape(B, T, H, R)
