"""One node of the multi-process rendezvous test (run as a script, not collected by pytest).

Usage: python _rdzv_worker.py <etcd_url> <run_id> <nodes> <result.json>

Joins the rendezvous through torch's registry and our ``flashckpt-etcd`` handler, forms a gloo
process group on the rendezvous store, all-reduces its rank, and writes what it saw as JSON.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from flashckpt.elastic.rendezvous.registry import BACKEND_NAME, register


def main() -> None:
    url, run_id, nodes, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    register()  # the entry point may not be installed when running from a source tree
    params = RendezvousParameters(
        backend=BACKEND_NAME,
        endpoint=url,
        run_id=run_id,
        min_nodes=nodes,
        max_nodes=nodes,
        local_addr="127.0.0.1",
        join_timeout=40,
        read_timeout=10,
        keep_alive_interval=1,
        store_timeout=30,
    )
    handler = get_rendezvous_handler(params)
    info = handler.next_rendezvous()
    rank, world = info.rank, info.world_size
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore("pg", info.store),
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=30),
    )
    tensor = torch.tensor([float(rank + 1)])
    dist.all_reduce(tensor)
    dist.barrier()
    dist.destroy_process_group()
    bootstrap = info.bootstrap_store_info
    assert bootstrap is not None
    result = {
        "rank": rank,
        "world_size": world,
        "sum": tensor.item(),
        "backend": handler.get_backend(),
        "master_addr": bootstrap.master_addr,
        "master_port": bootstrap.master_port,
    }
    handler.shutdown()
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
