"""Client-side CPU of the two steady etcd paths of every simulated machine (issue 31): one lease
renewal on the ``LeaseKeepAlive`` stream, and one event received on a watch stream.

One real etcd (started here), in one process:

- **renewals**: ``--leases`` clients (one per simulated machine, so one keep-alive stream each,
  as 1,024 machines have), each with a lease of its own, renewed by a thread each with
  ``renew_lease(keep=True)`` as ``NodeRegistry``'s renew loop does, ``--rounds`` times, a thread
  sleeping ``--pace`` s between its renewals. CPU per renewal = this process's CPU during the
  run / renewals (the threads' wake-ups are in it; nothing else runs in the process).
- **watch events**: one ``WatchStream`` on a prefix (as the node-key watch: no previous values,
  or ``--prev-kv``), read with ``next_events`` in slices of 1 s by one thread, while a writer
  process (another ``python``) puts ``--events`` small values on ``--keys`` keys of the prefix,
  one put every ``--event-pace`` s (so most events come as a message each, as on the kill
  path). CPU per event = the watcher thread's CPU (``time.thread_time``) / events.
- **quiet slices**: ``next_events`` with a 10 ms timeout on a quiet stream, ``--quiet`` times
  (the node watch's wake-ups in steady state). CPU per call of the calling thread.

``--trials`` runs each part that many times, alternating, on the same etcd; the medians are
reported. etcd's own CPU is reported too (read from ``/proc``), for context only. To compare two
versions of the client, run it once per version with ``PYTHONPATH`` set to each source tree
(``flashckpt_package`` in the JSON says which ran), alternating, close in time.

Usage:
  python benchmarks/etcd_client_cost.py --leases 256 --rounds 20 --events 2000 --trials 3 \
      --out benchmarks/runs/etcd-client-cost-<date>-<tag>.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

from _common import own_cpu, process_cpu

import flashckpt
from flashckpt.elastic.etcd.client import EtcdClient, Lease
from flashckpt.elastic.etcd.server import EtcdV3Server, find_etcd_binary
from flashckpt.elastic.etcd.watchstream import WatchStream, prefix_end

_PREFIX = b"/bench/etcd-client-cost/"

_WRITER = """
import sys, time
from datetime import timedelta
from flashckpt.elastic.etcd.client import EtcdClient
url, prefix, events, keys, pace = sys.argv[1], sys.argv[2].encode(), int(sys.argv[3]), \
    int(sys.argv[4]), float(sys.argv[5])
client = EtcdClient(url, timeout=timedelta(seconds=30))
sys.stdout.write("ready\\n")
sys.stdout.flush()
sys.stdin.readline()
for i in range(events):
    client.put(prefix + b"node-%05d" % (i % keys), b'{"host":"10.0.%d.%d","seq":%d}' % (
        i % 256, i % 7, i))
    if pace:
        time.sleep(pace)
