"""DeepSeek-V4's attention (transformers' `deepseek_v4`) on `torch.ops.mla`: recognition by structure and
the patched forward of both cache modes.

DeepSeek-V4 attends with one shared key-and-value row per token (K = V, RoPE on its trailing R dims
included), per-head attention sinks and a sliding window of the last `sliding_window` tokens; per layer
type (`config.layer_types`) it adds

* `sliding_attention`: nothing (the window only);
* `compressed_sparse_attention` (CSA): compressed entries, each pooling 2m tokens (overlapping windows
  of stride m), and a lightning indexer over its own compressed keys picking each query's top
  `index_topk` entries;
* `heavily_compressed_attention` (HCA): compressed entries pooling m' tokens each, all of them visible.

Entry w may be seen from position p when w < (p + 1) // m (it is complete). The attention output has
its RoPE undone (rotation by -theta at the query position) before the grouped output projection.

Dense mode (transformers' own `DynamicCache`, or no cache): both prologs are `mla.shared_kv_q_prolog`
/ `mla.shared_kv_prolog`, every compressor is `mla.kv_compressor` (its state and the request's entries
live on the stock cache layer object, `DenseCompressorState`, in place of stock's open-window buffers and
overlap state, which stay empty; the entries a call closes go to the stock layer's
`update_compressor_states`, so the stock cache holds the window, the entries and their counts as stock
does), the indexer's scores and top-k are `mla.lightning_indexer(compress_ratio=m)` folded into
stock's block mask, the inverse RoPE is `mla.rope` with -sin, and the attention core is the model's own
attention function with stock's mask: its logits are stock's bit for bit where no two indexer scores tie
at the k-th place (docs/transformers.md, DeepSeek-V4).

Paged mode (`SharedKvPagedCache`): the same prologs, `mla.scatter_pa_cache` for the window rows,
`mla.kv_compressor` into the layer's entry pools, `mla.lightning_indexer` for CSA, and
`mla.shared_kv_attention` over the window plus the selected (CSA) or all visible (HCA) entries.

RoPE. Stock rotates in fp32 (`x.float() * cos + rotate_half(x).float() * sin`, cos / sin rounded to the
model's dtype) and rounds once. `mla.rope` with compute_dtype "activation" on fp32 operands is that
formula op for op, so the patch rotates fp32 operands that way and rounds the result once; the
"float32" rotation (one complex multiplication) fuses multiply-adds in rows of fewer than 8 pairs and
can differ from it there by an ulp.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import pathlib
import sys
from typing import Optional

import torch
import torch.nn.functional as F

from ...ops.rope import rope_math
from .attention_parts import layer_patch, sort_arguments
from .families import MlaFamily, forward_names, forward_parameters

# What DeepSeek-V4's attention `__init__` builds (read from its code, nothing is built).
SHARED_KV_MODULES = ("q_a_proj", "q_a_norm", "q_b_proj", "q_b_norm", "kv_proj", "kv_norm", "o_a_proj", "o_b_proj",
                     "sinks", "compressor")
# Every name DeepSeek-V4's attention forward uses (transformers 5.24, modeling_deepseek_v4.py): the
# prologs, the window cache update, the compressor call and mask extension, the attention interface
# with sinks, the inverse RoPE and the grouped output projection.
SHARED_KV_FORWARD_NAMES = frozenset({
    "ALL_ATTENTION_FUNCTIONS", "F", "Tensor", "_attn_implementation", "apply_rotary_pos_emb", "attention_dropout",
    "cat", "compressor", "config", "dtype", "eager_attention_forward", "flatten", "get_interface", "head_dim",
    "isinstance", "kv_norm", "kv_proj", "layer_idx", "o_a_proj", "o_b_proj", "o_groups", "pad", "q_a_norm",
    "q_a_proj", "q_b_norm", "q_b_proj", "reshape", "rope_layer_type", "scaling", "shape", "sinks", "sliding_window",
    "to", "torch", "training", "transpose", "update", "view",
})
# Every name its compressors' and indexer's forwards use (the classes whose forward calls
# `store_compression_weights`): gated pooling of m tokens (2m overlapping, where the forward calls
# `update_overlap_state`), RMSNorm, RoPE at the window's start, the running entries, and the indexer's
# query, scorer call, visibility mask and top-k.
COMPRESSOR_NAMES = frozenset({
    "apply_rotary_pos_emb", "arange", "compress_rate", "device", "dtype", "expand", "float", "float32", "full_like",
    "gate_proj", "head_dim", "index_topk", "indexer", "indices", "kv_norm", "kv_proj", "layers", "masked_fill", "min",
    "new_full", "new_zeros", "position_bias", "q_b_proj", "rope_layer_type", "rotary_emb", "scatter_", "scorer",
    "shape", "softmax", "squeeze", "store_compression_weights", "sum", "to", "topk", "torch", "transpose",
    "unsqueeze", "update_compressor_states", "update_overlap_state", "view", "where",
})
# The indexer scorer's forward (the class whose forward uses `weights_proj`):
# sum_h relu(q_h . k) * softmax_scale * (weights_proj(x) * weights_scaling)_h, in fp32.
SCORER_NAMES = frozenset({"F", "float", "matmul", "relu", "softmax_scale", "sum", "torch", "transpose", "unsqueeze",
                          "weights_proj", "weights_scaling"})
# The attribute of a transformers cache layer holding the dense mode's compressor states.
DENSE_STATE_ATTRIBUTE = "_mla_ops_compressor_states"


# ------------------------------------------------------------------------------------ recognition
def builds_shared_kv_modules(cls: type) -> bool:
    """Whether `cls.__init__` creates DeepSeek-V4's shared-KV attention modules (read from its code)."""
    code = getattr(getattr(cls, "__init__", None), "__code__", None)
    return code is not None and all(name in code.co_names for name in SHARED_KV_MODULES)


