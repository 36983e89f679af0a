"""LoRA adapters: read from PEFT folders or .aslora files, checked against the model, serialized, and sharded for
each tensor-parallel rank in the decoder's fused projection layout (lora/adapter.py is the door)."""
from allspark_server.lora.adapter import (
    PROJECTIONS,
    LoraAdapter,
    LoraAdapterError,
    LoraCfg,
    fused_rank_shard,
    load_adapter,
    save_aslora,
    write_adapters,
)

__all__ = ["PROJECTIONS", "LoraAdapter", "LoraAdapterError", "LoraCfg", "fused_rank_shard", "load_adapter",
           "save_aslora", "write_adapters"]
