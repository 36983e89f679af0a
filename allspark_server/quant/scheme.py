"""The quantization scheme of a model: the user's `customized_quant_config` validated into a QuantScheme,
which weights it covers and with which group size, and how it travels in the `.asgraph` (JSON).

It owns no tensors (formats.py quantizes; the linear layers hold the results). Every problem is a
QuantConfigError naming the field, raised before anything is written.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from allspark_server.quant.formats import ALL_FORMATS, GROUP_SIZES, check_shape, is_float

# weight_only: x meets the codes rounded to 16 bits per token (A16W8 / A16W4, no visible loss); activate_quant:
# rounded to int8 per token (DashInfer's A8W8, there for int8 weights only; here any integer format: A8W4 is the
# fastest 4-bit batch-1 GEMV on AVX2, llama.cpp's q4_0 . q8_0 arithmetic), or to e4m3 for fp8_e4m3 weights
COMPUTE_METHODS = ("weight_only", "activate_quant")
FLOAT_ACTIVATIONS = "fp8_e4m3"      # activate_quant's activations with fp8 weights (W8A8-FP8): e4m3 per row
KNOWN_KEYS = {"quant_method", "weight_format", "group_size", "compute_method", "group_settings", "activate_format",
              "quantize_lm_head"}
LM_HEAD = r"^lm_head\.weight$"


class QuantConfigError(ValueError):
    pass


@dataclass(frozen=True)
class QuantScheme:
    weight_format: str
    group_size: int = -1
    compute_method: str = "weight_only"
    group_settings: tuple[tuple[str, int], ...] = ()     # (regex, group size), first match wins
    groups: dict = field(default_factory=dict, compare=False)   # checkpoint weight name -> its group size
    lm_head: bool = False                                # the LM head quantized too (off by default)
    # checkpoint weight name -> its format where weights differ (GGUF files mix types); others: weight_format
    formats: dict = field(default_factory=dict, compare=False)

    @classmethod
    def from_user(cls, cfg) -> "QuantScheme":
        """DashInfer's customized_quant_config dict -> a validated scheme."""
        if not isinstance(cfg, dict):
            raise QuantConfigError(f"customized_quant_config must be a dict, got {type(cfg).__name__}")
        unknown = set(cfg) - KNOWN_KEYS
        if unknown:
            raise QuantConfigError(f"customized_quant_config: unknown keys {sorted(unknown)} "
                                   f"(known: {sorted(KNOWN_KEYS)})")
        method = cfg.get("quant_method", "instant_quant")
        if method != "instant_quant":
            raise QuantConfigError(f"quant_method {method!r} is not supported (instant_quant; GPTQ checkpoints "
                                   f"are read from their config.json)")
        fmt = cfg.get("weight_format", "int8")
        if fmt not in ALL_FORMATS:
            raise QuantConfigError(f"weight_format {fmt!r} is not one of {list(ALL_FORMATS)}")
        group = cfg.get("group_size", -1)
        if isinstance(group, bool) or group not in GROUP_SIZES:
            raise QuantConfigError(f"group_size {group!r} is not one of {list(GROUP_SIZES)}")
        compute = cfg.get("compute_method", "weight_only")
        if compute not in COMPUTE_METHODS:
            raise QuantConfigError(f"compute_method {compute!r} is not supported (supported: "
                                   f"{list(COMPUTE_METHODS)})")
        expected_act = FLOAT_ACTIVATIONS if is_float(fmt) else "int8"
        act = cfg.get("activate_format", expected_act)
        if act != expected_act:
            raise QuantConfigError(f"activate_format {act!r} is not supported with {fmt} weights (int8 with integer "
                                   f"formats, {FLOAT_ACTIVATIONS} with {FLOAT_ACTIVATIONS})")
        settings = cfg.get("group_settings") or {}
        if not isinstance(settings, dict):
            raise QuantConfigError("group_settings must be a dict {regex: group_size}")
        pairs = []
        for pattern, size in settings.items():
            try:
                re.compile(pattern)
            except (re.error, TypeError) as e:
                raise QuantConfigError(f"group_settings: {pattern!r} is not a regular expression ({e})") from None
            if isinstance(size, bool) or size not in GROUP_SIZES:
                raise QuantConfigError(f"group_settings[{pattern!r}] = {size!r} is not one of {list(GROUP_SIZES)}")
            pairs.append((pattern, int(size)))
        lm_head = cfg.get("quantize_lm_head", False)
        if not isinstance(lm_head, bool):
            raise QuantConfigError(f"quantize_lm_head must be true or false, got {lm_head!r}")
        scheme = cls(fmt, int(group), compute, tuple(pairs), lm_head=lm_head)
        scheme.check_float_activations({"group_size": int(group), **{p: s for p, s in pairs}})
        return scheme

    @property
    def act_bits(self) -> int:
        """How the kernels round x before it meets the codes (QuantizedWeight.act_bits)."""
        return 8 if self.compute_method == "activate_quant" else 16

    def format_for(self, name: str) -> str:
        """The format of one quantized checkpoint weight."""
        return self.formats.get(name, self.weight_format)

    def check_float_activations(self, groups: dict[str, int]) -> None:
        """activate_quant with fp8 weights (W8A8) scales x per row and the weight per output channel (the FP8 GEMM's
        row-wise scaling): refused, naming the first, where `groups` (name -> group size) has another size."""
        if self.compute_method != "activate_quant" or not self.float_formats():
            return
        grouped = next((name for name, size in groups.items() if size != -1), None)
        if grouped is not None:
            raise QuantConfigError(f"compute_method activate_quant with {self.weight_format} weights needs per-channel "
                                   f"scales (group_size -1); {grouped} gives groups of {groups[grouped]}")

    def float_formats(self) -> list[str]:
        """The floating-point formats (fp8) among its weights: served on GPUs of compute capability 8.9+ alone."""
        return sorted({f for f in (self.weight_format, *self.formats.values()) if is_float(f)})

    def group_for(self, name: str) -> int:
        for pattern, size in self.group_settings:
            if re.search(pattern, name):
                return size
        return self.group_size

    def with_groups(self, groups: dict[str, int]) -> "QuantScheme":
        return QuantScheme(self.weight_format, self.group_size, self.compute_method, self.group_settings,
                           dict(groups), self.lm_head, dict(self.formats))

    # ---- the .asgraph's `quantization` field ------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps({"quant_method": "instant_quant", "weight_format": self.weight_format,
                           "group_size": self.group_size, "compute_method": self.compute_method,
                           "group_settings": dict(self.group_settings), "groups": self.groups,
                           "quantize_lm_head": self.lm_head, "formats": self.formats})

    @classmethod
    def from_json(cls, text: str) -> "QuantScheme | None":
        if not text:
            return None
        d = json.loads(text)
        return cls(d["weight_format"], d["group_size"], d["compute_method"], tuple(d["group_settings"].items()),
                   d["groups"], d.get("quantize_lm_head", False), d.get("formats", {}))

    def describe(self) -> dict:
        """What get_model_info reports (with `weight_formats`, how many weights each format holds, when they
        differ)."""
        out = {"quant_method": "instant_quant", "weight_format": self.weight_format,
               "group_size": self.group_size, "compute_method": self.compute_method,
               "group_settings": dict(self.group_settings), "quantized_weights": len(self.groups),
               "quantize_lm_head": self.lm_head}
        if self.formats:
            counts: dict[str, int] = {}
            for name in self.groups:
                counts[self.format_for(name)] = counts.get(self.format_for(name), 0) + 1
            out["weight_formats"] = counts
        return out


def plan_groups(scheme: QuantScheme, shapes: dict[str, tuple[int, ...]], quantizable: str) -> QuantScheme:
    """Decide every quantized weight's group size (checkpoint names matching `quantizable`) and check that
    it splits the weight's input features; returns the scheme with its `groups` filled."""
    groups = {}
    for name, shape in shapes.items():
        if not (re.search(quantizable, name) or (scheme.lm_head and re.search(LM_HEAD, name))):
            continue
        group = scheme.group_for(name)
        try:
            check_shape(scheme.weight_format, group, shape[1], name)
        except ValueError as e:
            raise QuantConfigError(str(e)) from None
        groups[name] = group
    if not groups:
        raise QuantConfigError("no weight of this model matches the quantizable GEMM weights")
    return scheme.with_groups(groups)
