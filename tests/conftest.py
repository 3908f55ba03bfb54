"""Shared pytest setup: deterministic seeds, one torch thread per xdist worker, the backend setting
and every model patch restored after each test, torch_npu kept out of CI."""
import importlib.util
import os
import sys

# torch_npu installed without CANN breaks `import torch` through device autoload; CI never has it,
# but a developer machine might.
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

import mla_ops  # noqa: E402  (defines torch.ops.mla)

# The vLLM tests need vLLM, which lives in its own venv (`make test-vllm`); elsewhere they are not collected.
collect_ignore = [] if importlib.util.find_spec("vllm") else ["vllm_engine"]

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs one worker per core: threads beyond that would only oversubscribe the cores.
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _restore_backend():
    previous = mla_ops.settings.settings.backend
    yield
    if mla_ops.settings.settings.backend != previous:
        mla_ops.set_backend(previous)


@pytest.fixture(autouse=True)
def _no_patch_outlives_its_test():
    """Revert whatever model patch a test left active, and check that the classes are stock again."""
    yield
    integration = sys.modules.get("mla_ops.integrations.transformers")
    if integration is None:
        return
    integration.revert()
    hf = sys.modules.get("transformers.models.deepseek_v2.modeling_deepseek_v2")
    if hf is not None:
        for cls in (hf.DeepseekV2Attention, hf.DeepseekV2RMSNorm, hf.DeepseekV2Model):
            assert cls.forward.__module__ == hf.__name__, f"{cls.__name__}.forward is still patched"
        assert "_prepare_cache_for_generation" not in hf.DeepseekV2ForCausalLM.__dict__
