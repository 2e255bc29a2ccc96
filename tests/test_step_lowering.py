"""The whole latency_specialized decode step — every Pallas kernel in its model context — cross-lowers for CUDA
on the CPU (Mosaic GPU lowering, layout inference, SMEM budgets), at kernel-tiny and at the real geometry of one
TP4 rank (45 layers + MTP, abstract weights: nothing is allocated)."""

import re

import jax
import pytest

from glm5_jax import config as C
from glm5_jax import sharding as shd
from glm5_jax.runtime import DecodeConfig
from glm5_jax.speculative import Decoder
from glm5_jax.synthetic import abstract_model, tp_rank_config
from pallas_kernels import indexer as ki


def trace_step(cfg, q, backend, max_context=32784, b=1, tp=1, policy=(), **kw):
  """The step traced (not lowered) with the kernels on and no interpret mode, as the CUDA lowering sees it."""
  model, params = abstract_model(cfg, mesh=shd.make_mesh(tp))
  dec = Decoder(model, DecodeConfig(max_context=max_context, q=q, capture_sizes=(b,), policy=policy), backend=backend,
                **kw)
  with dec.kernel_mode(interpret=False):  # kernels on, no interpret mode: this is the CUDA lowering
    return dec.trace_step(b, params, interpret=False)


def lower_step(cfg, q, backend, max_context=32784, b=1, tp=1, policy=(), **kw):
  return trace_step(cfg, q, backend, max_context, b, tp, policy, **kw).lower(lowering_platforms=("cuda",)).as_text()


def kernel_calls(txt):
  """[(kernel name, operand/result types, kernel hash)] of every Mosaic GPU call in a lowered step."""
  out = []
  for line in txt.splitlines():
    if "@mosaic_gpu_v2" not in line:
      continue
    h = re.search(r'kernel_hash = "((?:[^"\\]|\\.)*)"', line).group(1)
    # (the KDA kernels' names have no glm5_ prefix; the source path kda_decode.py is in every KDA module)
    name = (re.search(r"(glm5_\w+?|kda_o_proj)(?:_mosaic|\\|\b)", line)
            or re.search(r"(kda_decode)(?:_mosaic|\\|\b)", line)).group(1)
    out.append((name, line.rsplit(" : ", 1)[1], h))
  return out


PARITY_GRIDS = ("glm5_moe_one_grid", "kda_o_proj")  # (one module per counter bank: a static parity)


def check_one_module_per_kernel(txt):
  """Calls of the same kernel with the same types carry the same module hash (one runtime compilation each) —
  but the one grids (the MoE's, the KDA recurrence + o_proj's), whose two counter banks (their static parity) make
  two modules. Identical calls are lowered once (a called function), so the text holds one custom call per
  distinct kernel."""
  calls = kernel_calls(txt)
  sigs = {(n, t) for n, t, _ in calls}
  hashes = {h for n, _, h in calls if n not in PARITY_GRIDS}
  assert len(hashes) == len(sigs - {s for s in sigs if s[0] in PARITY_GRIDS}), (len(hashes), len(sigs))
  for name in PARITY_GRIDS:
    grids = {(t, h) for n, t, h in calls if n == name}
    assert all(sum(g[0] == t for g in grids) <= 2 for t, _ in grids), grids
  return len(calls), len(hashes)


def test_kernel_tiny_step_lowers_for_cuda():
  """The kernel-tiny step at q = 1 (q = 4: test_real_geometry_step_lowers_for_cuda, whose kernels are the same
  forms at the real shapes; a kernel-tiny q = 4 lowering of its own cost the CPU suite ~20 s)."""
  traced = trace_step(C.kernel_tiny(), 1, "latency_specialized", max_context=4096)
  txt = traced.lower(lowering_platforms=("cuda",)).as_text()
  n_calls, n_kernels = check_one_module_per_kernel(txt)
  # identical calls share one lowering (pallas_kernels._common.kernel_entry); where they do not (another
  # lowering context), they still share one module, hence one runtime compilation
  assert n_kernels <= 18 and n_calls <= 35, (n_calls, n_kernels)
  # (the FP8 linears with the weight dequantised in registers: policy fp8_dq, on by default)
  # (a single token row's MoE as one grid: moe_one_grid, on since session 60 — no gate/up or down launch)
  for name in ("glm5_fp8_dq_linear", "glm5_moe_one_grid", "glm5_sparse_mla", "glm5_indexer_scores"):
    assert name in txt, name
  assert "glm5_moe_gate_up" not in txt and "glm5_moe_down" not in txt
  grids = [c for c in kernel_calls(txt) if c[0] == "glm5_moe_one_grid"]  # (kernel-tiny's 2 MoE layers)
  assert len(grids) == 2 and len({h for _, _, h in grids}) == 2, grids  # (parities 0, 1: two modules)
  # one-row MoE calls: the router's selection inside the gate/up kernel (moe_router_in_kernel, on since session
  # 41), no router_topk launch
  assert "glm5_router_topk" not in txt
  assert "glm5_moe_route" not in txt  # (router_route, on since session 35: the router kernel builds the tables)
  # the indexer's selection from pallas_kernels.indexer.THRESHOLD_MIN_ROWS score rows (1 since session 32) as ONE
  # launch of the compaction kernel whose CTAs find the threshold themselves (topk_compact_kernel +
  # topk_compact_fused, on since session 50: no threshold kernel), fed the scores kernel's f32 output as it is
  assert ki.THRESHOLD_MIN_ROWS == 1 and "glm5_topk_compact" in txt and "glm5_topk_threshold" not in txt
  sel = [line for line in txt.splitlines() if "@mosaic_gpu_v2" in line and "glm5_topk_compact" in line]
  assert sel and all(re.search(r"\(tensor<\d+x\d+x\d+xf32>, tensor<\d+xi32>, tensor<\d+xi32>\)", line)
                     for line in sel), sel
  assert "mosaic_gpu.uses_pdl" not in txt  # (policy pdl, off by default: test_kernel_tiny_step_lowers_for_cuda_at_tp4)
  # and the stock path has no kernel at all (its traced program: no Pallas call — a lowering of it cost ~5 s)
  stock = str(trace_step(C.kernel_tiny(), 1, "auto", max_context=4096).jaxpr)
  assert "mpmd_map" in str(traced.jaxpr)
  assert "mpmd_map" not in stock and "pallas" not in stock


