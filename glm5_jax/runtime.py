"""Which deployments may run the GLM-5.3-Flash "latency_specialized" decode, and with which settings.

A port of vLLM's ``vllm.models.glm5next.nvidia.specialized_decode.runtime``:

* :class:`DeploymentConfig` — the deployment, with vLLM's field names (``tensor_parallel_size``,
  ``kv_cache_dtype``, ``mamba_ssm_cache_dtype``, ``additional_config`` …) so a vLLM user recognises them.
* :func:`kda_dtypes` — the (conv, recurrent) KDA state dtypes the deployment selects.
* :func:`unsupported` — every reason the deployment cannot run the specialized decode (all of them, not the
  first).
* :func:`specialized_decode_config` — the :class:`DecodeConfig` of a deployment that asks for
  ``additional_config={"decode_backend": "latency_specialized"}``; ``None`` for ``"auto"`` (the stock decode);
  a ``ValueError`` listing every reason for an unsupported deployment.

Where vLLM speaks of CUDA graphs this port speaks of the jitted decode step: the one XLA program per
step plays the role of vLLM's FULL decode CUDA graph, and the capture sizes are the batch sizes that
program is compiled for.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax.config import GEOMETRY, GEOMETRY_COUNTS, Glm5Config

DECODE_BACKENDS = ("auto", "latency_specialized")
"""The values ``additional_config["decode_backend"]`` may take."""

MAX_SPECULATIVE_TOKENS = 7
"""The most draft tokens per step the specialized decode verifies (q = 1 + k <= 8)."""

SUPPORTED_GPUS = ("sm_90", "sm_100", "sm_103")
"""Hopper (sm_90) and Blackwell (sm_100, sm_103): the GPU families Mosaic GPU compiles for."""

FULL_TP = 4
"""The only tensor-parallel size of the release geometry."""

# Every reason text, defined once. ``unsupported`` returns these (the two templates filled in) in this
# order, which follows the seed's.
REASONS: dict[str, str] = {
    "platform": "this GPU (Hopper sm_90 or Blackwell sm_100/sm_103)",
    "geometry": "this model geometry: {}",  # filled with "name=value (expects ...)" items
    "mhc": "checkpoints without mHC",
    "tp": "TP other than 4",
    "tp_reduced": "TP={tp} (must divide {sizes})",  # reduced (test) geometries
    "pp": "pipeline parallelism",
    "dp": "data parallelism",
    "ep": "expert parallelism",
    "sp_moe": "sequence-parallel MoE",
    "dbo": "DBO",
    "dcp": "decode context parallel",
    "pcp": "prefill context parallel",
    "sleep": "sleep mode",
    "lora": "LoRA",
    "eager": "deployments without a jitted decode step (eager)",
    "kv_cache": "KV cache dtypes other than FP8",
    "spec_method": "speculative methods other than MTP",
    "spec_tokens": f"more than {MAX_SPECULATIVE_TOKENS} speculative tokens",
    "kda_dtypes": ("KDA cache dtypes other than a BF16 conv state and an FP32 recurrent state "
                   "(mamba_cache_dtype, mamba_ssm_cache_dtype)"),
    "replayssm": "ReplaySSM / RecoverSSM (use_replayssm, use_kda_recoverssm)",
}

ERROR_PREFIX = "GLM-5.3-Flash specialized decode does not support "
"""The start of the ValueError of :func:`specialized_decode_config`; the reasons follow, joined by "; "."""

# vLLM's STR_DTYPE_TO_TORCH_DTYPE, for the dtypes a model or a KDA state may have.
_DTYPES: dict[str, Any] = {
    "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16,
    "float16": jnp.float16, "half": jnp.float16, "fp16": jnp.float16,
    "float32": jnp.float32, "float": jnp.float32, "fp32": jnp.float32,
}
# vLLM's CacheDType values (plus the "bf16" spelling).
_KV_CACHE_DTYPES = ("auto", "bfloat16", "bf16", "float16", "fp16", "half", "float32", "fp8", "fp8_e4m3",
                    "fp8_e5m2", "fp8_inc", "fp8_ds_mla")
# TP shards these model sizes in a reduced geometry.
_TP_SHARDED = ("linear_num_heads", "num_attention_heads", "intermediate_size", "moe_intermediate_size",
               "vocab_size")


# ---------------------------------------------------------------------------------------------------- helpers
def _bad(owner: str, field: str, value: Any, expect: str):
  raise ValueError(f"{owner}.{field}={value!r} is invalid: expected {expect}")


def _is_int(v: Any) -> bool:
  return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


class _FrozenDict(tuple):
  """A dict frozen into a hashable tuple of sorted (key, value) pairs; thawed back into a dict."""

  __slots__ = ()


def _freeze(value: Any, where: str) -> Any:
  """A hashable copy of a JSON-like value: dicts become sorted pair tuples, lists tuples, sets frozensets."""
  if isinstance(value, _FrozenDict):  # already frozen (e.g. a field passed on by dataclasses.replace)
    return value
  if isinstance(value, Mapping):
    return _FrozenDict(_freeze_items(value, where))
  if isinstance(value, (list, tuple)):
    return tuple(_freeze(v, f"{where}[{i}]") for i, v in enumerate(value))
  if isinstance(value, (set, frozenset)):
    return frozenset(_freeze(v, where) for v in value)
  try:
    hash(value)
  except TypeError:
    raise ValueError(f"{where}={value!r} is invalid: expected a hashable (JSON-like) value") from None
  return value


def _freeze_items(items: Any, where: str) -> tuple[tuple[str, Any], ...]:
  """Sorted, frozen (key, value) pairs of a mapping or of an iterable of pairs with unique str keys."""
  if isinstance(items, Mapping):
    pairs = list(items.items())
  else:
    try:
      pairs = [tuple(p) for p in items]
    except TypeError:
      raise ValueError(f"{where}={items!r} is invalid: expected a dict or (key, value) pairs") from None
    if any(len(p) != 2 for p in pairs):
      raise ValueError(f"{where}={items!r} is invalid: expected a dict or (key, value) pairs")
  keys = [k for k, _ in pairs]
  if not all(isinstance(k, str) for k in keys):
    raise ValueError(f"{where}={items!r} is invalid: expected str keys")
  if len(set(keys)) != len(keys):
    raise ValueError(f"{where}={items!r} is invalid: expected unique keys")
  return tuple(sorted(((k, _freeze(v, f"{where}[{k!r}]")) for k, v in pairs), key=lambda kv: kv[0]))


def _thaw(value: Any) -> Any:
  """The inverse of :func:`_freeze` for dicts (lists stay tuples)."""
  if isinstance(value, _FrozenDict):
    return {k: _thaw(v) for k, v in value}
  if isinstance(value, tuple):
    return tuple(_thaw(v) for v in value)
  return value


def _thaw_items(items: tuple[tuple[str, Any], ...]) -> dict[str, Any]:
  return {k: _thaw(v) for k, v in items}


def _dtype(name: Any, owner: str, field: str) -> np.dtype:
  """The numpy dtype of a vLLM dtype name (or of a numpy / jnp dtype)."""
  if isinstance(name, str):
    if name not in _DTYPES:
      _bad(owner, field, name, "one of " + ", ".join(sorted(_DTYPES)))
    return np.dtype(_DTYPES[name])
  try:
    dt = np.dtype(name)
  except TypeError:
    _bad(owner, field, name, "a dtype name such as 'bfloat16' or 'float32'")
  if dt not in {np.dtype(v) for v in _DTYPES.values()}:
    _bad(owner, field, name, "bfloat16, float16 or float32")
  return dt


# ---------------------------------------------------------------------------------------------------- platform
def detect_platform(devices: Any = None) -> str:
  """The platform of the JAX devices: "sm_90", "sm_100", "sm_103" (any "sm_XY"), "cpu" or "other:<kind>".

  GPUs are named by ``device.compute_capability`` ("9.0" -> "sm_90", "10.3" -> "sm_103") where jaxlib
  gives it, else by their ``device_kind`` (H100/H200 -> sm_90, B200/GB200 -> sm_100, B300/GB300 ->
  sm_103). Devices of different platforms give "other:" and their platforms joined by "+".

  Args:
    devices: the devices to inspect; ``None``: ``jax.devices()``.
  """
  devices = jax.devices() if devices is None else list(devices)
  names = sorted({_device_platform(d) for d in devices})
  if not names:
    return "other:none"
  if len(names) == 1:
    return names[0]
  return "other:" + "+".join(names)


def _device_platform(device: Any) -> str:
  platform = str(getattr(device, "platform", "")).lower()
  kind = str(getattr(device, "device_kind", "") or platform)
  if platform == "cpu":
    return "cpu"
  if platform in ("gpu", "cuda"):
    cc = getattr(device, "compute_capability", None)
    if cc:
      m = re.fullmatch(r"(\d+)\.(\d+)", str(cc))
      if m:
        return f"sm_{m.group(1)}{m.group(2)}"
    upper = kind.upper()
    for marker, name in (("B300", "sm_103"), ("B200", "sm_100"), ("H100", "sm_90"), ("H200", "sm_90")):
      if marker in upper:  # GB300 / GB200 contain B300 / B200
        return name
  return f"other:{kind}"


_PLATFORM_RE = re.compile(r"cpu|sm_\d+|other:.+", re.DOTALL)


# ---------------------------------------------------------------------------------------------------- configs
@dataclasses.dataclass(frozen=True)
class DecodeConfig:
  """The specialized decode settings of a supported deployment. Frozen, hashable (a static jit argument)."""

  max_context: int
  """The longest sequence (prompt + generated tokens) a slot holds: vLLM's ``max_model_len``."""
  q: int
  """Tokens per decode step and sequence: 1 + num_speculative_tokens (1 without speculation)."""
  capture_sizes: tuple[int, ...]
  """The batch sizes the decode step is compiled for: positive, unique, ascending, at least one."""
  policy: tuple[tuple[str, Any], ...] = ()
  """``additional_config["policy"]``: kernel and tuning knobs as sorted (name, value) pairs (a dict is
  accepted and frozen; nested dicts are frozen too)."""

  def __post_init__(self):
    owner = "DecodeConfig"
    if not _is_int(self.max_context) or self.max_context <= 0:
      _bad(owner, "max_context", self.max_context, "a positive integer (max_model_len)")
    if not _is_int(self.q) or not 1 <= self.q <= 1 + MAX_SPECULATIVE_TOKENS:
      _bad(owner, "q", self.q, f"an integer in [1, {1 + MAX_SPECULATIVE_TOKENS}] (1 + num_speculative_tokens)")
    try:
      sizes = tuple(self.capture_sizes)
    except TypeError:
      _bad(owner, "capture_sizes", self.capture_sizes, "a tuple of batch sizes")
    if (not sizes or not all(_is_int(s) and s > 0 for s in sizes)
        or any(a >= b for a, b in zip(sizes, sizes[1:]))):
      _bad(owner, "capture_sizes", self.capture_sizes, "positive batch sizes, unique and ascending, at least one")
    object.__setattr__(self, "max_context", int(self.max_context))
    object.__setattr__(self, "q", int(self.q))
    object.__setattr__(self, "capture_sizes", tuple(int(s) for s in sizes))
    object.__setattr__(self, "policy", _freeze_items(self.policy, f"{owner}.policy"))

  @property
  def k(self) -> int:
    """Draft tokens per step (num_speculative_tokens): q - 1."""
    return self.q - 1

  def policy_dict(self) -> dict[str, Any]:
    """The policy as a dict (nested dicts thawed; lists come back as tuples)."""
    return _thaw_items(self.policy)

  def capture_size_for(self, batch: int) -> int:
    """The smallest capture size that holds ``batch`` sequences (the compiled step a batch pads to)."""
    if not _is_int(batch) or batch <= 0:
      raise ValueError(f"batch={batch!r} is invalid: expected a positive integer")
    for size in self.capture_sizes:
      if size >= batch:
        return size
    raise ValueError(f"batch={batch} is larger than every capture size: capture_sizes={self.capture_sizes} "
                     f"(largest {self.capture_sizes[-1]})")


