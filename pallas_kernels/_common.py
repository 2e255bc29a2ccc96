"""Helpers shared by the kernels: interpret mode on CPU, CUDA cross-lowering, one lowering per program
(kernel_entry) and per process (_memoize_kernel_lowerings), one Mosaic module (_dedupe_kernel_modules) per
distinct kernel, barriers and counters."""

from __future__ import annotations

import contextlib
import dataclasses
import os

import jax
import jax.numpy as jnp
from jax._src import config as jax_config
from jax.experimental.mosaic.gpu import core as _mgpu_core
from jax.experimental.mosaic.gpu import utils as _mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

_DUMP_NAME = "mosaic_gpu.dump_basename"


F16_MAX = 65504.0  # the largest finite f16 (the dq kernels' f16 activations saturate there: linear._act)


MMA_FORMS = ("wgmma", "tcgen05")  # Hopper's warpgroup MMA; Blackwell's tensor-core gen 5 MMA (TMEM accumulator)


def check_mma(mma: str, name: str) -> bool:
  """Whether ``mma`` (a kernel entry's MMA form) is the tcgen05 one; an unknown form is refused by name."""
  if mma not in MMA_FORMS:
    raise ValueError(f"{name}: mma={mma!r}, expected one of {MMA_FORMS}")
  return mma == "tcgen05"


def tmem_to_wgmma(acc, t_s):
  """A [128, N] f32 register array in tcgen05's layout (a TMEM accumulator's load: a row per thread) -> the same
  values in the WGMMA layout the Hopper forms' epilogues take, through the SMEM f32 tile t_s (no register relayout
  between the two exists). The commit is also a warpgroup barrier: every warp's TMEM load is done after it."""
  t_s[...] = acc
  plgpu.commit_smem()
  return plgpu.load(t_s, layout=plgpu.Layout.WGMMA, optimized=False)


def saturate_f16(x):
  """x in f16, saturated at ±65,504 (the conversion alone would give inf past it: bf16 keeps such values) — the dq
  kernels' f16 activations, wherever they are made (linear._act, the f16 copies of the mHC boundary and W_UV)."""
  return jnp.clip(x.astype(jnp.float32), -F16_MAX, F16_MAX).astype(jnp.float16)


def _dedupe_kernel_modules():
  """Make identical kernels lower to identical Mosaic GPU modules.

  jax 0.11.2 stamps every lowered module with a per-process counter (attribute ``mosaic_gpu.dump_basename``,
  used only to name dump files) before hashing it. The runtime compiles one binary per hash (MLIR passes, an
  LLVM-JIT'd host launcher and ptxas, seconds each), so the same kernel called from 45 layers was compiled 45
  times: the real-geometry step has 244 kernel calls and its first run took minutes. Dropping the stamp before
  serialisation leaves one module -- and one compilation -- per distinct kernel; the runtime sets the name
  again itself if it dumps. Checked by tests/test_step_lowering.py."""
  orig = getattr(_mgpu_core, "_run_serde_pass", None)
  if orig is None or getattr(orig, "_drops_dump_name", False):
    return  # (another jax: nothing to patch; identical kernels may then compile once per call site)
  if os.environ.get("MOSAIC_GPU_DUMP_TO"):
    return  # dumping: keep jax's own file names

  def run_serde_pass(module, *args, **kwargs):
    attrs = module.operation.attributes
    if _DUMP_NAME in attrs:
      del attrs[_DUMP_NAME]
    return orig(module, *args, **kwargs)

  run_serde_pass._drops_dump_name = True
  _mgpu_core._run_serde_pass = run_serde_pass


_dedupe_kernel_modules()


