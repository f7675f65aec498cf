"""The trainer's checks of its storage root at entry: that it can keep checkpoints at all, and
that a run starting from step 0 does not take over another run's committed steps."""

from __future__ import annotations

import contextlib
import logging
import os
from typing import TYPE_CHECKING

from flashckpt.errors import StorageUnavailableError
from flashckpt.format.storage_owner import foreign_owner, write_owner
from flashckpt.trainer.restore.reshard import listed_steps

if TYPE_CHECKING:
    from flashckpt.format.storage import Storage
    from flashckpt.trainer.config import CheckpointConfig
    from flashckpt.trainer.rankctx import RankContext

__all__ = ["check_owner", "probe_storage", "start_fresh"]

log = logging.getLogger("flashckpt")


def probe_storage(st: Storage, ctx: RankContext, what: str = "storage") -> None:
    """Writes, reads back and deletes a small file under the storage root (every rank, then
    all agree), so storage that cannot keep the work fails here, not silently at the end.

    Args:
        what: the option that named the root (``storage``, or ``mirror`` for the remote tier),
            in the error.

    Raises:
        StorageUnavailableError: this rank's probe failed (with the URL and the OS error), or
            another rank's did.
    """
    path = st.path(f".flashckpt-probe-{ctx.rank}-{os.getpid()}-{os.urandom(4).hex()}")
    error = probe_round_trip(st, path)
    others = ctx.all_max(1 if error else 0)
    if error is not None:
        fix = (
            "pass storage=None to keep snapshots in memory only"
            if what == "storage"
            else f"pass {what}=None to go without it"
        )
        raise StorageUnavailableError(
            f"{what} {st.url} cannot keep checkpoints: writing, reading back and deleting "
            f"{path} failed: {error}. Fix the URL, its permissions or its free space, or {fix}"
        )
    if others:
        raise StorageUnavailableError(
            f"{what} {st.url} cannot keep checkpoints: another rank could not write, read "
            "back and delete a file there (its error names the cause)"
        )


def check_owner(st: Storage | None, ctx: RankContext, config: CheckpointConfig) -> None:
    """Refuses a storage root (and mirror) that belongs to another job: its newest committed
    step's manifest names that job, or, with nothing committed yet, the root's owner file does
    (:mod:`flashckpt.format.storage_owner`), unless ``takeover=True`` (or ``overwrite=True``
    with ``restore=False``, which deletes those steps): two jobs on one root would resume from
    each other's steps. Every rank agrees; rank 0 then records this job in the owner file (a
    takeover rewrites it). A manifest without a job name (older format) or one that cannot be
    read is left to the restore's checks.

    Raises:
        ValueError: the root belongs to another job, naming it, the evidence, the root and the
            options.
    """
    if st is None:
        return
    roots = [(st, "storage")]
    if config.mirror is not None:
        from flashckpt.format.storage import Storage

        roots.append((Storage(config.mirror), "mirror"))
    take = config.takeover or (config.overwrite and not config.restore)
    for root, what in roots:
        if not take:
            _check_owner(root, ctx, what)
        if ctx.rank == 0:
            try:
                write_owner(root, ctx.job)
            except Exception as e:  # any backend's failure: the probe passed, so rare
                log.warning(
                    "flashckpt: cannot record job %r as the owner of %s %s (%s): another job "
                    "with nothing committed there would not be refused",
                    ctx.job,
                    what,
                    root.url,
                    e,
                )


def _check_owner(st: Storage, ctx: RankContext, what: str) -> None:
    found = foreign_owner(st, ctx.job)
    if not ctx.all_max(1 if found else 0):
        return
    if found is not None:
        raise ValueError(found.refusal(what, st.url, ctx.job, "takeover=True"))
    raise ValueError(
        f"{what} {st.url} belongs to another job (seen by another rank, whose error names it): "
        "give this job a root of its own or pass takeover=True"
    )


def start_fresh(st: Storage | None, ctx: RankContext, config: CheckpointConfig) -> None:
    """A run that starts from step 0 over a storage root holding committed steps: refused,
    unless ``overwrite=True``, which deletes them (every rank agrees first). The remote tier
    (``mirror``) is checked the same way, after the storage root: its steps would otherwise be
    restored next time as this run's.

    Raises:
        ValueError: the root (or the mirror) holds committed steps and ``overwrite`` is False.
    """
    if st is None:
        return
    _start_fresh(st, ctx, config, "storage")
    if config.mirror is not None:
        from flashckpt.format.storage import Storage

        _start_fresh(Storage(config.mirror), ctx, config, "mirror")


def _start_fresh(st: Storage, ctx: RankContext, config: CheckpointConfig, what: str) -> None:
    stored = listed_steps(st)
    if not ctx.all_max(1 if stored else 0):
        return
    why = (
        "restore=False"
        if not config.restore
        else "none of them could be restored by every rank (see the warnings above)"
    )
    if not config.overwrite:
        held = f"committed steps {stored}" if stored else "committed steps (seen by a rank)"
        raise ValueError(
            f"{what} {st.url} holds {held} of an earlier run, and this run starts from "
            f"step 0 ({why}): its steps would be mixed with those, and the older run's taken "
            "for this one's. Pass overwrite=True to delete them and start over, use a new "
            f"{what} root" + (", or drop restore=False to resume" if not config.restore else "")
        )
    if ctx.rank == 0:
        doomed = st.all_step_dirs()
        for s in sorted(doomed, reverse=True):
            st.uncommit(s)  # the commit marker first: never a half-deleted committed step
            with contextlib.suppress(FileNotFoundError):
                st.fs.rm(st.step_path(s), recursive=True)
        with contextlib.suppress(FileNotFoundError):
            st.fs.rm(st.path("latest"))
        log.warning(
            "flashckpt: overwrite=True: deleted steps %s of an earlier run from %s (%s)",
            doomed,
            st.url,
            why,
        )
    ctx.all_max(0)  # nobody writes before the old steps are gone


def probe_round_trip(st: Storage, path: str) -> str | None:
    """Writes, reads back and deletes a small file at ``path`` (a local root is created first,
    as the node agent would). Returns None, or what failed."""
    payload = b"flashckpt storage probe " + os.urandom(16)
    try:
        if st.local:
            st.fs.makedirs(st.root, exist_ok=True)
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
