"""Persisting to S3: flashckpt's shard write against what the store takes, and the training
loop's time lost per checkpoint with ``s3://`` storage against ``file://``.

A real S3 server on loopback (SeaweedFS, ``flashckpt.testing.s3``). For each ``--gib`` size the
same bytes (in memory) are uploaded and read back in interleaved rounds (the machine is shared:
each round runs every variant once, the order rotated round by round):

- ``product``: the node agent's shard write, ``Storage.write_buffer`` (head + data from a
  memoryview, hashed as it goes: a parallel multipart upload) to ``s3://ckpts/...``;
- ``plain``: one plain ``s3fs`` upload (``fs.open(key, "wb")``, written 64 MiB at a time);
- ``limit``: a parallel multipart upload straight through the S3 API with the store's best
  settings (``--parts`` MiB parts, ``--concurrency`` in flight; ``--sweep`` picks them first
  from a grid, one 256 MiB upload each, and records the grid);
- ``dcp``: torch DCP's ``async_save`` of the bytes (one uint8 tensor) to the same bucket through
  fsspec (``FsspecWriter``), until its future is done: the peer;
- ``read-product`` / ``read-plain`` / ``read-dcp``: reading it back with ``Storage.read_file``
  (what restore does, checking size and hash), with one plain ``s3fs`` ``cat_file``, and with
  ``dcp.load`` through ``FsspecReader``.

With ``--loop``: a training loop (``--loop-mib`` MiB of parameters, Adam; a step is
``--loop-sleep`` seconds of compute stand-in, a snapshot every ``--loop-every`` steps, every
snapshot persisted) run with no checkpointing, with ``storage=file://``, and with
``storage=s3://`` (its node agent persists), rounds interleaved; the time lost per checkpoint is
(loop time - loop time without checkpointing) / snapshots. Persistence stays in the agent, so the
two storages should lose the same.

Output: JSON with every round's seconds and the client's CPU seconds (the server is another
process: what the client spends shows apart from the load), medians, MB/s, ratios to ``limit``
and to ``read-plain``, the load average before and after. Example (what the README's table ran)::

    python benchmarks/s3_persist.py --gib 1 4 --rounds 2 --sweep --loop \\
        --out benchmarks/runs/s3-persist.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import mmap
import os
import resource
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
from _common import machine_info, median

from flashckpt.format.manifest import FileEntry
from flashckpt.format.storage import Storage
from flashckpt.testing.s3 import SeaweedS3

SHARD = "shard-00000-of-00001.safetensors"
WRITES = ("product", "plain", "limit", "dcp")
READS = ("read-product", "read-plain", "read-dcp")


def _limit(fs: Any, key: str, data: memoryview, part: int, concurrency: int) -> None:
    """A parallel multipart upload of ``data`` to ``ckpts/key`` through s3fs's client."""

    async def run() -> None:
        s3 = await fs.set_session()
        up = await s3.create_multipart_upload(Bucket="ckpts", Key=key)
        sem = asyncio.Semaphore(concurrency)

        async def one(n: int, off: int) -> dict[str, Any]:
            async with sem:
                r = await s3.upload_part(
                    Bucket="ckpts",
                    Key=key,
                    UploadId=up["UploadId"],
                    PartNumber=n,
                    Body=bytes(data[off : off + part]),
                )
                return {"PartNumber": n, "ETag": r["ETag"]}

        parts = await asyncio.gather(
            *(one(i + 1, off) for i, off in enumerate(range(0, len(data), part)))
        )
        await s3.complete_multipart_upload(
            Bucket="ckpts", Key=key, UploadId=up["UploadId"], MultipartUpload={"Parts": parts}
        )

    from fsspec.asyn import sync

    sync(fs.loop, run)


def sweep(fs: Any, data: memoryview) -> dict[str, Any]:
    """The limit's settings: one upload per (part MiB, concurrency) of the grid, the fastest."""
    grid: dict[str, float] = {}
    for part in (16, 32, 64):
        for conc in (4, 8, 16):
            t = time.perf_counter()
            _limit(fs, f"sweep/{part}x{conc}", data, part << 20, conc)
            grid[f"{part}x{conc}"] = time.perf_counter() - t
            fs.rm(f"ckpts/sweep/{part}x{conc}")
            print(f"sweep {part} MiB x {conc}: {grid[f'{part}x{conc}']:.2f} s", flush=True)
    best = min(grid, key=grid.__getitem__)
    part, conc = (int(x) for x in best.split("x"))
    return {"grid_s": grid, "part_mib": part, "concurrency": conc}


