"""Open a GGUF file (llama.cpp's model format) with the `gguf` package, memory-mapped, checked before use.

GGUFReader maps the file (np.memmap): a tensor's data is a view into it, read only when used, so the file is
never copied whole. Checked here, each a GGUFError naming the file and the problem: the magic, a header cut
short or corrupt, a tensor type id no GGML type has (naming the tensor), a tensor whose data runs past the end of
the file (truncated), and which path is a GGUF model at all (`find_gguf`).

Shapes: GGUF lists a tensor's dims innermost first (ne[0], the contiguous one, is a weight's input features);
`GGUFTensor.shape` is the torch order ([out, in] for a weight, [experts, out, in] for stacked experts). The data
of a quantized tensor is its raw blocks as bytes [*shape[:-1], bytes per row]; of a dense one, its values.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from allspark_server.loader.hf_reader import CheckpointError

MAGIC = b"GGUF"
HEADER_BYTES = 24          # magic, version, tensor count, metadata count
_MISSING = object()


class GGUFError(CheckpointError):
    pass


def find_gguf(path: str) -> Optional[str]:
    """The GGUF file `path` names: the path itself when it is a .gguf file, the one .gguf in a folder without
    config.json (a HuggingFace folder stays one), else None. A folder of several .gguf files is an error."""
    if os.path.isfile(path):
        return path if path.lower().endswith(".gguf") else None
    if not os.path.isdir(path) or os.path.isfile(os.path.join(path, "config.json")):
        return None
    found = sorted(n for n in os.listdir(path) if n.lower().endswith(".gguf"))
    if len(found) > 1:
        raise GGUFError(f"{path!r} holds {len(found)} GGUF files ({', '.join(found)}): name the one to load")
    return os.path.join(path, found[0]) if found else None


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    type: Any                  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]     # torch order
    data: np.ndarray           # a view into the mapped file (see the module docstring)

    @property
    def type_name(self) -> str:
        return self.type.name



def _checked_reader_class():
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

    class CheckedReader(GGUFReader):
        """GGUFReader that names the tensor of an unknown type id or of data past the file's end."""

        def _build_tensors(self, start_offs, fields):
            size = len(self.data)
            for field in fields:
                _, name_data, _, dims, raw_dtype, offset = field.parts
                name = bytes(name_data).decode("utf-8", "replace")
                try:
                    qtype = GGMLQuantizationType(int(raw_dtype[0]))
                except ValueError:
                    raise GGUFError(f"tensor {name!r} has type id {int(raw_dtype[0])}, which is no GGML tensor "
                                    f"type this gguf package knows") from None
                block, type_size = GGML_QUANT_SIZES[qtype]
                elements = int(np.prod(dims.astype(np.int64)))
                if elements % block:
                    raise GGUFError(f"tensor {name!r} ({qtype.name}) has {elements} elements, not whole blocks "
                                    f"of {block}")
                end = start_offs + int(offset[0]) + elements // block * type_size
                if end > size:
                    raise GGUFError(f"tensor {name!r} ends at byte {end} but the file has only {size} bytes: the "
                                    f"file is truncated")
            super()._build_tensors(start_offs, fields)

    return CheckedReader


class GGUFFile:
    """A GGUF file's metadata (`get`, `arch_get`) and tensors (`tensors`: name -> GGUFTensor)."""

    def __init__(self, path: str):
        self.path = path
        _check_header(path)
        try:
            self.reader = _checked_reader_class()(path)
        except GGUFError as e:
            raise GGUFError(f"{path!r}: {e}") from None
        except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError, TypeError) as e:
            raise GGUFError(f"{path!r} is not a readable GGUF file (truncated or corrupt header: "
                            f"{type(e).__name__}: {e})") from None
        self.tensors: dict[str, GGUFTensor] = {
            t.name: GGUFTensor(t.name, t.tensor_type, tuple(int(d) for d in reversed(t.shape.tolist())), t.data)
            for t in self.reader.tensors}
        arch = self.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{path!r} has no general.architecture")
        self.architecture: str = arch

    def get(self, key: str, default: Any = _MISSING) -> Any:
        """A metadata value (str, number, bool or list); without `default` a missing key is a GGUFError."""
        field = self.reader.fields.get(key)
        if field is None:
            if default is _MISSING:
                raise GGUFError(f"{self.path!r} lacks the metadata key {key!r}")
            return default
        return field.contents()

    def arch_get(self, suffix: str, default: Any = _MISSING) -> Any:
        """`<architecture>.<suffix>`, e.g. arch_get("block_count")."""
        return self.get(f"{self.architecture}.{suffix}", default)


def _check_header(path: str) -> None:
    try:
        with open(path, "rb") as f:
            head = f.read(HEADER_BYTES)
    except OSError as e:
        raise GGUFError(f"cannot read {path!r}: {e}") from None
    if head[:4] != MAGIC:
        raise GGUFError(f"{path!r} is not a GGUF file: it starts with {head[:4]!r}, a GGUF file with {MAGIC!r}")
    if len(head) < HEADER_BYTES:
        raise GGUFError(f"{path!r} is truncated: {len(head)} bytes, less than a GGUF header")
