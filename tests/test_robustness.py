"""Careless use of the public entry points: each failure is a clear exception naming the bad value and what was
expected, raised before anything is donated."""

import jax
import numpy as np
import pytest

import glm5_jax
from glm5_jax import sharding as shd
from glm5_jax.runtime import DecodeConfig, DeploymentConfig
from glm5_jax.speculative import Decoder, decode
from helpers import load, tiny_checkpoint

MICRO = dict(num_hidden_layers=4, mlp_layer_types=("dense", "sparse", "sparse", "sparse"), index_topk=8)


@pytest.fixture(scope="module")
def model():
  return load(tiny_checkpoint("oracle-tiny", 11, "float32", **MICRO), "float32")


@pytest.fixture(scope="module")
def dec(model):
  return Decoder(model, DecodeConfig(max_context=96, q=2, capture_sizes=(4,), policy=()), prefill_chunk=16)


def test_decode_token_inputs(dec):
  state = dec.prefill([np.arange(5) + 1])
  good = np.array(state.next_tokens)
  with pytest.raises(TypeError, match="integer token ids: got dtype float64"):
    decode(state, good.astype(np.float64))
  with pytest.raises(ValueError, match=r"tokens must be \[B, q\] = \[4, 2\] .*got shape \(4, 2, 1\)"):
    decode(state, good[..., None])
  with pytest.raises(ValueError, match=r"token id -1 is outside \[0, 512\)"):
    decode(state, np.where(np.arange(2)[None] == 1, -1, good))
  state, out = decode(state, good.astype(np.int64))  # int64 ids are fine; the state survived the bad calls
  assert int(out.counts[0]) >= 1
  with pytest.raises(TypeError, match="needs a DecodeState made by Decoder.prefill"):
    decode({"caches": None}, good)


def test_prefill_inputs(dec):
  with pytest.raises(ValueError, match="prompt 0 has 95 tokens: expected at most max_context - q = 94"):
    dec.prefill([np.arange(95) % 500])
  with pytest.raises(ValueError, match="needs at least one prompt"):
    dec.prefill([])
  with pytest.raises(ValueError, match=r"token id 9999 is outside \[0, 512\)"):
    dec.prefill([[1, 2, 9999]])


def test_prefill_compiler_options(model, dec):
  """Decoder(prefill_compiler_options=): a malformed value is refused when the decoder is built; an unknown XLA
  option fails the first prefill, named by XLA (nothing of the caller's is donated: the prefill's caches are its
  own); given options compile the chunk programs apart from the defaults' (their own jitted functions) and leave the
  prefill's result as it was."""
  cfg = DecodeConfig(max_context=96, q=2, capture_sizes=(4,), policy=())
  for bad in ({"xla_gpu_autotune_level": [0]}, {0: 1}, ("xla_gpu_autotune_level", 0)):
    with pytest.raises(ValueError, match=r"prefill_compiler_options=.*expected a dict of XLA option names"):
      Decoder(model, cfg, prefill_chunk=16, prefill_compiler_options=bad)
  with pytest.raises(Exception, match="No such compile option: 'xla_no_such_option'"):
    Decoder(model, cfg, prefill_chunk=16, prefill_compiler_options={"xla_no_such_option": 1}).prefill([[1, 2, 3]])
  prompt = np.random.default_rng().integers(0, 500, 21)
  tuned = Decoder(model, cfg, prefill_chunk=16, prefill_compiler_options={"xla_gpu_autotune_level": 0})
  from glm5_jax.speculative import _prefill_target_fn  # noqa: PLC0415
  assert _prefill_target_fn(tuned, 4, 16) is not _prefill_target_fn(dec, 4, 16)
  np.testing.assert_array_equal(np.asarray(tuned.prefill([prompt]).next_tokens),
                                np.asarray(dec.prefill([prompt]).next_tokens))


def test_decoder_settings(model):
  with pytest.raises(ValueError, match="backend='fast': expected 'auto' or 'latency_specialized'"):
    Decoder(model, DecodeConfig(max_context=96, q=2, capture_sizes=(1,), policy=()), backend="fast")
  with pytest.raises(ValueError, match="max_context=90 must be a multiple of index_kpool=4"):
    Decoder(model, DecodeConfig(max_context=90, q=2, capture_sizes=(1,), policy=()))
  with pytest.raises(ValueError, match="temperature=-1.0"):
    Decoder(model, DecodeConfig(max_context=96, q=2, capture_sizes=(1,), policy=()), temperature=-1.0)
  for bad in (0, -16, 2.5, True):
    with pytest.raises(ValueError, match=f"prefill_chunk={bad!r}: expected a positive int"):
      Decoder(model, DecodeConfig(max_context=96, q=2, capture_sizes=(1,), policy=()), prefill_chunk=bad)


def test_deployment_against_the_loaded_model(model):
  dep = DeploymentConfig(model=model.cfg, tensor_parallel_size=2, num_speculative_tokens=1, max_model_len=96,
                         capture_sizes=(4,), additional_config={"decode_backend": "auto"})
  with pytest.raises(ValueError, match="tensor_parallel_size=2 but the model is loaded on a mesh of 1 devices"):
    Decoder.from_deployment(model, dep)


def test_mesh_checks():
  class Fake:
    def __init__(self, kind):
      self.device_kind, self.platform = kind, "gpu"

  with pytest.raises(ValueError, match=r"mixes device kinds \['NVIDIA H100', 'NVIDIA H200'\]"):
    shd.make_mesh(2, devices=[Fake("NVIDIA H200"), Fake("NVIDIA H100")])
  with pytest.raises(ValueError, match="tensor_parallel_size=8 needs 8 devices but only 4 are visible"):
    shd.make_mesh(8, devices=[Fake("x")] * 4)
  with pytest.raises(ValueError, match="tensor_parallel_size=3 is not supported: expected 1, 2, 4 or 8"):
    shd.make_mesh(3)


def test_load_model_without_config(tmp_path):
  (tmp_path / "model.safetensors").write_bytes(b"")
  with pytest.raises(FileNotFoundError, match="no config.json"):
    glm5_jax.load_model(tmp_path)


def test_malformed_state_refused_before_tokens_are_written(model):
  """Caller tokens are written into the state's io in place: a state whose caches do not match the decoder is
  refused first, and the original state stays usable."""
  import dataclasses  # noqa: PLC0415
  dec = Decoder(model, DecodeConfig(max_context=64, q=2, capture_sizes=(1,), policy=()))
  state = dec.prefill([np.arange(5) + 1])
  state, _ = decode(state)  # the step has run: later caller tokens go into io in place
  toks = np.array(state.next_tokens)
  caches = jax.tree.map(lambda a: a, state.caches)
  caches["layers"][0] = {k: v[..., :1] for k, v in caches["layers"][0].items()}
  bad = dataclasses.replace(state, caches=caches)
  with pytest.raises(ValueError, match="do not have this decoder's shapes"):
    decode(bad, toks)
  state, out = decode(state, toks)  # the original still works
  assert int(np.asarray(out.counts)[0]) >= 1