def test_kernel_tiny_step_lowers_at_twelve_token_rows():
  """B = 4, q = 3: 12 token rows, not a multiple of the kernels' 8-row tiles — the weight-streaming kernels take
  x padded there (linear._tma_rows; unpadded it does not lower), the mHC sums go as [40, 12]."""
  txt = lower_step(C.kernel_tiny(), 3, "latency_specialized", max_context=4096, b=4)
  for name in ("glm5_fp8_dq_linear", "glm5_bf16_linear", "glm5_moe_gate_up", "glm5_mhc_finish", "glm5_mhc_sinkhorn"):
    assert name in txt, name


@pytest.mark.parametrize("form", ["kernels", "grid"])
def test_kernel_tiny_step_with_fused_mhc_lowers_for_cuda(form):
  """Policy mhc on: the 8 boundaries of kernel-tiny run as the fused kernels (the first site without a post), or
  (mhc_grid_barrier, the default) each as one launch with a grid barrier + the Sinkhorn kernel. With the KDA
  kernel's approximate math and its tokens as a loop (kda_approx_math, kda_token_loop: a knob turned on
  explicitly that reached no call site would be refused) and the router kernel building the MoE slot tables
  (router_route: q = 2 is two token rows). With the fused kernels (each form lowers its own off-by-default
  knobs: the kernels of both at once took the CPU suite past its 10 minutes), half as wide per CTA (mhc_narrow),
  the finish / Sinkhorn summing the raw partials (mhc_fused_sums), the short conv inside the KDA kernel
  (kda_conv), the top-k threshold kernel on 4 warpgroups (topk_threshold_4wg) before XLA's compaction, and the
  sparse MLA's split merge as a kernel (mla_combine_kernel); with the grid barrier, its counters in one Ref per step
  (mhc_barrier_counters: every trunk boundary's launch takes the Ref's buffer as an aliased operand), the FP8 /
  BF16 linears' K splits summed in the kernel on the step's split-K counters (linear_fused_sum), and the indexer's
  selection as ONE launch of the multi-CTA compaction kernel whose CTAs find the threshold themselves
  (topk_compact_kernel + topk_compact_fused: no threshold kernel; on by default since session 50); in the kernels
  form the split-K counters at the DSA layers' q_a / kv_a projection alone (qkv_a_fused_sum)."""
  kernels = form == "kernels"
  txt = lower_step(C.kernel_tiny(), 2, "latency_specialized", max_context=4096,
                   policy=(("kda_approx_math", True), ("kda_token_loop", True), ("mhc", True), ("router_route", True),
                           ("mhc_grid_barrier", not kernels), ("mhc_barrier_counters", not kernels),
                           ("linear_fused_sum", not kernels), ("topk_compact_kernel", not kernels),
                           ("topk_compact_fused", not kernels),
                           ("mhc_narrow", kernels), ("mhc_fused_sums", kernels),
                           ("kda_conv", kernels), ("topk_threshold_4wg", kernels), ("mla_combine_kernel", kernels),
                           ("qkv_a_fused_sum", kernels)))
  names = {"kernels": ("glm5_mhc_pre", "glm5_mhc_post_pre", "glm5_mhc_finish"),
           "grid": ("glm5_mhc_post_finish", "glm5_mhc_sinkhorn")}[form]
  for name in names:
    assert name in txt, name
  assert ("glm5_mhc_post_pre" in txt) == kernels
  assert "glm5_router_route" in txt and "glm5_moe_route" not in txt and ("glm5_mla_combine" in txt) == kernels
  # the indexer's selection: the threshold kernel (on 4 warpgroups) + XLA's compaction in the kernels form, the
  # fused compaction in one launch (no threshold kernel) in the grid form
  assert ("glm5_topk_threshold" in txt) == kernels
  assert ("glm5_topk_compact" in txt) != kernels
  # (the kernels form: the split-K counters at the DSA layers' q_a / kv_a projection alone — qkv_a_fused_sum)
  fp8 = [line for line in txt.splitlines() if "@mosaic_gpu_v2" in line and "glm5_fp8_dq_linear" in line]
  assert any(line.endswith("xi32>)") for line in fp8) and (kernels or all(line.endswith("xi32>)") for line in fp8))
  if form == "grid":  # the trunk's boundaries (2 per layer; 3 lowerings — first, parity 0 / 1 — of two kernels)
    # return the counters' int32[2] buffer last (aliased), not a pl.get_global int32[1] scratch
    calls = [line for line in txt.splitlines() if "@mosaic_gpu_v2" in line and "glm5_mhc_post_finish" in line]
    assert len(calls) == 3 and all(line.endswith("tensor<2xi32>)") for line in calls)  # (the parity: int32[1] in)
    assert len(re.findall(r"call @mhc_post_finish", txt)) == 2 * C.kernel_tiny().num_hidden_layers
    for name in ("glm5_fp8_dq_linear", "glm5_bf16_linear"):  # (the trunk's and the MTP pass's)
      lines = [line for line in txt.splitlines() if "@mosaic_gpu_v2" in line and name in line]
      assert lines and any(line.endswith("xi32>)") for line in lines), name
  check_one_module_per_kernel(txt)


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices (jax_num_cpu_devices=4)")
def test_kernel_tiny_step_lowers_for_cuda_at_tp4():
  """The kernels inside shard_map with TP4-local shapes (1 KDA / MLA head per rank, experts 128 wide). GPU
  interpret mode cannot run this: its check that no barrier outlives a kernel is global over devices, so two
  kernels in one multi-device program trip it (jax 0.11.2) — hence cross-lowering here and a 2-GPU test.
  The FP8 linears and the MoE dequantise the weight in registers (fp8_dq, the default; the quantising
  fp8_linear's kernels cross-lower in test_linear_kernels)."""
  # (with the grid barrier's counters and the split-K counters: jax Refs created inside shard_map; the MoE's
  # rows in f32 there — the all-reduce after it sums f32 partials, as the XLA form's)
  # (and the dq kernels in f16: dq_f16; and policy pdl: every Mosaic kernel starts with griddepcontrol —
  # Programmatic Dependent Launch — which Mosaic marks on the module, ``mosaic_gpu.uses_pdl``, for its launcher;
  # without it, the default, none does: test_kernel_tiny_step_lowers_for_cuda. The knob changes the kernels'
  # modules, not their count. Folded in here: a lowering of its own cost the CPU suite ~19 s; and the indexer's cache update as one
  # launch: indexer_pool_kernel)
  txt = lower_step(C.kernel_tiny(), 3, "latency_specialized", max_context=4096, tp=4,
                   policy=(("mhc", True), ("mhc_barrier_counters", True), ("linear_fused_sum", True),
                           ("dq_f16", True), ("pdl", True), ("indexer_pool_kernel", True)))
  calls = [line for line in txt.splitlines() if "@mosaic_gpu_v2" in line]
  assert calls and all("mosaic_gpu.uses_pdl" in line for line in calls)
  check_one_module_per_kernel(txt)
  for name in ("kda_decode", "glm5_fp8_dq_linear", "glm5_moe_gate_up", "glm5_moe_down", "glm5_sparse_mla",
               "glm5_indexer_scores", "glm5_mhc_post_finish", "glm5_mhc_sinkhorn",  # (mhc_grid_barrier's boundary)
               "glm5_indexer_pool_update"):
    assert name in txt, name
  assert txt.count("all_reduce") == 1 + 2 * 4 + 3 * 2
  dql = [line.split("} : ")[-1].split("->")[0] for line in txt.splitlines()
         if "@mosaic_gpu_v2" in line and "glm5_fp8_dq_linear" in line]
  assert dql and all("xf16>" in d for d in dql), dql  # (x in f16)
  downs = [line.split("->")[-1] for line in txt.splitlines() if "@mosaic_gpu_v2" in line and "glm5_moe_down" in line]
  assert downs and all("xbf16>" not in d for d in downs) and any(re.search(r"tensor<3x\d+xf32>", d) for d in downs)


