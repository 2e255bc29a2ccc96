"""Per-component gap of profiled decode steps: each component's GPU time next to its floor (the bytes it must move
÷ 4.3 TB/s, glm5_jax.profiling.floor_bytes), as a markdown table — issue #9's "the gap per component".

  python benchmarks/gap_table.py benchmarks/results/decode_h200.jsonl [--last 4] [--since 2026-12-01]

Rows of the one-TP4-rank geometry (bench_decode.py --geometry tp4-rank --profile, all 45 layers). The floors come
from the abstract one-rank model (no weights allocated). Under XLA's CONCURRENT command-buffer schedule kernels
overlap and stretch, so a component's summed kernel time can exceed what it adds to the wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from glm5_jax import config as C, profiling as P, sharding as shd  # noqa: E402
from glm5_jax.synthetic import abstract_model, tp_rank_config  # noqa: E402


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("results", nargs="+")
  p.add_argument("--last", type=int, default=4, help="the last N qualifying rows")
  p.add_argument("--since", default=None, help="only rows dated on or after this day (YYYY-MM-DD)")
  a = p.parse_args(argv)
  rows = [json.loads(line) for f in a.results for line in open(f) if line.strip()]
  rows = [r for r in rows if r.get("profile") and r.get("geometry") == "tp4-rank" and r.get("layers") == 45
          and r.get("tp", 1) == 1 and (a.since is None or r.get("date", "") >= a.since)][-a.last:]
  if not rows:
    raise SystemExit("no profiled tp4-rank rows with all 45 layers")
  cfg = tp_rank_config(C.real(), 4)
  _, params = abstract_model(cfg, mesh=shd.make_mesh(1))
  heads, cols = [], []
  for r in rows:
    sched = (r.get("compiler_options") or {}).get("xla_gpu_command_buffer_scheduling_mode", "LHS")
    split = ((r.get("kernel_sites") or {}).get("mhc_sinkhorn_split") or {}).get("sites", 0)
    heads.append(f"B={r['batch']} q={r['q']} {sched}{' +split' if split else ''} ({r['ms_per_step']:.2f} ms)")
    floors = P.floor_bytes(cfg, params, batch=r["batch"], q=r["q"], context=r["context"])
    cols.append({c: (f, m) for c, f, m, _ in P.gap_table(floors, r["profile"]["us_per_step"])})
  # (a component with neither a floor nor a time of 1 µs is left out; a ratio needs a floor of 1 µs)
  comps = [c for c in P.COMPONENTS if any(max(col.get(c, (0.0, 0.0))) >= 1.0 for col in cols)]
  print("| component | " + " | ".join(heads) + " |")
  print("| --- |" + " --- |" * len(heads))
  for c in comps:
    cells = []
    for col in cols:
      f, m = col.get(c, (0.0, 0.0))
      cells.append(f"{m:,.0f} / {f:,.0f} µs" + (f" ({m / f:.1f}×)" if f >= 1.0 else ""))
    print(f"| {c} | " + " | ".join(cells) + " |")
  tot = [(sum(m for f, m in col.values()), sum(f for f, m in col.values())) for col in cols]
  print("| **all** (GPU busy / floor) | " + " | ".join(f"{m:,.0f} / {f:,.0f} µs ({m / f:.1f}×)" for m, f in tot)
        + " |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
