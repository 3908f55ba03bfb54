"""Backend selection end to end: the pypto_sim backend behind torch.ops.mla on CPU, explicit
requests that cannot be met, and the NPU dispatch policy as plain functions."""
import os
import platform
import subprocess
import sys

import pytest
import torch

import mla_ops
from mla_ops import backends, pypto_runtime
from mla_ops.backends.npu import use_fused_kv_prolog

from utils import LITE, SMALL, paged_case, prolog_inputs, prolog_kwargs

REASONS = pypto_runtime.unavailable_reasons()
needs_pypto = pytest.mark.skipif(bool(REASONS), reason="; ".join(REASONS) or "pypto 0.2.0 available")


@pytest.mark.pypto
@needs_pypto
def test_kv_prolog_through_the_pypto_sim_backend_matches_reference():
    """B=2, S=3 (prefill, so the token-major kernel layout must be transposed back right), bf16 V2-Lite dims."""
    from mla_ops.bench import npu_sim

    dims = LITE.__class__("lite-prefill", B=2, S=3, H=LITE.H, N=LITE.N, L=LITE.L, R=LITE.R, P=LITE.P, V=LITE.V)
    args = prolog_inputs(dims, torch.bfloat16)
    kwargs = prolog_kwargs(dims)
    expected = torch.ops.mla.kv_prolog(*args, **kwargs)
    with mla_ops.use_backend("pypto_sim"):
        assert mla_ops.explain("kv_prolog", *args, **kwargs).startswith("mla.kv_prolog: pypto_sim")
        got = torch.ops.mla.kv_prolog(*args, **kwargs)
    result = pypto_runtime.last_result()
    assert result.kernel.startswith("kv_prolog_stage2") and result.failed == [] and result.aicore_us > 0
    assert torch.equal(got[2], expected[2]), "k_pe: the same fp32 rotation, bit-identical"
    # k_nope / value: the reference GEMM and the kernel's per-head matmuls accumulate in other orders
    hidden, kv_a, _, norm_w, kv_b, cos, sin = args
    from mla_ops.ops.kv_prolog import latent_stage

    _, latent, _ = latent_stage(hidden, kv_a, None, norm_w, 1e-6)
    inputs = {"normed_ckv": latent.reshape(-1, dims.L), "kv_b_weight": kv_b}

    def token_major(t):  # [B, N, S, D] -> [T, N, D]
        return t.transpose(1, 2).reshape(dims.B * dims.S, dims.N, -1)

    npu_sim.assert_stage2_close([token_major(got[0]), token_major(got[1]), got[2].reshape(-1, dims.R)],
                              [token_major(expected[0]), token_major(expected[1]), expected[2].reshape(-1, dims.R)],
                              inputs, num_heads=dims.N, qk_nope_head_dim=dims.P)


@pytest.mark.pypto
@needs_pypto
def test_paged_ops_through_the_pypto_sim_backend_are_bit_exact():
    kc, vc, tables, cumsum, offsets = paged_case(12, 16, [5, 20, 3], key_shape=(1, 64), value_shape=(1, 32),
                                                 offsets=[16, 0, 32], columns=4)
    key, value = torch.zeros(30, 1, 64, dtype=torch.bfloat16), torch.zeros(30, 1, 32, dtype=torch.bfloat16)
    expected = torch.ops.mla.gather_pa_kv_cache_functional(kc, vc, tables, cumsum, key, value, seq_offset=offsets,
                                                           is_seq_lens_cumsum=True)
    slots = torch.tensor([3, -1, 150, 40])
    new_k, new_v = torch.randn(4, 1, 64).bfloat16(), torch.randn(4, 1, 32).bfloat16()
    ref_caches = kc.clone(), vc.clone()
    torch.ops.mla.scatter_pa_kv_cache(new_k, new_v, *ref_caches, slots)
    with mla_ops.use_backend("pypto_sim"):
        got = torch.ops.mla.gather_pa_kv_cache_functional(kc, vc, tables, cumsum, key, value, seq_offset=offsets,
                                                          is_seq_lens_cumsum=True)
        assert pypto_runtime.last_result().kernel.startswith("gather_pa_kv_cache")
        sim_caches = kc.clone(), vc.clone()
        torch.ops.mla.scatter_pa_kv_cache(new_k, new_v, *sim_caches, slots)
        # validation runs before the kernel, with the reference path's message
        with pytest.raises(ValueError, match="slot_mapping\\[0\\] = 999 is outside the cache"):
            torch.ops.mla.scatter_pa_kv_cache(new_k, new_v, *sim_caches, torch.tensor([999, 0, 1, 2]))
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert torch.equal(sim_caches[0], ref_caches[0]) and torch.equal(sim_caches[1], ref_caches[1])


