"""Goldens nobody here wrote: transformers' own DeepSeek-V2 / V3 modules (5.24.0) and the published
hub remote-code RoPE formula. Bit-identical where the arithmetic is the same: DeepSeek-V2 rotates in
fp32 (the ops' default rope_compute_dtype "float32"); DeepSeek-V3's RoPE functions and the hub code
rotate in the model's dtype ("activation") — in every dtype, fp16 and bf16 included."""
import pytest
import torch
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as hf

import mla_ops

from models import lite_attn_config, tiny_config

DTYPES = [torch.float32, torch.bfloat16]
dtype_ids = ["fp32", "bf16"]


def _rotary(config, batch, seq, offset=0):
    rotary = hf.DeepseekV2RotaryEmbedding(config)
    positions = (torch.arange(seq) + offset)[None].expand(batch, seq)
    return rotary(torch.empty(0), positions)  # complex64 freqs_cis [B, S, R/2] (YaRN scaled)


@pytest.mark.parametrize("dtype", DTYPES + [torch.float16], ids=dtype_ids + ["fp16"])
def test_rms_norm_bit_identical_to_deepseek_v2_rmsnorm(dtype):
    norm = hf.DeepseekV2RMSNorm(512, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(512))
    norm = norm.to(dtype)
    x = torch.randn(3, 7, 512).to(dtype) * 3
    assert torch.equal(mla_ops.rms_norm(x, norm.weight, norm.variance_epsilon), norm(x))
    # a strided input (a split view, as inside the attention) gives the same bits
    wide = torch.randn(2, 5, 576).to(dtype)
    view = wide[..., :512]
    assert torch.equal(mla_ops.rms_norm(view, norm.weight, 1e-6), norm(view))


@pytest.mark.parametrize("dtype", DTYPES + [torch.float16], ids=dtype_ids + ["fp16"])
@pytest.mark.parametrize("batch,seq", [(1, 1), (3, 7), (2, 128)])
def test_rope_interleaved_bit_identical_to_apply_rotary_emb(dtype, batch, seq):
    config = lite_attn_config()
    freqs_cis = _rotary(config, batch, seq, offset=11)
    q_pe = torch.randn(batch, 16, seq, 64).to(dtype)
    k_pe = torch.randn(batch, 1, seq, 64).to(dtype)
    q_ref, k_ref = hf.apply_rotary_emb(q_pe, k_pe, freqs_cis)
    cos, sin = freqs_cis.real, freqs_cis.imag
    assert torch.equal(mla_ops.rope(q_pe, cos, sin), q_ref)
    assert torch.equal(mla_ops.rope(k_pe, cos, sin), k_ref)