client.close()
"""


def _renewals(
    clients: list[EtcdClient], leases: list[Lease], rounds: int, pace: float, pid: int
) -> dict[str, float]:
    errors: list[BaseException] = []
    go = threading.Event()

    def renew(client: EtcdClient, lease: Lease) -> None:
        go.wait()
        try:
            for _ in range(rounds):
                client.renew_lease(lease, timeout=timedelta(seconds=30), keep=True)
                time.sleep(pace)
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=renew, args=(client, lease), daemon=True)
        for client, lease in zip(clients, leases, strict=True)
    ]
    for thread in threads:
        thread.start()
    time.sleep(0.2)  # every thread waits on go
    etcd0, own0, wall0 = process_cpu(pid), own_cpu(), time.monotonic()
    go.set()
    for thread in threads:
        thread.join()
    wall, etcd, own = time.monotonic() - wall0, process_cpu(pid) - etcd0, own_cpu() - own0
    if errors:
        raise RuntimeError(f"{len(errors)} renewal threads failed, first: {errors[0]!r}")
    total = len(leases) * rounds
    return {
        "renewals": total,
        "wall_s": round(wall, 3),
        "client_cpu_s": round(own, 3),
        "client_cpu_us_per_renewal": round(own / total * 1e6, 1),
        "etcd_cpu_us_per_renewal": round(etcd / total * 1e6, 1),
    }


def _watch(
    url: str, events: int, keys: int, pace: float, prev_kv: bool, pid: int
) -> dict[str, float]:
    client = EtcdClient(url, timeout=timedelta(seconds=30))
    try:
        revision = client.revision() + 1
        stream = WatchStream(client, _PREFIX, prefix_end(_PREFIX), revision, prev_kv=prev_kv)
        stream.next_events(timedelta(seconds=0.5))  # opens the stream (no event yet)
        writer = subprocess.Popen(
            [
                sys.executable,
                "-c",
                _WRITER,
                url,
                _PREFIX.decode(),
                str(events),
                str(keys),
                str(pace),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert writer.stdout is not None and writer.stdin is not None
            if writer.stdout.readline().strip() != "ready":
                raise RuntimeError("the writer process did not start")
            got = messages = 0
            etcd0, cpu0, wall0 = process_cpu(pid), time.thread_time(), time.monotonic()
            writer.stdin.write("go\n")
            writer.stdin.flush()
            while got < events:
                batch = stream.next_events(timedelta(seconds=1))
                if batch:
                    messages += 1
                    got += len(batch)
                elif writer.poll() not in (None, 0):
                    raise RuntimeError(f"the writer exited {writer.returncode}")
            cpu, wall, etcd = time.thread_time() - cpu0, time.monotonic() - wall0, process_cpu(pid)
            if writer.wait(timeout=60) != 0:
                raise RuntimeError(f"the writer exited {writer.returncode}")
            # Quiet slices: the watch's wake-ups when nothing changes.
            quiet = 200
            q0 = time.thread_time()
            for _ in range(quiet):
                if stream.next_events(timedelta(seconds=0.01)):
                    raise RuntimeError("an event on a quiet watch")
            quiet_cpu = time.thread_time() - q0
        finally:
            if writer.poll() is None:
                writer.kill()
                writer.wait()
        stream.close()
    finally:
        client.close()
    return {
        "events": got,
        "messages": messages,
        "wall_s": round(wall, 3),
        "watcher_cpu_s": round(cpu, 3),
        "watcher_cpu_us_per_event": round(cpu / got * 1e6, 1),
        "watcher_cpu_us_per_message": round(cpu / max(messages, 1) * 1e6, 1),
        "etcd_cpu_us_per_event": round((etcd - etcd0) / got * 1e6, 1),
        "quiet_cpu_us_per_10ms_slice": round(quiet_cpu / quiet * 1e6, 1),
    }


def _median(runs: list[dict[str, float]], key: str) -> float:
    return round(statistics.median(r[key] for r in runs), 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--leases", type=int, default=256, help="clients, one lease each")
    parser.add_argument("--rounds", type=int, default=20, help="renewals per lease and trial")
    parser.add_argument("--pace", type=float, default=0.05, help="s between a lease's renewals")
    parser.add_argument("--events", type=int, default=2000, help="watch events per trial")
    parser.add_argument("--keys", type=int, default=64, help="keys the writer puts")
    parser.add_argument("--event-pace", type=float, default=0.002, help="s between puts")
    parser.add_argument("--prev-kv", action="store_true", help="watch with previous values")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--tag", default="", help="a label stored in the JSON")
    parser.add_argument("--out", help="JSON output file (default: stdout only)")
    args = parser.parse_args()
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="flashckpt-bench-client-cost-") as tmp:
        server = EtcdV3Server(Path(tmp) / "etcd", binary=find_etcd_binary())
        server.start()
        try:
            pid = server.pid
            assert pid is not None
            url = server.client_url
            clients = [EtcdClient(url, timeout=timedelta(seconds=30)) for _ in range(args.leases)]
            leases = [clients[0].grant_lease(timedelta(seconds=60)) for _ in range(args.leases)]
            for client, lease in zip(clients, leases, strict=True):
                client.renew_lease(lease)  # opens each client's keep-alive stream
            renewal_runs: list[dict[str, float]] = []
            watch_runs: list[dict[str, float]] = []
            for _ in range(args.trials):
                renewal_runs.append(_renewals(clients, leases, args.rounds, args.pace, pid))
                print("renewals", renewal_runs[-1], file=sys.stderr)
                watch_runs.append(
                    _watch(url, args.events, args.keys, args.event_pace, args.prev_kv, pid)
                )
                print("watch", watch_runs[-1], file=sys.stderr)
            streams = sum(c.connection_stats().keepalive_streams for c in clients)
            for lease in leases:
                clients[0].revoke_lease(lease)
            for client in clients:
                client.close()
        finally:
            server.close()
    result = {
        "benchmark": "etcd_client_cost",
        "tag": args.tag,
        "flashckpt_package": str(Path(flashckpt.__file__).parent),
        "args": vars(args),
        "load_1_5_15_at_start": load0,
        "load_1_5_15_at_end": os.getloadavg(),
        "cpus": os.cpu_count(),
        "renewal_runs": renewal_runs,
        "watch_runs": watch_runs,
        "keepalive_streams_opened": streams,
        "median_client_cpu_us_per_renewal": _median(renewal_runs, "client_cpu_us_per_renewal"),
        "median_watcher_cpu_us_per_event": _median(watch_runs, "watcher_cpu_us_per_event"),
        "median_watcher_cpu_us_per_message": _median(watch_runs, "watcher_cpu_us_per_message"),
        "median_quiet_cpu_us_per_10ms_slice": _median(watch_runs, "quiet_cpu_us_per_10ms_slice"),
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
