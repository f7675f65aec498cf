"""One ``flashckpt run`` per job and node on a machine: the launcher's lock.

A second launch of a job that runs on this machine (the same command typed again in another
terminal, a scheduler that started it twice) is refused at once, before it starts anything:
before, its node agent crash-looped on the first agent's lock, and its clean-up then removed the
first agent's socket and lock file and called the first job's live snapshots "kept for the next
launch". The lock is an ``flock`` on ``<run_dir>/<job>.<node>.launcher.lock``, held for the
launcher's life (the kernel releases it however the launcher ends, ``kill -9`` included); the
file names the holder's pid, for the error message.
"""

from __future__ import annotations

import contextlib
import fcntl
import os

from flashckpt.elastic.launch.config import LaunchError

__all__ = ["LaunchLock"]


class LaunchLock:
    """The held lock; :meth:`release` at the launcher's exit."""

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, run_dir: str, job: str, node: str) -> LaunchLock:
        """Takes the lock of ``job`` and ``node`` in ``run_dir`` (a private directory).

        Raises:
            LaunchError: Another launcher of this job and node runs on this machine (naming
                its pid and what to do), or the lock file cannot be opened.
        """
        path = os.path.join(run_dir, f"{job}.{node}.launcher.lock")
        while True:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            except OSError as exc:
                raise LaunchError(f"cannot open the launcher's lock {path}: {exc}") from exc
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_pid(fd)
                os.close(fd)
                who = f"launcher pid {holder}" if holder else "another launcher"
                raise LaunchError(
                    f"job {job!r} already runs on this machine as node {node!r} ({who}, which "
                    f"holds {path}): a second launch of a running job is refused, and nothing "
                    "of the running one was touched. Wait for it to end, or stop it first "
                    f"(kill -TERM {holder or '<its pid>'}; a rerun then resumes from its "
                    "snapshots); a standby on this machine needs its own --node-id"
                ) from None
            # Taken: still the file at the path? (a launcher leaving unlinks it after its
            # release; one that locked the old file meanwhile must lock the new one)
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        return cls(path, fd)

    def release(self) -> None:
        """Removes the lock file and releases the lock (the next launch may start)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.path)  # while held: nobody waits on a file that is gone
        os.close(fd)


def _read_pid(fd: int) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        text = os.pread(fd, 32, 0).decode().strip()
        return int(text) if text.isdigit() else None
    return None
