"""LoRA adapters on one rank: the adapter slots of a model's projections, filled and emptied as rank 0 says.

A model that may load adapters (lora_max_num > 0) gives each projection of its dense layers a LoraSlots
(compute/lora_slots.py) at install. `apply` runs a LoraMsg on every rank (a collective): the rank reads the adapter from
its file (lora/: a PEFT folder or an .aslora file), cuts its own shard of each projection's A and B and puts them in
the slot; a message without a path empties the slot. The ranks then agree: if one failed, every rank empties the
slot again and all return the same error, so a pool never serves an adapter some ranks lack.
"""
from __future__ import annotations

import logging
from typing import Optional

from allspark_server.compute.lora_slots import LoraSlots
from allspark_server.core.messages import LoraMsg
from allspark_server.lora.adapter import LoraAdapterError, fused_rank_shard, load_adapter
from allspark_server.lora.shard import PROJECTION_PARTS

log = logging.getLogger(__name__)

# the reasons a load fails, as rank 0 turns them into statuses (engine/lora_api.py)
MISSING, TOO_LARGE, BAD = "missing", "rank", "bad"


def attach(model, num_slots: int, max_rank: int) -> list[dict]:
    """Per layer, {projection name: its LoraSlots} for the projections adapters may change (an MoE layer's
    experts take none); nothing when num_slots is 0."""
    if num_slots <= 0:
        return []
    layers = []
    for layer in model.model.layers:
        found = {"qkv_proj": layer.self_attn.qkv_proj, "o_proj": layer.self_attn.o_proj}
        if hasattr(layer.mlp, "gate_up_proj"):
            found.update(gate_up_proj=layer.mlp.gate_up_proj, down_proj=layer.mlp.down_proj)
        for name, module in found.items():   # a slot holds one adapter's rank per merged part
            module.lora = LoraSlots(num_slots, max_rank * len(PROJECTION_PARTS[name][1]), module.in_features,
                                    module.out_features)
        layer._bound_kv = None            # bound steps made before carry no adapters: bind again
        layers.append({name: module.lora for name, module in found.items()})
    return layers


def _fill(runner, msg: LoraMsg) -> None:
    """This rank's shard of the adapter at msg.path into msg.slot of every projection it targets."""
    adapter = load_adapter(msg.path, runner.args, msg.name or None)
    if adapter.rank > runner.cfg.lora_max_rank:
        raise _Refused(TOO_LARGE, f"adapter {adapter.name!r} has rank {adapter.rank}, over lora_max_rank "
                                  f"{runner.cfg.lora_max_rank}")
    for i, slots in enumerate(runner.lora_layers):
        for name, lora in slots.items():
            pair = fused_rank_shard(adapter, runner.tp, i, name, runner.dtype)
            if pair is None:
                lora.clear(msg.slot)
            else:
                lora.set(msg.slot, pair[0].to(runner.device), pair[1].to(runner.device))


class _Refused(Exception):
    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def _empty(runner, slot: int) -> None:
    for slots in runner.lora_layers:
        for lora in slots.values():
            lora.clear(slot)


def apply(runner, msg: LoraMsg, comm) -> Optional[tuple[str, str]]:
    """Collective: load (msg.path) or unload the slot on this rank, then agree with the others. Returns None, or
    (reason, message) on every rank when any rank failed (reason: MISSING, TOO_LARGE or BAD)."""
    error = None
    if not runner.lora_layers:
        error = (BAD, "this model takes no LoRA adapters (lora_max_num is 0)")
    elif msg.path:
        try:
            _fill(runner, msg)
        except FileNotFoundError as e:
            error = (MISSING, str(e))
        except _Refused as e:
            error = (e.kind, str(e))
        except (LoraAdapterError, ValueError, OSError, RuntimeError) as e:
            error = (BAD, str(e))
    else:
        _empty(runner, msg.slot)
    errors = comm.allgather_obj(error)
    failed = next((e for e in errors if e is not None), None)
    if failed is not None and msg.path and runner.lora_layers:
        _empty(runner, msg.slot)
    runner.model.lora_generation += 1     # the native decode stack is built again with the slots as they are
    runner.adapters_changed()
    if failed is not None:
        log.info("LoRA %s in slot %d failed: %s", msg.name or msg.path, msg.slot, failed[1])
    return failed
