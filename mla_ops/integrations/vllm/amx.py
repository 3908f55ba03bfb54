"""vLLM's AMX MLA backend (x86 CPUs with AMX tiles) with decode and cache write on `torch.ops.mla`.

Subclasses `vllm/v1/attention/backends/mla/amx_mla.py` (`AMXMLABackend`, `AMXMLAImpl`). vLLM's CPU platform
picks AMX_MLA instead of CPU_MLA whenever `torch.cpu._is_amx_tile_supported()`; the plugin re-points both so
the route does not depend on the CPU model. The cache layout is the same `[num_blocks, block_size, 576]`
(block_size a multiple of 32 here); AMX's own prefill (`forward_mha`, `extend_attention_cpu`) reads the
cache our scatter wrote, in the layout it expects. The decode and cache-write code is the CPU_MLA route's,
shared through :mod:`.cpu`.

The default where mla-ops' bf16 decode runs its AMX engine (measured faster than vLLM's AMX kernel on the
same memory, :mod:`.routes`); elsewhere (the engine turned off, oneDNN capped below AMX) only under
`MLA_OPS_VLLM_ROUTE=mla-ops`.
"""
from __future__ import annotations

from vllm.v1.attention.backends.mla.amx_mla import AMXMLABackend, AMXMLAImpl

from .cpu import MlaOpsMethods


class MlaOpsAMXMLAImpl(MlaOpsMethods, AMXMLAImpl):
    """`AMXMLAImpl` whose decode is `mla.mla_decode_attention` and cache write `mla.scatter_pa_kv_cache`."""

    backend_name = "AMX_MLA"


class MlaOpsAMXMLABackend(AMXMLABackend):
    """`AMXMLABackend` with :class:`MlaOpsAMXMLAImpl`; `get_name()` stays "AMX_MLA"."""

    @staticmethod
    def get_impl_cls() -> type[MlaOpsAMXMLAImpl]:
        return MlaOpsAMXMLAImpl
