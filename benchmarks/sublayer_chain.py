"""Each sublayer's kernels, boundary to boundary, from a decode step's saved GPU trace — what session 43's table
read by hand: which kernels a KDA / DSA / MoE sublayer launches, when each starts after its boundary, how long each
runs, how long the sublayer takes, and which kernel its next boundary waited for (the last to end).

  python benchmarks/sublayer_chain.py RUN.events.tsv.gz [--hlo RUN.hlo.gz | --kernels RUN.kernels.tsv] [--kind dsa]
      [--show 1] [--plot OUT.png --title TEXT]

The events file is what ``bench_decode.py --trace --hlo-dir DIR`` keeps (``DIR/NAME.events.tsv.gz``: kernel name,
start ns, end ns, stream). A sublayer starts at its mHC boundary (the ``mhc_row_boundary`` or ``mhc_post_finish``
launch, or the first of the older multi-kernel forms) and ends where the next boundary starts; it is named by the
kernels inside it
(KDA: a kda kernel; DSA: the sparse MLA / indexer kernels; MoE: an MoE kernel; else "other": the dense MLP, the
first sublayer's embedding, the head and the MTP draft). With ``--hlo`` each XLA kernel is labelled with its
component (profiling.kernel_map), with ``--kernels`` (the HLO's kernel listing) with its component and op_name.
Times are the trace's: under XLA's concurrent command-buffer schedule kernels of one sublayer overlap, so the
offsets, not the summed durations, show the sublayer's length.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from glm5_jax import profiling  # noqa: E402

# the boundary kernels: the one-launch forms (one kernel a boundary: the one-row form, the default at one token
# row since session 55, and the grid form), else the first of the older multi-kernel forms — the first group with a
# name found in the trace marks the boundaries
BOUNDARY = (("mhc_row_boundary", "mhc_post_finish"), ("mhc_post_pre",))
KINDS = (("kda", ("kda",)), ("dsa", ("sparse_mla", "indexer", "topk")), ("moe", ("moe",)))


def read_events(path: str):
  """(name, start ns, end ns, stream) rows of a saved trace, by start."""
  with gzip.open(path, "rt") as fh:
    rows = [ln.rstrip("\n").split("\t") for ln in fh if ln.strip()]
  return sorted(((r[0], int(float(r[1])), int(float(r[2])), r[3] if len(r) > 3 else "") for r in rows),
                key=lambda e: e[1])


def sublayers(events):
  """Split the events at the boundary launches -> [(kind, [events from this boundary to the next], the next
  boundary's start ns)]."""
  marks = next((g for g in BOUNDARY if any(b in e[0] for b in g for e in events)), None)
  if marks is None:
    raise SystemExit(f"no boundary kernel ({' / '.join(b for g in BOUNDARY for b in g)}) in the trace")
  starts = [i for i, e in enumerate(events) if any(b in e[0] for b in marks)]
  out = []
  for a, b in zip(starts, starts[1:]):
    seg = events[a:b]
    names = " ".join(e[0].lower() for e in seg)
    kind = next((k for k, keys in KINDS if any(key in names for key in keys)), "other")
    out.append((kind, seg, events[b][1]))
  return out


def kernel_labels(hlo: str | None = None, kernels: str | None = None) -> dict:
  """Kernel name -> component label, from the step's HLO (.hlo.gz: profiling.kernel_map) or its kernel listing
  (.kernels.tsv[.gz]: (computation, name, opcode, component, shape, op_name) rows -> "component: op_name")."""
  kmap = {}
  if hlo:
    with gzip.open(hlo, "rt") as fh:
      kmap = profiling.kernel_map(fh.read())
  if kernels:
    with (gzip.open(kernels, "rt") if kernels.endswith(".gz") else open(kernels)) as fh:
      for ln in fh:
        f = ln.rstrip("\n").split("\t")
        if len(f) >= 6:
          kmap.setdefault(profiling._sanitize(f[1]), f"{f[3]}: {f[5][-60:]}")
  return kmap


def label(name: str, kmap: dict) -> str:
  """A kernel's component label ('' without a map)."""
  comp = profiling.classify_kernel(name, kmap) if kmap else ""
  return "+".join(comp) if isinstance(comp, dict) else (comp or "")


def by_kind(events):
  """{kind: [(µs boundary to boundary, [events])] sorted by length} over the trace's sublayers."""
  out = collections.defaultdict(list)
  for kind, seg, end in sublayers(events):
    out[kind].append(((end - seg[0][1]) / 1e3, seg))
  return {k: sorted(v, key=lambda x: x[0]) for k, v in sorted(out.items())}


def chain_rows(seg):
  """One sublayer's events -> [(kernel, start µs after the boundary's start, µs, stream)]."""
  t0 = seg[0][1]
  return [(name, (s - t0) / 1e3, (e - s) / 1e3, line) for name, s, e, line in seg]


def median_chain(chains):
  """The median-length sublayer of one kind (``by_kind``'s list) -> (µs, chain_rows)."""
  length, seg = chains[len(chains) // 2]
  return length, chain_rows(seg)


def last_arrivals(chains, kmap: dict | None = None):
  """What each sublayer's next boundary waited for: per sublayer (``by_kind``'s list of one kind) the kernel that
  ended last (its boundary aside) and by how many µs it ended after the kernel that ended last before it ->
  [(short name, instances, median µs ahead)], most frequent first. A side kernel listed here is on the chain
  (e.g. the boundary's one-CTA Sinkhorn, which only the next boundary reads, when it starts late)."""
  got = collections.defaultdict(list)
  for _, seg in chains:
    rest = sorted(seg[1:], key=lambda e: e[2])
    if not rest:
      continue
    ahead = (rest[-1][2] - rest[-2][2]) / 1e3 if len(rest) > 1 else 0.0
    got[short_name(rest[-1][0], kmap or {})].append(ahead)
  return sorted(((n, len(v), statistics.median(v)) for n, v in got.items()), key=lambda r: -r[1])


def short_name(name: str, kmap: dict) -> str:
  """A kernel's name for a plot: a Mosaic kernel's without its glm5_ / _mosaic_gpu_kernel affixes; an XLA
  fusion's component and op (from the kernel labels) or its own name."""
  if "mosaic_gpu" in name:
    return name.replace("glm5_", "").replace("_mosaic_gpu_kernel", "")
  lab = label(name, kmap)
  if ":" in lab:
    comp, op = lab.split(":", 1)
    return f"{comp}: {op.strip().split('/')[-1]}"
  return name[:32]


def plot_chains(kinds, kmap: dict, title: str = "", order=("kda", "moe", "dsa")):
  """The median sublayer of each kind as a Gantt chart — one row per kernel in launch order, bars from its start
  after the boundary's start to its end (Mosaic kernels blue, XLA kernels orange), a dashed line where the next
  boundary starts. -> the matplotlib figure."""
  import matplotlib.pyplot as plt  # noqa: PLC0415 (plots only)

  kinds = {k: kinds[k] for k in order if k in kinds}
  sizes = [len(median_chain(c)[1]) for c in kinds.values()]
  fig, axes = plt.subplots(len(kinds), 1, figsize=(10, 1.2 + 0.22 * sum(sizes) + 0.5 * len(kinds)),
                           gridspec_kw={"height_ratios": sizes}, squeeze=False)
  xmax = max(median_chain(c)[0] for c in kinds.values()) * 1.02
  for ax, (kind, chains) in zip(axes[:, 0], kinds.items()):
    length, rows = median_chain(chains)
    for i, (name, start, dur, _) in enumerate(rows):
      mosaic = "mosaic_gpu" in name
      ax.barh(i, dur, left=start, color="tab:blue" if mosaic else "tab:orange", height=0.7)
      ax.text(start + dur + 0.3, i, f"{short_name(name, kmap)}  {dur:.1f}", va="center", fontsize=7)
    ax.axvline(length, color="k", ls="--", lw=1)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_yticks([])
    ax.set_xlim(0, xmax)
    ax.set_title(f"{kind}: {length:.1f} µs boundary to boundary (median of {len(chains)}), {len(rows)} kernels",
                 fontsize=9, loc="left")
  axes[-1, 0].set_xlabel("µs after the sublayer's mHC boundary starts (blue: Mosaic GPU kernels, orange: XLA)")
  if title:
    fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  return fig


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("events")
  p.add_argument("--hlo", default=None, help="the step's HLO (.hlo.gz) to label XLA kernels with their component")
  p.add_argument("--kernels", default=None, help="the step's kernel listing (.kernels.tsv[.gz], what a device run "
                 "brings back where the HLO is too large) to label each kernel with its op_name")
  p.add_argument("--kind", default=None, help="only this sublayer kind (kda, dsa, moe, other)")
  p.add_argument("--show", type=int, default=1, help="sublayers of each kind listed kernel by kernel (the median "
                 "ones by length)")
  p.add_argument("--plot", default=None, help="also draw each kind's median sublayer as a Gantt chart (a .png)")
  p.add_argument("--title", default="", help="the plot's title")
  a = p.parse_args(argv)
  kmap = kernel_labels(a.hlo, a.kernels)
  kinds = by_kind(read_events(a.events))
  if a.plot:
    plot_chains(kinds, kmap, a.title).savefig(a.plot, dpi=110)
    print(f"wrote {a.plot}")
  # (90th percentile, not the max: a step's last sublayer spans the host's gap to the next call's first boundary)
  print("| sublayer | instances | µs boundary to boundary (median / min / 90th percentile) | kernels (median) |")
  print("| --- | --- | --- | --- |")
  for kind, chains in kinds.items():
    ls = [n for n, _ in chains]
    p90 = ls[min(len(ls) - 1, int(0.9 * len(ls)))]
    print(f"| {kind} | {len(ls)} | {statistics.median(ls):.1f} / {ls[0]:.1f} / {p90:.1f} | "
          f"{statistics.median(len(s) for _, s in chains):.0f} |")
  print("\n| sublayer | its last kernel to end — what the next boundary waited for (instances, median µs after the "
        "kernel that ended before it) |")
  print("| --- | --- |")
  for kind, chains in kinds.items():
    print(f"| {kind} | " + "; ".join(f"{n} {c} ({d:.1f})" for n, c, d in last_arrivals(chains, kmap)[:4]) + " |")
  for kind, chains in kinds.items():
    if a.kind and kind != a.kind:
      continue
    for length, seg in chains[len(chains) // 2:][:a.show]:
      rows = chain_rows(seg)
      print(f"\n{kind}: {length:.1f} µs, {len(rows)} kernels (start µs after the boundary's start, µs, "
            "stream, kernel, component)")
      for name, start, dur, line in rows:
        print(f"  {start:7.1f} {dur:6.1f}  {line[-12:]:>12}  {name[:70]:70} {label(name, kmap)}")


if __name__ == "__main__":
  main()
