"""CPU simulation harness for the PyPTO kernels (pypto 0.2.0 ``RunMode.SIM`` + pass verification).

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
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import dataclasses
import glob
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

__all__ = [
    "SUPPORTED_PYPTO_VERSION",
    "SimResult",
    "SimVerificationError",
    "ensure_supported",
    "installed_pypto_version",
    "last_result",
    "load_calculator",
    "plog_root",
    "run_kernel",
    "sim_aicore_e2e_us",
    "sim_total_cycles",
    "unsupported_reasons",
]

SUPPORTED_PYPTO_VERSION = "0.2.0"

# pypto's swim-lane script converts cycles to microseconds with --time_convert_denominator=1800
# (the modelled ASCEND_910B2 AICore clock, 1.8 GHz).
SIM_CLOCK_MHZ = 1800

# The passes the verifier checks by default (pypto 0.2.0 docs, set_verify_options).
DEFAULT_VERIFIED_PASSES = ("ExpandFunction", "SplitK", "L1CopyInReuseMerge", "InferDynShape",
                           "InferParamIndex", "CodegenPreproc")

_RUN_LOCK = threading.RLock()          # chdir, pypto's global options and verify data are process-wide
_SETUP_LOCK = threading.Lock()
_CALC_LOCK = threading.Lock()
_PATCHED_MARK = "_mla_ops_cpu_verify_fix"
_calculator_path: Optional[Path] = None
_plog_base_at_import: Optional[str] = None
_poisoned_by: Optional[str] = None     # set when a failed compile left pypto's recorder inside a function
_last_result: Optional["SimResult"] = None


# ----------------------------------------------------------------------------------------------
# version guard and the one private-method fix
# ----------------------------------------------------------------------------------------------
def installed_pypto_version() -> Optional[str]:
    """The installed ``pypto`` distribution's version, or None if it is not installed (no import)."""
    try:
        return importlib.metadata.version("pypto")
    except importlib.metadata.PackageNotFoundError:
        return None


def unsupported_reasons() -> List[str]:
    """Why the PyPTO simulation cannot run here (empty list = it can). Does not import pypto."""
    ver = installed_pypto_version()
    if ver is None:
        return [f"pypto {SUPPORTED_PYPTO_VERSION} not installed "
                f"(pip install pypto=={SUPPORTED_PYPTO_VERSION})"]
    if ver != SUPPORTED_PYPTO_VERSION:
        return [f"pypto {ver} is installed, but mla_ops' PyPTO kernels and CPU simulation support exactly "
                f"pypto {SUPPORTED_PYPTO_VERSION} (the harness replaces a private method of that release); "
                f"install pypto=={SUPPORTED_PYPTO_VERSION}"]
    if importlib.util.find_spec("pypto") is None:
        return [f"the pypto {ver} distribution is installed but `pypto` is not importable"]
    return []


def _prepare_environment() -> None:
    """Settings pypto reads once, when it is first imported: the plog location.

    Without CANN (no ASCEND_HOME_PATH) and with no ASCEND_PROCESS_LOG_PATH, the plog goes to a private
    temporary directory (removed at exit) instead of ~/ascend/log. On a CANN machine the operator's
    log settings are left alone. Either way, the location in effect when pypto was imported is
    remembered, because changing the variable later does not move pypto's log.
    """
    global _plog_base_at_import
    if "pypto" in sys.modules:
        return
    if not os.environ.get("ASCEND_PROCESS_LOG_PATH") and not os.environ.get("ASCEND_HOME_PATH"):
        tmp = tempfile.mkdtemp(prefix="mla_ops_pypto_plog_")
        os.environ["ASCEND_PROCESS_LOG_PATH"] = tmp
        atexit.register(shutil.rmtree, tmp, True)
    _plog_base_at_import = os.environ.get("ASCEND_PROCESS_LOG_PATH") or None