def is_shared_kv_attention(module: torch.nn.Module) -> bool:
    """A transformers DeepSeek-V4-style attention module (by the structure of its class; supported or not)."""
    cls = type(module)
    return cls.__module__.startswith("transformers.models.") and builds_shared_kv_modules(cls)


@functools.lru_cache(maxsize=None)
def installed_shared_kv_model_types() -> tuple[str, ...]:
    """model_type of every transformers model whose modeling file builds DeepSeek-V4's grouped output
    projection (`o_a_proj`) beside compressors (a text scan of the installed package, once per process:
    nothing is imported; `families.families_of` then reads the classes)."""
    import importlib.util

    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return ()
    models = pathlib.Path(next(iter(spec.submodule_search_locations))) / "models"
    found = []
    for path in sorted(models.glob("*/modeling_*.py")):
        text = path.read_text(errors="ignore") if path.stem == f"modeling_{path.parent.name}" else ""
        if "o_a_proj" in text and "store_compression_weights" in text:
            found.append(path.parent.name)
    return tuple(found)


def _module_classes_using(modeling, name: str) -> list:
    """The nn.Module classes of `modeling` whose own forward uses `name`."""
    return [obj for obj in vars(modeling).values()
            if isinstance(obj, type) and obj.__module__ == modeling.__name__ and issubclass(obj, torch.nn.Module)
            and "forward" in vars(obj) and name in forward_names(obj)]


def rope_refusal(modeling) -> Optional[str]:
    """Why the module's `apply_rotary_pos_emb` is not the rotation of interleaved pairs of the trailing
    dims, in fp32 and rounded once, that the patch computes (None when it is): run on a small random
    bf16 input x [B, H, S, 12] with per-pair tables [B, S, 4] (R = 8)."""
    function = getattr(modeling, "apply_rotary_pos_emb", None)
    if function is None:
        return "its forward calls apply_rotary_pos_emb, which its module does not define"
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 12, generator=generator).to(torch.bfloat16)
    angles = torch.randn(2, 5, 4, generator=generator)
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    with torch.no_grad():
        try:
            got = function(x, cos, sin)
        except Exception as exc:  # another signature
            return f"its apply_rotary_pos_emb does not take (x, cos, sin) per-pair tables ({type(exc).__name__})"
        rotated = rope_math(x[..., -8:].float(), cos.float(), sin.float(), "interleaved", "activation")
        expected = torch.cat((x[..., :-8], rotated.to(x.dtype)), dim=-1)
    if got.shape != expected.shape or not torch.equal(got, expected):
        return "its apply_rotary_pos_emb does not rotate interleaved pairs of the trailing dims as the patch does"
    return None


