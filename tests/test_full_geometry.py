"""The real geometry, abstractly (jax.eval_shape: nothing is allocated)."""

import math

import jax.numpy as jnp
from flax import nnx

from glm5_jax import config as C
from glm5_jax import sharding as shd
from glm5_jax.model import Glm5Model

# spec/model.md §1.4: 321,323,031,390 parameters including the vision tower (563,627,008) and the MTP layer.
TEXT_AND_MTP = 321_323_031_390 - 563_627_008


def _count(state, skip_scales):
  """The release's parameter count of the model's leaves: a block-diagonal weight (checkpoint.BLOCKDIAGS, S
  matrices in [S, out, S·in]) holds S·(S − 1) blocks of zeros that are not parameters of the release."""
  from glm5_jax.checkpoint import BLOCKDIAGS  # noqa: PLC0415
  n = 0
  for path, v in nnx.to_flat_state(state):
    if skip_scales and path[-1] in ("scale", "gate_scale", "up_scale", "down_scale") and path[-2] not in (
        "attn_hc", "ffn_hc"):
      continue
    shape = v.get_value().shape
    n += math.prod(shape) // (shape[0] if len(path) > 1 and path[-2] in BLOCKDIAGS else 1)
  return n


def test_parameter_count_of_the_release():
  abstract = nnx.eval_shape(lambda: Glm5Model(C.real(), jnp.bfloat16, fp8=False, mtp=True))
  assert _count(nnx.split(abstract)[1], False) == TEXT_AND_MTP


def test_fp8_release_per_device_bytes_at_tp4():
  """FP8 weights + fp32 block scales; ≈82 GB per device at TP4 (fits a 141 GB H200 with room for caches)."""
  abstract = nnx.eval_shape(lambda: Glm5Model(C.real(), jnp.bfloat16, fp8=True, mtp=True))
  state = nnx.split(abstract)[1]
  assert _count(state, True) == TEXT_AND_MTP
  per_device = shd.param_bytes_per_device(state, 4)
  assert 80e9 < per_device < 84e9
