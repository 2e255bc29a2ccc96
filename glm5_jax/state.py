"""Caches of the decode: shapes, dtypes and logical axes, declared once.

Per KDA layer (sharded by head):
  conv  [B, Wc, 3, C]    the raw q|k|v projections (short-conv inputs) by position mod Wc = (conv_kernel − 1)
                          + q: a ring holding the conv history and a step's q new inputs (rollback-free: see
                          attention._conv_history / _conv_ring_write)
  ssm   [B, Q, H, K, V]  fp32 recurrent state, one slot per verify position (Q = q)
Per DSA layer and for the MTP layer (replicated on every rank):
  latent [B, S, R]        MLA latent per position in the compute dtype; with an FP8 KV cache (the
                          latency_specialized default) latent8 [B, S, 160] int32: one row per position of R = 512
                          e4m3 bytes packed 4 per word, the R/128 f32 scales' bits, zero padding to 640 bytes
                          (pallas_kernels.sparse_mla.quantize_latent: one TMA gather per selected position)
  pool   [B, P, Di]       pooled indexer keys by pool index, P = S/kpool rounded up to a multiple of POOL_ALIGN
                          (slots past S/kpool are never complete: masked like any pool not yet full); FP8: pool8
                          (Hadamard-rotated e4m3) + pool_scale [B, P] (power-of-two scales, vLLM's numerics)
  ring   [B, Rg, 2, Di]   raw indexer keys (entry 0) and gate scores (entry 1) of the open pool by position
                          mod Rg (Rg = kpool·⌈(kpool − 1 + q)/kpool⌉ keeps every position a step can touch
                          distinct); one array: one gather and one scatter per step instead of two each
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from glm5_jax.config import KDA as KDA_TYPE, Glm5Config
from glm5_jax.layers import KDA_H, KDA_HD
from glm5_jax.sharding import logical_to_spec, shardings


# The indexer scores kernel reads the pooled keys in blocks of 64 (pallas_kernels.indexer.BLOCK); a pool count
# that is a multiple of it spares the kernel a padded copy of the whole pooled-key cache per layer and step (~1 MB
# and 2.3 + 1.4 µs at 32K context on the H200, BENCHMARKS.md session 21).
POOL_ALIGN = 64


def pool_slots(cfg: Glm5Config, S: int) -> int:
  """Pool slots of a cache of S positions: S / kpool rounded up to a multiple of POOL_ALIGN."""
  return -(-(S // cfg.index_kpool) // POOL_ALIGN) * POOL_ALIGN


def ring_size(cfg: Glm5Config, q: int) -> int:
  kp = cfg.index_kpool
  return kp * (-(-(kp - 1 + q) // kp))


def _dsa_cache(cfg: Glm5Config, B, S, q, dtype, kv_fp8):
  R, Di, P = cfg.kv_lora_rank, cfg.index_head_dim, pool_slots(cfg, S)
  Rg = ring_size(cfg, q)
  rep3 = (None, None, None)
  ring = {"ring": (jax.ShapeDtypeStruct((B, Rg, 2, Di), dtype), (None, None, None, None))}
  if not kv_fp8:
    return {"latent": (jax.ShapeDtypeStruct((B, S, R), dtype), rep3),
            "pool": (jax.ShapeDtypeStruct((B, P, Di), dtype), rep3), **ring}
  from pallas_kernels.sparse_mla import D_LATENT, ROW_WORDS  # noqa: PLC0415 (the row format, declared there)
  if R != D_LATENT or Di != 128:
    raise ValueError(f"an FP8 KV cache needs kv_lora_rank == {D_LATENT} (the sparse MLA kernel's cache rows) and "
                     f"index_head_dim == 128: got {R}, {Di}")
  return {"latent8": (jax.ShapeDtypeStruct((B, S, ROW_WORDS), jnp.int32), rep3),
          "pool8": (jax.ShapeDtypeStruct((B, P, Di), jnp.float8_e4m3fn), rep3),
          "pool_scale": (jax.ShapeDtypeStruct((B, P), jnp.float32), (None, None)), **ring}


def cache_layout(cfg: Glm5Config, batch: int, max_context: int, q: int, dtype, *, mtp: bool, kv_fp8: bool = False):
  """-> {"layers": [per-layer {name: (ShapeDtypeStruct, logical axes)}], "mtp": {...} | None}."""
  if max_context % cfg.index_kpool:
    raise ValueError(f"max_context={max_context} must be a multiple of index_kpool={cfg.index_kpool}")
  Kc, H, Kd = cfg.linear_conv_kernel_dim, cfg.linear_num_heads, cfg.linear_head_dim
  layers = []
  for t in cfg.layer_types:
    if t == KDA_TYPE:
      layers.append({
          "conv": (jax.ShapeDtypeStruct((batch, Kc - 1 + q, 3, H * Kd), dtype), (None, None, None, KDA_HD)),
          "ssm": (jax.ShapeDtypeStruct((batch, q, H, Kd, Kd), jnp.float32), (None, None, KDA_H, None, None)),
      })
    else:
      layers.append(_dsa_cache(cfg, batch, max_context, q, dtype, kv_fp8))
  return {"layers": layers, "mtp": _dsa_cache(cfg, batch, max_context, q, dtype, kv_fp8) if mtp else None}


def _is_entry(x):
  return isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], jax.ShapeDtypeStruct)


def cache_specs(layout):
  return jax.tree.map(lambda e: logical_to_spec(e[1]), layout, is_leaf=_is_entry)


def cache_shapes(layout):
  return jax.tree.map(lambda e: e[0], layout, is_leaf=_is_entry)


def cache_bytes_per_device(layout, tp: int) -> int:
  total = 0
  for sds, axes in jax.tree.leaves(layout, is_leaf=_is_entry):
    n = 1
    for s in sds.shape:
      n *= s
    split = tp if any(logical_to_spec(axes)) else 1
    total += n * jnp.dtype(sds.dtype).itemsize // split
  return total


def abstract_caches(layout, mesh):
  """ShapeDtypeStructs of the caches carrying their shardings (for AOT compilation and lowering)."""
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), cache_shapes(layout),
                      shardings(cache_specs(layout), mesh))


_ZEROS: dict = {}


def init_caches(layout, mesh):
  """Zero caches placed with their shardings (jitted so each device allocates only its shard; one program per
  layout and mesh, kept: a function made per call was traced and compiled again for every prefill)."""
  shapes = cache_shapes(layout)
  leaves, treedef = jax.tree.flatten(shapes)
  specs = jax.tree.leaves(cache_specs(layout), is_leaf=lambda x: isinstance(x, P))
  key = (treedef, tuple((s.shape, jnp.dtype(s.dtype).name) for s in leaves), tuple(specs), mesh)
  if key not in _ZEROS:
    _ZEROS[key] = jax.jit(lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes),
                          out_shardings=shardings(cache_specs(layout), mesh))
  return _ZEROS[key]()
