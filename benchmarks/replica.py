"""Bandwidth of snapshot replicas between node agents (flashckpt/agent/replicas/transport.py),
against a memcpy.

Each sample, per size: a complete, hashed snapshot slot of ``size`` bytes of random data on
machine A is pushed over TCP to machine B's
:class:`~flashckpt.agent.replicas.transport.ReplicaServer` (A hashes it as it sends, B as it
receives; B writes it into a slot file of its tmpfs), then fetched back verified into a buffer, as a
replacement machine would read it. The baseline in the same run is a plain copy of the same bytes
into a pre-faulted buffer (the memory bound on this machine), so the ratios say what the transport,
the TCP stack and the two hashes cost.

The holder runs in a process of its own (as another machine's agent would) and both talk over
loopback (127.0.0.1): on one machine the sender, the receiver and the kernel share the cores, so
this is a lower bound of what two machines reach; the network between real machines is the other
bound.

    python benchmarks/replica.py --sizes 0.25,1 --repeats 3 --out replica.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import machine_info, median

from flashckpt import names
from flashckpt.agent.replicas.transport import (
    ReplicaServer,
    ReplicaStore,
    fetch_replica,
    push_replica,
)
from flashckpt.format.shm import Slot, allocate_slot_file

JOB = "benchrep"


def _make_slot(shm_dir: str, nbytes: int) -> Slot:
    path = names.slot_path(shm_dir, JOB, "nA", 0, 0)
    meta = json.dumps({"bench": True}).encode()
    allocate_slot_file(path, len(meta), nbytes)
    slot = Slot(path)
    seq = slot.begin_write()
    slot.write_meta(meta)
    view = slot.data(nbytes)
    block = os.urandom(1 << 20)
    for off in range(0, nbytes, len(block)):
        n = min(len(block), nbytes - off)
        view[off : off + n] = block[:n]
    slot.end_write(seq, 1, meta, nbytes)
    info = slot.header()
    assert info is not None
    slot.record_hash(info.seq, slot.data_hash(info))
    return slot


def _serve(shm_dir: str, limit: int, chunk: int) -> int:
    """The holder machine's side: serves until stdin closes."""
    store = ReplicaStore(shm_dir, JOB, "nB", limit_bytes=limit)
    server = ReplicaServer(store, chunk_bytes=chunk, timeout=120)
    print(json.dumps(list(server.address)), flush=True)
    try:
        sys.stdin.read()
    finally:
        server.close()
        store.close()
    return 0


def run(sizes: list[float], repeats: int, chunk: int) -> dict[str, Any]:
    shm_root = tempfile.mkdtemp(prefix="fcbench-rep-", dir="/dev/shm")
    out: dict[str, Any] = {"machine": machine_info(), "chunk_bytes": chunk, "sizes": []}
    try:
        for gib in sizes:
            nbytes = int(gib * 2**30)
            slot = _make_slot(shm_root, nbytes)
            holder = subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--serve",
                    shm_root,
                    "--limit",
                    str(4 * nbytes + 2**24),
                    "--chunk-mib",
                    str(chunk / 2**20),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            assert holder.stdout is not None and holder.stdin is not None
            host, port = json.loads(holder.stdout.readline())
            address = (str(host), int(port))
            sink = bytearray(nbytes)  # touched once so the fetch and the copy both hit RAM
            sink[::4096] = b"\1" * len(sink[::4096])
            copy_s, push_s, fetch_s = [], [], []
            try:
                for _ in range(repeats):
                    t = time.perf_counter()
                    memoryview(sink)[:] = slot.data(nbytes)
                    copy_s.append(time.perf_counter() - t)
                    t = time.perf_counter()
                    push_replica(
                        address,
                        slot,
                        job=JOB,
                        node="nA",
                        rank=0,
                        world="bench",
                        chunk_bytes=chunk,
                    )
                    push_s.append(time.perf_counter() - t)
                    t = time.perf_counter()
                    got = fetch_replica(
                        address,
                        job=JOB,
                        sender_node="nA",
                        rank=0,
                        alloc=lambda h, s=sink: memoryview(s),
                        chunk_bytes=chunk,
                    )
                    fetch_s.append(time.perf_counter() - t)
                    assert got is not None and got.header.data_len == nbytes
            finally:
                holder.stdin.close()
                holder.wait(timeout=60)
                slot.close()
                os.unlink(names.slot_path(shm_root, JOB, "nA", 0, 0))
            c, p, f = median(copy_s), median(push_s), median(fetch_s)
            assert c is not None and p is not None and f is not None
            row = {
                "gib": gib,
                "bytes": nbytes,
                "memcpy_s": copy_s,
                "push_s": push_s,
                "fetch_s": fetch_s,
                "memcpy_gib_s": gib / c,
                "push_gib_s": gib / p,
                "fetch_gib_s": gib / f,
                "push_vs_memcpy": p / c,
                "fetch_vs_memcpy": f / c,
            }
            out["sizes"].append(row)
            print(
                f"{gib:5.2f} GiB  memcpy {gib / c:6.2f} GiB/s  push {gib / p:6.2f} GiB/s "
                f"({p / c:4.1f}x memcpy)  fetch+verify {gib / f:6.2f} GiB/s ({f / c:4.1f}x)",
                flush=True,
            )
    finally:
        shutil.rmtree(shm_root, ignore_errors=True)
    out["loadavg_end"] = os.getloadavg()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", default="0.25,1", help="snapshot sizes in GiB (default 0.25,1)")
    ap.add_argument("--repeats", type=int, default=3, help="samples per size (default 3)")
    ap.add_argument("--chunk-mib", type=float, default=8, help="transfer chunk (default 8 MiB)")
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--serve", help=argparse.SUPPRESS)  # the holder process
    ap.add_argument("--limit", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        return _serve(args.serve, args.limit, int(args.chunk_mib * 2**20))
    sizes = [float(x) for x in args.sizes.split(",") if x]
    start = os.getloadavg()
    res = run(sizes, args.repeats, int(args.chunk_mib * 2**20))
    res["loadavg_start"] = start
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
