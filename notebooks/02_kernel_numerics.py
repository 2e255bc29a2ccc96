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
# # Kernel numerics: each Pallas kernel against its reference on fresh random inputs
#
# On a GPU the kernels run natively; on a CPU in Mosaic GPU interpret mode (a simulator: small shapes here).

# %%
import matplotlib.pyplot as plt
import numpy as np
import jax
import jax.numpy as jnp

from pallas_kernels import indexer as ki, kda_decode as kk, linear as kl, sparse_mla as ks
from pallas_kernels._common import maybe_interpret, on_gpu

print("backend:", jax.default_backend(), "(native)" if on_gpu() else "(interpret mode)")
rng = np.random.default_rng()
rel = lambda a, b: float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b)))
errors = {}

# %% KDA decode recurrence
B, T, H, D, Q = 1, 4, 2, 128, 4
r = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
args = (r(B, T, H, D), r(B, T, H, D), r(B, T, H, D), r(B, T, H, D), r(B, T, H), r(H) * 0.5,
        jnp.asarray(rng.uniform(-7, -2, (H, D)), jnp.float32), r(B, Q, H, D, D) * 0.1,
        jnp.asarray([2], jnp.int32))
with maybe_interpret():
  o, s = jax.jit(kk.kda_decode)(*args)
o_ref, s_ref = kk.kda_decode_reference(*args)
errors["KDA output"] = rel(o, o_ref)
errors["KDA state slots"] = rel(s[:, :T], s_ref[:, :T])

# %% FP8 block-scaled GEMV
N, K, M = 256, 512, 4
w = rng.standard_normal((N, K)).astype(np.float32) / np.sqrt(K)
s = np.abs(w).reshape(N // 128, 128, K // 128, 128).max((1, 3)) / 448
w8 = jnp.asarray(w / np.repeat(np.repeat(s, 128, 0), 128, 1), jnp.float8_e4m3fn)
x = r(M, K).astype(jnp.bfloat16)
with maybe_interpret():
  y = jax.jit(kl.fp8_linear)(x, w8, jnp.asarray(s))
errors["FP8 GEMV"] = rel(y, kl.fp8_linear_reference(x, w8, jnp.asarray(s)))

# %% [markdown]
# The same GEMV with the weight tile dequantised to bf16 inside the kernel (policy knob `fp8_dq`): the
# activations stay bf16, so the products are exact — the hi/lo e4m3 split of `fp8_linear` keeps ~9 bits of x.

# %%
with maybe_interpret():
  y_dq = jax.jit(kl.fp8_dq_linear)(x, w8, jnp.asarray(s))
errors["FP8 GEMV (dq)"] = rel(y_dq, kl.fp8_linear_reference(x, w8, jnp.asarray(s)))

# %% FP8 sparse MLA over a quantised latent cache
S, W, Hm = 256, 96, 16
cache = ks.quantize_latent(r(1, S, 512))  # one row per position: e4m3 bytes + scales
idx = jnp.asarray(np.sort(rng.choice(S, (1, 2, W), replace=True), -1), jnp.int32).at[:, :, -5:].set(-1)
qm = r(1, 2, Hm, 512) * 0.05
with maybe_interpret():
  om = jax.jit(lambda *a: ks.sparse_mla_decode(*a, softmax_scale=1 / 16))(qm, cache, idx)
errors["sparse MLA"] = rel(om, ks.sparse_mla_decode_reference(qm, cache, idx, softmax_scale=1 / 16))

# %% FP8 indexer scores
P, HI = 128, 8
q8, qs = ki.quant_ue8m0_fp8(ki.hadamard128(r(1, 2, HI, 128)))
k8, kscale = ki.quant_ue8m0_fp8(ki.hadamard128(r(1, P, 128)))
wts, nv = r(1, 2, HI), jnp.asarray([[100, 128]], jnp.int32)
with maybe_interpret():
  sc = jax.jit(ki.indexer_scores)(q8, qs, wts, k8, kscale, nv)
sr = ki.indexer_scores_reference(q8, qs, wts, k8, kscale, nv)
fin = np.isfinite(np.asarray(sr))
assert (np.isfinite(np.asarray(sc)) == fin).all()
errors["indexer scores"] = rel(np.asarray(sc)[fin], np.asarray(sr)[fin])

# %%
for n, e in errors.items():
  print(f"{n:>18}: relative error {e:.2e}")
plt.figure(figsize=(6, 2.8))
plt.barh(list(errors), [max(e, 1e-9) for e in errors.values()])
plt.xscale("log")
plt.xlabel("‖kernel − reference‖ / ‖reference‖")
plt.tight_layout()
plt.show()
assert max(errors.values()) < 3e-2
