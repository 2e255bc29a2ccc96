# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Where a decode step's time goes
#
# The model labels its parts with `jax.named_scope` (embed, mhc, kda, dsa, indexer, router, moe, mlp, lm_head,
# draft). XLA keeps those scopes in the compiled program, so `glm5_jax.profiling` can (1) count the kernels a
# compiled step launches, per component, and (2) attribute measured GPU kernel times to components
# (`benchmarks/bench_decode.py --profile` records them with CUPTI on a GPU).
#
# Here: the census of the tiny model's stock step on this machine, the census of the real geometry's
# latency_specialized step as compiled on an H200, and the measured split of both backends' steps there
# (`benchmarks/results/decode_h200.jsonl`).

# %%
import json
import os

import matplotlib.pyplot as plt

import glm5_jax
from checkpoints.make_tiny import builtin_checkpoint
from glm5_jax import profiling
from glm5_jax.runtime import DecodeConfig
from glm5_jax.speculative import Decoder

model = glm5_jax.load_model(builtin_checkpoint("kernel-tiny"), dtype="float32")
census = {}
dec = Decoder(model, DecodeConfig(max_context=256, q=2, capture_sizes=(1,), policy=()), backend="auto")
census["auto"] = profiling.census(dec.trace_step(1).lower().compile().as_text())
print("auto:", census["auto"]["kernels"], "kernel-level instructions:", census["auto"]["by_kind"])

# On a CPU the Pallas kernels would run in the GPU interpreter (each one many host callbacks): a
# latency_specialized census compiled here is not the GPU's. The one the H200 compiled (one TP4 rank, B = 1):
h200 = [json.loads(line) for line in open(os.path.join("..", "benchmarks", "results", "decode_h200.jsonl"))]
for q in (1, 4):
  last = [r for r in h200 if r["backend"] == "latency_specialized" and r["batch"] == 1 and r["q"] == q
          and r.get("census") and r.get("steps_per_call", 1) == 1][-1]  # (one step per call: one step's census)
  print(f"latency_specialized on the H200, q = {q} ({last['date']}):", last["census"]["kernels"],
        "kernel-level instructions", last["census"]["by_component"])

# %% [markdown]
# The tiny stock step's census by component:

# %%
comps = [c for c in profiling.COMPONENTS if census["auto"]["by_component"].get(c)]
plt.figure(figsize=(8, 3))
plt.bar(comps, [census["auto"]["by_component"][c] for c in comps])
plt.ylabel("kernel-level instructions")
plt.title("kernel-tiny stock step (q = 2), compiled on this machine")
plt.xticks(rotation=30)
plt.tight_layout()

# %% [markdown]
# ## The real geometry on an H200
#
# One TP4 rank's share of GLM-5.3-Flash (45 layers + MTP, 82 GB of random weights, 32K context), B = 1, both
# backends (`benchmarks/results/decode_h200.jsonl`, the last 10 profiled runs). Bars: GPU time per component;
# black: the wall-clock step; dotted: when the chained calls had returned on the host (close to the wall time =
# the step is host-bound, as it was at q = 1 until small parameters were packed in session 20; in session 25 wall
# time was GPU time + ~0.1 ms — 5.49 ms wall for 5.37 ms of GPU); red: the HBM roofline. Since session 26 the
# step compiles with XLA's CONCURRENT command-buffer schedule on a GPU: kernels overlap, so the bars (the sum of
# kernel durations) can exceed the wall time, and the host's time per step came close to the wall again (3.9 ms
# of 4.56 at q = 1).

