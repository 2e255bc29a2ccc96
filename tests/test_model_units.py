"""Units of the reference model: the chunked KDA form, and the checkpoint loader's layouts and errors."""

import contextlib
import functools
import json
import os
import shutil

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
import pytest

import glm5_jax
from checkpoints import make_tiny
from pallas_kernels._common import maybe_interpret
from conftest import tol
from glm5_jax.attention import ABSORB_ROWS, _per_head, kda_chunked, l2norm
from glm5_jax.checkpoint import CheckpointError
from glm5_jax.layers import unroll_loops, use_kernels
from helpers import load, tiny_checkpoint
from pallas_kernels.kda_decode import kda_decode_reference


def _chunked_kda_case(B, T, H, D, decay: float = 0.0):
  """Fresh random inputs of kda_chunked (the safe gate's log-decays, l2-normalised q / k) -> (its arguments, the
  per-token recurrence's outputs [B, T, H, D] and state after the last token). ``decay``: added to the gate's
  input (large: every log-decay near the bound, −5 a token)."""
  rng = np.random.default_rng()
  r = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
  q, k, v, f, b = r(B, T, H, D), r(B, T, H, D), r(B, T, H, D), r(B, T, H, D) + decay, r(B, T, H)
  A_log, dt = r(H) * 0.5, jnp.asarray(np.log(np.expm1(np.exp(rng.uniform(np.log(1e-3), np.log(0.1), (H, D))))),
                                       jnp.float32)
  S0 = r(B, 1, H, D, D) * 0.1
  o_ref, s_ref = kda_decode_reference(q, k, v, f, b, A_log, dt, jnp.broadcast_to(S0, (B, T, H, D, D)),
                                      jnp.ones(B, jnp.int32))
  g = -5.0 * jax.nn.sigmoid(jnp.exp(A_log)[:, None] * (f + dt))
  return (l2norm(q) * D ** -0.5, l2norm(k), v, g, jax.nn.sigmoid(b), S0[:, 0]), o_ref, s_ref[:, T - 1]


@pytest.mark.parametrize("T,chunk,arch", [(70, 16, None), (9, 32, None), (33, 32, None), (70, 16, "sm_90")])
def test_chunked_kda_equals_the_recurrence(T, chunk, arch):
  """arch: traced as for that GPU (layers.unroll_loops: the chunks' state hand-over unrolled, as a GPU runs it)."""
  args, o_ref, s_ref = _chunked_kda_case(2, T, 3, 32)
  with use_kernels({}, arch) if arch else contextlib.nullcontext():
    f = functools.partial(kda_chunked, chunk=chunk)
    scan, = [e for e in jax.make_jaxpr(f)(*args).eqns if e.primitive.name == "scan"]
    assert scan.params["unroll"] == (-(-T // chunk) if unroll_loops() else 1)
    assert unroll_loops() == (arch is not None or jax.default_backend() != "cpu")
    o, S = f(*args)
  np.testing.assert_allclose(np.asarray(o), np.asarray(o_ref), **tol("fp32_paths"))
  np.testing.assert_allclose(np.asarray(S), np.asarray(s_ref), **tol("fp32_paths"))


@pytest.mark.parametrize("T,chunk", [(40, 16), (33, 32)])
def test_chunked_kda_handover_kernel_equals_the_recurrence(T, chunk):
  """kda_chunked with the hand-over as the Mosaic GPU kernel (policy knob kda_handover; GPU interpret mode): the
  outputs and the final state equal the per-token recurrence, and the XLA chain's, at the real head dim (the
  kernel's state rows: 128), 3 and 2 sub-chunks (the last partial); the kernel alone against its reference in
  test_kda_prefill_kernel_interpret."""
  args, o_ref, s_ref = _chunked_kda_case(1, T, 2, 128)
  o_x, S_x = kda_chunked(*args, chunk=chunk)
  with maybe_interpret(True):
    jaxpr = str(jax.make_jaxpr(functools.partial(kda_chunked, chunk=chunk, handover_kernel=True))(*args))
    o, S = kda_chunked(*args, chunk=chunk, handover_kernel=True)
  assert "glm5_kda_handover" in jaxpr
  np.testing.assert_allclose(np.asarray(o), np.asarray(o_ref), **tol("fp32_paths"))
  np.testing.assert_allclose(np.asarray(S), np.asarray(s_ref), **tol("fp32_paths"))
  np.testing.assert_allclose(np.asarray(o), np.asarray(o_x), **tol("fp32_paths"))
  np.testing.assert_allclose(np.asarray(S), np.asarray(S_x), **tol("fp32_paths"))


@pytest.mark.parametrize("T,chunk,decay", [(70, 32, 0.0), (45, 32, 30.0), (9, 32, 30.0), (40, 16, 0.0)])
def test_chunked_kda_pairwise_gemm_equals_the_recurrence(T, chunk, decay):
  """kda_chunked's pairwise terms as GEMMs about each sub-chunk's middle token (policy knob kda_chunk_gemm): the
  outputs and final state within the fp32 paths' tolerance of the per-token recurrence and of the pairwise-exponent
  form — random gates, and every gate at its bound (decay 30: log-decays −5 a token, the factors up to e^±80 and
  the anti-causal entries overflowing before the select drops them); a partial last sub-chunk, one shorter than the
  sub-chunk size, 16-token sub-chunks; no non-finite value in the outputs."""
  args, o_ref, s_ref = _chunked_kda_case(1, T, 2, 128, decay)
  if decay:
    assert float(jnp.min(args[3])) < -4.99  # (the bound: −5 a token)
  o_x, S_x = kda_chunked(*args, chunk=chunk)
  f = functools.partial(kda_chunked, chunk=chunk, pairwise_gemm=True)
  jaxpr = str(jax.make_jaxpr(f)(*args))
  o, S = f(*args)
  C = min(chunk, T)  # (no [.., C, C, K] tensor of pairwise exponents: the pairwise form has them)
  pairwise = f"{C},{C},128]"
  assert pairwise not in jaxpr and pairwise in str(jax.make_jaxpr(functools.partial(kda_chunked, chunk=chunk))(*args))
  assert np.isfinite(np.asarray(o)).all() and np.isfinite(np.asarray(S)).all()
  for got, want in ((o, o_ref), (S, s_ref), (o, o_x), (S, S_x)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **tol("fp32_paths"))


@pytest.mark.parametrize("knob", ["kda_chunk_gemm"])
def test_chunked_kda_knob_at_the_model_site(knob):
  """Policy knob kda_chunk_gemm at the model's KDA sites as a prefill chunk runs it (every other
  knob off; kernel-tiny in f32, a 13-token prompt in two 8-row chunks): the trunk's hidden states within the fp32
  paths' tolerance of the default form's; the knob's sites reported (one per KDA layer and chunk program)."""
  from glm5_jax.layers import KERNEL_DEFAULTS  # noqa: PLC0415
  from glm5_jax.runtime import DecodeConfig  # noqa: PLC0415
  from glm5_jax.speculative import Decoder  # noqa: PLC0415
  from helpers import target_hidden_in_chunks  # noqa: PLC0415
  m = load(tiny_checkpoint("kernel-tiny", 4, "fp8", n_routed_experts=4), "float32")
  toks = np.random.default_rng().integers(0, 2000, (1, 13)).astype(np.int32)
  hs = {}
  for on in (False, True):
    pol = tuple(sorted({**{k: False for k in KERNEL_DEFAULTS}, knob: on, "kv_cache_dtype": "auto"}.items()))
    dec = Decoder(m, DecodeConfig(max_context=64, q=2, capture_sizes=(1,), policy=pol), backend="latency_specialized",
                  prefill_chunk=8)
    hs[on], rep = target_hidden_in_chunks(dec, m, toks, 13, 8, dec.prefill_kernel_mode())
    assert ((knob, None) in rep) == on, rep
  np.testing.assert_allclose(hs[True], hs[False], **tol("fp32_paths"))
  dec.prefill([toks[0]])  # (the knob on)
  kda_layers = sum(t == "linear_attention" for t in m.cfg.layer_types)
  assert dec.prefill_sites[knob]["sites"] == kda_layers > 0


@pytest.mark.gpu
@pytest.mark.parametrize("T,decay", [(512, 0.0), (70, 0.0), (512, 30.0)])
def test_chunked_kda_pairwise_gemm_gpu(T, decay):
  """Natively (XLA's GPU dots): the pairwise terms as GEMMs (kda_chunk_gemm, on by default) and the pairwise-exponent
  form each against the per-token recurrence, and against each other — a 512-token chunk of 16 heads at the real
  head dim (random gates, and every gate at its bound), and a partial last sub-chunk; the fp32 paths' tolerance.
  (Its first form also held the since removed BF16_BF16_F32_X6 products: a case with random gates failed there by
  1.7e-4, session 81 — which form failed the log did not keep.)"""
  args, o_ref, s_ref = _chunked_kda_case(1, T, 16 if T == 512 else 2, 128, decay)

  def run(**kw):  # (without XLA's autotuning: the f32 pairwise form's concatenation autotunes for minutes, session 80)
    return jax.jit(functools.partial(kda_chunked, **kw)).lower(*args).compile(
        compiler_options={"xla_gpu_autotune_level": 0})(*args)
  o_x, S_x = run()
  o, S = run(pairwise_gemm=True)
  for got, want, what in ((o_x, o_ref, "pairwise form"), (S_x, s_ref, "pairwise form"), (o, o_ref, "GEMMs"),
                          (S, s_ref, "GEMMs"), (o, o_x, "GEMMs vs pairwise"), (S, S_x, "GEMMs vs pairwise")):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), err_msg=what, **tol("fp32_paths"))


