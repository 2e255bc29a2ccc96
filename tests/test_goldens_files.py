"""Fast checks of checkpoints/make_tiny.py and of the provenance of the Hugging Face goldens (no torch).

* every golden's recorded sha256 equals a freshly generated checkpoint's (the generator is deterministic and has
  not drifted since the goldens were made: a drift would make the goldens describe other weights);
* make_tiny round-trips: an independent reader written here (u64 header length, JSON header, np.memmap) finds
  exactly the expected names, shapes and dtypes; float32 tensors equal the draw, bf16 ones its RNE rounding,
  and FP8 ones dequantise to the draw within the e4m3 error bound;
* the writer is byte-identical to the safetensors library, config.json parses back to the same Glm5Config,
  sharded checkpoints have a consistent index, and builtin_checkpoint caches.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from checkpoints import make_tiny as mt
from glm5_jax.config import Glm5Config, kernel_tiny, oracle_tiny

GOLDEN_DIR = Path(__file__).parent / "goldens"
GOLDENS = sorted(GOLDEN_DIR.glob("*.npz"))
EXPECTED_CASES = {"hf_oracle_tiny_s0_f32", "hf_oracle_tiny_s0_bf16w", "hf_oracle_tiny_s1_fp8", "hf_geom12_s2_f32"}
_NP = {"F32": np.dtype(np.float32), "BF16": np.dtype(ml_dtypes.bfloat16),
       "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn)}


# ------------------------------------------------------------------------------------------------ reader
def read_file(path) -> tuple[dict[str, np.ndarray], dict[str, str], dict]:
  """(name -> read-only memory-mapped array, name -> safetensors dtype, metadata) of one .safetensors file."""
  with open(path, "rb") as f:
    n = int.from_bytes(f.read(8), "little")
    head = json.loads(f.read(n))
  meta = head.pop("__metadata__", {})
  size = os.path.getsize(path)
  arrays, dtypes, end = {}, {}, 0
  for name, h in head.items():
    lo, hi = h["data_offsets"]
    dt = _NP[h["dtype"]]
    assert hi - lo == math.prod(h["shape"]) * dt.itemsize, name
    assert lo % dt.itemsize == 0, f"{name} misaligned"
    end = max(end, hi)
    arrays[name] = np.memmap(path, dtype=dt, mode="r", offset=8 + n + lo, shape=tuple(h["shape"]))
    dtypes[name] = h["dtype"]
  assert 8 + n + end == size, "trailing or missing bytes"
  return arrays, dtypes, meta


def read_checkpoint(d) -> tuple[dict[str, np.ndarray], dict[str, str]]:
  d = Path(d)
  idx = d / "model.safetensors.index.json"
  files = sorted(set(json.loads(idx.read_text())["weight_map"].values())) if idx.exists() else ["model.safetensors"]
  arrays, dtypes = {}, {}
  for fn in files:
    a, t, meta = read_file(d / fn)
    assert meta == {"format": "pt"}
    assert not set(a) & set(arrays), "a tensor in two shards"
    arrays.update(a)
    dtypes.update(t)
  return arrays, dtypes


def expected_dtype(cfg, name, dtype):
  if dtype == "float32":
    return "F32"
  if dtype == "bfloat16":
    return "F32" if mt.keeps_f32_in_bf16(name) else "BF16"
  if name.endswith("_scale_inv"):
    return "F32"
  return "F8_E4M3" if mt.is_fp8_weight(cfg, name) else "F32"


def dequantised(arrays, name, block=(128, 128)):
  w8, s = np.asarray(arrays[name]), np.asarray(arrays[name + "_scale_inv"])
  n, k = w8.shape
  full = np.repeat(np.repeat(s, block[0], 0), block[1], 1)[:n, :k]
  return w8.astype(np.float32) * full, full


# ------------------------------------------------------------------------------------------------ goldens
def _meta(path):
  with np.load(path) as g:
    return json.loads(str(g["meta"]))


def test_goldens_present_and_small():
  assert {p.stem for p in GOLDENS} >= EXPECTED_CASES, "run tests/goldens/make_goldens.py (see checkpoints/README.md)"
  assert sum(p.stat().st_size for p in GOLDENS) < 3_000_000


@pytest.mark.parametrize("path", GOLDENS, ids=[p.stem for p in GOLDENS])
def test_golden_checkpoint_sha256(path, tmp_path):
  m = _meta(path)
  a = m["make_tiny"]
  cfg = mt.preset_config(a["preset"], mtp=a["mtp"], **a["overrides"])
  assert cfg.to_hf_dict()["text_config"] == m["config"]
  d = mt.write_checkpoint(cfg, tmp_path / "ck", seed=a["seed"], dtype=a["dtype"], mtp=a["mtp"], shards=a["shards"],
                          vision=a["vision"])
  assert mt.file_sha256(Path(d) / "model.safetensors") == m["sha256"]["model.safetensors"], (
      "checkpoints/make_tiny.py no longer generates the weights these goldens were computed on: revert the "
      "generator change or regenerate the goldens (checkpoints/README.md)")


@pytest.mark.parametrize("path", GOLDENS, ids=[p.stem for p in GOLDENS])
def test_golden_arrays_consistent(path):
  m = _meta(path)
  a = m["make_tiny"]
  cfg = mt.preset_config(a["preset"], mtp=a["mtp"], **a["overrides"])
  assert m["versions"]["transformers"] == "5.23.0"
  assert m["hf"]["load_report"]["missing_keys"] == []
  g = np.load(path)
  s, v = g["prompt"].shape[0], cfg.vocab_size
  assert g["prompt"].dtype == np.int32 and g["prompt"].max() < v
  assert not set(g["prompt"].tolist()) & set(mt.special_token_ids(cfg).values())
  assert g["logits_full"].shape == (s, v) and g["logits_incremental"].shape == (s, v)
  assert g["gen_tokens"].shape == (m["n_gen"],) and g["gen_tokens"].max() < v
  assert np.array_equal(g["gen_step_logits"].argmax(-1), g["gen_tokens"])
  assert np.abs(g["gen_step_logits"][0] - g["logits_full"][-1]).max() < 1e-4  # row 0 = last prompt position
  if "logits_chunked" in g:
    assert g["logits_chunked"].shape == (s, v) and int(g["chunk_sizes"].sum()) == s
  # indexer: [n_mla, S, index_topk + kpool - 1], -1 padded, causal, the tail always present
  topk = g["indexer_topk"]
  assert list(g["mla_layers"]) == list(cfg.dsa_layers)
  assert topk.shape == (len(cfg.dsa_layers), s, cfg.index_width)
  for t in range(s):
    for row in topk[:, t]:
      sel = set(row.tolist()) - {-1}
      assert sel <= set(range(t + 1))
      assert set(range((t + 1) // cfg.index_kpool * cfg.index_kpool, t + 1)) <= sel  # the incomplete tail pool
      assert len(sel) == min(t + 1, cfg.index_topk + (t + 1) % cfg.index_kpool)
  moe = [i for i, k in enumerate(cfg.mlp_layer_types) if k == "sparse"]
  rt = g["router_topk"]
  assert list(g["moe_layers"]) == moe and rt.shape == (len(moe), s, cfg.num_experts_per_tok)
  assert (np.diff(rt, axis=-1) > 0).all() and rt.min() >= 0 and rt.max() < cfg.n_routed_experts
  # the recorded tie margins meet the thresholds the goldens promise
  mg, th = m["prompt_selection"]["margins"], m["prompt_selection"]["thresholds"]
  assert mg["min_index_margin"] >= th["index"] and mg["sparse_queries"] > 0
  assert mg["min_router_margin"] >= th["router"] and mg["min_argmax_margin"] >= th["argmax"]
  assert m["diffs"]["full_vs_incremental"] < 1e-4


# ------------------------------------------------------------------------------------------------ make_tiny
@pytest.fixture(scope="module")
def draw0():
  cfg = oracle_tiny()
  return cfg, mt.draw_weights(cfg, 0, vision=True)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "fp8"])
def test_roundtrip(dtype, tmp_path, draw0):
  cfg, w = draw0
  d = mt.write_checkpoint(cfg, tmp_path, seed=0, dtype=dtype)
  arrays, dtypes = read_checkpoint(d)
  specs = mt.weight_specs(cfg) + mt.vision_specs(cfg)
  names = {n for n, _, _ in specs}
  scales = {n + "_scale_inv" for n in names if dtype == "fp8" and mt.is_fp8_weight(cfg, n)}
  assert set(arrays) == names | scales
  for name, shape, _ in specs:
    assert arrays[name].shape == shape, name
    assert dtypes[name] == expected_dtype(cfg, name, dtype), name
  if dtype == "float32":
    assert all(np.array_equal(arrays[n], w[n]) for n in names)
  elif dtype == "bfloat16":
    for n in names:
      ref = w[n] if dtypes[n] == "F32" else w[n].astype(ml_dtypes.bfloat16)
      assert np.array_equal(np.asarray(arrays[n]).view(np.uint8), ref.view(np.uint8)), n
  else:
    rel = []
    for n in names:
      if n + "_scale_inv" not in arrays:
        assert np.array_equal(arrays[n], w[n]), n
        continue
      s = arrays[n + "_scale_inv"]
      assert s.shape == tuple(-(-x // 128) for x in w[n].shape) and dtypes[n + "_scale_inv"] == "F32"
      dq, full = dequantised(arrays, n)
      # e4m3: 3 mantissa bits -> half-ulp 2^-4 relative for normals, 2^-10 absolute (x s) for subnormals
      bound = np.abs(w[n]) * (2.0 ** -4 + 1e-6) + full * 2.0 ** -10
      assert (np.abs(dq - w[n]) <= bound).all(), n
      # every block's max maps to exactly ±448 (s = amax / 448)
      a8 = np.abs(np.asarray(arrays[n]).astype(np.float32))
      nb, kb = s.shape
      blocks = np.zeros((nb * 128, kb * 128), np.float32)
      blocks[:a8.shape[0], :a8.shape[1]] = a8
      assert (blocks.reshape(nb, 128, kb, 128).max(axis=(1, 3)) == 448).all(), n
      rel.append(np.linalg.norm(dq - w[n]) / np.linalg.norm(w[n]))
    assert len(rel) == len(scales) and 0.01 < max(rel) < 0.04
    # the FP8 set: 3 dense layers x 3, 5 MoE layers x (8 + 1) x 3, 2 DSA layers x 4, MTP 4 + 9 x 3
    assert len(scales) == 9 + 5 * 27 + 8 + 4 + 27


def test_fp8_quantizer_edges():
  """Partial edge blocks, an all-zero block (s = 1) and round-to-nearest-even."""
  w = np.zeros((130, 260), np.float32)
  w[:128, :128] = np.linspace(-3, 3, 128 * 128, dtype=np.float32).reshape(128, 128)
  w[128:, 256:] = 7.0  # a 2x4 edge block
  w8, s = mt.quantize_fp8_block(w)
  assert w8.dtype == ml_dtypes.float8_e4m3fn and s.shape == (2, 3) and s.dtype == np.float32
  assert s[0, 1] == 1.0 and s[1, 0] == 1.0  # all-zero blocks
  assert s[1, 2] == np.float32(7.0) / np.float32(448.0) and (w8[128:, 256:].astype(np.float32) == 448).all()
  np.testing.assert_array_equal(mt.dequantize_fp8_block(w8, s)[128:, 256:], 7.0)
  # RNE at the top binade (spacing 32): 432 is halfway 416|448 -> 448 (even), 400 is halfway 384|416 -> 384 (even)
  w8, s = mt.quantize_fp8_block(np.array([[448.0, 432.0, 400.0, -432.0]], np.float32))
  assert s[0, 0] == 1.0
  assert w8.astype(np.float32).tolist() == [[448.0, 448.0, 384.0, -448.0]]


def test_writer_matches_safetensors_library(draw0, tmp_path):
  st = pytest.importorskip("safetensors.numpy")
  cfg, w = draw0
  for dtype in mt.DTYPES:
    t = mt.to_disk_tensors(cfg, w, dtype)
    mt.write_safetensors(tmp_path / "x.safetensors", t, {"format": "pt"})
    assert (tmp_path / "x.safetensors").read_bytes() == st.save(t, metadata={"format": "pt"}), dtype


def test_config_json(tmp_path):
  cfg = oracle_tiny()
  for dtype in mt.DTYPES:
    d = mt.write_checkpoint(cfg, tmp_path / dtype, dtype=dtype)
    c = json.loads(Path(d, "config.json").read_text())
    assert c["model_type"] == "glm5_next" and c["dtype"] == ("bfloat16" if dtype == "bfloat16" else "float32")
    assert c["vision_config"]["out_hidden_size"] == cfg.hidden_size
    back = Glm5Config.from_json(d)
    assert back == cfg.replace(fp8_block=(128, 128) if dtype == "fp8" else None)
    assert ("quantization_config" in c) == (dtype == "fp8")
  q = json.loads(Path(tmp_path / "fp8" / "config.json").read_text())["quantization_config"]
  assert q["quant_method"] == "fp8" and q["fmt"] == "e4m3" and q["weight_block_size"] == [128, 128]
  assert q["activation_scheme"] == "dynamic" and list(q) == sorted(q)
  skip = set(q["modules_to_not_convert"])
  assert {"lm_head", "model.visual", "model.language_model.layers.0.self_attn.o_proj",
          "model.language_model.layers.3.self_attn.kv_b_proj", "model.language_model.layers.8.eh_proj"} <= skip
  fp8_modules = {n[:-len(".weight")] for n, _, _ in mt.weight_specs(cfg) if mt.is_fp8_weight(cfg, n)}
  assert not skip & fp8_modules
  assert "model.language_model.layers.3.self_attn.o_proj" in fp8_modules  # DSA o_proj is FP8, KDA's is not
  # kernel-tiny (an FP8 preset) written as float32 loses its quantization_config, and MTP off is recorded
  d = mt.write_checkpoint(kernel_tiny(), tmp_path / "kt", dtype="float32", mtp=False, vision=False)
  assert Glm5Config.from_json(d) == kernel_tiny(mtp=False).replace(fp8_block=None)


def test_mtp_layer_and_independence(draw0):
  cfg, w = draw0
  L, d = cfg.num_hidden_layers, cfg.hidden_size
  p = f"model.language_model.layers.{L}."
  mtp = {n[len(p):]: v for n, v in w.items() if n.startswith(p)}
  assert mtp["eh_proj.weight"].shape == (d, 2 * d)
  for k in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight", "input_layernorm.weight",
            "post_attention_layernorm.weight", "self_attn.indexer.index_kpool_compress_ape", "mlp.gate.weight",
            "mlp.gate.e_score_correction_bias", "mlp.shared_experts.down_proj.weight",
            f"mlp.experts.{cfg.n_routed_experts - 1}.up_proj.weight", "self_attn.kv_b_proj.weight"):
    assert k in mtp, k
  assert not any(k.startswith("hc_") or "shared_head.head" in k or "embed" in k for k in mtp)
  assert mt.is_fp8_weight(cfg, p + "self_attn.o_proj.weight") and not mt.is_fp8_weight(cfg, p + "eh_proj.weight")
  # turning MTP / vision off, or the dtype, never changes the other weights
  w2 = mt.draw_weights(cfg, 0, mtp=False, vision=False)
  assert set(w2) == {n for n in w if not n.startswith((p, "model.visual."))}
  assert all(np.array_equal(w[n], w2[n]) for n in w2)
  assert not np.array_equal(w["lm_head.weight"], mt.draw_weights(cfg, 1)["lm_head.weight"])


def test_init_rules_live(draw0):
  """Every path is live: no tensor is constant, norms are in [0.6, 1.4], gate/up have twice the std of down."""
  cfg, w = draw0
  for n, a in w.items():
    if not n.startswith("model.visual."):
      assert a.std() > 0, n
  norm = w["model.language_model.layers.0.input_layernorm.weight"]
  assert norm.min() >= 0.6 and norm.max() <= 1.4
  up = w["model.language_model.layers.0.mlp.up_proj.weight"]
  assert abs(up.std() * math.sqrt(cfg.hidden_size) - 2) < 0.05
  dt = w["model.language_model.layers.0.self_attn.dt_bias"]
  sp = np.log1p(np.exp(dt.astype(np.float64)))  # softplus(dt_bias) in [1e-3, 1e-1]
  assert sp.min() >= 1e-3 * 0.999 and sp.max() <= 0.1 * 1.001


def test_sharded(tmp_path):
  cfg = oracle_tiny()
  one, _ = read_checkpoint(mt.write_checkpoint(cfg, tmp_path / "one", seed=3, dtype="fp8"))
  d = mt.write_checkpoint(cfg, tmp_path / "three", seed=3, dtype="fp8", shards=3)
  files = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
  assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
  idx = json.loads(Path(d, "model.safetensors.index.json").read_text())
  arrays, _ = read_checkpoint(d)
  assert set(idx["weight_map"]) == set(arrays) == set(one)
  assert idx["metadata"]["total_size"] == sum(a.nbytes for a in arrays.values())
  assert all(np.array_equal(np.asarray(arrays[n]).view(np.uint8), np.asarray(one[n]).view(np.uint8)) for n in one)
  sizes = [os.path.getsize(Path(d, f)) for f in files]
  assert max(sizes) < 0.6 * sum(sizes)  # roughly balanced
  # rewriting a directory with fewer shards leaves no stale shard behind
  mt.write_checkpoint(cfg, d, seed=3, dtype="float32")
  assert sorted(f for f in os.listdir(d) if "safetensors" in f) == ["model.safetensors"]


def test_generation_fast(tmp_path):
  t0 = time.perf_counter()
  mt.write_checkpoint(oracle_tiny(), tmp_path, seed=0, dtype="fp8")
  assert time.perf_counter() - t0 < 2.0


def test_builtin_checkpoint_cache(tmp_path, monkeypatch):
  monkeypatch.setenv("GLM5_JAX_CACHE", str(tmp_path))
  p = mt.builtin_checkpoint("oracle-tiny", dtype="bfloat16", seed=0)
  assert Path(p) == tmp_path / "checkpoints" / "oracle-tiny-bfloat16-s0"
  stamp = os.path.getmtime(Path(p, "model.safetensors"))
  assert mt.builtin_checkpoint("oracle-tiny", dtype="bfloat16", seed=0) == p
  assert os.path.getmtime(Path(p, "model.safetensors")) == stamp  # not regenerated
  assert Glm5Config.from_json(p) == oracle_tiny()


def test_cli(tmp_path, capsys):
  mt.main(["--preset", "oracle-tiny", "--seed", "0", "--dtype", "fp8", "--shards", "2", "--out", str(tmp_path),
           "--override", "hidden_size=128"])
  assert "model-00002-of-00002.safetensors" in capsys.readouterr().out
  assert Glm5Config.from_json(tmp_path).hidden_size == 128
