#!/usr/bin/env python
"""Hugging Face goldens for the JAX port, on checkpoints written by checkpoints/make_tiny.py.

Runs in a separate venv with torch (CPU) and transformers 5.23.0; it never imports jax:

    python3 -m venv /work/hfvenv
    /work/hfvenv/bin/pip install torch==2.13.0        # the CPU wheel
    /work/hfvenv/bin/pip install transformers==5.23.0 safetensors numpy ml_dtypes
    /work/hfvenv/bin/python tests/goldens/make_goldens.py            # all cases -> tests/goldens/*.npz
    /work/hfvenv/bin/python tests/goldens/make_goldens.py --case hf_geom12_s2_f32

For every case it generates the checkpoint with make_tiny (recording the sha256 of model.safetensors, so a
generator drift is caught by tests/test_goldens_files.py), loads it with
``Glm5NextForConditionalGeneration.from_pretrained(dir, dtype=float32, attn_implementation="eager",
experts_implementation="eager")``, checks that every HF parameter equals the generator's tensor bit for bit,
draws prompts until no discrete decision is near a tie, and writes ``<case>.npz`` (compressed) with:

  prompt [S] int32, logits_full [S,V], logits_incremental [S,V] (prefill `prefill_len`, then one token at a
  time on a DynamicCache), logits_chunked [S,V] (chunks `chunk_sizes` on one cache), gen_tokens [G] (greedy),
  gen_step_logits [G,V] (row i chose gen_tokens[i]), final_hidden [S,D] (input of lm_head), layer_hidden
  [L,S,D] (mean over the mHC streams of each decoder layer's output; a debugging aid), mla_layers /
  indexer_topk [n_mla,S,width] (-1 padded, compare as SETS), moe_layers / router_topk [n_moe,S,k] (sorted),
  meta (a JSON string: make_tiny args, sha256, versions, margins, self-consistency diffs, HF load report).

The bf16w case stores a subset (see CASES). FP8 cases run HF on the DEQUANTISED float32 weights (HF 5.23's
own FP8 loader infers the block from the scale grid and is wrong for partial edge blocks, see
../shared/oracle/README.md): the FP8 file is read back, dequantised with numpy and saved as a plain fp32
checkpoint, which HF loads.

Tie screening (as the oracle): over a cache-free pass on prompt + the greedy continuation, every indexer query
that really selects must have (last kept - first dropped pool score) >= 2e-4 x that query's score spread,
every router a sigmoid(+bias) gap >= 1e-4 between the k-th and (k+1)-th expert, and every greedy step a
top1 - top2 logit gap >= 1e-3. Prompts are drawn from default_rng([seed, 7, attempt]) until one passes.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from checkpoints import make_tiny as mt  # noqa: E402  (numpy only; loads glm5_jax/config.py without jax)

import transformers  # noqa: E402
from transformers import Glm5NextForConditionalGeneration  # noqa: E402
from transformers.cache_utils import DynamicCache  # noqa: E402
from transformers.models.glm5_next import modeling_glm5_next as hf_glm  # noqa: E402

THRESHOLDS = {"index": 2e-4, "router": 1e-4, "argmax": 1e-3}
N_GEN = 16

# The geometry (d): every size differs from oracle-tiny so nothing in the port is tuned to one shape.
GEOM12 = dict(
    vocab_size=384, hidden_size=192, num_hidden_layers=12, mlp_layer_types=["dense"] * 2 + ["sparse"] * 10,
    linear_num_heads=3, linear_head_dim=64, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=80,
    kv_lora_rank=48, qk_nope_head_dim=40, v_head_dim=24, index_n_heads=8, index_head_dim=16, index_topk=8,
    index_kpool=4, n_routed_experts=6, num_experts_per_tok=3, moe_intermediate_size=40, intermediate_size=200,
    swiglu_limit=5.0)

FULL = ("logits_full", "logits_incremental", "logits_chunked", "gen_tokens", "gen_step_logits", "final_hidden",
        "layer_hidden", "indexer_topk", "router_topk")
CASES = {
    # (a) oracle-tiny geometry, float32 weights
    "hf_oracle_tiny_s0_f32": dict(preset="oracle-tiny", overrides={}, seed=0, dtype="float32", prompt_len=40,
                                  prefill=24, chunks=[13, 11, 7, 1, 8], arrays=FULL,
                                  screen_also="hf_oracle_tiny_s0_bf16w"),
    # (b) the same draw stored as a bf16 checkpoint, computed in fp32; same prompt as (a) (screened for both)
    "hf_oracle_tiny_s0_bf16w": dict(preset="oracle-tiny", overrides={}, seed=0, dtype="bfloat16", prompt_len=40,
                                    prefill=24, chunks=[13, 11, 7, 1, 8], prompt_from="hf_oracle_tiny_s0_f32",
                                    arrays=("logits_full", "logits_incremental", "gen_tokens", "gen_step_logits",
                                            "indexer_topk", "router_topk")),
    # (c) oracle-tiny geometry, seed 1, FP8 checkpoint (partial 128-blocks: 320, 96, 48 rows/cols)
    "hf_oracle_tiny_s1_fp8": dict(preset="oracle-tiny", overrides={}, seed=1, dtype="fp8", prompt_len=40,
                                  prefill=24, chunks=[13, 11, 7, 1, 8], arrays=FULL),
    # (d) a different geometry: 12 layers (3 DSA), hidden 192, ...
    "hf_geom12_s2_f32": dict(preset="oracle-tiny", overrides=GEOM12, seed=2, dtype="float32", prompt_len=48,
                             prefill=24, chunks=[13, 11, 7, 1, 8, 8], arrays=FULL),
}


# ------------------------------------------------------------------------------------------------ helpers
def case_config(spec):
  return mt.preset_config(spec["preset"], mtp=True, **spec["overrides"])


def read_safetensors(path) -> dict[str, np.ndarray]:
  """All tensors of one file (header + np.frombuffer), including F8_E4M3 via ml_dtypes."""
  types = {"F32": np.float32, "BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn}
  buf = Path(path).read_bytes()
  n = int.from_bytes(buf[:8], "little")
  head = json.loads(buf[8:8 + n])
  head.pop("__metadata__", None)
  out = {}
  for name, h in head.items():
    lo, hi = h["data_offsets"]
    out[name] = np.frombuffer(buf, types[h["dtype"]], (hi - lo) // np.dtype(types[h["dtype"]]).itemsize,
                              8 + n + lo).reshape(h["shape"])
  return out


def write_dequantised(fp8_dir, out_dir, cfg, weights_f32) -> tuple[dict, dict[str, np.ndarray]]:
  """fp8 checkpoint -> plain fp32 checkpoint of the dequantised weights (what HF is run on). Also checks the
  numpy quantiser against torch's float8 cast (both must round to nearest even)."""
  disk = read_safetensors(os.path.join(fp8_dir, "model.safetensors"))
  block = tuple(cfg.fp8_block or (128, 128))
  deq, n_q, worst = {}, 0, 0.0
  for name, a in disk.items():
    if name.endswith("_scale_inv"):
      continue
    s = disk.get(name + "_scale_inv")
    if s is None:
      deq[name] = np.array(a)
      continue
    n_q += 1
    deq[name] = mt.dequantize_fp8_block(a, s, block)
    w = weights_f32[name]
    # independent quantiser: torch's e4m3 cast of the same w / s
    full = torch.from_numpy(np.repeat(np.repeat(s, block[0], 0), block[1], 1)[: w.shape[0], : w.shape[1]].copy())
    t8 = (torch.from_numpy(w) / full).clamp(-mt.FP8_MAX, mt.FP8_MAX).to(torch.float8_e4m3fn)
    assert np.array_equal(t8.view(torch.uint8).numpy(), a.view(np.uint8)), f"numpy vs torch e4m3 rounding: {name}"
    worst = max(worst, float(np.linalg.norm(deq[name] - w) / np.linalg.norm(w)))
  os.makedirs(out_dir, exist_ok=True)
  conf = json.load(open(os.path.join(fp8_dir, "config.json")))
  conf.pop("quantization_config")
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(conf, f, indent=2)
  shutil.copy(os.path.join(fp8_dir, "generation_config.json"), out_dir)
  mt.write_safetensors(os.path.join(out_dir, "model.safetensors"), deq, {"format": "pt"})
  return {"n_fp8_weights": n_q, "max_rel_fro_error": worst, "numpy_equals_torch_e4m3_cast": True}, deq


