"""The launcher's check of its ``--storage`` at start: a root that cannot keep checkpoints is an
error on the terminal before anything runs, not an agent whose every persist fails in a log file
while the job trains to its end."""

from __future__ import annotations

import os

__all__ = ["check_storage"]


def check_storage(url: str) -> str | None:
    """Writes, reads back and deletes a small file under the storage root (a local root is
    created first, as the node agent would).

    Returns:
        ``None`` when that worked, else the problem and the fix, for ``flashckpt run: error:``.
    """
    from flashckpt.format.storage import Storage
    from flashckpt.trainer.storageroot import probe_round_trip

    try:
        st = Storage(url)
    except (ValueError, ImportError) as e:
        return f"--storage {url}: {e}"
    path = st.path(f".flashckpt-launcher-probe-{os.getpid()}-{os.urandom(4).hex()}")
    error = probe_round_trip(st, path)
    if error is None:
        return None
    return (
        f"--storage {url} cannot keep checkpoints: writing, reading back and deleting {path} "
        f"failed: {error}. The node agent would fail every persist there. Fix the URL, its "
        "permissions or its free space, or leave --storage out to keep snapshots in memory "
        "only (or to use the script's own storage=)"
    )
