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
# # Acceptance against k, and step time against batch and q
#
# The tiny checkpoints have random weights, so their MTP layer guesses at chance. To see how the step turns draft
# quality into tokens per step we inject drafts from a simulated drafter that is right with probability p per
# token (the truth comes from the reference continuation) and let the real step verify them. With independent
# per-token accuracy p the expected tokens per step is (1 − p^(k+1)) / (1 − p).

# %%
import matplotlib.pyplot as plt
import numpy as np
import jax

import glm5_jax
from checkpoints.make_tiny import builtin_checkpoint

model = glm5_jax.load_model(builtin_checkpoint("oracle-tiny"), dtype="float32")
V = model.cfg.vocab_size
rng = np.random.default_rng(0)
prompt = rng.integers(0, V, 10)
N = 90
cache = glm5_jax.init_cache(model, 1, 128)
out, cache = glm5_jax.extend(model, cache, prompt[None])
ref = [int(np.argmax(out["logits"][0, -1]))]
for _ in range(N):
  o, cache = glm5_jax.extend(model, cache, np.array([[ref[-1]]]))
  ref.append(int(np.argmax(o["logits"][0, -1])))

# %%
decoders = {}


def tokens_per_step(k, p, steps=8):
  if k not in decoders:  # one compiled step per k, reused for every p
    decoders[k] = glm5_jax.Decoder(model, glm5_jax.DecodeConfig(max_context=128, q=k + 1, capture_sizes=(1,),
                                                                policy=()), prefill_chunk=16)
  dec = decoders[k]
  state = dec.prefill([prompt])
  done, emitted = 1, []
  for _ in range(steps):
    toks = np.array(state.next_tokens)
    truth = ref[done:done + k]
    for j in range(k):  # right with probability p, else a wrong token
      toks[0, 1 + j] = truth[j] if rng.random() < p else (truth[j] + 1 + rng.integers(0, V - 1)) % V
    state, step = glm5_jax.decode(state, toks)
    n = int(step.counts[0])
    assert np.asarray(step.tokens[0, :n]).tolist() == ref[done:done + n]  # never changes the greedy output
    done += n
    emitted.append(n)
  return float(np.mean(emitted))

ks, ps = [1, 3], [0.5, 0.8, 0.95]
meas = {p: [tokens_per_step(k, p) for k in ks] for p in ps}

# %%
fig, ax = plt.subplots(figsize=(6, 3.5))
kk = np.arange(0, 8)
for p in ps:
  ax.plot(kk, (1 - p ** (kk + 1)) / (1 - p), "--", alpha=0.6)
  ax.plot(ks, meas[p], "o", label=f"p = {p} (measured)")
ax.set_xlabel("draft tokens per step k")
ax.set_ylabel("tokens emitted per step")
ax.legend()
plt.show()
print({p: dict(zip(ks, v)) for p, v in meas.items()})

# %% [markdown]
# ## Step time against batch and q, from the benchmark data
# `benchmarks/bench_decode.py --out benchmarks/results/decode_<machine>.jsonl` appends one JSON line per
# configuration (the whole step: verify + accept + MTP drafts, random weights). The H200 lines are the real
# geometry's TP4-rank share; the CPU lines the tiny geometries. BENCHMARKS.md has the tables.

# %%
import glob
import json
import os

rows = []
for f in sorted(glob.glob(os.path.join("..", "benchmarks", "results", "decode_*.jsonl"))):
  rows += [json.loads(line) for line in open(f) if line.strip()]
print(f"{len(rows)} benchmark rows")
fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
for geo, ax in zip(["oracle-tiny", "kernel-tiny"], axes):
  for q in sorted({r["q"] for r in rows if r["geometry"] == geo}):
    r = sorted((x for x in rows if x["geometry"] == geo and x["q"] == q and x["backend"] == "auto"),
               key=lambda x: x["batch"])
    ax.plot([x["batch"] for x in r], [x["ms_per_step"] for x in r], "o-", label=f"q = {q}")
  ax.set_title(f"{geo} ({rows[0]['device'] if rows else ''})")
  ax.set_xlabel("batch (capture size)")
  ax.set_ylabel("ms / step")
  ax.legend()
plt.tight_layout()
plt.show()
for r in rows:
  if r["geometry"] == "tp4-rank":
    print(f"H200, one TP4 rank, {r['backend']}, B={r['batch']} q={r['q']}: {r['ms_per_step']:.2f} ms/step "
          f"({r['pct_roofline']:.1f} % of the {r['roofline_ms']:.3f} ms roofline)")
