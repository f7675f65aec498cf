"""Storage contract, run against a local directory and fsspec's memory:// file system."""

from __future__ import annotations

import contextlib
import mmap
import os
import uuid
from pathlib import Path
from typing import Any

import pytest
import xxhash
from stephelpers import write_step

from flashckpt.format.storage import CHUNK, CorruptCheckpointError, Storage, rank_file_name


@pytest.fixture(params=["file", "memory"])
def storage(request, tmp_path):
    if request.param == "file":
        yield Storage(f"file://{tmp_path}/root")
    else:
        url = f"memory://fc-{uuid.uuid4().hex}"
        st = Storage(url)
        yield st
        with contextlib.suppress(FileNotFoundError):
            st.fs.rm(st.root, recursive=True)


def _write_step(st: Storage, step: int, payload: bytes = b"x" * 1000) -> dict:
    return write_step(st, step, payload)


def test_step_is_invisible_until_committed(storage: Storage) -> None:
    manifest = _write_step(storage, 10)
    assert storage.committed_steps() == []
    assert storage.all_step_dirs() == [10]
    storage.commit(10, manifest)
    assert storage.committed_steps() == [10]
    assert storage.verify(10) == []
    data = storage.read_file(10, "shard-00000-of-00001.safetensors", storage.manifest(10))
    assert bytes(data).endswith(b"x" * 1000)


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
    good = storage.fs.cat_file(path)
    storage.fs.pipe_file(path, good[:-1] + b"y")
    problems = storage.verify(5)
    assert len(problems) == 1 and "checksum" in problems[0] and "shard-00000" in problems[0]
    storage.fs.pipe_file(path, b"x" * 500)
    with pytest.raises(CorruptCheckpointError, match="wrong size"):
        storage.read_file(5, "shard-00000-of-00001.safetensors", storage.manifest(5))
    storage.fs.rm(path)
    with pytest.raises(CorruptCheckpointError, match="missing"):
        storage.read_file(5, "shard-00000-of-00001.safetensors", storage.manifest(5))


def test_bad_url_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="storage URL"):
        Storage("nosuchscheme-xyz://bucket/x")
    with pytest.raises(ValueError, match="non-empty"):
        Storage("")


def _page_aligned(data: bytes) -> tuple[mmap.mmap, memoryview]:
    """``data`` in anonymous memory at a page boundary, as the agent's slots hold it."""
    m = mmap.mmap(-1, len(data) + 2 * 4096)
    view = memoryview(m)[4096 : 4096 + len(data)]
    view[:] = data
    return m, view


