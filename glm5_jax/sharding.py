"""Tensor parallelism: the mesh, the ONE logical-axis -> mesh-axis table, and partition specs.

Every parameter declares logical axis names where it is created (layers.py / attention.py / model.py, the
``axes=`` metadata); every cache declares them in state.py. This module is the only place that says which of
those names are split over the mesh axis ``tp`` (spec/model.md §6):

* ``vocab``          — embedding and lm_head rows (vocabulary-parallel; greedy argmax without a gather)
* ``kda_heads``, ``kda_heads_dim`` — KDA q/k/v/f_b/g_b/conv/dt_bias/A_log/b rows, o_proj columns, KDA state heads
* ``mla_heads_dim``  — MLA q_b/kv_b rows and o_proj columns
* ``ffn``            — dense MLP, shared and routed experts' intermediate dimension
Everything else (q_a/kv_a, the indexer, routers, norms, mHC, the MLA/indexer caches) is replicated.
"""

from __future__ import annotations

import math
import os

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from glm5_jax.layers import EMBED, FFN, KDA_H, KDA_HD, MLA_HD, TP, VOCAB

# jax 0.11.2's Shardy partitioner segfaults in its canonicalizer (sdy ManualComputationUnusedInputsPattern)
# on our shard_map programs with TP >= 2 when some inputs are unused (e.g. the MTP params in a prefill); the
# GSPMD partitioner compiles the same programs. Measured on CPU with 2 and 4 devices.
jax.config.update("jax_use_shardy_partitioner", False)

# How the step's TP all-reduces run (process-level: NCCL and XLA read these when the GPU backend starts).
# Measured on two H200s (BENCHMARKS.md, all-reduce table): psum at 8-256 KiB takes 18.5-20 µs with the defaults
# (each all-reduce ends the step's CUDA graph) and 11.8-15.2 µs with the collectives recorded into the graph.
# NCCL_PROTO=LL on top measured 11.7-13.5 µs, within the run-to-run noise, and was not measured at prefill
# message sizes (MBs, where LL is bandwidth-limited): not set. NVLink multicast stays off in every mode: on
# these hosts it can take the GPUs down.
COLLECTIVE_MODES = {
    "graph": {"XLA_FLAGS": "--xla_gpu_enable_command_buffer=+COLLECTIVES"},
    "xla": {},  # XLA's and NCCL's defaults
}


def configure_collectives(mode: str = "graph", environ=None) -> dict[str, str]:
  """Set the environment for ``mode`` (see COLLECTIVE_MODES) before JAX starts its GPU backend; returns what was
  set. XLA_FLAGS is appended to (a flag the user already set keeps the user's value), other variables already set
  are kept. Refuses once a backend exists: the setting would silently not apply."""
  if mode not in COLLECTIVE_MODES:
    raise ValueError(f"collectives mode {mode!r} is not one of {sorted(COLLECTIVE_MODES)}")
  from jax._src import xla_bridge  # noqa: PLC0415 (backends_are_initialized: no public equivalent in 0.11.2)

  env = os.environ if environ is None else environ
  if environ is None and xla_bridge.backends_are_initialized():
    raise RuntimeError(f"configure_collectives({mode!r}) must run before JAX initialises its backends (before the "
                       "first jax.devices() or computation): NCCL and XLA read these settings only at start-up")
  done = {"NCCL_NVLS_ENABLE": env.setdefault("NCCL_NVLS_ENABLE", "0")}
  for k, v in COLLECTIVE_MODES[mode].items():
    if k == "XLA_FLAGS":
      flags = env.get(k, "").split()
      name = v.split("=")[0]
      if not any(f.split("=")[0] == name for f in flags):  # a value the user set for this flag is kept
        env[k] = " ".join(flags + [v])
    else:
      env.setdefault(k, v)
    done[k] = env[k]
  return done


RULES = {VOCAB: TP, KDA_H: TP, KDA_HD: TP, MLA_HD: TP, FFN: TP, EMBED: None, None: None}


def logical_to_spec(axes) -> P:
  return P(*[RULES[a] for a in axes])


def make_mesh(tp: int | None = None, devices=None) -> Mesh:
  """A 1-D mesh ("tp",) over ``tp`` devices (default: 1). Device order 0..n-1 (Mosaic GPU's remote refs need it)."""
  devices = list(jax.devices() if devices is None else devices)
  tp = 1 if tp is None else tp
  if tp not in (1, 2, 4, 8):
    raise ValueError(f"tensor_parallel_size={tp} is not supported: expected 1, 2, 4 or 8")
  if tp > len(devices):
    raise ValueError(f"tensor_parallel_size={tp} needs {tp} devices but only {len(devices)} are visible")
  kinds = {d.device_kind for d in devices[:tp]}
  if len(kinds) > 1:
    raise ValueError(f"the mesh mixes device kinds {sorted(kinds)}: expected {tp} devices of one kind")
  return Mesh(np.array(devices[:tp]), (TP,), axis_types=(jax.sharding.AxisType.Auto,))


def tp_size(mesh: Mesh) -> int:
  return mesh.shape[TP]


def _is_var(x):
  return isinstance(x, nnx.Variable)


def param_specs(state):
  """The PartitionSpec tree of an nnx.State of parameters (from their ``axes`` metadata)."""
  return jax.tree.map(lambda v: logical_to_spec(v.get_metadata()["axes"]), state, is_leaf=_is_var)


def check_divisible(state, mesh: Mesh, block=None):
  """Every sharded dimension must split evenly; FP8 weights must not cut a 128-block at a shard boundary."""
  n = tp_size(mesh)
  if n == 1:
    return
  flat = list(nnx.to_flat_state(state))
  by_path = dict(flat)
  weight_of = {"scale": "weight", "gate_scale": "gate_proj", "up_scale": "up_proj", "down_scale": "down_proj"}
  for path, v in flat:
    axes = v.get_metadata()["axes"]
    name = ".".join(map(str, path))
    w = by_path.get((*path[:-1], weight_of[path[-1]])) if path[-1] in weight_of else None
    if w is not None and block is not None:  # an FP8 block scale: check the weight's shard against the blocks
      wshape = w.get_value().shape
      for d, a in enumerate(axes):
        if RULES[a] is None:
          continue
        local, b = wshape[d] / n, block[0] if d == len(axes) - 2 else block[1]
        if local % b:
          wname = ".".join(map(str, (*path[:-1], weight_of[path[-1]])))
          raise ValueError(f"{wname}: TP={n} gives {wshape[d]}/{n} = {local:g} rows/cols per shard on dimension {d}, "
                           f"which cuts a {b}-wide FP8 scale block: expected a multiple of {b} per shard")
      continue
    shape = v.get_value().shape
    for d, a in enumerate(axes):
      if RULES[a] is not None and shape[d] % n:
        raise ValueError(f"{name}: dimension {d} of size {shape[d]} ({a}) does not divide over TP={n}")


def shardings(specs, mesh: Mesh):
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def param_bytes_per_device(abstract_state, mesh_size: int) -> int:
  """Bytes of one device's parameter shards (from an abstract state, nothing allocated)."""
  total = 0
  for v in jax.tree.leaves(abstract_state, is_leaf=_is_var):
    val = v.get_value() if hasattr(v, "get_value") else v.value
    axes = v.get_metadata()["axes"]
    split = math.prod(mesh_size for a in axes if RULES[a] is not None)
    total += math.prod(val.shape) * np.dtype(val.dtype).itemsize // split
  return total
