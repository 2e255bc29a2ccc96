"""What a compiled decode step is made of: its kernel census and the GPU time per model component.

The model labels its parts with ``jax.named_scope`` (embed, mhc, kda, dsa, indexer, router, moe, mlp, lm_head,
draft); XLA keeps the scope path in each instruction's ``op_name`` metadata. ``census`` counts the kernel-level
instructions of the optimised HLO (fusions, custom calls — Pallas kernels, cuBLAS, TopK —, sorts, collectives,
loops): the static kernel count of issue #14. ``split`` attributes measured kernel durations (from CUPTI, named
after the HLO instruction that launched them) to components: the per-component table of the benchmarks.
"""

from __future__ import annotations

import collections
import re

COMPONENTS = ("embed", "mhc", "kda", "dsa", "indexer", "router", "moe", "mlp", "lm_head", "draft", "all-reduce",
              "other")
# innermost-first: the indexer runs inside a DSA layer, the router inside an MoE block; a draft pass is one unit
_ORDER = ("indexer", "router", "kda", "dsa", "moe", "mlp", "mhc", "lm_head", "embed")

# instructions that launch no kernel of their own (aliases, tuples, parameters, loop plumbing)
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
         "replica-id", "opt-barrier", "add-dependency", "all-reduce-done", "all-gather-done",
         "collective-permute-done", "async-done", "copy-done", "send-done", "recv-done", "call", "while",
         "conditional", "domain"}
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")

_COMP_HEAD = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"(?:^|[\s\]}\)])([a-z][a-z0-9\-]*)\(")
_OPNAME = re.compile(r'op_name="([^"]*)"')
_CALLED = re.compile(r"(?:calls|to_apply|called_computations)=\{?%?([\w.\-]+(?:,\s*%?[\w.\-]+)*)\}?")


def component(op_name: str) -> str:
  """The model component an instruction belongs to, from its op_name scope path."""
  parts = op_name.split("/")
  if "draft" in parts:
    return "draft"
  for c in _ORDER:
    if c in parts:
      return c
  return "other"


def _instructions(hlo_text: str):
  """Yields (computation, name, opcode, op_name, rest of the line) for every instruction of an HLO module."""
  comp = None
  for line in hlo_text.splitlines():
    h = _COMP_HEAD.match(line)
    if h:
      comp = h.group(1)
      continue
    m = _INSTR.match(line)
    if not m or comp is None:
      continue
    name, rest = m.groups()
    op = _OPCODE.search(rest)
    opn = _OPNAME.search(rest)
    yield comp, name, op.group(1) if op else "?", opn.group(1) if opn else "", rest


def _called(rest: str) -> list[str]:
  """The computations an instruction calls (fused bodies, reducers, comparators, a call's target)."""
  return [c.strip().lstrip("%") for m in _CALLED.finditer(rest) for c in m.group(1).split(",")]


def _kernel_rows(hlo_text: str):
  """(name, opcode, op_name, rest of the line) of the instructions that run as kernels: those of computations
  that are not fused bodies, reducers or sort comparators (i.e. the entry computation, loop bodies / branches,
  called computations). Loops name their computations with condition= / body= and branches with
  branch_computations=, which _CALLED does not match; a `call` runs its computation's instructions as kernels."""
  rows, inner, scope = [], set(), {}
  for comp, _, op, opn, rest in _instructions(hlo_text):
    if op != "call":
      inner.update(_called(rest))
    if opn and (comp not in scope or op == "custom-call"):  # a computation's scope: its custom call's, else any
      scope[comp] = opn
  for comp, name, op, opn, rest in _instructions(hlo_text):
    if comp in inner or op in _FREE:
      continue
    if not opn:  # a fusion with a tuple root carries no metadata (XLA's wrapper of a Mosaic call with an aliased
      # Ref operand — the mHC grid barrier's counters, a fused split-K sum): the scope of what it calls
      opn = next((scope[c] for c in _called(rest) if c in scope), "")
    rows.append((name, op, opn, rest, comp))
  return rows


def kernel_listing(hlo_text: str) -> str:
  """The kernel-level instructions as TSV (computation, name, opcode, component, result shape, op_name): small
  enough to bring back from a device where the module text (Mosaic kernels' serialized bodies included) is not,
  and to diff two programs' kernels (e.g. one step against a loop of steps: which buffers the loop copies)."""
  def shape(rest, op):
    return rest[:max(0, rest.find(f" {op}("))][:120]
  return "".join(f"{comp}\t{name}\t{op}\t{component(opn)}\t{shape(rest, op)}\t{opn}\n"
                 for name, op, opn, rest, comp in _kernel_rows(hlo_text))


def kernel_instructions(hlo_text: str) -> list[tuple[str, str, str]]:
  """(name, opcode, op_name) of the instructions that run as kernels (see _kernel_rows)."""
  return [r[:3] for r in _kernel_rows(hlo_text)]


