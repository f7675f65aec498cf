"""Rendezvous at scale: N simulated machines against one real etcd, flashckpt-etcd vs torch c10d.

Each simulated machine is a thread running what a launcher runs for the rendezvous, without
workers:

- ``flashckpt``: the ``flashckpt-etcd`` handler as torchrun and ``flashckpt run`` build it
  (``flashckpt.elastic.rendezvous.backend.create_handler``:
  :mod:`flashckpt.elastic.rendezvous.handler`, per-machine join keys on a lease of ``--lease-ttl``),
  and the launcher's liveness (``flashckpt.elastic.membership.nodes.NodeRegistry``: a lease-bound
  node key renewed every ``ttl / 5``, a watch on the peers' keys, a probe port, links to its
  ``--links`` ring successors' probe ports; a lost peer's rendezvous keys are deleted with
  ``handler.expire_nodes``, as ``flashckpt run`` does);
- ``c10d``: torch's ``C10dRendezvousBackend`` on a TCPStore this benchmark hosts, with torch's
  ``DynamicRendezvousHandler`` built by ``dynamic_rendezvous.create_handler``, as torchrun's
  ``--rdzv-backend=c10d`` does;
- ``floor``: the same threads each writing one etcd key and waiting for one watched key
  (written by this process when all N keys are there), nothing else.

Machines run many per process over ``--procs`` processes; the machine that dies (machine 0) is
alone in its own process, so SIGKILL really stops its lease renewals and heartbeats, and the
standby is alone in another, started once round 1 formed. After round 1 each machine does
what torch's agent does while workers train: ``num_nodes_waiting()`` every
``--monitor-interval``. When the victim is killed, every survivor is told at once (its
workers' collectives would fail within milliseconds), runs the launcher's ``round_lost``
probe (flashckpt only: ``reap_dead_peers``) and calls ``next_rendezvous()`` again.

Per N and backend (a fresh etcd each trial): time from "go" until every machine has its rank
in round 1; time from the kill until every survivor and the standby are in round 2; every
compare-and-set (c10d: torch's ``set_state``; flashckpt: the handler's conditional
transactions) and how many failed; the largest value written; etcd's
``/metrics`` (writes, received bytes, DB size) over a steady period of ``--steady`` seconds
after round 2; the job's etcd keys after each round and after the machines left. Rounds are
bounded by ``--round-timeout``: a round not formed by then is recorded with the machines that
had their rank. Every process and etcd is killed on exit, also on failure or Ctrl-C.

Usage:
  python benchmarks/rendezvous_scale.py --sizes 8,32 --out benchmarks/runs/rendezvous-scale.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pickle
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

BACKENDS = ("flashckpt", "c10d", "floor", "handler")
DEFAULT_BACKENDS = ("flashckpt", "c10d", "floor")
# etcd's gRPC calls (the JSON gateway forwards each HTTP request as one), counted per method.
_RPCS = (
    "Range",
    "Txn",
    "Put",
    "DeleteRange",
    "LeaseGrant",
    "LeaseKeepAlive",
    "LeaseRevoke",
    "Watch",
)
_METRICS = (
    "process_cpu_seconds_total",
    "etcd_mvcc_put_total",
    "etcd_mvcc_txn_total",
    "etcd_mvcc_range_total",
    "etcd_mvcc_delete_total",
    "etcd_network_client_grpc_received_bytes_total",
    "etcd_network_client_grpc_sent_bytes_total",
    "etcd_mvcc_db_total_size_in_bytes",
    "etcd_mvcc_db_total_size_in_use_in_bytes",
    "etcd_debugging_mvcc_keys_total",
)


# ============================================================================ host process side
class _Counters:
    """Compare-and-set outcomes of every machine of one host process."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.set_state = 0
        self.cas_failed = 0
        self.bytes_written = 0
        self.max_value = 0
        self.errors: list[str] = []
        self.handlers: list[Any] = []

    def wrap_handler(self, handler: Any) -> None:
        """flashckpt: the handler counts its own transactions (``handler.stats``)."""
        with self.lock:
            self.handlers.append(handler)

    def wrap(self, backend: Any, overhead: int) -> None:
        original = backend.set_state

        def set_state(state: bytes, token: Any = None) -> Any:
            result = original(state, token)
            with self.lock:
                self.set_state += 1
                if result is not None and not result[2]:
                    self.cas_failed += 1
                else:
                    self.bytes_written += len(state) + overhead
                    self.max_value = max(self.max_value, len(state) + overhead)
            return result

        backend.set_state = set_state

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            out = {
                "set_state": self.set_state,
                "cas_failed": self.cas_failed,
                "bytes_written": self.bytes_written,
                "max_value": self.max_value,
                "errors": list(self.errors[:5]),
            }
            handlers = list(self.handlers)
        for h in handlers:
            st = h.stats.snapshot()
            out["set_state"] += st["txns"]
            out["cas_failed"] += st["txns_failed"]
            out["bytes_written"] += st["bytes_written"]
            out["max_value"] = max(out["max_value"], st["max_value"])
        return out