def _main_args(txt):
  sig = next(line for line in txt.splitlines() if "func.func public @main(" in line)
  return len(re.findall(r"%arg\d+:", sig))


def test_real_geometry_step_lowers_for_cuda():
  """One TP4 rank of GLM-5.3-Flash, q = 4 (3 drafts), 32K context, with packed parameters (glm5_jax.param_packing,
  as bench_decode runs it): ~500 of the parameters under 64 KiB in two buffers (f32, bf16; the KEEP_WHOLE vectors
  stay arguments) — far fewer arguments — and every kernel lowers with sliced operands, once per program (~20 s on
  the CPU). (The one-row mHC boundary's real-width lowering: test_mhc.test_row_boundary_lowers_for_cuda; the
  q = 1 step's kernels: the kernel-tiny lowering at q = 1 and step_census.)"""
  cfg = tp_rank_config(C.real(), 4)
  # (the arguments as traced — before jit drops unused ones — so that the unpacked step need not be lowered too)
  traced = trace_step(cfg, 4, "latency_specialized", pack_params=1 << 16)
  plain = len(trace_step(cfg, 4, "latency_specialized", pack_params=0).jaxpr.in_avals)
  packed = len(traced.jaxpr.in_avals)
  assert plain - packed > 490, (plain, packed)
  txt = traced.lower(lowering_platforms=("cuda",)).as_text()
  assert _main_args(txt) < 1150, _main_args(txt)
  n_calls, n_kernels = check_one_module_per_kernel(txt)
  # 45 layers share their kernels: lowered and compiled once each (the indexer's cache update adds two since session
  # 46: the verify's 4 token rows and the draft's one; W_UV as a kernel one more since session 48)
  assert n_kernels <= 35, (n_calls, n_kernels)
  assert "glm5_indexer_pool_update" in txt
  # the indexer's 8,256 pools (and 4 score rows) fit the one-launch selection (topk_compact_fused, since session 50)
  assert "glm5_topk_compact" in txt and "glm5_topk_threshold" not in txt
  assert "glm5_mla_uv" in txt and "glm5_mla_combine" in txt  # W_UV on the merged O^T (mla_uv_kernel, since s48)
  # (q = 4: 4 token rows — the router kernel builds the MoE's slot tables, router_route; the draft's one row: the
  # selection inside the gate/up kernel, moe_router_in_kernel, the MoE's two kernels as one grid, moe_one_grid)
  assert "glm5_router_route" in txt and "glm5_router_topk" not in txt and "glm5_moe_route" not in txt
  names = {n for n, _, _ in kernel_calls(txt)}  # fp8_dq (the default): the dequantising FP8 kernels only
  assert {"glm5_fp8_dq_linear", "glm5_moe_gate_up", "glm5_moe_down", "glm5_moe_one_grid"} <= names
  assert "glm5_fp8_linear" not in names
  assert txt.count("all_reduce") == 1 + 2 * 45 + 3 * 3  # psums are no-ops on one device but still lowered
  # the one-launch selection fed the scores kernel's f32 output as it is; no kernel marked for PDL (policy pdl off)
  sel = [line for line in txt.splitlines() if "@mosaic_gpu_v2" in line and "glm5_topk_compact" in line]
  assert sel and all(re.search(r"\(tensor<\d+x\d+x\d+xf32>, tensor<\d+xi32>, tensor<\d+xi32>\)", line)
                     for line in sel), sel
  assert "mosaic_gpu.uses_pdl" not in txt