_REF = re.compile(r"%([\w.\-]+)")
_CONTROL = re.compile(r"control-predecessors=\{([^}]*)\}")
_INDEX = re.compile(r"\bindex=(\d+)")


def _operand_names(rest: str) -> list[str]:
  """Names of an instruction's operands (the %refs inside its opcode's parentheses) and control predecessors."""
  op = _OPCODE.search(rest)
  names = []
  if op:
    depth, i = 0, op.end() - 1
    for j in range(i, len(rest)):  # up to the matching parenthesis (tuple-typed operands nest)
      depth += {"(": 1, ")": -1}.get(rest[j], 0)
      if depth == 0:
        break
    names = _REF.findall(rest[i:j])
  c = _CONTROL.search(rest)
  return names + (_REF.findall(c.group(1)) if c else [])


_METADATA = re.compile(r",?\s*metadata=\{[^}]*\}")


def _fused_bodies(hlo_text: str) -> dict[str, str]:
  """Computation -> its instructions with the names replaced by their positions and the metadata dropped: equal
  texts are computations XLA may compile to one kernel."""
  lines: dict = collections.defaultdict(list)
  for comp, name, _, _, rest in _instructions(hlo_text):
    lines[comp].append((name, rest))
  out = {}
  for comp, rows in lines.items():
    pos = {n: str(i) for i, (n, _) in enumerate(rows)}
    out[comp] = "\n".join(_REF.sub(lambda m: "%" + pos.get(m.group(1), "c"), _METADATA.sub("", r))  # noqa: B023
                          for _, r in rows)
  return out


def instruction_kernels(hlo_text: str, known=None) -> dict[str, str]:
  """Kernel-level instruction -> the name CUPTI gives the kernel it launches: XLA names a fusion's kernel after
  the instruction (``.``/``-`` -> ``_``); a Mosaic GPU kernel after its kernel name (+ MOSAIC_SUFFIX), also when
  XLA wraps its custom call in a fusion (a dynamic-slice fusion around the KDA kernel's state slots).
  XLA compiles fusions with the same fused computation (or an identical one: its computation deduplicator, its
  kernel reuse cache) to ONE kernel, named after the first of them: the 34 KDA layers' qkv GEMVs all launch
  ``input_reduce_fusion_180`` (session 39's profile, unrolled step). Such a group maps to one name — the first
  member (text order) whose name is in ``known`` (e.g. the names CUPTI recorded), else its first member."""
  mosaic: dict = {}  # computation -> the Mosaic kernel a custom call inside it launches
  for comp, _, op, opn, rest in _instructions(hlo_text):
    if (k := _mosaic_kernel(op, opn, rest)) is not None:
      mosaic[comp] = k + MOSAIC_SUFFIX
  bodies = _fused_bodies(hlo_text)
  out, groups = {}, collections.defaultdict(list)
  for name, op, opn, rest, comp in _kernel_rows(hlo_text):
    own = _mosaic_kernel(op, opn, rest)
    called = _called(rest)
    out[name] = (own + MOSAIC_SUFFIX if own else next((mosaic[c] for c in called if c in mosaic), None)
                 or _sanitize(name))
    if op == "fusion" and out[name] == _sanitize(name) and called:
      # the group: the fusion's kind and result shape (its line up to the operands) + its body's text
      head = _METADATA.sub("", rest[:rest.find(" fusion(")])
      groups[(head, _kind(rest), bodies.get(called[0], called[0]))].append(name)
  for members in groups.values():
    names = [_sanitize(n) for n in members]
    pick = next((k for k in names if known is not None and k in known), names[0])
    for n in members:
      out[n] = pick
  return out


def _kind(rest: str) -> str:
  m = re.search(r"kind=(k\w+)", rest)
  return m.group(1) if m else ""


def _dependence(hlo_text: str):
  """(kernel rows, {computation: {instruction: the instructions it waits for}}, {(computation, kernel
  instruction)}, {(computation, kernel instruction): component}) — operands and control predecessors, an
  element of a tuple instruction depending on that element alone."""
  full = _kernel_rows(hlo_text)
  kernel_comps = {r[4] for r in full}
  is_kernel = {(r[4], r[0]) for r in full}
  comp_of = {(r[4], r[0]): component(r[2]) for r in full}
  body: dict = collections.defaultdict(dict)  # computation -> {name: operand names}
  tuples: dict = {}  # (computation, name of a tuple instruction) -> its operands
  gtes: dict = {}  # (computation, name of a get-tuple-element) -> index
  for comp, name, op, _, rest in _instructions(hlo_text):
    if comp in kernel_comps:
      body[comp][name] = _operand_names(rest)
      if op == "tuple":
        tuples[(comp, name)] = body[comp][name]
      elif op == "get-tuple-element" and (ix := _INDEX.search(rest)):
        gtes[(comp, name)] = int(ix.group(1))
  for (comp, name), i in gtes.items():  # an element of a tuple instruction depends on that element alone
    src = body[comp][name][:1]
    if src and (comp, src[0]) in tuples and i < len(tuples[(comp, src[0])]):
      body[comp][name] = [tuples[(comp, src[0])][i]]
  return full, body, is_kernel, comp_of


