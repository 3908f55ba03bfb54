"""mla-ops: DeepSeek-V2 multi-head latent attention (MLA) kernels as torch.ops.mla operators."""
from setuptools import find_packages, setup

setup(
    name="mla-ops",
    version="0.1.0",
    description="DeepSeek-V2 MLA kernels (KV prolog, paged latent cache, absorbed decode) as torch.ops.mla",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
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
        "transformers": ["transformers>=5.24,<5.25", "safetensors", "tokenizers"],
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
)
