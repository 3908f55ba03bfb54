"""The paged MLA latent cache: a transformers `Cache` for `mla_ops.patch(model)` (cache="paged").

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
* sparse attention (a config with `index_topk`): every layer with its own indexer also keeps the
  indexer keys `[num_blocks, block_size, 1, index_head_dim]` (written with `mla.scatter_pa_cache`,
  same block tables); the decode attends to the indexer's top-k with `mla.sparse_mla_attention`.

A hybrid model's linear-attention layers (Kimi-Linear, Bailing-hybrid: KDA beside MLA) keep their conv and
recurrent states in transformers' own `LinearAttentionLayer` at their layer index, through the `Cache` methods
those layers call (`get_conv_state`, `update_recurrent_state`, ...); the MLA layers' latents are paged.

`MLAPagedCache(static=False)` grows block by block from a free list as tokens arrive (host
bookkeeping, pools double when full; it refuses to be traced by torch.compile). Its first
reservation is at most `MAX_INITIAL_TOKENS_PER_ROW` tokens per row whatever `max_cache_len` says:
generate passes prompt + max_new_tokens, and a generation that stops early (EOS, a stopping
criterion) must not pay for tokens it never made. `MLAPagedCache(static=True, batch_size=...,
max_cache_len=...)` preallocates everything by design (fixed shapes for compile and graph capture)
and keeps the per-token bookkeeping in tensors, so a
decode step (and a first prefill) compiles with `torch.compile(fullgraph=True)` and can be
graph-captured; a prefill continuing a cached prefix reads the prefix back with host-known sizes and
runs eagerly.

While gradients are enabled (training), the patched model does not create a paged cache by itself:
the model's own cache and the dense path serve, because cache writes are inference-only ops.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

DEFAULT_BLOCK_SIZE = 64
# The dynamic pool's first reservation per row, in tokens (rounded up to whole blocks): enough for a
# typical prompt and some decoding without a regrowth, small next to a max_new_tokens upper bound.
MAX_INITIAL_TOKENS_PER_ROW = 512


# ------------------------------------------------------------------------------------------- cache
class PagedLayerView(CacheLayerMixin):
    """A paged cache's layer as transformers' `Cache` sees it: sizes and resets are the parent cache's
    (`self._cache`, a `PagedCache`, whose token bookkeeping every layer shares); what the cache cannot do
    raises through the parent's `unsupported(what)`."""

    def unsupported(self, what: str):
        self._cache.unsupported(what)

    def get_seq_length(self) -> int:
        return self._cache.get_seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self._cache.static:
            return self._cache.max_cache_len, 0
        return self._cache.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return self._cache.max_cache_len if self._cache.static else -1

    def get_max_cache_shape(self) -> int:  # the name of get_max_length before transformers 5.13
        return self.get_max_length()

    def reset(self) -> None:
        self._cache.reset()

    def reorder_cache(self, beam_idx) -> None:
        self.unsupported("beam search (reorder_cache)")

    def crop(self, tokens_to_remove: int) -> None:
        self.unsupported("crop")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.unsupported("batch_repeat_interleave")

    def batch_select_indices(self, indices) -> None:
        self.unsupported("batch_select_indices")


@dataclasses.dataclass(frozen=True)
class LatentLayout:
    """One MLA layer's share of an MLAPagedCache: its latent and rotary dims (R = 0: a layer without RoPE dims),
    the layer whose latent pools it reads (itself, unless it attends to an earlier layer's latent KV), and whether
    it runs a sparse-attention indexer of its own (it then keeps the indexer keys; a pooled indexer, GLM-5-Next's,
    keeps each token's key and gate score, 2 x index_head_dim)."""

    kv_lora_rank: int
    rope_dim: int
    source: int
    indexer: bool = False
    pooled_indexer: bool = False