def describe_shared_kv(cls: type) -> MlaFamily:
    """Read a shared-KV attention class (`builds_shared_kv_modules`) into an MlaFamily (`shared_kv=True`):
    refused, with the names, when its forward, its compressors' or its indexer scorer's use a name beyond
    DeepSeek-V4's, or when its RoPE function rotates otherwise."""
    modeling = sys.modules[cls.__module__]
    module = cls.__module__
    model_type = module.split(".")[2] if module.startswith("transformers.models.") else module
    parameters = forward_parameters(cls)
    reasons = []
    unknown = sorted(forward_names(cls) - SHARED_KV_FORWARD_NAMES)
    if unknown:
        reasons.append(f"its forward uses {', '.join(unknown)}, which the patch does not reproduce")
    compressors = _module_classes_using(modeling, "store_compression_weights")
    if not compressors:
        reasons.append("its module has no compressor (a forward calling store_compression_weights)")
    for compressor in compressors:
        extra = sorted(forward_names(compressor) - COMPRESSOR_NAMES)
        if extra:
            reasons.append(f"its {compressor.__name__} uses {', '.join(extra)}, beyond DeepSeek-V4's gated pooling "
                           f"(mla.kv_compressor) and lightning indexer (mla.lightning_indexer)")
    for scorer in _module_classes_using(modeling, "weights_proj"):
        extra = sorted(forward_names(scorer) - SCORER_NAMES)
        if extra:
            reasons.append(f"its {scorer.__name__} uses {', '.join(extra)}, beyond the score "
                           f"sum_h w_h * relu(q_h . k) that mla.lightning_indexer computes")
    if not reasons:
        refusal = rope_refusal(modeling) or norm_class_refusal(cls)
        if refusal:
            reasons.append(refusal)
    return MlaFamily(attention=cls, model_type=model_type, rope="interleaved", parameters=parameters,
                     refused="; ".join(reasons) or None, shared_kv=True)


def _norm_refusal(owner: str, norm, weighted: bool) -> Optional[str]:
    """Why `norm` is not the RMSNorm the V4 ops compute (None when it is), run on a random bf16 input:
    weighted: (w * (x32 * rsqrt(mean(x32^2) + eps))).to(dtype); unweighted: x * rsqrt(...).to(dtype),
    the multiply in x's dtype."""
    weight = getattr(norm, "weight", None) if weighted else None
    eps = getattr(norm, "variance_epsilon" if weighted else "eps", None)
    if eps is None or (weighted and not isinstance(weight, torch.Tensor)):
        return f"its {owner} is not an RMSNorm with the eps / weight the ops take"
    if weighted and weight.is_meta:
        return None
    width = weight.shape[0] if weighted else 16
    device = weight.device if weighted else torch.device("cpu")
    x = torch.randn(3, width, generator=torch.Generator().manual_seed(0)).to(device=device, dtype=torch.bfloat16)
    x32 = x.float()
    with torch.no_grad():
        got = norm(x)
        if weighted:
            expected = (weight.float() * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)
        else:
            expected = x * torch.rsqrt(x32.square().mean(-1, keepdim=True) + eps).to(x.dtype)
    if got.dtype != expected.dtype or not torch.equal(got, expected):
        kind = "weighted (fp32 weight multiply, one rounding)" if weighted else "unweighted"
        return f"its {owner} does not compute the {kind} RMSNorm the mla ops compute"
    return None


