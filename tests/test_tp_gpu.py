"""Tensor parallelism on real GPUs (nvidia-h200-x2 and larger): NCCL all-reduces and the Pallas kernels inside
shard_map with TP-local shapes. On CPU the stock path is covered by test_tp.py (4 fake devices); the kernels
under shard_map cannot run there (GPU interpret mode trips on two kernels in one multi-device program) and are
cross-lowered instead (test_step_lowering.py)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import glm5_jax
from conftest import tol
from glm5_jax.runtime import DecodeConfig
from glm5_jax.speculative import Decoder, decode
from helpers import load, tiny_checkpoint

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 GPUs (nvidia-h200-x2)")]

TPS = [tp for tp in (2, 4) if tp <= len(jax.devices())]


def _ckpt():
  return tiny_checkpoint("kernel-tiny", 4, "fp8")


@pytest.mark.parametrize("tp", TPS)
def test_forward_tp_equals_tp1_gpu(tp):
  p = np.random.default_rng(0).integers(0, 2000, (2, 19))
  ref = np.asarray(glm5_jax.forward(load(_ckpt(), "float32", 1), p))
  got = np.asarray(glm5_jax.forward(load(_ckpt(), "float32", tp), p))
  np.testing.assert_allclose(got, ref, **tol("fp32_paths"))


def _greedy(m, backend, steps=4, **kw):
  dec = Decoder(m, DecodeConfig(max_context=128, q=3, capture_sizes=(2,), policy=()), backend=backend,
                prefill_chunk=16, **kw)
  rng = np.random.default_rng(3)
  state = dec.prefill([rng.integers(0, 2000, 11), rng.integers(0, 2000, 17)])
  out = [np.asarray(state.next_tokens)]
  for _ in range(steps // dec.steps_per_call):
    state, o = decode(state)
    out += [np.asarray(o.tokens), np.asarray(o.counts), np.asarray(o.next_tokens)]
  return out


def _committed(out):
  """Each sequence's committed tokens over the calls, in order (a call of n steps returns them compacted)."""
  return [[t for toks, n in zip(out[1::3], out[2::3]) for t in toks[j, :n[j]].tolist()] for j in range(2)]


@pytest.mark.parametrize("backend", ["auto", "latency_specialized"])
@pytest.mark.parametrize("tp", TPS)
def test_speculative_greedy_tp_equals_tp1_gpu(tp, backend):
  a = _greedy(load(_ckpt(), "float32", 1), backend)
  b = _greedy(load(_ckpt(), "float32", tp), backend)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("tp", TPS)
def test_steps_per_call_tp_equals_tp1_gpu(tp):
  """Two speculative steps per call at TP (the loop inside the CUDA graph with the all-reduces in its body; on a
  GPU the Decoder compiles it with the WHILE / CONDITIONAL command-buffer commands) commit the tokens of single
  steps at TP1, and end on the same next input."""
  a = _greedy(load(_ckpt(), "float32", 1), "latency_specialized")
  b = _greedy(load(_ckpt(), "float32", tp), "latency_specialized", steps_per_call=2)
  assert _committed(b) == _committed(a)
  np.testing.assert_array_equal(a[-1], b[-1])
