"""Simulated machines for the launcher tests: one ``flashckpt run`` process tree per machine.

Each machine gets its own node id, its own shared-memory directory under
``/dev/shm/fce-<id>/<node>`` and its own launcher event log; they share the run directory (the
agents' sockets are named by node), the checkpoint storage and the worker's output directory.
:meth:`SimCluster.close` SIGKILLs every process of every machine (launchers, node agents,
workers, private etcd) and removes the shared-memory and run directories, whatever happened.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from flashckpt.format.storage import Storage
from flashckpt.testing.elastic import (
    kill_job,
    kill_processes,
    loopback_env,
    process_tree,
    read_jsonl,
)

WORKER = Path(__file__).with_name("_elastic_worker.py")


def cluster_env() -> dict[str, str]:
    """The environment of every simulated machine: this checkout, loopback gloo, one thread."""
    env = loopback_env()
    env.pop("FLASHCKPT_INJECT_HEALTH_FAULT", None)
    return env


def assert_same_model(out: Path, reference: dict[str, Any]) -> None:
    """The run that wrote ``out`` ended with the bitwise same model as the uninterrupted one."""
    import safetensors.torch
    import torch

    final = safetensors.torch.load_file(out / "final.safetensors")
    assert final.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(final[name], tensor), f"{name} differs from the uninterrupted run"


class Machine:
    """One simulated machine: a launcher process (its own session) and everything below it."""

    def __init__(self, node_id: str, proc: subprocess.Popen[bytes], log: Path, events: Path):
        self.node_id = node_id
        self.proc = proc
        self.log = log
        self.event_log = events

    def kill(self) -> list[int]:
        """SIGKILLs the launcher, its node agent and its workers at the same instant."""
        victims = process_tree(self.proc.pid)
        kill_processes(victims)
        self.proc.wait(timeout=30)
        return [p.pid for p in victims]

    def events(self) -> list[dict[str, Any]]:
        """The launcher's lifecycle events."""
        return read_jsonl(self.event_log)

    def tail(self, chars: int = 4000) -> str:
        """The end of the launcher's output."""
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"


