"""The paged cache of DeepSeek-V4's attention: a transformers `Cache` for `mla_ops.patch(model)`
(cache="paged") on a `deepseek_v4` model, whose pools the ops write and read (`shared_kv.paged_forward`).

Per layer, in block pools `[num_blocks, block_size, 1, dim]` (bytes per token and layer in bf16 at
V4-Flash's D 512, Di 128, m 4, m' 128):

* every layer: the window pool of K = V rows (RoPE inside), D*2 = 1024 B; `mla.shared_kv_attention` reads
  only the last `sliding_window` tokens, and the dynamic cache gives blocks wholly before every window
  back to its free list (their block-table entries become -1);
* `compressed_sparse_attention` (CSA): the compressed entries, D*2/m = 256 B, the indexer's entries,
  Di*2/m = 64 B, and two `mla.kv_compressor` states, `[B, 2m, 2, 2D]` and `[B, 2m, 2, 2Di]`;
* `heavily_compressed_attention` (HCA): the compressed entries, D*2/m' = 8 B, and a state `[B, m', 2, D]`.

One block table per row addresses every layer's window pool (block j holds positions j*bs .. j*bs+bs-1),
and one per compress rate every entry pool of that rate (block j holds entries j*bs ..). Batches without
padding only: stock DeepSeek-V4's compressors pool padding tokens too and rope the entries by count while
masking by `position_ids`, which a paged cache of real tokens does not reproduce (cache="dense" serves
padded batches as stock does).

`SharedKvPagedCache(static=False)` grows block by block from free lists (host bookkeeping; pools double
when one runs out) and refuses torch.compile; its first reservation is at most `MAX_INITIAL_TOKENS_PER_ROW`
tokens per row. `static=True` preallocates `max_cache_len` tokens per row by design and keeps the
per-token bookkeeping in tensors, so a decode step (and a first prefill) compiles with
`torch.compile(fullgraph=True)`. The compressor state cannot be rewound: no crop, beam search or
assisted decoding (stock DeepSeek-V4 refuses the latter two as well).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

from .paged_cache import DEFAULT_BLOCK_SIZE, MAX_INITIAL_TOKENS_PER_ROW, PagedCache, PagedLayerView, real_token_flags
from .shared_kv import rope_tables

CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"
WINDOW = "window"  # the block space of the window rows; an entry space is keyed by its compress rate


def _unsupported(what: str):
    raise NotImplementedError(
        f"SharedKvPagedCache does not support {what}: the compressors' state cannot be rewound or shared "
        f"between rows. Use greedy or sampling generation, or mla_ops.patch(model, cache='dense') (stock's cache)")


class SharedKvPagedLayer(PagedLayerView):
    """One layer's pools and compressor states; the token bookkeeping is the parent cache's."""

    is_sliding = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, cache: "SharedKvPagedCache", layer_type: str):
        super().__init__()
        self._cache = cache
        self.layer_type = layer_type
        self.compress_rate: Optional[int] = cache.compress_rates.get(layer_type)  # None: the window only
        self.is_compileable = cache.static
        self.window_pool: Optional[torch.Tensor] = None  # [NB, bs, 1, D]
        self.entry_pool: Optional[torch.Tensor] = None  # [NBm, bs, 1, D]
        self.index_pool: Optional[torch.Tensor] = None  # [NBm, bs, 1, Di] (CSA)
        self.state: Optional[torch.Tensor] = None  # [B, L, 2, C]
        self.index_state: Optional[torch.Tensor] = None  # [B, 2m, 2, 2Di] (CSA)

    def pool_names(self, kind) -> tuple[str, ...]:
        """The pools of block space `kind` (WINDOW, or a compress rate) this layer holds."""
        if kind == WINDOW:
            return ("window_pool",)
        if kind != self.compress_rate:
            return ()
        return ("entry_pool", "index_pool") if self.layer_type == CSA else ("entry_pool",)

    def tensors(self) -> list:
        """Every pool and state of the layer."""
        names = ("window_pool", "entry_pool", "index_pool", "state", "index_state")
        return [getattr(self, n) for n in names if getattr(self, n) is not None]

    def allocate(self, blocks: dict, batch: int, dtype: torch.dtype, device: torch.device) -> None:
        c = self._cache
        pool = lambda kind, dim: torch.zeros(blocks[kind], c.block_size, 1, dim, dtype=dtype, device=device)  # noqa: E731
        self.window_pool = pool(WINDOW, c.head_dim)
        self.keys = self.values = self.window_pool  # K = V
        rate = self.compress_rate
        if rate is not None:
            self.entry_pool = pool(rate, c.head_dim)
            if self.layer_type == CSA:
                self.index_pool = pool(rate, c.index_head_dim)
                self.state = torch.zeros(batch, 2 * rate, 2, 2 * c.head_dim, dtype=dtype, device=device)
                self.index_state = torch.zeros(batch, 2 * rate, 2, 2 * c.index_head_dim, dtype=dtype, device=device)
            else:
                self.state = torch.zeros(batch, rate, 2, c.head_dim, dtype=dtype, device=device)
        self.device = device
        self.is_initialized = True
        if c.static and not torch.compiler.is_compiling():
            for tensor in self.tensors():
                torch._dynamo.mark_static_address(tensor)

    def grow(self, kind, num_blocks: int) -> None:
        for name in self.pool_names(kind):
            pool = getattr(self, name)
            setattr(self, name, torch.cat((pool, pool.new_zeros(num_blocks - pool.shape[0], *pool.shape[1:]))))
        if kind == WINDOW:
            self.keys = self.values = self.window_pool

    def clear_states(self) -> None:
        for state in (self.state, self.index_state):
            if state is not None:
                state.zero_()

    def lazy_initialization(self, key_states, value_states) -> None:
        raise NotImplementedError("SharedKvPagedLayer is filled by the patched attention forward, not by update()")

    def update(self, key_states, value_states, *args, **kwargs):
        raise NotImplementedError("SharedKvPagedCache is written by the ops in the patched attention "
                                  "(mla_ops.patch(model), whose cache is 'paged'), not by update()")


@dataclasses.dataclass
class SharedKvPlan:
    """Where one forward's tokens go, computed once per forward and read by every layer (requests = rows,
    S new tokens each: the ops' request convention)."""

    slot_mapping: torch.Tensor  # [B*S] int64: the window pool slot of each new token
    seq_lens: torch.Tensor  # [B] int64: tokens of each row after this forward
    query_start_loc: torch.Tensor  # [B+1] int64
    block_tables: torch.Tensor  # [B, blocks] int32: the window pools' (-1: freed or unused)
    entry_tables: dict  # compress rate -> [B, blocks] int32: the entry pools'
    longest: int  # host bound on seq_lens (max_cache_len in a static cache)


