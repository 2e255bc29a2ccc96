"""Parity with Hugging Face transformers' own Glm5Next (fp32): the repository's goldens (tests/goldens, made by
tests/goldens/make_goldens.py) and, when present beside the checkout, the independent oracle in ../shared/oracle.

Tolerance: TOL["hf_fp32_logits"]; discrete choices (indexer selections as sets, router experts, greedy tokens)
must be identical."""

from __future__ import annotations

import glob
import json
import os

import numpy as np
import pytest

import glm5_jax
from conftest import TOL
from helpers import ORACLE, REPO, extend_chunks, load

ATOL = TOL["hf_fp32_logits"][0]


def _oracle_cases():
  cases = []
  for sub, ck, dtype, prefix in [("golden_seed0", "checkpoint", "float32", ""),
                                 ("golden_seed0", "checkpoint_bf16", "float32", "bf16w_"),
                                 ("golden_seed0_fp8", "checkpoint_fp8", "float32", "")]:
    d = os.path.join(ORACLE, sub)
    if os.path.isdir(d):
      cases.append(pytest.param(os.path.join(d, ck), os.path.join(d, "golden.npz"), prefix, id=f"oracle-{ck}"))
  return cases


def _repo_cases():
  cases = []
  for f in sorted(glob.glob(os.path.join(REPO, "tests", "goldens", "*.npz"))):
    cases.append(pytest.param(f, id=f"repo-{os.path.basename(f)[:-4]}"))
  return cases


def _sets(a):
  return [set(r.tolist()) - {-1} for r in a]


def check_case(model, g, prefix=""):
  p = np.asarray(g["prompt"], np.int32)
  logits, aux = glm5_jax.forward(model, p[None], return_aux=True)
  np.testing.assert_allclose(np.asarray(logits[0]), g[prefix + "logits_full"], atol=ATOL, rtol=0)
  if not prefix:
    for li, layer in enumerate(np.asarray(g["mla_layers"])):
      assert _sets(np.asarray(aux["layers"][layer]["idx"][0])) == _sets(g["indexer_topk"][li]), f"indexer {layer}"
    for li, layer in enumerate(np.asarray(g["moe_layers"])):
      mine = np.sort(np.asarray(aux["layers"][layer]["experts"][0]), -1)
      np.testing.assert_array_equal(mine, g["router_topk"][li], err_msg=f"router layer {layer}")
    if "final_hidden" in g:
      np.testing.assert_allclose(np.asarray(aux["hidden"][0]), g["final_hidden"], atol=ATOL, rtol=0)
  pre = int(g["prefill_len"]) if "prefill_len" in g else 24
  inc, _ = extend_chunks(model, p, [pre] + [1] * (len(p) - pre))
  np.testing.assert_allclose(inc, g[prefix + "logits_incremental"], atol=ATOL, rtol=0)
  if not prefix and "logits_chunked" in g:
    ch, _ = extend_chunks(model, p, [int(c) for c in g["chunk_sizes"]])
    np.testing.assert_allclose(ch, g["logits_chunked"], atol=ATOL, rtol=0)
  if prefix + "gen_tokens" in g:
    from helpers import greedy_reference  # noqa: PLC0415
    gen = greedy_reference(model, p, len(g[prefix + "gen_tokens"]), max_context=64)
    assert gen == g[prefix + "gen_tokens"].tolist()


@pytest.mark.parametrize("ckpt,golden,prefix", _oracle_cases())
def test_oracle(ckpt, golden, prefix):
  check_case(load(ckpt, "float32"), np.load(golden), prefix)


@pytest.mark.parametrize("golden", _repo_cases())
def test_repo_goldens(golden):
  from helpers import tiny_checkpoint  # noqa: PLC0415
  g = np.load(golden, allow_pickle=False)
  meta = json.loads(str(g["meta"]))
  path = tiny_checkpoint(meta["preset"], meta["seed"], meta["dtype"], **meta.get("overrides", {}))
  check_case(load(path, "float32"), g, meta.get("prefix", ""))
