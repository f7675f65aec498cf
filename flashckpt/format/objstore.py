"""What an object store (S3 and S3-compatible stores through ``s3fs``) needs beyond fsspec's
file interface: the multipart uploads a killed writer left behind.

A shard larger than a part goes to S3 as a multipart upload; the object exists only once the
upload is completed, so a node agent SIGKILLed mid-upload leaves no object (the step is not
committed: it has no manifest), but the parts it sent stay on the store, billed and invisible
to a listing, until someone aborts the upload. :func:`abort_uploads_of` aborts those of one
key (the next write of that shard, by the only agent that writes it); :func:`abort_stale_uploads`
those of the steps a retention would delete as abandoned (older than the newest committed step).

Other stores (local files, ``memory://``, GCS, Azure through fsspec) have nothing to abort here:
the functions return empty.
"""

from __future__ import annotations

import errno
import re
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Upload",
    "abort_stale_uploads",
    "abort_uploads",
    "abort_uploads_of",
    "as_storage_error",
    "list_uploads",
]

_STEP_IN_KEY = re.compile(r"(?:^|/)step-(\d{9,})/")


@dataclass(frozen=True, slots=True)
class Upload:
    """A multipart upload begun and neither completed nor aborted."""

    key: str
    """The object key it would create (``<root>/step-.../shard-...``)."""
    upload_id: str
    step: int | None
    """The step directory its key is in; None for a key outside every step."""


def _is_s3(fs: Any) -> bool:
    return callable(getattr(fs, "call_s3", None))


def _split(root: str) -> tuple[str, str]:
    bucket, _, key = root.strip("/").partition("/")
    return bucket, (key + "/") if key else ""


def list_uploads(fs: Any, root: str) -> list[Upload]:
    """The unfinished multipart uploads under the checkpoint root ``root`` (``bucket/prefix``);
    empty for a store that is not S3."""
    if not _is_s3(fs):
        return []
    bucket, prefix = _split(root)
    out: list[Upload] = []
    kw: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix}
    while True:
        page = fs.call_s3("list_multipart_uploads", **kw)
        for u in page.get("Uploads", []) or []:
            key, uid = u.get("Key"), u.get("UploadId")
            if not isinstance(key, str) or not isinstance(uid, str) or not key.startswith(prefix):
                continue
            m = _STEP_IN_KEY.match(key[len(prefix) :])
            out.append(Upload(key, uid, int(m.group(1)) if m else None))
        if not page.get("IsTruncated"):
            return out
        kw["KeyMarker"] = page.get("NextKeyMarker", "")
        kw["UploadIdMarker"] = page.get("NextUploadIdMarker", "")
        if not kw["KeyMarker"] and not kw["UploadIdMarker"]:
            return out


def abort_uploads(
    fs: Any, root: str, which: Callable[[Upload], bool] = lambda u: True
) -> list[Upload]:
    """Aborts the unfinished multipart uploads under ``root`` that ``which`` selects; returns
    them. An upload gone meanwhile (completed or aborted by another) is skipped."""
    bucket, _ = _split(root)
    done = []
    for u in list_uploads(fs, root):
        if not which(u):
            continue
        try:
            fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=u.key, UploadId=u.upload_id)
        except FileNotFoundError:
            continue  # NoSuchUpload: finished or aborted by another
        done.append(u)
    return done


def abort_uploads_of(fs: Any, path: str) -> int:
    """Aborts the unfinished multipart uploads of exactly the object ``path`` (``bucket/key``):
    the ones a writer killed while writing it left; returns how many. Nothing on a store that
    is not S3."""
    parent, _, _ = path.strip("/").rpartition("/")
    key = path.strip("/").partition("/")[2]
    return len(abort_uploads(fs, parent, lambda u: u.key == key))


def abort_stale_uploads(fs: Any, root: str, newest_committed: int) -> list[Upload]:
    """Aborts the uploads into step directories older than the newest committed step: a step
    commits only while no newer one is committed, so nobody completes those any more (the same
    rule that deletes partial step directories)."""
    return abort_uploads(fs, root, lambda u: u.step is not None and u.step < newest_committed)


