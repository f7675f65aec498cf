"""The state codecs (:mod:`flashckpt.state.codec`, :mod:`flashckpt.state.jsonstate`): a nested
training state split into tensors and a JSON skeleton comes back equal, what cannot be stored is
refused naming its key path, and a malformed skeleton or tensor entry (it may come from storage)
raises instead of building a wrong state."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import torch

from flashckpt.state.codec import flatten_state, unflatten_state
from flashckpt.state.jsonstate import MAX_BYTES, decode_state, encode_state


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return type(a) is type(b) and a == b


def _state() -> dict[str, Any]:
    return {
        "model": {"w": torch.randn(3, 4), "b": torch.arange(4, dtype=torch.int32)},
        "opt": {"state": {0: {"step": torch.tensor(5.0), "exp_avg": torch.zeros(2)}}, "lr": 0.1},
        "np": np.arange(6, dtype=np.int16).reshape(2, 3),
        "pair": (1, "a", None, True),
        "list": [torch.ones(1, dtype=torch.bfloat16), [2.5, {"x/y": torch.tensor([7])}]],
        "scalar": np.float32(1.5),
    }


def test_a_nested_state_comes_back_equal_through_json() -> None:
    state = _state()
    flat = flatten_state(state)
    assert len(flat.names) == len(set(flat.names)) == 7
    skeleton = json.loads(json.dumps(flat.skeleton))  # stored as JSON
    back = unflatten_state(skeleton, dict(zip(flat.names, flat.tensors, strict=True)))
    state["scalar"] = 1.5  # a numpy scalar is stored as its JSON value
    assert _same(state, back), back


def test_keys_that_collide_as_paths_keep_their_own_tensors() -> None:
    # "a/b" (escaped) and a nested a -> b must not share a name.
    state = {"a/b": torch.zeros(1), "a": {"b": torch.ones(1)}}
    flat = flatten_state(state)
    back = unflatten_state(flat.skeleton, dict(zip(flat.names, flat.tensors, strict=True)))
    assert torch.equal(back["a/b"], torch.zeros(1)) and torch.equal(back["a"]["b"], torch.ones(1))


@pytest.mark.parametrize(
    ("value", "words"),
    [
        (object(), "state key 'x/y' holds a builtins.object"),
        ({(1, 2): 3}, "dict key (1, 2) of type tuple"),
        (np.array([object()]), "numpy object arrays"),
        (torch.zeros(2, dtype=torch.complex64), "complex dtype"),
        (torch.zeros(2, 2).to_sparse(), "sparse tensors"),
    ],
)
def test_what_cannot_be_stored_is_refused_naming_its_key_path(value: Any, words: str) -> None:
    with pytest.raises(TypeError) as info:
        flatten_state({"x": {"y": value}})
    assert words in str(info.value)


@pytest.mark.parametrize(
    ("skeleton", "words"),
    [
        ({"D": [["w", {"T": "missing"}]]}, "names tensor 'missing' that is missing"),
        ({"D": [["w", {"Q": 1}]]}, "malformed checkpoint skeleton node"),
    ],
)
def test_a_malformed_skeleton_raises(skeleton: Any, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        unflatten_state(skeleton, {"w": torch.zeros(1)})


def test_a_per_rank_tree_comes_back_equal() -> None:
    tree = {"pos": 3, "seed": (1, 2), "gen": torch.arange(5, dtype=torch.uint8), "empty": []}
    back = decode_state(json.loads(json.dumps(encode_state(tree, "loader"))), "loader")
    assert _same(tree, back), back


@pytest.mark.parametrize(
    ("tree", "words"),
    [
        ({1: 2}, "needs string keys"),
        ({"__flashckpt_tensor__": 1}, "is reserved"),
        ({"x": float("inf")}, "has no JSON form"),
        ({"x": {1, 2}}, "a set cannot go in a per-rank state"),
        ({"x": torch.zeros(2, dtype=torch.complex64)}, "dtype torch.complex64 is not supported"),
    ],
)
def test_a_per_rank_tree_that_json_cannot_carry_is_refused(tree: Any, words: str) -> None:
    with pytest.raises(TypeError, match=words):
        encode_state(tree, "loader")


def _tensor_entry(**over: Any) -> dict[str, Any]:
    entry = encode_state({"t": torch.arange(4, dtype=torch.int32)}, "x")["t"]
    entry["__flashckpt_tensor__"].update(over)
    return {"t": entry}


@pytest.mark.parametrize(
    ("doc", "words"),
    [
        (_tensor_entry(dtype="complex128"), "unknown tensor dtype"),
        (_tensor_entry(shape=[-1]), "bad tensor shape"),
        (_tensor_entry(shape=[True]), "bad tensor shape"),
        (_tensor_entry(shape=[5]), "bytes of tensor data for shape"),
        (_tensor_entry(b64="!!!!"), "is not base64"),
        (_tensor_entry(shape=[MAX_BYTES]), "MiB of tensors"),
        ({"t": {"__flashckpt_tuple__": 3}}, "a malformed tuple"),
    ],
)
def test_a_malformed_tensor_entry_from_storage_raises(doc: Any, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        decode_state(doc, "loader")
