"""`mla.q_prolog`: the query path of transformers' own DeepSeek-V2 / V3 attention, opcheck, autograd,
one graph node under torch.compile, and the bad-input matrix."""
import pytest
import torch
from torch.autograd import gradcheck

import mla_ops

from utils import DTYPES, opcheck, rope_tables

B, S, H, Q, N, P, R = 2, 5, 48, 24, 4, 16, 8


def q_inputs(dtype=torch.float32, *, lora=True, bias=False, requires_grad=False, batched_tables=True, seed=0):
    """(hidden, q_a_w, q_a_b, q_norm_w, q_b_w, cos, sin) with realistic scales."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).requires_grad_(requires_grad)

    hidden = rand(B, S, H)
    q_a = rand(Q, H, scale=H ** -0.5) if lora else None
    q_a_b = rand(Q, scale=0.1) if (lora and bias) else None
    norm = (1.0 + 0.1 * torch.randn(Q, generator=g)).to(dtype).requires_grad_(requires_grad) if lora else None
    q_b = rand(N * (P + R), Q if lora else H, scale=(Q if lora else H) ** -0.5)
    table_dtype = torch.promote_types(dtype, torch.float32)
    cos, sin = (t.to(table_dtype) for t in rope_tables(B, S, R, offset=2, batched=batched_tables))
    if requires_grad:
        cos, sin = cos.requires_grad_(), sin.requires_grad_()
    return hidden, q_a, q_a_b, norm, q_b, cos, sin


KW = dict(num_heads=N, qk_nope_head_dim=P)


@pytest.mark.parametrize("lora", [True, False], ids=["q_lora", "q_proj"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout,rounding", [("interleaved", "float32"), ("half", "float32"), ("half", "activation"),
                                             ("neox", "activation")])
def test_opcheck(lora, dtype, layout, rounding):
    opcheck(torch.ops.mla.q_prolog.default, q_inputs(dtype, lora=lora),
            dict(KW, rope_layout=layout, rope_compute_dtype=rounding))


def _deepseek_v2_attention(q_lora_rank, dtype):
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as hf

    from models import tiny_config

    config = tiny_config(q_lora_rank=q_lora_rank)
    torch.manual_seed(0)
    attn = hf.DeepseekV2Attention(config, layer_idx=0).to(dtype).eval()
    rotary = hf.DeepseekV2RotaryEmbedding(config)
    return hf, config, attn, rotary


@pytest.mark.parametrize("q_lora_rank", [24, None], ids=["q_lora", "q_proj"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bit_identical_to_deepseek_v2_query_path(q_lora_rank, dtype):
    """transformers' own modules, the same weights: q_a_proj -> q_a_layernorm -> q_b_proj (or q_proj)
    -> view/transpose/split -> apply_rotary_emb (complex multiply of interleaved pairs)."""
    hf, config, attn, rotary = _deepseek_v2_attention(q_lora_rank, dtype)
    hidden = torch.randn(2, 7, config.hidden_size).to(dtype)
    freqs_cis = rotary(hidden, torch.arange(3, 10)[None].expand(2, -1))
    with torch.no_grad():
        if q_lora_rank is None:
            q = attn.q_proj(hidden)
            weights = (None, None, None, attn.q_proj.weight)
        else:
            q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(hidden)))
            weights = (attn.q_a_proj.weight, attn.q_a_proj.bias, attn.q_a_layernorm.weight, attn.q_b_proj.weight)
        q = q.view(2, 7, -1, attn.qk_head_dim).transpose(1, 2)
        q_nope_ref, q_pe = torch.split(q, [attn.qk_nope_head_dim, attn.qk_rope_head_dim], dim=-1)
        q_pe_ref, _ = hf.apply_rotary_emb(q_pe, q_pe[:, :1], freqs_cis)
        eps = attn.q_a_layernorm.variance_epsilon if q_lora_rank else 1e-6
        q_nope, q_pe_out = mla_ops.q_prolog(hidden, *weights, freqs_cis.real, freqs_cis.imag,
                                            num_heads=attn.num_heads, qk_nope_head_dim=attn.qk_nope_head_dim, eps=eps)
    assert torch.equal(q_nope, q_nope_ref) and q_nope.is_contiguous()
    assert torch.equal(q_pe_out, q_pe_ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleave", [True, False], ids=["rope_interleave", "rotate_half"])
def test_bit_identical_to_deepseek_v3_query_path_in_its_dtype(interleave, dtype):
    """DeepSeek-V3 rotates in the activation dtype: with rope_interleave=True the interleaved pairs,
    written de-interleaved (`apply_rotary_pos_emb_interleave`, rope_layout="half"), else rotate_half
    pairs (`apply_rotary_pos_emb`, "neox"). rope_compute_dtype="activation" gives its bits in every dtype."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    config = DeepseekV3Config(vocab_size=64, hidden_size=48, intermediate_size=64, moe_intermediate_size=16,
                              num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24,
                              kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                              n_routed_experts=4, num_experts_per_tok=2, rope_interleave=interleave)
    torch.manual_seed(0)
    attn = hf.DeepseekV3Attention(config, layer_idx=0).to(dtype).eval()
    rotary = hf.DeepseekV3RotaryEmbedding(config)
    hidden = torch.randn(2, 6, 48).to(dtype)
    cos_full, sin_full = rotary(hidden, torch.arange(6)[None].expand(2, -1))  # in hidden's dtype
    function = hf.apply_rotary_pos_emb_interleave if interleave else hf.apply_rotary_pos_emb
    with torch.no_grad():
        q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(hidden))).view(2, 6, -1, attn.qk_head_dim).transpose(1, 2)
        q_pass, q_rot = torch.split(q, [attn.qk_nope_head_dim, attn.qk_rope_head_dim], dim=-1)
        q_rot_ref, _ = function(q_rot, q_rot[:, :1], cos_full, sin_full)
        half = config.qk_rope_head_dim // 2
        q_nope, q_pe = mla_ops.q_prolog(hidden, attn.q_a_proj.weight, attn.q_a_proj.bias, attn.q_a_layernorm.weight,
                                        attn.q_b_proj.weight, cos_full[..., :half], sin_full[..., :half],
                                        num_heads=4, qk_nope_head_dim=16, eps=attn.q_a_layernorm.variance_epsilon,
                                        rope_layout="half" if interleave else "neox", rope_compute_dtype="activation")
    assert torch.equal(q_nope, q_pass) and torch.equal(q_pe, q_rot_ref)