def _topological(deps: dict) -> list[str]:
  """The instructions of one computation in a dependence order (iterative post-order)."""
  order, seen = [], set()
  for root in deps:
    stack = [(root, False)]
    while stack:
      n, ready = stack.pop()
      if ready:
        order.append(n)
        continue
      if n in seen:
        continue
      seen.add(n)
      stack.append((n, True))
      stack.extend((q, False) for q in reversed(deps.get(n, ())) if q in deps and q not in seen)
  return order


def timeline_critical_path(hlo_text: str, events, *, execution: int = -1, top_waits: int = 12) -> dict:
  """The critical path of one execution of the program's largest kernel computation, from MEASURED start and end
  times instead of per-kernel weights (``critical_paths``): each kernel waits for the kernel it depends on that
  ended LAST; from the kernel that ends last, that chain back is the path the time actually ran along — with the
  gap before each kernel (launch and scheduling after its input was ready). Where a layer's branches are about
  equally long (session 42: shortening one of a DSA layer's branches did not move the step, 3 times), this names
  the branch that finished last instead of the one with the most weight.

  events: (kernel name as the trace / CUPTI names it, start ns, end ns) for one or more executions of the
  computation (device events of a trace; other kernels' names are ignored). The kernels of one name are matched
  to its instructions in dependence order, execution by execution (``execution``: which one; events of a name
  whose count is not a multiple of its instructions' are left out, with their instructions). Kernels of one name
  on parallel branches (one fused computation used in two branches of a layer) can be matched the wrong way round
  when the GPU runs them in another order than the dependence order lists them (session 43): read the path's waits
  with that in mind — a layer-by-layer timeline of the events themselves does not have the ambiguity.

  Returns {"computation", "matched" (instructions timed), "unmatched" (kernel names left out), "span_us" (first
  start to last end), "path" [(instruction, component, start_us from the first start, kernel_us, wait_us)],
  "by_component" {component: {"kernels", "kernel_us", "wait_us"}}, "waits": the ``top_waits`` longest waits on the
  path [(instruction, component, wait_us, [(instruction running during the wait, component, overlap µs), up to 3,
  longest first])]}."""
  full, body, is_kernel, comp_of = _dependence(hlo_text)
  counts = collections.Counter(r[4] for r in full)
  if not counts:
    raise ValueError("timeline_critical_path: no kernel-level instructions in the module")
  comp = counts.most_common(1)[0][0]
  deps = body[comp]
  by_name: dict = collections.defaultdict(list)
  for name, start, end in events:
    by_name[name].append((start, end))
  names = instruction_kernels(hlo_text, known=set(by_name))
  order = _topological(deps)
  group: dict = collections.defaultdict(list)
  for n in order:
    if (comp, n) in is_kernel:
      group[names.get(n, _sanitize(n))].append(n)
  timed, unmatched = {}, []
  for kname, members in group.items():
    ev = sorted(by_name.get(kname, ()))
    if not ev or len(ev) % len(members):
      unmatched.append(kname)
      continue
    runs = len(ev) // len(members)
    i = execution % runs
    for n, t in zip(members, ev[i * len(members):(i + 1) * len(members)]):
      timed[n] = t
  if not timed:
    raise ValueError(f"timeline_critical_path: no event matches a kernel of {comp}")
  # each instruction's latest-ending timed kernel among what it waits for (through untimed instructions)
  last: dict = {}
  for n in order:
    cands = []
    for q in deps.get(n, ()):
      if q in timed:
        cands.append(q)
      elif last.get(q) is not None:
        cands.append(last[q])
    last[n] = max(cands, key=lambda q: timed[q][1], default=None)
  t0 = min(t[0] for t in timed.values())
  end = max(timed, key=lambda n: timed[n][1])
  path, n = [], end
  while n is not None:
    pred = last.get(n)
    start, stop = timed[n]
    wait = start - timed[pred][1] if pred is not None else start - t0
    path.append((n, comp_of[(comp, n)], (start - t0) / 1e3, (stop - start) / 1e3, max(wait, 0) / 1e3))
    n = pred
  path.reverse()
  # what ran while each kernel on the path waited (its input ready, it not yet started): the kernels of the same
  # execution overlapping the gap — a wait filled by a kernel off the path means the two competed (for SMs, or
  # for a slot in the graph's launch order), not that the GPU idled
  waits = []
  for n, _, st, _, w_us in sorted(path, key=lambda r: -r[4])[:top_waits]:
    if w_us <= 0:
      continue
    lo, hi = t0 + (st - w_us) * 1e3, t0 + st * 1e3
    occ = sorted(((m, comp_of[(comp, m)], (min(e, hi) - max(s, lo)) / 1e3) for m, (s, e) in timed.items()
                  if s < hi and e > lo and m != n), key=lambda r: -r[2])
    waits.append((n, comp_of[(comp, n)], round(w_us, 2), [(m, c, round(o, 2)) for m, c, o in occ[:3]]))
  by: dict = collections.defaultdict(lambda: {"kernels": 0, "kernel_us": 0.0, "wait_us": 0.0})
  for _, c, _, k_us, w_us in path:
    by[c]["kernels"] += 1
    by[c]["kernel_us"] += k_us
    by[c]["wait_us"] += w_us
  return dict(computation=comp, matched=len(timed), unmatched=sorted(unmatched),
              span_us=(timed[end][1] - t0) / 1e3, path=path, waits=waits,
              by_component=dict(sorted(by.items(), key=lambda kv: -(kv[1]["kernel_us"] + kv[1]["wait_us"]))))


