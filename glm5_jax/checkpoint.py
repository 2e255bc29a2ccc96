"""Hugging Face checkpoint loading (F32 / BF16 / FP8 E4M3 + 128×128 ``weight_scale_inv``) and orbax save/restore.

The loader reads the real release layout: ``config.json``; ``model.safetensors`` or ``*.safetensors`` shards
with ``model.safetensors.index.json``; keys under ``model.language_model.layers.N.``; the vision tower
(``model.visual.*``) is ignored; layer ``num_hidden_layers`` (45) is the MTP draft layer. Tensors are read
tensor by tensor from memory maps straight into their device shards (each device reads only its slice), so
the model is never held twice in host memory. FP8 matrices stay FP8 with their fp32 block scales.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from glm5_jax import sharding as shd
from glm5_jax.config import Glm5Config
from glm5_jax.model import Glm5Model


class CheckpointError(ValueError):
  """A checkpoint that does not match the model: names the tensor, what it is and what was expected."""


_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
_FLOATS = ("F64", "F32", "F16", "BF16")


@dataclasses.dataclass
class _Entry:
  file: str
  dtype: str
  shape: tuple[int, ...]
  start: int
  end: int


class SafetensorsIndex:
  """Header-only index of a checkpoint's tensors; arrays come from memory maps on demand (F8 included,
  which the safetensors numpy reader cannot do)."""

  def __init__(self, directory: str):
    self.dir = directory
    idx = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(idx):
      with open(idx) as f:
        weight_map = json.load(f)["weight_map"]
      files = sorted(set(weight_map.values()))
    else:
      files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
      if not files:
        raise FileNotFoundError(f"{directory!r} has no *.safetensors file and no model.safetensors.index.json")
      weight_map = None
    self.entries: dict[str, _Entry] = {}
    self._maps: dict[str, np.memmap] = {}
    for fn in files:
      path = os.path.join(directory, fn)
      if not os.path.exists(path):
        raise CheckpointError(f"model.safetensors.index.json names {fn!r} but {path!r} does not exist")
      size = os.path.getsize(path)
      with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
          raise CheckpointError(f"{path!r} is truncated: {size} bytes, no safetensors header")
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
          raise CheckpointError(f"{path!r} is truncated: header of {n} bytes but the file has {size}")
        header = json.loads(f.read(n))
      base = 8 + n
      for name, info in header.items():
        if name == "__metadata__":
          continue
        s, e = info["data_offsets"]
        if base + e > size:
          raise CheckpointError(f"{path!r} is truncated: tensor {name!r} ends at byte {base + e} of {size}")
        if info["dtype"] not in _DTYPES:
          raise CheckpointError(f"tensor {name!r} has dtype {info['dtype']}: expected one of {sorted(_DTYPES)}")
        if weight_map is not None and weight_map.get(name, fn) != fn:
          continue
        self.entries[name] = _Entry(path, info["dtype"], tuple(info["shape"]), base + s, base + e)

  def __contains__(self, name):
    return name in self.entries

  def array(self, name) -> np.ndarray:
    """A read-only memory-mapped numpy view of the tensor (no copy)."""
    e = self.entries[name]
    if e.file not in self._maps:
      self._maps[e.file] = np.memmap(e.file, np.uint8, mode="r")
    dt = _DTYPES[e.dtype]
    return self._maps[e.file][e.start:e.end].view(dt).reshape(e.shape)


# ---------------------------------------------------------------------------------------------------- names
def hf_names(path, cfg: Glm5Config) -> tuple[str, str | None]:
  """Parameter path in Glm5Model -> (checkpoint name pattern, marker). Experts ('expert') use '{e}' in the name,
  stacked linears ('stack:NAME': StackedLinear, one matrix of STACKS[NAME] per entry of the leading axis; or
  'blockdiag:NAME': entry s holds matrix s of BLOCKDIAGS[NAME] in its s-th block of input columns, zeros
  elsewhere) and concatenated ones ('concat:NAME': ConcatLinear, the rows of the matrices CONCATS[NAME] one after
  another) '{s}'."""
  p = [str(x) for x in path]
  if p == ["embed_tokens"]:
    return "model.language_model.embed_tokens.weight", None
  if p == ["lm_head"]:
    return "lm_head.weight", None
  if p[:1] == ["norm"]:
    return "model.language_model.norm.weight", None
  if p[0] == "layers":
    prefix, rest = f"model.language_model.layers.{p[1]}.", p[2:]
  elif p[0] == "mtp":
    prefix, rest = f"model.language_model.layers.{cfg.mtp_layer}.", p[1:]
  else:
    raise AssertionError(path)
  if rest[0] in ("attn_hc", "ffn_hc"):
    if rest[1] in CONCATS:  # base_scale: hc_*_base then hc_*_scale
      return prefix + f"hc_{rest[0][:-3]}_" + "{s}", "concat:" + rest[1]
    return prefix + f"hc_{rest[0][:-3]}_{rest[1]}", None
  if rest == ["shared_head_norm", "weight"]:
    return prefix + "shared_head.norm.weight", None
  if rest[-1] in ("k_norm_weight", "k_norm_bias"):
    return prefix + ".".join(rest[:-1] + ["k_norm", rest[-1][7:]]), None
  if rest[-1] in ("q_conv1d", "k_conv1d", "v_conv1d"):
    return prefix + ".".join(rest) + ".weight", None
  if len(rest) >= 2 and rest[-2] in STACKS and rest[-1] == "weight":  # layers.StackedLinear
    return prefix + ".".join(rest[:-2]) + ".{s}", "stack:" + rest[-2]
  if len(rest) >= 2 and rest[-2] in BLOCKDIAGS and rest[-1] == "weight":  # layers.StackedLinear, block-diagonal
    return prefix + ".".join(rest[:-2]) + ".{s}", "blockdiag:" + rest[-2]
  if len(rest) >= 2 and rest[-2] in CONCATS and rest[-1] in ("weight", "scale"):  # layers.ConcatLinear
    suffix = "_scale_inv" if rest[-1] == "scale" else ""  # FP8: the block scales' rows concatenate likewise
    return prefix + ".".join(rest[:-2]) + ".{s}" + suffix, "concat:" + rest[-2]
  if len(rest) >= 2 and rest[-2] == "experts":  # stacked routed experts
    leaf = rest[-1]
    mat = leaf.replace("_scale", "_proj")
    suffix = "weight_scale_inv" if leaf.endswith("_scale") else "weight"
    return prefix + ".".join(rest[:-1]) + ".{e}." + f"{mat}.{suffix}", "expert"
  if rest[-1] == "scale" and rest[-2] not in ("attn_hc", "ffn_hc"):
    return prefix + ".".join(rest[:-1]) + ".weight_scale_inv", None
  return prefix + ".".join(rest), None


# StackedLinear / ConcatLinear weights: the checkpoint matrices they hold (as entries / as rows), in order
STACKS = {"qkv_proj": ("q_proj.weight", "k_proj.weight", "v_proj.weight")}
# StackedLinear whose entry s holds matrix s in input columns s·in.. (zeros elsewhere): S matrices on S inputs
BLOCKDIAGS = {"fg_b_proj": ("f_b_proj.weight", "g_b_proj.weight")}
CONCATS = {"fgb_a_proj": ("f_a_proj.weight", "g_a_proj.weight", "b_proj.weight"),
           "x_proj": ("wk.weight", "index_kpool_compress_gate", "weights_proj.weight"),
           "qkv_a_proj": ("q_a_proj.weight", "kv_a_proj_with_mqa.weight"),
           "base_scale": ("base", "scale")}  # layers.HyperConnection (vectors, concatenated the same way)


def _convert(x: np.ndarray, dtype) -> np.ndarray:
  dtype = np.dtype(dtype)
  return x if x.dtype == dtype else x.astype(dtype)


def _dequant_np(w8: np.ndarray, s: np.ndarray, block) -> np.ndarray:
  r, c = w8.shape[-2:]
  full = np.repeat(np.repeat(s, block[0], axis=-2), block[1], axis=-1)[..., :r, :c]
  return w8.astype(np.float32) * full


# ---------------------------------------------------------------------------------------------------- load
def load_params(path: str, *, dtype=None, mesh=None, progress: bool | None = None):
  """Read a Hugging Face checkpoint directory -> (cfg, graphdef, params (sharded nnx.State), meta)."""
  if not os.path.isdir(path):
    raise FileNotFoundError(f"checkpoint directory {path!r} does not exist")
  cfg = Glm5Config.from_json(path)
  index = SafetensorsIndex(path)
  has_scales = any(n.endswith("weight_scale_inv") for n in index.entries)
  if has_scales and cfg.fp8_block is None:
    raise CheckpointError(f"{path!r} holds weight_scale_inv tensors but config.json has no fp8 quantization_config")
  fp8 = cfg.fp8_block is not None and has_scales
  mtp_key = f"model.language_model.layers.{cfg.num_hidden_layers}.eh_proj.weight"
  has_mtp = mtp_key in index
  if has_mtp != cfg.has_mtp:
    cfg = cfg.replace(num_nextn_predict_layers=int(has_mtp))
  if dtype is None:
    with open(os.path.join(path, "config.json")) as f:
      raw = json.load(f)
    dtype = raw.get("dtype") or raw.get("torch_dtype") or raw.get("text_config", {}).get("dtype") or "bfloat16"
    dtype = "bfloat16" if fp8 else dtype
  dtype = jnp.dtype(dtype)
  if dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
    raise ValueError(f"dtype={dtype} is not supported: expected float32 or bfloat16")
  mesh = shd.make_mesh(1) if mesh is None else mesh
  abstract = nnx.eval_shape(lambda: Glm5Model(cfg, dtype, fp8=fp8, mtp=has_mtp))
  graphdef, astate = nnx.split(abstract)
  shd.check_divisible(astate, mesh, cfg.fp8_block if fp8 else None)
  flat = list(nnx.to_flat_state(astate))
  used: set[str] = set()
  total = sum(math.prod(v.get_value().shape) * v.get_value().dtype.itemsize for _, v in flat)
  if progress is None:
    progress = total > (1 << 30)
  bar = None
  if progress:
    from tqdm.auto import tqdm  # noqa: PLC0415
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="loading")
  new_leaves = {}
  for p, var in flat:
    aval = var.get_value()
    name, kind = hf_names(p, cfg)
    spec = shd.logical_to_spec(var.get_metadata()["axes"])
    sharding = NamedSharding(mesh, spec)
    stack = kind is not None and kind.startswith("stack:")
    if kind == "expert" or stack:  # one checkpoint matrix per entry of the leading axis
      names = ([name.format(s=s) for s in STACKS[kind[6:]]] if stack
               else [name.format(e=e) for e in range(aval.shape[0])])
      srcs = [_source(index, nm, aval.shape[1:], aval.dtype, cfg) for nm in names]
      used.update(names)
      if stack:  # (FP8 matrices the model keeps unquantised were dequantised with their scales)
        used.update(nm + "_scale_inv" for nm in names if nm + "_scale_inv" in index)

      def cb(idx, srcs=srcs, dt=aval.dtype):
        es = range(*idx[0].indices(len(srcs)))
        return np.stack([_convert(srcs[e](idx[1:]), dt) for e in es])
    elif kind and kind.startswith("blockdiag:"):
      names = [name.format(s=s) for s in BLOCKDIAGS[kind[10:]]]
      S, n_in = aval.shape[0], aval.shape[2] // aval.shape[0]
      srcs = [_source(index, nm, (aval.shape[1], n_in), aval.dtype, cfg) for nm in names]
      used.update(names)
      used.update(nm + "_scale_inv" for nm in names if nm + "_scale_inv" in index)

      def cb(idx, srcs=srcs, dt=aval.dtype, S=S, n_in=n_in):
        rows = (idx[1], slice(None))
        out = []
        for e in range(*idx[0].indices(S)):
          m = _convert(srcs[e](rows), dt)
          full = np.zeros((m.shape[0], S * n_in), dt)
          full[:, e * n_in:(e + 1) * n_in] = m
          out.append(full[:, idx[2]])
        return np.stack(out)
    elif kind and kind.startswith("concat:"):
      names = [name.format(s=s) for s in CONCATS[kind[7:]]]
      whole_w = f"stored as one weight {list(aval.shape)} of the model"
      for nm in names:
        if nm not in index:
          raise CheckpointError(f"missing tensor {nm!r}: expected [{', '.join(['rows', *map(str, aval.shape[1:])])}], "
                                f"one of {names} {whole_w}")
      rows = [index.entries[nm].shape[0] for nm in names]
      if sum(rows) != aval.shape[0]:
        raise CheckpointError(f"tensors {names} have {rows} rows, {sum(rows)} in all: expected {aval.shape[0]} "
                              f"({whole_w})")
      srcs = [_source(index, nm, (r, *aval.shape[1:]), aval.dtype, cfg) for nm, r in zip(names, rows)]
      used.update(names)
      used.update(nm + "_scale_inv" for nm in names if nm + "_scale_inv" in index)

      def cb(idx, srcs=srcs, dt=aval.dtype):
        whole = (slice(None),) + tuple(idx[1:])
        return np.concatenate([_convert(s(whole), dt) for s in srcs])[idx[0]]
    else:
      src = _source(index, name, aval.shape, aval.dtype, cfg)
      used.add(name)
      if name + "_scale_inv" in index and jnp.dtype(aval.dtype) != jnp.float8_e4m3fn:
        used.add(name + "_scale_inv")

      def cb(idx, src=src, dt=aval.dtype):
        return _convert(src(idx), dt)
    arr = jax.make_array_from_callback(aval.shape, sharding, cb)
    new_leaves[p] = arr
    if bar is not None:
      bar.update(math.prod(aval.shape) * aval.dtype.itemsize)
  if bar is not None:
    bar.close()
  unexpected = sorted(n for n in index.entries if n not in used and not n.startswith("model.visual."))
  if unexpected:
    more = f" (and {len(unexpected) - 5} more)" if len(unexpected) > 5 else ""
    raise CheckpointError(f"unexpected tensors in {path!r}: {unexpected[:5]}{more}: not part of the "
                          f"{cfg.num_hidden_layers}-layer model described by config.json")
  for p, var in flat:  # the flat view shares the Variables of astate: fill them in place
    var.set_value(new_leaves[p])
  return cfg, graphdef, astate, {"fp8": fp8, "mtp": has_mtp, "dtype": dtype, "mesh": mesh}


def _source(index: SafetensorsIndex, name: str, shape, dtype, cfg: Glm5Config):
  """A function idx -> numpy slice of the named tensor, checked against the expected shape and dtype."""
  if name not in index:
    raise CheckpointError(f"missing tensor {name!r}: expected shape {list(shape)} ({np.dtype(dtype).name})")
  e = index.entries[name]
  if tuple(e.shape) != tuple(shape):
    raise CheckpointError(f"tensor {name!r} has shape {list(e.shape)}: expected {list(shape)}")
  want_fp8 = np.dtype(dtype) == np.dtype(ml_dtypes.float8_e4m3fn)
  scale_name = name.replace(".weight", ".weight_scale_inv") if name.endswith(".weight") else None
  if want_fp8:
    if e.dtype != "F8_E4M3":
      raise CheckpointError(f"tensor {name!r} has dtype {e.dtype}: expected F8_E4M3 (the FP8 release set)")
    return lambda idx: index.array(name)[idx]
  if e.dtype == "F8_E4M3":  # an FP8 matrix the model keeps unquantised: dequantise at load
    if scale_name is None or scale_name not in index:
      raise CheckpointError(f"FP8 tensor {name!r} has no {scale_name!r} block scale")
    blk = cfg.fp8_block or (128, 128)
    return lambda idx: _dequant_np(np.asarray(index.array(name)), np.asarray(index.array(scale_name)), blk)[idx]
  if e.dtype not in _FLOATS:
    raise CheckpointError(f"tensor {name!r} has dtype {e.dtype}: expected a float tensor ({np.dtype(dtype).name})")
  return lambda idx: index.array(name)[idx]


# ---------------------------------------------------------------------------------------------------- orbax
def save_orbax(model, directory: str):
  """Save a loaded model's params (sharded arrays) + its config with orbax-checkpoint."""
  import orbax.checkpoint as ocp  # noqa: PLC0415

  directory = os.path.abspath(directory)
  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, "glm5_config.json"), "w") as f:
    json.dump({"config": model.cfg.to_hf_dict(), "fp8": model.fp8, "mtp": model.mtp, "dtype": str(model.dtype),
               "num_nextn_predict_layers": model.cfg.num_nextn_predict_layers}, f)
  ckptr = ocp.StandardCheckpointer()
  ckptr.save(os.path.join(directory, "params"), nnx.to_pure_dict(model.params), force=True)
  ckptr.wait_until_finished()


