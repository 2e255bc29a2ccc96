"""Tensor parallelism on 4 fake CPU devices: TP4 == TP2 == TP1, the collectives of a step, sharded loading,
orbax restore across meshes."""

from __future__ import annotations

import os
import re

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import glm5_jax
from conftest import tol
from glm5_jax.speculative import Decoder, decode
from glm5_jax.runtime import DecodeConfig
from helpers import load, tiny_checkpoint

MICRO = dict(num_hidden_layers=4, mlp_layer_types=("dense", "sparse", "sparse", "sparse"), index_topk=8)

pytestmark = pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices (jax_num_cpu_devices=4)")


def _ckpt():
  return tiny_checkpoint("oracle-tiny", 11, "float32", **MICRO)


def test_params_are_sharded_by_the_rules():
  m = load(_ckpt(), "float32", 4)
  mod = m.module()
  kda = mod.layers[0].self_attn
  assert kda.qkv_proj.weight[...].sharding.spec == P(None, "tp", None)  # q, k, v stacked, each split on heads
  assert kda.o_proj.weight[...].sharding.spec == P(None, "tp")
  assert kda.fgb_a_proj.weight[...].sharding.spec == P(None, None)  # replicated (f_a, g_a and b rows)
  assert kda.fg_b_proj.weight[...].sharding.spec == P(None, "tp", None)  # f_b, g_b block-diagonal, split on heads
  dsa = mod.layers[3].self_attn
  assert dsa.q_b_proj.weight[...].sharding.spec == P("tp", None)
  assert dsa.indexer.wq_b.weight[...].sharding.spec == P(None, None)
  assert mod.layers[3].mlp.experts.gate_proj[...].sharding.spec == P(None, "tp", None)
  assert mod.embed_tokens[...].sharding.spec == P("tp", None)
  # each device holds a quarter of a column-parallel weight
  shard = kda.qkv_proj.weight[...].addressable_shards[0].data
  assert shard.shape[:2] == (3, kda.qkv_proj.weight[...].shape[1] // 4)


@pytest.mark.parametrize("tp", [2, 4])
def test_forward_tp_equals_tp1(tp):
  p = np.random.default_rng(0).integers(0, 500, (2, 19))
  ref = np.asarray(glm5_jax.forward(load(_ckpt(), "float32", 1), p))
  got = np.asarray(glm5_jax.forward(load(_ckpt(), "float32", tp), p))
  np.testing.assert_allclose(got, ref, **tol("fp32_paths"))


def _greedy_run(m, k=3, steps=6, **kw):
  dec = Decoder(m, DecodeConfig(max_context=64, q=k + 1, capture_sizes=(4,), policy=()), prefill_chunk=16, **kw)
  rng = np.random.default_rng(1)
  state = dec.prefill([rng.integers(0, 500, 9), rng.integers(0, 500, 14)])
  out = [np.asarray(state.next_tokens)]
  for _ in range(steps):
    state, o = decode(state)
    out.append(np.asarray(o.tokens))
    out.append(np.asarray(o.next_tokens))
  return out


def test_speculative_greedy_tp4_equals_tp1():
  a = _greedy_run(load(_ckpt(), "float32", 1))
  b = _greedy_run(load(_ckpt(), "float32", 4))
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x, y)