def norm_class_refusal(cls: type) -> Optional[str]:
    """Why an RMSNorm class the attention's `__init__` names (a module class whose forward uses `rsqrt`)
    does not compute the norm the ops do (None when none differs): each is built small, with its default
    weights, and run on a random bf16 input (`layer_refusal` probes a model's own modules again)."""
    modeling = sys.modules[cls.__module__]
    for name in inspect.unwrap(cls.__init__).__code__.co_names:
        norm_class = getattr(modeling, name, None)
        if not (isinstance(norm_class, type) and issubclass(norm_class, torch.nn.Module) and "forward" in
                vars(norm_class) and "rsqrt" in forward_names(norm_class)):
            continue
        weighted = "weight" in forward_names(norm_class)
        try:
            norm = norm_class(16) if weighted else norm_class()
        except Exception:  # another constructor: the patch-time probe of the model's own modules decides
            continue
        refusal = _norm_refusal(norm_class.__name__, norm, weighted)
        if refusal:
            return refusal
    return None


def layer_refusal(attn) -> Optional[str]:
    """Why this attention module's weights or norms are not what the ops take (None when they are): the
    prolog projections without bias, one eps for both query norms, DeepSeek-V4's RMSNorms."""
    for name in ("q_a_proj", "q_b_proj", "kv_proj"):
        if getattr(getattr(attn, name), "bias", None) is not None:
            return f"its {name} has a bias, which mla.shared_kv_q_prolog / mla.shared_kv_prolog do not add"
    if getattr(attn.q_b_norm, "eps", None) != getattr(attn.q_a_norm, "variance_epsilon", None):
        return "its q_a_norm and q_b_norm use different eps; mla.shared_kv_q_prolog takes one"
    norms = [("q_a_norm", attn.q_a_norm, True), ("kv_norm", attn.kv_norm, True), ("q_b_norm", attn.q_b_norm, False)]
    compressor = attn.compressor
    if compressor is not None:
        norms.append(("compressor.kv_norm", compressor.kv_norm, True))
        indexer = getattr(compressor, "indexer", None)
        if indexer is not None:
            norms.append(("compressor.indexer.kv_norm", indexer.kv_norm, True))
    for owner, norm, weighted in norms:
        refusal = _norm_refusal(f"{owner} ({type(norm).__name__})", norm, weighted)
        if refusal:
            return refusal
    return None


def overlapping(compressor) -> bool:
    """Whether the compressor pools overlapping windows of 2m tokens (CSA: its forward carries the
    previous window's first half with `update_overlap_state`) or m tokens (HCA)."""
    return "update_overlap_state" in forward_names(type(compressor))


# ------------------------------------------------------------------------------------------ RoPE
def per_request_tables(table: torch.Tensor, batch: int) -> torch.Tensor:
    """cos / sin [B or 1, S, R/2] as the ops take them: [B, S, R/2], or [S, R/2] shared by every row."""
    return table[0] if table.dim() == 3 and table.shape[0] != batch else table


