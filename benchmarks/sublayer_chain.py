"""Each sublayer's kernels, boundary to boundary, from a decode step's saved GPU trace — what session 43's table
read by hand: which kernels a KDA / DSA / MoE sublayer launches, when each starts after its boundary, how long each
runs, and how long the sublayer takes.

  python benchmarks/sublayer_chain.py RUN.events.tsv.gz [--hlo RUN.hlo.gz | --kernels RUN.kernels.tsv] [--kind dsa]
      [--show 1]

The events file is what ``bench_decode.py --trace --hlo-dir DIR`` keeps (``DIR/NAME.events.tsv.gz``: kernel name,
start ns, end ns, stream). A sublayer starts at its mHC boundary (the ``mhc_post_finish`` launch, or the first
of the older multi-kernel forms) and ends where the next boundary starts; it is named by the kernels inside it
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

BOUNDARY = ("mhc_post_finish", "mhc_post_pre")  # the first name found in the trace marks the boundaries
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
  mark = next((b for b in BOUNDARY if any(b in e[0] for e in events)), None)
  if mark is None:
    raise SystemExit(f"no boundary kernel ({' / '.join(BOUNDARY)}) in the trace")
  starts = [i for i, e in enumerate(events) if mark in e[0]]
  out = []
  for a, b in zip(starts, starts[1:]):
    seg = events[a:b]
    names = " ".join(e[0].lower() for e in seg)
    kind = next((k for k, keys in KINDS if any(key in names for key in keys)), "other")
    out.append((kind, seg, events[b][1]))
  return out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("events")
  p.add_argument("--hlo", default=None, help="the step's HLO (.hlo.gz) to label XLA kernels with their component")
  p.add_argument("--kernels", default=None, help="the step's kernel listing (.kernels.tsv, what a device run brings "
                 "back where the HLO is too large) to label each kernel with its op_name")
  p.add_argument("--kind", default=None, help="only this sublayer kind (kda, dsa, moe, other)")
  p.add_argument("--show", type=int, default=1, help="sublayers of each kind listed kernel by kernel (the median "
                 "ones by length)")
  a = p.parse_args(argv)
  kmap = {}
  if a.hlo:
    with gzip.open(a.hlo, "rt") as fh:
      kmap = profiling.kernel_map(fh.read())
  if a.kernels:  # (computation, name, opcode, component, shape, op_name) rows: name -> "component: op_name"
    for ln in open(a.kernels):
      f = ln.rstrip("\n").split("\t")
      if len(f) >= 6:
        kmap.setdefault(profiling._sanitize(f[1]), f"{f[3]}: {f[5][-60:]}")
  subs = sublayers(read_events(a.events))
  by = collections.defaultdict(list)
  nxt = {}
  for kind, seg, end in subs:
    by[kind].append(seg)
    nxt[id(seg)] = end
  # (90th percentile, not the max: a step's last sublayer spans the host's gap to the next call's first boundary)
  print("| sublayer | instances | µs boundary to boundary (median / min / 90th percentile) | kernels (median) |")
  print("| --- | --- | --- | --- |")
  length = lambda seg: (nxt[id(seg)] - seg[0][1]) / 1e3  # noqa: E731
  for kind, segs in sorted(by.items()):
    ls = [length(s) for s in segs]
    p90 = sorted(ls)[min(len(ls) - 1, int(0.9 * len(ls)))]
    print(f"| {kind} | {len(segs)} | {statistics.median(ls):.1f} / {min(ls):.1f} / {p90:.1f} | "
          f"{statistics.median(len(s) for s in segs):.0f} |")
  for kind, segs in sorted(by.items()):
    if a.kind and kind != a.kind:
      continue
    segs = sorted(segs, key=length)
    for seg in segs[len(segs) // 2:][:a.show]:
      t0 = seg[0][1]
      print(f"\n{kind}: {length(seg):.1f} µs, {len(seg)} kernels (start µs after the boundary's start, µs, "
            "stream, kernel, component)")
      for name, s, e, line in seg:
        comp = profiling.classify_kernel(name, kmap) if kmap else ""
        if isinstance(comp, dict):
          comp = "+".join(comp)
        print(f"  {(s - t0) / 1e3:7.1f} {(e - s) / 1e3:6.1f}  {line[-12:]:>12}  {name[:70]:70} {comp or ''}")


if __name__ == "__main__":
  main()
