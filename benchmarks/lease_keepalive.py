"""etcd CPU per lease keep-alive: gateway requests vs the client's keep-alive stream.

One real etcd (started here), ``--threads`` threads of one ``EtcdClient`` each renewing a lease
of its own with ``refresh_lease`` as the node-lease renewer does (one renewal in flight per
lease), ``--renewals`` renewals per thread; once with every keep-alive a JSON-gateway request
(``POST /v3/lease/keepalive`` on the pooled connections: how the client renewed before the
stream) and once on the client's one ``LeaseKeepAlive`` stream, alternating for ``--trials``
trials on the same etcd. etcd's CPU is read from ``/proc/<pid>/stat`` before and after each
run; the client's own CPU is this process's. Read the ratio of the two modes in the same run.

``--own-clients`` gives every thread a client of its own (a machine each: one stream per lease,
as 1,024 machines would have), and ``--pace`` spaces a thread's renewals (a steady renewer
sends one per interval, not back to back).

Usage:
  python benchmarks/lease_keepalive.py --threads 64 --renewals 100 --trials 3 --out x.json
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
from datetime import timedelta
from pathlib import Path

from _common import own_cpu, process_cpu

from flashckpt.elastic.etcd.client import EtcdClient, Lease
from flashckpt.elastic.etcd.server import EtcdV3Server, find_etcd_binary


def _run(
    clients: list[EtcdClient], leases: list[Lease], renewals: int, pace: float, pid: int
) -> dict[str, float]:
    errors: list[BaseException] = []
    go = threading.Event()

    def renew(client: EtcdClient, lease: Lease) -> None:
        go.wait()
        try:
            for _ in range(renewals):
                client.refresh_lease(lease, timeout=timedelta(seconds=30))
                if pace:
                    time.sleep(pace)
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=renew, args=(clients[i % len(clients)], lease))
        for i, lease in enumerate(leases)
    ]
    for thread in threads:
        thread.start()
    etcd0, own0, wall0 = process_cpu(pid), own_cpu(), time.monotonic()
    go.set()
    for thread in threads:
        thread.join()
    wall, etcd, own = time.monotonic() - wall0, process_cpu(pid) - etcd0, own_cpu() - own0
    if errors:
        raise RuntimeError(f"{len(errors)} renewals failed, first: {errors[0]!r}")
    total = len(leases) * renewals
    return {
        "renewals": total,
        "wall_s": round(wall, 3),
        "etcd_cpu_s": round(etcd, 3),
        "etcd_cpu_us_per_renewal": round(etcd / total * 1e6, 1),
        "client_cpu_us_per_renewal": round(own / total * 1e6, 1),
        "renewals_per_s": round(total / wall, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=64)
    parser.add_argument("--renewals", type=int, default=100, help="per thread and run")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--own-clients", action="store_true", help="one client per thread")
    parser.add_argument("--pace", type=float, default=0.0, help="s between a thread's renewals")
    parser.add_argument("--out", help="JSON output file (default: stdout only)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="flashckpt-bench-lease-") as tmp:
        server = EtcdV3Server(Path(tmp) / "etcd", binary=find_etcd_binary())
        server.start()
        try:
            pid = server.pid
            assert pid is not None
            # Clients per mode: the request mode's never open a stream.
            count = args.threads if args.own_clients else 1
            url = server.client_url
            by_request = [EtcdClient(url, timeout=timedelta(seconds=30)) for _ in range(count)]
            for client in by_request:
                client.transport._pool_here().keepalive_by_request = True
            on_stream = [EtcdClient(url, timeout=timedelta(seconds=30)) for _ in range(count)]
            leases = [by_request[0].grant_lease(timedelta(seconds=60)) for _ in range(args.threads)]
            runs: dict[str, list[dict[str, float]]] = {"request": [], "stream": []}
            for _ in range(args.trials):
                for mode, clients in (("request", by_request), ("stream", on_stream)):
                    runs[mode].append(_run(clients, leases, args.renewals, args.pace, pid))
                    print(mode, runs[mode][-1], file=sys.stderr)
            streams = sum(c.connection_stats().keepalive_streams for c in on_stream)
            for client in by_request + on_stream:
                client.close()
        finally:
            server.close()
    median = {
        mode: statistics.median(r["etcd_cpu_us_per_renewal"] for r in results)
        for mode, results in runs.items()
    }
    result = {
        "benchmark": "lease_keepalive",
        "threads": args.threads,
        "renewals_per_thread": args.renewals,
        "trials": args.trials,
        "own_clients": args.own_clients,
        "pace_s": args.pace,
        "load_1min": os.getloadavg()[0],
        "runs": runs,
        "median_etcd_cpu_us_per_renewal": median,
        "request_over_stream": round(median["request"] / max(median["stream"], 0.1), 2),
        "keepalive_streams_opened": streams,
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
