"""The public error hierarchy: every error flashckpt raises on purpose derives from FlashckptError.

The bottom layer: this module imports nothing of flashckpt (and no torch), so the node agent,
storage, the CLI and the trainer side all raise the same types. Where a subclass also derives from
a builtin (``ValueError``, ``RuntimeError``, ``TimeoutError``), code that caught the builtin before
the hierarchy existed keeps working.
"""

from __future__ import annotations

__all__ = [
    "AgentError",
    "CorruptCheckpointError",
    "CorruptSnapshotError",
    "FlashckptError",
    "PersistError",
    "ProtocolError",
    "RestoreError",
    "ShmSpaceError",
    "StorageUnavailableError",
    "UnsafeLocalStateError",
]


class FlashckptError(Exception):
    """Base class of the errors flashckpt raises on purpose.

    Attributes:
        restartable: Whether starting the workers again can mend it. ``False`` for errors of
            the machine or the job's configuration (too little shared memory, storage that
            cannot be written, a final snapshot storage refused): a worker under ``flashckpt
            run`` that fails with one records it, and the launcher fails at once with its text
            instead of spending ``--max-restarts`` on it. A class attribute, which an instance
            may override.
    """

    restartable: bool = True


class CorruptCheckpointError(FlashckptError, ValueError):
    """A checkpoint file (or its manifest) is missing, malformed, truncated or fails its checksum.

    Attributes:
        path: the file (or step directory) at fault.
    """

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"checkpoint file {path} {problem}")
        self.path = path


class ShmSpaceError(FlashckptError, RuntimeError):
    """The shared-memory file system has too little room for the snapshot slots."""

    restartable = False


class AgentError(FlashckptError, RuntimeError):
    """The node agent refused a request or could not be reached.

    Attributes:
        kind: the agent-side exception type name when the agent refused (e.g. ``ShmSpaceError``).
    """

    def __init__(self, message: str, kind: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind


class StorageUnavailableError(FlashckptError, OSError):
    """The checkpoint storage cannot be written (read-only, full, gone, no permission)."""

    restartable = False


class PersistError(FlashckptError, RuntimeError):
    """Work was not made durable: the final snapshot was not committed to storage.

    Attributes:
        step: the snapshot that is not committed (None when unknown).
        errors: the persist failures the agent reported, newest last.
    """

    restartable = False  # the snapshot is in memory; a restart would only fail the same way

    def __init__(self, message: str, step: int | None = None, errors: list | None = None) -> None:
        super().__init__(message)
        self.step = step
        self.errors = list(errors or [])


class UnsafeLocalStateError(FlashckptError, PermissionError):
    """Local state (the run dir, a slot file) could be controlled or read by another user of
    the machine: refused instead of trusted. The message names the path, the problem and the fix.
    """

    restartable = False


class ProtocolError(FlashckptError, ValueError):
    """A message on the node agent's socket is not one the protocol has: unknown ``op``, a field
    missing, unknown, ill-typed or out of range. The message names the field."""


class CorruptSnapshotError(FlashckptError, ValueError):
    """A snapshot in memory (this machine's slot, a replica held by another machine) no longer
    matches its data hash: never loaded or replicated. The message names rank, step and source.

    Attributes:
        rank: the rank whose snapshot it is.
        step: the snapshot's step.
        source: where it was read (a slot path, ``host:port`` of a peer agent).
    """

    def __init__(self, message: str, *, rank: int, step: int, source: str) -> None:
        super().__init__(message)
        self.rank = rank
        self.step = step
        self.source = source


class RestoreError(FlashckptError, ValueError):
    """The step the ranks agreed on cannot be restored: on some rank its state does not fit this
    run (model, optimizer, the user's objects) or reading it failed in a way no other step or
    source mends. Raised on every rank, naming each failed rank and its error (as torch DCP's
    ``CheckpointException``); on a failed rank it is raised from that rank's own error.

    Attributes:
        step: the step that was being restored.
        failures: ``{rank: "ExceptionType: message"}`` for every rank that failed (another rank's
            text is cut to a few kB).
    """

    def __init__(
        self,
        step: int,
        failures: dict[int, str],
        *,
        start_over: str = "pass restore=False to start from scratch",
    ) -> None:
        ranks = sorted(failures)
        lines = [
            f"step {step} cannot be restored: {len(ranks)} rank(s) failed ({ranks}):",
            *(f"  rank {r}: {failures[r]}" for r in ranks),
            f"  fix the cause on each rank named, or {start_over}",
        ]
        super().__init__("\n".join(lines))
        self.step = step
        self.failures = dict(failures)
