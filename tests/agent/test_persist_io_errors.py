"""An I/O error of storage mid-shard stays the I/O error it is, on every write path, and the
buffers the write used are free at once (issue 41, row 6: storage answering EIO during a staged
shard write reported ``BufferError: cannot close exported pointers exist``, and a state-sized
copy was left to the garbage collector).

Storage fails the way a failing disk or network file system does: ``OSError(EIO)`` from a write
call once part of the shard is written. Local files fail at the system call (the O_DIRECT path
writes with ``os.write``, the buffered one through a file object), other storage through an
fsspec file system (``fceio://``, an in-memory one whose shard writes fail while told to)."""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import threading
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from fchelpers import FcEnv, RunningAgent
from fsspec import register_implementation
from fsspec.implementations.memory import MemoryFileSystem
from tinytrain import make, train_step
from waiting import wait_until

import flashckpt
import flashckpt.format.storage as storage_mod
from flashckpt.agent.persist import Persister
from flashckpt.format.manifest import FileEntry
from flashckpt.format.storage import Storage

EIO_TEXT = "[Errno 5] Input/output error"


class _FailingFile:
    """An fsspec file whose data writes fail with EIO after the first ``ok_writes`` calls."""

    def __init__(self, f: Any, path: str, ok_writes: int) -> None:
        self._f, self._path, self._left = f, path, ok_writes

    def write(self, data: Any) -> int:
        if self._left <= 0:
            raise OSError(errno.EIO, os.strerror(errno.EIO), self._path)
        self._left -= 1
        return int(self._f.write(data))

    def __enter__(self) -> _FailingFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._f.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


class EioFileSystem(MemoryFileSystem):
    """In-memory storage whose shard writes fail with EIO after the head while ``failing`` > 0
    (each failed file counts one down: storage that comes back after a while)."""

    protocol = "fceio"
    store: ClassVar[dict[str, Any]] = {}
    pseudo_dirs: ClassVar[list[str]] = [""]
    failing = 0
    failed = 0
    lock = threading.Lock()

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        if isinstance(path, str):
            path = path.removeprefix("fceio://")
        return super()._strip_protocol(path)

    def _open(self, path: str, mode: str = "rb", *args: Any, **kw: Any) -> Any:
        f = super()._open(path, mode, *args, **kw)
        if "w" in mode and "/shard-" in path:
            with EioFileSystem.lock:
                if EioFileSystem.failing > 0:
                    EioFileSystem.failing -= 1
                    EioFileSystem.failed += 1
                    return _FailingFile(f, path, ok_writes=1)  # the head goes, the data fails
        return f


register_implementation("fceio", EioFileSystem, clobber=True)


@pytest.fixture
def eio_root(fc_env: FcEnv) -> Any:
    url = f"fceio://fct-{fc_env.job}"
    EioFileSystem.failing = EioFileSystem.failed = 0
    yield url
    EioFileSystem.failing = 0
    for k in [k for k in EioFileSystem.store if k.startswith(f"/fct-{fc_env.job}")]:
        EioFileSystem.store.pop(k, None)


def _buffer(n: int) -> tuple[mmap.mmap, memoryview]:
    """A page-aligned buffer like a slot's data or a staged copy (an anonymous mapping)."""
    m = mmap.mmap(-1, n)
    m[:n] = os.urandom(n)
    return m, memoryview(m)


def _fail_os_writes_into(monkeypatch: pytest.MonkeyPatch, where: Path, after: int) -> None:
    """``os.write`` (the O_DIRECT path's call) fails with EIO for files under ``where`` after
    ``after`` calls; every other write goes through."""
    real = os.write
    calls = {"n": 0}

    def write(fd: int, data: Any) -> int:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = ""
        if target.startswith(str(where)):
            calls["n"] += 1
            if calls["n"] > after:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, data)

    monkeypatch.setattr(os, "write", write)


class _FailingLocalFile:
    """A local file object whose data writes fail with EIO after the first ``ok`` calls."""

    def __init__(self, f: Any, ok: int) -> None:
        self._f, self._left = f, ok

    def write(self, data: Any) -> int:
        if self._left <= 0:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        self._left -= 1
        return int(self._f.write(data))

    def __enter__(self) -> _FailingLocalFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._f.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


