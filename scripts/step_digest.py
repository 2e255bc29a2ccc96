"""A digest of the decode step's XLA-level program, to check that a refactor leaves a step unchanged.

Lowers the latency_specialized (or auto) step for CUDA on abstract weights — no GPU, nothing allocated — and hashes
its StableHLO text with what is not the program removed: source locations, and each Mosaic GPU call's serialized
kernel module and kernel hash (they embed file paths and line numbers; the kernels themselves have their own
tests). Two commits whose digests agree build the same XLA program around the same kernel calls, operands and
result types.

  PYTHONPATH=. python3 scripts/step_digest.py [--geometry kernel-tiny] [--q 1 4] [--policy '{}'] [--out FILE]

Session 53 used it to check that removing eight measured-slower knobs left the defaults' step as it was.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys


def normalised_text(txt: str) -> str:
  """The lowered text without locations and Mosaic kernel payloads (see the module docstring)."""
  txt = re.sub(r'kernel_hash = "(?:[^"\\]|\\.)*"', 'kernel_hash = ""', txt)
  txt = re.sub(r'module = "(?:[^"\\]|\\.)*"', 'module = ""', txt)
  txt = re.sub(r"loc\([^)]*\)", "", txt)
  return re.sub(r"#loc\d*( = .*)?", "", txt)


def lowered_step(geometry: str, q: int, backend: str, policy: tuple, batch: int = 1) -> str:
  from glm5_jax import config as C  # noqa: PLC0415
  from glm5_jax import sharding as shd  # noqa: PLC0415
  from glm5_jax.runtime import DecodeConfig  # noqa: PLC0415
  from glm5_jax.speculative import Decoder  # noqa: PLC0415
  from glm5_jax.synthetic import abstract_model, tp_rank_config  # noqa: PLC0415
  cfg = {"kernel-tiny": C.kernel_tiny, "tp4-rank": lambda: tp_rank_config(C.real(), 4)}[geometry]()
  max_context = 4096 if geometry == "kernel-tiny" else 32784
  model, params = abstract_model(cfg, mesh=shd.make_mesh(1))
  dec = Decoder(model, DecodeConfig(max_context=max_context, q=q, capture_sizes=(batch,), policy=policy),
                backend=backend)
  with dec.kernel_mode(interpret=False):  # (the kernels as the CUDA lowering sees them)
    traced = dec.trace_step(batch, params, interpret=False)
  return traced.lower(lowering_platforms=("cuda",)).as_text()


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--geometry", default="kernel-tiny", choices=["kernel-tiny", "tp4-rank"])
  p.add_argument("--q", type=int, nargs="+", default=[1, 4])
  p.add_argument("--backend", default="latency_specialized", choices=["latency_specialized", "auto"])
  p.add_argument("--policy", default="{}", help="decode policy knobs as JSON")
  p.add_argument("--out", default=None, help="also write the normalised text of the last q here (to diff)")
  a = p.parse_args(argv)
  policy = tuple(sorted(json.loads(a.policy).items()))
  for q in a.q:
    txt = normalised_text(lowered_step(a.geometry, q, a.backend, policy))
    print(f"{a.geometry} {a.backend} q={q} policy={dict(policy)}: {hashlib.sha256(txt.encode()).hexdigest()[:16]} "
          f"({len(txt):,} chars)")
    if a.out:
      with open(a.out, "w") as fh:
        fh.write(txt)
  return 0


if __name__ == "__main__":
  sys.exit(main())