@dataclasses.dataclass(frozen=True)
class DeploymentConfig:
  """A deployment of GLM-5.3-Flash, with vLLM's names for what the specialized decode depends on.

  Frozen and hashable. ``additional_config`` is stored as sorted (key, value) pairs; read it with
  :meth:`additional`.
  """

  model: Glm5Config
  """The model geometry (vLLM: ``model_config.hf_text_config``)."""
  tensor_parallel_size: int = 1
  """Tensor-parallel devices (vLLM: ``parallel_config.tensor_parallel_size``)."""
  pipeline_parallel_size: int = 1
  """Pipeline stages (vLLM: ``parallel_config.pipeline_parallel_size``)."""
  data_parallel_size: int = 1
  """Data-parallel replicas (vLLM: ``parallel_config.data_parallel_size``)."""
  enable_expert_parallel: bool = False
  """Shard experts instead of their widths (vLLM: ``parallel_config.enable_expert_parallel``)."""
  use_sequence_parallel_moe: bool = False
  """Sequence-parallel MoE (vLLM: ``parallel_config.use_sequence_parallel_moe``)."""
  use_ubatching: bool = False
  """Dual-batch overlap, DBO (vLLM: ``parallel_config.use_ubatching``)."""
  decode_context_parallel_size: int = 1
  """Decode context parallelism (vLLM: ``parallel_config.decode_context_parallel_size``)."""
  prefill_context_parallel_size: int = 1
  """Prefill context parallelism (vLLM: ``parallel_config.prefill_context_parallel_size``)."""
  enable_sleep_mode: bool = False
  """Sleep mode (vLLM: ``model_config.enable_sleep_mode``)."""
  lora_config: Any = None
  """LoRA adapters; ``None``: no LoRA (vLLM: ``lora_config``)."""
  jit: bool = True
  """Whether the decode step is one jitted program; False: an eager step (vLLM: ``enforce_eager``)."""
  kv_cache_dtype: str = "fp8"
  """MLA KV cache dtype: "auto", "bfloat16"/"bf16", "fp8", "fp8_e4m3", … (vLLM: ``cache_config.cache_dtype``)."""
  mamba_cache_dtype: str = "auto"
  """KDA conv state dtype; "auto": the model dtype (vLLM: ``cache_config.mamba_cache_dtype``)."""
  mamba_ssm_cache_dtype: str = "float32"
  """KDA recurrent state dtype; "auto": the conv state dtype (vLLM: ``cache_config.mamba_ssm_cache_dtype``)."""
  dtype: Any = "bfloat16"
  """The model (activation) dtype: "bfloat16", "float16" or "float32" (vLLM: ``model_config.dtype``)."""
  use_replayssm: bool = False
  """ReplaySSM state records (vLLM: ``cache_config.use_replayssm``)."""
  use_kda_recoverssm: bool = False
  """KDA RecoverSSM state records (vLLM: ``cache_config.use_kda_recoverssm``)."""
  speculative_method: str | None = "mtp"
  """Speculative decoding method, e.g. "mtp"; ``None``: none (vLLM: ``speculative_config.method``)."""
  num_speculative_tokens: int | None = 3
  """Draft tokens per step; 0 or ``None``: no speculation (vLLM: ``speculative_config.num_speculative_tokens``)."""
  max_model_len: int | None = None
  """Longest sequence; ``None``: the model's max_position_embeddings (vLLM: ``model_config.max_model_len``)."""
  capture_sizes: tuple[int, ...] = (1, 2, 4, 8)
  """Batch sizes the decode step is compiled for; stored unique and ascending; empty: no compiled step
  (vLLM: ``compilation_config.cudagraph_capture_sizes``)."""
  additional_config: Any = ()
  """``{"decode_backend": "auto" | "latency_specialized", "policy": {...}}`` and any other keys, as a dict or
  (key, value) pairs; stored frozen (vLLM: ``additional_config``)."""
  platform: str | None = None
  """"sm_90", "sm_100", "sm_103", "cpu", "other:<kind>"; ``None``: detected from ``jax.devices()``."""

  def __post_init__(self):
    owner = "DeploymentConfig"
    if not isinstance(self.model, Glm5Config):
      _bad(owner, "model", type(self.model).__name__, "a Glm5Config")
    for f in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
              "decode_context_parallel_size", "prefill_context_parallel_size"):
      v = getattr(self, f)
      if not _is_int(v) or v <= 0:
        _bad(owner, f, v, "a positive integer")
    for f in ("enable_expert_parallel", "use_sequence_parallel_moe", "use_ubatching", "enable_sleep_mode", "jit",
              "use_replayssm", "use_kda_recoverssm"):
      if not isinstance(getattr(self, f), (bool, np.bool_)):
        _bad(owner, f, getattr(self, f), "True or False")
    if self.kv_cache_dtype not in _KV_CACHE_DTYPES:
      _bad(owner, "kv_cache_dtype", self.kv_cache_dtype, "one of " + ", ".join(_KV_CACHE_DTYPES))
    if self.dtype == "auto":
      _bad(owner, "dtype", self.dtype, "the resolved model dtype: bfloat16, float16 or float32")
    _dtype(self.dtype, owner, "dtype")
    for f in ("mamba_cache_dtype", "mamba_ssm_cache_dtype"):
      if getattr(self, f) != "auto":
        _dtype(getattr(self, f), owner, f)
    if self.speculative_method is not None and (not isinstance(self.speculative_method, str)
                                                or not self.speculative_method):
      _bad(owner, "speculative_method", self.speculative_method, "a method name such as 'mtp', or None")
    n = self.num_speculative_tokens
    if n is not None and (not _is_int(n) or n < 0):
      _bad(owner, "num_speculative_tokens", n, "a non-negative integer or None")
    if self.max_model_len is None:
      object.__setattr__(self, "max_model_len", self.model.max_position_embeddings)
    elif not _is_int(self.max_model_len) or self.max_model_len <= 0:
      _bad(owner, "max_model_len", self.max_model_len, "a positive integer")
    elif self.max_model_len > self.model.max_position_embeddings:
      _bad(owner, "max_model_len", self.max_model_len,
           f"<= max_position_embeddings={self.model.max_position_embeddings}")
    try:
      sizes = tuple(self.capture_sizes)
    except TypeError:
      _bad(owner, "capture_sizes", self.capture_sizes, "a tuple of positive batch sizes")
    if not all(_is_int(s) and s > 0 for s in sizes):
      _bad(owner, "capture_sizes", self.capture_sizes, "positive integer batch sizes")
    object.__setattr__(self, "capture_sizes", tuple(sorted({int(s) for s in sizes})))
    extra = _freeze_items({} if self.additional_config is None else self.additional_config,
                          f"{owner}.additional_config")
    object.__setattr__(self, "additional_config", extra)
    policy = dict(extra).get("policy", _FrozenDict())
    if not isinstance(policy, _FrozenDict):
      _bad(owner, "additional_config['policy']", _thaw(policy), "a dict of kernel and tuning knobs")
    if self.platform is not None and (not isinstance(self.platform, str)
                                      or not _PLATFORM_RE.fullmatch(self.platform)):
      _bad(owner, "platform", self.platform, "'sm_90', 'sm_100', 'sm_103', 'cpu', 'other:<kind>' or None")

  def additional(self) -> dict[str, Any]:
    """``additional_config`` as a dict (nested dicts thawed; lists come back as tuples)."""
    return _thaw_items(self.additional_config)

  @property
  def speculative(self) -> bool:
    """Whether the step verifies drafts: a speculative method with at least one token (vLLM: a
    ``speculative_config``)."""
    return self.speculative_method is not None and bool(self.num_speculative_tokens)

  def current_platform(self) -> str:
    """``platform``, or the platform detected from ``jax.devices()`` when it is ``None``."""
    return detect_platform() if self.platform is None else self.platform

  def replace(self, **kw) -> "DeploymentConfig":
    """A copy with some fields changed (validated again)."""
    return dataclasses.replace(self, **kw)