def test_lean_barriers_reaches_the_chains_kernels():
  """Policy knob lean_barriers in the kernel-tiny step at q = 1, traced as the CUDA lowering sees it: it runs at
  the mHC boundaries, the indexer's scores and selection, the sparse MLA and its W_UV, the FP8 GEMVs and the MoE
  (one kernel_enabled per such call site). (That the step's XLA program stays the defaults' — the lean builds
  differ inside their Mosaic kernels only — is scripts/step_digest.py's to show: session 54.)"""
  model, params = abstract_model(C.kernel_tiny(), mesh=shd.make_mesh(1))
  dec = Decoder(model, DecodeConfig(max_context=4096, q=1, capture_sizes=(1,), policy=(("lean_barriers", True),)),
                backend="latency_specialized")
  with dec.kernel_mode(interpret=False):
    dec.trace_step(1, params, interpret=False)
  sites = dec.kernel_sites(1)["lean_barriers"]
  assert sites["sites"] >= 8, sites  # (4 layers' boundaries, their GEMVs, the DSA layer's and MoE kernels)


def test_bf16_balanced_splits_reaches_the_verifys_gemvs():
  """Policy knob bf16_balanced_splits in the kernel-tiny verify step (q = 4, traced as the CUDA lowering sees it):
  it runs at every bf16_linear site — the KDA projections, the indexer's, the router, the lm_head — and nowhere
  else (one kernel_enabled per bf16_linear call)."""
  model, params = abstract_model(C.kernel_tiny(), mesh=shd.make_mesh(1))
  dec = Decoder(model, DecodeConfig(max_context=4096, q=4, capture_sizes=(1,),
                                    policy=(("bf16_balanced_splits", True),)), backend="latency_specialized")
  with dec.kernel_mode(interpret=False):
    dec.trace_step(1, params, interpret=False)
  sites = dec.kernel_sites(1)
  assert sites["bf16_balanced_splits"]["sites"] == sites["bf16_linear"]["sites"] > 8, sites["bf16_linear"]


def test_side_chain_gemvs_take_their_own_counters(monkeypatch):
  """Under linear_fused_sum the side branches' GEMVs (glm5_jax.layers.side_chain: the indexer's projections beside
  the MLA's, the KDA gates' beside the q/k/v GEMV, the dense MLP's up beside gate) sum their K splits on a split-K
  counters Ref of their own — each call on a Ref is ordered after the previous one (the Ref is an aliased
  operand), so on the main chain's Ref they ran after it instead of beside it. Traced at kernel-tiny's verify step
  (q = 4): every bf16 / FP8 GEMV call with counters records its Ref; the side calls' Refs and the main chain's are
  disjoint, one of each per counters scope (the trunk, each MTP pass), the indexer's query projection is a side
  call and of the dense MLPs' gate / up calls half are."""
  from glm5_jax import layers as L
  from pallas_kernels import linear as kl
  calls = []

  def recording(fn):
    def wrapped(x, w, *a, counters=None, **kw):
      if counters is not None:
        calls.append(((fn.__name__, *w.shape), L._SIDE.get(), id(counters)))
      return fn(x, w, *a, counters=counters, **kw)
    return wrapped
  monkeypatch.setattr(kl, "bf16_linear", recording(kl.bf16_linear))
  monkeypatch.setattr(kl, "fp8_dq_linear", recording(kl.fp8_dq_linear))
  cfg = C.kernel_tiny()
  trace_step(cfg, 4, "latency_specialized", max_context=4096, policy=(("linear_fused_sum", True),))
  side = {ref for _, s, ref in calls if s}
  main = {ref for _, s, ref in calls if not s}
  assert side and main and not side & main, calls
  assert len(side) <= len(main), calls  # (a scope without side GEMVs creates no side Ref)
  wq_b = ("bf16_linear", cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank)
  on = [s for shape, s, _ in calls if shape == wq_b]  # (the trunk's DSA layer, then the MTP passes')
  assert len(on) >= 2 and all(on), calls
  gate_up = ("fp8_dq_linear", cfg.intermediate_size, cfg.hidden_size)  # (the dense MLP's: up on the side)
  on = [s for shape, s, _ in calls if shape == gate_up]
  assert len(on) == 4 and sum(on) == 2, calls