def _memoize_kernel_lowerings():
  """Lower each traced kernel to its Mosaic GPU module once per process.

  jax lowers a kernel again for every program that calls it (its lowering cache lives in one module's context),
  and a kernel's lowering is seconds (Mosaic GPU's layout inference: 1.75 s per kernel of the kernel-tiny step, 15
  of its 19 s). The kernels' entry points are jax.jit functions (``kernel_entry``), so a kernel called again
  with the same shapes and statics — another policy, another test, bench_decode's next configuration — brings
  back the *same* traced jaxpr object; its module is kept (as MLIR bytecode: the round trip is exact, a textual
  one was not) and parsed into the new program's context instead of lowered again. Keyed by that jaxpr's
  identity (held, so the key cannot be reused) and everything else the lowering reads; errors are not kept."""
  from jax._src.pallas.mosaic_gpu import lowering as _lowering  # noqa: PLC0415
  from jax._src.pallas.mosaic_gpu import pallas_call_registration as _registration  # noqa: PLC0415
  orig = getattr(_registration.lowering, "lower_unpipelined_jaxpr_to_module", None)
  if orig is None or getattr(orig, "_memoized", False) or os.environ.get("MOSAIC_GPU_DUMP_TO"):
    return  # (another jax: nothing to patch; dumping: every lowering writes its own files)
  import io  # noqa: PLC0415
  from jax._src.lib.mlir import ir  # noqa: PLC0415
  kept: dict = {}

  def lower(gpu_mesh, jax_mesh, jaxpr, in_shapes, out_shapes, params, **kwargs):
    key = (id(jaxpr), tuple(in_shapes), tuple(out_shapes), params, gpu_mesh, jax_mesh)
    if (hit := kept.get(key)) is not None and hit[0] is jaxpr:
      return _lowering.LoweringResult(ir.Module.parse(hit[1], context=ir.Context.current), *hit[2])
    r = orig(gpu_mesh, jax_mesh, jaxpr, in_shapes, out_shapes, params, **kwargs)
    code = io.BytesIO()
    r.module.operation.write_bytecode(code)
    kept[key] = (jaxpr, code.getvalue(), (r.grid, r.block, r.new_out_shapes, r.profiler_spec, r.gmem_scratch_shapes))
    return r

  lower._memoized = True
  lower.kept = kept  # (tests read how many modules were kept)
  _registration.lowering.lower_unpipelined_jaxpr_to_module = lower


_memoize_kernel_lowerings()


def _name_layout_variables_once():
  """Number the module's values once per layout inference instead of once per printed operation.

  Mosaic GPU's layout inference (jax 0.11.2) sorts its variables by their names, ``str(ValueSite)``: the first
  tokens of ``str(operation)``, whose printer numbers every SSA value of the enclosing module again for each
  operation printed — 4,477 prints and 6.1 of the kernel-tiny step's 34 s of (profiled) lowering (session 57).
  Here each ``infer_layout`` call numbers its module once (an ``ir.AsmState``, as the printer would build it) and
  prints the operations with it: the same text, so the same order and the same layouts — and 29 % less lowering
  time (the kernel-tiny step at q = 1 20.1 -> 14.2 s; tests/test_sparse_mla.py checks every name against jax's and
  the lowered kernels byte for byte against the unpatched inference)."""
  import io  # noqa: PLC0415
  import re  # noqa: PLC0415
  import threading  # noqa: PLC0415

  from jax._src.lib.mlir import ir  # noqa: PLC0415
  from jax.experimental.mosaic.gpu import layout_inference as _li  # noqa: PLC0415
  site, infer = getattr(_li, "ValueSite", None), getattr(_li, "infer_layout", None)
  regex = getattr(_li, "_op_name_regex", None)
  # (jax 0.11.2 only — the pinned version, whose ValueSite.__str__ ``named`` reproduces; another jax keeps its own)
  if (jax.__version__ != "0.11.2" or site is None or infer is None or getattr(infer, "_names_memoized", False)
      or not isinstance(regex, re.Pattern) or regex.pattern != r"^(%\d+ = )?\S+"):
    return
  plain = site.__str__
  local = threading.local()  # per thread (lowerings may run in several): the open infer_layout calls' (module,
  # AsmState or None), innermost last

  tags = {_li.VariableType.OPERAND: "o", _li.VariableType.RESULT: "r"}

  def named(self):  # (ValueSite.__str__ of jax 0.11.2, the operation printed with the call's numbering)
    states = getattr(local, "states", None)
    if not states:
      return plain(self)
    module, state = states[-1]
    if state is None:
      state = ir.AsmState(module.operation)
      states[-1] = (module, state)
    buf = io.StringIO()
    self.operation.print(state, file=buf)
    return f"{regex.match(buf.getvalue()).group(0)}:{tags.get(self.type, 'a')}-{self.index}"

  def infer_layout(module, *args, **kwargs):
    states = local.__dict__.setdefault("states", [])
    states.append((module, None))
    try:
      return infer(module, *args, **kwargs)
    finally:
      states.pop()

  infer_layout._names_memoized = True  # (a second import does not patch twice)
  infer_layout.unmemoized = infer
  site.__str__ = named
  _li.infer_layout = infer_layout


