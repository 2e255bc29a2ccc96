"""glm5_jax: the GLM-5.3-Flash ("Glm5Next") speculative decode in JAX.

Public API: load_model, save_model, forward, init_cache, extend, enable_compile_cache (reference model, api.py);
the configs (config.py); the deployment checks (runtime.py); the speculative decode step (speculative.py):
glm5_jax.decode(state, tokens); warmup_all (several decoders' steps compiled concurrently).
"""

# The kernels' jax config states (pallas_kernels._common: PDL, in-kernel profiling) join every jit's cache key when
# they are defined: imported lazily — at a process's first prefill or step — they made every program compiled
# before (the model's loading, the first prefill's cache fill and key) compile again once. Defined first here.
import pallas_kernels._common  # noqa: F401,I001
from glm5_jax.config import Glm5Config, kernel_tiny, oracle_tiny, real
from glm5_jax.api import (Cache, Model, enable_compile_cache, extend, forward, init_cache, load_model,
                          save_model)
from glm5_jax.runtime import DecodeConfig, DeploymentConfig
from glm5_jax.speculative import DecodeOutput, DecodeState, Decoder, decode, warmup_all

__all__ = ["Glm5Config", "kernel_tiny", "oracle_tiny", "real", "Cache", "Model", "enable_compile_cache", "extend",
           "forward", "init_cache", "load_model", "save_model", "DecodeConfig", "DeploymentConfig", "DecodeOutput",
           "DecodeState", "Decoder", "decode", "warmup_all"]
