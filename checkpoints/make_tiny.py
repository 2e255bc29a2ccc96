"""Random GLM-5.3-Flash ("Glm5Next") checkpoints in exactly the layout of the real release.

Used by the tests, the notebooks and the README demo. Needs only numpy and ml_dtypes (no jax, no torch, no
safetensors), so it also runs inside the Hugging Face venv that regenerates ``tests/goldens``.

    python -m checkpoints.make_tiny --preset oracle-tiny --seed 0 --dtype fp8 --shards 2 --out DIR

writes ``DIR/config.json``, ``DIR/generation_config.json`` and ``DIR/model.safetensors`` (or
``model-0000i-of-0000N.safetensors`` + ``model.safetensors.index.json``). ``checkpoints/README.md`` documents
every name, shape, dtype, the FP8 block format and the draw order.

Weights (every path live, the init rules of ../shared/oracle/README.md "Random weights"), drawn from ONE
``numpy.random.default_rng(seed)`` in the fixed order of :func:`weight_specs`:

* ``embed_tokens`` N(0, 1);
* layers 0 .. L-1, each: mHC attn site (fn, base, scale), mHC ffn site, ``input_layernorm``, the attention
  block (KDA or DSA order below), ``post_attention_layernorm``, the MLP (dense or MoE order below);
* the final ``norm``, then ``lm_head``;
* the MTP layer L (when present), so that turning MTP on or off never changes the trunk weights.

The vision stub comes from a second generator, ``default_rng([seed, 1])``, so ``vision=False`` changes nothing
else. bf16 and fp8 checkpoints are derived from the same float32 draw (same seed => same fp32 weights).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np

FP8_MAX = 448.0  # largest finite float8_e4m3fn
DTYPES = ("float32", "bfloat16", "fp8")
GENERATOR_VERSION = 1  # bump when the draw order or a rule changes (invalidates builtin_checkpoint caches)

_ST_DTYPE = {np.dtype(np.float32): "F32", np.dtype(ml_dtypes.bfloat16): "BF16",
             np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3", np.dtype(np.int64): "I64", np.dtype(np.int32): "I32"}
# safetensors (Rust) orders tensors by dtype, widest first, then by name; we reproduce it byte for byte.
_ST_ORDER = {"I64": 0, "F32": 1, "I32": 2, "BF16": 3, "F8_E4M3": 4}


# ------------------------------------------------------------------------------------------------ config
def _config_module():
  """glm5_jax.config; loaded from its file when the ``glm5_jax`` package cannot be imported (its __init__ may
  pull jax, which the Hugging Face venv lacks). The normal import comes first so that presets built here are
  the same class as the ones the rest of the package builds (dataclass equality compares classes)."""
  mod = sys.modules.get("glm5_jax.config")
  if mod is not None:
    return mod
  try:
    import glm5_jax.config as mod  # noqa: PLC0415
    return mod
  except ImportError:
    pass
  name = "_glm5_jax_config_standalone"
  if name in sys.modules:
    return sys.modules[name]
  path = Path(__file__).resolve().parents[1] / "glm5_jax" / "config.py"
  spec = importlib.util.spec_from_file_location(name, path)
  mod = importlib.util.module_from_spec(spec)
  sys.modules[name] = mod  # dataclasses resolves annotations through sys.modules
  spec.loader.exec_module(mod)
  return mod


def preset_config(preset: str, *, mtp: bool = True, **overrides):
  """A Glm5Config from a preset name ("oracle-tiny", "kernel-tiny", "real") plus field overrides."""
  c = _config_module()
  if preset not in c.PRESETS:
    raise ValueError(f"unknown preset {preset!r}: expected one of {sorted(c.PRESETS)}")
  cfg = c.PRESETS[preset]() if preset == "real" else c.PRESETS[preset](mtp=mtp)
  if overrides:
    fix = {k: tuple(v) if isinstance(v, list) else v for k, v in overrides.items()}
    if "num_hidden_layers" in fix:  # re-derive the per-layer schedules unless they are given too
      fix.setdefault("layer_types", ())
      fix.setdefault("mlp_layer_types", ())
    cfg = cfg.replace(**fix)
  return cfg


# ------------------------------------------------------------------------------------------------ names / rules
# A rule is ("normal", std) | ("uniform", lo, hi) | ("dt_bias",). Gate/up projections and routers use gain 2.
def _lin(fan_in, gain=1.0):
  return ("normal", gain / math.sqrt(fan_in))


_NORM = ("uniform", 0.6, 1.4)


def _hc_specs(cfg, p):
  n, d = cfg.hc_mult, cfg.hidden_size
  out = []
  for site in ("attn", "ffn"):
    out += [(f"{p}hc_{site}_fn", ((2 + n) * n, n * d), _lin(n * d)),
            (f"{p}hc_{site}_base", ((2 + n) * n,), ("normal", 0.5)),
            (f"{p}hc_{site}_scale", (3,), ("uniform", 0.5, 1.5))]
  return out


def _kda_specs(cfg, p):
  d, h, k, kc = cfg.hidden_size, cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel_dim
  c, r = h * k, cfg.kda_gate_rank
  a = p + "self_attn."
  return [(f"{a}q_proj.weight", (c, d), _lin(d)), (f"{a}k_proj.weight", (c, d), _lin(d)),
          (f"{a}v_proj.weight", (c, d), _lin(d)),
          (f"{a}q_conv1d.weight", (c, 1, kc), _lin(kc)), (f"{a}k_conv1d.weight", (c, 1, kc), _lin(kc)),
          (f"{a}v_conv1d.weight", (c, 1, kc), _lin(kc)),
          (f"{a}f_a_proj.weight", (r, d), _lin(d)), (f"{a}f_b_proj.weight", (c, r), _lin(r)),
          (f"{a}A_log", (h,), ("normal", 0.5)), (f"{a}dt_bias", (c,), ("dt_bias",)),
          (f"{a}b_proj.weight", (h, d), _lin(d)),
          (f"{a}g_a_proj.weight", (r, d), _lin(d)), (f"{a}g_b_proj.weight", (c, r), _lin(r)),
          (f"{a}o_norm.weight", (k,), _NORM), (f"{a}o_proj.weight", (d, c), _lin(c))]


def _dsa_specs(cfg, p):
  d, hm, ql, kl = cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank
  qk, nope, vd, rope = cfg.qk_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.qk_rope_head_dim
  hi, di = cfg.index_n_heads, cfg.index_head_dim
  a, x = p + "self_attn.", p + "self_attn.indexer."
  return [(f"{a}q_a_proj.weight", (ql, d), _lin(d)), (f"{a}q_a_layernorm.weight", (ql,), _NORM),
          (f"{a}q_b_proj.weight", (hm * qk, ql), _lin(ql)),
          (f"{a}kv_a_proj_with_mqa.weight", (kl + rope, d), _lin(d)), (f"{a}kv_a_layernorm.weight", (kl,), _NORM),
          (f"{a}kv_b_proj.weight", (hm * (nope + vd), kl), _lin(kl)),
          (f"{a}o_proj.weight", (d, hm * vd), _lin(hm * vd)),
          (f"{x}wq_b.weight", (hi * di, ql), _lin(ql)), (f"{x}wk.weight", (di, d), _lin(d)),
          (f"{x}k_norm.weight", (di,), _NORM), (f"{x}k_norm.bias", (di,), ("normal", 0.2)),
          (f"{x}weights_proj.weight", (hi, d), _lin(d)),
          (f"{x}index_kpool_compress_gate", (di, d), _lin(d)),
          (f"{x}index_kpool_compress_ape", (cfg.index_kpool, di), ("normal", 0.5))]


def _swiglu_specs(p, d, i):
  return [(f"{p}gate_proj.weight", (i, d), _lin(d, 2.0)), (f"{p}up_proj.weight", (i, d), _lin(d, 2.0)),
          (f"{p}down_proj.weight", (d, i), _lin(i))]


def _mlp_specs(cfg, p, kind):
  d, m = cfg.hidden_size, p + "mlp."
  if kind == "dense":
    return _swiglu_specs(m, d, cfg.intermediate_size)
  e = cfg.n_routed_experts
  out = [(f"{m}gate.weight", (e, d), _lin(d, 2.0)), (f"{m}gate.e_score_correction_bias", (e,), ("normal", 0.1))]
  if cfg.n_shared_experts:
    out += _swiglu_specs(f"{m}shared_experts.", d, cfg.moe_intermediate_size * cfg.n_shared_experts)
  for j in range(e):
    out += _swiglu_specs(f"{m}experts.{j}.", d, cfg.moe_intermediate_size)
  return out


def _resolve_mtp(cfg, mtp):
  return cfg.num_nextn_predict_layers > 0 if mtp is None else bool(mtp)


def weight_specs(cfg, mtp: bool | None = None) -> list[tuple[str, tuple[int, ...], tuple]]:
  """(checkpoint name, shape, init rule) of every language-model tensor, in draw order."""
  lm, d = "model.language_model.", cfg.hidden_size
  out = [(f"{lm}embed_tokens.weight", (cfg.vocab_size, d), ("normal", 1.0))]
  for i in range(cfg.num_hidden_layers):
    p = f"{lm}layers.{i}."
    out += _hc_specs(cfg, p)
    out.append((f"{p}input_layernorm.weight", (d,), _NORM))
    out += _kda_specs(cfg, p) if cfg.layer_types[i] == "linear_attention" else _dsa_specs(cfg, p)
    out.append((f"{p}post_attention_layernorm.weight", (d,), _NORM))
    out += _mlp_specs(cfg, p, cfg.mlp_layer_types[i])
  out.append((f"{lm}norm.weight", (d,), _NORM))
  out.append(("lm_head.weight", (cfg.vocab_size, d), _lin(d)))
  if _resolve_mtp(cfg, mtp):
    p = f"{lm}layers.{cfg.num_hidden_layers}."
    out += [(f"{p}enorm.weight", (d,), _NORM), (f"{p}hnorm.weight", (d,), _NORM),
            (f"{p}eh_proj.weight", (d, 2 * d), _lin(2 * d)), (f"{p}input_layernorm.weight", (d,), _NORM)]
    out += _dsa_specs(cfg, p)
    out.append((f"{p}post_attention_layernorm.weight", (d,), _NORM))
    out += _mlp_specs(cfg, p, "sparse")
    out.append((f"{p}shared_head.norm.weight", (d,), _NORM))
  return out


# A never-run vision stub with the tensor set of HF's Glm5NextVisionModel for VISION_CONFIG (25 tensors).
VISION_CONFIG = dict(model_type="glm5_next_vision", depth=1, hidden_size=32, num_heads=2, intermediate_size=32,
                     projection_intermediate_size=32, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                     in_channels=3)


def vision_specs(cfg) -> list[tuple[str, tuple[int, ...], tuple]]:
  v, d = VISION_CONFIG, cfg.hidden_size
  h, i, pi, m = v["hidden_size"], v["intermediate_size"], v["projection_intermediate_size"], v["spatial_merge_size"]
  hd, b, w = h // v["num_heads"], "model.visual.blocks.0.", ("normal", 0.02)
  shapes = [
      (f"{b}attn.k_norm.weight", (hd,)), (f"{b}attn.proj.bias", (h,)), (f"{b}attn.proj.weight", (h, h)),
      (f"{b}attn.q_norm.weight", (hd,)), (f"{b}attn.qkv.bias", (3 * h,)), (f"{b}attn.qkv.weight", (3 * h, h)),
      (f"{b}mlp.down_proj.bias", (h,)), (f"{b}mlp.down_proj.weight", (h, i)), (f"{b}mlp.gate_proj.bias", (i,)),
      (f"{b}mlp.gate_proj.weight", (i, h)), (f"{b}mlp.up_proj.bias", (i,)), (f"{b}mlp.up_proj.weight", (i, h)),
      (f"{b}norm1.weight", (h,)), (f"{b}norm2.weight", (h,)),
      ("model.visual.downsample.bias", (d,)), ("model.visual.downsample.weight", (d, h, m, m)),
      ("model.visual.merger.down_proj.weight", (d, pi)), ("model.visual.merger.gate_proj.weight", (pi, d)),
      ("model.visual.merger.post_projection_norm.bias", (d,)),
      ("model.visual.merger.post_projection_norm.weight", (d,)),
      ("model.visual.merger.proj.weight", (d, d)), ("model.visual.merger.up_proj.weight", (pi, d)),
      ("model.visual.patch_embed.proj.bias", (h,)),
      ("model.visual.patch_embed.proj.weight",
       (h, v["in_channels"], v["temporal_patch_size"], v["patch_size"], v["patch_size"])),
      ("model.visual.post_layernorm.weight", (h,)),
  ]
  return [(n, s, w) for n, s in shapes]


# ------------------------------------------------------------------------------------------------ drawing
def _draw(rng: np.random.Generator, shape, rule) -> np.ndarray:
  """One tensor. float32 draws and float32 arithmetic with float32 constants, so the bytes are reproducible."""
  kind = rule[0]
  if kind == "normal":
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(rule[1])
  if kind == "uniform":
    lo, hi = rule[1], rule[2]
    return rng.random(shape, dtype=np.float32) * np.float32(hi - lo) + np.float32(lo)
  if kind == "dt_bias":
    # FLA/HF init: dt ~ logU(1e-3, 1e-1), dt_bias = softplus^-1(dt). float64 then one rounding to float32,
    # so a last-ulp difference of a vectorised exp/log between CPUs cannot reach the stored float32.
    u = rng.random(shape)
    dt = np.exp(u * (math.log(1e-1) - math.log(1e-3)) + math.log(1e-3))
    return (dt + np.log(-np.expm1(-dt))).astype(np.float32)
  raise ValueError(f"unknown init rule {rule!r}")


def draw_weights(cfg, seed: int = 0, *, mtp: bool | None = None, vision: bool = False) -> dict[str, np.ndarray]:
  """The float32 weights of every checkpoint tensor (insertion order = draw order); no scales."""
  rng = np.random.default_rng(seed)
  out = {name: _draw(rng, shape, rule) for name, shape, rule in weight_specs(cfg, mtp)}
  if vision:
    vr = np.random.default_rng([seed, 1])
    out.update({name: _draw(vr, shape, rule) for name, shape, rule in vision_specs(cfg)})
  return out


# ------------------------------------------------------------------------------------------------ dtypes
_FP8_SUFFIXES_MLP = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
_FP8_SUFFIXES_DSA = ("self_attn.q_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight", "self_attn.q_b_proj.weight",
                     "self_attn.o_proj.weight")


def _layer_of(name: str) -> int | None:
  parts = name.split(".")
  if len(parts) > 3 and parts[:3] == ["model", "language_model", "layers"]:
    return int(parts[3])
  return None


def is_fp8_weight(cfg, name: str) -> bool:
  """The FP8 set of the release (spec §1.2): dense/shared/routed MLP gate/up/down, and q_a/kv_a/q_b/o_proj of the
  DSA layers and of the MTP layer (KDA's o_proj stays unquantised)."""
  i = _layer_of(name)
  if i is None:
    return False
  rest = name.split(".", 4)[4]
  if rest in _FP8_SUFFIXES_MLP or rest.startswith(("mlp.shared_experts.", "mlp.experts.")) and rest.endswith(
      ("gate_proj.weight", "up_proj.weight", "down_proj.weight")):
    return True
  if rest in _FP8_SUFFIXES_DSA:
    return i >= cfg.num_hidden_layers or cfg.layer_types[i] == "indexed_attention"
  return False


def keeps_f32_in_bf16(name: str) -> bool:
  """Tensors HF keeps in F32 when it saves a bf16 model (its _keep_in_fp32_modules_strict)."""
  leaf = name.rsplit(".", 1)[-1]
  return (leaf in ("A_log", "dt_bias", "e_score_correction_bias") or "_conv1d." in name
          or leaf.startswith(("hc_attn_base", "hc_attn_scale", "hc_ffn_base", "hc_ffn_scale")))


def quantize_fp8_block(w: np.ndarray, block=(128, 128)) -> tuple[np.ndarray, np.ndarray]:
  """W [N,K] float32 -> (W8 float8_e4m3fn [N,K], scale_inv float32 [ceil(N/bn), ceil(K/bk)]).

  Per block (partial edge blocks use only their real elements): s = amax|W| / 448 (s = 1 for an all-zero block),
  W8 = e4m3(clip(W / s, -448, 448)) rounded to nearest even. Every nonzero block has an element at exactly ±448.
  """
  assert w.dtype == np.float32 and w.ndim == 2, (w.dtype, w.shape)
  n, k = w.shape
  bn, bk = block
  nb, kb = -(-n // bn), -(-k // bk)
  padded = np.zeros((nb * bn, kb * bk), np.float32)  # zero padding never raises a block's max
  padded[:n, :k] = np.abs(w)
  amax = padded.reshape(nb, bn, kb, bk).max(axis=(1, 3))
  s = np.where(amax > 0, amax / np.float32(FP8_MAX), np.float32(1.0)).astype(np.float32)
  full = np.repeat(np.repeat(s, bn, axis=0), bk, axis=1)[:n, :k]
  w8 = np.clip(w / full, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
  return w8, s


def dequantize_fp8_block(w8: np.ndarray, scale_inv: np.ndarray, block=(128, 128)) -> np.ndarray:
  """W[i, j] = f32(W8[i, j]) * scale_inv[i // bn, j // bk]: one float32 multiply (bit-exact in every loader)."""
  n, k = w8.shape
  bn, bk = block
  assert scale_inv.shape == (-(-n // bn), -(-k // bk)), (w8.shape, scale_inv.shape)
  full = np.repeat(np.repeat(scale_inv.astype(np.float32), bn, axis=0), bk, axis=1)[:n, :k]
  return w8.astype(np.float32) * full


def to_disk_tensors(cfg, weights: dict[str, np.ndarray], dtype: str, block=(128, 128)) -> dict[str, np.ndarray]:
  """The tensors as the checkpoint stores them for `dtype` (adds `<name>_scale_inv` next to each FP8 weight)."""
  if dtype not in DTYPES:
    raise ValueError(f"dtype={dtype!r}: expected one of {DTYPES}")
  out = {}
  for name, w in weights.items():
    if dtype == "float32":
      out[name] = w
    elif dtype == "bfloat16":
      out[name] = w if keeps_f32_in_bf16(name) else w.astype(ml_dtypes.bfloat16)
    elif is_fp8_weight(cfg, name):
      out[name], out[name + "_scale_inv"] = quantize_fp8_block(w, block)
    else:
      out[name] = w
  return out


# ------------------------------------------------------------------------------------------------ config.json
def modules_to_not_convert(cfg, mtp: bool) -> list[str]:
  """Every unquantised nn.Linear by checkpoint name (HF's FP8 quantizer converts every Linear not listed, and once
  a list is given it drops its default lm_head skip). Routers are not nn.Linear in HF and are not listed."""
  lm = "model.language_model.layers."
  out = ["lm_head", "model.visual"]
  kda = ("b_proj", "f_a_proj", "f_b_proj", "g_a_proj", "g_b_proj", "k_proj", "o_proj", "q_proj", "v_proj")
  dsa = ("indexer.weights_proj", "indexer.wk", "indexer.wq_b", "kv_b_proj")
  for i, t in enumerate(cfg.layer_types):
    out += [f"{lm}{i}.self_attn.{m}" for m in (kda if t == "linear_attention" else dsa)]
  if mtp:
    j = cfg.num_hidden_layers
    out.append(f"{lm}{j}.eh_proj")
    out += [f"{lm}{j}.self_attn.{m}" for m in dsa]
  return out


def special_token_ids(cfg) -> dict[str, int]:
  """Multimodal placeholder ids, placed at vocab-12 .. vocab-7 (the oracle's 500..505 for a 512 vocab)."""
  base = cfg.vocab_size - 12
  names = ("image_token_id", "video_token_id", "image_start_token_id", "image_end_token_id",
           "video_start_token_id", "video_end_token_id")
  return {n: base + i for i, n in enumerate(names)}


def hf_config_dict(cfg, dtype: str, *, mtp: bool, block=(128, 128)) -> dict:
  """config.json: cfg.to_hf_dict() (+ quantization_config for fp8), "dtype", a tiny vision_config, token ids."""
  c = cfg.replace(num_nextn_predict_layers=int(mtp), fp8_block=tuple(block) if dtype == "fp8" else None)
  out = c.to_hf_dict()
  out["dtype"] = "bfloat16" if dtype == "bfloat16" else "float32"  # fp8: the unquantised tensors are F32
  out.update(special_token_ids(cfg))
  out["vision_config"] = dict(VISION_CONFIG, out_hidden_size=cfg.hidden_size)
  out["transformers_version"] = "5.23.0"
  if dtype == "fp8":
    q = dict(out["quantization_config"])
    q["modules_to_not_convert"] = modules_to_not_convert(cfg, mtp)
    out["quantization_config"] = {k: q[k] for k in sorted(q)}  # DeepSeek-V3's key order (sorted)
  else:
    out.pop("quantization_config", None)
  return out


def generation_config_dict(cfg) -> dict:
  out = {"_from_model_config": True, "output_attentions": False, "output_hidden_states": False,
         "transformers_version": "5.23.0", "use_cache": True}
  if cfg.eos_token_id:
    out["eos_token_id"] = list(cfg.eos_token_id) if len(cfg.eos_token_id) > 1 else cfg.eos_token_id[0]
  if cfg.pad_token_id is not None:
    out["pad_token_id"] = cfg.pad_token_id
  return out


# ------------------------------------------------------------------------------------------------ safetensors
def safetensors_header(tensors: dict[str, np.ndarray], metadata: dict | None = None) -> tuple[bytes, list[str]]:
  """The header bytes (u64 length + JSON padded with spaces to 8 bytes) and the data order, as safetensors writes."""
  order = sorted(tensors, key=lambda n: (_ST_ORDER[_ST_DTYPE[tensors[n].dtype]], n))
  head: dict = {"__metadata__": dict(metadata)} if metadata else {}
  off = 0
  for n in order:
    a = tensors[n]
    head[n] = {"dtype": _ST_DTYPE[a.dtype], "shape": list(a.shape), "data_offsets": [off, off + a.nbytes]}
    off += a.nbytes
  js = json.dumps(head, separators=(",", ":")).encode()
  js += b" " * (-len(js) % 8)
  return len(js).to_bytes(8, "little") + js, order


def write_safetensors(path: str | os.PathLike, tensors: dict[str, np.ndarray], metadata: dict | None = None) -> None:
  """A .safetensors file (F32 / BF16 / F8_E4M3 / I32 / I64), byte-identical to safetensors' own writer."""
  assert sys.byteorder == "little"
  for n, a in tensors.items():
    if a.dtype not in _ST_DTYPE:
      raise TypeError(f"{n}: dtype {a.dtype} cannot be written")
  head, order = safetensors_header(tensors, metadata)
  with open(path, "wb") as f:
    f.write(head)
    for n in order:
      f.write(np.ascontiguousarray(tensors[n]).view(np.uint8).reshape(-1).data)


def _natural(name: str):
  return [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in name.split(".")]


def file_sha256(path) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 22), b""):
      h.update(chunk)
  return h.hexdigest()


def _write_tensor_files(out_dir: str, tensors: dict[str, np.ndarray], shards: int) -> list[str]:
  meta = {"format": "pt"}
  if shards <= 1:
    write_safetensors(os.path.join(out_dir, "model.safetensors"), tensors, meta)
    return ["model.safetensors"]
  # Contiguous groups in natural name order, cut at equal byte fractions; a weight and its scale stay together
  # only by accident, as in the release (the index says where each tensor lives).
  names = sorted(tensors, key=_natural)
  if shards > len(names):
    raise ValueError(f"shards={shards} > {len(names)} tensors")
  sizes = np.array([tensors[n].nbytes for n in names], np.int64)
  total = int(sizes.sum())
  before = np.cumsum(sizes) - sizes  # bytes before each tensor
  bounds = [0]
  for j in range(1, shards):  # shard j starts at the first tensor past j/shards of the bytes; none is empty
    b = int(np.searchsorted(before, total * j / shards))
    bounds.append(min(max(b, bounds[-1] + 1), len(names) - (shards - j)))
  bounds.append(len(names))
  files, weight_map = [], {}
  for j in range(shards):
    fn = f"model-{j + 1:05d}-of-{shards:05d}.safetensors"
    part = {n: tensors[n] for n in names[bounds[j]:bounds[j + 1]]}
    write_safetensors(os.path.join(out_dir, fn), part, meta)
    weight_map.update({n: fn for n in part})
    files.append(fn)
  index = {"metadata": {"total_size": total}, "weight_map": {n: weight_map[n] for n in sorted(weight_map)}}
  with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
    json.dump(index, f, indent=2)
    f.write("\n")
  return files


def write_checkpoint(cfg, out_dir, *, seed: int = 0, dtype: str = "float32", mtp: bool | None = None,
                     shards: int = 1, vision: bool = True) -> str:
  """Write a random checkpoint of `cfg` in the release layout to `out_dir`; returns the directory.

  dtype: "float32" (all F32), "bfloat16" (HF's bf16 save: A_log, dt_bias, convs, router bias, hc base/scale F32),
  "fp8" (the release's FP8 set as F8_E4M3 + F32 `<name>_scale_inv`, blocks cfg.fp8_block or 128x128, rest F32).
  mtp: write the MTP layer L = cfg.num_hidden_layers (default: cfg.num_nextn_predict_layers > 0).
  """
  if dtype not in DTYPES:
    raise ValueError(f"dtype={dtype!r}: expected one of {DTYPES}")
  mtp = _resolve_mtp(cfg, mtp)
  block = tuple(cfg.fp8_block) if cfg.fp8_block else (128, 128)
  out_dir = os.fspath(out_dir)
  os.makedirs(out_dir, exist_ok=True)
  for fn in os.listdir(out_dir):  # a rewrite with fewer shards must not leave stale files behind
    if fn.endswith(".safetensors") or fn == "model.safetensors.index.json":
      os.remove(os.path.join(out_dir, fn))
  weights = draw_weights(cfg, seed, mtp=mtp, vision=vision)
  tensors = to_disk_tensors(cfg, weights, dtype, block)
  del weights
  _write_tensor_files(out_dir, tensors, shards)
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(hf_config_dict(cfg, dtype, mtp=mtp, block=block), f, indent=2)
    f.write("\n")
  with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
    json.dump(generation_config_dict(cfg), f, indent=2)
    f.write("\n")
  return out_dir


# ------------------------------------------------------------------------------------------------ cache
def cache_root() -> Path:
  env = os.environ.get("GLM5_JAX_CACHE")
  return Path(env) if env else Path.home() / ".cache" / "glm5_jax"


def builtin_checkpoint(preset: str = "kernel-tiny", dtype: str | None = None, seed: int = 0) -> str:
  """A generated checkpoint of a preset, written once into <cache>/checkpoints/<preset>-<dtype>-s<seed>.

  <cache> is $GLM5_JAX_CACHE or ~/.cache/glm5_jax. dtype None: "fp8" for kernel-tiny and real-like presets
  (like the release), "float32" for oracle-tiny. Regenerated when the stamp (generator version + args) differs.
  """
  if dtype is None:
    dtype = "float32" if preset == "oracle-tiny" else "fp8"
  if preset == "real":
    raise ValueError("builtin_checkpoint: the 'real' geometry is far too large to generate")
  path = cache_root() / "checkpoints" / f"{preset}-{dtype}-s{seed}"
  stamp = {"generator": "checkpoints.make_tiny", "version": GENERATOR_VERSION, "preset": preset, "dtype": dtype,
           "seed": seed}
  sp = path / "make_tiny.json"
  if sp.is_file():
    try:
      if json.loads(sp.read_text()) == stamp:
        return str(path)
    except ValueError:
      pass
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=path.name + ".tmp", dir=path.parent)
  try:
    write_checkpoint(preset_config(preset), tmp, seed=seed, dtype=dtype)
    Path(tmp, "make_tiny.json").write_text(json.dumps(stamp, indent=1) + "\n")
    if path.exists():
      shutil.rmtree(path)
    os.replace(tmp, path)  # atomic: a concurrent reader sees the old or the new directory, never half of one
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return str(path)


# ------------------------------------------------------------------------------------------------ CLI
def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--preset", default="oracle-tiny", choices=["oracle-tiny", "kernel-tiny"])
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--dtype", default="float32", choices=DTYPES)
  p.add_argument("--shards", type=int, default=1)
  p.add_argument("--no-mtp", action="store_true", help="omit the MTP layer")
  p.add_argument("--no-vision", action="store_true", help="omit the model.visual.* stub tensors")
  p.add_argument("--override", action="append", default=[], metavar="FIELD=JSON",
                 help="a Glm5Config field override, e.g. --override hidden_size=192 (repeatable)")
  p.add_argument("--out", required=True)
  a = p.parse_args(argv)
  over = {}
  for o in a.override:
    k, _, v = o.partition("=")
    over[k] = json.loads(v)
  cfg = preset_config(a.preset, mtp=not a.no_mtp, **over)
  d = write_checkpoint(cfg, a.out, seed=a.seed, dtype=a.dtype, mtp=not a.no_mtp, shards=a.shards,
                       vision=not a.no_vision)
  files = sorted(f for f in os.listdir(d) if f.endswith((".safetensors", ".json")))
  for f in files:
    print(f"{os.path.getsize(os.path.join(d, f)):>12,d}  {os.path.join(d, f)}")


if __name__ == "__main__":
  main()
