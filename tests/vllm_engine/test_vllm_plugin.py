"""The plugin's registration and its two methods against vLLM's own CPU MLA implementation (no engine)."""
import importlib.metadata
import os
import subprocess
import sys
import types

import pytest
import torch

L, R, HEADS, BS = 512, 64, 4, 16


@pytest.fixture
def fresh_plugin(monkeypatch):
    """The plugin module with its per-process state and vLLM's CPU MLA overrides reset (restored after)."""
    from vllm.v1.attention.backends.registry import _ATTN_OVERRIDES

    import mla_ops.integrations.vllm as plugin

    saved_overrides = dict(_ATTN_OVERRIDES)
    monkeypatch.setattr(plugin, "_state", None)
    _ATTN_OVERRIDES.clear()
    yield plugin
    _ATTN_OVERRIDES.clear()
    _ATTN_OVERRIDES.update(saved_overrides)


def test_entry_point_is_installed():
    eps = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="vllm.general_plugins")}
    assert eps.get("mla_ops") == "mla_ops.integrations.vllm:register"


def test_register_routes_cpu_mla_once(fresh_plugin):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from mla_ops.integrations.vllm.cpu import MlaOpsCPUMLABackend, MlaOpsCPUMLAImpl

    state = fresh_plugin.register()
    assert state == "registered: CPU_MLA, AMX_MLA"
    backend = AttentionBackendEnum.CPU_MLA.get_class()
    assert backend is MlaOpsCPUMLABackend
    assert backend.get_name() == "CPU_MLA" and backend.get_impl_cls() is MlaOpsCPUMLAImpl
    assert AttentionBackendEnum.AMX_MLA.get_path() == fresh_plugin.AMX_BACKEND
    # the AMX route at least imports and keeps its name (it runs only on AMX CPUs)
    amx = AttentionBackendEnum.AMX_MLA.get_class()
    assert amx.get_name() == "AMX_MLA" and amx.get_impl_cls().__name__ == "MlaOpsAMXMLAImpl"
    # vLLM calls general plugins once per process, but several entry points may; a second call is a no-op
    assert fresh_plugin.register() == state


def test_cpu_platform_selects_the_plugin_backend(fresh_plugin):
    from vllm.platforms import current_platform

    fresh_plugin.register()
    selector = types.SimpleNamespace(use_sparse=False, use_mla=True)
    path = current_platform.get_attn_backend_cls(None, selector)
    assert path in (fresh_plugin.CPU_BACKEND, fresh_plugin.AMX_BACKEND)


@pytest.mark.parametrize("value", ["0", "false", "off"])
def test_switch_off_leaves_vllm_untouched(fresh_plugin, monkeypatch, value):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    monkeypatch.setenv("MLA_OPS_VLLM_PLUGIN", value)
    assert fresh_plugin.register().startswith("disabled by MLA_OPS_VLLM_PLUGIN")
    assert not AttentionBackendEnum.CPU_MLA.is_overridden()


def test_unsupported_vllm_version_is_refused_with_reason(fresh_plugin, monkeypatch):
    import vllm
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    monkeypatch.setattr(vllm, "__version__", "0.31.2")
    state = fresh_plugin.register()
    assert "0.31.2 is not a supported version" in state and "MLA_OPS_VLLM_ALLOW_UNTESTED=1" in state
    assert not AttentionBackendEnum.CPU_MLA.is_overridden()
    monkeypatch.setattr(fresh_plugin, "_state", None)
    monkeypatch.setenv("MLA_OPS_VLLM_ALLOW_UNTESTED", "1")
    assert fresh_plugin.register() == "registered: CPU_MLA, AMX_MLA"


