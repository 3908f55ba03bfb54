"""The paged MLA latent cache and its attention path: `apply(model, cache="paged")` (ARCHITECTURE §3.4-§3.6, §5).

Per token and layer the cache keeps only what MLA needs: the RMS-normed latent [L] and the rotated
k_pe [R] — 576 values, 1152 bytes in bf16 for DeepSeek-V2-Lite — in block pools
`[num_blocks, block_size, 1, L]` / `[num_blocks, block_size, 1, R]`, addressed through a block table
per batch row. Padding tokens are never stored (their slot is -1), so each row holds exactly its
real tokens.

* prefill: `mla.latent_kv_prolog` -> `mla.scatter_pa_kv_cache`; attention over the new tokens
  expanded with kv_b (exactly stock's arithmetic, so logits match stock bit for bit). When a row
  already has cached tokens (a prompt continued in a second call, chunked prefill), the prefix is
  read back with `mla.gather_pa_kv_cache` and expanded with it.
* decode (one token per row): the absorbed path of vLLM / FlashMLA — q_nope @ W_UK ->
  `mla.mla_decode_attention` over the paged latent cache -> @ W_UV -> o_proj. W_UK / W_UV are
  prepared once per layer from kv_b_proj.weight (contiguous copies); kv_b never runs over the cache.

`MLAPagedCache(static=False)` grows block by block from a free list (host bookkeeping, pools double
when full; it refuses to be traced by torch.compile). `MLAPagedCache(static=True, batch_size=...,
max_cache_len=...)` preallocates everything and keeps the per-token bookkeeping in tensors, so a
decode step (and a first prefill) compiles with `torch.compile(fullgraph=True)` and can be
graph-captured; a prefill continuing a cached prefix reads the prefix back with host-known sizes and
runs eagerly.

While gradients are enabled (training), the patched model does not create a paged cache by itself:
the model's own cache and the dense path serve, because cache writes are inference-only ops.
"""
from __future__ import annotations

import dataclasses
import math
import types
import weakref
from typing import Optional

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, CacheLayerMixin


DEFAULT_BLOCK_SIZE = 64


# ------------------------------------------------------------------------------------------- cache
class MLAPagedLayer(CacheLayerMixin):
    """One layer's pools. Token bookkeeping (block tables, lengths) is shared, on the parent cache."""

    is_sliding = False
    is_croppable = True
    supports_early_init = False

    def __init__(self, cache: "MLAPagedCache"):
        super().__init__()
        self._cache = cache
        self.is_compileable = cache.static

    @property
    def latent_pool(self) -> torch.Tensor:  # [num_blocks, block_size, 1, L]
        return self.keys

    @property
    def k_pe_pool(self) -> torch.Tensor:  # [num_blocks, block_size, 1, R]
        return self.values

    def allocate(self, num_blocks: int, dtype: torch.dtype, device: torch.device) -> None:
        c = self._cache
        self.keys = torch.zeros(num_blocks, c.block_size, 1, c.kv_lora_rank, dtype=dtype, device=device)
        self.values = torch.zeros(num_blocks, c.block_size, 1, c.rope_dim, dtype=dtype, device=device)
        self.device = device
        self.is_initialized = True
        if c.static and not torch.compiler.is_compiling():
            torch._dynamo.mark_static_address(self.keys)
            torch._dynamo.mark_static_address(self.values)

    def grow(self, num_blocks: int) -> None:
        extra = num_blocks - self.keys.shape[0]
        self.keys = torch.cat((self.keys, self.keys.new_zeros(extra, *self.keys.shape[1:])))
        self.values = torch.cat((self.values, self.values.new_zeros(extra, *self.values.shape[1:])))

    def lazy_initialization(self, key_states, value_states) -> None:
        raise NotImplementedError("MLAPagedLayer is filled by the paged attention forward, not by update()")

    def update(self, key_states, value_states, *args, **kwargs):
        raise NotImplementedError(
            "MLAPagedCache stores the MLA latent through mla.scatter_pa_kv_cache in the patched attention "
            "(mla_ops.model_patches.deepseek_v2.apply(model, cache='paged')); it has no per-head K/V to update")

    def get_seq_length(self) -> int:
        return self._cache.get_seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self._cache.static:
            return self._cache.max_cache_len, 0
        return self._cache.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return self._cache.max_cache_len if self._cache.static else -1

    def reset(self) -> None:
        self._cache.reset()

    def reorder_cache(self, beam_idx) -> None:
        _unsupported("beam search (reorder_cache)")

    def crop(self, tokens_to_remove: int) -> None:
        pass  # the parent cache crops the shared bookkeeping once (Cache.crop calls every layer)

    def batch_repeat_interleave(self, repeats: int) -> None:
        _unsupported("batch_repeat_interleave")

    def batch_select_indices(self, indices) -> None:
        _unsupported("batch_select_indices")


