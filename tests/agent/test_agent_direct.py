"""The node agent writes shard files with O_DIRECT where the file system takes it (straight from
the slot, no page-cache copy), and falls back to buffered writes where it does not (a file
system that refuses it, remote storage). Which way each shard went is in the agent's status."""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import shutil
import uuid
from pathlib import Path

import pytest
from fchelpers import FcEnv, RunningAgent
from tinytrain import make

import flashckpt
from flashckpt.format.storage import Storage


def takes_o_direct(directory: Path) -> bool:
    """Whether the file system of ``directory`` accepts an aligned O_DIRECT write (probed with
    plain system calls, independently of flashckpt)."""
    path = directory / f"probe-{uuid.uuid4().hex}"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False
        raise
    try:
        with mmap.mmap(-1, 4096) as page:  # page-aligned
            return os.write(fd, page) == 4096
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False
        raise
    finally:
        os.close(fd)
        path.unlink()


def _page_aligned(data: bytes) -> tuple[mmap.mmap, memoryview]:
    m = mmap.mmap(-1, max(len(data), 1))
    m[: len(data)] = data
    return m, memoryview(m)[: len(data)]


def test_write_buffer_takes_o_direct_where_the_file_system_does(tmp_path: Path) -> None:
    if not takes_o_direct(tmp_path):
        pytest.skip(f"the file system of {tmp_path} refuses O_DIRECT")
    st = Storage(f"file://{tmp_path}")
    data = os.urandom(3 * 4096 + 100)  # a tail that is not a whole block goes buffered
    m, view = _page_aligned(data)
    try:
        rec = st.write_buffer(st.path("a.safetensors"), b"H" * 4096, view)
        assert rec.direct
        # A header that is not whole blocks puts the data at unaligned offsets: buffered.
        rec2 = st.write_buffer(st.path("b.safetensors"), b"short", view)
        assert not rec2.direct
    finally:
        view.release()
        m.close()
    assert (tmp_path / "a.safetensors").read_bytes() == b"H" * 4096 + data
    assert (tmp_path / "b.safetensors").read_bytes() == b"short" + data
    assert rec.to_json() == {"size": 4096 + len(data), "xxh3_64": rec.xxh3_64}  # format as is


def test_write_buffer_falls_back_where_o_direct_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No writable file system here refuses O_DIRECT (tmpfs takes it since Linux 6.6), so the
    # refusal is simulated at the system call, as a FUSE file system would answer.
    real_open = os.open

    def refusing_open(path: str, flags: int, *args: int) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refusing_open)
    st = Storage(f"file://{tmp_path}")
    data = os.urandom(2 * 4096)
    m, view = _page_aligned(data)
    try:
        rec = st.write_buffer(st.path("c.safetensors"), b"H" * 4096, view)
    finally:
        view.release()
        m.close()
    assert not rec.direct
    assert (tmp_path / "c.safetensors").read_bytes() == b"H" * 4096 + data


def _persist_one(env: FcEnv, storage: str) -> dict[str, int]:
    agent = RunningAgent(env.agent_config(storage=storage))
    try:
        model, opt, sched = make(0)
        with flashckpt.checkpointing(
            model, opt, scheduler=sched, **env.ckpt_kwargs(agent="connect")
        ) as ck:
            ck.step()
            ck.save(mode="sync")
            assert ck.flush() == 1
        assert flashckpt.load(storage).step == 1  # sound, whichever way it was written
        return dict(agent.agent.status()["shard_writes"])
    finally:
        agent.stop()


@pytest.mark.parametrize("where", ["tmp_path", "dev_shm"])
def test_agent_writes_shards_with_o_direct_where_it_can(
    fc_env: FcEnv, tmp_path: Path, where: str
) -> None:
    root = tmp_path if where == "tmp_path" else Path("/dev/shm") / f"fct-{fc_env.job}-ckpt"
    root.mkdir(exist_ok=True)
    try:
        fc_env.storage = f"file://{root}/ckpt"
        direct = takes_o_direct(root)
        writes = _persist_one(fc_env, fc_env.storage)
        assert writes == {"direct": int(direct), "buffered": int(not direct)}, (root, direct)
    finally:
        if where == "dev_shm":
            shutil.rmtree(root, ignore_errors=True)


def test_agent_writes_remote_shards_buffered(fc_env: FcEnv) -> None:
    fc_env.storage = f"memory://fct-{fc_env.job}"
    try:
        assert _persist_one(fc_env, fc_env.storage) == {"direct": 0, "buffered": 1}
    finally:
        st = Storage(fc_env.storage)
        with contextlib.suppress(FileNotFoundError):
            st.fs.rm(st.root, recursive=True)