def test_moe_one_grid_reaches_the_steps_moe():
  """Policy knob moe_one_grid (on by default) in the kernel-tiny step at q = 1 as the CUDA lowering sees it: both
  MoE layers take it (test_kernel_tiny_step_lowers_for_cuda: their calls on alternating counter banks — two
  modules — and no glm5_moe_down launch left); off, neither does. mhc_row_scalars and mhc_ll_exchange likewise at
  every one-row boundary, and kda_o_grid (the recurrence and o_proj as one grid, on the step's counters) and
  kda_qkv_kernel (the q/k/v GEMV's bf16 kernel at one row) at every KDA layer; mla_gather_warpgroup (on by default)
  at none (one block of positions a CTA), with its reason. And moe_h_rows at q = 4 (with the
  knobs linear_part_rows, mla_dequant_warpgroups, mla_scales_after, mla_group_arrival and mla_q_in_kernel: where
  they reach)."""
  model, params = abstract_model(C.kernel_tiny(), mesh=shd.make_mesh(1))
  ones = {}
  for on in (True, False):
    dec = Decoder(model, DecodeConfig(max_context=4096, q=1, capture_sizes=(1,),
                                      policy=(("moe_one_grid", on), ("mhc_row_scalars", on), ("kda_o_grid", on),
                                              ("mhc_ll_exchange", on), ("kda_qkv_kernel", on),
                                              ("kda_fg_b_kernel", on), ("indexer_wq_kernel", on))),
                  backend="latency_specialized")
    with dec.kernel_mode(interpret=False):
      dec.trace_step(1, params, interpret=False)
    sites = dec.kernel_sites(1)
    assert sites["moe_one_grid"]["sites"] == (2 if on else 0)
    # and mhc_row_scalars (off by default): every one-row boundary of the q = 1 step
    want = sites["mhc_row"]["sites"] if on else 0
    assert (want > 0 or not on) and sites["mhc_row_scalars"]["sites"] == want, sites
    # mhc_ll_exchange (on since session 71) likewise: every one-row boundary's partial sums by the low-latency exchange
    assert sites["mhc_ll_exchange"]["sites"] == want, sites
    want = sites["kda"]["sites"] if on else 0
    assert (want > 0 or not on) and sites["kda_o_grid"]["sites"] == want, sites
    # kda_qkv_kernel (off by default): every KDA layer's q/k/v GEMV through the bf16 kernel at one row
    assert sites["kda_qkv_kernel"]["sites"] == want, sites
    # kda_fg_b_kernel (off by default): every KDA layer's gates' fg_b GEMV likewise
    assert sites["kda_fg_b_kernel"]["sites"] == want, sites
    # indexer_wq_kernel (off by default): every indexer query projection (one per scores call: the trunk's DSA layer
    # and the MTP passes that select their own pools)
    want = sites["indexer"]["sites"] if on else 0
    assert (want > 0 or not on) and sites["indexer_wq_kernel"]["sites"] == want, sites
    # mla_gather_warpgroup (on by default): at no sparse MLA call of one sequence's step — each CTA runs one block
    # of positions there — and it says why (a policy naming it would be refused: test_decode's explicit-knob test)
    rep = sites["mla_gather_warpgroup"]
    assert rep["sites"] == 0 and rep["not_used"], rep
    assert all("nothing to overlap" in w for w in rep["not_used"]), rep
    ones[on] = sites["bf16_linear"]["sites"]
  # (the other one-row sites stay XLA's)
  assert ones[True] == ones[False] + 2 * sites["kda"]["sites"] + sites["indexer"]["sites"], ones
  # policy knob moe_h_rows (on since session 61): the 4-row MoE calls (the trunk's 2 and the MTP layer's over the verified rows;
  # 17 slots x 8 tiles fill the SMs: one D split) write h's rows in their gate/up kernel (the draft's one-row calls
  # select in the kernel: their own rows form, the one grid)
  # and linear_part_rows (off by default): every 4-row weight-streaming site that XLA sums (the KDA, DSA and dense
  # linears, the 4-row MoE calls' down kernels, the router logits, the head); not the draft's one-row calls
  dec = Decoder(model, DecodeConfig(max_context=4096, q=4, capture_sizes=(1,),
                                    policy=(("moe_h_rows", True), ("linear_part_rows", True),
                                            ("mla_dequant_warpgroups", True), ("mla_scales_after", True),
                                            ("mla_group_arrival", True), ("mla_q_in_kernel", True))),
                backend="latency_specialized")
  with dec.kernel_mode(interpret=False):
    dec.trace_step(1, params, interpret=False)
  sites = dec.kernel_sites(1)
  rep = sites["moe_h_rows"]
  assert rep["sites"] == 3 and not rep["not_used"], rep
  rep = sites["linear_part_rows"]
  assert rep["sites"] >= 10 and all("token rows (2 to 8" in why for why in rep["not_used"]), rep
  # and mla_dequant_warpgroups, mla_group_arrival, mla_q_in_kernel (off by default), mla_scales_after (on): every
  # sparse MLA call, the verify's and the draft's
  for knob in ("mla_dequant_warpgroups", "mla_scales_after", "mla_group_arrival", "mla_q_in_kernel"):
    rep = sites[knob]
    assert rep["sites"] == sites["sparse_mla"]["sites"] > 0 and not rep["not_used"], (knob, rep)


