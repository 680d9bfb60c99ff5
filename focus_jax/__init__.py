"""focus_jax: block-diffusion language models (SDAR) on GPUs and TPUs with JAX, made fast by FOCUS
eviction inside jit-compiled, static-shape decode steps."""

from focus_jax.quiet import quiet_transformers

quiet_transformers()  # before anything imports transformers

from focus_jax import tpu  # noqa: E402
from focus_jax.api import encode_prompt, generate  # noqa: E402
from focus_jax.bundled import MODEL as BUNDLED_MODEL  # noqa: E402
from focus_jax.checkpoint import convert, load, save  # noqa: E402
from focus_jax.config import ConfigError, GenerationConfig, ModelConfig, Quantization  # noqa: E402
from focus_jax.engine import Engine, RequestError, RequestStats, Result, RunStats  # noqa: E402
from focus_jax.model import Model  # noqa: E402

# Before any backend starts: on a host without TPU chips, libtpu (installed for compile-check)
# would print its initialisation errors before every command's output.
tpu.skip_absent_tpu()

__all__ = [
    "BUNDLED_MODEL", "ConfigError", "Engine", "GenerationConfig", "Model", "ModelConfig", "Quantization",
    "RequestError",
    "RequestStats", "Result", "RunStats", "convert", "encode_prompt", "generate", "load", "save",
]
__version__ = "0.1.0"
