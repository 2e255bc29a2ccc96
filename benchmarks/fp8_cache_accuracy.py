"""Accuracy of the FP8 KV cache (latent: e4m3 + fp32 scale per 128; indexer: Hadamard + e4m3 + power-of-two
scale) against the unquantised cache, on the kernel-tiny model (real per-head sizes, FP8 weights, fp32 compute).

  python benchmarks/fp8_cache_accuracy.py [--steps 64]

Prints (1) the sparse-MLA output error of the FP8 latent cache against fp32 latents on random data, and (2) the
agreement of 64 greedy decode steps (q = 1) with the FP8 cache against the same model with an fp32 cache.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import glm5_jax  # noqa: E402
from checkpoints.make_tiny import builtin_checkpoint  # noqa: E402
from pallas_kernels import sparse_mla as ks  # noqa: E402


def attention_error(rng, B=2, T=4, H=16, S=2048, W=2051):
  c = jnp.asarray(rng.standard_normal((B, S, 512)), jnp.float32)  # RMSNorm'd latents are O(1)
  q = jnp.asarray(rng.standard_normal((B, T, H, 512)) / 16, jnp.float32)
  idx = jnp.asarray(rng.integers(0, S, (B, T, W)), jnp.int32)
  o8 = ks.sparse_mla_decode_reference(q, ks.quantize_latent(c), idx, softmax_scale=1 / 16)
  # the fp32 reference: the same softmax over unquantised latents
  bi = jnp.arange(B)[:, None, None]
  cs = c[bi, idx]
  s = jnp.einsum("bthd,btwd->bthw", q, cs, precision="highest") / 16
  o32 = jnp.einsum("bthw,btwd->bthd", jax.nn.softmax(s, -1), cs, precision="highest")
  return float(jnp.linalg.norm(o8 - o32) / jnp.linalg.norm(o32)), float(jnp.abs(o8 - o32).max())


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--steps", type=int, default=64)
  a = p.parse_args(argv)
  rng = np.random.default_rng(0)
  rel, mx = attention_error(rng)
  print(f"sparse MLA output, FP8 latent vs fp32 latent: relative error {rel:.2e}, max abs {mx:.2e}")
  model = glm5_jax.load_model(builtin_checkpoint("kernel-tiny"), dtype="float32")
  prompt = rng.integers(0, model.cfg.vocab_size, 40)
  outs = {}
  for kv in ("auto", "fp8"):
    dec = glm5_jax.Decoder(model, glm5_jax.DecodeConfig(max_context=256, q=1, capture_sizes=(1,),
                                                        policy=(("kv_cache_dtype", kv),)), prefill_chunk=64)
    outs[kv], _ = dec.generate([prompt], a.steps)
  x, y = np.array(outs["auto"][0]), np.array(outs["fp8"][0])
  same = x == y
  prefix = int(np.argmin(same)) if not same.all() else len(x)
  print(f"greedy tokens over {a.steps} steps, FP8 cache vs fp32 cache: {same.mean():.1%} equal position-wise, "
        f"identical prefix {prefix} tokens")


if __name__ == "__main__":
  main()
