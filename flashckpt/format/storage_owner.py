"""Which job a storage root belongs to (issue 30: a job's state is its own).

Two pieces of evidence, checked in this order at entry (the trainer's ``storage=`` and
``mirror=``, the launcher's ``--storage``):

- the newest committed step's manifest, which names the job that wrote it;
- the owner file :data:`OWNER_FILE` at the root, ``{"job", "host", "pid", "time"}``, written by
  the job's trainers (rank 0) and launchers each time they enter, so a live job that has
  committed nothing yet owns its root too.

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
import os
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flashckpt.format.storage import Storage

__all__ = ["OWNER_FILE", "Foreign", "delete_steps", "foreign_owner", "write_owner"]

OWNER_FILE = ".flashckpt-owner.json"
"""The owner file's name at a storage root (a format: every version reads it there)."""
_MAX_OWNER_BYTES = 64 << 10


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


def write_owner(st: Storage, job: str) -> None:
    """Records ``job`` as the root's owner (this host, this pid, now); a local root is created
    first. The file is replaced in one step (temp file, then rename): a launcher or trainer of
    the same job reading it meanwhile sees the old record or the new one, never an empty file
    (which reads as another job's unreadable claim and refuses the root). Raises what the file
    system raises."""
    if st.local:
        st.fs.makedirs(st.root, exist_ok=True)
    doc = {"job": job, "host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}
    st.replace_json(owner_path(st), doc)


def foreign_owner(st: Storage, job: str) -> Foreign | None:
    """Another job's evidence on the root ``st`` (see the module), or None when the root is
    free or ``job``'s own. A root that cannot be listed counts as holding no steps (the
    storage probe before this names a root that does not work)."""
    try:
        committed = st.committed_steps()
    except OSError:
        committed = []
    if committed:
        newest = max(committed)
        try:
            other = st.manifest(newest).job
        except (OSError, ValueError):  # CorruptCheckpointError is a ValueError
            other = None
        if other is not None and other != job:
            return Foreign(other, newest, "")
        if other is not None:
            return None  # its own steps: the owner file may be older (a takeover's)
    path = owner_path(st)
    try:
        doc = read_owner(st)
    except ValueError as e:
        return Foreign(None, None, f"an owner file that cannot be read ({e})")
    if doc is None or doc["job"] == job:
        return None
    when = doc.get("time")
    at = (
        time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(when))
        if isinstance(when, (int, float))
        else "an unknown time"
    )
    return Foreign(
        doc["job"],
        None,
        f"its owner file {path} names it (last entered on host {doc.get('host', '?')!s}, "
        f"pid {doc.get('pid', '?')!s}, at {at}; nothing committed yet)",
    )


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
