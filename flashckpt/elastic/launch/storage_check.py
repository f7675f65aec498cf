"""The launcher's check of its ``--storage`` at start: a root that cannot keep checkpoints, or
that belongs to another job, is an error on the terminal before anything runs, not an agent whose
every persist fails in a log file while the job trains to its end (or a job that resumes from
another's steps)."""

from __future__ import annotations

import os

__all__ = ["check_storage"]


def check_storage(url: str, job: str | None = None, *, takeover: bool = False) -> str | None:
    """Writes, reads back and deletes a small file under the storage root (a local root is
    created first, as the node agent would); then, given the ``job``, refuses a root that
    belongs to another job (its committed steps or its owner file name that job, as the
    trainer's entry checks ``storage=``: :mod:`flashckpt.format.storage_owner`) unless
    ``takeover``, and records ``job`` as the root's owner.

    Returns:
        ``None`` when that worked, else the problem and the fix, for ``flashckpt run: error:``.
    """
    from flashckpt.format.storage import Storage
    from flashckpt.format.storage_owner import foreign_owner, write_owner
    from flashckpt.trainer.storageroot import probe_round_trip

    try:
        st = Storage(url)
    except (ValueError, ImportError) as e:
        return f"--storage {url}: {e}"
    path = st.path(f".flashckpt-launcher-probe-{os.getpid()}-{os.urandom(4).hex()}")
    error = probe_round_trip(st, path)
    if error is None:
        if job is None:
            return None
        if not takeover:
            found = foreign_owner(st, job)
            if found is not None:
                return found.refusal("--storage", url, job, "--takeover", "--rdzv-id {}")
        try:
            write_owner(st, job)
        except Exception as e:  # the probe wrote there a moment ago: rare
            return f"--storage {url}: cannot record job {job!r} as its owner: {e}"
        return None
    return (
        f"--storage {url} cannot keep checkpoints: writing, reading back and deleting {path} "
        f"failed: {error}. The node agent would fail every persist there. Fix the URL, its "
        "permissions or its free space, or leave --storage out to keep snapshots in memory "
        "only (or to use the script's own storage=)"
    )
