"""A LoRA adapter in the decoder's terms, and the shard of it that each tensor-parallel rank holds.

`LoraAdapter` keeps one (A [r, in], B [out, r], scale) per targeted module, in float32, keyed by the decoder's
canonical module names (`model.layers.<i>.self_attn.q_proj`, ...), each checked against the model it was made for
(`check_module`, `check_pair`); the readers (lora/peft_folder.py, lora/aslora.py) build it and lora/adapter.py is
the package's door. `fused_rank_shard` lays out one layer's modules as the decoder's fused projection on one rank:
the targeted parts' A rows stacked, B block-diagonal over the parts with each scale folded in, and B's rows
(column-parallel) or A's columns (row-parallel) sliced as the base weight's are (layers/sharding.py).

Which architectures may take an adapter is decided here too (`check_architecture`). Nothing here reads a file or
checks the engine's rank limit (lora_max_rank: the engine's, with its own status code).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from allspark_server.layers.sharding import SplitMode, TPLayout
from allspark_server.models.args import ModelArgs


class LoraAdapterError(ValueError):
    """A bad adapter folder or file; the message names the problem (file, tensor, module, shape)."""


# fused projection -> (its sublayer, its parts in the fused weight's row order, each with its base weight's split)
PROJECTION_PARTS = {
    "qkv_proj": ("self_attn", (("q_proj", SplitMode.HEADS), ("k_proj", SplitMode.KV_HEADS),
                               ("v_proj", SplitMode.KV_HEADS))),
    "o_proj": ("self_attn", (("o_proj", SplitMode.ROW_HEADS),)),
    "gate_up_proj": ("mlp", (("gate_proj", SplitMode.COLUMN), ("up_proj", SplitMode.COLUMN))),
    "down_proj": ("mlp", (("down_proj", SplitMode.ROW),)),
}
PROJECTIONS = tuple(PROJECTION_PARTS)
TARGETS = {part: sub for sub, parts in PROJECTION_PARTS.values() for part, _ in parts}   # q_proj -> self_attn
ROW_PARALLEL = (SplitMode.ROW, SplitMode.ROW_HEADS)
MODULE = re.compile(r"model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)")
MOE_MODULE = re.compile(r"model\.layers\.\d+\.(mlp\.(experts|shared_expert)|block_sparse_moe)\b")
BASE_KEYS = ("architecture", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size")
# the families whose checkpoints hold q/k/v/o/gate/up/down as the decoder does (their converters leave these weights
# alone), so an adapter's A and B apply to the served weights as they are; the MoE ones for attention and their dense
# layers. Other converters fuse, split, permute (interleaved rotaries) or normalize these weights at load.
LORA_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                      "Gemma2ForCausalLM", "Gemma3ForCausalLM", "GraniteForCausalLM", "Qwen2MoeForCausalLM",
                      "Qwen3MoeForCausalLM", "MixtralForCausalLM", "GraniteMoeForCausalLM")


@dataclass
class LoraAdapter:
    name: str
    rank: int                                                   # the largest r over its modules
    modules: dict[str, tuple[torch.Tensor, torch.Tensor, float]]   # module -> (A [r, in], B [out, r], scale), fp32
    base: dict                                                  # base_shape() of the model it was made for


def base_shape(args: ModelArgs) -> dict:
    """What an adapter must agree with: the architecture and the projections' shapes."""
    return {key: getattr(args, key) for key in BASE_KEYS}


def check_architecture(args: ModelArgs) -> None:
    if args.architecture not in LORA_ARCHITECTURES:
        raise LoraAdapterError(
            f"LoRA adapters are not supported for {args.architecture}: its converter (models/) renames, fuses or "
            f"reorders the q/k/v/o/gate/up/down weights at load, so an adapter's A and B would not line up with the "
            f"served weights; supported: {', '.join(LORA_ARCHITECTURES)}")


def part_shape(part: str, base: dict) -> tuple[int, int]:
    """(out, in) of a module's whole base weight."""
    h, i = base["hidden_size"], base["intermediate_size"]
    q, kv = base["num_heads"] * base["head_dim"], base["num_kv_heads"] * base["head_dim"]
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q), "gate_proj": (i, h),
            "up_proj": (i, h), "down_proj": (h, i)}[part]


def check_module(module: str, args: ModelArgs, where: str) -> str:
    """The part (q_proj, ...) a canonical module name targets; refuses modules the decoder's projections lack."""
    m = MODULE.fullmatch(module)
    if m is None or TARGETS.get(m.group(3)) != m.group(2):
        if MOE_MODULE.match(module):
            raise LoraAdapterError(f"{where}: module {module!r} is part of a mixture-of-experts MLP; LoRA on MoE "
                                   f"layers' MLPs is not supported (adapt attention, or dense layers' MLPs)")
        raise LoraAdapterError(f"{where}: module {module!r} cannot take a LoRA here; supported: q_proj, k_proj, "
                               f"v_proj, o_proj (model.layers.<i>.self_attn) and gate_proj, up_proj, down_proj "
                               f"(model.layers.<i>.mlp)")
    layer = int(m.group(1))
    if layer >= args.num_layers:
        raise LoraAdapterError(f"{where}: module {module!r} is in layer {layer}, but the model has {args.num_layers} "
                               f"layers (0..{args.num_layers - 1})")
    if m.group(2) == "mlp" and layer in args.moe_layers:
        raise LoraAdapterError(f"{where}: module {module!r}: layer {layer}'s MLP is a mixture of experts in "
                               f"{args.architecture}; LoRA on MoE layers' MLPs is not supported")
    return m.group(3)


