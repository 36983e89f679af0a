"""Architecture registry: HF `architectures[0]` -> how to read its args and which module implements it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from allspark_server.models.args import ModelArgs, args_from_hf_config


@dataclass(frozen=True)
class ArchSpec:
    read_args: Callable[[dict], ModelArgs]
    model_module: str                 # module holding the model class and SPLIT_RULES
    model_class: str


_REGISTRY: dict[str, ArchSpec] = {
    "LlamaForCausalLM": ArchSpec(lambda hf: args_from_hf_config(hf, qkv_bias_always=False),
                                 "allspark_server.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ArchSpec(lambda hf: args_from_hf_config(hf, qkv_bias_always=True),
                                 "allspark_server.models.llama", "LlamaForCausalLM"),
}


class UnsupportedArchitecture(ValueError):
    pass


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def get_arch(architecture: str) -> ArchSpec:
    if architecture not in _REGISTRY:
        raise UnsupportedArchitecture(
            f"architecture {architecture!r} is not supported; supported: {', '.join(supported_architectures())}")
    return _REGISTRY[architecture]


def model_class_and_rules(architecture: str):
    import importlib
    spec = get_arch(architecture)
    module = importlib.import_module(spec.model_module)
    return getattr(module, spec.model_class), module.SPLIT_RULES


def read_args(hf_config: dict) -> ModelArgs:
    archs = hf_config.get("architectures") or []
    if not archs:
        raise UnsupportedArchitecture(
            f"config.json has no 'architectures'; supported: {', '.join(supported_architectures())}")
    return get_arch(archs[0]).read_args(hf_config)


def quantizable_weights(architecture: str) -> str:
    """The regex of the checkpoint weights InstantQuant may quantize for this architecture (its GEMMs)."""
    import importlib
    return importlib.import_module(get_arch(architecture).model_module).QUANTIZABLE
