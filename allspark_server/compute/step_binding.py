"""The one binder from the layer description's steps (compute/steps.py) to the native descriptors (native/steps.h).

Each native descriptor lists its fields once (steps.h's F(type, name) lists, exposed as the class's FIELDS). A field
is filled from the attribute of the same name on the bound step, or else on its step (a dataclass field or a
property); weights go through the caller's weight converter. A kernel's options struct (native/step_options.h,
`options`) is filled the same way from the step alone. `check_fields` runs when the extension loads: a native
field with no Python attribute of a matching type, or a step option that the native path neither reads nor names
in NOT_NATIVE, fails there, loudly, instead of becoming an option one backend silently ignores.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import torch

from allspark_server.compute.steps import Attention, BoundAttention, BoundMlp, BoundMoe, BoundNorm, Mlp, Moe, Norm

# bound step -> (its native descriptor's class name, its step class)
NATIVE_STEPS = {BoundNorm: ("NormStep", Norm), BoundAttention: ("AttentionStep", Attention),
                BoundMlp: ("MlpStep", Mlp), BoundMoe: ("MoeStep", Moe)}
# a kernel's options struct (native/step_options.h) -> the step class whose fields fill it
NATIVE_OPTIONS = {"AttentionOptions": Attention}
# steps.h's field types -> the annotations compute/steps.py writes for them
PYTHON_TYPES = {"torch::Tensor": "torch.Tensor", "OptTensor": "Optional[torch.Tensor]", "Weight": "Weight",
                "Weights": "list[Weight]", "OptWeight": "Optional[Weight]", "double": "float", "int64_t": "int",
                "bool": "bool", "OptLora": "Optional[LoraSlots]"}


def _annotation(cls, name: str):
    """The annotation of `name` on cls: a dataclass field's type or a property's return type; None: no such name."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            return f.type
    prop = getattr(cls, name, None)
    if isinstance(prop, property):
        return prop.fget.__annotations__.get("return")
    return None


def check_fields(ext) -> None:
    """Raise when the extension's descriptors and compute/steps.py disagree (see the module docstring)."""
    problems = []
    for native_name, step_cls in NATIVE_OPTIONS.items():
        for name, ctype in getattr(ext, native_name).FIELDS:
            found, want = _annotation(step_cls, name), PYTHON_TYPES.get(ctype)
            if found != want:
                problems.append(f"native/step_options.h {native_name}.{name} is {ctype} (Python: {want}) but "
                                f"{step_cls.__name__}.{name} is {found or 'missing'} in compute/steps.py")
    for bound_cls, (native_name, step_cls) in NATIVE_STEPS.items():
        native_fields = dict(getattr(ext, native_name).FIELDS)
        for name, ctype in native_fields.items():
            found = _annotation(bound_cls, name) or _annotation(step_cls, name)
            want = PYTHON_TYPES.get(ctype)
            if found is None:
                problems.append(f"native/steps.h {native_name}.{name} has no attribute {name!r} on "
                                f"{bound_cls.__name__} or {step_cls.__name__}")
            elif found != want:
                problems.append(f"{native_name}.{name} is {ctype} in native/steps.h (Python: {want}) but "
                                f"{found} in compute/steps.py")
        options = {f.name for f in dataclasses.fields(step_cls)}
        not_native = step_cls.NOT_NATIVE
        for name in sorted(options - set(native_fields) - set(not_native)):
            problems.append(f"{step_cls.__name__}.{name} reaches no native {native_name} field: add it to "
                            f"native/steps.h (and read it in the kernel), or say in {step_cls.__name__}.NOT_NATIVE "
                            f"what carries it")
        for name in sorted(set(not_native) - options):
            problems.append(f"{step_cls.__name__}.NOT_NATIVE names {name!r}, which is no option of the step")
    if problems:
        raise RuntimeError("the native step descriptors and compute/steps.py disagree (rebuild the extension "
                           "after changing native/steps.h):\n  " + "\n  ".join(problems))