def critical_paths(hlo_text: str, weights: dict[str, float] | None = None) -> list[dict]:
  """The longest dependence chains of kernels in each computation that runs kernels (the entry, a loop body —
  Decoder(steps_per_call=n) runs the step as one), largest computation first. A kernel waits for the kernels
  whose results it reads (through free instructions: tuples, bitcasts, slices XLA folds away) and for its
  control predecessors; each weighs 1 (a launch) or ``weights[instruction name]`` (e.g. measured µs per launch).
  Under XLA's CONCURRENT command-buffer schedule launches off the critical path overlap others, launches on it
  pay the graph's dependent-launch gap (~2 µs on the H200, bench_pdl, session 34) in series: removing launches
  off the chain did not move the step's time (session 36); whether shortening it does by as much is open (815 ->
  715 launches: −0.35 / +0.32 ms in two rounds, session 36). (The graph adds edges for reused buffers, so this is
  a lower bound.)

  Returns [{"computation", "kernels", "critical" (the longest chain's weight), "launches" (its kernels),
  "by_component" {component: kernels of the chain}, "path" [(name, component), ...] in order}]."""
  full, body, is_kernel, comp_of = _dependence(hlo_text)
  kernel_comps = collections.Counter(r[4] for r in full)
  out = []
  for comp, deps in body.items():
    best: dict = {}  # name -> (weight of the longest chain ending here, its length in kernels, predecessor)
    for root in deps:  # iterative post-order: instruction order in the text need not be topological
      stack = [(root, False)]
      while stack:
        n, ready = stack.pop()
        if n in best:
          continue
        preds = [p for p in deps.get(n, ()) if p in deps]
        if not ready:
          stack.append((n, True))
          stack.extend((p, False) for p in preds if p not in best)
          continue
        k = (comp, n) in is_kernel
        w = (weights.get(n, 1.0) if weights else 1.0) if k else 0.0
        p = max(preds, key=lambda x: best[x][0], default=None)
        bw, bl = (best[p][0], best[p][1]) if p is not None else (0.0, 0)
        best[n] = (bw + w, bl + int(k), p)
    if not best:
      continue
    end = max(best, key=lambda n: best[n][0])
    path, n = [], end
    while n is not None:
      if (comp, n) in is_kernel:
        path.append((n, comp_of[(comp, n)]))
      n = best[n][2]
    path.reverse()
    out.append(dict(computation=comp, kernels=kernel_comps[comp], critical=best[end][0], launches=best[end][1],
                    by_component=dict(collections.Counter(c for _, c in path).most_common()), path=path))
  return sorted(out, key=lambda d: -d["kernels"])


MOSAIC_SUFFIX = "_mosaic_gpu_kernel"  # CUPTI's name for a Mosaic GPU kernel: kernel_name + this
_PALLAS_SCOPE = re.compile(r"jit\((\w+)\)/\1/")
# XLA emits a TP all-reduce as a fusion kernel named after the psum (psum_44_0_fusion_1) when it implements it
# itself (H200 pairs), or NCCL's kernels (ncclDevKernel_*): neither name is an instruction of the optimised HLO
_COLLECTIVE_KERNEL = re.compile(r"^(nccl|psum_|all_reduce|all_gather|reduce_scatter)", re.IGNORECASE)
_MOSAIC_NAME = re.compile(r"(glm5_[a-z0-9_]+?|kda_decode)(?=_mosaic|\\|\"|$)")


_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
             "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_ARRAY = re.compile(r"\b([a-z]+[0-9a-z]*)\[([0-9,]*)\]")


def _operand_bytes(rest: str) -> int:
  """Bytes of the operands of one instruction whose HLO text prints operand shapes (``custom-call(bf16[1,4096]
  %x, ...)``); 0 when it does not."""
  start = rest.find("custom-call(")
  if start < 0:
    return 0
  depth, i = 0, start + len("custom-call")
  for j in range(i, len(rest)):  # the operand list: up to the matching parenthesis
    depth += {"(": 1, ")": -1}.get(rest[j], 0)
    if depth == 0:
      break
  total = 0
  for dt, dims in _ARRAY.findall(rest[i:j]):
    if dt in _ITEMSIZE:
      n = 1
      for d in filter(None, dims.split(",")):
        n *= int(d)
      total += n * _ITEMSIZE[dt]
  return total


