"""mla-ops: multi-head latent attention (MLA) operators for PyTorch, `torch.ops.mla`.

The native CPU kernels (mla_ops/csrc/cpu) are one extension module, `mla_ops._C`: the sources of
csrc/cpu/kernels are compiled once per ISA of the platform (x86-64: DEFAULT, AVX2, AVX512; elsewhere
DEFAULT, which is NEON on aarch64) and the rest once, all linked into it; the kernels pick their ISA at
run time (csrc/cpu/isa.h). They are compiled against the torch of the environment that runs the build,
so that torch must be importable here: `pip install --no-build-isolation .` (pip's default build
isolation hides it). A build that cannot import torch, finds a torch outside `TORCH_REQUIREMENT`, or
fails to compile, stops with the reason and the fix. MLA_OPS_NO_NATIVE=1 installs the package without
them (the reference kernels serve the CPU).
"""
import glob
import os
import platform
import re
import sys

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import SetupError

NO_NATIVE_ENV = "MLA_OPS_NO_NATIVE"
# The torch release the C++ is built and tested against: the kernels use ATen internals (at::vec,
# at::parallel_for, dispatcher registration) whose ABI changes between releases, so an extension
# built for one release does not load in another.
TORCH_MAJOR_MINOR = (2, 13)
_MAJOR, _MINOR = TORCH_MAJOR_MINOR
TORCH_REQUIREMENT = f"torch>={_MAJOR}.{_MINOR},<{_MAJOR}.{_MINOR + 1}"
NATIVE_FIX = (f"rerun with `pip install --no-build-isolation .` (`pip install --no-build-isolation -e .` for a "
              f"development install) in an environment that has {TORCH_REQUIREMENT} installed, or set "
              f"{NO_NATIVE_ENV}=1 for a pure-Python install (reference kernels only)")


