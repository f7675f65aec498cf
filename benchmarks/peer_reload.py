"""Peer-memory restore benchmark (issue 11): what restoring a lost machine's shards from another
machine's replica buys, against storage, and what the replication costs the training loop.

A sharded job (FSDP2 over gloo, 2 machines x 1 rank, every Linear layer ``fully_shard``ed, AdamW;
``size`` GiB of state per machine: params + two moments) runs with real node agents on 127.0.0.1,
node ids ``a`` and ``b``, each with a tmpfs of its own (root; a plain directory elsewhere), storage
in a local directory (the disk, not a tmpfs) with every snapshot persisted. Per size and repeat:

1. **loop, replicas off** and **loop, replicas on** (the order alternates between repeats): one
   job each, fresh agents; each rank times ``--loop-steps`` plain training steps twice (the
   baseline and its noise floor), then the same number inside ``flashckpt.checkpointing``
   (``every``, ``mode="sync"``, ``persist_every=1``). Time lost per checkpoint = (checkpointed
   loop - baseline loop) / checkpoints, of the slower rank; the two baselines' difference per
   checkpoint is the noise floor. With replicas on, ``a`` and ``b`` replicate to each other; the
   per-thread CPU of both agents over the job (the sender thread is ``flashckpt-agent-replica``)
   comes from /proc with the ``_probe`` thread names, and the replication bandwidth from the
   agents' logs (each push: bytes, seconds) and ``status``.
2. **lose machine b**: once ``a`` holds b's replica of the last step and storage has committed it,
   both trainers and b's agent are SIGKILLed and b's memory removed.
3. **restore** rank 1 on a standby ``c`` (fresh agent, its own tmpfs), rank 0 on ``a`` (own memory),
   three ways, in rotating order: ``peer`` (c's agent knows a's replica server: rank 1 restores
   ``peer-memory``), ``cold`` storage (c knows no peer; every checkpoint file fsync'ed and evicted
   from the page cache with ``posix_fadvise(POSIX_FADV_DONTNEED)``, file by file), ``warm``
   storage (the files read once before). Timed in rank 1 from the ``checkpointing`` entry to the
   state applied, and broken into phases by wrapping the restore's own functions in the worker
   process (nothing in flashckpt changes): ``plan`` (the agreement, with each source's offer),
   ``prepare`` (for peer-memory: the agent's pull over TCP into c's slot), ``read`` (of which
   ``hash`` is the data-hash check of the slot), ``fit``, ``apply``. A checksum of rank 1's
   restored shards is compared with the one it had at that step: a wrong restore fails the run.
   The pull's own phases (the agent's: ask, connect, alloc, recv, install, total; the
   trainer's: offer.ask, offer.gather, pull, map, verify) come from the restore's info
   (``pull_phases_s``) and are tabled with the load average.

``--variants peer,cold`` and ``--no-off-loop`` make a short run (no warm restore; no loop with
replicas off, so no replication cost).

Every figure is measured in the same run; ratios are of medians. On a machine that other work
loads the load average (before, after) is in the JSON.

    python benchmarks/peer_reload.py --sizes 0.25,1 --repeats 3 \
        --out benchmarks/runs/peer-reload.json
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C

WIDTH = 1024
EVERY = 2
JOB = "peerbench"


# -- one rank (``--worker SPEC``) ------------------------------------------------------------


def _layers(size_gib: float, world: int) -> int:
    """Linear(WIDTH, WIDTH) layers for ``size_gib`` of state per rank (fp32 params + 2 moments)."""
    params = size_gib * world * C.GiB / 12
    return max(world, round(params / (WIDTH * WIDTH + WIDTH)))


def _build(spec: dict[str, Any]) -> tuple[Any, Any, Any]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (spec["world"],))
    n = _layers(spec["size_gib"], spec["world"])
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(n)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1234 + spec["rank"])
    x = torch.randn(8, WIDTH, generator=g)
    return model, opt, x


def _train_step(model: Any, opt: Any, x: Any) -> None:
    loss = model(x).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def _checksum(model: Any, opt: Any) -> str:
    """blake2b of this rank's local shards of the parameters and the optimizer state."""
    import torch

    h = hashlib.blake2b(digest_size=16)

    def add(name: str, t: Any) -> None:
        if hasattr(t, "to_local"):
            t = t.to_local()
        if isinstance(t, torch.Tensor):
            h.update(name.encode())
            h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())

    for k, v in sorted(model.state_dict().items()):
        add(k, v)
    params = [p for g in opt.param_groups for p in g["params"]]
    for i, p in enumerate(params):
        for k, v in sorted(opt.state.get(p, {}).items()):
            add(f"{i}/{k}", v)
    return h.hexdigest()


