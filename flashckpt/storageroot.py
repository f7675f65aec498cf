"""The trainer's checks of its storage root at entry: that it can keep checkpoints at all, and
that a run starting from step 0 does not take over another run's committed steps."""

from __future__ import annotations

import contextlib
import logging
import os
from typing import TYPE_CHECKING

from flashckpt.errors import StorageUnavailableError
from flashckpt.reshard import listed_steps

if TYPE_CHECKING:
    from flashckpt.config import CheckpointConfig
    from flashckpt.rankctx import RankContext
    from flashckpt.storage import Storage

__all__ = ["probe_storage", "start_fresh"]

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
    name = f".flashckpt-probe-{ctx.rank}-{os.getpid()}-{os.urandom(4).hex()}"
    path = st.path(name)
    payload = b"flashckpt storage probe " + os.urandom(16)
    error = None
    try:
        if st.local:  # a local root is created here, as the node agent would
            st.fs.makedirs(st.root, exist_ok=True)
        st.fs.pipe_file(path, payload)
        got = st.fs.cat_file(path)
        st.fs.rm(path)
        if got != payload:
            error = f"the file read back differs ({len(got)} bytes, {len(payload)} written)"
    except Exception as e:  # any backend's failure (OSError, botocore, ...), reported as is
        error = f"{type(e).__name__}: {e}"
        with contextlib.suppress(Exception):
            st.fs.rm(path)
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
        from flashckpt.storage import Storage

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
