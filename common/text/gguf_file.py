"""A .gguf file's metadata and tensor directory, read in one pass with `struct` (GGUF v2 and v3, little-endian).

gguf.GGUFReader parses every metadata field into numpy views, one per string: for a 49k-token vocabulary and its
48k merges that is ~3 million small arrays and 3-6 seconds, paid by every reader (an engine's start read the file
three times: config and weights, the block formats, the tokenizer). Here a field is a plain Python value (str, int,
float, bool, or a list of them), and a tensor is its name, ggml type number, dims and where its bytes are: the
engine maps them itself. No dependency: the gateway counts prompts with a GGUF's tokenizer without numpy.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# value type -> struct format of one scalar (GGUF spec: gguf_metadata_value_type)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True, slots=True)
class GGUFTensorInfo:
    name: str
    ggml_type: int  # gguf.GGMLQuantizationType's value
    dims: tuple[int, ...]  # ggml's order: the fastest-moving dimension first
    offset: int  # of its first byte, from the start of the file


@dataclass(frozen=True, slots=True)
class GGUFFile:
    path: str
    version: int
    fields: dict[str, Any]
    tensors: list[GGUFTensorInfo]


class _Cursor:
    def __init__(self, buf: mmap.mmap | bytes, path: str) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise ValueError(f"{self.path}: truncated GGUF header at byte {self.pos}")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.take("<Q")
        if self.pos + n > len(self.buf):
            raise ValueError(f"{self.path}: truncated GGUF string at byte {self.pos}")
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.take("<" + _SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.take("<I"), self.take("<Q")
            if item in _SCALARS:  # one unpack for the whole array
                fmt = f"<{count}{_SCALARS[item]}"
                size = struct.calcsize(fmt)
                if self.pos + size > len(self.buf):
                    raise ValueError(f"{self.path}: truncated GGUF array at byte {self.pos}")
                values = list(struct.unpack_from(fmt, self.buf, self.pos))
                self.pos += size
                return values
            return [self.value(item) for _ in range(count)]
        raise ValueError(f"{self.path}: unknown GGUF value type {kind} at byte {self.pos}")


def read_gguf(path: str) -> GGUFFile:
    """The file's metadata fields and tensor directory. A ValueError names what is wrong with a file that is not a
    GGUF (v2/v3) or is cut short."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != MAGIC:
            raise ValueError(f"{path}: not a GGUF file (magic {bytes(buf[:4])!r})")
        cur = _Cursor(buf, path)
        cur.pos = 4
        version = cur.take("<I")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
        n_tensors, n_fields = cur.take("<Q"), cur.take("<Q")
        fields: dict[str, Any] = {}
        for _ in range(n_fields):
            key = cur.string()
            fields[key] = cur.value(cur.take("<I"))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = tuple(cur.take("<Q") for _ in range(cur.take("<I")))
            infos.append((name, dims, cur.take("<I"), cur.take("<Q")))
        alignment = int(fields.get("general.alignment", DEFAULT_ALIGNMENT))
        start = -(-cur.pos // alignment) * alignment
    tensors = [GGUFTensorInfo(name, kind, dims, start + offset) for name, dims, kind, offset in infos]
    return GGUFFile(path, version, fields, tensors)
