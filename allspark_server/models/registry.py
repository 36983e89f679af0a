"""Architecture registry: HF `architectures[0]` -> how to read its config and its checkpoint.

Every architecture runs on the one decoder (models/decoder.py); what differs is described by ModelArgs (read
from config.json by the architecture's `read_args`), by `convert`, which maps each checkpoint tensor onto the
decoder's canonical (Llama) names (fused projections split, rotary dims reordered, a head normalized), and by
`refine`, the family's own changes to the generic layer description (models/description.py). A module under models/
that defines ARCHITECTURES (HF name -> ArchSpec) is found here by itself, and so are its TINY_VARIANTS (the tiny
random models the tests build of it, loader/tiny_model.py): a new family is its file.
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch

from allspark_server.compute.steps import ModelSpec
from allspark_server.models.args import ModelArgs

Converter = Callable[[str, torch.Tensor, ModelArgs], Iterable[tuple[str, torch.Tensor]]]


def keep(name: str, tensor: torch.Tensor, args: ModelArgs) -> Iterable[tuple[str, torch.Tensor]]:
    """Checkpoints already in the decoder's names."""
    return ((name, tensor),)


@dataclass(frozen=True)
class ArchSpec:
    read_args: Callable[[dict, Optional[str]], ModelArgs]   # (config.json, the folder or None) -> args
    convert: Converter = keep           # checkpoint tensor -> canonical tensors (none: ignored)
    # (args, the generic description) -> this family's: its steps' options set from args.options
    refine: Optional[Callable[[ModelArgs, ModelSpec], ModelSpec]] = None
    # checkpoint tensors that are not the decoder's but travel with it (a vision tower): name -> its name in the
    # model file (stored beside the decoder's weights, not in the graph), None for the decoder's own tensors
    side: Optional[Callable[[str], Optional[str]]] = None


class UnsupportedArchitecture(ValueError):
    pass


_REGISTRY: dict[str, ArchSpec] = {}
_TINY_VARIANTS: dict[str, dict] = {}


def _registry() -> dict[str, ArchSpec]:
    """Filled on first use from every module of this package that defines ARCHITECTURES or TINY_VARIANTS (they
    import this one)."""
    if not _REGISTRY:
        import allspark_server.models as package
        for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
            module = importlib.import_module(f"{package.__name__}.{info.name}")
            for table, found, what in ((_REGISTRY, "ARCHITECTURES", "architecture"),
                                       (_TINY_VARIANTS, "TINY_VARIANTS", "tiny variant")):
                for name, value in getattr(module, found, {}).items():
                    if name in table:
                        raise RuntimeError(f"{what} {name!r} is defined twice (models/{info.name}.py)")
                    table[name] = value
    return _REGISTRY


def tiny_variants() -> dict[str, dict]:
    """The families' tiny models: name -> transformers config keys, with `arch` the HF architecture."""
    _registry()
    return _TINY_VARIANTS


def supported_architectures() -> list[str]:
    return sorted(_registry())


def get_arch(architecture: str) -> ArchSpec:
    if architecture not in _registry():
        raise UnsupportedArchitecture(
            f"architecture {architecture!r} is not supported; supported: {', '.join(supported_architectures())}")
    return _REGISTRY[architecture]


def read_args(hf_config: dict, folder: Optional[str] = None) -> ModelArgs:
    """`folder`: the HF folder, for architectures whose files say more than config.json (Baichuan2's head)."""
    archs = hf_config.get("architectures") or []
    if not archs:
        raise UnsupportedArchitecture(
            f"config.json has no 'architectures'; supported: {', '.join(supported_architectures())}")
    spec = get_arch(archs[0])
    try:
        return spec.read_args(hf_config, folder)
    except KeyError as e:
        raise ValueError(f"{archs[0]}: config.json lacks the key {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise ValueError(f"{archs[0]}: config.json: {e}") from None
