"""The torch state codec: a nested training state (dicts, lists, tensors, DTensors, numpy arrays,
JSON scalars) split into tensors and a JSON skeleton, and rebuilt from them.

* the *tensors* go to the byte layout of :mod:`flashckpt.format.layout` (this module only names them
  and checks that their dtype has a code there);
* the *skeleton* is a JSON tree that records the structure, every non-tensor value and, for each
  tensor, the name it has in the buffer. A DTensor is saved as this rank's local piece and a
  description of where it sits (:mod:`flashckpt.state.sharded`); it comes back as a
  :class:`~flashckpt.state.sharded.ShardedPiece` for the restore path to fit to the target mesh.

Nothing here pickles. The skeleton tags: ``T`` tensor, ``S`` DTensor piece (with ``dt``, its
description), ``N`` numpy array, ``D`` dict (a list of ``[key, node]``), ``L`` list, ``U`` tuple.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from flashckpt.format.layout import dtype_code

if TYPE_CHECKING:
    import torch

# torch, numpy and flashckpt.state.sharded (which imports torch) are imported inside the functions:
# the agent-side modules that import the byte formats never pay for torch through this module.

__all__ = [
    "FlatState",
    "flatten_state",
    "piece_nodes",
    "unflatten_state",
]

_JSON_SCALARS = (bool, int, float, str, type(None))


@dataclass(slots=True)
class FlatState:
    """A state split into tensors (in input order) and a JSON skeleton."""

    names: list[str]
    tensors: list[torch.Tensor]
    skeleton: Any

    def specs(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        return [(n, t.dtype, tuple(t.shape)) for n, t in zip(self.names, self.tensors, strict=True)]


def _key_text(key: object) -> str:
    return str(key).replace("%", "%25").replace("/", "%2F")


def flatten_state(state: Mapping[str, Any]) -> FlatState:
    """Splits a nested state into tensors and a JSON skeleton.

    Args:
        state: dicts (str/int keys), lists, tuples, tensors, numpy arrays and JSON scalars.

    Returns:
        The tensors with their names (paths joined by ``/``) and the skeleton.

    Raises:
        TypeError: an object of another type, naming its key path.
    """
    import numpy as np
    import torch

    from flashckpt.state.sharded import describe, is_dtensor

    names: list[str] = []
    tensors: list[torch.Tensor] = []
    seen: set[str] = set()

    def add(path: str, t: torch.Tensor) -> str:
        name = path or "_"
        k = 1
        while name in seen:
            k += 1
            name = f"{path}#{k}"
        seen.add(name)
        names.append(name)
        tensors.append(t)
        return name

    def walk(obj: Any, path: str) -> Any:
        if isinstance(obj, torch.Tensor) and is_dtensor(obj):
            # Only this rank's piece: nothing is gathered on the save path.
            local, meta = describe(obj, path)
            if local.is_complex():
                raise TypeError(f"state key {path!r}: complex dtype {obj.dtype} is not supported")
            dtype_code(local.dtype)
            return {"S": add(path, local), "dt": meta}
        if isinstance(obj, torch.Tensor):
            if obj.is_sparse or obj.layout != torch.strided:
                raise TypeError(f"state key {path!r}: sparse tensors cannot be checkpointed")
            if obj.is_complex():
                raise TypeError(f"state key {path!r}: complex dtype {obj.dtype} is not supported")
            dtype_code(obj.dtype)
            return {"T": add(path, obj.detach())}
        if isinstance(obj, np.ndarray):
            if obj.dtype == object:
                raise TypeError(f"state key {path!r}: numpy object arrays cannot be checkpointed")
            t = torch.from_numpy(np.ascontiguousarray(obj))
            dtype_code(t.dtype)
            return {"N": add(path, t)}
        if isinstance(obj, np.generic):
            return obj.item()
        if isinstance(obj, _JSON_SCALARS):
            return obj
        if isinstance(obj, Mapping):
            items = []
            for k, v in obj.items():
                if not isinstance(k, _JSON_SCALARS):
                    raise TypeError(
                        f"state key {path!r}: dict key {k!r} of type {type(k).__name__} "
                        "cannot be checkpointed (use str or int keys)"
                    )
                items.append([k, walk(v, f"{path}/{_key_text(k)}" if path else _key_text(k))])
            return {"D": items}
        if isinstance(obj, list | tuple):
            tag = "L" if isinstance(obj, list) else "U"
            return {tag: [walk(v, f"{path}/{i}") for i, v in enumerate(obj)]}
        raise TypeError(
            f"state key {path!r} holds a {type(obj).__module__}.{type(obj).__qualname__}, "
            "which cannot be checkpointed: use tensors, numpy arrays, dicts, lists and JSON "
            "scalars (convert it, or keep it out of the state)"
        )

    skeleton = walk(dict(state), "")
    return FlatState(names, tensors, skeleton)


def unflatten_state(skeleton: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Rebuilds a state from its skeleton and tensors by name (numpy arrays come back as such).

    A DTensor comes back as a :class:`~flashckpt.state.sharded.ShardedPiece` (the saved local piece
    and where it sits); the restore path turns it into a DTensor of the target mesh.
    """
    from flashckpt.state.sharded import ShardedPiece

    def build(node: Any) -> Any:
        if isinstance(node, dict):
            if "T" in node:
                return _lookup(node["T"])
            if "S" in node:
                return ShardedPiece(_lookup(node["S"]), node["dt"], node["S"])
            if "N" in node:
                return _lookup(node["N"]).numpy()
            if "D" in node:
                return {k: build(v) for k, v in node["D"]}
            if "L" in node:
                return [build(v) for v in node["L"]]
            if "U" in node:
                return tuple(build(v) for v in node["U"])
            raise ValueError(f"malformed checkpoint skeleton node {sorted(node)}")
        return node

    def _lookup(name: str) -> torch.Tensor:
        try:
            return tensors[name]
        except KeyError:
            raise ValueError(f"checkpoint skeleton names tensor {name!r} that is missing") from None

    return build(skeleton)


def piece_nodes(skeleton: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    """(tensor name, piece description) of every DTensor piece in a skeleton."""
    if isinstance(skeleton, dict):
        if "S" in skeleton:
            yield skeleton["S"], skeleton["dt"]
            return
        for tag, value in skeleton.items():
            if tag == "D":
                for _, v in value:
                    yield from piece_nodes(v)
            elif tag in ("L", "U"):
                for v in value:
                    yield from piece_nodes(v)
