"""The speculative decode step ``decode(state, tokens)`` as ONE jitted XLA program, plus prefill and generate.

One step (spec/decode.md §1), for B sequences each feeding q = 1 + k tokens [last committed, k drafts]:
  1. the target forward over the q tokens (KDA from slot n_acc − 1, all q slots written; latent / indexer caches
     written by position, so rejected positions are overwritten later),
  2. verification: greedy (a draft is accepted iff it equals the target argmax; the first mismatch is replaced
     by the argmax; a bonus token when all pass) or sampled (one-hot drafts: accept x with probability p(x);
     on rejection sample p with x removed and renormalised; the bonus from p at the last position),
  3. the MTP layer proposes k new drafts: one pass over the q positions (inputs shifted left by one, the new
     token at the last accepted index) + k − 1 single-token passes that reuse the first pass's top-k pools.
The state is donated; the layer loop and the draft chain are unrolled; nothing syncs with the host.

``Decoder(steps_per_call=n)`` runs n such steps in ONE call (a device-side loop, or unrolled): each step's input
is the previous one's output, so the host launches once per n steps. Why: one TP4 rank's step at B = 1 is
host-bound on the H200 — the host spends ~2-3 µs per CUDA-graph node launching the ~1,600-node graph (5.2 of
5.4 ms per step at q = 1, BENCHMARKS.md session 28). Measured: 7.57 -> 5.31 ms per step with n = 4 (session 29; the
loop stays inside the CUDA graph, and the GPU then sets the pace). The committed tokens of the n steps come back
together; tokens passed to ``decode(state, tokens)`` feed the first of the n steps (the later ones take the MTP
layer's drafts).

Shapes: B batch (a capture size), q = 1 + k tokens per sequence, V vocabulary, D hidden.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from glm5_jax import param_packing as pp
from glm5_jax import state as st
from glm5_jax.api import Model, _check_tokens, compiled
from glm5_jax.attention import StepCtx
from glm5_jax.layers import (KERNEL_DEFAULTS, PREFILL_FORM_KNOBS, PREFILL_KNOBS, REMOVED_KNOBS, WGMMA_REASON,
                             compile_target, declined_on, has_wgmma, kernel_enabled, kernel_report)
from glm5_jax.runtime import SUPPORTED_GPUS, DecodeConfig, detect_platform

REP = P()
MAX_STEPS_PER_CALL = 64  # speculative steps one call may run (its output holds steps · q tokens per sequence)


class Chunk(NamedTuple):
  """One call's share of ``Decoder.stream``: ``tokens``, per prompt the tokens it emitted (a list per prompt,
  empty once it has ended), and ``steps``, the speculative steps the call ran (0 for the prefill's first
  tokens)."""
  tokens: list
  steps: int


def _eos_set(eos_id) -> frozenset:
  """``eos_id`` (None, an id, or several: a checkpoint's ``Glm5Config.eos_token_id``) -> the set of ids that end a
  sequence."""
  ids = () if eos_id is None else (eos_id,) if not isinstance(eos_id, (list, tuple, set, frozenset, np.ndarray)) \
      else list(eos_id)
  for i in ids:
    if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
      raise ValueError(f"eos_id={eos_id!r}: expected None, a token id or a sequence of token ids (ints)")
  return frozenset(int(i) for i in ids)


@dataclasses.dataclass(frozen=True)
class DecodeOutput:
  """What one step emitted.

  tokens [B, n·q] int32: the committed new tokens (accepted drafts then the corrected/bonus token), in order,
    −1 padded (n = the decoder's steps_per_call, 1 by default).
  counts [B] int32: how many of ``tokens`` are real (1..n·q; 0 for padding rows and for non-finite rows).
  next_tokens [B, q] int32: the next step's input (the last emitted token + k new drafts).
  finite [B] bool: False where the target's hidden states (hence logits) held NaN/Inf (at any of the call's
  steps): nothing was sampled from them, the sequence did not advance from there (its length and KDA slot are
  unchanged), and stream() / generate() raise."""

  tokens: jax.Array
  counts: jax.Array
  next_tokens: jax.Array
  finite: jax.Array


jax.tree_util.register_dataclass(DecodeOutput, data_fields=["tokens", "counts", "next_tokens", "finite"],
                                 meta_fields=[])


# The step's small per-sequence state and its outputs live in ONE int32 buffer ``io`` [B, 7 + 2q] that the step
# donates and rewrites in place. Why: XLA runs the step as a CUDA graph (command buffer) and must update the graph
# whenever a buffer it touches moved; fresh output arrays every step (tokens, counts, ...) and an input that was
# the last step's output moved every step. Measured on the H200 (one TP4 rank, B = 1): the per-step update took
# 5-9 ms of host time and blocked the next graph launch until the previous step had finished, making the step
# host-bound (BENCHMARKS.md, 2026-11-30). Columns:
IO_LENGTHS, IO_N_ACC, IO_KEYS, IO_ACTIVE, IO_NEXT = 0, 1, 2, 4, 5  # keys: 2 columns of uint32 bits


def io_width(q: int, steps: int = 1) -> int:
  """Columns of the io buffer: lengths, n_acc, keys (2), active, next_tokens (q), then the last call's output:
  emitted tokens (steps · q), counts, finite."""
  return IO_NEXT + q + steps * q + 2


def _io_views(io, q):
  """io [B, W] -> (lengths, n_acc, keys uint32 [B, 2], active bool, next_tokens [B, q])."""
  return (io[:, IO_LENGTHS], io[:, IO_N_ACC], jax.lax.bitcast_convert_type(io[:, IO_KEYS:IO_KEYS + 2], jnp.uint32),
          io[:, IO_ACTIVE] != 0, io[:, IO_NEXT:IO_NEXT + q])


def _io_pack(lengths, n_acc, keys, active, next_tokens, emitted=None, counts=None, finite=None, steps: int = 1):
  B, q = next_tokens.shape
  emitted = jnp.full((B, steps * q), -1, jnp.int32) if emitted is None else emitted
  counts = jnp.zeros((B,), jnp.int32) if counts is None else counts
  finite = jnp.ones((B,), bool) if finite is None else finite
  col = lambda a: a.astype(jnp.int32)[:, None]  # noqa: E731
  return jnp.concatenate([col(lengths), col(n_acc), jax.lax.bitcast_convert_type(keys.astype(jnp.uint32), jnp.int32),
                          col(active), next_tokens.astype(jnp.int32), emitted.astype(jnp.int32), col(counts),
                          col(finite)], axis=1)


@functools.partial(jax.jit, static_argnums=1)
def _io_output(io, q: int):
  """io [B, W] -> the DecodeOutput its last call wrote (fresh arrays: io itself is donated by the next call)."""
  e, w = IO_NEXT + q, io.shape[1] - IO_NEXT - q - 2  # w = steps · q emitted columns
  return DecodeOutput(io[:, e:e + w], io[:, e + w], io[:, IO_NEXT:IO_NEXT + q], io[:, e + w + 1] != 0)


@functools.partial(jax.jit, donate_argnums=0)
def _io_set_tokens(io, tokens):
  """Write a caller's [B, q] tokens into the next_tokens columns in place (the buffer keeps its address)."""
  return jax.lax.dynamic_update_slice_in_dim(io, tokens.astype(jnp.int32), IO_NEXT, axis=1)


@dataclasses.dataclass(frozen=True)
class DecodeState:
  """The decode state: a registered pytree of device arrays (+ static metadata).

  caches: {"layers": [per-layer caches], "mtp": MTP caches} (shapes in state.py)
  io [B, io_width(q, steps)] int32: the per-sequence scalars and the step's input, packed (see IO_* above) and
    read through:
    lengths [B] int32: committed tokens per sequence (the position of next_tokens[:, 0])
    n_acc [B] int32: verify positions committed at the last step (KDA reads slot n_acc − 1)
    keys [B, 2] uint32: per-sequence sampling keys
    active [B] bool: real sequences (False for the rows that pad the batch to its capture size)
    next_tokens [B, q] int32: the input the next step expects (returned by the last step)
  decoder: the Decoder that owns the compiled step (static)
  len_bound: host-side upper bound of max(lengths), to refuse a step past max_context without a device sync"""

  caches: Any
  io: jax.Array
  decoder: Any = None
  len_bound: int = 0

  @classmethod
  def make(cls, caches, lengths, n_acc, keys, active, next_tokens, decoder, len_bound: int) -> "DecodeState":
    """Pack the per-sequence arrays into io, replicated over the decoder's mesh."""
    io = _io_pack(*(jnp.asarray(a) for a in (lengths, n_acc, keys, active, next_tokens)),
                  steps=decoder.steps_per_call)
    return cls(caches, jax.device_put(io, NamedSharding(decoder.model.mesh, REP)), decoder, int(len_bound))

  @property
  def batch(self) -> int:
    return self.io.shape[0]

  @property
  def q(self) -> int:
    return self.decoder.config.q

  lengths = property(lambda self: self.io[:, IO_LENGTHS])
  n_acc = property(lambda self: self.io[:, IO_N_ACC])
  keys = property(lambda self: jax.lax.bitcast_convert_type(self.io[:, IO_KEYS:IO_KEYS + 2], jnp.uint32))
  active = property(lambda self: self.io[:, IO_ACTIVE] != 0)
  next_tokens = property(lambda self: self.io[:, IO_NEXT:IO_NEXT + self.q])

  def retired(self, rows) -> "DecodeState":
    """This state with ``rows`` inactive: finished sequences stop advancing (their rows write nothing past the
    cache, counts 0) and stop counting toward the max_context check, so that they do not refuse the others'
    steps."""
    return dataclasses.replace(self, io=self.io.at[np.asarray(rows, np.int32), IO_ACTIVE].set(0))

  def longest(self) -> int:
    """The longest active sequence's length, read from the device (a sync: only where len_bound, the cheap host
    bound, says the context may be running out)."""
    return int(np.max(np.where(np.asarray(self.active), np.asarray(self.lengths), 0)))


jax.tree_util.register_dataclass(DecodeState, data_fields=["caches", "io"], meta_fields=["decoder", "len_bound"])


# ---------------------------------------------------------------------------------------------------- sampling
def _probs(logits, temperature, top_p):
  """logits [..., V] f32 -> probabilities with temperature and (optional) nucleus truncation."""
  p = jax.nn.softmax(logits / temperature, axis=-1)
  if top_p < 1.0:
    srt = jnp.sort(p, axis=-1)[..., ::-1]
    cum = jnp.cumsum(srt, axis=-1)
    # smallest set whose mass reaches top_p: keep tokens with prob >= the cut-off value
    cut = jnp.take_along_axis(srt, jnp.sum(cum < top_p, axis=-1, keepdims=True), axis=-1)
    p = jnp.where(p >= cut, p, 0.0)
    p = p / jnp.sum(p, axis=-1, keepdims=True)
  return p


def _sample(key, p):
  """Categorical draw from probabilities p [B, V] with one key per row [B] (Gumbel-argmax)."""
  g = jax.vmap(lambda k, n: jax.random.gumbel(k, (n,)), in_axes=(0, None))(key, p.shape[-1])
  return jnp.argmax(jnp.where(p > 0, jnp.log(p) + g, -jnp.inf), axis=-1).astype(jnp.int32)


# ---------------------------------------------------------------------------------------------------- pieces
def _draft_chain(m, hn, d1, pos1, pools, tail_start, mtp_cache, k):
  """k − 1 single-token MTP passes. hn [B, D] recycled hidden, d1 [B] first draft, pos1 [B] the position of the
  first chained pass. Reuses the first pass's pools [B, kp] (index_share_for_mtp_iteration)."""
  drafts = [d1]
  h, d = hn, d1
  for s in range(1, k):
    pos = pos1 + (s - 1)
    ctx = StepCtx(pos, jnp.ones_like(pos), jnp.ones_like(pos), mode="extend")
    h3, mtp_cache, _ = m.draft(h[:, None], d[:, None], pos[:, None], mtp_cache, ctx,
                               shared=(pools, tail_start), extra_tail=k - 1)
    h = h3[:, 0]
    d = m.argmax(h)
    drafts.append(d)
  return jnp.stack(drafts, axis=1), mtp_cache


def _first_drafts(m, h, next_ids, start, idx_last, mtp_cache, q, k, valid):
  """The MTP pass over this call's positions, then the draft chain from index idx_last [B]. With no drafts (k = 0,
  q = 1: plain decoding, as vLLM without a speculator) nothing runs: the MTP layer's only output would be its own
  cache, which a q = 1 state never reads (the state's layout depends on q, so no q > 1 decoder takes it over) —
  a whole DSA + MoE layer per step (~0.1 ms of the one-rank step; not in the q = 1 roofline either)."""
  if k == 0:
    return jnp.zeros((h.shape[0], 0), jnp.int32), mtp_cache
  T = next_ids.shape[1]
  positions = start[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
  ctx = StepCtx(start, valid, jnp.ones_like(start), mode="extend")
  hh, mtp_cache, aux = m.draft(h, next_ids, positions, mtp_cache, ctx)
  take = lambda a: jnp.take_along_axis(a, idx_last.reshape((-1,) + (1,) * (a.ndim - 1)), axis=1)[:, 0]
  hn = take(hh)
  d1 = m.argmax(hn)
  pools = take(aux["pools"])
  kp = m.cfg.index_kpool
  p0 = start + idx_last
  tail_start = ((p0 + 1) // kp) * kp
  return _draft_chain(m, hn, d1, p0 + 1, pools, tail_start, mtp_cache, k)


# ---------------------------------------------------------------------------------------------------- decoder
# (graph, mesh, decoder key, capture size) -> the traced step's kernel sites (Decoder.kernel_sites); keyed like the
# compiled steps, which decoders of the same model and configuration share
_KERNEL_SITES: dict = {}


def _requested_kernels(config) -> set[str]:
  """Kernel switches the policy turns on explicitly (defaults are not requests)."""
  return {k for k, v in config.policy_dict().items() if k in KERNEL_DEFAULTS and v is True}


# DecodeConfig.policy keys: the kernel switches (glm5_jax.layers.KERNEL_DEFAULTS), the cache dtype, and
# "interpret" (runtime.unsupported accepts a CPU platform with it; kernels then run in Mosaic GPU interpret mode)
POLICY_KEYS = frozenset(KERNEL_DEFAULTS) | {"kv_cache_dtype", "interpret"}


# XLA options the latency_specialized step compiles with on a GPU (a caller's compiler_options override them).
# CONCURRENT command-buffer scheduling: the CUDA graph's nodes are ordered by their buffer dependencies only, not
# by the HLO schedule, so independent small kernels (the indexer beside the query path, the router beside the
# shared expert, ...) overlap. Measured on the H200, one TP4 rank, B = 1 (BENCHMARKS.md, session 26): q = 1
# 5.36 -> 5.14 ms, q = 4 9.29 -> 8.63 ms; the same tokens as the default schedule (GPU test
# test_concurrent_command_buffer_step_equals_serial). Compile options take precedence over XLA_FLAGS: to compile
# the step with another schedule pass it as a compile option (Decoder(compiler_options={...}), the CLI's and
# bench_decode's --xla-option xla_gpu_command_buffer_scheduling_mode=LHS), not through XLA_FLAGS.
GPU_COMPILE_DEFAULTS = {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"}
# With steps_per_call > 1 (a rolled loop over the step) on a GPU: XLA's default command-buffer commands (FUSION,
# CUBLAS, CUBLASLT, CUSTOM_CALL, CUDNN, DYNAMIC_SLICE_FUSION) plus WHILE / CONDITIONAL, so that the loop runs
# inside the CUDA graph (a conditional node) instead of being driven from the host one body graph per iteration.
# The option replaces the whole list ("+WHILE" is not accepted as a compile option, only in XLA_FLAGS, and a
# compile option overrides XLA_FLAGS): COLLECTIVES joins it where XLA_FLAGS put the all-reduces into the graph
# (sharding.configure_collectives("graph")).
GPU_LOOP_OPTIONS = {"xla_gpu_enable_command_buffer":
                    "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL"}


def parse_xla_option(text: str) -> tuple[str, bool | int | float | str]:
  """'NAME=VALUE' (an XLA DebugOptions field, e.g. xla_gpu_command_buffer_scheduling_mode=LHS) -> (name, value
  as bool / int / float / str): the CLI's and bench_decode's --xla-option."""
  name, sep, value = text.partition("=")
  if not sep or not name:
    raise ValueError(f"--xla-option {text!r}: expected NAME=VALUE")
  low = value.lower()
  if low in ("true", "false"):
    return name, low == "true"
  for kind in (int, float):
    try:
      return name, kind(value)
    except ValueError:
      pass
  return name, value


def compile_options(backend: str, platform: str, given: dict | None, *, loop: bool = False) -> dict:
  """The step's XLA compile options: ``given`` over GPU_COMPILE_DEFAULTS (latency_specialized on a GPU only) and,
  for a step with a device-side loop (``loop``: steps_per_call > 1, rolled) on a GPU, GPU_LOOP_OPTIONS."""
  defaults = GPU_COMPILE_DEFAULTS if (backend == "latency_specialized" and platform == "gpu") else {}
  if loop and platform == "gpu":
    loop_opts = dict(GPU_LOOP_OPTIONS)
    if "COLLECTIVES" in os.environ.get("XLA_FLAGS", ""):
      loop_opts["xla_gpu_enable_command_buffer"] += ",COLLECTIVES"
    defaults = {**defaults, **loop_opts}
  return {**defaults, **(given or {})}


# Prompt tokens per prefill call (Decoder.prefill_chunk; the CLI's --prefill-chunk). A chunk's time is mostly a fixed
# cost — its ~2,900 XLA launches at one TP4 rank and the prefill MoE streaming every expert once (~22.5 ms a chunk
# at the first 32 layers on an H100) — so larger chunks pay it fewer times: in 512-token chunks a 4K / 32K prompt
# took 0.53 / 4.05 s to the first token there, in 1,024-token ones 0.36-0.40 / 2.93 s and in 2,048-token ones 0.39 /
# 2.53 s (session 79, with layers' kda_chunk_gemm: without it, past 512 tokens, XLA's fusion autotuning compiled a
# chunk program for ~5 minutes; with it 90 s at 2,048). Prompts shorter than a chunk run a power-of-two program
# (prefill_rows), so a short prompt's time to the first token does not grow with the chunk.
PREFILL_CHUNK = 2048


class Decoder:
  """Owns a model, a DecodeConfig and the step compiled once per capture size.

  backend: "auto" (the pure-JAX stock path) or "latency_specialized" (the Pallas kernels).
  temperature 0 = greedy; otherwise sampled acceptance with optional top_p."""

  def __init__(self, model: Model, config: DecodeConfig, *, backend: str = "auto", temperature: float = 0.0,
               top_p: float = 1.0, prefill_chunk: int = PREFILL_CHUNK, compiler_options: dict | None = None,
               executables: int = 1, pack_params: int = pp.DEFAULT_BYTES, steps_per_call: int = 1,
               unroll_steps: bool = False, prefill_compiler_options: dict | None = None):
    if backend not in ("auto", "latency_specialized"):
      raise ValueError(f"backend={backend!r}: expected 'auto' or 'latency_specialized'")
    if config.q > 1 and not model.mtp:
      raise ValueError(f"q={config.q} needs the MTP draft layer, but the checkpoint has none "
                       f"(layer {model.cfg.num_hidden_layers}): use q=1")
    if executables not in (1, 2):
      raise ValueError(f"executables={executables}: expected 1 or 2")
    if (not isinstance(pack_params, (int, np.integer)) or isinstance(pack_params, bool)
        or not 0 <= pack_params <= pp.MAX_BYTES):
      raise ValueError(f"pack_params={pack_params!r}: expected a byte threshold in [0, {pp.MAX_BYTES}] (0 = off; "
                       "packing copies the packed parameters, so it is for small ones)")
    if (not isinstance(steps_per_call, (int, np.integer)) or isinstance(steps_per_call, bool)
        or not 1 <= steps_per_call <= MAX_STEPS_PER_CALL):
      raise ValueError(f"steps_per_call={steps_per_call!r}: expected an integer in [1, {MAX_STEPS_PER_CALL}]")
    if temperature < 0 or not 0 < top_p <= 1:
      raise ValueError(f"temperature={temperature}, top_p={top_p}: expected temperature >= 0 and 0 < top_p <= 1")
    if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, (int, np.integer)) or prefill_chunk < 1:
      raise ValueError(f"prefill_chunk={prefill_chunk!r}: expected a positive int (prompt tokens per prefill call)")
    if prefill_compiler_options is not None and (
        not isinstance(prefill_compiler_options, dict)
        or not all(isinstance(k, str) and isinstance(v, (bool, int, float, str))
                   for k, v in prefill_compiler_options.items())):
      raise ValueError(f"prefill_compiler_options={prefill_compiler_options!r}: expected a dict of XLA option names "
                       "to bool / int / float / str values (e.g. {'xla_gpu_autotune_level': 0})")
    unknown = sorted(set(config.policy_dict()) - POLICY_KEYS)
    gone = [f"{k} ({REMOVED_KNOBS[k]})" for k in unknown if k in REMOVED_KNOBS]
    if gone:
      raise ValueError(f"policy knob(s) removed after measurement: {'; '.join(gone)}")
    if unknown:
      raise ValueError(f"unknown policy key(s) {unknown}: expected some of {sorted(POLICY_KEYS)}")
    if backend == "auto" and _requested_kernels(config):
      raise ValueError(f"the policy turns on kernel(s) {sorted(_requested_kernels(config))} but backend 'auto' runs "
                       "none (the stock path): use backend='latency_specialized'")
    if config.max_context % model.cfg.index_kpool:
      raise ValueError(f"max_context={config.max_context} must be a multiple of index_kpool={model.cfg.index_kpool}")
    # the GPU the step's kernels are compiled for: the mesh's (a CPU mesh: Hopper's, the CUDA lowering's default)
    self.platform = detect_platform(model.mesh.devices.flat)
    if backend == "latency_specialized" and self.platform not in ("cpu", *SUPPORTED_GPUS):
      raise ValueError(f"backend 'latency_specialized' runs Mosaic GPU kernels, which need one of {SUPPORTED_GPUS} "
                       f"(or a CPU, in interpret mode): this mesh is {self.platform}; use backend='auto'")
    if backend == "latency_specialized" and not has_wgmma(self.platform):
      wg = sorted(k for k in _requested_kernels(config) if declined_on(self.platform, k))
      if wg:
        raise ValueError(f"the policy turns on kernel(s) {wg}: each {WGMMA_REASON.format(arch=self.platform)}")
      pol = {**KERNEL_DEFAULTS, **config.policy_dict()}
      hilo = [k for k in ("fp8_linear", "fp8_moe") if pol.get(k) and k in _requested_kernels(config)]
      if hilo and not pol.get("fp8_dq"):  # (the defaults with fp8_dq off: declined at each site, with the reason)
        raise ValueError(f"the policy turns on {hilo} with fp8_dq off: on {self.platform} the FP8 kernels run only "
                         "in the dq kernels' tcgen05 form (the hi/lo kernels issue wgmma) — turn fp8_dq on, or "
                         f"{hilo} off")
      off = sorted(k for k, on in {**KERNEL_DEFAULTS, **config.policy_dict()}.items()
                   if on and declined_on(self.platform, k))
      if off:  # (defaults, not requests: declined at every site, said here, when a decoder is built, and in
        # kernel_sites())
        import warnings  # noqa: PLC0415
        warnings.warn(f"latency_specialized on {self.platform}: kernel(s) {off} run as XLA — each "
                      f"{WGMMA_REASON.format(arch=self.platform)}; so does the mHC boundary of several token rows "
                      f"unless policy knob mhc_rows is on", stacklevel=2)
    self.model, self.config, self.backend = model, config, backend
    self.temperature, self.top_p = float(temperature), float(top_p)
    # XLA options for the step's AOT compilation, e.g. {"xla_gpu_autotune_level": 0} (benchmarks/bench_decode.py
    # --fast-compile); with options set, the first step of a capture size compiles ahead of time too
    self.compiler_options = compile_options(backend, model.mesh.devices.flat[0].platform, compiler_options,
                                            loop=steps_per_call > 1 and not unroll_steps)
    self._aot: dict[int, Any] = {}  # capture size -> compiled step (warmup)
    # executables=2: warmup() also loads a second copy of each compiled step and step() alternates between them
    # (each its own CUDA graph). Measured on the H200 (BENCHMARKS.md, session 19): no faster — a graph launch does
    # not wait on its previous launch; kept for the experiment.
    self.executables = executables
    # pack_params > 0: parameters whose local shard is under this many bytes reach the step packed in one buffer
    # per dtype (glm5_jax.param_packing): at 64 KiB the one-rank step's lowered arguments fell from 1,830 to 1,073.
    # The host parses every argument on every call (~1.3 µs each) and at B = 1 the step is host-bound; on by
    # default (param_packing.DEFAULT_BYTES), 0 turns it off.
    self.pack_params = int(pack_params)
    # steps_per_call = n > 1: one call runs n speculative steps on the device, each fed the previous one's output
    # (the module doc: the host's launch cost is paid once per n steps). A rolled loop (lax.fori_loop: the step
    # traced and compiled once; on the GPU inside the CUDA graph: GPU_LOOP_OPTIONS join the compile options) or,
    # with unroll_steps, n copies of the step in one program (n times the compile, and the graph's nodes).
    self.steps_per_call, self.unroll_steps = int(steps_per_call), bool(unroll_steps)
    self._copies: dict[int, list] = {}
    self._calls: dict[int, int] = {}  # steps run per capture size (which copy runs next)
    self._ran: set[int] = set()  # capture sizes whose step has traced and run
    self.prefill_chunk = int(prefill_chunk)  # prompts run in chunks of at most this many tokens (one compile each)
    self._given_options = compiler_options
    # XLA options the prefill's chunk programs compile with (jax.jit's compiler_options), e.g. {"xla_gpu_autotune_level":
    # 0}: 768- and 1,024-token chunks compiled past 300 s on an H100 with XLA's autotuning ("Very slow compile" of a
    # fusion module the autotuner builds; sessions 76-77) — an unknown name fails at the first prefill, named by XLA
    self.prefill_compiler_options = dict(prefill_compiler_options or {})
    self.prefill_sites: dict = {}  # the prefill kernels' call sites in the traced chunks (_check_prefill_kernels)
    self._single: Decoder | None = None  # generate()'s one-step decoder near max_context (steps_per_call > 1)

  # ------------------------------------------------------------------ shapes
  @property
  def kv_fp8(self) -> bool:
    """FP8 latent + indexer caches: the latency_specialized default (the deployment requires an FP8 KV cache);
    policy {"kv_cache_dtype": "fp8"} also gives the stock path the same cache numerics (its references)."""
    default = "fp8" if self.backend == "latency_specialized" else "auto"
    return str(self.config.policy_dict().get("kv_cache_dtype", default)).startswith("fp8")

  def layout(self, batch):
    cfg = self.config
    return st.cache_layout(self.model.cfg, batch, cfg.max_context, cfg.q, self.model.dtype, mtp=self.model.mtp,
                           kv_fp8=self.kv_fp8)

  # ------------------------------------------------------------------ the step
  def _step_fn(self, batch):
    model, cfg = self.model, self.config
    q, k = cfg.q, cfg.q - 1
    greedy = self.temperature == 0.0
    temperature, top_p = self.temperature, self.top_p
    cspecs = st.cache_specs(self.layout(batch))

    def fn(*args):
      with kernel_report() as rep:
        # the PDL launch mode of every Mosaic kernel (kernel_mode sets it; recorded here as one site)
        from pallas_kernels._common import interpreting  # noqa: PLC0415
        kernel_enabled("pdl", fits=not interpreting(), why="GPU interpret mode (no launches to overlap)")
        out = body(*args)
      _KERNEL_SITES[self._sites_key(batch)] = self._check_kernels(rep)  # at trace time: raises before any run
      return out

    def one(m, caches, lengths, n_acc, keys, active, tokens):
      """One speculative step -> (caches, (lengths, n_acc, keys, next_tokens), emitted [B, q], counts, finite)."""
      B = tokens.shape[0]
      ctx = StepCtx(lengths, jnp.full_like(lengths, q), n_acc, mode="verify")
      h, layers, _ = m.trunk(tokens, caches["layers"], ctx)
      drafts = tokens[:, 1:]  # [B, k]
      i = jnp.arange(q, dtype=jnp.int32)[None]
      keys_new, ks = _split_keys(keys)
      if greedy:
        target = m.argmax(h)  # [B, q]
        ok = drafts == target[:, :k]
      else:
        p = _probs(m.logits(h), temperature, top_p)  # [B, q, V]
        pd = jnp.take_along_axis(p[:, :k], drafts[..., None], axis=-1)[..., 0]
        u = jax.vmap(lambda kk: jax.random.uniform(jax.random.fold_in(kk, 1), (k,)))(ks)
        ok = u < pd
      n = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)  # accepted drafts [B]
      if greedy:
        new_tok = jnp.take_along_axis(target, n[:, None], axis=1)[:, 0]
      else:
        pn = jnp.take_along_axis(p, n[:, None, None], axis=1)[:, 0]  # [B, V]
        rejected = jnp.take_along_axis(jnp.pad(drafts, ((0, 0), (0, 1))), n[:, None], axis=1)[:, 0]
        pn = jnp.where((n < k)[:, None] & (jnp.arange(pn.shape[-1])[None] == rejected[:, None]), 0.0, pn)
        pn = pn / jnp.sum(pn, axis=-1, keepdims=True)
        new_tok = _sample(jax.vmap(lambda kk: jax.random.fold_in(kk, 2))(ks), pn)
      emitted = jnp.where(i < n[:, None], jnp.pad(drafts, ((0, 0), (0, 1))), -1)
      emitted = jnp.where(i == n[:, None], new_tok[:, None], emitted)
      # MTP: inputs shifted left by one, the new token at the last accepted index n
      shifted = jnp.pad(tokens[:, 1:], ((0, 0), (0, 1)))
      next_ids = jnp.where(i == n[:, None], new_tok[:, None], shifted)
      if m.mtp is not None:
        new_drafts, mtp = _first_drafts(m, h, next_ids, lengths, n, caches["mtp"], q, k, jnp.full_like(n, q))
      else:
        new_drafts, mtp = jnp.zeros((B, 0), jnp.int32), caches["mtp"]
      finite = jnp.all(jnp.isfinite(h.astype(jnp.float32)), axis=(1, 2))  # NaN/Inf logits are never sampled
      live = active & finite
      counts = jnp.where(live, n + 1, 0)
      new_lengths = lengths + counts
      new_n_acc = jnp.where(live, n + 1, n_acc)
      nxt = jnp.concatenate([new_tok[:, None], new_drafts], axis=1)
      nxt = jnp.where(live[:, None], nxt, tokens)
      return ({"layers": layers, "mtp": mtp}, (new_lengths, new_n_acc, keys_new, nxt),
              jnp.where(live[:, None], emitted, -1), counts, finite | ~active)

    steps, unroll = self.steps_per_call, self.unroll_steps
    rolled = steps > 1 and not unroll

    def body(make_m, caches, io):
      lengths, n_acc, keys, active, tokens = _io_views(io, q)
      if steps == 1:
        caches, carry, emitted, counts, finite = one(make_m(), caches, lengths, n_acc, keys, active, tokens)
        return caches, _io_pack(*carry[:3], active, carry[3], emitted, counts, finite)
      B = tokens.shape[0]
      m = None if rolled else make_m()  # (unrolled: one module for the n copies, as one step builds it)

      def it(_, c):
        caches, carry, out, total, fin = c
        # rolled: the module (the packed parameters' slices) built inside the loop body, where XLA fuses the
        # slices into their consumers; built before the loop they were loop operands, copied once per call
        mi = make_m() if m is None else m
        caches, carry, emitted, counts, finite = one(mi, caches, *carry[:3], active, carry[3])
        # this step's tokens after the ones already committed (its -1 tail is overwritten by the next step's)
        out = jax.vmap(lambda o, e, t: jax.lax.dynamic_update_slice(o, e, (t,)))(out, emitted, total)
        return caches, carry, out, total + counts, fin & finite

      c = (caches, (lengths, n_acc, keys, tokens), jnp.full((B, steps * q), -1, jnp.int32),
           jnp.zeros((B,), jnp.int32), jnp.ones((B,), bool))
      if unroll:
        for i in range(steps):  # (kernel sites are reported per step: the copies after the first go unrecorded)
          with contextlib.nullcontext() if i == 0 else kernel_report():
            c = it(i, c)
      else:
        c = jax.lax.fori_loop(0, steps, it, c)
      caches, carry, out, total, fin = c
      return caches, _io_pack(*carry[:3], active, carry[3], out, total, fin, steps=steps)

    pack = self._pack()
    sm = model.shard_map(fn, (cspecs, REP), (cspecs, REP), pack=pack, lazy=True)
    n = 1 if pack is None else 2  # parameter arguments before the caches
    return jax.jit(sm, donate_argnums=(n, n + 1))  # outputs alias the donated caches and io: no buffer moves

  def _check_kernels(self, rep):
    """Summarise a traced step's kernel sites; a kernel the policy turns on explicitly that runs at no site is
    an error naming why (a requested path never silently falls back)."""
    sites: dict = {}
    for name, reason in rep:
      d = sites.setdefault(name, {"sites": 0, "not_used": {}})
      if reason is None:
        d["sites"] += 1
      else:
        d["not_used"][reason] = d["not_used"].get(reason, 0) + 1

    def impossible(k):  # batches past the decode kernels' row limit run in XLA by design: not a failure alone
      d = sites.get(k)
      if not d:  # (a prefill kernel has a site in a step only where the decode MoE declines: many rows)
        return k not in PREFILL_KNOBS
      return not d["sites"] and any("token rows >" not in r for r in d["not_used"])

    missing = sorted(k for k in _requested_kernels(self.config) if impossible(k))
    if missing:
      why = "; ".join(f"{k}: " + (", ".join(sites[k]["not_used"]) if k in sites else "no call site in this step")
                      for k in missing)
      raise ValueError(f"the policy turns on kernel(s) {missing} that cannot run in this step — {why}")
    return sites

  def kernel_sites(self, batch: int | None = None) -> dict:
    """Which kernels the traced step of capture size ``batch`` (default: the first traced capture size) runs, at
    how many call sites, and why they do not run elsewhere: {kernel: {"sites": n, "not_used": {reason: n}}}.
    Empty for backend "auto" (no kernels) or before the step is traced (warmup() traces every capture size)."""
    sizes = self.config.capture_sizes if batch is None else (batch,)
    return next((_KERNEL_SITES[k] for k in map(self._sites_key, sizes) if k in _KERNEL_SITES), {})

  def _sites_key(self, batch):
    return (self.model.graph_key, self.model.mesh, self.key, batch)  # as compiled(): decoders that share a step

  @classmethod
  def from_deployment(cls, model: Model, deployment, **kw) -> "Decoder":
    """The decoder a deployment asks for: ``additional_config["decode_backend"]`` "auto" (stock path) or
    "latency_specialized" (kernels), gated by runtime.unsupported() — an unsupported deployment raises a
    ValueError listing every reason; nothing silently falls back."""
    from glm5_jax.runtime import specialized_decode_config  # noqa: PLC0415
    if deployment.model != model.cfg:
      raise ValueError("deployment.model is not the loaded model's config")
    if deployment.tensor_parallel_size != model.tp:
      raise ValueError(f"deployment.tensor_parallel_size={deployment.tensor_parallel_size} but the model is "
                       f"loaded on a mesh of {model.tp} devices")
    spec = specialized_decode_config(deployment)
    if spec is not None:
      return cls(model, spec, backend="latency_specialized", **kw)
    k = deployment.num_speculative_tokens if deployment.speculative else 0
    cfg = DecodeConfig(max_context=deployment.max_model_len or model.cfg.max_position_embeddings, q=1 + (k or 0),
                       capture_sizes=tuple(deployment.capture_sizes),
                       policy=tuple(sorted(deployment.additional().get("policy", {}).items())))
    return cls(model, cfg, backend="auto", **kw)

  def kernel_mode(self, interpret: bool | None = None, policy: dict | None = None):
    """Pallas kernels run natively on a GPU; elsewhere (tests on CPU) in Mosaic GPU interpret mode.
    interpret=False forces native lowering (cross-lowering for CUDA on a CPU). ``policy``: the kernel switches
    (default: the decoder's)."""
    if self.backend != "latency_specialized":
      return contextlib.nullcontext()
    from glm5_jax.layers import use_kernels  # noqa: PLC0415
    from pallas_kernels._common import maybe_interpret, pdl_mode  # noqa: PLC0415
    stack = contextlib.ExitStack()
    stack.enter_context(maybe_interpret(interpret))
    policy = self.config.policy_dict() if policy is None else policy
    stack.enter_context(use_kernels(policy, self.platform))
    stack.enter_context(pdl_mode(policy.get("pdl", KERNEL_DEFAULTS["pdl"])))  # (the step records it: _step_fn)
    return stack

  def prefill_kernel_mode(self, interpret: bool | None = None):
    """The kernels a prefill chunk runs (latency_specialized): only those built for many token rows
    (layers.PREFILL_KNOBS: the prefill MoE, DSA's attention, the indexer's scores and selection, the KDA state
    hand-over, the mHC sites' two-pass XLA form and their Sinkhorn kernel — policy knobs moe_prefill
    (moe_prefill_rows, moe_prefill_resident: its forms), mla_prefill, indexer_prefill, topk_prefill, kda_handover,
    mhc_prefill, mhc_prefill_sinkhorn; kda_chunk_gemm: the chunked KDA's form) — those on by default
    (layers.KERNEL_DEFAULTS) on a GPU, the others and elsewhere (GPU interpret mode) where the policy asks for them; the
    decode kernels stay off there, the knobs that only choose their forms (layers.PREFILL_FORM_KNOBS) keep the policy's
    values. The stock backend: none.
    interpret=False: native lowering, with a GPU's defaults (a compile-only census on a CPU)."""
    from pallas_kernels._common import on_gpu  # noqa: PLC0415
    policy = self.config.policy_dict()
    native = on_gpu() if interpret is None else not interpret
    # (on by default where they run natively; in GPU interpret mode — the CPU — only when the policy asks)
    on = {k: bool(policy.get(k, KERNEL_DEFAULTS[k] and native)) for k in PREFILL_KNOBS}
    if not any(on.values()):
      return contextlib.nullcontext()
    forms = {k: bool(policy.get(k, KERNEL_DEFAULTS[k])) for k in PREFILL_FORM_KNOBS}  # (their forms: as the step's)
    return self.kernel_mode(interpret, policy={**{k: False for k in KERNEL_DEFAULTS}, **forms, **on})

  def _check_prefill_kernels(self, rep):
    """Record a traced prefill chunk's kernel sites (``prefill_sites``: {kernel: {"sites": n, "not_used": {reason:
    n}}}, as ``kernel_sites`` for the step). A prefill kernel the policy turns on explicitly that the chunk declined
    (its shapes) is an error naming why; a chunk without its call site (few pairs: the MoE's gather path) is not."""
    if not rep:  # (no trace: a compiled chunk)
      return
    refused = {}
    for name, reason in rep:
      if name not in PREFILL_KNOBS:  # (the decode kernels: off in a chunk's policy)
        continue
      d = self.prefill_sites.setdefault(name, {"sites": 0, "not_used": {}})
      if reason is None:
        d["sites"] += 1
      else:
        d["not_used"][reason] = d["not_used"].get(reason, 0) + 1
      if name in _requested_kernels(self.config) and reason is not None:
        refused.setdefault(name, set()).add(reason)
    if refused:
      why = "; ".join(f"{k}: {', '.join(sorted(r))}" for k, r in sorted(refused.items()))
      raise ValueError(f"the policy turns on prefill kernel(s) {sorted(refused)} that cannot run here — {why}")

  @property
  def key(self):
    return (self.config, self.backend, self.temperature, self.top_p, self.steps_per_call, self.unroll_steps)

  def _pack(self):
    return self.model.pack_layout(self.pack_params) if self.pack_params else None

  def _param_args(self, params=None) -> tuple:
    """The step's parameter arguments: (params,) or, packed, (big leaves, packed buffers); ``params`` abstract
    (ShapeDtypeStructs with shardings) gives abstract ones."""
    if not self.pack_params:
      return (self.model.params if params is None else params,)
    if params is None:
      return self.model.packed_params(self.pack_params)
    lay = pp.layout(params, self.model.param_specs, self.model.tp, self.pack_params)
    own = self._pack()
    if (lay.big, lay.small, lay.sizes) != (own.big, own.small, own.sizes):  # (trees may differ in metadata only)
      raise ValueError("the abstract parameters do not pack like the model's (shapes, dtypes or specs differ)")
    return pp.abstract(params, lay, self.model.mesh)

  def step_fn(self, batch):
    # the pack layout (None: unpacked) is part of the key: the step slices the packed buffers at its offsets
    return compiled(self.model, ("step", self.key, batch, self._pack()), lambda: self._step_fn(batch))

  def trace_step(self, batch, params=None, *, interpret: bool | None = None):
    """Trace the step for capture size ``batch`` on abstract state (``params``: the model's, or abstract ones
    with shardings) -> jax Traced, to .lower() / .compile(). For .lower(lowering_platforms=("cuda",)) on a CPU
    pass interpret=False and lower inside ``kernel_mode(interpret=False)``."""
    rep = NamedSharding(self.model.mesh, REP)
    sd = lambda s, d: jax.ShapeDtypeStruct(s, d, sharding=rep)
    b = batch
    with self.kernel_mode(interpret), compile_target(self.platform):
      return self.step_fn(b).trace(
          *self._param_args(params), st.abstract_caches(self.layout(b), self.model.mesh),
          sd((b, io_width(self.config.q, self.steps_per_call)), jnp.int32))

  def warmup(self, capture_sizes=None, *, single_step: bool = False, workers: int = 1):
    """Compile the step for every capture size ahead of time (AOT): later steps run the stored executables
    and nothing compiles while decoding. ``single_step`` (steps_per_call > 1): also the one-step decoder that
    ``for_next_call`` hands the last steps to near max_context — else it compiles when a sequence gets there
    (the step's full compile time, ~40-60 s at the real geometry, in the middle of decoding). ``workers`` > 1:
    the capture sizes' XLA compiles run concurrently (``warmup_all``)."""
    warmup_all([self], capture_sizes, single_step=single_step, workers=workers)

  def _lowered_step(self, b):
    with self.kernel_mode():  # Mosaic lowering happens in lower(): keep interpret mode / kernels active
      return self.trace_step(b).lower()

  def _adopt(self, b, executable):
    """Store the compiled step of capture size ``b`` and warm what runs around it (nothing stored if that fails:
    a later warmup tries again)."""
    try:
      self._adopt_unchecked(b, executable)
    except BaseException:
      self._aot.pop(b, None)
      self._copies.pop(b, None)
      raise

  def _adopt_unchecked(self, b, executable):
    self._aot[b] = executable
    # the small programs around each step (its output views; a caller's tokens written into io) compile here
    # too, on an io laid out as the step returns it
    io = jax.device_put(jnp.zeros((b, io_width(self.config.q, self.steps_per_call)), jnp.int32),
                        executable.output_shardings[-1])
    _io_output(_io_set_tokens(io, jax.device_put(jnp.zeros((b, self.config.q), jnp.int32),
                                                 NamedSharding(self.model.mesh, REP))), self.config.q)
    if self.executables > 1 and b not in self._copies:
      self._copies[b] = [executable, self._second_copy(b)]

  def _second_copy(self, b):
    """Another loaded executable of the compiled step: on a GPU a deserialised copy (no recompilation); on the CPU
    (whose serialised executables in jax 0.11.2 lose their kernels: "Function ..._kernel not found") compiled again."""
    devices = list(self.model.mesh.devices.flat)
    if devices[0].platform == "cpu":
      with self.kernel_mode():
        return self.trace_step(b).lower().compile(self.compiler_options or None)
    from jax.experimental import serialize_executable as se  # noqa: PLC0415
    return se.deserialize_and_load(*se.serialize(self._aot[b]), execution_devices=devices)

  def step(self, state: DecodeState, tokens=None):
    """One speculative step (steps_per_call of them). ``tokens`` [B, q] int32 (default: the state's next_tokens).
    Validated before any buffer is donated, so a rejected call leaves ``state`` usable."""
    cfg = self.config
    span = cfg.q * self.steps_per_call  # positions one call may write per sequence
    if state.decoder is not self:
      raise ValueError("this state belongs to another Decoder")
    if tokens is not None:
      t = tokens if isinstance(tokens, jax.Array) else np.asarray(tokens)
      if t.ndim != 2 or t.shape != (state.batch, cfg.q):
        raise ValueError(f"tokens must be [B, q] = [{state.batch}, {cfg.q}] (batch, 1 + k drafts): got "
                         f"shape {tuple(t.shape)}")
      tokens = _check_tokens(self.model, np.asarray(t))
    if state.len_bound + span > cfg.max_context:
      worst = state.longest()
      if worst + span > cfg.max_context:
        raise ValueError(f"a sequence at length {worst} cannot verify q={cfg.q} more tokens"
                         + (f" in each of {self.steps_per_call} steps" if self.steps_per_call > 1 else "")
                         + f" within max_context={cfg.max_context}; nothing was written")
      state = dataclasses.replace(state, len_bound=worst)
    if (self.compiler_options or self.executables > 1) and state.batch not in self._aot:
      self.warmup((state.batch,))
    if state.batch in self._copies:
      copies = self._copies[state.batch]
      n = self._calls.get(state.batch, 0)
      fn = copies[n % len(copies)]
      self._calls[state.batch] = n + 1
    else:
      fn = self._aot.get(state.batch) or self.step_fn(state.batch)
    io = state.io
    if tokens is not None:  # written into io in place: refuse a malformed state first; and before the step has
      # first traced (which may still refuse the call), write into a copy
      self._check_state_shapes(state)
      io = _io_set_tokens(io if state.batch in self._ran else jnp.copy(io),
                          jax.device_put(tokens, NamedSharding(self.model.mesh, REP)))
    with self.kernel_mode():
      caches, io = fn(*self._param_args(), state.caches, io)
    self._ran.add(state.batch)
    return DecodeState(caches, io, self, state.len_bound + span), _io_output(io, cfg.q)

  def _check_state_shapes(self, state):
    """The state's caches and io have the shapes and dtypes of this decoder's layout (what the compiled step
    would check only after the io was donated)."""
    want = jax.tree.map(lambda a: (tuple(a.shape), jnp.dtype(a.dtype)), st.cache_shapes(self.layout(state.batch)))
    got = jax.tree.map(lambda a: (tuple(a.shape), jnp.dtype(a.dtype)), state.caches)
    io_want = ((state.batch, io_width(self.config.q, self.steps_per_call)), jnp.dtype(jnp.int32))
    if got != want or (tuple(state.io.shape), jnp.dtype(state.io.dtype)) != io_want:
      raise ValueError(f"the state's caches / io do not have this decoder's shapes (capture size {state.batch}, "
                       f"q={self.config.q}): was it built for another configuration or modified?")

  # ------------------------------------------------------------------ prefill
  def prefill_rows(self, longest: int) -> int:
    """Token rows of the chunk programs a prefill whose longest prompt has ``longest`` tokens runs: a power of two
    from 16 up to prefill_chunk (buckets: few compiles)."""
    return min(self.prefill_chunk, max(16, 1 << (int(longest) - 1).bit_length()))

  def prefill(self, prompts, *, seeds=None) -> DecodeState:
    """Build the state from a list of prompts (token-id sequences of different lengths): the target forward
    over every prompt (in chunks), the first token, the MTP pass over the prompt and the first k drafts.
    The batch is padded to the next capture size with inactive rows. Returns the state; its next_tokens are the
    first step's input."""
    model, cfg = self.model, self.config
    prompts = [np.asarray(p, np.int64).reshape(-1) for p in prompts]
    if not prompts:
      raise ValueError("prefill needs at least one prompt")
    for j, p in enumerate(prompts):
      if p.size == 0:
        raise ValueError(f"prompt {j} is empty: expected at least one token")
      if p.size + cfg.q > cfg.max_context:
        raise ValueError(f"prompt {j} has {p.size} tokens: expected at most max_context - q = "
                         f"{cfg.max_context - cfg.q}")
      _check_tokens(model, p[None], place=False)
    B = cfg.capture_size_for(len(prompts))
    lens = np.array([p.size for p in prompts] + [1] * (B - len(prompts)), np.int32)
    active = np.arange(B) < len(prompts)
    Tmax = int(lens.max())
    T = self.prefill_rows(Tmax)
    n_chunks = -(-Tmax // T)
    toks = np.zeros((B, n_chunks * T), np.int32)
    for j, p in enumerate(prompts):
      toks[j, :p.size] = p
    seeds = np.arange(len(prompts)) if seeds is None else np.asarray(seeds)
    keys = np.zeros((B, 2), np.uint32)
    with _on_host():  # (drawn on the host: on the GPU each seed's key was a kernel and a device-to-host copy before
      # the first chunk could be dispatched)
      keys[:len(prompts)] = np.stack([np.asarray(jax.random.key_data(jax.random.key(int(s)))) for s in seeds])
    rep = NamedSharding(model.mesh, REP)
    put = lambda x: jax.device_put(x, rep)
    caches = st.init_caches(self.layout(B), model.mesh)
    lengths = put(np.zeros(B, np.int32))
    # Every array below has a shape of (B, T) alone, not of the prompt's chunk count: a prompt of a new length
    # compiles nothing (the chunks' hidden states concatenated, a first-token program over them and the next ids of
    # the whole prompt did: ~0.6 s of session 63's 1.6 s prefill of a 4K prompt on an H100 ran no kernel)
    hs, h_last = [], None  # (each chunk's hidden states; each sequence's at its last prompt position [B, D])
    fn = _prefill_target_fn(self, B, T)
    for c in range(n_chunks):
      valid = np.clip(lens - c * T, 0, T).astype(np.int32)
      args = (put(toks[:, c * T:(c + 1) * T]), lengths, put(valid))
      with self.prefill_kernel_mode(), kernel_report() as traced:  # (traced at the first chunk: its sites reported)
        caches, h = fn(model.params, caches, *args)
      self._check_prefill_kernels(traced)
      lengths = lengths + put(valid)
      hs.append(h)
      here = (lens - 1 >= c * T) & (lens - 1 < (c + 1) * T)
      hl = _row_at(h, put(np.clip(lens - 1 - c * T, 0, T - 1).astype(np.int32)))
      h_last = hl if h_last is None else jnp.where(put(here)[:, None], hl, h_last)
    first, keys, finite = _first_token_fn(self, B)(model.params, h_last, put(keys))

    def check_finite():  # (a host read: it waits for the target chunks)
      ok = np.asarray(finite)[:len(prompts)]
      if not ok.all():
        j = int(np.flatnonzero(~ok)[0])
        raise FloatingPointError(f"prompt {j} produced NaN/Inf logits at its last position: nothing was sampled "
                                 "(check the weights and the dtype)")
    if not model.mtp:
      check_finite()
      return DecodeState.make(caches, lengths, np.ones(B, np.int32), keys, active, first[:, None], self,
                              int(lens.max()))
    next_ids = np.zeros_like(toks)  # (the token after each position; at the last one, the first sampled: below)
    next_ids[:, :-1] = toks[:, 1:]
    mfn = _prefill_mtp_fn(self, B, T)
    mstart = put(np.zeros(B, np.int32))
    drafts = None
    for c in range(n_chunks):
      valid = np.clip(lens - c * T, 0, T).astype(np.int32)
      last_here = (lens - 1 >= c * T) & (lens - 1 < (c + 1) * T)
      idx_last = np.clip(lens - 1 - c * T, 0, T - 1).astype(np.int32)
      at_last = put(last_here[:, None] & (np.arange(T)[None] == idx_last[:, None]))
      nid = jnp.where(at_last, first[:, None], put(next_ids[:, c * T:(c + 1) * T]))
      args = (hs[c], nid, mstart, put(valid), put(idx_last))
      with self.prefill_kernel_mode():
        caches, d = mfn(model.params, caches, *args)
      drafts = d if drafts is None else jnp.where(put(last_here)[:, None], d, drafts)
      mstart = mstart + put(valid)
    # checked once the MTP pass is dispatched: read before it, the host left the GPU idle while it dispatched the
    # MTP chunks (16.7 ms of a 4K prompt's traced 336 ms on an H100, session 80); the state is still refused
    check_finite()
    nxt = jnp.concatenate([first[:, None], drafts], axis=1)
    return DecodeState.make(caches, lengths, np.ones(B, np.int32), keys, active, nxt, self, int(lens.max()))

  # ------------------------------------------------------------------ generate
  def _single_decoder(self) -> "Decoder":
    if self._single is None:
      self._single = Decoder(self.model, self.config, backend=self.backend, temperature=self.temperature,
                             top_p=self.top_p, prefill_chunk=self.prefill_chunk,
                             compiler_options=self._given_options, pack_params=self.pack_params,
                             prefill_compiler_options=self.prefill_compiler_options)
    return self._single

  def single_step(self, state: DecodeState) -> tuple["Decoder", DecodeState]:
    """(a decoder of one step per call with this one's settings, ``state`` handed over to it: the same caches,
    io repacked to its width; its calls then return one step's tokens). For the last steps where steps_per_call
    steps no longer fit max_context but one does (generate(), the CLI)."""
    d = self._single_decoder()
    return d, DecodeState.make(state.caches, state.lengths, state.n_acc, state.keys, state.active,
                               state.next_tokens, d, state.len_bound)

  def for_next_call(self, state: DecodeState) -> tuple["Decoder", DecodeState]:
    """(decoder, state) for the next call: this decoder and ``state``, or — where steps_per_call steps no longer
    fit max_context for the longest active sequence but one step does — ``single_step(state)``, so that a loop of
    calls runs to the end of the context (generate(), the CLI). Reads the lengths (a sync) only near the end."""
    span = self.config.q * self.steps_per_call
    if self.steps_per_call == 1 or state.len_bound + span <= self.config.max_context:
      return self, state
    worst = state.longest()
    if worst + span > self.config.max_context >= worst + self.config.q:
      return self.single_step(state)
    return self, state

  def stream(self, prompts, max_new_tokens: int, *, seeds=None, eos_id=None):
    """Prefill + speculative steps, yielding each call's new tokens as they come: a ``Chunk`` per call — ``tokens``,
    for every prompt the tokens it emitted (the first chunk: the prefill's first token each), and ``steps``, the
    speculative steps the call ran (0 for the prefill's). A sequence ends at ``max_new_tokens`` or at an
    end-of-sequence id (``eos_id``: one id or several — a checkpoint's ``Glm5Config.eos_token_id`` —, emitted,
    nothing after it); the generator returns when every sequence has.

    The next call is issued before this call's tokens are read (the host prepares it while the GPU runs this one),
    except near max_context, where the last steps run one per call (``for_next_call``). NaN / Inf logits in a
    live sequence raise ``FloatingPointError`` naming it: nothing was sampled from them."""
    eos = _eos_set(eos_id)
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
      raise ValueError(f"max_new_tokens={max_new_tokens!r}: expected an int >= 1")
    state = self.prefill(prompts, seeds=seeds)
    n = len(prompts)
    first = [int(t) for t in np.asarray(state.next_tokens[:n, 0])]  # chosen by the prefill, emitted first
    emitted = np.ones(n, np.int64)
    done = np.array([max_new_tokens <= 1 or t in eos for t in first])
    yield Chunk([[t] for t in first], 0)
    dec, max_ctx = self, self.config.max_context
    pend = None if done.all() else dec.step(state)  # (state after the step, its output)
    while pend is not None:
      state, o = pend
      span = dec.config.q * dec.steps_per_call  # positions one call may write per sequence
      # Issue the next step before reading this one's tokens: the host prepares it while the GPU still runs this
      # one (reading first would serialise host and GPU time). Only where it cannot hit max_context (no sync);
      # the step after the last useful one is then computed and dropped.
      pend = dec.step(state) if state.len_bound + span <= max_ctx else None
      toks, counts, finite = np.asarray(o.tokens), np.asarray(o.counts), np.asarray(o.finite)
      live = ~done
      if not finite[:n][live].all():
        j = int(np.flatnonzero(live & ~finite[:n])[0])
        raise FloatingPointError(f"sequence {j} produced NaN/Inf logits after {int(emitted[j])} generated tokens: "
                                 "nothing was sampled from them (check the weights and the dtype)")
      chunk = [[] for _ in range(n)]
      for j in np.flatnonzero(live):
        for t in toks[j, :counts[j]].tolist():
          chunk[j].append(t)
          emitted[j] += 1
          if t in eos or emitted[j] >= max_new_tokens:
            done[j] = True
            break
      yield Chunk(chunk, dec.steps_per_call)
      if done.all():
        break
      if pend is None:  # near max_context: the next step after reading (it refuses what does not fit)
        if done.any():  # (a finished sequence that ran ahead must not refuse the step the others still need)
          state = state.retired(np.flatnonzero(done))
        dec, state = dec.for_next_call(state)
        pend = dec.step(state)

  def generate(self, prompts, max_new_tokens: int, *, seeds=None, eos_id=None, progress=False):
    """Prefill + speculative steps until every prompt has ``max_new_tokens`` new tokens (or hit an end-of-sequence
    id: ``eos_id``, one or several) — ``stream``'s calls collected. Returns (list of generated token lists, stats
    {steps: speculative steps run, tokens: emitted, tokens_per_step})."""
    n = len(prompts)
    out = [[] for _ in range(n)]
    bar = None
    if progress:
      from tqdm.auto import tqdm  # noqa: PLC0415
      bar = tqdm(total=max_new_tokens * n, desc="generating", unit="tok")
    steps = 0
    for chunk in self.stream(prompts, max_new_tokens, seeds=seeds, eos_id=eos_id):
      steps += chunk.steps
      for o, c in zip(out, chunk.tokens):
        o += c
      if bar is not None:
        bar.update(sum(map(len, chunk.tokens)))
    if bar is not None:
      bar.close()
    emitted = sum(map(len, out))
    return out, {"steps": steps, "tokens": emitted, "tokens_per_step": emitted / max(steps * n, 1)}


def _on_host():
  """A context placing jax's arrays on the host's CPU device — or, where jax runs without one (JAX_PLATFORMS naming
  only the GPU), on the default device: the same values, a device round trip more."""
  try:
    return jax.default_device(jax.local_devices(backend="cpu")[0])
  except RuntimeError:
    return contextlib.nullcontext()


def _split_keys(keys):
  """keys [B, 2] uint32 -> (next keys, this step's keys), both raw uint32 key data."""
  k = jax.vmap(lambda d: jax.random.split(jax.random.wrap_key_data(d), 2))(keys)
  return jax.random.key_data(k[:, 0]), k[:, 1]


def _prefill_options(dec: Decoder) -> tuple:
  return tuple(sorted(dec.prefill_compiler_options.items()))


def _prefill_target_fn(dec: Decoder, B: int, T: int):
  return compiled(dec.model, ("_prefill_target_fn", dec.key, B, T, _prefill_options(dec)),
                  lambda: _prefill_target_fn_build(dec, B, T))


def _prefill_target_fn_build(dec: Decoder, B: int, T: int):
  cspecs = st.cache_specs(dec.layout(B))

  def fn(m, caches, tokens, start, valid):
    ctx = StepCtx(start, valid, jnp.ones_like(start), mode="extend")
    h, layers, _ = m.trunk(tokens, caches["layers"], ctx)
    return {"layers": layers, "mtp": caches["mtp"]}, h

  return jax.jit(dec.model.shard_map(fn, (cspecs, REP, REP, REP), (cspecs, REP)), donate_argnums=(1,),
                 compiler_options=dec.prefill_compiler_options or None)


def _first_token_fn(dec: Decoder, B: int):
  return compiled(dec.model, ("_first_token_fn", dec.key, B), lambda: _first_token_fn_build(dec, B))


def _first_token_fn_build(dec: Decoder, B: int):
  greedy, temperature, top_p = dec.temperature == 0.0, dec.temperature, dec.top_p

  def fn(m, hl, keys):  # hl [B, D]: each sequence's hidden state at its last prompt position
    keys_new, ks = _split_keys(keys)
    finite = jnp.all(jnp.isfinite(hl.astype(jnp.float32)), axis=-1)
    if greedy:
      return m.argmax(hl), keys_new, finite
    p = _probs(m.logits(hl), temperature, top_p)
    return _sample(ks, p), keys_new, finite

  return jax.jit(dec.model.shard_map(fn, (REP, REP), (REP, REP, REP)))


@jax.jit
def _row_at(h, i):
  """h [B, T, D], i [B] -> [B, D]: each sequence's row i."""
  return jnp.take_along_axis(h, i[:, None, None], axis=1)[:, 0]


def _prefill_mtp_fn(dec: Decoder, B: int, T: int):
  return compiled(dec.model, ("_prefill_mtp_fn", dec.key, B, T, _prefill_options(dec)),
                  lambda: _prefill_mtp_fn_build(dec, B, T))


def _prefill_mtp_fn_build(dec: Decoder, B: int, T: int):
  cspecs = st.cache_specs(dec.layout(B))
  q, k = dec.config.q, dec.config.q - 1

  def fn(m, caches, h, next_ids, start, valid, idx_last):
    drafts, mtp = _first_drafts(m, h, next_ids, start, idx_last, caches["mtp"], q, k, valid)
    return {"layers": caches["layers"], "mtp": mtp}, drafts

  return jax.jit(dec.model.shard_map(fn, (cspecs, REP, REP, REP, REP, REP), (cspecs, REP)), donate_argnums=(1,),
                 compiler_options=dec.prefill_compiler_options or None)


@dataclasses.dataclass
class Compiled:
  """One step compiled by ``warmup_all``: its decoder and capture size, the seconds its lowering (Python, one at
  a time) and its XLA compile (in a worker thread: wall time, longer while others compile beside it) took, and
  the exception that stopped it (None: the decoder holds the executable)."""
  decoder: "Decoder"
  batch: int
  lower_s: float = 0.0
  compile_s: float = 0.0
  error: BaseException | None = None


def warmup_all(decoders, capture_sizes=None, *, single_step: bool = False, workers: int = 1,
               strict: bool = True, should_start=None, on_ready=None) -> list[Compiled]:
  """Compile the steps of several decoders (each for ``capture_sizes``, default its config's) ahead of time.

  Lowering traces Python (the Mosaic kernels are lowered there) and runs one step at a time; XLA's compile
  releases the GIL, so with ``workers`` > 1 each step's compile runs in a thread while the next step lowers and
  other compiles run — a benchmark of five policies, or a decoder of four capture sizes, then costs about the
  lowerings plus one compile instead of every compile in turn. The compiled steps are adopted (stored, their
  small helper programs compiled) on the calling thread, in order, each as soon as it and those before it are
  compiled. ``strict``: raise the first error after every step finished (else it is in its ``Compiled``).
  ``should_start(decoder, batch)`` -> bool: asked before each lowering (a benchmark's time budget); a step it
  refuses is left out of the result. ``on_ready(Compiled)``: called on the calling thread as each step is
  adopted (or fails), in order."""
  import concurrent.futures as cf  # noqa: PLC0415
  import time  # noqa: PLC0415
  decs = []
  for d in decoders:
    if single_step and d.steps_per_call > 1:
      decs.append(d._single_decoder())
    decs.append(d)
  todo = [(d, b) for d in decs for b in (capture_sizes or d.config.capture_sizes) if b not in d._aot]
  done: list[Compiled] = []

  def compile_one(c, low):
    t = time.perf_counter()
    try:
      return low.compile(c.decoder.compiler_options or None)
    finally:
      c.compile_s = time.perf_counter() - t

  def finish(c, result):
    try:
      if c.error is None:
        c.decoder._adopt(c.batch, result())
    except Exception as e:  # noqa: BLE001 (handed back in the Compiled, or raised below when strict)
      c.error = e
    done.append(c)
    if on_ready is not None:
      on_ready(c)

  with cf.ThreadPoolExecutor(max(1, workers)) as pool:
    pending = []
    for d, b in todo:
      if should_start is not None and not should_start(d, b):
        continue
      c = Compiled(d, b)
      t = time.perf_counter()
      try:
        low = d._lowered_step(b)
      except Exception as e:  # noqa: BLE001
        c.error = e
      c.lower_s = time.perf_counter() - t
      if c.error is not None:  # (reported in its turn, after the compiles started before it)
        failed = cf.Future()
        failed.set_result(None)
        pending.append((c, failed))
        continue
      if workers <= 1:  # no thread: the compile on this thread, adopted at once
        for pc, pf in pending:
          finish(pc, pf.result)
        pending.clear()
        finish(c, lambda c=c, low=low: compile_one(c, low))
        continue
      pending.append((c, pool.submit(compile_one, c, low)))
      while pending and pending[0][1].done():  # adopt what is ready (in order) before the next lowering
        c, fut = pending.pop(0)
        finish(c, fut.result)
    for c, fut in pending:
      finish(c, fut.result)
  if strict:
    for c in done:
      if c.error is not None:
        raise c.error
  return done


def decode(state: DecodeState, tokens=None):
  """``glm5_jax.decode(state, tokens) -> (state, DecodeOutput)``: one speculative step — or the decoder's
  steps_per_call of them, chained on the device (see the module doc).

  tokens [B, q] int32: the last committed token followed by k drafts (default: state.next_tokens, i.e. what the
  previous step proposed); with several steps per call, the first step's input. The input state is donated: use
  the returned one."""
  if not isinstance(state, DecodeState) or state.decoder is None:
    raise TypeError(f"decode() needs a DecodeState made by Decoder.prefill: got {type(state).__name__}")
  return state.decoder.step(state, tokens)
