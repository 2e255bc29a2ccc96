"""glm5_jax.profiling: the kernel census of a compiled step and the attribution of kernel records to components."""

from __future__ import annotations

import numpy as np
import pytest

from glm5_jax import profiling as P
from glm5_jax.runtime import DecodeConfig
from glm5_jax.speculative import Decoder
from helpers import load, tiny_checkpoint

HLO = """HloModule m

%fused_computation (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %neg = f32[4]{0} negate(%p), metadata={op_name="jit(step)/shard_map/mhc/neg"}
}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%body (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %t = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %v = f32[4]{0} get-tuple-element(%t), index=1
  %loop_neg_fusion.2 = f32[4]{0} fusion(%v), kind=kLoop, calls=%fused_computation, metadata={op_name="jit(step)/shard_map/draft/dsa/indexer/neg"}
  ROOT %r = (s32[], f32[4]{0}) tuple(%i, %loop_neg_fusion.2)
}

%callee (c: f32[4]) -> f32[4] {
  %c = f32[4]{0} parameter(0)
  ROOT %called_fusion = f32[4]{0} fusion(%c), kind=kLoop, calls=%fused_computation, metadata={op_name="jit(step)/shard_map/lm_head/neg"}
}

ENTRY %main (a: f32[4], b: f32[8,288]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  %b = f32[8,288]{1,0} parameter(1)
  %loop_neg_fusion = f32[4]{0} fusion(%a), kind=kLoop, calls=%fused_computation, metadata={op_name="jit(step)/shard_map/mhc/neg"}
  %all-reduce.3 = f32[4]{0} all-reduce(%loop_neg_fusion), to_apply=%add, metadata={op_name="jit(step)/shard_map/moe/psum"}
  %custom-call.7 = f32[4]{0} custom-call(%all-reduce.3), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(step)/shard_map/kda/kda_decode"}
  %sort.5 = f32[8,288]{1,0} sort(%b), dimensions={1}, to_apply=%add, metadata={op_name="jit(step)/shard_map/moe/router/top_k"}
  %custom-call.8 = f32[4]{0} custom-call(%a), custom_call_target="mosaic_gpu_v2", backend_config={kernel_hash="\\01", module="ML\\EFR\\00glm5_fp8_linear\\00"}, metadata={op_name="jit(step)/shard_map/dsa/jit(fp8_linear)/mosaic"}
  %custom-call.9 = f32[4]{0} custom-call(%a), custom_call_target="mosaic_gpu_v2", backend_config={kernel_hash="\\01", module="ML\\EFR\\00glm5_fp8_linear\\00"}, metadata={op_name="jit(step)/shard_map/mlp/jit(fp8_linear)/mosaic"}
  %custom-call.10 = f32[4]{0} custom-call(%a), custom_call_target="mosaic_gpu_v2", backend_config={kernel_hash="\\02", module="ML\\EFR\\00glm5_fp8_linear\\00"}, metadata={op_name="jit(step)/shard_map/dsa/jit(fp8_linear)/mosaic"}
  %cl = f32[4]{0} call(%a), to_apply=%callee
  %c = s32[] constant(0)
  %t0 = (s32[], f32[4]{0}) tuple(%c, %custom-call.7)
  %w = (s32[], f32[4]{0}) while(%t0), condition=%add, body=%body
  ROOT %out = f32[4]{0} get-tuple-element(%w), index=1
}
"""


def test_mosaic_kernels_are_split_over_their_call_sites():
  shares = P.mosaic_shares(HLO)
  assert shares == {"glm5_fp8_linear_mosaic_gpu_kernel": {"dsa": 2 / 3, "mlp": 1 / 3}}  # no operand shapes: by sites
  # with operand shapes printed: by the bytes each site streams (1 KiB + 16 B in dsa, 8 KiB + 16 B in mlp)
  hlo = HLO.replace("%custom-call.8 = f32[4]{0} custom-call(%a)", "%custom-call.8 = f32[4]{0} custom-call(f32[4]{0} %a, "
                    "f8e4m3fn[8,128]{1,0} %w)")
  hlo = hlo.replace("%custom-call.9 = f32[4]{0} custom-call(%a)", "%custom-call.9 = f32[4]{0} custom-call(f32[4]{0} %a, "
                    "bf16[64,64]{1,0} %w)")
  assert P.mosaic_shares(hlo)["glm5_fp8_linear_mosaic_gpu_kernel"] == pytest.approx(
      {"dsa": (1040 + 1) / (1040 + 1 + 8208), "mlp": 8208 / (1040 + 1 + 8208)})
  per, launches, unmatched = P.split([("glm5_fp8_linear_mosaic_gpu_kernel", 0.006)], P.kernel_map(HLO), steps=2)
  assert per == pytest.approx({"dsa": 2.0, "mlp": 1.0}) and unmatched == {} and launches == 0.5
  # a pl.kernel(name=...) kernel has no name in its module text: it is found through its jit(name)/name/ scope
  hlo = HLO.replace('op_name="jit(step)/shard_map/kda/kda_decode"',
                    'op_name="jit(step)/shard_map/kda/jit(kda_decode)/kda_decode/mpmd_map"')
  assert P.mosaic_shares(hlo)["kda_decode_mosaic_gpu_kernel"] == {"kda": 1.0}
  # ... also when XLA wraps it in a dynamic-slice fusion (its state-slot operands are slices): the kernel row is
  # the fusion, the Mosaic kernel runs from inside it
  dsf = """HloModule d

%dsf (s: f32[8,4]) -> f32[4] {
  %s = f32[8,4]{1,0} parameter(0)
  %sl = f32[1,4]{1,0} slice(%s), slice={[2:3], [0:4]}
  ROOT %mpmd_map.1 = f32[4]{0} custom-call(%sl), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(body)/shard_map/kda/jit(kda_decode)/kda_decode/mpmd_map"}
}

ENTRY %main (a: f32[8,4]) -> f32[4] {
  %a = f32[8,4]{1,0} parameter(0)
  ROOT %f = f32[4]{0} fusion(%a), kind=kCustom, calls=%dsf, metadata={op_name="jit(body)/shard_map/kda/jit(kda_decode)/kda_decode/mpmd_map"}
}
"""
  assert P.mosaic_shares(dsf) == {"kda_decode_mosaic_gpu_kernel": {"kda": 1.0}}
  assert P.census(dsf)["kernels"] == 1