class _Host:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.ctl = Path(a.ctl)
        self.out_lock = threading.Lock()
        self.out = open(a.events, "a")  # noqa: SIM115 (closed at exit)
        self.counters = _Counters()
        self.broken = threading.Event()
        self.stop = threading.Event()
        self.cleanups: dict[int, list[Any]] = {}  # per machine, in the order taken
        self.profiles: list[Any] = []

    def emit(self, **fields: Any) -> None:
        fields.setdefault("t", time.time())
        with self.out_lock:
            self.out.write(json.dumps(fields) + "\n")
            self.out.flush()

    def params(self, backend: str, endpoint: str, **extra: Any) -> Any:
        from torch.distributed.elastic.rendezvous import RendezvousParameters

        a = self.a
        return RendezvousParameters(
            backend=backend,
            endpoint=endpoint,
            run_id=a.run_id,
            min_nodes=a.nnodes,
            max_nodes=a.nnodes,
            local_addr="127.0.0.1",
            join_timeout=int(a.round_timeout) + 60,
            keep_alive_interval=a.keep_alive_interval,
            **extra,
        )

    def machine(self, index: int) -> None:
        try:
            self._machine(index)
        except BaseException as exc:  # reported, the parent decides
            with self.counters.lock:
                self.counters.errors.append(f"m{index}: {type(exc).__name__}: {exc}")
            self.emit(ev="error", m=index, error=f"{type(exc).__name__}: {exc}")

    def _machine(self, index: int) -> None:
        a = self.a
        if a.backend == "floor":
            self._floor(index)
            return
        registry = None
        lost = threading.Event()
        if a.backend in ("flashckpt", "handler"):
            from flashckpt.elastic.membership.nodes import NodeRegistry
            from flashckpt.elastic.rendezvous.backend import create_handler, job_prefix
            from flashckpt.elastic.rendezvous.name import BACKEND_NAME

            params = self.params(
                BACKEND_NAME, a.endpoint, read_timeout=60, lease_ttl=str(a.lease_ttl)
            )
            handler = create_handler(params)
            backend = None
            self.counters.wrap_handler(handler)

            def on_lost(record: Any, via: str) -> None:
                lost.set()
                if record.rdzv_node and via != "watch":  # as flashckpt run's session does
                    handler.expire_nodes([record.rdzv_node])

            if a.backend == "flashckpt":
                registry = NodeRegistry(
                    handler.client,
                    job_prefix(a.run_id),
                    f"m{index}",
                    ttl=timedelta(seconds=a.lease_ttl),
                    advertise_host="127.0.0.1",
                    bind_host="127.0.0.1",
                    on_lost=on_lost,
                    on_fenced=None,
                    # flashckpt run: 2 (--links) when it probes.
                    links=a.links if a.probe else 0,
                )
                # As flashckpt run: one lease per machine; the descriptor and state in the
                # registration itself, which the first join carries (the launcher's read of
                # its health-check key finds its node id free and, but for the standby, no
                # running job); the peers' watch once the machine has its rank, or while it
                # waits as a standby.
                with_join = handler.share_lease(registry) and not a.standby
                registry.start(
                    timedelta(seconds=60),
                    watch=False,
                    watch_if=None if with_join else handler.round_key,
                    with_join=with_join,
                    rdzv_node=handler.node,
                    state="waiting",
                )
                handler.on_waiting = lambda _round, r=registry: r.watch_peers()
                self.cleanups.setdefault(index, []).append(registry.close)
        else:
            from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend as c10d
            from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

            params = self.params("c10d", a.endpoint, is_host="false", read_timeout=60)
            backend, store = c10d.create_backend(params)
            self.counters.wrap(backend, overhead=0)
            handler = dr.create_handler(store, backend, params)
        # The launcher's exit after a signal: the rendezvous stays open (leave), as it does for
        # every machine but the last (closing it would end the job for the others).
        # flashckpt: machine 1 closes the rendezvous (the job is over), the others leave it, as
        # launchers do when a job ends; the keys left behind are then a finished job's.
        if a.backend in ("flashckpt", "handler") and index != 1:
            self.cleanups.setdefault(index, []).append(handler.leave)
        else:
            self.cleanups.setdefault(index, []).append(handler.shutdown)
        if a.standby:
            threading.Thread(
                target=self._report_standby, args=(backend, handler), daemon=True
            ).start()
        registered = time.time()  # the launcher's registration done (flashckpt)
        info = handler.next_rendezvous()
        self.emit(
            ev="rank",
            m=index,
            round=1 if not a.standby else 2,
            rank=info.rank,
            world=info.world_size,
            phases={**getattr(handler, "phases", {}), "registered": registered},
        )
        if registry is not None:  # as flashckpt run's session does
            registry.update(state="active", group_rank=info.rank, rdzv_member=handler.member_id)
            registry.watch_peers()
        if a.standby:
            self._monitor(handler, None, None)
            return
        self._monitor(handler, lost, registry)
        if self.stop.is_set():
            return
        # The round is broken (its workers' collectives failed): the launcher's round_lost.
        self.emit(ev="restart", m=index)
        told = time.time()
        if registry is not None and a.probe:
            with contextlib.suppress(Exception):
                registry.reap_dead_peers()
        reaped = time.time()
        probes = getattr(registry, "peers_probed", None)  # None: code that did not count
        if registry is not None:  # as flashckpt run's session does between two rounds
            registry.update(
                state="waiting", group_rank=None, publish_after=timedelta(seconds=a.lease_ttl)
            )
        info = handler.next_rendezvous()
        self.emit(
            ev="rank",
            m=index,
            round=2,
            rank=info.rank,
            world=info.world_size,
            phases={**getattr(handler, "phases", {}), "told": told, "reaped": reaped},
            probes=probes,
        )
        if registry is not None:
            registry.update(state="active", group_rank=info.rank, rdzv_member=handler.member_id)
        self._monitor(handler, None, None)

    def _monitor(self, handler: Any, lost: threading.Event | None, registry: Any) -> None:
        """torch's agent while workers train: num_nodes_waiting() every monitor interval."""
        while not self.stop.is_set():
            if lost is not None and self.broken.is_set():
                return
            with contextlib.suppress(Exception):
                handler.num_nodes_waiting()
            self.stop.wait(self.a.monitor_interval)

    def _report_standby(self, backend: Any, handler: Any) -> None:
        if self.a.backend in ("flashckpt", "handler"):
            while not self.stop.is_set():
                if handler.waiting_in is not None:  # its join key of the next round is there
                    self.emit(ev="standby_waiting", m=-1)
                    return
                time.sleep(0.05)
            return
        me = handler._this_node
        while not self.stop.is_set():
            with contextlib.suppress(Exception):
                found = backend.get_state()
                if found is not None:
                    state = pickle.loads(found[0])  # torch's own state, in our own etcd/store
                    if me in state.redundancy_list or me in state.wait_list:
                        self.emit(ev="standby_waiting", m=-1)
                        return
            time.sleep(0.2)

    def _floor(self, index: int) -> None:
        from flashckpt.elastic.etcd.client import EtcdClient

        client = EtcdClient([self.a.endpoint], timeout=timedelta(seconds=60))
        prefix = f"/floor/{self.a.run_id}/"
        revision = client.revision()
        client.put(prefix + f"m/{index}", b"x")
        while client.get(prefix + "go") is None:
            client.wait_for_change(
                prefix + "go", after_revision=revision, timeout=timedelta(seconds=5)
            )
        self.emit(ev="rank", m=index, round=1, rank=index, world=self.a.nnodes)

    def run(self) -> None:
        a = self.a
        first, count = (int(x) for x in a.machines.split(":"))
        if a.profile:
            _tally_ended_threads()
        if a.profile and first == 1 and not a.profile_kinds_only:
            self.profiles = _profile_threads()
        import torch.distributed.elastic.rendezvous  # noqa: F401  (imports done before "go")

        if a.backend in ("flashckpt", "handler"):
            import flashckpt.elastic.membership.nodes
            import flashckpt.elastic.rendezvous.backend  # noqa: F401
        self.emit(ev="ready", pid=os.getpid())
        while not (self.ctl / "go").exists():
            time.sleep(0.01)
        threads = [
            threading.Thread(target=self.machine, args=(i,), daemon=True, name=f"m{i}")
            for i in range(first, first + count)
        ]
        for t in threads:
            t.start()
        answered: set[str] = set()
        while True:
            names = set(os.listdir(self.ctl))
            if "broken" in names:
                self.broken.set()
            for name in sorted(names - answered):
                if name.startswith("snap-"):
                    answered.add(name)
                    if a.profile and name in _PROFILED_SNAPS:
                        _dump_profile(Path(a.profile), a, first, self.profiles, name[5:])
                    self.emit(
                        ev="snap",
                        name=name[5:],
                        pid=os.getpid(),
                        threads=threading.active_count(),
                        **self.counters.snapshot(),
                    )
            if "stop" in names:
                break
            time.sleep(0.02)
        self.emit(ev="snap", name="end", pid=os.getpid(), **self.counters.snapshot())
        self.stop.set()

        # Every machine's launcher leaves at once, each on its own (leave the rendezvous, then
        # revoke its lease), as the machines of a job that ends do; one after another, 256
        # machines did not all leave within the time given, and the lease-bound keys of those
        # that did not were counted as "left behind" until their leases lapsed.
        def leave(steps: list[Any]) -> None:
            for cleanup in reversed(steps):
                with contextlib.suppress(Exception):
                    cleanup()

        leaving = [
            threading.Thread(target=leave, args=(steps,), daemon=True)
            for steps in list(self.cleanups.values())
        ]
        for t in leaving:
            t.start()
        deadline = time.monotonic() + 30
        for t in leaving:
            t.join(max(0.0, deadline - time.monotonic()))
        self.emit(ev="leave", pid=os.getpid(), unfinished=sum(t.is_alive() for t in leaving))
        self.emit(ev="left", pid=os.getpid())
        self.out.close()
        os._exit(0)  # torch's keep-alive timers and our watches are daemon threads


