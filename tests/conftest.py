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

# Persistent XLA compilation cache: repeated runs on one machine skip recompiling identical programs.
jax.config.update("jax_compilation_cache_dir", os.path.expanduser(os.environ.get(
    "GLM5_JAX_XLA_CACHE", "~/.cache/glm5_jax/xla")))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)

ON_GPU = any(d.platform == "gpu" for d in jax.devices())

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


def pytest_collection_modifyitems(config, items):
  if ON_GPU:
    return
  skip = pytest.mark.skip(reason="needs a CUDA GPU")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)
