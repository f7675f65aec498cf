"""The public error hierarchy: every error flashckpt raises on purpose derives from FlashckptError,
through exactly one of a few families a caller can catch by what it can do about it.

=======================  ===================================================================
family                   what went wrong
=======================  ===================================================================
``CheckpointDataError``  a checkpoint or a snapshot is damaged, torn, or does not fit this run
``StorageError``         the checkpoint storage cannot be written or used
``LocalMachineError``    this machine cannot host the job (shared memory, unsafe local state)
``AgentDaemonError``     the node agent refused, failed, or could not be reached
``ElasticJobError``      the launcher cannot run this machine in the job
``EtcdError``            etcd refused, failed or did not answer (or could not be started)
=======================  ===================================================================

Each family's docstring says what to do about it (the errors reference lists them). A family
derives from ``FlashckptError`` alone; where an error also derives from a builtin
(``ValueError``, ``RuntimeError``, ``OSError``, ``TimeoutError``), code that catches the builtin
keeps working. Private control-flow signals (``_Name`` classes, or classes of ``_private``
modules) stay out of this hierarchy: nothing that catches a family catches them.

The bottom layer: this module imports nothing of flashckpt (and no torch), so the node agent,
storage, the CLI and the trainer side all raise the same types.
"""

from __future__ import annotations

__all__ = [
    "FAMILIES",
    "AgentDaemonError",
    "AgentError",
    "CheckpointDataError",
    "CorruptCheckpointError",
    "CorruptSnapshotError",
    "ElasticJobError",
    "EtcdError",
    "FlashckptError",
    "LocalMachineError",
    "PersistError",
    "ProtocolError",
    "RestoreError",
    "ShmSpaceError",
    "StorageError",
    "StorageRootRefused",
    "StorageUnavailableError",
    "TornSnapshot",
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


# --- the families -------------------------------------------------------------------------------


class CheckpointDataError(FlashckptError):
    """A checkpoint in storage or a snapshot in memory is damaged, torn, or does not fit this
    run: it is never loaded (a damaged copy is never committed or replicated either).

    What to do: nothing, where flashckpt can fall back by itself (another copy of the step:
    storage, a replica; else an older step), which it does with a warning naming the copy. One
    that reaches your code names the file, step or rank at fault: fix what it names (a model or
    optimizer that changed, a file altered by hand) or restore another step; pass
    ``restore=False`` to start from scratch.
    """


class StorageError(FlashckptError):
    """The checkpoint storage (a directory or an fsspec URL such as ``s3://``) cannot be written
    or used as flashckpt needs: work in memory is not made durable.

    What to do: fix the storage the message names (permissions, free space, credentials, the
    endpoint, a file system that supports exclusive create) or point ``storage=`` elsewhere.
    Restarting the workers cannot mend it.
    """


class LocalMachineError(FlashckptError):
    """This machine cannot host the job as configured: too little shared memory for the
    snapshot slots, or local state (the run dir, a slot file) another user could control.

    What to do: fix the machine as the message says (a larger ``/dev/shm``, fewer snapshot
    slots, the owner and mode of the path named) and start again; a restart on the same machine
    cannot mend it.
    """


class AgentDaemonError(FlashckptError):
    """The node agent (the daemon on each machine that persists and replicates snapshots)
    refused a request, failed, could not be reached, or could not be started; or two agents
    could not exchange a replica.

    What to do: read the agent's log (the message names it where it can; ``flashckpt status``
    shows each agent of the machine and its errors); under ``flashckpt run`` the launcher
    restarts a dead agent, and a failed replica is sent again. One that says another agent
    serves the job: stop that one, or give this job another id.
    """


class ElasticJobError(FlashckptError):
    """The elastic launcher (``flashckpt run``) cannot run this machine in the job: a flag or
    setting that cannot work, or a node id another live launcher of the job already holds.

    What to do: fix the command line or configuration as the message says (it names the flag
    and the fix), or give this machine a node id of its own; restarting the same command fails
    the same way.
    """


class EtcdError(FlashckptError):
    """etcd refused a request, failed or did not answer, or an etcd server flashckpt starts
    could not start: every error of the etcd client (``EtcdClient``), its watches and lease
    keep-alives, and of those servers.

    Raised as such when etcd rejected a request (for example a malformed key), which retrying
    cannot fix.

    What to do: check that etcd runs and is reachable from this machine (``--rdzv-endpoint``),
    and its TLS and auth options (an :class:`EtcdAuthError` names the one to set); after
    :class:`EtcdOutcomeUnknown` re-read the key before writing again. The launcher retries an
    unavailable etcd until its timeouts run out.
    """


FAMILIES: tuple[type[FlashckptError], ...] = (
    CheckpointDataError,
    StorageError,
    LocalMachineError,
    AgentDaemonError,
    ElasticJobError,
    EtcdError,
)
"""The families, each a direct subclass of FlashckptError; every public error is under one."""


# --- checkpoint data ----------------------------------------------------------------------------


class CorruptCheckpointError(CheckpointDataError, ValueError):
    """A checkpoint file (or its manifest) is missing, malformed, truncated or fails its checksum.

    Attributes:
        path: the file (or step directory) at fault.
    """

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"checkpoint file {path} {problem}")
        self.path = path