def _profile_threads() -> list[Any]:
    """``--profile``: a cProfile of every thread this process starts from now on (cProfile
    follows one thread; each thread's ``run`` is wrapped), in CPU seconds of the thread."""
    import cProfile

    profiles: list[Any] = []
    run = threading.Thread.run

    def profiled(self: threading.Thread) -> None:
        prof = cProfile.Profile(time.thread_time)  # CPU, not the time blocked or waiting
        profiles.append(prof)
        prof.enable()
        run(self)

    threading.Thread.run = profiled  # type: ignore[method-assign]
    return profiles


_PROFILED_SNAPS = ("snap-round1", "snap-before_kill", "snap-round2")
"""``--profile`` dumps at these snapshots; the kill path is the difference of the last two
(``benchmarks/profile_diff.py``)."""


_ENDED: dict[str, float] = {}
"""``--profile``: CPU seconds of the threads that ended, by kind (:func:`_tally_ended_threads`)."""
_ENDED_LOCK = threading.Lock()


def _thread_kind(name: str) -> str:
    return re.sub(r"\d+", "N", re.sub(r" \(.*\)$", "", name))


def _tally_ended_threads() -> None:
    """``--profile``: each thread started from now on adds its own CPU time (its clock, not
    ``/proc``'s 10 ms ticks, which round a short thread to nothing) to :data:`_ENDED` under its
    kind as it ends."""
    run = threading.Thread.run

    def tallied(self: threading.Thread) -> None:
        try:
            run(self)
        finally:
            cpu = time.thread_time()
            kind = _thread_kind(self.name)
            with _ENDED_LOCK:
                _ENDED[kind] = _ENDED.get(kind, 0.0) + cpu

    threading.Thread.run = tallied  # type: ignore[method-assign]


