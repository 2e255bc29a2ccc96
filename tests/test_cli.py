"""The glm5-jax command line on a tiny checkpoint."""

import re

import numpy as np
import pytest

import glm5_jax
from glm5_jax.cli import main
from helpers import tiny_checkpoint


def test_generate_with_prompt_ids(capsys):
  """generate prints the tokens, the acceptance and the step time; it stops at the checkpoint's eos_token_id (the
  id emitted, nothing after it) and --stream prints the same tokens as they come; --ignore-eos runs on, here with
  three speculative steps per call to the end of a context where the last steps no longer fit three at a time
  (5 + 10 tokens in 16: Decoder.for_next_call hands them to a one-step decoder) — the same tokens."""
  args = ["--prompt-ids", "1,2,3,4,5", "--max-new-tokens", "10", "--k", "1", "--max-context", "64",
          "--capture-sizes", "1"]
  gen = lambda text: next(line for line in text.splitlines() if line.startswith("generated"))  # noqa: E731
  ids = lambda line: [int(t) for t in re.search(r"\[(.*)\]", line).group(1).split(",")]  # noqa: E731
  main(["generate", tiny_checkpoint("oracle-tiny", 0, "float32"), *args])
  out = capsys.readouterr().out
  assert "generated (10 tokens)" in out and "draft acceptance" in out and "step time" in out
  full = ids(gen(out))
  j = next(i for i in range(2, 10) if full[i] not in full[:i])  # a first occurrence past the first call's tokens
  other = next(t for t in range(1000) if t not in full)  # a second end id that never comes
  path = tiny_checkpoint("oracle-tiny", 0, "float32", eos_token_id=[other, full[j]])  # (the same weights)
  assert glm5_jax.config.Glm5Config.from_json(path).eos_token_id == (other, full[j])
  main(["generate", path, *args, "--stream"])
  out = capsys.readouterr().out
  line = gen(out)
  assert ids(line) == full[:j + 1] and "tokens, end of sequence)" in line
  streamed = out.split("streaming (token ids):\n", 1)[1].splitlines()[0]
  assert [int(t) for t in streamed.split()] == full[:j + 1]
  main(["generate", path, *args, "--ignore-eos", "--steps-per-call", "3", "--max-context", "16"])
  assert ids(gen(capsys.readouterr().out)) == full


def test_generate_knobs_give_the_same_tokens(capsys):
  """--pack-params and --policy reach the Decoder: unpacked parameters (packed is the default) and a bad policy
  key."""
  path = tiny_checkpoint("oracle-tiny", 0, "float32")
  base = ["generate", path, "--prompt-ids", "4,8,15,16,23", "--max-new-tokens", "5", "--k", "1", "--max-context",
          "64", "--capture-sizes", "1"]
  gen = lambda out: re.search(r"generated \(5 tokens\): (\[.*\])", out).group(1)  # noqa: E731
  main(base)
  plain = gen(capsys.readouterr().out)
  main(base + ["--pack-params", "0"])
  assert gen(capsys.readouterr().out) == plain
  with pytest.raises(ValueError, match="unknown policy key"):
    main(base + ["--policy", '{"no_such_knob": true}'])
  # --xla-option reaches the step's compile (a GPU option: accepted, and without effect, on the CPU)
  main(base + ["--xla-option", "xla_gpu_command_buffer_scheduling_mode=LHS"])
  assert gen(capsys.readouterr().out) == plain
  with pytest.raises(ValueError, match="expected NAME=VALUE"):
    main(base + ["--xla-option", "no_equals_sign"])
  with pytest.raises(Exception, match="No such compile option: 'xla_no_such_option'"):  # it reached XLA
    main(base + ["--xla-option", "xla_no_such_option=1"])


def test_parse_xla_option_types():
  from glm5_jax.speculative import parse_xla_option  # noqa: PLC0415
  assert parse_xla_option("a=TRUE") == ("a", True) and parse_xla_option("b=0") == ("b", 0)
  assert parse_xla_option("c=0.5") == ("c", 0.5)
  assert parse_xla_option("xla_gpu_command_buffer_scheduling_mode=LHS") == (
      "xla_gpu_command_buffer_scheduling_mode", "LHS")
  with pytest.raises(ValueError, match="'=x'"):
    parse_xla_option("=x")


def test_generate_without_tokenizer_needs_ids():
  with pytest.raises(SystemExit, match="has no tokenizer.json: pass --prompt-ids"):
    main(["generate", tiny_checkpoint("oracle-tiny", 0, "float32"), "--prompt", "hello"])


def test_convert_then_load(tmp_path, capsys):
  path = tiny_checkpoint("oracle-tiny", 0, "float32")
  main(["convert", path, str(tmp_path / "orbax")])
  a, b = glm5_jax.load_model(path), glm5_jax.load_model(tmp_path / "orbax")
  p = np.arange(9)[None] + 3
  np.testing.assert_array_equal(np.asarray(glm5_jax.forward(a, p)), np.asarray(glm5_jax.forward(b, p)))


def test_check_deployment_lists_reasons(capsys):
  rc = main(["check-deployment", "--preset", "real", "--tp", "2", "--kv-cache-dtype", "bf16", "--platform", "sm_90"])
  out = capsys.readouterr().out
  assert rc == 1 and "2 reason(s)" in out and "TP other than 4" in out and "KV cache dtypes other than FP8" in out
  rc = main(["check-deployment", "--preset", "real", "--tp", "4", "--platform", "sm_90"])
  assert rc == 0 and "supported: DecodeConfig" in capsys.readouterr().out