def test_component_of_scope_paths():
  assert P.component("jit(step)/shard_map/dsa/indexer/dot_general") == "indexer"  # innermost wins
  assert P.component("jit(step)/shard_map/moe/router/top_k") == "router"
  assert P.component("jit(step)/shard_map/draft/moe/add") == "draft"  # a draft pass is one unit
  assert P.component("jit(step)/shard_map/mhc/while/body/div") == "mhc"
  assert P.component("jit(step)/shard_map/argmax") == "other"
  assert P.component("mhcx/kdax") == "other"  # whole scope names only


def test_census_counts_kernel_level_instructions_once():
  c = P.census(HLO)
  # entry: fusion, all-reduce, 4 custom-calls, sort (the while and the call launch nothing themselves); loop body and
  # called computation: one fusion each. Fused bodies and reducers are not kernels; parameters / tuples /
  # constants are free.
  assert c["kernels"] == 9
  assert c["by_kind"] == {"fusion": 3, "collective": 1, "custom-call": 4, "sort": 1}
  assert c["by_component"] == {"mhc": 1, "moe": 1, "kda": 1, "router": 1, "draft": 1, "lm_head": 1, "dsa": 2,
                               "mlp": 1}
  assert c["while_loops"] == 1
  assert c["outside_loops"] == 7  # the entry's kernels (once per call); the loop body's and the call's run per use


def test_launches_count_each_computation_as_often_as_it_runs():
  # a loop without a known trip count: unknown; with 5 trips: the entry's 7 kernels, the called computation's one,
  # the body's fusion 5 times (its condition, a reducer here, launches nothing)
  assert P.launches(HLO) is None
  known = HLO.replace("body=%body", 'body=%body, backend_config={"known_trip_count":{"n":"5"}}')
  assert P.launches(known) == 7 + 1 + 5
  assert P.census(known)["kernels"] == 9  # (census: each computation's kernels once)


WRAPPED = """HloModule w

%wrapped (p: f32[8], q: s32[2]) -> (f32[8], s32[2]) {
  %p = f32[8]{0} parameter(0)
  %q = s32[2]{0} parameter(1)
  ROOT %cc = (f32[8]{0}, s32[2]{0}) custom-call(%p, %q), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(s)/mhc/jit(mhc_post_finish)/glm5_mhc_post_finish/mpmd_map"}
}

ENTRY %main (a: f32[8], c: s32[2]) -> (f32[8], s32[2]) {
  %a = f32[8]{0} parameter(0)
  %c = s32[2]{0} parameter(1)
  ROOT %f = (f32[8]{0}, s32[2]{0}) fusion(%a, %c), kind=kCustom, calls=%wrapped
}
"""


def test_a_wrapping_fusion_without_metadata_takes_its_custom_calls_scope():
  """XLA wraps a Mosaic call with an aliased Ref operand in a fusion whose tuple root carries no op_name (session
  36: the MoE kernels' rows form counted as "other"): the census, the listing and the critical path take the
  scope of the custom call inside."""
  assert P.census(WRAPPED)["by_component"] == {"mhc": 1}
  assert P.kernel_listing(WRAPPED).split("\t")[3] == "mhc"
  assert P.critical_paths(WRAPPED)[0]["by_component"] == {"mhc": 1}


DIAMOND = """HloModule d

%f (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %n = f32[4]{0} negate(%p)
}

ENTRY %main (a: f32[4]) -> (f32[4], f32[4]) {
  %a = f32[4]{0} parameter(0)
  %k1 = f32[4]{0} fusion(%a), kind=kLoop, calls=%f, metadata={op_name="jit(s)/mhc/neg"}
  %k2 = f32[4]{0} fusion(%k1), kind=kLoop, calls=%f, metadata={op_name="jit(s)/kda/neg"}
  %k3 = f32[4]{0} fusion(%k1), kind=kLoop, calls=%f, metadata={op_name="jit(s)/dsa/neg"}
  %t = (f32[4]{0}, f32[4]{0}) tuple(%k3, %k2)
  %g = f32[4]{0} get-tuple-element(%t), index=0
  %k4 = f32[4]{0} fusion(%g), kind=kLoop, calls=%f, metadata={op_name="jit(s)/dsa/neg"}
  %k5 = f32[4]{0} fusion((f32[4]{0}, f32[4]{0}) %t, f32[4]{0} %k4), kind=kLoop, calls=%f, metadata={op_name="jit(s)/moe/neg"}
  %k6 = f32[4]{0} fusion(%a), kind=kLoop, calls=%f, control-predecessors={%k5}, metadata={op_name="jit(s)/mlp/neg"}
  ROOT %r = (f32[4]{0}, f32[4]{0}) tuple(%k5, %k6)
}
"""


def test_critical_paths_follow_dependences_through_free_instructions():
  """The longest kernel chain of a hand-built DAG: k1 -> {k2, k3 -> (tuple, get-tuple-element 0: k3 alone) -> k4}
  -> k5 (reads the tuple and k4, operands printed with their types) -> k6 (a control predecessor only): 5 launches
  through k3 and k4; with k2 weighing 10 (µs per launch, say), the chain through k2 (13) wins over the one through
  k3, k4 (5) — k4 does not wait for k2, which shares a tuple with what it reads. The entry of the module above: mhc -> the all-reduce -> the KDA kernel (3), the loop
  body's one kernel apart."""
  (d,) = P.critical_paths(DIAMOND)
  assert d["kernels"] == 6 and d["launches"] == 5 and d["critical"] == 5.0
  assert [n for n, _ in d["path"]] == ["k1", "k3", "k4", "k5", "k6"]
  assert d["by_component"] == {"dsa": 2, "mhc": 1, "moe": 1, "mlp": 1}
  (w,) = P.critical_paths(DIAMOND, weights={"k2": 10.0})
  assert [n for n, _ in w["path"]] == ["k1", "k2", "k5", "k6"] and w["critical"] == 13.0 and w["launches"] == 4
  paths = {d["computation"]: d for d in P.critical_paths(HLO)}
  assert [n for n, _ in paths["main"]["path"]] == ["loop_neg_fusion", "all-reduce.3", "custom-call.7"]
  assert paths["body"]["launches"] == 1 and paths["callee"]["launches"] == 1