def _remote_code_rope(x, cos_pairs, sin_pairs):
    """The hub remote code's apply_rotary_pos_emb for one tensor, from its published formula:
    de-interleave (view(b, h, s, d/2, 2).transpose(4, 3)), then x*cos + rotate_half(x)*sin with
    cos = cat(freqs, freqs), in x's dtype like the original (its rotary embedding casts the tables)."""
    cos_pairs, sin_pairs = cos_pairs.to(x.dtype), sin_pairs.to(x.dtype)
    b, h, s, d = x.shape
    x = x.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)
    cos = torch.cat((cos_pairs, cos_pairs), dim=-1).unsqueeze(1)
    sin = torch.cat((sin_pairs, sin_pairs), dim=-1).unsqueeze(1)
    rotate_half = torch.cat((-x[..., d // 2:], x[..., : d // 2]), dim=-1)
    return x * cos + rotate_half * sin


@pytest.mark.parametrize("seq", [1, 7, 64])
def test_rope_half_equals_remote_code_formula(seq):
    config = lite_attn_config()
    freqs_cis = _rotary(config, 2, seq, offset=5)
    x = torch.randn(2, 16, seq, 64)
    expected = _remote_code_rope(x, freqs_cis.real, freqs_cis.imag)
    assert torch.equal(mla_ops.rope(x, freqs_cis.real, freqs_cis.imag, layout="half"), expected)
    # same rotated values as the interleaved layout, only permuted
    inter = mla_ops.rope(x, freqs_cis.real, freqs_cis.imag)
    assert torch.equal(torch.cat((inter[..., 0::2], inter[..., 1::2]), -1), expected)


@pytest.mark.parametrize("dtype", DTYPES + [torch.float16], ids=dtype_ids + ["fp16"])
def test_rope_half_in_the_activation_dtype_equals_remote_code_formula(dtype):
    """The hub code in a bf16 / fp16 model: tables cast to the model's dtype, every product and sum
    rounded to it. compute_dtype="activation" gives its bits; the fp32 rotation does not (in half types)."""
    config = lite_attn_config()
    freqs_cis = _rotary(config, 2, 9, offset=5)
    x = torch.randn(2, 16, 9, 64).to(dtype)
    cos, sin = freqs_cis.real.to(dtype), freqs_cis.imag.to(dtype)  # what its rotary embedding hands over
    expected = _remote_code_rope(x, cos, sin)
    assert torch.equal(mla_ops.rope(x, cos, sin, layout="half", compute_dtype="activation"), expected)
    assert torch.equal(mla_ops.rope(x, cos, sin, layout="half"), expected) == (dtype == torch.float32)


def _v3_config(**overrides):
    from transformers import DeepseekV3Config

    params = dict(vocab_size=64, hidden_size=256, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=128,
                  qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=4, num_experts_per_tok=2,
                  rope_interleave=True)
    return DeepseekV3Config(**{**params, **overrides})


def _v3_tables(config, dtype, batch, seq, offset=0):
    """DeepseekV3RotaryEmbedding's (cos, sin) [B, S, R] = cat(per-pair, per-pair), in `dtype` as it returns them."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as v3

    positions = (torch.arange(seq) + offset)[None].expand(batch, seq)
    return v3.DeepseekV3RotaryEmbedding(config)(torch.empty(0, dtype=dtype), positions)


@pytest.mark.parametrize("dtype", DTYPES + [torch.float16], ids=dtype_ids + ["fp16"])
@pytest.mark.parametrize("function,layout", [("apply_rotary_pos_emb_interleave", "half"),
                                             ("apply_rotary_pos_emb", "neox")])
def test_rope_in_the_activation_dtype_bit_identical_to_deepseek_v3(function, layout, dtype):
    """DeepSeek-V3's two RoPE functions (rope_interleave=True / False; every family built on its forward
    uses one of them) in the model's dtype."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as v3

    config = _v3_config()
    cos, sin = _v3_tables(config, dtype, 3, 7, offset=11)
    q_pe = torch.randn(3, 16, 7, 64).to(dtype)
    k_pe = torch.randn(3, 1, 7, 64).to(dtype)
    q_ref, k_ref = getattr(v3, function)(q_pe, k_pe, cos, sin)
    half = cos.shape[-1] // 2
    pairs = cos[..., :half], sin[..., :half]
    assert torch.equal(mla_ops.rope(q_pe, *pairs, layout=layout, compute_dtype="activation"), q_ref)
    assert torch.equal(mla_ops.rope(k_pe, *pairs, layout=layout, compute_dtype="activation"), k_ref)


def _v3_stock_kv_path(attn, hidden, cos, sin):
    """transformers' own DeepseekV3Attention KV path (forward's prolog + expand_kv), no cache."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as v3

    batch, seq, _ = hidden.shape
    kv_nope, k_rot = torch.split(attn.kv_a_proj_with_mqa(hidden), [attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1)
    latent = attn.kv_a_layernorm(kv_nope).view(batch, 1, seq, attn.kv_lora_rank)
    k_rot = k_rot.view(batch, 1, seq, attn.qk_rope_head_dim)
    _, k_rot = v3.apply_rotary_pos_emb_interleave(k_rot, k_rot, cos, sin)
    key_states, value_states = attn.expand_kv(latent, k_rot)
    return key_states[..., : attn.qk_nope_head_dim], value_states, k_rot, latent


@pytest.mark.parametrize("dtype", DTYPES + [torch.float16], ids=dtype_ids + ["fp16"])
@pytest.mark.parametrize("seq", [1, 9])
def test_prologs_in_the_activation_dtype_bit_identical_to_deepseek_v3_attention(dtype, seq):
    """mla.kv_prolog / mla.latent_kv_prolog with rope_layout="half", rope_compute_dtype="activation"
    against DeepseekV3Attention's own modules: every output, every dtype."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as v3

    config = _v3_config()
    torch.manual_seed(2)
    attn = v3.DeepseekV3Attention(config, layer_idx=0).to(dtype).eval()
    with torch.no_grad():
        attn.kv_a_layernorm.weight.copy_(1 + 0.1 * torch.randn(config.kv_lora_rank))
    hidden = torch.randn(2, seq, config.hidden_size).to(dtype)
    cos, sin = _v3_tables(config, dtype, 2, seq, offset=4)
    half = config.qk_rope_head_dim // 2
    kv_a, norm = attn.kv_a_proj_with_mqa, attn.kv_a_layernorm
    options = dict(eps=norm.variance_epsilon, rope_layout="half", rope_compute_dtype="activation")
    with torch.no_grad():
        k_nope_ref, value_ref, k_pe_ref, latent_ref = _v3_stock_kv_path(attn, hidden, cos, sin)
        k_nope, value, k_pe = mla_ops.kv_prolog(
            hidden, kv_a.weight, kv_a.bias, norm.weight, attn.kv_b_proj.weight, cos[..., :half], sin[..., :half],
            num_heads=config.num_attention_heads, qk_nope_head_dim=config.qk_nope_head_dim,
            v_head_dim=config.v_head_dim, **options)
        latent, k_pe_latent = mla_ops.latent_kv_prolog(hidden, kv_a.weight, kv_a.bias, norm.weight, cos[..., :half],
                                                       sin[..., :half], **options)
    assert torch.equal(k_nope, k_nope_ref) and torch.equal(value, value_ref) and torch.equal(k_pe, k_pe_ref)
    assert torch.equal(latent, latent_ref.squeeze(1)) and torch.equal(k_pe_latent, k_pe_ref.squeeze(1))


def _stock_kv_path(attn, hidden, freqs_cis):
    """transformers' own DeepseekV2Attention KV path (forward's prolog + expand_kv), no cache."""
    batch, seq, _ = hidden.shape
    compressed_kv = attn.kv_a_proj_with_mqa(hidden)
    kv_nope, k_pe = torch.split(compressed_kv, [attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1)
    latent = attn.kv_a_layernorm(kv_nope).view(batch, 1, seq, attn.kv_lora_rank)
    k_pe = k_pe.view(batch, 1, seq, attn.qk_rope_head_dim)
    q_dummy = torch.zeros(batch, 1, seq, attn.qk_rope_head_dim, dtype=hidden.dtype)
    _, k_pe = hf.apply_rotary_emb(q_dummy, k_pe, freqs_cis)
    key_states, value_states = attn.expand_kv(latent, k_pe)
    return key_states[..., : attn.qk_nope_head_dim], value_states, k_pe, latent


@pytest.mark.parametrize("config_fn", [tiny_config, lite_attn_config], ids=["tiny", "lite-attn"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("seq", [1, 7, 128])
def test_kv_prolog_bit_identical_to_deepseek_v2_attention(config_fn, dtype, batch, seq):
    config = config_fn(attention_bias=config_fn is tiny_config)  # tiny also exercises the kv_a bias
    torch.manual_seed(1)
    attn = hf.DeepseekV2Attention(config, layer_idx=0).to(dtype).eval()
    with torch.no_grad():
        attn.kv_a_layernorm.weight.copy_(1 + 0.1 * torch.randn(config.kv_lora_rank))
    hidden = torch.randn(batch, seq, config.hidden_size).to(dtype)
    freqs_cis = _rotary(config, batch, seq, offset=3)
    with torch.no_grad():
        k_nope_ref, value_ref, k_pe_ref, latent_ref = _stock_kv_path(attn, hidden, freqs_cis)
        k_nope, value, k_pe = mla_ops.kv_prolog(
            hidden, attn.kv_a_proj_with_mqa.weight, attn.kv_a_proj_with_mqa.bias, attn.kv_a_layernorm.weight,
            attn.kv_b_proj.weight, freqs_cis.real, freqs_cis.imag, num_heads=config.num_attention_heads,
            qk_nope_head_dim=config.qk_nope_head_dim, v_head_dim=config.v_head_dim,
            eps=attn.kv_a_layernorm.variance_epsilon)
        latent, k_pe_latent = mla_ops.latent_kv_prolog(
            hidden, attn.kv_a_proj_with_mqa.weight, attn.kv_a_proj_with_mqa.bias, attn.kv_a_layernorm.weight,
            freqs_cis.real, freqs_cis.imag, eps=attn.kv_a_layernorm.variance_epsilon)
    assert k_nope.shape == (batch, config.num_attention_heads, seq, config.qk_nope_head_dim)
    assert torch.equal(k_nope, k_nope_ref)
    assert torch.equal(value, value_ref)
    assert torch.equal(k_pe, k_pe_ref)
    assert torch.equal(latent, latent_ref.squeeze(1))
    assert torch.equal(k_pe_latent, k_pe_ref.squeeze(1))


def test_kv_prolog_layout_is_transpose_not_reshape():
    """The original PyPTO sample reshaped [B*S, N, D] -> [B, N, S, D]; that is wrong for S > 1.
    Feed a kv_b that copies the latent index into each head's slot and check token positions."""
    batch, seq, heads, lora = 2, 3, 2, 4
    hidden = torch.eye(seq).repeat(batch, 1, 1) * torch.arange(1, batch + 1)[:, None, None]  # [B, S, S]
    kv_a = torch.cat((torch.eye(seq, lora).T, torch.zeros(2, seq)))  # latent = hidden (padded), rope dim 2
    kv_b = torch.cat([torch.eye(lora)[:1]] * (heads * 2))  # each head's P=V=1 column reads latent[0]
    cos, sin = torch.ones(batch, seq, 1), torch.zeros(batch, seq, 1)
    k_nope, value, _ = mla_ops.kv_prolog(hidden, kv_a, None, torch.ones(lora), kv_b, cos, sin, num_heads=heads,
                                         qk_nope_head_dim=1, v_head_dim=1, eps=0.0)
    # only token 0 of every sequence has latent[0] != 0: position s=0 in every head, nowhere else
    nonzero = (k_nope[..., 0] != 0)
    assert nonzero[:, :, 0].all() and not nonzero[:, :, 1:].any()
