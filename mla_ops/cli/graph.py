"""`--use_acl_graph`: compile the model for graph execution on the current device.

* Ascend NPU, chosen by what the installed torch_npu/torchair provide (feature detection):
  - the ``npugraph_ex`` torch.compile backend where it is registered (torchair's aclgraph backend
    of its current line; Ascend/torchair ``npugraph_ex/``, docs/zh/npugraph_ex): options
    ``frozen_parameter``; current torchair deprecates CompilerConfig's "reduce-overhead" mode in its
    favour (python/torchair/configs/compiler_config.py, ``_check_config_support``);
  - else torchair's NPU backend with ``CompilerConfig.mode = "reduce-overhead"`` (aclgraph) and
    ``experimental_config.frozen_parameter`` (the original script's settings, torchair before the
    npugraph_ex backend). ``tiling_schedule_optimize`` is not set: it is a GE option that current
    torchair ignores in aclgraph mode, with a warning (``unsupport_aclgraphconfig_list``).
  transformers' CompileConfig would pass ``mode="reduce-overhead"`` (its default) through
  torch.compile to a custom backend as a keyword argument; torchair's ``_npu_backend`` accepts extra
  keyword arguments only from its 7.3 line on (a TypeError before), so the mode is always None
  (nothing is passed; torch.compile also refuses a mode together with options) and the graph mode
  lives in the backend's own configuration.
  GE graph mode (CompilerConfig mode "max-autotune") is not supported: the fused PyPTO kernel is a
  Python-launched kernel that cannot be expressed as GE IR. MLA_OPS_NPU_GRAPH selects a path
  (``auto`` | ``npugraph_ex`` | ``aclgraph``); ``ge`` / ``max-autotune`` are refused with that reason.
  Without torchair: torch.compile's default backend (with a message).
* CUDA: torch.compile(mode="reduce-overhead"), i.e. CUDA graphs.
* CPU: torch.compile(fullgraph=True) (inductor).
Every device decodes with a static-shape cache (`cache_implementation="static"`; MLAPagedCache in its
static variant when the paged patch is active), and transformers compiles the decode step.
"""
from __future__ import annotations

import os
import warnings
from typing import Callable, Optional

import torch

from .._optional import has_module
from .runtime import CliError

NPU_GRAPH_PATHS = ("auto", "npugraph_ex", "aclgraph")
GE_NAMES = ("ge", "max-autotune")


def requested_npu_graph_path() -> str:
    """MLA_OPS_NPU_GRAPH (default auto); GE is refused with the reason."""
    value = (os.environ.get("MLA_OPS_NPU_GRAPH") or "auto").strip().lower()
    if value in GE_NAMES:
        raise CliError(f"MLA_OPS_NPU_GRAPH={value}: GE graph mode (torchair max-autotune) is not supported: the "
                       f"fused kv_prolog is a PyPTO kernel launched from Python, which cannot be expressed as GE IR. "
                       f"Use MLA_OPS_NPU_GRAPH=auto (aclgraph: npugraph_ex or torchair reduce-overhead).")
    if value not in NPU_GRAPH_PATHS:
        raise CliError(f"MLA_OPS_NPU_GRAPH={value!r}: choose one of {', '.join(NPU_GRAPH_PATHS)}")
    return value


def npugraph_ex_available() -> bool:
    """Whether a torch.compile backend named "npugraph_ex" is registered (after torch_npu/torchair import)."""
    from torch._dynamo.backends.registry import lookup_backend
    from torch._dynamo.exc import InvalidBackend

    try:
        lookup_backend("npugraph_ex")
    except InvalidBackend:
        return False
    return True


def npu_compile_kwargs(say: Callable[[str], None] = print) -> Optional[dict]:
    """CompileConfig keyword arguments for aclgraph on NPU, or None when torchair is not importable."""
    path = requested_npu_graph_path()
    if has_module("torchair"):
        import torchair  # noqa: F401  (current lines register their backends on import)
    if path in ("auto", "npugraph_ex") and npugraph_ex_available():
        say("graph mode: torchair's npugraph_ex backend (aclgraph, frozen parameters)")
        return {"backend": "npugraph_ex", "mode": None, "options": {"frozen_parameter": True}}
    if path == "npugraph_ex":
        raise CliError("MLA_OPS_NPU_GRAPH=npugraph_ex: no torch.compile backend named npugraph_ex is registered "
                       "by the installed torch_npu/torchair; use MLA_OPS_NPU_GRAPH=auto")
    if not has_module("torchair"):
        return None
    import torchair
    from torchair.configs.compiler_config import CompilerConfig

    config = CompilerConfig()
    config.mode = "reduce-overhead"  # aclgraph: capture and replay the decode step
    config.experimental_config.frozen_parameter = True
    backend = torchair.get_npu_backend(compiler_config=config)
    say("graph mode: torchair NPU backend (CompilerConfig reduce-overhead = aclgraph, frozen parameters)")
    return {"backend": backend, "mode": None}


def compile_settings(device: torch.device, say: Callable[[str], None] = print) -> dict:
    """generate() keyword arguments for graph execution on `device`."""
    from transformers import CompileConfig

    # Known, harmless noise from compiling transformers' own code (its MoE helper's lru_cache, the
    # complex-valued rotary embedding inductor leaves to eager); anything else still shows.
    warnings.filterwarnings("ignore", message="Dynamo detected a call to a `functools.lru_cache`-wrapped function")
    warnings.filterwarnings("ignore", message="Torchinductor does not support code generation for complex operators")

    if device.type == "npu":
        kwargs = npu_compile_kwargs(say)
        if kwargs is not None:
            compile_config = CompileConfig(fullgraph=True, dynamic=False, **kwargs)
        else:
            compile_config = CompileConfig(fullgraph=True, dynamic=False, mode=None)
            say("graph mode: torchair is not importable; falling back to torch.compile's default backend on NPU")
    elif device.type == "cuda":
        compile_config = CompileConfig(fullgraph=True, dynamic=False, mode="reduce-overhead")
        say("graph mode: torch.compile(mode='reduce-overhead') — CUDA graphs")
    else:
        compile_config = CompileConfig(fullgraph=True, dynamic=False)
        say("graph mode: torch.compile(fullgraph=True) with the inductor CPU backend and a static cache")
    # transformers only auto-compiles generate on cuda/xpu/tpu/neuron unless told otherwise.
    compile_config._compile_all_devices = True
    return {"cache_implementation": "static", "compile_config": compile_config}
