"""etcd CPU per key-value call: JSON-gateway requests vs unary gRPC calls, in the same run.

One real etcd (started here); ``--threads`` threads, each with a key of its own, make
``--ops`` calls of one kind each: ``txn`` (a compare-and-set of the thread's key: one
transaction with a compare, a put and a range, as the rendezvous's joins are), ``range`` (a
read of the key) and ``put``. Each kind runs once on clients whose key-value calls go to the
JSON gateway (``EtcdClient(grpc_kv=False)``: HTTP/1.1 + JSON, which etcd's grpc-gateway turns
into a loopback gRPC call) and once over gRPC (``grpc_kv=True``: one HTTP/2 connection per
client), alternating for ``--trials`` trials on the same etcd. etcd's CPU comes from
``/proc/<pid>/stat`` before and after each run, the client's from this process. Read the ratio
of the two transports in the same run.

``--own-clients`` gives every thread a client of its own (a machine each: one connection per
thread, as 1,024 machines would have); without it the threads share one client.

Usage:
  python benchmarks/etcd_transport.py --threads 16 --ops 200 --trials 3 --out x.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

from _common import own_cpu, process_cpu

from flashckpt.elastic.etcd.client import EtcdClient
from flashckpt.elastic.etcd.server import EtcdV3Server, find_etcd_binary

KINDS = ("txn", "range", "put")
TRANSPORTS = ("gateway", "grpc")


def _work(kind: str, client: EtcdClient, key: str, ops: int) -> Callable[[], None]:
    def run() -> None:
        revision = client.put(key, b"0")
        for i in range(ops):
            if kind == "txn":
                ok, kv = client.compare_and_set(key, str(i).encode(), mod_revision=revision)
                if not ok or kv is None:
                    raise RuntimeError(f"the compare-and-set of {key} lost: another writer?")
                revision = kv.mod_revision
            elif kind == "range":
                if client.get(key) is None:
                    raise RuntimeError(f"{key} vanished")
            else:
                client.put(key, str(i).encode())

    return run


def _run(
    kind: str, clients: list[EtcdClient], threads: int, ops: int, pid: int
) -> dict[str, float]:
    errors: list[BaseException] = []
    go = threading.Event()

    def body(i: int) -> None:
        work = _work(kind, clients[i % len(clients)], f"/bench/transport/{kind}/{i}", ops)
        go.wait()
        try:
            work()
        except BaseException as exc:
            errors.append(exc)

    workers = [threading.Thread(target=body, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    etcd0, own0, wall0 = process_cpu(pid), own_cpu(), time.monotonic()
    go.set()
    for worker in workers:
        worker.join()
    wall, etcd, own = time.monotonic() - wall0, process_cpu(pid) - etcd0, own_cpu() - own0
    if errors:
        raise RuntimeError(f"{len(errors)} threads failed, first: {errors[0]!r}")
    total = threads * (ops + 1)  # each thread's first put counts
    return {
        "calls": total,
        "wall_s": round(wall, 3),
        "etcd_cpu_s": round(etcd, 3),
        "etcd_cpu_us_per_call": round(etcd / total * 1e6, 1),
        "client_cpu_us_per_call": round(own / total * 1e6, 1),
        "calls_per_s": round(total / wall, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--ops", type=int, default=200, help="calls per thread and run")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--own-clients", action="store_true", help="one client per thread")
    parser.add_argument("--out", help="JSON output file (default: stdout only)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="flashckpt-bench-transport-") as tmp:
        server = EtcdV3Server(Path(tmp) / "etcd", binary=find_etcd_binary())
        server.start()
        try:
            pid = server.pid
            assert pid is not None
            count = args.threads if args.own_clients else 1
            clients = {
                transport: [
                    EtcdClient(
                        server.client_url,
                        timeout=timedelta(seconds=60),
                        grpc_kv=transport == "grpc",
                    )
                    for _ in range(count)
                ]
                for transport in TRANSPORTS
            }
            runs: dict[str, dict[str, list[dict[str, float]]]] = {
                kind: {transport: [] for transport in TRANSPORTS} for kind in KINDS
            }
            for _ in range(args.trials):
                for kind in KINDS:
                    for transport in TRANSPORTS:
                        result = _run(kind, clients[transport], args.threads, args.ops, pid)
                        runs[kind][transport].append(result)
                        print(kind, transport, result, file=sys.stderr)
            stats = {
                transport: [c.connection_stats() for c in group]
                for transport, group in clients.items()
            }
            for group in clients.values():
                for client in group:
                    client.close()
        finally:
            server.close()
    median = {
        kind: {
            transport: {
                field: statistics.median(r[field] for r in results)
                for field in ("etcd_cpu_us_per_call", "client_cpu_us_per_call", "calls_per_s")
            }
            for transport, results in per.items()
        }
        for kind, per in runs.items()
    }
    ratio = {
        kind: round(
            median[kind]["gateway"]["etcd_cpu_us_per_call"]
            / max(median[kind]["grpc"]["etcd_cpu_us_per_call"], 0.1),
            2,
        )
        for kind in KINDS
    }
    result = {
        "benchmark": "etcd_transport",
        "threads": args.threads,
        "ops_per_thread": args.ops,
        "trials": args.trials,
        "own_clients": args.own_clients,
        "load_1min": os.getloadavg()[0],
        "runs": runs,
        "median": median,
        "etcd_cpu_gateway_over_grpc": ratio,
        "grpc_connections": sum(s.grpc_connections for s in stats["grpc"]),
        "gateway_connections": sum(s.opened for s in stats["gateway"]),
        "grpc_calls_on_gateway_clients": sum(s.grpc_calls for s in stats["gateway"]),
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
