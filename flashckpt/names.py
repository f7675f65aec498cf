"""The names of every file flashckpt keeps on a machine: shared-memory segments (slots, step
rings, the agent's owner file), the agent's socket, lock and logs, the monitor's event log, and
the launcher's per-generation directories. Each name is built by one function here.

The names are a format: agents, trainers and ``flashckpt status`` of different processes (and
versions) find each other's files by them, so they must not change. A job or node id is 1-64
characters from ``A-Z a-z 0-9 _ -`` (:func:`check_name`), so it can never contain the dots that
separate the parts of a name. Bottom layer: imports nothing of the project, no torch.
"""

from __future__ import annotations

import os
import re

__all__ = [
    "GROUP_NAME_RE",
    "ID_RE",
    "RETIRED_RING_SUFFIX_RE",
    "SLOT_NAME_RE",
    "SLOT_SUFFIX_RE",
    "agent_log_path",
    "check_name",
    "events_path",
    "generation_log_path",
    "generation_run_dir",
    "generation_shm_dir",
    "generation_shm_prefix",
    "goodput_report_path",
    "lock_path",
    "owner_path",
    "prewarm_log_path",
    "prewarm_socket_path",
    "rank_lock_path",
    "replica_path",
    "retired_ring_path",
    "ring_path",
    "slot_path",
    "slot_prefix",
    "socket_path",
    "stacks_path",
]

ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
"""A valid job or node id."""

SLOT_NAME_RE = re.compile(r"^fc\.([A-Za-z0-9_-]+)\.([A-Za-z0-9_-]+)\.r(\d{5})\.s([01])$")
"""A slot segment's file name: groups job, node, rank, slot index."""
SLOT_SUFFIX_RE = re.compile(r"r(\d{5})\.s[01]")
"""What follows :func:`slot_prefix` in a slot's name: group rank."""
GROUP_NAME_RE = re.compile(r"^fc\.([A-Za-z0-9_-]{1,64})\.([A-Za-z0-9_-]{1,64})\.")
"""The start of any segment of one job's agent on one node: groups job, node."""


def check_name(kind: str, value: str) -> str:
    """Validates a job or node id used in shared-memory and socket names."""
    if not ID_RE.match(value):
        raise ValueError(
            f"{kind} {value!r} is not a valid id: use 1-64 characters from A-Z a-z 0-9 _ -"
        )
    return value


# -- shared memory (the agent's ``--shm-dir``) -------------------------------------------------


def slot_prefix(job: str, node: str) -> str:
    """The start of the name of every segment of ``job`` on ``node``: ``fc.<job>.<node>.``."""
    return f"fc.{job}.{node}."


def slot_path(shm_dir: str, job: str, node: str, rank: int, index: int) -> str:
    """Path of slot ``index`` (0 or 1) of ``rank``."""
    return os.path.join(shm_dir, f"{slot_prefix(job, node)}r{rank:05d}.s{index}")


def ring_path(shm_dir: str, job: str, node: str, rank: int) -> str:
    """Path of ``rank``'s step ring (the trainer's monitoring segment)."""
    return os.path.join(shm_dir, f"{slot_prefix(job, node)}r{rank:05d}.mon")


def retired_ring_path(ring: str, token: str) -> str:
    """Where the step ring at ``ring`` (:func:`ring_path`) of the process named by ``token``
    (16 hex digits) is kept for the node agent once the rank's next process replaced it."""
    return f"{ring}.{token}"


RETIRED_RING_SUFFIX_RE = re.compile(r"\.[0-9a-f]{16}")
"""What :func:`retired_ring_path` appends to a ring's path."""


def owner_path(shm_dir: str, job: str, node: str) -> str:
    """Path of the owner file of the agent of ``job`` on ``node`` (its pid and start time)."""
    return os.path.join(shm_dir, f"{slot_prefix(job, node)}owner")


def replica_path(shm_dir: str, job: str, holder: str, sender: str, rank: int) -> str:
    """Path of the replica that machine ``holder`` keeps of machine ``sender``'s ``rank``.

    It starts with ``holder``'s prefix (its agent owns and removes it, and ``flashckpt clean``
    finds it with the rest of that agent's segments) and never matches :data:`SLOT_NAME_RE`.
    """
    check_name("node", sender)
    return os.path.join(shm_dir, f"{slot_prefix(job, holder)}rep.{sender}.r{rank:05d}")


# -- the agent's run directory ------------------------------------------------------------------


def socket_path(run_dir: str, job: str, node: str) -> str:
    """The agent's Unix socket."""
    return os.path.join(run_dir, f"{job}.{node}.sock")


def lock_path(run_dir: str, job: str, node: str) -> str:
    """The agent's lock file (one agent per job and node)."""
    return os.path.join(run_dir, f"{job}.{node}.lock")


def rank_lock_path(run_dir: str, job: str, node: str, rank: int) -> str:
    """The lock a trainer holds while its checkpointer is entered (one live process per job,
    node and rank); it holds that process's pid."""
    return os.path.join(run_dir, f"{job}.{node}.rank{rank}.lock")


def agent_log_path(run_dir: str, job: str, node: str) -> str:
    """The log of an agent a trainer (or ``flashckpt agent``) started."""
    return os.path.join(run_dir, f"{job}.{node}.log")


def stacks_path(run_dir: str, job: str, node: str, rank: int) -> str:
    """Where ``rank`` dumps its Python stacks when the monitor asks (a hang)."""
    return os.path.join(run_dir, f"{job}.{node}.r{rank:05d}.stacks.log")


def events_path(events_dir: str, job: str, node: str) -> str:
    """The agent monitor's JSON-lines event log."""
    return os.path.join(events_dir, f"{job}.{node}.events.jsonl")


def goodput_report_path(events_dir: str, job: str, node: str) -> str:
    """The agent monitor's goodput report."""
    return os.path.join(events_dir, f"{job}.{node}.goodput.txt")


# -- the launcher (``flashckpt run``) -------------------------------------------------------------


def generation_run_dir(run_dir: str, job: str, node: str, number: int) -> str:
    """The run directory of the launcher's node agent generation ``number``."""
    return os.path.join(run_dir, f"{job}.{node}.g{number}")


def generation_log_path(run_dir: str, job: str, node: str, number: int) -> str:
    """The log of the launcher's node agent generation ``number``."""
    return os.path.join(run_dir, f"{job}.{node}.g{number}.log")


def generation_shm_prefix(job: str, node: str) -> str:
    """The start of the name of every generation's shared-memory directory."""
    return f"flashckpt.{job}.{node}.g"


def generation_shm_dir(shm_dir: str, job: str, node: str, number: int) -> str:
    """The shared-memory directory of the launcher's node agent generation ``number``."""
    return os.path.join(shm_dir, f"{generation_shm_prefix(job, node)}{number}")


def prewarm_socket_path(run_dir: str, job: str, node: str) -> str:
    """The socket of the launcher's pre-warmed zygote."""
    return os.path.join(run_dir, f"{job}.{node}.prewarm")


def prewarm_log_path(run_dir: str, job: str, node: str) -> str:
    """The log of the launcher's pre-warmed zygote."""
    return os.path.join(run_dir, f"{job}.{node}.prewarm.log")