def _timed_block(fn: Callable[[], None], n: int) -> float:
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    dist.barrier()
    return time.perf_counter() - t0


class _PhaseClock:
    """Wraps the restore's functions in this process and sums the seconds spent in each."""

    def __init__(self) -> None:
        self.s: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def wrap(self, owner: Any, attr: str, phase: str) -> None:
        orig = getattr(owner, attr)

        def timed(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return orig(*a, **kw)
            finally:
                self.s[phase] = self.s.get(phase, 0.0) + time.perf_counter() - t0
                self.calls[phase] = self.calls.get(phase, 0) + 1

        setattr(owner, attr, timed)

    def install(self) -> None:
        from flashckpt.trainer import snapshot
        from flashckpt.trainer.restore import apply, sources
        from flashckpt.trainer.restore import pipeline as restore

        self.wrap(restore, "agree", "plan")
        self.wrap(restore.Restorer, "_fit", "fit")
        self.wrap(apply.Applier, "apply", "apply")
        self.wrap(snapshot.Snapshotter, "verify", "hash")
        for cls in (sources.MemorySource, sources.StorageSource, sources.ReplicaPullSource):
            self.wrap(cls, "prepare", f"prepare.{cls.name}")
            self.wrap(cls, "read", f"read.{cls.name}")


def worker(spec: dict[str, Any]) -> int:
    import torch
    import torch.distributed as dist

    import flashckpt

    torch.set_num_threads(1)
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    os.environ["LOCAL_RANK"] = "0"
    clock = _PhaseClock()
    if spec["mode"] == "restore":
        clock.install()
    dist.init_process_group(
        "gloo",
        init_method=f"file://{spec['init_file']}",
        rank=spec["rank"],
        world_size=spec["world"],
        timeout=datetime.timedelta(seconds=600),
    )
    model, opt, x = _build(spec)
    out: dict[str, Any] = {"rank": spec["rank"], "mode": spec["mode"]}
    n = spec["loop_steps"]
    kw = dict(
        storage=spec["storage"],
        every=EVERY,
        persist_every=1,
        job=spec["job"],
        node=spec["node"],
        run_dir=spec["run_dir"],
        mode="sync",
        agent="connect",
        agent_timeout=120,
    )
    if spec["mode"] == "train":
        _train_step(model, opt, x)  # the optimizer state exists from here on
        out["base1_s"] = _timed_block(lambda: _train_step(model, opt, x), n)
        out["base2_s"] = _timed_block(lambda: _train_step(model, opt, x), n)
        ckpt = flashckpt.checkpointing(model, opt, **kw).__enter__()

        def ck() -> None:
            _train_step(model, opt, x)
            ckpt.step()

        out["ckpt_s"] = _timed_block(ck, n)
        out["checkpoints"] = n // EVERY
        out["last_step"] = n
        out["stats"] = ckpt.status().get("stats")
        out["checksum"] = _checksum(model, opt)
    else:
        t0 = time.perf_counter()
        ckpt = flashckpt.checkpointing(model, opt, **kw).__enter__()
        out["entry_s"] = time.perf_counter() - t0
        st = ckpt.status()
        out["start"] = ckpt.start_step
        out["from"] = ckpt.restored_from
        out["restore_s"] = st.get("restore_s")
        out["restore"] = st.get("restore")
        out["phases_s"] = clock.s
        out["phase_calls"] = clock.calls
        out["checksum"] = _checksum(model, opt)
    with open(spec["report"], "a") as f:
        f.write(json.dumps(out, default=str) + "\n")
    dist.barrier()
    if spec["mode"] == "restore":
        os._exit(0)  # no exit flush: storage and memory stay as the next variant needs them
    Path(spec["done"]).touch()
    while True:  # a machine at work until it is killed
        time.sleep(60)


# -- the driver ------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Bench:
    """The agents, trainers, tmpfs mounts and files of one run; all removed at the end."""

    def __init__(self, size_gib: float, loop_steps: int) -> None:
        self.size = size_gib
        self.loop_steps = loop_steps
        self.root = tempfile.mkdtemp(prefix="fcpr-", dir="/tmp")
        self.run_dir = os.path.join(self.root, "run")
        os.makedirs(self.run_dir, mode=0o700)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.errs: dict[int, str] = {}
        """pid -> the file of its stdout and stderr."""
        self.mounts: list[str] = []
        self.shm: dict[str, str] = {}
        self.n = 0
        self.probe_dir = os.path.join(self.root, "threads")
        os.makedirs(self.probe_dir)
        tmpfs = f"{int(size_gib * 4 + 1)}g"  # two own slots + one replica, and some room
        for node in "abc":
            d = os.path.join(self.root, f"shm-{node}")
            os.makedirs(d, mode=0o700)
            if os.geteuid() == 0:
                r = subprocess.run(
                    ["mount", "-t", "tmpfs", "-o", f"size={tmpfs},mode=0700", "tmpfs", d],
                    capture_output=True,
                )
                if r.returncode == 0:
                    self.mounts.append(d)
            self.shm[node] = d

    def clean_shm(self, node: str, job: str) -> None:
        """Removes one job's files from a machine's memory (another job's stay: the restores
        of the job with replicas still need them)."""
        d = self.shm[node]
        for name in os.listdir(d):
            if name.startswith(f"fc.{job}."):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(d, name))

    def agent(
        self, job: str, node: str, storage: str, extra: list[str]
    ) -> tuple[subprocess.Popen[bytes], str]:
        log = os.path.join(self.root, f"agent-{job}-{node}.log")
        cmd = [sys.executable, "-m", "flashckpt", "agent", "--job", job, "--node", node]
        cmd += ["--run-dir", self.run_dir, "--shm-dir", self.shm[node], "--storage", storage]
        cmd += ["--idle-timeout", "1800", "--poll-interval", "0.05", "--log-file", log, *extra]
        env = dict(os.environ, FCBENCH_THREAD_LOG=self.probe_dir)
        env["PYTHONPATH"] = os.pathsep.join([C.PROBE_DIR, env.get("PYTHONPATH", "")])
        p = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=open(log + ".err", "wb"),  # noqa: SIM115
            env=env,
            start_new_session=True,
        )
        self.procs.append(p)
        self.errs[p.pid] = log + ".err"
        sock = os.path.join(self.run_dir, f"{job}.{node}.sock")
        deadline = time.monotonic() + 120
        while True:
            if p.poll() is not None:
                raise RuntimeError(f"agent {node} exited {p.returncode}: {_tail(log + '.err')}")
            with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as s:
                s.connect(sock)
                return p, log
            if time.monotonic() > deadline:
                raise TimeoutError(f"agent {node} did not listen on {sock}")
            time.sleep(0.05)

    def trainers(
        self, job: str, nodes: list[str], storage: str, mode: str
    ) -> tuple[list[subprocess.Popen[bytes]], str, list[str]]:
        self.n += 1
        tag = f"{mode}{self.n}"
        report = os.path.join(self.root, f"{tag}.jsonl")
        dones, procs = [], []
        for rank, node in enumerate(nodes):
            done = os.path.join(self.root, f"{tag}-r{rank}.done")
            spec = {
                "rank": rank,
                "world": len(nodes),
                "job": job,
                "node": node,
                "run_dir": self.run_dir,
                "storage": storage,
                "init_file": os.path.join(self.root, f"init-{tag}"),
                "size_gib": self.size,
                "mode": mode,
                "loop_steps": self.loop_steps,
                "report": report,
                "done": done,
            }
            err = open(os.path.join(self.root, f"{tag}-r{rank}.err"), "wb")  # noqa: SIM115
            p = subprocess.Popen(
                [sys.executable, __file__, "--worker", json.dumps(spec)],
                stdin=subprocess.DEVNULL,
                stdout=err,
                stderr=err,
                start_new_session=True,
            )
            self.procs.append(p)
            self.errs[p.pid] = err.name
            procs.append(p)
            dones.append(done)
        return procs, report, dones

    def kill(self, p: subprocess.Popen[bytes]) -> None:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=60)

    def close(self) -> None:
        for p in self.procs:
            self.kill(p)
        for d in self.mounts:
            subprocess.run(["umount", "-l", d], capture_output=True)
        shutil.rmtree(self.root, ignore_errors=True)


