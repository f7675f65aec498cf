from __future__ import annotations

import json

import numpy as np
import pytest
import safetensors.torch
import torch

from flashckpt.format.layout import (
    Layout,
    dtype_code,
    parse_safetensors,
    safetensors_header,
    tensor_views,
    torch_dtype,
)
from flashckpt.state.codec import flatten_state, unflatten_state


def _pack(state: dict) -> tuple[bytes, Layout, object]:
    flat = flatten_state(state)
    layout = Layout.build(flat.specs())
    buf = torch.zeros(layout.nbytes, dtype=torch.uint8)
    views = tensor_views(layout, buf)
    for name, t in zip(flat.names, flat.tensors, strict=True):
        views[name].copy_(t)
    return buf.numpy().tobytes(), layout, flat.skeleton


def test_roundtrip_keeps_structure_types_and_bits() -> None:
    state = {
        "model": {"w": torch.randn(3, 4), "b": torch.arange(5, dtype=torch.int64)},
        "optimizer": {
            "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(3, 4).bfloat16()}},
            "param_groups": [{"lr": 0.1, "params": [0], "betas": (0.9, 0.99), "name": None}],
        },
        "np": np.arange(6, dtype=np.float32).reshape(2, 3),
        "flag": torch.tensor([True, False]),
        "noncontig": torch.randn(4, 6).t(),
        "empty": torch.empty(0, 3),
    }
    raw, layout, skeleton = _pack(state)
    # The skeleton is plain JSON.
    skeleton = json.loads(json.dumps(skeleton))
    back = unflatten_state(
        skeleton, tensor_views(layout, torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    )
    assert torch.equal(back["model"]["w"], state["model"]["w"])
    assert torch.equal(back["model"]["b"], state["model"]["b"])
    st0 = back["optimizer"]["state"][0]  # int key survives
    assert torch.equal(st0["exp_avg"], state["optimizer"]["state"][0]["exp_avg"])
    assert st0["exp_avg"].dtype == torch.bfloat16
    assert back["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.99)  # tuple survives
    assert back["optimizer"]["param_groups"][0]["name"] is None
    assert isinstance(back["np"], np.ndarray) and np.array_equal(back["np"], state["np"])
    assert torch.equal(back["noncontig"], state["noncontig"])
    assert back["empty"].shape == (0, 3)


def test_layout_has_no_holes_and_aligned_offsets() -> None:
    flat = flatten_state(
        {
            "a": torch.zeros(3, dtype=torch.uint8),
            "b": torch.zeros(2),
            "c": torch.zeros(1, dtype=torch.float64),
        }
    )
    layout = Layout.build(flat.specs())
    end = 0
    for e in sorted(layout.entries, key=lambda e: e.offset):
        assert e.offset == end
        size = torch.empty(
            (), dtype=getattr(torch, {"F64": "float64", "F32": "float32", "U8": "uint8"}[e.dtype])
        ).element_size()
        assert e.offset % size == 0
        end += e.nbytes
    assert end == layout.nbytes == 3 + 8 + 8


def test_unsupported_object_names_its_key() -> None:
    with pytest.raises(TypeError, match=r"optimizer/state/0/weird.*builtins.set"):
        flatten_state({"optimizer": {"state": {0: {"weird": {1, 2}}}}})
    with pytest.raises(TypeError, match=r"model/x.*complex"):
        flatten_state({"model": {"x": torch.zeros(2, dtype=torch.complex64)}})
    with pytest.raises(TypeError, match="dict key"):
        flatten_state({"m": {(1, 2): 3}})


def test_written_file_is_plain_safetensors(tmp_path) -> None:
    state = {"model": {"w": torch.randn(7, 3), "i": torch.arange(4, dtype=torch.int32)}}
    raw, layout, skeleton = _pack(state)
    header = safetensors_header(layout, {"skeleton": json.dumps(skeleton)})
    assert len(header) % 8 == 0
    path = tmp_path / "x.safetensors"
    path.write_bytes(header + raw)
    loaded = safetensors.torch.load_file(str(path))
    assert torch.equal(loaded["model/w"], state["model"]["w"])
    assert torch.equal(loaded["model/i"], state["model"]["i"])
    _, meta, start = parse_safetensors(path.read_bytes())
    assert json.loads(meta["skeleton"]) == skeleton
    assert start == len(header)


def test_parse_rejects_truncated_and_garbage() -> None:
    state = {"w": torch.randn(100)}
    raw, layout, _ = _pack(state)
    blob = safetensors_header(layout, {}) + raw
    with pytest.raises(ValueError, match="truncated"):
        parse_safetensors(blob[:-10])
    with pytest.raises(ValueError):
        parse_safetensors(b"\xff" * 64)


def test_dtype_tables_agree_with_torch() -> None:
    # parse_safetensors sizes entries from its own table (the agent has no torch to ask).
    from flashckpt.format.layout import _ST_ITEMSIZE, _TORCH_NAMES

    assert _ST_ITEMSIZE.keys() == _TORCH_NAMES.keys()
    for code, name in _TORCH_NAMES.items():
        if not hasattr(torch, name):
            continue
        dt = getattr(torch, name)
        assert torch_dtype(code) == dt and dtype_code(dt) == code
        assert torch.empty((), dtype=dt).element_size() == _ST_ITEMSIZE[code], code
