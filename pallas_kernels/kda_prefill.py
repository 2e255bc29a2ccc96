"""KDA's prefill chunk: the chunks' state hand-over as one Mosaic GPU kernel.

``glm5_jax.attention.kda_chunked`` computes everything of a prefill chunk's gated delta rule for all its
sub-chunks at once except the sequential part: with n sub-chunks of C tokens, each sub-chunk's exit state is an
affine map of its entry state, S_{c+1} = R_c S_c + P_c (R_c [K, K], P_c [K, V] per head), and every sub-chunk's
output needs its entry state. As XLA ops that chain is n dependent f32 products and n adds per layer — 2 x 16
launches a KDA layer of a 512-token chunk (~3 ms of a chunk's 63 ms of kernels on an H100, session 77's trace) and
a stack of the n entry states that XLA builds as one concatenation (at 768 and 1,024 tokens a suspect in a
compile that did not end: BENCHMARKS.md, sessions 76 / 77).

``kda_handover`` runs the chain in one launch: a CTA per (sequence x head, block of ``vb`` state columns) — the
columns evolve independently — keeps its [K, vb] state block in SMEM, streams each sub-chunk's R_cᵀ [K, K] and
P_c block through a two-slot TMA ring, and accumulates R_c S_c as K rank-1 updates in f32 on the CUDA cores (a
column of R_c times a row of S_c, both read from SMEM: the products and sums are f32, as XLA's HIGHEST-precision
product; no tensor core, whose TF32 inputs would round the state), starting from P_c — unrolled (UNROLL), so that
the updates' SMEM loads issue ahead of the multiply-adds. Each entry state is written
by TMA as the chain passes it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._common import kernel_entry, mgpu_kernel

HIGHEST = lax.Precision.HIGHEST
VB = 16  # state columns a CTA (the WGMMA register layout's columns: a multiple of 8)
# the rank-1 updates' unroll factor: a 512-token chunk's hand-over (16 sub-chunks x 16 heads) 85.5 µs rolled, 67.0 /
# 55.5 / 46.8 / 45.1 unrolled by 2 / 4 / 8 / 16 on an H100, bit for bit (benchmarks/bench_kda_prefill.py, session 79)
UNROLL = 16
_L = plgpu.Layout


def kda_handover_reference(Rt, P, S0):
  """Rt [n, B, K, K] f32: each sub-chunk's hand-over matrix transposed (Rt[c] = R_cᵀ), P [n, B, K, V] f32,
  S0 [B, K, V] f32 (B: sequences x heads) -> (entry [n, B, K, V]: each sub-chunk's entry state, S_n [B, K, V]),
  S_{c+1} = R_c S_c + P_c."""
  def step(S, xs):
    rt, p = xs
    return jnp.einsum("bjk,bjv->bkv", rt, S, precision=HIGHEST) + p, S

  S, entry = lax.scan(step, S0, (Rt, P))
  return entry, S


def _handover_kernel(n: int, K: int, vb: int, unroll: int = 1):
  def body(rt_g, p_g, s0_g, e_g, sn_g, rt_s, p_s, s_s, bar, sbar):
    bh = lax.axis_index("bh")
    v0 = lax.axis_index("v") * vb

    def issue(c, slot):
      plgpu.copy_gmem_to_smem(rt_g.at[c, bh], rt_s.at[slot], bar.at[slot])
      plgpu.copy_gmem_to_smem(p_g.at[c, bh, :, pl.ds(v0, vb)], p_s.at[slot], bar.at[slot])

    issue(0, 0)
    plgpu.copy_gmem_to_smem(s0_g.at[bh, :, pl.ds(v0, vb)], s_s, sbar.at[0])
    plgpu.barrier_wait(sbar.at[0])

    def chunk(c, carry):
      slot = lax.rem(c, 2)

      @pl.when(c + 1 < n)
      def _():
        issue(c + 1, 1 - slot)

      plgpu.copy_smem_to_gmem(s_s, e_g.at[c, bh, :, pl.ds(v0, vb)])  # (sub-chunk c's entry state)
      plgpu.barrier_wait(bar.at[slot])

      def rank1(j, acc):  # acc += R_c[:, j] ⊗ S_c[j, :] (row j of R_cᵀ; row j of the state)
        r = plgpu.load(rt_s.at[slot, j], layout=_L.WGMMA.reduce(1), optimized=False)
        s = plgpu.load(s_s.at[j], layout=_L.WGMMA.reduce(0), optimized=False)
        return acc + lax.broadcast_in_dim(r, (K, vb), (0,)) * lax.broadcast_in_dim(s, (K, vb), (1,))

      acc = lax.fori_loop(0, K, rank1, plgpu.load(p_s.at[slot], layout=_L.WGMMA, optimized=False), unroll=unroll)
      # every thread past its reads of the state (the wait ends in a warpgroup barrier) and the entry's TMA store
      # past its read of it: the new state may overwrite it
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      s_s[...] = acc
      plgpu.commit_smem()  # (the next sub-chunk's TMA store and every thread's row loads see it)
      return carry

    lax.fori_loop(0, n, chunk, None)
    plgpu.copy_smem_to_gmem(s_s, sn_g.at[bh, :, pl.ds(v0, vb)])
    plgpu.wait_smem_to_gmem(0)

  return body


@kernel_entry("vb", "unroll")
def kda_handover(Rt, P, S0, *, vb: int = VB, unroll: int = UNROLL):
  """Mosaic GPU version of ``kda_handover_reference`` (same signature): K a multiple of 64 (the state's rows in the
  WGMMA register layout), V a multiple of ``vb`` (a multiple of 8). ``unroll``: the K rank-1 updates of a
  sub-chunk unrolled by this factor (a divisor of K) — each update's two SMEM loads then issue ahead of the
  previous updates' multiply-adds instead of waiting for them; the same sums in the same order (bit for bit)."""
  n, B, K, K2 = Rt.shape
  V = P.shape[-1]
  if K2 != K or P.shape != (n, B, K, V) or S0.shape != (B, K, V) or K % 64 or vb % 8 or V % vb:
    raise ValueError(f"kda_handover: Rt {Rt.shape}, P {P.shape}, S0 {S0.shape}, vb={vb}; expected [n, B, K, K], "
                     f"[n, B, K, V], [B, K, V] with K a multiple of 64 and V a multiple of vb (a multiple of 8)")
  if not isinstance(unroll, int) or unroll < 1 or K % unroll:
    raise ValueError(f"kda_handover: unroll={unroll!r}; expected a positive divisor of K = {K}")
  f32 = jnp.float32
  return mgpu_kernel(
      _handover_kernel(n, K, vb, unroll),
      out_type=(jax.ShapeDtypeStruct((n, B, K, V), f32), jax.ShapeDtypeStruct((B, K, V), f32)),
      grid=(B, V // vb),
      grid_names=("bh", "v"),
      kernel_name="glm5_kda_handover",
      scratch_types=[
          plgpu.SMEM((2, K, K), f32),  # rt_s: R_cᵀ, two slots
          plgpu.SMEM((2, K, vb), f32),  # p_s: P_c's columns, two slots
          plgpu.SMEM((K, vb), f32),  # s_s: the state's columns
          plgpu.Barrier(num_arrivals=2, num_barriers=2),
          plgpu.Barrier(num_arrivals=1, num_barriers=1),
      ],
  )(Rt.astype(f32), P.astype(f32), S0.astype(f32))