def _tail(path: str, n: int = 3000) -> str:
    try:
        return Path(path).read_text(errors="replace")[-n:]
    except OSError:
        return ""


def _status(run_dir: str, job: str, node: str) -> dict[str, Any]:
    from flashckpt import names
    from flashckpt.protocol.channel import AgentClient

    c = AgentClient(names.socket_path(run_dir, job, node), timeout=30.0)
    try:
        return c.request("status", timeout=30)
    finally:
        c.close()


def _wait(
    b: Bench, cond: Callable[[], Any], what: str, procs: list[Any], timeout: float = 900
) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        for p in procs:
            if p.poll() is not None:
                why = _tail(b.errs.get(p.pid, ""))
                raise RuntimeError(f"{what}: process {p.pid} exited {p.returncode}:\n{why}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _rows(report: str) -> dict[int, dict[str, Any]]:
    rows = [json.loads(x) for x in Path(report).read_text().splitlines() if x.strip()]
    return {int(r["rank"]): r for r in rows}


SENT_RE = re.compile(
    r"replica of rank (\d+) step (\d+) \(([\d.]+) MiB\) sent to (\S+) in ([\d.]+) s"
)


def _pushes(log: str) -> list[dict[str, Any]]:
    out = []
    for m in SENT_RE.finditer(_tail(log, 10**7)):
        mib, s = float(m.group(3)), float(m.group(5))
        out.append(
            {"rank": int(m.group(1)), "step": int(m.group(2)), "mib": mib, "seconds": s}
            | {"target": m.group(4), "gib_s": (mib / 1024 / s) if s > 0 else None}
        )
    return out


def loop_job(b: Bench, rep: int, replicas: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """One training job on a and b; returns its results and what the restores need."""
    from flashckpt.format.storage import Storage

    job = f"{JOB}{os.getpid() % 10000}r{rep}{'on' if replicas else 'off'}"
    storage = os.path.join(b.root, f"storage-{job}")
    os.makedirs(storage)
    pa_port, pb_port = _free_port(), _free_port()
    if replicas:
        addr_a, addr_b = f"127.0.0.1:{pa_port}", f"127.0.0.1:{pb_port}"
        ea = ["--replica-listen", addr_a, "--replica-peers", f"b={addr_b}"]
        eb = ["--replica-listen", addr_b, "--replica-peers", f"a={addr_a}"]
    else:
        ea = eb = ["--replicas", "0"]
    for n in "ab":
        b.clean_shm(n, job)
    agent_a, log_a = b.agent(job, "a", storage, ea)
    agent_b, log_b = b.agent(job, "b", storage, eb)
    cpu0 = {n: C.proc_snapshot(p.pid) for n, p in (("a", agent_a), ("b", agent_b))}
    log0 = {n: C.thread_log(b.probe_dir, p.pid) for n, p in (("a", agent_a), ("b", agent_b))}
    procs, report, dones = b.trainers(job, ["a", "b"], storage, "train")
    _wait(b, lambda: all(os.path.exists(d) for d in dones), "the loop", procs)
    rows = _rows(report)
    last = rows[1]["last_step"]
    st = Storage(storage)
    _wait(b, lambda: last in st.committed_steps(), f"step {last} committed", [agent_a, agent_b])
    if replicas:

        def held() -> bool:
            rep_a = _status(b.run_dir, job, "a")["replication"]
            return any((h["sender"], h["rank"], h["step"]) == ("b", 1, last) for h in rep_a["held"])

        _wait(b, held, f"a to hold b's replica of step {last}", [agent_a, agent_b])
    time.sleep(0.5)  # the sender's last log line
    cpu1 = {n: C.proc_snapshot(p.pid) for n, p in (("a", agent_a), ("b", agent_b))}
    log1 = {n: C.thread_log(b.probe_dir, p.pid) for n, p in (("a", agent_a), ("b", agent_b))}
    agents_cpu = {n: C.thread_cpu_delta(cpu0[n], cpu1[n], log0[n], log1[n]) for n in "ab"}
    status = {n: _status(b.run_dir, job, n).get("replication") for n in "ab"}
    res: dict[str, Any] = {
        "replicas": replicas,
        "ranks": rows,
        "agents_cpu": agents_cpu,
        "replication_status": status,
        "pushes": {"a": _pushes(log_a), "b": _pushes(log_b)},
    }
    ctx = {
        "job": job,
        "storage": storage,
        "agent_a": agent_a,
        "agent_b": agent_b,
        "trainers": procs,
        "addr_a": f"127.0.0.1:{pa_port}",
        "last": last,
        "checksum1": rows[1]["checksum"],
    }
    return res, ctx


def lose_b(b: Bench, ctx: dict[str, Any]) -> None:
    for p in ctx["trainers"]:
        b.kill(p)
    b.kill(ctx["agent_b"])
    b.clean_shm("b", ctx["job"])  # the lost machine's memory is gone with it


def _read_all(root: str) -> int:
    n = 0
    for dirpath, _d, files in os.walk(root):
        for f in files:
            with open(os.path.join(dirpath, f), "rb") as fh:
                while chunk := fh.read(1 << 24):
                    n += len(chunk)
    return n


def restore_once(b: Bench, ctx: dict[str, Any], variant: str) -> dict[str, Any]:
    job, storage = ctx["job"], ctx["storage"]
    b.clean_shm("c", job)
    extra = ["--replica-peers", f"a={ctx['addr_a']}"] if variant == "peer" else ["--replicas", "0"]
    agent_c, _ = b.agent(job, "c", storage, extra)
    prep: dict[str, Any] = {}
    if variant == "cold":
        t0 = time.perf_counter()
        prep["files_evicted"] = C.drop_file_cache(storage)
        prep["evict_s"] = time.perf_counter() - t0
    elif variant == "warm":
        prep["bytes_read"] = _read_all(storage)
    try:
        procs, report, _ = b.trainers(job, ["a", "c"], storage, "restore")
        for p in procs:
            try:
                p.wait(timeout=900)
            except subprocess.TimeoutExpired:
                b.kill(p)
        errs = [_tail(os.path.join(b.root, f"restore{b.n}-r{r}.err")) for r in (0, 1)]
        for p, e in zip(procs, errs, strict=True):
            if p.returncode != 0:
                raise RuntimeError(f"restore ({variant}) rank exited {p.returncode}:\n{e}")
        rows = _rows(report)
    finally:
        b.kill(agent_c)
        b.clean_shm("c", job)
    r1 = rows[1]
    want = {"peer": "peer-memory", "cold": "storage", "warm": "storage"}[variant]
    if (r1["start"], r1["from"], rows[0]["from"]) != (ctx["last"], want, "memory"):
        raise RuntimeError(
            f"restore ({variant}): rank 1 restored step {r1['start']} from {r1['from']!r}, rank 0 "
            f"from {rows[0]['from']!r}; expected step {ctx['last']} from {want!r} and 'memory'"
        )
    if r1["checksum"] != ctx["checksum1"]:
        raise RuntimeError(f"restore ({variant}): rank 1's restored state differs from step's")
    return {"variant": variant, "prep": prep, "ranks": rows}


def _lost_per_ckpt(res: dict[str, Any]) -> dict[str, float]:
    """Of the slower rank: time lost per checkpoint and the noise floor (baselines' difference)."""
    rows = res["ranks"].values()
    n = max(1, next(iter(rows))["checkpoints"])
    base = max(min(r["base1_s"], r["base2_s"]) for r in rows)
    ckpt = max(r["ckpt_s"] for r in rows)
    noise = max(abs(r["base1_s"] - r["base2_s"]) for r in rows)
    return {
        "lost_per_ckpt_s": (ckpt - base) / n,
        "noise_per_ckpt_s": noise / n,
        "base_step_s": base / max(1, next(iter(rows))["checkpoints"] * EVERY),
    }


def off_job(b: Bench, rep: int, log: Callable[[str], None]) -> dict[str, Any]:
    """The loop with replicas off; its agents, memory and storage removed after."""
    res, c = loop_job(b, rep, False)
    res |= _lost_per_ckpt(res)
    for p in [*c["trainers"], c["agent_a"], c["agent_b"]]:
        b.kill(p)
    for n in "ab":
        b.clean_shm(n, c["job"])
    shutil.rmtree(c["storage"], ignore_errors=True)
    log(
        f"{b.size} GiB rep {rep} replicas off: lost/ckpt {res['lost_per_ckpt_s']:.3f} s "
        f"(noise {res['noise_per_ckpt_s']:.3f} s)"
    )
    return res


def run_size(
    size: float,
    repeats: int,
    loop_steps: int,
    log: Callable[[str], None],
    variants: list[str] | None = None,
    off_loop: bool = True,
) -> dict[str, Any]:
    out: dict[str, Any] = {"gib_per_machine": size, "layers": _layers(size, 2), "repeats": []}
    variants = variants or ["peer", "cold", "warm"]
    b = Bench(size, loop_steps)
    out["private_tmpfs"] = bool(b.mounts)
    try:
        for rep in range(repeats):
            one: dict[str, Any] = {"repeat": rep, "load_start": os.getloadavg()}
            # The job without replicas runs before the one with them on even repeats, after its
            # restores on odd ones (never while the other job's memory is in use).
            if rep % 2 == 0 and off_loop:
                one["loop_off"] = off_job(b, rep, log)
            res, ctx = loop_job(b, rep, True)
            res |= _lost_per_ckpt(res)
            one["loop_on"] = res
            log(
                f"{size} GiB rep {rep} replicas on : lost/ckpt {res['lost_per_ckpt_s']:.3f} s "
                f"(noise {res['noise_per_ckpt_s']:.3f} s)"
            )
            lose_b(b, ctx)
            one["restores"] = []
            for i in range(len(variants)):
                v = variants[(rep + i) % len(variants)]
                r = restore_once(b, ctx, v)
                one["restores"].append(r)
                r1 = r["ranks"][1]
                log(
                    f"{size} GiB rep {rep} restore {v:4}: entry->applied {r1['entry_s']:.3f} s, "
                    f"restore_s {r1['restore_s']:.3f}, phases "
                    + ", ".join(f"{k} {s:.3f}" for k, s in sorted(r1["phases_s"].items()))
                )
                pull = (r1.get("restore") or {}).get("pull_phases_s")
                if pull:
                    log("  pull: " + ", ".join(f"{k} {s:.3f}" for k, s in pull.items()))
            b.kill(ctx["agent_a"])
            b.clean_shm("a", ctx["job"])
            shutil.rmtree(ctx["storage"], ignore_errors=True)
            if rep % 2 == 1 and off_loop:
                one["loop_off"] = off_job(b, rep, log)
            one["load_end"] = os.getloadavg()
            out["repeats"].append(one)
    finally:
        b.close()
    out["summary"] = summarize(out)
    return out


def _rank(res: dict[str, Any], rank: int) -> dict[str, Any]:
    """A rank's row, in a result just measured (int keys) or read back from JSON (str keys)."""
    ranks = res["ranks"]
    return ranks[rank] if rank in ranks else ranks[str(rank)]


def summarize(size_res: dict[str, Any]) -> dict[str, Any]:
    reps = size_res["repeats"]
    s: dict[str, Any] = {}
    for v in ("peer", "cold", "warm"):
        rows = [_rank(r, 1) for rep in reps for r in rep["restores"] if r["variant"] == v]
        phases: dict[str, list[float]] = {}
        for r in rows:
            for k, x in r["phases_s"].items():
                phases.setdefault(k, []).append(x)
        pull: dict[str, list[float]] = {}
        for r in rows:
            for k, x in ((r.get("restore") or {}).get("pull_phases_s") or {}).items():
                pull.setdefault(k, []).append(x)
        entries = [r["entry_s"] for r in rows]
        s[v] = {
            "entry_s": entries,
            "entry_median_s": C.median(entries),
            "restore_median_s": C.median([r["restore_s"] for r in rows]) if rows else None,
            "phases_median_s": {k: C.median(xs) for k, xs in sorted(phases.items())},
        }
        if pull:
            # Where the peer-memory pull's time goes (the trainer's and its agent's phases).
            s[v]["pull_phases_median_s"] = {k: C.median(xs) for k, xs in pull.items()}
    for v in ("cold", "warm"):
        s[f"{v}_over_peer"] = C.ratio(s[v]["entry_median_s"], s["peer"]["entry_median_s"])
    s["target_cold_over_peer"] = 5.0
    s["hash_check_median_s"] = s["peer"]["phases_median_s"].get("hash")
    for k in ("off", "on"):
        rows = [rep[f"loop_{k}"] for rep in reps if f"loop_{k}" in rep]
        s[f"lost_per_ckpt_{k}_s"] = C.median([r["lost_per_ckpt_s"] for r in rows])
        s[f"noise_per_ckpt_{k}_s"] = C.median([r["noise_per_ckpt_s"] for r in rows])
    loops = [rep[f"loop_{k}"] for rep in reps for k in ("off", "on") if f"loop_{k}" in rep]
    s["base_step_median_s"] = C.median([r["base_step_s"] for r in loops])
    s["noise_per_ckpt_max_s"] = max(r["noise_per_ckpt_s"] for r in loops)
    s["replication_adds_per_ckpt_s"] = (s["lost_per_ckpt_on_s"] or 0) - (
        s["lost_per_ckpt_off_s"] or 0
    )
    pushes = [p for rep in reps for side in rep["loop_on"]["pushes"].values() for p in side]
    s["pushes"] = len(pushes)
    s["push_gib_s_median"] = C.median([p["gib_s"] for p in pushes if p["gib_s"]])
    s["push_seconds_median"] = C.median([p["seconds"] for p in pushes])
    sender: list[float] = []
    receiver: list[float] = []
    for rep in reps:
        for side in rep["loop_on"]["agents_cpu"].values():
            sender.append(side["threads_cpu_s"].get("flashckpt-agent-replica", 0.0))
            receiver.append(side["threads_cpu_s"].get("fc-replica", 0.0))
    s["sender_thread_cpu_s_per_agent_median"] = C.median(sender)
    s["receiver_thread_cpu_s_per_agent_median"] = C.median(receiver)
    return s


def markdown(res: dict[str, Any]) -> list[str]:
    """Two tables: the restore of rank 1 on the standby, and the loop with replicas off / on."""

    def f(x: float | None) -> str:
        return C.fmt_s(x).strip()

    lines = [
        "| GiB/machine | source | entry -> applied | restore pipeline | plan | pull | "
        "read (of it: hash check) | fit + apply | time / peer-memory's |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for size in res["sizes"]:
        s = size["summary"]
        for v, label in (("peer", "peer-memory"), ("cold", "cold storage"), ("warm", "warm")):
            r = s[v]
            if not r["entry_s"]:
                continue  # not run (--variants)
            ph = r["phases_median_s"]
            src = "peer-memory" if v == "peer" else "storage"
            fa = (ph.get("fit") or 0.0) + (ph.get("apply") or 0.0)
            vs = "1x" if v == "peer" else C.fmt_x(s[f"{v}_over_peer"]).strip()
            lines.append(
                f"| {size['gib_per_machine']} | {label} | **{f(r['entry_median_s'])}** | "
                f"{f(r['restore_median_s'])} | {f(ph.get('plan'))} | "
                f"{f(ph.get('prepare.peer-memory')) if v == 'peer' else '-'} | "
                f"{f(ph.get('read.' + src))} ({f(ph.get('hash')) if v == 'peer' else '-'}) | "
                f"{f(fa)} | {vs} |"
            )
    lines += [
        "",
        "| GiB/machine | load (1 min) | agent: ask | connect | alloc | recv + hash | install | "
        "agent total | trainer waits | map | verify |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for size in res["sizes"]:
        ph = size["summary"]["peer"].get("pull_phases_median_s") or {}
        loads = [x for rep in size["repeats"] for x in (rep["load_start"][0], rep["load_end"][0])]
        lines.append(
            f"| {size['gib_per_machine']} | {min(loads):.1f}-{max(loads):.1f} | "
            + " | ".join(
                f(ph.get(k))
                for k in (
                    "agent.ask",
                    "agent.connect",
                    "agent.alloc",
                    "agent.recv",
                    "agent.install",
                    "agent.total",
                    "pull",
                    "map",
                    "verify",
                )
            )
            + " |"
        )
    lines += [
        "",
        "| GiB/machine | step | lost/ckpt, replicas off | lost/ckpt, replicas on | "
        "noise floor/ckpt (max) | replica push GiB/s (s per push) | sender thread CPU/agent | "
        "receiver threads CPU/agent |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for size in res["sizes"]:
        s = size["summary"]
        bw = s["push_gib_s_median"]
        lines.append(
            f"| {size['gib_per_machine']} | {f(s.get('base_step_median_s'))} | "
            f"{f(s['lost_per_ckpt_off_s'])} | {f(s['lost_per_ckpt_on_s'])} | "
            f"{f(s['noise_per_ckpt_max_s'])} | "
            f"{'-' if bw is None else f'{bw:.2f}'} ({f(s['push_seconds_median'])}) | "
            f"{f(s['sender_thread_cpu_s_per_agent_median'])} | "
            f"{f(s.get('receiver_thread_cpu_s_per_agent_median'))} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", default="0.25,1", help="GiB of state per machine (default 0.25,1)")
    ap.add_argument("--repeats", type=int, default=3, help="repeats per size, interleaved")
    ap.add_argument(
        "--loop-steps", type=int, default=8, help=f"steps per loop block (a snapshot every {EVERY})"
    )
    ap.add_argument(
        "--variants", default="peer,cold,warm", help="restores to time (default peer,cold,warm)"
    )
    ap.add_argument(
        "--no-off-loop",
        action="store_true",
        help="skip the loop with replicas off (no replication cost measured)",
    )
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument(
        "--report", help="print the markdown tables of JSON results (comma-separated) and exit"
    )
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(json.loads(args.worker))
    if args.report:
        sizes = []
        for name in args.report.split(","):
            sizes += json.loads(Path(name).read_text())["sizes"]
        for size in sizes:
            size["summary"] = summarize(size)  # of this version of the script
        print("\n".join(markdown({"sizes": sizes})))
        return 0
    if args.loop_steps < EVERY or args.loop_steps % EVERY:
        ap.error(f"--loop-steps must be a multiple of {EVERY}")
    sizes = [float(x) for x in args.sizes.split(",") if x]
    variants = [v for v in args.variants.split(",") if v]
    if "peer" not in variants or not set(variants) <= {"peer", "cold", "warm"}:
        ap.error("--variants: peer and any of cold, warm")

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    res: dict[str, Any] = {
        "benchmark": "peer_reload",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "argv": sys.argv[1:],
        "machine": C.machine_info(),
        "loadavg_start": os.getloadavg(),
        "loop_steps": args.loop_steps,
        "every": EVERY,
        "sizes": [],
    }
    with C.terminate_as_exception():
        for size in sizes:
            res["sizes"].append(
                run_size(size, args.repeats, args.loop_steps, log, variants, not args.no_off_loop)
            )
            if args.out:  # what is done so far survives a later failure
                Path(args.out).write_text(json.dumps(res, indent=1, default=str))
    res["loadavg_end"] = os.getloadavg()
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1, default=str))
        log(f"wrote {args.out}")
    print("\n".join(markdown(res)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
