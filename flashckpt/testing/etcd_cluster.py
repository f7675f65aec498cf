"""A multi-member etcd cluster on loopback, for tests and benchmarks of etcd failures that a
single member cannot show: a leader change, a quorum loss (a majority of members down: nothing
is written or read linearizably until it is back), a member that comes back.

Every member is an etcd process of its own (the binary of :func:`find_etcd_binary`) with its own
data directory, client port and peer port (chosen free by the OS); members are stopped with
SIGKILL and started again on the same ports and data, like a machine that reboots. The
processes die with the process that started them. Torch-free.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from datetime import timedelta
from pathlib import Path
from types import TracebackType

from flashckpt.elastic.deadline import Deadline
from flashckpt.elastic.etcd.server import (
    EtcdV3ServerError,
    etcd_command,
    find_etcd_binary,
    log_tail,
    wait_serving,
)
from flashckpt.elastic.procutil import die_with_parent
from flashckpt.testing.ports import free_ports

__all__ = ["EtcdCluster"]


class EtcdCluster:
    """``size`` etcd members on loopback forming one cluster.

    Args:
        root: An empty or not-yet-existing directory for the members' data and logs.
        size: Members (3 tolerates one down; two down lose the quorum).
        binary: The etcd executable; defaults to :func:`find_etcd_binary`.
    """

    def __init__(self, root: str | os.PathLike[str], *, size: int = 3, binary: str | None = None):
        if size < 1:
            raise ValueError(f"an etcd cluster has at least 1 member, got {size}")
        self._root = Path(root)
        self._binary = binary or find_etcd_binary()
        self._size = size
        ports = free_ports(2 * size)
        self._client_ports = ports[:size]
        self._peer_ports = ports[size:]
        self._procs: list[subprocess.Popen[bytes] | None] = [None] * size
        self._lock = threading.Lock()

    @property
    def size(self) -> int:
        """The number of members."""
        return self._size

    def client_url(self, member: int) -> str:
        """One member's client URL."""
        return f"http://127.0.0.1:{self._client_ports[member]}"

    @property
    def client_urls(self) -> list[str]:
        """Every member's client URL (what a client of the cluster is given)."""
        return [self.client_url(i) for i in range(self._size)]

    @property
    def endpoints(self) -> str:
        """The client URLs, comma-separated (``--rdzv-endpoint``)."""
        return ",".join(self.client_urls)

    def running(self, member: int) -> bool:
        """Whether a member's process is alive."""
        proc = self._procs[member]
        return proc is not None and proc.poll() is None

    def log_path(self, member: int) -> Path:
        """A member's log file."""
        return self._root / f"m{member}" / "etcd.log"

    def start(self, timeout: timedelta = timedelta(seconds=60)) -> None:
        """Starts every member and waits until each serves reads (the cluster has a leader).

        Raises:
            EtcdV3ServerError: A member exited or did not serve in time (every member is killed
                first; the error carries the end of its log).
        """
        try:
            for member in range(self._size):
                self._launch(member)
            deadline = Deadline.after(timeout)
            for member in range(self._size):
                self._wait(member, deadline)
        except BaseException:
            self.close()
            raise

    def kill(self, *members: int) -> None:
        """SIGKILLs members (a crash or a power loss); their data stays."""
        with self._lock:
            for member in members:
                proc = self._procs[member]
                if proc is not None and proc.poll() is None:
                    proc.kill()
                if proc is not None:
                    proc.wait()

    def revive(self, *members: int, timeout: timedelta = timedelta(seconds=60)) -> None:
        """Starts killed members again on their ports and data, and waits until each serves
        reads (which needs a quorum of the cluster up)."""
        for member in members:
            if self.running(member):
                raise EtcdV3ServerError(f"etcd member m{member} is running already")
            self._launch(member)
        deadline = Deadline.after(timeout)
        for member in members:
            self._wait(member, deadline)

    def close(self) -> None:
        """Kills every member. The data directories are left to their owner (``tmp_path``)."""
        self.kill(*range(self._size))

    def __enter__(self) -> EtcdCluster:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _launch(self, member: int) -> None:
        directory = self._root / f"m{member}"
        directory.mkdir(parents=True, exist_ok=True)
        peers = ",".join(f"m{i}=http://127.0.0.1:{port}" for i, port in enumerate(self._peer_ports))
        args = etcd_command(
            self._binary,
            name=f"m{member}",
            data_dir=directory / "data",
            client_url=self.client_url(member),
            peer_url=f"http://127.0.0.1:{self._peer_ports[member]}",
        )
        # etcd_command names a single-member cluster; this one has every member. A member
        # started again has its data directory, and etcd ignores these flags then.
        args = [a for a in args if not a.startswith("--initial-cluster=")]
        args += [
            f"--initial-cluster={peers}",
            "--initial-cluster-state=new",
            f"--initial-cluster-token=flashckpt-{self._peer_ports[0]}",
        ]
        with self._lock, open(directory / "etcd.log", "ab") as log:
            self._procs[member] = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
                preexec_fn=die_with_parent(signal.SIGKILL),
            )

    def _wait(self, member: int, deadline: Deadline) -> None:
        def check_alive() -> None:
            proc = self._procs[member]
            if proc is not None and proc.poll() is not None:
                raise EtcdV3ServerError(
                    f"etcd member m{member} exited with code {proc.returncode}; its log ends "
                    f"with:\n{log_tail(self.log_path(member))}"
                )

        wait_serving(
            self.client_url(member),
            deadline,
            check_alive=check_alive,
            log_tail=lambda: log_tail(self.log_path(member)),
        )
