"""One node of the multi-round rendezvous test (run as a script, not collected by pytest).

Usage: python _rdzv_rounds_worker.py <etcd_url> <run_id> <nodes> <rounds> <result.jsonl> <go_dir>

Joins ``rounds`` rounds of the rendezvous through torch's registry and our ``flashckpt-etcd``
handler. In each it forms a gloo process group on a TCPStore at the round's
``MASTER_ADDR:MASTER_PORT`` (hosted by this round's rank 0, as torchelastic's workers do),
all-reduces its rank + 1, and appends what it saw as one JSON line. Before round ``i > 0`` it
waits for the file ``<go_dir>/go-<i>`` (the test's signal to rendezvous again, as an agent does
when a worker failed).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from flashckpt.elastic.rendezvous.registry import BACKEND_NAME, register


def _wait_for(path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s} s")
        time.sleep(0.05)


def main() -> None:
    url, run_id = sys.argv[1], sys.argv[2]
    nodes, rounds = int(sys.argv[3]), int(sys.argv[4])
    out, go_dir = Path(sys.argv[5]), Path(sys.argv[6])
    # The handler's info lines (a standby says it is one) go to the node's log.
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    register()  # the entry point may not be installed when running from a source tree
    params = RendezvousParameters(
        backend=BACKEND_NAME,
        endpoint=url,
        run_id=run_id,
        min_nodes=nodes,
        max_nodes=nodes,
        local_addr="127.0.0.1",
        join_timeout=120,
        read_timeout=10,
        keep_alive_interval=1,
        keep_alive_max_attempt=3,
        store_timeout=60,
    )
    handler = get_rendezvous_handler(params)
    stores: list[Any] = []  # rank 0's TCPStore servers stay up until the process ends
    for i in range(rounds):
        if i > 0:
            _wait_for(go_dir / f"go-{i}", 150)
        info = handler.next_rendezvous()
        rank, world = info.rank, info.world_size
        boot = info.bootstrap_store_info
        assert boot is not None
        store = dist.TCPStore(
            boot.master_addr,
            boot.master_port,
            world,
            is_master=rank == 0,
            timeout=timedelta(seconds=60),
        )
        stores.append(store)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60)
        )
        tensor = torch.tensor([float(rank + 1)])
        dist.all_reduce(tensor)
        dist.barrier()
        dist.destroy_process_group()
        result = {
            "round": i,
            "pid": os.getpid(),
            "node": handler.node,  # type: ignore[attr-defined]
            "rank": rank,
            "world_size": world,
            "sum": tensor.item(),
            "master_addr": boot.master_addr,
            "master_port": boot.master_port,
        }
        with open(out, "a") as f:
            f.write(json.dumps(result) + "\n")
            f.flush()
            os.fsync(f.fileno())
    handler.shutdown()


if __name__ == "__main__":
    main()