def test_disabled_plugin_does_not_import_vllm():
    # (importing any mla_ops module imports the package, i.e. torch and the op registrations; vLLM processes
    # have torch loaded already, so what matters is that a switched-off plugin pulls in nothing of vLLM)
    code = ("import sys, mla_ops.integrations.vllm as p; print(p.register()); "
            "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')))")
    env = dict(os.environ, MLA_OPS_VLLM_PLUGIN="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout
    assert out.splitlines() == ["disabled by MLA_OPS_VLLM_PLUGIN=0", "[]"]


def _impls():
    """vLLM's CPUMLAImpl and the plugin's, built as MLAAttention builds them."""
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

    from mla_ops.integrations.vllm.cpu import MlaOpsCPUMLAImpl

    args = dict(num_heads=HEADS, head_size=L + R, scale=(64 + R) ** -0.5 * 1.3, num_kv_heads=1,
                alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto", logits_soft_cap=None,
                attn_type=AttentionType.DECODER,
                kv_sharing_target_layer_name=None, q_lora_rank=None, kv_lora_rank=L, qk_nope_head_dim=64,
                qk_rope_head_dim=R, qk_head_dim=64 + R, v_head_dim=64, kv_b_proj=None, indexer=None)
    return CPUMLAImpl(**args), MlaOpsCPUMLAImpl(**args)


def _decode_metadata(seq_lens, num_blocks, width, gen):
    """Decode metadata as vLLM's builder makes it: int32 block table rows of distinct shuffled blocks,
    columns past a row's length left as whatever the table holds (here: other valid ids)."""
    from vllm.model_executor.layers.attention.mla_attention import MLACommonDecodeMetadata

    perm = torch.randperm(num_blocks, generator=gen)[: len(seq_lens) * width].view(len(seq_lens), width)
    decode = MLACommonDecodeMetadata(block_table=perm.to(torch.int32), dcp_tot_seq_lens=None,
                                     seq_lens=torch.tensor(seq_lens, dtype=torch.int32))
    return types.SimpleNamespace(decode=decode)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("as_tuple", [True, False])
def test_forward_mqa_matches_vllm_cpu_kernel(dtype, atol, as_tuple):
    from mla_ops.integrations.vllm.cpu import CALLS

    gen = torch.Generator().manual_seed(1)
    stock, ours = _impls()
    cache = torch.randn(64, BS, L + R, generator=gen).to(dtype)
    seq_lens = [1, 15, 16, 17, 40, 100]  # a single token, block edges, several blocks
    meta = _decode_metadata(seq_lens, 64, 8, gen)
    ql_nope = torch.randn(HEADS, len(seq_lens), L, generator=gen).to(dtype).transpose(0, 1)  # as forward_impl
    q_pe = torch.randn(len(seq_lens), HEADS, 64 + R, generator=gen).to(dtype)[..., 64:]  # a strided slice
    q = (ql_nope, q_pe) if as_tuple else torch.cat([ql_nope, q_pe], -1)
    layer = types.SimpleNamespace(layer_name="model.layers.0.self_attn.attn")
    before = sum(CALLS.values())
    expected, _ = stock.forward_mqa(q, cache, meta, layer)
    got, lse = ours.forward_mqa(q, cache, meta, layer)
    assert lse is None and got.shape == (len(seq_lens), HEADS, L) and got.dtype == dtype
    assert sum(CALLS.values()) == before + 1
    torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_update_is_bit_equal_to_vllm(dtype):
    gen = torch.Generator().manual_seed(2)
    stock, ours = _impls()
    tokens = 37
    kv_c = torch.randn(tokens, L, generator=gen).to(dtype)
    k_pe = torch.randn(tokens, 1, R, generator=gen).to(dtype)
    slots = torch.randperm(20 * BS, generator=gen)[:tokens]
    slots[[3, 20]] = -1  # padding slots: must be skipped
    cache_stock = torch.zeros(20, BS, L + R, dtype=dtype)
    cache_ours = torch.zeros(20, BS, L + R, dtype=dtype)
    ptr = cache_ours.data_ptr()
    stock.do_kv_cache_update(kv_c, k_pe, cache_stock, slots, "auto", torch.ones(()))
    ours.do_kv_cache_update(kv_c, k_pe, cache_ours, slots, "auto", torch.ones(()), skip_scale=True)
    assert cache_ours.data_ptr() == ptr
    assert torch.equal(cache_ours, cache_stock)
    assert int((cache_ours.abs().sum(-1) != 0).sum()) == tokens - 2


def test_quantized_cache_is_refused_clearly():
    _, ours = _impls()
    cache = torch.zeros(4, BS, L + R)
    with pytest.raises(NotImplementedError, match="kv_cache_dtype='fp8'.*not supported"):
        ours.do_kv_cache_update(torch.zeros(1, L), torch.zeros(1, 1, R), cache,
                                torch.zeros(1, dtype=torch.long), "fp8", torch.ones(()))
