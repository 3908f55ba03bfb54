"""Test stand-in with the API shape of current torchair (no NPU code): the backend callable takes
extra keyword arguments (`**kwargs`, from the 7.3 line on) and a torch.compile backend named
"npugraph_ex" is registered, which accepts `options=` (Ascend/torchair docs/zh/npugraph_ex). Both
record what they were given and run the graph eagerly."""
import functools

import torch

from .configs.compiler_config import CompilerConfig

__all__ = ["CompilerConfig", "get_npu_backend", "COMPILED"]
COMPILED = []


def _npu_backend(gm, example_inputs, compiler_config=None, decompositions={}, **kwargs):
    COMPILED.append(("npu_backend", compiler_config, kwargs))
    return gm.forward


def get_npu_backend(*, compiler_config=None, custom_decompositions={}):
    return functools.partial(_npu_backend, compiler_config=compiler_config or CompilerConfig())


@torch._dynamo.register_backend(name="npugraph_ex")
def _npugraph_ex(gm, example_inputs, **kwargs):
    COMPILED.append(("npugraph_ex", None, kwargs))
    return gm.forward