@pytest.mark.parametrize("n", [0, 3 * 4096, 3 * 4096 + 17, CHUNK + 4096 + 5])
def test_write_buffer_round_trips_and_hashes(storage: Storage, n: int) -> None:
    if n > CHUNK and not storage.local:
        pytest.skip("one big buffer is enough on the local path")
    data = os.urandom(min(n, 1 << 16)) * (n // (1 << 16)) + os.urandom(n % (1 << 16))
    for head in (b"H" * 4096, b"short head"):  # page-multiple (O_DIRECT locally) or not
        m, view = _page_aligned(data)
        path = storage.step_path(3, f"f{len(head)}.safetensors")
        rec = storage.write_buffer(path, head, view)
        view.release()
        m.close()
        assert rec.size == len(head) + n
        assert rec.xxh3_64 == xxhash.xxh3_64_hexdigest(head + data)
        assert storage.fs.cat_file(path) == head + data


def test_write_buffer_check_abandons_the_write(storage: Storage) -> None:
    m, view = _page_aligned(b"z" * (CHUNK + 4096))
    calls = []

    def check() -> None:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("slot changed")

    with pytest.raises(RuntimeError, match="slot changed"):
        storage.write_buffer(storage.step_path(1, "x.safetensors"), b"H" * 4096, view, check)
    assert len(calls) == 2  # checked before each chunk; the second chunk was never written
    view.release()
    m.close()


def test_page_aligned_shard_is_valid_safetensors(tmp_path) -> None:
    import safetensors.torch
    import torch

    from flashckpt.format.layout import Layout, parse_safetensors, safetensors_header

    tensors = {"a": torch.randn(5, 7), "b": torch.arange(9, dtype=torch.int64)}
    layout = Layout.build([(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()])
    raw = bytearray(layout.nbytes)
    for e in layout.entries:
        raw[e.offset : e.offset + e.nbytes] = tensors[e.name].numpy().tobytes()
    head = safetensors_header(layout, {"k": "v"}, align=4096)
    assert len(head) % 4096 == 0 and head.endswith(b" ")
    st = Storage(f"file://{tmp_path}")
    m, view = _page_aligned(bytes(raw))
    st.write_buffer(st.path("s.safetensors"), head, view)
    view.release()
    m.close()
    path = tmp_path / "s.safetensors"
    loaded = safetensors.torch.load_file(str(path))  # the reference reader takes the padding
    assert loaded.keys() == tensors.keys()
    for k, t in tensors.items():
        assert torch.equal(loaded[k], t), k
    _, meta, start = parse_safetensors(path.read_bytes())
    assert meta == {"k": "v"} and start % 4096 == 0
    with pytest.raises(ValueError, match="multiple of 8"):
        safetensors_header(layout, {}, align=100)


def _modes(root) -> dict[str, int]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = os.path.join(dirpath, n)
            out[os.path.relpath(p, root)] = os.stat(p).st_mode & 0o777
    out["."] = os.stat(root).st_mode & 0o777
    return out


@pytest.mark.parametrize(("file_mode", "dir_mode"), [(None, 0o700), (0o640, 0o750), (0o644, 0o755)])
def test_storage_files_are_private_unless_shared(tmp_path, file_mode, dir_mode) -> None:
    old = os.umask(0o022)  # the usual umask: it used to leave checkpoints world-readable
    try:
        kw = {} if file_mode is None else {"file_mode": file_mode}
        st = Storage(f"file://{tmp_path}/root", **kw)
        st.commit(7, write_step(st, 7))
        st.write_part(7, "n0", {"node": "n0"})
        m, view = _page_aligned(b"d" * 3 * 4096)  # the O_DIRECT path
        assert st.write_buffer(st.step_path(7, "direct.bin"), b"H" * 4096, view).direct in (
            True,
            False,
        )
        view.release()
        m.close()
        # An existing file rewritten gets the mode too (not the one it had).
        loose = tmp_path / "root" / "step-000000007" / "rank-00000-of-00001.json"
        os.chmod(loose, 0o666)
        st.write_private(7, 0, 1, {"extras": {}})
    finally:
        os.umask(old)
    modes = _modes(tmp_path / "root")
    want_file = 0o600 if file_mode is None else file_mode
    assert {"step-000000007/manifest.json", "latest", "step-000000007/_parts/n0.json"} <= set(modes)
    for rel, mode in modes.items():
        is_dir = os.path.isdir(tmp_path / "root" / rel)
        assert mode == (dir_mode if is_dir else want_file), (rel, oct(mode))


def test_bad_file_mode_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(ValueError, match="permission bits"):
        Storage(f"file://{tmp_path}", file_mode=0o4755)
    with pytest.raises(ValueError, match="owner must read and write"):
        Storage(f"file://{tmp_path}", file_mode=0o444)


def test_partial_steps_older_than_the_newest_commit_are_removed(storage: Storage) -> None:
    storage.commit(1, _write_step(storage, 1))
    _write_step(storage, 2)  # a persist that never committed (torn, failed, disk full)
    storage.write_part(3, "n1", {"node": "n1"})  # only another node's part of a dropped step
    storage.write_private(4, 0, 1, {"extras": {}})  # a write-through of a skipped snapshot
    storage.commit(5, _write_step(storage, 5))
    _write_step(storage, 6)  # newer than the newest commit: may be in flight, kept
    assert storage.retain(3) == [2, 3, 4]
    assert storage.all_step_dirs() == [1, 5, 6] and storage.committed_steps() == [1, 5]
    assert storage.remove_partial_steps() == []


def test_retention_keeps_held_steps_until_released(storage: Storage) -> None:
    for s in (1, 2, 3, 4):
        storage.commit(s, _write_step(storage, s))
    assert storage.retain(2, hold=frozenset({1})) == [2]  # step 1 held (the mirror copies it)
    assert storage.committed_steps() == [1, 3, 4]
    assert storage.retain(2) == [1]  # released: the next retention takes it
    assert storage.committed_steps() == [3, 4]


def test_retention_goes_on_past_a_step_it_cannot_remove(
    storage: Storage, monkeypatch: pytest.MonkeyPatch
) -> None:
    for s in (1, 2, 3, 4):
        storage.commit(s, _write_step(storage, s))
    _write_step(storage, 3_5)
    real = storage.fs.rm

    def rm(path, recursive=False, **kw):
        if path.endswith("step-000000002") and recursive:
            raise OSError(39, "Directory not empty")  # a writer adding a file meanwhile
        return real(path, recursive=recursive, **kw)

    monkeypatch.setattr(storage.fs, "rm", rm)
    _write_step(storage, 0)  # a partial step below everything
    assert storage.retain(1) == [0, 1, 3]
    assert storage.committed_steps() == [4]  # step 2 lost its manifest first: not visible
    monkeypatch.undo()
    assert storage.retain(1) == [2]  # now a partial step: the next retention takes it
    assert storage.all_step_dirs() == [4, 35]


def test_a_link_planted_where_a_file_goes_is_not_written_through(tmp_path) -> None:
    st = Storage(f"file://{tmp_path}/root")
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    step_dir = tmp_path / "root" / "step-000000001"
    step_dir.mkdir(parents=True)
    (step_dir / "rank-00000-of-00001.json").symlink_to(victim)
    with pytest.raises(OSError):
        st.write_private(1, 0, 1, {"extras": {}})
    m, view = _page_aligned(b"d" * 4096)
    (step_dir / "shard-00000-of-00001.safetensors").symlink_to(victim)
    with pytest.raises(OSError):
        st.write_buffer(st.step_path(1, "shard-00000-of-00001.safetensors"), b"H" * 4096, view)
    view.release()
    m.close()
    assert victim.read_bytes() == b"precious"


def test_a_rewritten_rank_file_is_never_seen_truncated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The node agent's write-through rewrites a step's rank file while the mirror may copy
    that step (seen: the mirror read 0 bytes of a committed step's rank file and failed the
    copy). While the new file is being written, the file at the step's path stays whole."""
    st = Storage(f"file://{tmp_path}")
    st.write_private(1, 0, 1, {"rng": [1, 2, 3]})
    final = Path(st.step_path(1, rank_file_name(0, 1)))
    whole = final.read_bytes()
    seen: list[bytes] = []
    real = Storage._write_chunks

    def spy(self: Storage, path: str, head: bytes, chunks: Any, fh: Any) -> Any:
        def reading_midway() -> Any:
            seen.append(final.read_bytes())  # what a reader (the mirror's copy) gets meanwhile
            yield from chunks

        return real(self, path, head, reading_midway(), fh)

    monkeypatch.setattr(Storage, "_write_chunks", spy)
    st.write_private(1, 0, 1, {"rng": [1, 2, 3]})
    assert seen == [whole]
    assert final.read_bytes() == whole
    assert sorted(p.name for p in final.parent.iterdir()) == [final.name]  # no temp file left
