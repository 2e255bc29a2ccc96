"""The benchmarks' random models must behave like trained ones where speed depends on it."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from glm5_jax.config import kernel_tiny
from glm5_jax.synthetic import random_model


def test_random_router_spreads_tokens_like_a_load_balanced_model():
  # The MoE's bytes per step grow with the distinct experts a batch routes to; a trained router's correction
  # bias keeps the load even, so N tokens reach about E·(1 − (1 − k/E)^N) experts. A bias that dominates the
  # sigmoid scores (session 24's N(0, 0.5)) sent 32 tokens to ~36 of 288 experts and made B > 1 look fast.
  E, k, n = 288, 8, 32
  # (one MoE layer of 16-wide experts: only the router matters here — at 128 wide the expert draws took ~8 s)
  cfg = kernel_tiny(mtp=False).replace(n_routed_experts=E, num_experts_per_tok=k, moe_intermediate_size=16,
                                       num_hidden_layers=1, layer_types=("linear_attention",),
                                       mlp_layer_types=("sparse",))
  seed = int(np.random.default_rng().integers(2**31))  # fresh draws every run
  model = random_model(cfg, dtype=jnp.float32, fp8=False, mtp=False, seed=seed)
  net = nnx.merge(model.graphdef, model.params)
  router = next(layer.mlp.gate for layer in net.layers if hasattr(layer.mlp, "gate"))
  x = jax.random.normal(jax.random.key(seed + 1), (n, cfg.hidden_size), jnp.float32)  # RMS-normalised inputs: |x| ~ 1
  ids, _ = router(x)
  distinct = len(set(ids.reshape(-1).tolist()))
  uniform = E * (1 - (1 - k / E) ** n)
  assert distinct >= 0.8 * uniform, (seed, distinct, uniform)
