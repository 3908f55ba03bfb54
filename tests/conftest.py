"""Shared pytest setup: deterministic seeds, a scratch cwd, and torch_npu kept out of CI."""
import os

# torch_npu installed without CANN breaks `import torch` through device autoload; CI never has it,
# but a developer machine might.
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

import mla_ops  # noqa: E402,F401  (registers torch.ops.mla)


@pytest.fixture(autouse=True)
def _seed_and_threads():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _restore_backend():
    previous = mla_ops.settings.settings.backend
    yield
    if mla_ops.settings.settings.backend != previous:
        mla_ops.set_backend(previous)
