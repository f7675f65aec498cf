"""Replication's cost on the training loop (issue 11): time lost per checkpoint with and without
replicas, in one run, and the replication's bandwidth.

Two simulated machines on this host, ``a`` and ``b``: each its own node agent (``python -m
flashckpt agent``, own node id, own tmpfs as its shared memory when root, else a plain directory)
and its own trainer process running the loop of ``benchmarks/stall.py``'s loop phase
(``--layers`` x Linear(``--dim``, ``--dim``) + Adam, a checkpoint every ``--every`` steps, memory
only). Per round, in a shuffled order (seeded), three variants:

- ``plain``: no agents; each trainer times the loop twice without checkpoints (the noise floor:
  their difference per checkpoint);
- ``replicas0``: agents with ``--replicas 0``; each trainer times the plain loop, then the loop
  inside ``flashckpt.checkpointing`` (``every``, ``storage=None``);
- ``replicas1``: the same with each agent the other's fixed peer (``--replica-listen``,
  ``--replica-peers``): every snapshot is pushed to the other machine's agent.

The first snapshot (slot allocation) is taken in ``every`` untimed warm-up steps inside the
checkpointed block; the timed loop's checkpoints are steady ones. Time lost per checkpoint =
(checkpointed loop - the same process's plain loop) / checkpoints, of the slower machine. With
``--pin`` (default when the host has >= 2 cores) machine ``a`` (agent and trainer) runs on one core
and ``b`` on another, trainers with ``torch.set_num_threads(1)``. Pushes (count, bytes, seconds)
come from the agents' logs, the last push per rank from their ``status`` reply; per-thread CPU of
the agents from /proc (thread names from the ``_probe``).

``--spare-core`` asks what replication costs a trainer whose agent has a core to itself (a GPU
host has cores to spare; this one has two): ``a``'s trainer alone on core 0; both agents and
``b``'s trainer on core 1. Only ``a``'s loop is measured; ``b`` feeds ``a``'s agent its replicas
and receives ``a``'s, so ``a``'s agent still sends and receives every snapshot.

    python benchmarks/replication_cost.py --rounds 3 --out benchmarks/runs/replication-cost.json
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C
from peer_reload import _pushes, _status, _tail  # their parsers/clients, tested there

VARIANTS = ("plain", "replicas0", "replicas1")
NODES = ("a", "b")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# -- one machine's trainer (``--child SPEC``) ----------------------------------------------------
def _timed_loop(tr: Any, steps: int, ck: Any = None) -> tuple[float, int]:
    """``steps`` training steps (``ck.step()`` after each when given); seconds and snapshots."""
    saves0 = ck.stats.saves if ck is not None else 0
    t0 = time.perf_counter()
    for _ in range(steps):
        tr.step()
        if ck is not None:
            ck.step()
    dt = time.perf_counter() - t0
    return dt, (ck.stats.saves - saves0) if ck is not None else 0


def child(spec: dict[str, Any]) -> dict[str, Any]:
    import stall
    import torch

    import flashckpt

    if spec.get("cpu") is not None:
        os.sched_setaffinity(0, {int(spec["cpu"])})
    torch.set_num_threads(int(spec["threads"]))
    tr = stall._loop_trainer(spec)  # the stall loop's model, Adam and batch
    steps, every = int(spec["steps"]), int(spec["every"])
    for _ in range(int(spec["warmup"])):
        tr.step()
    out: dict[str, Any] = {"node": spec["node"], "state_bytes": tr.state_bytes()}
    out["plain_s"], _ = _timed_loop(tr, steps)
    if spec["variant"] == "plain":
        out["loop_s"], out["ckpts"] = _timed_loop(tr, steps)
        return out
    with flashckpt.checkpointing(
        tr.model,
        tr.optimizer,
        job=spec["job"],
        node=spec["node"],
        run_dir=spec["run_dir"],
        shm_dir=spec["shm_dir"],
        storage=None,
        every=every,
        restore=False,
    ) as ck:
        _timed_loop(tr, every, ck)  # the first snapshot (slot allocation), untimed
        n = len(ck.stats.stall_s)
        out["loop_s"], out["ckpts"] = _timed_loop(tr, steps, ck)
        out["stall_s"] = ck.stats.stall_s[n:]
        out["saves"] = ck.stats.saves
    # ``ck.step()`` counts from 1 in the block: its snapshots are the multiples of ``every``.
    out["last_step"] = (every + steps) // every * every
    return out


# -- the machines ------------------------------------------------------------------------------
class Machines:
    """Two machines' shared-memory dirs, agents and trainers; everything removed at close."""

    def __init__(self, pin: bool, idle_timeout: float, spare_core: bool = False) -> None:
        self.idle_timeout = idle_timeout
        """An agent left behind (this process SIGKILLed) exits after this long alone."""
        self.root = tempfile.mkdtemp(prefix="fcrc-", dir="/tmp")
        self.run_dir = os.path.join(self.root, "run")
        os.makedirs(self.run_dir, mode=0o700)
        self.probe_dir = os.path.join(self.root, "threads")
        os.makedirs(self.probe_dir)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.mounts: list[str] = []
        self.shm: dict[str, str] = {}
        self.cpu: dict[str, int | None] = {}
        """Each machine's trainer core (None: not pinned)."""
        self.agent_cpu: dict[str, int | None] = {}
        """Each machine's agent core: its trainer's, or with ``spare_core`` the second core for
        both agents (machine ``b``'s trainer is there too: ``a``'s agent has a core its
        trainer never runs on, as on a GPU host whose agent has cores to spare)."""
        cpus = sorted(os.sched_getaffinity(0))
        for i, node in enumerate(NODES):
            d = os.path.join(self.root, f"shm-{node}")
            os.makedirs(d, mode=0o700)
            if os.geteuid() == 0:
                r = subprocess.run(
                    ["mount", "-t", "tmpfs", "-o", "size=8g,mode=0700", "tmpfs", d],
                    capture_output=True,
                )
                if r.returncode == 0:
                    self.mounts.append(d)
            self.shm[node] = d
            self.cpu[node] = cpus[i % len(cpus)] if pin else None
            self.agent_cpu[node] = cpus[1 % len(cpus)] if spare_core else self.cpu[node]

    def _spawn(self, cmd: list[str], cpu: int | None, logf: str, env: dict[str, str]) -> Any:
        pre = (lambda: os.sched_setaffinity(0, {cpu})) if cpu is not None else None
        with open(logf, "ab") as f:
            p = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=f,
                stderr=f,
                env=env,
                start_new_session=True,
                preexec_fn=pre,  # this process starts no threads
            )
        self.procs.append(p)
        return p

    def agent(self, job: str, node: str, extra: list[str]) -> tuple[Any, str]:
        logf = os.path.join(self.root, f"agent-{job}-{node}.log")
        cmd = [sys.executable, "-m", "flashckpt", "agent", "--job", job, "--node", node]
        cmd += ["--run-dir", self.run_dir, "--shm-dir", self.shm[node]]
        cmd += ["--idle-timeout", f"{self.idle_timeout:.0f}", "--poll-interval", "0.05"]
        cmd += ["--log-file", logf, *extra]
        env = dict(os.environ, FCBENCH_THREAD_LOG=self.probe_dir)
        env["PYTHONPATH"] = os.pathsep.join([C.PROBE_DIR, env.get("PYTHONPATH", "")])
        p = self._spawn(cmd, self.agent_cpu[node], logf + ".err", env)
        sock = os.path.join(self.run_dir, f"{job}.{node}.sock")
        deadline = time.monotonic() + 120
        while True:
            if p.poll() is not None:
                raise RuntimeError(f"agent {node} exited {p.returncode}: {_tail(logf + '.err')}")
            with contextlib.suppress(OSError):
                _status(self.run_dir, job, node)
                return p, logf
            if time.monotonic() > deadline:
                raise TimeoutError(f"agent {node} did not answer on {sock}")
            time.sleep(0.05)

    def trainer(self, spec: dict[str, Any]) -> tuple[Any, str]:
        node = spec["node"]
        part = os.path.join(self.root, f"{spec['variant']}-r{spec['round']}-{node}.json")
        env = dict(os.environ)
        import stall

        env["GLIBC_TUNABLES"] = ":".join(
            filter(None, [os.environ.get("GLIBC_TUNABLES"), stall.PINNED_MALLOC])
        )
        spec = dict(spec, cpu=self.cpu[node], shm_dir=self.shm[node], run_dir=self.run_dir)
        cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)]
        cmd += ["--out", part]
        return self._spawn(cmd, self.cpu[node], part + ".err", env), part

    def stop(self, p: Any) -> None:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=30)

    def clean_shm(self) -> None:
        for d in self.shm.values():
            for name in os.listdir(d):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(d, name))

    def close(self) -> None:
        for p in self.procs:
            with contextlib.suppress(Exception):
                self.stop(p)
        self.clean_shm()
        for d in self.mounts:
            subprocess.run(["umount", "-l", d], capture_output=True)
        shutil.rmtree(self.root, ignore_errors=True)


