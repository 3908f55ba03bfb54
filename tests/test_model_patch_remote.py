"""The model patch on the hub remote-code attention (modeling_deepseek.py), via a test-local module
written from that file's published structure (tests/remote_deepseek_v2.py)."""
import pytest
import torch

from mla_ops.integrations import transformers as patch

import remote_deepseek_v2 as remote
from models import lite_attn_config, tiny_config

# whole models, generate and compile: `make test-fast` leaves these to `make test`
pytestmark = pytest.mark.slow


def _stack(config, dtype, seed=0):
    torch.manual_seed(seed)
    stack = remote.RemoteCodeLayerStack(config).to(dtype).eval()
    with torch.no_grad():
        for layer in stack.layers:
            layer.kv_a_layernorm.weight.copy_(1 + 0.1 * torch.randn(config.kv_lora_rank))
    return stack


def _run(stack, hidden, decode_steps=4):
    """Prefill then teacher-forced decode with the 4.x cache API; returns every step's output."""
    cache = remote.LegacyDynamicCache()
    seq = hidden.shape[1] - decode_steps
    outs = [stack(hidden[:, :seq], remote.causal_mask(seq, seq, hidden.dtype),
                  torch.arange(seq)[None].expand(hidden.shape[0], -1), cache)]
    for t in range(seq, hidden.shape[1]):
        outs.append(stack(hidden[:, t:t + 1], remote.causal_mask(1, t + 1, hidden.dtype),
                          torch.full((hidden.shape[0], 1), t), cache))
    return outs, cache


def test_remote_attention_is_recognised_from_the_instance():
    stack = _stack(tiny_config(), torch.float32)
    assert patch.is_remote_attention(stack.layers[0]) and not patch.is_native_attention(stack.layers[0])
    with patch.apply(stack) as handle:
        assert handle.patched_modules == 2
        assert stack.layers[0].forward.__func__ is patch.remote_attention_forward
    assert stack.layers[0].forward.__func__ is remote.DeepseekV2Attention.forward


@pytest.mark.parametrize("config_fn", [tiny_config, lite_attn_config], ids=["tiny", "lite-attn"])
@pytest.mark.parametrize("rope", [False, True], ids=["stock-q-rope", "mla-rope"])
def test_remote_prefill_and_decode_fp32_bit_identical(config_fn, rope):
    """fp32: the remote code rotates in fp32 too and also runs kv_b per new token, so every output
    and the cached K/V (k_pe in its de-interleaved 'half' layout) are bit-identical."""
    config = config_fn()
    stack = _stack(config, torch.float32)
    hidden = torch.randn(2, 11, config.hidden_size)
    with torch.no_grad():
        expected, expected_cache = _run(stack, hidden)
        with patch.apply(stack, rope=rope, rms_norm=True):
            got, got_cache = _run(stack, hidden)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    for a, b in zip(got_cache.key_cache + got_cache.value_cache, expected_cache.key_cache + expected_cache.value_cache):
        assert torch.equal(a, b)


def test_remote_bf16_within_rounding():
    """bf16: the remote code casts its cos/sin tables to bf16 and rotates in bf16; mla rotates in fp32
    from the same bf16 tables. The rotated k_pe / q_pe differ by <= 1 bf16 ulp; after 2 layers and 4
    decode steps the outputs (|x| up to ~4.5, bf16 ulp 0.031 there) differ by at most 1 ulp of the
    largest magnitude (measured 0.016-0.031 over seeds): atol 6e-2 is 2 such ulps."""
    config = lite_attn_config()
    stack = _stack(config, torch.bfloat16)
    hidden = torch.randn(1, 9, config.hidden_size).to(torch.bfloat16)
    with torch.no_grad():
        expected, _ = _run(stack, hidden)
        with patch.apply(stack):
            got, _ = _run(stack, hidden)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=6e-2)


def test_remote_returns_the_three_tuple_and_attention_weights():
    config = tiny_config()
    attn = _stack(config, torch.float32).layers[0]
    hidden = torch.randn(1, 5, config.hidden_size)
    mask = remote.causal_mask(5, 5, torch.float32)
    cache = remote.LegacyDynamicCache()
    with torch.no_grad():
        ref = attn(hidden, mask, torch.arange(5)[None], None, output_attentions=True)
        with patch.apply(attn):
            out, weights, returned_cache = attn(hidden, mask, torch.arange(5)[None], cache, output_attentions=True)
    assert returned_cache is cache and weights.shape == (1, config.num_attention_heads, 5, 5)
    assert torch.equal(out, ref[0]) and torch.equal(weights, ref[1])


def test_remote_paged_mode_is_refused_clearly():
    stack = _stack(tiny_config(), torch.float32)
    with pytest.raises(NotImplementedError, match="cache='paged' supports transformers' native"):
        patch.apply(stack, cache="paged")
    assert stack.layers[0].forward.__func__ is remote.DeepseekV2Attention.forward


def test_a_refused_reapply_keeps_the_previous_patch():
    """apply() checks everything before touching the model: a refused re-apply (paged on remote
    code) leaves the earlier dense patch in place, handle and all."""
    stack = _stack(tiny_config(), torch.float32)
    handle = patch.apply(stack)
    with pytest.raises(NotImplementedError, match="cache='paged' supports transformers' native"):
        patch.apply(stack, cache="paged")
    assert handle.active and patch.active_patches() == [handle]
    assert stack.layers[0].forward.__func__ is patch.remote_attention_forward


def test_remote_flash_attention_is_refused_with_the_fix():
    """The hub code's DeepseekV2FlashAttention2 receives flash-attention masks (None or a 2-D
    padding mask), which the eager patched forward would misread: refused, naming the way out."""
    stack = _stack(tiny_config(), torch.float32)
    flash = type("DeepseekV2FlashAttention2", (remote.DeepseekV2Attention,), {})
    for layer in stack.layers:
        layer.__class__ = flash
    with pytest.raises(NotImplementedError, match="attn_implementation='eager'"):
        patch.apply(stack)
    assert "forward" not in stack.layers[0].__dict__ and not patch.active_patches()