def test_explicit_pypto_sim_refuses_fp32_with_the_reason():
    args = prolog_inputs(SMALL, torch.float32)
    with mla_ops.use_backend("pypto_sim"):
        text = mla_ops.explain("kv_prolog", *args, **prolog_kwargs(SMALL))
        assert "backend 'pypto_sim' was requested" in text and "float16 or bfloat16" in text, text
        with pytest.raises(NotImplementedError, match="no fp32 variant"):
            torch.ops.mla.kv_prolog(*args, **prolog_kwargs(SMALL))
        # ops the backend does not claim keep running on the reference kernels
        x, cos, sin = torch.randn(1, 2, 3, 8), torch.rand(3, 4), torch.rand(3, 4)
        assert torch.equal(torch.ops.mla.rope(x, cos, sin), backends.REFERENCE.kernels["rope"].fn(x, cos, sin))


@pytest.mark.pypto
@needs_pypto
def test_backend_from_the_environment_variable():
    code = ("import torch, mla_ops; from mla_ops import pypto_runtime as sim\n"
            "kc = torch.randn(4, 16, 1, 32).bfloat16(); vc = torch.randn(4, 16, 1, 16).bfloat16()\n"
            "k, v = mla_ops.gather_pa_kv_cache(kc, vc, torch.tensor([[2, 0]], dtype=torch.int32),"
            " torch.tensor([20], dtype=torch.int32))\n"
            "assert torch.equal(k[:16, 0], kc[2, :, 0]) and torch.equal(k[16:, 0], kc[0, :4, 0])\n"
            "print('aicore_us', sim.last_result().aicore_us)")
    env = dict(os.environ, MLA_OPS_BACKEND="pypto_sim", TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert float(out.stdout.split("aicore_us")[1]) > 0


def test_npu_policy_fused_for_short_token_counts():
    assert use_fused_kv_prolog(1, 16) and use_fused_kv_prolog(16, 16)
    assert not use_fused_kv_prolog(17, 16) and not use_fused_kv_prolog(2048, 16)
    assert not use_fused_kv_prolog(0, 16)  # nothing to launch: the baseline handles empties
    with pytest.raises(ValueError, match="num_tokens must be >= 0"):
        use_fused_kv_prolog(-1, 16)


def test_npu_threshold_from_the_environment():
    code = ("import mla_ops; s = mla_ops.settings.settings; "
            "print(s.npu_fused_max_tokens, s.npu_warmup_tokens)")
    env = dict(os.environ, MLA_OPS_NPU_FUSED_MAX_TOKENS="4", MLA_OPS_NPU_WARMUP_TOKENS="1,2,4",
               TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.stdout.split() == ["4", "(1,", "2,", "4)"], out.stderr


@pytest.mark.pypto
@needs_pypto
def test_simulator_leaves_the_process_environment_intact():
    """pypto 0.2.0's own torch probe swaps os.environ for a plain dict, after which torch inductor's
    compiled modules fail (they read an environment variable through getenv). The harness builds the
    calculator without it; a cold build in CI runs in this process before the compile tests."""
    from mla_ops.pypto_runtime.calculator import load_calculator

    pypto_runtime.ensure_supported()
    load_calculator()
    assert isinstance(os.environ, os._Environ)
    os.environ["MLA_OPS_ENV_PROBE"] = "1"
    try:
        probe = subprocess.run([sys.executable, "-c", "import os; print(os.environ.get('MLA_OPS_ENV_PROBE'))"],
                               capture_output=True, text=True, timeout=60)
        assert probe.stdout.strip() == "1"
    finally:
        del os.environ["MLA_OPS_ENV_PROBE"]


# `import mla_ops` with the native builds made unimportable, printing the RuntimeWarnings it raised
_IMPORT_WITHOUT_NATIVE = """
import importlib.abc, json, sys, warnings
class HideNativeExtension(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "mla_ops._C":
            raise ImportError(name + " hidden by the test")
        return None
sys.meta_path.insert(0, HideNativeExtension())
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import mla_ops
print(json.dumps([str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]))
"""


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                    reason="the import warning is for x86-64, where the native builds are expected")
@pytest.mark.parametrize("opted_out", [False, True], ids=["default", "MLA_OPS_NO_NATIVE=1"])
def test_import_warns_once_with_the_fix_when_the_native_extension_does_not_load(opted_out):
    import json

    env = {k: v for k, v in os.environ.items() if not k.startswith("MLA_OPS_")}
    if opted_out:
        env["MLA_OPS_NO_NATIVE"] = "1"
    done = subprocess.run([sys.executable, "-c", _IMPORT_WITHOUT_NATIVE], env=env, capture_output=True, text=True,
                          timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr
    messages = json.loads(done.stdout.strip().splitlines()[-1])
    if opted_out:
        assert messages == []
    else:
        assert len(messages) == 1, messages
        assert "native CPU kernels are unavailable" in messages[0]
        assert "pip install --no-build-isolation ." in messages[0] and "MLA_OPS_NO_NATIVE=1" in messages[0]
