"""Running a ``pypto.frontend.jit`` kernel: in SIM mode on CPU tensors (outputs computed by the
calculator, every verified pass checked, simulated time recorded), or as a plain launch on the
current NPU stream."""
from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from . import compat
from .calculator import load_calculator
from .compat import ensure_supported
from .verify_log import (
    SimResult,
    SimVerificationError,
    _PlogTail,
    parse_verify_lines,
    sim_aicore_e2e_us,
    sim_total_cycles,
)

_RUN_LOCK = threading.RLock()          # chdir, pypto's global options and verify data are process-wide
_poisoned_by: Optional[str] = None     # set when a failed compile left pypto's recorder inside a function
_last_result: Optional[SimResult] = None


def last_result() -> Optional[SimResult]:
    """The result of the last simulated kernel call in this process (None before the first)."""
    return _last_result


def _keep_output() -> bool:
    return os.environ.get("MLA_OPS_PYPTO_KEEP_OUTPUT", "") not in ("", "0")


@contextlib.contextmanager
def _fds_redirected_to(path: str):
    """Send this process's stdout/stderr file descriptors to ``path`` (pypto's SIM step prints a
    swim-lane report from a subprocess, which Python-level redirection cannot catch)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    try:
        with open(path, "ab") as fh:
            os.dup2(fh.fileno(), 1)
            os.dup2(fh.fileno(), 2)
            yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])


def _tail(path: str, n: int = 3000) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - n))
            return fh.read().decode(errors="replace")
    except OSError:
        return ""


def run_kernel(name: str, kernel: Callable, args: Sequence[torch.Tensor], *,
               outputs: Mapping[str, torch.Tensor],
               goldens: Optional[Sequence[Optional[torch.Tensor]]] = None,
               check: bool = True) -> SimResult:
    """Run a ``pypto.frontend.jit`` kernel built with ``run_mode=SIM`` + pass verify, on CPU tensors.

    args:    every kernel tensor argument in signature order (inputs and outputs), contiguous CPU.
    outputs: name -> the output tensors (for the result; they are written in place).
    goldens: optional, one entry per ``args`` item (None = do not compare); adds ``tensor_graph``
             verdicts per argument.
    check:   raise :class:`SimVerificationError` if any verdict is FAILED.

    The call runs in a fresh temporary working directory (pypto writes ``./output``; ``chdir`` is
    process-global, so calls are serialised by a lock and the previous cwd is always restored).
    pypto's console output goes to ``<work_dir>/console.log`` (its tail is attached to errors) unless
    ``MLA_OPS_PYPTO_VERBOSE=1``. A compile error that pypto 0.2.0 cannot recover from (it leaves its
    function recorder open) makes every later call in the process fail fast with a clear error.
    """
    global _last_result, _poisoned_by
    ensure_supported()
    load_calculator()
    import pypto
    from pypto._controller import Controller

    if _poisoned_by is not None:
        raise RuntimeError(f"{name}: an earlier PyPTO compile in this process failed inside function "
                           f"recording ({_poisoned_by}); pypto 0.2.0 cannot recover from that (its recorder "
                           f"stays inside the failed function and later compiles fail or crash). "
                           f"Restart the process.")

    for i, t in enumerate(args):
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            raise ValueError(f"{name}: argument {i} must be a CPU torch.Tensor for the simulation")
    if goldens is not None and len(goldens) != len(args):
        raise ValueError(f"{name}: goldens needs one entry per kernel argument ({len(args)}), "
                         f"got {len(goldens)}")
    with _RUN_LOCK:
        work_dir = tempfile.mkdtemp(prefix=f"mla_ops_pypto_{name}_")
        old_cwd = os.getcwd()
        tail = _PlogTail()
        try:
            os.chdir(work_dir)
            # One entry per argument; an empty list leaves every comparison out (NO_COMPARE).
            pypto.set_verify_golden_data(goldens=list(goldens) if goldens is not None else [])
            console = os.path.join(work_dir, "console.log")
            quiet = os.environ.get("MLA_OPS_PYPTO_VERBOSE", "") in ("", "0")
            t0 = time.perf_counter()
            try:
                with _fds_redirected_to(console) if quiet else contextlib.nullcontext():
                    kernel(*args)
            except Exception as exc:
                if Controller.in_function:
                    # The failure escaped from pypto.function's EndFunction (where compilation runs), so
                    # pypto never left the function; resetting the flag alone crashes the next compile.
                    _poisoned_by = f"{name}: {str(exc).splitlines()[0][:200]}"
                raise RuntimeError(f"PyPTO simulation of {name} failed: {exc}\n--- pypto console (tail) ---\n"
                                   f"{_tail(console)}") from exc
            wall = time.perf_counter() - t0
            sim_dirs = sorted(Path(work_dir).glob("output/*/CostModelSimulationOutput"),
                              key=lambda p: p.stat().st_mtime)
            if not sim_dirs:
                raise RuntimeError(f"{name}: pypto wrote no CostModelSimulationOutput under "
                                   f"{work_dir}/output (is the kernel built with run_mode=RunMode.SIM?)")
            aicore_us = sim_aicore_e2e_us(sim_dirs[-1])
            cycles = sim_total_cycles(sim_dirs[-1])
        finally:
            os.chdir(old_cwd)
            keep = _keep_output()
            if not keep:
                shutil.rmtree(work_dir, ignore_errors=True)
        lines = tail.read()
        if not lines:
            # pypto logs at INFO level throughout a verified run; no new line at all means its plog is
            # not where we look, and nothing could be claimed as verified. (A kernel that writes
            # nothing -- e.g. a scatter of padding only -- legitimately has no verdict lines.)
            raise RuntimeError(f"{name}: nothing was logged to this process's pypto plog under {compat.plog_root()} "
                               f"(set ASCEND_PROCESS_LOG_PATH before pypto is imported, and keep "
                               f"ASCEND_GLOBAL_LOG_LEVEL at INFO (1) or below)")
        verdicts, errors = parse_verify_lines(lines)
        result = SimResult(kernel=name, outputs=dict(outputs), verdicts=verdicts,
                           failed=[v for v in verdicts if v[2] == "FAILED"], errors=errors,
                           aicore_us=aicore_us, total_cycles=cycles, wall_s=wall,
                           work_dir=work_dir if keep else None)
        _last_result = result
    if check and result.failed:
        raise SimVerificationError(result)
    return result


def sim_jit_options(*, error_tol: Tuple[float, float] = (1e-3, 1e-3)) -> Dict[str, Any]:
    """``verify_options`` for a SIM kernel: full pass verification with the given [rtol, atol]."""
    return {"enable_pass_verify": True, "pass_verify_error_tol": [float(error_tol[0]), float(error_tol[1])]}


# ----------------------------------------------------------------------------------------------
# helpers shared by the kernel modules (building and launching a kernel in "sim" or "npu" mode)
# ----------------------------------------------------------------------------------------------
MODES = ("sim", "npu")


def device_reasons(tensors: Mapping[str, torch.Tensor], mode: str, anchor: torch.Tensor) -> List[str]:
    """The device part of every kernel's not-supported reasons: one device, and the one `mode` runs on."""
    devices = {t.device for t in tensors.values()}
    if len(devices) > 1:
        return [f"all tensors must be on one device, got {sorted(str(d) for d in devices)}"]
    if mode == "sim" and anchor.device.type != "cpu":
        return [f"mode='sim' runs on CPU tensors, got device {anchor.device}"]
    if mode == "npu" and anchor.device.type != "npu":
        return [f"mode='npu' needs torch_npu tensors, got device {anchor.device}"]
    return []


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def pypto_dtype(dtype: torch.dtype):
    """torch dtype -> pypto DataType (imports pypto)."""
    import pypto
    table = {torch.float16: pypto.DT_FP16, torch.bfloat16: pypto.DT_BF16, torch.float32: pypto.DT_FP32,
             torch.int32: pypto.DT_INT32}
    if dtype not in table:
        raise ValueError(f"no PyPTO dtype for {dtype}")
    return table[dtype]