def _mosaic_kernel(op: str, opn: str, rest: str) -> str | None:
  """The kernel name of a Mosaic GPU custom call (None for any other instruction): the name in its module, not
  op_name's; pl.kernel(name=...) kernels (KDA) do not carry it in the module text — op_name has jit(name)/name/."""
  if op != "custom-call" or "mosaic_gpu" not in rest:
    return None
  m = _MOSAIC_NAME.search(re.sub(r"metadata=\{[^}]*\}", "", rest)) or _PALLAS_SCOPE.search(opn or "")
  return m.group(1) if m else None


def mosaic_shares(hlo_text: str) -> dict[str, dict[str, float]]:
  """Mosaic GPU kernel (as CUPTI names it) -> {component: share}. One kernel binary serves every site with the
  same name, so its records cannot be told apart; they are split over the components in proportion to the bytes
  of the sites' operands (these kernels stream their operands), or to the number of sites when the HLO text does
  not print operand shapes."""
  calls: dict = collections.defaultdict(collections.Counter)
  # every instruction, not only kernel rows: XLA wraps a custom call whose operands are slices (the KDA kernel's
  # state slots) in a dynamic-slice fusion, and the Mosaic kernel runs from inside it
  for _, _, op, opn, rest in _instructions(hlo_text):
    if (k := _mosaic_kernel(op, opn, rest)) is not None:
      calls[k + MOSAIC_SUFFIX][component(opn)] += _operand_bytes(rest) or 1
  return {k: {c: n / sum(v.values()) for c, n in v.items()} for k, v in calls.items()}


_ENTRY = re.compile(r"^ENTRY\s+%?([\w.\-]+)", re.MULTILINE)


def census(hlo_text: str) -> dict:
  """Static kernel count of a compiled program by kind and by component (loop bodies counted once). With a loop
  (``while_loops`` > 0, e.g. Decoder(steps_per_call=n)) ``outside_loops`` counts the entry computation's kernels:
  those run once per call, the loop body's once per iteration."""
  full = _kernel_rows(hlo_text)
  rows = [r[:3] for r in full]
  kinds, comps = collections.Counter(), collections.Counter()
  for _, op, opn in rows:
    kind = ("collective" if op.removesuffix("-start") in _COLLECTIVES else
            op if op in ("fusion", "custom-call", "sort") else "other")
    kinds[kind] += 1
    comps[component(opn)] += 1
  loops = sum(1 for _, _, op, _, _ in _instructions(hlo_text) if op == "while")
  out = {"kernels": len(rows), "by_kind": dict(kinds), "by_component": dict(comps), "while_loops": loops}
  entry = _ENTRY.search(hlo_text)
  if loops and entry:
    out["outside_loops"] = sum(1 for r in full if r[4] == entry.group(1))
  return out


_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_BODY = re.compile(r"\bbody=%?([\w.\-]+)")
_COND = re.compile(r"\bcondition=%?([\w.\-]+)")


def launches(hlo_text: str) -> int | None:
  """Kernels one call of a compiled program launches: each computation's kernels (``census``) times the number of
  times it runs — a while loop's body and condition its known trip count (its condition once more), nested loops
  multiplied — where ``census`` counts a loop body once. None when a loop's trip count is not known at compile
  time. (A prefill chunk's scans and the mHC Sinkhorn's fori_loop are counted here as they run.)"""
  per_comp = collections.Counter(r[4] for r in _kernel_rows(hlo_text))
  loops = collections.defaultdict(list)  # computation -> [(body, condition, trips)]
  calls = collections.defaultdict(list)  # computation -> the computations its `call`s run (once per call)
  for comp, _, op, _, rest in _instructions(hlo_text):
    if op == "while":
      t, b, c = _TRIPS.search(rest), _BODY.search(rest), _COND.search(rest)
      if t is None or b is None or c is None:
        return None
      loops[comp].append((b.group(1), c.group(1), int(t.group(1))))
    elif op == "call":
      calls[comp] += _called(rest)

  def runs(comp, depth=0):
    if depth > 16:
      raise ValueError(f"launches: loops / calls nested deeper than 16 at {comp}")
    return (per_comp[comp] + sum(runs(c, depth + 1) for c in calls[comp])
            + sum(n * runs(b, depth + 1) + (n + 1) * runs(c, depth + 1) for b, c, n in loops[comp]))

  entry = _ENTRY.search(hlo_text)
  return runs(entry.group(1)) if entry else None


def _sanitize(name: str) -> str:
  return re.sub(r"[.\-]", "_", name)