# %%
path = os.path.join("..", "benchmarks", "results", "decode_h200.jsonl")
rows_all = [json.loads(line) for line in open(path) if line.strip()]
rows = [r for r in rows_all if r.get("profile")][-10:]
fig, ax = plt.subplots(figsize=(9, 1 + 0.55 * len(rows)))
for i, r in enumerate(rows):
  us, left = r["profile"]["us_per_step"], 0.0
  for j, c in enumerate(profiling.COMPONENTS):
    if us.get(c):
      ax.barh(i, us[c] / 1e3, left=left, color=plt.cm.tab20(j), label=c if i == 0 else None)
      left += us[c] / 1e3
  ax.plot([r["ms_per_step"]] * 2, [i - 0.4, i + 0.4], "k-", lw=2)
  if r.get("host_ms_per_step"):
    ax.plot([r["host_ms_per_step"]] * 2, [i - 0.4, i + 0.4], color="0.5", ls=":", lw=2)
  ax.plot([r["roofline_ms"]] * 2, [i - 0.45, i + 0.45], "r--", lw=1.5)
  print(f"{r['backend']} B={r['batch']} q={r['q']} {r.get('policy') or ''}: {r['ms_per_step']:.2f} ms/step, GPU "
        f"busy {r['profile']['gpu_busy_ms']:.2f} ms in {r['profile']['launches_per_step']:.0f} launches "
        f"({r.get('note', '')})")
sched = lambda r: (r.get("compiler_options") or {}).get("xla_gpu_command_buffer_scheduling_mode", "")  # noqa: E731
ax.set_yticks(range(len(rows)), [f"{r['backend']} B={r['batch']} q={r['q']} {r.get('date', '')} {sched(r)} "
                                 f"{r.get('policy') or ''}" for r in rows], fontsize=7)
ax.set_xlabel("ms per decode step")
ax.legend(fontsize=7, ncol=6, loc="upper center", bbox_to_anchor=(0.5, -0.2))
fig.tight_layout()

# %% [markdown]
# ## One sublayer of each kind, kernel by kernel
#
# The profile above sums kernel durations per component; under XLA's concurrent command-buffer schedule kernels
# overlap, so what sets the step's length is each sublayer's chain. `benchmarks/sublayer_chain.py` splits a saved
# GPU trace of the chained steps (`bench_decode.py --trace --hlo-dir DIR`) at the mHC boundaries and shows the
# median sublayer of each kind: here session 70's defaults at B = 1, q = 1 on an H100, the first 32 layers (s69a's
# trace, `benchmarks/results/trace_h100_session70_q1_spc4_defaults.*`; no H200 was lent that session). Each
# sublayer starts with the ~4.7 µs boundary; the one-grid MoE streams ~57 MB of FP8 weights (floor ~13 µs at the
# H200's 4.3 TB/s, ~21.5 µs at the ~2.6 TB/s an H100's TMA stream reaches: `benchmarks/bench_stream.py`), a KDA
# layer's GEMVs ~69 MB of bf16, a DSA layer's ~48 MB (`../shared/notes/roofline.py`'s ledger) — the rest is
# latency: launches in series, and the DSA layer's selection chain (indexer query → scores → top-512 compaction → sparse MLA).

# %%
import sys

sys.path.insert(0, os.path.join("..", "benchmarks"))
import sublayer_chain as sc  # noqa: E402

trace = os.path.join("..", "benchmarks", "results", "trace_h100_session70_q1_spc4_defaults")
kmap = sc.kernel_labels(kernels=trace + ".kernels.tsv.gz")
kinds = sc.by_kind(sc.read_events(trace + ".events.tsv.gz"))
for kind, chains in kinds.items():
  length, rows = sc.median_chain(chains)
  print(f"{kind}: {len(chains)} sublayers in the trace, the median {length:.1f} µs in {len(rows)} kernels")
sc.plot_chains(kinds, kmap, "one TP4 rank's first 32 layers, B = 1, q = 1, session 70's defaults (H100)");

# %% [markdown]
# ### The verify step (q = 4)
#
# Speculative decoding runs the trunk over 1 + k = 4 tokens a step; session 71 traced that step with the defaults
# (s71a, the same H100 kind; 6.26 ms a step against 2.8 at q = 1). Half of it is the MoE: four tokens route to ~31
# distinct experts of 288 with random weights, ~200 MB of FP8 a layer, streamed by the rows form's two kernels at
# ~2.5 TB/s (the stream's ceiling on an H100). Around it the several-row sites' launches: the grid form of the
# boundary (8.8 µs vs the one-row form's 4.3), the router's GEMV, its split sum and `router_route` (11.5 µs before
# the experts start), the K-split sums XLA adds after each weight-streaming kernel. The last table says which kernel
# each next boundary waited for.

