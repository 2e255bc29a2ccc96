"""Shared test set-up: 4 fake CPU devices (TP tests), the one tolerance table, GPU markers."""

import os

os.environ.setdefault("XLA_FLAGS", "")
import jax  # noqa: E402

from glm5_jax.sharding import configure_collectives  # noqa: E402

# The TP GPU tests check the all-reduce mode the CLI and benchmarks use (collectives in the CUDA graph);
# set before any backend starts. The CPU backend ignores it.
configure_collectives(os.environ.get("GLM5_JAX_COLLECTIVES", "graph"))

# 4 fake CPU devices for the TP tests (only the CPU backend reads this; set before any backend starts).
jax.config.update("jax_num_cpu_devices", 4)

import pytest  # noqa: E402

# Persistent XLA compilation cache: repeated runs on one machine skip recompiling identical programs (keyed by the
# program: a changed program compiles again). Every program, not only those over a second: the suite's hundreds of
# sub-second compiles were ~20 % of its warm time (test_decode + test_model_units: 121 -> 97 s, session 64). Not
# bounded (jax_compilation_cache_max_size): its eviction lists and stats the whole directory under a file lock at
# every write — with ~10^4 entries that doubled the suite's time.
jax.config.update("jax_compilation_cache_dir", os.path.expanduser(os.environ.get(
    "GLM5_JAX_XLA_CACHE", "~/.cache/glm5_jax/xla")))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)

ON_GPU = any(d.platform == "gpu" for d in jax.devices())
# a Blackwell GPU (compute capability 10.x: tcgen05, no wgmma) — where the kernels' tcgen05 forms run natively
ON_BLACKWELL = ON_GPU and all(float(getattr(d, "compute_capability", "0")) >= 10 for d in jax.devices())


def _host_arrays_for_interpret_callbacks():
  """GPU interpret mode simulates a kernel through ~70,000 io_callbacks per kernel-tiny decode step (every ref
  access, barrier and copy), and jax 0.11.2's io_callback implementation device_puts each callback's ~10 host
  arguments back onto the CPU device as jax Arrays before calling it: 80 % of the step's interpretation time
  (122 of 152 s in the all-kernels equivalence test's step, session 41). The suite hands the callbacks the host
  values as they are instead — integer / bool scalars as Python ints (what the interpreter's index types accept),
  the rest as numpy arrays: the same values, 152 -> 59 s for that step. Test harness only (a user's own
  io_callbacks keep jax's behaviour); on a jax without this function nothing is patched."""
  import numpy as np  # noqa: PLC0415
  from jax._src import callback as cb  # noqa: PLC0415
  from jax._src import config as jcfg  # noqa: PLC0415
  from jax._src import tree_util  # noqa: PLC0415
  from jax._src import xla_bridge  # noqa: PLC0415
  if jax.__version__ != "0.11.2" or not hasattr(cb, "io_callback_impl"):
    return

  def host(a):
    a = np.asarray(a)
    return int(a) if a.ndim == 0 and a.dtype.kind in "iub" else a

  def io_callback_impl(*args, result_avals, callback, sharding, ordered):
    del result_avals, sharding, ordered
    cpu, *_ = xla_bridge.local_devices(backend="cpu")
    with jcfg.default_device(cpu):
      return tree_util.tree_map(np.asarray, callback(*[host(a) for a in args]))

  cb.io_callback_impl = io_callback_impl


if not ON_GPU:
  _host_arrays_for_interpret_callbacks()

# The one tolerance table of the suite: (atol, rtol) by what is compared.
TOL = {
    # fp32 model vs the Hugging Face goldens (oracle README: atol 1e-4; issue #3: <= 2e-4)
    "hf_fp32_logits": (2e-4, 0.0),
    # two fp32 paths of our own model that must agree (cached vs full, chunked vs recurrent, TP vs TP1)
    "fp32_paths": (5e-5, 1e-5),
    # a Pallas kernel vs its pure-jnp reference, fp32 accumulation, f32 inputs
    "kernel_f32": (2e-5, 2e-5),
    # a Pallas kernel vs its reference with bf16 inputs / outputs
    "kernel_bf16": (2e-2, 2e-2),
    # FP8 (e4m3) quantised operands vs the dequantised fp32 reference
    "kernel_fp8": (3e-2, 3e-2),
}


def tol(name):
  atol, rtol = TOL[name]
  return dict(atol=atol, rtol=rtol)


def rounding_reference(fn, *args):
  """fn(*args) compiled without XLA's excess precision: on the GPU XLA otherwise keeps bf16 intermediates in f32
  where the model's astype(bf16) — and the kernels, and HF — round (the CPU's XLA rounds either way). For GPU
  tests of kernels against an XLA reference with bf16 roundings inside."""
  return jax.jit(fn).lower(*args).compile(compiler_options={"xla_allow_excess_precision": False})(*args)


# The slowest CPU tests (~10-35 s each: the step's CUDA lowerings, the notebooks, the end-to-end kernel test, the
# compile cache's two processes) run first. pytest-xdist's worksteal deals the collected order out to the workers
# and balances them by stealing from the ends of their queues: a half-minute test started last leaves the other
# worker idle to the end (the suite's ~10 minutes on 2 workers).
SLOW_FIRST = ("test_step_lowering.py::", "test_notebooks.py::test_notebook_executes",
              "test_cli.py::test_compile_cache_reused_across_processes",
              "test_decode.py::test_latency_specialized_all_kernels_equals_stock_fp8_cache",
              "test_mhc.py::test_row_boundary_lowers_for_cuda", "test_mhc.py::test_lean_boundaries_lower",
              "test_mhc.py::test_cross_lower_real", "test_model_units.py::test_dq_f16_inputs",
              "test_cli.py::test_generate_with_prompt_ids", "test_decode.py::test_indexer_pool_kernel_equals_xla_update")


def pytest_collection_modifyitems(config, items):
  items.sort(key=lambda item: not any(s in item.nodeid for s in SLOW_FIRST))  # (stable: the rest keep their order)
  if not ON_BLACKWELL:
    bw = pytest.mark.skip(reason="needs a Blackwell GPU (sm_100 / sm_103: the kernels' tcgen05 forms)")
    for item in items:
      if "blackwell" in item.keywords:
        item.add_marker(bw)
  if ON_GPU:
    return
  skip = pytest.mark.skip(reason="needs a CUDA GPU")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)
