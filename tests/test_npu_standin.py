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
def test_npu_kernels_serve_whichever_imports_first(autoload):
    """AUTOLOAD=1: `import torch` imports (the stand-in) torch_npu through its entry point, before
    mla_ops. AUTOLOAD=0: torch_npu is imported after mla_ops, as `mla-ops ask --device 0` does. Either
    way kv_prolog on an npu tensor reaches the npu kernel (through the op's CompositeExplicitAutograd entry,
    where the backend layer serves every device but the native CPU kernels' own)."""
    run("""
        import os, torch
        loaded_first = "torch_npu" in sys.modules
        assert loaded_first == (os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] == "1"), loaded_first
        import mla_ops
        assert ("kv_prolog", "npu", "npu") in mla_ops.backends.serving_report()
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
    oracle; every npu kernel is bound; kv_prolog, the decode attention, both scatters and both other
    prologs are captured (the stand-in's graph refuses a host synchronisation) and replayed with new
    inputs; the host time is reported, not judged."""
    from mla_ops.backends.npu import NPU
    from mla_ops.testing.cases import CASES

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(STANDIN), str(ROOT)]), TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    out = subprocess.run([sys.executable, str(STANDIN / "run_with_standin.py"), "selftest", "--device", "0",
                          "--no-generate"], capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    table = out.stdout.split("check ", 1)[1]
    lines = table.splitlines()

    def row(check):
        return next(line for line in lines if line.startswith(check + " "))

    for check in ("served on npu: kv_prolog", "kv_prolog path T=1 bf16 interleaved",
                  "kv_prolog path T=17 fp16 half", "kv_prolog graph capture + replay"):
        assert " PASS " in row(check), row(check)
    for op, cases in CASES.items():
        for name in cases.selftest:
            assert " PASS " in row(f"{op} {name} bf16"), row(f"{op} {name} bf16")
    assert "PASS     npu (" in row("kv_prolog v2lite bf16")
    for op in sorted(NPU.kernels):
        assert " PASS " in row(f"served on npu: {op}"), row(f"served on npu: {op}")
    for op in ("mla_decode_attention", "scatter_pa_kv_cache", "scatter_pa_cache", "q_prolog", "latent_kv_prolog"):
        check = row(f"{op} graph capture + replay")
        assert " PASS " in check and "npu (torch_npu" in check, check
    decode_row = row("mla_decode_attention v2lite-block-128 bf16")
    assert "PASS     npu (torch_npu.npu_fused_infer_attention_score_v2" in decode_row, decode_row
    # this sample's pool holds fewer blocks than batch x table width: the reference kernel serves it
    assert "PASS     reference;" in row("mla_decode_attention v2lite-ragged bf16")
    assert "PASS     npu (torch_npu.npu_scatter_nd_update_" in row("scatter_pa_kv_cache padding bf16")
    assert "PASS     npu (torch_npu.npu_scatter_nd_update_" in row("scatter_pa_cache v2lite fp16")
    assert "PASS     npu (torch_npu composite" in row("q_prolog v2-lora-decode bf16")
    assert "PASS     npu (torch_npu composite" in row("latent_kv_prolog v2lite bf16")
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
    """Without the npu decode kernel (taken out of the backend here) the automatic route stays off."""
    out = run_ascend("""
        from mla_ops import backends
        from mla_ops.backends import candidates, npu
        del npu.NPU.kernels["mla_decode_attention"]
        backends.apply_setting()
        assert [b.name for b in candidates("mla_decode_attention", "npu")] == ["reference"]
        state = ascend.register()
        print(state)
        assert state.startswith("not routed: ASCEND_MLA decode stays vLLM's"), state
        assert "its reference kernel" in state and "MLA_OPS_VLLM_ROUTE=mla-ops" in state
        assert NPUPlatform.get_attn_backend_cls == original  # vllm-ascend untouched
        assert NPUPlatform.get_attn_backend_cls(None, mla) == ascend.ASCEND_MLA
    """)
    assert "not routed" in out


def test_ascend_adapter_routes_when_asked_and_not_unmeasured_by_default():
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
    # the npu backend's decode kernel (torch_npu's fused infer attention) serves the op, but it has not been
    # measured against vllm-ascend's own call on hardware: with no switch set the route stays off, saying so
    run_ascend("""
        from mla_ops.backends import candidates
        assert [b.name for b in candidates("mla_decode_attention", "npu")] == ["npu", "reference"]
        state = ascend.register()
        assert state.startswith("not routed: ASCEND_MLA decode stays vLLM's"), state
        assert "not measured" in state and "MLA_OPS_VLLM_ROUTE=mla-ops" in state
        assert NPUPlatform.get_attn_backend_cls(None, mla) == ascend.ASCEND_MLA
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
    name, call = torch_npu.CALLS[-1]
    assert name == kernel, name
    return got, want, call
"""


def run_sparse(code: str) -> str:
    return run(SPARSE_PRELUDE + textwrap.dedent(code))


def test_sparse_ops_are_served_by_torch_npus_fused_kernels():
    run_sparse("""
        from mla_ops.backends import candidates
        for op in ("lightning_indexer", "sparse_mla_attention"):
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
        assert torch_npu.CALLS[-1][1]["block_table"][1] == torch.int32
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
        calls = len(torch_npu.CALLS)
        got = getattr(torch.ops.mla, {op!r})(*on_npu(args)).cpu()
        assert len(torch_npu.CALLS) == calls  # torch_npu never called
        assert torch.equal(got, getattr(torch.ops.mla, {op!r})(*args))
        refused = pytest.raises(NotImplementedError, match="cannot serve this call.*" + {reason!r})
        with mla_ops.use_backend("npu"), refused:
            getattr(torch.ops.mla, {op!r})(*on_npu(args))
    """)


# --- paged decode attention, cache writes and prologs on torch_npu ---
PAGED_PRELUDE = """
import re, torch, mla_ops, torch_npu, pytest
import run_with_standin  # the PyPTO launches stood in (kv_prolog)
from mla_ops.backends import npu
from mla_ops.ops.decode_attention import decode_sync_free
from mla_ops.ops.scatter_pa_kv_cache import scatter_sync_free
from mla_ops.testing.cases import CASES
torch.manual_seed(0)
def decode_args(heads=4, latent=512, rope=64, dtype=torch.bfloat16, block_size=16, seq_lens=(40, 7, 33),
                width=4, spare_blocks=2, split_pool=False):
    '''q_latent [B, N, L], q_pe, a cache pair of B * width + spare_blocks blocks (or split views of one
    [NB, bs, 1, L+R] pool), tables with -1 past each row's blocks, int32 lengths, the scale.'''
    num_blocks = len(seq_lens) * width + spare_blocks
    perm = torch.randperm(num_blocks)
    tables = torch.full((len(seq_lens), width), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(seq_lens):
        need = -(-n // block_size)
        tables[b, :need] = perm[used:used + need].to(torch.int32); used += need
    if split_pool:
        pool = torch.randn(num_blocks, block_size, 1, latent + rope).to(dtype)
        kc, vc = pool[..., :latent], pool[..., latent:]
    else:
        kc = torch.randn(num_blocks, block_size, 1, latent).to(dtype)
        vc = torch.randn(num_blocks, block_size, 1, rope).to(dtype)
    batch = len(seq_lens)
    return (torch.randn(batch, heads, latent).to(dtype), torch.randn(batch, heads, rope).to(dtype), kc, vc, tables,
            torch.tensor(seq_lens, dtype=torch.int32), 0.06)
def to_npu(t):
    '''t on the npu; a strided view (a split pool) stays such a view of its base moved there.'''
    if t._base is not None and not t.is_contiguous():
        return t._base.to("npu").as_strided(t.shape, t.stride(), t.storage_offset())
    return t.to("npu")
def on_npu(args):
    return tuple(to_npu(a) if isinstance(a, torch.Tensor) else a for a in args)
def served_by_torch_npu(op, kernel, args, kwargs={}):
    text = mla_ops.explain(op, *on_npu(args), **kwargs)
    assert text.startswith(f"mla.{op}: npu") and f"torch_npu.{kernel}" in text, text
    return text
def calls_of(name, start=0):
    return [call for called, call in torch_npu.CALLS[start:] if called == name]
"""


def run_paged(code: str) -> str:
    return run(PAGED_PRELUDE + textwrap.dedent(code))


def test_paged_ops_and_prologs_are_served_by_the_npu_backend():
    run_paged("""
        from mla_ops.backends import candidates
        for op in ("mla_decode_attention", "scatter_pa_kv_cache", "scatter_pa_cache", "q_prolog", "latent_kv_prolog"):
            assert [b.name for b in candidates(op, "npu")] == ["npu", "reference"], op
    """)


def test_mla_decode_attention_reaches_torch_npu_with_the_documented_arguments():
    """MLA form of npu_fused_infer_attention_score_v2: BNSD query [B, N, 1, 512] + query_rope [B, N, 1, 64],
    key = value = the latent cache viewed [NB, 1, bs, 512], key_rope the k_pe cache viewed [NB, 1, bs, 64],
    one KV head, int32 block table clamped into the pool, a host list of lengths (the table's capacity:
    no host read of seq_lens) and seq_lens as a bool mask; the reference's result."""
    run_paged("""
        args = decode_args()
        served_by_torch_npu("mla_decode_attention", "npu_fused_infer_attention_score_v2", args)
        got = torch.ops.mla.mla_decode_attention(*on_npu(args)).cpu()
        want = torch.ops.mla.mla_decode_attention(*args)
        (call,) = calls_of("npu_fused_infer_attention_score_v2")
        B, N, L = args[0].shape
        NB, W = args[2].shape[0], args[4].shape[1]
        assert call["input_layout"] == "BNSD" and call["sparse_mode"] == 0 and call["block_size"] == 16
        assert call["num_query_heads"] == N and call["num_key_value_heads"] == 1 and call["softmax_scale"] == 0.06
        assert call["query"] == ((B, N, 1, L), torch.bfloat16, True)
        assert call["query_rope"] == ((B, N, 1, 64), torch.bfloat16, True)
        assert call["key"] == ((NB, 1, 16, L), torch.bfloat16, True) and call["value_is_key"]
        assert call["key_rope"] == ((NB, 1, 16, 64), torch.bfloat16, True)
        assert call["block_table"] == ((B, W), torch.int32, True)
        assert call["actual_seq_kvlen"] == [W * 16] * B      # a host list, from shapes only
        assert call["atten_mask"] == ((B, 1, 1, W * 16), torch.bool, True)
        assert call["actual_seq_qlen"] is None and call["inner_precise"] == 0 and not call["return_softmax_lse"]
        assert got.dtype == torch.bfloat16 and got.shape == (B, N, L)
        assert torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2), (got.float() - want.float()).abs().max()
        # int64 tables and lengths: converted on the device, the same result
        args64 = args[:4] + (args[4].long(), args[5].long(), args[6])
        assert torch.equal(torch.ops.mla.mla_decode_attention(*on_npu(args64)).cpu(), got)
        # rows the CPU kernel refuses (a length of 0, an invalid id inside a length): the reference's
        # device path (those positions unattended, an empty row zeros)
        tables, lens = args[4].clone(), args[5].clone()
        lens[1] = 0
        tables[2, 1] = 10_000
        odd = args[:4] + (tables, lens, args[6])
        got = torch.ops.mla.mla_decode_attention(*on_npu(odd)).cpu()
        want = decode_sync_free(*odd)
        assert torch.equal(got[1], torch.zeros_like(got[1]))
        assert torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2), (got.float() - want.float()).abs().max()
        # fp16 as well
        args16 = decode_args(dtype=torch.float16, heads=8, block_size=32, seq_lens=(90, 1), width=3)
        got = torch.ops.mla.mla_decode_attention(*on_npu(args16)).cpu()
        assert torch.allclose(got.float(), torch.ops.mla.mla_decode_attention(*args16).float(), atol=3e-3, rtol=3e-3)
    """)


def test_scatter_reaches_npu_scatter_nd_update_with_block_offset_indices():
    """npu_scatter_nd_update_(cache, [T, 2] (block, offset) indices, [T, H, D] rows) for each cache; the
    padding (-1) and out-of-range slots torch_npu cannot take are redirected on the device, so the caches
    equal the reference's (bit for bit), also for split views of one pool and with no token kept."""
    run_paged("""
        T, L, R, NB, bs = 7, 16, 8, 6, 4
        def caches(split=False):
            if split:
                pool = torch.randn(NB, bs, 1, L + R)
                return pool[..., :L], pool[..., L:]
            return torch.randn(NB, bs, 1, L), torch.randn(NB, bs, 1, R)
        key, value = torch.randn(T, 1, L), torch.randn(T, 1, R)
        slots = torch.tensor([5, 17, -1, 0, 23, -1, 9], dtype=torch.int32)
        for split in (False, True):
            kc, vc = caches(split)
            args = (key, value, kc, vc, slots)
            served_by_torch_npu("scatter_pa_kv_cache", "npu_scatter_nd_update_", args)
            start = len(torch_npu.CALLS)
            dev = on_npu(args)
            torch.ops.mla.scatter_pa_kv_cache(*dev)
            calls = calls_of("npu_scatter_nd_update_", start)
            assert [c["input"][:2] for c in calls] == [((NB, bs, 1, L), torch.float32), ((NB, bs, 1, R), torch.float32)]
            assert [c["indices"] for c in calls] == [((T, 2), torch.int64, True)] * 2
            assert [c["updates"][:2] for c in calls] == [((T, 1, L), torch.float32), ((T, 1, R), torch.float32)]
            assert calls[0]["input"][2] == (not split)  # the split views are written in place, as they are
            want_k, want_v = kc.clone(), vc.clone()
            torch.ops.mla.scatter_pa_kv_cache(key, value, want_k, want_v, slots)
            assert torch.equal(dev[2].cpu(), want_k) and torch.equal(dev[3].cpu(), want_v)
        # slots past the pool, which the CPU kernel refuses: skipped, as the reference's device path does
        kc, vc = caches()
        wild = torch.tensor([NB * bs, 3, -7, 2**40, 1, -1, 8])
        dev = on_npu((key, value, kc.clone(), vc.clone(), wild))
        torch.ops.mla.scatter_pa_kv_cache(*dev)
        want_k, want_v = kc.clone(), vc.clone()
        scatter_sync_free(key, value, want_k, want_v, wild)
        assert torch.equal(dev[2].cpu(), want_k) and torch.equal(dev[3].cpu(), want_v)
        # nothing kept: the caches stay as they were
        dev = on_npu((key, value, kc.clone(), vc.clone(), torch.full((T,), -1)))
        torch.ops.mla.scatter_pa_kv_cache(*dev)
        assert torch.equal(dev[2].cpu(), kc) and torch.equal(dev[3].cpu(), vc)
        # one pool (the indexer's key cache), bf16
        pool = torch.randn(NB, bs, 1, 128).to(torch.bfloat16)
        rows = torch.randn(T, 1, 128).to(torch.bfloat16)
        served_by_torch_npu("scatter_pa_cache", "npu_scatter_nd_update_", (rows, pool, slots))
        start = len(torch_npu.CALLS)
        dev = on_npu((rows, pool.clone(), slots))
        torch.ops.mla.scatter_pa_cache(*dev)
        assert len(calls_of("npu_scatter_nd_update_", start)) == 1
        want = pool.clone()
        torch.ops.mla.scatter_pa_cache(rows, want, slots)
        assert torch.equal(dev[1].cpu(), want)
    """)


def test_prologs_are_torch_npu_composites_and_say_why_not_npu_mla_prolog():
    """q_prolog / latent_kv_prolog: F.linear + npu_rms_norm + RoPE, with the reason torch_npu's
    npu_mla_prolog_v3 cannot serve them in explain(); the reference's result; latent_kv_prolog's latent
    is the one the npu kv_prolog expands (bit for bit)."""
    run_paged("""
        norms = []
        real = torch_npu.npu_rms_norm
        torch_npu.npu_rms_norm = lambda x, *a, **k: norms.append(tuple(x.shape)) or real(x, *a, **k)
        for op, name in (("q_prolog", "v2-lora-decode"), ("q_prolog", "small-lora-bias-half"),
                         ("q_prolog", "small-no-lora-neox"), ("latent_kv_prolog", "small-bias-half"),
                         ("latent_kv_prolog", "v2lite")):
            s = CASES[op].sample(torch.bfloat16, name)
            text = mla_ops.explain(op, *on_npu(s.args), **s.kwargs)
            assert text.startswith(f"mla.{op}: npu") and "path: torch_npu composite" in text, text
            assert "not torch_npu.npu_mla_prolog_v3" in text and "absorbs W_UK" in text, text
            norms.clear()
            got = getattr(torch.ops.mla, op)(*on_npu(s.args), **s.kwargs)
            assert len(norms) == (0 if name == "small-no-lora-neox" else 1), (name, norms)
            want = getattr(torch.ops.mla, op)(*s.args, **s.kwargs)
            for g, w in zip(got, want):
                assert g.shape == w.shape and g.dtype == w.dtype and g.is_contiguous()
                assert torch.allclose(g.cpu().float(), w.float(), atol=3e-2, rtol=3e-2), (op, name)
        s = CASES["kv_prolog"].sample(torch.bfloat16, "small")
        hidden, kv_a, kv_a_b, norm, kv_b, cos, sin = on_npu(s.args)
        latent, _ = torch.ops.mla.latent_kv_prolog(hidden, kv_a, kv_a_b, norm, cos, sin,
                                                   rope_layout=s.kwargs["rope_layout"])
        k_nope, _, _ = torch.ops.mla.kv_prolog(*on_npu(s.args), **s.kwargs)
        P = s.kwargs["qk_nope_head_dim"]
        expanded = torch.nn.functional.linear(latent, kv_b).view(*latent.shape[:2], s.kwargs["num_heads"], -1)
        assert torch.equal(expanded[..., :P].transpose(1, 2).cpu(), k_nope.cpu())
    """)


@pytest.mark.parametrize("op, change, reason", [
    ("mla_decode_attention", {"latent": 256}, "kv_lora_rank 256"),
    ("mla_decode_attention", {"rope": 32}, "rope_dim 32"),
    ("mla_decode_attention", {"heads": 3}, "3 heads"),
    ("mla_decode_attention", {"dtype": "float32"}, "dtype torch.float32"),
    ("mla_decode_attention", {"block_size": 8, "width": 6}, "block_size 8"),
    ("mla_decode_attention", {"block_size": 1024, "seq_lens": (700,), "width": 1}, "block_size 1024"),
    ("mla_decode_attention", {"split_pool": True}, "key_cache is not contiguous"),
    ("mla_decode_attention", {"spare_blocks": -3}, "num_blocks 9 < batch 3 x block-table width 4"),
    ("scatter_pa_kv_cache", {"dtype": "float64"}, "key_cache dtype torch.float64"),
    ("scatter_pa_cache", {"dtype": "float64"}, "cache dtype torch.float64"),
    ("q_prolog", {"dtype": "float64"}, "dtype torch.float64 (torch_npu.npu_rms_norm"),
    ("latent_kv_prolog", {"dtype": "float64"}, "dtype torch.float64 (torch_npu.npu_rms_norm"),
])
def test_npu_kernels_fall_back_with_the_reason_and_a_demand_is_refused(op, change, reason):
    """Each declared limit: explain() names it, the reference kernel serves the call (torch_npu is not
    called), and MLA_OPS_BACKEND=npu refuses it with the reason."""
    run_paged(f"""
        from mla_ops.testing import suites
        op, kwargs = {op!r}, {change!r}.copy()
        if "dtype" in kwargs:
            kwargs["dtype"] = getattr(torch, kwargs["dtype"])
        if op == "mla_decode_attention":
            args, kw = decode_args(**kwargs), {{}}
        else:
            name = {{"scatter_pa_kv_cache": "padding", "scatter_pa_cache": "padding", "q_prolog": "small-lora",
                     "latent_kv_prolog": "small"}}[op]
            sample = CASES[op].sample(kwargs["dtype"], name)
            args, kw = sample.args, dict(sample.kwargs)
        dev = on_npu(args)  # split views stay views (Sample.to / .clone would make them contiguous)
        text = mla_ops.explain(op, *dev, **kw)
        assert text.startswith(f"mla.{{op}}: reference") and "not npu" in text and {reason!r} in text, text
        calls, norms = len(torch_npu.CALLS), []
        real = torch_npu.npu_rms_norm
        torch_npu.npu_rms_norm = lambda *a, **k: norms.append(1) or real(*a, **k)
        written = suites.written_positions(op)
        got = suites.outputs_of(getattr(torch.ops.mla, op)(*dev, **kw), dev, written)
        assert len(torch_npu.CALLS) == calls and not norms  # torch_npu never called
        if op == "mla_decode_attention":  # the reference kernel's device path, run on the CPU
            want = (decode_sync_free(*args),)
        else:
            want = suites.call(op, suites.Sample("", args, kw))
        assert all(torch.equal(g.cpu(), w) for g, w in zip(got, want))
        refused = pytest.raises(NotImplementedError, match="cannot serve this call.*" + re.escape({reason!r}))
        with mla_ops.use_backend("npu"), refused:
            getattr(torch.ops.mla, op)(*dev, **kw)
    """)


def test_decode_reasons_for_limits_too_large_to_allocate_here():
    """The limits of one query token over the whole table (KV_S <= 262144) and of the batch (<= 65536),
    asked of the reasons directly on meta tensors (no memory behind them)."""
    run_paged("""
        def reasons(batch=2, width=4, block_size=16, num_blocks=None):
            num_blocks = num_blocks or batch * width
            meta = dict(device="meta", dtype=torch.bfloat16)
            return npu.mla_decode_attention_reasons(
                torch.empty(batch, 16, 512, **meta), torch.empty(batch, 16, 64, **meta),
                torch.empty(num_blocks, block_size, 1, 512, **meta), torch.empty(num_blocks, block_size, 1, 64, **meta),
                torch.empty(batch, width, dtype=torch.int32, device="meta"),
                torch.empty(batch, dtype=torch.int32, device="meta"), 0.1)
        assert reasons() == []
        assert any("a block table of 513 x 512 positions" in r for r in reasons(batch=1, width=513, block_size=512))
        assert reasons(batch=1, width=512, block_size=512) == []
        assert any("batch 65537" in r for r in reasons(batch=65537, width=1))
    """)


def test_capture_refuses_a_host_sync_and_the_npu_kernels_replay_new_inputs():
    """torch.npu.graph on the stand-in raises on a host synchronisation (a negative control for each
    kind), and every new npu kernel captures without one and replays new inputs (the selftest's rows,
    run here through their function): the torch_npu function runs again at replay."""
    run_paged("""
        from mla_ops.cli import selftest
        x = torch.arange(6, dtype=torch.float32).to("npu")
        # (.tolist() of an npu tensor is refused by torch itself here: wrapper tensors have no host data)
        syncs = {"item": lambda: x.sum().item(), "cpu": lambda: x.cpu(),
                 "bool": lambda: bool(x.any()), "nonzero": lambda: torch.nonzero(x),
                 "mask": lambda: x[x > 2], "to npu": lambda: torch.ones(3).to("npu"),
                 "tensor on npu": lambda: torch.tensor([1, 2], device="npu"),
                 "repeat_interleave": lambda: torch.repeat_interleave(x.long())}
        for name, sync in syncs.items():
            with pytest.raises(torch_npu.HostSyncInCapture), torch.npu.graph(torch.npu.NPUGraph()):
                sync()
        with torch.npu.graph(torch.npu.NPUGraph()):  # device work only: fine
            torch.repeat_interleave(x, 2), x.to(torch.int32), torch.zeros(3, device="npu"), x.clamp(0, 3)
        for op, name in selftest.NPU_GRAPH_CASES:
            sample = CASES[op].sample(torch.bfloat16, name)
            start = len(torch_npu.CALLS)
            verdict, detail = selftest.replay_with_new_inputs(op, sample, selftest.other_values(sample),
                                                              torch.device("npu", 0), torch.npu.NPUGraph,
                                                              torch.npu.graph)
            assert verdict == "PASS" and detail.startswith("npu ("), (op, detail)
            fused = [c for c, _ in torch_npu.CALLS[start:]]
            if op == "mla_decode_attention":
                assert fused == ["npu_fused_infer_attention_score_v2"] * 3, fused   # warm-up, capture, replay
            elif op.startswith("scatter"):
                assert fused == ["npu_scatter_nd_update_"] * (3 * (2 if op == "scatter_pa_kv_cache" else 1)), fused
    """)


# --- DeepSeek-V4's shared-KV attention on CANN's sparse_flash_mla ---
SHARED_KV_PRELUDE = SPARSE_PRELUDE + """
import cann_ops_transformer
def shared_kv_args(mode="csa", heads=8, dim=512, dtype=torch.bfloat16, block_size=16, window=128, ratio=None,
                   sinks=True, topk=24):
    '''q [T, H, D], a window pool and a compressed pool (shuffled blocks), int32 tables, lengths and
    query starts of a chunked prefill (3 tokens at 300), a decode (at 150) and a prefill (of 40),
    sinks, the scale, and for CSA distinct visible entries with -1s.'''
    ratio = ratio or {"csa": 4, "hca": 128, "swa": 1}[mode]
    seq_lens, q_lens = (300, 150, 40), (3, 1, 40)
    tables, lens, loc = requests(block_size=block_size, num_blocks=640 // block_size, seq_lens=seq_lens,
                                 q_lens=q_lens, width=320 // block_size)
    T = int(loc[-1])
    q = torch.randn(T, heads, dim).to(dtype)
    pool = torch.randn(640 // block_size, block_size, 1, dim).to(dtype)
    args = [q, pool, tables, lens, loc, torch.randn(heads) if sinks else None, dim ** -0.5, window]
    if mode == "swa":
        return tuple(args)
    ctables, _, _ = requests(block_size=block_size, num_blocks=160 // block_size,
                             seq_lens=[n // ratio for n in seq_lens], q_lens=q_lens, width=96 // block_size)
    cpool = torch.randn(160 // block_size, block_size, 1, dim).to(dtype)
    args += [cpool, ctables, ratio, None]
    if mode == "csa":
        rows = []
        for b, (n, q_len) in enumerate(zip(seq_lens, q_lens)):
            for i in range(q_len):
                visible = (n - q_len + i + 1) // ratio
                picked = torch.randperm(visible)[:topk].tolist()
                rows.append(picked + [-1] * (topk - len(picked)))
        args[-1] = torch.tensor(rows, dtype=torch.int32)
    return tuple(args)
def shared_kv_npu_and_reference(args):
    text = mla_ops.explain("shared_kv_attention", *on_npu(args))
    assert text.startswith("mla.shared_kv_attention: npu") and "sparse_flash_mla" in text, text
    start = len(torch_npu.CALLS)
    got = torch.ops.mla.shared_kv_attention(*on_npu(args)).cpu()
    calls = dict(torch_npu.CALLS[start:])
    return got, torch.ops.mla.shared_kv_attention(*args), calls["sparse_flash_mla_metadata"], calls["sparse_flash_mla"]
"""


@pytest.mark.parametrize("mode", ["csa", "hca", "swa"])
def test_shared_kv_attention_reaches_sparse_flash_mla_with_the_documented_arguments(mode):
    """TND queries over PA_BBND pools, the window as a 128-token band (ori_mask_mode 4, win_left 127),
    the compressed side right-down causal over seq_lens = seqused_cmp_kv * m + cmp_residual_kv, CSA's
    entries as cmp_sparse_indices [T, 1, K]; the reference's result."""
    run(SHARED_KV_PRELUDE + textwrap.dedent(f"""
        args = shared_kv_args({mode!r})
        got, want, split, call = shared_kv_npu_and_reference(args)
        T, H, D = args[0].shape
        assert call["layout_q"] == split["layout_q"] == "TND" and call["layout_kv"] == "PA_BBND"
        assert call["ori_mask_mode"] == 4 and call["ori_win_left"] == 127 and call["ori_win_right"] == 0
        assert call["sinks"] == ((H,), torch.float32, True) and split["max_seqlen_q"] == 40
        assert call["seqused_ori_kv"] == ((3,), torch.int32, True) and call["cu_seqlens_q"][0] == (4,)
        if {mode!r} == "swa":
            assert call["cmp_kv"] is None and call["cmp_ratio"] == 1 and call["cmp_mask_mode"] == 0
        else:
            assert call["cmp_mask_mode"] == 3 and call["cmp_residual_kv"] == ((3,), torch.int32, True)
            assert call["cmp_ratio"] == {dict(csa=4, hca=128, swa=1)[mode]}
        if {mode!r} == "csa":
            assert call["cmp_sparse_indices"] == ((T, 1, 24), torch.int32, True) and split["cmp_topk"] == 24
        else:
            assert call["cmp_sparse_indices"] is None and split["cmp_topk"] == 0
        assert got.dtype == torch.bfloat16 and got.shape == (T, H, D)
        assert torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2), (got.float() - want.float()).abs().max()
    """))


@pytest.mark.parametrize("change, reason", [
    ({"window": 64}, "sliding_window 64"),
    ({"sinks": False}, "no sinks"),
    ({"dtype": "float32"}, "dtype torch.float32"),
    ({"heads": 6}, "6 heads"),
    ({"dim": 256}, "head_dim 256"),
    ({"block_size": 8}, "block_size 8"),
    ({"ratio": 8}, "compress_ratio 8 for CSA"),
    ({"mode": "hca", "ratio": 64}, "compress_ratio 64 for HCA"),
])
def test_shared_kv_attention_falls_back_with_the_reason_and_a_demand_is_refused(change, reason):
    run(SHARED_KV_PRELUDE + textwrap.dedent(f"""
        kwargs = {change!r}.copy()
        if "dtype" in kwargs:
            kwargs["dtype"] = getattr(torch, kwargs["dtype"])
        args = shared_kv_args(**kwargs)
        text = mla_ops.explain("shared_kv_attention", *on_npu(args))
        assert text.startswith("mla.shared_kv_attention: reference") and {reason!r} in text, text
        calls = len(torch_npu.CALLS)
        got = torch.ops.mla.shared_kv_attention(*on_npu(args)).cpu()
        assert len(torch_npu.CALLS) == calls  # sparse_flash_mla never called
        assert torch.equal(got, torch.ops.mla.shared_kv_attention(*args))
        refused = pytest.raises(NotImplementedError, match="cannot serve this call.*" + {reason!r})
        with mla_ops.use_backend("npu"), refused:
            torch.ops.mla.shared_kv_attention(*on_npu(args))
    """))
