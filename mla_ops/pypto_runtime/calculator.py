"""pypto's verify "calculator": a host library that interprets kernel graphs with torch ops on CPU.

The stock pypto rebuilds it with cmake in a temporary directory in every process (20-45 s on two
cores). Here it is built once per ``<pypto>-<torch>-abi<n>`` key into an on-disk cache
(``MLA_OPS_PYPTO_CACHE``, default ``~/.cache/mla_ops/pypto_calculator``) and loaded in milliseconds.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Optional

import torch

from .compat import ensure_supported, installed_pypto_version

_CALC_LOCK = threading.Lock()
_calculator_path: Optional[Path] = None


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
