"""Devices, dtypes, memory and timing for the command line (`mla-ops ask` / `mla-ops bench`)."""
from __future__ import annotations

import contextlib
import os
import pathlib
import re
import time
from typing import Iterator, Optional

import torch

from .._optional import has_module
from ..bench.timing import synchronize

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}


class CliError(Exception):
    """A user-facing error: printed as `mla-ops: error: <message>`, exit status 2."""


def first_line(exc: BaseException) -> str:
    """An exception's message on one line (library errors often carry tracebacks or tables)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).strip().splitlines()  # no terminal colour codes
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def check_writable(flag: str, path_name: str) -> pathlib.Path:
    """Refuse an output path that cannot be written, before any work: a report or a table that fails
    to save after a whole generation or benchmark throws the run away. Creates missing parent
    directories (as the writer would) and leaves no file behind."""
    path = pathlib.Path(path_name).expanduser()
    if path.is_dir():
        raise CliError(f"{flag} {path}: is a directory; give a file name")
    existed = path.exists()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8"):
            pass
    except OSError as exc:
        raise CliError(f"{flag} {path}: cannot be written ({exc.strerror or exc}); choose a writable path") from None
    if not existed:
        path.unlink()
    return path


def resolve_device(spec: str) -> torch.device:
    """'cpu', an accelerator index ('0', as the original script's --device 7), or 'npu:1' / 'cuda:0'."""
    spec = str(spec).strip().lower()
    if spec == "cpu":
        return torch.device("cpu")
    if spec.isdigit():
        index = int(spec)
        if has_module("torch_npu"):
            import torch_npu  # noqa: F401  (registers torch.npu)

            if torch.npu.is_available():
                if index >= torch.npu.device_count():
                    raise CliError(f"--device {index}: only {torch.npu.device_count()} NPU(s) are visible")
                return torch.device(f"npu:{index}")
        if torch.cuda.is_available():
            if index >= torch.cuda.device_count():
                raise CliError(f"--device {index}: only {torch.cuda.device_count()} CUDA device(s) are visible")
            return torch.device(f"cuda:{index}")
        raise CliError(f"--device {index}: no NPU (torch_npu) or CUDA device is available on this machine; "
                       f"use --device cpu")
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise CliError(f"--device {spec!r} is not a device: use cpu, an accelerator index (0, 1, ...), "
                       f"npu:N or cuda:N") from None
    if device.type not in ("cpu", "cuda", "npu"):  # mps, meta, xpu, ...: no backend or path here runs them
        raise CliError(f"--device {spec}: device type {device.type!r} is not supported; use cpu, an accelerator "
                       f"index (0, 1, ...), npu:N or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CliError(f"--device {spec}: CUDA is not available on this machine; use --device cpu")
    if device.type == "npu":
        return resolve_device(str(device.index or 0))
    return device


def resolve_dtype(name: str, device: torch.device, checkpoint_dtype: Optional[torch.dtype] = None) -> torch.dtype:
    """'auto': the checkpoint's dtype, else bf16 (fp32 on a CPU without native bf16 support)."""
    if name != "auto":
        if name not in DTYPES:
            raise CliError(f"--dtype {name!r}: choose auto, fp32, bf16 or fp16")
        return DTYPES[name]
    if checkpoint_dtype is not None:
        return checkpoint_dtype
    if device.type == "cpu" and not torch.backends.mkldnn.is_available():
        return torch.float32
    return torch.bfloat16


class PeakMemory:
    """Peak memory of a phase: device allocator peak on accelerators, peak RSS (VmHWM) on CPU.

    Linux lets a process reset its own VmHWM (write 5 to /proc/self/clear_refs), so each phase gets
    its own peak; where that is not possible the process-wide peak is reported and says so."""

    def __init__(self, device: torch.device):
        self.device = device
        self.source = ""

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.device.type == "npu":
            torch.npu.reset_peak_memory_stats(self.device)
        else:
            try:
                with open("/proc/self/clear_refs", "w") as fh:
                    fh.write("5")
                self.source = "peak RSS of the phase"
            except OSError:
                self.source = "process peak RSS (could not reset it)"

    def peak_mb(self) -> float:
        if self.device.type == "cuda":
            self.source = "CUDA allocator peak"
            return torch.cuda.max_memory_allocated(self.device) / 2**20
        if self.device.type == "npu":
            self.source = "NPU allocator peak"
            return torch.npu.max_memory_allocated(self.device) / 2**20
        try:
            with open("/proc/self/status") as fh:
                for line in fh:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) / 1024
        except OSError:
            pass
        import resource

        self.source = "process peak RSS"
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@contextlib.contextmanager
def timed(device: torch.device) -> Iterator[dict]:
    """with timed(dev) as t: ...  -> t["seconds"], device work included."""
    result: dict = {}
    synchronize(device)
    start = time.perf_counter()
    try:
        yield result
    finally:
        synchronize(device)
        result["seconds"] = time.perf_counter() - start


def offline_environment() -> None:
    """No network: everything loads from local files."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