_name_layout_variables_once()


def _cache_layout_hashes():
  """Hash each of layout inference's frozen values once instead of at every dictionary lookup.

  Mosaic GPU's layout inference (jax 0.11.2) reduces its constraint system again at every step of its search: ~1.9
  million constraint reductions for the kernel-tiny step, each looking its variables up in the assignments — and a
  frozen dataclass's generated ``__hash__`` hashes its fields again each time (a Variable its ValueSite, that its
  operation, type and index: 11.7 million hash calls, ~20 % of the step's lowering). These classes are immutable,
  so their hash is computed once and kept on the instance: the same values, the same dictionary order, the same
  layouts — the kernel-tiny step's lowering 39.0 -> 28.1 s on the CPU, its kernels' hashes unchanged
  (tests/test_sparse_mla.py lowers kernels with and without it, byte for byte)."""
  from jax.experimental.mosaic.gpu import constraints as _cs  # noqa: PLC0415
  from jax.experimental.mosaic.gpu import layout_inference as _li  # noqa: PLC0415
  names = ("Variable", "RegisterLayout", "TMEMLayout", "SMEMTransforms", "Reduce", "Reshape", "Transpose",
           "CollapseShape", "Equals", "Relayout", "NotOfType", "IsTransferableTmemRegisters",
           "IsTransferableSmemRegisters", "Divides", "IsSupportedBroadcast", "MinorDimDivisibleBy", "AlwaysTrue",
           "OneOf")
  classes = [getattr(_cs, n, None) for n in names] + [getattr(_li, "ValueSite", None)]
  if jax.__version__ != "0.11.2" or not all(
      c is not None and dataclasses.is_dataclass(c) and c.__dataclass_params__.frozen
      and "__slots__" not in c.__dict__ for c in classes):
    return  # (another jax: its classes may differ — keep its own hashing)
  for cls in classes:
    plain = cls.__hash__
    if getattr(plain, "_cached", False):
      continue

    def cached(self, plain=plain):
      try:
        return self.__dict__["_glm5_hash"]
      except KeyError:
        h = plain(self)
        object.__setattr__(self, "_glm5_hash", h)  # (frozen: the dataclass's own __setattr__ refuses)
        return h

    cached._cached = True
    cached.plain = plain  # (tests lower with the plain hashes too)
    cls.__hash__ = cached


_cache_layout_hashes()


# Counters in a plain int32 GMEM ref (a slice [1] of a jax Ref the step passes in: ``jax.new_ref``, one zero fill
# per step) with the semaphore operations of Mosaic GPU: plgpu.semaphore_* take semaphore-typed refs only, i.e.
# pl.get_global scratch, which XLA zero-fills before every call (a graph node per launch). A signal is one thread's
# release add after a warpgroup barrier (the CTA's stores before it are ordered first, as plgpu.semaphore_signal);
# a wait polls with one thread, then an acquire fence and a warpgroup barrier. ``take`` subtracts the count it
# waited for: the waiter leaves the counter as it found it before the signals (self-resetting).
def counter_signal(ref):
  """Add 1 to the counter ``ref`` (int32 [1], GMEM) once per warpgroup, with release semantics (GPU scope)."""
  _counter_op(ref, signal=True)


def counter_wait(ref, count: int, *, take: bool = False, async_reads: bool = False):
  """Wait until the counter ``ref`` reaches ``count`` (acquire, GPU scope); ``take``: subtract it then (a
  compare-and-swap spin: one waiter per counter; without it a read-only poll, any number of waiters);
  ``async_reads``: a proxy fence after it, for TMA loads of what the signalling CTAs wrote."""
  _counter_op(ref, count=count, take=take, async_reads=async_reads)