def test_timeline_critical_path_follows_the_last_arrival():
  """The measured critical path of DIAMOND (its six fusions share one body: one kernel name, matched to the
  instructions in dependence order): k2 runs long, so k5 waits for k2 (ended last), not for k4 — the path is
  k1 -> k2 -> k5 -> k6 with the gaps before each kernel, whichever execution of two is picked; events of other
  kernels are ignored, and a name whose events do not cover its instructions is left out (here: all of them)."""
  t = {"k1": (0, 1000), "k2": (1200, 9000), "k3": (1500, 2000), "k4": (2500, 3500), "k5": (9500, 10000),
       "k6": (10600, 11000)}
  events = [("k1", a + off, b + off) for off in (0, 20000) for a, b in t.values()] + [("other", 5, 6)]
  for ex in (0, -1):
    d = P.timeline_critical_path(DIAMOND, events, execution=ex)
    assert d["matched"] == 6 and d["unmatched"] == [] and d["span_us"] == 11.0
    assert [(n, c) for n, c, *_ in d["path"]] == [("k1", "mhc"), ("k2", "kda"), ("k5", "moe"), ("k6", "mlp")]
    assert [(st, k, w) for _, _, st, k, w in d["path"]] == [(0.0, 1.0, 0.0), (1.2, 7.8, 0.2), (9.5, 0.5, 0.5),
                                                          (10.6, 0.4, 0.6)]
    assert d["by_component"]["kda"] == {"kernels": 1, "kernel_us": 7.8, "wait_us": 0.2}
  # what ran during each wait: with k4 running long and late, the path goes k1 -> k3 -> k4; k4 waited 1.2 µs
  # after k3, 1.0 of them while k2 (off the path) still ran; k3 waited 0.5, 0.3 of them beside k2
  late = dict(t, k2=(1200, 3000), k4=(3200, 9000))
  d = P.timeline_critical_path(DIAMOND, [("k1", a, b) for a, b in late.values()])
  assert [n for n, *_ in d["path"]] == ["k1", "k3", "k4", "k5", "k6"]
  assert d["waits"][0] == ("k4", "dsa", 1.2, [("k2", "kda", 1.0)])
  assert ("k3", "dsa", 0.5, [("k2", "kda", 0.3)]) in d["waits"] and ("k5", "moe", 0.5, []) in d["waits"]
  # the weights' view (critical_paths) takes the longest chain by count instead: through k3 and k4
  assert [n for n, _ in P.critical_paths(DIAMOND)[0]["path"]] == ["k1", "k3", "k4", "k5", "k6"]
  with pytest.raises(ValueError, match="no event matches"):
    P.timeline_critical_path(DIAMOND, events[1:])


def test_trace_summary_reports_the_measured_critical_path(monkeypatch):
  """trace_summary with the step's HLO: the device events of a (stand-in) XSpace — two streams, two executions
  of DIAMOND — give the last execution's measured critical path (bench_decode --trace prints it); events that
  match no kernel of the module give the reason instead."""
  from types import SimpleNamespace as NS  # noqa: PLC0415
  from jax._src.lib import _profile_data  # noqa: PLC0415
  t = {"k1": (0, 1000), "k2": (1200, 9000), "k3": (1500, 2000), "k4": (2500, 3500), "k5": (9500, 10000),
       "k6": (10600, 11000)}

  def plane(events):
    ev = [NS(name=n, start_ns=a, end_ns=b, duration_ns=b - a) for n, a, b in events]
    return NS(name="/device:GPU:0", lines=[NS(name="Stream #1", events=ev[::2]), NS(name="Stream #2", events=ev[1::2])])

  for events, ok in (([("k1", a + off, b + off) for off in (0, 20000) for a, b in t.values()], True),
                     ([("zz", 0, 5)], False)):
    monkeypatch.setattr(_profile_data.ProfileData, "from_file", staticmethod(lambda _: NS(planes=[plane(events)])))  # noqa: B023
    out = P.trace_summary("unused.xplane.pb", 2, hlo_text=DIAMOND)["timeline"]
    if ok:
      assert out["span_us"] == 11.0 and out["launches"] == 4 and out["matched"] == 6 and out["unmatched"] == 0
      assert out["by_component"]["kda"]["kernel_us"] == 7.8 and out["longest_waits"][0] == ("k6", "mlp", 0.6)
    else:
      assert "no event matches" in out["error"]


def test_instruction_kernels_name_what_cupti_records():
  """Kernel-level instruction -> CUPTI's kernel name: a fusion's own (sanitised) name, a Mosaic custom call's
  kernel name, and a fusion wrapping a Mosaic call (XLA's dynamic-slice fusion around the KDA kernel) the wrapped
  kernel's name."""
  wrapped = HLO.replace("ENTRY %main", """%dsf (q: f32[4]) -> f32[4] {
  %q = f32[4]{0} parameter(0)
  ROOT %cc = f32[4]{0} custom-call(%q), custom_call_target="mosaic_gpu_v2", backend_config={kernel_hash="\\03", module="ML\\EFR\\00glm5_mhc_post_finish\\00"}
}

ENTRY %main""").replace("  %cl = ", "  %dynamic-slice-fusion.4 = f32[4]{0} fusion(%a), kind=kCustom, calls=%dsf\n  %cl = ")
  k = P.instruction_kernels(wrapped)
  assert k["custom-call.8"] == k["custom-call.10"] == "glm5_fp8_linear" + P.MOSAIC_SUFFIX
  assert k["dynamic-slice-fusion.4"] == "glm5_mhc_post_finish" + P.MOSAIC_SUFFIX
  assert k["loop_neg_fusion.2"] == "loop_neg_fusion_2" and k["all-reduce.3"] == "all_reduce_3"
  assert "cc" not in k  # (inside a fused computation: not a kernel of its own)


