"""The node agent's settings: one validated dataclass (the `agent` CLI flags come from it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from flashckpt.cliargs import flag
from flashckpt.monitor import MonitorConfig
from flashckpt.names import check_name
from flashckpt.protocol import default_node_id, default_run_dir

__all__ = ["AgentConfig"]


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
    unused_timeout: float = 30.0
    """With ``exit_when_done``: exit if no trainer connected within this many seconds and there
    are no snapshots to keep (an agent a trainer started while another one was answering); also
    exit this many seconds after the last trainer left (finished, failed at entry or killed)
    once storage holds everything memory does."""
    poll_interval: float = 0.2
    """Seconds between scans of the slots when no trainer notifies."""
    commit_timeout: float = 120.0
    """How long the committing node waits for the other nodes' parts of a step."""
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
    monitor: MonitorConfig = field(
        default_factory=MonitorConfig, metadata=flag(derived="the monitoring flags")
    )
    """Step monitoring, hang and straggler detection, metrics endpoint, events and goodput."""

    def __post_init__(self) -> None:
        check_name("job", self.job)
        check_name("node", self.node)
        if self.keep < 1:
            raise ValueError(f"keep={self.keep}: keep at least 1 committed step")
        if self.idle_timeout <= 0:
            raise ValueError(f"idle_timeout={self.idle_timeout}: must be > 0 seconds")
        if self.orphan_age_s < 0:
            raise ValueError(f"orphan_age_s={self.orphan_age_s}: must be >= 0 seconds")