# ---------------------------------------------------------------------------------------------------- API
def kda_dtypes(deployment: DeploymentConfig) -> tuple[np.dtype, np.dtype]:
  """(conv, recurrent) KDA state dtypes the deployment's cache config selects.

  As vLLM's ``MambaStateDtypeCalculator`` (``get_kv_cache_torch_dtype`` then ``_mamba_state_dtype``): the
  conv state is ``mamba_cache_dtype``, "auto" meaning the model dtype; the recurrent state is
  ``mamba_ssm_cache_dtype``, "auto" meaning the conv state dtype.
  """
  d = deployment
  owner = "DeploymentConfig"
  model = _dtype(d.dtype, owner, "dtype")
  conv = model if d.mamba_cache_dtype == "auto" else _dtype(d.mamba_cache_dtype, owner, "mamba_cache_dtype")
  if d.mamba_ssm_cache_dtype == "auto":
    recurrent = conv
  else:
    recurrent = _dtype(d.mamba_ssm_cache_dtype, owner, "mamba_ssm_cache_dtype")
  return conv, recurrent


def _geometry(model: Glm5Config) -> list[str]:
  """"name=value (expects ...)" for every kernel-relevant field off the release geometry."""
  out = [f"{name}={getattr(model, name, None)} (expects {value})"
         for name, value in GEOMETRY.items() if getattr(model, name, None) != value]
  for name, value in GEOMETRY_COUNTS.items():
    got = getattr(model, name, None)
    if not _is_int(got) or got > value:
      out.append(f"{name}={got} (expects <= {value})")
  return out


