"""A slow network file system for tests: the local file system under the ``slowfile://`` scheme,
every mutating call (write, create, link, rename, delete, mkdir) delayed by
``$FLASHCKPT_TEST_SLOWFS_DELAY`` seconds (0.1 by default), as on a loaded NFS or a FUSE mount
of remote storage. Reads are not delayed.

Every Python process of a test sees the scheme through :func:`site_dir`: a directory holding a
``sitecustomize.py`` that registers it, put on ``PYTHONPATH`` (trainers, the node agents they
start, launchers).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, ClassVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

SCHEME = "slowfile"
DELAY_ENV = "FLASHCKPT_TEST_SLOWFS_DELAY"


def _delay() -> None:
    time.sleep(float(os.environ.get(DELAY_ENV, "0.1")))


class SlowFileSystem(LocalFileSystem):
    """The local file system, each mutating call slowed (see the module)."""

    protocol: ClassVar[Any] = (SCHEME, "file")  # "file": a local root to flashckpt's Storage

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        if isinstance(path, str) and path.startswith(f"{SCHEME}://"):
            path = path[len(SCHEME) + 3 :]
        return super()._strip_protocol(path)

    def pipe_file(self, *a: Any, **kw: Any) -> Any:
        _delay()
        return super().pipe_file(*a, **kw)

    def _open(self, path: Any, mode: str = "rb", *a: Any, **kw: Any) -> Any:
        if "r" not in mode or "+" in mode:
            _delay()
        return super()._open(path, mode, *a, **kw)

    def link(self, *a: Any, **kw: Any) -> Any:
        _delay()
        return super().link(*a, **kw)

    def mv(self, *a: Any, **kw: Any) -> Any:
        _delay()
        return super().mv(*a, **kw)

    def rm(self, *a: Any, **kw: Any) -> Any:
        _delay()
        return super().rm(*a, **kw)

    def rm_file(self, *a: Any, **kw: Any) -> Any:
        _delay()
        return super().rm_file(*a, **kw)

    def makedirs(self, *a: Any, **kw: Any) -> Any:
        _delay()
        return super().makedirs(*a, **kw)

    def mkdir(self, *a: Any, **kw: Any) -> Any:
        _delay()
        return super().mkdir(*a, **kw)

    def touch(self, *a: Any, **kw: Any) -> Any:
        _delay()
        return super().touch(*a, **kw)


def register() -> None:
    """Makes ``slowfile://`` URLs open :class:`SlowFileSystem` in this process."""
    fsspec.register_implementation(SCHEME, SlowFileSystem, clobber=True)


def site_dir(tmp: Path) -> Path:
    """A directory for ``PYTHONPATH`` whose ``sitecustomize.py`` registers the scheme in every
    Python process started with it (this file is copied next to it)."""
    d = tmp / "slowfs-site"
    d.mkdir(exist_ok=True)
    (d / "slowfs.py").write_text(Path(__file__).read_text())
    (d / "sitecustomize.py").write_text("import slowfs\n\nslowfs.register()\n")
    return d


def slow_storage_writes(monkeypatch: Any, seconds_per_chunk: float) -> None:
    """In this process (an agent served from a thread of the test): the agent writes a shard in
    1 MiB chunks and each chunk's write waits ``seconds_per_chunk`` first (a slow disk), the
    write's own check still run after it."""
    import flashckpt.agent.persist as agent_persist
    from flashckpt.format.storage import Storage

    monkeypatch.setattr(agent_persist, "WRITE_CHUNK", 1 << 20)
    real = Storage.write_buffer

    def write_buffer(
        self: Storage, path: str, head: bytes, data: Any, check: Any = None, **kw: Any
    ) -> Any:
        def slow() -> None:
            time.sleep(seconds_per_chunk)
            if check is not None:
                check()

        return real(self, path, head, data, slow, **kw)

    monkeypatch.setattr(Storage, "write_buffer", write_buffer)
