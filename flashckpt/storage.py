"""Committed checkpoints in storage, through fsspec (``file://``, ``memory://``, ``s3://``, ...).

Format (the storage URL is the job's checkpoint root)::

    <url>/step-000001200/
        shard-00000-of-00001.safetensors   tensors of one shard (one replica writes it)
        rank-00000-of-00002.json           per-rank private state (RNG, extras)
        _parts/<node>.json                 what each node agent wrote (before the commit)
        manifest.json                      written last: the commit marker
    <url>/latest                           atomically replaced pointer to the newest step

A step without ``manifest.json`` does not exist. The manifest lists every file with its size and
xxh3-64 hash; a file that does not match is never loaded.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import mmap
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import fsspec
import xxhash

from flashckpt.errors import CorruptCheckpointError
from flashckpt.shm import buffer_address

__all__ = [
    "CorruptCheckpointError",
    "FileRecord",
    "Storage",
    "rank_file_name",
    "shard_file_name",
]

FORMAT = "flashckpt/1"
MANIFEST = "manifest.json"
PARTS = "_parts"
CHUNK = 64 << 20
# O_DIRECT needs buffer address, file offset and length aligned to the logical block size
# (512 B or 4 KiB); a page satisfies every local disk.
DIRECT_ALIGN = 4096
_STEP_RE = re.compile(r"^step-(\d{9,})$")


@dataclass(frozen=True, slots=True)
class FileRecord:
    """Size and hash of a written file."""

    size: int
    xxh3_64: str
    direct: bool = False
    """Whether the bytes went to the file with ``O_DIRECT`` (the page cache bypassed); not part
    of the manifest, it says how the file was written."""

    def to_json(self) -> dict[str, Any]:
        return {"size": self.size, "xxh3_64": self.xxh3_64}


def shard_file_name(shard: int, num_shards: int) -> str:
    return f"shard-{shard:05d}-of-{num_shards:05d}.safetensors"


def rank_file_name(rank: int, world_size: int) -> str:
    return f"rank-{rank:05d}-of-{world_size:05d}.json"


def step_dir_name(step: int) -> str:
    return f"step-{step:09d}"


class Storage:
    """A checkpoint root reached through fsspec.

    Args:
        url: any fsspec URL (``file:///ckpt/run1``, ``memory://run1``, ``s3://bucket/run1``) or a
            local path.
    """

    def __init__(self, url: str) -> None:
        if not isinstance(url, str) or not url:
            raise ValueError(f"storage must be a non-empty URL string, got {url!r}")
        self.url = url
        try:
            self.fs, self.root = fsspec.core.url_to_fs(url)
        except (ImportError, ValueError) as e:
            raise ValueError(
                f"storage URL {url!r} cannot be opened: {e} (install the fsspec backend for its "
                "scheme, e.g. s3fs for s3://)"
            ) from e
        self.root = self.root.rstrip("/") or "/"
        self.local = "file" in _protocols(self.fs)

    # -- paths -------------------------------------------------------------------------------
    def path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def step_path(self, step: int, *parts: str) -> str:
        return self.path(step_dir_name(step), *parts)

    # -- writing -----------------------------------------------------------------------------
    def write_stream(self, path: str, chunks: Iterable[bytes | memoryview]) -> FileRecord:
        """Writes chunks to ``path`` (durably for local files); returns size and hash."""
        h = xxhash.xxh3_64()
        size = 0
        self.fs.makedirs(self.fs._parent(path), exist_ok=True)
        if self.local:
            with open(path, "wb", buffering=0) as f:
                for c in chunks:
                    h.update(c)
                    size += f.write(c) or 0
                os.fsync(f.fileno())
        else:
            with self.fs.open(path, "wb") as f:
                for c in chunks:
                    h.update(c)
                    f.write(c)
                    size += len(c)
        return FileRecord(size, h.hexdigest())

    def write_buffer(
        self,
        path: str,
        head: bytes,
        data: memoryview,
        check: Callable[[], None] | None = None,
    ) -> FileRecord:
        """Writes ``head`` then ``data`` to ``path`` (durably for local files); returns size and
        hash, as :meth:`write_stream` does.

        A local file whose ``head`` is a multiple of 4 KiB and whose ``data`` starts on a page
        boundary is written with ``O_DIRECT`` straight from ``data``: no copy into the page
        cache (an order of magnitude less CPU, and a disk-speed write), while this thread hashes
        each chunk as another writes it. Other file systems get the plain streamed write; the
        returned record's ``direct`` says which path the bytes took.

        Args:
            check: called before each chunk of ``data``; may raise to abandon the write.
        """
        direct = getattr(os, "O_DIRECT", 0)  # Linux
        addr = buffer_address(data) if self.local and direct else None
        if addr is None or addr % DIRECT_ALIGN or len(head) % DIRECT_ALIGN:
            return self.write_stream(path, _chunks(head, data, check))
        self.fs.makedirs(self.fs._parent(path), exist_ok=True)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | direct
        try:
            fd = os.open(path, flags, 0o666)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            # tmpfs before Linux 6.6 and some FUSE file systems refuse O_DIRECT.
            return self.write_stream(path, _chunks(head, data, check))
        try:
            return _write_direct(fd, head, data, check)
        finally:
            os.close(fd)

    def write_json(self, path: str, obj: Any) -> FileRecord:
        return self.write_stream(path, [json.dumps(obj, indent=1).encode()])

    def replace_json(self, path: str, obj: Any) -> None:
        """Writes ``path`` atomically (temp file, then rename) so readers never see half of it."""
        tmp = f"{path}.tmp-{os.getpid()}-{time.monotonic_ns()}"
        self.write_json(tmp, obj)
        self.fs.mv(tmp, path)
        if self.local:
            _fsync_dir(os.path.dirname(path))

    # -- commit protocol ---------------------------------------------------------------------
    def write_part(self, step: int, node: str, part: dict[str, Any]) -> None:
        self.replace_json(self.step_path(step, PARTS, f"{node}.json"), part)

    def read_parts(self, step: int) -> list[dict[str, Any]]:
        d = self.step_path(step, PARTS)
        try:
            names = self.fs.ls(d, detail=False)
        except FileNotFoundError:
            return []
        out = []
        for n in names:
            if str(n).endswith(".json"):
                with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
                    out.append(json.loads(self.fs.cat_file(n)))
        return out

    def commit(self, step: int, manifest: dict[str, Any]) -> None:
        """Writes the manifest (the commit marker), then moves ``latest`` forward."""
        self.replace_json(self.step_path(step, MANIFEST), manifest)
        newest = max(self.committed_steps(), default=step)
        self.replace_json(self.path("latest"), {"step": newest, "dir": step_dir_name(newest)})

    def uncommit(self, step: int) -> None:
        """Removes a step's commit marker (before its files are rewritten)."""
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.step_path(step, MANIFEST))

    def retain(self, keep: int) -> list[int]:
        """Deletes all but the newest ``keep`` committed steps, and abandoned partial steps older
        than the newest committed one. Returns the deleted steps."""
        committed = self.committed_steps()
        if not committed:
            return []
        newest = committed[-1]
        doomed = set(committed[:-keep] if keep > 0 else [])
        doomed |= {s for s in self.all_step_dirs() if s < newest and s not in committed}
        for s in sorted(doomed):
            # The manifest goes first so a half-deleted step is never visible as committed.
            self.uncommit(s)
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(self.step_path(s), recursive=True)
        return sorted(doomed)

    # -- reading -----------------------------------------------------------------------------
    def all_step_dirs(self) -> list[int]:
        try:
            names = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        steps = []
        for n in names:
            m = _STEP_RE.match(str(n).rstrip("/").rsplit("/", 1)[-1])
            if m:
                steps.append(int(m.group(1)))
        return sorted(steps)

    def committed_steps(self) -> list[int]:
        """Steps whose manifest exists, oldest first."""
        return [s for s in self.all_step_dirs() if self.fs.exists(self.step_path(s, MANIFEST))]

    def read_manifest(self, step: int) -> dict[str, Any]:
        path = self.step_path(step, MANIFEST)
        try:
            manifest = json.loads(self.fs.cat_file(path))
        except FileNotFoundError:
            raise FileNotFoundError(f"step {step} is not committed in {self.url}") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CorruptCheckpointError(path, f"is not valid JSON ({e})") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise CorruptCheckpointError(path, f"is not a {FORMAT} manifest")
        return manifest

    def read_file(self, step: int, name: str, manifest: dict[str, Any]) -> bytearray:
        """Reads a committed file whole and checks it against the manifest."""
        path = self.step_path(step, name)
        rec = manifest["files"].get(name)
        if rec is None:
            raise CorruptCheckpointError(path, "is not listed in the manifest")
        size = int(rec["size"])
        buf = bytearray(size)
        h = xxhash.xxh3_64()
        try:
            with self.fs.open(path, "rb") as f:
                view = memoryview(buf)
                got = 0
                while got < size:
                    n = f.readinto(view[got : got + CHUNK])
                    if not n:
                        break
                    h.update(view[got : got + n])
                    got += n
                extra = f.read(1)
        except FileNotFoundError:
            raise CorruptCheckpointError(path, "is missing") from None
        if got != size or extra:
            raise CorruptCheckpointError(
                path, f"has the wrong size (expected {size} bytes; truncated or overwritten)"
            )
        if h.hexdigest() != rec["xxh3_64"]:
            raise CorruptCheckpointError(path, "fails its checksum (corrupted)")
        return buf

    def write_private(self, step: int, rank: int, world_size: int, private: Any) -> FileRecord:
        """Writes a rank's private state (RNG, extras) of a step, self-checking (embedded hash)."""
        body = json.dumps(private, sort_keys=True, separators=(",", ":"))
        doc = {
            "format": FORMAT,
            "rank": rank,
            "step": step,
            "world_size": world_size,
            "private": private,
            "xxh3_64": xxhash.xxh3_64_hexdigest(body.encode()),
        }
        return self.write_json(self.step_path(step, rank_file_name(rank, world_size)), doc)

    def read_private(self, step: int, rank: int, world_size: int) -> dict[str, Any] | None:
        """A rank's private state of a step, committed or not, if present and intact."""
        path = self.step_path(step, rank_file_name(rank, world_size))
        try:
            doc = json.loads(self.fs.cat_file(path))
            body = json.dumps(doc["private"], sort_keys=True, separators=(",", ":"))
            ok = (
                doc["rank"] == rank
                and doc["step"] == step
                and doc["world_size"] == world_size
                and doc["xxh3_64"] == xxhash.xxh3_64_hexdigest(body.encode())
            )
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return doc["private"] if ok and isinstance(doc["private"], dict) else None

    def verify(self, step: int) -> list[str]:
        """Checks every file of a committed step; returns the problems found (empty if sound)."""
        problems = []
        try:
            manifest = self.read_manifest(step)
        except (FileNotFoundError, CorruptCheckpointError) as e:
            return [str(e)]
        for name in manifest["files"]:
            try:
                self.read_file(step, name, manifest)
            except CorruptCheckpointError as e:
                problems.append(str(e))
        return problems

    def iter_files(self, step: int) -> Iterator[tuple[str, int]]:
        manifest = self.read_manifest(step)
        for name, rec in sorted(manifest["files"].items()):
            yield name, int(rec["size"])