def _dump_profile(
    out: Path, a: argparse.Namespace, first: int, profiles: list[Any], snap: str
) -> None:
    """``--profile``: this process's CPU seconds per thread kind (its threads' names, digits
    dropped; each thread's own clock, those that ended included) and, for the cProfiled
    host, the merged profile (``.prof`` for ``pstats``, and the top functions by own time as
    text), so far: at the end of round 1 (``<backend>-n<N>-m<first>.*``), before the kill and
    once round 2 formed (``...-before_kill.*``, ``...-round2.*``: the kill path is the
    difference)."""
    import io
    import pstats

    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"{a.backend}-n{a.nnodes}-m{first}{'' if snap == 'round1' else '-' + snap}"
    kinds: dict[str, float] = {}
    with _ENDED_LOCK:
        for kind, cpu in _ENDED.items():  # threads that ended, by their own clocks
            kinds[kind] = kinds.get(kind, 0.0) + cpu
    for thread in threading.enumerate():  # the live ones, by theirs
        try:
            cpu = time.clock_gettime(time.pthread_getcpuclockid(thread.ident or 0))
        except (OSError, OverflowError):
            continue  # ended meanwhile (tallied)
        kind = _thread_kind(thread.name)
        kinds[kind] = kinds.get(kind, 0.0) + cpu
    total = _cpu_seconds(os.getpid()) or 0.0
    kinds = {k: round(v, 3) for k, v in kinds.items()}
    kinds["(not a Python thread)"] = round(total - sum(kinds.values()), 3)
    stem.with_suffix(".threads.json").write_text(
        json.dumps(dict(sorted(kinds.items(), key=lambda kv: -kv[1])), indent=1) + "\n"
    )
    if not profiles:
        return

    class _Taken:  # the calls each thread completed so far; its pending ones are left out
        def __init__(self, prof: Any) -> None:
            prof.snapshot_stats()  # not create_stats: disabling from here would close them
            self.stats = prof.stats  # with this thread's clock

        def create_stats(self) -> None:
            pass

    stats = pstats.Stats(_Taken(profiles[0]))
    for prof in profiles[1:]:
        stats.add(_Taken(prof))
    stats.dump_stats(str(stem.with_suffix(".prof")))
    text = io.StringIO()
    pstats.Stats(str(stem.with_suffix(".prof")), stream=text).sort_stats("tottime").print_stats(60)
    pstats.Stats(str(stem.with_suffix(".prof")), stream=text).sort_stats("cumulative").print_stats(
        120
    )
    stem.with_suffix(".txt").write_text(text.getvalue())


