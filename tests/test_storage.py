"""Storage contract, run against a local directory and fsspec's memory:// file system."""

from __future__ import annotations

import uuid

import pytest

from flashckpt.storage import CorruptCheckpointError, Storage


@pytest.fixture(params=["file", "memory"])
def storage(request, tmp_path):
    if request.param == "file":
        yield Storage(f"file://{tmp_path}/root")
    else:
        url = f"memory://fc-{uuid.uuid4().hex}"
        st = Storage(url)
        yield st
        st.fs.rm(st.root, recursive=True)


def _write_step(st: Storage, step: int, payload: bytes = b"x" * 1000) -> dict:
    rec = st.write_stream(
        st.step_path(step, "shard-00000-of-00001.safetensors"), [payload[:10], payload[10:]]
    )
    files = {"shard-00000-of-00001.safetensors": rec.to_json()}
    manifest = {
        "format": "flashckpt/1",
        "step": step,
        "world_size": 1,
        "num_shards": 1,
        "created": 0.0,
        "files": files,
        "ranks": {},
        "shards": {"0": {"file": "shard-00000-of-00001.safetensors"}},
    }
    return manifest


def test_step_is_invisible_until_committed(storage: Storage) -> None:
    manifest = _write_step(storage, 10)
    assert storage.committed_steps() == []
    assert storage.all_step_dirs() == [10]
    storage.commit(10, manifest)
    assert storage.committed_steps() == [10]
    assert storage.verify(10) == []
    data = storage.read_file(10, "shard-00000-of-00001.safetensors", storage.read_manifest(10))
    assert bytes(data) == b"x" * 1000


def test_latest_moves_forward_and_retention_keeps_k(storage: Storage) -> None:
    for s in (1, 2, 3, 4):
        storage.commit(s, _write_step(storage, s))
    _write_step(storage, 2_5)  # an abandoned partial step, older than the newest
    storage.retain(2)
    assert storage.committed_steps() == [3, 4]
    assert 25 in storage.all_step_dirs()  # newer than 4: could still be in flight, so kept
    import json

    assert json.loads(storage.fs.cat_file(storage.path("latest")))["step"] == 4


def test_corruption_and_truncation_are_detected(storage: Storage) -> None:
    storage.commit(5, _write_step(storage, 5))
    path = storage.step_path(5, "shard-00000-of-00001.safetensors")
    storage.fs.pipe_file(path, b"x" * 999 + b"y")
    problems = storage.verify(5)
    assert len(problems) == 1 and "checksum" in problems[0] and "shard-00000" in problems[0]
    storage.fs.pipe_file(path, b"x" * 500)
    with pytest.raises(CorruptCheckpointError, match="wrong size"):
        storage.read_file(5, "shard-00000-of-00001.safetensors", storage.read_manifest(5))
    storage.fs.rm(path)
    with pytest.raises(CorruptCheckpointError, match="missing"):
        storage.read_file(5, "shard-00000-of-00001.safetensors", storage.read_manifest(5))


def test_bad_url_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="storage URL"):
        Storage("nosuchscheme-xyz://bucket/x")
    with pytest.raises(ValueError, match="non-empty"):
        Storage("")