def _check_tensor(t, name: str, shape: tuple[int, ...], where: str, why: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise LoraAdapterError(f"{where}: {name!r} is a {type(t).__name__}, not a tensor")
    if not t.is_floating_point():
        raise LoraAdapterError(f"{where}: tensor {name!r} is {str(t.dtype).replace('torch.', '')}, not floating point")
    if tuple(t.shape) != shape:
        raise LoraAdapterError(f"{where}: tensor {name!r} has shape {list(t.shape)}, expected {list(shape)} ({why})")
    t = t.detach().to(torch.float32)
    bad = int((~torch.isfinite(t)).sum())
    if bad:
        raise LoraAdapterError(f"{where}: tensor {name!r} has {bad} values that are not finite (NaN or inf)")
    return t


def check_pair(part: str, a, b, names: tuple[str, str], base: dict, where: str, r: int | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B) as float32 on the host, once their shapes fit the model's `part`: [r, in] and [out, r], with `r` the
    rank the adapter's config gives the module (None: A's rows)."""
    out_features, in_features = part_shape(part, base)
    if r is None:
        r = a.shape[0] if isinstance(a, torch.Tensor) and a.dim() == 2 and a.shape[0] > 0 else 1
        why = f"[r, {in_features}] for this model's {part}"
    else:
        why = f"r {r} by the adapter's config, {in_features} inputs for this model's {part}"
    a = _check_tensor(a, names[0], (r, in_features), where, why)
    why = f"{out_features} outputs for this model's {part}, r {r} as its A"
    return a, _check_tensor(b, names[1], (out_features, r), where, why)


def _check_layout(adapter: LoraAdapter, tp: TPLayout) -> None:
    for key in ("num_heads", "num_kv_heads", "head_dim", "intermediate_size"):
        if getattr(tp, key) != adapter.base[key]:
            raise LoraAdapterError(f"adapter {adapter.name!r} was made for {key} {adapter.base[key]}, the model "
                                   f"has {getattr(tp, key)}")


def fused_rank_shard(adapter: LoraAdapter, tp: TPLayout, layer: int, projection: str, dtype: torch.dtype
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """This rank's (A_local [R, in_local], B_local [out_local, R]) of one fused projection of `layer`, None where
    the adapter targets none of its parts. R is the sum of the targeted parts' ranks. x_local @ A_local.T @ B_local.T
    is this rank's share of the sum over the parts of scale * x @ A.T @ B.T: its rows of it for the column-parallel
    projections (qkv_proj, gate_up_proj; an untargeted part's rows are zero), its partial sum for the row-parallel
    ones (o_proj, down_proj: the sum over ranks is the whole delta). Scales multiply B in float32, then both cast.
    A may share memory with the adapter's own A (where neither a slice nor a cast copies it): read-only."""
    if projection not in PROJECTION_PARTS:
        raise ValueError(f"projection {projection!r} is not one of {', '.join(PROJECTIONS)}")
    if not 0 <= layer < adapter.base["num_layers"]:
        raise ValueError(f"layer {layer} is outside the model's {adapter.base['num_layers']} layers")
    _check_layout(adapter, tp)
    sub, parts = PROJECTION_PARTS[projection]
    found = [(part, mode, adapter.modules.get(f"model.layers.{layer}.{sub}.{part}")) for part, mode in parts]
    if all(entry is None for _, _, entry in found):
        return None
    if parts[0][1] in ROW_PARALLEL:                     # one part: A's columns as the base weight's input columns
        part, mode, (a, b, scale) = found[0]
        dim, lo, hi = tp.slice_for(mode, part_shape(part, adapter.base))
        a_local = a[:, lo:hi] if dim == 1 else a
        return a_local.to(dtype).contiguous(), (b * scale).to(dtype).contiguous()
    slices = [tp.slice_for(mode, part_shape(part, adapter.base)) for part, mode, _ in found]
    rows = [hi - lo if dim == 0 else part_shape(part, adapter.base)[0]
            for (part, _, _), (dim, lo, hi) in zip(found, slices)]
    ranks = [entry[0].shape[0] if entry is not None else 0 for _, _, entry in found]
    a_local = torch.cat([entry[0] for _, _, entry in found if entry is not None])          # [R, in]
    b_local = torch.zeros(sum(rows), sum(ranks), dtype=torch.float32)                      # [out_local, R]
    row = col = 0
    for (_, _, entry), (dim, lo, hi), n, r in zip(found, slices, rows, ranks):
        if entry is not None:
            b = entry[1][lo:hi] if dim == 0 else entry[1]
            b_local[row:row + n, col:col + r] = b * entry[2]
        row, col = row + n, col + r
    return a_local.to(dtype).contiguous(), b_local.to(dtype)
