"""The npu backend's Python paths on CPU, through the torch_npu stand-in (tests/npu_standin).

Each test runs in a subprocess with the stand-in on PYTHONPATH, so the import order is the one under
test and nothing leaks into this process (the stand-in renames PrivateUse1 to "npu", irreversibly).
What this proves: registration timing, the backend/path choice and fallbacks, the arguments our code
passes to torch_npu / torchair / transformers, the selftest's steps. What it does not: NPU kernels,
NPU numerics, PyPTO's NPU launch (stood in by the driver), aclgraph capture of real kernels.
"""
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
STANDIN = ROOT / "tests" / "npu_standin"
PRELUDE = "import sys; sys.path.insert(0, %r); sys.path.insert(0, %r)\n" % (str(ROOT / "tests"), str(STANDIN))


def run(code: str, *, autoload: str = "0", torchair: str = "", timeout: int = 300) -> str:
    paths = [str(STANDIN)] + ([str(STANDIN / torchair)] if torchair else [])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths + [str(ROOT)]), TORCH_DEVICE_BACKEND_AUTOLOAD=autoload)
    env.pop("MLA_OPS_BACKEND", None)
    out = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(code)], capture_output=True, text=True,
                         env=env, timeout=timeout, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


@pytest.mark.parametrize("autoload", ["0", "1"])
def test_npu_kernels_are_bound_whichever_imports_first(autoload):
    """AUTOLOAD=1: `import torch` imports (the stand-in) torch_npu through its entry point, before
    mla_ops. AUTOLOAD=0: torch_npu is imported after mla_ops, as `mla-ops ask --device 0` does. Either
    way kv_prolog on an npu tensor reaches the npu kernel through the dispatcher's PrivateUse1 key."""
    run("""
        import os, torch
        loaded_first = "torch_npu" in sys.modules
        assert loaded_first == (os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] == "1"), loaded_first
        import mla_ops
        assert torch._C._dispatch_has_kernel_for_dispatch_key("mla::kv_prolog", "PrivateUse1")
        import torch_npu, run_with_standin as d
        from utils import SMALL, prolog_inputs, prolog_kwargs
        args = [a.to("npu") if a is not None else None for a in prolog_inputs(SMALL, torch.bfloat16)]
        out = torch.ops.mla.kv_prolog(*args, **prolog_kwargs(SMALL))
        assert out[0].device.type == "npu" and d.STAGE2_CALLS == [(6, torch.bfloat16, "interleaved", "npu", "npu")]
    """, autoload=autoload)


def test_cli_warmup_compiles_the_fused_kernel_after_a_late_torch_npu_import():
    """The CLI's order: mla_ops first, torch_npu when --device 0 is resolved, then the warm-up."""
    out = run("""
        import torch, mla_ops
        assert "torch_npu" not in sys.modules
        from mla_ops.cli.runtime import resolve_device
        device = resolve_device("0")
        assert device.type == "npu" and "torch_npu" in sys.modules
        import run_with_standin as d
        from mla_ops.backends import npu
        from mla_ops.cli.loading import builtin_model
        model, _ = builtin_model(torch.bfloat16, torch.device("cpu"))
        model.to(device)
        npu.warmup(model)
        print(d.STAGE2_CALLS)
        assert [c[0] for c in d.STAGE2_CALLS] == [1, 2] and all(c[3:] == ("npu", "npu") for c in d.STAGE2_CALLS)
    """)
    assert "npu" in out


