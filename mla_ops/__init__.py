"""mla-ops: multi-head latent attention (MLA) kernels as PyTorch operators, `torch.ops.mla.*`.

Importing this package defines every op (schema, fake, reference kernel, autograd: `mla_ops.ops`),
routes them to the backends (`mla_ops.backends`: the native CPU kernels
register themselves when their extension loads) and imports no NPU, CUDA or PyPTO package.

    import mla_ops, torch
    k_nope, value, k_pe = torch.ops.mla.kv_prolog(hidden, kv_a_w, None, norm_w, kv_b_w, cos, sin,
                                                  num_heads=16, qk_nope_head_dim=128, v_head_dim=128)

`mla_ops.patch(model)` routes a transformers MLA model through the ops (it imports transformers when
first used; see `mla_ops.integrations.transformers.patch.patch`).
"""
from . import ops  # noqa: F401,I001  (defines the ops before the backends route them)
from . import backends, settings
from .backends import explain
from .ops import (
    gather_pa_kv_cache,
    gather_pa_kv_cache_into,
    kv_compressor,
    kv_prolog,
    latent_kv_prolog,
    lightning_indexer,
    mha_prefill_attention,
    mla_decode_attention,
    mla_prefill_attention,
    q_prolog,
    rms_norm,
    rope,
    scatter_pa_cache,
    scatter_pa_kv_cache,
    shared_kv_attention,
    shared_kv_prolog,
    shared_kv_q_prolog,
    sparse_mla_attention,
    to_global_slots,
)
from ._version import __version__
from .settings import set_backend, use_backend

backends.cpu_native.warn_if_unavailable()


def __getattr__(name: str):
    # `mla_ops.patch` is the transformers integration's `patch`: imported on first use, so that
    # `import mla_ops` (the ops, the backends, the vLLM plugin) never imports transformers.
    if name == "patch":
        try:
            from .integrations.transformers.patch import patch
        except ModuleNotFoundError as exc:
            if exc.name != "transformers":
                raise
            raise ModuleNotFoundError("mla_ops.patch needs transformers: pip install 'mla-ops[transformers]'",
                                      name="transformers") from exc
        globals()["patch"] = patch
        return patch
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), "patch"})


def patch_deepseek_v2(model=None, **options):
    """Deprecated name of `mla_ops.patch(model, **options)`: the same options; `cache` defaults to "dense"."""
    __getattr__("patch")  # imports transformers, with the error that names the extra when it is missing
    from .integrations.transformers.patch import patch_under_former_name

    return patch_under_former_name("mla_ops.patch_deepseek_v2", model, options)


# (`patch` is left out: `from mla_ops import *` must not need transformers)
__all__ = [
    "__version__", "backends", "settings", "explain", "patch_deepseek_v2", "set_backend", "use_backend",
    "rms_norm", "rope", "kv_prolog", "latent_kv_prolog", "q_prolog",
    "scatter_pa_kv_cache", "gather_pa_kv_cache", "gather_pa_kv_cache_into", "mla_decode_attention",
    "scatter_pa_cache", "lightning_indexer", "sparse_mla_attention", "to_global_slots",
    "shared_kv_q_prolog", "shared_kv_prolog", "kv_compressor", "shared_kv_attention",
    "mla_prefill_attention", "mha_prefill_attention",
]
