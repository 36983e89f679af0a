"""DashInfer's `serialize_model_from_torch`: a torch state dict and its config dict -> the `.asgraph` + `.asparam`
that HuggingFaceModel.serialize writes for the same weights.

DashInfer names the architecture with its own `model_type` tag (LLaMA_v2, Qwen_v20, ...) and passes the HF config as
a dict (DashInfer's HuggingFaceModel adds `size_per_head` and `rotary_emb_base` to it); both are mapped onto our
architectures here. Each argument is honoured or refused naming it; none is ignored in silence (docs/api.md).
"""
from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import Iterator, Mapping, Optional

import torch

from allspark_server.loader.hf_model import HuggingFaceModel, ModelSerializerException, _as_list
from allspark_server.loader.model_file import DTYPES
from allspark_server.lora.adapter import LoraAdapterError, LoraCfg
from allspark_server.models.registry import supported_architectures

log = logging.getLogger("allspark")

# DashInfer model_type -> (the HF architectures it covers, the first is the default; the HF model_type)
MODEL_TYPES = {
    "LLaMA": (("LlamaForCausalLM",), "llama"),
    "LLaMA_v2": (("LlamaForCausalLM",), "llama"),
    "LLaMA_v3": (("LlamaForCausalLM",), "llama"),
    "Qwen_v10": (("QWenLMHeadModel",), "qwen"),
    "Qwen_v15": (("Qwen2ForCausalLM",), "qwen2"),
    "Qwen_v20": (("Qwen2ForCausalLM",), "qwen2"),
    "QwenCode_v20": (("Qwen2ForCausalLM",), "qwen2"),
    "Qwen_v30": (("Qwen3ForCausalLM",), "qwen3"),
    "Qwen_v20_MOE": (("Qwen2MoeForCausalLM",), "qwen2_moe"),
    "ChatGLM_v2": (("ChatGLMModel", "ChatGLMForConditionalGeneration"), "chatglm"),
    "ChatGLM_v3": (("ChatGLMModel", "ChatGLMForConditionalGeneration"), "chatglm"),
    "ChatGLM_v4": (("ChatGLMModel", "ChatGLMForConditionalGeneration"), "chatglm"),
    "Baichuan": (("BaiChuanForCausalLM", "BaichuanForCausalLM"), "baichuan"),
    "Baichuan_v1": (("BaiChuanForCausalLM", "BaichuanForCausalLM"), "baichuan"),
    "Baichuan_v2": (("BaichuanForCausalLM",), "baichuan"),
}
DEFAULT_ROTARY_BASE = 10000.0
WEIGHT_TYPES = {"int8": "int8", "uint8": "uint8", "int4": "int4", "uint4": "uint4"}   # QuantizeConfig.weight_type


def _refuse(argument: str, why: str) -> ModelSerializerException:
    return ModelSerializerException(f"serialize_model_from_torch: {argument}: {why}")


def architecture_for(model_type: str, model_config: dict) -> tuple[str, Optional[str]]:
    """(our architecture, the HF model_type to record) for DashInfer's `model_type`; our own architecture names
    (LlamaForCausalLM, ...) are accepted too. The config's `architectures`, when present, must be one of the type's."""
    given = (model_config.get("architectures") or [None])[0]
    if model_type in supported_architectures():
        if given not in (None, model_type):
            raise _refuse("model_type", f"{model_type!r} but model_config's architectures says {given!r}")
        return model_type, None
    if model_type not in MODEL_TYPES:
        raise _refuse("model_type", f"{model_type!r} is not supported; DashInfer's types: "
                                    f"{', '.join(MODEL_TYPES)}, or one of ours: {', '.join(supported_architectures())}")
    archs, hf_type = MODEL_TYPES[model_type]
    if given is not None and given not in archs:
        raise _refuse("model_type", f"{model_type!r} serves {' / '.join(archs)}, but model_config's architectures "
                                    f"says {given!r}")
    return given or archs[0], hf_type


