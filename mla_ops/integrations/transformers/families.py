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
* no RoPE function: NoPE (Kimi-Linear), the rope dims pass through (identity tables);
* `mla_scale_q_lora` / `mla_scale_kv_lora`: LongCat's scales on q and the latent, applied where stock does;
* `g_proj`: Bailing's per-head sigmoid output gate, applied before o_proj;
* `get_llama_4_attn_scale`: Mistral-4's position-dependent query scale;
* `expand_kv`: the stock cache holds the latent (transformers >= 5.15; matters for rope=True with
  kv_prolog=False, which keeps the stock KV path);
* `pad`: DeepSeek-V2 of 4.54 - 5.23 pads V to the qk head dim for flash attention; padded the same way;
* `indexer`: DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): an indexer module scores the cached
  keys and each query attends to its top-k only (`MlaFamily.indexer`, see `describe_indexer`); with a
  `prev_topk_indices` parameter, layers of `config.indexer_types` "shared" reuse the previous layer's
  top-k (`MlaFamily.shared_topk`).

An indexer is served when its class's forward is DeepSeek-V3.2's: q = wq_b(q_resid), k = k_norm(wk(x)),
the RoPE function it names on their first qk_rope_head_dim dims, the key through
`cache.update_indexer`, scores sum_h w_h * relu(softmax_scale * q_h.k) with w = weights_proj(x) *
n_heads**-0.5, masked by the attention mask, top-k: what `mla.lightning_indexer` computes. One that uses
any other name (pooled keys, a query norm, shared KV, ...) is refused with those names.

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
FEATURES = {  # feature -> (the name that marks it, every name its code uses)
    "config_rope_interleave": ("rope_interleave", {"rope_interleave"}),
    "lora_scales": ("mla_scale_q_lora", {"mla_scale_q_lora", "mla_scale_kv_lora"}),
    "output_gate": ("g_proj", {"g_proj", "sigmoid", "float", "dtype", "unsqueeze"}),
    "query_position_scale": ("get_llama_4_attn_scale", {"get_llama_4_attn_scale", "rope_parameters", "get", "dtype"}),
    "latent_stock_cache": ("expand_kv", {"expand_kv"}),
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
MLA_MODULES = ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")
# The RMSNorm forward the ops reproduce (fp32 variance, weight * normed.to(input dtype)).
RMS_NORM_NAMES = frozenset({"dtype", "to", "torch", "float32", "pow", "mean", "rsqrt", "variance_epsilon", "weight"})


@dataclasses.dataclass(frozen=True)
class MlaFamily:
    """What the patch needs to know about one transformers MLA attention class.

    `rope`: "interleaved" | "half" | "neox" (fixed by the forward), "config" (`config.rope_interleave`
    chooses "half" or "neox"), or "none" (NoPE). `rope_rounding`: (layout, compute_dtype) for each
    RoPE function the forward calls: the mla `rope_compute_dtype` that reproduces its rounding bit for
    bit in bf16 and fp16 ("float32" | "activation"), None where neither does. `parameters`: the stock
    forward's parameter names after `self`, in order (positional calls are mapped onto them).
    `indexer`: the sparse-attention indexer's RoPE function (the name in the modeling module; None:
    dense attention). `shared_topk`: the forward takes `prev_topk_indices` and returns its top-k third
    (GLM-5's cross-layer sharing). `refused`: why it cannot be patched (None when it can). `shared_kv`:
    DeepSeek-V4's shared-KV attention (one K=V row per token, compressors, sinks; served by `shared_kv`,
    whose `describe_shared_kv` reads such a class)."""

    attention: type
    model_type: str
    rope: str
    parameters: tuple[str, ...]
    rope_rounding: tuple[tuple[str, Optional[str]], ...] = ()
    lora_scales: bool = False
    output_gate: bool = False
    query_position_scale: bool = False
    latent_stock_cache: bool = False
    flash_value_padding: bool = False
    indexer: Optional[str] = None
    shared_topk: bool = False
    refused: Optional[str] = None
    shared_kv: bool = False

    @property
    def sparse(self) -> bool:
        """DeepSeek Sparse Attention: each query attends to the top-k keys its layer's indexer picks."""
        return self.indexer is not None

    def indexer_layout(self) -> Optional[str]:
        """The rope layout of the indexer's RoPE function (None: dense attention)."""
        return None if self.indexer is None else ROPE_FUNCTIONS[self.indexer]

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

    def model_classes(self) -> tuple[Optional[type], Optional[type]]:
        """(the decoder `*Model`, the `*ForCausalLM`) of this family's modeling module, for a class-level
        paged patch (an instance patch finds the decoder in the model itself)."""
        from transformers import PreTrainedModel

        classes = [obj for obj in vars(self.modeling).values() if isinstance(obj, type)
                   and obj.__module__ == self.modeling.__name__ and issubclass(obj, PreTrainedModel)]
        decoder = next((c for c in classes if c.__name__.endswith("Model")
                        and not c.__name__.endswith("PreTrainedModel")), None)
        causal_lm = next((c for c in classes if c.__name__.endswith("ForCausalLM")), None)
        return decoder, causal_lm


def _forward_names(cls: type) -> frozenset:
    return frozenset(inspect.unwrap(cls.forward).__code__.co_names)


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
    names = _forward_names(cls)
    module = cls.__module__
    model_type = module.split(".")[2] if module.startswith("transformers.models.") else module
    parameters = tuple(p.name for p in list(inspect.signature(inspect.unwrap(cls.forward)).parameters.values())[1:]
                       if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
    rope_functions = sorted(names & ROPE_FUNCTIONS.keys())
    features = {feature: marker in names for feature, (marker, _) in FEATURES.items()}
    known = set(BASE_FORWARD_NAMES) | set(ROPE_FUNCTIONS)
    for feature, (_, used) in FEATURES.items():
        if features[feature]:
            known |= used
    sparse = "indexer" in names
    shared_topk = sparse and SHARED_TOPK_PARAMETER in parameters
    if sparse:
        known |= SPARSE_FORWARD_NAMES | ({"ValueError"} if shared_topk else set())
    unknown = sorted(names - known)
    refused = indexer = None
    if unknown:
        refused = f"its forward uses {', '.join(unknown)}, which the patch does not reproduce"
    if sparse:
        indexer, indexer_refusal = describe_indexer(cls)
        reasons = [r for r in (refused, indexer_refusal) if r]
        refused = f"sparse attention: {'; '.join(reasons)}" if reasons else None
        indexer = None if refused else indexer  # (`sparse`: served through the indexer op)
    if features["config_rope_interleave"] and set(rope_functions) == {"apply_rotary_pos_emb",
                                                                       "apply_rotary_pos_emb_interleave"}:
        rope = "config"
    elif len(rope_functions) == 1:
        rope = ROPE_FUNCTIONS[rope_functions[0]]
    elif not rope_functions:
        rope = "none"
    else:
        rope, refused = "config", refused or f"its forward chooses between {rope_functions} by a rule the patch " \
                                             f"does not know"
    if refused is None:
        refused = rope_function_refusal(sys.modules[module], rope_functions + ([indexer] if indexer else []))
    rounding = () if refused else tuple((ROPE_FUNCTIONS[name], stock_rope_rounding(sys.modules[module], name))
                                        for name in rope_functions)
    return MlaFamily(attention=cls, model_type=model_type, rope=rope, parameters=parameters, rope_rounding=rounding,
                     lora_scales=features["lora_scales"], output_gate=features["output_gate"],
                     query_position_scale=features["query_position_scale"],
                     latent_stock_cache=features["latent_stock_cache"],
                     flash_value_padding=features["flash_value_padding"], indexer=indexer, shared_topk=shared_topk,
                     refused=refused)


def indexer_classes(cls: type) -> list:
    """The sparse-attention indexer classes an attention class builds: the module classes its `__init__`
    names whose forward writes an indexer-key cache (`update_indexer`)."""
    modeling = sys.modules[cls.__module__]
    init = inspect.unwrap(cls.__init__)
    found = [getattr(modeling, name, None) for name in init.__code__.co_names]
    return [c for c in found if isinstance(c, type) and issubclass(c, torch.nn.Module) and "forward" in vars(c)
            and "update_indexer" in _forward_names(c)]


def describe_indexer(cls: type) -> tuple[Optional[str], Optional[str]]:
    """(the indexer's RoPE function name, None) for a DeepSeek-V3.2 indexer the patch reproduces, else
    (None, why not): read off the indexer class's forward, as the attention's is."""
    classes = indexer_classes(cls)
    if len(classes) != 1:
        return None, (f"its indexer is not one module class writing cache.update_indexer "
                      f"(found {[c.__name__ for c in classes]})")
    indexer_cls = classes[0]
    names = _forward_names(indexer_cls)
    rope = sorted(names & ROPE_FUNCTIONS.keys())
    unknown = sorted(names - INDEXER_NAMES - set(rope))
    if unknown:
        return None, (f"its indexer ({indexer_cls.__name__}) uses {', '.join(unknown)}, beyond "
                      f"DeepSeek-V3.2's score sum_h w_h * relu(scale * q_h.k) over every cached key that "
                      f"mla.lightning_indexer computes")
    if len(rope) != 1 or ROPE_FUNCTIONS[rope[0]] == "interleaved":
        return None, (f"its indexer ({indexer_cls.__name__}) rotates with {rope or 'no RoPE'}, "
                      f"not one (cos, sin) RoPE function")
    return rope[0], None


def _rope_probe(dtype: torch.dtype):
    """A small random q_pe-like input x [B, N, S, R] and per-pair tables cos/sin [B, S, R/2], in `dtype`
    (rotary embeddings hand the tables to the attention in the model's dtype)."""
    generator = torch.Generator().manual_seed(0)
    batch, heads, seq, rope_dim = 2, 2, 5, 16
    x = torch.randn(batch, heads, seq, rope_dim, generator=generator).to(dtype)
    angles = torch.randn(batch, seq, rope_dim // 2, generator=generator)
    return x, angles.cos().to(dtype), angles.sin().to(dtype)


def _stock_rotation(function, layout: str):
    """`function` (a transformers RoPE function of `layout`) as rotate(x, cos, sin) on per-pair tables."""
    if layout == "interleaved":  # DeepSeek-V2's apply_rotary_emb takes complex freqs_cis [B, S, R/2]
        return lambda x, cos, sin: function(x, x[:, :1], torch.complex(cos.float(), sin.float()))[0]
    return lambda x, cos, sin: function(x, x[:, :1], torch.cat((cos, cos), -1), torch.cat((sin, sin), -1))[0]


def rope_function_refusal(modeling, names) -> Optional[str]:
    """Run each RoPE function the forward names on a small random input and check it rotates the way
    its layout says (a family could reuse a name for another rotation); None when all do."""
    x, cos, sin = _rope_probe(torch.float32)
    for name in names:
        function, layout = getattr(modeling, name, None), ROPE_FUNCTIONS[name]
        if function is None:
            return f"its forward calls {name}, which its module does not define"
        with torch.no_grad():
            try:
                got = _stock_rotation(function, layout)(x, cos, sin)
            except Exception as exc:  # another signature: not the function the layout stands for
                return f"its {name} does not take the arguments of the {layout} RoPE ({type(exc).__name__})"
            expected = rope_math(x, cos, sin, layout)  # the op's formula, called without dispatch
        if got.shape != expected.shape or not torch.allclose(got, expected, rtol=0, atol=1e-5):
            return f"its {name} does not compute the {layout} rotation the patch reproduces"
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
    layout = ROPE_FUNCTIONS[name]
    return matching_rope_compute_dtype(_stock_rotation(getattr(modeling, name), layout), layout)


def is_mla_attention(module: torch.nn.Module) -> bool:
    """A transformers MLA attention module (by the structure of its class; supported or not)."""
    cls = type(module)
    return cls.__module__.startswith("transformers.models.") and builds_mla_modules(cls)


def is_rms_norm_class(cls: type) -> bool:
    """Whether cls.forward computes only what mla.rms_norm does (read from its code)."""
    return not (_forward_names(cls) - RMS_NORM_NAMES)


def norm_refusal(norm: torch.nn.Module) -> Optional[str]:
    """Why `kv_a_layernorm` is not the RMSNorm mla.kv_prolog computes (None when it is)."""
    if not hasattr(norm, "variance_epsilon") or not isinstance(getattr(norm, "weight", None), torch.Tensor):
        return f"its kv_a_layernorm ({type(norm).__name__}) has no `weight` / `variance_epsilon`"
    extra = sorted(_forward_names(type(norm)) - RMS_NORM_NAMES)
    if extra:
        return f"its kv_a_layernorm ({type(norm).__name__}) computes more than RMSNorm (uses {', '.join(extra)})"
    return None


# ------------------------------------------------------------------------------ what is installed
@functools.lru_cache(maxsize=None)
def installed_mla_model_types() -> tuple[str, ...]:
    """model_type of every transformers model whose modeling file builds MLA projections (a text
    scan of the installed package, once per process: nothing is imported)."""
    import importlib.util

    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return ()
    models = pathlib.Path(next(iter(spec.submodule_search_locations))) / "models"
    found = []
    for path in sorted(models.glob("*/modeling_*.py")):
        if path.stem == f"modeling_{path.parent.name}" and "kv_a_proj_with_mqa" in path.read_text(errors="ignore"):
            found.append(path.parent.name)
    return tuple(found)


def families_of(model_type: str) -> list[MlaFamily]:
    """Every MLA (or DeepSeek-V4 shared-KV) attention class of one installed model family (imports its
    modeling module)."""
    import importlib

    from .shared_kv import builds_shared_kv_modules

    modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    return [describe(obj) for obj in vars(modeling).values()
            if isinstance(obj, type) and obj.__module__ == modeling.__name__ and "forward" in vars(obj)
            and (builds_mla_modules(obj) or builds_shared_kv_modules(obj))]
