"""Helpers shared by the kernels: interpret mode on CPU and CUDA cross-lowering."""

from __future__ import annotations

import contextlib

import jax
from jax.experimental.pallas import mosaic_gpu as plgpu


def on_gpu() -> bool:
  return jax.default_backend() == "gpu"


def interpret_params() -> plgpu.InterpretGPUParams:
  """GPU interpret mode parameters used on CPU (uninitialised memory reads as NaN, OOB reads raise)."""
  return plgpu.InterpretGPUParams()


@contextlib.contextmanager
def maybe_interpret(interpret: bool | None = None):
  """Run Mosaic GPU kernels natively on a GPU and in GPU interpret mode elsewhere (or when asked)."""
  if interpret is None:
    interpret = not on_gpu()
  if interpret:
    with plgpu.force_gpu_interpret_mode(interpret_params()):
      yield
  else:
    yield


def cross_lower(f, *args, **kwargs):
  """Lower ``f`` for CUDA on any machine: runs Mosaic GPU's lowering, layout inference and SMEM checks."""
  return jax.jit(f).trace(*args, **kwargs).lower(lowering_platforms=("cuda",))
