"""HuggingFaceModel: DashInfer's loader object — read an HF folder, serialize it, derive configs.

`load_model()` reads the weights (cast to the chosen dtype) and checks them against the
architecture; `serialize()` writes `<name>.asgraph` + `<name>.asparam`; the two
`create_reference_*_builder` methods fill runtime and generation configs from the model's own
config.json / generation_config.json. The tokenizer comes from the same folder. A GGUF file (or a folder
holding one) stands in for the folder: loader/gguf_model.py reads it.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import re
from typing import Optional

import torch

from allspark_client.config import AsModelConfig, AsModelRuntimeConfigBuilder
from allspark_client.generation_config import ASGenerationConfigBuilder
from allspark_server.collective.comm import LocalComm
from allspark_server.layers.sharding import TPLayout, split_mode_for
from allspark_server.loader.gguf_reader import GGUFError, find_gguf
from allspark_server.loader.hf_reader import iter_hf_tensors, read_generation_config, read_hf_config
from allspark_server.loader.model_file import DTYPES, write_model_files
from allspark_server.loader.quantized import plan_scheme, quantize_tensors, quantized_split_modes
from allspark_server.loader.tokenizer_files import load_tokenizer, read_tokenizer_json
from allspark_server.loader.weights import checkpoint_shapes, non_finite, quantize_layers
from allspark_server.lora.adapter import LoraAdapterError, read_lora_cfg, write_adapters
from allspark_server.models.args import ModelArgs
from allspark_server.models.decoder import model_class_and_rules, quantizable_weights
from allspark_server.models.registry import get_arch, read_args
from allspark_server.quant import awq, fp8_checkpoint, gptq
from allspark_server.quant.scheme import QuantConfigError, QuantScheme

log = logging.getLogger("allspark")

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
SAMPLING_KEYS = ("do_sample", "temperature", "top_k", "top_p", "repetition_penalty")
# quantization_config.quant_method -> its reader
PREQUANTIZED = {"gptq": gptq.GptqConfig, "awq": awq.AwqConfig, "fp8": fp8_checkpoint.Fp8Config,
                "compressed-tensors": fp8_checkpoint.Fp8Config, "fbgemm_fp8": fp8_checkpoint.Fp8Config}


class ModelSerializerException(RuntimeError):
    pass


def _dtype_from(name) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    key = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "float": "float32", "half": "float16"}.get(
        str(name).replace("torch.", ""), str(name).replace("torch.", ""))
    if key not in DTYPES:
        raise ModelSerializerException(f"data type {name!r} is not supported (float32, bfloat16, float16)")
    return DTYPES[key]


def _as_list(v) -> list[int]:
    if v is None:
        return []
    return [int(x) for x in (v if isinstance(v, (list, tuple)) else [v])]


class HuggingFaceModel:
    def __init__(self, pretrain_model_name_or_path: str, pretrain_model_name: str, in_memory_serialize: bool = False,
                 user_set_data_type: Optional[str] = None, trust_remote_code: bool = False, gguf_requant=None):
        """`pretrain_model_name_or_path`: a HF folder, a .gguf file or a folder holding one (and no config.json);
        `gguf_requant`: a GGUF's format for block types without an exact mapping (loader/gguf_model.py)."""
        try:
            gguf_file = find_gguf(pretrain_model_name_or_path)
        except GGUFError as e:
            raise ModelSerializerException(str(e)) from None
        if gguf_file is None and not os.path.isdir(pretrain_model_name_or_path):
            raise ModelSerializerException(f"{pretrain_model_name_or_path!r} is not a local folder or .gguf file "
                                           f"(allspark never downloads models)")
        self.path = gguf_file or pretrain_model_name_or_path
        self.model_name = pretrain_model_name
        self.trust_remote_code = trust_remote_code
        self.gguf = None                                 # a GGUF file's reader (loader/gguf_model.py)
        try:
            if gguf_file:
                from allspark_server.loader.gguf_model import GGUFModel
                self.gguf = GGUFModel(gguf_file, gguf_requant)
                self.hf_config, self.hf_generation_config = self.gguf.hf_config, self.gguf.generation_config
            else:
                self.hf_config = read_hf_config(self.path)
                self.hf_generation_config = read_generation_config(self.path)
        except ValueError as e:                          # CheckpointError, GGUFError
            raise ModelSerializerException(str(e)) from None
        self._read_config(user_set_data_type)

    def _read_config(self, user_set_data_type) -> None:
        """The model's args, dtype and quantization from self.hf_config (self.path: its folder, or None)."""
        try:
            self.args: ModelArgs = read_args(self.hf_config, self.path)
        except ValueError as e:
            raise ModelSerializerException(str(e)) from None
        cfg_dtype = self.hf_config.get("dtype") or self.hf_config.get("torch_dtype") or "bfloat16"
        self.data_type = _dtype_from(user_set_data_type or cfg_dtype)
        self.prequant = None                             # a GPTQ / AWQ / FP8 checkpoint's config (config.json says so)
        qc = self.hf_config.get("quantization_config")
        if qc:
            method = qc.get("quant_method") if isinstance(qc, dict) else None
            if method not in PREQUANTIZED:
                raise ModelSerializerException(f"quantization_config.quant_method {method!r} is not supported "
                                               f"({', '.join(PREQUANTIZED)})")
            try:
                self.prequant = PREQUANTIZED[method].from_hf(qc)
            except QuantConfigError as e:
                raise ModelSerializerException(str(e)) from None
        self._quant: Optional[QuantScheme] = None        # the scheme of already quantized weights (GPTQ / AWQ / FP8)
        self._tensors: Optional[dict[str, torch.Tensor]] = None
        self._tokenizer = None
        self.graph_path: Optional[str] = None
        self.weights_path: Optional[str] = None

    # ---- weights -----------------------------------------------------------------------------
    def load_model(self, override_data_type=None, **_ignored) -> "HuggingFaceModel":
        if override_data_type is not None:
            self.data_type = _dtype_from(override_data_type)
        if self.gguf is not None:
            try:
                tensors, quant = self.gguf.load(self.args, self._meta_model, self.data_type)
            except ValueError as e:                      # GGUFError, QuantConfigError
                raise ModelSerializerException(str(e)) from None
            for name, t in tensors.items():
                self._check_finite(name, t)
            self._tensors, self._quant = tensors, quant
            return self
        shapes = self._checkpoint_shapes()
        expected = set(shapes)
        tensors = {}
        prequant_layers: dict[str, dict[str, torch.Tensor]] = {}
        quantizable = quantizable_weights(self.args.architecture)
        convert, side = get_arch(self.args.architecture).convert, get_arch(self.args.architecture).side
        self._side_tensors = {}
        for checkpoint_name, raw in self._checkpoint_tensors():
            if checkpoint_name.endswith(IGNORED_SUFFIXES):
                continue
            side_name = side(checkpoint_name) if side is not None else None
            if side_name is not None:         # a vision tower's: kept as it is, in the model's dtype
                self._side_tensors[side_name] = raw.to(self.data_type) if raw.is_floating_point() else raw
                self._check_finite(checkpoint_name, self._side_tensors[side_name], raw)
                continue
            base, _, suffix = checkpoint_name.rpartition(".")
            if (self.prequant and suffix in self.prequant.tensors and re.search(quantizable, base + ".weight")
                    and not self.prequant.keeps_dense(base)):
                prequant_layers.setdefault(base, {})[suffix] = raw
                continue
            try:
                converted = list(convert(checkpoint_name, raw, self.args))
            except ValueError as e:
                raise ModelSerializerException(f"{self.args.architecture}: tensor {checkpoint_name!r}: {e}") from None
            for name, t in converted:
                if name not in expected:
                    raise ModelSerializerException(f"unexpected tensor {checkpoint_name!r} for "
                                                   f"{self.args.architecture}")
                tensors[name] = t.to(self.data_type) if t.is_floating_point() else t
                self._check_finite(checkpoint_name, tensors[name], t)
        if self.args.tie_word_embeddings:
            tensors.pop("lm_head.weight", None)
            expected.discard("lm_head.weight")
        if self.prequant:
            self._quant = self._repack_prequantized(prequant_layers, shapes, tensors, expected)
        missing = expected - set(tensors)
        if missing:
            raise ModelSerializerException(f"{self.args.architecture} checkpoint lacks tensors (in the decoder's "
                                           f"names): {sorted(missing)[:5]}")
        for name, t in tensors.items():
            if name in shapes and tuple(t.shape) != shapes[name]:
                raise ModelSerializerException(f"tensor {name!r} has shape {tuple(t.shape)}, config says "
                                               f"{shapes[name]}")
        self._tensors = tensors
        return self

    def _check_finite(self, name: str, t: torch.Tensor, source: Optional[torch.Tensor] = None) -> None:
        """Refuse a tensor with NaN / inf values, naming it (`name`: the file's); `source`: what `t` was converted
        from, to tell values that the file holds from finite ones beyond the range of the model's dtype."""
        why = non_finite(t)
        if why is None:
            return
        if source is not None and source is not t and non_finite(source) is None:
            raise ModelSerializerException(
                f"{self.path!r}: tensor {name!r} has values beyond the range of {str(t.dtype).replace('torch.', '')} "
                f"(largest magnitude {source.abs().max().item():.4g}): {why} after the conversion; load the model "
                f"in a wider data type (user_set_data_type 'bfloat16' or 'float32')")
        raise ModelSerializerException(f"{self.path!r}: tensor {name!r}: {why}, and a model with such weights "
                                       f"computes NaN logits")

    def _checkpoint_tensors(self):
        """(checkpoint name, tensor) of every tensor the checkpoint holds."""
        return iter_hf_tensors(self.path)

    def _repack_prequantized(self, layers: dict, shapes: dict, tensors: dict, expected: set) -> QuantScheme:
        """GPTQ / AWQ / FP8 layers -> our quantized tensors in `tensors` (their dense names leave `expected`); the
        scheme. A GEMM weight the config keeps dense (AWQ's modules_to_not_convert) arrives as an ordinary one."""
        cfg, groups = self.prequant, {}
        for base, parts in layers.items():
            if base + ".weight" not in shapes:
                raise ModelSerializerException(f"unexpected {cfg.method} layer {base!r} for {self.args.architecture}")
            for part, t in parts.items():                        # the scales (the codes are integers)
                self._check_finite(f"{base}.{part}", t)
            try:
                repacked = cfg.repack(base, parts)
            except QuantConfigError as e:
                raise ModelSerializerException(str(e)) from None
            n, k = repacked["qweight"].shape[0], repacked["qweight"].shape[1] * (2 if cfg.bits == 4 else 1)
            if (n, k) != shapes[base + ".weight"]:
                raise ModelSerializerException(f"{cfg.method} layer {base} is {n} x {k}, config says "
                                               f"{shapes[base + '.weight']}")
            tensors.update({f"{base}.{part}": t for part, t in repacked.items()})
            expected.discard(base + ".weight")
            groups[base + ".weight"] = cfg.group_size
        missing = sorted(n for n in expected if re.search(quantizable_weights(self.args.architecture), n)
                         and not (n in tensors and cfg.keeps_dense(n[:-len(".weight")])))
        if missing:
            raise ModelSerializerException(f"{cfg.method} checkpoint lacks the quantized layers {missing[:5]}")
        scheme = cfg.scheme(groups)
        try:
            quantize_layers(self._meta_model(), scheme)          # the parts of a fused projection agree
        except QuantConfigError as e:                            # only dense-kept layers can disagree
            raise ModelSerializerException(f"{cfg.method} checkpoint: the layers it keeps unquantized "
                                           f"(modules_to_not_convert) cannot be served: {e}") from None
        return scheme

    def _meta_model(self):
        """This architecture's model on the meta device (shapes only, no memory)."""
        model_cls, _ = model_class_and_rules(self.args.architecture)
        with torch.device("meta"):
            return model_cls(self.args, TPLayout.for_model(self.args), LocalComm(), self.data_type, max_positions=1)

    def _checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every checkpoint tensor this architecture needs, with its shape."""
        return checkpoint_shapes(self._meta_model())

    def read_model_config(self) -> "HuggingFaceModel":
        return self

    def free_model(self) -> "HuggingFaceModel":
        self._tensors = None
        return self

    # ---- serialization -----------------------------------------------------------------------
    def serialize(self, engine=None, model_output_dir: str = "", enable_quant: bool = False,
                  weight_only_quant: bool = False, customized_quant_config=None, lora_cfg=None,
                  **_ignored) -> "HuggingFaceModel":
        return self.serialize_to_path(engine, model_output_dir or ".", enable_quant, weight_only_quant,
                                      customized_quant_config, lora_cfg=lora_cfg)

    def serialize_to_path(self, engine=None, output_dir: str = ".", enable_quant: bool = False,
                          weight_only_quant: bool = False, customized_quant_config=None,
                          skip_if_exists: bool = False, lora_cfg=None, **_ignored) -> "HuggingFaceModel":
        """Write `<name>.asgraph` + `<name>.asparam` into `output_dir`. With `enable_quant` (or a
        `customized_quant_config`), the GEMM weights are quantized with InstantQuant (README: Quantization);
        the default scheme is int8 per channel, weight-only. DashInfer's `lora_cfg` (lora/adapter.py) adds
        `<output_dir>/<lora name>.aslora` per adapter, all read first; with its `lora_only`, only those."""
        try:
            adapters, lora_only = read_lora_cfg(lora_cfg, self.args)
        except LoraAdapterError as e:
            raise ModelSerializerException(f"lora_cfg: {e}") from None
        if not lora_only:
            self._serialize_model(output_dir, enable_quant, weight_only_quant, customized_quant_config, skip_if_exists)
        write_adapters(adapters, output_dir)
        return self

    def _serialize_model(self, output_dir, enable_quant, weight_only_quant, customized_quant_config, skip_if_exists):
        quantized = bool(enable_quant or weight_only_quant or customized_quant_config)
        if customized_quant_config is not None and not isinstance(customized_quant_config, dict):
            raise ModelSerializerException(f"customized_quant_config must be a dict, got "
                                           f"{type(customized_quant_config).__name__}")
        graph, params = self._output_paths(output_dir)
        if skip_if_exists and os.path.isfile(graph) and os.path.isfile(params):
            self.graph_path, self.weights_path = graph, params
            return
        if self._tensors is None:
            raise ModelSerializerException("call load_model() before serialize()")
        _, rules = model_class_and_rules(self.args.architecture)
        tensors = dict(self._tensors)
        if (quantized and self.args.tie_word_embeddings and isinstance(customized_quant_config, dict)
                and customized_quant_config.get("quantize_lm_head")):
            tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]   # tied: the head gets its own codes
        modes = {name: split_mode_for(name, rules) for name in tensors}
        scheme = self._quant
        if scheme is not None and quantized:
            scheme = self._prequantized_compute(scheme, customized_quant_config, enable_quant or weight_only_quant)
            quantized = False
        if scheme is not None:
            modes.update(quantized_split_modes(tensors, rules, scheme))
        if quantized:
            try:
                scheme = plan_scheme(customized_quant_config, {n: tuple(t.shape) for n, t in tensors.items()},
                                     quantizable_weights(self.args.architecture), self._meta_model())
            except QuantConfigError as e:
                raise ModelSerializerException(f"customized_quant_config: {e}") from None
            tensors, modes = quantize_tensors(tensors, modes, scheme)
        eos = self.eos_token_ids()
        serialize_args = {**self._source_args(), "data_type": str(self.data_type).replace("torch.", "")}
        if scheme is not None:
            serialize_args["quantization"] = scheme.weight_format
        self.graph_path, self.weights_path = write_model_files(
            output_dir, self.model_name, self.args, self.hf_config, self.data_type, tensors, modes, eos, eos,
            serialize_args, quant=scheme, tokenizer_json=self._tokenizer_json(), paths=(graph, params),
            side_tensors=getattr(self, "_side_tensors", None))

    def _prequantized_compute(self, scheme: QuantScheme, config, flags: bool) -> QuantScheme:
        """An already quantized checkpoint (GGUF, GPTQ, AWQ, FP8) keeps its codes: a customized_quant_config may only
        choose how x meets them (`compute_method`: activate_quant rounds x to int8 per token, as llama.cpp's q8
        activations do, or to e4m3 for FP8 checkpoints of per-channel scales; weight_only, the default, to 16
        bits)."""
        kind = self.prequant.method if self.prequant else "GGUF"
        if flags or not config or set(config) != {"compute_method"}:
            raise ModelSerializerException(f"this checkpoint is already quantized ({kind}): serialize it without "
                                           "enable_quant / customized_quant_config, or with a customized_quant_config "
                                           "of only compute_method")
        try:
            method = QuantScheme.from_user({"compute_method": config["compute_method"],
                                            "weight_format": scheme.weight_format}).compute_method
            scheme = dataclasses.replace(scheme, compute_method=method)
            scheme.check_float_activations(scheme.groups)
        except QuantConfigError as e:
            raise ModelSerializerException(f"customized_quant_config: {e}") from None
        return scheme

    def _output_paths(self, output_dir: str) -> tuple[str, str]:
        """Where serialize_to_path writes the .asgraph and the .asparam."""
        safe = self.model_name.replace("/", "_")
        return os.path.join(output_dir, safe + ".asgraph"), os.path.join(output_dir, safe + ".asparam")

    def _source_args(self) -> dict[str, str]:
        """What the .asgraph's build_meta.serialize_args records of where the weights came from."""
        return {"source": os.path.abspath(self.path)}

    def _tokenizer_json(self) -> str:
        if self.gguf is None:
            return read_tokenizer_json(self.path, self.trust_remote_code)
        try:                                             # built once from the file's metadata, 10+ s
            return self.get_tokenizer().backend_tokenizer.to_str()
        except ModelSerializerException as e:
            log.info("no tokenizer in %s (%s): guided output will be unavailable", self.path, e)
            return ""

    # ---- configs -----------------------------------------------------------------------------
    def eos_token_ids(self) -> list[int]:
        from allspark_server.loader.qwen_tokenizer import chatml_stop_ids
        ids = _as_list(self.hf_generation_config.get("eos_token_id", self.hf_config.get("eos_token_id")))
        return ids + [i for i in chatml_stop_ids(self.path, self.hf_generation_config) if i not in ids]

    def get_model_context_length(self) -> int:
        exact = self.args.exact_context()
        return min(self.args.max_position_embeddings, exact[0] if exact else self.args.max_position_embeddings)

    def create_reference_runtime_config_builder(self, engine_model_name: str, device_type, device_ids,
                                                max_batch: int, max_context_length: int = -1
                                                ) -> AsModelRuntimeConfigBuilder:
        if self.graph_path is None:
            raise ModelSerializerException("serialize the model first (its files go into the runtime config)")
        b = AsModelRuntimeConfigBuilder().model_name(engine_model_name)
        b.model_file_path(self.graph_path, self.weights_path).compute_unit(device_type, device_ids)
        return b.max_batch(max_batch).max_length(
            self.get_model_context_length() if max_context_length == -1 else max_context_length)

    def create_reference_generation_config_builder(self, runtime_cfg: Optional[AsModelConfig] = None
                                                   ) -> ASGenerationConfigBuilder:
        gen = {k: self.hf_generation_config[k] for k in SAMPLING_KEYS if k in self.hf_generation_config}
        gen["eos_token_id"] = self.eos_token_ids()
        context = self.get_model_context_length()
        gen["max_length"] = min(context, runtime_cfg.engine_max_length) if runtime_cfg else context
        return ASGenerationConfigBuilder(gen)

    # ---- tokenizer ---------------------------------------------------------------------------
    def init_tokenizer(self, padding_side: str = "left") -> "HuggingFaceModel":
        try:
            self._tokenizer = load_tokenizer(self.path, self.trust_remote_code, padding_side=padding_side)
        except Exception as e:
            remote = "" if self.trust_remote_code else (
                " If its tokenizer is remote code, HuggingFaceModel(..., trust_remote_code=True) lets transformers "
                "run it; the model itself never needs it, and token ids (start_request) work without a tokenizer.")
            raise ModelSerializerException(f"cannot load the tokenizer of {self.path!r}: {e}.{remote}") from None
        return self

    def get_tokenizer(self):
        if self._tokenizer is None:
            self.init_tokenizer()
        return self._tokenizer
