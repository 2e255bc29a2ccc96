"""The decode step over time: every measured one-rank step (bench_decode.py rows) with the defaults of its day,
latency_specialized against auto, at q = 1 and q = 4, with the best so far and the HBM roofline.

  python benchmarks/plot_history.py benchmarks/results/decode_h200.jsonl -o benchmarks/results/decode_history.png

A row counts when it is the one-rank geometry (tp4-rank) at B = 1 and 32K context with no policy override
(its backend's defaults on that day; A/B candidates and forced knobs are left out). Rows are ordered by their run
time (``run``; the date where an early row has none). Each panel shows every such row as a point and the best
so far as a step line; the table printed lists each day's best.
"""

from __future__ import annotations

import argparse
import json
import sys

BACKENDS = ("latency_specialized", "auto")
QS = (1, 4)


def load_rows(paths):
  return [json.loads(line) for p in paths for line in open(p) if line.strip()]


def default_rows(rows, backend: str, q: int):
  """The rows with the defaults of their day (or what became them: ``is_defaults``) for (backend, q) at B = 1,
  32K context on the one-rank geometry, ordered by run time: [(time key, ms per step, row)]."""
  out = []
  for i, r in enumerate(rows):
    if (r.get("geometry"), r.get("batch"), r.get("context"), r.get("backend"), r.get("q")) != (
        "tp4-rank", 1, 32768, backend, q):
      continue
    # a policy row counts when it measured what became the defaults (is_defaults: the knobs turned on after it)
    if (r.get("policy") and not r.get("is_defaults")) or r.get("ms_per_step") is None:
      continue
    out.append(((r.get("run") or r.get("date") or "", i), float(r["ms_per_step"]), r))
  return sorted(out, key=lambda t: t[0])


def best_so_far(series):
  """The running minimum of a [(key, ms, row)] series: [(key, best ms)]."""
  best, out = float("inf"), []
  for key, ms, _ in series:
    best = min(best, ms)
    out.append((key, best))
  return out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("results", nargs="+")
  p.add_argument("-o", "--out", default="benchmarks/results/decode_history.png")
  a = p.parse_args(argv)
  import matplotlib  # noqa: PLC0415
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  rows = load_rows(a.results)
  series = {(b, q): default_rows(rows, b, q) for b in BACKENDS for q in QS}
  if not any(series.values()):
    raise SystemExit("no default-policy one-rank rows at B = 1, 32K context")
  keys = sorted({k for s in series.values() for k, _, _ in s})
  pos = {k: i for i, k in enumerate(keys)}  # (one x position per run, in time order)
  fig, axes = plt.subplots(1, len(QS), figsize=(6.5 * len(QS), 4.2), squeeze=False)
  for ax, q in zip(axes[0], QS):
    roof = None
    for b, color in zip(BACKENDS, ("tab:blue", "tab:orange")):
      s = series[(b, q)]
      if not s:
        continue
      roof = roof or s[-1][2].get("roofline_ms")
      ax.scatter([pos[k] for k, _, _ in s], [ms for _, ms, _ in s], s=12, color=color, alpha=0.5)
      bs = best_so_far(s)
      ax.step([pos[k] for k, _ in bs], [ms for _, ms in bs], where="post", color=color,
              label=f"{b}: best {bs[-1][1]:.2f} ms")
    if roof:
      ax.axhline(roof, color="r", ls="--", lw=1.2, label=f"HBM roofline {roof:.2f} ms")
    days = {}
    for k in keys:  # (tick labels: the first run of each day)
      days.setdefault(k[0][:10], pos[k])
    ax.set_xticks(list(days.values()), list(days.keys()), rotation=30, ha="right", fontsize=8)
    ax.set_ylim(bottom=0)
    ax.set_ylabel("ms per decode step")
    ax.set_title(f"one TP4 rank on an H200, B = 1, q = {q}, 32K context")
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(a.out, dpi=110)
  print(f"wrote {a.out}")
  print("| backend | q | day | best ms/step | rows |")
  print("| --- | --- | --- | --- | --- |")
  for (b, q), s in series.items():
    per_day = {}
    for k, ms, _ in s:
      d = k[0][:10]
      per_day[d] = (min(per_day.get(d, (ms, 0))[0], ms), per_day.get(d, (ms, 0))[1] + 1)
    for d, (ms, n) in per_day.items():
      print(f"| {b} | {q} | {d} | {ms:.2f} | {n} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
