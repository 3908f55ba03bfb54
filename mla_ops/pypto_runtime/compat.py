"""The pypto version this runtime supports, and the one private pypto 0.2.0 method it replaces.

``JitCallableWrapper._setup_verify_data`` stages the kernel arguments through zero-filled copies
with ``CopyToHost``, which is a no-op without CANN, so the verifier computes on zeros and the
write-back zeroes the caller's inputs and outputs. The replacement hands the caller's CPU buffers to
``SetVerifyData`` directly (non-CPU tensors still take the original path). The fix is only valid for
pypto 0.2.0, which is why :func:`ensure_supported` refuses any other version. Nothing here imports
pypto until :func:`ensure_supported` is called.
"""
from __future__ import annotations

import atexit
import functools
import importlib.metadata
import importlib.util
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path
from typing import Callable, Optional

SUPPORTED_PYPTO_VERSION = "0.2.0"

_SETUP_LOCK = threading.Lock()
_PATCHED_MARK = "_mla_ops_cpu_verify_fix"
_plog_base_at_import: Optional[str] = None


@functools.lru_cache(maxsize=None)
def installed_pypto_version() -> Optional[str]:
    """The installed ``pypto`` distribution's version, or None if it is not installed (no import).

    Cached: it is consulted on every kernel call's "can this run" check, and reading package
    metadata costs about half a millisecond."""
    try:
        return importlib.metadata.version("pypto")
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=None)
def unavailable_reasons() -> tuple[str, ...]:
    """Why the PyPTO kernels cannot run here (empty = they can). Does not import pypto; cached."""
    ver = installed_pypto_version()
    if ver is None:
        return (f"pypto {SUPPORTED_PYPTO_VERSION} not installed (pip install pypto=={SUPPORTED_PYPTO_VERSION})",)
    if ver != SUPPORTED_PYPTO_VERSION:
        return (f"pypto {ver} is installed, but mla_ops' PyPTO kernels and CPU simulation support exactly "
                f"pypto {SUPPORTED_PYPTO_VERSION} (the runtime replaces a private method of that release); "
                f"install pypto=={SUPPORTED_PYPTO_VERSION}",)
    if importlib.util.find_spec("pypto") is None:
        return (f"the pypto {ver} distribution is installed but `pypto` is not importable",)
    return ()


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
    reasons = unavailable_reasons()
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
        # The verify calculator is loaded by runner.run_kernel before any kernel runs on CPU tensors.
        pypto_impl.SetVerifyData(entry._pto_to_tensor_data(pto_tensors), [], _pto_verify_datas.get_data())

    return _setup_verify_data




def plog_root() -> Path:
    """The directory pypto's plog files are written under: ASCEND_PROCESS_LOG_PATH as it was when
    :func:`ensure_supported` imported pypto, else as it is now, else pypto's default ~/ascend/log."""
    base = _plog_base_at_import or os.environ.get("ASCEND_PROCESS_LOG_PATH")
    return Path(base) if base else Path(os.path.expanduser("~"), "ascend", "log")