def test_sharded_checkpoint_loads_like_one_file(tmp_path):
  cfg = make_tiny.preset_config("oracle-tiny")
  make_tiny.write_checkpoint(cfg, tmp_path / "one", seed=5, dtype="fp8")
  make_tiny.write_checkpoint(cfg, tmp_path / "three", seed=5, dtype="fp8", shards=3)
  assert os.path.exists(tmp_path / "three" / "model.safetensors.index.json")
  a, b = glm5_jax.load_model(tmp_path / "one"), glm5_jax.load_model(tmp_path / "three")
  assert a.fp8 and a.mtp
  for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
    assert x.dtype == y.dtype
    np.testing.assert_array_equal(np.asarray(x.astype(jnp.float32)), np.asarray(y.astype(jnp.float32)))
  kept = a.module().layers[0].mlp.gate_proj  # FP8 stays FP8 + scales in memory
  assert kept.weight.dtype == jnp.float8_e4m3fn and kept.scale.dtype == jnp.float32


def _copy(src, dst):
  shutil.copytree(src, dst)
  return dst


def _rewrite(path, drop=(), add=None, reshape=None):
  """Rewrite model.safetensors without some tensors / with extra ones / with one reshaped."""
  from glm5_jax.checkpoint import SafetensorsIndex  # noqa: PLC0415
  idx = SafetensorsIndex(str(path))
  t = {n: np.array(idx.array(n)) for n in idx.entries if n not in drop}
  if reshape:
    n, shape = reshape
    t[n] = np.zeros(shape, t[n].dtype) + 1
  t.update(add or {})
  make_tiny.write_safetensors(os.path.join(path, "model.safetensors"), t, {"format": "pt"})


W = "model.language_model.layers.0.self_attn.q_proj.weight"
WK = "model.language_model.layers.3.self_attn.indexer.wk.weight"  # one of three matrices held as one weight
S = "model.language_model.layers.0.mlp.gate_proj.weight_scale_inv"


def _truncate(p):
  f = os.path.join(p, "model.safetensors")
  with open(f, "r+b") as fh:
    fh.truncate(os.path.getsize(f) - 100)


def _model_type(p):
  cfgj = json.load(open(os.path.join(p, "config.json")))
  cfgj["model_type"] = "qwen3"
  json.dump(cfgj, open(os.path.join(p, "config.json"), "w"))


@pytest.mark.parametrize("mutate,exc,msg", [
    (lambda p: _rewrite(p, drop=[W]), CheckpointError, rf"missing tensor '{W}': expected shape \[128, 256\]"),
    (lambda p: _rewrite(p, reshape=(W, (64, 256))), CheckpointError,
     rf"tensor '{W}' has shape \[64, 256\]: expected \[128, 256\]"),
    (lambda p: _rewrite(p, add={"model.language_model.layers.0.self_attn.bogus.weight": np.ones((2, 2), np.float32)}),
     CheckpointError, r"unexpected tensors .*bogus"),
    (lambda p: _rewrite(p, drop=[S]), CheckpointError, rf"missing tensor '{S}'"),
    (_truncate, CheckpointError, "is truncated"),
    (_model_type, ValueError, "model_type='qwen3' is not supported"),
    (lambda p: _rewrite(p, add={W: np.ones((128, 256), np.int32)}), CheckpointError,
     rf"tensor '{W}' has dtype I32: expected a float tensor"),
    (lambda p: _rewrite(p, drop=[WK]), CheckpointError, rf"missing tensor '{WK}': expected \[rows, 256\], one of"),
    (lambda p: _rewrite(p, reshape=(WK, (8, 256))), CheckpointError, r"tensors \[.*wk.weight.*\] have \[8, "),
], ids=["missing", "shape", "extra", "fp8-without-scale", "truncated", "model-type", "dtype", "concat-missing",
        "concat-rows"])
def test_loader_errors_name_the_tensor(tmp_path, mutate, exc, msg):
  p = _copy(tiny_checkpoint("oracle-tiny", 0, "fp8"), tmp_path / "ck")
  mutate(p)
  with pytest.raises(exc, match=msg):
    glm5_jax.load_model(p)


def test_fp8_concat_holds_the_checkpoint_rows():
  """q_a and kv_a as one FP8 weight (ConcatLinear) where the scale blocks allow: weight and block-scale rows are the
  checkpoint's own matrices one after another (kernel-tiny: 256 + 512 rows); where they do not (oracle-tiny: 96 +
  64 rows with 128-row blocks) the two linears stay apart."""
  from glm5_jax.checkpoint import SafetensorsIndex  # noqa: PLC0415
  path = tiny_checkpoint("kernel-tiny", 0, "fp8")
  m = load(path, "bfloat16")
  idx = SafetensorsIndex(path)
  layer = next(i for i, t in enumerate(m.cfg.layer_types) if t != "linear_attention")
  attn = m.params["layers"][layer]["self_attn"]
  pre = f"model.language_model.layers.{layer}.self_attn."
  for leaf, suffix in (("weight", ".weight"), ("scale", ".weight_scale_inv")):
    got = np.asarray(attn["qkv_a_proj"][leaf][...]).view(np.uint8 if leaf == "weight" else np.float32)
    want = np.concatenate([np.asarray(idx.array(pre + n + suffix)).view(got.dtype)
                           for n in ("q_a_proj", "kv_a_proj_with_mqa")])
    np.testing.assert_array_equal(got, want)
  small = load(tiny_checkpoint("oracle-tiny", 0, "fp8"), "bfloat16")
  a = small.params["layers"][3]["self_attn"]
  assert "q_a_proj" in a and "kv_a_proj_with_mqa" in a and "qkv_a_proj" not in a