SHARED = """HloModule s

%fused_a (p0: bf16[8]) -> f32[] {
  %p0 = bf16[8]{0} parameter(0)
  %cv = f32[8]{0} convert(%p0)
  %z = f32[] constant(0)
  ROOT %r = f32[] reduce(%cv, %z), dimensions={0}, to_apply=%add.1, metadata={op_name="jit(s)/kda/dot_general"}
}

%fused_b (p1: bf16[8]) -> f32[] {
  %p1 = bf16[8]{0} parameter(0)
  %cv.2 = f32[8]{0} convert(%p1)
  %z.2 = f32[] constant(0)
  ROOT %r.2 = f32[] reduce(%cv.2, %z.2), dimensions={0}, to_apply=%add.7, metadata={op_name="jit(s)/kda/dot_general"}
}

%fused_c (p2: bf16[8]) -> f32[] {
  %p2 = bf16[8]{0} parameter(0)
  %cv.3 = f32[8]{0} convert(%p2)
  %z.3 = f32[] constant(1)
  ROOT %r.3 = f32[] reduce(%cv.3, %z.3), dimensions={0}, to_apply=%add.1
}

ENTRY %main (a: bf16[8]) -> f32[] {
  %a = bf16[8]{0} parameter(0)
  %input_reduce_fusion.180 = f32[] fusion(%a), kind=kInput, calls=%fused_a, metadata={op_name="jit(s)/kda/dot_general"}
  %input_reduce_fusion.181 = f32[] fusion(%a), kind=kInput, calls=%fused_b, metadata={op_name="jit(s)/kda/dot_general"}
  %input_reduce_fusion.182 = f32[] fusion(%a), kind=kInput, calls=%fused_a, metadata={op_name="jit(s)/kda/dot_general"}
  %input_reduce_fusion.183 = f32[] fusion(%a), kind=kInput, calls=%fused_c, metadata={op_name="jit(s)/kda/dot_general"}
  %loop_reduce_fusion.9 = f32[] fusion(%a), kind=kLoop, calls=%fused_a, metadata={op_name="jit(s)/kda/dot_general"}
  ROOT %t = (f32[], f32[], f32[], f32[], f32[]) tuple(%input_reduce_fusion.180, %input_reduce_fusion.181, %input_reduce_fusion.182, %input_reduce_fusion.183, %loop_reduce_fusion.9)
}
"""


def test_fusions_sharing_one_kernel_map_to_its_name():
  """XLA compiles fusions of one fused computation — or of identical ones — to one kernel named after the first
  (session 39: the 34 KDA layers' qkv GEMVs all launched input_reduce_fusion_180, and the chain by GPU time weighed
  33 of them 0): such instructions map to that one name; another body (a different constant) or another fusion
  kind is a kernel of its own; with ``known`` (the names CUPTI recorded) the group takes the recorded name."""
  k = P.instruction_kernels(SHARED)
  assert k["input_reduce_fusion.180"] == k["input_reduce_fusion.181"] == k["input_reduce_fusion.182"] == \
      "input_reduce_fusion_180"
  assert k["input_reduce_fusion.183"] == "input_reduce_fusion_183"
  assert k["loop_reduce_fusion.9"] == "loop_reduce_fusion_9"
  k = P.instruction_kernels(SHARED, known={"input_reduce_fusion_181"})
  assert {k[f"input_reduce_fusion.{i}"] for i in (180, 181, 182)} == {"input_reduce_fusion_181"}
  # the chain by GPU time weighs every member with the shared kernel's time
  w = {i: {"input_reduce_fusion_180": 5.0}.get(n, 0.0) for i, n in P.instruction_kernels(SHARED).items()}
  assert w["input_reduce_fusion.181"] == w["input_reduce_fusion.182"] == 5.0


def test_split_attributes_kernel_records():
  kmap = P.kernel_map(HLO)
  assert kmap["loop_neg_fusion_2"] == "draft" and kmap["custom_call_7"] == "kda"
  assert kmap["neg"] == "mhc"  # an instruction inside a fused computation names its kernel on some emitters
  recs = [("loop_neg_fusion", 0.002), ("loop_neg_fusion_2", 0.004), ("sort_5_1", 0.010),  # a suffixed launch
          ("ncclDevKernel_AllReduce_Sum_bf16", 0.010), ("psum_44_0_fusion_1", 0.010),  # XLA's own all-reduce
          ("mystery_kernel", 0.001)] * 2
  per, launches, unmatched = P.split(recs, kmap, steps=2)
  assert launches == 6
  assert per == pytest.approx({"mhc": 2.0, "draft": 4.0, "router": 10.0, "all-reduce": 20.0, "other": 1.0})
  assert unmatched == pytest.approx({"mystery_kernel": 1.0})


def test_census_of_a_compiled_step_sees_every_component():
  """The real step, compiled on CPU: every named component shows up and the TP all-reduces are counted."""
  m = load(tiny_checkpoint("kernel-tiny", 4, "fp8"), "float32")
  dec = Decoder(m, DecodeConfig(max_context=64, q=2, capture_sizes=(1,), policy=()), backend="auto")
  dec.warmup()
  c = P.census(dec._aot[1].as_text())
  for comp in ("embed", "mhc", "kda", "dsa", "indexer", "router", "moe", "mlp", "lm_head", "draft"):
    assert c["by_component"].get(comp, 0) > 0, (comp, c)
  assert c["by_kind"]["fusion"] > 100
  # its longest kernel chain: each kernel on it reads (through free instructions) the one before it
  text = dec._aot[1].as_text()
  paths = P.critical_paths(text)
  top = paths[0]
  assert sum(d["kernels"] for d in paths) == c["kernels"] and 20 < top["launches"] < top["kernels"], top
  deps = {n: P._operand_names(rest) for comp, n, _, _, rest in P._instructions(text) if comp == top["computation"]}

  def reaches(a, b):  # b among a's transitive operands
    seen, todo = set(), [a]
    while todo:
      for p in deps.get(todo.pop(), ()):
        if p == b:
          return True
        if p not in seen:
          seen.add(p)
          todo.append(p)
    return False
  names = [n for n, _ in top["path"]]
  assert all(reaches(b, a) for a, b in zip(names, names[1:]))


