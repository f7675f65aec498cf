"""What one ``flashckpt run`` is told and what it reports: its configuration, its event log and
its error.

Below both :mod:`flashckpt.elastic.launch.launcher` (the command line, which builds a
:class:`LauncherConfig`) and :mod:`flashckpt.elastic.launch.session` (which runs one): neither
imports the other for these. Torch is imported only to validate ``--redirects``/``--tee``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from flashckpt import cliargs, names
from flashckpt.errors import ElasticJobError

__all__ = [
    "EventLog",
    "LaunchError",
    "LauncherConfig",
    "default_node_id",
    "default_shutdown_timeout",
    "derive_job_id",
    "parse_nnodes",
    "parse_nproc",
    "parse_ranks_filter",
    "parse_rdzv_conf",
]

logger = logging.getLogger("flashckpt.launcher")


class LaunchError(ElasticJobError, RuntimeError):
    """The launcher cannot run this machine: the message names the problem and the fix."""


def parse_nnodes(text: str) -> tuple[int, int]:
    """``--nnodes``: ``N`` or ``MIN:MAX`` machines."""
    parts = text.split(":")
    try:
        if len(parts) == 1:
            return int(parts[0]), int(parts[0])
        if len(parts) == 2:
            return int(parts[0]), int(parts[1])
    except ValueError:
        pass
    raise ValueError(f"--nnodes {text!r}: use N or MIN:MAX (e.g. 2:2, or 1:4 to scale)")


def parse_nproc(text: str) -> int:
    """``--nproc-per-node``: a number, ``gpu``, ``cpu`` or ``auto``."""
    if text == "cpu":
        return os.cpu_count() or 1
    if text in ("gpu", "auto"):
        import torch

        if torch.cuda.is_available():
            return torch.cuda.device_count()
        if text == "gpu":
            raise ValueError("--nproc-per-node gpu: no CUDA device is visible on this machine")
        return os.cpu_count() or 1
    try:
        return int(text)
    except ValueError:
        raise ValueError(
            f"--nproc-per-node {text!r}: use a number, 'gpu', 'cpu' or 'auto'"
        ) from None


def parse_rdzv_conf(text: str) -> dict[str, str]:
    """``--rdzv-conf``: ``key=value[,key=value...]``."""
    conf: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--rdzv-conf item {item!r}: use key=value[,key=value...]")
        conf[key.strip()] = value.strip()
    return conf


def parse_ranks_filter(text: str) -> frozenset[int] | None:
    """``--local-ranks-filter``: comma-separated local ranks (empty: no filter)."""
    if not text:
        return None
    try:
        return frozenset(int(r) for r in text.split(","))
    except ValueError:
        raise ValueError(
            f"--local-ranks-filter {text!r}: use a comma-separated list of local ranks, e.g. 0,1"
        ) from None


@dataclass(kw_only=True, slots=True)
class LauncherConfig:
    """Everything one ``flashckpt run`` needs; built from the command line by
    :func:`parse_args`."""

    entrypoint: str = field(metadata=cliargs.flag(derived="training_script"))
    """The training script (or module, with ``module=True``)."""
    entrypoint_args: list[str] = field(
        default_factory=list, metadata=cliargs.flag(derived="training_script_args")
    )
    """Its arguments."""
    module: bool = field(
        default=False,
        metadata=cliargs.flag(
            "-m", "--module", help="run the entry point as a Python module (python -m)"
        ),
    )
    """Run ``entrypoint`` as a module (``python -m``)."""
    min_nodes: int = field(default=1, metadata=cliargs.flag(derived="--nnodes"))
    """Smallest number of machines the job runs with."""
    max_nodes: int = field(default=1, metadata=cliargs.flag(derived="--nnodes"))
    """Largest number of machines the job runs with; more launchers are standbys."""
    nproc_per_node: int = field(
        default=1,
        metadata=cliargs.flag(
            "--nproc-per-node",
            "--nproc_per_node",
            parse=parse_nproc,
            help="workers per machine: a number, 'gpu', 'cpu' or 'auto'",
        ),
    )
    """Worker processes per machine."""
    rdzv_endpoint: str | None = field(
        default=None,
        metadata=cliargs.flag(
            "--rdzv-endpoint",
            "--rdzv_endpoint",
            help="etcd client URL(s) host:port[,host:port] shared by all machines",
        ),
    )
    """etcd client URL(s); ``None`` with ``standalone``."""
    rdzv_id: str = field(default="none", metadata=cliargs.flag(derived="--rdzv-id"))
    """The job id: every machine of a job uses the same; it also names the flashckpt job."""
    rdzv_id_origin: str | None = field(default=None, metadata=cliargs.flag(derived="--rdzv-id"))
    """What the job id was derived from (:func:`derive_job_id`); ``None`` when given."""
    rdzv_conf: dict[str, str] = field(
        default_factory=dict,
        metadata=cliargs.flag(
            "--rdzv-conf",
            "--rdzv_conf",
            parse=parse_rdzv_conf,
            help="rendezvous options key=value,...: join_timeout, last_call_timeout, "
            "keep_alive_interval, keep_alive_max_attempt, read_timeout, key_prefix, ...",
        ),
    )
    """Extra rendezvous options (torch's ``join_timeout``, ``last_call_timeout``,
    ``keep_alive_interval``..., ours: ``read_timeout``, ``key_prefix``...)."""
    etcd_ca: str | None = field(
        default=None,
        metadata=cliargs.flag(
            help="CA certificate (PEM) that signed etcd's server certificate; endpoints without "
            "a scheme are then https (default $FLASHCKPT_ETCD_CA)"
        ),
    )
    """CA bundle that signed etcd's certificate (rendezvous option ``ca_cert``)."""
    etcd_cert: str | None = field(
        default=None,
        metadata=cliargs.flag(
            help="this machine's etcd client certificate (PEM), for an etcd run with "
            "--client-cert-auth (default $FLASHCKPT_ETCD_CERT)"
        ),
    )
    """etcd client certificate (rendezvous option ``ssl_cert``)."""
    etcd_key: str | None = field(
        default=None,
        metadata=cliargs.flag(help="the private key of --etcd-cert (default $FLASHCKPT_ETCD_KEY)"),
    )
    """Key of the etcd client certificate (rendezvous option ``ssl_cert_key``)."""
    etcd_user: str | None = field(
        default=None,
        metadata=cliargs.flag(
            help="etcd user, for an etcd with auth enabled; its password in "
            "$FLASHCKPT_ETCD_PASSWORD or --etcd-password-file (default $FLASHCKPT_ETCD_USER)"
        ),
    )
    """etcd user (rendezvous option ``user``)."""
    etcd_password_file: str | None = field(
        default=None,
        metadata=cliargs.flag(
            help="file whose first line is the etcd user's password, e.g. a mounted secret "
            "(default $FLASHCKPT_ETCD_PASSWORD_FILE, then $FLASHCKPT_ETCD_PASSWORD)"
        ),
    )
    """File holding the etcd user's password (rendezvous option ``password_file``)."""
    standalone: bool = field(default=False, metadata=cliargs.flag(derived="--standalone"))
    """Start a private etcd on loopback (single machine)."""
    max_restarts: int = field(
        default=3,
        metadata=cliargs.flag(
            "--max-restarts",
            "--max_restarts",
            help="worker-group restarts after the workers' own failures before giving up (a "
            "failure because a machine of their round died is a membership change and is not "
            "counted)",
        ),
    )
    """Worker-group restarts after the workers' own failures before the launcher gives up; workers
    that fail because a machine of their round died restart without using one up.
    docs/elastic.md."""
    shutdown_timeout: float = field(
        default_factory=lambda: default_shutdown_timeout(),
        metadata=cliargs.flag(
            "--shutdown-timeout",
            "--shutdown_timeout",
            help="seconds after SIGTERM/SIGINT before workers are killed and the launcher has "
            "stopped (default $TORCH_ELASTIC_SHUTDOWN_TIMEOUT or 30, as torchrun)",
        ),
    )
    """Seconds from a SIGTERM/SIGINT until everything is stopped: the workers get SIGTERM and
    are killed after it (torchrun's ``--shutdown-timeout``, ``$TORCH_ELASTIC_SHUTDOWN_TIMEOUT``,
    30 s), then the node agent persists what it holds in what is left of it."""
    monitor_interval: float = field(
        default=0.1,
        metadata=cliargs.flag(
            "--monitor-interval", "--monitor_interval", help="seconds between checks of the workers"
        ),
    )
    """Seconds between checks of the workers."""
    local_addr: str | None = field(
        default=None,
        metadata=cliargs.flag(
            "--local-addr",
            "--local_addr",
            help="this machine's address as the others reach it (default: its FQDN)",
        ),
    )
    """This machine's address as other machines reach it (default: its FQDN)."""
    node_id: str = field(
        default_factory=lambda: default_node_id(),
        metadata=cliargs.flag(
            "--node-id",
            help="this machine's id in the job (default: host name); simulated machines on one "
            "host need distinct ids",
        ),
    )
    """This machine's id in the job; unique per machine."""
    storage: str | None = field(
        default=None,
        metadata=cliargs.flag(
            parse=cliargs.storage_url, help="checkpoint root URL for the node agent (fsspec)"
        ),
    )
    """Checkpoint root URL handed to the node agent (``None``: the trainers supply it)."""
    takeover: bool = field(
        default=False,
        metadata=cliargs.flag(
            help="use a --storage root that belongs to another job (its committed steps or "
            "its owner file name that job): this job resumes from its steps and owns it from "
            "now on"
        ),
    )
    """Take over a ``--storage`` root that belongs to another job (the launcher's check at
    start; a script's own ``storage=`` takes ``takeover=True``)."""
    rerun_finished: bool = field(
        default=False,
        metadata=cliargs.flag(
            help="run a job whose --rdzv-id finished (its rendezvous is closed in etcd) again: "
            "the workers resume from its committed state (e.g. to train with more steps); "
            "without it such a launcher refuses with exit code 2. To start over instead, use "
            "a new --rdzv-id and an empty --storage"
        ),
    )
    """Reopen a job that finished (its rendezvous closed in etcd, kept ~2 h after the end) and
    train again from its committed state; without it a launcher that finds its job finished
    refuses (exit code 2) instead of doing nothing. docs/elastic.md."""
    shm_dir: str = field(
        default="/dev/shm", metadata=cliargs.flag(help="where the node agent keeps snapshots")
    )
    """Where the node agent keeps snapshots."""
    run_dir: str | None = field(
        default=None,
        metadata=cliargs.flag(
            help="directory of the node agent's socket and logs (default: /tmp/flashckpt-<uid>)"
        ),
    )
    """Directory of the node agent's socket and logs (default ``/tmp/flashckpt-<uid>``)."""
    keep: int = field(default=3, metadata=cliargs.flag(help="committed steps kept in storage"))
    """Committed steps the node agent keeps in storage."""
    metrics_port: int | None = field(
        default=None,
        metadata=cliargs.flag(
            help="serve the node agent's Prometheus metrics on this port (default: off)"
        ),
    )
    """Port of the node agent's Prometheus endpoint (``None``: off)."""
    replicas: int = field(
        default=1,
        metadata=cliargs.flag(
            help="other machines of the world that keep a copy of this machine's newest "
            "snapshot in their memory (the next ones in ring order; default 1, 0 turns it off): "
            "a job that loses a machine restores its shards from a survivor's memory"
        ),
    )
    """How many other machines of the world keep a copy of this machine's newest snapshot in
    their memory (the node agent's ``--replicas``; 0: none, and this machine holds none)."""
    lease_ttl: float = field(
        default=5.0,
        metadata=cliargs.flag(
            help="seconds after which a machine that stopped renewing its etcd lease is declared "
            "dead"
        ),
    )
    """Seconds after its last lease renewal that a silent machine is declared dead."""
    probe: bool = field(
        default=True,
        metadata=cliargs.flag(
            "--no-probe",
            help="do not probe peers when workers fail or when a held link to a peer breaks; "
            "rely on lease expiry alone",
        ),
    )
    """Probe peers when workers fail, and hold a link to two peers' probe ports (a link that breaks
    gets its peer probed), to find dead machines before their lease lapses."""
    health_check: bool = field(
        default=False,
        metadata=cliargs.flag(
            help="before each round, run a compute + all-reduce probe; a machine that fails is "
            "recorded in etcd and not admitted again to this job"
        ),
    )
    """Run the compute + all-reduce probe before each round's workers start."""
    prewarm: bool = field(
        default=True,
        metadata=cliargs.flag(
            "--no-prewarm",
            help="start every worker as a fresh interpreter instead of forking it from a process "
            "that has already imported torch (needed for NUMA memory binding)",
        ),
    )
    """Fork workers from a process that has already imported torch
    (:mod:`flashckpt.elastic.launch.prewarm`)."""
    log_dir: str | None = field(
        default=None,
        metadata=cliargs.flag(
            "--log-dir",
            "--log_dir",
            help="base directory of the worker logs (a sub-directory per job id is created)",
        ),
    )
    """Where torch writes worker logs (default: a temporary directory); a job-level
    sub-directory named after the job id is created in it (torchrun's ``--log-dir``)."""
    redirects: str = field(
        default="0",
        metadata=cliargs.flag(
            "-r",
            "--redirects",
            help="redirect std streams of workers to log files in the log directory: 0-3 for all "
            "(1 stdout, 2 stderr, 3 both) or 0:1,1:2 per local rank (as torchrun)",
        ),
    )
    """torchrun's ``--redirects``: which std streams of which local ranks go to log files
    only (``3``: both for every rank; ``0:1,1:2``: stdout of rank 0, stderr of rank 1)."""
    tee: str = field(
        default="0",
        metadata=cliargs.flag(
            "-t",
            "--tee",
            help="like --redirects, but also show the streams on the console (as torchrun)",
        ),
    )
    """torchrun's ``--tee``: like ``redirects``, but the console still shows the stream."""
    local_ranks_filter: frozenset[int] | None = field(
        default=None,
        metadata=cliargs.flag(
            "--local-ranks-filter",
            "--local_ranks_filter",
            parse=parse_ranks_filter,
            help="only show these local ranks' output on the console, e.g. 0 or 0,1 (as torchrun)",
        ),
    )
    """torchrun's ``--local-ranks-filter``: only these local ranks' output reaches the
    console (log files are not filtered)."""
    no_python: bool = field(
        default=False,
        metadata=cliargs.flag(
            "--no-python",
            "--no_python",
            help="run the entry point directly (a binary or a shell script), not with python",
        ),
    )
    """torchrun's ``--no-python``: run the entry point directly, not with ``python``."""
    start_method: str = field(
        default="spawn",
        metadata=cliargs.flag(
            "--start-method",
            "--start_method",
            choices=("spawn", "fork", "forkserver"),
            help="multiprocessing start method (as torchrun: scripts always run as new processes)",
        ),
    )
    """torchrun's ``--start-method`` (``spawn``, ``fork``, ``forkserver``); as in torchrun it
    only applies to function entry points, a script always runs as a new process."""
    event_log: str | None = field(
        default=None,
        metadata=cliargs.flag(
            help="append lifecycle events (JSON lines with wall-clock times) to this file"
        ),
    )
    """Append lifecycle events (JSON lines with wall-clock times) to this file."""
    swap_stragglers: bool = field(
        default=False,
        metadata=cliargs.flag(
            help="leave the job for a waiting standby when this machine stays the slowest by "
            "--straggler-factor (checked every 2 s, 5 checks in a row)"
        ),
    )
    """Leave the job for a waiting standby when this machine is persistently the slowest
    (:mod:`flashckpt.elastic.membership.jobview`)."""
    straggler_factor: float = field(
        default=1.5,
        metadata=cliargs.flag(
            help="a machine slower than this many times the others' median is a straggler"
        ),
    )
    """Slower than this many times the other machines' median counts as a straggler."""

    def etcd_options(self) -> dict[str, str]:
        """The rendezvous options of the ``--etcd-*`` flags (``ca_cert``, ``ssl_cert``,
        ``ssl_cert_key``, ``user``, ``password_file``): given flags only, to lay over
        ``--rdzv-conf`` (and ``$FLASHCKPT_ETCD_*``, read where the client is made)."""
        given = (
            ("ca_cert", self.etcd_ca),
            ("ssl_cert", self.etcd_cert),
            ("ssl_cert_key", self.etcd_key),
            ("user", self.etcd_user),
            ("password_file", self.etcd_password_file),
        )
        return {option: value for option, value in given if value}

    def __post_init__(self) -> None:
        if self.min_nodes < 1 or self.max_nodes < self.min_nodes:
            raise ValueError(
                f"--nnodes {self.min_nodes}:{self.max_nodes}: use N or MIN:MAX with 1 <= MIN <= MAX"
            )
        if self.nproc_per_node < 1:
            raise ValueError(f"--nproc-per-node {self.nproc_per_node}: must be at least 1")
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts {self.max_restarts}: must be >= 0")
        from torch.distributed.elastic.multiprocessing import Std

        for flag, value in (("--redirects", self.redirects), ("--tee", self.tee)):
            try:
                Std.from_str(value)
            except ValueError:
                raise ValueError(
                    f"{flag} {value!r}: use 0-3 for every local rank (1 stdout, 2 stderr, 3 "
                    "both) or rank:value pairs such as 0:1,1:2"
                ) from None
        if self.local_ranks_filter is not None and (
            not self.local_ranks_filter or min(self.local_ranks_filter) < 0
        ):
            raise ValueError(
                "--local-ranks-filter: use a comma-separated list of local ranks, e.g. 0,1"
            )
        if self.start_method not in ("spawn", "fork", "forkserver"):
            raise ValueError(f"--start-method {self.start_method!r}: use spawn, fork or forkserver")
        if self.no_python and self.module:
            raise ValueError("use either --no-python or --module (-m), not both (as torchrun)")
        if self.shutdown_timeout < 0:
            raise ValueError(f"--shutdown-timeout {self.shutdown_timeout}: must be >= 0 seconds")
        if self.monitor_interval <= 0:
            raise ValueError(f"--monitor-interval {self.monitor_interval}: must be > 0 seconds")
        if self.lease_ttl < 2:
            raise ValueError(
                f"--lease-ttl {self.lease_ttl}: must be at least 2 s; a TTL near etcd's 1 s "
                "granularity declares healthy machines dead"
            )
        if self.keep < 1:
            raise ValueError(f"--keep {self.keep}: keep at least 1 committed step")
        if self.metrics_port is not None and not 0 < self.metrics_port < 65536:
            raise ValueError(f"--metrics-port {self.metrics_port}: use a TCP port (1-65535)")
        if self.replicas < 0:
            raise ValueError(f"--replicas {self.replicas}: must be >= 0 (0 turns replicas off)")
        if self.straggler_factor <= 1:
            raise ValueError(
                f"--straggler-factor {self.straggler_factor}: must be > 1 (e.g. 1.5: 50% slower "
                "than the other machines' median)"
            )
        for flag, value in (("--rdzv-id", self.rdzv_id), ("--node-id", self.node_id)):
            if not names.ID_RE.match(value):
                raise ValueError(
                    f"{flag} {value!r}: use 1-64 letters, digits, '-' or '_' (it names etcd "
                    "keys, shared-memory segments and sockets)"
                )
        if self.standalone:
            if self.rdzv_endpoint:
                raise ValueError(
                    "--standalone starts a private etcd: drop --rdzv-endpoint, or drop "
                    "--standalone to use the etcd at that endpoint"
                )
            if self.max_nodes != 1:
                raise ValueError(
                    f"--standalone runs one machine, but --nnodes is "
                    f"{self.min_nodes}:{self.max_nodes}; for several machines start etcd and "
                    "pass --rdzv-endpoint host:2379 to every launcher"
                )
        elif not self.rdzv_endpoint:
            raise ValueError(
                "no --rdzv-endpoint: pass the etcd client URL every machine of the job can "
                "reach (e.g. --rdzv-endpoint etcd-host:2379), or --standalone for a "
                "single-machine run"
            )
        elif self.rdzv_id == "none":
            raise ValueError(
                "multi-machine jobs need a job id shared by all their machines: pass "
                "--rdzv-id <id> to every launcher (without one it is derived only from an "
                "absolute --storage path or URL, the same on every machine)"
            )


