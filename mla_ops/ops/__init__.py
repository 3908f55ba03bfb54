"""The `mla::` operators, one module per op (or per pair of twin ops).

Each module holds everything that makes its operator, in this order: the metadata check (shared by
the fake and every eager kernel), the fake kernel, the reference kernel (torch ops, any device: the
ground truth, and the CPU kernel when no native one is built), the autograd formula if the op has
one, the `define_op(...)` record that registers all of it, and the typed public wrapper.
Importing this package defines every op: every module in it is imported, so a new op module is
defined (and its `OpDef` in `mla_ops._library.OPS`) without being listed anywhere; the names
imported here are the public wrappers.
"""
import importlib as _importlib
import pkgutil as _pkgutil

from .decode_attention import mla_decode_attention
from .gather_pa_kv_cache import gather_pa_kv_cache, gather_pa_kv_cache_into
from .kv_compressor import kv_compressor
from .kv_prolog import kv_prolog, latent_kv_prolog
from .mha_prefill_attention import mha_prefill_attention
from .mla_prefill_attention import mla_prefill_attention
from .q_prolog import q_prolog
from .rms_norm import rms_norm
from .rope import rope
from .scatter_pa_kv_cache import scatter_pa_cache, scatter_pa_kv_cache
from .shared_kv_attention import shared_kv_attention
from .shared_kv_prolog import shared_kv_prolog, shared_kv_q_prolog
from .sparse_attention import lightning_indexer, sparse_mla_attention, to_global_slots

for _module in _pkgutil.iter_modules(__path__):  # the op modules without a public wrapper here
    _importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["rms_norm", "rope", "kv_prolog", "latent_kv_prolog", "q_prolog", "scatter_pa_kv_cache", "gather_pa_kv_cache",
           "gather_pa_kv_cache_into", "mla_decode_attention", "mla_prefill_attention", "mha_prefill_attention",
           "scatter_pa_cache", "lightning_indexer",
           "sparse_mla_attention", "to_global_slots", "shared_kv_attention", "shared_kv_q_prolog",
           "shared_kv_prolog", "kv_compressor"]
