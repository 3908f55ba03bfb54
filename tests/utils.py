"""Test helpers: the opcheck wrapper, a counter of mla op calls, prompts; the input factories of the
case database re-exported for the tests that build their own inputs."""
from __future__ import annotations

import torch
from torch.library import opcheck as _opcheck
from torch.utils._python_dispatch import TorchDispatchMode

from mla_ops.testing.inputs import (  # noqa: F401  (re-exported for the tests)
    DIM_SETS,
    LITE,
    PREFILL,
    SMALL,
    Dims,
    paged_case,
    prolog_inputs,
    prolog_kwargs,
    rope_tables,
)
from mla_ops.testing.suites import OPCHECK_UTILS as ALL_OPCHECK_TEST_UTILS

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def opcheck(op, args, kwargs=None, *, test_utils=ALL_OPCHECK_TEST_UTILS, **extra):
    """`torch.library.opcheck` with all four default utils; fails the test on any non-SUCCESS."""
    result = _opcheck(op, args, kwargs, test_utils=test_utils, raise_exception=True, **extra)
    assert all(v == "SUCCESS" for v in result.values()), result
    return result


class MlaCalls(TorchDispatchMode):
    """Counts torch.ops.mla.* calls that reach the dispatcher."""

    def __init__(self):
        super().__init__()
        self.counts = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "mla":
            name = func.overloadpacket.__name__
            self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def random_prompt(config, batch=1, length=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, config.vocab_size, (batch, length), generator=g)