# %%
trace4 = os.path.join("..", "benchmarks", "results", "trace_h100_session71_q4_spc4_defaults")
kmap4 = sc.kernel_labels(kernels=trace4 + ".kernels.tsv.gz")
kinds4 = sc.by_kind(sc.read_events(trace4 + ".events.tsv.gz"))
for kind, chains in kinds4.items():
  length, rows = sc.median_chain(chains)
  last = ", ".join(f"{n} ({c})" for n, c, _ in sc.last_arrivals(chains, kmap4)[:2])
  print(f"{kind}: {len(chains)} sublayers, the median {length:.1f} µs in {len(rows)} kernels; last to end: {last}")
sc.plot_chains(kinds4, kmap4, "the verify step: q = 4, one TP4 rank's first 32 layers, B = 1 (H100, session 71)");

# %% [markdown]
# ## Launching the step's CUDA graph: host time
#
# `benchmarks/bench_graph_launch.py` on the H200 (`benchmarks/results/graph_launch_h200.jsonl`): a synthetic
# program of ~2,400 small kernels, chained over calls with a donated state, launches as one CUDA graph in under
# half a millisecond of host time — wall time equals GPU time. In session 19 making every 7th kernel a Pallas
# Mosaic GPU call (171 calls) cost ~2 ms more host time per call (read then as ~12.7 µs per Mosaic call); session
# 25 measured the same program at 0.71 ms of host time for 4.10 ms of GPU, also under XLA's command-buffer update
# modes SKIP_TEMP / SKIP_PROFILED, and a VLOG showed no re-recording after the first call: Mosaic calls in the
# graph do not limit the step. (The real step was host-bound in session 19 through its 1,855 arguments, since
# packed.)

# %%
path = os.path.join("..", "benchmarks", "results", "graph_launch_h200.jsonl")
runs = [json.loads(line) for line in open(path) if line.strip()]
runs = [r for r in runs if r["variant"] == "one executable"]


def n_mosaic(r):  # Mosaic calls in the program: every mosaic_every-th of its steps
  return len(range(r["mosaic_every"] - 1, r["steps"], r["mosaic_every"])) if r["mosaic_every"] else 0


fig, ax = plt.subplots(figsize=(8, 0.5 + 0.45 * len(runs)))
y = list(range(len(runs)))
ax.barh([i - 0.2 for i in y], [r["host_ms"] for r in runs], height=0.4, label="host ms per call")
ax.barh([i + 0.2 for i in y], [r["gpu_ms"] for r in runs], height=0.4, label="GPU ms per call")
flags = {"": "default", "--xla_gpu_enable_command_buffer=": "no CUDA graph",
         "--xla_gpu_enable_command_buffer=-CUSTOM_CALL": "custom calls outside the graph",
         "--xla_gpu_command_buffer_update_mode=SKIP_TEMP": "update mode SKIP_TEMP",
         "--xla_gpu_command_buffer_update_mode=SKIP_PROFILED": "update mode SKIP_PROFILED"}
ax.set_yticks(y, [f"{n_mosaic(r)} Mosaic calls, {flags.get(r['xla_flags'], r['xla_flags'])}" for r in runs],
              fontsize=8)
ax.set_xlabel("ms per call (2,230-2,401 kernels each)")
ax.legend(fontsize=8)
fig.tight_layout()
for r in runs:  # against the program without Mosaic calls measured in the same process
  base = [b["host_ms"] for b in runs if not n_mosaic(b) and not b["xla_flags"] and b.get("call") == r.get("call")]
  if n_mosaic(r) and not r["xla_flags"] and base:
    extra = r["host_ms"] - base[0]
    print(f"{n_mosaic(r)} Mosaic calls: +{extra:.2f} ms of host time per call = "
          f"{1e3 * extra / n_mosaic(r):.1f} µs per Mosaic call")

