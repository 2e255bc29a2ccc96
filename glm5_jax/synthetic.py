"""Random models and decode states made directly on the devices, for benchmarks at the real geometry.

Nothing here is zero: weights are drawn like the tiny checkpoints' (N(0, 1/√fan_in), norms ≈ 1, FP8 blocks with
a realistic scale), caches hold random latents / pooled keys / KDA states, so timings see real data.
``tp_rank_config`` gives the exact share of one rank of a TP-n deployment as a TP1 geometry (heads, expert and
MLP widths and the vocabulary divided by n; replicated parts kept whole) — the way to time one TP4 rank on one
GPU (without its all-reduces).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from glm5_jax import sharding as shd
from glm5_jax import state as st
from glm5_jax.api import Model
from glm5_jax.config import Glm5Config
from glm5_jax.model import Glm5Model


def tp_rank_config(cfg: Glm5Config, tp: int) -> Glm5Config:
  """The geometry one rank of a TP-``tp`` deployment computes, as a TP1 config."""
  return cfg.replace(linear_num_heads=cfg.linear_num_heads // tp, num_attention_heads=cfg.num_attention_heads // tp,
                     num_key_value_heads=cfg.num_key_value_heads // tp, intermediate_size=cfg.intermediate_size // tp,
                     moe_intermediate_size=cfg.moe_intermediate_size // tp, vocab_size=cfg.vocab_size // tp)


@functools.cache
def _gen(shape, dtype, kind, sharding):
  dtype = jnp.dtype(dtype)

  def f(key):
    if kind == "norm":
      return jax.random.uniform(key, shape, jnp.float32, 0.6, 1.4).astype(dtype)
    if kind == "scale":  # FP8 block scales: |W| ~ 1/sqrt(fan_in) after dequantisation
      return jax.random.uniform(key, shape, jnp.float32, 0.5, 1.5) / (448.0 * 8.0)
    if kind == "fp8":
      return jnp.clip(jax.random.normal(key, shape, jnp.float32) * 112.0, -448, 448).astype(dtype)
    if kind == "router_bias":
      # the router's load-balancing bias: trained to keep expert load even, so its spread is small next to the
      # sigmoid scores' (~0.2). At N(0, 0.5) (session 24 and before) the bias chose the experts: 32 tokens
      # reached ~36 distinct experts instead of ~170, and B > 1 MoE timings were optimistic
      return (jax.random.normal(key, shape, jnp.float32) * 0.01).astype(dtype)
    if kind == "neg":  # A_log / dt_bias style
      return (jax.random.normal(key, shape, jnp.float32) * 0.5).astype(dtype)
    if kind in ("cache", "kda_state"):  # decode-state leaves; KDA states kept in a realistic range
      return (jax.random.normal(key, shape, jnp.float32) * (0.05 if kind == "kda_state" else 1.0)).astype(dtype)
    if kind == "latent_rows":  # FP8 latent cache rows (e4m3 bytes + scales): random latents quantised
      from pallas_kernels import sparse_mla as ks  # noqa: PLC0415
      return ks.quantize_latent(jax.random.normal(key, (*shape[:-1], ks.D_LATENT)))
    fan_in = shape[-1] if len(shape) >= 2 else 1
    return (jax.random.normal(key, shape, jnp.float32) / math.sqrt(fan_in)).astype(dtype)

  return jax.jit(f, out_shardings=sharding)


def random_model(cfg: Glm5Config, *, dtype=jnp.bfloat16, fp8: bool = True, mesh=None, seed: int = 0,
                 mtp: bool = True) -> Model:
  """A Model with random parameters placed straight into their shards (no host copy)."""
  mesh = shd.make_mesh(1) if mesh is None else mesh
  abstract = nnx.eval_shape(lambda: Glm5Model(cfg, dtype, fp8=fp8, mtp=mtp))
  graphdef, astate = nnx.split(abstract)
  shd.check_divisible(astate, mesh, cfg.fp8_block if fp8 else None)
  key = jax.random.key(seed)
  for i, (path, var) in enumerate(nnx.to_flat_state(astate)):
    aval = var.get_value()
    name = ".".join(map(str, path))
    if jnp.dtype(aval.dtype) == jnp.float8_e4m3fn:
      kind = "fp8"
    elif path[-1] in ("scale", "gate_scale", "up_scale", "down_scale") and len(aval.shape) >= 2:
      kind = "scale"
    elif "norm" in name or path[-1] in ("k_norm_weight",):
      kind = "norm"
    elif path[-1] == "e_score_correction_bias":
      kind = "router_bias"
    elif path[-1] in ("A_log", "dt_bias", "base_scale", "k_norm_bias",
                      "index_kpool_compress_ape") or (path[-1] == "scale" and len(aval.shape) == 1):
      kind = "neg"
    else:
      kind = "dense"
    sharding = NamedSharding(mesh, shd.logical_to_spec(var.get_metadata()["axes"]))
    var.set_value(_gen(tuple(aval.shape), str(jnp.dtype(aval.dtype)), kind, sharding)(jax.random.fold_in(key, i)))
  return Model(cfg, graphdef, astate, mesh, jnp.dtype(dtype), fp8, mtp)


def abstract_model(cfg: Glm5Config, *, dtype=jnp.bfloat16, fp8: bool = True, mesh=None, mtp: bool = True):
  """(Model with abstract parameters, their ShapeDtypeStructs with shardings): enough to trace or lower a step
  at any geometry without allocating a byte (the deployment check's kernel sites, the lowering tests)."""
  mesh = shd.make_mesh(1) if mesh is None else mesh
  graphdef, astate = nnx.split(nnx.eval_shape(lambda: Glm5Model(cfg, dtype, fp8=fp8, mtp=mtp)))
  params = jax.tree.map(
      lambda v, s: jax.ShapeDtypeStruct(v.get_value().shape, v.get_value().dtype, sharding=NamedSharding(mesh, s)),
      astate, shd.param_specs(astate), is_leaf=lambda x: isinstance(x, nnx.Variable))
  return Model(cfg, graphdef, astate, mesh, jnp.dtype(dtype), fp8, mtp), params


def random_caches(layout, mesh, key):
  """Random decode caches of ``layout`` (state.cache_layout's) placed with their shardings: latents, pooled keys,
  tails, KDA states (in a realistic range) and conv windows, FP8 latent rows quantised from random latents."""
  shapes, specs = st.cache_shapes(layout), st.cache_specs(layout)
  leaves, treedef = jax.tree.flatten(shapes)
  spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
  out = []
  for i, (s, sp) in enumerate(zip(leaves, spec_leaves)):
    kind = "kda_state" if len(s.shape) == 5 else "cache"
    if jnp.dtype(s.dtype) == jnp.int32:
      from pallas_kernels import sparse_mla as ks  # noqa: PLC0415
      if s.shape[-1] != ks.ROW_WORDS:
        raise ValueError(f"random_caches: an int32 cache leaf {s.shape}; only FP8 latent rows [.., {ks.ROW_WORDS}] "
                         "are known")
      kind = "latent_rows"
    # one compiled generator per distinct leaf (6 at the real geometry, shared by every call): a jit per leaf
    # (116 of them) was 116 compiles per state (24.8 -> 4.4 s on a 2-core CPU; on the H200 estimated at tens of s)
    out.append(_gen(tuple(s.shape), str(jnp.dtype(s.dtype)), kind, NamedSharding(mesh, sp))(
        jax.random.fold_in(key, i)))
  return jax.tree.unflatten(treedef, out)


def random_state(decoder, batch: int, context: int, *, seed: int = 0):
  """A DecodeState of ``batch`` active sequences at length ``context`` with random caches (``random_caches``) and
  random next tokens — what a long-running decode looks like."""
  from glm5_jax.speculative import DecodeState  # noqa: PLC0415

  model, cfg = decoder.model, decoder.config
  if context + cfg.q > cfg.max_context:
    raise ValueError(f"context={context} + q={cfg.q} exceeds max_context={cfg.max_context}")
  caches = random_caches(decoder.layout(batch), model.mesh, jax.random.key(seed + 1))
  rng = np.random.default_rng(seed)
  keys = np.stack([np.asarray(jax.random.key_data(jax.random.key(int(s)))) for s in rng.integers(0, 2**31, batch)])
  return DecodeState.make(caches, np.full(batch, context, np.int32), np.ones(batch, np.int32), keys,
                          np.ones(batch, bool), rng.integers(0, model.cfg.vocab_size, (batch, cfg.q)).astype(np.int32),
                          decoder, context)
