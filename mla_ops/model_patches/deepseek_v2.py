"""Route a transformers DeepSeek-V2 model's attention through `torch.ops.mla`, and back (ARCHITECTURE §5).

    from mla_ops.model_patches import deepseek_v2
    handle = deepseek_v2.apply(model)            # this model's attention layers only
    ...                                          # same tokens, through mla.kv_prolog
    handle.revert()                              # the stock forwards again

    with deepseek_v2.apply(kv_prolog=True, rms_norm=True, rope=True):   # class level: models built
        model = DeepseekV2ForCausalLM(config)                           # inside use the ops

Targets:
* transformers' native `DeepseekV2Attention` (supported range `SUPPORTED_TRANSFORMERS`; the forward's
  cache keyword and cache layout changed across 5.x, so other versions are refused at apply time);
* the hub remote-code `DeepseekV2Attention` of `modeling_deepseek.py` (trust_remote_code), found on
  the model instance; patched with `rope_layout="half"`, its `(out, weights, past_key_value)` return
  and `position_ids` / `past_key_value` arguments kept.

Options (each routes one piece; the rest stays stock):
* `kv_prolog` — the KV path (kv_a -> split -> RMSNorm -> kv_b -> split -> RoPE) is one
  `mla.kv_prolog` call on the new tokens, and the full per-head K/V is cached ("dense" cache).
* `rope` — `q_pe` is rotated with `mla.rope` (and `k_pe` too when `kv_prolog=False`).
* `rms_norm` — every DeepseekV2RMSNorm goes through `mla.rms_norm`.
* `cache` — `"dense"` (above) or `"paged"`: the MLA latent cache (see `mla_ops.model_patches.paged`).

cos/sin always come from the model's own rotary embedding (YaRN scaling included), never recomputed.
Memory trade-off of the dense cache: per token and layer it holds N*(P+R) + N*V values (V2-Lite:
16*192 + 16*128 = 5120, 10240 B in bf16) against the latent cache's L+R = 576 (1152 B); the paged
mode keeps the latent.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import types
import weakref
from typing import Callable, Optional

import torch

SUPPORTED_TRANSFORMERS = ("5.24.0", "5.25.0")  # [min, max): the versions this patch is tested against
ALLOW_UNTESTED_ENV = "MLA_OPS_ALLOW_UNTESTED_TRANSFORMERS"
CACHE_MODES = ("dense", "paged")
_REMOTE_FLASH_ATTENTION = "DeepseekV2FlashAttention2"  # the hub code's FA2 variant: other mask convention


@dataclasses.dataclass(frozen=True)
class PatchOptions:
    kv_prolog: bool = True
    rms_norm: bool = False
    rope: bool = False
    cache: str = "dense"


# --------------------------------------------------------------------------------------- discovery
def _native_module():
    from transformers.models.deepseek_v2 import modeling_deepseek_v2

    return modeling_deepseek_v2


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
    return isinstance(module, _native_module().DeepseekV2Attention)


def is_remote_attention(module: torch.nn.Module) -> bool:
    """The hub remote-code attention (modeling_deepseek.py): same class name, its own module, and the
    remote code's per-layer `rotary_emb` and `softmax_scale` attributes."""
    return (type(module).__name__ == "DeepseekV2Attention" and not is_native_attention(module)
            and hasattr(module, "kv_a_proj_with_mqa") and hasattr(module, "rotary_emb")
            and hasattr(module, "softmax_scale"))


def _is_rms_norm(module: torch.nn.Module) -> bool:
    return type(module).__name__ == "DeepseekV2RMSNorm" and hasattr(module, "variance_epsilon")


# ----------------------------------------------------------------------------- patched forwards
def _options(module) -> PatchOptions:
    return module._mla_ops_options


def _query(attn, hidden_states):
    """q [B, S, N*(P+R)] -> (q_nope [B, N, S, P], q_pe [B, N, S, R]), as the stock forwards do."""
    batch, seq = hidden_states.shape[:-1]
    if attn.q_lora_rank is None:
        q = attn.q_proj(hidden_states)
    else:
        q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(hidden_states)))
    q = q.view(batch, seq, -1, attn.qk_nope_head_dim + attn.qk_rope_head_dim).transpose(1, 2)
    return torch.split(q, [attn.qk_nope_head_dim, attn.qk_rope_head_dim], dim=-1)


