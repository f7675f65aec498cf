"""Launcher tests on machines that really are separate: :class:`SimCluster` on Linux namespaces.

Each machine's launcher (with its node agent and workers) runs in a machine of
:class:`flashckpt.testing.netns.Cluster`: its own network namespace and address on a private bridge,
its own hostname, its own ``/dev/shm``. etcd runs in the cluster's hub. Storage and the workers'
output directory stay on the shared file system (as a network file system would be); run directories
are per machine. Killing a machine SIGKILLs every process in its namespace, and its shared memory
disappears with them.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterable
from pathlib import Path

from elasticcluster import Machine, SimCluster, cluster_env

from flashckpt.testing import netns


class NsMachine(Machine):
    """A launcher on a namespaced machine; :meth:`kill` takes the whole machine down."""

    def __init__(self, host: netns.Machine, proc: subprocess.Popen[bytes], log: Path, ev: Path):
        super().__init__(host.name, proc, log, ev)
        self.host = host

    def kill(self) -> list[int]:
        """SIGKILLs every process of the machine at once; its memory goes with them."""
        pids = self.host.pids()
        self.host.kill()
        self.proc.wait(timeout=30)
        return pids


class NsSimCluster(SimCluster):
    """A :class:`SimCluster` whose machines live in their own namespaces (root only).

    Args:
        root: A per-test directory (``tmp_path``).
        net: The namespaces (the test owns it and closes it after this cluster).
        etcd_url: The etcd in ``net``'s hub.
        **kwargs: As :class:`SimCluster`.
    """

    def __init__(self, root: Path, net: netns.Cluster, etcd_url: str, **kwargs: object) -> None:
        super().__init__(root, etcd_url, **kwargs)  # type: ignore[arg-type]
        self.net = net

    def command(self, node_id: str, *extra: str, worker_args: Iterable[str] = ()) -> list[str]:
        cmd = super().command(node_id, *extra, worker_args=worker_args)
        host = self.net.machines[node_id]
        # Per-machine run dir and the machine's own /dev/shm; its own address for gloo and the
        # rendezvous.
        for flag, value in (
            ("--run-dir", f"{self.run_dir}/{node_id}"),
            ("--shm-dir", f"/dev/shm/{self.run_id}"),
            ("--local-addr", host.addr),
        ):
            cmd[cmd.index(flag) + 1] = value
        return cmd

    def start(
        self,
        node_id: str,
        *extra: str,
        env: dict[str, str] | None = None,
        worker_args: Iterable[str] = (),
    ) -> Machine:
        host = self.net.machines.get(node_id) or self.net.add(node_id)
        if not host.up:
            host.boot()
        host.run(["mkdir", "-p", f"/dev/shm/{self.run_id}"], check=True)
        env = dict(env or cluster_env())
        env["GLOO_SOCKET_IFNAME"] = "eth0"
        log = self.root / f"launcher-{node_id}.log"
        with open(log, "ab") as f:
            proc = host.popen(
                self.command(node_id, *extra, worker_args=worker_args),
                stdout=f,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=str(self.root),
            )
        machine = NsMachine(host, proc, log, self.root / f"launcher-{node_id}.jsonl")
        self.machines[node_id] = machine
        return machine

    def close(self) -> None:
        for host in self.net.machines.values():
            host.kill()
        super().close()