def quant_config_dict(quant_config) -> Optional[dict]:
    """DashInfer's quant_config as our customized InstantQuant config: a dict is ours already; a QuantizeConfig
    (activation_type, weight_type, extra_option {SubChannel, GroupSize}) is mapped."""
    if quant_config is None or isinstance(quant_config, dict):
        return quant_config
    if not all(hasattr(quant_config, a) for a in ("activation_type", "weight_type")):
        raise _refuse("quant_config", f"expected a dict (our InstantQuant keys, docs/quantization.md) or DashInfer's "
                                      f"QuantizeConfig, got {type(quant_config).__name__}")
    extra = dict(getattr(quant_config, "extra_option", None) or {})
    method = extra.pop("AdaptedQuantMethod", None)
    if method is not None:
        raise _refuse("quant_config", f"AdaptedQuantMethod {method!r}: serialize a GPTQ / AWQ checkpoint from its "
                                      f"folder with HuggingFaceModel instead")
    unknown = set(extra) - {"SubChannel", "GroupSize"}
    if unknown:
        raise _refuse("quant_config", f"extra_option keys {sorted(unknown)} are not supported (SubChannel, GroupSize)")
    weight = str(quant_config.weight_type or "").lower()
    if weight not in WEIGHT_TYPES:
        raise _refuse("quant_config", f"weight_type {quant_config.weight_type!r} is not one of {list(WEIGHT_TYPES)}")
    act = str(quant_config.activation_type).lower()
    if act not in ("float16", "bfloat16", "float32", "int8", "uint8"):
        raise _refuse("quant_config", f"activation_type {quant_config.activation_type!r} is not supported")
    return {"quant_method": "instant_quant", "weight_format": WEIGHT_TYPES[weight],
            "group_size": int(extra.get("GroupSize", 512)) if extra.get("SubChannel") else -1,
            "compute_method": "activate_quant" if act in ("int8", "uint8") else "weight_only"}


class TorchStateModel(HuggingFaceModel):
    """A HuggingFaceModel whose weights come from a state dict and whose config from a dict (no folder: no
    tokenizer, no generation_config.json; EOS ids from the config)."""

    def __init__(self, model_name: str, hf_config: dict, state_dict: Mapping[str, torch.Tensor], data_type: str,
                 source_args: dict[str, str]):
        self.path = None
        self.model_name = model_name
        self.trust_remote_code = False
        self.gguf = None
        self.hf_config, self.hf_generation_config = hf_config, {}
        self._state_dict = state_dict
        self._source = source_args
        self._paths: Optional[tuple[str, str]] = None
        self._read_config(data_type)

    def _checkpoint_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self._state_dict.items():
            if not isinstance(t, torch.Tensor):
                raise _refuse("torch_model", f"{name!r} is a {type(t).__name__}, not a tensor (a state dict is wanted)")
            yield name, t.detach().cpu()

    def _output_paths(self, output_dir: str) -> tuple[str, str]:
        return self._paths or super()._output_paths(output_dir)

    def _source_args(self) -> dict[str, str]:
        return self._source

    def _tokenizer_json(self) -> str:
        return ""

    def eos_token_ids(self) -> list[int]:
        return _as_list(self.hf_config.get("eos_token_id"))

    def init_tokenizer(self, padding_side: str = "left"):
        raise ModelSerializerException("a model serialized from a torch state dict has no tokenizer; pass one to "
                                       "start_request_text, or use start_request with token ids")


def _check_bool(name: str, value, allowed=(False, True)) -> None:
    if value not in allowed:
        raise _refuse(name, f"{value!r} is not one of {list(allowed)}")