def expected_hf_state(cfg, disk_f32: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """The HF in-memory state dict implied by the checkpoint tensors (HF's load-time renames/merges applied).
  The MTP layer has no HF counterpart."""
  out, lm = {}, "model.language_model.layers."
  ren = {"hc_attn_fn": "attn_hc.fn", "hc_attn_base": "attn_hc.base", "hc_attn_scale": "attn_hc.scale",
         "hc_ffn_fn": "ffn_hc.fn", "hc_ffn_base": "ffn_hc.base", "hc_ffn_scale": "ffn_hc.scale",
         "self_attn.f_a_proj.weight": "self_attn.forget_gate.f_a_proj.weight",
         "self_attn.f_b_proj.weight": "self_attn.forget_gate.f_b_proj.weight",
         "self_attn.dt_bias": "self_attn.forget_gate.dt_bias", "self_attn.A_log": "self_attn.forget_gate.A_log"}
  for name, a in disk_f32.items():
    if not name.startswith(lm):
      out[name] = a
      continue
    i, rest = name[len(lm):].split(".", 1)
    if int(i) >= cfg.num_hidden_layers or rest.startswith(("self_attn.q_conv1d", "self_attn.k_conv1d",
                                                            "self_attn.v_conv1d", "mlp.experts.")):
      continue
    out[f"{lm}{i}.{ren.get(rest, rest)}"] = a
  for i in range(cfg.num_hidden_layers):
    p = f"{lm}{i}."
    if cfg.layer_types[i] == "linear_attention":
      out[p + "self_attn.conv1d.weight"] = np.concatenate(
          [disk_f32[f"{p}self_attn.{x}_conv1d.weight"] for x in "qkv"], 0)
    if cfg.mlp_layer_types[i] == "sparse":
      e = range(cfg.n_routed_experts)
      out[p + "mlp.experts.gate_up_proj"] = np.stack([np.concatenate(
          [disk_f32[f"{p}mlp.experts.{j}.gate_proj.weight"], disk_f32[f"{p}mlp.experts.{j}.up_proj.weight"]], 0)
          for j in e])
      out[p + "mlp.experts.down_proj"] = np.stack([disk_f32[f"{p}mlp.experts.{j}.down_proj.weight"] for j in e])
  return out


def load_hf(ckpt_dir, cfg, disk_f32) -> tuple[torch.nn.Module, dict]:
  """from_pretrained + a bit-exact check of every HF tensor against the checkpoint."""
  model, info = Glm5NextForConditionalGeneration.from_pretrained(
      ckpt_dir, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager",
      output_loading_info=True)
  model.eval()
  mtp_prefix = f"model.language_model.layers.{cfg.num_hidden_layers}."
  missing = sorted(info["missing_keys"])
  unexpected = sorted(info["unexpected_keys"])
  assert not missing, f"HF did not find {missing[:10]} (it would random-init them)"
  assert all(k.startswith(mtp_prefix) for k in unexpected), f"unexpected keys outside the MTP layer: {unexpected}"
  want = expected_hf_state(cfg, disk_f32)
  sd = model.state_dict()
  assert set(sd) == set(want), (sorted(set(sd) - set(want))[:10], sorted(set(want) - set(sd))[:10])
  for k, v in sd.items():
    assert v.dtype == torch.float32, (k, v.dtype)
    assert np.array_equal(v.numpy(), want[k]), f"HF tensor {k} differs from the checkpoint"
  report = {"missing_keys": missing, "n_unexpected_keys": len(unexpected),
            "unexpected_keys_all_in_mtp_layer": True, "n_hf_tensors_checked_bitwise": len(sd)}
  return model, report


# ------------------------------------------------------------------------------------------------ probes
class Probe:
  """Forward hooks: indexer output and tie margins, router choices and gaps, decoder-layer outputs."""

  def __init__(self, model, cfg):
    self.cfg = cfg
    self.handles = []
    lm = model.model.language_model
    for i, layer in enumerate(lm.layers):
      self.handles.append(layer.register_forward_hook(self._layer(i)))
      if isinstance(layer.self_attn, hf_glm.Glm5NextTextAttention):
        self.handles.append(layer.self_attn.indexer.register_forward_hook(self._indexer(i), with_kwargs=True))
      if isinstance(layer.mlp, hf_glm.Glm5NextTextMoE):
        self.handles.append(layer.mlp.gate.register_forward_hook(self._router(i)))
    self.reset()

  def reset(self):
    self.layer_hidden, self.topk, self.index_margin, self.index_mismatch = {}, {}, {}, {}
    self.router_topk, self.router_gap = {}, {}

  def close(self):
    for h in self.handles:
      h.remove()

  def _layer(self, i):
    def hook(mod, args, out):
      self.layer_hidden.setdefault(i, []).append(out[0].detach()[0].float().mean(1).clone())  # [S, D]
    return hook

  def _router(self, i):
    def hook(mod, args, out):
      logits, _, idx = out
      s = logits.float().sigmoid() + mod.e_score_correction_bias.float()
      srt = s.sort(-1, descending=True).values
      self.router_gap.setdefault(i, []).append((srt[:, mod.top_k - 1] - srt[:, mod.top_k]).clone())
      self.router_topk.setdefault(i, []).append(idx.sort(-1).values.clone())
    return hook

  def _indexer(self, i):
    def hook(mod, args, kwargs, out):
      self.topk.setdefault(i, []).append(out.detach()[0].clone())
      if kwargs.get("past_key_values") is None:  # margins on cache-free passes (batch 1, no padding)
        m, bad = pool_margins(mod, kwargs["hidden_states"], kwargs["q_resid"], out[0])
        self.index_margin.setdefault(i, []).append(m)
        self.index_mismatch[i] = self.index_mismatch.get(i, 0) + bad
    return hook


@torch.no_grad()
def pool_margins(mod, h, q_resid, hf_topk) -> tuple[torch.Tensor, int]:
  """Recompute the kpool indexer scores of a cache-free unpadded pass (our own code, from the weights) and
  return per query the relative gap between the last kept and the first dropped pool (NaN where nothing is
  dropped), plus the number of queries whose selection differs from HF's (must be 0: validates the recompute).
  """
  h, q_resid = h[0].float(), q_resid[0].float()
  s_len, kp, nh, hd = h.shape[0], mod.index_kpool, mod.n_heads, mod.head_dim
  q = mod.wq_b(q_resid).view(s_len, nh, hd)
  k = mod.k_norm(mod.wk(h))  # [S, hd]
  g = h @ mod.index_kpool_compress_gate.float().T  # [S, hd]
  n_pool = s_len // kp  # complete pools only
  kk = k[: n_pool * kp].view(n_pool, kp, hd)
  gg = g[: n_pool * kp].view(n_pool, kp, hd) + mod.index_kpool_compress_ape.float()[None]
  pool_key = (gg.softmax(1) * kk).sum(1)  # [P, hd]: per-channel softmax over the pool's positions
  w = mod.weights_proj(h).float() * nh ** -0.5  # [S, H]
  score = torch.einsum("sh,shp->sp", w, F.relu(torch.einsum("shd,pd->shp", q, pool_key) * hd ** -0.5))
  sel = mod.index_topk // kp
  margins = torch.full((s_len,), float("nan"))
  mismatch = 0
  for t in range(s_len):
    n_vis = (t + 1) // kp  # pools whose last token is <= t
    sc = score[t, :n_vis]
    order = sc.argsort(descending=True)
    if n_vis > sel:
      srt = sc[order]
      margins[t] = (srt[sel - 1] - srt[sel]) / (srt[0] - srt[-1]).abs().clamp_min(1e-12)
    keep = order[:sel].tolist()
    mine = {p * kp + j for p in keep for j in range(kp)} | set(range(n_vis * kp, t + 1))
    theirs = set(hf_topk[t].tolist()) - {-1}
    mismatch += mine != theirs
  return margins, mismatch


# ------------------------------------------------------------------------------------------------ runs
@torch.no_grad()
def full_logits(model, ids):
  return model(input_ids=ids, use_cache=False).logits[0].float()


@torch.no_grad()
def chunked_logits(model, ids, sizes):
  cache, outs, pos = DynamicCache(config=model.config), [], 0
  for c in sizes:
    outs.append(model(input_ids=ids[:, pos:pos + c], past_key_values=cache, use_cache=True).logits[0].float())
    pos += c
  assert pos == ids.shape[1]
  return torch.cat(outs)


@torch.no_grad()
def greedy(model, ids, n):
  cache = DynamicCache(config=model.config)
  last = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1].float()
  toks, rows = [], []
  for _ in range(n):
    rows.append(last)
    toks.append(int(last.argmax()))
    last = model(input_ids=torch.tensor([[toks[-1]]]), past_key_values=cache, use_cache=True).logits[0, -1].float()
  return toks, torch.stack(rows)