def _kv_prolog(attn, hidden_states, cos, sin, rope_layout):
    """mla.kv_prolog with this layer's weights -> (k_nope [B,N,S,P], value [B,N,S,V], k_pe [B,1,S,R])."""
    kv_a, norm = attn.kv_a_proj_with_mqa, attn.kv_a_layernorm
    return torch.ops.mla.kv_prolog(
        hidden_states, kv_a.weight, kv_a.bias, norm.weight, attn.kv_b_proj.weight, cos, sin,
        num_heads=attn.num_heads, qk_nope_head_dim=attn.qk_nope_head_dim, v_head_dim=attn.v_head_dim,
        eps=norm.variance_epsilon, rope_layout=rope_layout)


def _dense_key(k_nope, k_pe):
    """[k_nope | k_pe broadcast over heads]: the full per-head key the dense cache stores."""
    return torch.cat((k_nope, k_pe.expand(-1, k_nope.shape[1], -1, -1)), dim=-1)


def native_attention_forward(self, hidden_states, attention_mask=None, cache=None, position_embeddings=None,
                             **kwargs):
    """Drop-in for transformers' native `DeepseekV2Attention.forward` (5.24 signature)."""
    if cache is None:
        cache = kwargs.pop("past_key_values", None)  # the pre-5.24 keyword, still accepted upstream
    from . import paged

    if isinstance(cache, paged.MLAPagedCache):  # whoever made it (this patch, or a class-level one)
        return paged.native_paged_attention_forward(self, hidden_states, attention_mask, cache,
                                                    position_embeddings, **kwargs)
    # no cache, or a cache of another kind: the dense path serves it
    opts = _options(self)
    hf = _native_module()
    batch, seq = hidden_states.shape[:-1]
    q_nope, q_pe = _query(self, hidden_states)
    freqs_cis = position_embeddings.to(hidden_states.device)  # complex64 [B, S, R/2]
    cos, sin = freqs_cis.real, freqs_cis.imag
    if opts.kv_prolog:
        k_nope, value_states, k_pe = _kv_prolog(self, hidden_states, cos, sin, "interleaved")
        if opts.rope:
            q_pe = torch.ops.mla.rope(q_pe, cos, sin)
        else:
            q_pe, _ = hf.apply_rotary_emb(q_pe, q_pe[:, :1], freqs_cis)  # stock rotation of q only
        key_states = _dense_key(k_nope, k_pe)
        if cache is not None:
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)
    else:
        # Stock KV path (latent cache + expand_kv), with only the RoPE routed through mla.rope.
        compressed_kv = self.kv_a_proj_with_mqa(hidden_states)
        kv_nope, k_pe = torch.split(compressed_kv, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_nope = self.kv_a_layernorm(kv_nope).view(batch, 1, seq, self.kv_lora_rank)
        k_pe = k_pe.view(batch, 1, seq, self.qk_rope_head_dim)
        q_pe, k_pe = torch.ops.mla.rope(q_pe, cos, sin), torch.ops.mla.rope(k_pe, cos, sin)
        if cache is not None:
            k_nope, k_pe = cache.update(k_nope, k_pe, self.layer_idx, kwargs=kwargs)
        key_states, value_states = self.expand_kv(k_nope, k_pe)
    query_states = torch.cat((q_nope, q_pe), dim=-1)
    return attend_and_project(self, query_states, key_states, value_states, attention_mask, **kwargs)


def attend_and_project(attn, query_states, key_states, value_states, attention_mask, **kwargs):
    """The stock forward's tail: the model's attention implementation (eager / sdpa / ...) over
    [B, N, S, *] states, then o_proj -> ([B, S, hidden], attention weights or None)."""
    hf = _native_module()
    batch, seq = query_states.shape[0], query_states.shape[2]
    attention_interface: Callable = hf.ALL_ATTENTION_FUNCTIONS.get_interface(
        attn.config._attn_implementation, hf.eager_attention_forward)
    attn_output, attn_weights = attention_interface(
        attn, query_states, key_states, value_states, attention_mask,
        dropout=0.0 if not attn.training else attn.attention_dropout, scaling=attn.scaling, **kwargs)
    return attn.o_proj(attn_output.reshape(batch, seq, -1).contiguous()), attn_weights


def _remote_rope_pairs(attn, hidden_states, position_ids, kv_seq_len):
    """cos/sin per rotation pair [B, S, R/2] from the remote code's own rotary embedding.

    Its tables are cat(freqs, freqs) over the full rope dim, indexed by position; the first half
    is one value per pair. They come in the activation dtype (the remote code casts them)."""
    cos, sin = attn.rotary_emb(hidden_states, seq_len=kv_seq_len)
    half = attn.qk_rope_head_dim // 2
    return cos[position_ids][..., :half], sin[position_ids][..., :half]


def _past_length(past_key_value, layer_idx, new_tokens) -> int:
    if past_key_value is None:
        return 0
    if hasattr(past_key_value, "get_usable_length"):  # transformers 4.x Cache API the remote code uses
        return past_key_value.get_usable_length(new_tokens, layer_idx)
    return past_key_value.get_seq_length(layer_idx)


def remote_attention_forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None,
                             output_attentions=False, use_cache=False, **kwargs):
    """Drop-in for the hub remote code's `DeepseekV2Attention.forward` (eager attention).

    KV path through `mla.kv_prolog(rope_layout="half")`: its k_pe is de-interleaved exactly like the
    remote code's `apply_rotary_pos_emb` leaves it, so the cached keys are the ones it would cache."""
    opts = _options(self)  # kv_prolog=True and cache="dense": apply() refuses the rest for remote code
    batch, seq, _ = hidden_states.shape
    q_nope, q_pe = _query(self, hidden_states)
    kv_seq_len = seq + _past_length(past_key_value, self.layer_idx, seq)
    if position_ids is None:
        position_ids = torch.arange(kv_seq_len - seq, kv_seq_len, device=hidden_states.device)[None].expand(batch, -1)
    cos, sin = _remote_rope_pairs(self, hidden_states, position_ids, kv_seq_len)
    k_nope, value_states, k_pe = _kv_prolog(self, hidden_states, cos, sin, "half")
    if opts.rope:
        q_pe = torch.ops.mla.rope(q_pe, cos, sin, layout="half")
    else:
        full_cos, full_sin = self.rotary_emb(hidden_states, seq_len=kv_seq_len)
        q_pe, _ = sys.modules[type(self).__module__].apply_rotary_pos_emb(
            q_pe, q_pe[:, :1], full_cos, full_sin, position_ids)
    query_states = torch.cat((q_nope, q_pe), dim=-1)
    key_states = _dense_key(k_nope, k_pe)
    if past_key_value is not None:
        key_states, value_states = past_key_value.update(key_states, value_states, self.layer_idx,
                                                         {"sin": sin, "cos": cos})
    attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * self.softmax_scale
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    attn_weights = torch.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
    attn_weights = torch.nn.functional.dropout(attn_weights, p=self.attention_dropout, training=self.training)
    attn_output = torch.matmul(attn_weights, value_states).transpose(1, 2).reshape(batch, seq, -1)
    attn_output = self.o_proj(attn_output)
    return attn_output, (attn_weights if output_attentions else None), past_key_value