def _unsupported(what: str):
    raise NotImplementedError(
        f"MLAPagedCache does not support {what}: rows own their blocks and there is no copy-on-write for "
        f"shared prefixes. Use greedy or sampling generation, or apply(model, cache='dense') for beam search "
        f"and assisted decoding.")


@dataclasses.dataclass
class ForwardPlan:
    """Where the tokens of one forward go; computed once per forward, shared by every layer."""

    slot_mapping: torch.Tensor  # [B*S] int64, -1 for padding tokens
    real: torch.Tensor  # [B, S] bool
    prefix_lens: torch.Tensor  # [B] int64: tokens cached before this forward
    seq_lens: torch.Tensor  # [B] int64: tokens cached after it
    block_tables: torch.Tensor  # [B, max_blocks] int32
    has_prefix: bool  # some row had cached tokens (host-known; False inside compiled decode)


class MLAPagedCache(Cache):
    """A transformers `Cache` holding the MLA latent and rotated k_pe in paged block pools.

    Args:
        config: the DeepseekV2Config (kv_lora_rank, qk_rope_head_dim, num_hidden_layers).
        block_size: tokens per block (default 64).
        batch_size: rows; required with static=True, else taken from the first forward.
        max_cache_len: tokens per row to reserve; required with static=True. With static=False it
            only sizes the first pool allocation (generate passes its max_length), the pool grows
            by doubling when the free list runs out.
        static: preallocate the pools and a fixed block table (row b owns blocks
            [b*n, (b+1)*n)) and keep every piece of bookkeeping in tensors, for torch.compile and
            graph capture.
        dtype, device: allocate now instead of at the first forward.
    """

    def __init__(self, config, *, block_size: int = DEFAULT_BLOCK_SIZE, batch_size: Optional[int] = None,
                 max_cache_len: Optional[int] = None, static: bool = False, dtype: Optional[torch.dtype] = None,
                 device=None):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if static and (batch_size is None or max_cache_len is None):
            raise ValueError("MLAPagedCache(static=True) needs batch_size and max_cache_len")
        self.static = static
        self.block_size = block_size
        self.kv_lora_rank = config.kv_lora_rank
        self.rope_dim = config.qk_rope_head_dim
        self.num_layers = config.num_hidden_layers
        self.max_cache_len = max_cache_len
        self._batch_size = batch_size
        super().__init__(layers=[MLAPagedLayer(self) for _ in range(self.num_layers)])
        self.plan: Optional[ForwardPlan] = None
        self._seen = 0  # positions seen per row, padding included (what transformers calls seq length)
        self._seen_tensor: Optional[torch.Tensor] = None  # the same, as a tensor, in static mode
        self._prefilled = False
        self._lens_host: list[int] = []  # dynamic: real tokens per row
        self._blocks_host: list[list[int]] = []  # dynamic: block ids per row
        self._free: list[int] = []
        self.seq_lens: Optional[torch.Tensor] = None
        self.block_tables: Optional[torch.Tensor] = None
        if dtype is not None and batch_size is not None:
            self._allocate(batch_size, dtype, torch.device(device or "cpu"))

    # ---------------------------------------------------------------- allocation and bookkeeping
    @property
    def blocks_per_row(self) -> int:
        return math.ceil(self.max_cache_len / self.block_size)

    def _allocate(self, batch_size: int, dtype: torch.dtype, device: torch.device) -> None:
        self._batch_size = batch_size
        if self.static:
            num_blocks = batch_size * self.blocks_per_row
            self.block_tables = torch.arange(num_blocks, dtype=torch.int32, device=device).view(batch_size, -1)
            self._seen_tensor = torch.zeros((), dtype=torch.int64, device=device)
            if not torch.compiler.is_compiling():
                torch._dynamo.mark_static_address(self._seen_tensor)
        else:
            per_row = self.blocks_per_row if self.max_cache_len else 1  # a size hint only: the pool grows
            num_blocks = batch_size * per_row
            self._free = list(range(num_blocks - 1, -1, -1))
            self._lens_host = [0] * batch_size
            self._blocks_host = [[] for _ in range(batch_size)]
            self.block_tables = torch.zeros(batch_size, 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(batch_size, dtype=torch.int64, device=device)
        for layer in self.layers:
            layer.allocate(num_blocks, dtype, device)

    def _take_blocks(self, count: int) -> list[int]:
        """Pop `count` block ids off the free stack, doubling every layer's pool when it runs out."""
        if count > len(self._free):
            old = self.layers[0].keys.shape[0]
            new = max(2 * old, old + count - len(self._free))
            for layer in self.layers:
                layer.grow(new)
            self._free = list(range(new - 1, old - 1, -1)) + self._free  # new ids go under the old ones
        taken = self._free[len(self._free) - count:]
        del self._free[len(self._free) - count:]
        return taken[::-1]

    def begin_forward(self, attention_mask: Optional[torch.Tensor], batch_size: int, new_tokens: int,
                      dtype: torch.dtype, device: torch.device) -> ForwardPlan:
        """Plan the slots of this forward's tokens (called once per model forward, before the layers)."""
        if not self.static and torch.compiler.is_compiling():
            raise RuntimeError(
                "MLAPagedCache(static=False) allocates blocks on the host and cannot be traced by torch.compile; "
                "use MLAPagedCache(config, static=True, batch_size=..., max_cache_len=...) or "
                "generate(..., cache_implementation='static') for compiled decoding")
        if self.layers[0].keys is None:
            self._allocate(batch_size, dtype, device)
        if batch_size != self._batch_size:
            raise ValueError(f"MLAPagedCache holds {self._batch_size} rows but the forward has batch size "
                             f"{batch_size}; use one cache per batch")
        real = self._real_token_flags(attention_mask, batch_size, new_tokens, device)
        self.plan = self._plan_static(real) if self.static else self._plan_dynamic(real)
        return self.plan

    def end_forward(self) -> None:
        plan, self.plan = self.plan, None
        if plan is None:
            return
        self.seq_lens.copy_(plan.seq_lens)
        new_tokens = plan.real.shape[1]
        if self.static:
            # Traced as tensor ops. The host flag is a plain attribute store (replayed after a
            # compiled step), set by multi-token forwards so a later prefill knows there is a prefix;
            # decode steps never read or write it, so they compile once.
            self._seen_tensor.add_(new_tokens)
            if new_tokens > 1 or not torch.compiler.is_compiling():
                self._prefilled = True
            if not torch.compiler.is_compiling():
                self._seen += new_tokens  # host mirror, for eager callers only
            return
        self._seen += new_tokens
        self._prefilled = True

    def _real_token_flags(self, attention_mask, batch_size, new_tokens, device) -> torch.Tensor:
        """[B, S] bool: which new tokens are real (not padding), from a 2-D or 4-D attention mask."""
        if attention_mask is None:
            return torch.ones(batch_size, new_tokens, dtype=torch.bool, device=device)
        if attention_mask.dim() == 2:
            return attention_mask[:, -new_tokens:].to(device=device, dtype=torch.bool)
        if attention_mask.dim() == 4:
            # A token is real iff it may attend to itself (padding columns are masked for every query).
            seen = self._seen_tensor if self.static else self._seen
            own = torch.arange(new_tokens, device=attention_mask.device)
            diag = attention_mask[:, 0, own, own + seen]
            allowed = diag if diag.dtype == torch.bool else diag == 0
            return allowed.to(device)
        raise ValueError(f"unsupported attention_mask of shape {tuple(attention_mask.shape)}")

    def _plan_dynamic(self, real: torch.Tensor) -> ForwardPlan:
        bs = self.block_size
        real_host = real.cpu()
        counts = real_host.sum(1).tolist()
        prefix = list(self._lens_host)
        for row, (old, add) in enumerate(zip(prefix, counts)):
            need = math.ceil((old + add) / bs) - len(self._blocks_host[row])
            if need > 0:
                self._blocks_host[row] += self._take_blocks(need)
        width = max(1, max(len(b) for b in self._blocks_host))
        tables = torch.full((len(prefix), width), -1, dtype=torch.int32)
        for row, blocks in enumerate(self._blocks_host):  # one small row copy per sequence
            tables[row, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        positions = torch.tensor(prefix)[:, None] + torch.cumsum(real_host.long(), 1) - 1
        block = tables.long().gather(1, torch.div(positions.clamp(min=0), bs, rounding_mode="floor"))
        slots = torch.where(real_host, block * bs + positions % bs, -1)
        self._lens_host = [p + c for p, c in zip(prefix, counts)]
        device = real.device
        self.block_tables = tables.to(device)
        return ForwardPlan(slot_mapping=slots.view(-1).to(device), real=real,
                           prefix_lens=torch.tensor(prefix, device=device),
                           seq_lens=torch.tensor(self._lens_host, device=device), block_tables=self.block_tables,
                           has_prefix=any(p > 0 for p in prefix))

    def _plan_static(self, real: torch.Tensor) -> ForwardPlan:
        bs, capacity = self.block_size, self.blocks_per_row * self.block_size
        prefix = self.seq_lens
        positions = prefix[:, None] + torch.cumsum(real.long(), 1) - 1
        new_lens = prefix + real.long().sum(1)
        if not torch.compiler.is_compiling():
            if int(new_lens.max()) > capacity:
                raise ValueError(f"MLAPagedCache(static=True) holds {capacity} tokens per row "
                                 f"(max_cache_len={self.max_cache_len}); this forward needs {int(new_lens.max())}")
        else:  # no host sync inside a graph: a device-side assert instead of silently clamped slots
            torch._assert_async(new_lens.max() <= capacity,
                                "MLAPagedCache(static=True): the forward needs more tokens than max_cache_len")
        col = torch.div(positions.clamp(0, capacity - 1), bs, rounding_mode="floor")
        block = self.block_tables.long().gather(1, col)
        slots = torch.where(real, block * bs + positions.clamp(min=0) % bs, -1)
        has_prefix = real.shape[1] > 1 and self._prefilled  # decode never reads the host flag
        return ForwardPlan(slot_mapping=slots.view(-1), real=real, prefix_lens=prefix, seq_lens=new_lens,
                           block_tables=self.block_tables, has_prefix=has_prefix)

    # ------------------------------------------------------------------------- Cache interface
    def get_seq_length(self, layer_idx: int = 0):
        if self.static:
            return self._seen_tensor if self._seen_tensor is not None else 0
        return self._seen

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.layers[0].get_mask_sizes(query_length)

    def get_max_length(self, layer_idx: Optional[int] = None) -> int:
        return self.layers[0].get_max_length()

    @property
    def batch_size(self) -> int:
        return self._batch_size if self._batch_size is not None else -1

    def reset(self) -> None:
        if self.seq_lens is not None:
            self.seq_lens.zero_()
        if self._seen_tensor is not None:
            self._seen_tensor.zero_()
        self._seen, self._prefilled, self.plan = 0, False, None
        if not self.static and self._batch_size is not None:
            for blocks in self._blocks_host:
                self._free += blocks[::-1]
            self._blocks_host = [[] for _ in range(self._batch_size)]
            self._lens_host = [0] * self._batch_size

    def reorder_cache(self, beam_idx) -> None:
        _unsupported("beam search (reorder_cache)")

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last `-tokens_to_remove` tokens of every row (transformers' crop convention: a
        negative count). Meant for tokens appended by decoding, which are real in every row; freed
        blocks go back to the free list."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, got {tokens_to_remove}")
        n = -tokens_to_remove
        if n == 0 or self.seq_lens is None:
            return
        self.seq_lens.sub_(n).clamp_(min=0)
        self._seen = max(0, self._seen - n)
        if self.static:
            self._seen_tensor.sub_(n).clamp_(min=0)
            return
        self._lens_host = [max(0, length - n) for length in self._lens_host]
        for row, length in enumerate(self._lens_host):
            keep = math.ceil(length / self.block_size)
            self._free += self._blocks_host[row][keep:][::-1]
            del self._blocks_host[row][keep:]

    def batch_repeat_interleave(self, repeats: int) -> None:
        _unsupported("batch_repeat_interleave")

    def batch_select_indices(self, indices) -> None:
        _unsupported("batch_select_indices")

    def memory_report(self) -> dict:
        """Bytes held by the cache. `bytes_per_token_per_layer` counts the blocks assigned to rows
        divided by the tokens they hold (so it is the 1152 B payload in bf16 V2-Lite plus at most
        one partly filled block per row); `pool_bytes` is everything allocated, free blocks included."""
        if self.layers[0].keys is None:
            return {"tokens": 0, "pool_bytes": 0, "assigned_bytes": 0, "bytes_per_token_per_layer": 0.0}
        per_slot = sum(t[0, 0].numel() * t.element_size() for t in (self.layers[0].keys, self.layers[0].values))
        lens = self.seq_lens.tolist()
        if self.static:
            assigned_blocks = len(lens) * self.blocks_per_row
        else:
            assigned_blocks = sum(len(b) for b in self._blocks_host)
        pool = sum(layer.keys.nbytes + layer.values.nbytes for layer in self.layers)
        assigned = assigned_blocks * self.block_size * per_slot * self.num_layers
        tokens = sum(lens)
        return {
            "tokens": tokens, "layers": self.num_layers, "block_size": self.block_size,
            "payload_bytes_per_token_per_layer": per_slot, "pool_bytes": pool, "assigned_bytes": assigned,
            "bytes_per_token_per_layer": assigned / tokens / self.num_layers if tokens else float("nan"),
        }


def cache_bytes_per_token_per_layer(cache, tokens: int) -> float:
    """Cache bytes per token and layer: an MLAPagedCache's assigned blocks (its memory_report), or
    everything a dense transformers cache holds for `tokens` tokens."""
    if isinstance(cache, MLAPagedCache):
        return cache.memory_report()["bytes_per_token_per_layer"]
    held = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    return held / tokens / len(cache.layers)


# -------------------------------------------------------------------------------------- attention
# Attention modules holding absorbed W_UK / W_UV copies (registered eagerly), freed on revert.
_ABSORBED_OWNERS: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def drop_absorbed_weights(modules=None) -> None:
    """Free the absorbed copies of `modules` (any iterable of modules), or of every owner."""
    for module in list(_ABSORBED_OWNERS if modules is None else modules):
        module.__dict__.pop("_mla_ops_absorbed", None)
        _ABSORBED_OWNERS.discard(module)


def _absorbed_weights(attn):
    """(W_UK [N, P, L], W_UV^T [N, L, V]), contiguous, made once per layer from kv_b_proj.weight.

    Contiguous copies rather than views: ATen's CPU bf16 bmm copies a strided batch operand on every
    call (measured 8.5 ms for q_nope @ W_UK from the view vs 0.06 ms from the copy). They are remade
    when kv_b_proj.weight is replaced, modified in place, moved or cast (not checked inside a compiled
    graph, where weights are frozen)."""
    weight = attn.kv_b_proj.weight
    cached = attn.__dict__.get("_mla_ops_absorbed")
    stale = cached is None or cached[0] is not weight
    if not stale and not torch.compiler.is_compiling():
        # in place (version), new storage (`.data = `, model.to(device) keeps the Parameter), new dtype
        stale = cached[1] != (weight._version, weight.data_ptr(), weight.dtype, weight.device)
    if stale:
        with torch.no_grad():
            per_head = weight.view(attn.num_heads, attn.qk_nope_head_dim + attn.v_head_dim, attn.kv_lora_rank)
            w_uk = per_head[:, : attn.qk_nope_head_dim].contiguous()
            w_uv_t = per_head[:, attn.qk_nope_head_dim:].transpose(1, 2).contiguous()
        cached = (weight, (weight._version, weight.data_ptr(), weight.dtype, weight.device), w_uk, w_uv_t)
        attn.__dict__["_mla_ops_absorbed"] = cached
        if not torch.compiler.is_compiling():  # (compiled generate: registered by the generate hook)
            _ABSORBED_OWNERS.add(attn)
    return cached[2], cached[3]


def _decode_absorbed(attn, layer: MLAPagedLayer, plan: ForwardPlan, q_nope, q_pe):
    """One token per row: o = ((softmax(q_lat·latent + q_pe·k_pe) · latent) @ W_UV) -> [B, 1, N*V]."""
    w_uk, w_uv_t = _absorbed_weights(attn)
    batch = q_nope.shape[0]
    q_latent = torch.bmm(q_nope[:, :, 0].transpose(0, 1), w_uk).transpose(0, 1)  # [B, N, L]
    o_latent = torch.ops.mla.mla_decode_attention(q_latent, q_pe[:, :, 0], layer.latent_pool, layer.k_pe_pool,
                                                  plan.block_tables, plan.seq_lens, attn.scaling)
    out = torch.bmm(o_latent.transpose(0, 1), w_uv_t)  # [N, B, V]
    return out.transpose(0, 1).reshape(batch, 1, -1)


def _gather_prefix(layer: MLAPagedLayer, plan: ForwardPlan):
    """Cached prefix of every row, padded: (latent [B, P, L], k_pe [B, P, R], valid [B, P])."""
    prefix = plan.prefix_lens
    lengths = prefix.tolist()
    longest, total = max(lengths), sum(lengths)
    cumsum = torch.zeros(len(lengths) + 1, dtype=torch.int64, device=prefix.device)
    cumsum[1:] = torch.cumsum(prefix, 0)
    latent, k_pe = layer.latent_pool, layer.k_pe_pool
    packed_latent = latent.new_empty(total, 1, latent.shape[-1])
    packed_k_pe = k_pe.new_empty(total, 1, k_pe.shape[-1])
    torch.ops.mla.gather_pa_kv_cache(latent, k_pe, plan.block_tables, cumsum, packed_latent, packed_k_pe,
                                     is_seq_lens_cumsum=True)
    pos = torch.arange(longest, device=prefix.device)
    valid = pos[None, :] < prefix[:, None]
    index = torch.where(valid, cumsum[:-1, None] + pos[None, :], 0)
    pad = lambda packed: torch.where(valid[..., None], packed[index.clamp(max=max(total - 1, 0)), 0], 0)  # noqa: E731
    return pad(packed_latent), pad(packed_k_pe), valid


def _prefill_with_prefix(attn, layer, plan, query_states, latent, k_pe):
    """New tokens attend to (gathered prefix + new tokens): materialised K/V via kv_b, own mask."""
    from .deepseek_v2 import _dense_key
    from ..ops.reference.kv_prolog import expand_latent

    prefix_latent, prefix_k_pe, prefix_valid = _gather_prefix(layer, plan)
    keys_latent = torch.cat((prefix_latent, latent), dim=1)  # [B, P+S, L]
    k_nope, value_states = expand_latent(keys_latent, attn.kv_b_proj.weight, attn.num_heads,
                                         attn.qk_nope_head_dim, attn.v_head_dim)
    k_pe_all = torch.cat((prefix_k_pe, k_pe), dim=1)[:, None]  # [B, 1, P+S, R]
    key_states = _dense_key(k_nope, k_pe_all)
    seq = latent.shape[1]
    real = plan.real
    causal = torch.ones(seq, seq, dtype=torch.bool, device=real.device).tril()
    new_part = causal[None] & real[:, None, :] & real[:, :, None]  # real queries see earlier real tokens
    new_part |= torch.eye(seq, dtype=torch.bool, device=real.device)[None]  # padding queries see themselves
    prefix_part = prefix_valid[:, None, :] & real[:, :, None]
    mask = torch.cat((prefix_part, new_part), dim=-1)[:, None]  # [B, 1, S, P+S]
    out = F.scaled_dot_product_attention(query_states, key_states, value_states.contiguous(), attn_mask=mask,
                                         scale=attn.scaling)
    return out.transpose(1, 2).reshape(latent.shape[0], seq, -1)


def native_paged_attention_forward(attn, hidden_states, attention_mask, cache, position_embeddings, **kwargs):
    """The paged-mode body of the patched native DeepseekV2Attention.forward."""
    from . import deepseek_v2 as dense

    plan = cache.plan
    if plan is None:
        raise RuntimeError("MLAPagedCache has no plan for this forward: the model-level hook did not run "
                           "(patch the model with apply(model, cache='paged'))")
    batch, seq = hidden_states.shape[:-1]
    freqs_cis = position_embeddings.to(hidden_states.device)
    cos, sin = freqs_cis.real, freqs_cis.imag
    kv_a, norm = attn.kv_a_proj_with_mqa, attn.kv_a_layernorm
    latent, k_pe = torch.ops.mla.latent_kv_prolog(hidden_states, kv_a.weight, kv_a.bias, norm.weight, cos, sin,
                                                  eps=norm.variance_epsilon)
    layer = cache.layers[attn.layer_idx]
    torch.ops.mla.scatter_pa_kv_cache(latent.view(batch * seq, 1, -1), k_pe.view(batch * seq, 1, -1),
                                      layer.latent_pool, layer.k_pe_pool, plan.slot_mapping)
    q_nope, q_pe = dense._query(attn, hidden_states)
    q_pe = torch.ops.mla.rope(q_pe, cos, sin)
    if seq == 1:
        attn_output = _decode_absorbed(attn, layer, plan, q_nope, q_pe)
        return attn.o_proj(attn_output), None
    query_states = torch.cat((q_nope, q_pe), dim=-1)
    if plan.has_prefix:
        attn_output = _prefill_with_prefix(attn, layer, plan, query_states, latent, k_pe)
        return attn.o_proj(attn_output), None
    # Fresh prefill: the new tokens are all there is (padding included, masked by transformers' own mask),
    # so this is stock's arithmetic and gives stock's logits.
    from ..ops.reference.kv_prolog import expand_latent

    k_nope, value_states = expand_latent(latent, attn.kv_b_proj.weight, attn.num_heads, attn.qk_nope_head_dim,
                                         attn.v_head_dim)
    key_states = dense._dense_key(k_nope, k_pe[:, None])
    if isinstance(attention_mask, torch.Tensor) and attention_mask.shape[-1] != seq:
        # transformers sized the mask for the whole cache (static: max_cache_len; after rows of only
        # padding: seen + S); the keys here are the new tokens, which are its last S (dynamic) or
        # first S (static, nothing seen yet) columns.
        attention_mask = attention_mask[..., :seq] if cache.static else attention_mask[..., -seq:]
    return dense.attend_and_project(attn, query_states, key_states, value_states, attention_mask, **kwargs)


# ------------------------------------------------------------------------ model-level integration
def _model_forward_with_paged_cache(original_forward):
    """Wrap DeepseekV2Model.forward: create an MLAPagedCache when the model would create a cache,
    and plan each forward's slots once before the layers run."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                use_cache=None, **kwargs):
        if cache is None:
            cache = kwargs.pop("past_key_values", None)
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        if use_cache and cache is None and not torch.is_grad_enabled():
            # With gradients (training), the model's own cache and the dense path serve: the paged
            # cache's writes are inference-only ops.
            cache = MLAPagedCache(self.config)
        if isinstance(cache, MLAPagedCache):
            tokens = input_ids if input_ids is not None else inputs_embeds
            cache.begin_forward(attention_mask, tokens.shape[0], tokens.shape[1], self.embed_tokens.weight.dtype,
                                tokens.device)
        try:
            return original_forward(self, input_ids=input_ids, attention_mask=attention_mask,
                                    position_ids=position_ids, cache=cache, inputs_embeds=inputs_embeds,
                                    use_cache=use_cache, **kwargs)
        finally:
            if isinstance(cache, MLAPagedCache):
                cache.end_forward()

    forward.__name__ = "mla_ops_paged_model_forward"
    forward.__wrapped__ = original_forward
    return forward


def _prepare_cache_with_paged(original):
    """Wrap GenerationMixin._prepare_cache_for_generation: the cache generate makes becomes an
    MLAPagedCache (static when cache_implementation='static'); a user-passed cache is respected."""

    def prepare(self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length):
        result = original(self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length)
        made = model_kwargs.get("cache")
        if made is None or getattr(made, "_is_user_defined", False) or isinstance(made, MLAPagedCache):
            return result
        if generation_config.num_beams > 1:
            _unsupported("beam search (num_beams > 1)")
        static = generation_config.cache_implementation == "static"
        if static and generation_config.max_cache_len is not None:  # as transformers sizes StaticCache
            max_cache_length = max(max_cache_length, generation_config.max_cache_len)
        config = self.config.get_text_config(decoder=True)
        # generate expands the batch by num_return_sequences before the first forward (as transformers
        # sizes its own caches)
        rows = batch_size * max(1, generation_config.num_return_sequences or 1)
        # a compiled decode makes the absorbed copies inside the trace: register their owners here
        _ABSORBED_OWNERS.update(m for m in self.modules() if hasattr(m, "kv_b_proj"))
        model_kwargs["cache"] = MLAPagedCache(config, batch_size=rows, max_cache_len=max_cache_length,
                                              static=static, dtype=self.dtype, device=self.device)
        return result

    prepare.__name__ = "mla_ops_prepare_cache_for_generation"
    return prepare


def install_cache_factory(target, handle) -> None:
    """Hook cache creation on a model instance (or on the native classes when target is the
    DeepseekV2Model class): model(use_cache=True) and generate() then build MLAPagedCache; reverting
    the handle frees the absorbed W_UK / W_UV copies the decode path made."""
    from .deepseek_v2 import _native_module, stock_attr

    hf = _native_module()
    # Always wrap the stock functions, so applying twice never stacks two wrappers.
    stock_forward = stock_attr(hf.DeepseekV2Model, "forward")
    stock_prepare = stock_attr(hf.DeepseekV2ForCausalLM, "_prepare_cache_for_generation")
    if isinstance(target, type):  # class level
        handle.set(hf.DeepseekV2Model, "forward", _model_forward_with_paged_cache(stock_forward))
        handle.set(hf.DeepseekV2ForCausalLM, "_prepare_cache_for_generation", _prepare_cache_with_paged(stock_prepare))
        handle.on_revert(drop_absorbed_weights)
        return
    target_ref = weakref.ref(target)  # the callback must not keep the model alive
    handle.on_revert(lambda: drop_absorbed_weights(target_ref().modules() if target_ref() is not None else ()))
    for model in (m for m in target.modules() if isinstance(m, hf.DeepseekV2Model)):  # apply() checked one exists
        bound = _model_forward_with_paged_cache(stock_forward)
        handle.set(model, "forward", types.MethodType(bound, model), in_dict=True)
    if hasattr(target, "_prepare_cache_for_generation"):
        wrapped = _prepare_cache_with_paged(stock_prepare)
        handle.set(target, "_prepare_cache_for_generation", types.MethodType(wrapped, target), in_dict=True)