def ensure_supported() -> None:
    """Check the pypto version, prepare the environment, import pypto and apply the CPU-verify fix.

    Idempotent and thread-safe. Raises RuntimeError (naming the installed version and the fix) unless
    the installed pypto is exactly 0.2.0.
    """
    reasons = unsupported_reasons()
    if reasons:
        raise RuntimeError("mla_ops PyPTO simulation unavailable: " + "; ".join(reasons) + ".")
    with _SETUP_LOCK:
        _prepare_environment()
        try:
            import pypto  # noqa: F401  (heavy: loads pypto's shared libraries)
            from pypto.frontend.parser import entry
        except (ImportError, OSError) as exc:
            hint = (" ASCEND_HOME_PATH is set: unset it on a machine without CANN."
                    if os.environ.get("ASCEND_HOME_PATH") else "")
            raise RuntimeError(f"mla_ops PyPTO simulation unavailable: `import pypto` failed: "
                               f"{exc}.{hint}") from exc
        wrapper = entry.JitCallableWrapper
        if not getattr(wrapper, _PATCHED_MARK, False):
            original = wrapper.__dict__["_setup_verify_data"]
            wrapper._setup_verify_data = staticmethod(_make_setup_verify_data(original.__func__))
            setattr(wrapper, _PATCHED_MARK, True)


def _make_setup_verify_data(original: Callable) -> Callable:
    def _setup_verify_data(pto_tensors) -> None:
        """Register the caller's own CPU buffers with the verifier (pypto 0.2.0 passes zero copies)."""
        import pypto
        from pypto import pypto_impl
        from pypto.frontend.parser import entry
        from pypto.runtime import _pto_verify_datas

        if not pypto.get_verify_options().get("enable_pass_verify"):
            return
        if any(t.device is not None and getattr(t.device, "type", "cpu") != "cpu" for t in pto_tensors):
            original(pto_tensors)          # device tensors: the stock path (a real CopyToHost exists there)
            return
        load_calculator()
        pypto_impl.SetVerifyData(entry._pto_to_tensor_data(pto_tensors), [], _pto_verify_datas.get_data())

    return _setup_verify_data


