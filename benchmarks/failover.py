"""Failover benchmark: time from killing a machine to the first training step after resume.

A tiny DDP job (``failover_worker.py``: gloo on loopback, 2 machines x 1 process, plus one
standby machine, all simulated on this host as separate launcher process trees) trains; the
machine that runs rank 0 is killed with SIGKILL (its launcher, node agent and worker at the same
instant, at a random point of a snapshot interval); the standby takes its place. Measured per
system, from worker and launcher timestamps:

- ``detect``: kill -> the first launcher reports the machine dead (flashckpt only; torchrun
  does not report it); ``detected_via`` in the JSON says how it learnt it (``link``: its held
  link to the victim's launcher closed; ``probe``: its workers failed and it probed;
  ``watch``: the victim's key went, its lease lapsed);
- ``rendezvous``: -> the new round is formed (flashckpt only);
- ``detect+rdzv``: kill -> the last new worker process is started;
- ``init``: -> every new worker has imported torch and joined the process group;
- ``restore``: -> every new worker has restored its state; in the JSON split at the model built
  (``model_s``: pg ready -> model and optimizer built, FSDP's ``fully_shard`` per layer included;
  ``entry_s``: -> the checkpointing block entered, the restore itself);
- ``first step``: -> every rank finished its first step after the resume (the headline number,
  ``total``, is kill -> here); in the JSON, ``train()`` alone (forward, backward, optimizer
  step) of a worker's first step and of later ones: ``train_first_fresh_s`` (the job's first
  workers: a fresh start, no restore), ``train_first_resumed_s`` (the resumed workers'),
  ``train_steady_s`` (the steps before the kill but each worker's first; flashckpt systems);
- ``lost``: steps done before the kill and computed again after it, against the snapshot
  interval.

Systems:

- ``flashckpt``: ``flashckpt run`` with its defaults (etcd v3 rendezvous, 5 s leases, links
  held between launchers and a peer probe when one breaks or workers fail, event-driven
  rendezvous, the node agent kept across rounds, workers forked
  from a pre-warmed process), resuming with
  ``flashckpt.checkpointing`` (memory or committed storage);
- ``flashckpt-lease-only``: the same with ``--no-probe`` (no links, no probes): a dead machine
  is found by its lease lapsing (what a power loss or network partition looks like);
- ``flashckpt-cold``: the same with ``--no-prewarm``: every worker is a fresh interpreter that
  imports torch, like torchrun's;
- ``flashckpt-peer``: ``flashckpt run`` defaults (replicas 1) without storage, and a sharded job
  instead (FSDP2, ``--peer-gib`` GiB of state per machine, default 0.25): the killed machine's
  shards exist only in the replica its agent sent to the survivor's agent, and the standby
  restores them from there (``restored_from`` ``peer-memory``). The machine killed is rank 1's
  (rank 0's, for the other systems): see ``run_once``;
- ``flashckpt-sharded-storage``: the same sharded job with ``--replicas 0`` and storage (every
  snapshot persisted, ``persist_every=1``): the standby restores the lost shards from storage
  (``restored_from`` ``storage``), the page cache of the storage directory as the run left it;
- ``torchrun-default``: plain ``torchrun`` with torch's c10d rendezvous and default keep-alive
  (5 s x 3), resuming from ``torch.save`` files written every interval by rank 0;
- ``torchrun-tuned``: the same with keep-alive 1 s x 3.

With ``--namespaces`` (root, Linux) every machine runs in its own network namespace, with its own
address on a private bridge, hostname and ``/dev/shm`` (``flashckpt/testing/netns.py``); etcd (or
torch's TCPStore) runs in the hub namespace, and a kill takes every process of the machine and its
shared memory at once. Without it, machines are process trees on this host's loopback.
``--socket-log`` (with ``--namespaces``) writes every machine's TCP sockets (``ss -tanpio``) at
0, 0.3, 1 and 3 s after each kill to ``socket-log-<victim>.txt`` in the run's directory: it
shows which connections a survivor still holds to a dead machine when a detection is slow.

Run from the repository root::

    python benchmarks/failover.py                     # every system, 3 kills each
    python benchmarks/failover.py --systems flashckpt --repeats 1
    python benchmarks/failover.py --namespaces        # machines that really are separate
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from flashckpt.elastic.etcd.server import EtcdV3Server
from flashckpt.testing import netns
from flashckpt.testing.elastic import (
    kill_job,
    kill_processes,
    loopback_env,
    process_tree,
    read_jsonl,
)

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).with_name("failover_worker.py")
SYSTEMS = (
    "flashckpt",
    "flashckpt-lease-only",
    "flashckpt-cold",
    "flashckpt-peer",
    "flashckpt-sharded-storage",
    "torchrun-tuned",
    "torchrun-default",
)


def _env(node: str, namespaced: bool) -> dict[str, str]:
    env = loopback_env()
    env["BENCH_NODE"] = node
    if namespaced:
        env["GLOO_SOCKET_IFNAME"] = "eth0"
    return env


class Job:
    """The machines of one benchmark run; :meth:`close` kills every process it started."""

    def __init__(self, system: str, work: Path, args: argparse.Namespace) -> None:
        self.system = system
        self.work = work
        self.args = args
        self.uid = "fo" + uuid.uuid4().hex[:10]
        self.out = work / f"out-{self.uid}"
        self.out.mkdir(parents=True)
        self.run_dir = f"/tmp/{self.uid}"
        self.shm_root = Path("/dev/shm") / self.uid
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.killed: set[str] = set()
        self.etcd: EtcdV3Server | None = None
        self.socket_logs: list[threading.Thread] = []
        self.store_host: subprocess.Popen[bytes] | None = None
        # Each machine's /dev/shm holds its two slots per rank and the replica it keeps with the
        # file that one replaced (reused by the next push): 4x its state, and some room.
        shm_gib = max(2, math.ceil(4.4 * args.peer_gib + 0.5))
        self.net: netns.Cluster | None = (
            netns.Cluster(shm_size=f"{shm_gib}g") if args.namespaces else None
        )
        try:
            self.endpoint = self._start_coordinator()
        except BaseException:
            self.close()
            raise

    @property
    def sharded(self) -> bool:
        return self.system in ("flashckpt-peer", "flashckpt-sharded-storage")

    @property
    def flashckpt(self) -> bool:
        return self.system.startswith("flashckpt")

    def _addr(self, node: str) -> str:
        return self.net.machines[node].addr if self.net is not None else "127.0.0.1"

    def _start_coordinator(self) -> str:
        if self.net is not None and self.flashckpt:
            return self.net.start_etcd(str(self.work / f"etcd-{self.uid}"))
        if self.flashckpt:
            self.etcd = EtcdV3Server(self.work / f"etcd-{self.uid}")
            return str(self.etcd.start())
        # torchrun's c10d rendezvous keeps its state in a TCPStore. Hosting it in a process of
        # its own keeps it alive when the machine that would otherwise host it is killed.
        code = (
            "import sys, time, torch.distributed as d\n"
            "s = d.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False, "
            "multi_tenant=True)\n"
            "print(s.port, flush=True)\n"
            "time.sleep(1e6)\n"
        )
        host = "127.0.0.1"
        if self.net is not None:
            host = self.net.hub_addr
            code = code.replace("'127.0.0.1'", repr(host))
            self.store_host = self.net.hub.popen(
                [sys.executable, "-c", code], stdout=subprocess.PIPE, env=loopback_env()
            )
        else:
            self.store_host = subprocess.Popen(
                [sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True
            )
        assert self.store_host.stdout is not None
        port = int(self.store_host.stdout.readline())
        return f"{host}:{port}"

    def command(self, node: str) -> list[str]:
        a = self.args
        worker = [
            str(WORKER),
            "--out",
            str(self.out),
            "--every",
            str(a.every),
            "--step-sleep",
            str(a.step_sleep),
        ]
        peer = self.system == "flashckpt-peer"
        sharded_storage = self.system == "flashckpt-sharded-storage"
        sharded = ["--fsdp-gib", str(a.peer_gib), "--fsdp-width", str(a.peer_width)]
        if peer:  # sharded, memory only: the lost shards can only come from a peer's replica
            worker += sharded
        if sharded_storage:  # sharded, no replicas: the lost shards come from storage
            worker += [*sharded, "--persist-every", "1"]
        if self.flashckpt:
            cmd = [
                sys.executable, "-m", "flashckpt", "run",
                "--nnodes", "2:2", "--nproc-per-node", "1",
                "--rdzv-endpoint", self.endpoint, "--rdzv-id", self.uid,
                "--node-id", node, "--local-addr", self._addr(node),
                "--run-dir", f"{self.run_dir}/{node}", "--shm-dir", str(self.shm_root / node),
                "--storage", f"file://{self.work}/ckpt-{self.uid}",
                "--event-log", str(self.work / f"launcher-{self.uid}-{node}.jsonl"),
                "--log-dir", str(self.work / f"logs-{self.uid}-{node}"),
            ]  # fmt: skip
            if self.system == "flashckpt-lease-only":
                cmd.append("--no-probe")
            if self.system == "flashckpt-cold":
                cmd.append("--no-prewarm")
            if sharded_storage:
                cmd += ["--replicas", "0"]
            if a.verbose:
                cmd.append("--verbose")
            if peer:
                at = cmd.index("--storage")
                del cmd[at : at + 2]
                return [*cmd, *worker, "--mode", "flashckpt", "--storage", ""]
            return [*cmd, *worker, "--mode", "flashckpt", "--storage", f"file://{self.work}/"
                    f"ckpt-{self.uid}"]  # fmt: skip
        conf = "is_host=0"
        if self.system == "torchrun-tuned":
            conf += ",keep_alive_interval=1,keep_alive_max_attempt=3"
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", "2:2", "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", self.endpoint, "--rdzv-id", self.uid,
            "--rdzv-conf", conf, "--max-restarts", "3", "--monitor-interval", "0.1",
            "--local-addr", self._addr(node),
            "--log-dir", str(self.work / f"logs-{self.uid}-{node}"),
        ]  # fmt: skip
        return [*cmd, *worker, "--mode", "torchsave", "--storage",
                str(self.work / f"torchsave-{self.uid}")]  # fmt: skip

    def start(self, node: str) -> None:
        log_path = self.work / f"launcher-{self.uid}-{node}.log"
        if self.net is not None:
            machine = self.net.add(node)
            machine.run(["mkdir", "-p", str(self.shm_root / node)], check=True)
            with open(log_path, "ab") as log:
                self.procs[node] = machine.popen(
                    self.command(node),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=_env(node, True),
                    cwd=str(self.work),
                )
            return
        (self.shm_root / node).mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            self.procs[node] = subprocess.Popen(
                self.command(node),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=_env(node, False),
                cwd=self.work,
                start_new_session=True,
            )

    def events(self) -> list[dict[str, Any]]:
        return read_jsonl(self.out / "events.jsonl")

    def launcher_events(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for node in self.procs:
            out += read_jsonl(self.work / f"launcher-{self.uid}-{node}.jsonl")
        return out

    def kill(self, node: str) -> float:
        if self.net is not None:  # every process of the machine, and its memory
            t = time.time()
            self.net.machines[node].kill()
            if self.args.socket_log:
                log = threading.Thread(target=self._log_sockets, args=(node, t), daemon=True)
                log.start()
                self.socket_logs.append(log)
            return t
        victims = process_tree(self.procs[node].pid)
        t = time.time()
        kill_processes(victims)
        psutil.wait_procs(victims, timeout=10)
        return t

    def _log_sockets(self, victim: str, t_kill: float) -> None:
        """Every machine's TCP sockets at a few moments after ``victim``'s kill."""
        assert self.net is not None
        with open(self.work / f"socket-log-{victim}.txt", "w") as f:
            for delay in (0.0, 0.3, 1.0, 3.0):
                time.sleep(max(0.0, t_kill + delay - time.time()))
                f.write(f"=== {time.time() - t_kill:+.2f} s after the kill of {victim}\n")
                for name, machine in self.net.machines.items():
                    ss = subprocess.run(
                        ["ip", "netns", "exec", machine.netns, "ss", "-tanpio"],
                        capture_output=True,
                        text=True,
                    )
                    f.write(f"--- {name} pids={machine.pids()}\n{ss.stdout}{ss.stderr}\n")

    def wait(self, what: str, check: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            for node, proc in self.procs.items():
                if proc.poll() is not None and node not in self.killed:
                    raise RuntimeError(f"launcher {node} exited with {proc.returncode}\n"
                                       f"{self.tail(node)}")  # fmt: skip
            if time.monotonic() > deadline:
                tails = "\n".join(self.tail(n) for n in self.procs)
                raise RuntimeError(f"timed out waiting for {what}\n{tails}")
            time.sleep(0.02)

    def tail(self, node: str) -> str:
        path = self.work / f"launcher-{self.uid}-{node}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return f"--- {node}\n{text[-3000:]}"

    def close(self) -> None:
        for log in self.socket_logs:
            log.join(timeout=10)
        launched = list(self.procs.values())
        if self.store_host is not None:
            launched.append(self.store_host)
        kill_job(launched, self.uid)
        if self.etcd is not None:
            self.etcd.close()
        if self.net is not None:
            self.net.close()
        shutil.rmtree(self.shm_root, ignore_errors=True)
        shutil.rmtree(self.run_dir, ignore_errors=True)


def run_once(
    system: str, work: Path, args: argparse.Namespace, rng: random.Random
) -> dict[str, Any]:
    """One kill (see ``lost_rank``); returns the measured times (seconds) and work lost."""
    job = Job(system, work, args)
    # A sharded job's step grows with its state (~2-4 s at 0.25 GiB per machine here, 17 s at 1).
    wait_s = 120.0 * max(1.0, 4 * args.peer_gib) if job.sharded else 120.0
    try:
        job.start("n0")
        job.start("n1")
        job.wait("training", lambda: _steps_done(job.events()) >= 5, wait_s)
        job.start("n2")
        # The standby must be waiting in the rendezvous, ready to start workers.
        if job.flashckpt:
            job.wait(
                "the standby",
                lambda: (
                    {"rendezvous_start", "warm"}
                    <= {e["event"] for e in job.launcher_events() if e["node"] == "n2"}
                ),
                120,
            )
        time.sleep(args.settle)
        # Kill at a random point of a snapshot interval: ``every`` steps of the job as it runs
        # (a sharded job's step takes seconds, far more than --step-sleep).
        time.sleep(rng.uniform(0, args.every * max(args.step_sleep, _step_interval(job.events()))))
        events = job.events()
        # The sharded systems lose the machine of rank 1 (the one whose shards are only in a
        # peer's replica or in storage; tests/elastic/launch/test_launcher_replica.py kills either).
        lost_rank = 1 if job.sharded else 0
        victim = next(
            e["node"] for e in reversed(events) if e["event"] == "start" and e["rank"] == lost_rank
        )
        job.killed.add(victim)
        t_kill = job.kill(victim)
        job.wait("the first step after the resume", lambda: _resumed(job.events(), t_kill), wait_s)
        time.sleep(0.2)
        return _measure(system, job, t_kill, args)
    finally:
        job.close()


def _rank(e: dict[str, Any]) -> int:
    return int(e["rank"])


def _step_interval(events: list[dict[str, Any]]) -> float:
    """The median interval between one rank's consecutive steps so far (0 before two)."""
    by_rank: dict[int, list[float]] = {}
    for e in events:
        if e["event"] == "step":
            by_rank.setdefault(e["rank"], []).append(e["t"])
    gaps = [b - a for times in by_rank.values() for a, b in itertools.pairwise(times)]
    return statistics.median(gaps) if gaps else 0.0