def test_kv_prolog_falls_back_to_the_baseline_when_stage2_cannot_take_the_call():
    """pypto other than 0.2.0 (or missing), fp32, 17 tokens: the torch_npu baseline, never an error,
    the same outputs, and explain() names the path and the reason."""
    run("""
        import torch, mla_ops, torch_npu, run_with_standin as d
        from mla_ops import pypto_runtime
        from mla_ops.backends import npu
        from utils import SMALL, prolog_inputs, prolog_kwargs
        def on_npu(dtype, dims=SMALL):
            cpu = prolog_inputs(dims, dtype)
            return cpu, [a.to("npu") if a is not None else None for a in cpu]
        cpu, dev = on_npu(torch.float32)               # unsupported dtype
        out = torch.ops.mla.kv_prolog(*dev, **prolog_kwargs(SMALL))
        ref = torch.ops.mla.kv_prolog(*cpu, **prolog_kwargs(SMALL))
        assert d.STAGE2_CALLS == [] and all(torch.allclose(o.cpu(), r, atol=1e-5) for o, r in zip(out, ref))
        # another pypto: the stage-2 reasons say so (memoised per signature: cleared after the change)
        pypto_runtime.unavailable_reasons = lambda: ("pypto 0.3.0 is installed, but ...",)
        npu.fused_kv_prolog_reasons.cache_clear()
        cpu, dev = on_npu(torch.bfloat16)
        out = torch.ops.mla.kv_prolog(*dev, **prolog_kwargs(SMALL))   # the fused kernel would raise
        ref = torch.ops.mla.kv_prolog(*cpu, **prolog_kwargs(SMALL))
        assert d.STAGE2_CALLS == [], d.STAGE2_CALLS
        assert all(torch.allclose(o.cpu().float(), r.float(), atol=3e-2) for o, r in zip(out, ref))
        # the same under an explicit demand for the npu backend: the baseline is the npu backend's own
        with mla_ops.use_backend("npu"):
            torch.ops.mla.kv_prolog(*dev, **prolog_kwargs(SMALL))
        text = mla_ops.explain("kv_prolog", *dev, **prolog_kwargs(SMALL))
        assert "path: torch_npu baseline" in text and "pypto 0.3.0" in text, text
        big = [a.to("npu") if a is not None else None for a in prolog_inputs(SMALL.__class__(
            "t17", B=1, S=17, H=32, N=4, L=16, R=8, P=8, V=12), torch.bfloat16)]
        text = mla_ops.explain("kv_prolog", *big, **prolog_kwargs(SMALL))
        assert "17 tokens" in text, text
    """)


def test_fused_reasons_are_memoised_per_signature():
    run("""
        import torch, mla_ops, torch_npu, run_with_standin as d
        from mla_ops.backends import npu
        from mla_ops.backends import staged_kv_prolog
        from utils import SMALL, prolog_inputs, prolog_kwargs
        calls = []
        real = npu.stage2_not_supported_reasons
        npu.stage2_not_supported_reasons = lambda *a, **k: calls.append(1) or real(*a, **k)
        dev = [a.to("npu") if a is not None else None for a in prolog_inputs(SMALL, torch.bfloat16)]
        for _ in range(5):
            torch.ops.mla.kv_prolog(*dev, **prolog_kwargs(SMALL))
        assert len(calls) == 1 and len(d.STAGE2_CALLS) == 5, (calls, d.STAGE2_CALLS)
    """)


def test_gather_falls_back_to_the_reference_kernel_and_an_explicit_demand_is_refused():
    run("""
        import torch, mla_ops, torch_npu, pytest
        from utils import paged_case
        kc, vc, tables, lens, _ = paged_case(8, 16, [5, 20], key_shape=(1, 64), value_shape=(1, 32))
        # a strided key cache (a split view of a combined cache), which the PyPTO gather does not take
        wide = torch.zeros(8, 16, 1, 96, dtype=kc.dtype).to("npu"); wide[..., :64] = kc.to("npu")
        args = (wide[..., :64], vc.to("npu"), tables.to("npu"), lens.to("npu"))
        key = torch.zeros(25, 1, 64, dtype=kc.dtype).to("npu")
        value = torch.zeros(25, 1, 32, dtype=vc.dtype).to("npu")
        text = mla_ops.explain("gather_pa_kv_cache", *args, key, value, is_seq_lens_cumsum=True)
        assert text.startswith("mla.gather_pa_kv_cache: reference") and "not npu" in text, text
        torch.ops.mla.gather_pa_kv_cache(*args, key, value, is_seq_lens_cumsum=True)
        want = torch.zeros(25, 1, 64, dtype=kc.dtype)
        torch.ops.mla.gather_pa_kv_cache(kc, vc, tables, lens, want, torch.zeros(25, 1, 32, dtype=vc.dtype),
                                         is_seq_lens_cumsum=True)
        assert torch.equal(key.cpu(), want)
        with mla_ops.use_backend("npu"), pytest.raises(NotImplementedError, match="cannot serve this call"):
            torch.ops.mla.gather_pa_kv_cache(*args, key, value, is_seq_lens_cumsum=True)
    """)