class SharedKvPagedCache(PagedCache):
    """A transformers `Cache` of DeepSeek-V4's window rows, compressed entries and compressor states in
    paged pools (see the module docstring for what each layer holds).

    Args:
        config: the model's DeepseekV4Config (layer_types, head_dim, index_head_dim, compress_rates,
            sliding_window).
        block_size: rows per block, in every pool (default 64).
        batch_size: rows; required with static=True, else taken from the first forward.
        max_cache_len: tokens per row to reserve; required with static=True. With static=False only a size
            hint for the first allocation, capped at MAX_INITIAL_TOKENS_PER_ROW.
        static: preallocate every pool and fixed block tables (row b owns blocks [b*n, (b+1)*n) of each
            space) and keep the bookkeeping in tensors, for torch.compile and graph capture.
        dtype, device: allocate now instead of at the first forward.
    """

    holds_shared_kv_pages = True  # how the patched attention recognises it (without importing this module)

    def __init__(self, config, *, block_size: int = DEFAULT_BLOCK_SIZE, batch_size: Optional[int] = None,
                 max_cache_len: Optional[int] = None, static: bool = False, dtype: Optional[torch.dtype] = None,
                 device=None):
        self.init_bookkeeping(block_size=block_size, batch_size=batch_size, max_cache_len=max_cache_len,
                              static=static)
        layer_types = list(config.layer_types)
        unknown = sorted(set(layer_types) - {"sliding_attention", CSA, HCA})
        if unknown:
            raise ValueError(f"config.layer_types has {unknown}: SharedKvPagedCache holds DeepSeek-V4's "
                             f"sliding_attention, {CSA} and {HCA} layers")
        self.head_dim = config.head_dim
        self.index_head_dim = config.index_head_dim
        self.sliding_window = config.sliding_window
        self.compress_rates = {t: int(config.compress_rates[t]) for t in (CSA, HCA) if t in layer_types}
        self.kinds = (WINDOW, *sorted(set(self.compress_rates.values())))
        super().__init__(layers=[SharedKvPagedLayer(self, t) for t in layer_types])
        self.plan: Optional[SharedKvPlan] = None
        self._lens_host: list[int] = []  # dynamic: tokens per row
        self._rows: dict = {}  # dynamic: space -> each row's block ids (-1: freed)
        self._free: dict = {}  # dynamic: space -> free block ids
        self._num_blocks: dict = {}  # space -> blocks in each of its pools
        self.entry_tables: dict = {}
        self._entry_cos: Optional[torch.Tensor] = None
        self._entry_sin: Optional[torch.Tensor] = None
        if dtype is not None and batch_size is not None:
            self._allocate(batch_size, dtype, torch.device(device or "cpu"))

    # ---------------------------------------------------------------- allocation and bookkeeping
    def _blocks_for(self, kind, tokens: int) -> int:
        """Blocks of space `kind` a row of `tokens` tokens uses."""
        rows = tokens if kind == WINDOW else tokens // kind
        return math.ceil(rows / self.block_size)

    def _allocate(self, batch_size: int, dtype: torch.dtype, device: torch.device) -> None:
        self._batch_size = batch_size
        if self.static:
            per_row = {kind: max(1, self._blocks_for(kind, self.max_cache_len)) for kind in self.kinds}
            self._num_blocks = {kind: batch_size * n for kind, n in per_row.items()}
            tables = {kind: torch.arange(batch_size * n, dtype=torch.int32, device=device).view(batch_size, n)
                      for kind, n in per_row.items()}
            self.block_tables = tables[WINDOW]
            self.entry_tables = {kind: t for kind, t in tables.items() if kind != WINDOW}
            self._seen_tensor = torch.zeros((), dtype=torch.int64, device=device)
            if not torch.compiler.is_compiling():
                torch._dynamo.mark_static_address(self._seen_tensor)
        else:
            hint = min(self.max_cache_len or 1, MAX_INITIAL_TOKENS_PER_ROW)
            self._num_blocks = {kind: batch_size * max(1, self._blocks_for(kind, hint)) for kind in self.kinds}
            self._free = {kind: list(range(n - 1, -1, -1)) for kind, n in self._num_blocks.items()}
            self._rows = {kind: [[] for _ in range(batch_size)] for kind in self.kinds}
            self._lens_host = [0] * batch_size
        self.seq_lens = torch.zeros(batch_size, dtype=torch.int64, device=device)
        for layer in self.layers:
            layer.allocate(self._num_blocks, batch_size, dtype, device)

    def _take(self, kind, count: int) -> list[int]:
        """Pop `count` block ids of space `kind`, doubling its pools (every layer's) when the list runs out."""
        free = self._free[kind]
        if count > len(free):
            old = self._num_blocks[kind]
            new = max(2 * old, old + count - len(free))
            for layer in self.layers:
                layer.grow(kind, new)
            self._num_blocks[kind] = new
            free[:0] = range(new - 1, old - 1, -1)  # the new ids go under the old ones
        taken = free[len(free) - count:]
        del free[len(free) - count:]
        return taken[::-1]

    def begin_forward(self, attention_mask, batch_size: int, new_tokens: int, dtype: torch.dtype,
                      device: torch.device) -> SharedKvPlan:
        """Plan the slots of this forward's tokens (once per model forward, before the layers)."""
        compiling = torch.compiler.is_compiling()
        if not self.static and compiling:
            raise RuntimeError(
                "SharedKvPagedCache(static=False) allocates blocks on the host and cannot be traced by "
                "torch.compile; use SharedKvPagedCache(config, static=True, batch_size=..., max_cache_len=...)")
        if self.seq_lens is None:
            self._allocate(batch_size, dtype, device)
        if batch_size != self._batch_size:
            raise ValueError(f"SharedKvPagedCache holds {self._batch_size} rows but the forward has batch size "
                             f"{batch_size}; use one cache per batch")
        if not compiling:
            seen = self._seen_tensor if self.static else self._seen
            real = real_token_flags(attention_mask, batch_size, new_tokens, device, seen)
            if not bool(real.all()):
                raise NotImplementedError(
                    "cache='paged' on DeepSeek-V4 serves batches without padding: stock DeepSeek-V4's compressors "
                    "pool padding tokens as well, which a paged cache of real tokens does not reproduce. Run the rows "
                    "one at a time, or patch with cache='dense'")
        self.plan = self._plan_static(new_tokens) if self.static else self._plan_dynamic(new_tokens, device)
        return self.plan

    def end_forward(self) -> None:
        plan, self.plan = self.plan, None
        if plan is None:
            return
        self.seq_lens.copy_(plan.seq_lens)
        new_tokens = plan.slot_mapping.shape[0] // self._batch_size
        if self.static:
            self._seen_tensor.add_(new_tokens)
            if not torch.compiler.is_compiling():
                self._seen += new_tokens  # host mirror, for eager callers only
            return
        self._seen += new_tokens

    def _plan_dynamic(self, new_tokens: int, device: torch.device) -> SharedKvPlan:
        bs, window = self.block_size, self.sliding_window
        prefix = list(self._lens_host)
        lens = [old + new_tokens for old in prefix]
        tables = {}
        for kind in self.kinds:
            rows = self._rows[kind]
            for row, (old, new) in enumerate(zip(prefix, lens)):
                if kind == WINDOW:
                    # blocks wholly before the earliest window of this forward's queries are never read again
                    for column in range(min(max(0, old - window + 1) // bs, len(rows[row]))):
                        if rows[row][column] >= 0:
                            self._free[kind].append(rows[row][column])
                            rows[row][column] = -1
                need = self._blocks_for(kind, new) - len(rows[row])
                if need > 0:
                    rows[row] += self._take(kind, need)
            width = max(1, max(len(r) for r in rows))
            table = torch.full((len(rows), width), -1, dtype=torch.int32)
            for row, blocks in enumerate(rows):
                table[row, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
            tables[kind] = table
        positions = torch.tensor(prefix)[:, None] + torch.arange(new_tokens)[None]
        block = tables[WINDOW].long().gather(1, torch.div(positions, bs, rounding_mode="floor"))
        slots = block * bs + positions % bs
        self._lens_host = lens
        batch = len(prefix)
        self.block_tables = tables[WINDOW].to(device)
        self.entry_tables = {kind: t.to(device) for kind, t in tables.items() if kind != WINDOW}
        return SharedKvPlan(slot_mapping=slots.view(-1).to(device), seq_lens=torch.tensor(lens, device=device),
                            query_start_loc=torch.arange(batch + 1, device=device) * new_tokens,
                            block_tables=self.block_tables, entry_tables=self.entry_tables, longest=max(lens))

    def _plan_static(self, new_tokens: int) -> SharedKvPlan:
        bs = self.block_size
        capacity = self.block_tables.shape[1] * bs
        prefix = self.seq_lens
        device = prefix.device
        positions = prefix[:, None] + torch.arange(new_tokens, device=device)[None]
        new_lens = prefix + new_tokens
        if not torch.compiler.is_compiling():
            if int(new_lens.max()) > self.max_cache_len:
                raise ValueError(f"SharedKvPagedCache(static=True) holds {self.max_cache_len} tokens per row "
                                 f"(max_cache_len); this forward needs {int(new_lens.max())}")
        else:  # no host sync inside a graph: a device-side assert instead of silently clamped slots
            torch._assert_async(new_lens.max() <= self.max_cache_len,
                                "SharedKvPagedCache(static=True): the forward needs more tokens than max_cache_len")
        column = torch.div(positions.clamp(0, capacity - 1), bs, rounding_mode="floor")
        slots = self.block_tables.long().gather(1, column) * bs + positions % bs
        batch = prefix.shape[0]
        return SharedKvPlan(slot_mapping=slots.view(-1), seq_lens=new_lens,
                            query_start_loc=torch.arange(batch + 1, device=device) * new_tokens,
                            block_tables=self.block_tables, entry_tables=self.entry_tables,
                            longest=self.max_cache_len)

    def entry_rope_tables(self, module, like: torch.Tensor):
        """(cos, sin) [P, R/2] by position, in `like`'s dtype, for the compressed entries of this forward:
        `module`'s (a compressor's or the indexer's) rotary embedding at positions 0 .. P-1, P covering every
        row (every compressor of the model has the same tables). Computed once in a static cache
        (P = max_cache_len), grown by doubling in a dynamic one."""
        length = self.plan.longest
        cos = self._entry_cos
        if cos is None or cos.shape[0] < length or cos.dtype != like.dtype or cos.device != like.device:
            known = 0 if cos is None else cos.shape[0]
            size = length if self.static else max(length, 2 * known)
            self._entry_cos, self._entry_sin = rope_tables(module.rotary_emb, module.rope_layer_type, like, size)
        return self._entry_cos, self._entry_sin

    # ------------------------------------------------------------------------- Cache interface
    def unsupported(self, what: str):
        _unsupported(what)

    def release_rows(self) -> None:
        for layer in self.layers:
            layer.clear_states()
        if not self.static and self._batch_size is not None:
            for kind, rows in self._rows.items():
                for blocks in rows:
                    self._free[kind] += [b for b in blocks[::-1] if b >= 0]
            self._rows = {kind: [[] for _ in range(self._batch_size)] for kind in self.kinds}
            self._lens_host = [0] * self._batch_size

    def crop(self, tokens_to_remove: int) -> None:
        _unsupported("crop")

    def memory_report(self) -> dict:
        """Bytes held: `pool_bytes` everything allocated (free blocks and states included), `assigned_bytes`
        the blocks rows hold, `bytes_per_token_per_layer` assigned bytes over tokens and layers, and
        `payload_bytes_per_token_per_layer` what one token adds, averaged over the layers (the window row,
        plus 1/m of an entry (and of an indexer entry) in a compressed layer)."""
        if self.seq_lens is None:
            return {"tokens": 0, "pool_bytes": 0, "assigned_bytes": 0, "bytes_per_token_per_layer": 0.0}
        layers = len(self.layers)
        row_bytes = {kind: sum(getattr(layer, name)[0, 0].nbytes for layer in self.layers
                               for name in layer.pool_names(kind)) for kind in self.kinds}
        payload = sum(row_bytes[kind] / (1 if kind == WINDOW else kind) for kind in self.kinds) / layers
        if self.static:
            assigned_blocks = {kind: self._num_blocks[kind] for kind in self.kinds}
        else:
            assigned_blocks = {kind: sum(b >= 0 for r in rows for b in r) for kind, rows in self._rows.items()}
        assigned = sum(assigned_blocks[kind] * self.block_size * row_bytes[kind] for kind in self.kinds)
        tokens = int(self.seq_lens.sum())
        return {
            "tokens": tokens, "layers": layers, "block_size": self.block_size,
            "payload_bytes_per_token_per_layer": payload,
            "pool_bytes": sum(t.nbytes for layer in self.layers for t in layer.tensors()),
            "assigned_bytes": assigned,
            "bytes_per_token_per_layer": assigned / tokens / layers if tokens else float("nan"),
        }
