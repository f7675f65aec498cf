"""The launcher's check of its ``--storage`` at start: a root that cannot keep checkpoints, or
that belongs to another job, is an error on the terminal before anything runs, not an agent whose
every persist fails in a log file while the job trains to its end (or a job that resumes from
another's steps)."""

from __future__ import annotations

import os

__all__ = ["check_storage"]


def check_storage(url: str, job: str | None = None, *, takeover: bool = False) -> str | None:
    """Writes, reads back and deletes a small file under the storage root (a local root is
    created first, as the node agent would); then, given the ``job``, takes the root for it
    atomically (:func:`~flashckpt.format.storage_owner.claim_root`, as the trainer's entry
    takes ``storage=``): a root whose owner file (or, without one, committed steps) names
    another job is refused unless ``takeover``, which records ``job`` as its owner.

    Returns:
        ``None`` when that worked, else the problem and the fix, for ``flashckpt run: error:``.
    """
    from flashckpt.format.storage import Storage
    from flashckpt.format.storage_owner import claim_root, probe_round_trip

    try:
        st = Storage(url)
    except (ValueError, ImportError) as e:
        return f"--storage {url}: {e}"
    path = st.path(f".flashckpt-launcher-probe-{os.getpid()}-{os.urandom(4).hex()}")
    error = probe_round_trip(st, path)
    if error is None:
        if job is None:
            return None
        try:
            found = claim_root(st, job, takeover=takeover)
        except Exception as e:  # the probe wrote there a moment ago: rare
            return f"--storage {url}: cannot record job {job!r} as its owner: {e}"
        if found is not None:
            return found.refusal("--storage", url, job, "--takeover", "--rdzv-id {}")
        return None
    return (
        f"--storage {url} cannot keep checkpoints: writing, reading back and deleting {path} "
        f"failed: {error}. The node agent would fail every persist there. Fix the URL, its "
        "permissions or its free space, or leave --storage out to keep snapshots in memory "
        "only (or to use the script's own storage=)"
    )