def test_kda_small_projections_hold_the_checkpoint_matrices():
  """f_a, g_a and b as the rows of one weight (fgb_a_proj); f_b and g_b block-diagonally (fg_b_proj [2, C, 2r]:
  entry 0 = [f_b | 0], entry 1 = [0 | g_b]), exactly the checkpoint's matrices."""
  from glm5_jax.checkpoint import SafetensorsIndex  # noqa: PLC0415
  path = tiny_checkpoint("oracle-tiny", 0, "float32")
  m = load(path, "float32")
  idx = SafetensorsIndex(path)
  attn = m.params["layers"][0]["self_attn"]
  pre = "model.language_model.layers.0.self_attn."
  w = lambda n: np.asarray(idx.array(pre + n + ".weight"), np.float32)  # noqa: E731
  np.testing.assert_array_equal(np.asarray(attn["fgb_a_proj"]["weight"][...]),
                                np.concatenate([w("f_a_proj"), w("g_a_proj"), w("b_proj")]))
  fb, gb = w("f_b_proj"), w("g_b_proj")
  r = fb.shape[1]
  want = np.zeros((2, fb.shape[0], 2 * r), np.float32)
  want[0, :, :r], want[1, :, r:] = fb, gb
  np.testing.assert_array_equal(np.asarray(attn["fg_b_proj"]["weight"][...]), want)