def kernel_map(hlo_text: str) -> dict:
  """GPU kernel name -> component: XLA names a fusion's kernel after the instruction (``.``/``-`` -> ``_``).
  Instructions inside fused computations are the fallback: some emitters (sorts on the GPU) name their kernels
  after the inner instruction. Mosaic GPU kernels map to {component: share} (``mosaic_shares``)."""
  kmap: dict = {_sanitize(name): component(opn) for _, name, _, opn, _ in _instructions(hlo_text) if opn}
  kmap.update({_sanitize(n): component(opn) for n, _, opn in kernel_instructions(hlo_text)})
  kmap.update(mosaic_shares(hlo_text))
  return kmap


def classify_kernel(kernel: str, kmap: dict):
  """Component of one launched kernel ({component: share} for a Mosaic kernel serving several), or None when
  the name matches no instruction."""
  if kernel in kmap and isinstance(kmap[kernel], dict):
    return kmap[kernel]
  if kernel not in kmap and (_COLLECTIVE_KERNEL.match(kernel) or "nccl" in kernel.lower()):
    return "all-reduce"  # (an instruction of the program that happens to be named psum_* keeps its component)
  k = kernel
  for _ in range(3):  # an instruction may launch several kernels: name, name_1, ...
    if k in kmap:
      return kmap[k]
    k2 = re.sub(r"_\d+$", "", k)
    if k2 == k:
      break
    k = k2
  return None


def split(records, kmap: dict[str, str], steps: int):
  """records: iterable of (kernel name, ms) over ``steps`` steps -> ({component: µs per step},
  launches per step, {unmatched kernel name: µs per step})."""
  per = collections.Counter()
  unmatched = collections.Counter()
  n = 0
  for name, ms in records:
    n += 1
    c = classify_kernel(name, kmap)
    if c is None:
      unmatched[name] += ms * 1e3 / steps
      c = "other"
    for comp, share in (c.items() if isinstance(c, dict) else ((c, 1.0),)):
      per[comp] += share * ms * 1e3 / steps
  return dict(per), n / steps, dict(unmatched)


def _union_busy(intervals):
  """Total length covered by [start, end) intervals (ns) and the idle gaps between them, in time order."""
  busy, gaps, end = 0, [], None
  for s, e in sorted(intervals):
    if end is None:
      busy, end = e - s, e
    elif s > end:
      gaps.append(s - end)
      busy, end = busy + e - s, e
    elif e > end:
      busy, end = busy + e - end, e
  return busy, gaps


def wall_shares(events) -> tuple[dict, float]:
  """events: (name, start, end) device intervals (ns) -> ({name: ns}, idle ns): each stretch of time split
  equally among the kernels running during it, so the shares sum to the union of the intervals (the busy time).
  Under XLA's CONCURRENT command-buffer schedule kernels overlap and their summed durations exceed the wall time
  (a one-CTA kernel beside a streaming GEMV runs 2-4x its time alone); the share says what a kernel costs the
  wall clock: a kernel that always overlaps others shares its time with them."""
  marks = []
  for i, (_, s, e) in enumerate(events):
    if e > s:
      marks.append((s, 1, i))
      marks.append((e, -1, i))
  marks.sort(key=lambda m: (m[0], m[1]))  # (ends before starts at the same instant)
  share, active, idle, t0 = collections.Counter(), set(), 0, None
  for t, kind, i in marks:
    if t0 is not None and t > t0:
      if active:
        w = (t - t0) / len(active)
        for j in active:
          share[events[j][0]] += w
      else:
        idle += t - t0
    t0 = t
    (active.add if kind > 0 else active.discard)(i)
  return dict(share), idle


_NUMBERED = re.compile(r"(?:[._]\d+)+$")
_GRAPH_ID = re.compile(r"\s*\(CudaGraph:\d+\)")  # cuGraphLaunch (CudaGraph:784): one row for every graph


def event_kind(name: str) -> str:
  """A host event's row in trace_summary: numbered instances and CUDA graph ids folded (fusion.12, fusion_8172
  -> fusion; cuGraphLaunch (CudaGraph:784) -> cuGraphLaunch)."""
  return _NUMBERED.sub("", _GRAPH_ID.sub("", name))


def _self_times(events):
  """(name, self ns) for the events of one host thread line: an event's duration less the time covered by the
  events nested inside it (by time containment), so wrappers (PjRt Execute, ExecuteThunks) do not hide the work
  below them. An event that overruns its parent counts towards the parent only up to the parent's end."""
  out, stack = [], []  # stack of [name, end, child ns, start]
  for name, s, e in sorted(events, key=lambda t: (t[1], -t[2])):
    while stack and stack[-1][1] <= s:
      n, end, child, start = stack.pop()
      out.append((n, max(end - start - child, 0)))
    if stack:
      stack[-1][2] += min(e, stack[-1][1]) - s
    stack.append([name, e, 0, s])
  out.extend((n, max(end - start - child, 0)) for n, end, child, start in stack)
  return out