class SimCluster:
    """Launchers of one job, started and killed at will, all cleaned up by :meth:`close`.

    Args:
        root: A per-test directory (``tmp_path``).
        etcd_url: The etcd every launcher uses; ``None`` for ``--standalone`` launchers.
        nnodes: ``--nnodes``.
        nproc: ``--nproc-per-node``.
        worker_args: Extra arguments of the training script, on every machine.
        launcher_args: Extra arguments of every launcher.
        worker: The training script (default: ``tests/support/_elastic_worker.py``).
    """

    def __init__(
        self,
        root: Path,
        etcd_url: str | None,
        *,
        nnodes: str = "2:2",
        nproc: int = 1,
        worker_args: Iterable[str] = (),
        launcher_args: Iterable[str] = (),
        worker: Path = WORKER,
    ) -> None:
        self.worker = worker
        self.uid = uuid.uuid4().hex[:10]
        self.run_id = f"fce-{self.uid}"
        self.root = root
        self.etcd_url = etcd_url
        self.nnodes = nnodes
        self.nproc = nproc
        self.run_dir = f"/tmp/{self.run_id}"
        self.shm_root = Path("/dev/shm") / self.run_id
        self.out = root / f"out-{self.run_id}"  # the id in every worker's command line
        self.out.mkdir(parents=True, exist_ok=True)
        self.storage_path = root / "ckpt"
        self.storage = f"file://{self.storage_path}"
        self.worker_args = list(worker_args)
        self.launcher_args = list(launcher_args)
        self.launcher_storage = True
        """Whether the launchers get ``--storage`` (False: the script's ``storage=`` only)."""
        self.machines: dict[str, Machine] = {}

    def command(self, node_id: str, *extra: str, worker_args: Iterable[str] = ()) -> list[str]:
        """The launcher command line of one machine.

        Args:
            node_id: The machine's node id.
            *extra: More launcher arguments.
            worker_args: More arguments of this machine's training script (after the cluster's).
        """
        cmd = [
            sys.executable,
            "-m",
            "flashckpt",
            "run",
            "--nnodes",
            self.nnodes,
            "--nproc-per-node",
            str(self.nproc),
            "--node-id",
            node_id,
            "--local-addr",
            "127.0.0.1",
            "--run-dir",
            self.run_dir,
            "--shm-dir",
            str(self.shm_root / node_id),
            *(["--storage", self.storage] if self.launcher_storage else []),
            "--event-log",
            str(self.root / f"launcher-{node_id}.jsonl"),
            "--log-dir",
            str(self.root / f"torchlogs-{node_id}"),
            *self.launcher_args,
            *extra,
        ]
        if self.etcd_url is None:
            cmd += ["--standalone", "--rdzv-id", self.run_id]
        else:
            cmd += ["--rdzv-endpoint", self.etcd_url, "--rdzv-id", self.run_id]
        cmd += [str(self.worker), "--out", str(self.out), "--storage", self.storage]
        return [*cmd, *self.worker_args, *worker_args]

    def start(
        self,
        node_id: str,
        *extra: str,
        env: dict[str, str] | None = None,
        worker_args: Iterable[str] = (),
    ) -> Machine:
        """Starts one machine's launcher in its own session (arguments as :meth:`command`)."""
        log = self.root / f"launcher-{node_id}.log"
        (self.shm_root / node_id).mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as f:
            proc = subprocess.Popen(
                self.command(node_id, *extra, worker_args=worker_args),
                stdout=f,
                stderr=subprocess.STDOUT,
                env=env or cluster_env(),
                cwd=self.root,
                start_new_session=True,
            )
        machine = Machine(node_id, proc, log, self.root / f"launcher-{node_id}.jsonl")
        self.machines[node_id] = machine
        return machine

    def events(self) -> list[dict[str, Any]]:
        """Every worker event so far."""
        return read_jsonl(self.out / "events.jsonl")

    def steps(self) -> list[int]:
        """Steps reported done, in order of report."""
        return [e["step"] for e in self.events() if e["event"] == "step"]

    def restored_since(self, t: float) -> list[dict[str, Any]]:
        """The workers' ``restored`` events after time ``t`` (a kill or a join)."""
        return [e for e in self.events() if e["event"] == "restored" and e["t"] > t]

    def rank0_node(self) -> str:
        """The machine that hosted rank 0 when the workers last restored."""
        return next(
            e["node"]
            for e in reversed(self.events())
            if e["event"] == "restored" and e["rank"] == 0
        )

    def committed(self) -> list[int]:
        """The steps committed in the job's storage so far ([] while it does not exist yet)."""
        try:
            return Storage(self.storage).committed_steps()
        except OSError:
            return []

    def wait_for(self, what: str, check: Callable[[], bool], timeout: float) -> None:
        """Polls ``check`` until it holds; fails with every log on timeout or launcher exit."""
        deadline = time.monotonic() + timeout
        while not check():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}\n{self.logs()}")
            time.sleep(0.05)

    def wait_exit(self, node_id: str, timeout: float) -> int:
        """Waits for one launcher to exit; returns its exit code."""
        machine = self.machines[node_id]
        try:
            return machine.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"launcher {node_id} did not exit\n{self.logs()}") from None

    def logs(self) -> str:
        """Every launcher's output and the agents' logs, for failure messages."""
        parts = [f"=== launcher {m.node_id}\n{m.tail()}" for m in self.machines.values()]
        for log in sorted(Path(self.run_dir).glob("*.log")) if Path(self.run_dir).exists() else []:
            parts.append(f"=== {log.name}\n{log.read_text(errors='replace')[-2000:]}")
        return "\n".join(parts)

    def close(self) -> None:
        """Kills every process of the job and removes its shared memory and run directory."""
        kill_job((m.proc for m in self.machines.values()), self.run_id)
        # Keep the node agents' logs with the test's other files, for post-mortems.
        run_dir = Path(self.run_dir)
        if run_dir.exists():
            kept = self.root / "agent-logs"
            kept.mkdir(exist_ok=True)
            for log in run_dir.rglob("*.log"):
                with contextlib.suppress(OSError):
                    shutil.copy(log, kept / log.name)
        shutil.rmtree(self.shm_root, ignore_errors=True)
        shutil.rmtree(self.run_dir, ignore_errors=True)