def test_missing_checkpoint_directory(tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    glm5_jax.load_model(tmp_path / "nowhere")


def test_forward_rejects_bad_tokens():
  m = load(tiny_checkpoint("oracle-tiny", 0, "float32"))
  with pytest.raises(ValueError, match=r"token id 512 is outside \[0, 512\)"):
    glm5_jax.forward(m, np.array([[1, 512]]))
  with pytest.raises(ValueError, match=r"token id -3 is outside"):
    glm5_jax.forward(m, np.array([[-3, 1]]))
  with pytest.raises(ValueError, match=r"tokens must be int32 \[B, T\]: got shape \(3,\)"):
    glm5_jax.forward(m, np.array([1, 2, 3]))
  with pytest.raises(TypeError, match="integer token ids: got dtype float32"):
    glm5_jax.forward(m, np.array([[1.0, 2.0]], np.float32))


def _dots(jaxpr):
  """Every dot_general of a jaxpr, nested jaxprs (shard_map, pjit, loops, conds) included."""
  from jax._src import core  # noqa: PLC0415
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      yield eqn
    for sub in core.jaxprs_in_params(eqn.params):
      yield from _dots(sub)


@pytest.mark.parametrize("backend", ["auto", "latency_specialized"])
def test_fp32_step_has_no_reduced_precision_dots(backend):
  """fp32 means fp32 on every backend: a dot without precision=HIGHEST runs in TF32 on a GPU (the stock step's
  draft tokens then differed between the H200 and the CPU). Every f32 dot of the whole decode step is HIGHEST."""
  from glm5_jax.runtime import DecodeConfig  # noqa: PLC0415
  from glm5_jax.speculative import Decoder  # noqa: PLC0415
  from helpers import load, tiny_checkpoint  # noqa: PLC0415
  m = load(tiny_checkpoint("kernel-tiny", 4, "fp8"), "float32")
  dec = Decoder(m, DecodeConfig(max_context=64, q=3, capture_sizes=(1,), policy=()), backend=backend)
  dots = list(_dots(dec.trace_step(1).jaxpr.jaxpr))
  assert len(dots) > 30  # the check sees the step's dots (50 since the DSA absorptions are product + sum)
  low = [str(e.params.get("precision")) for e in dots
         if any(v.aval.dtype == jnp.float32 for v in e.invars)
         and e.params.get("precision") != (lax.Precision.HIGHEST, lax.Precision.HIGHEST)]
  assert not low, low


@pytest.mark.parametrize("N,k,ties", [(288, 8, False), (288, 8, True), (37, 5, True), (16, 16, True),
                                     (288, 8, "special")])
def test_topk_by_rank_equals_lax_top_k(N, k, ties):
  """The sort-free router top-k selects exactly lax.top_k's indices in its order, ties included (lower index
  first): random sigmoid scores + bias, values drawn from a few levels so that ties are everywhere, or with
  NaN, -NaN, ±0 and ±inf sprinkled in (lax.top_k's total order)."""
  from glm5_jax.layers import topk_by_rank  # noqa: PLC0415
  rng = np.random.default_rng()
  shape = (3, 5, N)
  if ties == "special":
    v = rng.standard_normal(shape).astype(np.float32)
    specials = np.array([np.nan, -np.nan, 0.0, -0.0, np.inf, -np.inf], np.float32)
    hit = rng.random(shape) < 0.1
    v[hit] = specials[rng.integers(0, len(specials), hit.sum())]
  elif ties:
    v = rng.integers(0, 4, shape).astype(np.float32) / 4
    v[0, 0] = -np.inf  # a row of equal values
  else:
    v = (1 / (1 + np.exp(-rng.standard_normal(shape))) + rng.standard_normal(N) * 1e-2).astype(np.float32)
  got = jax.jit(topk_by_rank, static_argnums=1)(jnp.asarray(v), k)
  want = lax.top_k(jnp.asarray(v), k)[1]
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  # the picked values of another array come out of the same select exactly (NaN / inf elsewhere do not leak)
  vals = rng.standard_normal(shape).astype(np.float32)
  vals[rng.random(shape) < 0.05] = np.nan
  ids, picked = jax.jit(topk_by_rank, static_argnums=1)(jnp.asarray(v), k, jnp.asarray(vals))
  np.testing.assert_array_equal(np.asarray(ids), np.asarray(want))
  np.testing.assert_array_equal(np.asarray(picked), np.take_along_axis(vals, np.asarray(want), axis=-1))


def test_router_topk_equals_sorting_router():
  """The router with the sort-free top-k (policy router_topk): the same experts as lax.top_k's, weights within an
  ulp (the renormalising sum is added in another association); and through the Mosaic router kernel (policy
  router_kernel, GPU interpret mode): the same experts and weights."""
  from flax import nnx  # noqa: PLC0415
  from glm5_jax import config as C  # noqa: PLC0415
  from glm5_jax.layers import Router, use_kernels  # noqa: PLC0415
  cfg = C.oracle_tiny().replace(n_routed_experts=288, num_experts_per_tok=8)
  r = nnx.eval_shape(lambda: Router(cfg, jnp.float32))
  rng = np.random.default_rng()
  r.weight.set_value(jnp.asarray(rng.standard_normal((288, cfg.hidden_size)) * 0.05, jnp.float32))
  r.e_score_correction_bias.set_value(jnp.asarray(rng.standard_normal(288) * 0.01, jnp.float32))
  x = jnp.asarray(rng.standard_normal((3, 4, cfg.hidden_size)), jnp.float32)
  with use_kernels(None):
    ids0, w0 = jax.jit(r.__call__)(x)
  with use_kernels({"router_topk": True, "router_kernel": False}):
    ids1, w1 = jax.jit(r.__call__)(x)
  np.testing.assert_array_equal(np.asarray(ids1), np.asarray(ids0))
  np.testing.assert_allclose(np.asarray(w1), np.asarray(w0), rtol=2.0 ** -22, atol=0)
  with maybe_interpret(True), use_kernels({"router_kernel": True}):
    ids2, w2 = jax.jit(r.__call__)(x)
  assert ids2.shape == (3, 4, 8) and w2.shape == (3, 4, 8)
  np.testing.assert_array_equal(np.asarray(ids2), np.asarray(ids0))
  np.testing.assert_allclose(np.asarray(w2), np.asarray(w0), **tol("kernel_f32"))


@pytest.mark.parametrize("N,k,kind,opts", [
    (8196, 512, "scores", {}), (8196, 512, "ties", {}), (700, 512, "masked", {}), (2000, 512, "special", {}),
    (600, 600, "ties", {}), (33000, 512, "ties", {}), (50, 64, "scores", {}),
    # the blocked prefix sum and 4-bit digits (bench_topk's variants)
    (8196, 512, "ties", dict(scan_block=128)), (700, 512, "masked", dict(scan_block=128, digit_bits=4)),
    (33000, 512, "ties", dict(scan_block=512)), (50, 64, "special", dict(scan_block=128, digit_bits=4)),
    (2000, 512, "special", dict(digit_bits=4, scan_block=128)), (600, 600, "ties", dict(scan_block=128)),
    # the threshold from the Mosaic kernel (GPU interpret mode here)
    (8196, 512, "ties", dict(scan_block=128, threshold_kernel=True)),
    (700, 512, "masked", dict(scan_block=128, threshold_kernel=True)),
    (300, 64, "special", dict(threshold_kernel=True)), (8196, 512, "ties", dict(scan_block=128, threshold_kernel=2)),
    (300, 64, "special", dict(threshold_kernel=2)),
    # the kernel's early exit (policy knob topk_threshold_exit): the threshold one below a candidate with k above
    (8196, 512, "scores", dict(scan_block=128, threshold_kernel=True, threshold_exit=True)),
    (2000, 512, "special", dict(threshold_kernel=2, threshold_exit=True))])
def test_topk_set_by_threshold_equals_lax_top_k_set(N, k, kind, opts):
  """The indexer's sort-free top-k selects exactly lax.top_k's SET (ties: the lower indices), returned in
  ascending index order: indexer-like scores, a few levels (ties everywhere, one row all equal), -inf beyond a
  random number of complete pools (fewer than k in some rows), NaN / ±0 / ±inf sprinkled in; N >= 2^15 takes
  the two-prefix-sum branch; k > N pads with -1."""
  from glm5_jax.layers import topk_set_by_threshold  # noqa: PLC0415
  rng = np.random.default_rng()
  shape = (2, 3, N)
  v = (rng.standard_normal(shape) * rng.uniform(0.1, 10)).astype(np.float32)
  if kind == "ties":
    v = (rng.integers(0, 5, shape) / 4).astype(np.float32)
    v[0, 0] = 0.5
  elif kind == "masked":
    n_ok = rng.integers(0, N, shape[:-1])
    n_ok[0, 0] = 3
    v = np.where(np.arange(N) < n_ok[..., None], v, -np.inf).astype(np.float32)
  elif kind == "special":
    specials = np.array([np.nan, -np.nan, 0.0, -0.0, np.inf, -np.inf], np.float32)
    hit = rng.random(shape) < 0.1
    v[hit] = specials[rng.integers(0, len(specials), hit.sum())]
  with maybe_interpret(True):
    got = np.asarray(jax.jit(lambda v: topk_set_by_threshold(v, k, **opts))(jnp.asarray(v)))
  kk = min(k, N)
  want = np.sort(np.asarray(lax.top_k(jnp.asarray(v), kk)[1]), axis=-1)
  np.testing.assert_array_equal(got[..., :kk], want)
  assert (got[..., kk:] == -1).all()


def test_topk_set_by_threshold_rejects_an_exit_without_the_kernel():
  from glm5_jax.layers import topk_set_by_threshold  # noqa: PLC0415
  with pytest.raises(ValueError, match="threshold_exit without threshold_kernel"):
    topk_set_by_threshold(jnp.ones((1, 256), jnp.float32), 8, threshold_exit=True)


@pytest.mark.parametrize("N,block", [(1000, None), (1000, 128), (8256, 128), (77, 512), (300, 7)])
def test_exclusive_prefix_sum(N, block):
  """Every form == numpy's cumsum."""
  from glm5_jax.layers import exclusive_prefix_sum  # noqa: PLC0415
  rng = np.random.default_rng()
  x = rng.integers(0, 1 << 10, (3, N)).astype(np.int32)
  got = np.asarray(jax.jit(lambda x: exclusive_prefix_sum(x, block))(jnp.asarray(x)))
  np.testing.assert_array_equal(got, np.cumsum(x, axis=-1) - x)


def test_stacked_linear_equals_its_separate_linears_and_the_kernel():
  """StackedLinear (the KDA q/k/v in one weight [3, out, in]) == the three matrices applied one by one, side by
  side; with the bf16 GEMV kernel on (GPU interpret mode on CPU) the same up to the kernel's summation order."""
  from flax import nnx  # noqa: PLC0415

  from glm5_jax.layers import StackedLinear, kernel_report, use_kernels  # noqa: PLC0415
  from pallas_kernels._common import maybe_interpret  # noqa: PLC0415
  rng = np.random.default_rng()
  lin = nnx.eval_shape(lambda: StackedLinear(256, 64, 3, jnp.bfloat16, (None, None)))
  w = jnp.asarray(rng.standard_normal((3, 64, 256)) * 0.05, jnp.bfloat16)
  lin.weight.set_value(w)
  x = jnp.asarray(rng.standard_normal((2, 3, 256)), jnp.bfloat16)
  f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
  want = np.concatenate([f32(x) @ f32(w[s]).T for s in range(3)], axis=-1)
  got = jax.jit(lambda x: lin(x, jnp.float32))(x)
  np.testing.assert_allclose(f32(got), want, **tol("fp32_paths"))
  with maybe_interpret(True), use_kernels({"bf16_linear": True}), kernel_report() as rep:
    kern = jax.jit(lambda x: lin(x, jnp.float32))(x)
  # (the kernel's site also decides its partials' layout and its K splits: policy knobs linear_part_rows and
  # bf16_balanced_splits, not in this policy)
  assert rep == [("bf16_linear", None), ("linear_part_rows", "off in the policy"),
                 ("bf16_balanced_splits", "off in the policy")]
  np.testing.assert_allclose(f32(kern), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("knob", ["kda_qkv_kernel", "kda_fg_b_kernel", "indexer_wq_kernel"])
def test_one_row_knob_takes_its_site(knob):
  """Policy kda_qkv_kernel / kda_fg_b_kernel / indexer_wq_kernel: the call with one_row=knob — the KDA q/k/v and
  fg_b StackedLinears', the indexer's wq_b Linear's — takes the bf16 GEMV kernel at one token row, where bf16_linear left to itself declines
  (ONE_ROW_GEMV); at several rows the knob has no site (the kernel runs anyway) and says so; off, XLA's GEMV. The
  values are the matrices' either way (GPU interpret mode: the K splits summed by XLA — the in-kernel sum on the
  counters is the GPU's, lowered in test_step_lowering)."""
  from flax import nnx  # noqa: PLC0415

  from glm5_jax.layers import ONE_ROW_GEMV, Linear, StackedLinear, kernel_report, use_kernels  # noqa: PLC0415
  from pallas_kernels._common import maybe_interpret  # noqa: PLC0415
  rng = np.random.default_rng()
  S = {"kda_qkv_kernel": 3, "kda_fg_b_kernel": 2}.get(knob, 1)
  w = jnp.asarray(rng.standard_normal((S, 64, 256)) * 0.05, jnp.bfloat16)
  if S > 1:
    lin = nnx.eval_shape(lambda: StackedLinear(256, 64, S, jnp.bfloat16, (None, None)))
    lin.weight.set_value(w)
  else:
    lin = nnx.eval_shape(lambda: Linear(256, 64, jnp.bfloat16, (None, None)))
    lin.weight.set_value(w[0])
  f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
  for rows, on, site, gemv in ((1, True, None, None), (1, False, "off in the policy", ONE_ROW_GEMV),
                               (3, True, "one token row (here 3", None)):
    x = jnp.asarray(rng.standard_normal((rows, 256)), jnp.bfloat16)
    with maybe_interpret(True), use_kernels({knob: on}), kernel_report() as rep:
      y = jax.jit(lambda x: lin(x, jnp.float32, one_row=knob))(x)
    got = dict(rep)
    assert (got[knob] if site is None else got[knob][:len(site)]) == site, rep
    assert got["bf16_linear"] == gemv, rep
    want = np.concatenate([f32(x) @ f32(w[s]).T for s in range(S)], axis=-1)
    np.testing.assert_allclose(f32(y), want, rtol=1e-5, atol=1e-5)


def test_a_default_switch_declines_where_xla_is_faster_and_an_explicit_one_forces():
  """bf16_linear on by default runs the GEMV kernel from 2 token rows and leaves one row to XLA (saying why); set
  explicitly it runs at one row too; off, nowhere. The kernel's result equals XLA's either way."""
  from flax import nnx  # noqa: PLC0415

  from glm5_jax.layers import ONE_ROW_GEMV, Linear, kernel_report, use_kernels  # noqa: PLC0415
  from pallas_kernels._common import maybe_interpret  # noqa: PLC0415
  rng = np.random.default_rng()
  lin = nnx.eval_shape(lambda: Linear(256, 128, jnp.bfloat16, (None, None)))
  lin.weight.set_value(jnp.asarray(rng.standard_normal((128, 256)) * 0.05, jnp.bfloat16))
  f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
  for rows, pol, want in ((1, {}, ONE_ROW_GEMV), (3, {}, None), (1, {"bf16_linear": True}, None),
                          (3, {"bf16_linear": False}, "off in the policy")):
    x = jnp.asarray(rng.standard_normal((rows, 256)), jnp.bfloat16)
    with maybe_interpret(True), use_kernels(pol), kernel_report() as rep:
      y = jax.jit(lambda x: lin(x, jnp.float32))(x)
    # (where the kernel runs, its site also decides its partials' layout and its K splits: linear_part_rows and
    # bf16_balanced_splits, off in these policies)
    off = [("linear_part_rows", "off in the policy"), ("bf16_balanced_splits", "off in the policy")]
    assert rep == [("bf16_linear", want)] + (off if want is None else []), (rows, pol, rep)
    np.testing.assert_allclose(f32(y), f32(x) @ f32(lin.weight[...]).T, rtol=1e-5, atol=1e-5)


def test_router_logits_as_a_bf16_product():
  """Policy knob bf16_products where XLA computes the router's logits (past the GEMV kernel's rows: a prefill chunk):
  bf16 x times the bf16 weight with f32 sums — the f32 product's exact terms in another order: the logits within
  float rounding, the same experts; its lowering's product takes the bf16 operands; f32 inputs decline it, saying
  why; one token row (a decode step's router) keeps the f32 product."""
  from flax import nnx  # noqa: PLC0415
  from helpers import has_bf16_product  # noqa: PLC0415

  from glm5_jax import config as C  # noqa: PLC0415
  from glm5_jax.layers import MAX_KERNEL_ROWS, Router, kernel_report  # noqa: PLC0415
  cfg = C.oracle_tiny().replace(n_routed_experts=288, num_experts_per_tok=8, hidden_size=256)
  r = nnx.eval_shape(lambda: Router(cfg, jnp.bfloat16))
  rng = np.random.default_rng()
  r.weight.set_value(jnp.asarray(rng.standard_normal((288, 256)) * 0.05, jnp.bfloat16))
  r.e_score_correction_bias.set_value(jnp.asarray(rng.standard_normal(288) * 0.01, jnp.float32))
  x = jnp.asarray(rng.standard_normal((1, MAX_KERNEL_ROWS + 8, 256)), jnp.bfloat16)  # (past the kernel's rows)
  out, text = {}, {}
  for on in (False, True):
    with use_kernels({"bf16_products": on}), kernel_report() as rep:
      out[on] = jax.jit(r.logits)(x), jax.jit(r.__call__)(x)
      text[on] = jax.jit(r.logits).lower(x).as_text()
    assert (("bf16_products", None) in rep) == on, rep
  np.testing.assert_allclose(np.asarray(out[True][0]), np.asarray(out[False][0]), **tol("fp32_paths"))
  np.testing.assert_array_equal(np.asarray(out[True][1][0]), np.asarray(out[False][1][0]))
  assert has_bf16_product(text[True]) and not has_bf16_product(text[False])
  with use_kernels({"bf16_products": True}), kernel_report() as rep:
    jax.eval_shape(r.logits, x.astype(jnp.float32))
  assert [w for k, w in rep if k == "bf16_products"] == ["bf16 router input and weight (here float32 and bfloat16)"]
  # one token row (a decode step's router where XLA computes it): XLA's f32 product stays, the knob is not consulted
  with use_kernels({"bf16_products": True}), kernel_report() as rep:
    one = jax.jit(r.logits).lower(x[:, :1]).as_text()
  assert not has_bf16_product(one) and "bf16_products" not in {k for k, _ in rep}, rep


def test_router_logits_through_the_bf16_kernel():
  """With bf16 x and router weight at >= 2 token rows the logits come from the bf16 GEMV kernel (GPU interpret
  mode on CPU): the same exact products as f32(x)·f32(W), another summation order — the same experts, weights
  within float rounding; with f32 inputs the kernel declines (it would round x)."""
  from flax import nnx  # noqa: PLC0415

  from glm5_jax import config as C  # noqa: PLC0415
  from glm5_jax.layers import Router, kernel_report, use_kernels  # noqa: PLC0415
  from pallas_kernels._common import maybe_interpret  # noqa: PLC0415
  cfg = C.oracle_tiny().replace(n_routed_experts=288, num_experts_per_tok=8, hidden_size=256)
  r = nnx.eval_shape(lambda: Router(cfg, jnp.bfloat16))
  rng = np.random.default_rng()
  r.weight.set_value(jnp.asarray(rng.standard_normal((288, 256)) * 0.05, jnp.bfloat16))
  r.e_score_correction_bias.set_value(jnp.asarray(rng.standard_normal(288) * 0.01, jnp.float32))
  x = jnp.asarray(rng.standard_normal((1, 4, 256)), jnp.bfloat16)
  with use_kernels(None):
    lg0, (ids0, w0) = jax.jit(r.logits)(x), jax.jit(r.__call__)(x)
  with maybe_interpret(True), use_kernels({}), kernel_report() as rep:
    lg1, (ids1, w1) = jax.jit(r.logits)(x), jax.jit(r.__call__)(x)
  assert ("bf16_linear", None) in rep, rep
  np.testing.assert_allclose(np.asarray(lg1), np.asarray(lg0), rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(ids1), np.asarray(ids0))
  np.testing.assert_allclose(np.asarray(w1), np.asarray(w0), rtol=1e-5, atol=0)
  with maybe_interpret(True), use_kernels({}), kernel_report() as rep:
    jax.jit(r.logits)(x.astype(jnp.float32))
  assert rep and rep[0][0] == "bf16_linear" and "bf16 router input" in rep[0][1], rep
  # linear_fused_sum (CUDA lowering: GPU interpret mode runs no counters): the K splits summed in the kernel on the
  # step's split-K counters, the logits' rows written by it (no XLA reduction between the GEMV and the selection)
  from glm5_jax.layers import counters_scope  # noqa: PLC0415
  from pallas_kernels import linear as kl  # noqa: PLC0415
  from pallas_kernels._common import cross_lower  # noqa: PLC0415

  for policy, with_counters in (({"linear_fused_sum": True}, True), ({}, False)):
    def fused(x):  # (a function per policy: jit's cache does not see the policy's context)
      with counters_scope():
        return r.logits(x)
    with use_kernels(policy):
      txt = cross_lower(fused, x).as_text()
    calls = [line for line in txt.splitlines() if "@mosaic_gpu_v2" in line and "glm5_bf16_linear" in line]
    assert len(calls) == 1, calls
    assert calls[0].endswith(f"tensor<{kl.SPLITK_COUNTERS}xi32>)") == with_counters, calls
    assert ("tensor<4x288xf32>" in calls[0].split("->")[-1]) == with_counters, calls


@pytest.mark.parametrize("rows", [1, 4, 80])  # a verify's token rows (product + sum) and more (the dot)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_mla_absorption_forms_equal_the_einsum(rows, dtype):
  """DSA's per-head absorptions (W_UK into the query, W_UV out of the latent): at decode sizes the f32 product + sum
  equals the f64 contraction of the same inputs, in the inputs' dtype; above ABSORB_ROWS it is the HIGHEST einsum
  itself. (The product + sum is checked against f64, not against the einsum: XLA:CPU's bf16 einsum rounds partial
  sums to bf16 — CI saw a 7-ulp gap at one of 1,024 outputs — and XLA:CPU has no bf16 x bf16 -> f32 dot.)"""
  rng = np.random.default_rng()
  H, n, r = 4, 32, 64
  x = jnp.asarray(rng.standard_normal((1, rows, H, n)), dtype)
  w_uk = jnp.asarray(rng.standard_normal((H, n, r)) / 8, dtype)
  w_uv = jnp.asarray(rng.standard_normal((H, n, r)) / 8, dtype)
  lat = jnp.asarray(rng.standard_normal((1, rows, H, r)), dtype)
  t = tol("fp32_paths") if dtype == jnp.float32 else tol("kernel_bf16")
  for eq, a, w in (("bthn,hnr->bthr", x, w_uk), ("bthr,hvr->bthv", lat, w_uv)):
    got = _per_head(eq, a, w)
    if rows > ABSORB_ROWS:
      want = jnp.einsum(eq, a, w, precision=lax.Precision.HIGHEST)
      assert got.dtype == want.dtype and got.shape == want.shape
      np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
      continue
    want = np.einsum(eq, np.asarray(a, np.float64), np.asarray(w, np.float64))
    assert got.dtype == dtype and got.shape == want.shape
    np.testing.assert_allclose(np.asarray(got, np.float32), want, **t)
  with pytest.raises(ValueError, match="unknown contraction"):
    _per_head("bthn,hrn->bthr", x, w_uk)


def test_native_wrong_kernels_are_refused_outside_interpret_mode(monkeypatch):
  """A kernel that computes wrong results natively (layers.NATIVE_WRONG: its GPU tests failed) is refused at
  every call site outside interpret mode, with the reason, even when the policy asks for it explicitly (the
  Decoder then raises naming the knob, as for any requested kernel without a site); in interpret mode — the CPU
  equivalences — it still runs."""
  from glm5_jax.layers import NATIVE_WRONG, kernel_enabled, kernel_report, use_kernels  # noqa: PLC0415
  from pallas_kernels._common import maybe_interpret  # noqa: PLC0415
  knob = "topk_threshold_2bit"  # any knob: the list is empty while every kernel passes its GPU tests
  monkeypatch.setitem(NATIVE_WRONG, knob, "wrong natively (a test's entry)")
  with use_kernels({knob: True}), kernel_report() as rep:
    assert not kernel_enabled(knob)
    with maybe_interpret(True):
      assert kernel_enabled(knob)
  assert rep == [(knob, NATIVE_WRONG[knob]), (knob, None)]


def _extend_one_token(m, B, policy, seed, trace_only=False):
  """One extend step of B single-token rows through model m under kernel ``policy`` (GPU interpret mode; a fresh
  trace) -> ((final hidden [B, 1, D] f32, the first layer's expert ids — or, without an MoE there, its indexer
  selection, None with neither), the kernel report as a dict); with
  ``trace_only`` only traced (the report), the values None."""
  from glm5_jax import api  # noqa: PLC0415
  from glm5_jax.layers import kernel_report, use_kernels  # noqa: PLC0415
  tokens = jnp.asarray(np.random.default_rng(seed).integers(0, 2000, (B, 1)), jnp.int32)
  cache = api.init_cache(m, B, 64)
  fn = api._build_extend(m, (B, 64, 1), "all")
  args = (m.params, cache.caches, tokens, cache.lengths, jnp.full((B,), 1, jnp.int32), cache.n_acc)
  with use_kernels(policy), maybe_interpret(True), kernel_report() as rep:
    if trace_only:
      jax.eval_shape(fn, *args)
      return None, dict(rep)
    out = fn(*args)[0]
    aux = out["aux"][0]
    sel = aux["experts"] if "experts" in aux else aux.get("idx")  # (neither in a KDA layer with a dense MLP)
    got = np.asarray(out["hidden"], np.float32), None if sel is None else np.asarray(sel)
  return got, dict(rep)


def _lowered_barriers(m, B, policy) -> int:
  """The optimization barriers in the lowered one-token extend step of B rows under kernel ``policy`` (GPU
  interpret mode for its kernels; a fresh function per policy: the policy is not part of jit's cache key) — where
  an order knob (dsa_qkv_a_first) shows in the program."""
  from glm5_jax import api  # noqa: PLC0415
  from glm5_jax.layers import use_kernels  # noqa: PLC0415
  cache = api.init_cache(m, B, 64)
  args = (m.params, cache.caches, jnp.zeros((B, 1), jnp.int32), cache.lengths, jnp.ones((B,), jnp.int32),
          cache.n_acc)
  with use_kernels(policy), maybe_interpret(True):
    return jax.jit(api._build_extend(m, (B, 64, 1), "all")).trace(*args).lower().as_text().count(
        "optimization_barrier")


def test_router_in_the_gate_up_kernel_at_the_model_site():
  """Policy moe_router_in_kernel at the model's single-row MoE (one layer, one token): the router's selection
  inside fp8_moe's gate/up kernel (moe_router_ranks' form, and every CTA selecting all k without it) gives the hidden
  state and expert ids of router_kernel + fp8_moe exactly; the report names the site, and at two token rows
  declines it (one row only). With moe_static_table (the slot count a number, the down kernel's ids and weights
  staged into SMEM: k = 4) and moe_writer_cta (the selection stored by an extra gate/up CTA) the same again, and
  likewise declined at two rows."""
  path = tiny_checkpoint("kernel-tiny", 6, "fp8", num_hidden_layers=1, mlp_layer_types=["sparse"],
                         moe_intermediate_size=128, n_routed_experts=16, num_experts_per_tok=4)
  m = load(path, "float32")
  # (moe_static_table and moe_writer_cta — defaults — pinned off until the last runs)
  off = ("kda", "fp8_linear", "indexer", "sparse_mla", "mhc", "moe_router_in_kernel", "moe_static_table",
         "moe_writer_cta")
  base = {k: False for k in off} | {"fp8_moe": True, "router_kernel": True}
  fused = base | {"moe_router_in_kernel": True}

  run = functools.partial(_extend_one_token, m, seed=4)

  (h0, e0), _ = run(1, base)
  (h1, e1), rep = run(1, fused)
  assert rep["moe_router_in_kernel"] is None and rep["router_kernel"] is None, rep
  np.testing.assert_array_equal(e1, e0)
  np.testing.assert_array_equal(h1, h0)
  assert rep["moe_router_ranks"] is None, rep  # (a default: each CTA selects only up to its slot's rank)
  # (the other form of the selection there: every CTA selects all k)
  (h2, e2), rep = run(1, fused | {"moe_router_ranks": False})
  assert rep["moe_router_ranks"] == "off in the policy", rep
  np.testing.assert_array_equal(e2, e0)
  np.testing.assert_array_equal(h2, h0)
  assert "one token row" in run(2, fused, trace_only=True)[1]["moe_router_in_kernel"]
  (h3, e3), rep = run(1, fused | {"moe_static_table": True, "moe_writer_cta": True})
  assert rep["moe_static_table"] is None and rep["moe_writer_cta"] is None, rep
  np.testing.assert_array_equal(e3, e0)
  np.testing.assert_array_equal(h3, h0)
  assert "one token row" in run(2, base | {"moe_static_table": True}, trace_only=True)[1]["moe_static_table"]


def test_dsa_qkv_a_first_at_the_model_site():
  """Policy dsa_qkv_a_first (an order, not a kernel: the indexer's projection and cache update take the layer
  input through an optimization barrier with q_a's output) at a one-layer DSA model's step (XLA everywhere else):
  the lowered step has the barrier only with the knob, the hidden state and the layer's indexer selection are
  bit for bit the same, and the report names the site."""
  from glm5_jax.layers import KERNEL_DEFAULTS  # noqa: PLC0415
  path = tiny_checkpoint("kernel-tiny", 8, "fp8", num_hidden_layers=1, layer_types=["indexed_attention"],
                         mlp_layer_types=["dense"])
  m = load(path, "float32")
  off = {k: False for k in KERNEL_DEFAULTS}
  (h0, i0), rep0 = _extend_one_token(m, 2, off, seed=9)
  (h1, i1), rep1 = _extend_one_token(m, 2, off | {"dsa_qkv_a_first": True}, seed=9)
  assert rep1["dsa_qkv_a_first"] is None and rep0["dsa_qkv_a_first"] == "off in the policy", (rep0, rep1)
  np.testing.assert_array_equal(h1, h0)
  np.testing.assert_array_equal(i1, i0)
  assert np.all(np.any(i0 >= 0, axis=-1))  # (a real selection: the token's own position at least)
  for pol, want in ((off, False), (off | {"dsa_qkv_a_first": True}, True)):
    assert (_lowered_barriers(m, 2, pol) > 0) == want, pol


def test_fp8_scales_first_at_the_model_site():
  """Policy fp8_scales_first at a one-layer DSA model's FP8 linears (q_a / kv_a, q_b, o_proj, the dense MLP; GPU
  interpret mode, XLA elsewhere): every block scale requested before the weight tiles gives the hidden state bit
  for bit, and the report names the sites."""
  from glm5_jax.layers import KERNEL_DEFAULTS  # noqa: PLC0415
  path = tiny_checkpoint("kernel-tiny", 10, "fp8", num_hidden_layers=1, layer_types=["indexed_attention"],
                         mlp_layer_types=["dense"])
  m = load(path, "float32")
  fp8 = {k: False for k in KERNEL_DEFAULTS} | {"fp8_linear": True, "fp8_dq": True}
  (h0, _), rep0 = _extend_one_token(m, 1, fp8, seed=11)
  (h1, _), rep1 = _extend_one_token(m, 1, fp8 | {"fp8_scales_first": True}, seed=11)
  assert rep0["fp8_dq"] is None and rep1["fp8_scales_first"] is None, rep1
  assert rep0["fp8_scales_first"] == "off in the policy", rep0
  np.testing.assert_array_equal(h1, h0)


def test_mhc_row_at_the_model_site():
  """Policy mhc_row at a one-layer bf16 model's mHC boundaries (one token row; GPU interpret mode runs each as
  its two halves): the final hidden state within bf16 rounding of mhc_post_finish's (the partials summed over
  128-column chunks instead of 32), the report names the sites; at two token rows it is declined by name."""
  from glm5_jax.layers import KERNEL_DEFAULTS  # noqa: PLC0415
  path = tiny_checkpoint("kernel-tiny", 13, "bfloat16", num_hidden_layers=1, layer_types=["indexed_attention"],
                         mlp_layer_types=["dense"])
  m = load(path, "bfloat16")
  base = {k: False for k in KERNEL_DEFAULTS} | {"mhc": True, "mhc_finish": True, "mhc_sinkhorn_split": True,
                                                "mhc_grid_barrier": True}
  (h0, _), rep0 = _extend_one_token(m, 1, base, seed=13)
  (h1, _), rep1 = _extend_one_token(m, 1, base | {"mhc_row": True}, seed=13)
  assert rep0["mhc_grid_barrier"] is None and rep0["mhc_row"] == "off in the policy", rep0
  assert rep1["mhc_row"] is None, rep1
  np.testing.assert_allclose(h1, h0, **tol("kernel_bf16"))
  assert np.abs(h0).max() > 0
  _, rep2 = _extend_one_token(m, 2, base | {"mhc_row": True}, seed=13, trace_only=True)
  assert rep2["mhc_row"].startswith("one token row (here 2; up to 4 with mhc_rows)"), rep2


def test_dq_f16_inputs_from_the_boundary_at_the_model_site(monkeypatch):
  """Policy dq_f16 at a two-layer bf16 model (KDA + dense MLP, DSA + MoE; FP8 projections; the one-row lean
  boundary): the FP8 kernels' f16 inputs come from the boundary kernel (x_in also in f16) instead of a conversion
  kernel each — the hidden state and expert ids bit for bit those of dq_f16 with the conversions (the boundaries
  not asked for the f16 copy). (W_UV's f16 copy, in the FP8-cache decode step only: the kernel-tiny step's
  end-to-end test with the candidates, and test_uv_kernel_x16_interpret.)"""
  import glm5_jax.attention as A  # noqa: PLC0415
  import glm5_jax.model as Mo  # noqa: PLC0415
  from glm5_jax.layers import KERNEL_DEFAULTS  # noqa: PLC0415
  from pallas_kernels import mhc as km  # noqa: PLC0415
  from pallas_kernels import sparse_mla as ks  # noqa: PLC0415
  path = tiny_checkpoint("kernel-tiny", 16, "fp8", num_hidden_layers=2,
                         layer_types=["linear_attention", "indexed_attention"], mlp_layer_types=["dense", "sparse"])
  m = load(path, "bfloat16")
  pol = {k: v for k, v in KERNEL_DEFAULTS.items()} | {"dq_f16": True, "kv_cache_dtype": "fp8"}
  seed = int(np.random.default_rng().integers(1 << 20))
  asked = []
  for mod, fn in ((km, "mhc_row_boundary"), (ks, "mla_absorb_uv")):
    orig = getattr(mod, fn)
    monkeypatch.setattr(mod, fn, lambda *a, _o=orig, _n=fn, **k: asked.append((_n, k.get("x16", False))) or _o(*a, **k))
  (h1, e1), _ = _extend_one_token(m, 1, pol, seed=seed)
  assert ("mhc_row_boundary", True) in asked, asked
  no16 = lambda rows: False  # noqa: E731 (the sites' f16 copies not asked for: layers.f16_copies)
  monkeypatch.setattr(Mo, "f16_copies", no16)
  monkeypatch.setattr(A, "f16_copies", no16)
  asked.clear()
  (h0, e0), rep = _extend_one_token(m, 1, pol, seed=seed)
  assert asked and not any(x16 for _, x16 in asked), asked
  assert rep["dq_f16"] is None  # (the dq kernels in f16 all the same)
  np.testing.assert_array_equal(h1, h0)
  np.testing.assert_array_equal(e1, e0)
  assert np.abs(h0).max() > 0


def _attention_with_and_without(m, x, cache, ctx, base, knob):
  """The first layer's attention sublayer (one device's shard_map, GPU interpret mode, x's dtype) under policy
  ``base`` with ``knob`` off, then on -> [its outputs off, on]; the kernel report names the site only when on."""
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415
  from glm5_jax.layers import kernel_report, use_kernels  # noqa: PLC0415
  outs = []
  for on in (False, True):
    fn = m.shard_map(lambda mod, x, c: mod.layers[0].self_attn(x, c, ctx, x.dtype), (P(), P()), P())
    with use_kernels(base | {knob: on}), maybe_interpret(True), kernel_report() as rep:
      outs.append(jax.jit(fn)(m.params, x, cache))
    assert (dict(rep)[knob] is None) == on, rep
  return outs


def test_mla_latent_norms_at_the_model_site():
  """Policy mla_latent_norms at a DSA layer's verify call (kernel-tiny, bf16, FP8 latent cache; GPU interpret mode,
  XLA elsewhere): the latent_norms kernel's q_r / c / FP8 cache rows give the layer's output and its caches as
  the XLA norms and quantisation do, and the report names the site; an f32 model is declined by name."""
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415
  from glm5_jax import state as st  # noqa: PLC0415
  from glm5_jax.attention import StepCtx  # noqa: PLC0415
  from glm5_jax.layers import KERNEL_DEFAULTS, kernel_report, use_kernels  # noqa: PLC0415
  path = tiny_checkpoint("kernel-tiny", 14, "fp8", num_hidden_layers=1, layer_types=["indexed_attention"],
                         mlp_layer_types=["dense"])
  m = load(path, "bfloat16")
  B, T = 1, 2
  lay = st.cache_layout(m.cfg, B, 64, T, jnp.bfloat16, mtp=False, kv_fp8=True)
  rng = np.random.default_rng()
  cache = jax.tree.map(lambda a: jnp.asarray(rng.integers(-2**20, 2**20, a.shape), a.dtype)
                       if a.dtype == jnp.int32 else jnp.asarray(rng.standard_normal(a.shape), a.dtype),
                       st.init_caches(lay, m.mesh)["layers"][0])
  cache["latent8"] = jnp.zeros_like(cache["latent8"])  # (valid rows: the positions before the step's)
  x = jnp.asarray(rng.standard_normal((B, T, m.cfg.hidden_size)), jnp.bfloat16)
  ctx = StepCtx(jnp.full((B,), 5, jnp.int32), jnp.full((B,), T, jnp.int32), jnp.ones((B,), jnp.int32), "verify")
  base = {k: False for k in KERNEL_DEFAULTS}
  (y0, c0, _), (y1, c1, _) = _attention_with_and_without(m, x, cache, ctx, base, "mla_latent_norms")
  np.testing.assert_array_equal(np.asarray(c1["latent8"]), np.asarray(c0["latent8"]))
  np.testing.assert_array_equal(np.asarray(y1, np.float32), np.asarray(y0, np.float32))
  assert np.any(np.asarray(c1["latent8"])[:, 5:5 + T])
  fn = m.shard_map(lambda mod, x, c: mod.layers[0].self_attn(x, c, ctx, jnp.float32), (P(), P()), P())
  with use_kernels(base | {"mla_latent_norms": True}), kernel_report() as rep:
    jax.eval_shape(fn, m.params, x.astype(jnp.float32), cache)
  assert "a bf16 model (here float32)" in dict(rep)["mla_latent_norms"], rep


def _kda_layer_site(seed: int, dtype, n_acc: int):
  """A one-KDA-layer kernel-tiny checkpoint loaded in ``dtype`` -> (path, model, its layer's verify cache for B = 1,
  T = 2, fresh random x [1, 2, D] in dtype, the verify ctx at position 5 starting from state slot n_acc - 1)."""
  from glm5_jax import api  # noqa: PLC0415
  from glm5_jax.attention import StepCtx  # noqa: PLC0415
  path = tiny_checkpoint("kernel-tiny", seed, "fp8", num_hidden_layers=1, layer_types=["linear_attention"],
                         mlp_layer_types=["dense"])
  m = load(path, dtype)
  B, T = 1, 2
  cache = api.init_cache(m, B, 32, q=T).caches["layers"][0]
  x = jnp.asarray(np.random.default_rng().standard_normal((B, T, m.cfg.hidden_size)), dtype)
  ctx = StepCtx(jnp.full((B,), 5, jnp.int32), jnp.full((B,), T, jnp.int32), jnp.full((B,), n_acc, jnp.int32),
                "verify")
  return path, m, cache, x, ctx


def test_kda_norm_partials_at_the_model_site():
  """Policy kda_norm_partials at a KDA layer's verify call (kernel-tiny, f32; GPU interpret mode): the KDA
  kernel's per-CTA sums of o's squares make the gated RMSNorm after it elementwise — the layer's output and its
  caches within f32 rounding of the norm over o (kda_norm_partials off), and the report names the site."""
  from glm5_jax.layers import KERNEL_DEFAULTS  # noqa: PLC0415
  _, m, cache, x, ctx = _kda_layer_site(12, "float32", 1)
  base = {k: False for k in KERNEL_DEFAULTS} | {"kda": True, "kda_conv": True, "kda_token_loop": True}
  (y0, c0), (y1, c1) = _attention_with_and_without(m, x, cache, ctx, base, "kda_norm_partials")
  np.testing.assert_allclose(np.asarray(y1), np.asarray(y0), **tol("kernel_f32"))
  np.testing.assert_array_equal(np.asarray(c1["ssm"]), np.asarray(c0["ssm"]))
  assert np.abs(np.asarray(y0)).max() > 0


def test_kda_o_grid_spin_at_the_model_site(monkeypatch):
  """Policy kda_o_grid_spin at a KDA layer's verify call (kernel-tiny, bf16): the grid is asked for the clock hold
  of its o_proj-only CTAs (w_delay = kda_decode.W_DELAY_CYCLES) with the knob and for the `loaded` count without it,
  and the report names the site. (The hold itself: the grid's CUDA lowering and GPU tests, tests/test_kda_decode.py.)"""
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415
  from glm5_jax.layers import KERNEL_DEFAULTS, kernel_report, use_kernels  # noqa: PLC0415
  from pallas_kernels import kda_decode as kd  # noqa: PLC0415
  _, m, cache, x, ctx = _kda_layer_site(16, "bfloat16", 2)
  asked = []
  real = kd.kda_decode_o_proj
  monkeypatch.setattr(kd, "kda_decode_o_proj", lambda *a, **k: (asked.append(k.get("w_delay", 0)), real(*a, **k))[1])
  grid = {k: False for k in KERNEL_DEFAULTS} | {"kda": True, "kda_conv": True, "kda_token_loop": True,
                                                "kda_norm_partials": True, "kda_o_grid": True}
  for pol, want, why in ((grid, 0, "off in the policy"), (grid | {"kda_o_grid_spin": True}, kd.W_DELAY_CYCLES, None)):
    # (a fresh function per policy: the policy is not part of the trace cache's key)
    fn = m.shard_map(lambda mod, x, c: mod.layers[0].self_attn(x, c, ctx, jnp.bfloat16), (P(), P()), P())
    with use_kernels(pol), maybe_interpret(True), kernel_report() as rep:
      jax.eval_shape(fn, m.params, x, cache)
    assert asked[-1] == want and dict(rep)["kda_o_grid_spin"] == why and dict(rep)["kda_o_grid"] is None, (asked, rep)
  assert kd.W_DELAY_CYCLES > 0


def test_kda_o_grid_at_the_model_site():
  """Policy kda_o_grid at a KDA layer's verify call (kernel-tiny, bf16; GPU interpret mode: the grid's two roles
  as two launches): the recurrence, the gated norm and o_proj in the kernel give the layer's output within bf16
  rounding of the unfused form (the norm's 1/RMS applied after the product) and the same state; the report names
  the site; an f32 model (an f32 o_proj) is declined by name."""
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415
  from glm5_jax.layers import KERNEL_DEFAULTS, kernel_report, use_kernels  # noqa: PLC0415
  path, m, cache, x, ctx = _kda_layer_site(15, "bfloat16", 2)
  rng = np.random.default_rng()
  cache = dict(cache, ssm=jnp.asarray(rng.standard_normal(cache["ssm"].shape), cache["ssm"].dtype))
  base = {k: False for k in KERNEL_DEFAULTS} | {"kda": True, "kda_conv": True, "kda_token_loop": True,
                                                "kda_norm_partials": True}
  (y0, c0), (y1, c1) = _attention_with_and_without(m, x, cache, ctx, base, "kda_o_grid")
  np.testing.assert_allclose(np.asarray(y1, np.float32), np.asarray(y0, np.float32), **tol("kernel_bf16"))
  np.testing.assert_array_equal(np.asarray(c1["ssm"]), np.asarray(c0["ssm"]))
  np.testing.assert_array_equal(np.asarray(c1["conv"]), np.asarray(c0["conv"]))
  assert np.abs(np.asarray(y0, np.float32)).max() > 0.01
  fn = m.shard_map(lambda mod, x, c: mod.layers[0].self_attn(x, c, ctx, jnp.float32), (P(), P()), P())
  m32 = load(path, "float32")
  with use_kernels(base | {"kda_o_grid": True}), kernel_report() as rep:
    jax.eval_shape(fn, m32.params, x.astype(jnp.float32), cache)
  assert "float32 o_proj" in dict(rep)["kda_o_grid"], rep