def margins_of(model, probe, ids, prompt_len):
  """Greedy-continue, then measure every discrete decision on a cache-free pass over prompt + continuation."""
  toks, _ = greedy(model, ids, N_GEN)
  probe.reset()
  seq = torch.cat([ids, torch.tensor([toks])], 1)
  logits = full_logits(model, seq)
  idx = torch.cat([torch.cat(v) for v in probe.index_margin.values()])
  idx = idx[~torch.isnan(idx)]
  rg = torch.cat([torch.cat(v) for v in probe.router_gap.values()])
  top2 = logits[prompt_len - 1:-1].topk(2, -1).values
  am = top2[:, 0] - top2[:, 1]
  return toks, {
      "min_index_margin": float(idx.min()) if idx.numel() else float("nan"),
      "sparse_queries": int(idx.numel()),
      "index_recompute_mismatches": int(sum(probe.index_mismatch.values())),
      "min_router_margin": float(rg.min()),
      "min_argmax_margin": float(am.min()),
      "argmax_matches_cached_greedy": bool((logits[prompt_len - 1:-1].argmax(-1) == torch.tensor(toks)).all()),
  }


def margins_ok(m):
  return (m["sparse_queries"] > 0 and m["index_recompute_mismatches"] == 0 and m["argmax_matches_cached_greedy"]
          and m["min_index_margin"] >= THRESHOLDS["index"] and m["min_router_margin"] >= THRESHOLDS["router"]
          and m["min_argmax_margin"] >= THRESHOLDS["argmax"])