def as_storage_error(e: Exception, where: str) -> Exception:
    """``e`` as the storage error it is, in the :class:`OSError` family every write path raises
    (issue 41): a client library's network failure (botocore's ``EndpointConnectionError`` and
    ``ConnectionClosedError`` are not ``OSError``) becomes a ``TimeoutError``, a
    ``ConnectionError`` or an ``OSError(EIO)`` naming ``where`` (the object) and the original
    (the caller makes it the ``__cause__``). An ``OSError``, and anything not from the client
    library (a caller's own exception, abandoning the write), is returned as it is."""
    if isinstance(e, OSError) or not type(e).__module__.startswith(_CLIENT_MODULES):
        return e
    names = {c.__name__ for c in type(e).__mro__}
    what = f"{where}: {type(e).__name__}: {e}"
    if names & {"ReadTimeoutError", "ConnectTimeoutError", "TimeoutError"}:
        return TimeoutError(errno.ETIMEDOUT, what)
    if names & {"ConnectionError", "ConnectionClosedError", "HTTPClientError"}:
        return ConnectionError(errno.ECONNRESET, what)
    return OSError(errno.EIO, what)


_CLIENT_MODULES = ("botocore", "aiobotocore", "urllib3", "aiohttp", "s3fs")


def _drop_frames(e: BaseException | None) -> None:
    """Clears the locals of the finished frames in ``e``'s traceback and its causes' (a part
    upload's frame holds that part's bytes): a failed upload keeps no part buffer alive through
    the error the caller holds or logs."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        e = e.__cause__ or e.__context__


PART = 32 << 20
"""Bytes per part of :func:`put_parallel` (S3 allows 5 MiB to 5 GiB, at most 10,000 parts)."""
CONCURRENCY = 8
"""Parts :func:`put_parallel` has in flight at once."""
MAX_PARTS = 10_000


def can_put_parallel(fs: Any) -> bool:
    """Whether :func:`put_parallel` can write to ``fs`` (an S3 store through s3fs)."""
    return _is_s3(fs)


def put_parallel(
    fs: Any,
    path: str,
    head: bytes,
    data: memoryview,
    on_data: Callable[[bytes], None],
    check: Callable[[], None] | None = None,
    *,
    part: int = PART,
    concurrency: int = CONCURRENCY,
) -> int:
    """Writes ``head + data`` to the object ``path`` (``bucket/key``) by one multipart upload,
    ``concurrency`` parts in flight (a single stream, as s3fs writes, leaves most of a store's
    bandwidth unused). The object appears whole when the upload completes, or not at all: on any
    error (or ``check`` raising) the upload is aborted.

    Args:
        on_data: given each part's bytes of ``data`` in order, once that part is stored (the
            caller hashes them: what was sent, exactly).
        check: called before each part (may wait, or raise to abandon the upload).

    Returns:
        The bytes written.
    """
    from concurrent.futures import Future, ThreadPoolExecutor

    bucket, _, key = path.strip("/").partition("/")
    total = len(head) + len(data)
    part = max(part, -(-total // MAX_PARTS))
    uid: str | None = None

    def send(n: int, body: bytes) -> dict[str, Any]:
        r = fs.call_s3("upload_part", Bucket=bucket, Key=key, UploadId=uid, PartNumber=n, Body=body)
        return {"PartNumber": n, "ETag": r["ETag"]}

    parts: list[dict[str, Any]] = []
    inflight: list[tuple[Future[dict[str, Any]], bytes]] = []
    chunk = body = b""
    try:
        uid = fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]
        with ThreadPoolExecutor(concurrency, thread_name_prefix="fc-s3-part") as pool:

            def settle(keep: int) -> None:
                while len(inflight) > keep:
                    fut, sent = inflight.pop(0)
                    parts.append(fut.result())
                    on_data(sent)

            off, n = 0, 1
            first = True
            while first or off < len(data):
                if check is not None:
                    check()
                take = part - len(head) if first else part
                chunk = bytes(data[off : off + take])
                body = head + chunk if first else chunk
                inflight.append((pool.submit(send, n, body), chunk))
                off += len(chunk)
                n += 1
                first = False
                settle(concurrency)
            settle(0)
        fs.call_s3(
            "complete_multipart_upload",
            Bucket=bucket,
            Key=key,
            UploadId=uid,
            MultipartUpload={"Parts": parts},
        )
    except BaseException as e:
        # The part buffers go at once (issue 41): the ones still queued or in flight, the last
        # one made here, and those the error's traceback would keep alive.
        while inflight:
            inflight.pop()[0].cancel()
        chunk = body = b""
        if uid is not None:
            try:
                fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=uid)
            except Exception:  # the store is away: the next retention aborts it
                pass
        if not isinstance(e, Exception):
            raise
        err = as_storage_error(e, f"uploading part of {path}")
        _drop_frames(e)
        if err is e:
            raise
        raise err from e
    return total
