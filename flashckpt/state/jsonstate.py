"""A small state tree (a data loader's or sampler's ``state_dict()``) as JSON, tensors included,
so it travels in a rank's own JSON file with its RNG states and extras, never pickled.

Tensors become ``{"__flashckpt_tensor__": {"dtype", "shape", "b64"}}`` and tuples
``{"__flashckpt_tuple__": [...]}``; dict keys must be strings (JSON would turn an int key into a
string, and the object would get back a state it does not recognise). Decoding checks every
tensor's dtype, shape and size: the tree may come from storage.
"""

from __future__ import annotations

import base64
import math
from typing import Any

import torch

__all__ = ["decode_state", "encode_state"]

_TENSOR = "__flashckpt_tensor__"
_TUPLE = "__flashckpt_tuple__"
_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}
MAX_BYTES = 64 << 20
"""The most tensor bytes one tree may hold (a per-rank file is small by design)."""


def encode_state(obj: Any, where: str) -> Any:
    """A JSON-serialisable copy of ``obj``.

    Args:
        obj: dicts (string keys), lists, tuples, tensors, and JSON scalars.
        where: the tree's name, for error messages.

    Raises:
        TypeError: a value that is none of those, naming its path.
    """
    total = [0]

    def enc(o: Any, path: str) -> Any:
        if isinstance(o, torch.Tensor):
            if type(o) is not torch.Tensor and not isinstance(o, torch.nn.Parameter):
                raise TypeError(f"{path}: a {type(o).__name__} cannot go in a per-rank state")
            t = o.detach().cpu().contiguous()
            name = str(t.dtype).removeprefix("torch.")
            if name not in _DTYPES:
                raise TypeError(f"{path}: tensor dtype {t.dtype} is not supported here")
            total[0] += t.nbytes
            if total[0] > MAX_BYTES:
                raise TypeError(
                    f"{where}: more than {MAX_BYTES >> 20} MiB of tensors; a per-rank state "
                    "is for small things (positions, seeds): put big state in stateful="
                )
            raw = t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
            return {_TENSOR: {"dtype": name, "shape": list(t.shape), "b64": _b64(raw)}}
        if isinstance(o, dict):
            if len(o) == 1 and next(iter(o)) in (_TENSOR, _TUPLE):
                raise TypeError(f"{path}: key {next(iter(o))!r} is reserved")
            out = {}
            for k, v in o.items():
                if not isinstance(k, str):
                    raise TypeError(
                        f"{path}: key {k!r} is a {type(k).__name__}; a per-rank state needs "
                        "string keys (JSON would return it as a string)"
                    )
                out[k] = enc(v, f"{path}/{k}")
            return out
        if isinstance(o, tuple):
            return {_TUPLE: [enc(v, f"{path}/{i}") for i, v in enumerate(o)]}
        if isinstance(o, list):
            return [enc(v, f"{path}/{i}") for i, v in enumerate(o)]
        if o is None or isinstance(o, bool | int | str):
            return o
        if isinstance(o, float):
            if not math.isfinite(o):
                raise TypeError(f"{path}: {o} has no JSON form")
            return o
        raise TypeError(f"{path}: a {type(o).__name__} cannot go in a per-rank state")

    return enc(obj, where)


def decode_state(obj: Any, where: str) -> Any:
    """The tree :func:`encode_state` made, tensors and tuples rebuilt.

    Raises:
        ValueError: a malformed tensor entry (dtype, shape or size), naming its path.
    """
    total = [0]

    def dec(o: Any, path: str) -> Any:
        if isinstance(o, dict):
            if len(o) == 1 and _TENSOR in o:
                return _tensor(o[_TENSOR], path, total)
            if len(o) == 1 and _TUPLE in o:
                items = o[_TUPLE]
                if not isinstance(items, list):
                    raise ValueError(f"{path}: a malformed tuple")
                return tuple(dec(v, f"{path}/{i}") for i, v in enumerate(items))
            return {k: dec(v, f"{path}/{k}") for k, v in o.items()}
        if isinstance(o, list):
            return [dec(v, f"{path}/{i}") for i, v in enumerate(o)]
        return o

    return dec(obj, where)


def _tensor(d: Any, path: str, total: list[int]) -> torch.Tensor:
    if not isinstance(d, dict):
        raise ValueError(f"{path}: a malformed tensor")
    name = d.get("dtype")
    dtype = _DTYPES.get(name) if isinstance(name, str) else None
    shape = d.get("shape")
    if dtype is None:
        raise ValueError(f"{path}: unknown tensor dtype {d.get('dtype')!r}")
    if not isinstance(shape, list) or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape
    ):
        raise ValueError(f"{path}: bad tensor shape {shape!r}")
    numel = math.prod(shape)
    size = numel * torch.empty((), dtype=dtype).element_size()
    total[0] += size
    if total[0] > MAX_BYTES:
        raise ValueError(f"{path}: more than {MAX_BYTES >> 20} MiB of tensors")
    b64 = d.get("b64")
    if not isinstance(b64, str) or len(b64) > 4 * (size // 3 + 1):
        raise ValueError(f"{path}: tensor data does not match its shape {shape}")
    try:
        raw = base64.b64decode(b64, validate=True)
    except ValueError:
        raise ValueError(f"{path}: tensor data is not base64") from None
    if len(raw) != size:
        raise ValueError(f"{path}: {len(raw)} bytes of tensor data for shape {shape} ({size})")
    if not size:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape)


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()