@pytest.mark.parametrize("torchair, expect", [
    ("torchair_old", "npu_backend"),   # before 7.3: CompilerConfig path; the backend takes no extra kwargs
    ("torchair_new", "npugraph_ex"),   # current: the npugraph_ex backend, options through torch.compile
])
def test_graph_mode_configuration_follows_the_installed_torchair(torchair, expect):
    """transformers compiles with torch.compile(**compile_config.to_dict()); the stand-in backends
    have the signatures of old/new torchair, so passing mode= to the old one is a TypeError."""
    out = run(f"""
        import torch, mla_ops, torch_npu, torchair
        from mla_ops.cli.graph import compile_settings
        cfg = compile_settings(torch.device("npu", 0), say=print)["compile_config"]
        kwargs = cfg.to_dict()
        fn = torch.compile(lambda x: x * 2 + 1, **kwargs)
        with torch_npu.standin_paused():  # CPU tensors: this checks the backend's calling convention only
            assert torch.equal(fn(torch.ones(3)), torch.full((3,), 3.0))
        what = torchair.COMPILED[-1]
        print("USED", what[0] if isinstance(what, tuple) else "npu_backend")
        if {expect!r} == "npu_backend":
            config = what[1] if isinstance(what, tuple) else what
            assert config.mode == "reduce-overhead" and config.experimental_config.frozen_parameter
            assert not config.experimental_config.tiling_schedule_optimize  # GE-only, ignored in aclgraph
        else:
            assert what[2] == {{"options": {{"frozen_parameter": True}}}}, what
    """, torchair=torchair)
    assert f"USED {expect}" in out


def test_graph_mode_refuses_ge_with_the_reason():
    run("""
        import os, torch, mla_ops, torch_npu, pytest
        from mla_ops.cli.graph import compile_settings
        from mla_ops.cli.runtime import CliError
        os.environ["MLA_OPS_NPU_GRAPH"] = "max-autotune"
        with pytest.raises(CliError, match="GE graph mode .* not supported.*PyPTO kernel"):
            compile_settings(torch.device("npu", 0), say=print)
        os.environ["MLA_OPS_NPU_GRAPH"] = "npugraph_ex"   # asked for, not provided by this torchair
        with pytest.raises(CliError, match="no torch.compile backend named npugraph_ex"):
            compile_settings(torch.device("npu", 0), say=print)
    """, torchair="torchair_old")