def test_packed_parameters_tp4_equal_tp1_unpacked():
  """Decoder(pack_params=...) at TP4: each device's row of the packed buffers holds its own shards (sharded KDA
  vectors, replicated norms) — the same tokens as TP1 without packing (TP4 with two steps per call); and every
  leaf unpacks to its shard."""
  from glm5_jax import param_packing as pp  # noqa: PLC0415

  m4 = load(_ckpt(), "float32", 4)
  lay = m4.pack_layout(1 << 16)
  assert len(lay.small) > 0 and len(lay.big) > 0 and lay.num_args < len(jax.tree.leaves(m4.params))
  assert all(off * np.dtype(dt).itemsize % pp.ALIGN == 0 for _, dt, off, _ in lay.small)
  # the vectors Mosaic kernels read whole stay arguments of their own (XLA would copy a tiny packed slice per call)
  names = pp.leaf_names(m4.params)
  whole = [i for i, n in enumerate(names) if n in pp.KEEP_WHOLE]
  assert whole and set(whole) <= set(lay.big), [names[i] for i, *_ in lay.small if names[i] in pp.KEEP_WHOLE]
  big, packed = m4.packed_params(1 << 16)
  back = jax.jit(jax.shard_map(lambda b, p: pp.unpack(b, p, lay), mesh=m4.mesh, in_specs=pp.in_specs(lay),
                               out_specs=m4.param_specs, check_vma=False))(big, packed)
  for x, y in zip(jax.tree.leaves(back), jax.tree.leaves(m4.params)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  a = _greedy_run(load(_ckpt(), "float32", 1), pack_params=0)
  # (and two speculative steps per call at TP4: the loop's all-reduces inside shard_map)
  b = _greedy_run(m4, steps=3, pack_params=1 << 16, steps_per_call=2)
  committed = lambda out: [[t for o in out[1::2] for t in o[j].tolist() if t >= 0] for j in range(2)]  # noqa: E731
  assert committed(b) == committed(a)
  np.testing.assert_array_equal(a[0], b[0])
  np.testing.assert_array_equal(a[-1], b[-1])  # the next step's input


def test_collectives_per_step():
  """Two all-reduces per layer + one for the embedding; the MTP pass and each chained draft step add three
  (embedding, attention, MoE). Greedy verification and drafts gather only (max, index) pairs."""
  m = load(_ckpt(), "float32", 4)
  k, b = 3, 4
  dec = Decoder(m, DecodeConfig(max_context=64, q=k + 1, capture_sizes=(b,), policy=()))
  txt = dec.trace_step(b).lower().as_text()
  L = m.cfg.num_hidden_layers
  assert len(re.findall(r"all_reduce", txt)) == 1 + 2 * L + 3 * k
  n_gather = len(re.findall(r"all_gather", txt))
  assert n_gather <= 2 * (1 + k)  # one (max, index) gather per argmax: target + k drafts


def test_orbax_restore_across_meshes(tmp_path):
  m4 = load(_ckpt(), "float32", 4)
  glm5_jax.save_model(m4, tmp_path / "ck")
  m1 = glm5_jax.load_model(tmp_path / "ck", tp=1)
  m2 = glm5_jax.load_model(tmp_path / "ck", tp=2)
  a = jax.tree.leaves(m4.params)
  for other in (m1, m2):
    for x, y in zip(a, jax.tree.leaves(other.params)):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert m2.module().layers[0].self_attn.qkv_proj.weight[...].sharding.spec == P(None, "tp", None)
  p = np.random.default_rng(2).integers(0, 500, (1, 9))
  np.testing.assert_array_equal(np.asarray(glm5_jax.forward(m1, p)), np.asarray(glm5_jax.forward(load(_ckpt()), p)))


def test_fp8_shard_boundary_that_cuts_a_block_is_refused():
  path = tiny_checkpoint("oracle-tiny", 11, "fp8", **MICRO)
  with pytest.raises(ValueError, match=r"cuts a 128-wide FP8 scale block"):
    glm5_jax.load_model(path, tp=2)


def test_bad_tp_sizes():
  with pytest.raises(ValueError, match="tensor_parallel_size=3"):
    glm5_jax.load_model(_ckpt(), tp=3)


def test_configure_collectives_sets_the_environment_once_and_refuses_late_or_unknown():
  import subprocess  # noqa: PLC0415
  import sys  # noqa: PLC0415

  from glm5_jax.sharding import COLLECTIVE_MODES, configure_collectives  # noqa: PLC0415

  flag = COLLECTIVE_MODES["graph"]["XLA_FLAGS"]
  env = {"XLA_FLAGS": "--xla_dump_to=/tmp/x", "NCCL_NVLS_ENABLE": "1"}
  got = configure_collectives("graph", environ=env)
  assert env["XLA_FLAGS"].split() == ["--xla_dump_to=/tmp/x", flag]
  assert env["NCCL_NVLS_ENABLE"] == "1"  # the user's own setting is kept
  assert got == {k: env[k] for k in ("NCCL_NVLS_ENABLE", "XLA_FLAGS")}
  configure_collectives("graph", environ=env)  # idempotent: the flag is not appended twice
  assert env["XLA_FLAGS"].count("COLLECTIVES") == 1
  off = {"XLA_FLAGS": "--xla_gpu_enable_command_buffer="}  # the user turned command buffers off: kept
  configure_collectives("graph", environ=off)
  assert off["XLA_FLAGS"] == "--xla_gpu_enable_command_buffer=" and off["NCCL_NVLS_ENABLE"] == "0"
  assert configure_collectives("xla", environ={}) == {"NCCL_NVLS_ENABLE": "0"}
  with pytest.raises(ValueError, match="'nvls'.*graph"):
    configure_collectives("nvls", environ={})
  with pytest.raises(RuntimeError, match="before JAX initialises"):  # this process's backends are running
    configure_collectives("graph")
  # a fresh process: the flags are set before the backend starts, XLA accepts them, a computation runs
  code = ("from glm5_jax.sharding import configure_collectives; import os; configure_collectives('graph'); "
          "import jax.numpy as jnp; assert float(jnp.arange(4.0).sum()) == 6.0; "
          "print(os.environ['NCCL_NVLS_ENABLE'], os.environ['XLA_FLAGS'])")
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                     env={k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "NCCL_NVLS_ENABLE")})
  assert r.returncode == 0, r.stderr[-2000:]
  assert r.stdout.split() == ["0", flag]