def descriptor(bound, ext, native_weight: Callable):
    """A bound step's native descriptor, every field filled by name and checked by the struct itself."""
    native_name, _ = NATIVE_STEPS[type(bound)]
    d = getattr(ext, native_name)()
    for name, ctype in d.FIELDS:
        value = getattr(bound, name) if hasattr(bound, name) else getattr(bound.step, name)
        if ctype == "Weight" or (ctype == "OptWeight" and value is not None):
            value = native_weight(value)
        elif ctype == "Weights":
            value = [native_weight(w) for w in value]
        elif ctype == "OptLora" and value is not None:
            value = native_lora(ext, value)
        setattr(d, name, value)
    d.check()
    return d


LORA_PANEL = 16   # output columns of a panel of B (native/steps.h's LORA_PANEL, which LoraSlots::check holds it to)


def lora_panels(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """B [N, R] as the native expand reads it: panels of LORA_PANEL output columns (the last padded with zeros), each
    holding only the ranks [lo, hi) that are nonzero in its columns (a fused projection's B is block-diagonal over its
    parts), rank after rank: (packed [sum of hi - lo, LORA_PANEL], index [panels, 3] int64 of lo, hi and where the
    panel starts in `packed`, in elements)."""
    n, r = b.shape
    panels = -(-n // LORA_PANEL)
    bt = torch.nn.functional.pad(b.t(), (0, panels * LORA_PANEL - n)).reshape(r, panels, LORA_PANEL)
    nz = (bt != 0).any(2)                                                   # [R, panels]
    ranks = torch.arange(r)[:, None]
    hi = torch.where(nz, ranks + 1, 0).max(0).values
    lo = torch.minimum(torch.where(nz, ranks, r).min(0).values, hi)
    lens = hi - lo
    start = torch.cumsum(lens, 0) - lens
    panel_of = torch.repeat_interleave(torch.arange(panels), lens)
    rank_of = lo[panel_of] + torch.arange(int(lens.sum())) - start[panel_of]
    return bt[rank_of, panel_of].contiguous(), torch.stack([lo, hi, start * LORA_PANEL], 1).contiguous()


def native_lora(ext, lora):
    """A projection's adapters (compute/lora_slots.py LoraSlots) as the native LoraSlots: the same tensors, by slot
    (made again when they change). Each B's panels are laid out once: a slot whose B is the same tensor as at the
    last build keeps them, so loading or unloading one adapter does not lay out every other one again (with 8
    adapters on SmolLM2's 30 layers that took ~0.45 s of the next decode step)."""
    if lora.native is None or lora.native[0] != lora.version:
        kept = lora.native[2] if lora.native is not None else [None] * len(lora.b)

        def laid_out(b, k):                     # the decode kernel's layout of B, or the one kept for that very B
            if b is None:
                return None
            return k[1] if k is not None and k[0] is b else lora_panels(b)
        panels = [laid_out(b, k) for b, k in zip(lora.b, kept)]
        d = ext.LoraSlots()
        d.a, d.b = list(lora.a), list(lora.b)
        d.b_panels = [None if p is None else p[0] for p in panels]
        d.b_panel_index = [None if p is None else p[1] for p in panels]
        lora.native = (lora.version, d, [None if b is None else (b, p) for b, p in zip(lora.b, panels)])
    return lora.native[1]


@functools.lru_cache(maxsize=None)
def options(step, ext):
    """A step's kernel options struct (NATIVE_OPTIONS: the kernels' share of its fields), filled by name, checked,
    and kept for the step (steps are frozen: one struct per distinct step)."""
    native_name = next(name for name, cls in NATIVE_OPTIONS.items() if isinstance(step, cls))
    d = getattr(ext, native_name)()
    for name, _ in d.FIELDS:
        setattr(d, name, getattr(step, name))
    d.check()
    return d