def jit_kwargs(mode: str, *, error_tol: Tuple[float, float] = (1e-3, 1e-3),
               runtime_options: Optional[Mapping[str, Any]] = None,
               pass_options: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    """Keyword arguments for ``pypto.frontend.jit`` in ``mode``.

    "sim": ``RunMode.SIM`` with full pass verification (the only way to get outputs on a CPU);
    "npu": ``RunMode.NPU``, no verify options (verification would copy device data to the host).
    """
    check_mode(mode)
    import pypto
    rt = {"run_mode": pypto.RunMode.SIM if mode == "sim" else pypto.RunMode.NPU}
    rt.update(runtime_options or {})
    kwargs: Dict[str, Any] = {"runtime_options": rt, "pass_options": dict(pass_options or {})}
    if mode == "sim":
        kwargs["verify_options"] = sim_jit_options(error_tol=error_tol)
    return kwargs


def launch(name: str, kernel: Callable, args: Sequence[torch.Tensor], *, mode: str,
           outputs: Mapping[str, torch.Tensor],
           goldens: Optional[Sequence[Optional[torch.Tensor]]] = None) -> Optional[SimResult]:
    """Run ``kernel`` on ``args``: through :func:`run_kernel` in "sim" mode (returns the SimResult),
    or as a plain asynchronous launch on the current NPU stream in "npu" mode (returns None; no host
    synchronisation, no verification)."""
    check_mode(mode)
    if mode == "sim":
        return run_kernel(name, kernel, args, outputs=outputs, goldens=goldens)
    if goldens is not None:
        raise ValueError(f"{name}: goldens are only compared in mode='sim'")
    kernel(*args)
    return None