def _tp_reason(model: Glm5Config, tp: int) -> str | None:
  """The TP reason: the release geometry runs at TP4 only; a reduced one at any TP dividing its sharded sizes."""
  reduced = any(_is_int(getattr(model, n, None)) and getattr(model, n) < v for n, v in GEOMETRY_COUNTS.items())
  if not reduced:
    return REASONS["tp"] if tp != FULL_TP else None
  undivided = [f"{n}={getattr(model, n)}" for n in _TP_SHARDED if getattr(model, n) % tp]
  return REASONS["tp_reduced"].format(tp=tp, sizes=", ".join(undivided)) if undivided else None


def unsupported(deployment: DeploymentConfig) -> list[str]:
  """Every reason this deployment cannot run the specialized decode (empty: it can), in a fixed order."""
  d = deployment
  model = d.model
  platform = d.current_platform()
  policy = dict(d.additional()).get("policy", {})
  # Mosaic GPU kernels run on Hopper and Blackwell (there without the wgmma kernels that have no tcgen05 form:
  # layers.WGMMA_KNOBS minus TCGEN05_KNOBS, which the decoder declines by name); on CPU only in Pallas interpret
  # mode (tests).
  platform_ok = platform in SUPPORTED_GPUS or (platform == "cpu" and policy.get("interpret") is True)
  geometry = _geometry(model)
  tp = _tp_reason(model, d.tensor_parallel_size)
  hc_mult = getattr(model, "hc_mult", None)
  checks = (
      (not platform_ok, REASONS["platform"]),
      (bool(geometry), REASONS["geometry"].format(", ".join(geometry))),
      # One residual stream (or none) is a checkpoint without manifold-constrained hyper-connections.
      (not _is_int(hc_mult) or hc_mult <= 1, REASONS["mhc"]),
      (tp is not None, tp),
      (d.pipeline_parallel_size != 1, REASONS["pp"]),
      (d.data_parallel_size != 1, REASONS["dp"]),
      (d.enable_expert_parallel, REASONS["ep"]),
      (d.use_sequence_parallel_moe, REASONS["sp_moe"]),
      (d.use_ubatching, REASONS["dbo"]),
      (d.decode_context_parallel_size != 1, REASONS["dcp"]),
      (d.prefill_context_parallel_size != 1, REASONS["pcp"]),
      (d.enable_sleep_mode, REASONS["sleep"]),
      (d.lora_config is not None, REASONS["lora"]),
      # vLLM runs the decode loop only inside FULL decode CUDA graphs; here the jitted step is that graph.
      # Without capture sizes there is no compiled step (vLLM drops to eager, cudagraph_mode NONE). vLLM's
      # torch.compile reason has no counterpart: the jitted step is the only compiled program.
      (not d.jit or not d.capture_sizes, REASONS["eager"]),
      (not str(d.kv_cache_dtype).startswith("fp8"), REASONS["kv_cache"]),
      (d.speculative and d.speculative_method != "mtp", REASONS["spec_method"]),
      (d.speculative and d.num_speculative_tokens > MAX_SPECULATIVE_TOKENS, REASONS["spec_tokens"]),
      # The KDA decode keeps a BF16 conv state and an FP32 recurrent state in place; it maintains neither
      # other state dtypes nor ReplaySSM / RecoverSSM records.
      (kda_dtypes(d) != (np.dtype(jnp.bfloat16), np.dtype(np.float32)), REASONS["kda_dtypes"]),
      (d.use_replayssm or d.use_kda_recoverssm, REASONS["replayssm"]),
  )
  return [reason for failed, reason in checks if failed]


def specialized_decode_config(deployment: DeploymentConfig) -> DecodeConfig | None:
  """The deployment's specialized decode settings; ``None`` for the stock decode (decode_backend "auto").

  Raises:
    ValueError: a ``decode_backend`` other than "auto" / "latency_specialized"; or the specialized decode
      requested for an unsupported deployment (the message lists every reason, joined by "; ").
  """
  extra = deployment.additional()
  backend = extra.get("decode_backend", "auto")
  if backend == "auto":
    return None
  if backend != "latency_specialized":
    raise ValueError(f"Supported decode_backend values are auto/latency_specialized (got {backend!r})")
  reasons = unsupported(deployment)
  if reasons:
    raise ValueError(ERROR_PREFIX + "; ".join(reasons))
  return DecodeConfig(
      max_context=deployment.max_model_len,
      q=1 + deployment.num_speculative_tokens if deployment.speculative else 1,
      capture_sizes=deployment.capture_sizes,
      policy=extra.get("policy", {}),
  )