def test_kda_fg_b_kernel_follows_the_qkv_kernel_on_its_ref(monkeypatch):
  """Policy kda_fg_b_kernel with kda_qkv_kernel in the kernel-tiny step at q = 1: every KDA layer's fg_b GEMV is the
  bf16 kernel on the MAIN chain's counters Ref, the call right after that layer's q/k/v kernel on the same Ref (an
  aliased operand of both: fg_b runs after the q/k/v kernel, not beside it — session 75's trace), while the
  indexer's wq_b (indexer_wq_kernel) stays on a side chain's Ref of its own."""
  from glm5_jax import layers as L
  from pallas_kernels import linear as kl
  calls = []

  def recording(x, w, *a, counters=None, **kw):
    if counters is not None:
      calls.append((w.shape, L._SIDE.get(), id(counters)))
    return bf16_linear(x, w, *a, counters=counters, **kw)
  bf16_linear = kl.bf16_linear
  monkeypatch.setattr(kl, "bf16_linear", recording)
  cfg = C.kernel_tiny()
  trace_step(cfg, 1, "latency_specialized", max_context=4096,
             policy=(("kda_qkv_kernel", True), ("kda_fg_b_kernel", True), ("indexer_wq_kernel", True)))
  C_loc = cfg.linear_num_heads * cfg.linear_head_dim
  qkv, fg_b = (3 * C_loc, cfg.hidden_size), (2 * C_loc, 2 * cfg.kda_gate_rank)
  wq_b = (cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank)
  kda = [i for i, (shape, _, _) in enumerate(calls) if shape == qkv]
  assert len(kda) == cfg.layer_types.count(C.KDA) > 0, calls
  for i in kda:  # the q/k/v call, then the same layer's fg_b on the same (main) Ref, no call on it in between
    j = next(j for j in range(i + 1, len(calls)) if calls[j][2] == calls[i][2])
    assert calls[i][1] is False and calls[j][:2] == (fg_b, False), (i, j, calls)
  # (kernel-tiny's wq_b has fg_b's shape: [1024, 256]) the side chain's calls are the indexer's, on their own Ref
  side = [(shape, ref) for shape, s, ref in calls if s]
  assert side and all(shape == wq_b for shape, _ in side), calls
  assert not {r for _, r in side} & {calls[i][2] for i in kda}, calls
  assert sum(not s and shape == fg_b for shape, s, _ in calls) == len(kda), calls


@pytest.mark.parametrize("knob", ["kda_qkv_kernel", "kda_fg_b_kernel", "indexer_wq_kernel"])
def test_one_row_knob_sums_its_splits_on_the_counters(knob):
  """Policy kda_qkv_kernel / kda_fg_b_kernel / indexer_wq_kernel in the kernel-tiny step at q = 1 as the CUDA
  lowering sees it: the site's bf16 GEMV kernel (the KDA q/k/v or fg_b, the indexer's wq_b) takes the step's
  counters Ref (its K splits summed inside) — no bf16 GEMV does by default (their sites:
  test_moe_one_grid_reaches_the_steps_moe)."""
  from pallas_kernels import linear as kl  # noqa: PLC0415
  txt = lower_step(C.kernel_tiny(), 1, "latency_specialized", max_context=4096, policy=((knob, True),))
  # (the layers' identical calls share one lowered function: at least one such call)
  assert any("bf16_linear" in n and f"tensor<{kl.SPLITK_COUNTERS}xi32>" in types for n, types, _ in kernel_calls(txt))


def _census(tmp_path, *args):
  """benchmarks/step_census.py on the kernel-tiny step (one step per call) in a subprocess — the CUDA PJRT plugin
  must load before jax starts a backend — -> (its JSON row, the compiled program's kernel listing lines); skips
  without the plugin (scripts/test.sh installs it into .cuda_plugin)."""
  import json  # noqa: PLC0415
  import os  # noqa: PLC0415
  import subprocess  # noqa: PLC0415
  import sys  # noqa: PLC0415
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  if not os.path.isdir(os.path.join(root, ".cuda_plugin", "jax_plugins")):
    pytest.skip("no CUDA PJRT plugin in .cuda_plugin (scripts/test.sh installs it; see benchmarks/step_census.py)")
  out = tmp_path / "census.jsonl"
  r = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "step_census.py"), "--geometry", "kernel-tiny",
                      "--steps-per-call", "1", "--listing-dir", str(tmp_path), "--out", str(out), "--workers", "1",
                      *args], capture_output=True, text=True, timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert r.returncode == 0, r.stderr[-3000:]
  return json.loads(out.read_text()), next(tmp_path.glob("*.kernels.tsv")).read_text().splitlines(), r.stderr