def _thread_cpu(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Per-thread CPU (utime + stime) between two /proc snapshots, by probe name and comm."""
    d = C.thread_cpu_delta(before["proc"], after["proc"], before["log"], after["log"], "agent-main")
    comm: dict[str, float] = {}
    for tid, a in after["proc"]["threads"].items():
        b = before["proc"]["threads"].get(tid)
        comm[a["comm"]] = comm.get(a["comm"], 0.0) + a["cpu_s"] - (b["cpu_s"] if b else 0.0)
    d["threads_cpu_s_by_comm"] = dict(sorted(comm.items()))
    return d


def run_variant(m: Machines, args: argparse.Namespace, variant: str, rnd: int) -> dict[str, Any]:
    job = f"rc{os.getpid() % 10000}{variant[-1]}r{rnd}"
    spec = {
        "variant": variant,
        "round": rnd,
        "job": job,
        "width": args.dim,
        "layers": args.layers,
        "batch": args.batch,
        "threads": 1 if args.pin else args.threads,
        "steps": args.steps,
        "every": args.every,
        "warmup": args.warmup,
        "device": "cpu",
    }
    agents: dict[str, tuple[Any, str]] = {}
    trainers: dict[str, tuple[Any, str]] = {}
    m.clean_shm()
    res: dict[str, Any] = {"variant": variant, "round": rnd, "load_start": os.getloadavg()}
    try:
        if variant != "plain":
            if variant == "replicas1":
                ports = {n: _free_port() for n in NODES}
                addr = {n: f"127.0.0.1:{ports[n]}" for n in NODES}
                extra = {
                    "a": ["--replica-listen", addr["a"], "--replica-peers", f"b={addr['b']}"],
                    "b": ["--replica-listen", addr["b"], "--replica-peers", f"a={addr['a']}"],
                }
            else:
                extra = {n: ["--replicas", "0"] for n in NODES}
            for n in NODES:
                agents[n] = m.agent(job, n, extra[n])
        cpu0 = {n: _agent_snap(m, p.pid) for n, (p, _) in agents.items()}
        trainers = {n: m.trainer(dict(spec, node=n)) for n in NODES}
        deadline = time.monotonic() + args.timeout
        for n, (p, part) in trainers.items():
            try:
                rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise TimeoutError(
                    f"{variant} round {rnd}: trainer {n} ran past {args.timeout:g} s (--timeout)"
                ) from None
            if rc != 0 or not os.path.exists(part):
                raise RuntimeError(f"trainer {n} exited {rc}: {_tail(part + '.err')}")
        res["machines"] = {n: json.loads(Path(p).read_text()) for n, (_, p) in trainers.items()}
        if variant == "replicas1":  # the last snapshot's push lands after the loop: wait for it
            last = {n: res["machines"][n]["last_step"] for n in NODES}

            def pushed(n: str) -> bool:
                sent = (_status(m.run_dir, job, n).get("replication") or {}).get("sent") or []
                return any(s.get("step") == last[n] for s in sent)

            t_end = time.monotonic() + 120
            while not all(pushed(n) for n in NODES) and time.monotonic() < t_end:
                time.sleep(0.1)
            time.sleep(0.3)  # the sender's log line follows its status entry
        if agents:
            cpu1 = {n: _agent_snap(m, p.pid) for n, (p, _) in agents.items()}
            res["agents"] = {}
            for n, (_p, logf) in agents.items():
                pushes = _pushes(logf)
                res["agents"][n] = {
                    "cpu": _thread_cpu(cpu0[n], cpu1[n]),
                    "replication_status": _status(m.run_dir, job, n).get("replication"),
                    "pushes": len(pushes),
                    # The log line's MiB figure: 0.1 MiB resolution.
                    "push_bytes": int(sum(x["mib"] for x in pushes) * C.MiB),
                    "push_seconds": sum(x["seconds"] for x in pushes),
                    "push_log": pushes,
                }
    finally:  # a failed variant leaves nothing running into the next one
        for p, _ in [*trainers.values(), *agents.values()]:
            m.stop(p)
        m.clean_shm()
    res["load_end"] = os.getloadavg()
    for r in res["machines"].values():
        r["lost_per_ckpt_s"] = (r["loop_s"] - r["plain_s"]) / r["ckpts"] if r.get("ckpts") else None
    measured = [res["machines"][n] for n in _measured(args)]
    lost = [r["lost_per_ckpt_s"] for r in measured]
    res["measured"] = list(_measured(args))
    res["loop_s"] = max(r["loop_s"] for r in measured)
    res["lost_per_ckpt_s"] = max(lost) if None not in lost else None
    ckpts_expected = args.steps // args.every
    if variant == "plain":  # the noise floor: two plain loops of one process, per checkpoint
        res["noise_per_ckpt_s"] = max(
            abs(r["loop_s"] - r["plain_s"]) / max(1, ckpts_expected) for r in measured
        )
    return res


def _measured(args: argparse.Namespace) -> tuple[str, ...]:
    """The machines whose loops are measured: both, or with ``--spare-core`` only ``a`` (``b``
    shares the agents' core and only feeds ``a`` its replicas)."""
    return ("a",) if args.spare_core else NODES


def _agent_snap(m: Machines, pid: int) -> dict[str, Any]:
    return {"proc": C.proc_snapshot(pid), "log": C.thread_log(m.probe_dir, pid)}


def _free_port() -> int:
    import peer_reload

    return peer_reload._free_port()


def _verdict(
    ratio: float | None,
    off: float | None,
    noise: float | None,
    round_ratios: list[float | None] | None = None,
    difference: float | None = None,
) -> dict[str, Any]:
    """Missed when the median difference exceeds the allowance plus the noise floor; else met,
    or undecided (None) where the figures cannot tell: a ratio of a negative
    or missing time lost (in the medians or any round), rounds on both sides of the target, or
    an allowance (10% of the time lost without replicas) smaller than the noise floor."""
    rr = round_ratios or []
    # Missed outright when the difference the replicas make is clear of the allowance plus the
    # noise floor, whatever the sign of the time lost without them (which may be inside noise).
    if difference is not None and noise is not None and off is not None:
        allowance = 0.1 * max(off, 0.0)
        if difference > allowance + noise:
            return {
                "what": "replication adds < 10% to the time lost per checkpoint",
                "value": ratio,
                "met": False,
                "note": f"missed: replicas add {difference:.3f} s per checkpoint, more than the "
                f"allowance ({allowance:.3f} s) plus the noise floor ({noise:.3f} s)",
            }
    out: dict[str, Any] = {
        "what": "replication adds < 10% to the time lost per checkpoint",
        "value": ratio,
        "met": None,
    }
    if ratio is None or ratio < 0 or off is None or any(x is None or x < 0 for x in rr):
        out["note"] = "undecided: a time lost per checkpoint is missing or negative (noise)"
    elif rr and min(rr) < 1.10 <= max(rr):  # type: ignore[type-var]
        out["note"] = "undecided: the rounds fall on both sides of the target"
    elif noise is not None and 0.1 * off < noise:
        out["note"] = (
            f"undecided: the 10% allowance ({0.1 * off:.3f} s) is inside the noise floor "
            f"({noise:.3f} s per checkpoint)"
        )
    else:
        out["met"] = ratio < 1.10
    return out


def summarize(
    runs: list[dict[str, Any]], rounds: int, measured: tuple[str, ...] = NODES
) -> dict[str, Any]:
    by = {(r["variant"], r["round"]): r for r in runs}
    per_round = []
    for rnd in range(1, rounds + 1):
        r0, r1, pl = (by.get((v, rnd)) for v in ("replicas0", "replicas1", "plain"))
        l0 = r0.get("lost_per_ckpt_s") if r0 else None
        l1 = r1.get("lost_per_ckpt_s") if r1 else None

        def vs_plain(r: dict[str, Any] | None, pl: dict[str, Any] | None = pl) -> float | None:
            """Of the slower machine: (its checkpointed loop - the mean of its two loops in the
            round's plain variant) / checkpoints; another process's loops as the reference."""
            if r is None or pl is None:
                return None
            got = []
            for n in measured:
                m, p = r["machines"][n], pl["machines"][n]
                got.append((m["loop_s"] - (p["plain_s"] + p["loop_s"]) / 2) / max(1, m["ckpts"]))
            return max(got)

        v0, v1 = vs_plain(r0), vs_plain(r1)
        per_round.append(
            {
                "round": rnd,
                "lost_per_ckpt_replicas0_s": l0,
                "lost_per_ckpt_replicas1_s": l1,
                "ratio_on_off": C.ratio(l1, l0),
                "difference_s": (l1 - l0) if l0 is not None and l1 is not None else None,
                "noise_per_ckpt_s": pl.get("noise_per_ckpt_s") if pl else None,
                "lost_vs_plain_variant_replicas0_s": v0,
                "lost_vs_plain_variant_replicas1_s": v1,
                "difference_vs_plain_variant_s": (v1 - v0) if None not in (v0, v1) else None,
            }
        )

    def med(k: str) -> float | None:
        return C.median([x[k] for x in per_round if x[k] is not None])

    ratio = C.ratio(med("lost_per_ckpt_replicas1_s"), med("lost_per_ckpt_replicas0_s"))
    pushes = [a for r in runs if r["variant"] == "replicas1" for a in r.get("agents", {}).values()]
    nbytes = sum(a["push_bytes"] for a in pushes)
    secs = sum(a["push_seconds"] for a in pushes)
    # The agents' replication threads' CPU per push: the sender (flashckpt-agent-replica) and
    # the receiving server's connection threads (fc-replica); with --pin on the trainer's core.
    send, recv = [], []
    for a in pushes:
        th, n = a["cpu"]["threads_cpu_s"], a["pushes"]
        if n:
            send.append(th.get("flashckpt-agent-replica", 0.0) / n)
            recv.append(th.get("fc-replica", 0.0) / n)
    return {
        "per_round": per_round,
        "median_sender_cpu_s_per_push": C.median(send),
        "median_receiver_cpu_s_per_push": C.median(recv),
        "median_lost_per_ckpt_replicas0_s": med("lost_per_ckpt_replicas0_s"),
        "median_lost_per_ckpt_replicas1_s": med("lost_per_ckpt_replicas1_s"),
        "median_difference_s": med("difference_s"),
        "median_noise_per_ckpt_s": med("noise_per_ckpt_s"),
        "median_lost_vs_plain_variant_replicas0_s": med("lost_vs_plain_variant_replicas0_s"),
        "median_lost_vs_plain_variant_replicas1_s": med("lost_vs_plain_variant_replicas1_s"),
        "ratio_on_off_of_medians": ratio,
        "push_gib_s": (nbytes / C.GiB / secs) if secs > 0 else None,
        "target": _verdict(
            ratio,
            med("lost_per_ckpt_replicas0_s"),
            med("noise_per_ckpt_s"),
            [x["ratio_on_off"] for x in per_round],
            med("difference_s"),
        ),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dim", type=int, default=2048, help="Linear width (default 2048)")
    p.add_argument("--layers", type=int, default=10, help="Linear layers (default 10: ~0.5 GB)")
    p.add_argument("--batch", type=int, default=64, help="batch rows (default 64)")
    p.add_argument("--steps", type=int, default=30, help="timed steps per loop (default 30)")
    p.add_argument("--every", type=int, default=5, help="checkpoint every K steps (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before the loops")
    p.add_argument("--rounds", type=int, default=3, help="rounds of the three variants")
    p.add_argument("--threads", type=int, default=2, help="torch threads per trainer unpinned")
    pin = p.add_mutually_exclusive_group()
    pin.add_argument("--pin", dest="pin", action="store_true", default=None, help="one core each")
    pin.add_argument("--no-pin", dest="pin", action="store_false", help="no core pinning")
    p.add_argument(
        "--spare-core",
        action="store_true",
        help="machine a's trainer alone on core 0; both agents and b's trainer on core 1; only "
        "a's loop is measured (an agent with a core of its own, as on a GPU host)",
    )
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per variant run")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.pin is None:
        a.pin = len(os.sched_getaffinity(0)) >= 2
    if a.spare_core and (not a.pin or len(os.sched_getaffinity(0)) < 2):
        p.error("--spare-core needs two cores and pinning (not --no-pin)")
    for k in ("dim", "layers", "batch", "steps", "every", "rounds"):
        if getattr(a, k) < 1:
            p.error(f"--{k}: must be >= 1")
    if a.steps < a.every:
        p.error(f"--steps {a.steps} < --every {a.every}: the timed loop would hold no checkpoint")
    return a


def _write(path: str, obj: Any) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child is not None:
        got = child(json.loads(args.child))
        if args.out:
            _write(args.out, got)
        return 0
    out: dict[str, Any] = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": C.machine_info(),
        "args": {k: v for k, v in vars(args).items() if k != "child"},
        "pinned": args.pin,
        "pinned_note": (
            "machine a's trainer alone on one core; both agents and b's trainer on the other; "
            "only a measured; trainers with 1 torch thread"
            if args.spare_core
            else "each machine (agent + trainer) on a core of its own, trainers with 1 torch thread"
            if args.pin
            else f"no pinning; trainers with {args.threads} torch threads"
        ),
        "load_start": os.getloadavg(),
        "runs": [],
        "errors": [],
    }
    t0 = time.perf_counter()
    m = Machines(args.pin, idle_timeout=args.timeout + 60, spare_core=args.spare_core)
    try:
        with C.terminate_as_exception():
            out["cpus"] = {n: m.cpu[n] for n in NODES}
            out["agent_cpus"] = {n: m.agent_cpu[n] for n in NODES}
            out["tmpfs"] = bool(m.mounts)
            for rnd in range(1, args.rounds + 1):
                order = list(VARIANTS)
                random.Random(rnd).shuffle(order)
                for v in order:
                    log(f"round {rnd}/{args.rounds}: {v}")
                    try:
                        r = run_variant(m, args, v, rnd)
                    except Exception as e:
                        out["errors"].append(f"{v} round {rnd}: {type(e).__name__}: {e}"[:2000])
                        log(f"  error: {out['errors'][-1][:300]}")
                        continue
                    out["runs"].append(r)
                    pushes = sum(a["pushes"] for a in r.get("agents", {}).values())
                    log(
                        f"  loop {r['loop_s']:.2f} s, lost/ckpt {C.fmt_s(r['lost_per_ckpt_s'])}"
                        f", pushes {pushes}, load {r['load_end'][0]:.2f}"
                    )
                    if args.out:
                        _write(args.out, out)
    finally:
        m.close()
    out["summary"] = summarize(out["runs"], args.rounds, _measured(args))
    out["load_end"] = os.getloadavg()
    out["wall_s"] = time.perf_counter() - t0
    if args.out:
        _write(args.out, out)
    print(json.dumps(out["summary"], indent=1, default=str))
    return 1 if out["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