def test_check_deployment_lists_kernel_sites(capsys):
  """--kernels traces one rank's step on abstract weights: every KDA layer runs the KDA kernel; a knob that is off
  says so."""
  rc = main(["check-deployment", "--preset", "real", "--tp", "4", "--platform", "sm_90", "--kernels",
             "--policy", '{"sparse_mla": false}'])
  out = capsys.readouterr().out
  assert rc == 0
  assert re.search(r"kda\s+34 site\(s\)", out), out
  assert re.search(r"sparse_mla\s+0 site\(s\)\s+not used: off in the policy \(14\)", out), out


def test_memory(capsys):
  main(["memory", "--tp", "4", "--batch", "1", "--max-context", "65536"])
  out = capsys.readouterr().out
  gb = float(re.search(r"parameters per device:\s+([\d.]+) GB", out).group(1))
  assert 80 < gb < 84 and "fits" in out, out  # the FP8 release's share of one TP4 rank (test_full_geometry)


def test_compile_cache_reused_across_processes(tmp_path):
  """--compile-cache: the first process writes its compiled programs, a second one loads them (writes nothing new)
  and generates the same tokens. (--compile-cache-min-s 0: every program is written — with the default 1 s, a
  program compiling in about a second was written by one run and not the other, depending on the machine's load.)"""
  import os  # noqa: PLC0415
  import subprocess  # noqa: PLC0415
  import sys  # noqa: PLC0415

  path = tiny_checkpoint("oracle-tiny", 0, "float32")
  cache = tmp_path / "cc"
  cmd = [sys.executable, "-m", "glm5_jax.cli", "generate", path, "--prompt-ids", "3,1,4,1,5", "--max-new-tokens", "5",
         "--k", "0", "--max-context", "64", "--capture-sizes", "1", "--compile-cache", str(cache),
         "--compile-cache-min-s", "0"]
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
  runs = []
  for _ in range(2):
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    runs.append((re.search(r"generated \(5 tokens\): (\[.*\])", out.stdout).group(1), sorted(os.listdir(cache))))
  assert runs[0][1], "the first run wrote no compiled program"
  assert runs[1][1] == runs[0][1], "the second run compiled again instead of loading"
  assert runs[1][0] == runs[0][0]


def test_compile_cache_refuses_a_file(tmp_path):
  f = tmp_path / "file"
  f.write_text("x")
  with pytest.raises(ValueError, match="exists and is not a directory"):
    glm5_jax.enable_compile_cache(f)
  with pytest.raises(ValueError, match="min_compile_s = -1"):
    glm5_jax.enable_compile_cache(tmp_path / "d", min_compile_s=-1)


def test_knobs_lists_every_policy_key(capsys):
  """`glm5-jax knobs` lists every key a decode policy accepts with its default — the kernel switches as
  layers.KNOBS declares them, kv_cache_dtype and interpret — and a description of each."""
  import json  # noqa: PLC0415
  from glm5_jax.layers import KERNEL_DEFAULTS  # noqa: PLC0415
  from glm5_jax.speculative import POLICY_KEYS  # noqa: PLC0415
  assert main(["knobs", "--json"]) == 0
  got = json.loads(capsys.readouterr().out)
  assert set(got) == set(POLICY_KEYS)
  assert all(got[k]["default"] == v for k, v in KERNEL_DEFAULTS.items())
  assert all(len(v["doc"]) > 40 for v in got.values())
  assert main(["knobs"]) == 0
  text = capsys.readouterr().out
  assert "pdl = false" in text and "mhc_grid_barrier = true" in text
  # NAME filters (substrings of the names) and --on / --off (the defaults) select among them
  assert main(["knobs", "--json", "kda_", "topk"]) == 0
  want = {k for k in POLICY_KEYS if "kda_" in k or "topk" in k}
  assert set(json.loads(capsys.readouterr().out)) == want and len(want) > 2
  for flag, value in (("--on", True), ("--off", False)):
    assert main(["knobs", "--json", flag]) == 0
    got = json.loads(capsys.readouterr().out)
    assert set(got) == {k for k, v in KERNEL_DEFAULTS.items() if v is value} | (
        {"interpret"} if value is False else set()), flag
  with pytest.raises(SystemExit, match="no knob name contains 'no_such_knob'"):
    main(["knobs", "kda", "no_such_knob"])


def test_text_stream_holds_back_split_characters():
  """The streamed text of a byte-level tokenizer whose multi-byte characters span several tokens: printed piece by
  piece it is the whole text, and no piece shows U+FFFD (a character's first bytes alone)."""
  import io  # noqa: PLC0415

  from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # noqa: PLC0415

  from glm5_jax.cli import _TextStream  # noqa: PLC0415

  alphabet = pre_tokenizers.ByteLevel.alphabet()
  tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  text = "naïve café ✓ 数据 ok"
  ids = tok.encode(text).ids
  assert len(ids) == len(text.encode())  # one token per byte: "✓" and "数" span three tokens each
  out = io.StringIO()
  s = _TextStream(tok, out)
  pieces = []
  for i in range(0, len(ids), 2):
    before = out.getvalue()
    s.add(ids[i:i + 2])
    pieces.append(out.getvalue()[len(before):])
  s.close()
  assert out.getvalue() == text + "\n"
  assert not any("\ufffd" in p for p in pieces) and sum(map(bool, pieces)) > 5