@pytest.mark.parametrize("path", ["local-direct", "local-buffered", "fsspec"])
def test_an_eio_mid_shard_is_raised_as_the_oserror_and_the_buffer_is_free_at_once(
    path: str, tmp_path: Path, eio_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    n = 16 * 4096
    head = b"H" * 4096  # whole pages: the local path writes with O_DIRECT where it can
    if path == "fsspec":
        st = Storage(eio_root)
        EioFileSystem.failing = 1
    else:
        st = Storage(f"file://{tmp_path / 'ckpt'}")
        if path == "local-direct":
            _fail_os_writes_into(monkeypatch, tmp_path, after=3)  # the head, 2 chunks, then EIO
        else:
            head = b"short"  # not whole pages: the buffered path
            real_open = open

            def failing_open(file: Any, mode: str = "r", **kw: Any) -> Any:
                return _FailingLocalFile(real_open(file, mode, **kw), ok=3)

            monkeypatch.setattr(storage_mod, "open", failing_open, raising=False)
    m, view = _buffer(n)
    try:
        with pytest.raises(OSError) as got:
            st.write_buffer(
                st.path("step-000000001", "shard-00000-of-00001.safetensors"),
                head,
                view,
                chunk=4096,
            )
        # The storage's own error, not a BufferError nor a second error from closing the file.
        assert type(got.value) is OSError and got.value.errno == errno.EIO, repr(got.value)
        assert EIO_TEXT in str(got.value)
        if path == "local-direct" and not _took_o_direct(st, tmp_path):
            pytest.skip(f"the file system of {tmp_path} refuses O_DIRECT")
        # While the error (and its traceback, with every frame of the write) is still alive,
        # the caller's buffer has no view left: it is unmapped at once, not by the collector.
        view.release()
        m.close()
        assert m.closed
    finally:
        with contextlib.suppress(BufferError):
            view.release()
            m.close()


def _took_o_direct(st: Storage, tmp_path: Path) -> bool:
    """Whether the file system of ``tmp_path`` takes O_DIRECT (the write then used it)."""
    probe = tmp_path / "probe"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    os.close(fd)
    probe.unlink()
    return st.local


def test_an_eio_in_a_mirror_copy_is_raised_as_the_oserror_and_nothing_is_left(
    tmp_path: Path, eio_root: str
) -> None:
    src = Storage(f"file://{tmp_path / 'ckpt'}")
    name = "shard-00000-of-00001.safetensors"
    m, view = _buffer(8 * 4096)
    try:
        rec = src.write_buffer(src.step_path(1, name), b"H" * 4096, view)
    finally:
        view.release()
        m.close()
    dest = Storage(eio_root)
    EioFileSystem.failing = 1
    with pytest.raises(OSError) as got:
        src.copy_step_file(1, name, FileEntry(rec.size, rec.xxh3_64), dest, chunk=4096)
    assert type(got.value) is OSError and EIO_TEXT in str(got.value), repr(got.value)
    assert not dest.fs.exists(dest.step_path(1, name))  # the half copy is gone


def test_the_agent_reports_eio_as_the_io_error_on_staged_and_direct_writes_then_commits(
    fc_env: FcEnv, eio_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real persister, staged (storage slower than the trainer: the snapshot is copied out
    first) and straight from the slot: each EIO is reported as the OSError in the agent's status
    and to the trainer, never a BufferError; each staged copy is unmapped when its write fails;
    once storage answers again the step commits and restores bitwise."""
    stage = {"on": True}
    monkeypatch.setattr(Persister, "_outpaced", lambda self, *a: stage["on"])
    staged: list[mmap.mmap] = []
    real_stage = Persister._stage

    def spy_stage(self: Persister, *a: Any) -> mmap.mmap:
        buf = real_stage(self, *a)
        staged.append(buf)
        return buf

    monkeypatch.setattr(Persister, "_stage", spy_stage)
    fc_env.storage = eio_root
    root = Storage(eio_root)
    agent = RunningAgent(fc_env.agent_config(storage=eio_root))
    try:
        model, opt, sched = make(0, 2048)
        kw = fc_env.ckpt_kwargs(agent="connect", every=0, persist_every=1)
        with flashckpt.checkpointing(model, opt, scheduler=sched, **kw) as ck:
            for step, (mode, fails) in enumerate([("staged", 2), ("slot", 1)]):
                stage["on"] = mode == "staged"
                EioFileSystem.failing = fails
                before = len(staged)
                train_step(model, opt, sched, step)
                ck.step()
                ck.save(mode="sync")
                # The flush during the outage says the step is not persisted (the error is
                # reported); the agent tries again, and storage answers once the EIO is over.
                wait_until(
                    lambda: step + 1 in root.committed_steps(),  # noqa: B023 (waited here)
                    f"step {step + 1} committed after the outage ({mode})",
                    state=lambda: agent.agent.status()["errors"],
                )
                assert ck.flush() == step + 1
                if mode == "staged":
                    assert len(staged) - before == fails + 1, len(staged)
                    assert all(b.closed for b in staged), "a staged copy is still mapped"
            want = {k: v.clone() for k, v in model.state_dict().items()}
            trainer_errors = [e["error"] for e in ck.stats.persist_errors]
        errors = [e["error"] for e in agent.agent.status()["errors"]]
    finally:
        agent.stop()
    assert EioFileSystem.failed == 3 and len(errors) == 3, errors
    for e in errors:
        # "OSError persisting to <url>: [Errno 5] ...": the error's type, where, the errno
        assert e.startswith(f"OSError persisting to {eio_root}: "), e
        assert EIO_TEXT in e and "shard-" in e, e
        assert "BufferError" not in e, e
    assert trainer_errors and all(EIO_TEXT in e for e in trainer_errors), trainer_errors
    # A new agent (the old one's memory went with it): the committed steps restore bitwise.
    agent = RunningAgent(fc_env.agent_config(storage=eio_root))
    try:
        model2, opt2, sched2 = make(1, 2048)
        with flashckpt.checkpointing(model2, opt2, scheduler=sched2, **kw) as ck2:
            assert (ck2.start_step, ck2.restored_from) == (2, "storage")
            for k, v in model2.state_dict().items():
                assert torch.equal(v, want[k]), k
    finally:
        agent.stop()
