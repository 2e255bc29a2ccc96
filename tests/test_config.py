"""Glm5Config: HF config.json parsing, validation messages, presets."""

import json
import os

import pytest

from glm5_jax import config as C
from helpers import ORACLE


def test_presets_are_consistent():
  r = C.real()
  assert r.dsa_layers == tuple(range(3, 45, 4)) and len(r.kda_layers) == 34
  assert r.mlp_layer_types[:3] == ("dense",) * 3 and set(r.mlp_layer_types[3:]) == {"sparse"}
  kt = C.kernel_tiny()
  for k, v in C.GEOMETRY.items():  # kernel-tiny keeps every kernel-relevant per-head size of the release
    assert getattr(kt, k) == v, k
  for k, v in C.GEOMETRY_COUNTS.items():
    assert getattr(kt, k) <= v and getattr(r, k) == v, k
  assert kt.kda_layers and kt.dsa_layers and "dense" in kt.mlp_layer_types and "sparse" in kt.mlp_layer_types


def test_hf_dict_round_trip_outer_and_bare():
  for cfg in (C.real(), C.oracle_tiny(), C.kernel_tiny()):
    d = cfg.to_hf_dict()
    assert C.Glm5Config.from_hf_dict(d) == cfg
    bare = dict(d["text_config"])
    assert C.Glm5Config.from_hf_dict(bare).replace(fp8_block=cfg.fp8_block) == cfg


@pytest.mark.skipif(not os.path.isdir(ORACLE), reason="../shared/oracle not present")
def test_reads_the_oracle_config():
  cfg = C.Glm5Config.from_json(os.path.join(ORACLE, "golden_seed0", "checkpoint"))
  assert cfg == C.oracle_tiny(mtp=False)
  assert C.Glm5Config.from_json(os.path.join(ORACLE, "golden_seed0_fp8", "checkpoint_fp8")).fp8_block == (128, 128)


@pytest.mark.parametrize("field,value,expect", [
    ("qk_rope_head_dim", 64, "0 (GLM-5.3-Flash's MLA is NoPE)"),
    ("n_group", 2, "(1, 1)"),
    ("topk_group", 3, "(1, 1)"),
    ("index_topk", 2050, "a multiple of index_kpool=4"),
    ("tie_word_embeddings", True, "False"),
    ("hidden_size", 0, "a positive integer"),
    ("num_experts_per_tok", 300, "<= n_routed_experts=288"),
])
def test_validation_names_field_value_and_expectation(field, value, expect):
  with pytest.raises(ValueError) as e:
    C.real().replace(**{field: value})
  msg = str(e.value)
  assert f"Glm5Config.{field}" in msg, msg  # the field ...
  assert str(value) in msg, msg  # ... the value ...
  assert expect in msg, msg  # ... and what was expected


def test_layer_pattern_is_checked():
  with pytest.raises(ValueError, match=r"layer_types=.* expected 45 entries"):
    C.real().replace(layer_types=("linear_attention",) * 44)
  with pytest.raises(ValueError, match=r"layer_types\[2\]='mamba' is invalid"):
    C.oracle_tiny().replace(layer_types=("linear_attention",) * 2 + ("mamba",) + ("linear_attention",) * 5)


def test_bad_config_json(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
  with pytest.raises(ValueError, match=r"model_type='llama' is not supported: expected 'glm5_next' or 'glm5_next_text'"):
    C.Glm5Config.from_json(tmp_path)
  with pytest.raises(FileNotFoundError, match="no config.json"):
    C.Glm5Config.from_json(tmp_path / "nowhere")
  d = C.oracle_tiny().to_hf_dict()
  d["text_config"]["indexer_types"] = ["shared"] * 8
  with pytest.raises(ValueError, match="indexer_types"):
    C.Glm5Config.from_hf_dict(d)