def serialize_model_from_torch(model_name: str, model_type: str, torch_model, model_config, save_dir=None,
                               as_model_path=None, as_weight_path=None, data_type="float32", derive_type="lmhead",
                               multigpu_mode=1, do_binary_add_fused=True, do_dynamic_quantize_convert=False,
                               quant_config=None, enable_i8cache_mha=False, mha_kv_cache_config=None,
                               use_dynamic_ntk=False, use_logn_attn=False, model_sequence_length=2048,
                               seqlen_extrapolation=1.0, lora_cfg=None, rotary_base=DEFAULT_ROTARY_BASE
                               ) -> tuple[str, str]:
    """DashInfer's arguments (docs/api.md says how each is honoured); returns (graph path, weights path)."""
    if not isinstance(model_name, str) or not model_name:
        raise _refuse("model_name", "must be a non-empty str")
    if isinstance(torch_model, torch.nn.Module):
        torch_model = torch_model.state_dict()
    if not isinstance(torch_model, Mapping):
        raise _refuse("torch_model", f"expected a state dict (name -> tensor), got {type(torch_model).__name__}")
    if hasattr(model_config, "to_dict"):                 # a transformers PretrainedConfig
        model_config = model_config.to_dict()
    if not isinstance(model_config, Mapping):
        raise _refuse("model_config", f"expected a dict (the HF config), got {type(model_config).__name__}")
    if str(data_type).replace("torch.", "") not in DTYPES:
        raise _refuse("data_type", f"{data_type!r} is not one of {list(DTYPES)}")
    try:
        lora = None if lora_cfg is None else LoraCfg.from_dict(lora_cfg)   # its adapters: serialize_to_path reads them
    except LoraAdapterError as e:
        raise _refuse("lora_cfg", str(e)) from None
    if enable_i8cache_mha or mha_kv_cache_config is not None:
        name = "enable_i8cache_mha" if enable_i8cache_mha else "mha_kv_cache_config"
        raise _refuse(name, "the KV cache format is a runtime setting here: "
                            "AsModelRuntimeConfigBuilder.kv_cache_mode('int8' or 'uint4')")
    if derive_type != "lmhead":
        raise _refuse("derive_type", f"{derive_type!r}: only 'lmhead' (a causal LM head) is supported")
    _check_bool("multigpu_mode", multigpu_mode, (0, 1))            # files always hold whole tensors + split modes
    _check_bool("do_binary_add_fused", do_binary_add_fused)        # a kernel-fusion hint: results are the same
    _check_bool("do_dynamic_quantize_convert", do_dynamic_quantize_convert)
    _check_bool("use_dynamic_ntk", use_dynamic_ntk)
    _check_bool("use_logn_attn", use_logn_attn)
    if seqlen_extrapolation != 1.0:
        raise _refuse("seqlen_extrapolation", f"{seqlen_extrapolation!r}: only 1.0 (no extrapolation) is supported")
    if quant_config is not None and not do_dynamic_quantize_convert:
        raise _refuse("quant_config", "given without do_dynamic_quantize_convert=True, which quantizes with it")
    quant = quant_config_dict(quant_config)

    arch, hf_type = architecture_for(model_type, model_config)
    hf = {k: v for k, v in model_config.items()}
    hf["architectures"] = [arch]
    if hf_type:
        hf["model_type"] = hf_type                       # DashInfer's adapters overwrite it with their tag
    if "size_per_head" in hf and not hf.get("head_dim"):
        hf["head_dim"] = hf["size_per_head"]
    if use_dynamic_ntk or use_logn_attn:
        if arch != "QWenLMHeadModel":
            raise _refuse("use_dynamic_ntk" if use_dynamic_ntk else "use_logn_attn",
                          "only Qwen v1 (Qwen_v10) has dynamic NTK / logn attention")
        hf["seq_length"] = int(model_sequence_length)    # exact up to there; a longer max_length is refused
    if arch == "QWenLMHeadModel":                        # DashInfer's arguments decide, not the config's flags
        hf["use_dynamic_ntk"], hf["use_logn_attn"] = bool(use_dynamic_ntk), bool(use_logn_attn)

    if as_model_path is not None or as_weight_path is not None:
        if as_model_path is None or as_weight_path is None:
            raise _refuse("as_model_path" if as_model_path is None else "as_weight_path",
                          "as_model_path and as_weight_path are given together")
        paths: Optional[tuple[str, str]] = (str(as_model_path), str(as_weight_path))
    elif save_dir is None:
        raise _refuse("save_dir", "give save_dir, or both as_model_path and as_weight_path")
    else:
        paths = None

    dumped = {"source": "torch state dict", "model_type": str(model_type), "derive_type": derive_type,
              "multigpu_mode": str(int(multigpu_mode)), "do_binary_add_fused": str(bool(do_binary_add_fused)),
              "use_dynamic_ntk": str(bool(use_dynamic_ntk)), "use_logn_attn": str(bool(use_logn_attn)),
              "model_sequence_length": str(model_sequence_length), "rotary_base": str(float(rotary_base))}
    model = TorchStateModel(model_name, hf, torch_model, data_type, dumped)
    if float(rotary_base) != DEFAULT_ROTARY_BASE and float(rotary_base) != model.args.rope_theta:
        # DashInfer's rotary_base is the rope base its graph uses: it replaces the config's (serialize_args say so)
        log.info("serialize_model_from_torch: rotary_base %s replaces the config's rope base %s", rotary_base,
                 model.args.rope_theta)
        model.args = replace(model.args, rope_theta=float(rotary_base))
    model._paths = paths
    if lora is None or not lora.lora_only:
        model.load_model()
    # the .aslora files go beside the model's (save_dir, or as_model_path's folder)
    model.serialize_to_path(None, save_dir or os.path.dirname(paths[0]) or ".",
                            enable_quant=bool(do_dynamic_quantize_convert), customized_quant_config=quant,
                            lora_cfg=lora_cfg)
    return model.graph_path, model.weights_path