class MLAPagedLayer(PagedLayerView):
    """One layer's pools. Token bookkeeping (block tables, lengths) is shared, on the parent cache. A layer
    sharing an earlier layer's latent KV (`source`) holds no latent pools of its own: it reads the source's."""

    is_sliding = False
    is_croppable = True
    supports_early_init = False

    def __init__(self, cache: "MLAPagedCache", layout: LatentLayout, source: Optional["MLAPagedLayer"] = None):
        super().__init__()
        self._cache = cache
        self.is_compileable = cache.static
        self.indexed = layout.indexer  # holds a sparse-attention indexer's keys (a layer with its own indexer)
        self.layout = layout
        self.source = source
        self.indexer_keys: Optional[torch.Tensor] = None

    @property
    def latent_pool(self) -> torch.Tensor:  # [num_blocks, block_size, 1, L]
        return self.keys if self.source is None else self.source.keys

    @property
    def k_pe_pool(self) -> torch.Tensor:  # [num_blocks, block_size, 1, R]
        return self.values if self.source is None else self.source.values

    @property
    def indexer_pool(self) -> torch.Tensor:  # [num_blocks, block_size, 1, index_head_dim]
        if self.indexer_keys is None:
            raise RuntimeError("this MLAPagedCache layer holds no indexer keys (its model has no sparse-attention "
                               "indexer in this layer)")
        return self.indexer_keys

    def indexer_pool_like(self, keys: torch.Tensor) -> torch.Tensor:
        """The indexer-key pool, in the dtype the layer's indexer gives its keys: the model's, or fp32 where the
        stock indexer rotates with fp32 tables (dots3_note), as its own cache then holds them. Converted once, at
        the layer's first write (before a compiled step: the first forward of a cache runs eagerly)."""
        pool = self.indexer_pool
        if pool.dtype != keys.dtype:
            pool = self.indexer_keys = pool.to(keys.dtype)
            if self._cache.static and not torch.compiler.is_compiling():
                torch._dynamo.mark_static_address(pool)
        return pool

    def pools(self) -> list:
        """Every pool the layer holds (latent, k_pe, and the indexer keys where it has them; a layer sharing an
        earlier layer's latent KV holds no latent pools)."""
        return [p for p in (self.keys, self.values, self.indexer_keys) if p is not None]

    def allocate(self, num_blocks: int, dtype: torch.dtype, device: torch.device) -> None:
        c = self._cache
        if self.source is None:
            self.keys = torch.zeros(num_blocks, c.block_size, 1, self.layout.kv_lora_rank, dtype=dtype, device=device)
            self.values = torch.zeros(num_blocks, c.block_size, 1, self.layout.rope_dim, dtype=dtype, device=device)
        if self.indexed:
            width = c.index_head_dim * (2 if self.layout.pooled_indexer else 1)
            self.indexer_keys = torch.zeros(num_blocks, c.block_size, 1, width, dtype=dtype, device=device)
        self.device = device
        self.is_initialized = True
        if c.static and not torch.compiler.is_compiling():
            for pool in self.pools():
                torch._dynamo.mark_static_address(pool)

    def grow(self, num_blocks: int) -> None:
        grown = lambda pool: torch.cat((pool, pool.new_zeros(num_blocks - pool.shape[0], *pool.shape[1:])))  # noqa: E731
        if self.source is None:
            self.keys, self.values = grown(self.keys), grown(self.values)
        if self.indexer_keys is not None:
            self.indexer_keys = grown(self.indexer_keys)

    def lazy_initialization(self, key_states, value_states) -> None:
        raise NotImplementedError("MLAPagedLayer is filled by the paged attention forward, not by update()")

    def update(self, key_states, value_states, *args, **kwargs):
        raise NotImplementedError(
            "MLAPagedCache stores the MLA latent through mla.scatter_pa_kv_cache in the patched attention "
            "(mla_ops.patch(model), whose cache is 'paged'); it has no per-head K/V to update")

    def crop(self, tokens_to_remove: int) -> None:
        pass  # the parent cache crops the shared bookkeeping once (Cache.crop calls every layer)


def linear_attention_layer():
    """transformers' own cache layer for a hybrid's linear-attention states (conv and recurrent), or
    NotImplementedError on a release without one."""
    from transformers import cache_utils

    layer_class = getattr(cache_utils, "LinearAttentionLayer", None)
    if layer_class is None:
        raise NotImplementedError("cache='paged' on a hybrid model (linear attention beside MLA) needs transformers' "
                                  "LinearAttentionLayer (transformers 5.24 has it); use cache='dense' here")
    return layer_class()