def counter_publish(ref):
  """:func:`counter_signal` after this warpgroup's completed TMA stores (``plgpu.wait_smem_to_gmem``): a proxy fence
  first, so the release covers them for a consumer that waits with ``async_reads`` (or reads them generically)."""
  _counter_op(ref, signal=True, publish=True)


def wg_barrier():
  """A warpgroup barrier (``bar.sync``) — what Mosaic GPU puts before and after every vector store to a ref, and
  before every TMA load, unless a kernel is built with ``CompilerParams(unsafe_no_auto_barriers=True)``: a lean
  kernel (policy knob lean_barriers) places its own, here and in ``plgpu.commit_smem`` (a fence and this barrier),
  only where one thread reads what another wrote (or overwrites what another still reads)."""
  @plgpu.inline_mgpu()
  def op(_):
    _mgpu_utils.warpgroup_barrier()

  op()


def fence_async_writes():
  """``fence.proxy.async.global``: this thread's completed TMA stores (``plgpu.wait_smem_to_gmem``) ordered before
  its later generic-proxy operations — so a grid barrier's release (a semaphore or counter signal) covers them for
  CTAs that read them with plain loads after the barrier. (Plain GMEM stores need no fence.)"""
  @plgpu.inline_mgpu()
  def op(_):
    _mgpu_utils.inline_ptx("fence.proxy.async.global;", has_side_effects=True)

  op()


def spin_cycles(n: int):
  """Hold the warpgroup ~``n`` SM clock cycles (its threads poll %clock64): a fixed delay where no counter says
  when — a CTA's weight requests held back just long enough for another role's loads to be queued ahead of them."""
  from jax._src.lib.mlir import ir  # noqa: PLC0415
  from jax._src.lib.mlir.dialects import arith, scf  # noqa: PLC0415
  if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
    raise ValueError(f"spin_cycles: n = {n!r}; expected a positive int (SM clock cycles)")

  @plgpu.inline_mgpu()
  def op(_):
    u = _mgpu_utils
    i64 = ir.IntegerType.get_signless(64)
    clock = lambda: u.inline_ptx("mov.u64 $0, %clock64;", result_types=i64, has_side_effects=True)  # noqa: E731
    t0 = clock()
    loop = scf.WhileOp([], [])
    with ir.InsertionPoint(loop.before.blocks.append()):
      scf.condition(arith.cmpi(arith.CmpIPredicate.ult, arith.subi(clock(), t0), u.c(n, i64)), [])
    with ir.InsertionPoint(loop.after.blocks.append()):
      scf.yield_([])

  op()


def _counter_op(ref, *, signal: bool = False, count: int = 0, take: bool = False, publish: bool = False,
                async_reads: bool = False):
  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
  def op(_, counter):
    sem = _mgpu_utils.SemaphoreRef(_mgpu_utils.memref_ptr(counter))
    if signal:
      if publish:  # (the generic proxy's release must cover the async proxy's completed writes)
        _mgpu_utils.inline_ptx("fence.proxy.async.global;", has_side_effects=True)
      _mgpu_utils.warpgroup_barrier()
      sem.signal(1, memory_scope="gpu")
    else:
      sem.wait(count, decrement=take, memory_scope="gpu")
      if async_reads:
        _mgpu_utils.inline_ptx("fence.proxy.async.global;", has_side_effects=True)

  op(ref)


# A low-latency exchange between the CTAs of one grid (NCCL's "LL" protocol, within a GPU): each value travels
# with a flag in one 8-byte word, written by one relaxed store and read by relaxed polls of the word itself — the
# data and its arrival in one L2 round trip, where a grid barrier takes a release (after a fence over the CTA's
# stores), the pollers' acquire loads of a counter, and then the data's own loads (the one-row mHC boundary's
# barrier + partial sums: 1.65 + 0.82 µs of its ~6.5 on an H100, session 67's profile). The flag is an epoch: the
# words sit in a GMEM int32 Ref zeroed once per program run (LL_HEAD words: the epoch, a pad), every exchange
# writes epoch + 1 (a word from an earlier exchange holds a smaller flag, so a poll cannot mistake it), and the
# exchange's CTA 0 stores epoch + 1 back once it holds every CTA's words — after each CTA has read the epoch
# (its words carry it). The next kernel on that Ref starts after this one ends (the Ref is each launch's aliased
# operand). 8-byte words are single-copy atomic (st / ld .relaxed.gpu .b64, coherent at the L2: no stale L1 line).
LL_HEAD = 2  # the Ref's words before the exchange's pairs: the epoch and a pad (the pairs 8-byte aligned)