@pytest.mark.parametrize("lora,bias,layout,rounding", [(True, True, "interleaved", "float32"),
                                                        (False, False, "interleaved", "float32"),
                                                        (True, True, "half", "float32"),
                                                        (False, False, "half", "float32"),
                                                        (True, False, "neox", "activation")],
                         ids=["q_lora_bias-interleaved", "q_proj-interleaved", "q_lora_bias-half", "q_proj-half",
                              "q_lora-neox-activation"])
def test_gradcheck(lora, bias, layout, rounding):
    """fp64 is its own activation dtype, so "activation" is checked against the same exact gradient."""
    args = tuple(a for a in q_inputs(torch.float64, lora=lora, bias=bias, requires_grad=True, batched_tables=False))
    assert gradcheck(lambda *a: mla_ops.q_prolog(*a, **KW, rope_layout=layout, rope_compute_dtype=rounding), args)


def test_one_graph_node_under_compile():
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("eager")
    args = q_inputs()
    fn = torch.compile(lambda *a: mla_ops.q_prolog(*a, **KW), backend=counter, fullgraph=True)
    got = fn(*args)
    expected = mla_ops.q_prolog(*args, **KW)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    targets = [n.target for n in counter.graphs[0].graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.mla.q_prolog.default) == 1


BAD = [
    (dict(hidden=torch.randn(S, H)), r"hidden_states must be 3-D"),
    (dict(norm=None), r"q_a_weight and q_norm_weight come together"),
    (dict(q_a=None, norm=None, q_a_b=torch.randn(Q)), r"q_a_bias was given without q_a_weight"),
    (dict(q_b=torch.randn(N * (P + R), H)), r"q_b_weight in_features \(dim 1\) must equal q_lora_rank"),
    (dict(q_b=torch.randn(N * (P + R) + 1, Q)),
     r"q_b_weight rows must be num_heads \* \(qk_nope_head_dim \+ rope_dim\)"),
    (dict(norm=torch.ones(Q + 1)), r"q_norm_weight length must equal q_lora_rank"),
    (dict(q_b=torch.randn(N * (P + R), Q).double()), r"q_b_weight has dtype torch.float64"),
    (dict(sin=torch.randn(B, S, R)), r"cos and sin must have the same shape"),
]


@pytest.mark.parametrize("change,message", BAD, ids=[m for _, m in BAD])
def test_bad_inputs_name_the_argument(change, message):
    names = ("hidden", "q_a", "q_a_b", "norm", "q_b", "cos", "sin")
    args = dict(zip(names, q_inputs()))
    args.update(change)
    with pytest.raises(RuntimeError, match=r"mla.q_prolog: " + message):
        mla_ops.q_prolog(*args.values(), **KW)


def test_a_bad_rope_compute_dtype_names_the_argument_and_the_values():
    with pytest.raises(RuntimeError, match=r"mla.q_prolog: rope_compute_dtype must be one of \('float32', "
                                           r"'activation'\) .* got 'bfloat16'"):
        mla_ops.q_prolog(*q_inputs(), **KW, rope_compute_dtype="bfloat16")