def _chunks(
    head: bytes, data: memoryview, check: Callable[[], None] | None
) -> Iterator[bytes | memoryview]:
    yield head
    for off in range(0, len(data), CHUNK):
        if check is not None:
            check()
        yield data[off : off + CHUNK]


def _write_direct(
    fd: int, head: bytes, data: memoryview, check: Callable[[], None] | None
) -> FileRecord:
    """Writes ``head + data`` to ``fd`` (opened with ``O_DIRECT``) and fsyncs it.

    ``head`` goes through a page-aligned copy; ``data`` is written in place up to its last whole
    4 KiB block, and the tail (not a whole block, which ``O_DIRECT`` cannot write) after
    clearing ``O_DIRECT``. The hash of each chunk is computed while a worker thread writes it
    (both release the GIL), so hashing costs CPU but no wall time.
    """
    h = xxhash.xxh3_64(head)
    n = len(data)
    body = n - n % DIRECT_ALIGN
    with mmap.mmap(-1, max(len(head), 1)) as hbuf:
        hbuf[: len(head)] = head
        hv = memoryview(hbuf)
        try:
            _write_all(fd, hv[: len(head)])
        finally:
            hv.release()
    with ThreadPoolExecutor(1, thread_name_prefix="fc-direct-write") as pool:
        for off in range(0, body, CHUNK):
            if check is not None:
                check()
            chunk = data[off : min(off + CHUNK, body)]
            done = pool.submit(_write_all, fd, chunk)
            h.update(chunk)
            done.result()
    # _write_all clears O_DIRECT where the file system refused it for a buffer: then (part of)
    # the file went through the page cache after all.
    direct = bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)
    if body < n:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
        _write_all(fd, data[body:])
        h.update(data[body:])
    os.fsync(fd)
    return FileRecord(len(head) + n, h.hexdigest(), direct=direct)


def _write_all(fd: int, buf: memoryview) -> None:
    done = 0
    while done < len(buf):
        try:
            done += os.write(fd, buf[done:])
        except OSError as e:
            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
            if e.errno != errno.EINVAL or not flags & os.O_DIRECT:
                raise
            # The file system takes O_DIRECT at open but not this buffer or size: go buffered.
            fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)


def _protocols(fs: Any) -> tuple[str, ...]:
    p = fs.protocol
    return (p,) if isinstance(p, str) else tuple(p)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