def _ll_flag_layout():
  return plgpu.Layout.WG_STRIDED((128,), vec_size=1)


def ll_epoch(words):
  """The exchange's epoch from ``words`` (``ll_exchange``'s), one per thread ([128] int32): loaded early — at a
  kernel's start, where its L2 round trip overlaps other work instead of preceding the exchange's stores."""
  from jax._src.lib.mlir import ir  # noqa: PLC0415
  from jax.experimental.mosaic.gpu import fragmented_array as fa  # noqa: PLC0415

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),),
                     return_type=plgpu.ShapeDtypeStruct((128,), jnp.int32, layout=_ll_flag_layout()))
  def op(_, w_ref):
    i32 = ir.IntegerType.get_signless(32)
    e = _mgpu_utils.inline_ptx("ld.relaxed.gpu.global.b32 $0, [$1];", _mgpu_utils.memref_ptr(w_ref),
                               result_types=i32, has_side_effects=True)
    return fa.FragmentedArray.splat(e, (128,), fa.WGStridedFragLayout((128,), 1), is_signed=True)

  return op(words)


def ll_exchange(words, src_s, dst_s, epoch, *, src0: int, width: int, parts: int):
  """Every CTA p < ``parts`` of the grid (its first grid axis) publishes ``width`` f32 values src_s[src0:src0 +
  width] (SMEM, written and committed before the call) and gathers every CTA's into dst_s[q, :width] for q < parts
  (SMEM f32 [>= parts, width]; its other rows untouched). ``words``: int32 GMEM [LL_HEAD + 2 · parts · width] (the
  head, then a (value, flag) pair per value), zeroed before the first exchange on it; ``epoch``: ``ll_epoch(words)``
  of this kernel (before any CTA of it can have stored the next). GPU only (no interpreter:
  the kernels that call it run another form in interpret mode). The caller places a warpgroup barrier before any
  thread reads dst_s (each thread stores the values it polled)."""
  from jax._src.lib.mlir import ir  # noqa: PLC0415
  from jax._src.lib.mlir.dialects import arith, gpu, memref, scf, vector  # noqa: PLC0415

  n = parts * width
  polls = -(-n // 128)  # (pairs per thread: thread t reads pairs t, t + 128, ...)

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.RefType(), _ll_flag_layout()))
  def op(_, w_ref, s_ref, d_ref, ep):
    u = _mgpu_utils
    i32, i64, f32 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64), ir.F32Type.get()
    idx = ir.IndexType.get()
    ci = lambda v: u.c(v, i32)  # noqa: E731
    tid = arith.remui(u.thread_idx(), ci(128))
    part = arith.index_cast(i32, gpu.block_id(gpu.Dimension.x))
    base = u.memref_ptr(w_ref)
    at = lambda k: u.getelementptr(base, [k], i32)  # noqa: E731
    flag = arith.addi(vector.extract(ep.registers.flat[0], [], [0]), ci(1))
    mine = arith.cmpi(arith.CmpIPredicate.ult, tid, ci(width))
    put = scf.IfOp(mine)
    with ir.InsertionPoint(put.then_block):  # (thread t < width: value t, flag, one 8-byte store)
      v = memref.load(s_ref, [arith.index_cast(idx, arith.addi(tid, ci(src0)))])
      k = arith.addi(ci(LL_HEAD), arith.muli(arith.addi(arith.muli(part, ci(width)), tid), ci(2)))
      u.inline_ptx("{ .reg .b64 w; mov.b64 w, {$1, $2}; st.relaxed.gpu.global.b64 [$0], w; }", at(k),
                   arith.bitcast(i32, v), flag, has_side_effects=True)
      scf.yield_([])
    # every pair of this thread polled at once, each loop trip one round of loads (one L2 round trip when ready)
    pair = [arith.addi(tid, ci(128 * j)) for j in range(polls)]
    ok = [arith.cmpi(arith.CmpIPredicate.ult, q, ci(n)) for q in pair]
    addr = [at(arith.addi(ci(LL_HEAD), arith.muli(arith.select(o, q, ci(0)), ci(2)))) for q, o in zip(pair, ok)]
    loop = scf.WhileOp([i64] * polls, [u.c(0, i64)] * polls)
    before = loop.before.blocks.append(*([i64] * polls))
    with ir.InsertionPoint(before):
      got = [u.inline_ptx("ld.relaxed.gpu.global.b64 $0, [$1];", a, result_types=i64, has_side_effects=True)
             for a in addr]
      wait = None
      for g, o in zip(got, ok):
        stale = arith.cmpi(arith.CmpIPredicate.ne, arith.trunci(i32, arith.shrui(g, u.c(32, i64))), flag)
        stale = arith.andi(stale, o)  # (a thread's pairs past n: no wait)
        wait = stale if wait is None else arith.ori(wait, stale)
      scf.condition(wait, got)
    after = loop.after.blocks.append(*([i64] * polls))
    with ir.InsertionPoint(after):
      scf.yield_(list(after.arguments))
    for g, q, o in zip(loop.results, pair, ok):
      store = scf.IfOp(o)
      with ir.InsertionPoint(store.then_block):
        v = arith.bitcast(f32, arith.trunci(i32, g))
        memref.store(v, d_ref, [arith.index_cast(idx, arith.divui(q, ci(width))),
                                arith.index_cast(idx, arith.remui(q, ci(width)))])
        scf.yield_([])
    last = scf.IfOp(arith.andi(arith.cmpi(arith.CmpIPredicate.eq, part, ci(0)),
                               arith.cmpi(arith.CmpIPredicate.eq, tid, ci(0))))
    with ir.InsertionPoint(last.then_block):  # (CTA 0 holds every CTA's words: each has read the epoch)
      u.inline_ptx("st.relaxed.gpu.global.b32 [$0], $1;", at(0), flag, has_side_effects=True)
      scf.yield_([])

  op(words, src_s, dst_s, epoch)


