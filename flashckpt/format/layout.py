"""The byte formats of a state's tensors: dtype codes, the byte layout and safetensors headers.

The tensors of a state are laid out back to back in one byte buffer (the safetensors byte buffer:
no holes, entries sorted by element size so every offset is naturally aligned). A :class:`Layout`
says where each one lives; :func:`safetensors_header` and :func:`parse_safetensors` write and read
the header that makes the buffer a safetensors file. Splitting a nested state into tensors and a
JSON skeleton (and back) is the torch state codec, one layer up: :mod:`flashckpt.state.codec`.

Nothing here pickles: the tensors are raw bytes with a dtype and a shape.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# torch is imported inside the functions that take or make tensors, never at module level: the
# node agent builds safetensors headers from a layout (``Layout.from_json``,
# ``safetensors_header``) and must not pay torch's import (~2 s, ~220 MiB) for that.

__all__ = [
    "Layout",
    "TensorEntry",
    "parse_safetensors",
    "safetensors_header",
]

# safetensors dtype codes and element sizes, see https://github.com/huggingface/safetensors
# (format section); the torch dtype of each code is looked up lazily (``_dtype_tables``).
_ST_ITEMSIZE: dict[str, int] = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "U16": 2,
    "U32": 4,
    "U64": 8,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
_TORCH_NAMES: dict[str, str] = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    "U16": "uint16",
    "U32": "uint32",
    "U64": "uint64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}


@functools.cache
def _dtype_tables() -> tuple[dict[torch.dtype, str], dict[str, torch.dtype]]:
    """torch dtype -> code and back, for the dtypes this torch has (older ones lack some)."""
    import torch

    to_st = {
        getattr(torch, name): code for code, name in _TORCH_NAMES.items() if hasattr(torch, name)
    }
    return to_st, {v: k for k, v in to_st.items()}


def dtype_code(dtype: torch.dtype) -> str:
    """Returns the safetensors code of a torch dtype, or raises TypeError."""
    to_st, _ = _dtype_tables()
    try:
        return to_st[dtype]
    except KeyError:
        raise TypeError(
            f"dtype {dtype} cannot be checkpointed (supported: {', '.join(str(d) for d in to_st)})"
        ) from None


def torch_dtype(code: str) -> torch.dtype:
    """Returns the torch dtype of a safetensors code, or raises ValueError."""
    try:
        return _dtype_tables()[1][code]
    except KeyError:
        raise ValueError(f"unknown tensor dtype code {code!r} in checkpoint") from None


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """Where one tensor lives in the byte buffer."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    def to_json(self) -> list[Any]:
        return [self.name, self.dtype, list(self.shape), self.offset, self.nbytes]

    @staticmethod
    def from_json(item: list[Any]) -> TensorEntry:
        name, dtype, shape, offset, nbytes = item
        return TensorEntry(str(name), str(dtype), tuple(int(s) for s in shape), int(offset), nbytes)


@dataclass(frozen=True, slots=True)
class Layout:
    """The byte layout of the tensors of a state: stable while names, dtypes and shapes are."""

    entries: tuple[TensorEntry, ...]
    nbytes: int
    signature: str

    @staticmethod
    def build(specs: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> Layout:
        """Lays tensors out back to back, larger elements first, so offsets are aligned."""
        order = sorted(
            range(len(specs)), key=lambda i: (-_itemsize(specs[i][1]), i)
        )  # stable: same input order -> same layout
        entries: list[TensorEntry] = []
        offset = 0
        for i in order:
            name, dtype, shape = specs[i]
            nbytes = _itemsize(dtype) * math.prod(shape)
            entries.append(TensorEntry(name, dtype_code(dtype), shape, offset, nbytes))
            offset += nbytes
        sig = hashlib.sha1(
            json.dumps([e.to_json() for e in entries], separators=(",", ":")).encode()
        ).hexdigest()
        return Layout(tuple(entries), offset, sig)

    def to_json(self) -> list[list[Any]]:
        return [e.to_json() for e in self.entries]

    @staticmethod
    def from_json(items: list[list[Any]]) -> Layout:
        entries = tuple(TensorEntry.from_json(i) for i in items)
        nbytes = max((e.offset + e.nbytes for e in entries), default=0)
        sig = hashlib.sha1(
            json.dumps([e.to_json() for e in entries], separators=(",", ":")).encode()
        ).hexdigest()
        return Layout(entries, nbytes, sig)


def _itemsize(dtype: torch.dtype) -> int:
    return int(dtype.itemsize)


def safetensors_header(layout: Layout, metadata: Mapping[str, str], align: int = 8) -> bytes:
    """The bytes that precede the tensor buffer in a safetensors file: length + JSON header.

    The JSON is padded with trailing spaces (the format allows them) so the header is a multiple
    of ``align`` bytes: 8 is what the format recommends; a page (4096) puts the tensor bytes at a
    page-aligned file offset, so the file can be written with ``O_DIRECT`` straight from memory.
    """
    if align < 8 or align % 8:
        raise ValueError(f"safetensors header alignment must be a multiple of 8, got {align}")
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    for e in layout.entries:
        header[e.name] = {
            "dtype": e.dtype,
            "shape": list(e.shape),
            "data_offsets": [e.offset, e.offset + e.nbytes],
        }
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-(8 + len(body)) % align)
    return struct.pack("<Q", len(body)) + body


