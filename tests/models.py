"""The small DeepSeek-V2 configs the tests use (defined once, in mla_ops.models)."""
from mla_ops.models import build_model, lite_attn_config, tiny_config, yarn_rope_parameters  # noqa: F401