def maxdiff(a, b):
  return float((a - b).abs().max())


# ------------------------------------------------------------------------------------------------ cases
class Built:
  """A generated checkpoint loaded in HF, with its probe."""

  def __init__(self, name, spec, work):
    self.name, self.spec = name, spec
    self.cfg = cfg = case_config(spec)
    d = os.path.join(work, name)
    t0 = time.time()
    mt.write_checkpoint(cfg, d, seed=spec["seed"], dtype=spec["dtype"])
    self.gen_s = time.time() - t0
    self.sha256 = mt.file_sha256(os.path.join(d, "model.safetensors"))
    weights = mt.draw_weights(cfg, spec["seed"], vision=True)
    self.fp8 = None
    if spec["dtype"] == "fp8":
      self.fp8, disk = write_dequantised(d, d + "_dequantised", cfg, weights)
      load_dir = d + "_dequantised"
    else:
      disk = {k: np.asarray(v, np.float32) for k, v in read_safetensors(os.path.join(d, "model.safetensors")).items()}
      # the stored tensors are the float32 draw (float32) or its RNE bf16 rounding (bfloat16 checkpoint)
      for k, w in weights.items():
        ref = w if spec["dtype"] == "float32" or mt.keeps_f32_in_bf16(k) else w.astype(ml_dtypes.bfloat16)
        assert np.array_equal(disk[k], np.asarray(ref, np.float32)), k
      load_dir = d
    self.model, self.load_report = load_hf(load_dir, cfg, disk)
    self.probe = Probe(self.model, cfg)

  def close(self):
    self.probe.close()


