"""The decode kernels' code on a machine without a GPU: PTX instructions, registers and spills per kernel form.

Mosaic GPU compiles a kernel to PTX and runs ptxas when XLA compiles the program; with the CUDA PJRT plugin's
compile-only H200 topology (``step_census.compile_only_devices``) that happens on the CPU, and Mosaic's dump
(``MOSAIC_GPU_DUMP_PTX=1``, ``MOSAIC_GPU_DUMP_TO=DIR``: read when a kernel is compiled) keeps each kernel's PTX and
ptxas report. This script compiles the named kernel forms at one TP4 rank's shapes and prints, per kernel: PTX
instruction lines (static code: a loop body counts once), registers per thread, spill bytes, the e4m3x2 -> f16x2
conversions, and three code shapes that cost latency-bound kernels (``_lint``: SMEM store -> load turns, mbarrier
arrivals, scalar GMEM loads). A CPU-side proxy for where a latency-bound kernel's instructions go (session 66:
the sparse MLA's dequantisation, 3.4 of a block's ~7.5 µs on an H100, was 2,545 of its kernel's 3,430 PTX
instructions) — not a timing: the GPU decides that (``bench_kernel_profile.py``).

  python benchmarks/ptx_census.py [--cases mla_1x4,mla2_1x4,mlas_1x4,mla2s_1x4,mhc_row] [--keep DIR] 2> /dev/null

(Mosaic's dumper also asks for nvdisasm, which the CPU machines lack: one harmless error line per kernel on
stderr.) A kernel already compiled by an earlier case (the same module) is not dumped again.

Cases: ``mla_BxT`` the sparse MLA attention (16 heads, 2,051 positions; lean, the merge kernel) for B sequences of
T query tokens, its forms by prefix as in bench_kernel_profile (``mla2_`` two warpgroups, ``mlas_`` the scales
after the MMAs, ``mla2s_`` both, ``mlag_`` scales after + one gather arrival per group); ``mhc_row`` the one-row
mHC boundary as the step runs it (lean, x16, counters), ``mhc_row_scalars`` with its normalisation on scalars,
``mhc_row_ll`` with its partial sums by the low-latency exchange (policy knob mhc_ll_exchange);
``kda_BxT`` the KDA recurrence as the step runs it (the conv in it, the norm's partial sums), ``kdao_BxT`` the
recurrence, gated norm and o_proj as one grid (policy knob kda_o_grid).
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MLA_FORMS = {"mla_": {}, "mla2_": dict(warpgroups=2), "mlas_": dict(scales_after=True),
             "mla2s_": dict(warpgroups=2, scales_after=True), "mlag_": dict(scales_after=True, group_arrival=True)}


def _case(name: str, sds):
  """name -> (function, abstract arguments) at one TP4 rank's shapes; ``sds(shape, dtype)`` makes an argument."""
  import jax.numpy as jnp  # noqa: PLC0415

  from pallas_kernels import mhc as km  # noqa: PLC0415
  from pallas_kernels import sparse_mla as M  # noqa: PLC0415
  for prefix, kw in MLA_FORMS.items():
    if name.startswith(prefix):
      B, T = (int(v) for v in name[len(prefix):].split("x"))
      args = (sds((B, T, 16, M.D_LATENT), jnp.bfloat16), sds((B, 32768, M.ROW_WORDS), jnp.int32),
              sds((B, T, 2051), jnp.int32))
      return (lambda q, c, i, kw=kw: M.sparse_mla_decode(q, c, i, softmax_scale=1 / 16, combine="kernel",
                                                          lean=True, **kw)), args
  if name in ("mhc_row", "mhc_row_scalars", "mhc_row_ll"):  # (policy knobs mhc_row_scalars, mhc_ll_exchange)
    from glm5_jax import config as C  # noqa: PLC0415
    cfg, N, D = C.real(), km.N, 4096
    args = (sds((1, N * D), jnp.bfloat16), sds((1, D), jnp.bfloat16),
            (sds((N, km.ROWS), jnp.float32), sds((N * N, km.ROWS), jnp.float32)), sds((km.MIX, N * D), jnp.bfloat16),
            sds((km.MIX + 3,), jnp.float32), sds((D,), jnp.bfloat16),
            sds((2 + (km.LL_WORDS if name == "mhc_row_ll" else 0),), jnp.int32))
    consts = dict(eps=cfg.hc_eps, hc_norm_eps=cfg.rms_norm_eps, norm_eps=cfg.rms_norm_eps)
    return (lambda X, y, mix, fn, coef, w, ctr: km.mhc_row_boundary(
        X, y, mix, fn, coef, w, **consts, approx_math=True, lean=True, x16=True, counters=ctr,
        scalars=name == "mhc_row_scalars", ll=name == "mhc_row_ll")), args
  if name.startswith(("kda_", "kdao_")):  # the KDA recurrence as the step runs it (kda_conv, norm partials), kdao_:
    # with the gated norm and o_proj as one grid (policy knob kda_o_grid)
    from pallas_kernels import kda_decode as kd  # noqa: PLC0415
    from pallas_kernels import linear as kl  # noqa: PLC0415
    B, T = (int(v) for v in name.split("_")[1].split("x"))
    H, f32, bf16 = 16, jnp.float32, jnp.bfloat16
    args = (sds((B, T, 3, H, 128), bf16), sds((B, 3, 3, H, 128), bf16), sds((4, 3, H, 128), f32),
            sds((B, T, 2 * H, 128), f32), sds((B, T, 272), bf16), sds((H,), f32), sds((H, 128), f32),
            sds((B, max(T, 4), H, 128, 128), f32), sds((B,), jnp.int32))
    cfg = kd.KdaDecodeConfig(token_loop=True, approx_math=True)
    if name.startswith("kda_"):
      return (lambda *a: kd.kda_decode_conv(*a, b_offset=16, config=cfg, norm_partials=True)), args
    return (lambda *a: kd.kda_decode_o_proj(*a[:-2], a[-2], a[-1], kl.splitk_counters(), b_offset=16,
                                            config=cfg)), (*args, sds((128,), f32), sds((4096, H * 128), bf16))
  raise SystemExit(f"ptx_census: unknown case {name!r} (mla_BxT, mla2_BxT, mlas_BxT, mla2s_BxT, mlag_BxT, mhc_row, "
                   "mhc_row_scalars, mhc_row_ll, kda_BxT, kdao_BxT)")