def _read_version() -> str:
    """`__version__` of mla_ops/_version.py, read as text (importing the package needs torch)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mla_ops", "_version.py")
    with open(path, encoding="utf-8") as file:
        match = re.search(r'^__version__ = "([^"]+)"$', file.read(), re.MULTILINE)
    if match is None:
        raise SetupError(f"{path}: no `__version__ = \"...\"` line")
    return match.group(1)


_CSRC = "mla_ops/csrc/cpu"
# Compiled once: the argument checks, the reasons, the registration and the module.
_ONCE_SOURCES = sorted(glob.glob(f"{_CSRC}/*.cpp"))
# Compiled once per ISA: every kernel file (a new kernel needs no change here).
_KERNEL_SOURCES = sorted(glob.glob(f"{_CSRC}/kernels/*.cpp"))
# -ffp-contract=off: the kernels reproduce the reference's separately rounded products (RoPE); the
# FMAs the decode kernel wants are written explicitly (at::vec::fmadd), not left to contraction.
_COMMON_FLAGS = ["-O3", "-std=c++17", "-fvisibility=hidden", "-ffp-contract=off"]
# at::parallel_for is a header template: with ATen's OpenMP backend it is an `omp parallel` region
# compiled into this extension, so without -fopenmp every kernel would run on one thread.
_OPENMP_FLAGS = ["-fopenmp"]
# ATen's vec headers pick their SIMD implementation from these macros (and put it in the inline
# namespace CPU_CAPABILITY); the -m flags are the ones ATen's own kernels of that level use. The
# once-compiled sources get the DEFAULT flags.
_ISA_FLAGS = {
    "default": ["-DCPU_CAPABILITY=DEFAULT", "-DCPU_CAPABILITY_DEFAULT"],
    "avx2": ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512", "-mavx512f", "-mavx512bw", "-mavx512vl",
               "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
}


def _native_opted_out() -> bool:
    return os.environ.get(NO_NATIVE_ENV, "0") not in ("", "0")


def _isas() -> tuple:
    """The ISAs the kernel files are compiled for, DEFAULT first (csrc/cpu/isa.h names the same set)."""
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    return ("default", "avx2", "avx512") if x86 else ("default",)


def _refusing_build_ext(reason: str) -> type:
    """A build_ext that stops the build with `reason` (the extensions cannot be built here)."""

    class RefusingBuildExt(build_ext):
        def run(self):
            raise SetupError(reason)

    return RefusingBuildExt


def _native_extensions() -> tuple:
    """(ext_modules, cmdclass) building the native kernels; without torch, a build_ext that stops
    with the reason (metadata and sdists need no torch, wheels and installs do)."""
    if _native_opted_out():
        print(f"mla-ops: {NO_NATIVE_ENV} is set: installing without the native CPU kernels (reference kernels "
              f"only)", file=sys.stderr)
        return [], {}
    placeholders = [Extension("mla_ops._C", _ONCE_SOURCES + _KERNEL_SOURCES)]
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except Exception as exc:  # pip's default build isolation: a fresh environment without torch
        reason = (f"mla-ops builds its native CPU kernels against the torch installed in your environment, "
                  f"but this build cannot import torch ({type(exc).__name__}: {exc}); pip builds in an "
                  f"isolated environment unless told not to. Fix: {NATIVE_FIX}.")
        return placeholders, {"build_ext": _refusing_build_ext(reason)}
    found = tuple(int(part) for part in re.findall(r"\d+", torch.__version__)[:2])
    if found != TORCH_MAJOR_MINOR:
        reason = (f"mla-ops's native CPU kernels are built and tested against {TORCH_REQUIREMENT} (they use ATen "
                  f"internals that change between torch releases); this environment has torch {torch.__version__}. "
                  f"Fix: install {TORCH_REQUIREMENT} first, then {NATIVE_FIX}.")
        return placeholders, {"build_ext": _refusing_build_ext(reason)}

    # the DEFAULT build of the kernels is part of the extension's own sources, so its objects come first
    # on the link line: where two builds emit the same inline function of a shared header (outside
    # CPU_CAPABILITY), the linker keeps the first, which every CPU runs
    extension = CppExtension("mla_ops._C", _ONCE_SOURCES + _KERNEL_SOURCES,
                             extra_compile_args=_COMMON_FLAGS + _OPENMP_FLAGS + _ISA_FLAGS["default"],
                             extra_link_args=_OPENMP_FLAGS)

    class NativeBuildExtension(BuildExtension):
        """Compiles the kernel files once more per further ISA (into their own folder, linked after the
        DEFAULT objects); a failed build (no compiler, an old compiler, no OpenMP) stops the install with
        the fix."""

        def build_extension(self, ext):
            try:
                args = ext.extra_compile_args  # with what BuildExtension added (the extension's name, ABI)
                cxx = args["cxx"] if isinstance(args, dict) else args
                shared = [flag for flag in cxx if flag not in _ISA_FLAGS["default"]]
                objects = []
                for isa in _isas()[1:]:
                    objects += self.compiler.compile(
                        _KERNEL_SOURCES, output_dir=os.path.join(self.build_temp, isa), macros=ext.define_macros,
                        include_dirs=ext.include_dirs, debug=self.debug, extra_postargs=shared + _ISA_FLAGS[isa],
                        depends=ext.depends)
                ext.extra_objects = [*(ext.extra_objects or []), *objects]
                super().build_extension(ext)
            except Exception as exc:
                raise SetupError(
                    f"mla-ops: building the native CPU kernels ({ext.name}) failed: {exc}. They need a C++17 "
                    f"compiler with OpenMP (g++ 9 or newer, or clang with libomp; the compiler's own messages are "
                    f"above). Fix: install one and rerun, or set {NO_NATIVE_ENV}=1 for a pure-Python install "
                    f"(reference kernels only).") from exc

    return [extension], {"build_ext": NativeBuildExtension.with_options(use_ninja=True)}


_EXT_MODULES, _CMDCLASS = _native_extensions()

setup(
    name="mla-ops",
    version=_read_version(),
    description=("Multi-head latent attention (DeepSeek-V2/V3/V3.2 MLA and sparse attention) as PyTorch "
                 "operators, torch.ops.mla: CPU, Ascend and reference backends, a transformers patch and a vLLM "
                 "plugin"),
    long_description=open("README.md", encoding="utf-8").read() if os.path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    license_files=["LICENSE"],
    python_requires=">=3.10",
    packages=find_packages(include=["mla_ops", "mla_ops.*"]),
    # bench/entry_floor.cpp: compiled by `mla-ops bench ops` when it runs (not part of the extension)
    package_data={"mla_ops": ["py.typed", "assets/builtin_tokenizer/*", "assets/builtin_model/*", "bench/*.cpp"]},
    # torch is bounded to the release the native kernels are built and tested against (TORCH_REQUIREMENT);
    # any build of it works (CPU, CUDA, or the torch under torch_npu). The ops need nothing else; the
    # transformers integration and the CLI need transformers (the `transformers` extra, bounded to the
    # range the model patch accepts at patch time). Keeping it out of install_requires lets mla-ops sit
    # next to vLLM, which pins its own transformers.
    install_requires=[TORCH_REQUIREMENT],
    extras_require={
        # the releases the patch is tested on: the hub remote code from 4.45, native models 4.54-5.24
        "transformers": ["transformers>=4.45,<5.25", "safetensors", "tokenizers"],
        "pypto": ["pypto==0.2.0"],
        "plot": ["matplotlib"],
        "npu": ["torch_npu"],
        "test": ["pytest", "expecttest", "hypothesis"],
    },
    entry_points={
        "console_scripts": ["mla-ops=mla_ops.cli:main"],
        # vLLM calls this in each of its processes; it does nothing without vLLM (see the module docstring).
        "vllm.general_plugins": ["mla_ops = mla_ops.integrations.vllm:register"],
    },
    ext_modules=_EXT_MODULES,
    cmdclass=_CMDCLASS,
)