def rotate_like_stock(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Stock `apply_rotary_pos_emb`'s rotation of x [..., S, R] (interleaved pairs) with `mla.rope`: fp32
    operands, the elementwise formula op for op ("activation" on fp32), rounded once to x's dtype."""
    rotated = torch.ops.mla.rope(x.float(), cos.float(), sin.float(), layout="interleaved", compute_dtype="activation")
    return rotated.to(x.dtype)


def rotate_trailing(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, S, D] with its trailing R = 2 * cos.shape[-1] dims rotated (the rest unchanged)."""
    rope_dim = 2 * cos.shape[-1]
    return torch.cat((x[..., :-rope_dim], rotate_like_stock(x[..., -rope_dim:], cos, sin)), dim=-1)


# ---------------------------------------------------------------------------- pieces of both modes
def query_and_key(attn, hidden_states, cos, sin):
    """(q [B, S, H, D], q_residual [B, S, q_lora_rank], kv [B, S, D]): both prologs on the new tokens."""
    q, q_residual = torch.ops.mla.shared_kv_q_prolog(hidden_states, attn.q_a_proj.weight, attn.q_a_norm.weight,
                                                     attn.q_b_proj.weight, cos, sin, num_heads=attn.num_heads,
                                                     eps=attn.q_a_norm.variance_epsilon)
    kv = torch.ops.mla.shared_kv_prolog(hidden_states, attn.kv_proj.weight, attn.kv_norm.weight, cos, sin,
                                        eps=attn.kv_norm.variance_epsilon)
    return q, q_residual, kv


def project_output(attn, attn_output, cos, sin):
    """attn_output [B, S, H, D] -> [B, S, hidden]: RoPE undone on the trailing dims (rotation by -theta at
    the query position, `mla.rope` with -sin), then the grouped o_a_proj and o_b_proj, as stock."""
    batch, seq = attn_output.shape[:2]
    attn_output = rotate_trailing(attn_output.transpose(1, 2), cos, -sin).transpose(1, 2)
    grouped = attn_output.reshape(batch, seq, attn.config.o_groups, -1)
    return attn.o_b_proj(attn.o_a_proj(grouped).flatten(2))


def indexer_query(indexer, hidden_states, q_residual, position_ids):
    """The lightning indexer's query and head weights, as stock computes them: (q [B, S, Hi, Di] with RoPE
    on its trailing dims at `position_ids`, weights [B, S, Hi] fp32 = weights_proj(x) * Hi**-0.5)."""
    batch, seq = hidden_states.shape[:2]
    cos, sin = indexer.rotary_emb(hidden_states, position_ids=position_ids, layer_type=indexer.rope_layer_type)
    cos, sin = per_request_tables(cos, batch), per_request_tables(sin, batch)
    q = indexer.q_b_proj(q_residual).view(batch, seq, -1, indexer.head_dim).transpose(1, 2)
    q = rotate_trailing(q, cos, sin).transpose(1, 2)
    scorer = indexer.scorer
    weights = scorer.weights_proj(hidden_states).float() * scorer.weights_scaling
    return q, weights


def rope_tables(rotary, label: str, like: torch.Tensor, length: int):
    """The compressed entries' RoPE tables by position, (cos, sin) [length, R/2] in `like`'s dtype: what the
    stock compressor's rotary embedding gives for positions 0 .. length-1."""
    positions = torch.arange(length, device=like.device)[None]
    cos, sin = rotary(like, position_ids=positions, layer_type=label)
    return cos[0], sin[0]


def compress(module, kv, gate, state, entries, block_tables, seq_lens, query_start_loc, cos, sin):
    """One `mla.kv_compressor` call: `module`'s (a compressor or the indexer) raw projections of the new
    tokens, kv / gate [B, S, C], pooled into `entries` [NB, bs, 1, D] through `block_tables`, `state`
    [B, L, 2, C] carried from call to call."""
    torch.ops.mla.kv_compressor(kv.reshape(-1, kv.shape[-1]), gate.reshape(-1, gate.shape[-1]), module.position_bias,
                                module.kv_norm.weight, cos, sin, state, entries, block_tables, seq_lens,
                                query_start_loc, compress_ratio=module.compress_rate, overlap=overlapping(module),
                                eps=module.kv_norm.variance_epsilon)


def state_shape(module, batch: int) -> tuple[int, int, int, int]:
    """[B, L, 2, C] of a compressor's mla.kv_compressor state: L = 2m rows of C = 2D channels when it
    overlaps, m rows of D otherwise."""
    rows, channels = module.compress_rate, module.head_dim
    if overlapping(module):
        rows, channels = 2 * rows, 2 * channels
    return batch, rows, 2, channels


def shared_kv_attention_forward(self, hidden_states, *args, **kwargs):
    """Drop-in for DeepSeek-V4's attention forward (the stock signature): the paged path for a
    `SharedKvPagedCache`, the dense path otherwise. Returns (attn_output [B, S, hidden], attn_weights)."""
    patch = layer_patch(self)
    inputs = sort_arguments(patch.family, args, kwargs)
    if getattr(inputs.cache, "holds_shared_kv_pages", False):  # a SharedKvPagedCache, whoever made it
        return paged_forward(self, hidden_states, inputs)
    return dense_forward(self, patch, hidden_states, inputs)