def rms_norm_forward(self, hidden_states):
    """Drop-in for `DeepseekV2RMSNorm.forward` (native and remote code compute the same thing)."""
    return torch.ops.mla.rms_norm(hidden_states, self.weight, self.variance_epsilon)


# ---------------------------------------------------------------------------------- patch handle
class PatchHandle:
    """Undoes what one `apply()` did; also a context manager. Reverting twice is harmless.

    One handle is active per scope (the classes, or one model): applying again to the same scope
    first reverts the previous handle, so the newest options win and nothing stacks. Models are
    held by weak reference: a handle does not keep a deleted model alive."""

    def __init__(self, options: PatchOptions, scope):
        self.options = options
        self._scope = scope  # "classes", or a weakref to the patched model
        self._records: list[tuple[object, str, object, bool]] = []  # (obj or weakref, name, previous, in_dict)
        self._on_revert: list[Callable[[], None]] = []
        self.patched_modules = 0

    @property
    def target(self) -> str:
        if self._scope == "classes":
            return "classes"
        model = self._scope()
        return type(model).__name__ if model is not None else "<deleted model>"

    @property
    def active(self) -> bool:
        return self in _ACTIVE

    def _same_scope(self, scope) -> bool:
        return self._scope == scope if isinstance(scope, str) else (
            not isinstance(self._scope, str) and self._scope() is scope())

    def set(self, obj, name: str, value, *, in_dict: bool = False) -> None:
        """obj.name = value (a class attribute, or an instance __dict__ entry), remembering the old value."""
        self._records.append((obj if isinstance(obj, type) else weakref.ref(obj), name,
                              obj.__dict__.get(name, _MISSING), in_dict))
        if in_dict:
            obj.__dict__[name] = value
        else:
            setattr(obj, name, value)

    def on_revert(self, callback: Callable[[], None]) -> None:
        """Run callback after the attributes are restored (frees state the patched code made later)."""
        self._on_revert.append(callback)

    def stock_value(self, obj, name: str):
        """The value obj.name had before this handle changed it: _MISSING if obj had no own value,
        _NOT_RECORDED if this handle did not change it."""
        for ref, rec_name, previous, _ in self._records:
            if rec_name == name and (ref is obj if isinstance(ref, type) else ref() is obj):
                return previous
        return _NOT_RECORDED

    def revert(self) -> None:
        while self._records:
            ref, name, previous, in_dict = self._records.pop()
            obj = ref if isinstance(ref, type) else ref()
            if obj is None:
                continue  # the model is gone
            if previous is not _MISSING:
                if in_dict:
                    obj.__dict__[name] = previous
                else:
                    setattr(obj, name, previous)
            elif in_dict:
                obj.__dict__.pop(name, None)
            elif name in obj.__dict__:
                delattr(obj, name)
        while self._on_revert:
            self._on_revert.pop()()
        if self in _ACTIVE:
            _ACTIVE.remove(self)

    def __enter__(self) -> "PatchHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.revert()

    def __repr__(self) -> str:
        state = "active" if self.active else "reverted"
        return f"PatchHandle({self.target}, {self.options}, {self.patched_modules} modules, {state})"


