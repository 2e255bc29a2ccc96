"""Glm5Config: the GLM-5.3-Flash ("Glm5Next") text model + MTP geometry, frozen and validated.

Built from a Hugging Face ``config.json`` (outer ``glm5_next`` with a ``text_config``, or a bare
``glm5_next_text``) or from a preset:

* :func:`real` — the released GLM-5.3-Flash geometry (../shared/spec/model.md §1).
* :func:`oracle_tiny` — the geometry of the Hugging Face oracle (every structural feature on).
* :func:`kernel_tiny` — real per-head sizes (KDA head 128, kv_lora 512, qk_nope/v_head 256, indexer
  head 128, kpool 4, hc_mult 4, conv 4) with few layers, heads, experts and a small hidden/vocab, so the
  Pallas kernels see the shapes they are written for.

Shape alphabet used across the package: B batch, T/q new tokens, S cache length, D hidden, H heads,
K/V head dims, E experts, I intermediate, C conv channels, P pools, W selected positions, N streams.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

KDA = "linear_attention"
DSA = "indexed_attention"
# Names used for a DSA layer by the HF config ("indexed_attention") and by some exports of the real
# release ("deepseek_sparse_attention"); both mean the same layer.
_DSA_ALIASES = ("indexed_attention", "deepseek_sparse_attention", "sparse_attention", "full_attention")


@dataclasses.dataclass(frozen=True)
class Glm5Config:
  """Every field of spec §1 that changes the math or the shapes. Frozen; validated on creation."""

  vocab_size: int = 154880
  hidden_size: int = 4096
  num_hidden_layers: int = 45
  layer_types: tuple[str, ...] = ()  # KDA ("linear_attention") or DSA ("indexed_attention") per layer
  mlp_layer_types: tuple[str, ...] = ()  # "dense" or "sparse" per layer
  rms_norm_eps: float = 1e-5
  tie_word_embeddings: bool = False
  max_position_embeddings: int = 1048576
  pad_token_id: int | None = 154820
  eos_token_id: tuple[int, ...] = ()
  # KDA
  linear_num_heads: int = 64
  linear_head_dim: int = 128
  linear_conv_kernel_dim: int = 4
  linear_lower_bound: float = -5.0
  # MLA (NoPE)
  num_attention_heads: int = 64
  num_key_value_heads: int = 64
  q_lora_rank: int = 1536
  kv_lora_rank: int = 512
  qk_nope_head_dim: int = 256
  qk_rope_head_dim: int = 0
  v_head_dim: int = 256
  # indexer
  index_n_heads: int = 32
  index_head_dim: int = 128
  index_topk: int = 2048
  index_kpool: int = 4
  index_kpool_always_select_tail: bool = True
  index_share_for_mtp_iteration: bool = True
  # MoE / MLP
  intermediate_size: int = 12288
  moe_intermediate_size: int = 2048
  n_routed_experts: int = 288
  num_experts_per_tok: int = 8
  n_shared_experts: int = 1
  n_group: int = 1
  topk_group: int = 1
  norm_topk_prob: bool = True
  routed_scaling_factor: float = 2.5
  swiglu_limit: float = 10.0
  # mHC
  hc_mult: int = 4
  hc_sinkhorn_iters: int = 20
  hc_eps: float = 1e-6
  hc_post_mult: float = 2.0
  # MTP
  num_nextn_predict_layers: int = 1
  # quantisation of the checkpoint (None: unquantised)
  fp8_block: tuple[int, int] | None = (128, 128)

  def __post_init__(self):
    n = self.num_hidden_layers
    if not self.layer_types:
      object.__setattr__(self, "layer_types", tuple(DSA if i % 4 == 3 else KDA for i in range(n)))
    else:
      object.__setattr__(self, "layer_types", tuple(DSA if t in _DSA_ALIASES else t for t in self.layer_types))
    if not self.mlp_layer_types:
      k = min(3, n)
      object.__setattr__(self, "mlp_layer_types", ("dense",) * k + ("sparse",) * (n - k))
    else:
      object.__setattr__(self, "mlp_layer_types", tuple(self.mlp_layer_types))
    object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
    if self.fp8_block is not None:
      object.__setattr__(self, "fp8_block", tuple(self.fp8_block))
    self.validate()

  # ------------------------------------------------------------------ validation
  def validate(self) -> None:
    def bad(field, value, expect):
      raise ValueError(f"Glm5Config.{field}={value!r} is invalid: expected {expect}")

    for f in ("vocab_size", "hidden_size", "num_hidden_layers", "linear_num_heads", "linear_head_dim",
              "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim",
              "index_n_heads", "index_head_dim", "index_topk", "index_kpool", "intermediate_size",
              "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "hc_mult",
              "hc_sinkhorn_iters", "linear_conv_kernel_dim"):
      v = getattr(self, f)
      if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        bad(f, v, "a positive integer")
    n = self.num_hidden_layers
    if len(self.layer_types) != n:
      bad("layer_types", self.layer_types, f"{n} entries (num_hidden_layers)")
    for i, t in enumerate(self.layer_types):
      if t not in (KDA, DSA):
        bad(f"layer_types[{i}]", t, f"'{KDA}' or '{DSA}'")
    if len(self.mlp_layer_types) != n:
      bad("mlp_layer_types", self.mlp_layer_types, f"{n} entries (num_hidden_layers)")
    for i, t in enumerate(self.mlp_layer_types):
      if t not in ("dense", "sparse"):
        bad(f"mlp_layer_types[{i}]", t, "'dense' or 'sparse'")
    if self.qk_rope_head_dim != 0:
      bad("qk_rope_head_dim", self.qk_rope_head_dim, "0 (GLM-5.3-Flash's MLA is NoPE)")
    if self.num_key_value_heads != self.num_attention_heads:
      bad("num_key_value_heads", self.num_key_value_heads, f"num_attention_heads={self.num_attention_heads} (MLA)")
    if self.n_group != 1 or self.topk_group != 1:
      f = "n_group" if self.n_group != 1 else "topk_group"
      bad(f, getattr(self, f), "1 (n_group = topk_group = (1, 1)): group routing is not used by this model")
    if self.num_experts_per_tok > self.n_routed_experts:
      bad("num_experts_per_tok", self.num_experts_per_tok, f"<= n_routed_experts={self.n_routed_experts}")
    if self.n_shared_experts not in (0, 1):
      bad("n_shared_experts", self.n_shared_experts, "0 or 1")
    if self.index_topk % self.index_kpool:
      bad("index_topk", self.index_topk, f"a multiple of index_kpool={self.index_kpool}")
    if not self.index_kpool_always_select_tail:
      bad("index_kpool_always_select_tail", False, "True (the only mode of this model)")
    if self.linear_lower_bound >= 0:
      bad("linear_lower_bound", self.linear_lower_bound, "a negative bound (the safe gate)")
    if self.num_nextn_predict_layers not in (0, 1):
      bad("num_nextn_predict_layers", self.num_nextn_predict_layers, "0 or 1")
    if self.tie_word_embeddings:
      bad("tie_word_embeddings", True, "False (GLM-5.3-Flash has an untied lm_head)")
    if self.fp8_block is not None and (len(self.fp8_block) != 2 or any(b <= 0 for b in self.fp8_block)):
      bad("fp8_block", self.fp8_block, "two positive block sizes, e.g. (128, 128)")

  # ------------------------------------------------------------------ derived
  @property
  def kda_layers(self) -> tuple[int, ...]:
    return tuple(i for i, t in enumerate(self.layer_types) if t == KDA)

  @property
  def dsa_layers(self) -> tuple[int, ...]:
    return tuple(i for i, t in enumerate(self.layer_types) if t == DSA)

  @property
  def kda_gate_rank(self) -> int:
    # f_a/g_a project to the head dim (real: 128); HF's Glm5NextTextForgetGate uses linear_head_dim.
    return self.linear_head_dim

  @property
  def kda_dim(self) -> int:
    return self.linear_num_heads * self.linear_head_dim

  @property
  def qk_head_dim(self) -> int:
    return self.qk_nope_head_dim + self.qk_rope_head_dim

  @property
  def softmax_scale(self) -> float:
    return self.qk_head_dim ** -0.5

  @property
  def index_pools_topk(self) -> int:
    return self.index_topk // self.index_kpool

  @property
  def index_width(self) -> int:
    """Selected positions per query: top-k pools expanded to tokens + the tail (< kpool tokens)."""
    return self.index_topk + self.index_kpool - 1

  @property
  def hc_dim(self) -> int:
    return self.hc_mult * self.hidden_size

  @property
  def hc_mix(self) -> int:
    return (2 + self.hc_mult) * self.hc_mult

  @property
  def has_mtp(self) -> bool:
    return self.num_nextn_predict_layers > 0

  @property
  def mtp_layer(self) -> int:
    return self.num_hidden_layers  # checkpoint index of the MTP layer (45 in the release)

  def replace(self, **kw) -> "Glm5Config":
    return dataclasses.replace(self, **kw)

  # ------------------------------------------------------------------ HF config.json
  @classmethod
  def from_hf_dict(cls, cfg: dict[str, Any]) -> "Glm5Config":
    mt = cfg.get("model_type")
    if mt == "glm5_next":
      if "text_config" not in cfg:
        raise ValueError("config.json: model_type 'glm5_next' needs a 'text_config' section")
      text = dict(cfg["text_config"])
      outer = cfg
    elif mt == "glm5_next_text":
      text, outer = dict(cfg), {}
    else:
      raise ValueError(f"config.json: model_type={mt!r} is not supported: expected 'glm5_next' or 'glm5_next_text'")
    if text.get("model_type", "glm5_next_text") != "glm5_next_text":
      raise ValueError(f"config.json: text_config.model_type={text.get('model_type')!r}: expected 'glm5_next_text'")
    kw: dict[str, Any] = {}
    names = {f.name for f in dataclasses.fields(cls)}
    for k in names:
      if k in text and text[k] is not None:
        kw[k] = text[k]
    # HF spells a few things differently or not at all.
    if text.get("mla_use_nope") is False:
      raise ValueError("config.json: mla_use_nope=False is not supported: expected a NoPE MLA")
    if text.get("indexer_types") is not None:
      its = tuple(text["indexer_types"])
      if any(t != "full" for t in its):
        raise ValueError(f"config.json: indexer_types={list(its)!r}: expected every layer 'full'")
    if text.get("index_kpool_compress") is False:
      raise ValueError("config.json: index_kpool_compress=False is not supported: expected True")
    if text.get("scoring_func", "sigmoid") != "sigmoid":
      raise ValueError(f"config.json: scoring_func={text['scoring_func']!r}: expected 'sigmoid'")
    if text.get("hidden_act", "silu") != "silu":
      raise ValueError(f"config.json: hidden_act={text['hidden_act']!r}: expected 'silu'")
    for k in ("layer_types", "mlp_layer_types"):
      if k in kw:
        kw[k] = tuple(kw[k])
    eos = text.get("eos_token_id", outer.get("eos_token_id"))
    kw["eos_token_id"] = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
    kw["pad_token_id"] = text.get("pad_token_id", outer.get("pad_token_id"))
    kw["tie_word_embeddings"] = bool(text.get("tie_word_embeddings", outer.get("tie_word_embeddings", False)))
    kw["num_nextn_predict_layers"] = int(text.get("num_nextn_predict_layers", outer.get("num_nextn_predict_layers", 0)))
    q = outer.get("quantization_config") or text.get("quantization_config")
    if q:
      if q.get("quant_method") != "fp8":
        raise ValueError(f"config.json: quantization_config.quant_method={q.get('quant_method')!r}: expected 'fp8'")
      if q.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"config.json: quantization_config.fmt={q.get('fmt')!r}: expected 'e4m3'")
      kw["fp8_block"] = tuple(q.get("weight_block_size", (128, 128)))
    else:
      kw["fp8_block"] = None
    return cls(**kw)

  @classmethod
  def from_json(cls, path: str | os.PathLike) -> "Glm5Config":
    p = os.fspath(path)
    if os.path.isdir(p):
      p = os.path.join(p, "config.json")
    if not os.path.exists(p):
      raise FileNotFoundError(f"no config.json at {p!r}: expected a Hugging Face checkpoint directory")
    with open(p) as f:
      return cls.from_hf_dict(json.load(f))

  def to_hf_dict(self) -> dict[str, Any]:
    """An HF-style ``config.json`` (outer glm5_next + text_config) for this geometry."""
    text: dict[str, Any] = {"model_type": "glm5_next_text"}
    for f in dataclasses.fields(self):
      if f.name in ("fp8_block", "hc_post_mult"):
        continue
      v = getattr(self, f.name)
      text[f.name] = list(v) if isinstance(v, tuple) else v
    text["indexer_types"] = ["full"] * self.num_hidden_layers
    text.update(qk_head_dim=self.qk_head_dim, head_dim=0, hidden_act="silu", n_group=1, topk_group=1,
                linear_conv_kernel_dim=self.linear_conv_kernel_dim)
    out: dict[str, Any] = {"architectures": ["Glm5NextForConditionalGeneration"], "model_type": "glm5_next",
                           "text_config": text, "tie_word_embeddings": False}
    if self.fp8_block is not None:
      out["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                    "weight_block_size": list(self.fp8_block)}
    return out


# ---------------------------------------------------------------------------------------------------- presets
def real() -> Glm5Config:
  """The released GLM-5.3-Flash geometry (45 layers + 1 MTP layer, FP8 128×128 blocks)."""
  return Glm5Config()


def oracle_tiny(*, fp8: bool = False, mtp: bool = True) -> Glm5Config:
  """The geometry of the Hugging Face oracle in ../shared/oracle (seed directories)."""
  return Glm5Config(
      vocab_size=512, hidden_size=256, num_hidden_layers=8, max_position_embeddings=4096, pad_token_id=None,
      linear_num_heads=4, linear_head_dim=32, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=96,
      kv_lora_rank=64, qk_nope_head_dim=32, v_head_dim=32, index_n_heads=8, index_head_dim=32, index_topk=16,
      intermediate_size=320, moe_intermediate_size=48, n_routed_experts=8, num_experts_per_tok=2,
      swiglu_limit=4.0, num_nextn_predict_layers=int(mtp), fp8_block=(128, 128) if fp8 else None)


def kernel_tiny(*, fp8: bool = True, mtp: bool = True) -> Glm5Config:
  """Real per-head sizes, few layers (KDA, KDA, KDA, DSA: dense, dense, MoE, MoE), small hidden and vocab.

  Every projection dimension is a multiple of 128·4 where TP4 splits it, so FP8 128-blocks never straddle a
  shard at TP1/2/4.
  """
  return Glm5Config(
      vocab_size=2048, hidden_size=512, num_hidden_layers=4, max_position_embeddings=65536, pad_token_id=None,
      mlp_layer_types=("dense", "dense", "sparse", "sparse"),
      linear_num_heads=4, linear_head_dim=128, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=256,
      kv_lora_rank=512, qk_nope_head_dim=256, v_head_dim=256, index_n_heads=8, index_head_dim=128,
      index_topk=64, intermediate_size=1024, moe_intermediate_size=512, n_routed_experts=16,
      num_experts_per_tok=4, swiglu_limit=10.0, num_nextn_predict_layers=int(mtp),
      fp8_block=(128, 128) if fp8 else None)


PRESETS = {"real": real, "oracle-tiny": oracle_tiny, "kernel-tiny": kernel_tiny}


# The kernel-relevant geometry of the release (spec §1.3). A reduced geometry for tests may shrink layer,
# head, expert, hidden and vocabulary counts but must keep these per-head sizes for the specialized decode.
GEOMETRY = {
    "linear_head_dim": 128, "linear_conv_kernel_dim": 4, "linear_lower_bound": -5.0,
    "kv_lora_rank": 512, "qk_nope_head_dim": 256, "qk_rope_head_dim": 0, "v_head_dim": 256,
    "index_head_dim": 128, "index_kpool": 4, "index_kpool_always_select_tail": True,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "n_group": 1, "topk_group": 1,
    "norm_topk_prob": True, "fp8_block": (128, 128),
}
# Counts that must equal the release for the full geometry and may be smaller (never larger) for tests.
GEOMETRY_COUNTS = {
    "vocab_size": 154880, "hidden_size": 4096, "num_hidden_layers": 45, "linear_num_heads": 64,
    "num_attention_heads": 64, "q_lora_rank": 1536, "index_n_heads": 32, "index_topk": 2048,
    "intermediate_size": 12288, "moe_intermediate_size": 2048, "n_routed_experts": 288, "num_experts_per_tok": 8,
}
