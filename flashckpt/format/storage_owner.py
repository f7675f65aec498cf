"""Which job a storage root belongs to (issue 30: a job's state is its own).

Two pieces of evidence, checked in this order at entry (the trainer's ``storage=`` and
``mirror=``, the launcher's ``--storage``):

- the owner file :data:`OWNER_FILE` at the root, ``{"job", "host", "pid", "time"}``, created
  by the first of the job's trainers (rank 0), launchers or node agents to enter, only where
  none is (:func:`claim_root`: an exclusive create, so of two jobs entering at the same instant
  exactly one owns the root, issue 41), so a live job that has committed nothing yet owns its
  root too;
- where there is no owner file (a root written before them, or the file deleted), the newest
  committed step's manifest, which names the job that wrote it.

A root whose evidence names another job is refused unless the user says to take it over
(``takeover=True``, ``flashckpt run --takeover``), which rewrites the owner file for the new job.
An owner file left by a job that is gone blocks nobody for ever: the error names the file, the job,
its host, pid and time, and both ways out (take it over, or delete the file). A manifest without a
job name (older format), or one that cannot be read, is left to the restore's checks; an owner
file that cannot be parsed is named in the error, never guessed at.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flashckpt.format.storage import Storage

__all__ = [
    "OWNER_FILE",
    "Foreign",
    "claim_root",
    "delete_steps",
    "foreign_owner",
    "guard_step",
    "make_root",
    "probe_round_trip",
    "write_owner",
]

log = logging.getLogger("flashckpt")

OWNER_FILE = ".flashckpt-owner.json"
"""The owner file's name at a storage root (a format: every version reads it there)."""
_MAX_OWNER_BYTES = 64 << 10
_CLAIM_TRIES = 5
_EMPTY_WAIT_S = 0.1


@dataclass(frozen=True, slots=True)
class Foreign:
    """Another job's evidence on a root."""

    job: str | None
    """The other job (None: an owner file that cannot be read names none)."""
    newest: int | None
    """Its newest committed step (None: the owner file is the evidence)."""
    detail: str
    """The owner file's details (empty for committed steps)."""

    def refusal(
        self,
        what: str,
        url: str,
        job: str,
        takeover: str,
        rename: str = "job={!r}",
        *,
        resume: bool = True,
    ) -> str:
        """The error refusing ``job`` the root ``url`` (the option ``what`` named), with the
        ways out: ``takeover`` is how the caller's user says take it over, ``rename`` (a format
        of the other job's name) how to run as that job. ``resume=False``: the caller cannot
        read the root's steps back (a trainer without ``storage=`` of its own, whose node agent
        persists to its own root), so a takeover deletes them (``takeover`` says how)."""
        other = self.job
        as_other = rename.format(other)
        if self.newest is not None and not resume:
            return (
                f"{what} {url} holds committed steps of job {other!r} (newest: step "
                f"{self.newest}), and this is job {job!r}: both jobs would overwrite each "
                f"other's steps. Give this job a {what} root of its own, run it under "
                f"{as_other} if it is that job, or pass {takeover} to delete them and start "
                "this job there (a trainer without storage= of its own restores from memory "
                "only: it cannot resume from those steps)"
            )
        if self.newest is not None:
            return (
                f"{what} {url} holds committed steps of job {other!r} (newest: step "
                f"{self.newest}), and this is job {job!r}: resuming would take that job's state "
                f"for this one's, and both jobs would overwrite each other's steps. Give this "
                f"job a {what} root of its own, run it under {as_other} if it is that job, "
                f"or pass {takeover} to resume from those steps as this job"
            )
        if other is None:
            return (
                f"{what} {url} has {self.detail}: it may belong to another job. Give this job a "
                f"{what} root of its own, or pass {takeover} (or delete the file) if the root "
                "is free"
            )
        return (
            f"{what} {url} is in use by job {other!r}: {self.detail}; this is job {job!r}. "
            f"Two jobs on one root would write their steps over each other's and resume from "
            f"each other's. Give this job a {what} root of its own, run it under {as_other} "
            f"if it is that job, or, if job {other!r} is gone, pass {takeover} (or delete that "
            "file)"
        )


def owner_path(st: Storage) -> str:
    """Where the root's owner file is."""
    return st.path(OWNER_FILE)