def test_trace_interval_helpers():
  """Device busy time is the union of kernel intervals (overlaps counted once) and the gaps between them; host
  self time subtracts nested events."""
  rng = np.random.default_rng()
  starts = np.sort(rng.integers(0, 10_000, 40))
  iv = [(int(s), int(s + rng.integers(1, 400))) for s in starts]
  cover = np.zeros(11_000, bool)
  for s, e in iv:
    cover[s:e] = True
  busy, gaps = P._union_busy(iv)
  assert busy == cover.sum()
  span = max(e for _, e in iv) - min(s for s, _ in iv)
  assert busy + sum(gaps) == span and all(g > 0 for g in gaps)
  # outer [0, 100) holds a [10, 30) which holds b [12, 20); c [40, 50) also inside outer; d after
  ev = [("outer", 0, 100), ("a", 10, 30), ("b", 12, 20), ("c", 40, 50), ("d", 120, 125)]
  assert dict(P._self_times(ev)) == {"outer": 100 - 20 - 10, "a": 20 - 8, "b": 8, "c": 10, "d": 5}
  # an event overrunning its parent counts towards it only up to the parent's end; nothing goes negative
  assert [P.event_kind(n) for n in ("fusion.12", "fusion_8172", "cuGraphLaunch (CudaGraph:784)",
                                    "PjitFunction(jit(body))")] == ["fusion", "fusion", "cuGraphLaunch",
                                                                    "PjitFunction(jit(body))"]
  st = dict(P._self_times([("p", 0, 10), ("x", 5, 20), ("y", 15, 18)]))
  assert st["p"] == 5 and all(v >= 0 for v in st.values())


def test_wall_shares_split_overlaps_equally():
  """wall_shares: each instant's time split equally among the kernels running then — the shares sum to the busy
  union, the rest of the span is idle; checked against a unit-grid count on fresh random intervals."""
  rng = np.random.default_rng()
  names = ["a", "b", "c", "d"]
  ev = [(names[int(rng.integers(4))], int(s), int(s + rng.integers(1, 300))) for s in rng.integers(0, 5_000, 60)]
  share, idle = P.wall_shares(ev)
  want = dict.fromkeys(names, 0.0)
  cover = np.zeros(6_000, int)
  for _, s, e in ev:
    cover[s:e] += 1
  for n, s, e in ev:
    want[n] += float(np.sum(1.0 / cover[s:e]))
  for n in names:
    assert abs(share.get(n, 0.0) - want[n]) < 1e-6 * max(1.0, want[n]), (n, share.get(n), want[n])
  busy, _ = P._union_busy([(s, e) for _, s, e in ev])
  assert abs(sum(share.values()) - busy) < 1e-6 * busy
  span = max(e for *_, e in ev) - min(s for _, s, _ in ev)
  assert idle == span - busy


def test_kernel_table_reads_a_profile_with_its_hlo(tmp_path, capsys):
  """benchmarks/kernel_table.py: a component's kernels with time per launch, launches and the HLO's result type
  and op (profile names spell the HLO's '.' as '_'); filters by component and launch count."""
  import json  # noqa: PLC0415
  import os  # noqa: PLC0415
  import sys  # noqa: PLC0415
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
  import kernel_table as KT  # noqa: PLC0415
  kernels = {"loop_neg_fusion_2": [30.0, 10.0, "draft"], "glm5_moe_down_mosaic_gpu_kernel": [86.0, 10.0, {"moe": 1.0}],
             "input_reduce_fusion_7": [5.0, 1.0, "moe"]}
  path = tmp_path / "k.json"
  path.write_text(json.dumps(kernels))
  hlo = tmp_path / "s.hlo"
  hlo.write_text(HLO + '\n  %input_reduce_fusion.7 = f32[8]{0} fusion(%v), kind=kInput, calls=%add, '
                 'metadata={op_name="jit(body)/shard_map/moe/reduce_max"}\n'
                 '  %copy.3 = s32[1]{0} copy(s32[1]{0} %c), metadata={op_name="jit(body)/shard_map/kda/reshape"}\n'
                 '  %fusion.4 = f32[1,288]{1,0} fusion(%v), kind=kLoop, calls=%add, '
                 'metadata={op_name="jit(body)/shard_map/slice"}\n'
                 '\n%fused_computation.2 (p: f32[4]) -> f32[4] {\n  %copy.9 = f32[4]{0} copy(f32[4]{0} %p)\n}\n')
  # Copies outside fusions and fusions the profile never saw (the profile's nameless memcpy nodes) are listed by
  # op; copies inside fusions are not.
  assert KT.hlo_memcpy_candidates(hlo.read_text(), set(kernels)) == [
      ("copy.3", "s32[1]{0}", "jit(body)/shard_map/kda/reshape"),
      ("fusion.4", "f32[1,288]{1,0}", "jit(body)/shard_map/slice")]
  assert [n for n, *_ in KT.hlo_memcpy_candidates(hlo.read_text(), {"fusion_4"})] == ["copy.3"]
  got = KT.rows(KT.load_kernels(str(path)), KT.hlo_index(hlo.read_text()), ["moe", "draft"])
  assert [(c, round(p, 2), n, name) for c, p, n, name, _, _ in got] == [
      ("draft", 3.0, 10.0, "loop_neg_fusion_2"), ("moe", 8.6, 10.0, "glm5_moe_down_mosaic_gpu_kernel"),
      ("moe", 5.0, 1.0, "input_reduce_fusion_7")]
  assert got[0][4] == "f32[4]{0}" and got[0][5].endswith("draft/dsa/indexer/neg") and got[2][5] == "moe/reduce_max"
  assert KT.main([str(path), "--hlo", str(hlo), "--component", "moe", "--min-launches", "5"]) == 0
  out = capsys.readouterr().out
  assert "== moe: 86 µs per step in 10 launches" in out and "input_reduce_fusion_7" not in out
  assert "launched no kernel of their name (memcpy nodes?): 2" in out and "kda/reshape" in out


