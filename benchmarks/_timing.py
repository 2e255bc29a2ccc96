"""Shared by the kernel benchmarks: a log that is also kept for --out, and device time per call.

Device time comes from CUPTI through the Mosaic GPU extension (the sum of the kernels' durations per call); where
CUPTI is unavailable or fails, wall-clock time of back-to-back calls (which includes dispatch)."""

from __future__ import annotations

import time

import jax
import numpy as np

LINES: list[str] = []


def log(s=""):
  print(s, flush=True)
  LINES.append(s)


def write_log(path):
  with open(path, "w") as fh:
    fh.write("\n".join(LINES) + "\n")


def _cupti():
  try:
    from jax._src.lib import mosaic_gpu as mgpu_lib  # noqa: PLC0415
    ext = mgpu_lib._mosaic_gpu_ext
    return ext if hasattr(ext, "_cupti_init") else None
  except Exception:  # noqa: BLE001
    return None


_EXT = _cupti()
MODE = ["cupti" if _EXT is not None else "wall"]  # a list: switched to "wall" once if CUPTI fails


def time_calls(fn, arg_sets, reps: int = 3):
  """(µs per call, {kernel name: µs per call}) over ``arg_sets`` called back to back, median of ``reps``."""
  jax.block_until_ready(fn(*arg_sets[0]))  # compile + warm-up
  jax.block_until_ready([fn(*a) for a in arg_sets[:2]])
  totals, per_name = [], []
  for _ in range(reps):
    if MODE[0] == "cupti":
      try:
        _EXT._cupti_init()
        jax.block_until_ready([fn(*a) for a in arg_sets])
        names: dict[str, float] = {}
        for name, ms in _EXT._cupti_get_timings(True):
          names[name] = names.get(name, 0.0) + ms * 1e3 / len(arg_sets)
        totals.append(sum(names.values()))
        per_name.append(names)
        continue
      except Exception as e:  # noqa: BLE001
        log(f"# CUPTI failed ({type(e).__name__}: {e}); wall-clock from now on")
        MODE[0] = "wall"
    t = time.perf_counter()
    jax.block_until_ready([fn(*a) for a in arg_sets])
    totals.append((time.perf_counter() - t) * 1e6 / len(arg_sets))
    per_name.append({})
  i = int(np.argsort(totals)[len(totals) // 2])
  return totals[i], per_name[i]
