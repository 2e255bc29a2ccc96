"""The time to first token over time: every measured prefill (bench_prefill.py rows) with the defaults of its day or
what became them, per prompt length, by chunk size, with the best so far.

  python benchmarks/plot_prefill.py benchmarks/results/prefill_h100.jsonl -o benchmarks/results/prefill_history.png

A row counts when it is the one-rank geometry (tp4-rank) with no policy, or a policy whose every knob is set as today's
defaults have it (layers.KERNEL_DEFAULTS: an A/B's candidate that was adopted, e.g. moe_prefill in session 62,
mla_prefill in session 76) and no XLA options of its own (prefill_compiler_options). Rows are ordered as the file has
them (appended as measured). Each prompt length is a panel: a point per row, coloured by its chunk size, and the best so
far as a step line; the table printed lists each length's rows.

  python benchmarks/plot_prefill.py benchmarks/results/prefill_h100.jsonl --components-out OUT.png [--last N]

also draws where a chunk's GPU time went in each traced row (bench_prefill.py --trace: the kernels' µs a chunk by
the model's component) as stacked bars, the last N traced rows (default 6), and prints them as a table.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from plot_history import load_rows  # noqa: E402  (the result rows of a JSONL file or several)


def default_rows(rows, prompt: int, defaults: dict):
  """The rows of ``prompt`` tokens with the defaults of their day (an empty policy) or today's (every knob as
  ``defaults`` has it), in file order: [(index, seconds to first token, chunk, row)]."""
  out = []
  for i, r in enumerate(rows):
    if r.get("geometry", "tp4-rank") != "tp4-rank" or r.get("prompt") != prompt or r.get("ms") is None:
      continue
    pol = r.get("policy") or {}
    if any(defaults.get(k) != v for k, v in pol.items()) or r.get("prefill_compiler_options"):
      continue  # (not the defaults; or compiled with XLA options of its own, e.g. without autotuning)
    out.append((i, float(r["ms"]) / 1e3, int(r["chunk"]), r))
  return out


def component_rows(rows, last: int):
  """The last ``last`` rows with a trace split by component: [(label, {component: µs a chunk}, row)], the label
  its run, prompt length, chunk size and policy (the knobs it sets)."""
  out = []
  for r in rows:
    comp = (r.get("trace") or {}).get("components_us_per_chunk")
    if not comp:
      continue
    pol = ", ".join(f"{k}={v}" for k, v in (r.get("policy") or {}).items()) or "defaults"
    out.append((f"{r.get('run') or r.get('date', '')} p{r.get('prompt')} c{r.get('chunk')}: {pol}", comp, r))
  return out[-last:] if last else out


def plot_components(crow, path: str):
  """Stacked horizontal bars, one per traced row: its components' µs a chunk, the largest components first."""
  import matplotlib  # noqa: PLC0415
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415
  totals: dict = {}
  for _, comp, _ in crow:
    for k, v in comp.items():
      totals[k] = totals.get(k, 0.0) + v
  names = sorted(totals, key=totals.get, reverse=True)
  colours = plt.get_cmap("tab20").colors
  fig, ax = plt.subplots(figsize=(12, 0.5 * len(crow) + 1.4))
  for y, (_, comp, _) in enumerate(crow):
    left = 0.0
    for i, k in enumerate(names):
      v = comp.get(k, 0.0) / 1e3
      ax.barh(y, v, left=left, color=colours[i % len(colours)], label=k if y == 0 else None)
      left += v
    ax.text(left, y, f" {left:.1f} ms", va="center", fontsize=8)
  ax.set_yticks(range(len(crow)), [label for label, _, _ in crow], fontsize=8)
  ax.invert_yaxis()
  ax.set_xlabel("kernel time a chunk (ms), by the model's component")
  ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
  ax.grid(axis="x", alpha=0.3)
  ax.set_title("Where a prefill chunk's GPU time goes (bench_prefill.py --trace rows)", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  print(f"wrote {path}")


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("jsonl", nargs="+", help="bench_prefill.py result rows")
  p.add_argument("-o", "--out", default=None, help="write the plot here (PNG); without it only the table")
  p.add_argument("--components-out", default=None, help="also draw the traced rows' kernel time by component here")
  p.add_argument("--last", type=int, default=6, help="with --components-out: the last N traced rows (0: all)")
  a = p.parse_args(argv)
  from glm5_jax.layers import KERNEL_DEFAULTS  # noqa: PLC0415
  rows = load_rows(a.jsonl)
  prompts = sorted({r["prompt"] for r in rows if r.get("prompt")})
  series = {n: default_rows(rows, n, KERNEL_DEFAULTS) for n in prompts}
  series = {n: s for n, s in series.items() if s}
  if not series:
    raise SystemExit("plot_prefill: no row with the defaults of its day in " + ", ".join(a.jsonl))
  print("| prompt | row | date | run | chunk | layers | s to first token | best so far |")
  print("| --- | --- | --- | --- | --- | --- | --- | --- |")
  for n, s in series.items():
    best = float("inf")
    for i, sec, chunk, r in s:
      best = min(best, sec)
      print(f"| {n:,} | {i} | {r.get('date', '')} | {r.get('run', '')} | {chunk} | {r.get('layers', '')} | "
            f"{sec:.3f} | {best:.3f} |")
  if a.components_out:
    crow = component_rows(rows, a.last)
    if not crow:
      raise SystemExit("plot_prefill: no traced row (bench_prefill.py --trace) in " + ", ".join(a.jsonl))
    names = sorted({k for _, comp, _ in crow for k in comp}, key=lambda k: -max(c.get(k, 0) for _, c, _ in crow))
    print("\n| row | " + " | ".join(names) + " | total |")
    print("| --- |" + " --- |" * (len(names) + 1))
    for label, comp, _ in crow:
      print(f"| {label} | " + " | ".join(f"{comp.get(k, 0) / 1e3:.2f}" for k in names)
            + f" | {sum(comp.values()) / 1e3:.2f} |")
    plot_components(crow, a.components_out)
  if not a.out:
    return
  import matplotlib  # noqa: PLC0415
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415
  chunks = sorted({c for s in series.values() for _, _, c, _ in s})
  colours = dict(zip(chunks, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
  fig, axes = plt.subplots(1, len(series), figsize=(5.5 * len(series), 4.2), squeeze=False)
  for ax, (n, s) in zip(axes[0], series.items()):
    xs = list(range(len(s)))
    best, steps = float("inf"), []
    for _, sec, _, _ in s:
      best = min(best, sec)
      steps.append(best)
    ax.step(xs, steps, where="post", color="0.4", lw=1.2, label="best so far")
    for c in chunks:
      pts = [(x, sec) for x, (_, sec, cc, _) in zip(xs, s) if cc == c]
      if pts:
        ax.scatter(*zip(*pts), color=colours[c], s=28, zorder=3, label=f"{c}-token chunks")
    dates = [r.get("date", "") for _, _, _, r in s]
    ticks = [x for x in xs if x == 0 or dates[x] != dates[x - 1]]
    ax.set_xticks(ticks, [dates[x][5:] for x in ticks], rotation=45, fontsize=8)
    ax.set_title(f"{n:,}-token prompt")
    ax.set_ylabel("s to first token")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  layers = sorted({r.get("layers") for s in series.values() for *_, r in s} - {None})
  devices = sorted({r.get("device", "") for s in series.values() for *_, r in s} - {""})
  fig.suptitle(f"Prefill of one TP4 rank's first {'/'.join(map(str, layers))} layers, B = 1 ({', '.join(devices)}): "
               "the defaults of each day", fontsize=10)
  fig.tight_layout()
  fig.savefig(a.out, dpi=110)
  print(f"wrote {a.out}")


if __name__ == "__main__":
  main()
