"""Pallas Mosaic GPU kernels for the GLM-5.3-Flash decode (and a prefill chunk's MoE: ``moe_prefill``), each beside
a pure-jnp reference with the same signature. On CPU every kernel runs in Mosaic GPU interpret mode (tests) and
cross-lowers for CUDA.

What the H200 taught (BENCHMARKS.md has the measurements):
- Decode kernels are latency-bound, and most CTAs run their code once: keep per-CTA work that repeats (chunks,
  passes, tokens) a loop (``lax.fori_loop`` / ``pl.loop``), not Python-unrolled straight-line code. The one-launch
  mHC boundary unrolled was 3.1 MB of MLIR and ~135 µs per call in the step (session 31), looped 33.8 µs alone;
  the top-k threshold kernel's passes looped 23.7 -> 21.6 µs (2-bit: 28.8 -> 19.8; session 32); tests hold the
  looped kernels' code size (``mhc``, ``indexer.topk_threshold``).
- e4m3 -> bf16 converts go through f32 (no direct conversion in the H200's ptxas).
- Register loads from an untiled SMEM ref sliced at a column offset came back with 16-byte chunks exchanged
  natively (right in interpret mode): load whole blocks (``sparse_mla._dequant_block``).
- A tiny parameter slice handed to a kernel costs a memcpy node per call: keep such parameters whole
  (``glm5_jax.param_packing.KEEP_WHOLE``).
- GPU interpret mode (jax 0.11.2) runs neither GMEM semaphores nor griddepcontrol (PDL), and a cluster of more than
  2 CTAs can stall it: a kernel with a grid-wide barrier keeps a two-launch form of the same code, which interpret
  mode runs and the native test holds the one-launch form to bit for bit (``mhc.mhc_post_finish``); warpgroups of
  one CTA meeting at an mbarrier interpret fine (``indexer.topk_threshold(warpgroups=4)``,
  ``router.router_route``).
- A CTA lives until the bulk L2 prefetches it issued have been processed (session 41: a 128-CTA stand-in for the
  mHC boundary prefetching 16 MB lived 1.55 -> 4.68 µs): prefetches from a kernel on the step's critical chain
  lengthen the chain, and from launches of their own beside it their traffic slows the chain's streaming (the L2
  prefetch knobs measured slower in session 58 and were removed in session 59)."""

from pallas_kernels import _common  # noqa: F401  (one Mosaic module per distinct kernel: see _common)
