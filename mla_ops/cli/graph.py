"""`--use_acl_graph`: compile the model for graph execution on the current device.

* Ascend NPU: torchair's NPU backend in aclgraph mode (CompilerConfig: mode="reduce-overhead",
  frozen_parameter, tiling_schedule_optimize), as the original script; torch.compile's default
  backend (with a message) when torchair cannot be imported.
* CUDA: torch.compile(mode="reduce-overhead"), i.e. CUDA graphs.
* CPU: torch.compile(fullgraph=True) (inductor).
Every device decodes with a static-shape cache (`cache_implementation="static"`; MLAPagedCache in its
static variant when the paged patch is active), and transformers compiles the decode step.
"""
from __future__ import annotations

import warnings
from typing import Callable

import torch

from .._optional import has_module


def compile_settings(device: torch.device, say: Callable[[str], None] = print) -> dict:
    """generate() keyword arguments for graph execution on `device`."""
    from transformers import CompileConfig

    # Known, harmless noise from compiling transformers' own code (its MoE helper's lru_cache, the
    # complex-valued rotary embedding inductor leaves to eager); anything else still shows.
    warnings.filterwarnings("ignore", message="Dynamo detected a call to a `functools.lru_cache`-wrapped function")
    warnings.filterwarnings("ignore", message="Torchinductor does not support code generation for complex operators")

    if device.type == "npu":
        if has_module("torchair"):
            import torchair
            from torchair.configs.compiler_config import CompilerConfig

            config = CompilerConfig()
            config.mode = "reduce-overhead"  # aclgraph: capture and replay the decode step
            config.experimental_config.frozen_parameter = True
            config.experimental_config.tiling_schedule_optimize = True
            backend = torchair.get_npu_backend(compiler_config=config)
            compile_config = CompileConfig(fullgraph=True, dynamic=False, backend=backend)
            say("graph mode: torchair NPU backend (aclgraph, reduce-overhead, frozen parameters)")
        else:
            compile_config = CompileConfig(fullgraph=True, dynamic=False)
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
