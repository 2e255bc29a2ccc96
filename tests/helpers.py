"""Shared test helpers: checkpoints made on the fly, cached-path drivers that reuse one compilation."""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile

import numpy as np

import glm5_jax
from checkpoints import make_tiny

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ORACLE = os.path.join(os.path.dirname(REPO), "shared", "oracle")


def tiny_checkpoint(preset: str = "oracle-tiny", seed: int = 0, dtype: str = "float32", **overrides) -> str:
  """A random checkpoint in the release layout (with the MTP layer), written once per test session."""
  fix = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in overrides.items()))
  return _tiny_checkpoint(preset, seed, dtype, fix)


@functools.cache
def _checkpoint_root() -> str:
  # One folder per test process, removed when it exits: the checkpoints are up to ~80 MB each and a full run
  # writes dozens of them.
  d = tempfile.mkdtemp(prefix="glm5_test_checkpoints_")
  atexit.register(shutil.rmtree, d, ignore_errors=True)
  return d


@functools.cache
def _tiny_checkpoint(preset, seed, dtype, overrides) -> str:
  cfg = make_tiny.preset_config(preset, **dict(overrides))
  d = tempfile.mkdtemp(prefix=f"{preset}_{dtype}_s{seed}_", dir=_checkpoint_root())
  make_tiny.write_checkpoint(cfg, d, seed=seed, dtype=dtype)
  return d


@functools.cache
def load(path: str, dtype: str = "float32", tp: int = 1):
  return glm5_jax.load_model(path, dtype=dtype, tp=tp)


def extend_chunks(model, tokens, chunks, *, max_context=64, bucket=16):
  """Feed tokens [S] through the cached path in the given chunk sizes, each padded to ``bucket`` tokens (one
  compilation serves every chunk size) -> logits [S, V]."""
  cache = glm5_jax.init_cache(model, 1, max_context)
  rows, s = [], 0
  for n in chunks:
    for a in range(0, n, bucket):
      m = min(bucket, n - a)
      buf = np.zeros((1, bucket), np.int32)
      buf[0, :m] = tokens[s + a:s + a + m]
      out, cache = glm5_jax.extend(model, cache, buf, valid=np.array([m], np.int32))
      rows.append(np.asarray(out["logits"][0, :m]))
    s += n
  return np.concatenate(rows), cache


def target_hidden_in_chunks(dec, model, tokens, n: int, chunk: int, mode):
  """The target's chunk program (Decoder.prefill's first half) over the first ``n`` of ``tokens`` [1, >= n] in
  ``chunk``-row chunks from empty caches, under ``mode`` (a kernel-mode context: the Decoder's kernel_mode() or
  prefill_kernel_mode()) -> (the trunk's hidden states [1, n, D] f32, the kernel report of the traced chunks)."""
  import jax.numpy as jnp  # noqa: PLC0415

  from glm5_jax import state as st  # noqa: PLC0415
  from glm5_jax.layers import kernel_report  # noqa: PLC0415
  from glm5_jax.speculative import _prefill_target_fn  # noqa: PLC0415
  caches = st.init_caches(dec.layout(1), model.mesh)
  fn = _prefill_target_fn(dec, 1, chunk)
  start, h = 0, []
  with mode, kernel_report() as rep:
    while start < n:
      valid = min(chunk, n - start)
      part = np.zeros((1, chunk), np.int32)
      part[:, :valid] = tokens[:, start:start + valid]
      caches, hc = fn(model.params, caches, jnp.asarray(part), jnp.full((1,), start, jnp.int32),
                      jnp.full((1,), valid, jnp.int32))
      h.append(np.asarray(hc, np.float32)[:, :valid])
      start += valid
  return np.concatenate(h, axis=1), rep


def greedy_reference(model, prompt, n, *, max_context=128, bucket=16, gaps: bool = False):
  """The reference model's greedy continuation through the cached path (prefill, then one token at a time).
  ``gaps``: also each choice's margin (its logit minus the runner-up's) -> (tokens, margins)."""
  def top(lg):
    lg = np.asarray(lg, np.float64)
    i = int(np.argmax(lg))
    return i, float(lg[i] - np.max(np.delete(lg, i)))

  lg, cache = extend_chunks(model, prompt, [len(prompt)], max_context=max_context, bucket=bucket)
  picks = [top(lg[-1])]
  for _ in range(n - 1):
    buf = np.zeros((1, bucket), np.int32)
    buf[0, 0] = picks[-1][0]
    o, cache = glm5_jax.extend(model, cache, buf, valid=np.array([1], np.int32))
    picks.append(top(o["logits"][0, 0]))
  out = [t for t, _ in picks]
  return (out, [g for _, g in picks]) if gaps else out


def has_bf16_product(stablehlo: str) -> bool:
  """Whether a lowering (StableHLO text) has a product of two bf16 operands into f32 (policy knob bf16_products'
  form: no f32 copies of the operands)."""
  import re  # noqa: PLC0415
  pattern = r"dot_general.*\(tensor<[^>]*xbf16>, tensor<[^>]*xbf16>\) -> tensor<[^>]*xf32>"
  return re.search(pattern, stablehlo) is not None


def assert_greedy_matches(got, ref, margins, *, tie: float = 1e-4):
  """got == ref, the reference's greedy tokens — or equal up to a first difference where the reference's choice was
  a near-tie (its margin over the runner-up below ``tie``: another summation order of the same f32 logits may pick
  the other one; past it the continuations legitimately part)."""
  got, ref = list(got), list(ref)
  i = next((j for j, (a, b) in enumerate(zip(got, ref)) if a != b), None)
  if i is None:
    assert len(got) == len(ref), (got, ref)
    return
  assert margins[i] < tie, (f"token {i} differs ({got[i]} vs the reference's {ref[i]}) where the reference's margin "
                            f"is {margins[i]:.3g}, not a near-tie", got, ref)


def barrier_counts(monkeypatch, names, fn, *args):
  """{kernel name: warpgroup barriers (bar.sync) in its lowered module} for the Mosaic kernels fn lowers (CUDA): what
  policy knob lean_barriers changes (Mosaic GPU's automatic barriers) counted where it happens. ``names``: the
  kernels the caller reads — a kernel lowered before (by another test, the same configuration) is not lowered
  again, so then jax's caches are cleared and fn lowered once more (clearing them always would cost every later
  test of the process its compiled programs)."""
  import re  # noqa: PLC0415

  import jax  # noqa: PLC0415
  from jax.experimental.mosaic.gpu import dialect_lowering as dl  # noqa: PLC0415

  from pallas_kernels._common import cross_lower  # noqa: PLC0415
  counts, orig = {}, dl.lower_mgpu_dialect

  def counted(module, *a, **kw):
    out = orig(module, *a, **kw)
    txt = str(module)
    counts[re.search(r"glm5_[a-z0-9_]+", txt).group(0)] = txt.count("bar.sync")
    return out

  with monkeypatch.context() as m:  # (undone on return: a later call must not count into this call's dict)
    m.setattr(dl, "lower_mgpu_dialect", counted)
    cross_lower(fn, *args)
    if not set(names) <= set(counts):
      jax.clear_caches()
      cross_lower(fn, *args)
  return counts