def choose_prompt(built: list[Built], spec, max_tries):
  cfg = built[0].cfg
  special = set(mt.special_token_ids(cfg).values())
  allowed = np.array([t for t in range(cfg.vocab_size) if t not in special])
  tries = []
  for attempt in range(max_tries):
    rng = np.random.default_rng([spec["seed"], 7, attempt])
    ids = torch.tensor(rng.choice(allowed, size=spec["prompt_len"])[None], dtype=torch.long)
    entry, ok = {"attempt": attempt}, True
    for b in built:
      _, m = margins_of(b.model, b.probe, ids, spec["prompt_len"])
      entry[b.name] = m
      ok = margins_ok(m)
      if not ok:
        break
    tries.append(entry)
    print(f"  attempt {attempt}: {'ok' if ok else 'rejected'} {json.dumps(entry)}", flush=True)
    if ok:
      return ids, attempt, entry, tries[:-1]
  raise SystemExit(f"no prompt met the margins in {max_tries} tries")


@torch.no_grad()
def run_case(b: Built, ids, arrays):
  spec, cfg, model, probe = b.spec, b.cfg, b.model, b.probe
  s_len = ids.shape[1]
  probe.reset()
  logits_full = full_logits(model, ids)
  topk = torch.stack([probe.topk[i][0] for i in cfg.dsa_layers]).numpy().astype(np.int32)
  router = torch.stack([probe.router_topk[i][0] for i in range(cfg.num_hidden_layers)
                        if cfg.mlp_layer_types[i] == "sparse"]).numpy().astype(np.int32)
  layer_hidden = torch.stack([probe.layer_hidden[i][0] for i in range(cfg.num_hidden_layers)]).numpy()
  final_hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state[0].float()
  assert maxdiff(model.lm_head(final_hidden), logits_full) < 1e-4
  inc = chunked_logits(model, ids, [spec["prefill"]] + [1] * (s_len - spec["prefill"]))
  chunked = chunked_logits(model, ids, spec["chunks"])
  toks, step_logits = greedy(model, ids, N_GEN)
  seq_logits = full_logits(model, torch.cat([ids, torch.tensor([toks])], 1))
  moe = [i for i in range(cfg.num_hidden_layers) if cfg.mlp_layer_types[i] == "sparse"]
  all_arrays = dict(
      prompt=ids[0].numpy().astype(np.int32), logits_full=logits_full.numpy(), logits_incremental=inc.numpy(),
      logits_chunked=chunked.numpy(), gen_tokens=np.array(toks, np.int32), gen_step_logits=step_logits.numpy(),
      final_hidden=final_hidden.numpy(), layer_hidden=layer_hidden, mla_layers=np.array(cfg.dsa_layers, np.int32),
      indexer_topk=topk, moe_layers=np.array(moe, np.int32), router_topk=router,
      prefill_len=np.int32(spec["prefill"]), chunk_sizes=np.array(spec["chunks"], np.int32))
  keep = {"prompt", "prefill_len"} | set(arrays)
  if "logits_chunked" in arrays:
    keep.add("chunk_sizes")
  if "indexer_topk" in arrays:
    keep.add("mla_layers")
  if "router_topk" in arrays:
    keep.add("moe_layers")
  diffs = dict(
      full_vs_incremental=maxdiff(logits_full, inc), full_vs_chunked=maxdiff(logits_full, chunked),
      gen_step_logits_vs_full_pass_over_prompt_plus_gen=maxdiff(step_logits, seq_logits[s_len - 1:-1]),
      logits_abs_max=float(logits_full.abs().max()), logits_std=float(logits_full.std()),
      dense_queries_per_mla_layer=[int(sum(len(set(r) - {-1}) == t + 1 for t, r in enumerate(x.tolist())))
                                   for x in topk])
  return {k: v for k, v in all_arrays.items() if k in keep}, diffs


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--case", action="append", choices=sorted(CASES), help="only these cases (default: all)")
  p.add_argument("--out", default=str(Path(__file__).resolve().parent))
  p.add_argument("--threads", type=int, default=2)
  p.add_argument("--max-tries", type=int, default=100)
  p.add_argument("--keep", help="keep the generated checkpoints in this directory")
  a = p.parse_args(argv)
  torch.set_num_threads(a.threads)
  transformers.logging.set_verbosity_error()  # the MTP layer's "UNEXPECTED" table; the load report is in meta
  os.makedirs(a.out, exist_ok=True)
  names = a.case or list(CASES)
  # a case whose prompt comes from another is run together with it
  todo = [n for n in names if "prompt_from" not in CASES[n]]
  todo += [CASES[n]["prompt_from"] for n in names if "prompt_from" in CASES[n] and CASES[n]["prompt_from"] not in todo]
  work = a.keep or tempfile.mkdtemp(prefix="glm5_goldens_")
  versions = dict(transformers=transformers.__version__, torch=torch.__version__, numpy=np.__version__,
                  python=platform.python_version(), machine=platform.machine(), torch_threads=torch.get_num_threads())
  present = [m for m in ("fla", "causal_conv1d", "kernels") if importlib.util.find_spec(m) is not None]
  if present:
    raise SystemExit(f"optimized kernel packages installed ({present}); the goldens need HF's torch reference code")
  manifest_path = Path(a.out) / "manifest.json"
  manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
  try:
    for name in todo:
      spec = CASES[name]
      group = [name] + [n for n in (spec.get("screen_also"),) if n]
      t0 = time.time()
      print(f"== {' + '.join(group)}", flush=True)
      built = [Built(n, CASES[n], work) for n in group]
      print(f"  generated + loaded in {time.time() - t0:.1f} s", flush=True)
      ids, attempt, accepted, rejected = choose_prompt(built, spec, a.max_tries)
      for b in built:
        arrays, diffs = run_case(b, ids, b.spec["arrays"])
        meta = dict(
            case=b.name, generator="tests/goldens/make_goldens.py",
            make_tiny=dict(preset=b.spec["preset"], overrides=b.spec["overrides"], seed=b.spec["seed"],
                           dtype=b.spec["dtype"], mtp=True, shards=1, vision=True),
            # flat copies of make_tiny's main args for callers that want them at the top level
            preset=b.spec["preset"], overrides=b.spec["overrides"], seed=b.spec["seed"], dtype=b.spec["dtype"],
            config=b.cfg.to_hf_dict()["text_config"],
            sha256={"model.safetensors": b.sha256}, generate_s=round(b.gen_s, 3),
            hf=dict(model="Glm5NextForConditionalGeneration", dtype="float32", attn_implementation="eager",
                    experts_implementation="eager", cache="DynamicCache(config=model.config)",
                    weights="dequantised fp32 checkpoint" if b.fp8 else
                    ("bf16 checkpoint upcast to fp32" if b.spec["dtype"] == "bfloat16" else "fp32 checkpoint"),
                    load_report=b.load_report),
            fp8=b.fp8, versions=versions,
            prompt_selection=dict(seed_sequence=[b.spec["seed"], 7, attempt], attempt=attempt, thresholds=THRESHOLDS,
                                  screened_models=group, accepted=accepted, n_rejected=len(rejected),
                                  rejected=rejected[:5], margins=accepted[b.name]),
            prefill_len=b.spec["prefill"], chunk_sizes=b.spec["chunks"], n_gen=N_GEN, diffs=diffs,
            arrays={k: [list(np.shape(v)), str(np.asarray(v).dtype)] for k, v in arrays.items()})
        path = Path(a.out) / f"{b.name}.npz"
        np.savez_compressed(path, meta=np.array(json.dumps(meta, default=float)), **arrays)
        manifest[b.name] = dict(file=path.name, bytes=path.stat().st_size, make_tiny=meta["make_tiny"],
                                sha256=meta["sha256"], margins=accepted[b.name], attempt=attempt, diffs=diffs,
                                versions=versions)
        print(f"  wrote {path} ({path.stat().st_size:,d} B) diffs={json.dumps(diffs)}", flush=True)
      for b in built:
        b.close()
      print(f"  {time.time() - t0:.1f} s", flush=True)
  finally:
    if not a.keep:
      shutil.rmtree(work, ignore_errors=True)
  manifest = {k: manifest[k] for k in sorted(manifest)}
  manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")


if __name__ == "__main__":
  main()
