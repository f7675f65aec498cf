"""The node agent's settings: one validated dataclass (the `agent` CLI flags come from it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from flashckpt.cliargs import flag
from flashckpt.monitor.step_monitor import MonitorConfig
from flashckpt.names import check_name
from flashckpt.protocol.channel import default_node_id, default_run_dir

__all__ = ["AgentConfig", "parse_host_port"]


@dataclass(kw_only=True, slots=True)
class AgentConfig:
    """Settings of a node agent."""

    job: str
    """Job id: names the shared-memory segments and the socket."""
    node: str = field(default_factory=default_node_id)
    """Node (machine) id; several simulated machines on one host need distinct ids."""
    storage: str | None = field(default=None, metadata=flag(help="checkpoint root URL (fsspec)"))
    """Checkpoint root URL; None keeps snapshots in memory only (a trainer may supply it)."""
    shm_dir: str = "/dev/shm"
    """The tmpfs holding the slots."""
    run_dir: str = field(default_factory=default_run_dir)
    """Directory of the socket, lock and log files."""
    keep: int = field(default=3, metadata=flag(help="committed steps to keep"))
    """Committed steps kept in storage."""
    storage_file_mode: int = field(
        default=0o600,
        metadata=flag(
            "--shared-read",
            action="store_true",
            to_field=lambda shared: 0o644 if shared else 0o600,
            help="make checkpoint files readable by everyone (0644, directories 0755); by "
            "default they are private to the user (0600/0700)",
        ),
    )
    """Permission bits of the checkpoint files written to a local file system (directories get
    the matching execute bits): private by default; ``0o644`` shares read access."""
    idle_timeout: float = 600.0
    """Exit (after persisting) when no trainer has been connected for this long."""
    orphan_age_s: float = field(
        default=86400.0,
        metadata=flag(
            "--orphan-age",
            help="seconds a dead agent's segments stay untouched before another job's agent "
            "removes them (default a day; `flashckpt clean` removes them on demand)",
        ),
    )
    """Another job's segments are removed at start only when their agent is dead and none of
    their files changed for this many seconds (abandoned); younger ones may still be wanted by
    that job's next agent. ``flashckpt clean`` removes them on demand."""
    exit_when_done: bool = False
    """Exit once every rank said done and everything is persisted (auto-started agents)."""
    free_finished: bool = False
    """Free a finished job's snapshot slots once storage holds its newest step, then exit (a
    long-lived agent: the DaemonSet's, the systemd unit's; restarted, it holds nothing): the host
    memory returns when the job ends. Off: the slots (and replicas held for other machines) stay
    until the agent stops."""
    unused_timeout: float = 30.0
    """With ``exit_when_done``: exit this many seconds after the last trainer left once storage
    holds everything memory does, or when no trainer connected within it and nothing is kept.
    docs/node-agent.md."""
    poll_interval: float = 5.0
    """Seconds an idle background thread waits before it looks again uninvited: a safety net only,
    its work wakes it at once. docs/node-agent.md."""
    commit_timeout: float = 120.0
    """How long the committing node waits for the other nodes' parts of a step."""
    stop_timeout: float = 60.0
    """The longest the agent's stop (a signal, its launcher's death, the idle timeout) spends
    writing what storage lacks and waiting for its commit; what it could not write stays in shared
    memory. docs/node-agent.md."""
    retry_interval: float = 2.0
    """Pause after a persistence error before the next attempt."""
    write_through_private: bool = field(
        default=True,
        metadata=flag(
            "--no-write-through-private",
            help="write the ranks' small private state (RNG, extras) with the step only, not at "
            "once with each snapshot",
        ),
    )
    """Write each snapshot's small per-rank state (RNG, extras) to storage at once, so a rank
    whose machine dies can resume from a replica's memory with its own RNG and extras."""
    replicas: int = field(
        default=1,
        metadata=flag(
            help="replicas of this machine's newest snapshot kept in other machines' memory "
            "(0: off; the peers come from --replica-peers or from the launcher)"
        ),
    )
    """How many other machines (the next in ring order of the world's machine ids) keep a copy of
    this machine's newest complete snapshot in their shared memory; 0 turns replication off.
    docs/elastic.md."""
    replica_listen: str = field(default="", metadata=flag(metavar="HOST:PORT"))
    """Where this agent's replica server listens for other machines' replicas (``host:port``
    on the cluster network; port 0: one the OS picks, shown in the log and ``status``); empty:
    no server, this machine holds no replicas."""
    replica_peers: str = field(default="", metadata=flag(metavar="NODE=HOST:PORT,..."))
    """The other machines of the world and their replica servers, ``node=host:port`` separated
    by commas (the launcher passes them from its membership); empty: nowhere to send replicas."""
    replica_limit_bytes: int = field(
        default=0,
        metadata=flag(
            help="the most bytes of other machines' replicas held at once (default 0: replicas "
            "x this machine's own slot bytes, known once its trainers allocated their slots)"
        ),
    )
    """The most bytes of other machines' replicas this agent holds at once; 0 derives it:
    ``replicas`` x this machine's own slot bytes. docs/elastic.md."""
    monitor: MonitorConfig = field(
        default_factory=MonitorConfig, metadata=flag(derived="the monitoring flags")
    )
    """Step monitoring, hang and straggler detection, metrics endpoint, events and goodput."""

    def __post_init__(self) -> None:
        check_name("job", self.job)
        check_name("node", self.node)
        if self.keep < 1:
            raise ValueError(f"keep={self.keep}: keep at least 1 committed step")
        if self.poll_interval <= 0:
            raise ValueError(f"poll_interval={self.poll_interval}: must be > 0 seconds")
        if self.stop_timeout < 0:
            raise ValueError(f"stop_timeout={self.stop_timeout}: must be >= 0 seconds")
        if self.idle_timeout <= 0:
            raise ValueError(f"idle_timeout={self.idle_timeout}: must be > 0 seconds")
        if self.orphan_age_s < 0:
            raise ValueError(f"orphan_age_s={self.orphan_age_s}: must be >= 0 seconds")
        if self.replicas < 0:
            raise ValueError(f"replicas={self.replicas}: must be >= 0 (0 turns replication off)")
        if self.replica_limit_bytes < 0:
            raise ValueError(
                f"replica_limit_bytes={self.replica_limit_bytes}: must be >= 0 (0: derived)"
            )
        if self.replica_listen:
            parse_host_port(self.replica_listen, "replica_listen", allow_zero=True)
        self.replica_peer_addrs()  # raises on a bad list

    def replica_listen_addr(self) -> tuple[str, int] | None:
        """``replica_listen`` as (host, port); None when no server is to run."""
        if not self.replica_listen:
            return None
        return parse_host_port(self.replica_listen, "replica_listen", allow_zero=True)

    def replica_peer_addrs(self) -> dict[str, tuple[str, int]]:
        """``replica_peers`` as node id -> (host, port), checked: valid node ids, each once,
        never this machine's own."""
        out: dict[str, tuple[str, int]] = {}
        for item in self.replica_peers.split(","):
            item = item.strip()
            if not item:
                continue
            node, eq, addr = item.partition("=")
            if not eq:
                raise ValueError(
                    f"replica_peers entry {item!r} is not node=host:port "
                    "(e.g. node1=10.0.0.2:7070,node2=10.0.0.3:7070)"
                )
            try:
                check_name("node", node.strip())
            except ValueError as e:
                raise ValueError(f"replica_peers entry {item!r}: {e}") from None
            node = node.strip()
            if node == self.node:
                raise ValueError(
                    f"replica_peers names this machine's own node {node!r}: a replica must sit "
                    "on another machine; list only the other machines"
                )
            if node in out:
                raise ValueError(f"replica_peers names node {node!r} twice")
            out[node] = parse_host_port(addr.strip(), f"replica_peers entry {item!r}")
        return out


def parse_host_port(text: str, what: str, *, allow_zero: bool = False) -> tuple[str, int]:
    """``host:port`` (``[v6addr]:port`` for IPv6) as (host, port); ValueError naming ``what``
    and the expected form otherwise."""
    host, sep, port_text = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        # "fd00::2:7070" reads as address fd00::2 port 7070 or as address fd00::2:7070 with no
        # port: never guessed.
        raise ValueError(
            f"{what}: {text!r} is an IPv6 address without brackets; write it as [address]:port "
            "(e.g. [fd00::2]:7070, [::1]:0)"
        )
    lo = 0 if allow_zero else 1
    ok = bool(sep and host and port_text.isdigit()) and not any(c in host for c in " /[]")
    port = int(port_text) if ok else -1
    if not ok or not lo <= port <= 65535:
        raise ValueError(
            f"{what}: {text!r} is not host:port with a port in {lo}-65535 "
            "(e.g. 10.0.0.2:7070, [fd00::2]:7070)"
        )
    return host, port