def device_events(pd) -> list[tuple[str, float, float, str]]:
  """(kernel / memcpy name, start ns, end ns, stream line) of every timed event on the GPU planes' stream lines of
  a jaxlib ProfileData (``_profile_data.ProfileData.from_file(xspace)``); bench_decode --trace saves them beside
  the step's HLO for reading offline."""
  return [(e.name, e.start_ns, e.end_ns, line.name) for plane in pd.planes if plane.name.startswith("/device:GPU")
          for line in plane.lines if "stream" in line.name.lower() for e in line.events if e.duration_ns > 0]


def trace_summary(xspace_path: str, steps: int, *, top: int = 16, kmap: dict | None = None,
                  hlo_text: str | None = None) -> dict:
  """Where the wall time of ``steps`` traced decode steps goes, from a jax.profiler trace (an .xplane.pb file).

  Device side (every '/device:GPU:*' plane's stream lines): the span from the first kernel's start to the last
  one's end, the busy time (union of kernel/memcpy intervals) and the idle gaps between them; one long gap per
  step means the GPU waits for the host to issue the next step. Host side: self time (less nested events) and
  count per event name (XLA thunks, command-buffer updates, CUDA driver calls, PjRt argument handling) per step —
  what the host did while the GPU waited. Returns ms per step for span / busy / idle, the gap histogram and the
  top host events {name: (self ms per step, calls per step)}. With ``kmap`` (kernel_map of the step's HLO) also
  the busy time split by component and the kernels with the largest shares (``wall_shares``: concurrent kernels
  share the time they overlap), µs per step. With ``hlo_text`` (the step's optimised HLO) also "timeline": the
  last traced step's measured critical path (``timeline_critical_path``: its span, µs of kernels and of waits by
  component, the 12 longest waits on it), or the reason it could not be matched."""
  from jax._src.lib import _profile_data  # noqa: PLC0415 (jaxlib's reader of XSpace protos; no TensorFlow)

  pd = _profile_data.ProfileData.from_file(xspace_path)
  dev, host = [e[:3] for e in device_events(pd)], collections.defaultdict(lambda: [0.0, 0])
  for plane in pd.planes:
    if plane.name.startswith("/host:CPU"):
      for line in plane.lines:
        for name, ns in _self_times([(e.name[:80], e.start_ns, e.end_ns) for e in line.events]):
          h = host[event_kind(name)]
          h[0] += ns
          h[1] += 1
  out = {"steps": steps, "device_events": len(dev)}
  if dev:
    busy, gaps = _union_busy([(s, e) for _, s, e in dev])
    span = max(e for _, _, e in dev) - min(s for _, s, _ in dev)
    edges = (2_000, 5_000, 10_000, 50_000, 1_000_000)  # ns
    hist = collections.Counter(next((f"<{b // 1000}us" for b in edges if g < b), ">=1ms") for g in gaps)
    out.update(span_ms=span / 1e6 / steps, busy_ms=busy / 1e6 / steps, idle_ms=(span - busy) / 1e6 / steps,
               gaps_per_step=len(gaps) / steps,
               gap_hist_per_step={k: hist[k] / steps for k in [f"<{b // 1000}us" for b in edges] + [">=1ms"]},
               largest_gaps_us=[g / 1e3 for g in sorted(gaps)[-5:][::-1]])
    if kmap is not None:
      share, _ = wall_shares(dev)
      comp = collections.Counter()
      for name, ns in share.items():
        c = classify_kernel(name, kmap) or "other"
        for k, f in (c.items() if isinstance(c, dict) else ((c, 1.0),)):
          comp[k] += f * ns / 1e3 / steps
      out["wall_us_per_step"] = dict(comp.most_common())
      out["wall_top_us"] = {n: ns / 1e3 / steps for n, ns in sorted(share.items(), key=lambda kv: -kv[1])[:top]}
    if hlo_text is not None:
      try:
        t = timeline_critical_path(hlo_text, dev)
        out["timeline"] = dict(span_us=t["span_us"], launches=len(t["path"]), matched=t["matched"],
                               unmatched=len(t["unmatched"]), by_component=t["by_component"],
                               longest_waits=[(n, c, round(w, 2)) for n, c, w, _ in t["waits"]],
                               wait_occupants=t["waits"])
      except ValueError as e:
        out["timeline"] = {"error": str(e)}
  out["host_top"] = {k: (v[0] / 1e6 / steps, v[1] / steps)
                     for k, v in sorted(host.items(), key=lambda kv: -kv[1][0])[:top]}
  return out


# ------------------------------------------------------------------------------------------------ floors
HBM_BYTES_PER_S = 4.3e12  # the H200's measured copy bandwidth (../shared/notes/roofline.py)