# Programmatic Dependent Launch (PDL). With pdl_mode on, every kernel body starts with griddepcontrol.wait (it
# proceeds once its predecessor has finished and its writes are visible) and then griddepcontrol.launch_dependents
# (the next kernel in the stream may be launched while this one runs), so a dependent kernel's launch and
# scheduling overlap its predecessor's run instead of following it; Mosaic launches such a kernel with
# programmatic stream serialisation. The wait comes before anything else the kernel does, so its semantics are the
# plain launch's; the trigger after it keeps early-launched kernels one deep (triggered before the wait, a chain of
# waiting grids could fill the SMs' slots ahead of a kernel that needs several waves). A jax config state (in the
# jit key: the kernels' kernel_entry jits retrace when it changes); the decode step sets it from the policy knob
# "pdl". Whether the edges survive XLA's CUDA graph is benchmarks/bench_pdl.py's question. No effect in GPU
# interpret mode (no launches to overlap: the primitives have no interpreter).
_PDL = jax_config.bool_state(
    "glm5_mosaic_pdl", False, "glm5_jax's Mosaic GPU kernels start with griddepcontrol (PDL)",
    include_in_jit_key=True, include_in_trace_context=True)


def pdl_mode(on: bool):
  """Context: trace the kernels with the PDL prologue (``on``) or without."""
  return _PDL(bool(on))


def with_pdl(body):
  """A kernel body with the PDL prologue when pdl_mode is on (and not in interpret mode); else ``body`` itself."""
  if not _PDL.value or interpreting():
    return body

  def pdl_body(*refs, **kwargs):
    plgpu.griddepcontrol_wait()
    plgpu.griddepcontrol_launch_dependents()
    return body(*refs, **kwargs)

  return pdl_body


