"""orin-agent: serve an LLM on NVIDIA Jetson Orin, sliced into TensorRT engines, with power control."""
from setuptools import find_packages, setup

setup(
    name="orin-agent",
    version="0.1.0",
    description="On-device LLM service for NVIDIA Jetson Orin: sliced engines, phase-aware power control, early exit and offload",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # the shipped model (models/<name>) installs as package data of partition.shipped_models, so a
    # wheel or a non-editable install carries it (partition/paths.py finds it either way)
    packages=find_packages(include=["agent", "agent.*", "power", "power.*", "partition", "partition.*", "kernels", "kernels.*"])
    + ["partition.shipped_models"],
    package_dir={"partition.shipped_models": "models"},
    # kernels/ort_q4.c: the exact 4-bit CPU operator, compiled on the user's machine on first use (kernels/ort_q4.py)
    package_data={"power": ["profiles/*.toml"], "partition.shipped_models": ["*/*.json", "*/*.safetensors", "*/*.md"],
                  "kernels": ["*.c"]},
    include_package_data=True,
    install_requires=[
        # torch>=2.2: the on-disk CPU build torch==2.13.0 satisfies it; JetPack's NVIDIA wheels too.
        "torch>=2.2",
        "numpy>=1.24",
        "safetensors>=0.4",
        "tokenizers>=0.15",
        "onnx>=1.15",
        "onnxruntime>=1.17",
        "onnxscript>=0.1",
        "typer>=0.12",
        "rich>=13",
        "tqdm>=4.66",
        "gguf>=0.10",  # llama.cpp's reader of GGUF model files (partition/gguf)
        "scipy>=1.10",  # binomial tail bounds of the exit calibration (partition/exits/calibrate.py)
        "fastapi>=0.110",
        "uvicorn>=0.29",
        "httpx>=0.27",
        "jinja2>=3.1",
        "prometheus-client>=0.20",
        "tomli>=2.0; python_version < '3.11'",  # profiles (TOML) on Python 3.10
        "matplotlib>=3.7",
    ],
    extras_require={
        # accelerate: transformers' GGUF loader needs it (tests hold partition/gguf against it)
        # pytest < 9.2: schemathesis 4.32.5 (the newest) reads pytest's Function._nodeid, gone in pytest 9.2.0
        # (AttributeError: 'Function' object has no attribute '_nodeid'); 9.1.1 runs it (the slow tests).
        # transformers < 5.25: 5.25.0 requires Hugging Face's `kernels` package (kernels>=0.19.1,<0.20), whose
        # top-level module `kernels` is shadowed by this project's kernels/ (a fixed top-level folder): transformers
        # then fails at import (cannot import name 'CUDAProperties' from 'kernels'), and so do setuptools builds
        # that load its entry points (No module named 'kernels._internals'); 5.24.0 requires no such package.
        "test": ["pytest>=8,<9.2", "hypothesis>=6.100", "transformers>=4.45,<5.25", "accelerate>=0.26", "openai>=1.30",
                 "vermin>=1.6", "tomli>=2.0", "schemathesis>=4.0"],  # the 3.10 checks run under 3.11 too
        # TensorRT itself comes from JetPack's apt packages (python3-libnvinfer), never pip.
        "jetson": ["jetson-stats>=4.2"],
        # the device side of offload (KServe v2 over gRPC); the edge server's own interpreter comes
        # from scripts/edge-venv.sh (nvidia-pytriton needs numpy<2).
        "edge": ["tritonclient[grpc,http]>=2.51"],
        # GPU kernels of the INT8 KV-cache (kernels/kv_triton.py); CUDA builds of torch bring it already.
        "triton": ["triton>=3.2"],
    },
    entry_points={"console_scripts": ["orin-agent=agent.boot:main"]},  # SIGTERM handled from the first line
)
