"""Test stand-in with the API shape of torchair before its 7.3 line (no NPU code): CompilerConfig,
get_npu_backend returning a backend callable that takes no extra keyword arguments, and no
npugraph_ex backend. The backend records its configuration and runs the graph eagerly."""
import functools

from .configs.compiler_config import CompilerConfig

__all__ = ["CompilerConfig", "get_npu_backend", "COMPILED"]
COMPILED = []


def _npu_backend(gm, example_inputs, compiler_config=None, aot_config=None, custom_decompositions={}):
    COMPILED.append(compiler_config)
    return gm.forward


def get_npu_backend(*, compiler_config=None, custom_decompositions={}):
    return functools.partial(_npu_backend, compiler_config=compiler_config or CompilerConfig(),
                             custom_decompositions=custom_decompositions)
