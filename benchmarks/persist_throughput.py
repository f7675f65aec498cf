"""Persistence throughput: the node agent's persist of one snapshot against the raw disk, in one
run (issue 14: "persistence throughput unchanged, >= 70% of the disk").

For each size (GB of 1e9 bytes; default 0.5 and 2), in one process, with a real node agent
(``python -m flashckpt agent``, as a launcher starts it: nice 10, its hash and persist threads at
nice 15 and the lowest best-effort IO priority) persisting to a directory on the disk:

- the raw disk: a sequential write of as many bytes as the shard + fsync, from a page-aligned
  buffer with ``os.write`` in 64 MiB chunks (``benchmarks/_common.disk_write_speed``), buffered
  (page cache) and ``O_DIRECT``, into the same directory, before every persist sample and after
  the last (each persist sample sits between two of each);
- the agent's persist of a snapshot: ``save()`` of a state of that size (float32 parameters,
  random), then ``flush()`` until the agent committed it. Timed from the trainer (``flush``: the
  agent's wake-up, persist and commit), from the agent's log line (``persisted step N: ... in
  T s``: from the pick to the node's part written) with its phases (the completion hash waited
  for or computed, the shard written from the slot with each chunk hashed after it was written,
  pauses for a trainer's copy, the rank file, the part) and the commit's own line (manifest and
  ``latest``), and the agent process's CPU over the flush (``/proc``).

The ratios are of medians (MiB/s of the agent's persist over MiB/s of the disk), and the
median of the ratios of each persist to the mean of the two disk samples around it (paired: the
same load). The load average is recorded at every sample: the machine may be shared.

Run from the repository root::

    python benchmarks/persist_throughput.py --out benchmarks/runs/persist-throughput.json
    python benchmarks/persist_throughput.py --sizes 0.05 --repeats 1      # a smoke run
    python benchmarks/persist_throughput.py --report benchmarks/runs/persist-throughput.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time
from typing import Any

import torch

import flashckpt

try:
    from benchmarks import _common as C
except ImportError:  # run as a script: benchmarks/ is sys.path[0]
    import _common as C  # type: ignore[no-redef]

NODE = "n0"
CHUNK_ELEMS = 16 << 20  # float32 elements per parameter tensor (64 MiB)

_PERSISTED = re.compile(
    r"persisted step (\d+): ([\d.]+) MiB in ([\d.]+) s \(\d+ MiB/s; lock ([\d.]+) s, completion "
    r"hash ([\d.]+) s, shards ([\d.]+) s at \d+ MiB/s of which paused ([\d.]+) s, rank files "
    r"([\d.]+) s, part ([\d.]+) s\)"
)
_COMMITTED = re.compile(
    r"committed step (\d+) to \S+: manifest and latest in ([\d.]+) s .*?retention removed .*? "
    r"in ([\d.]+) s"
)


class State(torch.nn.Module):
    """Random float32 parameters of ``nbytes`` in all (64 MiB tensors), no computation."""

    def __init__(self, nbytes: int, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        left = nbytes // 4
        ps = []
        while left > 0:
            n = min(left, CHUNK_ELEMS)
            ps.append(torch.nn.Parameter(torch.randn(n, generator=g), requires_grad=False))
            left -= n
        self.ps = torch.nn.ParameterList(ps)

    def touch(self, step: int) -> None:
        """Changes the state a little (a new step's snapshot differs from the last)."""
        with torch.no_grad():
            for p in self.ps:
                p[:16] += step


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def _disk(directory: str, nbytes: int) -> dict[str, float]:
    buffered = C.disk_write_speed(directory, nbytes)
    direct = C.disk_write_speed(directory, nbytes, direct=True)
    return {"buffered_s": buffered, "direct_s": direct, "load": _load()}


def _agent_lines(
    path: str,
) -> tuple[dict[int, dict[str, float]], dict[int, tuple[float, float]]]:
    persisted: dict[int, dict[str, float]] = {}
    committed: dict[int, tuple[float, float]] = {}
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return persisted, committed
    for m in _PERSISTED.finditer(text):
        keys = ("mib", "s", "lock_s", "hash_s", "shard_s", "paused_s", "rank_s", "part_s")
        persisted[int(m.group(1))] = dict(zip(keys, map(float, m.groups()[1:]), strict=True))
    for m in _COMMITTED.finditer(text):
        committed[int(m.group(1))] = (float(m.group(2)), float(m.group(3)))
    return persisted, committed


def _wait_retention(path: str, step: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while step not in _agent_lines(path)[1]:
        if time.monotonic() > deadline:
            raise RuntimeError(f"no commit line for step {step} in {path} in {timeout:.0f} s")
        time.sleep(0.01)


def bench_size(ws: C.Workspace, size_gb: float, repeats: int) -> dict[str, Any]:
    nbytes = int(size_gb * 1e9)
    job = ws.new_job("pt")
    root = os.path.dirname(ws.path("store", job, "x"))
    url = f"file://{root}"
    load_start = _load()
    t0 = time.perf_counter()
    model = State(nbytes)
    build_s = time.perf_counter() - t0
    pid = ws.start_agent(job, NODE, url)
    samples: list[dict[str, Any]] = []
    disk: list[dict[str, float]] = []
    ck = flashckpt.checkpointing(
        model,
        job=job,
        node=NODE,
        run_dir=ws.run_dir,
        storage=url,
        agent="connect",
        mode="sync",
        every=0,
        persist_every=1,
        keep=2,
        restore=False,
        agent_idle_timeout=120.0,
    )
    ck.__enter__()
    try:
        # The first snapshot (slots allocated and pre-faulted at entry, the first persist of a
        # new root): measured, reported apart, not in the medians.
        for i in range(repeats + 1):
            if i > 0:
                disk.append(_disk(root, nbytes))
            model.touch(i + 1)
            ck.step()
            t1 = time.perf_counter()
            ck.save()
            save_s = time.perf_counter() - t1
            before = C.proc_snapshot(pid)
            load = _load()
            t1 = time.perf_counter()
            got = ck.flush()
            flush_s = time.perf_counter() - t1
            after = C.proc_snapshot(pid)
            step = ck.steps_done
            if got != step:
                raise RuntimeError(f"flush returned {got}, expected step {step}")
            # Retention deletes the step before last after the commit is announced: the next
            # disk sample must not share the disk with that unlink.
            _wait_retention(ws.log_path(job, NODE), step)
            cpu = None
            if before["cpu_s"] is not None and after["cpu_s"] is not None:
                cpu = after["cpu_s"] - before["cpu_s"]
            written = after["io"].get("write_bytes", 0) - before["io"].get("write_bytes", 0)
            samples.append(
                {
                    "step": step,
                    "first": i == 0,
                    "save_s": save_s,
                    "flush_s": flush_s,
                    "agent_cpu_s": cpu,
                    "agent_write_bytes": written,
                    "load": load,
                }
            )
            log(f"  {size_gb} GB step {step}: save {save_s:.3f} s, flush {flush_s:.3f} s")
        disk.append(_disk(root, nbytes))
        shard_dir = os.path.join(root, f"step-{ck.steps_done:09d}")
        shard_bytes = sum(
            os.path.getsize(os.path.join(shard_dir, f))
            for f in os.listdir(shard_dir)
            if f.endswith(".safetensors")
        )
    finally:
        ck.__exit__(None, None, None)
        ws.stop_agent(pid)
        ws.remove_job_shm(job)
    persisted, committed = _agent_lines(ws.log_path(job, NODE))
    for s in samples:
        s["agent"] = persisted.get(s["step"])
        s["commit_s"], s["retention_s"] = committed.get(s["step"], (None, None))
    del model
    return summarize(size_gb, nbytes, shard_bytes, samples, disk, build_s, load_start)


def summarize(
    size_gb: float,
    nbytes: int,
    shard_bytes: int,
    samples: list[dict[str, Any]],
    disk: list[dict[str, float]],
    build_s: float,
    load_start: float,
) -> dict[str, Any]:
    mib = shard_bytes / C.MiB
    steady = [s for s in samples if not s["first"]]

    def rate(seconds: float | None) -> float | None:
        return None if not seconds else mib / seconds

    def med(key: str) -> float | None:
        return C.median([s[key] for s in steady if s.get(key) is not None])

    def med_agent(key: str) -> float | None:
        return C.median([s["agent"][key] for s in steady if s.get("agent")])

    dd_b = C.median([d["buffered_s"] for d in disk])
    dd_d = C.median([d["direct_s"] for d in disk])
    agent_s, flush_s = med_agent("s"), med("flush_s")
    paired: dict[str, list[float]] = {"agent_vs_direct": [], "flush_vs_direct": []}
    for k, s in enumerate(steady):
        around = disk[k : k + 2]  # the disk samples just before and after this persist
        direct = sum(d["direct_s"] for d in around) / len(around)
        if s.get("agent"):
            paired["agent_vs_direct"].append(direct / s["agent"]["s"])
        paired["flush_vs_direct"].append(direct / s["flush_s"])
    phases = {
        k: med_agent(k)
        for k in ("lock_s", "hash_s", "shard_s", "paused_s", "rank_s", "part_s")
        if med_agent(k) is not None
    }
    out = {
        "size_gb": size_gb,
        "state_bytes": nbytes,
        "shard_bytes": shard_bytes,
        "build_s": build_s,
        "load_at_start": load_start,
        "samples": samples,
        "disk": disk,
        "median": {
            "disk_buffered_s": dd_b,
            "disk_direct_s": dd_d,
            "agent_persist_s": agent_s,
            "flush_s": flush_s,
            "commit_s": med("commit_s"),
            "retention_s": med("retention_s"),
            "save_s": med("save_s"),
            "agent_cpu_s": med("agent_cpu_s"),
            "phases_s": phases,
        },
        "mib_s": {
            "disk_buffered": rate(dd_b),
            "disk_direct": rate(dd_d),
            "agent_persist": rate(agent_s),
            "agent_shards": rate(phases.get("shard_s")),
            "flush": rate(flush_s),
        },
        "ratio": {
            "agent_vs_direct": C.ratio(dd_d, agent_s),
            "agent_vs_buffered": C.ratio(dd_b, agent_s),
            "flush_vs_direct": C.ratio(dd_d, flush_s),
            "paired_agent_vs_direct": C.median(paired["agent_vs_direct"]),
            "paired_flush_vs_direct": C.median(paired["flush_vs_direct"]),
        },
        "paired": paired,
    }
    r = out["ratio"]["agent_vs_direct"]
    out["target"] = {
        "what": "agent persist >= 70% of the disk's O_DIRECT sequential write (ratio of medians)",
        "met": None if r is None else r >= 0.7,
    }
    return out


def _git_head() -> str | None:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _f(x: float | None, fmt: str = "{:.0f}") -> str:
    return "-" if x is None else fmt.format(x)


def markdown(res: dict[str, Any]) -> str:
    lines = [
        "| size | shard MiB | disk buffered MiB/s | disk O_DIRECT MiB/s | agent persist MiB/s "
        "| flush (end to end) MiB/s | agent / O_DIRECT | flush / O_DIRECT | paired agent / "
        "O_DIRECT | load |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for s in res["sizes"]:
        m, r = s["mib_s"], s["ratio"]
        loads = [x["load"] for x in s["samples"]] + [d["load"] for d in s["disk"]]
        lines.append(
            f"| {s['size_gb']} GB | {s['shard_bytes'] / C.MiB:.0f} | {_f(m['disk_buffered'])} "
            f"| {_f(m['disk_direct'])} | {_f(m['agent_persist'])} | {_f(m['flush'])} "
            f"| {_f(r['agent_vs_direct'], '{:.2f}')} | {_f(r['flush_vs_direct'], '{:.2f}')} "
            f"| {_f(r['paired_agent_vs_direct'], '{:.2f}')} "
            f"| {min(loads):.1f}-{max(loads):.1f} |"
        )
    lines += [
        "",
        "Where the agent's persist goes (medians, s): lock | completion hash | shards (write + "
        "hash of each chunk; of it paused) | rank file | part | then the commit | agent CPU over "
        "the flush | flush (retention runs after the commit is announced)",
        "",
        "| size | lock | completion hash | shards | of it paused | rank file | part | commit "
        "| retention | agent CPU | flush | save() |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in res["sizes"]:
        m = s["median"]
        p = m["phases_s"]
        g = "{:.3f}"
        lines.append(
            f"| {s['size_gb']} GB | {_f(p.get('lock_s'), g)} | {_f(p.get('hash_s'), g)} "
            f"| {_f(p.get('shard_s'), g)} | {_f(p.get('paused_s'), g)} | {_f(p.get('rank_s'), g)} "
            f"| {_f(p.get('part_s'), g)} | {_f(m['commit_s'], g)} "
            f"| {_f(m.get('retention_s'), g)} | {_f(m['agent_cpu_s'], g)} "
            f"| {_f(m['flush_s'], g)} | {_f(m['save_s'], g)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="0.5,2", help="GB (1e9 bytes) of state, comma-separated")
    p.add_argument("--repeats", type=int, default=3, help="steady persists per size")
    p.add_argument("--out", default=None, help="JSON result (written after every size)")
    p.add_argument("--report", default=None, help="print the markdown tables of a result")
    a = p.parse_args(argv)
    if a.report:
        with open(a.report) as f:
            print(markdown(json.load(f)))
        return 0
    res: dict[str, Any] = {
        "benchmark": "persist_throughput",
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": _git_head(),
        "machine": C.machine_info(),
        "argv": sys.argv[1:],
        "sizes": [],
    }
    with C.terminate_as_exception(), C.Workspace("fcpt") as ws:
        res["disk_dir"] = ws.root
        for size in (float(x) for x in a.sizes.split(",")):
            log(f"size {size} GB (load {_load()})")
            res["sizes"].append(bench_size(ws, size, a.repeats))
            res["load_at_end"] = _load()
            if a.out:
                os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
                with open(a.out, "w") as f:
                    json.dump(res, f, indent=1)
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
