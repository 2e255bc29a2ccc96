"""Plot the per-component GPU time of profiled decode steps (bench_decode.py --profile --out FILE.jsonl).

  python benchmarks/plot_decode.py benchmarks/results/decode_h200.jsonl -o benchmarks/results/decode_components.png
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from glm5_jax.profiling import COMPONENTS  # noqa: E402


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("results", nargs="+")
  p.add_argument("-o", "--out", default="benchmarks/results/decode_components.png")
  p.add_argument("--since", default=None, help="only rows dated on or after this day (YYYY-MM-DD)")
  a = p.parse_args(argv)
  import matplotlib  # noqa: PLC0415
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  rows = [json.loads(line) for f in a.results for line in open(f) if line.strip()]
  rows = [r for r in rows if r.get("profile") and (a.since is None or r.get("date", "") >= a.since)]
  if not rows:
    raise SystemExit("no profiled rows (run bench_decode.py with --profile --out)")
  fig, ax = plt.subplots(figsize=(10, 1.8 + 0.6 * len(rows)))
  labels, seen = [], set()
  for i, r in enumerate(rows):
    left = 0.0
    for j, c in enumerate(COMPONENTS):
      us = r["profile"]["us_per_step"].get(c, 0.0)
      if us:
        ax.barh(i, us / 1e3, left=left, color=plt.cm.tab20(j), label=c if i == 0 else None)
        left += us / 1e3
    ax.plot([r["ms_per_step"]] * 2, [i - 0.4, i + 0.4], "k-", lw=2, label="wall" if i == 0 else None)
    if r.get("host_ms_per_step"):  # when the chained calls had returned: close to wall = host-bound
      ax.plot([r["host_ms_per_step"]] * 2, [i - 0.4, i + 0.4], color="0.5", ls=":", lw=2,
              label=None if "host" in seen else "host (calls returned)")
      seen.add("host")
    pol = ", ".join(f"{k}={v}" for k, v in sorted((r.get("policy") or {}).items()))
    # what the policy field does not say: the command-buffer schedule, kernel defaults of the day
    sched = (r.get("compiler_options") or {}).get("xla_gpu_command_buffer_scheduling_mode")
    split = ((r.get("kernel_sites") or {}).get("mhc_sinkhorn_split") or {}).get("sites", 0)
    extra = ", ".join(x for x in (sched or "", "Sinkhorn split" if split and "mhc_sinkhorn_split" not in pol
                                   else "") if x)
    spc = r.get("steps_per_call", 1)
    pol = ", ".join(x for x in (pol, extra, f"{spc} steps/call" if spc > 1 else "") if x)
    note = r.get("note", "")
    note = note if len(note) <= 60 else note[:57] + "..."  # the whole note is in the jsonl; keep the axis readable
    labels.append(f"{r['backend']} B={r['batch']} q={r['q']}{' (' + pol + ')' if pol else ''}\n"
                  f"{r.get('device', '')} {r.get('date', '')} {note}")
    if r.get("roofline_ms") == r.get("roofline_ms"):  # (NaN for geometries without one)
      ax.plot([r["roofline_ms"]] * 2, [i - 0.45, i + 0.45], "r--", lw=1.5, label="HBM roofline" if i == 0 else None)
  ax.set_yticks(range(len(rows)), labels, fontsize=8)
  ax.set_xlabel("ms per decode step (bars: GPU time by component; black tick: wall-clock step)")
  # (below the axis label: the fewer the rows, the larger the label is in axes units)
  ax.legend(fontsize=7, ncol=6, loc="upper center", bbox_to_anchor=(0.5, -0.1 - 0.6 / (len(rows) + 2)))
  fig.tight_layout()
  fig.savefig(a.out, dpi=120, bbox_inches="tight")
  print(f"wrote {a.out}")


if __name__ == "__main__":
  main()
