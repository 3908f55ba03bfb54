"""Running PyPTO kernels on a CPU: pypto 0.2.0's ``RunMode.SIM`` with pass verification.

pypto 0.2.0 has no CPU backend: ``RunMode.SIM`` only runs a cost model of an Ascend 910B2. With
``verify_options={"enable_pass_verify": True}`` however, the compiler builds a host "calculator"
(``libtile_fwk_calculator.so``, compiled with cmake against the installed torch) that interprets the
kernel's tensor graph -- and the graph after selected compiler passes -- with torch ops on the CPU,
comparing each pass against the tensor graph (and the tensor graph against goldens, when given).
After that, the SIM cost-model step copies the verifier's tensor data back into the caller's
tensors. So one call yields: real outputs computed on the CPU, a per-pass PASS/FAILED verdict, and
the simulated AICore time.

One private method of pypto 0.2.0 is broken for this flow and is replaced by :func:`ensure_supported`:
``JitCallableWrapper._setup_verify_data`` stages the kernel arguments through zero-filled copies with
``CopyToHost``, which is a no-op without CANN, so the verifier computes on zeros and the write-back
zeroes the caller's inputs and outputs. The replacement hands the caller's CPU buffers to
``SetVerifyData`` directly (non-CPU tensors still take the original path). The fix is only valid for
pypto 0.2.0, which is why :func:`ensure_supported` refuses any other version.

What the simulation does and does not validate: outputs are the tensor-graph interpretation (torch
ops on CPU, e.g. ``torch::matmul`` for ``pypto.matmul``), and the pass verifier re-runs the compiled
graph after ``ExpandFunction``, ``SplitK``, ``L1CopyInReuseMerge``, ``InferDynShape``,
``InferParamIndex`` and ``CodegenPreproc`` and compares it with the tensor graph. The generated AICore
code and the hardware numerics are not validated.

Environment variables:

* ``MLA_OPS_PYPTO_CACHE`` -- root of the calculator build cache (default
  ``~/.cache/mla_ops/pypto_calculator``); one sub-directory per ``<pypto>-<torch>-abi<n>`` key.
  The first build takes 20-45 s on two cores; later processes load it in milliseconds.
* ``MLA_OPS_PYPTO_KEEP_OUTPUT=1`` -- keep each run's pypto working directory (``output/`` with the
  verify dumps and ``CostModelSimulationOutput/``) instead of deleting it; its path is
  ``SimResult.work_dir``.
* ``MLA_OPS_PYPTO_VERBOSE=1`` -- let pypto's console output (compile messages, the swim-lane
  report) through instead of capturing it in ``<work_dir>/console.log``.
* ``ASCEND_PROCESS_LOG_PATH`` -- where pypto writes its plog (the verdict lines are read from it;
  keep ``ASCEND_GLOBAL_LOG_LEVEL`` at INFO or below, PASS verdicts are INFO lines). pypto reads it
  once, at import; if it is unset when :func:`ensure_supported` runs before pypto's first import on a
  machine without CANN, a private temporary directory is used (removed at exit).
* ``ASCEND_HOME_PATH`` must be unset on a machine without CANN (with it, ``import pypto`` wants the
  CANN runtime libraries).

Modules: `compat` (the supported pypto version and the one private-method fix), `calculator` (the
verify calculator's build cache), `verify_log` (verdicts and simulated time), `runner` (running and
launching a kernel).
"""
from .compat import SUPPORTED_PYPTO_VERSION, ensure_supported, installed_pypto_version, plog_root, unavailable_reasons
from .runner import MODES, check_mode, device_reasons, jit_kwargs, last_result, launch, pypto_dtype, run_kernel
from .verify_log import SimResult, SimVerificationError, parse_verify_lines, sim_aicore_e2e_us, sim_total_cycles

__all__ = [
    "SUPPORTED_PYPTO_VERSION", "MODES", "SimResult", "SimVerificationError", "check_mode", "device_reasons",
    "ensure_supported", "installed_pypto_version", "jit_kwargs", "last_result", "launch", "parse_verify_lines",
    "plog_root", "pypto_dtype", "run_kernel", "sim_aicore_e2e_us", "sim_total_cycles", "unavailable_reasons",
]
