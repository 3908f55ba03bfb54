"""Which transformers attention classes are DeepSeek-style multi-head latent attention (MLA), and how
each family differs from the others: read off the class, never looked up in a list of names.

transformers carries one MLA forward per model family (DeepSeek-V2/V3, GLM-4.7-Flash, Kimi-Linear,
LongCat-Flash, MiniCPM3, Mistral-4, ...), mostly generated from DeepSeek-V3's. A class is an MLA
attention the patch can serve when

* its `__init__` builds the MLA modules (`kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`,
  `o_proj`; the query through `q_proj` or `q_a_proj` / `q_a_layernorm` / `q_b_proj`), and
* every global and attribute name its `forward` uses (`forward.__code__.co_names`) is one the patch
  reproduces: the DeepSeek-V3 forward's own vocabulary plus the per-family features below.

A forward that uses any other name does something the patch does not reproduce, and is refused
with those names in the reason (a sparse-attention `indexer` gets its own reason). The features,
each marked by one name the forward uses:

* `apply_rotary_emb`: complex-pair RoPE (DeepSeek-V2) -> rope_layout "interleaved";
* `apply_rotary_pos_emb_interleave`: interleaved pairs written de-interleaved (DeepSeek-V3 with
  rope_interleave=True) -> "half";
* `apply_rotary_pos_emb`: rotate_half pairs (x[i], x[i+D/2]) -> "neox";
* both of the last two and `rope_interleave`: the config chooses, per model;
* a function's layout is what it computes, not its name: each is run on a small random input and matched
  against the layouts of mla.rope, its name's first (`rope_function_layout`: HY-V4-VL's
  `apply_rotary_pos_emb` rotates interleaved pairs in place, "interleaved" on (cos, sin) tables);
* no RoPE function: NoPE (Kimi-Linear), the rope dims pass through (identity tables);
* `mla_scale_q_lora` / `mla_scale_kv_lora`: LongCat's scales on q and the latent, applied where stock does;
* `q_lora_scale` / `kv_lora_scale`: dots3_note's scales on the normed q-LoRA latent (the indexer's input too)
  and the normed KV latent;
* `k_rope_only_layernorm`: dots3_note's RMSNorm on k_pe before RoPE: the KV path is then kv_a_proj_with_mqa,
  mla.rms_norm on the latent and on k_pe, mla.rope on k_pe (mla.latent_kv_prolog has no norm on k_pe);
* `sinks`: a learned per-head attention sink (HY-V4): the stock attention function takes it from the module in
  the dense mode and a paged prefill; a paged decode passes it to mla.mla_decode_attention /
  mla.sparse_mla_attention (`sinks=`);
* `sliding_window`: sliding-window layers (dots3_note): the model's own windowed mask in the dense mode and a
  fresh paged prefill; a paged decode attends to the last `sliding_window` cached tokens through
  mla.mla_decode_attention's `sliding_window`, a paged prefill on a cached prefix windows its own mask;
* an output gate (`OutputGate`), a per-head sigmoid gate on the attention output before o_proj, marked by
  its projection: `g_proj` (Bailing, dots3_note: a projection of the layer input, one gate per head),
  `gate_proj` (HY-V4: one per head and value channel) or `q_gate_proj` (AXK2: the trailing v_head_dim of
  each head of one projection that also gives the query, over cat(q_a_layernorm(q_a), q_a)); where the
  stock forward rounds it is read off its code (`output_gate_rounding`);
* `get_llama_4_attn_scale`: Mistral-4's position-dependent query scale;
* `softmax_scaling`: Mistral-Large-4's per-head log-position query scale, scale_h * log(pos + 1) + bias_h (the
  layer's own module, applied after RoPE as stock applies it); a paged decode step hands either scale to the
  decode / sparse attention op as its `q_scale` instead of scaling q;
* `use_rope`: RoPE in some layers only; a NoPE layer (Mistral-Large-4) has no rotary dims at all;
* `is_kv_shared_layer`: a latent KV cache shared across layers (Mistral-Large-4's `kv_source_layers`): a layer
  attends to an earlier layer's cached latent and k_pe through its own kv_b_proj, handed on in the forward's
  `shared_kv_states`; the dense mode then caches the latent as stock does;
* `expand_kv`: the stock cache holds the latent (transformers >= 5.15; matters for rope=True with
  kv_prolog=False, which keeps the stock KV path);
* `pad`: DeepSeek-V2 of 4.54 - 5.23 pads V to the qk head dim for flash attention; padded the same way;
* `indexer`: DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): an indexer module scores the cached
  keys and each query attends to its top-k only (`MlaFamily.indexer`, see `describe_indexer`); with a
  `prev_topk_indices` parameter, layers of `config.indexer_types` "shared" reuse the previous layer's
  top-k (`MlaFamily.shared_topk`). Mistral-Large-4's indexer, which has no q-LoRA latent to read, takes its
  query from the layer input: wq_b(q_input_norm(x)), scaled by its own log-position scale, rotated only in RoPE
  layers (`MlaFamily.indexer_input_query`);
* `build_attention_mask_from_topk`: the attention mask is the top-k alone (GLM-5-Next: the model hands the layer
  a [B, S] padding mask and the indexer's top-k holds causality and padding), built by the layer's own method;
  its `next_skip_topk` says whether the top-k is handed on (`MlaFamily.topk_mask`).

An indexer is served when its class's forward is DeepSeek-V3.2's: q = wq_b(q_resid), k = k_norm(wk(x)),
the RoPE function it names on their first qk_rope_head_dim dims (or their last: HY-V4, read off the order of
its split, `MlaFamily.indexer_rope_trailing`), the key through
`cache.update_indexer`, scores sum_h w_h * relu(softmax_scale * q_h.k) with w = weights_proj(x) *
n_heads**-0.5, masked by the attention mask, top-k: what `mla.lightning_indexer` computes. One that uses
any other name (pooled keys, a query norm, shared KV, ...) is refused with those names.

Model types are found by the classes their models build (`installed_mla_model_types`): their own modeling
module's, or another family's (`borrowed_model_types`: a configuration whose auto-mapped model is DeepSeek-V3's,
a multimodal wrapper whose language model is).

Each RoPE function is also run on a small random input: in fp32 to check it rotates the way its
layout says, and in bf16 and fp16 to find where it rounds, i.e. which mla `rope_compute_dtype`
reproduces it bit for bit (`MlaFamily.rope_rounding`): DeepSeek-V2's complex multiplication is fp32
("float32"); DeepSeek-V3's functions, and so every family generated from its forward, compute
x*cos + rotate_half(x)*sin in the model's dtype ("activation").
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import pathlib
import sys
from typing import Optional

import torch

from ..._checks import ROPE_COMPUTE_DTYPES
from ...ops.rope import rope_math

# Names every MLA forward of transformers >= 4.54 may use for what the patch reproduces: the q/kv
# projections, split, cache update, attention interface, o_proj (DeepSeek-V3's forward, plus the
# spellings of older DeepSeek-V2 releases).
BASE_FORWARD_NAMES = frozenset({
    "ALL_ATTENTION_FUNCTIONS", "_attn_implementation", "attention_dropout", "cat", "config", "contiguous",
    "eager_attention_forward", "get_interface", "kv_a_layernorm", "kv_a_proj_with_mqa", "kv_b_proj",
    "kv_lora_rank", "layer_idx", "o_proj", "q_a_layernorm", "q_a_proj", "q_b_proj", "q_lora_rank", "q_proj",
    "qk_head_dim", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "reshape", "scaling", "shape", "split",
    "torch", "training", "transpose", "update", "view", "expand", "device", "to",
    "warnings", "warn",  # DeepSeek-V2 before 5.x: a deprecation warning for `padding_mask`
})
ROPE_FUNCTIONS = {  # the stock function -> the layout mla.rope / mla.kv_prolog reproduce it with
    "apply_rotary_emb": "interleaved",
    "apply_rotary_pos_emb_interleave": "half",
    "apply_rotary_pos_emb": "neox",
}
# The RoPE functions taking DeepSeek-V2's complex freqs_cis [B, S, R/2] (the others take (cos, sin) [B, S, R]).
COMPLEX_ROPE_FUNCTIONS = frozenset({"apply_rotary_emb"})
FEATURES = {  # feature -> (the name that marks it, every name its code uses)
    "config_rope_interleave": ("rope_interleave", {"rope_interleave"}),
    "lora_scales": ("mla_scale_q_lora", {"mla_scale_q_lora", "mla_scale_kv_lora"}),
    "query_position_scale": ("get_llama_4_attn_scale", {"get_llama_4_attn_scale", "rope_parameters", "get", "dtype"}),
    "latent_stock_cache": ("expand_kv", {"expand_kv"}),
    "query_log_position_scale": ("softmax_scaling", {"softmax_scaling"}),
    "latent_scales": ("q_lora_scale", {"q_lora_scale", "kv_lora_scale"}),
    "key_rope_norm": ("k_rope_only_layernorm", {"k_rope_only_layernorm"}),
    "sliding_window": ("sliding_window", {"sliding_window"}),
    "attention_sinks": ("sinks", {"sinks"}),
    "topk_mask": ("build_attention_mask_from_topk", {"build_attention_mask_from_topk", "next_skip_topk"}),
    "layer_rope": ("use_rope", {"use_rope"}),
    "shared_latent_kv": ("is_kv_shared_layer", {"is_kv_shared_layer", "store_full_length_kv"}),
    # DeepSeek-V2 of 4.54 - 5.x pads V to the qk head dim for flash-attention kernels itself
    "flash_value_padding": ("pad", {"pad", "F", "is_flash_attention_requested"}),
}
# What a DeepSeek Sparse Attention forward adds: the indexer call and the top-k folded into the mask
# (`new_ones(...).scatter(-1, topk.long(), False)`, then `&` or `masked_fill(finfo(dtype).min)`);
# "ValueError" is the shared layers' guard against a missing previous top-k.
SPARSE_FORWARD_NAMES = frozenset({"indexer", "new_ones", "scatter", "long", "unsqueeze", "masked_fill", "finfo",
                                  "min", "bool", "dtype"})
SHARED_TOPK_PARAMETER = "prev_topk_indices"
# Every name DeepSeek-V3.2's indexer forward uses (its projections, RoPE split, cache update, scoring,
# mask, top-k), less the RoPE function, read separately.
INDEXER_NAMES = frozenset({
    "F", "bool", "cat", "dtype", "float", "head_dim", "index_topk", "indices", "int32", "k_norm", "layer_idx",
    "masked_fill", "matmul", "min", "n_heads", "qk_rope_head_dim", "relu", "shape", "softmax_scale", "split",
    "squeeze", "to", "topk", "torch", "transpose", "unsqueeze", "update_indexer", "view", "weight", "weights_proj",
    "wk", "wq_b",
})
# An output gate's projection (the name marking it) -> every name its code uses beside it.
OUTPUT_GATES = {"g_proj": {"g_proj"}, "gate_proj": {"gate_proj", "gate_projection_size"},
                "q_gate_proj": {"q_gate_proj"}}
OUTPUT_GATE_NAMES = frozenset({"sigmoid", "float", "dtype", "unsqueeze", "to"})
GATE_ROUNDINGS = ("activation", "gate_float32", "product_float32")
# What some names beyond the vocabulary stand for, so a refusal says what is not computed (transformers 5.24).
UNREPRODUCED = {
    "is_kv_shared_layer": "a latent KV cache shared across layers",
    "softmax_scaling": "a per-head log-position query scale",
    "use_rope": "RoPE in some layers only",
    "q_input_norm": "an indexer query from the normed layer input",
}
# What a pooled ("KeyPool") indexer adds (GLM-5-Next: keys pooled over index_kpool tokens by a learned gate, the best
# pools expanded back into their tokens, the open pool's tokens appended): its own forward selects in both modes.
POOLED_INDEXER_NAMES = frozenset({
    "append_visible_tail", "arange", "clamp", "device", "expand", "expand_as", "finfo", "flatten", "gather",
    "get_pooled_states", "get_seq_length", "get_visible_tokens", "index_kpool", "index_kpool_always_select_tail",
    "index_kpool_compress_gate", "keys", "layers", "linear", "pad",
})
# What an indexer taking its query from the layer input adds (Mistral-Large-4: no q-LoRA latent to read).
INDEXER_INPUT_QUERY_NAMES = frozenset({"q_input_norm", "softmax_scaling", "use_rope"})
MLA_MODULES = ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")
# The RMSNorm forward the ops reproduce (fp32 variance, weight * normed.to(input dtype)).
RMS_NORM_NAMES = frozenset({"dtype", "to", "torch", "float32", "pow", "mean", "rsqrt", "variance_epsilon", "weight"})


@dataclasses.dataclass(frozen=True)
class OutputGate:
    """A per-head sigmoid gate on the attention output before o_proj, o * sigmoid(g), as one family computes it.

    `module`: the projection g comes from: one of the layer input (`g_proj`, `gate_proj`), or `q_gate_proj`, a
    projection of cat(q_a_layernorm(q_a), q_a) giving each head's query and then its gate (`from_query`). The
    gate's shape is read off the projection when it runs: one gate per head (g [B, S, N]) or one per head and
    value channel (g [B, S, N*V]). `rounding`, read off the stock forward's code (`output_gate_rounding`):
    "activation" (sigmoid and product in the model's dtype), "gate_float32" (the sigmoid of g in fp32, rounded
    to the model's dtype, then the product), "product_float32" (sigmoid and product in fp32, rounded once)."""

    module: str
    rounding: str

    @property
    def from_query(self) -> bool:
        """The gate is part of the query projection (the query path computes it)."""
        return self.module == "q_gate_proj"


@dataclasses.dataclass(frozen=True)
class MlaFamily:
    """What the patch needs to know about one transformers MLA attention class.

    `rope`: "interleaved" | "half" | "neox" (fixed by the forward), "config" (`config.rope_interleave`
    chooses "half" or "neox"), or "none" (NoPE). `rope_functions`: (name, layout) of each RoPE function the
    forward calls, the layout read by running it (`rope_function_layout`). `rope_rounding`: (layout,
    compute_dtype) for each of them: the mla `rope_compute_dtype` that reproduces its rounding bit for bit in
    bf16 and fp16 ("float32" | "activation"), None where neither does. `parameters`: the stock forward's
    parameter names after `self`, in order (positional calls are mapped onto them). `output_gate`: the
    family's sigmoid output gate (None: none). `attention_sinks`: a learned per-head sink logit (`sinks`) in
    every softmax denominator. `indexer`: the sparse-attention indexer's RoPE function (the name in the
    modeling module; None: dense attention); `indexer_rope_trailing`: it rotates the trailing
    qk_rope_head_dim dims of the indexer's q and k (HY-V4), not the leading ones; `indexer_pooled`: it scores keys
    pooled over blocks of tokens (GLM-5-Next's KeyPool; its RoPE function, if any, in `indexer`), served by its own
    forward in both modes. `topk_mask`: the attention mask is the top-k alone. `shared_topk`: the forward
    takes `prev_topk_indices` and returns its top-k third (GLM-5's cross-layer sharing). `refused`: why it
    cannot be patched (None when it can). `shared_kv`: DeepSeek-V4's shared-KV attention (one K=V row per
    token, compressors, sinks; served by `shared_kv`, whose `describe_shared_kv` reads such a class)."""

    attention: type
    model_type: str
    rope: str
    parameters: tuple[str, ...]
    rope_rounding: tuple[tuple[str, Optional[str]], ...] = ()
    lora_scales: bool = False
    rope_functions: tuple[tuple[str, str], ...] = ()
    output_gate: Optional[OutputGate] = None
    query_position_scale: bool = False
    latent_stock_cache: bool = False
    flash_value_padding: bool = False
    query_log_position_scale: bool = False
    layer_rope: bool = False
    shared_latent_kv: bool = False
    latent_scales: bool = False
    key_rope_norm: bool = False
    sliding_window: bool = False
    attention_sinks: bool = False
    topk_mask: bool = False
    indexer: Optional[str] = None
    indexer_rope_trailing: bool = False
    indexer_pooled: bool = False
    indexer_input_query: bool = False
    shared_topk: bool = False
    refused: Optional[str] = None
    shared_kv: bool = False

    @property
    def fused_kv_prolog(self) -> bool:
        """Whether mla.kv_prolog computes this family's whole KV path (kv_a -> norm -> kv_b -> RoPE); else the dense
        mode runs `latent_prolog`, the family's latent steps and kv_b (LongCat-Flash's and dots3_note's latent scales,
        dots3_note's norm on k_pe)."""
        return not (self.lora_scales or self.latent_scales or self.key_rope_norm)

    @property
    def sparse(self) -> bool:
        """DeepSeek Sparse Attention: each query attends to the top-k keys its layer's indexer picks."""
        return self.indexer is not None or self.indexer_pooled

    def indexer_layout(self) -> Optional[str]:
        """The rope layout the indexer's RoPE function computes (None: dense attention)."""
        return None if self.indexer is None else rope_function_layout(self.modeling, self.indexer)

    def stock_rope_function(self, layout: str) -> str:
        """The name of the family's RoPE function computing `layout`."""
        return next(name for name, function_layout in self.rope_functions if function_layout == layout)

    @property
    def name(self) -> str:
        return f"{self.model_type} ({self.attention.__name__})"

    @property
    def modeling(self):
        """The attention class's modeling module (its RoPE functions, attention registry)."""
        return sys.modules[self.attention.__module__]

    def rope_layout(self, config) -> Optional[str]:
        """The mla rope layout reproducing this model's RoPE (None: NoPE)."""
        if self.rope == "config":
            return "half" if getattr(config, "rope_interleave", True) else "neox"
        return None if self.rope == "none" else self.rope

    def stock_rope_compute_dtype(self, config) -> str:
        """The mla rope_compute_dtype that rotates as this model's stock forward does. "float32" for NoPE
        (nothing is rotated) and for a RoPE function no op rounding reproduces (the nearer one to
        exact: the patch then matches stock in fp32 only)."""
        layout = self.rope_layout(config)
        return dict(self.rope_rounding).get(layout) or "float32"

    def model_classes(self) -> tuple[Optional[type], tuple[type, ...]]:
        """(the decoder stack class of this family's modeling module (its `__init__` builds `embed_tokens` and
        `layers`), the classes that generate (GenerationMixin: a causal LM, a multimodal wrapper)), for a
        class-level paged patch (an instance patch finds the decoder in the model itself)."""
        from transformers import GenerationMixin, PreTrainedModel

        classes = [obj for obj in vars(self.modeling).values() if isinstance(obj, type)
                   and obj.__module__ == self.modeling.__name__ and issubclass(obj, PreTrainedModel)]
        decoder = next((c for c in classes if {"embed_tokens", "layers"} <= set(_init_names(c))), None)
        return decoder, tuple(c for c in classes if issubclass(c, GenerationMixin))


def _init_names(cls: type) -> tuple:
    code = getattr(cls.__dict__.get("__init__"), "__code__", None)
    return code.co_names if code is not None else ()


def forward_names(cls: type) -> frozenset:
    """Every global and attribute name `cls.forward` uses (its code's co_names; none for a forward without Python
    code)."""
    code = getattr(inspect.unwrap(getattr(cls, "forward", None)), "__code__", None)
    return frozenset(code.co_names) if code is not None else frozenset()


@functools.lru_cache(maxsize=None)
def forward_parameters(cls: type) -> tuple[str, ...]:
    """The names of `cls.forward`'s positional parameters after `self`, in order."""
    parameters = list(inspect.signature(inspect.unwrap(cls.forward)).parameters.values())[1:]
    return tuple(p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def builds_mla_modules(cls: type) -> bool:
    """Whether `cls.__init__` creates the MLA projections (read from its code, nothing is built)."""
    init = getattr(cls, "__init__", None)
    code = getattr(init, "__code__", None)
    if code is None:
        return False
    names = set(code.co_names)
    return all(m in names for m in MLA_MODULES)


@functools.lru_cache(maxsize=None)
def describe(cls: type) -> MlaFamily:
    """Read `cls` (an attention class that `builds_mla_modules`, or DeepSeek-V4's shared-KV attention) into
    an MlaFamily."""
    from . import shared_kv

    if shared_kv.builds_shared_kv_modules(cls):
        return shared_kv.describe_shared_kv(cls)
    names = forward_names(cls)
    module = cls.__module__
    model_type = module.split(".")[2] if module.startswith("transformers.models.") else module
    parameters = forward_parameters(cls)
    rope_functions = sorted(names & ROPE_FUNCTIONS.keys())
    layouts = {name: rope_function_layout(sys.modules[module], name) for name in rope_functions}
    features = {feature: marker in names for feature, (marker, _) in FEATURES.items()}
    known = set(BASE_FORWARD_NAMES) | set(ROPE_FUNCTIONS)
    for feature, (_, used) in FEATURES.items():
        if features[feature]:
            known |= used
    gates = sorted(names & OUTPUT_GATES.keys())
    output_gate = refused = None
    if gates:
        known |= OUTPUT_GATE_NAMES | set().union(*(OUTPUT_GATES[g] for g in gates))
        rounding = output_gate_rounding(cls)
        if len(gates) > 1 or rounding is None:
            refused = (f"its output gate ({', '.join(gates)}) is not one sigmoid gate rounded as "
                       f"{', '.join(GATE_ROUNDINGS)} (see families.OutputGate)")
        else:
            output_gate = OutputGate(gates[0], rounding)
    sparse = "indexer" in names
    shared_topk = sparse and SHARED_TOPK_PARAMETER in parameters
    if sparse:
        known |= SPARSE_FORWARD_NAMES | ({"ValueError"} if shared_topk else set())
    unknown = sorted(names - known)
    indexer = None
    if unknown:
        used = f"its forward uses {explain_names(unknown)}, which the patch does not reproduce"
        refused = f"{refused}; {used}" if refused else used
    indexer_input_query = indexer_rope_trailing = indexer_pooled = False
    if sparse:
        indexer, indexer_refusal, indexer_input_query, indexer_rope_trailing, indexer_pooled = describe_indexer(cls)
        reasons = [r for r in (refused, indexer_refusal) if r]
        refused = f"sparse attention: {'; '.join(reasons)}" if reasons else None
        indexer = None if refused else indexer  # (`sparse`: served through the indexer op)
        indexer_pooled = indexer_pooled and not refused
    unread = [name for name, layout in layouts.items() if layout is None]
    if unread and refused is None:
        refused = (f"its {', '.join(unread)} computes none of the rotations mla.rope reproduces "
                   f"({', '.join(sorted(set(ROPE_FUNCTIONS.values())))})")
    if features["config_rope_interleave"] and set(rope_functions) == {"apply_rotary_pos_emb",
                                                                       "apply_rotary_pos_emb_interleave"}:
        rope = "config"
    elif len(rope_functions) == 1:
        rope = layouts[rope_functions[0]] or ROPE_FUNCTIONS[rope_functions[0]]
    elif not rope_functions:
        rope = "none"
    else:
        rope, refused = "config", refused or f"its forward chooses between {rope_functions} by a rule the patch " \
                                             f"does not know"
    if refused is None and indexer and rope_function_layout(sys.modules[module], indexer) is None:
        refused = f"sparse attention: its indexer's {indexer} computes none of the rotations mla.rope reproduces"
    rounding = () if refused else tuple((layouts[name], stock_rope_rounding(sys.modules[module], name))
                                        for name in rope_functions)
    return MlaFamily(attention=cls, model_type=model_type, rope=rope, parameters=parameters, rope_rounding=rounding,
                     rope_functions=() if refused else tuple(layouts.items()),
                     lora_scales=features["lora_scales"], output_gate=output_gate,
                     query_position_scale=features["query_position_scale"],
                     latent_stock_cache=features["latent_stock_cache"],
                     flash_value_padding=features["flash_value_padding"],
                     query_log_position_scale=features["query_log_position_scale"], layer_rope=features["layer_rope"],
                     shared_latent_kv=features["shared_latent_kv"], latent_scales=features["latent_scales"],
                     key_rope_norm=features["key_rope_norm"], sliding_window=features["sliding_window"],
                     attention_sinks=features["attention_sinks"], topk_mask=features["topk_mask"], indexer=indexer,
                     indexer_rope_trailing=indexer_rope_trailing, indexer_pooled=indexer_pooled,
                     indexer_input_query=indexer_input_query, shared_topk=shared_topk, refused=refused)


def explain_names(names) -> str:
    """The names a forward uses beyond what the patch reproduces, each with what it stands for where known."""
    return ", ".join(f"{name} ({UNREPRODUCED[name]})" if name in UNREPRODUCED else name for name in names)


def output_gate_rounding(cls: type) -> Optional[str]:
    """Where `cls.forward` rounds its sigmoid output gate (one of GATE_ROUNDINGS; None: not one sigmoid),
    read off its bytecode: the expression from the `sigmoid` to the store of its result. No `float` there:
    sigmoid and product in the model's dtype ("activation"); `float`, then `.to` before any product: the fp32
    sigmoid rounded, then multiplied ("gate_float32"); `float`, a product, then `.to`: "product_float32"."""
    import dis

    instructions = list(dis.get_instructions(inspect.unwrap(cls.forward)))
    starts = [i for i, instruction in enumerate(instructions) if instruction.argval == "sigmoid"]
    if len(starts) != 1:
        return None
    expression = []
    for instruction in instructions[starts[0]:]:
        if instruction.opname.startswith("STORE"):
            break
        multiply = instruction.opname == "BINARY_MULTIPLY" or (instruction.opname == "BINARY_OP"
                                                                and instruction.argrepr == "*")
        expression.append("*" if multiply else instruction.argval)
    if "float" not in expression:
        return "activation"
    if "to" not in expression:
        return None
    before_round = expression[:expression.index("to")]
    return "product_float32" if "*" in before_round else "gate_float32"


def indexer_classes(cls: type) -> list:
    """The sparse-attention indexer classes an attention class builds: the module classes its `__init__`
    names whose forward writes an indexer-key cache (`update_indexer`)."""
    modeling = sys.modules[cls.__module__]
    init = inspect.unwrap(cls.__init__)
    found = [getattr(modeling, name, None) for name in init.__code__.co_names]
    return [c for c in found if isinstance(c, type) and issubclass(c, torch.nn.Module) and "forward" in vars(c)
            and "update_indexer" in forward_names(c)]


def describe_indexer(cls: type) -> tuple[Optional[str], Optional[str], bool, bool, bool]:
    """(the indexer's RoPE function name, None, whether its query comes from the layer input, whether it rotates
    the trailing qk_rope_head_dim dims of q and k, whether it pools its keys) for a DeepSeek-V3.2 indexer the
    patch reproduces (or a pooled one, GLM-5-Next's: served by its own forward, its RoPE
    function None where it has none), else (None, why not, False, False, False): read off the indexer class's
    forward, as the attention's is."""
    classes = indexer_classes(cls)
    if len(classes) != 1:
        return None, (f"its indexer is not one module class writing cache.update_indexer "
                      f"(found {[c.__name__ for c in classes]})"), False, False, False
    indexer_cls = classes[0]
    names = forward_names(indexer_cls)
    rope = sorted(names & ROPE_FUNCTIONS.keys())
    input_query = "q_input_norm" in names
    pooled = "get_pooled_states" in names
    unknown = sorted(names - INDEXER_NAMES - set(rope) - (INDEXER_INPUT_QUERY_NAMES if input_query else set())
                     - (POOLED_INDEXER_NAMES if pooled else set()))
    if unknown:
        return None, (f"its indexer ({indexer_cls.__name__}) uses {explain_names(unknown)}, beyond "
                      f"DeepSeek-V3.2's score sum_h w_h * relu(scale * q_h.k) over every cached key that "
                      f"mla.lightning_indexer computes"), False, False, False
    if pooled and not rope:  # (NoPE: GLM-5-Next's attention and indexer rotate nothing)
        return None, None, input_query, False, True
    if len(rope) != 1 or rope[0] in COMPLEX_ROPE_FUNCTIONS:
        return None, (f"its indexer ({indexer_cls.__name__}) rotates with {rope or 'no RoPE'}, "
                      f"not one (cos, sin) RoPE function"), False, False, False
    return rope[0], None, input_query, rotates_trailing_dims(indexer_cls), pooled


def rotates_trailing_dims(indexer_cls: type) -> bool:
    """Whether the indexer's forward splits q and k as [head_dim - qk_rope_head_dim, qk_rope_head_dim] (the rotated
    part last: HY-V4) rather than [qk_rope_head_dim, ...] (first: DeepSeek-V3.2), read off its bytecode: the first
    attribute its first `split` size list loads. `indexer_refusal` then checks the whole forward on an input."""
    import dis

    instructions = list(dis.get_instructions(inspect.unwrap(indexer_cls.forward)))
    for i, instruction in enumerate(instructions):
        if instruction.argval == "split":
            sizes = [x.argval for x in instructions[i + 1:] if x.opname == "LOAD_ATTR"]
            return bool(sizes) and sizes[0] == "head_dim"
    return False


def _rope_probe(dtype: torch.dtype):
    """A small random q_pe-like input x [B, N, S, R] and per-pair tables cos/sin [B, S, R/2], in `dtype`
    (rotary embeddings hand the tables to the attention in the model's dtype)."""
    generator = torch.Generator().manual_seed(0)
    batch, heads, seq, rope_dim = 2, 2, 5, 16
    x = torch.randn(batch, heads, seq, rope_dim, generator=generator).to(dtype)
    angles = torch.randn(batch, seq, rope_dim // 2, generator=generator)
    return x, angles.cos().to(dtype), angles.sin().to(dtype)


def _stock_rotation(function, name: str):
    """`function` (the transformers RoPE function called `name`) as rotate(x, cos, sin) on per-pair tables."""
    if name in COMPLEX_ROPE_FUNCTIONS:  # DeepSeek-V2's apply_rotary_emb takes complex freqs_cis [B, S, R/2]
        return lambda x, cos, sin: function(x, x[:, :1], torch.complex(cos.float(), sin.float()))[0]
    return lambda x, cos, sin: function(x, x[:, :1], torch.cat((cos, cos), -1), torch.cat((sin, sin), -1))[0]


@functools.lru_cache(maxsize=None)
def rope_function_layout(modeling, name: str) -> Optional[str]:
    """The mla.rope layout the RoPE function `name` of `modeling` computes, found by running it in fp32 on a small
    random input (its name's layout tried first: a family may reuse a name for another rotation, HY-V4-VL's
    `apply_rotary_pos_emb` rotates interleaved pairs); None when it computes none of them or is not defined."""
    function = getattr(modeling, name, None)
    if function is None:
        return None
    x, cos, sin = _rope_probe(torch.float32)
    with torch.no_grad():
        try:
            got = _stock_rotation(function, name)(x, cos, sin)
        except Exception:  # another signature: no rotation the patch can call it for
            return None
    named = ROPE_FUNCTIONS[name]
    for layout in (named, *sorted(set(ROPE_FUNCTIONS.values()) - {named})):
        expected = rope_math(x, cos, sin, layout)  # the op's formula, called without dispatch
        if got.shape == expected.shape and torch.allclose(got, expected, rtol=0, atol=1e-5):
            return layout
    return None


def matching_rope_compute_dtype(rotate, layout: str) -> Optional[str]:
    """The mla rope_compute_dtype whose rotation equals `rotate(x, cos, sin)` bit for bit in bf16 and in
    fp16 (x [B, N, S, R], per-pair cos/sin [B, S, R/2], all in that dtype), or None when neither does.

    fp32 cannot tell them apart (both are the fp32 formula there); in a half type "float32" rounds
    once and "activation" rounds every product and sum, which a random input shows."""
    for candidate in ROPE_COMPUTE_DTYPES:
        matches = True
        for dtype in (torch.bfloat16, torch.float16):
            x, cos, sin = _rope_probe(dtype)
            with torch.no_grad():
                try:
                    got = rotate(x, cos, sin)
                except Exception:  # a rotation that does not run in half precision reproduces neither
                    return None
                matches = matches and torch.equal(got, rope_math(x, cos, sin, layout, candidate))
        if matches:
            return candidate
    return None


def stock_rope_rounding(modeling, name: str) -> Optional[str]:
    """Where the family's RoPE function `name` rounds: the rope_compute_dtype reproducing it (or None)."""
    layout = rope_function_layout(modeling, name)
    return matching_rope_compute_dtype(_stock_rotation(getattr(modeling, name), name), layout)


def is_mla_attention(module: torch.nn.Module) -> bool:
    """A transformers MLA attention module (by the structure of its class; supported or not)."""
    cls = type(module)
    return cls.__module__.startswith("transformers.models.") and builds_mla_modules(cls)


def is_rms_norm_class(cls: type) -> bool:
    """Whether cls.forward computes only what mla.rms_norm does (read from its code)."""
    return not (forward_names(cls) - RMS_NORM_NAMES)


def norm_refusal(norm: torch.nn.Module, name: str = "kv_a_layernorm") -> Optional[str]:
    """Why `norm` (the layer's `name`: kv_a_layernorm, or dots3_note's k_rope_only_layernorm) is not the RMSNorm
    mla.kv_prolog / mla.rms_norm compute (None when it is)."""
    if not hasattr(norm, "variance_epsilon") or not isinstance(getattr(norm, "weight", None), torch.Tensor):
        return f"its {name} ({type(norm).__name__}) has no `weight` / `variance_epsilon`"
    extra = sorted(forward_names(type(norm)) - RMS_NORM_NAMES)
    if extra:
        return f"its {name} ({type(norm).__name__}) computes more than RMSNorm (uses {', '.join(extra)})"
    return None


# ------------------------------------------------------------------------------ what is installed
def _models_dir() -> Optional[pathlib.Path]:
    """transformers/models of the installed package (found without importing it), or None."""
    import importlib.util

    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return None
    return pathlib.Path(next(iter(spec.submodule_search_locations))) / "models"


def _own_modeling_text(model_type_dir: pathlib.Path) -> str:
    path = model_type_dir / f"modeling_{model_type_dir.name}.py"
    return path.read_text(errors="ignore") if path.is_file() else ""


@functools.lru_cache(maxsize=None)
def _mla_modeling_types() -> tuple[str, ...]:
    """model_type of every transformers model whose own modeling file builds the MLA projections (a text
    scan of the installed package: nothing is imported)."""
    models = _models_dir()
    if models is None:
        return ()
    return tuple(path.name for path in sorted(models.iterdir()) if "kv_a_proj_with_mqa" in _own_modeling_text(path))


@functools.lru_cache(maxsize=None)
def borrowed_model_types() -> dict:
    """model_type -> the model_type whose modeling module builds its attention, for every installed model type
    whose models are built from another family's MLA (or DeepSeek-V4) classes instead of modeling of their own:

    * through the auto mapping's base model class: a config-only model type (`sarvam_mla` is a DeepseekV3Config
      whose models are DeepseekV3Model / DeepseekV3ForCausalLM);
    * through the text config a composite config builds by default: a multimodal wrapper whose language model
      is `AutoModel.from_config(config.text_config)` (`kimi_k25`: a deepseek_v3 text model).

    Found from the installed package's files (the class names each modeling file defines, the model types each
    configuration file names); only the candidates' configuration classes are imported, once per process."""
    from . import shared_kv

    models = _models_dir()
    if models is None:
        return {}
    try:
        from transformers.models.auto.configuration_auto import (
            CONFIG_MAPPING,
            CONFIG_MAPPING_NAMES,
            model_type_to_module_name,
        )
        from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES
    except ImportError:  # a transformers without these mappings: no borrowed families
        return {}
    bases = set(_mla_modeling_types()) | set(shared_kv.installed_shared_kv_model_types())
    defined = {}  # class name -> the base model_type whose modeling file defines it
    for base in sorted(bases):
        for line in _own_modeling_text(models / base).splitlines():
            if line.startswith("class "):
                defined[line[6:].split("(")[0].split(":")[0].strip()] = base
    found = {}
    for model_type in CONFIG_MAPPING_NAMES:
        module = model_type_to_module_name(model_type)
        if model_type in bases or module in bases:  # (a base's own sub-model types, e.g. its text model)
            continue
        base_model = MODEL_MAPPING_NAMES.get(model_type)
        if isinstance(base_model, str) and base_model in defined:
            found[model_type] = defined[base_model]
            continue
        config_file = models / module / f"configuration_{module}.py"
        text = config_file.read_text(errors="ignore") if config_file.is_file() else ""
        if not any(f'"{base}"' in text for base in bases):
            continue
        try:  # a candidate: the model type of the text config its default config builds
            text_type = CONFIG_MAPPING[model_type]().get_text_config(decoder=True).model_type
        except Exception:  # a config that does not build with its defaults here: not a wrapper we can read
            continue
        if text_type in bases and text_type != model_type:
            found[model_type] = text_type
    return found


@functools.lru_cache(maxsize=None)
def installed_mla_model_types() -> tuple[str, ...]:
    """model_type of every transformers model whose models build MLA attention classes: those whose own
    modeling file builds the MLA projections (a text scan of the installed package), then those whose models
    are built from another family's classes (`borrowed_model_types`: sarvam_mla, kimi_k25, ...)."""
    return _mla_modeling_types() + tuple(sorted(t for t, base in borrowed_model_types().items()
                                                if base in _mla_modeling_types()))


def modeling_model_type(model_type: str) -> str:
    """The model_type whose modeling module builds `model_type`'s attention (itself, unless it borrows)."""
    return borrowed_model_types().get(model_type, model_type) if model_type not in _mla_modeling_types() else model_type


def families_of(model_type: str) -> list[MlaFamily]:
    """Every MLA (or DeepSeek-V4 shared-KV) attention class a model of one installed model type builds (imports
    the modeling module that defines them: its own, or the one it borrows, `borrowed_model_types`)."""
    import importlib

    from .shared_kv import builds_shared_kv_modules

    source = modeling_model_type(model_type)
    modeling = importlib.import_module(f"transformers.models.{source}.modeling_{source}")
    return [describe(obj) for obj in vars(modeling).values()
            if isinstance(obj, type) and obj.__module__ == modeling.__name__ and "forward" in vars(obj)
            and (builds_mla_modules(obj) or builds_shared_kv_modules(obj))]