def transfer(
    fs: Any, n: int, rounds: int, part: int, conc: int
) -> tuple[dict[str, list[float]], dict[str, Any]]:
    """Every variant once per round on ``n`` bytes; the seconds of each."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    buf = mmap.mmap(-1, n)
    rnd = os.urandom(1 << 20)
    for off in range(0, n, 1 << 20):
        buf[off : off + (1 << 20)] = rnd[: min(1 << 20, n - off)]
    data = memoryview(buf)
    tensor = torch.frombuffer(buf, dtype=torch.uint8)
    head = b"\0" * 4096
    st = Storage("s3://ckpts/bench")
    times: dict[str, list[float]] = {k: [] for k in (*WRITES, *READS)}
    recs: dict[int, Any] = {}

    def write(name: str, r: int) -> None:
        if name == "product":
            recs[r] = st.write_buffer(st.step_path(r, SHARD), head, data)
        elif name == "plain":
            # in 64 MiB writes: fsspec's buffered file copies what one write gives it into its
            # buffer first (a 4 GiB run here was OOM-killed with 9 GiB of anonymous memory)
            with fs.open(f"ckpts/plain/{r}", "wb") as f:
                for off in range(0, n, 64 << 20):
                    f.write(data[off : off + (64 << 20)])
        elif name == "limit":
            _limit(fs, f"limit/{r}", data, part, conc)
        else:
            w = FsspecWriter(f"s3://ckpts/dcp/{r}", sync_files=False)
            dcp.async_save({"data": tensor}, storage_writer=w).result()

    def read(name: str, r: int) -> None:
        if name == "read-product":
            # restore's read, checked against the manifest's size and hash (read_file looks
            # up the file's entry only)
            m = SimpleNamespace(files={SHARD: FileEntry(recs[r].size, recs[r].xxh3_64)})
            st.read_file(r, SHARD, m)  # type: ignore[arg-type]
        elif name == "read-plain":
            fs.cat_file(f"ckpts/plain/{r}")
        else:
            out = {"data": torch.empty(n, dtype=torch.uint8)}
            dcp.load(out, storage_reader=FsspecReader(f"s3://ckpts/dcp/{r}"))
            assert torch.equal(out["data"][:4096], tensor[:4096])

    cpu: dict[str, list[float]] = {k: [] for k in times}

    def run(name: str, fn: Any) -> None:
        # the client's CPU (every thread of this process; the server is another process) and
        # the wall time
        c, t = _cpu(), time.perf_counter()
        fn(name, r)
        times[name].append(time.perf_counter() - t)
        cpu[name].append(_cpu() - c)

    for r in range(rounds):
        order = WRITES[r % len(WRITES) :] + WRITES[: r % len(WRITES)]
        for name in order:
            run(name, write)
        rorder = READS[r % 3 :] + READS[: r % 3]
        for name in rorder:
            run(name, read)
        print(
            f"{n / (1 << 30):g} GiB round {r + 1}: "
            + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()),
            flush=True,
        )
        for key in (f"ckpts/plain/{r}", f"ckpts/limit/{r}", f"ckpts/dcp/{r}"):
            fs.rm(key, recursive=True)
        st.fs.rm(st.step_path(r), recursive=True)
    data.release()
    buf.close()
    return times, {
        **summarize(times, n),
        "client_cpu_s": cpu,
        "client_cpu_median_s": {k: median(v) for k, v in cpu.items()},
    }


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def summarize(times: dict[str, list[float]], n: int) -> dict[str, Any]:
    med = {k: median(v) for k, v in times.items()}
    return {
        "median_s": med,
        "mb_per_s": {k: n / v / 1e6 for k, v in med.items() if v},
        "ratio_to_limit": {k: med[k] / med["limit"] for k in WRITES if med[k] and med["limit"]},
        "ratio_to_read_plain": {
            k: med[k] / med["read-plain"] for k in READS if med[k] and med["read-plain"]
        },
    }


# -- the training loop ---------------------------------------------------------------------
def loop_worker(a: argparse.Namespace) -> int:
    """One training loop (in its own process); prints its JSON result."""
    import torch

    import flashckpt

    torch.set_num_threads(1)
    torch.manual_seed(0)
    width = 1024
    layers = max(1, (a.loop_mib << 20) // (width * width * 4))
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(8, width)

    def step() -> None:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        time.sleep(a.loop_sleep)  # the accelerator's compute, not this machine's CPU

    step()  # Adam's state exists before the first snapshot
    if a.worker_storage == "off":
        t = time.perf_counter()
        for _ in range(a.loop_steps):
            step()
        print(json.dumps({"loop_s": time.perf_counter() - t, "snapshots": 0}))
        return 0
    with flashckpt.checkpointing(
        model,
        opt,
        storage=a.worker_storage,
        every=a.loop_every,
        persist_every=1,
        job=a.worker_job,
        run_dir=a.worker_run_dir,
        agent_idle_timeout=60,
    ) as ck:
        t = time.perf_counter()
        for _ in range(a.loop_steps):
            step()
            ck.step()
        loop_s = time.perf_counter() - t
        stats = ck.stats
    print(
        json.dumps(
            {
                "loop_s": loop_s,
                "snapshots": a.loop_steps // a.loop_every,
                "skips": stats.skips,
                "last_committed_step": stats.last_committed_step,
            }
        )
    )
    return 0


def loop(a: argparse.Namespace, tmp: str, server: SeaweedS3) -> dict[str, Any]:
    """The loop with no checkpointing, file:// and s3:// storage, ``a.loop_rounds`` rounds."""
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "file": [], "s3": []}
    for r in range(a.loop_rounds):
        for kind in ("off", "file", "s3")[r % 3 :] + ("off", "file", "s3")[: r % 3]:
            job = f"s3b{uuid.uuid4().hex[:8]}"
            url = {"off": "off", "file": f"file://{tmp}/loop-{job}", "s3": f"s3://ckpts/{job}"}
            cmd = [
                sys.executable,
                __file__,
                "--loop-worker",
                *("--worker-storage", url[kind], "--worker-job", job),
                *("--worker-run-dir", f"{tmp}/run-{job}"),
                *("--loop-mib", str(a.loop_mib), "--loop-steps", str(a.loop_steps)),
                *("--loop-every", str(a.loop_every), "--loop-sleep", str(a.loop_sleep)),
            ]
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            if p.returncode:
                raise SystemExit(f"loop worker {kind} failed:\n{p.stderr[-3000:]}")
            res = json.loads(p.stdout.strip().splitlines()[-1])
            runs[kind].append(res)
            print(f"loop round {r + 1} {kind}: {res}", flush=True)
    off = median([x["loop_s"] for x in runs["off"]]) or 0.0
    lost = {
        k: median([(x["loop_s"] - off) / x["snapshots"] for x in runs[k]]) for k in ("file", "s3")
    }
    return {
        "settings": {
            "param_mib": a.loop_mib,
            "steps": a.loop_steps,
            "every": a.loop_every,
            "step_sleep_s": a.loop_sleep,
            "persist_every": 1,
        },
        "runs": runs,
        "loop_s_median": {k: median([x["loop_s"] for x in v]) for k, v in runs.items()},
        "lost_per_checkpoint_s": lost,
        "ratio_s3_to_file": (lost["s3"] / lost["file"]) if lost["file"] else None,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--gib", type=float, nargs="*", default=[1.0], help="sizes, GiB")
    p.add_argument("--rounds", type=int, nargs="*", default=[2], help="per size (the last repeats)")
    p.add_argument("--parts", type=int, default=32, help="limit: part size, MiB")
    p.add_argument("--concurrency", type=int, default=8, help="limit: parts in flight")
    p.add_argument("--sweep", action="store_true", help="pick the limit's settings first")
    p.add_argument("--loop", action="store_true", help="also the training loop's time lost")
    p.add_argument("--loop-rounds", type=int, default=2)
    p.add_argument("--loop-mib", type=int, default=64, help="loop: parameters, MiB")
    p.add_argument("--loop-steps", type=int, default=40)
    p.add_argument("--loop-every", type=int, default=4)
    p.add_argument("--loop-sleep", type=float, default=0.25)
    p.add_argument("--out", default=None)
    p.add_argument("--loop-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-storage", help=argparse.SUPPRESS)
    p.add_argument("--worker-job", help=argparse.SUPPRESS)
    p.add_argument("--worker-run-dir", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.loop_worker:
        return loop_worker(a)
    out: dict[str, Any] = {"benchmark": "s3_persist", "argv": sys.argv[1:]}
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="s3bench") as tmp, SeaweedS3(tmp + "/s3") as server:
        os.environ.update(server.env())
        fs = server.filesystem()
        part, conc = a.parts << 20, a.concurrency
        if a.sweep:
            n = min(int(a.gib[0] * (1 << 30)), 256 << 20)
            buf = mmap.mmap(-1, n)
            buf.write(os.urandom(1 << 20) * (n >> 20))
            out["sweep"] = sweep(fs, memoryview(buf))
            buf.close()
            part, conc = out["sweep"]["part_mib"] << 20, out["sweep"]["concurrency"]
        out["limit_settings"] = {"part_mib": part >> 20, "concurrency": conc}
        out["sizes"] = {}
        for i, gib in enumerate(a.gib):
            n = int(gib * (1 << 30))
            rounds = a.rounds[min(i, len(a.rounds) - 1)]
            times, summary = transfer(fs, n, rounds, part, conc)
            out["sizes"][f"{gib:g}GiB"] = {"bytes": n, "seconds": times, **summary}
            save(out, a.out, load0)  # a run stopped later keeps what it measured
        if a.loop:
            out["loop"] = loop(a, tmp, server)
    print(save(out, a.out, load0))
    return 0


def save(out: dict[str, Any], path: str | None, load0: tuple[float, ...]) -> str:
    out["loadavg_before_after"] = [load0, os.getloadavg()]
    out["note"] = (
        "loopback SeaweedFS on the same 2 cores as the client, shared with other jobs: the "
        "store's limit is CPU, not a network"
    )
    out["machine"] = machine_info()
    text = json.dumps(out, indent=1)
    if path:
        Path(path).write_text(text + "\n")
    return text


if __name__ == "__main__":
    sys.exit(main())
