"""Read a profiled step's kernels offline: every kernel of one component with its time per launch, launches per
step, and — from the optimised HLO kept next to it — the fusion's result type and the JAX op it came from.

  python benchmarks/kernel_table.py RUN.kernels.json [--hlo RUN.hlo.gz] [--component moe dsa] [--min-launches 10]

The inputs are what `bench_decode.py --profile --hlo-dir DIR` writes per step (DIR/<name>.kernels.json:
{kernel: [µs per step, launches per step, component or {component: share}]}, DIR/<name>.hlo.gz). Where the time of
a component goes, kernel by kernel, is the question before each optimisation (BENCHMARKS.md, sessions 22-24).
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys


def load_kernels(path: str) -> dict:
  with open(path) as f:
    return json.load(f)


def component_of(c) -> str:
  """The component of a kernel entry: a name, or the largest share of a {component: share} split."""
  if isinstance(c, str):
    return c
  return max(c, key=c.get) if c else "?"


def hlo_index(text: str) -> dict[str, tuple[str, str]]:
  """{instruction name: (result type, op_name metadata)} of every instruction of an optimised HLO text. Kernel
  names in a profile are HLO names with '.' spelled '_' (``input_reduce_fusion.400`` -> ``input_reduce_fusion_400``)."""
  out = {}
  for m in re.finditer(r"^\s*%([\w.\-]+) = (\S+(?: \S+)*?) (?:fusion|custom-call)\((.*)$", text, re.M):
    name, ty, rest = m.group(1), m.group(2), m.group(3)
    op = re.search(r'op_name="([^"]*)"', rest)
    out[name.replace(".", "_").replace("-", "_")] = (ty, op.group(1) if op else "")
  return out


def hlo_memcpy_candidates(text: str, launched=None) -> list[tuple[str, str, str]]:
  """[(name, result type, op_name)] of what may run as a memcpy node (the profile's `memcpy32_post` kernels, which
  have no HLO name of their own): copies outside fusions, and — given the profile's kernel names — slice fusions
  that launched no kernel under their own name (XLA emits a fusion that only moves a contiguous block as a
  device-to-device copy: session 28's 43 per step were the router bias sliced out of the packed parameters for
  the router kernel). Candidates, not proof: XLA also launches identical fusions as one kernel under one name."""
  out, fused = [], False
  for line in text.splitlines():
    if line and not line[0].isspace():  # a computation's header (or its closing brace)
      fused = line.lstrip("%").startswith(("fused", "ENTRY %fused"))
      continue
    m = re.match(r"^\s*(?:ROOT )?%([\w.\-]+) = (\S+(?: \S+)*?) (copy|copy-start|fusion)\((.*)$", line)
    if not m or fused:
      continue
    name, ty, kind, rest = m.groups()
    op = re.search(r'op_name="([^"]*)"', rest)
    op = op.group(1) if op else ""
    if kind == "fusion" and (launched is None or name.replace(".", "_").replace("-", "_") in launched
                             or not ("slice" in name or op.rsplit("/", 1)[-1] == "slice")):
      continue
    out.append((name, ty, op))
  return out


def rows(kernels: dict, index: dict, components=None, min_launches: float = 0.0):
  """[(component, µs per launch, launches, name, result type, op)] sorted by component, then time per step."""
  out = []
  for name, (us, launches, comp) in kernels.items():
    comp = component_of(comp)
    if (components and comp not in components) or launches < min_launches:
      continue
    ty, op = index.get(name, ("", ""))
    out.append((comp, us / max(launches, 1e-9), launches, name, ty, op.replace("jit(body)/shard_map/", "")))
  return sorted(out, key=lambda r: (r[0], -r[1] * r[2]))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("kernels")
  p.add_argument("--hlo", default=None, help="the step's optimised HLO (.hlo or .hlo.gz)")
  p.add_argument("--component", nargs="+", default=None)
  p.add_argument("--min-launches", type=float, default=0.0)
  a = p.parse_args(argv)
  kernels = load_kernels(a.kernels)
  index, copies = {}, []
  if a.hlo:
    opener = gzip.open if a.hlo.endswith(".gz") else open
    with opener(a.hlo, "rt") as f:
      text = f.read()
    index, copies = hlo_index(text), hlo_memcpy_candidates(text, set(kernels))
  table = rows(kernels, index, a.component, a.min_launches)
  totals: dict[str, list[float]] = {}
  for comp, per, n, *_ in table:
    t = totals.setdefault(comp, [0.0, 0.0])
    t[0] += per * n
    t[1] += n
  last = None
  for comp, per, n, name, ty, op in table:
    if comp != last:
      print(f"== {comp}: {totals[comp][0]:.0f} µs per step in {totals[comp][1]:.0f} launches (the kernels listed)")
      last = comp
    print(f"  {per:6.2f} µs x {n:4.0f}  {name:44s} {ty[:40]:40s} {op[-80:]}")
  if copies:
    print(f"== copies, and slice fusions that launched no kernel of their name (memcpy nodes?): {len(copies)}")
    by_op: dict[tuple[str, str], int] = {}
    for _, ty, op in copies:
      key = (ty[:40], op.replace("jit(body)/shard_map/", "")[-100:])
      by_op[key] = by_op.get(key, 0) + 1
    for (ty, op), n in sorted(by_op.items(), key=lambda kv: -kv[1]):
      print(f"  x {n:4d}  {ty:40s} {op}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