# ------------------------------------------------------------------------------------------ dense
@dataclasses.dataclass
class DenseCompressorState:
    """One compressor's `mla.kv_compressor` state for the B requests of a transformers cache layer (or of
    one call without a cache): `state` [B, L, 2, C], the entries `pool` [B, capacity, 1, D] (request b's
    entries in block b), `tokens` it has pooled, and the entries' RoPE tables (grown as needed)."""

    state: torch.Tensor
    pool: torch.Tensor
    tokens: int = 0
    cos: Optional[torch.Tensor] = None
    sin: Optional[torch.Tensor] = None

    @classmethod
    def new(cls, module, like: torch.Tensor, batch: int, entries: int) -> "DenseCompressorState":
        return cls(like.new_zeros(state_shape(module, batch)),
                   like.new_zeros(batch, max(entries, 1), 1, module.head_dim))

    @property
    def block_tables(self) -> torch.Tensor:  # [B, 1]: request b's entries are block b
        return torch.arange(self.pool.shape[0], dtype=torch.int32, device=self.pool.device)[:, None]

    def reserve(self, entries: int) -> None:
        """Room for `entries` entries per request (doubling)."""
        capacity = self.pool.shape[1]
        if entries > capacity:
            grown = self.pool.new_zeros(self.pool.shape[0], max(entries, 2 * capacity), *self.pool.shape[2:])
            grown[:, :capacity] = self.pool
            self.pool = grown

    def tables(self, module, like: torch.Tensor, length: int):
        """The entries' RoPE tables for positions 0 .. at least length-1 (recomputed doubled when short)."""
        if self.cos is None or self.cos.shape[0] < length or self.cos.dtype != like.dtype:
            known = 0 if self.cos is None else self.cos.shape[0]
            self.cos, self.sin = rope_tables(module.rotary_emb, module.rope_layer_type, like, max(length, 2 * known))
        return self.cos, self.sin

    def select(self, rows: torch.Tensor) -> None:
        """Keep requests `rows` (beam search reorders the cache's rows)."""
        self.state = self.state.index_select(0, rows.to(self.state.device))
        self.pool = self.pool.index_select(0, rows.to(self.pool.device))


def _reorder_with_states(layer):
    """The cache layer's `reorder_cache`, reordering the dense compressor states with its own rows."""
    stock_reorder = layer.reorder_cache

    def reorder_cache(beam_idx):
        stock_reorder(beam_idx)
        for state in layer.__dict__.get(DENSE_STATE_ATTRIBUTE, {}).values():
            state.select(beam_idx)

    return reorder_cache


def _dense_state(module, name: str, layer, like: torch.Tensor, batch: int, before: int, entries: int):
    """The compressor state of entry `name` for a call following `before` pooled tokens: a temporary one
    without a cache layer, else the one kept on the layer (new once the layer starts from zero tokens)."""
    if layer is None:
        return DenseCompressorState.new(module, like, batch, entries)
    states = layer.__dict__.setdefault(DENSE_STATE_ATTRIBUTE, {})
    state = states.get(name)
    if before == 0:
        if "reorder_cache" not in layer.__dict__:
            layer.reorder_cache = _reorder_with_states(layer)
        state = states[name] = DenseCompressorState.new(module, like, batch, entries)
    elif state is None or state.tokens != before or state.state.shape[0] != batch:
        raise RuntimeError(
            f"the cache holds {before} tokens of layer {type(layer).__name__} that the patched compressor did not "
            f"pool (it was filled by the stock model, or cropped / reshaped outside the patched forward); use a new "
            f"cache (DynamicCache(config=model.config)) under the patch")
    return state


def dense_compress(module, name: str, hidden_states, layer, total: int):
    """Run `module` (a compressor, or the indexer's compressor) through mla.kv_compressor on the new tokens
    -> (every entry so far [B, T, D] as stock returns them: the stock layer's running entries with a cache,
    this call's complete windows without one; the state holding them as a paged pool)."""
    batch, seq = hidden_states.shape[:2]
    rate = module.compress_rate
    first, last = (total - seq) // rate, total // rate
    kv, gate = module.kv_proj(hidden_states), module.gate_proj(hidden_states)
    state = _dense_state(module, name, layer, kv, batch, total - seq, last)
    state.reserve(last)
    cos, sin = state.tables(module, kv, max(last * rate, 1))
    device = hidden_states.device
    seq_lens = torch.full((batch,), total, dtype=torch.int64, device=device)
    starts = torch.arange(batch + 1, dtype=torch.int64, device=device) * seq
    compress(module, kv, gate, state.state, state.pool, state.block_tables, seq_lens, starts, cos, sin)
    state.tokens = total
    new = state.pool[:, first:last, 0]
    if layer is None:
        return new, state
    return layer.update_compressor_states(name, new.clone()), state


