"""Restore time of a sharded (FSDP2) state at another world size: from memory vs from storage.

A job of ``--from`` ranks (one machine, FSDP2 on gloo, Adam) takes one snapshot, commits it, and
dies with the snapshot still in the node agent's shared memory. Then, for each world size of
``--to``, the job comes back at that size:

* ``memory``: the agent still holds the old ranks' snapshots; the new ranks rebuild their pieces
  from them (``restored_from == "memory-reshard"``);
* ``storage``: the machine lost its memory (agent killed, segments removed, a fresh agent already
  running, page cache of the step files dropped); the new ranks read the overlapping pieces from
  the committed step (``restored_from == "storage"``).

The time is the slowest rank's ``flashckpt.checkpointing(...).__enter__`` (connect, plan, read or
exchange, apply into model and optimizer). Both are measured in the same run; the JSON has every
sample.

    python benchmarks/reshard.py --size-gib 0.5 --from 4 --to 2,3 --repeats 2 --out r.json
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import _common as C
import torch

from flashckpt.elastic.procutil import set_parent_death_signal
from flashckpt.testing.elastic import kill_job

DIM = 2048


def _model(layers: int) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(DIM, DIM) for _ in range(layers)))


def _rank_main(a: argparse.Namespace, rank: int, world: int, phase: str, init: str) -> int:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import flashckpt

    os.environ["LOCAL_WORLD_SIZE"] = str(world)
    os.environ["LOCAL_RANK"] = str(rank)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=600),
    )
    mesh = init_device_mesh("cpu", (world,))
    model = _model(a.layers)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    kw = {"job": a.job, "node": "n0", "run_dir": a.run_dir, "storage": a.storage, "mode": "sync"}
    if phase == "save":
        model(torch.ones(2, DIM)).sum().backward()
        opt.step()
        with flashckpt.checkpointing(model, opt, every=1000, **kw) as ckpt:
            ckpt.step()
            ckpt.save()
            ckpt.flush()
            dist.barrier()
            os._exit(3)  # as if the machine's trainers died: the agent keeps the snapshot
    dist.barrier()
    t0 = time.perf_counter()
    ck = flashckpt.checkpointing(model, opt, every=1000, **kw)
    ck.__enter__()
    took = time.perf_counter() - t0
    with open(a.report, "a") as f:
        f.write(json.dumps({"rank": rank, "s": took, "from": ck.restored_from}) + "\n")
    dist.barrier()
    os._exit(3)  # keep the old snapshots in memory for the next sample


def _fork_ranks(a: argparse.Namespace, world: int, phase: str, tmp: Path) -> None:
    init = str(tmp / f"init-{uuid.uuid4().hex}")
    pids = []
    for rank in range(world):
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                set_parent_death_signal(signal.SIGKILL)  # die with the launcher
                code = _rank_main(a, rank, world, phase, init)
            finally:
                os._exit(code)
        pids.append(pid)
    codes = [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids]
    if codes != [3] * world:
        raise RuntimeError(f"{phase} at {world} ranks: exit codes {codes}")


def _kill_agent(job: str) -> None:
    """SIGKILLs the job's node agent and removes its segments: the machine lost its memory."""
    kill_job([], job)
    for n in os.listdir("/dev/shm"):
        if n.startswith(f"fc.{job}."):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join("/dev/shm", n))


def _start_agent(a: argparse.Namespace) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "flashckpt", "agent", "--job", a.job, "--node", "n0"]
    cmd += ["--run-dir", a.run_dir, "--storage", a.storage, "--idle-timeout", "600"]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    sock = Path(a.run_dir) / f"{a.job}.n0.sock"
    deadline = time.monotonic() + 60
    while not sock.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return p


def _sample(a: argparse.Namespace, world: int, tmp: Path) -> dict[str, Any]:
    Path(a.report).unlink(missing_ok=True)
    _fork_ranks(a, world, "restore", tmp)
    rows = [json.loads(x) for x in Path(a.report).read_text().splitlines()]
    return {"s": max(r["s"] for r in rows), "from": sorted({r["from"] for r in rows})}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gib", type=float, default=0.5, help="model + Adam state, all ranks")
    p.add_argument("--from", dest="src", type=int, default=4)
    p.add_argument("--to", default="2,3")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    a.layers = max(1, round(a.size_gib * C.GiB / (3 * 4 * (DIM * DIM + DIM))))
    tmp = Path(tempfile.mkdtemp(prefix="fc-reshard-"))
    a.job = "rb" + uuid.uuid4().hex[:10]
    a.run_dir = str(tmp / "run")
    a.storage = f"file://{tmp}/ckpt"
    a.report = str(tmp / "report.jsonl")
    results: dict[str, Any] = {
        "machine": C.machine_info(),
        "state_bytes": a.layers * 3 * 4 * (DIM * DIM + DIM),
        "from_world": a.src,
        "runs": {},
    }
    try:
        for world in (int(x) for x in a.to.split(",")):
            _kill_agent(a.job)
            shutil.rmtree(tmp / "ckpt", ignore_errors=True)
            _fork_ranks(a, a.src, "save", tmp)
            mem = [_sample(a, world, tmp) for _ in range(a.repeats)]
            _kill_agent(a.job)  # the machine lost its memory
            agent = _start_agent(a)
            st = []
            for _ in range(a.repeats):
                C.drop_file_cache(str(tmp / "ckpt"))
                st.append(_sample(a, world, tmp))
            agent.kill()
            agent.wait()
            m, s = C.median([x["s"] for x in mem]), C.median([x["s"] for x in st])
            results["runs"][f"{a.src}->{world}"] = {
                "memory_s": m,
                "storage_cold_s": s,
                "storage_over_memory": C.ratio(s, m),
                "memory_samples": mem,
                "storage_samples": st,
            }
            print(
                f"{a.src} -> {world} ranks, {results['state_bytes'] / C.GiB:.2f} GiB: "
                f"memory {C.fmt_s(m)} s  storage (cold) {C.fmt_s(s)} s  "
                f"storage/memory {C.fmt_x(C.ratio(s, m))}  "
                f"sources {mem[0]['from']} / {st[0]['from']}",
                flush=True,
            )
    finally:
        _kill_agent(a.job)
        shutil.rmtree(tmp, ignore_errors=True)
    text = json.dumps(results, indent=1)
    if a.out:
        Path(a.out).write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
