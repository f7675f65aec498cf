"""Real processes rendezvous through etcd with our handler, then run a gloo all_reduce."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

import flashckpt.elastic

WORKER = Path(__file__).with_name("_rdzv_worker.py")
ROUNDS_WORKER = Path(__file__).with_name("_rdzv_rounds_worker.py")
SOURCE_ROOT = Path(flashckpt.elastic.__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    # Workers import `elastic` from this checkout whether or not the package is installed.
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(SOURCE_ROOT), env.get("PYTHONPATH", "")) if p
    )
    env["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only: never touch another network
    env["OMP_NUM_THREADS"] = "1"
    return env


def _log_tails(logs: list[Path]) -> str:
    return "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}" for log in logs)


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
                        env=_env(),
                        start_new_session=True,
                    )
                )
        for proc in procs:
            try:
                code = proc.wait(timeout=75)
            except subprocess.TimeoutExpired:
                pytest.fail(f"worker {proc.pid} hung:\n{_log_tails(logs)}")
            assert code == 0, f"worker {proc.pid} exited with {code}:\n{_log_tails(logs)}"
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


def _rounds(path: Path) -> list[dict[str, object]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


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
    run_failover(etcd_server, tmp_path, _env())


def run_failover(etcd_url: str, tmp_path: Path, env: dict[str, str]) -> None:
    """The rounds of :func:`test_rank_0_dies_a_new_node_joins_and_the_survivor_keeps_its_rank`
    against the etcd at ``etcd_url``, the nodes run with ``env``."""
    run_id = f"mpr-{uuid.uuid4().hex[:8]}"
    go = tmp_path / "go"
    go.mkdir()
    procs: dict[str, subprocess.Popen[bytes]] = {}
    logs: list[Path] = []

    def start(name: str, rounds: int) -> Path:
        out, log = tmp_path / f"{name}.jsonl", tmp_path / f"{name}.log"
        logs.append(log)
        args = [etcd_url, run_id, "2", str(rounds), str(out), str(go)]
        with open(log, "wb") as log_file:
            procs[name] = subprocess.Popen(
                [sys.executable, str(ROUNDS_WORKER), *args],
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        return out

    def wait_rounds(out: Path, n: int, timeout: float = 120) -> list[dict[str, object]]:
        deadline = time.monotonic() + timeout
        while len(_rounds(out)) < n:
            dead = [k for k, p in procs.items() if p.poll() not in (None, 0, -signal.SIGKILL)]
            if dead or time.monotonic() > deadline:
                pytest.fail(f"no round {n} in {out.name} (failed: {dead}):\n{_log_tails(logs)}")
            time.sleep(0.1)
        return _rounds(out)

    try:
        outs = {name: start(name, 2) for name in ("p0", "p1")}
        first = {name: wait_rounds(out, 1)[0] for name, out in outs.items()}
        assert sorted(r["rank"] for r in first.values()) == [0, 1], first
        assert all(r["world_size"] == 2 and r["sum"] == 3 for r in first.values()), first
        victim = next(n for n, r in first.items() if r["rank"] == 0)
        survivor = next(n for n, r in first.items() if r["rank"] == 1)
        os.killpg(procs[victim].pid, signal.SIGKILL)
        procs[victim].wait()
        outs["p2"] = start("p2", 1)  # it waits as a standby: the round is full
        (go / "go-1").touch()

        again = wait_rounds(outs[survivor], 2)[1]
        newcomer = wait_rounds(outs["p2"], 1)[0]
        for name in (survivor, "p2"):
            assert procs[name].wait(timeout=60) == 0, _log_tails(logs)
        # The newcomer waited as a standby, and its log says so; the survivor never was one.
        logs_of = {log.stem: log.read_text(errors="replace") for log in logs}
        assert "standby: job" in logs_of["p2"], logs_of["p2"][-2000:]
        assert "standby: job" not in logs_of[survivor]
        assert again["node"] == first[survivor]["node"] != newcomer["node"]
        assert again["rank"] == 1, (first, again, newcomer)
        assert newcomer["rank"] == 0, newcomer
        assert again["world_size"] == newcomer["world_size"] == 2
        # Both all-reduced over the new world through the TCPStore the newcomer hosts at the
        # address it published.
        assert again["sum"] == newcomer["sum"] == 3
        assert (again["master_addr"], again["master_port"]) == (
            newcomer["master_addr"],
            newcomer["master_port"],
        )
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


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
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join((str(tmp_path), env["PYTHONPATH"]))
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["RdzvHandler", "flashckpt-etcd"]
