"""Public API of the reference model: load, cache-free forward, and the cached prefill / continue path.

>>> model = glm5_jax.load_model("ckpt_dir", dtype="float32")          # tp=... or mesh=... for TP
>>> logits = glm5_jax.forward(model, tokens)                           # [B, S, V] f32, tokens [B, S] int32
>>> cache = glm5_jax.init_cache(model, batch=2, max_context=4096)
>>> logits, cache = glm5_jax.extend(model, cache, tokens, valid=lens)  # prefill / continue T tokens

Every computation runs inside ``jax.shard_map`` over the model's mesh (TP = 1 is a 1-device mesh), so the same
code is the TP1 and the TP4 program; collectives are the explicit psums of the layers.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from glm5_jax import checkpoint as ckpt
from glm5_jax import param_packing as pp
from glm5_jax import sharding as shd
from glm5_jax import state as st
from glm5_jax.attention import StepCtx
from glm5_jax.config import Glm5Config


@dataclasses.dataclass(frozen=True, eq=False)
class Model:
  """A loaded model: config, NNX graph definition, sharded parameters (nnx.State) and the mesh."""

  cfg: Glm5Config
  graphdef: Any
  params: Any
  mesh: Any
  dtype: Any
  fp8: bool
  mtp: bool

  @property
  def tp(self) -> int:
    return shd.tp_size(self.mesh)

  @functools.cached_property
  def graph_key(self) -> "GraphKey":
    """The graph definition as a dictionary key, hashed once (see GraphKey)."""
    return GraphKey(self.graphdef)

  @functools.cached_property
  def param_specs(self):
    return shd.param_specs(self.params)

  def module(self):
    """The NNX module (for inspection; the jitted paths merge it inside shard_map)."""
    return nnx.merge(self.graphdef, self.params)

  def shard_map(self, fn, in_specs, out_specs, *, pack: pp.PackLayout | None = None, lazy: bool = False):
    """jax.shard_map of fn(module, *args) over the mesh, params passed first with their specs. With ``pack`` the
    params come as two arguments instead, (big leaves, packed small leaves): see ``packed_params``. ``lazy``: fn
    gets a function that builds the module (unpacking the packed parameters where it is called) instead of the
    module — a loop over steps calls it inside its body, so that the packed slices fuse into their consumers
    there instead of being copied out once per call as loop operands (session 29: 503 copies per call)."""
    gd = self.graphdef

    def call(make, args):
      return fn(make, *args) if lazy else fn(make(), *args)

    if pack is None:
      def body(params, *args):
        return call(lambda: nnx.merge(gd, params), args)

      specs = (self.param_specs,)
    else:
      def body(big, packed, *args):
        return call(lambda: nnx.merge(gd, pp.unpack(big, packed, pack)), args)

      specs = pp.in_specs(pack)
    return jax.shard_map(body, mesh=self.mesh, in_specs=(*specs, *in_specs), out_specs=out_specs, check_vma=False)

  def pack_layout(self, max_bytes: int) -> pp.PackLayout:
    """Which parameters a packed step takes in one buffer per dtype: those with local shards < max_bytes. One
    object per threshold (it keys the step's compile cache by identity; built once, not per step)."""
    cache = self.__dict__.setdefault("_pack_layouts", {})
    if max_bytes not in cache:
      cache[max_bytes] = pp.layout(self.params, self.param_specs, self.tp, max_bytes)
    return cache[max_bytes]

  def packed_params(self, max_bytes: int):
    """(big leaves, {dtype: [tp, N]}) — the parameter arguments of a step built with pack=pack_layout(max_bytes);
    built once per threshold (the small leaves are copied: MBs)."""
    cache = self.__dict__.setdefault("_packed", {})
    if max_bytes not in cache:
      cache[max_bytes] = pp.pack(self.params, self.pack_layout(max_bytes), self.mesh)
    return cache[max_bytes]


def load_model(path, *, dtype=None, mesh=None, tp: int | None = None, progress: bool | None = None) -> Model:
  """Load a Hugging Face checkpoint directory (F32/BF16/FP8) or an orbax checkpoint saved by save_model.

  dtype: compute dtype ("float32" or "bfloat16"; default: the checkpoint's, bfloat16 for FP8 releases).
  mesh / tp: a 1-D ("tp",) mesh, or the number of devices to build one over (default 1)."""
  import os  # noqa: PLC0415

  if mesh is None:
    mesh = shd.make_mesh(tp)
  if os.path.exists(os.path.join(os.fspath(path), "glm5_config.json")):
    cfg, gd, params, meta = ckpt.restore_orbax(path, mesh=mesh)
  else:
    cfg, gd, params, meta = ckpt.load_params(os.fspath(path), dtype=dtype, mesh=mesh, progress=progress)
  return Model(cfg, gd, params, mesh, meta["dtype"], meta["fp8"], meta["mtp"])


def save_model(model: Model, directory) -> None:
  """Save params + config with orbax (restorable onto another mesh with load_model(directory, tp=...))."""
  ckpt.save_orbax(model, directory)


# ---------------------------------------------------------------------------------------------------- cache
@dataclasses.dataclass(frozen=True)
class Cache:
  """Caches of a batch of sequences. lengths [B]: committed tokens; n_acc [B]: the KDA state slot + 1."""

  caches: Any
  lengths: jax.Array
  n_acc: jax.Array
  max_context: int = 0
  q: int = 1


jax.tree_util.register_dataclass(Cache, data_fields=["caches", "lengths", "n_acc"], meta_fields=["max_context", "q"])


def _layout(model: Model, batch, max_context, q):
  return st.cache_layout(model.cfg, batch, max_context, q, model.dtype, mtp=model.mtp)


def init_cache(model: Model, batch: int, max_context: int, *, q: int = 1) -> Cache:
  """Empty caches for ``batch`` sequences of up to ``max_context`` tokens (a multiple of index_kpool)."""
  layout = _layout(model, batch, max_context, q)
  rep = NamedSharding(model.mesh, P())
  zeros = jax.device_put(jnp.zeros((batch,), jnp.int32), rep)
  return Cache(st.init_caches(layout, model.mesh), zeros, jax.device_put(jnp.ones((batch,), jnp.int32), rep),
               max_context, q)


def _check_tokens(model: Model, tokens, *, place: bool = True):
  """Validate token ids [B, T] -> int32 on the device (``place=False``: validated only, returned as given)."""
  tokens = np.asarray(tokens) if not isinstance(tokens, jax.Array) else tokens
  if tokens.ndim != 2:
    raise ValueError(f"tokens must be int32 [B, T]: got shape {tuple(tokens.shape)}")
  if not jnp.issubdtype(tokens.dtype, jnp.integer):
    raise TypeError(f"tokens must be integer token ids: got dtype {tokens.dtype}")
  if tokens.size and isinstance(tokens, np.ndarray):
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= model.cfg.vocab_size:
      bad = lo if lo < 0 else hi
      raise ValueError(f"token id {bad} is outside [0, {model.cfg.vocab_size}) (vocab_size)")
  if not place:
    return tokens
  if isinstance(tokens, np.ndarray):  # (converted on the host and copied: jnp.asarray compiles a conversion per
    return jax.device_put(tokens.astype(np.int32, copy=False))  # shape — one per prompt length in a prefill)
  return jnp.asarray(tokens, jnp.int32)


_FNS: dict = {}


class GraphKey:
  """An nnx GraphDef as a dictionary key whose hash is computed once. nnx hashes a GraphDef's whole node tree at
  every lookup — 7.3 ms for one TP4 rank's 45 layers + MTP on a CPU core (session 80) — and every decode call
  (without ``warmup``) and each prefill phase looked its jitted function up by it: host time the GPU waited for.
  Equal graph definitions are equal keys, so models of the same graph still share their compilations."""

  __slots__ = ("graphdef", "_hash")

  def __init__(self, graphdef):
    self.graphdef, self._hash = graphdef, hash(graphdef)

  def __hash__(self):
    return self._hash

  def __eq__(self, other):
    return isinstance(other, GraphKey) and (self.graphdef is other.graphdef or (
        self._hash == other._hash and self.graphdef == other.graphdef))


def compiled(model: Model, key, build):
  """One jitted function per (architecture, mesh, key): models of the same graph share compilations."""
  full = (model.graph_key, model.mesh, key)
  if full not in _FNS:
    _FNS[full] = build()
  return _FNS[full]


def _extend_fn(model: Model, layout_key, T: int, want: str):
  return compiled(model, ("extend", layout_key, T, want), lambda: _build_extend(model, layout_key, want))


def _build_extend(model: Model, layout_key, want: str):
  batch, max_context, q = layout_key
  layout = _layout(model, batch, max_context, q)
  cspecs = st.cache_specs(layout)

  def fn(m, caches, tokens, start, valid, n_acc):
    ctx = StepCtx(start, valid, n_acc, mode="extend")
    h, new, aux = m.trunk(tokens, caches["layers"], ctx)
    out = {"logits": m.logits(h)} if want == "all" else {"logits": m.logits(
        jnp.take_along_axis(h, (valid - 1)[:, None, None], axis=1))[:, 0]}
    if want == "all":
      out["hidden"] = h
      out["aux"] = aux
    return out, {"layers": new, "mtp": caches["mtp"]}

  rep = P()
  aux_specs = None
  if want == "all":
    aux_specs = [({"idx": rep} if not t else {}) | ({"experts": rep} if s else {})
                 for t, s in zip((tt == "linear_attention" for tt in model.cfg.layer_types),
                                 (mm == "sparse" for mm in model.cfg.mlp_layer_types))]
  out_specs = ({"logits": rep, "hidden": rep, "aux": aux_specs} if want == "all" else {"logits": rep}, cspecs)
  sm = model.shard_map(fn, (cspecs, rep, rep, rep, rep), out_specs)
  return jax.jit(sm, donate_argnums=(1,))


def extend(model: Model, cache: Cache, tokens, *, valid=None, return_all: bool = True):
  """Append T tokens per sequence (``valid[b]`` ≤ T of them real; default all) -> (logits, new cache).

  logits: [B, T, V] f32 for every new token (return_all) or [B, V] for the last real token. The caller's cache is
  donated: use the returned one."""
  tokens = _check_tokens(model, tokens)
  B, T = tokens.shape
  valid = jnp.full((B,), T, jnp.int32) if valid is None else jnp.asarray(valid, jnp.int32)
  ends = np.asarray(cache.lengths) + np.asarray(valid)
  if ends.max(initial=0) > cache.max_context:
    raise ValueError(f"extending to {int(ends.max())} tokens passes max_context={cache.max_context}")
  fn = _extend_fn(model, (B, cache.max_context, cache.q), T, "all" if return_all else "last")
  out, caches = fn(model.params, cache.caches, tokens, cache.lengths, valid, cache.n_acc)
  new = Cache(caches, cache.lengths + valid, jnp.ones_like(cache.n_acc), cache.max_context, cache.q)
  return (out if return_all else out["logits"]), new


def forward(model: Model, tokens, *, return_aux: bool = False):
  """Cache-free forward: int32 tokens [B, S] -> float32 logits [B, S, V] (and aux when asked: final hidden,
  indexer selections per DSA layer [B, S, W], router choices per MoE layer [B, S, k])."""
  tokens = _check_tokens(model, tokens)
  B, S = tokens.shape
  kp = model.cfg.index_kpool
  cache = init_cache(model, B, kp * (-(-S // kp)))
  out, _ = extend(model, cache, tokens)
  if return_aux:
    return out["logits"], {"hidden": out["hidden"], "layers": out["aux"]}
  return out["logits"]


def enable_compile_cache(directory, *, min_compile_s: float = 1.0) -> str:
  """Keep compiled programs on disk in ``directory`` (JAX's persistent compilation cache): a later process that
  builds the same program — the same model geometry, DecodeConfig, backend, policy and jax version — loads it
  instead of compiling again (the real-geometry decode step of one TP4 rank compiles for 100–200 s on an H200).
  Programs that compiled in under ``min_compile_s`` are not written. Returns the directory's absolute path.

  The cache is trusted code: anyone who can write to ``directory`` can run code in processes that read it, so
  keep it private. Also set by the CLI's ``--compile-cache DIR`` and the ``GLM5_JAX_COMPILE_CACHE``
  environment variable."""
  import os  # noqa: PLC0415
  from jax.experimental.compilation_cache import compilation_cache as cc  # noqa: PLC0415

  if min_compile_s < 0:
    raise ValueError(f"min_compile_s = {min_compile_s}, expected >= 0 seconds")
  path = os.path.abspath(os.fspath(directory))
  if os.path.exists(path) and not os.path.isdir(path):
    raise ValueError(f"compile cache {path!r} exists and is not a directory")
  os.makedirs(path, exist_ok=True)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_s))
  cc.reset_cache()  # JAX decides once per process whether the cache is on: decide again with the new directory
  cc.set_cache_dir(path)
  return path