# ============================================================================== parent side
def _metrics(url: str) -> dict[str, float]:
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^([a-z_]+)(\{[^}]*\})? ([0-9.e+-]+)$", line)
        if m and m.group(1) in _METRICS:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
        elif m and m.group(1) in ("grpc_server_started_total", "grpc_server_msg_sent_total"):
            method = re.search(r'grpc_method="([A-Za-z]+)"', m.group(2) or "")
            if method and method.group(1) in _RPCS:
                name = f"{m.group(1)}:{method.group(1)}"
                out[name] = out.get(name, 0.0) + float(m.group(3))
    return out


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a live process (Linux ``/proc``)."""
    return _cpu_seconds_of(Path(f"/proc/{pid}/stat"))


def _cpu_seconds_of(stat: Path) -> float | None:
    try:
        fields = stat.read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cost(a: dict[str, Any], b: dict[str, Any], n: int) -> dict[str, Any]:
    """Between two snapshots: CPU seconds of etcd and of the simulated machines, and etcd's
    gRPC calls per machine by method (``Watch``: streams opened; ``Watch sent``: messages
    sent on watches; ``LeaseKeepAlive``: keep-alives answered, whether each came as a gateway
    request of its own or on the client's keep-alive stream)."""
    ea, eb = a.get("etcd", {}), b.get("etcd", {})
    out: dict[str, Any] = {"seconds": round(b["t"] - a["t"], 2)}
    if "process_cpu_seconds_total" in ea and "process_cpu_seconds_total" in eb:
        out["etcd_cpu_s"] = round(
            eb["process_cpu_seconds_total"] - ea["process_cpu_seconds_total"], 2
        )
    ha, hb = a.get("hosts_cpu", {}), b.get("hosts_cpu", {})
    out["machines_cpu_s"] = round(sum(v - ha.get(k, 0.0) for k, v in hb.items()), 2)
    calls = {}
    for method in _RPCS:
        kind = "msg_sent" if method == "LeaseKeepAlive" else "started"
        key = f"grpc_server_{kind}_total:{method}"
        if key in eb:
            calls[method] = round((eb[key] - ea.get(key, 0.0)) / n, 2)
    key = "grpc_server_msg_sent_total:Watch"
    if key in eb:
        calls["Watch sent"] = round((eb[key] - ea.get(key, 0.0)) / n, 2)
    out["etcd_calls_per_machine"] = calls
    return out


class _Trial:
    """One backend at one N: its processes, its etcd (or TCPStore), its event log."""

    def __init__(self, backend: str, n: int, a: argparse.Namespace, work: Path) -> None:
        self.backend, self.n, self.a = backend, n, a
        self.work = work / f"{backend}-{n}-{uuid.uuid4().hex[:6]}"
        self.ctl = self.work / "ctl"
        self.ctl.mkdir(parents=True)
        self.events = self.work / "events.jsonl"
        self.run_id = f"scale{n}{uuid.uuid4().hex[:6]}"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.etcd: Any = None
        self.store: Any = None
        self.client: Any = None
        self.endpoint = ""
        self.url = ""
        self.keys_left: int | None = None
        self.key_kinds_left: dict[str, int] = {}
        self.keys_left_after_ttl: int | None = None
        self.key_kinds_left_after_ttl: dict[str, int] = {}
        self.cpu_seen: dict[str, float] = {}

    # -- processes
    def start_infra(self) -> None:
        if self.backend in ("flashckpt", "floor", "handler"):
            from flashckpt.elastic.etcd.client import EtcdClient
            from flashckpt.elastic.etcd.server import EtcdV3Server

            self.etcd = EtcdV3Server(self.work / "etcd")
            self.url = self.etcd.start()
            self.endpoint = self.url
            self.client = EtcdClient([self.url], timeout=timedelta(seconds=30))
        else:
            import torch.distributed as dist

            self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            self.endpoint = f"127.0.0.1:{self.store.port}"

    def spawn(self, machines: str, *, standby: bool = False) -> None:
        from flashckpt.elastic.procutil import die_with_parent

        a = self.a
        cmd = [
            sys.executable, str(Path(__file__).resolve()), "--host",
            "--backend", self.backend, "--endpoint", self.endpoint, "--run-id", self.run_id,
            "--nnodes", str(self.n), "--machines", machines, "--events", str(self.events),
            "--ctl", str(self.ctl), "--lease-ttl", str(a.lease_ttl),
            "--round-timeout", str(a.round_timeout), "--monitor-interval", str(a.monitor_interval),
        ]  # fmt: skip
        if not a.probe:
            cmd.append("--no-probe")
        if a.profile:
            cmd += ["--profile", a.profile]
        if a.profile_kinds_only:
            cmd.append("--profile-kinds-only")
        cmd += ["--links", str(a.links)]
        cmd += ["--keep-alive-interval", str(a.keep_alive_interval)]
        if standby:
            cmd.append("--standby")
        env = dict(os.environ, OMP_NUM_THREADS="1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        log = open(self.work / f"host-{len(self.procs)}.log", "wb")  # noqa: SIM115
        self.procs.append(
            subprocess.Popen(
                cmd, stdout=log, stderr=log, env=env, start_new_session=True,
                preexec_fn=die_with_parent(signal.SIGKILL),
            )
        )  # fmt: skip
        log.close()

    def read(self) -> list[dict[str, Any]]:
        from flashckpt.testing.elastic import read_jsonl

        return read_jsonl(self.events)

    def wait(self, cond: Any, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if cond(self.read()):
                return True
            for p in self.procs[1:] if self.backend != "floor" else self.procs:
                if p.poll() is not None and p.returncode != 0:
                    raise RuntimeError(f"a host process exited with {p.returncode}: {self.work}")
            time.sleep(0.05)
        return cond(self.read())

    def snap(self, name: str) -> dict[str, Any]:
        (self.ctl / f"snap-{name}").touch()
        alive = [p.pid for p in self.procs if p.poll() is None]
        self.wait(
            lambda ev: (
                {e["pid"] for e in ev if e["ev"] == "snap" and e["name"] == name} >= set(alive)
            ),
            30,
        )
        snaps = [e for e in self.read() if e["ev"] == "snap" and e["name"] == name]
        out: dict[str, Any] = {
            "set_state": sum(s["set_state"] for s in snaps),
            "cas_failed": sum(s["cas_failed"] for s in snaps),
            "bytes_written": sum(s["bytes_written"] for s in snaps),
            "max_value": max((s["max_value"] for s in snaps), default=0),
            "errors": [x for s in snaps for x in s["errors"]][:5],
            # Python threads of each host process (machine 0's and the standby's hosts last).
            "threads_per_host": [s.get("threads") for s in snaps],
            "t": time.time(),
        }
        out["hosts_cpu"] = self.hosts_cpu()
        if self.etcd is not None:
            out["etcd"] = _metrics(self.url)
            with contextlib.suppress(Exception):
                out["job_keys"], out["job_key_kinds"] = self.job_keys()
        return out

    def hosts_cpu(self) -> dict[str, float]:
        """CPU seconds of each host process so far (a dead one keeps its last reading)."""
        for p in self.procs:
            cpu = _cpu_seconds(p.pid)
            if cpu is not None:
                self.cpu_seen[str(p.pid)] = cpu
        return dict(self.cpu_seen)

    def job_keys(self) -> tuple[int, dict[str, int]]:
        """How many keys the job has in etcd, and how many of each kind (digits as ``#``)."""
        prefix = f"/flashckpt/{self.run_id}/"
        kinds: dict[str, int] = {}
        kvs = self.client.get_prefix(prefix)
        for kv in kvs:
            kind = re.sub(r"[0-9]+", "#", kv.key.decode(errors="replace")[len(prefix) :])
            kinds[kind] = kinds.get(kind, 0) + 1
        return len(kvs), dict(sorted(kinds.items()))

    def cleanup(self) -> None:
        with contextlib.suppress(OSError):
            (self.ctl / "stop").touch()
        deadline = time.monotonic() + 45  # the hosts give their machines 30 s to leave
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(OSError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        if self.etcd is not None:
            with contextlib.suppress(Exception):  # the machines left: what stays in etcd
                self.keys_left, self.key_kinds_left = self.job_keys()
                if self.keys_left:
                    # What a machine that did not leave (killed, or out of time) still holds
                    # goes with its lease: count again once every lease of the job lapsed.
                    time.sleep(self.a.lease_ttl + 1.5)
                    self.keys_left_after_ttl, self.key_kinds_left_after_ttl = self.job_keys()
            self.etcd.kill()
        self.store = None


def _ranks(events: list[dict[str, Any]], rnd: int) -> dict[int, int]:
    return {e["m"]: e["rank"] for e in events if e["ev"] == "rank" and e["round"] == rnd}


def _where_the_time_goes(events: list[dict[str, Any]], rnd: int, t0: float) -> dict[str, Any]:
    """flashckpt: from ``t0`` (go, or the kill), the moments the last machine was registered
    (round 1) or told of the kill and done with its pre-round probes (round 2), entered the
    round, the last join was answered, the result was first and last read, the last machine
    had its rank (MASTER_ADDR/PORT read), as seconds after ``t0``."""
    ph = [
        e["phases"] for e in events if e["ev"] == "rank" and e["round"] == rnd and e.get("phases")
    ]
    if not ph:
        return {}

    def last(name: str) -> float | None:
        vals = [p[name] for p in ph if name in p]
        return round(max(vals) - t0, 3) if vals else None

    results = [p["result"] for p in ph if "result" in p]
    return {
        "last_registered_s": last("registered"),
        "last_told_s": last("told"),
        "last_reaped_s": last("reaped"),
        "last_start_s": last("start"),
        "last_joined_s": last("joined"),
        "first_result_s": round(min(results) - t0, 3) if results else None,
        "last_result_s": last("result"),
        "last_done_s": last("done"),
    }


def _per_machine_rate(a: dict[str, Any], b: dict[str, Any], key: str, n: int) -> float | None:
    if key not in a.get("etcd", {}) or key not in b.get("etcd", {}):
        return None
    return (b["etcd"][key] - a["etcd"][key]) / (b["t"] - a["t"]) / n


def run_trial(backend: str, n: int, a: argparse.Namespace, work: Path) -> dict[str, Any]:
    """One trial; never raises (a failure is recorded in the result)."""
    trial = _Trial(backend, n, a, work)
    res: dict[str, Any] = {"backend": backend, "n": n}
    try:
        trial.start_infra()
        if backend == "floor":
            per = -(-n // a.procs)
            for first in range(0, n, per):
                trial.spawn(f"{first}:{min(per, n - first)}")
        else:
            trial.spawn("0:1")  # the victim, alone
            per = -(-(n - 1) // a.procs)
            for first in range(1, n, per):
                trial.spawn(f"{first}:{min(per, n - first)}")
        hosts = len(trial.procs)
        trial.wait(lambda ev: sum(e["ev"] == "ready" for e in ev) >= hosts, 120)
        at_go = {
            "t": time.time(),
            "etcd": _metrics(trial.url) if trial.etcd else {},
            "hosts_cpu": trial.hosts_cpu(),
        }
        t_go = at_go["t"]
        (trial.ctl / "go").touch()
        if backend == "floor":
            prefix = f"/floor/{trial.run_id}/"
            deadline = time.monotonic() + a.round_timeout
            while time.monotonic() < deadline:
                rev = trial.client.revision()
                if trial.client.count_prefix(prefix + "m/") >= n:
                    trial.client.put(prefix + "go", b"1")
                    break
                trial.client.wait_for_change(
                    prefix + "m/", after_revision=rev, timeout=timedelta(seconds=1), prefix=True
                )
        formed = trial.wait(lambda ev: len(_ranks(ev, 1)) >= n, a.round_timeout)
        ev = trial.read()
        r1 = _ranks(ev, 1)
        res["round1"] = {
            "formed": formed,
            "machines_with_rank": len(r1),
            "seconds": max(
                (e["t"] for e in ev if e["ev"] == "rank" and e["round"] == 1), default=t_go
            )
            - t_go
            if formed
            else None,
            "ranks": [r1[m] for m in sorted(r1)],
        }
        if backend in ("flashckpt", "handler"):
            res["round1"]["phases"] = _where_the_time_goes(ev, 1, t_go)
        res["errors"] = [e["error"] for e in ev if e["ev"] == "error"][:5]
        res["after_round1"] = after1 = trial.snap("round1")
        res["cost_round1"] = _cost(at_go, after1, n)
        if backend == "floor":
            return res
        if formed:
            res["per_join_round1"] = {
                "set_state_per_machine": after1["set_state"] / n,
                "cas_failed_per_machine": after1["cas_failed"] / n,
                "bytes_per_successful_set_state": after1["bytes_written"]
                / max(1, after1["set_state"] - after1["cas_failed"]),
            }
            if trial.etcd is not None:
                dt = after1["t"] - t_go
                for key, name in (
                    ("etcd_mvcc_txn_total", "etcd_txns_per_machine"),
                    ("etcd_mvcc_put_total", "etcd_puts_per_machine"),
                    ("etcd_mvcc_range_total", "etcd_ranges_per_machine"),
                    (
                        "etcd_network_client_grpc_received_bytes_total",
                        "etcd_received_bytes_per_machine",
                    ),
                ):
                    rate = _per_machine_rate(at_go, after1, key, n)
                    res["per_join_round1"][name] = None if rate is None else rate * dt
        if not formed:
            return res
        # The standby: its own process, waiting once round 1 formed.
        trial.spawn(f"{n}:1", standby=True)
        trial.wait(
            lambda ev: any(e["ev"] == "ready" and e["pid"] == trial.procs[-1].pid for e in ev), 120
        )
        trial.wait(lambda ev: any(e["ev"] == "standby_waiting" for e in ev), a.round_timeout)
        res["standby_waiting"] = any(e["ev"] == "standby_waiting" for e in trial.read())
        before_kill = trial.snap("before_kill")
        t_kill = time.time()
        os.killpg(trial.procs[0].pid, signal.SIGKILL)
        trial.procs[0].wait()
        (trial.ctl / "broken").touch()
        survivors = set(range(1, n)) | {n}
        formed2 = trial.wait(lambda ev: survivors <= set(_ranks(ev, 2)), a.round_timeout)
        ev = trial.read()
        r2 = _ranks(ev, 2)
        res["round2"] = {
            "formed": formed2,
            "machines_with_rank": len(r2),
            "seconds_from_kill": max(e["t"] for e in ev if e["ev"] == "rank" and e["round"] == 2)
            - t_kill
            if formed2
            else None,
            "ranks": {str(m): r2[m] for m in sorted(r2)},
            "standby_rank": r2.get(n),
        }
        if backend in ("flashckpt", "handler"):
            res["round2"]["phases"] = _where_the_time_goes(ev, 2, t_kill)
            # Peers the survivors probed from the kill to round 2 (reap_dead_peers, any cause).
            probed = [e["probes"] for e in ev if e["ev"] == "rank" and "probes" in e]
            res["round2"]["peers_probed"] = (
                None if not probed or None in probed else sum(p for p in probed if p is not None)
            )
        after2 = trial.snap("round2")
        res["before_kill"], res["after_round2"] = before_kill, after2
        res["cost_kill_to_round2"] = _cost(before_kill, after2, n)
        res["cas_round1"] = {k: res["after_round1"][k] for k in ("set_state", "cas_failed")}
        res["cas_kill_to_round2"] = {
            k: after2[k] - before_kill[k] for k in ("set_state", "cas_failed")
        }
        res["errors"] = [e["error"] for e in ev if e["ev"] == "error"][:5]
        if not formed2:
            return res
        time.sleep(a.steady)  # the steady period: heartbeats, renewals, num_nodes_waiting polls
        steady = trial.snap("steady")
        res["cost_steady"] = _cost(after2, steady, n)
        dt = steady["t"] - after2["t"]
        res["steady"] = {
            "seconds": dt,
            "set_state_per_s_per_machine": (steady["set_state"] - after2["set_state"]) / dt / n,
            "cas_failed": steady["cas_failed"] - after2["cas_failed"],
            "state_bytes_per_s_per_machine": (steady["bytes_written"] - after2["bytes_written"])
            / dt
            / n,
            "max_value_bytes": steady["max_value"],
        }
        if trial.etcd is not None:
            w = [
                _per_machine_rate(after2, steady, k, n)
                for k in ("etcd_mvcc_put_total", "etcd_mvcc_txn_total")
            ]
            res["steady"].update(
                etcd_puts_per_s_per_machine=w[0],
                etcd_txns_per_s_per_machine=w[1],
                etcd_received_bytes_per_s_per_machine=_per_machine_rate(
                    after2, steady, "etcd_network_client_grpc_received_bytes_total", n
                ),
                etcd_ranges_per_s_per_machine=_per_machine_rate(
                    after2, steady, "etcd_mvcc_range_total", n
                ),
                etcd_db_bytes=steady["etcd"].get("etcd_mvcc_db_total_size_in_bytes"),
                etcd_db_in_use_bytes=steady["etcd"].get("etcd_mvcc_db_total_size_in_use_in_bytes"),
                etcd_keys_total=steady["etcd"].get("etcd_debugging_mvcc_keys_total"),
            )
            res["job_keys"] = {
                "after_round1": res["after_round1"].get("job_keys"),
                "after_round2": after2.get("job_keys"),
            }
        return res
    except Exception as exc:
        res["failure"] = f"{type(exc).__name__}: {exc}"
        return res
    finally:
        trial.cleanup()
        if res.get("job_keys") is not None:
            res["job_keys"]["after_job_left"] = trial.keys_left
            res["job_key_kinds_after_job_left"] = trial.key_kinds_left
            res["job_keys"]["after_leases_lapsed"] = trial.keys_left_after_ttl
            res["job_key_kinds_after_leases_lapsed"] = trial.key_kinds_left_after_ttl
            res["machines_not_left"] = sum(
                e.get("unfinished", 0) for e in trial.read() if e["ev"] == "leave"
            )


def _summary(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for t in sorted({r.get("trial", 0) for r in results}):
        rows += _summary_of_trial([r for r in results if r.get("trial", 0) == t], t)
    return rows


def _summary_of_trial(results: list[dict[str, Any]], trial: int) -> list[dict[str, Any]]:
    rows = []
    by = {(r["backend"], r["n"]): r for r in results}
    for n in sorted({r["n"] for r in results}):
        f, c, fl = by.get(("flashckpt", n), {}), by.get(("c10d", n), {}), by.get(("floor", n), {})

        def sec(r: dict[str, Any], rnd: str, key: str) -> float | None:
            return (r.get(rnd) or {}).get(key)

        def ratio(x: float | None, y: float | None) -> float | None:
            return None if x is None or not y else round(x / y, 2)

        f1, c1, fl1 = (
            sec(f, "round1", "seconds"),
            sec(c, "round1", "seconds"),
            sec(fl, "round1", "seconds"),
        )
        f2, c2 = sec(f, "round2", "seconds_from_kill"), sec(c, "round2", "seconds_from_kill")
        rows.append(
            {
                "n": n,
                "trial": trial,
                "flashckpt_round1_s": f1,
                "flashckpt_kill_to_round2_s": f2,
                "flashckpt_cas_failed_round1": (f.get("cas_round1") or {}).get("cas_failed"),
                "flashckpt_cas_failed_kill_to_round2": (f.get("cas_kill_to_round2") or {}).get(
                    "cas_failed"
                ),
                "c10d_round1_s": c1,
                "c10d_kill_to_round2_s": c2,
                "c10d_cas_failed_round1": (c.get("cas_round1") or {}).get("cas_failed"),
                "floor_round1_s": fl1,
                "round1_flashckpt_over_c10d": ratio(f1, c1),
                "round1_flashckpt_over_floor": ratio(f1, fl1),
                "kill_flashckpt_over_c10d": ratio(f2, c2),
            }
        )
        h = by.get(("handler", n))
        if h is not None:
            rows[-1]["handler_round1_s"] = sec(h, "round1", "seconds")
            rows[-1]["handler_kill_to_round2_s"] = sec(h, "round2", "seconds_from_kill")
        for name, r in (("flashckpt", f), ("handler", h or {}), ("floor", fl)):
            cost = r.get("cost_round1") or {}
            if cost:
                rows[-1][f"{name}_round1_cpu_s_etcd_machines"] = [
                    cost.get("etcd_cpu_s"),
                    cost.get("machines_cpu_s"),
                ]
    return rows


def _after_known(r: dict[str, Any]) -> float | None:
    """Kill -> round 2 counted from when the last survivor was told of the death."""
    two = r.get("round2") or {}
    told = (two.get("phases") or {}).get("last_told_s")
    total = two.get("seconds_from_kill")
    return None if total is None or told is None else round(total - told, 3)


def _spread(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per N and backend over the trials: median, min and max of round 1, of kill -> round 2
    (and after the death is known), of round 1 over the same trial's floor; the slowest
    trial's index (its phases and CPU per phase are in its result)."""

    def stats(xs: list[float | None]) -> dict[str, Any]:
        vals = [x for x in xs if x is not None]
        if not vals:
            return {"median": None, "min": None, "max": None, "n": 0, "missing": len(xs)}
        return {
            "median": round(statistics.median(vals), 3),
            "min": round(min(vals), 3),
            "max": round(max(vals), 3),
            "n": len(vals),
            "missing": len(xs) - len(vals),
        }

    out = []
    floors = {
        (r["n"], r.get("trial", 0)): (r.get("round1") or {}).get("seconds")
        for r in results
        if r["backend"] == "floor"
    }
    for n in sorted({r["n"] for r in results}):
        for b in sorted({r["backend"] for r in results if r["n"] == n}):
            rs = [r for r in results if r["n"] == n and r["backend"] == b]
            r1 = [(r.get("round1") or {}).get("seconds") for r in rs]
            over = []
            for r, x in zip(rs, r1, strict=True):
                fl = floors.get((n, r.get("trial", 0)))
                over.append(None if x is None or not fl or b == "floor" else x / fl)
            row: dict[str, Any] = {
                "n": n,
                "backend": b,
                "trials": len(rs),
                "round1_s": stats(r1),
                "round1_over_floor": stats(over),
            }
            if b != "floor":
                k2 = [(r.get("round2") or {}).get("seconds_from_kill") for r in rs]
                row["kill_to_round2_s"] = stats(k2)
                row["kill_to_round2_after_known_s"] = stats([_after_known(r) for r in rs])
            timed = [(x, r.get("trial", 0)) for x, r in zip(r1, rs, strict=True) if x is not None]
            row["slowest_round1_trial"] = max(timed)[1] if timed else None
            out.append(row)
    return out


_SETTINGS = (
    "trials",
    "procs",
    "round_timeout",
    "steady",
    "lease_ttl",
    "monitor_interval",
    "probe",
    "links",
    "keep_alive_interval",
)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--sizes", default="8,32", help="comma-separated N (the issue: 8,32,128,512,1024)"
    )
    p.add_argument(
        "--backends",
        default=",".join(DEFAULT_BACKENDS),
        help=f"of {', '.join(BACKENDS)} ('handler': flashckpt's rendezvous without the liveness "
        "layer, to split the cost)",
    )
    p.add_argument("--procs", type=int, default=2, help="host processes the machines share")
    p.add_argument("--round-timeout", type=float, default=180.0)
    p.add_argument("--steady", type=float, default=20.0, help="steady period in s (issue: 300)")
    p.add_argument("--lease-ttl", type=float, default=5.0, help="flashckpt run's --lease-ttl")
    p.add_argument("--monitor-interval", type=float, default=0.1, help="flashckpt run's default")
    p.add_argument(
        "--keep-alive-interval",
        type=int,
        default=5,
        help="torch's keep_alive_interval (s) for both backends; a node is dead to torch after "
        "3 missed (torch's default: 5)",
    )
    p.add_argument(
        "--no-probe",
        dest="probe",
        action="store_false",
        help="flashckpt run --no-probe: survivors learn the death from the lease alone",
    )
    p.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="write to DIR, at the end of round 1, before the kill and after round 2, each host "
        "process's CPU seconds per thread kind, and a cProfile of every thread of the host of "
        "machines 1.. (slows it down: not for timings; benchmarks/profile_diff.py gives the "
        "kill path)",
    )
    p.add_argument(
        "--profile-kinds-only",
        action="store_true",
        help="with --profile: the CPU seconds per thread kind only, no cProfile (at 1,024 "
        "machines on a loaded host the cProfiled host could not form round 1 in 120 s)",
    )
    p.add_argument(
        "--links",
        type=int,
        default=0,
        help="peer links per machine (0: none, as the earlier runs; flashckpt run holds 2: at "
        "1,024 machines beside two CPU burners, round 2 then did not form, old code and new); "
        "none with --no-probe",
    )
    p.add_argument(
        "--trials",
        type=int,
        default=1,
        help="trials per N and backend, interleaved (the issue: at least 5 at 1,024); the "
        "'spread' of the JSON gives median, min and max of each",
    )
    p.add_argument("--work-dir", default=None, help="logs and etcd data (default: a temp dir)")
    p.add_argument("--out", default=None, help="JSON results (default: stdout only)")
    # The host-process side (internal).
    p.add_argument("--host", action="store_true", help=argparse.SUPPRESS)
    for flag in ("--backend", "--endpoint", "--run-id", "--machines", "--events", "--ctl"):
        p.add_argument(flag, help=argparse.SUPPRESS)
    p.add_argument("--nnodes", type=int, help=argparse.SUPPRESS)
    p.add_argument("--standby", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.host:
        _Host(a).run()
        return 0
    sizes = [int(s) for s in a.sizes.split(",") if s]
    backends = [b for b in a.backends.split(",") if b]
    for b in backends:
        if b not in BACKENDS:
            p.error(f"--backends: unknown {b!r}; choose from {', '.join(BACKENDS)}")
    if a.trials < 1:
        p.error("--trials: at least 1")
    if any(n < 3 for n in sizes):
        p.error("--sizes: every N must be >= 3 (one machine dies, two survive)")

    def _term(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _term)
    results: list[dict[str, Any]] = []
    started = time.time()
    with contextlib.ExitStack() as stack:
        tmp = a.work_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="fc-rdzv-"))
        for n in sizes:
            # Trials interleaved: trial t of every backend runs before trial t+1 of any, so a
            # slow spell of the machine lands on all backends alike.
            for t in range(a.trials):
                for b in backends:
                    print(
                        f"[rendezvous_scale] {b} N={n} trial {t + 1}/{a.trials} ...",
                        file=sys.stderr,
                        flush=True,
                    )
                    r = run_trial(b, n, a, Path(tmp))
                    r["trial"] = t
                    results.append(r)
                    print(
                        json.dumps(
                            {k: r.get(k) for k in ("backend", "n", "round1", "round2", "failure")}
                        ),
                        file=sys.stderr,
                        flush=True,
                    )
    doc = {
        "benchmark": "rendezvous_scale",
        "argv": sys.argv[1:],
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "machine": {
            "cpus": os.cpu_count(),
            "load_avg_at_end": os.getloadavg(),
            "python": platform.python_version(),
            "shared": "other jobs ran on the same cores (see load_avg_at_end)",
        },
        "settings": {k: getattr(a, k) for k in _SETTINGS},
        "summary": _summary(results),
        "spread": _spread(results),
        "results": results,
    }
    text = json.dumps(doc, indent=1)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text + "\n")
    print(json.dumps(doc["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
