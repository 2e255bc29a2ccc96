# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Loading a real GLM-5.3-Flash checkpoint on GPUs
#
# Point `GLM5_CHECKPOINT` at a Hugging Face directory of the release (`config.json`, `model.safetensors.index.json`,
# 62 shards, FP8 with `weight_scale_inv`; `tokenizer.json` for text). The loader memory-maps every shard and puts
# each tensor straight into its device shards (each GPU reads only its slice; FP8 stays FP8). At TP4 a device holds
# ≈82 GB of parameters (`glm5-jax memory --tp 4`). Without the variable this notebook only prints the plan.

# %%
import os
import numpy as np
import jax

import glm5_jax

path = os.environ.get("GLM5_CHECKPOINT")
tp = min(4, len(jax.devices()))
print("devices:", jax.devices())
if not path:
  print("GLM5_CHECKPOINT is not set: nothing to load. The steps below run when it is:")
  print("  model = glm5_jax.load_model(path, tp=4)             # FP8 release, bf16 compute")
  print("  dep = glm5_jax.DeploymentConfig(model=model.cfg, tensor_parallel_size=4, kv_cache_dtype='fp8',")
  print("        num_speculative_tokens=3, additional_config={'decode_backend': 'latency_specialized'})")
  print("  dec = glm5_jax.Decoder.from_deployment(model, dep); dec.warmup()")

# %%
if path:
  model = glm5_jax.load_model(path, tp=tp, progress=True)
  dep = glm5_jax.DeploymentConfig(model=model.cfg, tensor_parallel_size=tp, kv_cache_dtype="fp8",
                                  num_speculative_tokens=3, max_model_len=8192, capture_sizes=(1,),
                                  additional_config={"decode_backend": "latency_specialized"})
  from glm5_jax.runtime import unsupported
  print("unsupported:", unsupported(dep) or "none")
  dec = glm5_jax.Decoder.from_deployment(model, dep)
  from tokenizers import Tokenizer
  tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
  ids = tok.encode("The capital of France is").ids
  out, stats = dec.generate([ids], 32)
  print(tok.decode(out[0]), stats)