def restore_orbax(directory: str, *, mesh=None):
  """Restore params saved by :func:`save_orbax` onto ``mesh`` (any TP size the shapes allow)."""
  import orbax.checkpoint as ocp  # noqa: PLC0415

  directory = os.path.abspath(directory)
  with open(os.path.join(directory, "glm5_config.json")) as f:
    meta = json.load(f)
  cfg = Glm5Config.from_hf_dict(meta["config"]).replace(num_nextn_predict_layers=meta["num_nextn_predict_layers"])
  dtype = jnp.dtype(meta["dtype"])
  mesh = shd.make_mesh(1) if mesh is None else mesh
  abstract = nnx.eval_shape(lambda: Glm5Model(cfg, dtype, fp8=meta["fp8"], mtp=meta["mtp"]))
  graphdef, astate = nnx.split(abstract)
  shd.check_divisible(astate, mesh, cfg.fp8_block if meta["fp8"] else None)
  specs = shd.param_specs(astate)
  target = jax.tree.map(
      lambda v, s: jax.ShapeDtypeStruct(v.get_value().shape, v.get_value().dtype, sharding=NamedSharding(mesh, s)),
      astate, specs, is_leaf=lambda x: isinstance(x, nnx.Variable))
  pure = ocp.StandardCheckpointer().restore(os.path.join(directory, "params"), nnx.to_pure_dict(target))
  nnx.replace_by_pure_dict(astate, pure)
  return cfg, graphdef, astate, {"fp8": meta["fp8"], "mtp": meta["mtp"], "dtype": dtype, "mesh": mesh}