# In-kernel profiling (Mosaic GPU's profiler): with kernel_profile(dir) active at trace time, every kernel is built
# with CompilerParams(profile_space, profile_dir) — each warpgroup records the entry and exit times (the SM's
# global timer) of the body's jax.named_scope regions into a buffer that a host callback dumps after the call as a
# Chrome trace (<dir>/<kernel>-<ns>-trace.json; benchmarks/bench_kernel_profile.py reads them). A jax config state
# (in the jit key, as pdl_mode), so profiled and plain traces never share a kernel entry's cache; the folder is one
# per process (jax's string states are not in the jit key). Off by default; GPU only (not in interpret mode).
_PROFILE = jax_config.bool_state(
    "glm5_mosaic_profile", False, "glm5_jax's Mosaic GPU kernels record their named scopes' times (kernel_profile)",
    include_in_jit_key=True, include_in_trace_context=True)
_PROFILE_DIR: list[str] = []
PROFILE_SPACE = 256  # events per warpgroup (a range is two): the kernels' scopes in loops must fit


@contextlib.contextmanager
def kernel_profile(directory: str):
  """Context: trace the kernels with Mosaic GPU's profiler on, their traces written to ``directory`` (one folder
  per process)."""
  directory = os.path.abspath(directory)
  if _PROFILE_DIR and _PROFILE_DIR[0] != directory:
    raise ValueError(f"kernel_profile: {directory!r}; this process profiles into {_PROFILE_DIR[0]!r} already (the "
                     "folder is part of the cached kernels)")
  os.makedirs(directory, exist_ok=True)
  _PROFILE_DIR[:] = [directory]
  with _PROFILE(True):
    yield directory


def profiled(cp: plgpu.CompilerParams | None) -> plgpu.CompilerParams | None:
  """``cp`` with the profiler's parameters under ``kernel_profile`` (GPU only), else as it is."""
  if _PROFILE.value and not interpreting():
    return (cp or plgpu.CompilerParams()).replace(profile_space=PROFILE_SPACE, profile_dir=_PROFILE_DIR[0],
                                                  profile_bounds_check=True)
  return cp


def mgpu_kernel(body, **kwargs):
  """``plgpu.kernel`` with the body under ``with_pdl`` (every kernel of the package is built through here but the
  KDA recurrence's ``pl.kernel``, which also takes ``profiled``'s parameters), and with the profiler's parameters
  under ``kernel_profile``."""
  if _PROFILE.value and not interpreting():
    kwargs["compiler_params"] = profiled(kwargs.pop("compiler_params", None))
  return plgpu.kernel(with_pdl(body), **kwargs)


def kernel_entry(*static: str):
  """Decorator for a kernel's public entry point: jax.jit with the given static keyword arguments. A kernel that
  45 layers call with the same shapes is then traced and lowered once per program (an inner jit is lowered once
  into a called function that XLA inlines again); lowering the real-geometry step spent 53 of its 70 s in
  Mosaic GPU lowering one call site at a time. The interpret-mode switch is part of jax's jit key, so native and
  interpret-mode traces never mix."""
  return lambda fn: jax.jit(fn, static_argnames=static)


def round_bf16(v):
  """f32 -> f32 rounded to bf16's 8 significant bits (to nearest, ties to even), by integer arithmetic on the bits:
  a rounding no compiler elides (XLA on the CPU, GPU interpret mode, drops f32 -> bf16 -> f32 as excess
  precision). ±inf stay; a NaN stays NaN (the carry would turn the GPU's 0x7FFFFFFF into -0.0)."""
  v = v.astype(jax.numpy.float32)
  bits = jax.lax.bitcast_convert_type(v, jax.numpy.uint32)
  bits = (bits + jax.numpy.uint32(0x7FFF) + ((bits >> 16) & jax.numpy.uint32(1))) & jax.numpy.uint32(0xFFFF0000)
  return jax.numpy.where(v != v, v, jax.lax.bitcast_convert_type(bits, jax.numpy.float32))


def order_key(v):
  """f32 [...] -> int32 keys monotone in lax.top_k's total order of f32 bit patterns (NaN above +inf, -NaN below
  -inf, +0 above -0): the model's sort-free top-k (glm5_jax.layers.topk_by_rank / topk_set_by_threshold) and the
  router kernel compare these, so that their selection is lax.top_k's for any input."""
  bits = jax.lax.bitcast_convert_type(v.astype(jax.numpy.float32), jax.numpy.int32)
  return jax.numpy.where(bits < 0, bits ^ jax.numpy.int32(0x7FFFFFFF), bits)


