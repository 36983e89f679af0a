"""Open a GGUF file (llama.cpp's model format), memory-mapped, with our own bounded reader, checked before use.

The header is parsed here, not by gguf.GGUFReader: that reader makes a numpy object of every metadata element
(a 20 M-element array costs gigabytes) and reads nothing, without an error, past the end of the file (an array
declaring 2^62 elements loops forever). Here every declared length is checked against the bytes left in the
file before it is read, arrays nest at most MAX_NESTING deep, and a metadata value is decoded only when asked
for (`get`), an array of at most MAX_VALUES elements: a key we never read costs nothing but walking it.
Checked, each a GGUFError naming the file and the key or tensor: the magic and version, a header cut short or
corrupt, a key or string that is not UTF-8, a value type GGUF does not define, general.alignment (a power of
two, as llama.cpp wants), a tensor type id no GGML type has, a tensor whose rows are not whole blocks, whose
data is not aligned to general.alignment, runs past the end of the file (truncated) or overlaps another's (the
checks llama.cpp's gguf_init makes), and which path is a GGUF model at all (`find_gguf`).

A tensor's data is a view into the mapped file, read only when used, so the file is never copied whole.
Shapes: GGUF lists a tensor's dims innermost first (ne[0], the contiguous one, is a weight's input features);
`GGUFTensor.shape` is the torch order ([out, in] for a weight, [experts, out, in] for stacked experts). The data
of a quantized tensor is its raw blocks as bytes [*shape[:-1], bytes per row]; of a dense one, its values.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import numpy as np

from allspark_server.loader.hf_reader import CheckpointError

MAGIC = b"GGUF"
HEADER_BYTES = 24          # magic, version, tensor count, metadata count
VERSIONS = (2, 3)          # v1 counted in 32 bits; llama.cpp reads 2 and 3
DEFAULT_ALIGNMENT = 32     # GGUF's, when general.alignment is absent
MAX_DIMS = 4               # GGML_MAX_DIMS
MAX_NESTING = 8            # arrays of arrays: GGUF allows them, no model uses them
MAX_VALUES = 1 << 21       # elements `get` returns from one array (vocabularies and merge lists are < 10^6)
_MISSING = object()
# GGUF metadata value types: id -> (struct format, numpy dtype); 8 is a string, 9 an array
_SCALARS = {0: ("<B", "<u1"), 1: ("<b", "<i1"), 2: ("<H", "<u2"), 3: ("<h", "<i2"), 4: ("<I", "<u4"),
            5: ("<i", "<i4"), 6: ("<f", "<f4"), 7: ("<?", "<u1"), 10: ("<Q", "<u8"), 11: ("<q", "<i8"),
            12: ("<d", "<f8")}
_WIDTH = {t: struct.calcsize(f) for t, (f, _) in _SCALARS.items()}
STRING, ARRAY, UINT32, BOOL = 8, 9, 4, 7
_MIN_BYTES = {**_WIDTH, STRING: 8, ARRAY: 12}       # the least bytes one value of a type takes in the file
_DENSE_DTYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                 "I32": np.int32, "I64": np.int64}   # the types a tensor's data is read as values (else bytes)


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


class Field(NamedTuple):
    """Where one metadata key/value lies in the file: [start, end) is the whole record (key, type, value)."""
    type: int
    value_at: int
    start: int
    end: int


class GGUFFile:
    """A GGUF file's metadata (`get`, `arch_get`) and tensors (`tensors`: name -> GGUFTensor)."""

    def __init__(self, path: str):
        self.path = path
        _check_header(path)
        try:
            self.data = np.memmap(path, mode="r", dtype=np.uint8)
        except (OSError, ValueError) as e:
            raise GGUFError(f"cannot map {path!r}: {e}") from None
        self.size = len(self.data)
        self.fields: dict[str, Field] = {}
        self._values: dict[str, Any] = {}
        try:
            self.tensors: dict[str, GGUFTensor] = self._read()
        except GGUFError as e:
            raise GGUFError(f"{path!r}: {e}") from None
        arch = self.get("general.architecture", None)
        if not isinstance(arch, str):
            raise GGUFError(f"{path!r} has no general.architecture")
        self.architecture: str = arch

    def get(self, key: str, default: Any = _MISSING) -> Any:
        """A metadata value (str, number, bool or list); without `default` a missing key is a GGUFError."""
        field = self.fields.get(key)
        if field is None:
            if default is _MISSING:
                raise GGUFError(f"{self.path!r} lacks the metadata key {key!r}")
            return default
        if key not in self._values:
            try:
                self._values[key] = self._value(field.value_at, field.type, key)
            except GGUFError as e:
                raise GGUFError(f"{self.path!r}: {e}") from None
        return self._values[key]

    def arch_get(self, suffix: str, default: Any = _MISSING) -> Any:
        """`<architecture>.<suffix>`, e.g. arch_get("block_count")."""
        return self.get(f"{self.architecture}.{suffix}", default)

    def array_info(self, key: str) -> Optional[tuple[int, int]]:
        """An array key's (element value type, element count), without reading it (None: absent or no array)."""
        field = self.fields.get(key)
        return struct.unpack_from("<IQ", self.data, field.value_at) if field and field.type == ARRAY else None

    def metadata_bytes(self, keys) -> bytes:
        """The records of `keys` (those present) as the file holds them: a GGUF header's metadata part."""
        return b"".join(bytes(self.data[self.fields[k].start:self.fields[k].end]) for k in keys if k in self.fields)

    # ---- the header --------------------------------------------------------------------------------
    def _need(self, at: int, n: int, what: str) -> None:
        if at + n > self.size:
            raise GGUFError(f"{what} needs {n} bytes at byte {at}, past the end of the file ({self.size} bytes): "
                            f"the file is truncated or corrupt")

    def _u32(self, at: int, what: str) -> int:
        self._need(at, 4, what)
        return struct.unpack_from("<I", self.data, at)[0]

    def _u64(self, at: int, what: str) -> int:
        self._need(at, 8, what)
        return struct.unpack_from("<Q", self.data, at)[0]

    def _string(self, at: int, what: str) -> tuple[str, int]:
        """The UTF-8 string at `at` and the offset past it."""
        n = self._u64(at, what)
        self._need(at + 8, n, what)
        raw = bytes(self.data[at + 8:at + 8 + n])
        try:
            return raw.decode("utf-8"), at + 8 + n
        except UnicodeDecodeError as e:
            raise GGUFError(f"{what} is not valid UTF-8 ({e.reason} at byte {e.start} of its {n})") from None

    def _read(self) -> dict[str, GGUFTensor]:
        version = self._u32(4, "the version")
        if version & 0xFFFF == 0:
            raise GGUFError("a big-endian GGUF file, which allspark does not read")
        if version not in VERSIONS:
            raise GGUFError(f"GGUF version {version}; allspark reads versions {' and '.join(map(str, VERSIONS))}")
        tensor_count, kv_count = self._u64(8, "the tensor count"), self._u64(16, "the metadata count")
        left = self.size - HEADER_BYTES
        if kv_count * 13 > left or tensor_count * 24 > left:   # the least a key/value or a tensor's info takes
            raise GGUFError(f"the header declares {kv_count} metadata keys and {tensor_count} tensors, more than "
                            f"the {left} bytes after it can hold: the file is truncated or corrupt")
        at = HEADER_BYTES
        for i in range(kv_count):
            start = at
            key, at = self._string(at, f"metadata key #{i}")
            vtype = self._u32(at, f"the type of metadata {key!r}")
            if key in self.fields:
                raise GGUFError(f"the metadata key {key!r} appears twice")
            end = self._skip(at + 4, vtype, key, 0)
            self.fields[key] = Field(vtype, at + 4, start, end)
            at = end
        infos = []
        for i in range(tensor_count):
            name, at = self._string(at, f"the name of tensor #{i}")
            n_dims = self._u32(at, f"the dims of tensor {name!r}")
            if n_dims > MAX_DIMS:
                raise GGUFError(f"tensor {name!r} has {n_dims} dims, more than GGML's {MAX_DIMS}")
            self._need(at + 4, 8 * n_dims + 12, f"the info of tensor {name!r}")
            dims = struct.unpack_from(f"<{n_dims}Q", self.data, at + 4)
            qtype, offset = struct.unpack_from("<IQ", self.data, at + 4 + 8 * n_dims)
            at += 4 + 8 * n_dims + 12
            infos.append((name, dims, qtype, offset))
        alignment = self._alignment()
        return self._tensors(infos, -(-at // alignment) * alignment, alignment)

    def _skip(self, at: int, vtype: int, key: str, depth: int) -> int:
        """The offset past the value of type `vtype` at `at`, every length checked against the file's end."""
        if vtype in _WIDTH:
            self._need(at, _WIDTH[vtype], f"metadata {key!r}")
            return at + _WIDTH[vtype]
        if vtype == STRING:
            n = self._u64(at, f"metadata {key!r}")
            self._need(at + 8, n, f"metadata {key!r}")
            return at + 8 + n
        if vtype != ARRAY:
            raise GGUFError(f"metadata {key!r} has value type {vtype}, which GGUF does not define")
        if depth >= MAX_NESTING:
            raise GGUFError(f"metadata {key!r} nests arrays more than {MAX_NESTING} deep")
        itype, count = self._u32(at, f"metadata {key!r}"), self._u64(at + 4, f"metadata {key!r}")
        at += 12
        if itype not in _MIN_BYTES:
            raise GGUFError(f"metadata {key!r} is an array of value type {itype}, which GGUF does not define")
        if count * _MIN_BYTES[itype] > self.size - at:
            raise GGUFError(f"metadata {key!r} declares an array of {count} values, more than the "
                            f"{self.size - at} bytes left in the file can hold: the file is truncated or corrupt")
        if itype in _WIDTH:
            return at + count * _WIDTH[itype]
        if itype == STRING:                        # the common long array (a vocabulary): walked without calls
            data, size = self.data, self.size
            for i in range(count):
                if at + 8 > size:
                    self._need(at, 8, f"string {i} of metadata {key!r}")
                at += 8 + struct.unpack_from("<Q", data, at)[0]
            self._need(at, 0, f"metadata {key!r}")
            return at
        for _ in range(count):
            at = self._skip(at, itype, key, depth + 1)
        return at

    def _value(self, at: int, vtype: int, key: str) -> Any:
        """The value `_skip` walked, decoded: a Python scalar, str or list."""
        if vtype in _SCALARS:
            v = struct.unpack_from(_SCALARS[vtype][0], self.data, at)[0]
            return bool(v) if vtype == BOOL else v
        if vtype == STRING:
            return self._string(at, f"metadata {key!r}")[0]
        itype, count = struct.unpack_from("<IQ", self.data, at)
        if count > MAX_VALUES:
            raise GGUFError(f"metadata {key!r} is an array of {count} values, more than the {MAX_VALUES} allspark "
                            f"reads from one key")
        at += 12
        if itype in _SCALARS:
            values = np.frombuffer(self.data, dtype=_SCALARS[itype][1], count=count, offset=at).tolist()
            return [bool(v) for v in values] if itype == BOOL else values
        out = []
        for _ in range(count):
            out.append(self._value(at, itype, key))
            at = self._skip(at, itype, key, 0)
        return out

    def _alignment(self) -> int:
        field = self.fields.get("general.alignment")
        if field is None:
            return DEFAULT_ALIGNMENT
        if field.type != UINT32:
            raise GGUFError("general.alignment must be a UINT32")
        alignment = self._value(field.value_at, UINT32, "general.alignment")
        if alignment == 0 or alignment & (alignment - 1):
            raise GGUFError(f"general.alignment is {alignment}, not a power of two")
        return alignment

    def _tensors(self, infos: list, data_start: int, alignment: int) -> dict[str, GGUFTensor]:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        tensors, spans = {}, []
        for name, dims, type_id, offset in infos:
            if name in tensors:
                raise GGUFError(f"the tensor {name!r} appears twice")
            try:
                qtype = GGMLQuantizationType(type_id)
            except ValueError:
                raise GGUFError(f"tensor {name!r} has type id {type_id}, which is no GGML tensor type this gguf "
                                f"package knows") from None
            block, type_size = GGML_QUANT_SIZES[qtype]
            elements = int(np.prod(dims, dtype=object)) if dims else 1
            row = dims[0] if dims else 1
            if row % block:
                raise GGUFError(f"tensor {name!r} ({qtype.name}) has rows of {row} elements, not whole blocks of "
                                f"{block}")
            if offset % alignment:
                raise GGUFError(f"tensor {name!r} starts at data offset {offset}, not a multiple of the alignment "
                                f"{alignment} (general.alignment)")
            start = data_start + offset
            end = start + elements // block * type_size
            if end > self.size:
                raise GGUFError(f"tensor {name!r} ends at byte {end} but the file has only {self.size} bytes: the "
                                f"file is truncated")
            spans.append((start, end, name))
            shape = tuple(int(d) for d in reversed(dims))
            dense = _DENSE_DTYPES.get(qtype.name)
            if dense is not None:
                data = self.data[start:end].view(dense).reshape(shape)
            else:
                data = self.data[start:end].reshape(*shape[:-1], row // block * type_size)
            tensors[name] = GGUFTensor(name, qtype, shape, data)
        spans.sort()
        for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
            if start < end:
                raise GGUFError(f"the data of tensors {a!r} and {b!r} overlap (bytes {start} to {end})")
        return tensors


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
