"""Pallas Mosaic GPU kernels for the GLM-5.3-Flash decode, each beside a pure-jnp reference with the same
signature. On CPU every kernel runs in Mosaic GPU interpret mode (tests) and cross-lowers for CUDA."""

from pallas_kernels import _common  # noqa: F401  (one Mosaic module per distinct kernel: see _common)