JOB_ID_HELP = (
    "job id, the same on every machine (names the flashckpt job too). Default: derived, so "
    "that running the same command again finds the job's snapshots in memory: from --storage "
    "when it is a URL or an absolute path, else (--standalone only) from the training "
    "script's path, its arguments and the working directory; with a shared etcd and no such "
    "--storage it is required"
)
"""``--rdzv-id``'s help (the flag is declared by the launcher's parser)."""


def derive_job_id(
    *,
    storage: str | None,
    entrypoint: str,
    entrypoint_args: list[str],
    module: bool,
    standalone: bool,
    cwd: str | None = None,
) -> tuple[str, str] | None:
    """The job id of a launch without ``--rdzv-id``: the same for the same command, so a rerun
    after a crash or a kill finds the snapshots its node agent left in memory.

    Every machine of a job must derive the same id, so only what is the same on all of them
    counts: ``storage`` when it is a URL or an absolute path (a relative path depends on the
    working directory). A private etcd (``standalone``: one machine) also allows the training
    script's absolute path, its arguments and the working directory.

    Returns:
        ``(id, what it was derived from)``, or ``None`` when nothing may be derived (a shared
        etcd and no absolute storage): the caller requires ``--rdzv-id``.
    """
    cwd = os.getcwd() if cwd is None else cwd
    if storage:
        text = storage.rstrip("/") or storage
        if "://" not in text and not os.path.isabs(text):
            if not standalone:
                return None
            text = os.path.normpath(os.path.join(cwd, text))
        name = text.rsplit("/", 1)[-1]
        return _job_id(name, ["storage", text]), f"--storage {text}"
    if not standalone:
        return None
    target = entrypoint
    if not module and ("/" in entrypoint or os.path.exists(os.path.join(cwd, entrypoint))):
        target = os.path.normpath(os.path.join(cwd, entrypoint))
    name = entrypoint.rsplit(".", 1)[-1] if module else os.path.basename(entrypoint)
    name = name.removesuffix(".py")
    what = f"{'-m ' if module else ''}{target}"
    if entrypoint_args:
        what += f" and its {len(entrypoint_args)} argument(s)"
    return (
        _job_id(name, ["script", module, target, list(entrypoint_args), cwd]),
        f"{what} in {cwd}",
    )