def order_key_u32(v):
  """``order_key`` as uint32 with the sign bit flipped: the same order as unsigned compares (the top-k threshold
  kernel's keys — formed by XLA, or in the kernel's registers from the scores)."""
  return jax.lax.bitcast_convert_type(order_key(v), jax.numpy.uint32) ^ jax.numpy.uint32(0x80000000)


def warp_split_layout():
  """The register layout of a warpgroup's [rows, 4, 32] array with warp i holding [:, i, :] (lane j [:, i, j], the
  rows in registers): summing over axis 2 (lanes: shuffles) then axis 0 (registers) leaves one value per warp with
  no cross-warp step. The cross-warp step of Mosaic GPU's warpgroup-semantics reductions uses one SMEM scratch at
  the same offset for every warpgroup of a CTA (jax 0.11.2, lowering._reduce_lowering_rule_wg), so warpgroups that
  reduce concurrently race on it — kernels with several warpgroups reduce to per-warp values in this layout and
  combine them through SMEM of their own (tests/test_router_kernel.py: the race and this way around it)."""
  from jax.experimental.mosaic.gpu import fragmented_array as fa  # noqa: PLC0415
  return plgpu.Layout.TILED(fa.Tiling(((1, 4, 32), (1,))), warp_dims=(-3,), lane_dims=(-2,), vector_dim=-1)


def warp_rows_layout():
  """The register layout of a warpgroup's [4, C] array (C a multiple of 64) with warp m holding row m (lanes x
  2-vectors along the row, its 64-column tiles in registers): reductions along a row stay inside its warp — one
  warpgroup reduces 4 rows at once with no cross-warp step (see warp_split_layout for why that matters)."""
  from jax.experimental.mosaic.gpu import fragmented_array as fa  # noqa: PLC0415
  return plgpu.Layout.TILED(fa.Tiling(((4, 64), (2,))), warp_dims=(-3,), lane_dims=(-2,), vector_dim=-1)


def tiled(layout) -> plgpu.Layout:
  """A mosaic-gpu TiledLayout as a Pallas register layout (canonicalised)."""
  layout = layout.canonicalize()
  return plgpu.Layout.TILED(layout.tiling, warp_dims=layout.warp_dims, lane_dims=layout.lane_dims,
                            vector_dim=layout.vector_dim)


def replicated_rows_layouts(D: int = 128):
  """(ROWS, ROW): the register layout of a warpgroup's [R, D] array (any R) with every warp holding all R rows
  (32 lanes x 4-vectors along a row: D == 128), the 4 warps replicas — row reductions stay inside a warp (no
  cross-warp step), GMEM / SMEM rows load and store as they are — and of one [D] row of it (to broadcast over
  rows). For a few rows of a head (the KDA norm epilogue, the indexer's pooled-key update)."""
  from jax.experimental.mosaic.gpu import fragmented_array as fa  # noqa: PLC0415
  if D != 128:
    raise NotImplementedError(f"replicated_rows_layouts: D={D}; the rows layout covers 128 columns (32 lanes x 4)")
  rows = fa.TiledLayout(fa.Tiling(((1, D), (1, 4))), warp_dims=(fa.Replicated(4),), lane_dims=(-3,), vector_dim=-1,
                        _check_canonical=False).canonicalize()
  return tiled(rows), tiled(rows.reduce([0]))


def on_gpu() -> bool:
  return jax.default_backend() == "gpu"


def interpreting() -> bool:
  """Whether Mosaic GPU kernels traced here run in GPU interpret mode (``plgpu.force_gpu_interpret_mode``, as
  ``maybe_interpret`` sets it; part of jax's jit key): for kernels with a form interpret mode cannot run (a
  register-A wgmma) and one it can. Reads jax's private config (0.11.2)."""
  return isinstance(jax_config.pallas_tpu_interpret_mode_context_manager.value, plgpu.InterpretGPUParams)


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
