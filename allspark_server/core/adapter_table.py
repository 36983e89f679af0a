"""AdapterTable: rank 0's record of one model's loaded LoRA adapters: which slot of the runners each sits in.

The tensors are the runners' (runner/adapters.py); loading and unloading are Engine's (engine/lora_api.py). No torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class LoadedAdapter:
    slot: int
    key: str                        # its identity in prefix-cache keys: the name and this load's number
    unloading: bool = False         # unload_lora is under way: new requests are refused


@dataclass
class AdapterTable:
    """Rank 0's record of one model's loaded adapters."""
    num_slots: int
    loaded: dict[str, LoadedAdapter] = field(default_factory=dict)

    def free_slot(self) -> Optional[int]:
        used = {a.slot for a in self.loaded.values()}
        return next((s for s in range(self.num_slots) if s not in used), None)

    def resolve(self, name: Optional[str]) -> Optional[LoadedAdapter]:
        """A request's adapter by name (None: the base model); LookupError when it is not loaded."""
        if not name:
            return None
        adapter = self.loaded.get(name)
        if adapter is None or adapter.unloading:
            raise LookupError(f"LoRA adapter {name!r} is not loaded (loaded: {sorted(self.loaded)}); "
                              f"load_lora it first")
        return adapter