def parse_safetensors_header(header: Any) -> tuple[Layout, dict[str, str]]:
    """Validates a parsed safetensors JSON header (read from a file: trusted in nothing).

    Returns:
        The layout (offsets relative to the data start) and the ``__metadata__``.

    Raises:
        ValueError: not a dict of tensors with a known dtype, a shape of non-negative ints and
            byte ranges that match them and do not overlap.
    """
    if not isinstance(header, dict):
        raise ValueError("safetensors header is not a JSON object")
    header = dict(header)
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
    ):
        raise ValueError("safetensors __metadata__ is not a map of strings")
    entries = []
    for name, info in header.items():
        if not isinstance(info, dict):
            raise ValueError(f"tensor {name!r}: header entry is not an object")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        size = _ST_ITEMSIZE.get(dtype) if isinstance(dtype, str) else None
        if size is None:
            raise ValueError(f"unknown tensor dtype code {dtype!r} in checkpoint")
        if not isinstance(shape, list) or not all(_is_uint(s) for s in shape):
            raise ValueError(f"tensor {name!r}: invalid shape {shape!r}")
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(_is_uint(o) for o in offsets)
            and offsets[0] <= offsets[1]
        ):
            raise ValueError(f"tensor {name!r}: invalid data_offsets {offsets!r}")
        start, end = offsets
        if end - start != size * math.prod(shape):
            raise ValueError(f"tensor {name!r}: byte range does not match dtype and shape")
        entries.append([name, dtype, shape, start, end - start])
    entries.sort(key=lambda e: (e[3], e[4]))
    for prev, cur in itertools.pairwise(entries):
        if prev[3] + prev[4] > cur[3]:
            raise ValueError(f"tensors {prev[0]!r} and {cur[0]!r} overlap")
    return Layout.from_json(entries), meta


def _is_uint(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def parse_safetensors(buf: memoryview | bytes | bytearray) -> tuple[Layout, dict[str, str], int]:
    """Parses a safetensors file held in memory.

    Returns:
        The layout (offsets relative to the data start), the ``__metadata__`` and the data start.

    Raises:
        ValueError: the bytes are not a well-formed safetensors file.
    """
    if len(buf) < 8:
        raise ValueError("file too short to be safetensors")
    (hlen,) = struct.unpack_from("<Q", buf, 0)
    if hlen > len(buf) - 8 or hlen > 100 << 20:
        raise ValueError(f"safetensors header length {hlen} exceeds the file")
    try:
        header = json.loads(bytes(buf[8 : 8 + hlen]))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"safetensors header is not JSON: {e}") from None
    layout, meta = parse_safetensors_header(header)
    data_start = 8 + hlen
    if data_start + layout.nbytes > len(buf):
        raise ValueError(
            f"safetensors data is truncated: needs {layout.nbytes} bytes, has "
            f"{len(buf) - data_start}"
        )
    return layout, meta, data_start


def tensor_views(layout: Layout, data: torch.Tensor) -> dict[str, torch.Tensor]:
    """Typed views of each tensor of a layout inside a uint8 tensor (no copy)."""
    out = {}
    for e in layout.entries:
        raw = data[e.offset : e.offset + e.nbytes]
        out[e.name] = raw.view(torch_dtype(e.dtype)).view(e.shape)
    return out
