"""Committed checkpoints in storage, through fsspec (``file://``, ``memory://``, ``s3://``, ...).

Format (the storage URL is the job's checkpoint root)::

    <url>/step-000001200/
        shard-00000-of-00001.safetensors   tensors of one shard (one replica writes it)
        rank-00000-of-00002.json           per-rank private state (RNG, extras)
        _parts/<node>.json                 what each node agent wrote (before the commit)
        manifest.json                      written last: the commit marker
    <url>/latest                           atomically replaced pointer to the newest step

A step without ``manifest.json`` does not exist. The manifest lists every file with its size and
xxh3-64 hash (of the whole file; or, for shards the node agent writes, one of the safetensors
header and one of the tensor data after it: the data hash its snapshot had in memory, see
:class:`~flashckpt.format.manifest.FileEntry`); a file that does not match is never loaded. Nothing
read back is trusted: the manifest, shard headers and rank files are validated
(:mod:`flashckpt.format.manifest`), and files are opened only inside their step directory (see
:meth:`Storage.open_step_file`). Local files are created ``0600`` and directories ``0700``
unless ``file_mode`` shares them.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import mmap
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

import fsspec
import xxhash

from flashckpt import envnames
from flashckpt.cliargs import storage_url
from flashckpt.errors import CorruptCheckpointError
from flashckpt.format.manifest import (
    FORMAT,
    FileEntry,
    Manifest,
    ShardContent,
    check_shard,
    parse_rank_doc,
    rank_file_name,
    shard_file_name,
)
from flashckpt.format.objstore import (
    PART,
    abort_stale_uploads,
    abort_uploads_of,
    can_put_parallel,
    put_parallel,
)
from flashckpt.format.shm import buffer_address

__all__ = [
    "CheckpointFileMissing",
    "CorruptCheckpointError",
    "FileRecord",
    "StepCheck",
    "Storage",
    "check_storage_options",
    "is_local_url",
    "rank_file_name",
    "read_storage_options_file",
    "shard_file_name",
    "storage_options_for",
    "use_storage_options",
    "write_storage_options_file",
]

log = logging.getLogger("flashckpt")

MANIFEST = "manifest.json"
MAX_WORLD_ID = 4096
"""Longest world id :meth:`Storage.manifest_world` accepts (the protocol's text bound)."""
PARTS = "_parts"

CHUNK = 64 << 20
# O_DIRECT needs buffer address, file offset and length aligned to the logical block size
# (512 B or 4 KiB); a page satisfies every local disk.
DIRECT_ALIGN = 4096
_STEP_RE = re.compile(r"^step-(\d{9,})$")
_FILE_RE = re.compile(r"^(shard-\d{5,}-of-\d{5,}\.safetensors|rank-\d{5,}-of-\d{5,}\.json)$")
MAX_MANIFEST_BYTES = 64 << 20
"""A manifest lists a few hundred bytes per rank: a bigger ``manifest.json`` is not one."""
MAX_RANK_FILE_BYTES = 1 << 30
"""Bound of a rank file read without a manifest to size it (RNG states and extras)."""
DEFAULT_FILE_MODE = 0o600


@dataclass(frozen=True, slots=True)
class FileRecord:
    """Size and hash(es) of a written file: of the whole file, or (split, see
    :class:`~flashckpt.format.manifest.FileEntry`) of the head and of the data apart."""

    size: int
    xxh3_64: str | None
    """xxh3-64 of the whole file (None when split)."""
    direct: bool = False
    """Whether the bytes went to the file with ``O_DIRECT`` (the page cache bypassed); not part
    of the manifest, it says how the file was written."""
    data_offset: int | None = None
    """Split: the length of the head."""
    head_xxh3_64: str | None = None
    data_xxh3_64: str | None = None
    """Split: xxh3-64 of the data bytes, each chunk hashed after it was written."""

    def entry(self) -> FileEntry:
        """The manifest's record of the file."""
        return FileEntry(
            self.size, self.xxh3_64, self.data_offset, self.head_xxh3_64, self.data_xxh3_64
        )

    def to_json(self) -> dict[str, Any]:
        return self.entry().to_json()


class _FileHash:
    """The hash(es) of a file written as ``head`` then data chunks: one over the whole file, or
    (``split``) one of the head and one of the data."""

    def __init__(self, head: bytes, split: bool) -> None:
        self.head_len = len(head) if split else None
        self.head_hex = xxhash.xxh3_64_hexdigest(head) if split else None
        self.h = xxhash.xxh3_64() if split else xxhash.xxh3_64(head)

    def update(self, chunk: bytes | memoryview) -> None:
        self.h.update(chunk)

    def record(self, size: int, direct: bool = False) -> FileRecord:
        if self.head_len is None:
            return FileRecord(size, self.h.hexdigest(), direct=direct)
        return FileRecord(
            size,
            None,
            direct=direct,
            data_offset=self.head_len,
            head_xxh3_64=self.head_hex,
            data_xxh3_64=self.h.hexdigest(),
        )


def step_dir_name(step: int) -> str:
    return f"step-{step:09d}"


class CheckpointFileMissing(CorruptCheckpointError):
    """A file of a committed step is not there, or its step directory is gone (read for the
    manifest, it means the step is not committed: :meth:`Storage.manifest` raises
    ``FileNotFoundError`` then)."""


@dataclass(slots=True)
class StepCheck:
    """What checking a committed step found."""

    step: int
    """The step checked."""
    status: Literal["ok", "corrupt", "missing"]
    """``ok``: every file is sound; ``corrupt``: ``problems`` says what is wrong; ``missing``:
    the step is not committed (any more: retention or a rewrite removed it, perhaps while it
    was being checked)."""
    problems: list[str] = field(default_factory=list)
    """One line per problem, each naming its file."""


def _check_local_url(url: str) -> None:
    """Refuses a ``file://`` URL with anything but a path after its two slashes: fsspec reads
    ``file://tmp/x`` (and ``file://localhost/x``) as a path relative to the working directory
    and writes there without a word.

    Raises:
        ValueError: naming the three-slash form.
    """
    try:
        storage_url(url)
    except ValueError as e:
        raise ValueError(f"storage URL {e}") from None


_OPTIONS: dict[str, dict[str, Any]] = {}
_OPTIONS_LOCK = threading.Lock()
_OPTIONS_FILE_READ: list[str] = []


def is_local_url(url: str) -> bool:
    """Whether ``url`` is a local path or a ``file://`` URL (no fsspec options apply)."""
    return "://" not in url or url.startswith(("file://", "local://"))


def use_storage_options(url: str, options: Mapping[str, Any] | None) -> None:
    """Makes ``options`` (fsspec keyword arguments: for ``s3://``, ``key``, ``secret``,
    ``client_kwargs``...) those of every :class:`Storage` of the root ``url`` this process opens
    without options of its own (the trainer's and its agent's many readers and writers of one
    root). None forgets them.

    Raises:
        ValueError: not a mapping of names to JSON values (they must reach the node agent,
            through a 0600 file; the message names the key, never a value).
    """
    if options is None:
        with _OPTIONS_LOCK:
            _OPTIONS.pop(url, None)
        return
    opts = check_storage_options(options)
    with _OPTIONS_LOCK:
        _OPTIONS[url] = opts


def check_storage_options(options: Any) -> dict[str, Any]:
    """``options`` as a plain dict of JSON values; a ValueError naming the bad key (never a
    value: it may be a secret) otherwise."""
    if not isinstance(options, Mapping):
        raise ValueError(
            f"storage_options must be a dict of fsspec options, got a {type(options).__name__}"
        )
    out: dict[str, Any] = {}
    for k, v in options.items():
        if not isinstance(k, str):
            raise ValueError(f"storage_options: key {k!r} is not a string")
        try:
            out[k] = json.loads(json.dumps(v))
        except (TypeError, ValueError):
            raise ValueError(
                f"storage_options[{k!r}] is a {type(v).__name__}: give JSON values (str, "
                "number, bool, list, dict) so the options reach the node agent; e.g. "
                'config_kwargs={"read_timeout": 30} instead of a botocore Config'
            ) from None
    return out


def storage_options_for(url: str) -> dict[str, Any] | None:
    """The options :func:`use_storage_options` gave ``url``, else those of the 0600 file
    ``$FLASHCKPT_STORAGE_OPTIONS_FILE`` names (a node agent's, written by its trainer)."""
    with _OPTIONS_LOCK:
        if url in _OPTIONS:
            return dict(_OPTIONS[url])
    path = os.environ.get(envnames.STORAGE_OPTIONS_FILE)
    if not path:
        return None
    with _OPTIONS_LOCK:
        if path not in _OPTIONS_FILE_READ:
            for u, o in read_storage_options_file(path).items():
                _OPTIONS.setdefault(u, o)
            _OPTIONS_FILE_READ.append(path)
        return dict(_OPTIONS[url]) if url in _OPTIONS else None


def write_storage_options_file(path: str, options: Mapping[str, Mapping[str, Any]]) -> None:
    """Writes ``{url: options}`` to ``path``, readable by this user alone (0600, created anew:
    an existing file is replaced, a symlink refused)."""
    doc = {u: check_storage_options(o) for u, o in options.items()}
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, path)