def test_sublayer_chain_splits_a_trace_at_the_boundaries(tmp_path, capsys):
  """benchmarks/sublayer_chain.py: a saved trace's events split at the mHC boundary launches — the one-row form's
  and the grid form's alike (a q = 4 step has both: the verify's rows and the draft's one) — each sublayer named
  by its kernels and timed boundary to boundary; a kernel listing labels the XLA kernels with their op_name."""
  import gzip  # noqa: PLC0415
  import os  # noqa: PLC0415
  import sys  # noqa: PLC0415
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
  import sublayer_chain as SC  # noqa: PLC0415
  rng = np.random.default_rng()
  t, rows, want = 1000, [], []
  bounds = ("glm5_mhc_row_boundary_mosaic_gpu_kernel", "glm5_mhc_post_finish_mosaic_gpu_kernel")
  for i, (kind, names) in enumerate([("kda", ["kda_decode_mosaic_gpu_kernel"]),
                                     ("moe", ["glm5_moe_gate_up", "loop_pad_fusion_41"]),
                                     ("dsa", ["glm5_topk_threshold", "glm5_sparse_mla"]),
                                     ("kda", ["kda_decode_mosaic_gpu_kernel"])]):
    start, dur = t, int(rng.integers(2000, 9000))
    rows.append((bounds[i % 2], t, t + 700, "stream 1"))
    for n in names:
      rows.append((n, t + 800, t + 800 + dur, "stream 2"))
    t += 1000 + dur
    want.append((kind, (t - start) / 1e3))
  rows.append(("glm5_mhc_post_finish_mosaic_gpu_kernel", t, t + 700, "stream 1"))
  path = tmp_path / "x.events.tsv.gz"
  with gzip.open(path, "wt") as fh:
    fh.writelines(f"{n}\t{s}\t{e}\t{ln}\n" for n, s, e, ln in rows[::-1])  # (any order: sorted on reading)
  subs = SC.sublayers(SC.read_events(str(path)))
  assert [k for k, _, _ in subs] == [k for k, _ in want] and [len(seg) for _, seg, _ in subs] == [2, 3, 3, 2]
  listing = tmp_path / "x.kernels.tsv"
  listing.write_text("c\tloop_pad_fusion.41\tfusion\tmoe\tf32[1]\tjit(body)/shard_map/moe/pad\n")
  SC.main([str(path), "--kernels", str(listing), "--kind", "moe"])
  out = capsys.readouterr().out
  assert f"| moe | 1 | {want[1][1]:.1f} / " in out and "moe: jit(body)/shard_map/moe/pad" in out
  assert f"| kda | 2 | {np.median([want[0][1], want[3][1]]):.1f} / " in out
  # what each next boundary waited for: the kernel that ended last (the moe sublayer's two end together: 0.0 ahead)
  assert any(f"| moe | {n} 1 (0.0) |" in out for n in ("glm5_moe_gate_up", "moe: pad")), out
  assert "| kda | kda_decode 2 (0.0) |" in out, out
  seg = [("b", 0, 700, ""), ("glm5_mhc_sinkhorn_mosaic_gpu_kernel", 900, 9000, ""), ("kda_o_proj", 800, 8500, "")]
  assert SC.last_arrivals([(9.0, seg)] * 3) == [("mhc_sinkhorn", 3, 0.5)]


def test_component_floors_add_up_to_the_roofline():
  """profiling.floor_bytes of one TP4 rank (abstract weights): every parameter lands in a component, the verify
  components add up to bench_decode's roofline formula (performance.md §6: BF16 latent there, FP8 rows here), the
  experts grow with the tokens, and the draft appears with q > 1; the real geometry sharded over 4 devices gives
  one device the same bytes as the one-rank geometry."""
  import os  # noqa: PLC0415
  import sys  # noqa: PLC0415
  import jax  # noqa: PLC0415
  from glm5_jax import config as C, sharding as shd  # noqa: PLC0415
  from glm5_jax.synthetic import abstract_model, tp_rank_config  # noqa: PLC0415
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
  from bench_decode import roofline_bytes  # noqa: PLC0415
  cfg = tp_rank_config(C.real(), 4)
  _, params = abstract_model(cfg, mesh=shd.make_mesh(1))
  floors = {}
  for b, q in ((1, 1), (1, 4), (8, 1)):
    f = P.floor_bytes(cfg, params, batch=b, q=q, context=32768)
    floors[b, q] = f
    assert f.get("other", 0.0) < 1e6 and set(f) <= set(P.COMPONENTS), f
    verify = sum(v for c, v in f.items() if c != "draft")
    assert abs(verify / roofline_bytes(b, q, 32768) - 1) < 0.03, (b, q, verify)
  assert floors[1, 1]["draft"] == 0 < floors[1, 4]["draft"]
  assert floors[1, 1]["moe"] < floors[1, 4]["moe"] < floors[8, 1]["moe"]
  assert floors[1, 1]["kda"] < floors[8, 1]["kda"]  # the recurrent state per sequence
  rows = P.gap_table(floors[1, 1], {"moe": 1000.0, "kda": 500.0})
  assert [r[0] for r in rows if r[2]] == ["kda", "moe"] and all(r[1] > 0 for r in rows)
  if len(jax.devices()) >= 4:
    _, sharded = abstract_model(C.real(), mesh=shd.make_mesh(4))
    g = P.floor_bytes(C.real(), sharded, batch=1, q=1, context=32768, tp=4)
    for c in ("kda", "moe", "dsa", "lm_head", "mhc", "router"):
      assert abs(g[c] / floors[1, 1][c] - 1) < 0.05, (c, g[c], floors[1, 1][c])


