"""LoRA adapters as an option of the projections: what one projection holds of them, and which rows use which.

A projection (a q|k|v, o, gate|up or down linear of one layer, on one rank) may carry `LoraSlots`: for each
adapter slot of the model, this rank's (A [R, in_local], B [out_local, R]) with the adapter's scale folded into B,
the parts of a merged projection stacked (lora/shard.py makes them). A step's rows pick their adapter by slot
(`LoraRows`, from the requests': -1 is the base model); the projection's output gains, on each row,
B[s] . (A[s] . x): `lora_add_reference` here, the native decode steps' add_lora (native/decode_steps.cpp) and the
CUDA backend's kernels (compute/cuda/lora_kernels.py), which ops.lora_add_ chooses between.

The delta of a row-parallel projection (o, down: A split by input columns) is a partial sum like the base product
and is added before the allreduce. The shrink's result is rounded to the activation dtype before the expand, as
PEFT computes lora_B(lora_A(x)) in the module's dtype.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch


class LoraSlots:
    """One projection's adapters on this rank, by slot. `version` counts changes: whatever was built from the
    slots (the native descriptors, the stacked copies a GPU kernel reads) is rebuilt when it moves. `max_rank`: the
    largest rank a slot may hold (lora_max_rank times the merged parts), the width of fixed stacks."""

    def __init__(self, num_slots: int, max_rank: int, in_features: int, out_features: int):
        self.a: list[Optional[torch.Tensor]] = [None] * num_slots     # [R_s, in_local]
        self.b: list[Optional[torch.Tensor]] = [None] * num_slots     # [out_local, R_s], the scale folded in
        self.max_rank, self.in_features, self.out_features = max_rank, in_features, out_features
        self.version = 0
        self._stacked: Optional[tuple[int, torch.Tensor, torch.Tensor]] = None
        self._fixed = False     # the stacks keep their storage (CUDA graphs read them): refilled in place
        self.native = None      # (version, the native LoraSlots, each slot's (B, panels)) once the native kernels
                                # took them (step_binding.native_lora)
        self._derived: dict[str, tuple[int, object]] = {}

    def set(self, slot: int, a: torch.Tensor, b: torch.Tensor) -> None:
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(f"LoRA slot {slot}: A {tuple(a.shape)} and B {tuple(b.shape)} do not chain")
        self.a[slot], self.b[slot] = a.contiguous(), b.contiguous()
        self.version += 1

    def clear(self, slot: int) -> None:
        self.a[slot] = self.b[slot] = None
        self.version += 1

    @property
    def is_empty(self) -> bool:
        """No slot holds an adapter of this projection (its delta is zero for every row)."""
        return all(a is None for a in self.a)

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(A [S, R, in], B [S, out, R]): every slot's pair, ranks padded with zeros, empty slots zero (what a kernel
        that gathers by slot reads); made again after a change, R the largest rank present, or refilled in place at
        R = max_rank once `fix_storage` was called."""
        if self._stacked is None or self._stacked[0] != self.version:
            present = [(a, b) for a, b in zip(self.a, self.b) if a is not None]
            if self._fixed:
                a_stack, b_stack = self._stacked[1].zero_(), self._stacked[2].zero_()
            else:
                a0, b0 = present[0]
                rank = max(a.shape[0] for a, _ in present)
                a_stack = a0.new_zeros(len(self.a), rank, a0.shape[1])
                b_stack = b0.new_zeros(len(self.a), b0.shape[0], rank)
            for s, (a, b) in enumerate(zip(self.a, self.b)):
                if a is not None:
                    a_stack[s, :a.shape[0]] = a
                    b_stack[s, :, :b.shape[1]] = b
            self._stacked = (self.version, a_stack, b_stack)
        return self._stacked[1], self._stacked[2]

    def fix_storage(self, dtype: torch.dtype, device: torch.device) -> None:
        """From now on the stacks keep their storage, max_rank wide (zero where no adapter is): CUDA graphs captured
        over them read what `stacked()` refills (call it after each change, before the next replay)."""
        n = len(self.a)
        self._stacked = (-1, torch.zeros(n, self.max_rank, self.in_features, dtype=dtype, device=device),
                         torch.zeros(n, self.out_features, self.max_rank, dtype=dtype, device=device))
        self._fixed = True
        self.stacked()

    @property
    def has_fixed_storage(self) -> bool:
        return self._fixed

    def derived(self, name: str, build):
        """build(self), kept until the slots change (a backend's other layout of the stacks)."""
        kept = self._derived.get(name)
        if kept is None or kept[0] != self.version:
            kept = self._derived[name] = (self.version, build(self))
        return kept[1]


@dataclass
class LoraRows:
    """A step's rows by adapter: `slots` [T] long, each row's slot (-1: the base model)."""
    slots: torch.Tensor
    _masks: dict = field(default_factory=dict, compare=False, repr=False)

    def other_slots(self, num_slots: int) -> torch.Tensor:
        """[T, num_slots] bool: True where the column is not the row's slot (made once a step)."""
        mask = self._masks.get(num_slots)
        if mask is None:
            slots = torch.arange(num_slots, device=self.slots.device)
            mask = self._masks[num_slots] = self.slots.unsqueeze(1) != slots
        return mask

    @classmethod
    def of(cls, row_slots: list[int]) -> Optional["LoraRows"]:
        """From each row's slot; None when no row uses an adapter (the step runs as without LoRA)."""
        if all(s < 0 for s in row_slots):
            return None
        return cls(torch.tensor(row_slots, dtype=torch.long))

    def to(self, device: torch.device) -> "LoraRows":
        return LoraRows(self.slots.to(device))


def _groups(slots: torch.Tensor) -> list[tuple[int, Optional[torch.Tensor]]]:
    """(slot, its rows; None: every row) for each slot the rows use, ascending."""
    used = sorted({s for s in slots.tolist() if s >= 0})
    if len(used) == 1 and bool((slots == used[0]).all()):
        return [(used[0], None)]
    return [(s, (slots == s).nonzero().flatten().cpu()) for s in used]


def lora_add_reference(y: torch.Tensor, x: torch.Tensor, lora: LoraSlots, rows: LoraRows, linear) -> torch.Tensor:
    """y [T, out] += each row's B[s] . (A[s] . x) through `linear` (the backend's x . w^T), in place; returns y."""
    for slot, idx in _groups(rows.slots):
        a, b = lora.a[slot], lora.b[slot]
        if a is None:           # this adapter leaves the projection alone
            continue
        xs = x if idx is None else x.index_select(0, idx)
        delta = linear(linear(xs, a), b)
        if idx is None:
            y.add_(delta)
        else:
            y.index_add_(0, idx, delta)
    return y
