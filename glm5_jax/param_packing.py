"""Small parameters packed into one flat buffer per dtype: fewer arguments for the jitted decode step.

Why: the one-rank step of the real geometry had 1,855 arguments (1,715 parameters; 1,499 since the stacked and
concatenated projections of sessions 20-21); on the H200 the host spends
~1.3 µs per argument per call parsing and checking them (jax.profiler trace, BENCHMARKS.md session 18/19), and at
B = 1 the step was host-bound. 679 of the parameters are under 64 KiB (norm weights, biases, FP8 block scales,
mHC / KDA vectors: 4.7 MB together). Packing 555 of them (all but KEEP_WHOLE) turns 555 arguments into 2; the
step slices them back out.

Layout: for every dtype, a global array [tp, N] sharded P("tp") whose row r holds device r's local shards of the
packed leaves, flattened, each starting at a multiple of ALIGN bytes (Mosaic GPU kernels need 16-byte aligned
operands; XLA passes a contiguous slice of a parameter to a custom call as an offset pointer). Inside shard_map a
leaf is ``row[off:off + n].reshape(local_shape)``: a slice and a bitcast, no arithmetic.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from glm5_jax.layers import TP

ALIGN = 256  # bytes: every packed leaf starts at a multiple (TMA wants 16; 256 keeps leaves on whole 128-B lines)
MAX_BYTES = 1 << 24  # packing copies what it packs: meant for small parameters, never the weights
# Decoder's default threshold. Measured on the H200 (BENCHMARKS.md, session 20): the one-rank step at B = 1, q = 1
# went from 10.77 to 6.99 ms per step (host-bound: the host parses every argument on every call), for 0.19 ms
# more GPU time (35 small slices XLA materialises for Mosaic kernels that take a packed leaf).
DEFAULT_BYTES = 1 << 16
# Small leaves that stay arguments of their own: Mosaic kernels read them whole, and XLA hands a kernel a tiny slice
# of a packed buffer through a copy (a memcpy node per call: the mHC finish kernel's base/scale vector, 90 per
# step, and the KDA kernel's A_log, 34 — ~1 µs of GPU time each on the H200, BENCHMARKS.md sessions 20-21), while
# larger slices (norm weights, dt_bias) are passed in place. 124 more arguments cost ~0.16 ms of host time per
# step at ~1.3 µs each, where the q = 1 step is GPU-bound by ~1.5 ms. The router's score-correction bias (1,152
# bytes) joined them with the router kernel: 43 memcpy nodes per step otherwise (session 28's kernel table).
KEEP_WHOLE = frozenset({"base_scale", "A_log", "e_score_correction_bias"})


@dataclasses.dataclass(frozen=True, eq=False)
class PackLayout:
  """Static description of which parameter leaves are packed where. Compared and hashed by identity: it is part
  of the step's compile-cache key, looked up on every step, and the model keeps one per threshold
  (Model.pack_layout) — hashing 1,499 specs per step would be host time on the hot path.

  treedef: the params tree; specs: every leaf's PartitionSpec (flattened); big: indices of the leaves passed as
  themselves; small: (leaf index, dtype name, offset in elements, local shape) per packed leaf; sizes: elements
  per row of each dtype's buffer."""

  treedef: object
  specs: tuple
  big: tuple[int, ...]
  small: tuple[tuple[int, str, int, tuple[int, ...]], ...]
  sizes: tuple[tuple[str, int], ...]
  max_bytes: int

  @property
  def num_args(self) -> int:
    return len(self.big) + len(self.sizes)


