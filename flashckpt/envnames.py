"""The ``FLASHCKPT_*`` environment variables, and their readers: one place for the contract
between ``flashckpt run`` (which sets them in the workers' environment) and the trainer, the
node agent and the worker entry point (which read them).

The names are public: users set them by hand outside ``flashckpt run`` (e.g. under torchrun).
Bottom layer: imports nothing of the project, no torch.
"""

from __future__ import annotations

import os

__all__ = [
    "ALL",
    "ETCD_CA",
    "ETCD_CERT",
    "ETCD_KEY",
    "ETCD_PASSWORD",
    "ETCD_PASSWORD_FILE",
    "ETCD_USER",
    "INJECT_HEALTH_FAULT",
    "JOB",
    "JOB_START",
    "LAUNCHER_PID",
    "NODE",
    "PREWARM_SOCKET",
    "RUN_DIR",
    "SHM_DIR",
    "STORAGE",
    "STORAGE_OPTIONS_FILE",
    "WORKER_ERRORS",
    "WORKER_FAST_EXIT",
    "WORLD_ID",
    "get",
    "job",
    "node",
    "run_dir",
    "shm_dir",
    "world_id",
]

JOB = "FLASHCKPT_JOB"
"""The job id (names the shared-memory segments and the agent); ``flashckpt run``: --rdzv-id."""
NODE = "FLASHCKPT_NODE"
"""This machine's node id; ``flashckpt run``: --node-id."""
RUN_DIR = "FLASHCKPT_RUN_DIR"
"""Directory of the node agent's socket and logs (of the launcher's current agent)."""
SHM_DIR = "FLASHCKPT_SHM_DIR"
"""Directory of the shared-memory slots (of the launcher's current agent)."""
STORAGE = "FLASHCKPT_STORAGE"
"""``flashckpt run --storage``, for the training script's own use."""
STORAGE_OPTIONS_FILE = "FLASHCKPT_STORAGE_OPTIONS_FILE"
"""A 0600 JSON file of the user's own, ``{url: fsspec options}``: the ``storage_options=`` of
the roots named (set by a trainer for the node agent it starts; secrets never go on a command
line). A file another user can read or write is refused."""
WORLD_ID = "FLASHCKPT_WORLD_ID"
"""Names the world (rendezvous round) a rank belongs to, overriding the default."""
JOB_START = "FLASHCKPT_JOB_START"
"""Wall-clock time (``time.time()``) the launcher started; set by ``flashckpt run``."""
LAUNCHER_PID = "FLASHCKPT_LAUNCHER_PID"
"""Set by the launcher to its pid; a worker whose parent is not this pid exits at once."""
PREWARM_SOCKET = "FLASHCKPT_PREWARM_SOCKET"
"""Set by the launcher in the workers' environment: the pre-warmed zygote's socket."""
WORKER_FAST_EXIT = "FLASHCKPT_WORKER_FAST_EXIT"
"""``0`` disables the immediate exit of a worker that failed with an exception."""
WORKER_ERRORS = "FLASHCKPT_WORKER_ERRORS"
"""Set by ``flashckpt run`` in the workers' environment: a directory where a worker that fails
with an error no restart can mend (a ``FlashckptError`` whose ``restartable`` is false) records
it, so the launcher fails at once with its text instead of restarting the workers."""
INJECT_HEALTH_FAULT = "FLASHCKPT_INJECT_HEALTH_FAULT"
"""Fault injection for tests: when ``1``, this machine's compute checksum comes out wrong."""
ETCD_CA = "FLASHCKPT_ETCD_CA"
"""CA bundle (PEM) that signed etcd's server certificate; ``flashckpt run``/``status``:
--etcd-ca, torchrun: ``--rdzv-conf ca_cert=``. Endpoints without a scheme are then https."""
ETCD_CERT = "FLASHCKPT_ETCD_CERT"
"""This machine's etcd client certificate (PEM), for an etcd with ``--client-cert-auth``;
--etcd-cert, torchrun: ``ssl_cert=``."""
ETCD_KEY = "FLASHCKPT_ETCD_KEY"
"""The private key of the etcd client certificate; --etcd-key, torchrun: ``ssl_cert_key=``."""
ETCD_USER = "FLASHCKPT_ETCD_USER"
"""etcd user (etcd's ``auth enable``); --etcd-user, torchrun: ``user=``."""
ETCD_PASSWORD = "FLASHCKPT_ETCD_PASSWORD"
"""The etcd user's password (never a flag: ``ps`` shows arguments)."""
ETCD_PASSWORD_FILE = "FLASHCKPT_ETCD_PASSWORD_FILE"
"""A file whose first line is the etcd user's password (a mounted secret); wins over
``FLASHCKPT_ETCD_PASSWORD``; --etcd-password-file, torchrun: ``password_file=``."""

ALL = (
    JOB,
    NODE,
    RUN_DIR,
    SHM_DIR,
    STORAGE,
    WORLD_ID,
    JOB_START,
    LAUNCHER_PID,
    PREWARM_SOCKET,
    WORKER_FAST_EXIT,
    INJECT_HEALTH_FAULT,
    WORKER_ERRORS,
    ETCD_CA,
    ETCD_CERT,
    ETCD_KEY,
    ETCD_USER,
    ETCD_PASSWORD,
    ETCD_PASSWORD_FILE,
    STORAGE_OPTIONS_FILE,
)
"""Every variable of this module."""


def get(name: str) -> str | None:
    """The variable's value, or ``None`` when it is unset or empty (an empty value means unset)."""
    value = os.environ.get(name)
    return value if value else None


def job() -> str | None:
    """``$FLASHCKPT_JOB``, or ``None``."""
    return get(JOB)


def node() -> str | None:
    """``$FLASHCKPT_NODE``, or ``None``."""
    return get(NODE)


def run_dir() -> str | None:
    """``$FLASHCKPT_RUN_DIR``, or ``None``."""
    return get(RUN_DIR)


def shm_dir() -> str | None:
    """``$FLASHCKPT_SHM_DIR``, or ``None``."""
    return get(SHM_DIR)


def world_id() -> str | None:
    """``$FLASHCKPT_WORLD_ID``, or ``None``."""
    return get(WORLD_ID)
