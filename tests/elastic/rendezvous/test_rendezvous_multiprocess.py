"""Real processes rendezvous through etcd with our handler, then run a gloo all_reduce."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
from rdzvprocs import WORKER, log_tails, rdzv_env, run_failover


@pytest.mark.etcd
@pytest.mark.slow
@pytest.mark.timeout(90)
def test_two_processes_rendezvous_and_all_reduce(etcd_server: str, tmp_path: Path) -> None:
    nodes = 2
    run_id = f"mp-{uuid.uuid4().hex[:8]}"
    outputs = [tmp_path / f"result{i}.json" for i in range(nodes)]
    logs = [tmp_path / f"worker{i}.log" for i in range(nodes)]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for out, log in zip(outputs, logs, strict=True):
            with open(log, "wb") as log_file:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, str(WORKER), etcd_server, run_id, str(nodes), str(out)],
                        stdout=log_file,
                        stderr=subprocess.STDOUT,
                        env=rdzv_env(),
                        start_new_session=True,
                    )
                )
        for proc in procs:
            try:
                code = proc.wait(timeout=75)
            except subprocess.TimeoutExpired:
                pytest.fail(f"worker {proc.pid} hung:\n{log_tails(logs)}")
            assert code == 0, f"worker {proc.pid} exited with {code}:\n{log_tails(logs)}"
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    results = [json.loads(out.read_text()) for out in outputs]
    assert sorted(r["rank"] for r in results) == list(range(nodes))
    for r in results:
        assert r["world_size"] == nodes
        assert r["sum"] == sum(range(1, nodes + 1))
        assert r["backend"] == "flashckpt-etcd"
    # Both learned rank 0's bootstrap address through our etcd store.
    assert len({(r["master_addr"], r["master_port"]) for r in results}) == 1


@pytest.mark.etcd
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_rank_0_dies_a_new_node_joins_and_the_survivor_keeps_its_rank(
    etcd_server: str, tmp_path: Path
) -> None:
    """Round 0: two nodes. The node of rank 0 is SIGKILLed, a new node starts and the survivor
    rendezvouses again (as its agent would after its worker failed). Round 1: the survivor is
    still rank 1 (torch's numbering would make it rank 0: its node descriptor sorts before the
    newcomer's, a later pid), the newcomer is rank 0, hosts the round's TCPStore at the
    MASTER_ADDR:MASTER_PORT it published, and a gloo all_reduce spans the new world."""
    run_failover(etcd_server, tmp_path, rdzv_env())


def test_torch_discovers_the_handler_through_the_entry_point(tmp_path: Path) -> None:
    # A throw-away distribution declaring the same entry point as our pyproject.toml.
    dist_info = tmp_path / "flashckpt_ep_probe-0.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: flashckpt-ep-probe\nVersion: 0.0\n"
    )
    (dist_info / "entry_points.txt").write_text(
        "[torchrun.handlers]\n"
        "flashckpt-etcd = flashckpt.elastic.rendezvous.registry:get_handler_creator\n"
    )
    code = textwrap.dedent(
        """
        from torch.distributed.elastic.rendezvous import RendezvousParameters
        from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

        params = RendezvousParameters("flashckpt-etcd", "127.0.0.1:1", "job", 1, 1)
        handler = get_rendezvous_handler(params)
        print(type(handler).__name__, handler.get_backend())
        """
    )
    env = rdzv_env()
    env["PYTHONPATH"] = os.pathsep.join((str(tmp_path), env["PYTHONPATH"]))
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["RdzvHandler", "flashckpt-etcd"]