_ACTIVE: list[PatchHandle] = []
_MISSING = object()
_NOT_RECORDED = object()


def stock_attr(obj, name: str):
    """obj.name as it was before mla_ops patched it (the current value if it is not patched)."""
    for handle in _ACTIVE:
        previous = handle.stock_value(obj, name)
        if previous is _NOT_RECORDED:
            continue
        if previous is not _MISSING:
            return previous
        if isinstance(obj, type):  # the stock value was inherited: look past obj's own (patched) entry
            for base in obj.__mro__[1:]:
                if name in base.__dict__:
                    return base.__dict__[name]
            raise AttributeError(name)
        return getattr(type(obj), name)
    return getattr(obj, name)


def apply(model: Optional[torch.nn.Module] = None, *, kv_prolog: bool = True, rms_norm: bool = False,
          rope: bool = False, cache: str = "dense") -> PatchHandle:
    """Patch DeepSeek-V2 attention (and optionally RMSNorm / RoPE) onto `torch.ops.mla`.

    Args:
        model: a loaded model: patch this instance's modules only (native or hub remote code).
            None: patch transformers' native classes, so models built afterwards use the ops.
        kv_prolog: KV path through `mla.kv_prolog` (dense cache) — see the module docstring.
        rms_norm: every DeepseekV2RMSNorm through `mla.rms_norm`.
        rope: q_pe (and k_pe without kv_prolog) through `mla.rope`.
        cache: "dense" or "paged" (latent paged cache + absorbed decode; native attention only).
    Returns:
        A PatchHandle: `handle.revert()` (or leaving a `with` block) restores the stock forwards.
        Applying again to the same model (or to the classes) first reverts the previous patch there:
        the newest options win.
    """
    if cache not in CACHE_MODES:
        raise ValueError(f"cache must be one of {CACHE_MODES}, got {cache!r}")
    if cache == "paged" and not kv_prolog:
        raise ValueError("cache='paged' needs kv_prolog=True (the latent prolog feeds the paged cache)")
    check_transformers_version()
    options = PatchOptions(kv_prolog=kv_prolog, rms_norm=rms_norm, rope=rope, cache=cache)
    # Everything that can refuse this model is checked before the previous patch is touched.
    targets = None if model is None else _instance_targets(model, options)
    scope = "classes" if model is None else weakref.ref(model)
    _forget_deleted_models()
    for previous in [h for h in _ACTIVE if h._same_scope(scope)]:
        previous.revert()
    handle = PatchHandle(options, scope)
    _ACTIVE.append(handle)
    try:
        _patch(handle, model, targets, options)
    except BaseException:
        handle.revert()
        raise
    return handle