def unsupported(what: str):
    raise NotImplementedError(
        f"MLAPagedCache does not support {what}: rows own their blocks and there is no copy-on-write for "
        f"shared prefixes. Use greedy or sampling generation, or mla_ops.patch(model, cache='dense') for beam search "
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


class PagedCache(Cache):
    """What the paged caches (`MLAPagedCache`, `SharedKvPagedCache`) share as transformers `Cache`s: their
    sizes, their token bookkeeping and its reset, and what none of them can do (beam search, batch
    reshuffles: rows own their blocks), raised through `unsupported(what)` with the cache's own reason.

    Token bookkeeping (set by `init_bookkeeping`): `_seen` positions per row (padding included: what
    transformers calls the sequence length), `_seen_tensor` the same as a tensor in a static cache (read
    by a compiled step), `seq_lens` [B] the tokens each row holds, `plan` the running forward's slots.
    A subclass gives its blocks back to its free lists in `release_rows()`."""

    # plain attributes: before transformers 5.20 the base class has read-only properties of these names
    max_cache_len: Optional[int] = None
    max_batch_size: Optional[int] = None

    def init_bookkeeping(self, *, block_size: int, batch_size: Optional[int], max_cache_len: Optional[int],
                         static: bool) -> None:
        """Check and set the sizes every paged cache takes (before its layers are built)."""
        name = type(self).__name__
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if static and (batch_size is None or max_cache_len is None):
            raise ValueError(f"{name}(static=True) needs batch_size and max_cache_len")
        self.static = static
        self.block_size = block_size
        self.max_cache_len = max_cache_len
        self._batch_size = batch_size
        self.plan = None
        self._seen = 0
        self._seen_tensor: Optional[torch.Tensor] = None
        self.seq_lens: Optional[torch.Tensor] = None
        self.block_tables: Optional[torch.Tensor] = None

    def unsupported(self, what: str):
        raise NotImplementedError(f"{type(self).__name__} does not support {what}")

    def release_rows(self) -> None:
        """Give every row's blocks back (a dynamic cache's free lists); called by `reset`."""

    # ------------------------------------------------------------------------- Cache interface
    def get_seq_length(self, layer_idx: int = 0):
        if self.static:
            return self._seen_tensor if self._seen_tensor is not None else 0
        return self._seen

    @property
    def paged_layers(self) -> list:
        """The layers whose tokens this cache pages (a hybrid's linear-attention layers hold states instead)."""
        return [layer for layer in self.layers if isinstance(layer, PagedLayerView)]

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.paged_layers[0].get_mask_sizes(query_length)

    def get_max_length(self, layer_idx: Optional[int] = None) -> int:
        return self.paged_layers[0].get_max_length()

    @property
    def batch_size(self) -> int:
        return self._batch_size if self._batch_size is not None else -1

    def reset(self) -> None:
        if self.seq_lens is not None:
            self.seq_lens.zero_()
        if self._seen_tensor is not None:
            self._seen_tensor.zero_()
        self._seen, self.plan = 0, None
        for layer in self.layers:
            if not isinstance(layer, PagedLayerView):  # a linear-attention layer's states: zeroed, kept
                layer.reset()
        self.release_rows()

    def reorder_cache(self, beam_idx) -> None:
        self.unsupported("beam search (reorder_cache)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.unsupported("batch_repeat_interleave")

    def batch_select_indices(self, indices) -> None:
        self.unsupported("batch_select_indices")


class MLAPagedCache(PagedCache):
    """A transformers `Cache` holding the MLA latent and rotated k_pe in paged block pools.

    Args:
        config: the model's config (kv_lora_rank, qk_rope_head_dim, num_hidden_layers).
        block_size: tokens per block (default 64).
        batch_size: rows; required with static=True, else taken from the first forward.
        max_cache_len: tokens per row to reserve; required with static=True. With static=False it
            is only a size hint for the first pool allocation, capped at MAX_INITIAL_TOKENS_PER_ROW
            (generate passes its max_length, an upper bound); the pool grows by doubling when the
            free list runs out.
        static: preallocate the pools and a fixed block table (row b owns blocks
            [b*n, (b+1)*n)) and keep every piece of bookkeeping in tensors, for torch.compile and
            graph capture.
        dtype, device: allocate now instead of at the first forward.
        num_layers: MLA layers to hold (default config.num_hidden_layers; LongCat-Flash has two per
            decoder layer).
        layouts: one `LatentLayout` per layer where the layers differ (dims per layer, layers sharing an earlier
            layer's latent KV: `latent_layouts(model)` reads them off a model), None for a linear-attention layer
            of a hybrid (its states in a transformers `LinearAttentionLayer`); default: every layer owns
            config.kv_lora_rank + config.qk_rope_head_dim.
    """

    holds_mla_latent_pages = True  # how the patched attention recognises it (without importing this module)

    def __init__(self, config, *, block_size: int = DEFAULT_BLOCK_SIZE, batch_size: Optional[int] = None,
                 max_cache_len: Optional[int] = None, static: bool = False, dtype: Optional[torch.dtype] = None,
                 device=None, num_layers: Optional[int] = None, layouts=None):
        self.init_bookkeeping(block_size=block_size, batch_size=batch_size, max_cache_len=max_cache_len,
                              static=static)
        # DeepSeek Sparse Attention: an indexer-key pool in every layer that runs its own indexer (by default every
        # layer but the "shared" ones of config.indexer_types, which reuse the previous layer's top-k)
        self.index_head_dim = getattr(config, "index_head_dim", None) if getattr(config, "index_topk", None) else None
        if not layouts:
            count = config.num_hidden_layers if num_layers is None else num_layers
            indexer_types = getattr(config, "indexer_types", None) or ()
            indexed = [self.index_head_dim is not None and (i >= len(indexer_types) or indexer_types[i] != "shared")
                       for i in range(count)]
            layouts = [LatentLayout(config.kv_lora_rank, config.qk_rope_head_dim, i, indexed[i]) for i in range(count)]
        layouts = list(layouts)
        self.num_layers = sum(layout is not None for layout in layouts)
        for i, layout in enumerate(layouts):
            if layout is None:
                continue
            source = layouts[layout.source] if 0 <= layout.source <= i else None
            if source is None or source.source != layout.source:
                raise ValueError(f"layouts[{i}]: a layer reads the latent KV of an earlier layer that owns it, got "
                                 f"source {layout.source}")
            if layout.indexer and self.index_head_dim is None:
                raise ValueError(f"layouts[{i}]: an indexer layer, but the config has no index_topk / index_head_dim")
        layers = []
        for i, layout in enumerate(layouts):
            if layout is None:
                layers.append(linear_attention_layer())
                continue
            source = None if layout.source == i else layers[layout.source]
            layers.append(MLAPagedLayer(self, layout, source))
        super().__init__(layers=layers)
        self.layouts_checked = False  # against the model's, at its first forward (`check_layouts`)
        self.plan: Optional[ForwardPlan] = None
        self._prefilled = False
        self._lens_host: list[int] = []  # dynamic: real tokens per row
        self._blocks_host: list[list[int]] = []  # dynamic: block ids per row
        self._free: list[int] = []
        if dtype is not None and batch_size is not None:
            self._allocate(batch_size, dtype, torch.device(device or "cpu"))

    def check_layouts(self, layouts) -> None:
        """Refuse (ValueError, before anything is written) a model whose MLA layers (`latent_layouts(model)`)
        are not the ones this cache was built for."""
        held = [getattr(layer, "layout", None) for layer in self.layers]
        if list(layouts) != held:
            raise ValueError(f"this MLAPagedCache holds the layers {held}, but the model's are {list(layouts)} (dims "
                             f"per layer, layers sharing an earlier layer's latent KV): build the cache with the "
                             f"model's layouts, MLAPagedCache(config, layouts=latent_layouts(model), ...)")
        self.layouts_checked = True

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
            # a size hint only, capped: the pool grows as tokens arrive
            hint = min(self.max_cache_len or 1, MAX_INITIAL_TOKENS_PER_ROW)
            per_row = math.ceil(hint / self.block_size)
            num_blocks = batch_size * per_row
            self._free = list(range(num_blocks - 1, -1, -1))
            self._lens_host = [0] * batch_size
            self._blocks_host = [[] for _ in range(batch_size)]
            self.block_tables = torch.zeros(batch_size, 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(batch_size, dtype=torch.int64, device=device)
        for layer in self.paged_layers:
            layer.allocate(num_blocks, dtype, device)

    def _take_blocks(self, count: int) -> list[int]:
        """Pop `count` block ids off the free stack, doubling every layer's pool when it runs out."""
        if count > len(self._free):
            old = self.paged_layers[0].keys.shape[0]
            new = max(2 * old, old + count - len(self._free))
            for layer in self.paged_layers:
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
        if self.paged_layers[0].keys is None:
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
        seen = self._seen_tensor if self.static else self._seen
        return real_token_flags(attention_mask, batch_size, new_tokens, device, seen)

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
    def unsupported(self, what: str):
        unsupported(what)

    def release_rows(self) -> None:
        self._prefilled = False
        if not self.static and self._batch_size is not None:
            for blocks in self._blocks_host:
                self._free += blocks[::-1]
            self._blocks_host = [[] for _ in range(self._batch_size)]
            self._lens_host = [0] * self._batch_size

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last `-tokens_to_remove` tokens of every row (transformers' crop convention: a
        negative count). Meant for tokens appended by decoding, which are real in every row; freed
        blocks go back to the free list."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, got {tokens_to_remove}")
        if len(self.paged_layers) != len(self.layers):
            self.unsupported("crop with linear-attention layers (their recurrent states cannot be taken back)")
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

    def memory_report(self) -> dict:
        """Bytes held by the cache. `bytes_per_token_per_layer` counts the blocks assigned to rows
        divided by the tokens they hold (so it is the 1152 B payload in bf16 V2-Lite plus at most
        one partly filled block per row); `pool_bytes` is everything allocated, free blocks included."""
        layers = self.paged_layers
        if layers[0].keys is None:
            return {"tokens": 0, "pool_bytes": 0, "assigned_bytes": 0, "bytes_per_token_per_layer": 0.0}
        # payload per token, averaged over the MLA layers (only those with an indexer hold its keys)
        per_slot = sum(t[0, 0].numel() * t.element_size() for layer in layers for t in layer.pools())
        per_slot /= self.num_layers
        lens = self.seq_lens.tolist()
        if self.static:
            assigned_blocks = len(lens) * self.blocks_per_row
        else:
            assigned_blocks = sum(len(b) for b in self._blocks_host)
        pool = sum(t.nbytes for layer in layers for t in layer.pools())
        assigned = assigned_blocks * self.block_size * per_slot * self.num_layers
        tokens = sum(lens)
        return {
            "tokens": tokens, "layers": self.num_layers, "block_size": self.block_size,
            "payload_bytes_per_token_per_layer": per_slot, "pool_bytes": pool, "assigned_bytes": assigned,
            "bytes_per_token_per_layer": assigned / tokens / self.num_layers if tokens else float("nan"),
        }


def real_token_flags(attention_mask, batch_size: int, new_tokens: int, device, seen) -> torch.Tensor:
    """[B, S] bool: which of a forward's S new tokens are real (not padding), from a 2-D or 4-D attention
    mask (or a dict of them, one per layer type, as generate prepares them); `seen`: the positions the
    cache has seen before the forward (an int, or a tensor in a static cache)."""
    if isinstance(attention_mask, dict):  # any of them shows the padding
        attention_mask = next(iter(attention_mask.values()), None)
    if attention_mask is None:
        return torch.ones(batch_size, new_tokens, dtype=torch.bool, device=device)
    if attention_mask.dim() == 2:
        return attention_mask[:, -new_tokens:].to(device=device, dtype=torch.bool)
    if attention_mask.dim() == 4:
        # A token is real iff it may attend to itself (padding columns are masked for every query).
        own = torch.arange(new_tokens, device=attention_mask.device)
        diag = attention_mask[:, 0, own, own + seen]
        allowed = diag if diag.dtype == torch.bool else diag == 0
        return allowed.to(device)
    raise ValueError(f"unsupported attention_mask of shape {tuple(attention_mask.shape)}")


def cache_bytes_per_token_per_layer(cache, tokens: int) -> float:
    """Cache bytes per token and layer: a paged cache's assigned blocks (the memory_report of an
    MLAPagedCache or a SharedKvPagedCache), or everything a dense transformers cache holds for `tokens`
    tokens (a sparse family's indexer keys included)."""
    if isinstance(cache, MLAPagedCache) or getattr(cache, "holds_shared_kv_pages", False):
        return cache.memory_report()["bytes_per_token_per_layer"]
    held = sum(layer.keys.nbytes + layer.values.nbytes + getattr(getattr(layer, "indexer_keys", None), "nbytes", 0)
               for layer in cache.layers)
    return held / tokens / len(cache.layers)
