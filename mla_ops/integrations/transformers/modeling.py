"""Where transformers keeps DeepSeek-V2 and how its modules are recognised (no patching here)."""
from __future__ import annotations

import os

import torch

from ..._optional import has_module

SUPPORTED_TRANSFORMERS = ("5.24.0", "5.25.0")  # [min, max): the versions this patch is tested against
ALLOW_UNTESTED_ENV = "MLA_OPS_ALLOW_UNTESTED_TRANSFORMERS"


def native_module():
    """transformers' `modeling_deepseek_v2` module (imports transformers)."""
    from transformers.models.deepseek_v2 import modeling_deepseek_v2

    return modeling_deepseek_v2


def has_native_deepseek_v2() -> bool:
    """Whether the installed transformers ships DeepSeek-V2 itself (4.54 and later), without importing it."""
    return has_module("transformers.models.deepseek_v2")


def check_transformers_version() -> str:
    """Raise a clear error unless the installed transformers is in SUPPORTED_TRANSFORMERS."""
    import transformers
    from packaging.version import Version

    installed = Version(transformers.__version__)
    low, high = (Version(v) for v in SUPPORTED_TRANSFORMERS)
    if not (low <= installed < high) and os.environ.get(ALLOW_UNTESTED_ENV) != "1":
        raise RuntimeError(
            f"mla_ops.model_patches.deepseek_v2 supports transformers >= {SUPPORTED_TRANSFORMERS[0]}, "
            f"< {SUPPORTED_TRANSFORMERS[1]} (the DeepseekV2Attention forward's cache keyword and cache layout "
            f"changed across 5.x); found {transformers.__version__}. Install transformers=="
            f"{SUPPORTED_TRANSFORMERS[0]}, or set {ALLOW_UNTESTED_ENV}=1 to try anyway.")
    return transformers.__version__


def is_native_attention(module: torch.nn.Module) -> bool:
    return has_native_deepseek_v2() and isinstance(module, native_module().DeepseekV2Attention)


def is_rms_norm(module: torch.nn.Module) -> bool:
    return type(module).__name__ == "DeepseekV2RMSNorm" and hasattr(module, "variance_epsilon")