def test_ab_table_compares_interleaved_rows_with_their_spread(capsys):
  """benchmarks/ab_table.py: per invocation, each configuration against the baseline (the empty policy, one step
  per call), the difference, whether the repeat ranges overlap, and the paired per-round difference (the first
  round left out; rows without stored repeats, or with another count, say "?"), and the default rule's verdict
  (faster / slower in >= 3 of 4 paired rounds, else a tie)."""
  import os  # noqa: PLC0415
  import sys  # noqa: PLC0415
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
  import ab_table  # noqa: PLC0415
  rng = np.random.default_rng()
  base_ms = float(rng.uniform(4, 8))
  common = dict(geometry="tp4-rank", layers=45, tp=1, batch=1, q=1, context=32768, date="2026-12-02",
                run="2026-12-02T00:00:00", interleaved=True, backend="latency_specialized", pack_params=65536)
  rows = [dict(common, policy={}, steps_per_call=1, ms_per_step=base_ms,
               ms_repeats=[base_ms + 3, base_ms - 0.1, base_ms + 0.1, base_ms + 0.4]),
          dict(common, policy={}, steps_per_call=4, ms_per_step=base_ms - 1, ms_repeats=[base_ms - 1.1, base_ms - 0.9]),
          # (a drift between rounds: the spreads overlap, but the configuration is 0.05 ms slower in every round)
          dict(common, policy={"kda_norm": True}, steps_per_call=1, ms_per_step=base_ms + 0.05,
               ms_repeats=[base_ms + 2, base_ms - 0.05, base_ms + 0.15, base_ms + 0.45]),
          dict(common, policy={"x": 1}, steps_per_call=1, ms_per_step=base_ms + 2),  # (no repeats stored)
          # (faster in 2 of 3 paired rounds: not 3 of 4 — a tie by the rule; faster in 3 of 3)
          dict(common, policy={"y": 1}, steps_per_call=1, ms_per_step=base_ms - 0.02,
               ms_repeats=[base_ms + 3, base_ms - 0.2, base_ms + 0.05, base_ms + 0.45]),
          dict(common, policy={"z": 1}, steps_per_call=1, ms_per_step=base_ms - 0.05,
               ms_repeats=[base_ms + 3, base_ms - 0.15, base_ms + 0.05, base_ms + 0.35]),
          dict(common, run="other", policy={}, steps_per_call=1, ms_per_step=1.0)]  # (alone in its invocation)
  lines = ab_table.table(rows, {})
  body = [ln for ln in lines if ln.startswith("| latency")]
  assert len(body) == 6 and "baseline" in body[0] and f"{base_ms:.2f}" in body[0]
  assert body[1].endswith("| -1.00 ms ({:+.1f} %) | yes | ? | ? |".format(-100 / base_ms))  # (unpaired: 2 vs 4)
  assert body[2].endswith("| no | +0.05 ms, faster in 0/3 | slower |")
  assert body[3].endswith("| ? | ? | ? |") and "| — |" in body[3]
  assert body[4].endswith("| -0.05 ms, faster in 2/3 | tie |"), body[4]
  assert body[5].endswith("| -0.05 ms, faster in 3/3 | faster |"), body[5]


