"""glm5_jax.runtime: DeploymentConfig, kda_dtypes, unsupported, specialized_decode_config, DecodeConfig."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax import config as C
from glm5_jax import runtime as R
from glm5_jax.runtime import DecodeConfig, DeploymentConfig

SPECIALIZED = {"decode_backend": "latency_specialized"}


def tiny(**kw) -> DeploymentConfig:
  """A supported deployment of the reduced kernel geometry at TP1 on Blackwell."""
  kw.setdefault("model", C.kernel_tiny())
  kw.setdefault("platform", "sm_100")
  kw.setdefault("additional_config", SPECIALIZED)
  return DeploymentConfig(**kw)


def full(**kw) -> DeploymentConfig:
  """A supported deployment of the release geometry (TP4 on GB300)."""
  kw.setdefault("model", C.real())
  kw.setdefault("tensor_parallel_size", 4)
  kw.setdefault("platform", "sm_103")
  kw.setdefault("additional_config", SPECIALIZED)
  return DeploymentConfig(**kw)


# ---------------------------------------------------------------------------------------------------- happy path
def test_happy_path_reduced_geometry():
  d = tiny()
  assert R.unsupported(d) == []
  cfg = R.specialized_decode_config(d)
  assert cfg == DecodeConfig(max_context=65536, q=4, capture_sizes=(1, 2, 4, 8), policy=())
  assert cfg.k == 3 and cfg.policy_dict() == {}
  hash(cfg)


def test_happy_path_full_geometry_tp4():
  d = full(max_model_len=32768, capture_sizes=(16, 1, 4, 4), num_speculative_tokens=7)
  assert R.unsupported(d) == []
  cfg = R.specialized_decode_config(d)
  assert (cfg.max_context, cfg.q, cfg.k, cfg.capture_sizes) == (32768, 8, 7, (1, 4, 16))


@pytest.mark.parametrize("platform", ["sm_90", "sm_100", "sm_103"])
def test_supported_gpus(platform):
  assert R.unsupported(tiny(platform=platform)) == []


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_reduced_geometry_any_dividing_tp(tp):
  assert R.unsupported(tiny(tensor_parallel_size=tp)) == []


def test_no_speculation_gives_q1():
  for kw in ({"speculative_method": None}, {"num_speculative_tokens": 0}, {"num_speculative_tokens": None}):
    d = tiny(**kw)
    assert not d.speculative
    assert R.unsupported(d) == []
    assert R.specialized_decode_config(d).q == 1


def test_no_speculation_ignores_method_and_token_rules():
  # vLLM: no speculative_config, so neither speculative rule applies.
  assert R.unsupported(tiny(speculative_method="eagle", num_speculative_tokens=0)) == []
  assert R.unsupported(tiny(speculative_method=None, num_speculative_tokens=9)) == []


def test_policy_is_frozen_sorted_and_thawed():
  policy = {"interpret": True, "blocks": {"mla": 64, "kda": {"chunk": 16}}, "sizes": [1, 2]}
  d = tiny(platform="cpu", additional_config={"policy": policy, "decode_backend": "latency_specialized"})
  hash(d)
  cfg = R.specialized_decode_config(d)
  assert [k for k, _ in cfg.policy] == ["blocks", "interpret", "sizes"]
  hash(cfg)
  assert cfg.policy_dict() == {"blocks": {"mla": 64, "kda": {"chunk": 16}}, "interpret": True, "sizes": (1, 2)}
  assert d.additional() == {"decode_backend": "latency_specialized", "policy": cfg.policy_dict()}


def test_replace_keeps_a_frozen_policy():
  d = tiny(platform="cpu", additional_config={**SPECIALIZED, "policy": {"interpret": True, "blocks": {"mla": 64}}})
  e = d.replace(tensor_parallel_size=2)  # passes the frozen additional_config back through __post_init__
  assert e.additional() == d.additional()
  assert d.replace(additional_config=d.additional_config) == d
  assert R.unsupported(e) == []
  cfg = R.specialized_decode_config(e)
  assert DecodeConfig(max_context=8, q=1, capture_sizes=(1,), policy=cfg.policy).policy == cfg.policy


def test_cpu_with_interpret_policy_is_supported():
  d = tiny(platform="cpu", additional_config={**SPECIALIZED, "policy": {"interpret": True}})
  assert R.unsupported(d) == []
  assert R.specialized_decode_config(d).policy_dict() == {"interpret": True}


def test_detected_platform_with_interpret_is_supported():
  # Here: "cpu" (interpret) or, on a GPU machine, its sm_XX.
  d = tiny(platform=None, additional_config={**SPECIALIZED, "policy": {"interpret": True}})
  assert d.current_platform() == R.detect_platform()
  assert R.unsupported(d) == []


# ---------------------------------------------------------------------------------------------------- backend
def test_auto_backend_returns_none_even_when_unsupported():
  assert R.specialized_decode_config(tiny(additional_config={})) is None
  assert R.specialized_decode_config(tiny(additional_config=None)) is None
  d = tiny(additional_config={"decode_backend": "auto"}, pipeline_parallel_size=2)
  assert R.unsupported(d) == ["pipeline parallelism"]
  assert R.specialized_decode_config(d) is None


@pytest.mark.parametrize("backend", ["fast", "", None, "LATENCY_SPECIALIZED"])
def test_unknown_backend_raises(backend):
  with pytest.raises(ValueError) as e:
    R.specialized_decode_config(tiny(additional_config={"decode_backend": backend}))
  assert str(e.value) == f"Supported decode_backend values are auto/latency_specialized (got {backend!r})"


# ---------------------------------------------------------------------------------------------------- each reason
REASON_CASES = [
    ("platform sm_80", dict(platform="sm_80"), ["this GPU (Hopper sm_90 or Blackwell sm_100/sm_103)"]),
    ("platform tpu", dict(platform="other:TPU v5 lite"), ["this GPU (Hopper sm_90 or Blackwell sm_100/sm_103)"]),
    ("cpu without interpret", dict(platform="cpu"), ["this GPU (Hopper sm_90 or Blackwell sm_100/sm_103)"]),
    ("cpu interpret False", dict(platform="cpu", additional_config={**SPECIALIZED, "policy": {"interpret": False}}),
     ["this GPU (Hopper sm_90 or Blackwell sm_100/sm_103)"]),
    ("kv_lora_rank", dict(model=C.kernel_tiny().replace(kv_lora_rank=64)),
     ["this model geometry: kv_lora_rank=64 (expects 512)"]),
    ("unquantised", dict(model=C.kernel_tiny(fp8=False)),
     ["this model geometry: fp8_block=None (expects (128, 128))"]),
    ("count larger", dict(model=C.kernel_tiny().replace(index_n_heads=64)),
     ["this model geometry: index_n_heads=64 (expects <= 32)"]),
    ("no mHC", dict(model=C.kernel_tiny().replace(hc_mult=1)),
     ["this model geometry: hc_mult=1 (expects 4)", "checkpoints without mHC"]),
    ("tp full", dict(model=C.real(), tensor_parallel_size=2), ["TP other than 4"]),
    ("tp full 8", dict(model=C.real(), tensor_parallel_size=8), ["TP other than 4"]),
    ("tp reduced 3", dict(tensor_parallel_size=3),
     ["TP=3 (must divide linear_num_heads=4, num_attention_heads=4, intermediate_size=1024, "
      "moe_intermediate_size=512, vocab_size=2048)"]),
    ("tp reduced 8", dict(tensor_parallel_size=8), ["TP=8 (must divide linear_num_heads=4, num_attention_heads=4)"]),
    ("pp", dict(pipeline_parallel_size=2), ["pipeline parallelism"]),
    ("dp", dict(data_parallel_size=2), ["data parallelism"]),
    ("ep", dict(enable_expert_parallel=True), ["expert parallelism"]),
    ("sp moe", dict(use_sequence_parallel_moe=True), ["sequence-parallel MoE"]),
    ("dbo", dict(use_ubatching=True), ["DBO"]),
    ("dcp", dict(decode_context_parallel_size=2), ["decode context parallel"]),
    ("pcp", dict(prefill_context_parallel_size=2), ["prefill context parallel"]),
    ("sleep", dict(enable_sleep_mode=True), ["sleep mode"]),
    ("lora", dict(lora_config="adapter"), ["LoRA"]),
    ("eager", dict(jit=False), ["deployments without a jitted decode step (eager)"]),
    ("no capture sizes", dict(capture_sizes=()), ["deployments without a jitted decode step (eager)"]),
    ("kv auto", dict(kv_cache_dtype="auto"), ["KV cache dtypes other than FP8"]),
    ("kv bf16", dict(kv_cache_dtype="bfloat16"), ["KV cache dtypes other than FP8"]),
    ("spec eagle", dict(speculative_method="eagle"), ["speculative methods other than MTP"]),
    ("spec 8 tokens", dict(num_speculative_tokens=8), ["more than 7 speculative tokens"]),
    ("kda fp32 conv", dict(mamba_cache_dtype="float32"),
     ["KDA cache dtypes other than a BF16 conv state and an FP32 recurrent state "
      "(mamba_cache_dtype, mamba_ssm_cache_dtype)"]),
    ("kda auto ssm", dict(mamba_ssm_cache_dtype="auto"),
     ["KDA cache dtypes other than a BF16 conv state and an FP32 recurrent state "
      "(mamba_cache_dtype, mamba_ssm_cache_dtype)"]),
    ("kda fp16 model", dict(dtype="float16"),
     ["KDA cache dtypes other than a BF16 conv state and an FP32 recurrent state "
      "(mamba_cache_dtype, mamba_ssm_cache_dtype)"]),
    ("replayssm", dict(use_replayssm=True), ["ReplaySSM / RecoverSSM (use_replayssm, use_kda_recoverssm)"]),
    ("recoverssm", dict(use_kda_recoverssm=True), ["ReplaySSM / RecoverSSM (use_replayssm, use_kda_recoverssm)"]),
]


@pytest.mark.parametrize("kw,reasons", [c[1:] for c in REASON_CASES], ids=[c[0] for c in REASON_CASES])
def test_each_reason(kw, reasons):
  d = tiny(**kw)
  assert R.unsupported(d) == reasons
  with pytest.raises(ValueError) as e:
    R.specialized_decode_config(d)
  assert str(e.value) == "GLM-5.3-Flash specialized decode does not support " + "; ".join(reasons)


def test_every_reason_is_covered():
  seen = {r for _, _, reasons in REASON_CASES for r in reasons}
  for key, text in R.REASONS.items():
    if "{" in text:  # templates: covered through their filled forms
      prefix = text.split("{")[0]
      assert any(r.startswith(prefix) for r in seen), key
    else:
      assert text in seen, key


def test_oracle_geometry_lists_every_field_in_order():
  [reason] = R.unsupported(tiny(model=C.oracle_tiny(fp8=True)))
  assert reason == (
      "this model geometry: linear_head_dim=32 (expects 128), kv_lora_rank=64 (expects 512), "
      "qk_nope_head_dim=32 (expects 256), v_head_dim=32 (expects 256), index_head_dim=32 (expects 128)")


def test_full_geometry_with_larger_count_needs_tp4():
  big = C.real().replace(vocab_size=160000)
  assert R.unsupported(full(model=big)) == ["this model geometry: vocab_size=160000 (expects <= 154880)"]
  assert R.unsupported(full(model=big, tensor_parallel_size=1)) == [
      "this model geometry: vocab_size=160000 (expects <= 154880)", "TP other than 4"]


def test_fp8_kv_cache_variants_are_supported():
  for kv in ("fp8", "fp8_e4m3"):
    assert R.unsupported(tiny(kv_cache_dtype=kv)) == []


def test_seven_speculative_tokens_supported():
  assert R.specialized_decode_config(tiny(num_speculative_tokens=7)).q == 8


# ---------------------------------------------------------------------------------------------------- several reasons
def test_five_broken_rules_give_five_reasons():
  d = tiny(pipeline_parallel_size=2, data_parallel_size=2, lora_config="adapter", kv_cache_dtype="auto",
           use_replayssm=True)
  assert R.unsupported(d) == ["pipeline parallelism", "data parallelism", "LoRA", "KV cache dtypes other than FP8",
                              "ReplaySSM / RecoverSSM (use_replayssm, use_kda_recoverssm)"]


def test_exact_message_of_many_reasons():
  d = tiny(platform="cpu", model=C.kernel_tiny().replace(kv_lora_rank=256), tensor_parallel_size=3,
           enable_expert_parallel=True, jit=False, speculative_method="ngram", num_speculative_tokens=9,
           mamba_ssm_cache_dtype="bfloat16", use_kda_recoverssm=True)
  with pytest.raises(ValueError) as e:
    R.specialized_decode_config(d)
  assert str(e.value) == (
      "GLM-5.3-Flash specialized decode does not support "
      "this GPU (Hopper sm_90 or Blackwell sm_100/sm_103); "
      "this model geometry: kv_lora_rank=256 (expects 512); "
      "TP=3 (must divide linear_num_heads=4, num_attention_heads=4, intermediate_size=1024, "
      "moe_intermediate_size=512, vocab_size=2048); "
      "expert parallelism; "
      "deployments without a jitted decode step (eager); "
      "speculative methods other than MTP; "
      "more than 7 speculative tokens; "
      "KDA cache dtypes other than a BF16 conv state and an FP32 recurrent state "
      "(mamba_cache_dtype, mamba_ssm_cache_dtype); "
      "ReplaySSM / RecoverSSM (use_replayssm, use_kda_recoverssm)")


# ---------------------------------------------------------------------------------------------------- kda_dtypes
BF16, F16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32)


@pytest.mark.parametrize("dtype,conv,ssm,expect", [
    ("bfloat16", "auto", "float32", (BF16, F32)),  # the default: conv follows the model
    ("bfloat16", "auto", "auto", (BF16, BF16)),  # recurrent follows the conv state
    ("bfloat16", "float32", "auto", (F32, F32)),
    ("bfloat16", "bfloat16", "float32", (BF16, F32)),
    ("float16", "auto", "float32", (F16, F32)),
    ("float32", "bfloat16", "auto", (BF16, BF16)),
    (jnp.bfloat16, "auto", "float32", (BF16, F32)),
])
def test_kda_dtypes(dtype, conv, ssm, expect):
  got = R.kda_dtypes(tiny(dtype=dtype, mamba_cache_dtype=conv, mamba_ssm_cache_dtype=ssm))
  assert got == expect
  assert all(isinstance(x, np.dtype) for x in got)


# ---------------------------------------------------------------------------------------------------- platform
@pytest.mark.parametrize("device,expect", [
    (SimpleNamespace(platform="gpu", compute_capability="9.0", device_kind="NVIDIA H100 80GB HBM3"), "sm_90"),
    (SimpleNamespace(platform="gpu", compute_capability="10.0", device_kind="NVIDIA B200"), "sm_100"),
    (SimpleNamespace(platform="gpu", compute_capability="10.3", device_kind="NVIDIA GB300"), "sm_103"),
    (SimpleNamespace(platform="gpu", compute_capability="8.0", device_kind="NVIDIA A100"), "sm_80"),
    (SimpleNamespace(platform="gpu", device_kind="NVIDIA H200"), "sm_90"),
    (SimpleNamespace(platform="gpu", device_kind="NVIDIA GB200"), "sm_100"),
    (SimpleNamespace(platform="gpu", device_kind="NVIDIA B300 SXM6 AC"), "sm_103"),
    (SimpleNamespace(platform="gpu", device_kind="AMD Instinct MI300X"), "other:AMD Instinct MI300X"),
    (SimpleNamespace(platform="tpu", device_kind="TPU v5 lite"), "other:TPU v5 lite"),
    (SimpleNamespace(platform="cpu", device_kind="cpu"), "cpu"),
])
def test_detect_platform(device, expect):
  assert R.detect_platform([device, device]) == expect


def test_detect_platform_mixed_and_real():
  cpu = SimpleNamespace(platform="cpu", device_kind="cpu")
  h100 = SimpleNamespace(platform="gpu", compute_capability="9.0", device_kind="H100")
  assert R.detect_platform([cpu, h100]) == "other:cpu+sm_90"
  if jax.default_backend() == "cpu":
    assert R.detect_platform() == "cpu"


# ---------------------------------------------------------------------------------------------------- DecodeConfig
def test_decode_config_capture_size_for():
  cfg = DecodeConfig(max_context=1024, q=4, capture_sizes=(1, 2, 4, 8))
  assert [cfg.capture_size_for(b) for b in (1, 2, 3, 4, 5, 8)] == [1, 2, 4, 4, 8, 8]
  with pytest.raises(ValueError, match=r"^batch=9 is larger than every capture size: capture_sizes=\(1, 2, 4, 8\)"):
    cfg.capture_size_for(9)
  with pytest.raises(ValueError, match=r"^batch=0 is invalid: expected a positive integer$"):
    cfg.capture_size_for(0)


def test_decode_config_policy_from_dict_or_pairs():
  a = DecodeConfig(max_context=8, q=1, capture_sizes=(1,), policy={"b": 1, "a": {"x": [1]}})
  b = DecodeConfig(max_context=8, q=1, capture_sizes=(1,), policy=(("a", {"x": (1,)}), ("b", 1)))
  assert a == b and hash(a) == hash(b)
  assert a.policy == (("a", (("x", (1,)),)), ("b", 1))
  assert a.policy_dict() == {"a": {"x": (1,)}, "b": 1}


@pytest.mark.parametrize("kw,message", [
    (dict(max_context=0), "DecodeConfig.max_context=0 is invalid: expected a positive integer (max_model_len)"),
    (dict(q=0), "DecodeConfig.q=0 is invalid: expected an integer in [1, 8] (1 + num_speculative_tokens)"),
    (dict(q=9), "DecodeConfig.q=9 is invalid: expected an integer in [1, 8] (1 + num_speculative_tokens)"),
    (dict(capture_sizes=()),
     "DecodeConfig.capture_sizes=() is invalid: expected positive batch sizes, unique and ascending, at least one"),
    (dict(capture_sizes=(2, 1)),
     "DecodeConfig.capture_sizes=(2, 1) is invalid: expected positive batch sizes, unique and ascending, at least one"),
    (dict(capture_sizes=(1, 1)),
     "DecodeConfig.capture_sizes=(1, 1) is invalid: expected positive batch sizes, unique and ascending, at least one"),
    (dict(capture_sizes=(0, 1)),
     "DecodeConfig.capture_sizes=(0, 1) is invalid: expected positive batch sizes, unique and ascending, at least one"),
    (dict(policy={1: 2}), "DecodeConfig.policy={1: 2} is invalid: expected str keys"),
    (dict(policy=(("a", 1), ("a", 2))), "DecodeConfig.policy=(('a', 1), ('a', 2)) is invalid: expected unique keys"),
    (dict(policy={"a": np.zeros(2)}),
     "DecodeConfig.policy['a']=array([0., 0.]) is invalid: expected a hashable (JSON-like) value"),
])
def test_decode_config_validation(kw, message):
  base = dict(max_context=8, q=1, capture_sizes=(1,))
  with pytest.raises(ValueError) as e:
    DecodeConfig(**{**base, **kw})
  assert str(e.value) == message


# ---------------------------------------------------------------------------------------------------- DeploymentConfig
def test_deployment_defaults_and_normalisation():
  d = DeploymentConfig(model=C.kernel_tiny(), capture_sizes=[8, 1, 2, 2], additional_config={"z": 1, "a": [1]})
  assert d.max_model_len == 65536
  assert d.capture_sizes == (1, 2, 8)
  assert d.additional_config == (("a", (1,)), ("z", 1))
  assert d.additional() == {"a": (1,), "z": 1}
  assert d.speculative and d.num_speculative_tokens == 3
  assert d.replace(additional_config=d.additional_config) == d
  hash(d)


@pytest.mark.parametrize("kw,message", [
    (dict(model="real"), "DeploymentConfig.model='str' is invalid: expected a Glm5Config"),
    (dict(tensor_parallel_size=0), "DeploymentConfig.tensor_parallel_size=0 is invalid: expected a positive integer"),
    (dict(pipeline_parallel_size=True),
     "DeploymentConfig.pipeline_parallel_size=True is invalid: expected a positive integer"),
    (dict(jit=1), "DeploymentConfig.jit=1 is invalid: expected True or False"),
    (dict(kv_cache_dtype="FP8"), "DeploymentConfig.kv_cache_dtype='FP8' is invalid: expected one of auto, bfloat16, "
                                 "bf16, float16, fp16, half, float32, fp8, fp8_e4m3, fp8_e5m2, fp8_inc, fp8_ds_mla"),
    (dict(dtype="auto"),
     "DeploymentConfig.dtype='auto' is invalid: expected the resolved model dtype: bfloat16, float16 or float32"),
    (dict(mamba_cache_dtype="fp8"), "DeploymentConfig.mamba_cache_dtype='fp8' is invalid: expected one of bf16, "
                                    "bfloat16, float, float16, float32, fp16, fp32, half"),
    (dict(mamba_ssm_cache_dtype=np.int8),
     "DeploymentConfig.mamba_ssm_cache_dtype=<class 'numpy.int8'> is invalid: expected bfloat16, float16 or float32"),
    (dict(speculative_method=""),
     "DeploymentConfig.speculative_method='' is invalid: expected a method name such as 'mtp', or None"),
    (dict(num_speculative_tokens=-1),
     "DeploymentConfig.num_speculative_tokens=-1 is invalid: expected a non-negative integer or None"),
    (dict(max_model_len=0), "DeploymentConfig.max_model_len=0 is invalid: expected a positive integer"),
    (dict(max_model_len=65537),
     "DeploymentConfig.max_model_len=65537 is invalid: expected <= max_position_embeddings=65536"),
    (dict(capture_sizes=(1, 0)),
     "DeploymentConfig.capture_sizes=(1, 0) is invalid: expected positive integer batch sizes"),
    (dict(additional_config={"policy": "fast"}),
     "DeploymentConfig.additional_config['policy']='fast' is invalid: expected a dict of kernel and tuning knobs"),
    (dict(additional_config=[1, 2]),
     "DeploymentConfig.additional_config=[1, 2] is invalid: expected a dict or (key, value) pairs"),
    (dict(platform="gpu"), "DeploymentConfig.platform='gpu' is invalid: expected 'sm_90', 'sm_100', 'sm_103', "
                           "'cpu', 'other:<kind>' or None"),
])
def test_deployment_validation(kw, message):
  with pytest.raises(ValueError) as e:
    DeploymentConfig(**{"model": C.kernel_tiny(), **kw})
  assert str(e.value) == message


def test_deployment_is_frozen():
  d = tiny()
  with pytest.raises(AttributeError):
    d.tensor_parallel_size = 4