def test_ptx_census_sees_the_hardware_conversion():
  """benchmarks/ptx_census.py (compile-only PTX and ptxas on the CPU, in a subprocess: the CUDA PJRT plugin loads
  before jax starts a backend): the sparse MLA with its scales after the MMAs (policy mla_scales_after) converts
  the FP8 latent with e4m3x2 -> f16x2 instructions and is shorter than the default form, which has none; nothing
  spills."""
  import os  # noqa: PLC0415
  import subprocess  # noqa: PLC0415
  import sys  # noqa: PLC0415
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  if not os.path.isdir(os.path.join(root, ".cuda_plugin", "jax_plugins")):
    pytest.skip("no CUDA PJRT plugin in .cuda_plugin (scripts/test.sh installs it; see benchmarks/step_census.py)")
  r = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "ptx_census.py"), "--cases", "mla_1x1,mlas_1x1"],
                     capture_output=True, text=True, timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert r.returncode == 0, r.stderr[-3000:]
  rows = {}
  for ln in r.stdout.splitlines():
    cells = [c.strip() for c in ln.strip("|").split("|")]
    if len(cells) == 9 and "sparse_mla" in cells[1]:
      rows[cells[0]] = (int(cells[2].replace(",", "")), int(cells[4]), int(cells[5]))
  assert set(rows) == {"mla_1x1", "mlas_1x1"}, r.stdout
  (base, base_spill, base_cvt), (after, after_spill, after_cvt) = rows["mla_1x1"], rows["mlas_1x1"]
  assert base_cvt == 0 and after_cvt > 0 and after < base and base_spill == after_spill == 0, rows


def test_kernel_tiny_step_compiles_for_blackwell(tmp_path):
  """The kernel-tiny step at q = 1 compiled for a B200 (sm_100a: Mosaic GPU and ptxas, compile-only, on this CPU):
  the wgmma kernels — which ptxas refuses for Blackwell — are declined at every site with the reason, said once as
  a warning; the kernels without wgmma (the one-row mHC boundary, the Sinkhorn, the KDA recurrence, the router's
  and the indexer's selection) compile for it and run in the step, and so does the FP8 GEMV in its tcgen05 form,
  the indexer's cache update (its rotation one tcgen05 MMA), the sparse MLA with W_UV and the MoE's kernels
  (layers.TCGEN05_KNOBS: Mosaic's layout inference places their tensor-memory accumulators for sm_100 —
  step_census.py tells it the target). Before session 57 this compile failed."""
  from glm5_jax.layers import TCGEN05_KNOBS, WGMMA_KNOBS  # noqa: PLC0415
  import os  # noqa: PLC0415
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  row, listing, err = _census(tmp_path, "--target", os.path.join(root, "benchmarks", "targets", "b200.txtpb"))
  assert row["target"] == "b200.txtpb" and "latency_specialized on sm_100" in err
  for knob in set(WGMMA_KNOBS) - set(TCGEN05_KNOBS):
    assert row["kernel_sites"].get(knob, 0) == 0, (knob, row["kernel_sites"])
  # (bf16_linear: XLA at one token row)
  assert row["kernel_sites"]["fp8_linear"] > 0 and row["kernel_sites"]["fp8_moe"] > 0, row["kernel_sites"]
  assert row["kernel_sites"]["indexer_pool_kernel"] > 0, row["kernel_sites"]  # (its tcgen05 form, session 65)
  text = "\n".join(listing)
  for name in ("glm5_mhc_row_boundary", "glm5_mhc_sinkhorn", "kda_decode", "glm5_fp8_dq_linear", "glm5_moe_gate_up",
               "glm5_moe_down", "glm5_indexer_pool_update", "glm5_sparse_mla", "glm5_mla_uv"):
    assert name in text, name
  assert row["kernel_sites"]["mhc"] > 0 and row["kernel_sites"]["kda"] > 0