# %% [markdown]
# ## Several speculative steps per call
#
# At B = 1 the host's launch of the step's CUDA graph (~2 µs per graph node) took longer than the GPU's work.
# `Decoder(steps_per_call=n)` runs n speculative steps in one call — a device-side loop that XLA keeps inside the
# CUDA graph (its WHILE command) — so the host launches once per n steps. Session 29 on one H200 (one TP4 rank,
# q = 1, configurations interleaved in one process, `bench_decode.py --steps-per-call 1 4 8 --interleave`):
# wall time per speculative step (bars) and when the chained calls had returned on the host (dots). Once the host
# returns well before the GPU is done, the GPU sets the pace.

# %%
sp = [r for r in rows_all if r.get("interleaved") and r["batch"] == 1 and r["q"] == 1 and r.get("steps_per_call")]
fig, ax = plt.subplots(figsize=(8, 0.6 + 0.4 * len(sp)))
for i, r in enumerate(sp):
  ax.barh(i, r["ms_per_step"], color="tab:blue" if r["steps_per_call"] > 1 else "0.6")
  ax.plot(r["host_ms_per_step"], i, "ko")
  print(f"{r['steps_per_call']} step(s)/call, pack_params={r.get('pack_params')}: {r['ms_per_step']:.2f} ms/step, "
        f"the calls returned after {r['host_ms_per_step']:.2f} ms/step ({r.get('date', '')})")
if sp:
  ax.axvline(sp[0]["roofline_ms"], color="r", ls="--", lw=1.5)  # (the HBM roofline)
ax.set_yticks(range(len(sp)), [f"{r['steps_per_call']} step(s)/call, {'packed' if r.get('pack_params') else 'unpacked'}"
                               f" params ({r.get('date', '')})" for r in sp], fontsize=8)
ax.set_xlabel("ms per speculative step (dots: the host's share)")
fig.tight_layout()

# %% [markdown]
# ## Which kernels run where
#
# `Decoder.kernel_sites()` records, while the step is traced, every call site where a kernel of the
# latency_specialized backend could run: whether it does, and why not. Tracing needs no weights and no GPU:
# abstract parameters of one TP4 rank of the real model are enough (`glm5-jax check-deployment --kernels` prints
# the same). The fused mHC boundary (policy knob `mhc`, on by default) is one decision for the whole trunk: its
# one site stands for all 90 boundaries; `mhc_finish` (the boundary's last step as a kernel) is decided at each
# boundary.

# %%
from glm5_jax import config as C
from glm5_jax.synthetic import abstract_model, tp_rank_config

rank, params = abstract_model(tp_rank_config(C.real(), 4))
sites = {}
for label, policy in (("default", ()), ("mhc_finish off", (("mhc_finish", False),))):
  dec = Decoder(rank, DecodeConfig(max_context=32768, q=4, capture_sizes=(1,), policy=policy),
                backend="latency_specialized")
  with dec.kernel_mode(interpret=False):
    dec.trace_step(1, params, interpret=False)
  sites[label] = dec.kernel_sites(1)
names = sorted(set().union(*sites.values()))
plt.figure(figsize=(8, 3))
for j, label in enumerate(sites):
  plt.bar([i + 0.4 * j for i in range(len(names))], [sites[label].get(n, {"sites": 0})["sites"] for n in names], width=0.4,
          label=label)
plt.xticks([i + 0.2 for i in range(len(names))], names, rotation=30)
plt.ylabel("call sites running the kernel")
plt.title("one TP4 rank, q = 4 (verify + 3 drafts)")
plt.legend()
plt.tight_layout()
for n in names:
  print(f"{n:<12}", {k: v.get(n, {"sites": 0})["sites"] for k, v in sites.items()}, sites["default"].get(n, {}).get("not_used") or "")
