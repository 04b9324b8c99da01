"""A fast reader of GGUF files: the metadata parsed in one pass, tensors as plain numpy views of a memory map.

`gguf.GGUFReader` builds a numpy view per element of every metadata array: a tokenizer's ~50k tokens and ~50k
merges cost it seconds (4 s of a 6 s SmolLM2 load on a 2-core host). This reader decodes the same file in tens of
milliseconds and offers the part of GGUFReader's interface the loaders use:

    reader.fields[key].contents()    python value: str, int, float, bool, or a list of them
    reader.tensors                   [GGUFTensor(name, tensor_type, shape (ggml ne, innermost first), n_elements,
                                                 n_bytes, data_offset, data)]

`data` is shaped as GGUFReader shapes it (float types [..., ne0]; quantised types uint8 [..., bytes per row]) but
is a plain ndarray over the map, so slicing it does not build numpy.memmap objects. Little-endian files only
(every file llama.cpp writes); a big-endian one raises ValueError.
"""

from __future__ import annotations

import dataclasses
import mmap
import struct
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
_STRING, _ARRAY = 8, 9
# GGUF value type -> (struct format, numpy dtype) of the fixed-size scalars
_SCALARS = {
    0: ("<B", np.uint8),
    1: ("<b", np.int8),
    2: ("<H", np.uint16),
    3: ("<h", np.int16),
    4: ("<I", np.uint32),
    5: ("<i", np.int32),
    6: ("<f", np.float32),
    7: ("<?", np.bool_),
    10: ("<Q", np.uint64),
    11: ("<q", np.int64),
    12: ("<d", np.float64),
}
_FLOAT_TYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "BF16": None}
_INT_TYPES = {"I8": np.int8, "I16": np.int16, "I32": np.int32, "I64": np.int64}


@dataclasses.dataclass(frozen=True)
class GGUFField:
    """One metadata key's value (`contents()` as GGUFReader's ReaderField returns it)."""

    name: str
    value: Any

    def contents(self) -> Any:
        return self.value


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray  # ggml ne (innermost first), uint64
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


class _Cursor:
    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        s = str(self.buf[self.pos : self.pos + n], "utf-8")
        self.pos += n
        return s

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            return self.array()
        if vtype not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {vtype} at byte {self.pos}")
        return self.unpack(_SCALARS[vtype][0])

    def array(self) -> list:
        item_type, count = self.unpack("<I"), self.unpack("<Q")
        if item_type in _SCALARS:  # one numpy read of the whole array
            dtype = np.dtype(_SCALARS[item_type][1]).newbyteorder("<")
            values = np.frombuffer(self.buf, dtype, count, self.pos)
            self.pos += values.nbytes
            return values.tolist()
        if item_type == _STRING:
            buf, pos, out = self.buf, self.pos, []
            unpack_len = struct.Struct("<Q").unpack_from
            for _ in range(count):
                n = unpack_len(buf, pos)[0]
                out.append(str(buf[pos + 8 : pos + 8 + n], "utf-8"))
                pos += 8 + n
            self.pos = pos
            return out
        return [self.value(item_type) for _ in range(count)]  # arrays of arrays (rare)


class GGUFFile:
    """Parses `path` (memory-mapped read-only; the map lives as long as any tensor's data does).

    Raises:
      ValueError: not a GGUF file, an unsupported version, a big-endian file, or a truncated header.
    """

    def __init__(self, path: str):
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # the type table; the reader itself is not used

        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf = memoryview(self._map)
        if bytes(buf[:4]) != GGUF_MAGIC:
            raise ValueError("no GGUF magic at the start of the file")
        cur = _Cursor(buf)
        cur.pos = 4
        version = cur.unpack("<I")
        if version not in (2, 3):
            swapped = struct.unpack(">I", struct.pack("<I", version))[0]
            kind = "big-endian GGUF is not supported" if swapped in (2, 3) else f"unsupported GGUF version {version}"
            raise ValueError(kind)
        try:
            n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
            header = {"GGUF.version": version, "GGUF.tensor_count": n_tensors, "GGUF.kv_count": n_kv}
            self.fields: dict[str, GGUFField] = {k: GGUFField(k, v) for k, v in header.items()}  # as GGUFReader's
            for _ in range(n_kv):
                key = cur.string()
                self.fields[key] = GGUFField(key, cur.value(cur.unpack("<I")))
            infos = []
            for _ in range(n_tensors):
                name = cur.string()
                dims = [cur.unpack("<Q") for _ in range(cur.unpack("<I"))]
                infos.append((name, dims, cur.unpack("<I"), cur.unpack("<Q")))
        except struct.error as e:
            raise ValueError(f"truncated GGUF header ({e})") from e
        align = int(self.fields["general.alignment"].value) if "general.alignment" in self.fields else DEFAULT_ALIGNMENT
        start = -(-cur.pos // align) * align
        self.tensors: list[GGUFTensor] = []
        names = set()
        for name, dims, raw_type, offset in infos:
            if name in names:
                raise ValueError(f"duplicated tensor {name}")
            names.add(name)
            ggml_type = GGMLQuantizationType(raw_type)
            n_elems = int(np.prod(dims, dtype=np.int64)) if dims else 1
            block, type_size = GGML_QUANT_SIZES[ggml_type]
            n_bytes = n_elems * type_size // block
            shape = tuple(reversed(dims))
            dtype = _FLOAT_TYPES.get(ggml_type.name) or _INT_TYPES.get(ggml_type.name)
            if dtype is None:  # quantised (and BF16): bytes, one row of blocks per innermost row
                dtype, shape = np.uint8, (*shape[:-1], shape[-1] // block * type_size)
            begin = start + offset
            if begin + n_bytes > len(self._map):
                raise ValueError(f"tensor {name} runs past the end of the file")
            data = np.frombuffer(self._map, np.uint8, n_bytes, begin).view(dtype).reshape(shape)
            self.tensors.append(GGUFTensor(name, ggml_type, np.asarray(dims, np.uint64), n_elems, n_bytes, begin, data))
