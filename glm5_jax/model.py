"""The GLM-5.3-Flash text model and its MTP draft layer as Flax NNX modules, and their per-shard forward.

``Glm5Model`` mirrors the checkpoint: ``embed_tokens``, ``layers[i]`` (mHC sites, norms, KDA or DSA, dense MLP
or MoE), ``norm``, ``lm_head`` and the MTP layer ``mtp`` (checkpoint index num_hidden_layers = 45). The
functions below run on one tensor-parallel shard inside ``jax.shard_map`` (sharding.py); the embedding and the
lm_head are vocabulary-parallel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from glm5_jax.attention import DSA, KDA, StepCtx
from glm5_jax.config import KDA as KDA_TYPE, Glm5Config
from glm5_jax.layers import (EMBED, HIGHEST, MLP, ONE_ROW_GEMV, TP, VOCAB, HyperConnection, Linear, MoE, RMSNorm,
                             balanced_splits, counters_scope, f16_copies, gemv_mma, has_wgmma, kernel_arch,
                             kernel_enabled, kernel_switch, param, part_rows)


class DecoderLayer(nnx.Module):
  def __init__(self, cfg: Glm5Config, i: int, dtype, fp8_block):
    self.is_kda = cfg.layer_types[i] == KDA_TYPE
    self.is_moe = cfg.mlp_layer_types[i] == "sparse"
    self.attn_hc = HyperConnection(cfg, dtype)
    self.ffn_hc = HyperConnection(cfg, dtype)
    self.input_layernorm = RMSNorm(cfg.hidden_size, dtype, cfg.rms_norm_eps)
    self.post_attention_layernorm = RMSNorm(cfg.hidden_size, dtype, cfg.rms_norm_eps)
    self.self_attn = KDA(cfg, dtype) if self.is_kda else DSA(cfg, dtype, fp8_block)
    self.mlp = MoE(cfg, dtype, fp8_block) if self.is_moe else MLP(cfg, cfg.intermediate_size, dtype, fp8_block)

  def __call__(self, X, cache, ctx: StepCtx, dtype):
    """X [B, T, N, D] residual streams -> (X', cache', aux)."""
    # named scopes label the compiled program's kernels by component (benchmarks/bench_decode.py --profile)
    aux = {}
    with jax.named_scope("mhc"):
      u, post, comb = self.attn_hc.pre(X)
      x = self.input_layernorm(u, dtype)
    with jax.named_scope("kda" if self.is_kda else "dsa"):
      if self.is_kda:
        y, cache = self.self_attn(x, cache, ctx, dtype)
      else:
        y, cache, a = self.self_attn(x, cache, ctx, dtype)
        aux["idx"] = a["idx"]
    with jax.named_scope("mhc"):
      X = HyperConnection.post(X, y, post, comb)
      u, post, comb = self.ffn_hc.pre(X)
      x = self.post_attention_layernorm(u, dtype)
    with jax.named_scope("moe" if self.is_moe else "mlp"):
      if self.is_moe:
        y, aux["experts"] = self.mlp(x, dtype, return_ids=True)
      else:
        y = self.mlp(x, dtype)
    with jax.named_scope("mhc"):
      return HyperConnection.post(X, y, post, comb), cache, aux


  def call_fused(self, X2, pending, cache, ctx: StepCtx, dtype, bt):
    """__call__ with the fused mHC boundaries (pallas_kernels/mhc.py). X2 [B·T, N·D] bf16 residual before the
    previous sublayer's post, pending = (y, mix) of that sublayer (None before layer 0), bt = (B, T)
    -> (X2, cache, aux, pending): this layer's MLP output and mix stay pending for the next boundary."""
    aux = {}
    B, T = bt
    with jax.named_scope("mhc"):
      # dq_f16: the boundary also writes x_in in f16 for the sublayer's FP8 kernels (none in a KDA sublayer)
      X2, x, mix = self.attn_hc.fused(X2, pending, self.input_layernorm, x16=not self.is_kda and f16_copies(B * T))
      x, x16 = x if isinstance(x, tuple) else (x, None)
    with jax.named_scope("kda" if self.is_kda else "dsa"):
      if self.is_kda:
        y, cache = self.self_attn(x.reshape(B, T, -1), cache, ctx, dtype)
      else:
        y, cache, a = self.self_attn(x.reshape(B, T, -1), cache, ctx, dtype,
                                     x16=None if x16 is None else x16.reshape(B, T, -1))
        aux["idx"] = a["idx"]
    with jax.named_scope("mhc"):
      X2, x, mix = self.ffn_hc.fused(X2, (y.reshape(B * T, -1), mix), self.post_attention_layernorm,
                                     x16=f16_copies(B * T))
      x, x16 = x if isinstance(x, tuple) else (x, None)
      x16 = None if x16 is None else x16.reshape(B, T, -1)
    with jax.named_scope("moe" if self.is_moe else "mlp"):
      if self.is_moe:
        y, aux["experts"] = self.mlp(x.reshape(B, T, -1), dtype, return_ids=True, x16=x16)
      else:
        y = self.mlp(x.reshape(B, T, -1), dtype, x16=x16)
    return X2, cache, aux, (y.reshape(B * T, -1), mix)