def test_blackwell_declines_the_wgmma_kernels(model_tiny_sm100):
  """On a GPU without wgmma (the platform patched to sm_100): a policy that asks for a wgmma kernel is refused
  before anything is traced, naming it and why (and on a GPU without Mosaic GPU, sm_80, the backend
  itself); the defaults trace with those kernels declined at every site
  (the reason in kernel_sites) and the mHC boundary of several token rows (q = 4: its logits are a wgmma) too,
  while the KDA kernel and the tcgen05 forms of the GEMVs, the MoE and the sparse MLA with W_UV run — and with
  policy knob mhc_rows the
  boundaries of 4 rows run in the row form; fp8_dq off (the FP8 kernels' hi/lo form: wgmma) is refused there."""
  from glm5_jax.layers import TCGEN05_KNOBS, WGMMA_KNOBS  # noqa: PLC0415
  model, params = model_tiny_sm100
  import glm5_jax.speculative as sp  # noqa: PLC0415
  with pytest.MonkeyPatch.context() as mp:  # (an A100 has neither wgmma nor the TMA the other kernels use)
    mp.setattr(sp, "detect_platform", lambda devices: "sm_80")
    with pytest.raises(ValueError, match=r"need one of \('sm_90', 'sm_100', 'sm_103'\).*this mesh is sm_80"):
      Decoder(model, DecodeConfig(max_context=4096, q=4, capture_sizes=(1,), policy=()), backend="latency_specialized")
    Decoder(model, DecodeConfig(max_context=4096, q=4, capture_sizes=(1,), policy=()), backend="auto")
  cfg = DecodeConfig(max_context=4096, q=4, capture_sizes=(1,), policy=(("moe_one_grid", True),))
  with pytest.raises(ValueError, match=r"\['moe_one_grid'\]: each needs Hopper's wgmma \(sm_90a\), which sm_100"):
    Decoder(model, cfg, backend="latency_specialized")
  with pytest.raises(ValueError, match=r"turns on \['fp8_moe'\] with fp8_dq off: on sm_100 the FP8 kernels .* turn "
                     r"fp8_dq on, or \['fp8_moe'\] off"):
    Decoder(model, DecodeConfig(max_context=4096, q=4, capture_sizes=(1,), policy=(("fp8_dq", False),
                                                                                   ("fp8_moe", True))),
            backend="latency_specialized")
  with pytest.warns(UserWarning, match=r"on sm_100: kernel\(s\) \['kda_o_grid', 'moe_one_grid'\] run as XLA"):
    dec = Decoder(model, DecodeConfig(max_context=4096, q=4, capture_sizes=(1,), policy=()),
                  backend="latency_specialized")
  with dec.kernel_mode(interpret=False):
    dec.trace_step(1, params, interpret=False)
  sites = dec.kernel_sites(1)
  from glm5_jax.layers import KERNEL_DEFAULTS  # noqa: PLC0415
  for knob in (set(WGMMA_KNOBS) - set(TCGEN05_KNOBS)) & set(sites):  # (an off-by-default knob: off in the policy)
    assert not sites[knob]["sites"] and all("wgmma" in r or (r == "off in the policy" and not KERNEL_DEFAULTS[knob])
                                            for r in sites[knob]["not_used"]), (knob, sites[knob])
  assert {"sparse_mla", "indexer"} <= set(sites)
  # the kernels with a tcgen05 form run in it (q = 4: bf16_linear too, XLA being preferred only at one row) — but
  # the indexer's scores: kernel-tiny's 8 index heads are not a multiple of the tcgen05 form's 16 (and the
  # compaction, topk_compact_kernel, reads the scores kernel's output: declined with it)
  # (moe_prefill, mla_prefill, topk_prefill, indexer_prefill: prefill kernels — no decode site where the decode
  # kernels run; moe_prefill's tcgen05 form in test_moe_prefill.py, the others' are sparse_mla's, topk_compact's and
  # the scores kernel's, test_indexer.py's)
  for knob in set(TCGEN05_KNOBS) - {"indexer", "topk_compact_kernel", "moe_prefill", "mla_prefill", "topk_prefill",
                                    "indexer_prefill"}:
    assert sites[knob]["sites"] > 0, (knob, sites[knob])
  assert not sites["indexer"]["sites"] and "multiple of 16" in next(iter(sites["indexer"]["not_used"]))
  assert not sites["mhc"]["sites"] and "one token row (here 4;" in next(iter(sites["mhc"]["not_used"]))
  assert sites["kda"]["sites"] > 0
  # policy knob mhc_rows: the row form at the verify's 4 token rows (no wgmma) — the boundaries run as kernels
  with pytest.warns(UserWarning, match="latency_specialized on sm_100"):
    dec = Decoder(model, DecodeConfig(max_context=4096, q=4, capture_sizes=(1,), policy=(("mhc_rows", True),)),
                  backend="latency_specialized")
  with dec.kernel_mode(interpret=False):
    dec.trace_step(1, params, interpret=False)
  sites = dec.kernel_sites(1)
  assert sites["mhc"]["sites"] > 0 and sites["mhc_rows"]["sites"] > 0 and sites["mhc_row"]["sites"] > 0, sites


@pytest.fixture
def model_tiny_sm100(monkeypatch):
  import glm5_jax.speculative as sp  # noqa: PLC0415
  monkeypatch.setattr(sp, "detect_platform", lambda devices: "sm_100")
  return abstract_model(C.kernel_tiny(), mesh=shd.make_mesh(1))


def test_step_digest_ignores_locations_and_kernel_payloads():
  """scripts/step_digest.py's normalisation: two lowerings that differ only in source locations and a Mosaic call's
  serialized module / kernel hash (file paths, line numbers) digest alike; an operand type that differs does not."""
  import importlib.util  # noqa: PLC0415
  import os  # noqa: PLC0415
  path = os.path.join(os.path.dirname(__file__), "..", "scripts", "step_digest.py")
  spec = importlib.util.spec_from_file_location("step_digest", path)
  sd = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(sd)
  call = ('%1 = stablehlo.custom_call @mosaic_gpu_v2(%0) {{mhlo.backend_config = {{kernel_hash = "{h}", '
          'module = "ML\\EFR{m}"}}}} : (tensor<{t}>) -> tensor<4xf32> loc(#loc7)\n#loc7 = loc("{f}":{n}:3)\n')
  a = call.format(h="\\22\\D9", m="/a/linear.py\\00", t="1x512xbf16", f="/a/x.py", n=10)
  b = call.format(h="\\01\\02", m="/b/linear.py\\00\\01", t="1x512xbf16", f="/b/x.py", n=99)
  c = call.format(h="\\22\\D9", m="/a/linear.py\\00", t="1x512xf16", f="/a/x.py", n=10)
  assert sd.normalised_text(a) == sd.normalised_text(b)
  assert sd.normalised_text(a) != sd.normalised_text(c)