def _local_shape(shape, spec, tp: int) -> tuple[int, ...]:
  spec = tuple(spec) + (None,) * (len(shape) - len(tuple(spec)))
  return tuple(d // tp if s == TP else d for d, s in zip(shape, spec))


def leaf_names(params) -> list[str]:
  """The parameter name (last dict key of the path) of every leaf of ``params`` — a dict tree or an nnx.State,
  whose leaves sit under a Variable's ``.value`` — in flattening order."""
  def name(path):
    keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
    return str(keys[-1]) if keys else ""
  return [name(p) for p, _ in jax.tree.flatten_with_path(params)[0]]


def layout(params, specs, tp: int, max_bytes: int) -> PackLayout:
  """Which leaves of ``params`` (arrays or ShapeDtypeStructs) to pack: those whose *local* shard is under
  ``max_bytes``, except the KEEP_WHOLE ones. ``specs``: the params' PartitionSpec tree (Model.param_specs)."""
  leaves, treedef = jax.tree.flatten(params)
  names = leaf_names(params)
  spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
  if len(spec_leaves) != len(leaves):
    raise ValueError(f"{len(spec_leaves)} partition specs for {len(leaves)} parameters")
  big, small, fill = [], [], {}
  for i, (x, spec) in enumerate(zip(leaves, spec_leaves)):
    dt = np.dtype(x.dtype)
    shp = _local_shape(x.shape, spec, tp)
    n = math.prod(shp)
    if n * dt.itemsize >= max_bytes or names[i] in KEEP_WHOLE:
      big.append(i)
      continue
    step = max(1, ALIGN // dt.itemsize)
    off = -(-fill.get(dt.name, 0) // step) * step
    small.append((i, dt.name, off, shp))
    fill[dt.name] = off + n
  sizes = tuple((k, -(-v // (ALIGN // np.dtype(k).itemsize)) * (ALIGN // np.dtype(k).itemsize))
                for k, v in sorted(fill.items()))
  return PackLayout(treedef, tuple(spec_leaves), tuple(big), tuple(small), sizes, max_bytes)


def pack(params, lay: PackLayout, mesh) -> tuple[list, dict]:
  """(big leaves, {dtype: [tp, N] buffer}) of concrete, sharded ``params``: the step's parameter arguments."""
  leaves = jax.tree.leaves(params)
  devices = list(mesh.devices.flat)
  shards = {}  # (leaf, device) -> that device's local shard
  for i, *_ in lay.small:
    for s in leaves[i].addressable_shards:
      shards[i, s.device] = s.data
  packed = {}
  for name, N in lay.sizes:
    rows = []
    for d in devices:
      parts, at = [], 0
      for i, dn, off, shp in lay.small:
        if dn != name:
          continue
        if off > at:
          parts.append(jax.device_put(jnp.zeros((off - at,), name), d))
        x = shards[i, d].reshape(-1)
        if x.shape[0] != math.prod(shp):  # the array is not sharded as its spec says: offsets would shift
          raise ValueError(f"parameter {i}: the shard on {d} has {x.shape[0]} elements, its spec "
                           f"{lay.specs[i]} says {math.prod(shp)}")
        parts.append(x)
        at = off + x.shape[0]
      if N > at:
        parts.append(jax.device_put(jnp.zeros((N - at,), name), d))
      rows.append(jnp.concatenate(parts)[None])
    packed[name] = jax.make_array_from_single_device_arrays((len(devices), N), NamedSharding(mesh, P(TP)), rows)
  return [leaves[i] for i in lay.big], packed


def abstract(params, lay: PackLayout, mesh) -> tuple[list, dict]:
  """The same arguments as ShapeDtypeStructs (for tracing with abstract weights)."""
  leaves = jax.tree.leaves(params)
  sh = NamedSharding(mesh, P(TP))
  return ([leaves[i] for i in lay.big],
          {name: jax.ShapeDtypeStruct((mesh.size, N), name, sharding=sh) for name, N in lay.sizes})


def in_specs(lay: PackLayout):
  return [lay.specs[i] for i in lay.big], {name: P(TP) for name, _ in lay.sizes}


def unpack(big: list, packed: dict, lay: PackLayout):
  """Inside shard_map: the params tree of local shards (packed rows [1, N] sliced and reshaped back)."""
  leaves: list = [None] * (len(lay.big) + len(lay.small))
  for i, x in zip(lay.big, big):
    leaves[i] = x
  for i, name, off, shp in lay.small:
    n = math.prod(shp)
    leaves[i] = lax.slice(packed[name][0], (off,), (off + n,)).reshape(shp)
  return jax.tree.unflatten(lay.treedef, leaves)