def _job_id(name: str, parts: list[Any]) -> str:
    # A readable stem plus a digest of everything that tells jobs apart. Short: the id appears
    # twice in the node agent's socket path, which has a length limit.
    stem = re.sub(r"[^A-Za-z0-9_-]", "-", name).strip("-")[:12] or "job"
    digest = hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:10]
    return f"{stem}-{digest}"


def default_shutdown_timeout() -> float:
    """``$TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` (torchrun's variable), 30 s when unset."""
    text = os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30")
    try:
        return float(text)
    except ValueError:
        raise ValueError(
            f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT={text!r}: use a number of seconds (torchrun's "
            "default is 30)"
        ) from None


def default_node_id() -> str:
    """The host name, cut to a valid node id."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())[:64] or "node"


class EventLog:
    """Appends lifecycle events as JSON lines (``{"t": wall clock, "event": ..., ...}``).

    Used by the failover benchmark to break a recovery down; a no-op without a path.
    """

    def __init__(self, path: str | None, node_id: str) -> None:
        self._path = path
        self._node = node_id
        self._lock = threading.Lock()

    def __call__(self, event: str, **fields: Any) -> None:
        """Records one event. Never raises."""
        if not self._path:
            return
        line = json.dumps({"t": time.time(), "event": event, "node": self._node, **fields})
        try:
            with self._lock, open(self._path, "a") as f:
                f.write(line + "\n")
        except OSError as exc:
            logger.warning("cannot write event log %s: %s", self._path, exc)