def _instance_targets(model: torch.nn.Module, options: PatchOptions) -> list:
    """(module, forward) pairs to patch in `model`; raises, touching nothing, if it cannot be patched."""
    patch_attention = options.kv_prolog or options.rope
    targets, found_attention, decoder_found = [], False, False
    native_model_class = _native_module().DeepseekV2Model
    for module in model.modules():
        decoder_found |= isinstance(module, native_model_class)
        if patch_attention and is_native_attention(module):
            targets.append((module, native_attention_forward))
            found_attention = True
        elif patch_attention and is_remote_attention(module):
            if options.cache == "paged":
                raise NotImplementedError("cache='paged' supports transformers' native DeepseekV2Attention only; "
                                          "this model uses the hub remote code")
            if not options.kv_prolog:
                raise ValueError("the hub remote-code attention is routed through mla.kv_prolog: use "
                                 "kv_prolog=True (rope=True and rms_norm=True can be added)")
            targets.append((module, remote_attention_forward))
            found_attention = True
        elif patch_attention and type(module).__name__ == _REMOTE_FLASH_ATTENTION:
            raise NotImplementedError("the hub remote code's DeepseekV2FlashAttention2 takes flash-attention "
                                      "masks this patch does not build: load the model with "
                                      "attn_implementation='eager', or use transformers' native DeepSeek-V2")
        elif options.rms_norm and _is_rms_norm(module):
            targets.append((module, rms_norm_forward))
    if patch_attention and not found_attention:
        raise ValueError(f"no DeepSeek-V2 attention module found in {type(model).__name__}: expected "
                         f"transformers' DeepseekV2Attention or the hub remote code's (modeling_deepseek.py)")
    if options.cache == "paged" and not decoder_found:
        raise ValueError(f"cache='paged' needs a transformers DeepseekV2Model inside {type(model).__name__}")
    return targets


def _patch(handle: PatchHandle, model, targets, options: PatchOptions) -> None:
    hf = _native_module()
    if model is None:
        if options.kv_prolog or options.rope:
            handle.set(hf.DeepseekV2Attention, "_mla_ops_options", options)
            handle.set(hf.DeepseekV2Attention, "forward", native_attention_forward)
            handle.patched_modules += 1
        if options.rms_norm:
            handle.set(hf.DeepseekV2RMSNorm, "forward", rms_norm_forward)
            handle.patched_modules += 1
    else:
        for module, forward in targets:
            if forward is not rms_norm_forward:
                handle.set(module, "_mla_ops_options", options, in_dict=True)
            handle.set(module, "forward", types.MethodType(forward, module), in_dict=True)
            handle.patched_modules += 1
    if options.cache == "paged":
        from . import paged

        paged.install_cache_factory(hf.DeepseekV2Model if model is None else model, handle)


def revert() -> None:
    """Undo every patch applied through `apply()` that is still active (newest first)."""
    for handle in reversed(list(_ACTIVE)):
        handle.revert()


def _forget_deleted_models() -> None:
    """Drop the handles of models that no longer exist (their patches died with them)."""
    _ACTIVE[:] = [h for h in _ACTIVE if isinstance(h._scope, str) or h._scope() is not None]


def active_patches() -> list[PatchHandle]:
    """The handles still in effect, oldest first (one per scope: the classes, or a live model)."""
    _forget_deleted_models()
    return list(_ACTIVE)


__all__ = ["apply", "revert", "active_patches", "PatchHandle", "PatchOptions", "SUPPORTED_TRANSFORMERS",
           "native_attention_forward", "remote_attention_forward", "rms_norm_forward"]