def test_selftest_on_the_standin_npu():
    """Every npu row of `mla-ops selftest --device 0` on the stand-in except generate: transformers
    takes accelerator-only paths for a non-CPU device (its MoE calls torch.histc on integer tensors,
    which the stand-in's CPU kernels lack), and graph mode cannot compile under a dispatch mode.
    Every op of the case database runs on the npu device (the npu kernels where they serve, the
    reference kernels' sync-free paths elsewhere) against the reference kernel on the CPU and the
    oracle; the host time is reported, not judged."""
    from mla_ops.testing.cases import CASES

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(STANDIN), str(ROOT)]), TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    out = subprocess.run([sys.executable, str(STANDIN / "run_with_standin.py"), "selftest", "--device", "0",
                          "--no-generate"], capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    table = out.stdout.split("check ", 1)[1]
    lines = table.splitlines()

    def row(check):
        return next(line for line in lines if line.startswith(check + " "))

    for check in ("bound on PrivateUse1: kv_prolog", "kv_prolog path T=1 bf16 interleaved",
                  "kv_prolog path T=17 fp16 half", "kv_prolog graph capture + replay"):
        assert " PASS " in row(check), row(check)
    for op, cases in CASES.items():
        for name in cases.selftest:
            assert " PASS " in row(f"{op} {name} bf16"), row(f"{op} {name} bf16")
    assert "PASS     npu (" in row("kv_prolog v2lite bf16")
    assert "PASS     reference;" in row("mla_decode_attention v2lite-ragged bf16")
    assert "equal to torch_npu.npu_gather_pa_kv_cache" in row("gather_pa_kv_cache cumsum-offset-uncovered-rows bf16")
    assert " INFO " in row("host time per kv_prolog call")
    assert "fused" in row("kv_prolog path T=16 bf16 half") and "baseline" in row("kv_prolog path T=17 bf16 half")


def test_npu_rms_norm_takes_the_strided_latent_view_without_a_copy():
    """Stage 1 hands npu_rms_norm the [.., L] split view of the kv_a output (row stride L + R)."""
    run("""
        import torch, mla_ops, torch_npu, run_with_standin as d
        from utils import SMALL, prolog_inputs, prolog_kwargs
        seen = []
        real = torch_npu.npu_rms_norm
        torch_npu.npu_rms_norm = lambda x, *a, **k: seen.append((x.is_contiguous(), x.stride())) or real(x, *a, **k)
        dev = [a.to("npu") if a is not None else None for a in prolog_inputs(SMALL, torch.bfloat16)]
        torch.ops.mla.kv_prolog(*dev, **prolog_kwargs(SMALL))
        assert seen == [(False, (SMALL.S * (SMALL.L + SMALL.R), SMALL.L + SMALL.R, 1))], seen
    """)


# --- the vllm-ascend adapter's route decision (vllm_ascend stood in by tests/npu_standin/vllm_ascend) ---
ASCEND_ROUTE_PRELUDE = """
import types, torch, mla_ops
from mla_ops.integrations.vllm import ascend
from vllm_ascend.platform import NPUPlatform
mla = types.SimpleNamespace(use_mla=True)
original = NPUPlatform.get_attn_backend_cls
"""


def run_ascend(code: str) -> str:
    return run(ASCEND_ROUTE_PRELUDE + textwrap.dedent(code))


def test_ascend_adapter_keeps_vllm_ascends_decode_while_no_npu_kernel_serves_it():
    out = run_ascend("""
        from mla_ops.backends import candidates
        assert [b.name for b in candidates("mla_decode_attention", "npu")] == ["reference"]
        state = ascend.register()
        print(state)
        assert state.startswith("not routed: ASCEND_MLA decode stays vLLM's"), state
        assert "its reference kernel" in state and "MLA_OPS_VLLM_ROUTE=mla-ops" in state
        assert NPUPlatform.get_attn_backend_cls == original  # vllm-ascend untouched
        assert NPUPlatform.get_attn_backend_cls(None, mla) == ascend.ASCEND_MLA
    """)
    assert "not routed" in out


def test_ascend_adapter_routes_when_asked_or_once_an_npu_kernel_serves_the_decode():
    run_ascend("""
        import os
        os.environ["MLA_OPS_VLLM_ROUTE"] = "mla-ops"
        state = ascend.register()
        assert state.startswith("registered: ASCEND_MLA decode -> torch.ops.mla.mla_decode_attention"), state
        assert "forced by MLA_OPS_VLLM_ROUTE=mla-ops" in state
        assert NPUPlatform.get_attn_backend_cls(None, mla) == ascend.ADAPTER_BACKEND
        assert NPUPlatform.get_attn_backend_cls(None, types.SimpleNamespace(use_mla=False)).endswith(
            "AscendAttentionBackend")
        assert ascend.register().endswith("(already wrapped)")
    """)
    # an NPU kernel for the decode (here: the reference kernel declared as the npu backend's) flips the
    # automatic decision, with no switch set
    run_ascend("""
        from mla_ops.backends import REFERENCE, candidates, npu
        npu.NPU.kernel("mla_decode_attention")(REFERENCE.kernels["mla_decode_attention"].fn)
        assert candidates("mla_decode_attention", "npu")[0].name == "npu"
        state = ascend.register()
        assert state.startswith("registered: ASCEND_MLA decode -> torch.ops.mla"), state
        assert NPUPlatform.get_attn_backend_cls(None, mla) == ascend.ADAPTER_BACKEND
    """)


# --- sparse attention: torch_npu's lightning indexer and sparse flash attention ---
SPARSE_PRELUDE = """
import torch, mla_ops, torch_npu, pytest
torch.manual_seed(0)
def requests(block_size=16, num_blocks=12, seq_lens=(40, 7, 33), q_lens=(3, 1, 33), width=4):
    perm = torch.randperm(num_blocks)
    tables = torch.full((len(seq_lens), width), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(seq_lens):
        need = -(-n // block_size)
        tables[b, :need] = perm[used:used + need].to(torch.int32); used += need
    loc = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32)
    return tables, torch.tensor(seq_lens, dtype=torch.int32), loc
def indexer_args(heads=8, dim=128, dtype=torch.bfloat16, block_size=16, topk=20, weights_dtype=torch.float32):
    tables, lens, loc = requests(block_size=block_size, num_blocks=max(12, 192 // block_size),
                                 width=max(4, 64 // block_size))
    T = int(loc[-1])
    q = torch.randn(T, heads, dim).to(dtype)
    w = torch.randn(T, heads).to(weights_dtype)
    k = torch.randn(tables.shape[1] * 3 * 64 // block_size, block_size, 1, dim).to(dtype)
    return (q, w, k, tables, lens, loc, topk, dim ** -0.5)
def sparse_args(heads=4, latent=512, rope=64, dtype=torch.bfloat16, block_size=16, topk=12):
    tables, lens, loc = requests(block_size=block_size, num_blocks=max(12, 192 // block_size),
                                 width=max(4, 64 // block_size))
    T = int(loc[-1])
    nb = tables.shape[1] * 3 * 64 // block_size
    req = torch.repeat_interleave(torch.arange(3), loc[1:] - loc[:-1])
    idx = torch.stack([torch.randint(0, int(lens[r]), (topk,)) for r in req.tolist()]).to(torch.int32)
    if topk >= 3:
        idx[::2, -3:] = -1      # -1s in the tail and in the middle: the kernel moves them last
        idx[1, 0] = -1
        idx[3] = -1             # a token with nothing listed: zeros
    return (torch.randn(T, heads, latent).to(dtype), torch.randn(T, heads, rope).to(dtype),
            torch.randn(nb, block_size, 1, latent).to(dtype), torch.randn(nb, block_size, 1, rope).to(dtype),
            tables, lens, loc, idx, 0.07)
def on_npu(args):
    return tuple(a.to("npu") if isinstance(a, torch.Tensor) else a for a in args)
def npu_and_reference(op, kernel, args):
    '''mla.<op> on the stand-in npu, checked to be served by torch_npu.<kernel>, and on CPU:
    (npu result on the host, reference result, the arguments torch_npu.<kernel> was called with).'''
    text = mla_ops.explain(op, *on_npu(args))
    assert text.startswith(f"mla.{op}: npu") and f"torch_npu.{kernel}" in text, text
    got = getattr(torch.ops.mla, op)(*on_npu(args)).cpu()
    want = getattr(torch.ops.mla, op)(*args)
    name, call = torch_npu.SPARSE_CALLS[-1]
    assert name == kernel, name
    return got, want, call
"""


def run_sparse(code: str) -> str:
    return run(SPARSE_PRELUDE + textwrap.dedent(code))


def test_sparse_ops_are_bound_to_torch_npus_fused_kernels():
    run_sparse("""
        from mla_ops.backends import candidates
        for op in ("lightning_indexer", "sparse_mla_attention"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key("mla::" + op, "PrivateUse1"), op
            assert [b.name for b in candidates(op, "npu")] == ["npu", "reference"], op
    """)


def test_lightning_indexer_reaches_torch_npu_with_the_documented_arguments():
    """TND query, PA_BSND key, int32 cumulative query lengths (no leading 0) and per-request key
    lengths, sparse_mode=3, the weights with softmax_scale folded in; the same positions as
    the reference kernel (as sets: the fused kernel's tie order is not documented), -1 past p + 1."""
    run_sparse("""
        args = indexer_args()
        got, want, call = npu_and_reference("lightning_indexer", "npu_lightning_indexer", args)
        T, H, D = args[0].shape
        assert call["layout_query"] == "TND" and call["layout_key"] == "PA_BSND" and call["sparse_mode"] == 3
        assert call["sparse_count"] == 20 and call["query"] == ((T, H, D), torch.bfloat16, True)
        assert call["weights"] == ((T, H), torch.float32, True)  # fp32 kept, scale folded in
        assert call["actual_seq_lengths_query"] == ((3,), torch.int32, True)
        assert call["actual_seq_lengths_key"] == ((3,), torch.int32, True)
        assert call["block_table"][1] == torch.int32
        assert got.dtype == torch.int32 and got.shape == want.shape == (T, 20)
        for t in range(T):
            assert set(got[t].tolist()) == set(want[t].tolist()), (t, got[t], want[t])
            n = int((want[t] >= 0).sum())
            assert (got[t, n:] == -1).all() and (got[t, :n] >= 0).all(), (t, got[t])
        # int64 request tensors: converted to int32 on the way
        args64 = args[:3] + tuple(a.long() for a in args[3:6]) + args[6:]
        got64 = torch.ops.mla.lightning_indexer(*on_npu(args64)).cpu()
        assert torch.equal(got64, got)
        assert torch_npu.SPARSE_CALLS[-1][1]["block_table"][1] == torch.int32
    """)


def test_sparse_mla_attention_reaches_torch_npu_with_the_documented_arguments():
    """MLA-absorb: query = q_latent, query_rope = q_pe, key = value = the latent cache, key_rope =
    the k_pe cache; sparse_indices [T, 1, K] int32 with the -1s moved last; the reference's result."""
    run_sparse("""
        args = sparse_args()
        got, want, call = npu_and_reference("sparse_mla_attention", "npu_sparse_flash_attention", args)
        T, N, L = args[0].shape
        assert call["value_is_key"]
        assert call["layout_query"] == "TND" and call["layout_kv"] == "PA_BSND" and call["attention_mode"] == 2
        assert call["sparse_mode"] == 0 and call["sparse_block_size"] == 1 and call["scale_value"] == 0.07
        assert call["sparse_indices"] == ((T, 1, 12), torch.int32, True)
        assert call["key"][0] == args[2].shape and call["key_rope"][0] == args[3].shape
        assert call["query_rope"] == ((T, N, 64), torch.bfloat16, True)
        assert call["actual_seq_lengths_query"][1:] == call["actual_seq_lengths_kv"][1:] == (torch.int32, True)
        assert got.dtype == torch.bfloat16 and got.shape == (T, N, L)
        assert torch.equal(got[3], torch.zeros(N, L, dtype=got.dtype))
        assert torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2), (got.float() - want.float()).abs().max()
        # the indexer's output feeds it directly
        q, w, kc, tables, lens, loc = indexer_args()[:6]
        idx = torch.ops.mla.lightning_indexer(*on_npu((q, w, kc, tables, lens, loc, 20, 128 ** -0.5)))
        sargs = list(sparse_args()); sargs[7] = idx.cpu()
        got = torch.ops.mla.sparse_mla_attention(*on_npu(sargs)).cpu()
        want = torch.ops.mla.sparse_mla_attention(*sargs)
        assert torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    """)


@pytest.mark.parametrize("op, change, reason", [
    ("lightning_indexer", {"heads": 65}, "65 index heads"),
    ("lightning_indexer", {"dim": 64}, "index_head_dim 64"),
    ("lightning_indexer", {"dtype": "float32"}, "dtype torch.float32"),
    ("lightning_indexer", {"block_size": 8}, "block_size 8"),
    ("lightning_indexer", {"topk": 2049}, "topk 2049"),
    ("sparse_mla_attention", {"latent": 256}, "kv_lora_rank 256"),
    ("sparse_mla_attention", {"heads": 3}, "3 heads"),
    ("sparse_mla_attention", {"dtype": "float32"}, "dtype torch.float32"),
    ("sparse_mla_attention", {"block_size": 8}, "block_size 8"),
    ("sparse_mla_attention", {"topk": 0}, "topk width 0"),
])
def test_sparse_ops_fall_back_with_the_reason_and_a_demand_is_refused(op, change, reason):
    run_sparse(f"""
        make = indexer_args if {op!r} == "lightning_indexer" else sparse_args
        kwargs = {change!r}.copy()
        if "dtype" in kwargs:
            kwargs["dtype"] = getattr(torch, kwargs["dtype"])
        args = make(**kwargs)
        text = mla_ops.explain({op!r}, *on_npu(args))
        assert text.startswith("mla.{op}: reference") and "not npu" in text and {reason!r} in text, text
        calls = len(torch_npu.SPARSE_CALLS)
        got = getattr(torch.ops.mla, {op!r})(*on_npu(args)).cpu()
        assert len(torch_npu.SPARSE_CALLS) == calls  # torch_npu never called
        assert torch.equal(got, getattr(torch.ops.mla, {op!r})(*args))
        refused = pytest.raises(NotImplementedError, match="cannot serve this call.*" + {reason!r})
        with mla_ops.use_backend("npu"), refused:
            getattr(torch.ops.mla, {op!r})(*on_npu(args))
    """)