def read_storage_options_file(path: str) -> dict[str, dict[str, Any]]:
    """The ``{url: options}`` of a file :func:`write_storage_options_file` wrote.

    Raises:
        ValueError: it is not this user's, others may read or write it, or it is not such a
            document (the message names the file and the fix, never its contents).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise ValueError(
            f"storage options file {path} ({envnames.STORAGE_OPTIONS_FILE}): {e}"
        ) from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise ValueError(
                f"storage options file {path} ({envnames.STORAGE_OPTIONS_FILE}) is not this "
                f"user's alone (mode {oct(st.st_mode & 0o777)}): it holds credentials; chmod "
                "600 it"
            )
        raw = f.read(1 << 20)
    try:
        doc = json.loads(raw)
    except ValueError:
        doc = None
    if not isinstance(doc, dict) or not all(
        isinstance(u, str) and isinstance(o, dict) for u, o in doc.items()
    ):
        raise ValueError(
            f"storage options file {path} ({envnames.STORAGE_OPTIONS_FILE}) is not a JSON "
            "object of {url: {option: value}}"
        )
    return doc


_BUCKET_PROTOCOLS = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss"}
"""Object stores whose fsspec ``makedirs`` would create a missing bucket (a typo must fail at
entry instead). Other non-local file systems (a ``dir::`` wrapper, an SFTP or HDFS root) get their
directories made as before."""


class Storage:
    """A checkpoint root reached through fsspec.

    Args:
        url: any fsspec URL (``file:///ckpt/run1``, ``memory://run1``, ``s3://bucket/run1``) or a
            local path.
        file_mode: permission bits of the files it creates on a local file system (directories
            get the matching execute bits): ``0o600`` (the default) keeps checkpoints private to
            the user; ``0o640`` or ``0o644`` shares read access with the group or everyone.
        storage_options: keyword arguments of the fsspec file system (for ``s3://``, those of
            ``s3fs.S3FileSystem``: ``key``, ``secret``, ``client_kwargs={"endpoint_url": ...}``,
            ``config_kwargs``...); None: those :func:`use_storage_options` gave ``url`` if any,
            else the backend's defaults and standard places (the environment, its config files).
    """

    def __init__(
        self,
        url: str,
        *,
        file_mode: int = DEFAULT_FILE_MODE,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        if not isinstance(url, str) or not url:
            raise ValueError(f"storage must be a non-empty URL string, got {url!r}")
        if isinstance(file_mode, bool) or not isinstance(file_mode, int) or file_mode & ~0o666:
            raise ValueError(
                f"file_mode={file_mode!r}: give read/write permission bits such as 0o600 "
                "(private, the default) or 0o644 (readable by everyone)"
            )
        if not file_mode & 0o200 or not file_mode & 0o400:
            raise ValueError(f"file_mode={oct(file_mode)}: the owner must read and write its files")
        _check_local_url(url)
        self.url = url
        self.file_mode = file_mode
        # A directory is searchable by whoever may read the files in it.
        self.dir_mode = file_mode | (file_mode & 0o444) >> 2
        try:
            # No listing cache: fsspec's object-store backends (s3fs, gcsfs, adlfs) keep every
            # listing forever by default, so a long-running agent would never see the parts,
            # manifests and steps that other machines' agents (or a user) wrote after its first
            # listing; the commit protocol reads the store, never a cache of it.
            if storage_options is None:
                storage_options = storage_options_for(url)
            opts = dict(storage_options or {})
            opts["use_listings_cache"] = False
            self.fs, self.root = fsspec.core.url_to_fs(url, **opts)
        except (ImportError, ValueError, TypeError) as e:
            raise ValueError(
                f"storage URL {url!r} cannot be opened: {e} (install the fsspec backend for its "
                "scheme, e.g. s3fs for s3://)"
            ) from e
        self.root = self.root.rstrip("/") or "/"
        self.local = "file" in _protocols(self.fs)
        self.object_store = not self.local and "memory" not in _protocols(self.fs)
        """Whether a write is an object PUT (S3, GCS, Azure...): atomic, and without renames."""

    # -- paths -------------------------------------------------------------------------------
    def path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def step_path(self, step: int, *parts: str) -> str:
        return self.path(step_dir_name(step), *parts)

    # -- writing -----------------------------------------------------------------------------
    def _makedirs(self, path: str) -> None:
        if _BUCKET_PROTOCOLS & set(_protocols(self.fs)):
            # No directories on an object store, and s3fs's makedirs creates a missing bucket:
            # a typo in the URL must fail (NoSuchBucket at entry), not make a new bucket without
            # the team's region, encryption, lifecycle and access policies.
            return
        if not self.local:
            self.fs.makedirs(path, exist_ok=True)
            return
        # Every directory made here gets ``dir_mode`` (os.makedirs gives it to the leaf only);
        # existing ones (the root a user made) keep theirs.
        missing = []
        p = os.path.abspath(path)
        while not os.path.isdir(p):
            missing.append(p)
            parent = os.path.dirname(p)
            if parent == p:
                break
            p = parent
        for d in reversed(missing):
            with contextlib.suppress(FileExistsError):
                os.mkdir(d, self.dir_mode)
                os.chmod(d, self.dir_mode)  # exact bits, whatever the umask

    def _create(self, path: str, extra_flags: int = 0) -> int:
        """Opens a local file for writing with ``file_mode`` (also when it already exists),
        never through a symbolic link planted in its place (that is an error)."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW | extra_flags
        fd = os.open(path, flags, self.file_mode)
        try:
            os.fchmod(fd, self.file_mode)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def write_stream(self, path: str, chunks: Iterable[bytes | memoryview]) -> FileRecord:
        """Writes chunks to ``path`` (durably for local files); returns size and hash."""
        return self._write_chunks(path, b"", chunks, _FileHash(b"", split=False))

    def _write_chunks(
        self, path: str, head: bytes, chunks: Iterable[bytes | memoryview], fh: _FileHash
    ) -> FileRecord:
        # Each chunk is hashed after it is written: a byte that changed in memory before it
        # reached the file shows in the hash.
        size = 0
        it = iter(chunks)
        try:
            self._makedirs(self.fs._parent(path))
            if self.local:
                with open(self._create(path), "wb", buffering=0) as f:
                    size += f.write(head) or 0
                    for c in it:
                        size += f.write(c) or 0
                        fh.update(c)
                    os.fsync(f.fileno())
            else:
                f = self.fs.open(path, "wb")
                try:
                    f.write(head)
                    size += len(head)
                    for c in it:
                        f.write(c)
                        fh.update(c)
                        size += len(c)
                except BaseException:
                    _abandon(f)
                    raise
                f.close()
        finally:
            # A generator of views into the caller's buffer (:func:`_chunks`) releases the one
            # it handed out: a failed write leaves no view alive in its traceback, so the
            # caller can close its mapping at once (issue 41: an EIO became a BufferError).
            close = getattr(it, "close", None)
            if close is not None:
                close()
        return fh.record(size)

    def write_buffer(
        self,
        path: str,
        head: bytes,
        data: memoryview,
        check: Callable[[], None] | None = None,
        *,
        split: bool = False,
        chunk: int = CHUNK,
    ) -> FileRecord:
        """Writes ``head`` then ``data`` to ``path`` (durably for local files); returns size and
        hash, as :meth:`write_stream` does.

        A local file whose ``head`` is a multiple of 4 KiB and whose ``data`` starts on a page
        boundary is written with ``O_DIRECT`` straight from ``data``: no copy into the page
        cache (an order of magnitude less CPU, and a disk-speed write), while this thread hashes
        the chunk another thread wrote before. Other file systems get the plain streamed write;
        the returned record's ``direct`` says which path the bytes took. Either way each chunk
        of ``data`` is hashed once, after it was written (what changed in memory before it
        reached the file shows in the hash).

        Args:
            check: called before each chunk of ``data``; may raise to abandon the write (it may
                also wait: the node agent gives way there to a trainer's copy).
            split: hash the head and the data apart (the record's ``data_xxh3_64`` is then the
                hash of ``data`` alone) instead of the whole file.
            chunk: bytes of ``data`` per write (rounded down to whole 4 KiB blocks).
        """
        if chunk < DIRECT_ALIGN:
            raise ValueError(f"chunk {chunk} is below {DIRECT_ALIGN} bytes")
        chunk -= chunk % DIRECT_ALIGN
        fh = _FileHash(head, split)
        if can_put_parallel(self.fs) and len(head) + len(data) > PART:
            # An S3 store: one multipart upload with parts in parallel, hashing each part's
            # bytes as sent once the store has them. An upload of this very object left open
            # (an agent killed while writing this step) is aborted first: only this node's
            # agent writes this key, so nobody else would complete it.
            with contextlib.suppress(OSError):
                abort_uploads_of(self.fs, path)
            return fh.record(put_parallel(self.fs, path, head, data, fh.update, check))
        direct = getattr(os, "O_DIRECT", 0)  # Linux
        addr = buffer_address(data) if self.local and direct else None
        if addr is None or addr % DIRECT_ALIGN or len(head) % DIRECT_ALIGN:
            return self._write_chunks(path, head, _chunks(data, check, chunk), fh)
        self._makedirs(self.fs._parent(path))
        try:
            fd = self._create(path, direct)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            # tmpfs before Linux 6.6 and some FUSE file systems refuse O_DIRECT.
            return self._write_chunks(path, head, _chunks(data, check, chunk), fh)
        try:
            return _write_direct(fd, head, data, check, fh, chunk)
        finally:
            os.close(fd)

    def write_json(self, path: str, obj: Any) -> FileRecord:
        return self.write_stream(path, [json.dumps(obj, indent=1).encode()])

    def replace_json(self, path: str, obj: Any) -> None:
        """Writes ``path`` atomically (temp file, then rename) so readers never see half of it.

        On an object store a PUT is atomic already (readers see the old object or the new one,
        never part of one) and a rename is a copy and a delete: the object is written in place,
        one request, and a writer killed mid-write leaves no temp object behind.
        """
        if self.object_store:
            self.write_json(path, obj)
            return
        tmp = f"{path}.tmp-{os.getpid()}-{time.monotonic_ns()}"
        try:
            self.write_json(tmp, obj)
            self.fs.mv(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                self.fs.rm(tmp)  # a full disk must not also collect temp files
            raise
        if self.local:
            _fsync_dir(os.path.dirname(path))

    # -- commit protocol ---------------------------------------------------------------------
    def write_part(self, step: int, node: str, part: dict[str, Any]) -> None:
        self.replace_json(self.step_path(step, PARTS, f"{node}.json"), part)

    def read_parts(self, step: int) -> list[dict[str, Any]]:
        """The parts of a step the node agents wrote (read as carefully as the step's files;
        what a part says is validated when the manifest built from it is)."""
        d = self.step_path(step, PARTS)
        try:
            names = self.fs.ls(d, detail=False)
        except FileNotFoundError:
            return []
        out = []
        for n in names:
            name = str(n).rstrip("/").rsplit("/", 1)[-1]
            if not name.endswith(".json") or name.startswith("."):
                continue
            try:
                with self.open_step_file(step, name, PARTS) as (f, size):
                    if size > MAX_MANIFEST_BYTES:
                        continue
                    part = json.loads(f.read(MAX_MANIFEST_BYTES))
            except (CorruptCheckpointError, OSError, ValueError, RecursionError):
                continue  # gone, a FIFO or link, half written by a dead agent: not a part
            if isinstance(part, dict):
                out.append(part)
        return out

    def commit(self, step: int, manifest: dict[str, Any]) -> None:
        """Writes the manifest (the commit marker), then moves ``latest`` forward.

        Raises:
            CorruptCheckpointError: the manifest is one readers would reject (a part from another
                node named a file outside the format): nothing is committed.
        """
        path = self.step_path(step, MANIFEST)
        Manifest.from_json(manifest, path, step)
        self.replace_json(path, manifest)
        newest = max(self.committed_steps(), default=step)
        self.replace_json(self.path("latest"), {"step": newest, "dir": step_dir_name(newest)})

    def uncommit(self, step: int) -> None:
        """Removes a step's commit marker (before its files are rewritten)."""
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.step_path(step, MANIFEST))

    def retain(self, keep: int, hold: frozenset[int] = frozenset()) -> list[int]:
        """Deletes all but the newest ``keep`` committed steps, and the partial step directories
        older than the newest committed one (:meth:`remove_partial_steps`).

        Args:
            keep: how many of the newest committed steps stay.
            hold: steps not deleted now, whatever their age (the remote tier still copies or
                commits them); a later retention deletes them once they are no longer held.

        Returns:
            The deleted steps.
        """
        committed = self.committed_steps()
        if not committed:
            return []
        doomed = committed[:-keep] if keep > 0 else []
        removed = [s for s in doomed if s not in hold and self._remove_step(s)]
        return sorted(removed + self.remove_partial_steps(committed))

    def remove_partial_steps(self, committed: list[int] | None = None) -> list[int]:
        """Deletes the step directories without a manifest that are older than the newest
        committed step: a step commits only while no newer one is committed, so those were
        abandoned (a failed or torn persist, a full disk, a write-through of a skipped
        snapshot), never in flight. Partial steps newer than the newest committed one are kept:
        they may be being written.

        Args:
            committed: the committed steps, if just listed.

        Returns:
            The deleted steps.
        """
        committed = self.committed_steps() if committed is None else committed
        if not committed:
            return []
        newest, done = max(committed), set(committed)
        partial = [s for s in self.all_step_dirs() if s < newest and s not in done]
        removed = [s for s in partial if self._remove_step(s)]
        # An object store: the multipart uploads a killed agent left into those steps (its
        # parts are billed, and invisible to a listing of the step directories).
        with contextlib.suppress(OSError):
            abort_stale_uploads(self.fs, self.root, newest)
        return removed

    def _remove_step(self, step: int) -> bool:
        """Removes a step directory, manifest first (a half-deleted step is never visible as
        committed). False if it could not be removed now (the next retention tries again)."""
        try:
            self.uncommit(step)
            self.fs.rm(self.step_path(step), recursive=True)
        except FileNotFoundError:
            pass  # another agent (or a user) removed it first
        except OSError:
            # E.g. a late writer adding a file while the tree goes: one step that cannot go now
            # must not stop retention of the others (nor fail the commit that ran it).
            return False
        return True

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

    @contextlib.contextmanager
    def open_step_file(
        self, step: int, name: str, sub: str | None = None
    ) -> Iterator[tuple[Any, int]]:
        """Opens a file of a step directory for reading, confined to it; yields it and its size.

        Only a plain name is opened, relative to the step directory and without following a
        symbolic link (the step directory's own name included), and only a regular file is read:
        a FIFO, a device or a link to elsewhere is corrupt, never opened for reading (so nothing
        hangs on a FIFO or reads /dev/zero).

        Args:
            sub: a subdirectory of the step directory holding the file (``_parts``).

        Raises:
            CorruptCheckpointError: the file (or its step directory) is missing, not a regular
                file, a link, or cannot be read.
        """
        path = self.step_path(step, *([sub] if sub else []), name)
        if "/" in name or name in ("", ".", ".."):
            raise CorruptCheckpointError(path, "is not a plain file name in its step directory")
        if not self.local:
            try:
                info = self.fs.info(path)
            except FileNotFoundError:
                raise CheckpointFileMissing(path, "is missing") from None
            size = info.get("size")
            if info.get("type") != "file" or not isinstance(size, int) or size < 0:
                raise CorruptCheckpointError(path, "is not a regular file")
            with self.fs.open(path, "rb") as f:
                yield f, size
            return
        step_dir = self.step_path(step)
        try:
            dfd = os.open(step_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise CheckpointFileMissing(path, "is missing (its step directory is gone)") from None
        except OSError as e:
            raise CorruptCheckpointError(
                step_dir, f"is not a directory of its own (a symbolic link?): {e.strerror}"
            ) from None
        if sub:
            try:
                sfd = os.open(sub, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dfd)
            except FileNotFoundError:
                os.close(dfd)
                raise CheckpointFileMissing(path, "is missing") from None
            except OSError as e:
                os.close(dfd)
                raise CorruptCheckpointError(path, f"is not in a directory: {e.strerror}") from None
            os.close(dfd)
            dfd = sfd
        try:
            # O_NONBLOCK: opening a FIFO must not wait for a writer (its type is checked next).
            flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
            fd = os.open(name, flags, dir_fd=dfd)
        except FileNotFoundError:
            raise CheckpointFileMissing(path, "is missing") from None
        except OSError as e:
            problem = (
                "is a symbolic link (a step's files must be regular files in its directory)"
                if e.errno == errno.ELOOP
                else f"cannot be opened: {e.strerror}"
            )
            raise CorruptCheckpointError(path, problem) from None
        finally:
            os.close(dfd)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise CorruptCheckpointError(
                    path, "is not a regular file (a FIFO, device or directory): not read"
                )
            os.set_blocking(fd, True)
            f = os.fdopen(fd, "rb", buffering=0)
        except BaseException:
            os.close(fd)
            raise
        with f:
            yield f, st.st_size

    def _read_small(self, step: int, name: str, limit: int) -> bytes:
        """A whole small file of a step (a manifest, a rank file), bounded by ``limit`` bytes."""
        path = self.step_path(step, name)
        try:
            with self.open_step_file(step, name) as (f, size):
                if size > limit:
                    raise CorruptCheckpointError(path, f"is {size} bytes, over the {limit} limit")
                raw = f.read(limit + 1)
        except OSError as e:
            raise CorruptCheckpointError(path, f"cannot be read: {e}") from None
        if len(raw) > limit:
            raise CorruptCheckpointError(path, f"is over the {limit}-byte limit")
        return raw

    def manifest(self, step: int) -> Manifest:
        """The validated manifest of a committed step.

        Raises:
            FileNotFoundError: the step is not committed.
            CorruptCheckpointError: the manifest is malformed, not of this step, or names a file
                the format does not define.
        """
        path = self.step_path(step, MANIFEST)
        try:
            raw = self._read_small(step, MANIFEST, MAX_MANIFEST_BYTES)
        except CheckpointFileMissing:
            raise FileNotFoundError(f"step {step} is not committed in {self.url}") from None
        try:
            doc = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise CorruptCheckpointError(path, f"is not valid JSON ({e})") from None
        return Manifest.from_json(doc, path, step)

    def manifest_world(self, step: int) -> str | None:
        """The world id the committed manifest of ``step`` records; None when it records none or
        cannot be read (an older manifest, a torn or foreign file: counted as another world's)."""
        try:
            with self.open_step_file(step, MANIFEST) as (f, size):
                if size > MAX_MANIFEST_BYTES:
                    return None
                doc = json.loads(f.read(MAX_MANIFEST_BYTES))
        except (OSError, ValueError, RecursionError):  # CorruptCheckpointError is a ValueError
            return None
        world = doc.get("world_id") if isinstance(doc, dict) else None
        return world if isinstance(world, str) and len(world) <= MAX_WORLD_ID else None

    def read_file(self, step: int, name: str, manifest: Manifest) -> bytearray:
        """Reads a committed file whole and checks it against the manifest.

        The file system must agree with the manifest on the size before a byte is allocated.
        """
        path = self.step_path(step, name)
        if not isinstance(name, str) or not _FILE_RE.match(name):
            raise CorruptCheckpointError(path, "is not a file name the checkpoint format defines")
        entry = manifest.files.get(name)
        if entry is None:
            raise CorruptCheckpointError(path, "is not listed in the manifest")
        size = entry.size
        # The split form hashes the bytes before data_offset and those after it apart.
        cut = entry.data_offset if entry.data_offset is not None else size + 1
        h = xxhash.xxh3_64()
        hd = xxhash.xxh3_64()
        try:
            with self.open_step_file(step, name) as (f, on_disk):
                if on_disk != size:
                    raise CorruptCheckpointError(
                        path,
                        f"has the wrong size (expected {size} bytes, the file has {on_disk}; "
                        "truncated or overwritten)",
                    )
                buf = bytearray(size)
                view = memoryview(buf)
                got = 0
                while got < size:
                    n = f.readinto(view[got : got + CHUNK])
                    if not n:
                        break
                    if got + n <= cut:
                        h.update(view[got : got + n])
                    elif got >= cut:
                        hd.update(view[got : got + n])
                    else:
                        h.update(view[got:cut])
                        hd.update(view[cut : got + n])
                    got += n
                extra = f.read(1)
        except OSError as e:
            raise CorruptCheckpointError(path, f"cannot be read: {e}") from None
        if got != size or extra:
            raise CorruptCheckpointError(
                path, f"has the wrong size (expected {size} bytes; truncated or overwritten)"
            )
        if entry.data_offset is None:
            ok = h.hexdigest() == entry.xxh3_64
        else:
            ok = h.hexdigest() == entry.head_xxh3_64 and hd.hexdigest() == entry.data_xxh3_64
        if not ok:
            raise CorruptCheckpointError(path, "fails its checksum (corrupted)")
        return buf

    def read_shard_file(
        self, step: int, name: str, manifest: Manifest
    ) -> tuple[bytearray, ShardContent]:
        """Reads a shard file of a committed step and validates its header and skeleton."""
        buf = self.read_file(step, name, manifest)
        return buf, check_shard(buf, self.step_path(step, name))

    def read_rank_file(self, step: int, rank: int, manifest: Manifest) -> dict[str, Any]:
        """A rank's private state (RNG, extras) of a committed step, checked."""
        world = manifest.world_size
        name = rank_file_name(rank, world)
        raw = self.read_file(step, name, manifest)
        private: dict[str, Any] = parse_rank_doc(raw, self.step_path(step, name), step, rank, world)
        return private

    def copy_step_file(
        self,
        step: int,
        name: str,
        entry: FileEntry,
        dest: Storage,
        check: Callable[[], None] | None = None,
        chunk: int = CHUNK,
    ) -> FileRecord:
        """Copies a file of a step (committed or not) to the same place under ``dest``, in
        chunks, verifying it against ``entry`` (its size and hash(es)) as it goes: a file that
        does not match is removed from ``dest`` again and raises, so a copy never passes for
        the bytes that were persisted. Only the format's file names are copied, opened confined
        to the step directory (:meth:`open_step_file`).

        Args:
            check: called before each chunk (may wait, or raise to abandon the copy).

        Raises:
            CorruptCheckpointError: the source is missing, of the wrong size, or fails its hash.
        """
        path = self.step_path(step, name)
        if not isinstance(name, str) or not _FILE_RE.match(name):
            raise CorruptCheckpointError(path, "is not a file name the checkpoint format defines")
        size = entry.size
        cut = entry.data_offset if entry.data_offset is not None else size + 1
        h, hd = xxhash.xxh3_64(), xxhash.xxh3_64()
        got = 0

        def chunks(f: Any) -> Iterator[bytes]:
            nonlocal got
            while got < size:
                if check is not None:
                    check()
                b = f.read(min(chunk, size - got))
                if not b:
                    return
                lo, hi = got, got + len(b)
                if hi <= cut:
                    h.update(b)
                elif lo >= cut:
                    hd.update(b)
                else:
                    h.update(b[: cut - lo])
                    hd.update(b[cut - lo :])
                got = hi
                yield b

        out = dest.step_path(step, name)
        try:
            with self.open_step_file(step, name) as (f, on_disk):
                if on_disk != size:
                    raise CorruptCheckpointError(
                        path, f"has the wrong size (expected {size} bytes, the file has {on_disk})"
                    )
                rec = dest.write_stream(out, chunks(f))
                extra = f.read(1)
            if entry.data_offset is None:
                ok = h.hexdigest() == entry.xxh3_64
            else:
                ok = h.hexdigest() == entry.head_xxh3_64 and hd.hexdigest() == entry.data_xxh3_64
            if got != size or extra:
                raise CorruptCheckpointError(path, f"has the wrong size (expected {size} bytes)")
            if not ok:
                raise CorruptCheckpointError(path, "fails its checksum (corrupted): not copied")
        except BaseException:
            with contextlib.suppress(OSError):
                dest.fs.rm(out)
            raise
        return FileRecord(
            rec.size,
            entry.xxh3_64,
            data_offset=entry.data_offset,
            head_xxh3_64=entry.head_xxh3_64,
            data_xxh3_64=entry.data_xxh3_64,
        )

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
        # Replaced atomically (temp file, then rename): the write-through of a snapshot may
        # rewrite the file of a step that is already committed while the mirror copies it, and
        # a reader must see the whole file, old or new (both hold the same state), never a
        # truncated one.
        path = self.step_path(step, rank_file_name(rank, world_size))
        if self.local and os.path.islink(path):
            # As every other local write (O_NOFOLLOW): a link planted where a checkpoint file
            # goes is an error, not something to replace quietly.
            raise OSError(errno.ELOOP, "a symbolic link is where a checkpoint file goes", path)
        if self.object_store:
            return self.write_json(path, doc)  # a PUT replaces the object atomically
        tmp = f"{path}.tmp-{os.getpid()}-{time.monotonic_ns()}"
        try:
            rec = self.write_json(tmp, doc)
            self.fs.mv(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                self.fs.rm(tmp)
            raise
        if self.local:
            _fsync_dir(os.path.dirname(path))
        return rec

    def read_private(self, step: int, rank: int, world_size: int) -> dict[str, Any] | None:
        """A rank's private state of a step, committed or not, if present and intact."""
        name = rank_file_name(rank, world_size)
        try:
            raw = self._read_small(step, name, MAX_RANK_FILE_BYTES)
            private: dict[str, Any] = parse_rank_doc(
                raw, self.step_path(step, name), step, rank, world_size, listed=False
            )
        except (CorruptCheckpointError, OSError):
            return None
        return private

    def check_step(self, step: int, *, _again: bool = True) -> StepCheck:
        """Checks a committed step exactly as loading and restoring it do: the manifest, then
        every file (size, hash), every shard's header and skeleton, every rank file.

        A step that is not committed, or stops being committed while it is checked (retention
        deleted it, or an agent is rewriting it), is ``missing``, not corrupt.
        """
        problems = []
        manifest: Manifest | None = None
        try:
            manifest = self.manifest(step)
        except FileNotFoundError:
            return StepCheck(step, "missing", [f"step {step} is not committed in {self.url}"])
        except CorruptCheckpointError as e:
            problems.append(str(e))
        else:
            rank_of = {e.file: r for r, e in manifest.ranks.items()}
            for name in sorted(manifest.files):
                try:
                    if name in rank_of:
                        self.read_rank_file(step, rank_of[name], manifest)
                    else:
                        self.read_shard_file(step, name, manifest)
                except CorruptCheckpointError as e:
                    problems.append(str(e))
        if not problems:
            return StepCheck(step, "ok")
        # Retention removes the manifest first and then the files: a step found broken whose
        # manifest is now gone was deleted under the check, not corrupt.
        try:
            now = self.manifest(step)
        except FileNotFoundError:
            return StepCheck(step, "missing", [f"step {step} was removed while being checked"])
        except CorruptCheckpointError:
            now = None
        if manifest is not None and now is not None and now != manifest and _again:
            # Rewritten and committed again under the check (an agent re-persisting the step):
            # check the new one.
            return self.check_step(step, _again=False)
        return StepCheck(step, "corrupt", problems)

    def verify(self, step: int) -> list[str]:
        """Checks a committed step (see :meth:`check_step`); returns the problems found (empty if
        sound; one line if the step is not committed)."""
        return self.check_step(step).problems

    def iter_files(self, step: int) -> Iterator[tuple[str, int]]:
        for name, entry in sorted(self.manifest(step).files.items()):
            yield name, entry.size


def _chunks(
    data: memoryview, check: Callable[[], None] | None, chunk: int = CHUNK
) -> Iterator[bytes | memoryview]:
    """Views of ``data``, ``chunk`` bytes each; each is released once the next is asked for or
    the generator is closed (a failed write's traceback then holds no live view of the
    caller's buffer: its mapping can be closed at once)."""
    for off in range(0, len(data), chunk):
        if check is not None:
            check()
        view = data[off : off + chunk]
        try:
            yield view
        finally:
            view.release()


def _abandon(f: Any) -> None:
    """Closes an fsspec file whose write failed, without letting a second failure (the close
    flushes what it buffered to the storage that just failed) replace the first: the error
    raised is the storage's own, such as the ``OSError`` of an EIO."""
    with contextlib.suppress(Exception):
        f.discard()
    try:
        f.close()
    except Exception as e:  # the write's own error is the one raised
        log.debug("closing %s after a failed write: %s", getattr(f, "path", f), e)


def _write_direct(
    fd: int,
    head: bytes,
    data: memoryview,
    check: Callable[[], None] | None,
    fh: _FileHash,
    chunk: int = CHUNK,
) -> FileRecord:
    """Writes ``head + data`` to ``fd`` (opened with ``O_DIRECT``) and fsyncs it.

    ``head`` goes through a page-aligned copy; ``data`` is written in place up to its last whole
    4 KiB block, and the tail (not a whole block, which ``O_DIRECT`` cannot write) after
    clearing ``O_DIRECT``. Each chunk is hashed once it is written, while a worker thread writes
    the next one (both release the GIL), so hashing costs CPU but no wall time.
    """
    n = len(data)
    body = n - n % DIRECT_ALIGN
    # Every view of ``data`` taken here is released before this returns or raises: a failed
    # write's traceback (this frame, the writer thread's) then keeps no export of the caller's
    # buffer alive, and the caller closes its mapping at once (issue 41).
    views: list[memoryview] = []

    def view(lo: int, hi: int) -> memoryview:
        v = data[lo:hi]
        views.append(v)
        return v

    try:
        with mmap.mmap(-1, max(len(head), 1)) as hbuf:
            hv = memoryview(hbuf)
            try:
                hv[: len(head)] = head
                hh = hv[: len(head)]
                try:
                    _write_all(fd, hh)
                finally:
                    hh.release()
            finally:
                hv.release()
        with ThreadPoolExecutor(1, thread_name_prefix="fc-direct-write") as pool:
            written: memoryview | None = None  # written, not hashed yet
            for off in range(0, body, chunk):
                if check is not None:
                    check()
                part = view(off, min(off + chunk, body))
                done = pool.submit(_write_all, fd, part)
                if written is not None:
                    fh.update(written)
                    written.release()
                done.result()
                written = part
            if written is not None:
                fh.update(written)
        # _write_all clears O_DIRECT where the file system refused it for a buffer: then (part
        # of) the file went through the page cache after all.
        direct = bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)
        if body < n:
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            tail = view(body, n)
            _write_all(fd, tail)
            fh.update(tail)
        os.fsync(fd)
    finally:
        # The writer thread is done (the pool was shut down): nothing reads these any more.
        for v in views:
            v.release()
    return fh.record(len(head) + n, direct=direct)


def _write_all(fd: int, buf: memoryview) -> None:
    done = 0
    while done < len(buf):
        try:
            with buf[done:] as rest:  # released even when the write fails
                done += os.write(fd, rest)
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