def expected_distinct(n_tokens: int, n_experts: int, top_k: int) -> float:
  """Experts that n_tokens tokens select under uniform routing: E (1 - (1 - k/E)^n)."""
  return n_experts * (1.0 - (1.0 - top_k / n_experts) ** n_tokens)


def _leaf_component(keys: tuple[str, ...], cfg) -> str:
  """The component whose kernels read a parameter leaf (its path in the params tree) in a decode step."""
  from glm5_jax.config import KDA  # noqa: PLC0415
  head = keys[0]
  if head == "mtp":
    return "draft"
  if head in ("lm_head", "embed_tokens"):
    return "lm_head" if head == "lm_head" else "embed"
  if head != "layers":
    return "mhc" if "hc" in head else "other"
  i, part = int(keys[1]), keys[2]
  if part == "self_attn":
    if "indexer" in keys:
      return "indexer"
    return "kda" if cfg.layer_types[i] == KDA else "dsa"
  if part == "mlp":
    if "experts" in keys:
      return "experts"  # scaled by the share of experts the step's tokens select
    if "gate" in keys and "shared_experts" not in keys and cfg.mlp_layer_types[i] != "dense":
      return "router"
    return "moe" if cfg.mlp_layer_types[i] != "dense" else "mlp"
  return "mhc"  # the mHC fn / base / scale and the norms the boundary kernels read


def floor_bytes(cfg, params, *, batch: int, q: int, context: int, tp: int = 1) -> dict[str, float]:
  """Bytes one decode step must move, per profiling component (COMPONENTS), for ``params`` (the arrays one device
  holds — e.g. synthetic.abstract_model of tp_rank_config(real, 4): one TP4 rank) at ``batch`` sequences,
  ``q`` verified tokens each and ``context`` cached positions: every weight read once; of the routed experts
  the share that B·q tokens select under uniform routing (the MTP draft: B tokens per draft step); the KDA
  state read once and written per slot; the DSA's selected FP8 latent rows and the indexer's pooled-key scan
  per query; the draft (q > 1): the MTP layer, its experts and the lm_head once per draft token. Divided by
  HBM_BYTES_PER_S: the per-component floor that a measured component time is compared with (bench_decode).
  Sharded parameters count their shard on one device (``tp``: the KDA heads per device too)."""
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  from glm5_jax.config import DSA, KDA  # noqa: PLC0415
  from pallas_kernels.sparse_mla import ROW_WORDS  # noqa: PLC0415 (the FP8 latent cache row, declared there)
  row_bytes = ROW_WORDS * 4  # one FP8 latent cache row per selected position
  E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
  share = expected_distinct(batch * q, E, k) / E
  drafts = q - 1
  draft_share = expected_distinct(batch, E, k) / E
  out = collections.Counter()
  for path, x in jax.tree.flatten_with_path(params)[0]:
    keys = tuple(str(getattr(p, "key", getattr(p, "idx", p))) for p in path)
    sharding = getattr(x, "sharding", None)
    shape = sharding.shard_shape(x.shape) if sharding is not None else x.shape  # one device's share
    nbytes = float(np.prod(shape)) * np.dtype(x.dtype).itemsize
    comp = _leaf_component(keys, cfg)
    if comp == "experts":
      out["moe"] += nbytes * share
    elif comp == "embed":
      out["embed"] += nbytes / shape[0] * batch * q  # the rows of the step's tokens
    elif comp == "draft":
      out["draft"] += nbytes * drafts * (draft_share if "experts" in keys else 1.0)
    else:
      out[comp] += nbytes
  if drafts:
    out["draft"] += out["lm_head"] * drafts  # each draft token's logits
  n_kda = sum(t == KDA for t in cfg.layer_types)
  n_dsa = sum(t == DSA for t in cfg.layer_types)
  h, d = cfg.linear_num_heads // tp, cfg.linear_head_dim
  out["kda"] += batch * n_kda * h * d * d * 4 * (1 + q)
  w = min(cfg.index_topk + cfg.index_kpool - 1, context)
  pools = context // cfg.index_kpool
  pool_bytes = pools * (cfg.index_head_dim + 4)  # FP8 pooled keys + one f32 scale each
  out["dsa"] += batch * q * n_dsa * w * row_bytes
  out["indexer"] += batch * n_dsa * pool_bytes
  out["draft"] += drafts * batch * (w * row_bytes + pool_bytes)
  return dict(out)


def gap_table(floors: dict[str, float], measured_us: dict[str, float]) -> list[tuple[str, float, float, float]]:
  """[(component, floor µs, measured µs, measured / floor)] for the components with a floor or a time; the
  floor at HBM_BYTES_PER_S."""
  rows = []
  for c in COMPONENTS:
    f = floors.get(c, 0.0) / HBM_BYTES_PER_S * 1e6
    m = measured_us.get(c, 0.0)
    if f or m:
      rows.append((c, f, m, m / f if f >= 1.0 else float("inf")))  # (a ratio needs a floor of 1 µs)
  return rows