def _steps_done(events: list[dict[str, Any]]) -> int:
    ranks: dict[int, int] = {}
    for e in events:
        if e["event"] == "step":
            ranks[e["rank"]] = max(ranks.get(e["rank"], -1), e["step"])
    return min(ranks.values()) + 1 if len(ranks) >= 2 else 0


def _new_pids(events: list[dict[str, Any]], t_kill: float) -> set[int]:
    """Workers started after the kill (an old worker may still log a step just after it)."""
    return {e["pid"] for e in events if e["event"] == "start" and e["t_process"] > t_kill}


def _resumed(events: list[dict[str, Any]], t_kill: float) -> bool:
    new = _new_pids(events, t_kill)
    ranks = {e["rank"] for e in events if e["event"] == "step" and e["pid"] in new}
    return len(ranks) >= 2


def _first_pids(events: list[dict[str, Any]]) -> set[int]:
    """The job's first workers: the first ``start`` of each rank."""
    first: dict[int, int] = {}
    for e in sorted((e for e in events if e["event"] == "start"), key=lambda e: e["t"]):
        first.setdefault(e["rank"], e["pid"])
    return set(first.values())


def _first_train_s(events: list[dict[str, Any]]) -> float | None:
    """The slowest worker's ``train_s`` of its first step among ``events`` (None: not logged)."""
    first: dict[int, float] = {}
    for e in events:
        if e["event"] == "step" and e["pid"] not in first and e.get("train_s") is not None:
            first[e["pid"]] = e["train_s"]
    return max(first.values()) if first else None