def fused_mhc(cfg: Glm5Config, dtype, rows: int) -> bool:
  """Whether this trace runs the mHC boundaries of ``rows`` token rows as the fused kernels: policy knob ``mhc``,
  a bf16 residual, 4 streams, hidden size a multiple of 128 (the kernels' column chunks) — and on a GPU without
  wgmma (layers.has_wgmma: Blackwell) the one form that issues none, the row form of the boundary (mhc_row under
  mhc_grid_barrier, mhc_finish and mhc_sinkhorn_split: one token row, or up to 4 with mhc_rows)."""
  from pallas_kernels import mhc as km  # noqa: PLC0415 (kernels import lazily)
  one_row = all(kernel_switch(k) for k in ("mhc_grid_barrier", "mhc_finish", "mhc_sinkhorn_split", "mhc_row"))
  D = cfg.hidden_size
  row_form = (one_row and (rows == 1 or (rows <= km.PARTS_MAX_ROWS and kernel_switch("mhc_rows")))
              and D % km.ROW_COLS == 0 and D // km.ROW_COLS <= km.GRID_MAX_CTAS)
  unmet = [w for ok, w in ((jnp.dtype(dtype) == jnp.bfloat16, f"a bf16 residual (model dtype {jnp.dtype(dtype).name})"),
                            (cfg.hc_mult == 4, f"4 streams (hc_mult {cfg.hc_mult})"),
                            (cfg.hidden_size % 128 == 0, f"hidden % 128 == 0 (hidden {cfg.hidden_size})"),
                            (has_wgmma(kernel_arch()) or row_form,
                             f"one token row (here {rows}; up to 4 with mhc_rows) in the row form of the boundary "
                             f"(mhc_row, mhc_grid_barrier, mhc_finish, mhc_sinkhorn_split on; hidden a multiple of "
                             f"128 up to 16,384): the other forms' logits are a wgmma, which {kernel_arch()} does not "
                             f"have")) if not ok]
  return kernel_enabled("mhc", fits=not unmet, why="needs " + ", ".join(unmet))


class MTPLayer(nnx.Module):
  """The MTP draft layer (checkpoint layer 45): eh_proj over [enorm(e), hnorm(h)], a plain pre-norm DSA + MoE
  block (no mHC), shared_head.norm; the trunk's embedding and lm_head are shared."""

  def __init__(self, cfg: Glm5Config, dtype, fp8_block):
    D = cfg.hidden_size
    self.eh_proj = Linear(2 * D, D, dtype, (None, None))
    self.enorm = RMSNorm(D, dtype, cfg.rms_norm_eps)
    self.hnorm = RMSNorm(D, dtype, cfg.rms_norm_eps)
    self.shared_head_norm = RMSNorm(D, dtype, cfg.rms_norm_eps)
    self.input_layernorm = RMSNorm(D, dtype, cfg.rms_norm_eps)
    self.post_attention_layernorm = RMSNorm(D, dtype, cfg.rms_norm_eps)
    self.self_attn = DSA(cfg, dtype, fp8_block)
    self.mlp = MoE(cfg, dtype, fp8_block)

  def __call__(self, h, e, cache, ctx: StepCtx, dtype, *, shared=None, extra_tail=0):
    """h [B, T, D] target hidden (post final norm), e [B, T, D] embedding of the next token (0 at position 0)
    -> (ĥ [B, T, D] post shared_head.norm: draft logits input and the next step's recycled hidden, cache, aux)."""
    z = jnp.concatenate([self.enorm(e, dtype), self.hnorm(h, dtype)], axis=-1)
    u = self.eh_proj(z, dtype)
    y, cache, aux = self.self_attn(self.input_layernorm(u, dtype), cache, ctx, dtype, shared=shared,
                                   extra_tail=extra_tail)
    u = u + y
    u = u + self.mlp(self.post_attention_layernorm(u, dtype), dtype)
    return self.shared_head_norm(u, dtype), cache, aux


class Glm5Model(nnx.Module):
  """Parameters of the whole text model (+ MTP layer). ``dtype`` is the compute dtype (float32 or bfloat16);
  FP8 checkpoints keep their FP8 matrices (``fp8_block`` set) and dequantise them where they are used."""

  def __init__(self, cfg: Glm5Config, dtype=jnp.float32, *, fp8: bool = False, mtp: bool | None = None):
    self.cfg = cfg
    self.dtype = jnp.dtype(dtype)
    fp8_block = cfg.fp8_block if fp8 else None
    V, D = cfg.vocab_size, cfg.hidden_size
    self.embed_tokens = param((V, D), dtype, (VOCAB, EMBED))
    self.layers = nnx.List([DecoderLayer(cfg, i, dtype, fp8_block) for i in range(cfg.num_hidden_layers)])
    self.norm = RMSNorm(D, dtype, cfg.rms_norm_eps)
    self.lm_head = param((V, D), dtype, (VOCAB, EMBED))
    use_mtp = cfg.has_mtp if mtp is None else mtp
    self.mtp = MTPLayer(cfg, dtype, fp8_block) if use_mtp else None

  # ------------------------------------------------------------------ vocabulary-parallel ends
  @jax.named_scope("embed")
  def embed(self, ids):
    """ids [...] int32 -> [..., D]: each shard looks up its vocabulary slice, one psum joins them."""
    tbl = self.embed_tokens[...]
    Vl = tbl.shape[0]
    local = ids - lax.axis_index(TP) * Vl
    ok = (local >= 0) & (local < Vl)
    e = jnp.where(ok[..., None], tbl[jnp.clip(local, 0, Vl - 1)], 0).astype(self.dtype)
    return lax.psum(e, TP)

  @jax.named_scope("lm_head")
  def local_logits(self, h):
    """h [..., D] -> this shard's logits [..., V/tp] in f32."""
    rows, (Vl, D) = h.size // h.shape[-1], self.lm_head.shape
    ok = self.lm_head.dtype == jnp.bfloat16 and D % 128 == 0 and Vl % 64 == 0
    why = f"bf16 lm_head with D % 128 == 0 and V/tp % 64 == 0 ({self.lm_head.dtype}, {D}, {Vl})"
    mma, ok, why = gemv_mma(Vl, ok, why)
    if kernel_enabled("bf16_linear", rows, fits=ok, why=why, prefer=rows > 1, prefer_why=ONE_ROW_GEMV):
      from pallas_kernels import linear as kl  # noqa: PLC0415
      return kl.bf16_linear(h.reshape(rows, D), self.lm_head[...], **mma, **part_rows(rows),
                            **balanced_splits()).reshape(*h.shape[:-1], Vl)
    return jnp.einsum("...d,vd->...v", h.astype(self.dtype), self.lm_head[...].astype(self.dtype),
                      precision=HIGHEST).astype(jnp.float32)

  def logits(self, h):
    """Full logits [..., V] (all-gathered over the vocabulary shards)."""
    return lax.all_gather(self.local_logits(h), TP, axis=h.ndim - 1, tiled=True)

  def argmax(self, h):
    """Greedy token ids [...] without gathering the logits: local max + a gather of (max, index) pairs.
    Ties resolve to the lowest vocabulary index, like jnp.argmax over the full logits."""
    lg = self.local_logits(h)
    Vl = lg.shape[-1]
    m = jnp.max(lg, axis=-1)
    a = jnp.argmax(lg, axis=-1).astype(jnp.int32) + lax.axis_index(TP) * Vl
    # one gather of (max, index) pairs; indices < 2^24 are exact in f32
    both = lax.all_gather(jnp.stack([m, a.astype(jnp.float32)]), TP, axis=0)  # [tp, 2, ...]
    best = jnp.argmax(both[:, 0], axis=0)
    return jnp.take_along_axis(both[:, 1], best[None], axis=0)[0].astype(jnp.int32)

  # ------------------------------------------------------------------ trunk
  def trunk(self, tokens, caches, ctx: StepCtx):
    """tokens [B, T] -> (h [B, T, D] after the final norm, new caches (list per layer), aux per layer)."""
    cfg = self.cfg
    e = self.embed(tokens)
    X = jnp.broadcast_to(e[:, :, None, :], (*e.shape[:2], cfg.hc_mult, e.shape[-1]))
    new, aux = [], []
    if fused_mhc(cfg, self.dtype, tokens.shape[0] * tokens.shape[1]):
      B, T = tokens.shape
      X2, pending = X.reshape(B * T, -1), None
      with counters_scope():  # (policy knobs mhc_barrier_counters, linear_fused_sum: the kernels' counters per step)
        for layer, cache in zip(self.layers, caches):
          X2, cache, a, pending = layer.call_fused(X2, pending, cache, ctx, self.dtype, (B, T))
          new.append(cache)
          aux.append(a)
      with jax.named_scope("mhc"):  # the last sublayer's post has no next site to fuse with
        post, comb = HyperConnection.unpack(pending[1], (B, T))
        X = HyperConnection.post(X2.reshape(X.shape), pending[0].reshape(B, T, -1), post, comb)
    else:
      for layer, cache in zip(self.layers, caches):
        X, cache, a = layer(X, cache, ctx, self.dtype)
        new.append(cache)
        aux.append(a)
    h = self.norm(jnp.mean(X.astype(jnp.float32), axis=2).astype(self.dtype), self.dtype)
    return h, new, aux

  @jax.named_scope("draft")
  def draft(self, h, next_ids, positions, cache, ctx: StepCtx, *, shared=None, extra_tail=0):
    """One MTP pass. h [B, T, D] hidden to recycle, next_ids [B, T] the token after each position,
    positions [B, T] (embedding zeroed at position 0) -> (ĥ [B, T, D], cache, aux)."""
    e = self.embed(next_ids)
    e = jnp.where((positions == 0)[..., None], jnp.zeros_like(e), e)
    with counters_scope():  # (linear_fused_sum: the pass's kernels write their sums as rows, on its own counters)
      return self.mtp(h, e, cache, ctx, self.dtype, shared=shared, extra_tail=extra_tail)
