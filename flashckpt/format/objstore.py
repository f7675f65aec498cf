"""What an object store (S3 and S3-compatible stores through ``s3fs``) needs beyond fsspec's
file interface: the multipart uploads a killed writer left behind.

A shard larger than a part goes to S3 as a multipart upload; the object exists only once the
upload is completed, so a node agent SIGKILLed mid-upload leaves no object (the step is not
committed: it has no manifest), but the parts it sent stay on the store, billed and invisible
to a listing, until someone aborts the upload. :func:`abort_stale_uploads` aborts those of the
steps a retention would delete as abandoned (older than the newest committed step); ``flashckpt
clean`` aborts every one under the root.

Other stores (local files, ``memory://``, GCS, Azure through fsspec) have nothing to abort here:
the functions return empty.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Upload", "abort_stale_uploads", "abort_uploads", "list_uploads"]

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


def abort_stale_uploads(fs: Any, root: str, newest_committed: int) -> list[Upload]:
    """Aborts the uploads into step directories older than the newest committed step: a step
    commits only while no newer one is committed, so nobody completes those any more (the same
    rule that deletes partial step directories)."""
    return abort_uploads(fs, root, lambda u: u.step is not None and u.step < newest_committed)
