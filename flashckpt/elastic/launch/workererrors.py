"""Errors no restart can mend, from a worker of ``flashckpt run`` to its launcher.

A worker that fails with a :class:`~flashckpt.errors.FlashckptError` whose ``restartable`` is
false (too little shared memory, storage that cannot be written, a final snapshot storage
refused: the machine's or the job's configuration) writes one small JSON record, its error's
type and text, into the directory ``$FLASHCKPT_WORKER_ERRORS`` names (one file per local
rank, written whole or not at all), then exits as before. Its launcher reads the records of
the workers that failed before it decides on a restart: a record turns the failure into the
launcher's own, once, with the error's text on its terminal, and ``--max-restarts`` is not
spent on it (each restart would fail the same way, and the text would drown in torch's generic
"workers failed").

Nothing in a record is trusted: a record that is not a small JSON object of the expected fields
is ignored (the failure is then an ordinary one, restarted as before).
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass

from flashckpt import envnames

__all__ = ["WorkerError", "clear", "not_restartable", "read", "record"]

_MAX_RECORD = 64 * 1024
_MAX_MESSAGE = 16 * 1024


@dataclass(frozen=True, slots=True)
class WorkerError:
    """A worker's error that no restart can mend."""

    local_rank: int
    rank: int
    type: str
    message: str

    def describe(self) -> str:
        """One paragraph: which rank, the error's type and its text."""
        return f"rank {self.rank} (local rank {self.local_rank}): {self.type}: {self.message}"


def not_restartable(exc: BaseException) -> BaseException | None:
    """The error in ``exc``'s chain (itself, its causes and contexts) that no restart can mend:
    a ``FlashckptError`` whose ``restartable`` is false; None when there is none."""
    from flashckpt.errors import FlashckptError

    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, FlashckptError) and not getattr(e, "restartable", True):
            return e
        todo += [c for c in (e.__cause__, e.__context__) if c is not None]
    return None


def _path(directory: str, local_rank: int) -> str:
    return os.path.join(directory, f"rank{local_rank}.json")


def record(exc: BaseException) -> bool:
    """In a worker failing with ``exc``: records the error no restart can mend, if ``exc``
    holds one and the launcher gave a directory. Returns whether it did. Never raises."""
    try:
        directory = envnames.get(envnames.WORKER_ERRORS)
        found = not_restartable(exc)
        if directory is None or found is None:
            return False
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        data = json.dumps(
            {
                "local_rank": local_rank,
                "rank": int(os.environ.get("RANK", "-1")),
                "type": type(found).__name__,
                "message": str(found)[:_MAX_MESSAGE],
            }
        ).encode()
        path = _path(directory, local_rank)
        tmp = f"{path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        return True
    except Exception:  # a report: the worker fails as it would have anyway
        return False


def read(directory: str, local_ranks: list[int]) -> list[WorkerError]:
    """The records of these local ranks in ``directory`` (the launcher's side)."""
    out: list[WorkerError] = []
    for local_rank in sorted(set(local_ranks)):
        try:
            fd = os.open(_path(directory, local_rank), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            raw = os.read(fd, _MAX_RECORD + 1)
        except OSError:
            continue
        finally:
            os.close(fd)
        try:
            doc = json.loads(raw) if len(raw) <= _MAX_RECORD else None
        except ValueError:
            doc = None
        if not isinstance(doc, dict):
            continue
        rank, kind, message = doc.get("rank"), doc.get("type"), doc.get("message")
        if not (isinstance(rank, int) and isinstance(kind, str) and isinstance(message, str)):
            continue
        out.append(WorkerError(local_rank, rank, kind[:200], message[:_MAX_MESSAGE]))
    return out


def clear(directory: str) -> None:
    """Removes every record (before the workers start again), creating the directory (0700)
    when it does not exist."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    for name in os.listdir(directory):
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(directory, name))
