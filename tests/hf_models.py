"""The small DeepSeek-V2 configs the tests use (defined once, in mla_ops.configs)."""
from mla_ops.configs import build_model, lite_attn_config, tiny_config, yarn_rope_parameters  # noqa: F401