def _after_first_steps(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The step events of each worker but its first."""
    seen: set[int] = set()
    out = []
    for e in events:
        if e["event"] != "step":
            continue
        if e["pid"] in seen:
            out.append(e)
        seen.add(e["pid"])
    return out


def _measure(system: str, job: Job, t_kill: float, args: argparse.Namespace) -> dict[str, Any]:
    events = job.events()
    new_pids = _new_pids(events, t_kill)
    before = [e for e in events if e["pid"] not in new_pids]
    after = [e for e in events if e["pid"] in new_pids]
    last_by_rank: dict[int, int] = {}
    for e in before:
        if e["event"] == "step" and e["t"] <= t_kill:
            last_by_rank[e["rank"]] = max(last_by_rank.get(e["rank"], -1), e["step"])
    last_done = min(last_by_rank.values())
    starts = [e for e in after if e["event"] == "start"]
    t_spawn = max(e["t_process"] for e in starts)
    t_pg = max(e["t"] for e in after if e["event"] == "pg_ready" and e["pid"] in new_pids)
    restored = [e for e in after if e["event"] == "restored" and e["pid"] in new_pids]
    t_restored = max(e["t"] for e in restored)
    # The restore's two parts: building the model (FSDP: one fully_shard per layer) and the
    # checkpointing block's entry (the restore itself), each the slowest worker's end.
    built = [e["t"] for e in after if e["event"] == "ddp_ready"]
    t_built = max(built) if built else None
    first_by_rank: dict[int, float] = {}
    for e in after:
        if e["event"] == "step" and e["rank"] not in first_by_rank:
            first_by_rank[e["rank"]] = e["t"]
    t_first = max(first_by_rank.values())
    # The first step after the resume against a steady one: the interval between one rank's
    # consecutive steps before the kill (it includes --step-sleep and any snapshot steps).
    steady = _step_interval([e for e in before if e["t"] <= t_kill]) or None
    # ``train()`` alone (forward, backward, optimizer step; no snapshot, no sleep): each
    # worker's first step against the steady ones, for the job's first workers (a fresh start:
    # no restore) and for the resumed ones. What a fresh process's first step costs anyway is
    # the job's own (FSDP2's lazy init, first-touch allocations), not the failover's.
    first_pids = _first_pids(events)
    fresh_first = _first_train_s([e for e in before if e["pid"] in first_pids])
    resumed_first = _first_train_s(after)
    later = [
        e["train_s"]
        for e in _after_first_steps([e for e in before if e["t"] <= t_kill])
        if e.get("train_s") is not None
    ]
    resume_step = restored[0]["start_step"]
    result: dict[str, Any] = {
        "system": system,
        "total_s": t_first - t_kill,
        "detect_rdzv_s": t_spawn - t_kill,
        "init_s": t_pg - t_spawn,
        "restore_s": t_restored - t_pg,
        "model_s": (t_built - t_pg) if t_built is not None else None,
        "entry_s": (t_restored - t_built) if t_built is not None else None,
        "first_step_s": t_first - t_restored,
        "first_step_by_rank_s": {
            str(r): t - max(e["t"] for e in restored if e["rank"] == r)
            for r, t in sorted(first_by_rank.items())
            if any(e["rank"] == r for e in restored)
        },
        "steady_step_s": steady,
        "train_first_fresh_s": fresh_first,
        "train_first_resumed_s": resumed_first,
        "train_steady_s": statistics.median(later) if later else None,
        "step_sleep_s": args.step_sleep,
        "last_step_done_before_kill": last_done,
        "resume_step": resume_step,
        "steps_recomputed": last_done + 1 - resume_step,
        "snapshot_interval": args.every,
        "restored_from": sorted({str(e["restored_from"]) for e in restored}),
        # Per new rank: its restore pipeline (inside the entry) and its pull's phases.
        "restore_pipeline_by_rank_s": {
            str(e["rank"]): e.get("restore_pipeline_s") for e in sorted(restored, key=_rank)
        },
        "entry_phases_by_rank_s": {
            str(e["rank"]): e.get("entry_phases_s") for e in sorted(restored, key=_rank)
        },
        "pull_phases_by_rank_s": {
            str(e["rank"]): e["pull_phases_s"]
            for e in sorted(restored, key=_rank)
            if e.get("pull_phases_s")
        },
    }
    if job.flashckpt:
        launcher = [e for e in job.launcher_events() if e["t"] > t_kill]
        lost = [e["t"] for e in launcher if e["event"] == "peer_lost"]
        rdzv = [e["t"] for e in launcher if e["event"] == "rendezvous_done"]
        if lost and rdzv:
            result["detect_s"] = min(lost) - t_kill
            result["rendezvous_s"] = max(rdzv) - min(lost)
            # How the first launcher learnt it: "link" (a held link to the victim's launcher
            # closed), "probe" (its workers failed and it probed), "watch" (the key went).
            first = min((e for e in launcher if e["event"] == "peer_lost"), key=lambda e: e["t"])
            result["detected_via"] = first.get("via")
    return result


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ["total_s", "detect_s", "rendezvous_s", "detect_rdzv_s", "init_s", "restore_s",
            "model_s", "entry_s", "first_step_s", "steady_step_s", "train_first_fresh_s",
            "train_first_resumed_s", "train_steady_s", "steps_recomputed"]  # fmt: skip
    out: dict[str, Any] = {"runs": len(runs)}
    for key in keys:
        values = [r[key] for r in runs if r.get(key) is not None]
        if values:
            out[key] = {"median": statistics.median(values), "min": min(values),
                        "max": max(values)}  # fmt: skip
    return out


def _table(summaries: dict[str, dict[str, Any]], every: int) -> str:
    cols = [("total", "total_s"), ("detect", "detect_s"), ("rdzv", "rendezvous_s"),
            ("detect+rdzv", "detect_rdzv_s"), ("init", "init_s"), ("restore", "restore_s"),
            ("1st step", "first_step_s")]  # fmt: skip
    lines = [
        "kill -> first step after resume, median seconds (min-max) over the runs; "
        f"steps recomputed vs snapshot interval {every}",
        f"{'system':<22}" + "".join(f"{c:>20}" for c, _ in cols) + f"{'recomputed':>14}",
    ]
    for system, s in summaries.items():
        row = f"{system:<22}"
        for _, key in cols:
            v = s.get(key)
            cell = "-" if v is None else f"{v['median']:.2f} ({v['min']:.2f}-{v['max']:.2f})"
            row += f"{cell:>20}"
        v = s.get("steps_recomputed")
        cell = "-" if v is None else f"{v['median']:.1f} ({v['min']:.0f}-{v['max']:.0f})"
        row += f"{cell:>14}"
        lines.append(row)
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--table", metavar="JSON", help="print the table of an earlier run and exit")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list of {SYSTEMS}")
    p.add_argument("--repeats", type=int, default=3, help="kills per system")
    p.add_argument("--every", type=int, default=5, help="snapshot interval (steps)")
    p.add_argument("--step-sleep", type=float, default=0.05, help="extra seconds per step")
    p.add_argument(
        "--settle",
        type=float,
        default=4.0,
        help="seconds the standby gets to reach the rendezvous before the kill",
    )
    p.add_argument(
        "--namespaces",
        action="store_true",
        help="every machine in its own network namespace, hostname and /dev/shm (root)",
    )
    p.add_argument(
        "--peer-gib",
        type=float,
        default=0.25,
        help="GiB of state per machine of the sharded systems' job (default 0.25)",
    )
    p.add_argument(
        "--peer-width",
        type=int,
        default=1024,
        help="width of the sharded job's Linear(W, W) layers (default 1024: 43 layers at 0.25 "
        "GiB per machine); wider layers hold the same state in fewer layers, so a step of "
        "FSDP2 over gloo makes fewer collectives",
    )
    p.add_argument(
        "--socket-log",
        action="store_true",
        help="with --namespaces: every machine's TCP sockets at 0, 0.3, 1, 3 s after each kill, "
        "in the run's directory (socket-log-<victim>.txt)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--verbose", action="store_true", help="debug logs from flashckpt run")
    p.add_argument(
        "--work-dir",
        default=None,
        help="keep every run's logs here (default: a temporary directory, removed)",
    )
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "failover.json"))
    args = p.parse_args()
    if args.table:
        with open(args.table) as f:
            saved = json.load(f)
        print(_table(saved["summary"], saved["settings"]["every"]))
        return 0
    if args.namespaces and (reason := netns.unavailable()) is not None:
        p.error(f"--namespaces: {reason}")
    if args.socket_log and not args.namespaces:
        p.error("--socket-log needs --namespaces (it reads each machine's network namespace)")
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    for s in systems:
        if s not in SYSTEMS:
            p.error(f"unknown system {s!r}; choose from {SYSTEMS}")
    rng = random.Random(args.seed)
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    errors: list[str] = []
    with contextlib.ExitStack() as stack:
        if args.work_dir:
            tmp = args.work_dir
            os.makedirs(tmp, exist_ok=True)
        else:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="fc-failover-"))
        for i in range(args.repeats):
            for system in systems:
                work = Path(tmp) / f"{system}-{i}"
                work.mkdir()
                try:
                    result = run_once(system, work, args, rng)
                except Exception as exc:
                    errors.append(f"{system} run {i}: {exc}")
                    print(f"{system} run {i} FAILED: {str(exc)[:3000]}", file=sys.stderr)
                    continue
                runs[system].append(result)
                print(
                    f"{system} run {i}: total {result['total_s']:.2f} s, recomputed "
                    f"{result['steps_recomputed']} steps, restored from {result['restored_from']}",
                    flush=True,
                )
    summaries = {s: _summary(r) for s, r in runs.items() if r}
    report = {
        "benchmark": "failover",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
        "settings": vars(args),
        "summary": summaries,
        "runs": runs,
        "errors": errors,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(_table(summaries, args.every))
    print(f"wrote {args.out}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