def read_owner(st: Storage) -> dict[str, Any] | None:
    """The owner file's content; None when there is none.

    Raises:
        ValueError: the file is there but is not an owner record (named, with its size).
    """
    path = owner_path(st)
    try:
        raw = st.fs.cat_file(path)
    except FileNotFoundError:
        return None
    try:
        doc = json.loads(raw[:_MAX_OWNER_BYTES])
    except (ValueError, UnicodeDecodeError):
        doc = None
    if not isinstance(doc, dict) or not isinstance(doc.get("job"), str):
        raise ValueError(f"{path} ({len(raw)} bytes) is not a flashckpt owner record")
    return doc


def _owner_doc(job: str) -> dict[str, Any]:
    return {"job": job, "host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}


def make_root(st: Storage) -> None:
    """Creates a local root (and its missing parents) with the storage's directory mode (0700
    for the default private files, as every directory of the root's steps), not the 0755 a
    plain ``makedirs`` would give it; a root that exists keeps its mode. Nothing for object
    stores (no directories)."""
    if st.local:
        st._makedirs(st.root)


def write_owner(st: Storage, job: str) -> None:
    """Records ``job`` as the root's owner (this host, this pid, now) whoever owned it: a
    takeover's write (:func:`claim_root` takes a root atomically otherwise). A local root is
    created first. The file is replaced in one step (temp file, then rename): a reader never
    sees an empty file. Raises what the file system raises."""
    make_root(st)
    st.replace_json(owner_path(st), _owner_doc(job))


def _newest_job(st: Storage) -> tuple[int | None, str | None]:
    """The root's newest committed step and the job its manifest names (None: no step, or a
    manifest without a job name (older format) or one that cannot be read, left to the
    restore's checks). A root that cannot be listed counts as holding no steps (the storage
    probe before this names a root that does not work)."""
    try:
        committed = st.committed_steps()
    except OSError:
        committed = []
    if not committed:
        return None, None
    newest = max(committed)
    try:
        return newest, st.manifest(newest).job
    except (OSError, ValueError):  # CorruptCheckpointError is a ValueError
        return newest, None


def _judge(
    st: Storage, job: str, newest: int | None, by: str | None, doc: dict[str, Any] | None
) -> Foreign | None:
    """Whose the root is: the owner file's job where there is one (the atomic claim, or a
    takeover's record), else the job of the newest committed step (a root written before owner
    files, or whose owner file was deleted)."""
    if doc is None:
        return Foreign(by, newest, "") if by is not None and by != job else None
    if doc["job"] == job:
        return None
    if by == doc["job"]:
        return Foreign(by, newest, "")
    when = doc.get("time")
    at = (
        time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(when))
        if isinstance(when, (int, float))
        else "an unknown time"
    )
    return Foreign(
        doc["job"],
        None,
        f"its owner file {owner_path(st)} names it (claimed on host {doc.get('host', '?')!s}, "
        f"pid {doc.get('pid', '?')!s}, at {at}; nothing committed yet)",
    )


def foreign_owner(st: Storage, job: str) -> Foreign | None:
    """Another job's evidence on the root ``st`` (see the module), or None when the root is
    free or ``job``'s own. Only reads: :func:`claim_root` takes the root."""
    newest, by = _newest_job(st)
    try:
        doc = read_owner(st)
    except ValueError as e:
        return Foreign(None, None, f"an owner file that cannot be read ({e})")
    return _judge(st, job, newest, by, doc)


def claim_root(st: Storage, job: str, *, takeover: bool = False) -> Foreign | None:
    """Takes the root ``st`` for ``job``, atomically: the owner file is created only where
    none is (:func:`~flashckpt.format.exclusive.create_exclusive`), so of two jobs entering at
    the same instant exactly one creates it and the other reads it and is refused (issue 41:
    a check that read the root, then wrote, let both in). A root already ``job``'s is left as
    it is; one with another job's committed steps and no owner file is refused before anything
    is written. ``takeover`` rewrites the owner file for ``job`` whoever owned it (the user's
    word: it is not exclusive against another takeover at the same instant).

    A file system that cannot create exclusively (see :mod:`flashckpt.format.exclusive`) gets
    the owner file written after the check, with a warning naming the risk, every time.

    Returns:
        The other job's evidence (nothing was written), or None: the root is ``job``'s.

    Raises:
        OSError: writing the owner file failed (what the file system raised).
    """
    from flashckpt.format.exclusive import ExclusiveCreateUnsupported, create_exclusive

    if takeover:
        write_owner(st, job)
        return None
    newest, by = _newest_job(st)
    path = owner_path(st)
    for attempt in range(_CLAIM_TRIES):
        try:
            doc = read_owner(st)
        except ValueError as e:
            if attempt < _CLAIM_TRIES - 1 and _empty(st, path):
                time.sleep(_EMPTY_WAIT_S)  # being created in place (no hard links there)
                continue
            return Foreign(None, None, f"an owner file that cannot be read ({e})")
        if doc is not None or (by is not None and by != job):
            return _judge(st, job, newest, by, doc)
        make_root(st)
        body = json.dumps(_owner_doc(job), indent=1).encode()
        try:
            create_exclusive(st.fs, path, body, file_mode=st.file_mode)
        except FileExistsError:
            continue  # another process created it meanwhile: read whose it is
        except ExclusiveCreateUnsupported as e:
            log.warning(
                "flashckpt: storage %s cannot take a root atomically (%s): job %r records "
                "itself as the owner after checking, and a job entering at the same instant "
                "could do the same; give each job a root of its own",
                st.url,
                e.strerror,
                job,
            )
            write_owner(st, job)
        return None
    raise OSError(
        f"the owner file {path} kept appearing and disappearing while job {job!r} took the "
        "root: another process is creating and deleting it"
    )