def dense_topk(indexer, hidden_states, q_residual, position_ids, layer, total: int):
    """Stock's CSA selection through mla.lightning_indexer -> int64 [B, S, index_topk] entry indices (-1:
    none). Each query is a request of its own whose length makes the op's visibility rule stock's:
    entries w < min((position_ids + 1) // m, T), the top `index_topk` of them by score."""
    batch, seq = hidden_states.shape[:2]
    entries, state = dense_compress(indexer, "indexer", hidden_states, layer, total)
    q, weights = indexer_query(indexer, hidden_states, q_residual, position_ids)
    rate = indexer.compress_rate
    positions = position_ids.expand(batch, seq).reshape(-1).to(torch.int64)
    seq_lens = (positions + 1).clamp(max=entries.shape[1] * rate).clamp(min=1)
    starts = torch.arange(batch * seq + 1, dtype=torch.int64, device=positions.device)
    tables = state.block_tables.repeat_interleave(seq, dim=0)
    topk = torch.ops.mla.lightning_indexer(q.reshape(batch * seq, *q.shape[2:]), weights.reshape(batch * seq, -1),
                                           state.pool, tables, seq_lens, starts, indexer.index_topk,
                                           indexer.scorer.softmax_scale, compress_ratio=rate)
    return topk.view(batch, seq, -1).long()


def dense_compressed(attn, hidden_states, q_residual, inputs):
    """The compressor's part of the stock forward: (compressed_kv [B, 1, T, D], block_bias [B, 1, S, T] or
    None) exactly as stock returns them, the pooling and selection on the ops."""
    compressor = attn.compressor
    cache = inputs.cache
    layer = cache.layers[attn.layer_idx] if cache is not None else None
    if layer is not None and not hasattr(layer, "update_compressor_states"):
        raise ValueError(f"the cache's layer {attn.layer_idx} ({type(layer).__name__}) holds no compressed entries: "
                         f"DeepSeek-V4 needs its own cache layers, DynamicCache(config=model.config)")
    batch, seq = hidden_states.shape[:2]
    total = layer.cumulative_length if layer is not None else seq  # (the window update counted the new tokens)
    entries, _ = dense_compress(compressor, "compressor", hidden_states, layer, total)
    compressed_kv = entries.unsqueeze(1)
    count = compressed_kv.shape[2]
    position_ids = inputs.position_ids
    indexer = getattr(compressor, "indexer", None)
    if indexer is not None:  # CSA: the selected entries only, folded as stock folds them
        topk = dense_topk(indexer, hidden_states, q_residual, position_ids, layer, total)
        safe = torch.where(topk >= 0, topk, count)
        block_bias = compressed_kv.new_full((batch, 1, seq, count + 1), float("-inf"))
        block_bias.scatter_(-1, safe.unsqueeze(1), 0.0)
        return compressed_kv, block_bias[..., :count]
    if seq == 1 or count == 0:  # HCA decode: every entry is complete
        return compressed_kv, None
    threshold = (position_ids + 1) // compressor.compress_rate
    hidden = torch.arange(count, device=compressed_kv.device).view(1, 1, 1, -1) >= threshold.unsqueeze(1).unsqueeze(-1)
    return compressed_kv, compressed_kv.new_zeros((batch, 1, seq, count)).masked_fill(hidden, float("-inf"))