def test_code_size_probe_computes_its_reference():
  """benchmarks/bench_code_size.py's probe kernel (GPU interpret mode): both forms compute the FMA chain, and the
  unrolled one is the larger module (what the benchmark times against its code size)."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  from benchmarks import bench_code_size as B  # noqa: PLC0415
  from pallas_kernels._common import cross_lower, maybe_interpret  # noqa: PLC0415
  x = np.random.default_rng().uniform(-1, 1, (2, *B.SHAPE)).astype(np.float32)
  sizes = []
  for unroll in (False, True):
    with maybe_interpret(True):
      got = np.asarray(jax.jit(lambda v, u=unroll: B.fma_chain(v, 12, u))(jnp.asarray(x)))
    np.testing.assert_allclose(got, B.reference(x, 12), rtol=1e-5, atol=1e-5)
    sizes.append(len(cross_lower(lambda v, u=unroll: B.fma_chain(v, 64, u),
                                 jax.ShapeDtypeStruct((2, *B.SHAPE), jnp.float32)).as_text()))
  assert sizes[1] > 2 * sizes[0], sizes  # (64 steps: ~2.5x; 1,024: ~18x)


def test_bench_decode_refuses_a_profile_of_the_rolled_steps_loop(capsys):
  """bench_decode --profile at several steps per call needs the unrolled form: CUPTI records one pass of the
  rolled loop per call (session 37: 355 of 1,417 launches per step); --trace with --profile is refused too."""
  import os  # noqa: PLC0415
  import sys  # noqa: PLC0415
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
  import bench_decode  # noqa: PLC0415
  for argv, why in ((["--profile", "--steps-per-call", "4"], "--steps-per-call 4: CUPTI records one iteration"),
                    (["--profile", "--trace"], "both use CUPTI")):
    with pytest.raises(SystemExit) as e:
      bench_decode.main(argv)
    assert e.value.code == 2 and why in capsys.readouterr().err, argv


def test_plot_history_takes_the_defaults_rows_in_time_order(tmp_path, capsys):
  """benchmarks/plot_history.py: of random rows (shuffled), only the one-rank geometry at B = 1 and 32K context
  with no policy override counts, per backend and q, in run-time order; the best-so-far line is the running
  minimum of those rows; the PNG is written and each day's best printed."""
  import json  # noqa: PLC0415
  import os  # noqa: PLC0415
  import sys  # noqa: PLC0415
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
  import plot_history as PH  # noqa: PLC0415
  rng = np.random.default_rng()
  rows = []
  for i in range(40):
    day = f"2026-12-0{1 + i // 10}"
    r = {"geometry": "tp4-rank", "batch": 1, "context": 32768, "backend": ["auto", "latency_specialized"][i % 2],
         "q": [1, 4][(i // 2) % 2], "policy": {}, "ms_per_step": float(rng.uniform(3, 9)), "date": day,
         "run": f"{day}T{10 + i % 10:02d}:00:00", "roofline_ms": 1.417}
    rows.append(r)
  # rows that must not count: a policy override, another batch / context / geometry
  noise = [dict(rows[0], policy={"x": True}, ms_per_step=0.1), dict(rows[1], batch=8, ms_per_step=0.1),
           dict(rows[2], context=4096, ms_per_step=0.1), dict(rows[3], geometry="tp2", ms_per_step=0.1)]
  shuffled = [rows[j] for j in rng.permutation(len(rows))] + noise
  path = tmp_path / "rows.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in shuffled))
  want = sorted((r for r in rows if (r["backend"], r["q"]) == ("latency_specialized", 1)), key=lambda r: r["run"])
  got = PH.default_rows(PH.load_rows([str(path)]), "latency_specialized", 1)
  assert [ms for _, ms, _ in got] == [r["ms_per_step"] for r in want]
  assert [b for _, b in PH.best_so_far(got)] == list(np.minimum.accumulate([r["ms_per_step"] for r in want]))
  out = tmp_path / "h.png"
  PH.main([str(path), "-o", str(out)])
  assert out.stat().st_size > 1000
  text = capsys.readouterr().out
  day_best = min(r["ms_per_step"] for r in want if r["date"] == "2026-12-02")
  assert f"| latency_specialized | 1 | 2026-12-02 | {day_best:.2f} |" in text


def test_plot_prefill_takes_the_defaults_rows_per_prompt(tmp_path, capsys):
  """benchmarks/plot_prefill.py: of random prefill rows, those with an empty policy or one set as today's defaults
  count (an adopted candidate), per prompt length in file order — not a policy that differs from the defaults, nor
  another geometry; the table's best so far is the running minimum; the PNG is written."""
  import json  # noqa: PLC0415
  import os  # noqa: PLC0415
  import sys  # noqa: PLC0415
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
  import plot_prefill as PP  # noqa: PLC0415

  from glm5_jax.layers import KERNEL_DEFAULTS  # noqa: PLC0415
  rng = np.random.default_rng()
  on, off = next(k for k, v in KERNEL_DEFAULTS.items() if v), next(k for k, v in KERNEL_DEFAULTS.items() if not v)
  rows = [{"geometry": "tp4-rank", "prompt": [4096, 32768][i % 2], "chunk": [256, 512][(i // 2) % 2],
           "policy": [{}, {on: True}][(i // 4) % 2], "ms": float(rng.uniform(500, 9000)), "layers": 32,
           "date": f"2026-12-0{1 + i // 10}", "device": "H100"} for i in range(24)]
  noise = [dict(rows[0], policy={on: False}, ms=1.0), dict(rows[1], policy={off: True}, ms=1.0),
           dict(rows[2], geometry="kernel-tiny", ms=1.0),
           dict(rows[3], prefill_compiler_options={"xla_gpu_autotune_level": 0}, ms=1.0)]
  order = rng.permutation(len(rows) + len(noise))
  everything = [(rows + noise)[j] for j in order]
  path = tmp_path / "rows.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in everything))
  got = PP.default_rows(PP.load_rows([str(path)]), 4096, KERNEL_DEFAULTS)
  want = [r for r in everything if r in rows and r["prompt"] == 4096]
  assert [sec for _, sec, _, _ in got] == [r["ms"] / 1e3 for r in want]
  out = tmp_path / "p.png"
  PP.main([str(path), "-o", str(out)])
  assert out.stat().st_size > 1000
  text = capsys.readouterr().out
  best = min(r["ms"] for r in want) / 1e3
  assert text.count("| 4,096 |") == len(want) and f"| {best:.3f} |" in text.splitlines()[1 + len(want)]


def test_plot_prefill_components_of_the_traced_rows(tmp_path, capsys):
  """plot_prefill.py --components-out: the last N rows with a trace split by component (untraced rows skipped),
  each a table row of its components in ms (the columns by their largest value) and its total; the PNG is written."""
  import json  # noqa: PLC0415
  import os  # noqa: PLC0415
  import sys  # noqa: PLC0415
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
  import plot_prefill as PP  # noqa: PLC0415

  rng = np.random.default_rng()
  comps = ("moe", "kda", "dsa", "mhc", "indexer")
  rows = [{"geometry": "tp4-rank", "prompt": 4096, "chunk": 512, "policy": {} if i % 2 else {"x": True},
           "ms": 500.0, "run": f"r{i}", "date": "2026-12-07", "layers": 32, "device": "H100",
           **({"trace": {"components_us_per_chunk": {c: float(rng.uniform(100, 30000)) for c in comps}}}
              if i % 3 else {})} for i in range(9)]
  path = tmp_path / "rows.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  traced = [r for r in rows if "trace" in r]
  got = PP.component_rows(PP.load_rows([str(path)]), 4)
  assert [r["run"] for _, _, r in got] == [r["run"] for r in traced[-4:]]
  out = tmp_path / "c.png"
  PP.main([str(path), "--components-out", str(out), "--last", "4"])
  assert out.stat().st_size > 1000
  lines = [ln for ln in capsys.readouterr().out.splitlines() if ln[:3] == "| r" and ln[3].isdigit()]
  assert len(lines) == 4
  for ln, r in zip(lines, traced[-4:]):
    cells = [c.strip() for c in ln.strip("|").split("|")]
    assert cells[0].startswith(r["run"] + " p4096 c512") and ("x=True" in cells[0]) == bool(r["policy"])
    assert float(cells[-1]) == pytest.approx(sum(r["trace"]["components_us_per_chunk"].values()) / 1e3, abs=0.006)


def test_step_census_diff_names_the_kernels_a_policy_adds_and_removes():
  """benchmarks/step_census.py --diff: kernels matched across two compiles by component, result type and JAX op
  (the instructions' numbering ignored); a conversion kernel a knob adds and a fusion it changes show as + / -."""
  import os  # noqa: PLC0415
  import sys  # noqa: PLC0415
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
  import step_census  # noqa: PLC0415
  row = lambda name, comp, shape, op: f"body\t{name}\tfusion\t{comp}\t{shape}\t{op}\n"  # noqa: E731
  base = (row("loop_mul.3", "mlp", "bf16[1,3072]", "jit(body)/mlp/mul") +
          row("dsf.17", "moe", "f32[8]", "jit(body)/moe/jit(fp8_moe.2)/glm5_moe_gate_up/mpmd_map") * 2)
  other = (row("loop_convert.9", "moe", "f16[1,4096]", "jit(body)/moe/jit(fp8_moe.5)/convert_element_type") * 2 +
           row("dsf.31", "moe", "f32[8]", "jit(body)/moe/jit(fp8_moe.7)/glm5_moe_gate_up/mpmd_map") * 2)
  rows = [dict(q=1, policy={}), dict(q=1, policy={"dq_f16": True}), dict(q=1, policy={"x": 1})]
  out = step_census.diff(rows, [base, other, base]).splitlines()
  assert out[0].startswith('# q = 1 {"dq_f16": true}') and len(out) == 3, out
  assert out[1].split()[:2] == ["-1", "mlp"] and out[2].split()[:3] == ["+2", "moe", "f16[1,4096]"], out
