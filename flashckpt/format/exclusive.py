"""Creating a file only where none is: the one atomic step that decides which job owns a storage
root (issue 41: two jobs that each read "free" and then wrote their owner file both entered).

:func:`create_exclusive` either creates the file with the whole of its content or raises
:class:`FileExistsError`, on every backend that can say so in one operation; one that cannot
raises :class:`ExclusiveCreateUnsupported` rather than pretend (the caller warns and goes on
without the guarantee, or refuses). What each backend relies on:

- **local and network file systems** (fsspec ``file://``, a plain path; NFSv3+, Lustre, GPFS,
  CephFS mounts): the content goes to a private temporary file first (``O_EXCL``, synced), then
  ``link(2)`` gives it its name. ``link`` fails with ``EEXIST`` where the name exists, atomically,
  also on NFS (the classic NFS-safe lock), and a reader never sees the file empty or half
  written. A file system without hard links (some FUSE mounts, SMB) falls back to
  ``open(O_CREAT | O_EXCL)`` on the name itself, then the write: still exclusive, but a reader
  may see it empty for a moment (the owner check retries that).
- **S3** (``s3://``, ``s3a://``; s3fs): one ``PutObject`` with ``If-None-Match: *`` (a
  conditional write: AWS S3 since 2024-08, MinIO, Ceph RGW, recent SeaweedFS). The service
  answers ``412 Precondition Failed`` where the key exists (-> ``FileExistsError``) and ``409
  ConditionalRequestConflict`` while another conditional write of the key is in flight (tried
  again, then ``FileExistsError``: someone is creating it). A service that ignores the header
  (an old S3-compatible server) overwrites silently: nothing on the client can tell; such a
  store needs a root per job. Needs s3fs (its ``call_s3``; recent s3fs translates the 412
  to ``FileExistsError`` itself, older ones to an ``OSError`` whose cause carries the code,
  both handled) and a botocore that knows ``IfNoneMatch`` on ``put_object`` (1.35.16+).
- **fsspec ``memory://``** (one process's own dictionary): ``open(path, "xb")``.
- **anything else** (gcsfs, adlfs, hdfs, ...): :class:`ExclusiveCreateUnsupported`. Adding one is
  a branch here: its conditional create (GCS ``ifGenerationMatch=0``, Azure ``If-None-Match:
  *``) mapped to ``FileExistsError``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from typing import Any

from flashckpt.errors import StorageError
from flashckpt.format.storage import _fsync_dir, _protocols

__all__ = ["ExclusiveCreateUnsupported", "create_exclusive", "supports_exclusive"]

_S3 = ("s3", "s3a")
_CONFLICT_TRIES = 4


class ExclusiveCreateUnsupported(StorageError, OSError):
    """The file system cannot create a file only where none is, in one operation."""


def _kind(fs: Any) -> str:
    from fsspec.implementations.local import LocalFileSystem
    from fsspec.implementations.memory import MemoryFileSystem

    if isinstance(fs, LocalFileSystem):
        return "local"
    if isinstance(fs, MemoryFileSystem):
        return "memory"
    if any(p in _S3 for p in _protocols(fs)) and hasattr(fs, "call_s3"):
        return "s3"
    return "unsupported"


def supports_exclusive(fs: Any) -> bool:
    """Whether :func:`create_exclusive` works on ``fs`` (see the module for each backend)."""
    return _kind(fs) != "unsupported"


def create_exclusive(fs: Any, path: str, data: bytes, *, file_mode: int = 0o600) -> None:
    """Creates ``path`` holding ``data`` where nothing is at ``path``, in one atomic step.

    Args:
        fs: the fsspec file system (``Storage.fs``).
        path: the file, in ``fs``'s terms (``Storage.path(...)``).
        data: the whole content: a reader sees all of it or no file (see the module for the
            one fallback where it may see it empty for a moment).
        file_mode: permission bits of a local file.

    Raises:
        FileExistsError: something is at ``path`` already (another process won).
        ExclusiveCreateUnsupported: ``fs`` cannot create exclusively (named, with its protocol).
        OSError: what the file system raises otherwise.
    """
    kind = _kind(fs)
    if kind == "local":
        _create_local(fs, path, data, file_mode)
    elif kind == "memory":
        with fs.open(path, "xb") as f:
            f.write(data)
    elif kind == "s3":
        _create_s3(fs, path, data)
    else:
        raise ExclusiveCreateUnsupported(
            errno.EOPNOTSUPP,
            f"{type(fs).__name__} (protocol {'/'.join(_protocols(fs))}) cannot create a file "
            "only where none is in one operation",
            path,
        )


def _create_local(fs: Any, path: str, data: bytes, file_mode: int) -> None:
    path = fs._strip_protocol(path)
    tmp = f"{path}.excl-{os.getpid()}-{os.urandom(6).hex()}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(tmp, flags, file_mode)
    try:
        try:
            os.fchmod(fd, file_mode)  # exact bits, whatever the umask
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            fs.link(tmp, path)  # EEXIST where the name exists: the atomic step
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK):
                raise
            _create_in_place(path, data, flags, file_mode)  # no hard links here
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    _fsync_dir(os.path.dirname(path))


def _create_in_place(path: str, data: bytes, flags: int, file_mode: int) -> None:
    fd = os.open(path, flags, file_mode)
    try:
        os.fchmod(fd, file_mode)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def _create_s3(fs: Any, path: str, data: bytes) -> None:
    bucket, key, _ = fs.split_path(path)
    for attempt in range(_CONFLICT_TRIES):
        try:
            fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, IfNoneMatch="*")
        except FileExistsError:
            raise  # recent s3fs translates an If-None-Match 412 itself
        except Exception as e:  # s3fs translates botocore's errors: read the code back
            code = _s3_code(e)
            if code in ("PreconditionFailed", "412"):
                raise FileExistsError(errno.EEXIST, "the object exists", path) from None
            if code in ("ConditionalRequestConflict", "409") and attempt < _CONFLICT_TRIES - 1:
                time.sleep(0.05 * 2**attempt)
                continue
            if code in ("ConditionalRequestConflict", "409"):
                raise FileExistsError(errno.EEXIST, "another writer is creating it", path) from e
            raise
        with contextlib.suppress(Exception):
            fs.invalidate_cache(path)
        return


def _s3_code(e: BaseException) -> str | None:
    """The S3 error code of ``e`` or of the botocore error it was translated from."""
    seen: BaseException | None = e
    while seen is not None:
        response = getattr(seen, "response", None)
        if isinstance(response, dict):
            err = response.get("Error") or {}
            code = err.get("Code")
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            if code is not None:
                return str(code)
            if status is not None:
                return str(status)
        text = str(seen)
        for code in ("PreconditionFailed", "ConditionalRequestConflict"):
            if code in text:
                return code
        seen = seen.__cause__ or seen.__context__
    return None