def dense_forward(attn, patch, hidden_states, inputs):
    """The dense-mode forward: stock's, with the prologs, compressors, indexer and inverse RoPE on the ops."""
    batch = hidden_states.shape[0]
    cos, sin = inputs.position_embeddings[attn.rope_layer_type]
    cos, sin = per_request_tables(cos, batch), per_request_tables(sin, batch)
    q, q_residual, kv = query_and_key(attn, hidden_states, cos, sin)
    kv = kv.unsqueeze(1)  # [B, 1, S, D]: the one K = V head
    if inputs.cache is not None:  # the sliding window, as stock updates it
        kv = patch.release.update_cache(inputs.cache, kv, kv, attn.layer_idx, None, inputs.extra)[0]
    attention_mask, block_bias = inputs.attention_mask, None
    if attn.compressor is not None:
        compressed_kv, block_bias = dense_compressed(attn, hidden_states, q_residual, inputs)
        kv = torch.cat([kv, compressed_kv], dim=2)
    if isinstance(attention_mask, torch.Tensor) and kv.shape[2] > attention_mask.shape[-1]:
        if block_bias is not None:
            attention_mask = torch.cat([attention_mask, block_bias.to(attention_mask.dtype)], dim=-1)
        else:
            attention_mask = F.pad(attention_mask, (0, kv.shape[2] - attention_mask.shape[-1]), value=0.0)
    interface = patch.release.attention_function(patch.family.modeling, attn.config._attn_implementation)
    attn_output, attn_weights = interface(
        attn, q.transpose(1, 2), kv, kv, attention_mask, dropout=0.0 if not attn.training else attn.attention_dropout,
        scaling=attn.scaling, sliding_window=attn.sliding_window, s_aux=attn.sinks, **inputs.extra)
    return project_output(attn, attn_output, cos, sin), attn_weights


# ------------------------------------------------------------------------------------------ paged
def paged_forward(attn, hidden_states, inputs):
    """The paged-mode forward, every step on the ops -> (attn_output [B, S, hidden], None)."""
    cache = inputs.cache
    plan = cache.plan
    if plan is None:
        raise RuntimeError("SharedKvPagedCache has no plan for this forward: the model-level hook did not run "
                           "(patch the model with mla_ops.patch(model), whose cache is 'paged')")
    batch, seq = hidden_states.shape[:2]
    tokens = batch * seq
    cos, sin = inputs.position_embeddings[attn.rope_layer_type]
    cos, sin = per_request_tables(cos, batch), per_request_tables(sin, batch)
    layer = cache.layers[attn.layer_idx]
    q, q_residual, kv = query_and_key(attn, hidden_states, cos, sin)
    torch.ops.mla.scatter_pa_cache(kv.reshape(tokens, 1, -1), layer.window_pool, plan.slot_mapping)
    compressed = {}
    compressor = attn.compressor
    if compressor is not None:
        tables = plan.entry_tables[compressor.compress_rate]
        entry_kv, entry_gate = compressor.kv_proj(hidden_states), compressor.gate_proj(hidden_states)
        entry_cos, entry_sin = cache.entry_rope_tables(compressor, entry_kv)
        compress(compressor, entry_kv, entry_gate, layer.state, layer.entry_pool, tables, plan.seq_lens,
                 plan.query_start_loc, entry_cos, entry_sin)
        topk = None
        indexer = getattr(compressor, "indexer", None)
        if indexer is not None:
            index_kv, index_gate = indexer.kv_proj(hidden_states), indexer.gate_proj(hidden_states)
            compress(indexer, index_kv, index_gate, layer.index_state, layer.index_pool, tables, plan.seq_lens,
                     plan.query_start_loc, *cache.entry_rope_tables(indexer, index_kv))
            index_q, weights = indexer_query(indexer, hidden_states, q_residual, inputs.position_ids)
            topk = torch.ops.mla.lightning_indexer(index_q.reshape(tokens, *index_q.shape[2:]),
                                                   weights.reshape(tokens, -1), layer.index_pool, tables,
                                                   plan.seq_lens, plan.query_start_loc, indexer.index_topk,
                                                   indexer.scorer.softmax_scale, compress_ratio=indexer.compress_rate)
        compressed = dict(compressed_cache=layer.entry_pool, compressed_block_tables=tables,
                          compress_ratio=compressor.compress_rate, topk_indices=topk)
    attn_output = torch.ops.mla.shared_kv_attention(q.reshape(tokens, attn.num_heads, -1), layer.window_pool,
                                                    plan.block_tables, plan.seq_lens, plan.query_start_loc,
                                                    attn.sinks, attn.scaling, attn.sliding_window, **compressed)
    return project_output(attn, attn_output.view(batch, seq, attn.num_heads, -1), cos, sin), None