def _empty(st: Storage, path: str) -> bool:
    try:
        return st.fs.size(path) == 0
    except OSError:
        return False


def guard_step(st: Storage, step: int, job: str) -> bool:
    """A writer's last check before it writes files of ``step``: a step committed by another
    job (its manifest names that job) is that job's and immutable here, never written into,
    whatever the owner checks at entry let through (defence in depth, issue 41: a second job's
    rank files overwrote a first job's committed steps and both lost every step).

    Returns:
        Whether ``step`` is committed (by ``job``, or by a manifest naming no job or one that
        cannot be read: the restore's checks judge those).

    Raises:
        PersistError: ``step`` is committed by another job (named, with the root and the fix).
    """
    from flashckpt.errors import PersistError
    from flashckpt.format.storage import MANIFEST

    if not st.fs.exists(st.step_path(step, MANIFEST)):
        return False
    try:
        other = st.manifest(step).job
    except (OSError, ValueError):  # gone meanwhile, or unreadable: not another job's
        return True
    if other is not None and other != job:
        raise PersistError(
            f"step {step} in {st.url} is committed by job {other!r}: job {job!r} does not "
            "write into another job's committed step. Two jobs share this storage root: give "
            "each job a root of its own"
        )
    return True


def delete_steps(st: Storage) -> list[int]:
    """Deletes every step of the root, committed or not, newest first, each one's commit marker
    before its files (never a half-deleted committed step), then ``latest`` (``overwrite=True``:
    a run that starts over). Returns the steps deleted."""
    doomed = st.all_step_dirs()
    for s in sorted(doomed, reverse=True):
        st.uncommit(s)
        with contextlib.suppress(FileNotFoundError):
            st.fs.rm(st.step_path(s), recursive=True)
    with contextlib.suppress(FileNotFoundError):
        st.fs.rm(st.path("latest"))
    return sorted(doomed)


def _bucket_exists(fs: Any, bucket: str) -> bool:
    """Whether the S3 bucket exists: False on 404 alone; any other failure (a wrong key, an
    unreachable store) is left to the round trip, whose PUT's answer names the cause."""
    try:
        fs.call_s3("head_bucket", Bucket=bucket)
    except FileNotFoundError:
        return False
    except Exception:  # a HEAD's answer has no body: the round trip's PUT names the cause
        return True
    return True


def probe_round_trip(st: Storage, path: str) -> str | None:
    """Writes, reads back and deletes a small file at ``path`` (a local root is created first,
    as the node agent would). Returns None, or what failed."""
    payload = b"flashckpt storage probe " + os.urandom(16)
    try:
        if st.object_store:
            # Some stores (SeaweedFS) create a missing bucket on the first PUT, AWS refuses
            # it: either way a typo in the URL must fail here, not write to a new bucket
            # without the team's region, encryption, lifecycle and access policies.
            bucket = st.root.strip("/").split("/")[0]
            if callable(getattr(st.fs, "call_s3", None)) and not _bucket_exists(st.fs, bucket):
                return (
                    f"the bucket {bucket!r} does not exist (flashckpt does not create buckets): "
                    "create it with its policies, or fix the bucket in the URL"
                )
        make_root(st)
        st.fs.pipe_file(path, payload)
        got = st.fs.cat_file(path)
        st.fs.rm(path)
        if got != payload:
            return f"the file read back differs ({len(got)} bytes, {len(payload)} written)"
    except Exception as e:  # any backend's failure (OSError, botocore, ...), reported as is
        with contextlib.suppress(Exception):
            st.fs.rm(path)
        return f"{type(e).__name__}: {e}"
    return None
