"""mla-ops: multi-head latent attention (MLA) kernels as torch.ops.mla operators.

Native CPU kernels (mla_ops/csrc/cpu) are built once per ISA as extension modules
`mla_ops._C_avx512`, `mla_ops._C_avx2` (x86-64) and `mla_ops._C_default` (every platform; NEON on
aarch64); `mla_ops.backends.cpu_native` picks the best one the CPU supports at run time. They are optional:
without a C++ compiler (or with MLA_OPS_NO_NATIVE=1) the package installs without them and
`mla-ops info` / `mla_ops.explain(...)` say why.
"""
import os
import platform
import sys

from setuptools import find_packages, setup

_CSRC = "mla_ops/csrc/cpu"
_SOURCES = [f"{_CSRC}/{name}.cpp"
            for name in ("decode_attention", "lightning_indexer", "kv_prolog", "paged_kv_cache", "arguments",
                         "registration", "bindings")]
# -ffp-contract=off: the kernels reproduce the reference's separately rounded products (RoPE); the
# FMAs the decode kernel wants are written explicitly (at::vec::fmadd), not left to contraction.
_COMMON_FLAGS = ["-O3", "-std=c++17", "-fvisibility=hidden", "-ffp-contract=off"]
# at::parallel_for is a header template: with ATen's OpenMP backend it is an `omp parallel` region
# compiled into this extension, so without -fopenmp every kernel would run on one thread.
_OPENMP_FLAGS = ["-fopenmp"]
# ATen's vec headers pick their SIMD implementation from these macros (and put it in the inline
# namespace CPU_CAPABILITY); the -m flags are the ones ATen's own kernels of that level use.
_ISA_FLAGS = {
    "avx512": ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512", "-mavx512f", "-mavx512bw", "-mavx512vl",
               "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
    "avx2": ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", "-mf16c"],
    "default": ["-DCPU_CAPABILITY=DEFAULT", "-DCPU_CAPABILITY_DEFAULT"],
}


def _native_extensions():
    """(ext_modules, cmdclass) for the native kernels, or ([], {}) where they cannot be built."""
    if os.environ.get("MLA_OPS_NO_NATIVE", "0") not in ("", "0"):
        return [], {}
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except Exception as exc:  # torch missing at build time (e.g. build isolation): pure-Python install
        print(f"mla-ops: native CPU kernels not built ({exc})", file=sys.stderr)
        return [], {}

    x86 = platform.machine().lower() in ("x86_64", "amd64")
    isas = ("avx512", "avx2", "default") if x86 else ("default",)
    extensions = [
        CppExtension(f"mla_ops._C_{isa}", _SOURCES, extra_compile_args=_COMMON_FLAGS + _OPENMP_FLAGS + _ISA_FLAGS[isa],
                     extra_link_args=_OPENMP_FLAGS)
        for isa in isas
    ]

    class OptionalBuildExtension(BuildExtension):
        """Builds each ISA in its own temp folder (the three share source names) and turns a failed
        build (no compiler, old compiler) into a warning: the package still installs."""

        def build_extension(self, ext):
            build_temp = self.build_temp
            self.build_temp = os.path.join(build_temp, ext.name.rsplit(".", 1)[-1])
            try:
                super().build_extension(ext)
            except Exception as exc:
                print(f"mla-ops: WARNING: native extension {ext.name} not built: {exc}", file=sys.stderr)
            finally:
                self.build_temp = build_temp

        def run(self):
            try:
                super().run()
            except Exception as exc:
                print(f"mla-ops: WARNING: native CPU kernels not built: {exc}", file=sys.stderr)

    return extensions, {"build_ext": OptionalBuildExtension.with_options(use_ninja=True)}


_EXT_MODULES, _CMDCLASS = _native_extensions()

setup(
    name="mla-ops",
    version="0.1.0",
    description="DeepSeek-V2 MLA kernels (KV prolog, paged latent cache, absorbed decode) as torch.ops.mla",
    long_description=open("README.md", encoding="utf-8").read() if os.path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["mla_ops", "mla_ops.*"]),
    package_data={"mla_ops": ["assets/builtin_tokenizer/*"]},
    # torch is deliberately unpinned here (pinned in requirements.txt): the package works with the
    # torch a user already has (CPU, CUDA or torch_npu builds). The ops need nothing else; the
    # transformers integration and the CLI need transformers (the `transformers` extra, bounded to the
    # range the model patch accepts at apply time). Keeping it out of install_requires lets mla-ops sit
    # next to vLLM, which pins its own transformers.
    install_requires=["torch>=2.6"],
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