class CorruptSnapshotError(CheckpointDataError, ValueError):
    """A snapshot in memory (this machine's slot, a replica held by another machine) cannot be
    trusted whole: it no longer matches its data hash (the memory was written over), has no hash
    to check it by, or the copy is gone or unreadable. It is never loaded, persisted or
    replicated; a restore takes the step from another copy (storage, a replica) if there is one.
    The message names rank, step and source.

    Attributes:
        rank: the rank whose snapshot it is (None where the message alone names it).
        step: the snapshot's step (None likewise).
        source: where it was read (a slot path, ``host:port`` of a peer agent; None likewise).
        why: its damage alone, where the raiser names it apart from the whole message.
    """

    def __init__(
        self,
        message: str,
        why: str | None = None,
        *,
        rank: int | None = None,
        step: int | None = None,
        source: str | None = None,
    ) -> None:
        super().__init__(message)
        self.why = why
        self.rank = rank
        self.step = step
        self.source = source


class TornSnapshot(CheckpointDataError):
    """A snapshot changed (or could not be had whole) while it was read, persisted or sent: a
    trainer began writing a newer one over it. That read is void: the agent does not commit it
    (it persists the newer snapshot), a restore tries an older step."""


class RestoreError(CheckpointDataError, ValueError):
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


# --- storage ------------------------------------------------------------------------------------


class StorageUnavailableError(StorageError, OSError):
    """The checkpoint storage cannot be written (read-only, full, gone, no permission)."""

    restartable = False


class StorageRootRefused(StorageError, ValueError):
    """The storage root (or mirror) is not this run's to write: it belongs to another job, or
    holds an earlier run's committed steps while this run starts from step 0. The message names
    the root, the evidence and the options (``takeover=True``, ``overwrite=True``, a root of its
    own). No restart mends it: under ``flashckpt run`` the launcher fails at once with it."""

    restartable = False


class PersistError(StorageError, RuntimeError):
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


# --- the local machine --------------------------------------------------------------------------


class ShmSpaceError(LocalMachineError, RuntimeError):
    """The shared-memory file system has too little room for the snapshot slots."""

    restartable = False


class UnsafeLocalStateError(LocalMachineError, PermissionError):
    """Local state (the run dir, a slot file) could be controlled or read by another user of
    the machine: refused instead of trusted. The message names the path, the problem and the fix.
    """

    restartable = False


# --- the node agent -----------------------------------------------------------------------------


class AgentError(AgentDaemonError, RuntimeError):
    """The node agent refused a request or could not be reached.

    Attributes:
        kind: the agent-side exception type name when the agent refused (e.g. ``ShmSpaceError``).
    """

    def __init__(self, message: str, kind: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind


class ProtocolError(AgentDaemonError, ValueError):
    """A message on the node agent's socket is not one the protocol has: unknown ``op``, a field
    missing, unknown, ill-typed or out of range. The message names the field."""
