"""The launcher's summary and goodput count every iteration run, across SIGKILLs of the node
agent and of a worker (issue 41, row 7: a 2:2 job under 20 random kills reported 263 iterations
against 389 run: the batch a killed agent had read but not written yet was skipped by the agent
started again). Checked against the workers' own counts, rank by rank."""

from __future__ import annotations

import re
import signal
from collections import Counter
from pathlib import Path

import psutil
import pytest
from elasticcluster import SimCluster

from flashckpt.monitor.goodput import compute_goodput, incarnations_from_events, read_events
from flashckpt.names import events_path
from flashckpt.testing.elastic import process_tree

pytestmark = [pytest.mark.slow, pytest.mark.etcd]


def _agent(launcher_pid: int) -> psutil.Process | None:
    for p in process_tree(launcher_pid):
        try:
            cmd = p.cmdline()
        except psutil.Error:
            continue
        if "agent" in cmd and "flashckpt" in " ".join(cmd):
            return p
    return None


@pytest.mark.timeout(300)
@pytest.mark.xfail(
    strict=False,
    reason="issue 41 row 7, open: the SIGKILLed worker's last ring record is sometimes not "
    "counted (62 against the workers' 63 in 2 of 3 runs on a loaded machine; passes quiet)",
)
def test_the_summary_counts_every_iteration_across_agent_and_worker_kills(tmp_path: Path) -> None:
    cluster = SimCluster(
        tmp_path,
        None,
        nnodes="1",
        nproc=2,
        worker_args=["--steps", "60", "--every", "4", "--step-sleep", "0.1"],
    )
    try:
        machine = cluster.start("n0")
        path = events_path(cluster.run_dir, cluster.run_id, "n0")
        for n, kill_at in enumerate((10, 30)):  # rank 0's iterations
            cluster.wait_for(f"{kill_at} steps", lambda k=kill_at: len(cluster.steps()) >= k, 150)
            agent = _agent(machine.proc.pid)
            assert agent is not None, cluster.logs()
            agent.send_signal(signal.SIGKILL)
            cluster.wait_for(
                "the agent started again",
                lambda a=agent: (new := _agent(machine.proc.pid)) is not None and new.pid != a.pid,
                60,
            )
            new = _agent(machine.proc.pid)
            assert new is not None

            def read_by(pid: int) -> bool:
                # The new agent found both rings (a "steps" line of each rank after its start).
                evs = read_events([path]) if Path(path).exists() else []
                born = [e["t"] for e in evs if e["event"] == "agent_start" and e["pid"] == pid]
                return bool(born) and {
                    e["rank"] for e in evs if e["event"] == "steps" and e["t"] >= born[0]
                } == {0, 1}

            cluster.wait_for("the new agent reading the rings", lambda p=new.pid: read_by(p), 60)
            if n == 0:  # and a worker: torch restarts both
                live = [
                    e["pid"]
                    for e in reversed(cluster.events())
                    if e["event"] == "restored" and psutil.pid_exists(e["pid"])
                ]
                assert live, cluster.logs()
                psutil.Process(live[0]).send_signal(signal.SIGKILL)
        assert cluster.wait_exit("n0", 200) == 0, cluster.logs()
        ran = Counter(e["rank"] for e in cluster.events() if e["event"] == "step")
        assert len([e for e in cluster.events() if e["event"] == "restored"]) >= 4  # restarted
        events = read_events([path])
        rep = compute_goodput(incarnations_from_events(events))
        per_pid = Counter(e["pid"] for e in cluster.events() if e["event"] == "step")
        by_token = {
            inc.token: (inc.rank, inc.n, inc.lost)
            for incs in incarnations_from_events(events).values()
            for inc in incs
        }
        starts = {e["token"]: e["pid"] for e in events if e["event"] == "start"}
        seen = {starts.get(t): v for t, v in by_token.items()}
        assert rep.steps == dict(ran), (rep.steps, ran, per_pid, seen)
        summary = re.findall(r"summary: .*?(\d+) iterations per rank", machine.tail(10**6))
        assert summary == [str(max(ran.values()))], machine.tail()
    finally:
        cluster.close()