# ----------------------------------------------------------------------------------------------
# calculator build cache
# ----------------------------------------------------------------------------------------------
def _calculator_cache_dir() -> Path:
    key = "{}-{}-abi{}".format(installed_pypto_version(), torch.__version__,
                               int(torch._C._GLIBCXX_USE_CXX11_ABI))
    root = os.environ.get("MLA_OPS_PYPTO_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "mla_ops", "pypto_calculator")
    return Path(root, key)


def load_calculator() -> Path:
    """Build (once per cache key, on disk) and load pypto's verify calculator; once per process.

    The stock pypto rebuilds it with cmake in a temporary directory in every process (20-45 s). The
    build here is published atomically (build elsewhere, then ``os.replace`` into place) under an
    exclusive file lock, so parallel test workers neither race nor build twice.
    """
    global _calculator_path
    if _calculator_path is not None:
        return _calculator_path
    ensure_supported()
    with _CALC_LOCK:
        if _calculator_path is not None:
            return _calculator_path
        from pypto._utils import BuildOnlineManager

        mgr = BuildOnlineManager()
        cache = _calculator_cache_dir()
        so = cache / "lib" / "libtile_fwk_calculator.so"
        if not so.exists():
            cache.parent.mkdir(parents=True, exist_ok=True)
            with open(cache.parent / f".{cache.name}.lock", "w") as lock_fh:
                import fcntl
                fcntl.flock(lock_fh, fcntl.LOCK_EX)
                if not so.exists():
                    _build_calculator(mgr, cache)
        ctypes.CDLL(str(so), mode=ctypes.RTLD_GLOBAL)
        mgr.calculator_loaded = True       # pypto's own build_and_load_calculator() is now a no-op
        _calculator_path = so
        return so


def _build_calculator(mgr, cache: Path) -> None:
    # The torch facts pypto's _TorchContext() would collect, collected here: pypto 0.2.0's
    # _TorchContext replaces os.environ with a plain dict copy (`os.environ = os_env`), after which
    # os.environ writes no longer reach the C environment — and torch inductor's compiled modules,
    # which read an environment variable through getenv(), fail for the rest of the process.
    torch_version = str(torch.__version__)
    torch_root = str(Path(torch.__file__).parent)
    cxx11_abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cmake_ctx = mgr._CMakeContext()        # raises a clear RuntimeError when cmake is missing
    with tempfile.TemporaryDirectory(prefix="mla_ops_pypto_calc_") as tmp:
        ctx = mgr._CMakeContext.CompileContext(src_dir=Path(mgr.pkg_lib_dir, "calculator"), tmp_dir=Path(tmp))
        ctx.cfg_cmd_ext = (f"-DPY3_MOD_TORCH_VERSION={torch_version}"
                           f" -DPY3_MOD_TORCH_ROOT_PATH={torch_root}"
                           f" -DPY3_MOD_TORCH_C_GLIBCXX_USE_CXX11_ABI={cxx11_abi}")
        ctx.build_job_num = os.cpu_count() or 4
        try:
            install = cmake_ctx.compile(ctx=ctx)
        except Exception as exc:  # subprocess.CalledProcessError carries the cmake output
            out = getattr(exc, "stderr", "") or getattr(exc, "stdout", "") or ""
            raise RuntimeError(f"building pypto's verify calculator failed (needs cmake>=3.16, make, "
                               f"g++>=9): {exc}\n{out[-2000:]}") from exc
        staging = Path(tempfile.mkdtemp(prefix=f".{cache.name}.", dir=cache.parent))
        shutil.copytree(install, staging, dirs_exist_ok=True)
        try:
            os.replace(staging, cache)      # atomic publish
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
            if not (cache / "lib" / "libtile_fwk_calculator.so").exists():
                raise


# ----------------------------------------------------------------------------------------------
# plog verdicts
# ----------------------------------------------------------------------------------------------
_VERDICT_RE = re.compile(
    r"\[VERIFY\]:(?:ErrCode: \w+! )?(?P<what>\S+) Verify for \d+ data view list index (?P<idx>\d+) "
    r"result (?P<res>PASS|FAILED|NO_COMPARE)")
_PASS_ERROR_RE = re.compile(
    r"VerifyPass failed for function (?P<func>\S+), pass (?P<pass>\w+) "
    r"\(passIndex: \d+, captureIndex: \d+\): "
    r"(?:Errcode: )?(?P<code>[^!\n]*)")


def plog_root() -> Path:
    """The directory pypto's plog files are written under: ASCEND_PROCESS_LOG_PATH as it was when
    :func:`ensure_supported` imported pypto, else as it is now, else pypto's default ~/ascend/log."""
    base = _plog_base_at_import or os.environ.get("ASCEND_PROCESS_LOG_PATH")
    return Path(base) if base else Path(os.path.expanduser("~"), "ascend", "log")


class _PlogTail:
    """Lines appended to this process's pypto plog files since construction."""

    def __init__(self) -> None:
        self._pos = {f: os.path.getsize(f) for f in self._files()}

    @staticmethod
    def _files() -> List[str]:
        return sorted(glob.glob(str(plog_root() / "**" / f"pypto-log-{os.getpid()}_*.log"), recursive=True))

    def read(self) -> List[str]:
        lines: List[str] = []
        for f in self._files():
            with open(f, "r", errors="replace") as fh:
                fh.seek(self._pos.get(f, 0))
                lines.extend(fh.read().splitlines())
        return lines


def parse_verify_lines(lines: Sequence[str]) -> Tuple[List[Tuple[str, int, str]], List[Tuple[str, str]]]:
    """Plog lines -> (verdicts [(what, index, PASS|FAILED|NO_COMPARE)], pass errors [(func_pass, code)]).

    ``what`` is ``tensor_graph`` (kernel argument ``index`` against its golden) or
    ``<function>_Pass_NN_<PassName>`` (output ``index`` of that pass against the tensor graph).
    Pass errors mean the pass interpreter could not evaluate the graph (e.g. ``FB200B``
    GetValidDataView before InferDynShape, a documented limitation), not a numeric mismatch.
    """
    verdicts, errors = [], []
    for line in lines:
        m = _VERDICT_RE.search(line)
        if m:
            verdicts.append((m["what"], int(m["idx"]), m["res"]))
            continue
        m = _PASS_ERROR_RE.search(line)
        if m:
            errors.append((f"{m['func']}:{m['pass']}", m["code"].split(",")[-1].strip()))
    return verdicts, errors


# ----------------------------------------------------------------------------------------------
# SIM cost-model time
# ----------------------------------------------------------------------------------------------
def sim_aicore_e2e_us(sim_dir: os.PathLike) -> float:
    """pypto's printed 'AICore End-to-End Time': (last AIC/AIV task end - first start) / 1800 MHz.

    Read from ``_simulate.swim.json``; excludes AICPU scheduling before the first AICore task.
    """
    with open(Path(sim_dir, "_simulate.swim.json")) as fh:
        lanes = json.load(fh)
    starts, ends = [], []
    for lane in lanes:
        if not any(k in lane.get("coreType", "") for k in ("AIC", "AIV")):
            continue
        for task in lane.get("tasks", []):
            if task["execEnd"] >= task["execStart"]:
                starts.append(task["execStart"])
                ends.append(task["execEnd"])
    return (max(ends) - min(starts)) / SIM_CLOCK_MHZ if starts else 0.0


def sim_total_cycles(sim_dir: os.PathLike) -> int:
    """'Total Cycles' of ``_simulate.stat.report.txt`` (whole simulated run incl. AICPU scheduling)."""
    text = Path(sim_dir, "_simulate.stat.report.txt").read_text(errors="replace")
    m = re.search(r"Total Cycles\.*:\s*(\d+)", text)
    if not m:
        raise RuntimeError(f"no 'Total Cycles' in {sim_dir}/_simulate.stat.report.txt")
    return int(m.group(1))


# ----------------------------------------------------------------------------------------------
# running a kernel
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class SimResult:
    """One simulated kernel call.

    verdicts: ``(what, index, verdict)`` per comparison (see :func:`parse_verify_lines`).
    failed:   the FAILED verdicts (a run with any raises :class:`SimVerificationError`).
    errors:   ``(function:pass, code)`` pass-interpreter errors -- passes that could not be checked.
    aicore_us / total_cycles: simulated AICore end-to-end time (µs at 1.8 GHz) and total cycles.
    wall_s:   host wall time of the call (compile + verify + cost model).
    work_dir: pypto's working directory for the call (deleted unless MLA_OPS_PYPTO_KEEP_OUTPUT=1).
    """

    kernel: str
    outputs: Dict[str, torch.Tensor]
    verdicts: List[Tuple[str, int, str]]
    failed: List[Tuple[str, int, str]]
    errors: List[Tuple[str, str]]
    aicore_us: float
    total_cycles: int
    wall_s: float
    work_dir: Optional[str] = None

    @property
    def passed(self) -> int:
        return sum(v[2] == "PASS" for v in self.verdicts)

    @property
    def tensor_graph(self) -> List[str]:
        """Verdicts of the kernel arguments against the goldens, in argument order."""
        return [v[2] for v in self.verdicts if v[0] == "tensor_graph"]

    def summary(self) -> str:
        codes = sorted({f"{e[0].rsplit(':', 1)[-1]}={e[1]}" for e in self.errors})
        return (f"{self.kernel}: {self.aicore_us:.2f} us AICore ({self.total_cycles} cycles), "
                f"{self.passed} PASS / {len(self.failed)} FAILED, unchecked passes {codes}, "
                f"wall {self.wall_s:.2f} s")


class SimVerificationError(AssertionError):
    """A simulated kernel produced a FAILED verdict (a pass disagrees with the tensor graph, or an
    output disagrees with its golden)."""

    def __init__(self, result: SimResult):
        self.result = result
        shown = ", ".join(f"{w}[{i}]" for w, i, _ in result.failed[:8])
        super().__init__(f"PyPTO simulation of {result.kernel} reported {len(result.failed)} FAILED "
                         f"verdict(s): {shown}. Rerun with MLA_OPS_PYPTO_KEEP_OUTPUT=1 and read "
                         f"output/*/verify_*/ and the plog under {plog_root()} for the mismatching elements.")


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
            raise RuntimeError(f"{name}: nothing was logged to this process's pypto plog under {plog_root()} "
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
