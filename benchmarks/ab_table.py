"""A/B table of interleaved decode benchmarks (bench_decode.py --interleave with several --policy JSONs,
--steps-per-call values or backends): each configuration against the group's baseline, with the spread of the
timed repeats, as markdown — and whether the difference exceeds that spread (the hosts drift: session 28).

  python benchmarks/ab_table.py RESULTS.jsonl [--baseline '{}'] [--since 2026-12-02]

Rows are grouped by what an A/B keeps fixed (geometry, batch, q, context, the invocation — its start time, or
the date for older rows — and note); within a group the baseline is the row with the given policy (default: the
empty one), one step per call and latency_specialized where present, else the first row. "clear" means the two
repeat ranges do not overlap ("?" for rows recorded before the repeats were stored). "paired" compares round by
round: an interleaved run times every configuration once per round, so repeat i of two rows ran minutes apart at
most, while the host's speed drifts between rounds (session 36: every configuration 4.64 -> 4.93 ms from round 4
on) — the median of the per-round differences and in how many rounds the configuration was faster, the first
round (the warm-up) left out. "verdict" applies the project's rule for a default (README, policy knobs): faster
in at least 3 of every 4 paired rounds — "faster"; slower in at least 3 of 4 — "slower"; else "tie" (fewer than 2
paired rounds: "?"). The rule's other half, the knob's GPU tests passing natively, is not in the results.
"""

from __future__ import annotations

import argparse
import json
import sys


def label(r: dict) -> str:
  spc = r.get("steps_per_call", 1)
  parts = [r["backend"], json.dumps(r.get("policy") or {}, sort_keys=True)]
  if spc > 1:
    parts.append(f"{spc} steps/call" + (" unrolled" if r.get("unroll_steps") else ""))
  if not r.get("pack_params", 1):
    parts.append("unpacked")
  return " ".join(parts)


def spread(r: dict) -> tuple[float, float] | None:
  """(min, max) of the timed repeats; None for rows recorded before bench_decode stored them (session 29)."""
  reps = r.get("ms_repeats")
  return (min(reps), max(reps)) if reps else None


def round_diffs(r: dict, base: dict) -> list[float] | None:
  """The per-round differences to the baseline (ms), the first round left out; None without paired repeats."""
  a, b = r.get("ms_repeats") or [], base.get("ms_repeats") or []
  if len(a) != len(b) or len(a) < 2:
    return None
  return sorted(x - y for x, y in zip(a[1:], b[1:]))


def paired(r: dict, base: dict) -> str:
  """The median per-round difference to the baseline (rounds after the first) and the rounds it was faster in."""
  d = round_diffs(r, base)
  if d is None:
    return "?"
  med = d[len(d) // 2] if len(d) % 2 else (d[len(d) // 2 - 1] + d[len(d) // 2]) / 2
  return f"{med:+.2f} ms, faster in {sum(x < 0 for x in d)}/{len(d)}"


def verdict(r: dict, base: dict) -> str:
  """The default rule on the paired rounds: "faster" / "slower" in >= 3 of every 4, else "tie"."""
  d = round_diffs(r, base)
  if d is None or len(d) < 2:
    return "?"
  if 4 * sum(x < 0 for x in d) >= 3 * len(d):
    return "faster"
  if 4 * sum(x > 0 for x in d) >= 3 * len(d):
    return "slower"
  return "tie"


def groups(rows: list[dict]) -> dict[tuple, list[dict]]:
  out: dict[tuple, list[dict]] = {}
  for r in rows:
    key = (r.get("geometry"), r.get("layers"), r.get("tp", 1), r["batch"], r["q"], r.get("context"),
           r.get("run") or r.get("date"), r.get("note", ""))
    out.setdefault(key, []).append(r)
  return out


def pick_baseline(rows: list[dict], policy: dict) -> dict:
  def score(r):
    return ((r.get("policy") or {}) == policy, r.get("steps_per_call", 1) == 1,
            r["backend"] == "latency_specialized")
  return max(rows, key=score)  # (max keeps the first of equal scores)


def table(rows: list[dict], policy: dict) -> list[str]:
  """Markdown lines: one table per group of interleaved rows."""
  lines = []
  for key, rs in groups([r for r in rows if r.get("interleaved")]).items():
    if len(rs) < 2:
      continue
    base = pick_baseline(rs, policy)
    bs = spread(base)
    geometry, layers, tp, batch, q, ctx, date, note = key
    lines += [f"{geometry} ({layers} layers, TP{tp}) B = {batch}, q = {q}, context {ctx} — {date} {note}".rstrip(),
              "", "| configuration | ms/step | repeats (min–max) | vs baseline | clear? | paired (rounds 2+) | verdict |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rs:
      sp = spread(r)
      if r is base:
        vs, clear, pr, vd = "baseline", "", "", ""
      else:
        d = r["ms_per_step"] - base["ms_per_step"]
        vs = f"{d:+.2f} ms ({100 * d / base['ms_per_step']:+.1f} %)"
        clear = "?" if sp is None or bs is None else "yes" if (sp[1] < bs[0] or sp[0] > bs[1]) else "no"
        pr, vd = paired(r, base), verdict(r, base)
      rng = "—" if sp is None else f"{sp[0]:.2f}–{sp[1]:.2f}"
      lines.append(f"| {label(r)} | {r['ms_per_step']:.2f} | {rng} | {vs} | {clear} | {pr} | {vd} |")
    lines.append("")
  return lines


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("results", nargs="+")
  p.add_argument("--baseline", default="{}", help="the baseline's policy JSON (default: the empty policy)")
  p.add_argument("--since", default=None, help="only rows dated on or after this day (YYYY-MM-DD)")
  a = p.parse_args(argv)
  rows = [json.loads(line) for f in a.results for line in open(f) if line.strip()]
  rows = [r for r in rows if a.since is None or r.get("date", "") >= a.since]
  lines = table(rows, json.loads(a.baseline))
  if not lines:
    raise SystemExit("no interleaved groups of two or more rows (bench_decode.py --interleave)")
  sys.stdout.write("\n".join(lines) + "\n")


if __name__ == "__main__":
  main()