def summarise(dump_dir: str):
  """Each kernel's dump in ``dump_dir`` -> {kernel: dict(ptx=instruction lines, registers, spill bytes, cvt)}."""
  out = {}
  for ptx in sorted(glob.glob(os.path.join(dump_dir, "*.ptx"))):
    kernel = os.path.basename(ptx)[:-4]
    text = open(ptx).read()
    instr = sum(1 for ln in text.splitlines() if re.match(r"\s+(@%?\w+\s+)?[a-z]", ln) and not ln.strip().startswith("//"))
    rep = open(ptx[:-4] + ".ptxas").read() if os.path.exists(ptx[:-4] + ".ptxas") else ""
    regs = re.search(r"Used (\d+) registers", rep)
    spill = sum(int(v) for v in re.findall(r"(\d+) bytes spill (?:stores|loads)", rep))
    out[kernel] = dict(ptx=instr, registers=int(regs.group(1)) if regs else None, spill=spill,
                       cvt=text.count("cvt.rn.f16x2.e4m3x2"), **_lint(text))
  return out


def _lint(text: str) -> dict:
  """Two code shapes session 67 found costing a latency-bound kernel ~1 µs each on an H100, counted statically:
  ``turns`` — an SMEM load following an SMEM store (ptxas keeps a shared load behind the shared stores before it
  when it cannot tell the buffers apart: a loop of load-compute-store runs its loads one round trip at a time;
  the mHC boundary's 24 logits were 24 such turns), ``arrives`` — mbarrier arrive instructions (in Pallas' Lane
  semantics each is executed by all 128 threads of a warpgroup: the sparse MLA's gathers paid 4 per 4-row group),
  and ``gscalar`` — scalar GMEM loads (an L2 round trip each where their result is needed at once: the boundary's
  barrier parity and coefficients sat on its path)."""
  prev, turns = None, 0
  for m in re.finditer(r"^\s+(ld|st)\.shared", text, flags=re.M):
    turns += prev == "st" and m.group(1) == "ld"
    prev = m.group(1)
  return dict(turns=turns, arrives=len(re.findall(r"mbarrier\.arrive", text)),
              gscalar=len(re.findall(r"^\s+ld\.global\.(?:b32|f32|u32|s32)\s", text, flags=re.M)))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--cases", default="mla_1x4,mla2_1x4,mlas_1x4,mla2s_1x4,mhc_row")
  p.add_argument("--keep", default=None, help="keep the dumps under this folder (default: a temporary one)")
  a = p.parse_args(argv)
  from step_census import compile_only_devices  # noqa: PLC0415
  devices = compile_only_devices()
  import jax  # noqa: PLC0415
  sharding = jax.sharding.SingleDeviceSharding(devices[0])
  sds = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)  # noqa: E731
  root = a.keep or tempfile.mkdtemp(prefix="ptx_census_")
  rows = collections.OrderedDict()
  for name in a.cases.split(","):
    fn, args = _case(name, sds)
    d = os.path.join(root, name)
    os.makedirs(d, exist_ok=True)
    os.environ["MOSAIC_GPU_DUMP_PTX"], os.environ["MOSAIC_GPU_DUMP_TO"] = "1", d  # (read when a kernel compiles)
    jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).compile()
    for f in glob.glob(os.path.join(d, "*.mlir-passes.log")):  # (the pass pipeline's dumps: megabytes, unused here)
      os.remove(f)
    rows[name] = summarise(d)
  print(f"# PTX of the decode kernels, compiled for {devices[0].device_kind} (compile-only, ptxas on the CPU)")
  print("| case | kernel | PTX instructions | registers | spill bytes | e4m3x2 conversions | SMEM store -> load "
        "turns | mbarrier arrives | scalar GMEM loads |")
  print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
  for name, kernels in rows.items():
    for kernel, r in kernels.items():
      print(f"| {name} | {kernel} | {r['ptx']:,} | {r['registers']} | {r['spill']} | {r['cvt']} | {r['turns']} | "
            f"{r['arrives']} | {r['gscalar']} |")
  return rows


if __name__ == "__main__":
  main()
