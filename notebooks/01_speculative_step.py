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
# # One speculative decode step, step by step
#
# The tiny model (oracle-tiny geometry with its MTP layer, random weights) decodes with k = 3 drafts per step.
# We look at the decode state, inject drafts that are partly right, see what the step accepts, and check that
# the KDA state "rolls back" for free: the step stored the state after every verified token in its own slot, and
# the next step starts from slot `n_acc − 1`.

# %%
import matplotlib
import matplotlib.pyplot as plt
import numpy as np
import jax

import glm5_jax
from checkpoints.make_tiny import builtin_checkpoint

model = glm5_jax.load_model(builtin_checkpoint("oracle-tiny"), dtype="float32")
cfg = model.cfg
print(f"{cfg.num_hidden_layers} layers: {cfg.layer_types}")
print(f"MTP layer: {model.mtp}, vocabulary {cfg.vocab_size}, hidden {cfg.hidden_size}")

# %% [markdown]
# ## The reference continuation
# The stock model's greedy continuation through the cached path: prefill, then one token at a time.

# %%
prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, 12)
cache = glm5_jax.init_cache(model, 1, 64)
out, cache = glm5_jax.extend(model, cache, prompt[None])
ref = [int(np.argmax(out["logits"][0, -1]))]
for _ in range(15):
  o, cache = glm5_jax.extend(model, cache, np.array([[ref[-1]]]))
  ref.append(int(np.argmax(o["logits"][0, -1])))
print("reference continuation:", ref)

# %% [markdown]
# ## The decode state
# One jitted program per capture size; every array of the state has a fixed shape.

# %%
k = 3
dec = glm5_jax.Decoder(model, glm5_jax.DecodeConfig(max_context=64, q=1 + k, capture_sizes=(1,), policy=()))
state = dec.prefill([prompt])
for i, c in enumerate(state.caches["layers"]):
  print(f"layer {i} ({cfg.layer_types[i]}):", {n: (tuple(a.shape), str(a.dtype)) for n, a in c.items()})
print("MTP:", {n: tuple(a.shape) for n, a in state.caches["mtp"].items()})
print("lengths", state.lengths, "n_acc", state.n_acc, "next_tokens", state.next_tokens)

# %% [markdown]
# ## Verify drafts that are right for two tokens, then wrong
# `tokens = [last committed, d1, d2, d3]`: d1 and d2 equal the reference, d3 does not.

# %%
tokens = np.array(state.next_tokens)
assert tokens[0, 0] == ref[0]
tokens[0, 1:] = [ref[1], ref[2], (ref[3] + 1) % cfg.vocab_size]
kda0 = [np.asarray(c["ssm"][0]) for c in state.caches["layers"] if "ssm" in c][0]  # slots before the step
state, step = glm5_jax.decode(state, tokens)
print("emitted:", np.asarray(step.tokens[0, :int(step.counts[0])]), "count", int(step.counts[0]))
print("reference:", ref[1:4])
print("n_acc after the step:", int(state.n_acc[0]), "-> the next step reads KDA slot", int(state.n_acc[0]) - 1)

# %% [markdown]
# The step verified 4 positions and wrote 4 KDA slots; positions 0–2 were committed (the last committed token
# plus two accepted drafts), so slot 2 is the state to continue from and slot 3 (after the rejected draft) is
# simply never read. Below: the norm of each slot's state (first KDA layer, all heads).

# %%
kda1 = [np.asarray(c["ssm"][0]) for c in state.caches["layers"] if "ssm" in c][0]
fig, ax = plt.subplots(figsize=(6, 3))
ax.bar(np.arange(k + 1) - 0.2, np.linalg.norm(kda0.reshape(k + 1, -1), axis=1), 0.4, label="before the step")
ax.bar(np.arange(k + 1) + 0.2, np.linalg.norm(kda1.reshape(k + 1, -1), axis=1), 0.4, label="after the step")
ax.axvline(int(state.n_acc[0]) - 1, color="k", ls="--", label="slot read next")
ax.set_xlabel("KDA state slot (verify position)")
ax.set_ylabel("‖S‖")
ax.legend()
plt.show()

# %% [markdown]
# ## Check: the committed slot equals the reference state of the same tokens

# %%
_, c2 = glm5_jax.extend(model, glm5_jax.init_cache(model, 1, 64), np.concatenate([prompt, ref[:3]])[None])
kref = [np.asarray(c["ssm"][0, 0]) for c in c2.caches["layers"] if "ssm" in c][0]
err = np.abs(kda1[int(state.n_acc[0]) - 1] - kref).max()
print(f"max |slot − reference state| = {err:.2e}")
assert err < 1e-4

# %% [markdown]
# ## A few more steps with the MTP's own drafts
# With random weights the MTP rarely guesses right, so most steps emit one token; the emitted tokens still equal
# the reference continuation (speculation never changes greedy output).

# %%
emitted = [ref[0]] + np.asarray(step.tokens[0, :int(step.counts[0])]).tolist()
counts = [int(step.counts[0])]
while len(emitted) < 12:
  state, step = glm5_jax.decode(state)
  n = int(step.counts[0])
  counts.append(n)
  emitted += np.asarray(step.tokens[0, :n]).tolist()
print("emitted:  ", emitted[:12])
print("reference:", ref[:12])
assert emitted[:12] == ref[:12]
plt.figure(figsize=(6, 2.5))
plt.bar(range(len(counts)), counts)
plt.xlabel("step")
plt.ylabel("tokens emitted")
plt.show()
