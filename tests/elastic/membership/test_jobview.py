"""Per-machine summaries in etcd, `flashckpt status --etcd`, and the straggler -> standby swap."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from elasticcluster import SimCluster
from fchelpers import FcEnv, RunningAgent
from tinytrain import make, train_step
from waiting import wait_until

import flashckpt
from flashckpt import cli
from flashckpt.elastic.etcd.client import EtcdClient
from flashckpt.elastic.membership.jobview import (
    JobViewPublisher,
    Retirement,
    StragglerSwap,
    agent_status,
    format_job_view,
    machine_summary,
    read_job_view,
    straggler_key,
)
from flashckpt.elastic.membership.nodes import NodeRegistry
from flashckpt.elastic.rendezvous.backend import job_prefix
from flashckpt.monitor.step_monitor import MonitorConfig
from flashckpt.protocol.channel import socket_path


def _rank(step: int, p50: float, p99: float, fwd: float, opt: float, **kw: Any) -> dict[str, Any]:
    return {
        "state": "running",
        "step": step,
        "p50_ms": p50,
        "p99_ms": p99,
        "p50_parts_ms": {"forward": fwd, "optimizer": opt, "data": 0.1},
        "restarts": 0,
        "straggler": False,
        **kw,
    }


def _status(ranks: dict[str, dict[str, Any]], slots: dict[str, list[int | None]], committed=()):
    # The monitor keys ranks by global rank, the agent its slots by local rank.
    return {
        "monitor": {"ranks": ranks, "alerts": [], "goodput": {}},
        "ranks": {
            str(local): {"rank": int(r), "slots": s, "connected": True}
            for local, (r, s) in enumerate(slots.items())
        },
        "committed": list(committed),
    }


def test_machine_summary_by_hand() -> None:
    st = _status(
        {
            "4": _rank(41, 10.0, 20.0, 4.0, 1.0),
            "5": _rank(40, 30.0, 50.0, 8.0, 2.0, restarts=2, straggler=True),
            "6": _rank(42, 12.0, 15.0, 5.0, 1.0),
            # This machine's rank of a former round (the agent stays across rounds): listed,
            # not counted.
            "9": _rank(17, 99.0, 99.0, 90.0, 9.0, state="replaced", restarts=1),
        },
        {"4": [36, 40], "5": [40, None], "6": [32, 36]},
        committed=[24, 32],
    )
    st["monitor"]["alerts"] = [{"kind": "straggler", "message": "rank 1 is a straggler"}]
    s = machine_summary(
        node_id="m1", host="h1", role="active", group_rank=0, restarts=1, agent_status=st, now=5.0
    )
    assert s["step"] == 41  # the slowest rank's steps completed (its ring index 40, 0-based)
    assert s["p50_ms"] == 12.0  # median of 10, 30, 12
    assert s["p99_ms"] == 50.0  # the worst rank
    assert s["compute_ms"] == 6.0  # forward + optimizer medians 5, 10, 6 -> 6
    assert s["snapshot"] == 36  # newest per rank 40, 40, 36: every rank has 36
    assert s["persisted"] == 32
    assert s["restarts"] == 2  # a rank restarted twice; the launcher saw one round
    assert sorted(s["ranks"]) == ["4", "5", "6", "9"] and s["live_ranks"] == 3
    assert s["ranks"]["5"]["straggler"] is True and s["ranks"]["5"]["compute_ms"] == 10.0
    assert s["ranks"]["6"]["snapshot"] == 36
    assert s["alerts"] == ["[straggler] rank 1 is a straggler"]
    assert s["t"] == 5.0 and s["agent"] is True
    # No agent answer: the machine is still listed, with nothing measured.
    s = machine_summary(
        node_id="m2", host="h2", role="standby", group_rank=None, restarts=0, agent_status=None
    )
    assert s["agent"] is False and s["ranks"] == {} and s["step"] is None


def _view(*machines: dict[str, Any]) -> dict[str, Any]:
    return {"machines": list(machines), "now": 0.0}


def _m(node: str, role: str = "active", compute: float | None = 10.0, p50: float = 100.0):
    return {"node": node, "role": role, "compute_ms": compute, "p50_ms": p50, "age_s": 1.0}


def test_straggler_swap_decisions() -> None:
    swap = StragglerSwap(factor=1.5, persist=3)
    slow = _view(_m("a", compute=10.0), _m("b", compute=11.0), _m("me", compute=30.0))
    # Flagged (30 > 1.5 x median(10, 11) = 15.75) but no standby: never retires.
    assert [swap.observe("me", slow) for _ in range(4)] == [None] * 4
    assert swap.flagged == 4
    with_standby = _view(*slow["machines"], _m("s", role="standby", compute=None))
    reason = swap.observe("me", with_standby)
    assert reason is not None and "compute_ms 30.0 ms vs 10.5 ms" in reason and "s waits" in reason
    # One check back to normal resets the count: persistently means in a row.
    swap = StragglerSwap(factor=1.5, persist=3)
    ok = _view(_m("a", compute=10.0), _m("b", compute=11.0), _m("me", compute=12.0))
    assert swap.observe("me", with_standby) is None and swap.flagged == 1
    assert swap.observe("me", ok) is None and swap.flagged == 0
    assert [swap.observe("me", with_standby) for _ in range(3)][-1] is not None
    # Not the slowest machine of the job: someone else goes first.
    swap = StragglerSwap(factor=1.5, persist=1)
    two_slow = _view(_m("a", compute=10.0), _m("b", compute=40.0), _m("me", compute=30.0))
    assert swap.observe("me", _view(*two_slow["machines"], _m("s", role="standby"))) is None
    # Without forward/optimizer timings on some machine: compares iteration times instead.
    swap = StragglerSwap(factor=1.5, persist=1)
    v = _view(
        _m("a", compute=None, p50=100.0), _m("me", compute=5.0, p50=200.0), _m("s", "standby")
    )
    assert "p50_ms 200.0 ms vs 100.0 ms" in str(swap.observe("me", v))
    # A standby itself, or a stale peer summary, never triggers anything.
    assert StragglerSwap(persist=1).observe("s", v) is None
    stale = _view(
        {**_m("a", compute=1.0), "age_s": 999.0}, _m("me", compute=50.0), _m("s", "standby")
    )
    assert StragglerSwap(persist=1).observe("me", stale) is None
    with pytest.raises(ValueError, match="must be > 1"):
        StragglerSwap(factor=1.0)


def test_status_text_flags_a_slow_machine() -> None:
    v = _view(
        {**_m("a", compute=10.0), "step": 40, "ranks": {}, "alerts": []},
        {**_m("b", compute=11.0), "step": 41, "ranks": {}, "alerts": ["[hang] rank 3 ..."]},
        {**_m("c", compute=30.0), "step": 39, "ranks": {}, "alerts": []},
        {**_m("s", role="standby", compute=None), "ranks": {}, "alerts": []},
    )
    text = format_job_view(v, "j")
    assert text.splitlines()[0] == "job j: 3 active machine(s), 1 standby, 0 other; 0 rank(s)"
    alerts = text.split("alerts:\n")[1].splitlines()
    # c: 30 vs median(10, 11) = 10.5; a and b are within 1.5x of their peers' median.
    assert alerts == [
        "  b: [hang] rank 3 ...",
        "  [straggler] machine c: compute_ms 30.0 ms vs 10.5 ms on the other active machines"
        " (x2.86)",
    ]
    assert "standby: s" in text


@pytest.mark.etcd
def test_status_from_etcd_shows_the_whole_job(
    fc_env: FcEnv,
    etcd_server: str,
    etcd_client: EtcdClient,
    etcd_prefix: str,
    registries: Callable[..., NodeRegistry],
    capsys: pytest.CaptureFixture[str],
) -> None:
    key_prefix = etcd_prefix.rstrip("/")
    jp = job_prefix("job1", key_prefix)
    agent = RunningAgent(fc_env.agent_config(monitor=MonitorConfig(poll_s=0.05)))
    try:
        a, b = registries(jp, "m-a"), registries(jp, "m-b")
        a.update(state="active", group_rank=0)
        b.update(state="waiting")
        sock = socket_path(fc_env.run_dir, fc_env.job, fc_env.node)
        pub_a = JobViewPublisher(
            client=etcd_client,
            job_prefix=jp,
            node_id="m-a",
            host="host-a",
            publish=a.publish,
            agent_status=lambda: agent_status(sock),
            role=lambda: ("active", 0),
            restarts=lambda: 1,
        )
        pub_b = JobViewPublisher(
            client=etcd_client,
            job_prefix=jp,
            node_id="m-b",
            host="host-b",
            publish=b.publish,
            agent_status=lambda: {"ranks": {}, "committed": [], "monitor": None},  # idle agent
            role=lambda: ("standby", None),
            restarts=lambda: 0,
        )
        model, opt, sched = make(0)
        with flashckpt.checkpointing(
            model, opt, scheduler=sched, every=4, **fc_env.ckpt_kwargs(agent="connect")
        ) as ck:
            for step in range(12):
                train_step(model, opt, sched, step)
                ck.step()
            assert ck.flush() == 12
            wait_until(
                lambda: (
                    (r := ((agent_status(sock) or {}).get("monitor") or {}).get("ranks", {}))
                    .get("0", {})
                    .get("step")
                    == 11
                    and r["0"]["state"] == "running"
                ),
                "rank 0 running at step 11 in the agent's monitor (the flush is over)",
                timeout=30.0,
            )
            mine = pub_a.tick()
            pub_b.tick()
            # The summary lives and dies with the machine's node lease.
            assert etcd_client.get_kv(pub_a.key).lease == etcd_client.get_kv(a.key).lease != 0

            view = read_job_view(etcd_client, jp)
            by_node = {m["node"]: m for m in view["machines"]}
            assert sorted(by_node) == ["m-a", "m-b"]
            ma = by_node["m-a"]
            assert ma == {**mine, "state": "active", "age_s": ma["age_s"]}
            assert ma["role"] == "active" and ma["group_rank"] == 0 and ma["host"] == "host-a"
            assert list(ma["ranks"]) == ["0"] and ma["ranks"]["0"]["state"] == "running"
            # One convention: 12 steps done, snapshot and commit labelled 12.
            assert ma["step"] == 12 and ma["snapshot"] == 12 and ma["persisted"] == 12
            assert 0 < ma["p50_ms"] <= ma["p99_ms"] and ma["compute_ms"] > 0
            assert ma["restarts"] == 1 and ma["alerts"] == []
            assert by_node["m-b"]["role"] == "standby" and by_node["m-b"]["ranks"] == {}

            argv = ["status", "--etcd", etcd_server, "--job", "job1", "--key-prefix", key_prefix]
            assert cli.main(argv) == 0
            out = capsys.readouterr().out
            assert out.startswith("job job1: 1 active machine(s), 1 standby, 0 other; 1 rank(s)")
            row = next(line for line in out.splitlines() if line.startswith("m-a "))
            assert row.split()[:5] == ["m-a", "active", "0", "1", "12"]  # steps completed
            assert row.split()[8:11] == ["12", "12", "1"]  # snapshot, persisted, restarts
            assert "standby: m-b" in out and "alerts: none" in out
            assert format_job_view(view, "job1") in out

        # A machine that leaves (or whose lease lapses) disappears from the view.
        b.close()
        assert [m["node"] for m in read_job_view(etcd_client, jp)["machines"]] == ["m-a"]
        a.close()
        assert read_job_view(etcd_client, jp)["machines"] == []
        assert cli.main(["status", "--etcd", etcd_server, "--job", "job1", "--key-prefix",
                         key_prefix]) == 1  # fmt: skip
        assert "no machine registered" in capsys.readouterr().out
    finally:
        agent.stop()


class _Counting:
    """An etcd client that counts one machine's requests and the keys they return."""

    def __init__(self, client: EtcdClient) -> None:
        self._client = client
        self.requests = 0
        self.keys = 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            out = attr(*args, **kwargs)
            self.requests += 1
            self.keys += len(out) if isinstance(out, list) else int(hasattr(out, "key"))
            return out

        return call


@pytest.mark.etcd
def test_one_judge_reads_the_job_and_a_persistent_straggler_retires_once_a_standby_waits(
    etcd_client: EtcdClient,
    etcd_prefix: str,
    registries: Callable[..., NodeRegistry],
) -> None:
    jp = job_prefix("job2", etcd_prefix.rstrip("/"))
    retired: list[tuple[str, str]] = []
    clients: dict[str, _Counting] = {}

    def publisher(node: str, reg: NodeRegistry, compute: float, role: str, rank: int | None):
        st = _status({"0": _rank(7, compute + 2, compute + 5, compute - 1, 1.0)}, {"0": [4, 8]})
        clients[node] = _Counting(etcd_client)
        return JobViewPublisher(
            client=clients[node],  # type: ignore[arg-type]
            job_prefix=jp,
            node_id=node,
            host=node,
            publish=reg.publish,
            agent_status=lambda: st if role == "active" else None,
            role=lambda: (role, rank),
            restarts=lambda: 0,
            swap=StragglerSwap(persist=2),
            on_retire=lambda reason: retired.append((node, reason)),
            period_s=0.05,
        )

    # Eight active machines, group rank 0 (m0) judges; "slow" has three times their compute.
    regs = {f"m{i}": registries(jp, f"m{i}") for i in range(7)} | {"slow": registries(jp, "slow")}
    pubs = {
        node: publisher(node, reg, 30.0 if node == "slow" else 10.0, "active", i)
        for i, (node, reg) in enumerate(regs.items())
    }

    def check() -> None:  # one check on every machine, the judge first
        for pub in pubs.values():
            pub.tick()

    check()  # every summary is in etcd
    for c in clients.values():
        c.requests = c.keys = 0
    for _ in range(3):  # flagged every time, but no standby waits: stays
        check()
    assert retired == [] and etcd_client.get_kv(straggler_key(jp)) is None
    # Each machine but the judge reads one key per check, whatever the job's size (each read
    # the whole job view before: 2 requests, 16 keys here); the judge reads the view.
    per_check = {n: (c.requests / 3, c.keys / 3) for n, c in clients.items()}
    assert all(per_check[n] == (1.0, 0.0) for n in pubs if n != "m0"), per_check
    assert per_check["m0"] == (3.0, 16.0), per_check

    spare = registries(jp, "spare")
    publisher("spare", spare, 0.0, "standby", None).tick()
    pubs["m0"].tick()  # the judge names the straggler ...
    named = etcd_client.get_kv(straggler_key(jp))
    assert named is not None and named.lease == etcd_client.get_kv(regs["m0"].key).lease
    assert retired == []
    check()  # ... which reads its name and retires; nobody else does
    assert [n for n, _ in retired] == ["slow"]
    assert "machine slow is a straggler: compute_ms 30.0 ms vs 10.0 ms" in retired[0][1]
    assert "standby spare waits" in retired[0][1]
    check()
    assert len(retired) == 1  # once
    # The straggler leaves: the judge takes its name away; the key is never left behind.
    regs["slow"].close()
    pubs["m0"].tick()
    assert etcd_client.get_kv(straggler_key(jp)) is None

    # A name about a former launcher of the same node id (an older summary) is not acted on.
    etcd_client.put(straggler_key(jp), Retirement(node="m3", reason="old", t=1.0).encode())
    pubs["m3"].tick()
    assert len(retired) == 1

    # The thread publishes on its own and stops on close().
    spare_pub = publisher("spare", spare, 0.0, "standby", None)
    done = threading.Event()
    spare_pub._publish = lambda k, v: (done.set(), spare.publish(k, v))[1]  # type: ignore[method-assign]
    spare_pub.start()
    assert done.wait(30)
    spare_pub.close()
    assert etcd_client.get_kv(spare_pub.key) is not None


# Trains until the test ends, snapshots overlapped (`--mode overlap`; on CPU the default "auto"
# copies synchronously, and this test wants the copy thread running).
_TRAIN_ON = ["--steps", "100000", "--every", "20", "--step-sleep", "0.02", "--mode", "overlap"]


@pytest.mark.etcd
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_flashckpt_run_swaps_a_straggler_for_the_standby(
    etcd_server: str, etcd_client: EtcdClient, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cluster = SimCluster(
        tmp_path,
        etcd_server,
        nnodes="2:2",
        launcher_args=["--swap-stragglers"],
        worker_args=_TRAIN_ON,
    )
    jp = job_prefix(cluster.run_id)

    def view() -> dict[str, dict[str, Any]]:
        return {m["node"]: m for m in read_job_view(etcd_client, jp)["machines"]}

    try:
        cluster.start("n0")
        cluster.start("n1", worker_args=["--slow-forward", "0.05"])
        cluster.wait_for(
            "both machines' compute times in etcd",
            lambda: all(view().get(n, {}).get("compute_ms") is not None for n in ("n0", "n1")),
            120,
        )
        v = view()
        assert v["n0"]["role"] == v["n1"]["role"] == "active"
        assert v["n1"]["compute_ms"] > 1.5 * v["n0"]["compute_ms"]  # 50 ms of sleep in forward
        assert cli.main(["status", "--etcd", etcd_server, "--job", cluster.run_id]) == 0
        out = capsys.readouterr().out
        assert out.startswith(f"job {cluster.run_id}: 2 active machine(s), 0 standby")
        assert "standby: none" in out
        # Flagged at every check, but no standby waits: it stays. Six more summaries of n1 (one
        # per check, the swap needs five flagged in a row) while it keeps running.
        seen: set[float] = set()
        cluster.wait_for(
            "six more checks on n1",
            lambda: seen.add(view()["n1"]["t"]) or len(seen) >= 7,  # type: ignore[func-returns-value]
            120,
        )
        assert view()["n1"]["role"] == "active"
        assert cluster.machines["n1"].proc.poll() is None

        spare = cluster.start("n2")
        assert cluster.wait_exit("n1", 120) == 0, cluster.logs()
        retired = [e for e in cluster.machines["n1"].events() if e["event"] == "retired"]
        assert len(retired) == 1 and "machine n1 is a straggler" in retired[0]["reason"]
        assert "standby n2 waits" in retired[0]["reason"]
        # The next round is n0 and the standby; training resumes from the newest step both
        # can obtain (n0's memory, the straggler's persisted snapshots), not from scratch.
        cluster.wait_for(
            "the standby to train in the straggler's place",
            lambda: any(e["event"] == "restored" and e["node"] == "n2" for e in cluster.events()),
            150,
        )
        resumed = [e for e in cluster.events() if e["event"] == "restored" and e["node"] == "n2"]
        assert resumed[0]["world_size"] == 2 and resumed[0]["start_step"] > 0, resumed
        cluster.wait_for(
            "n0 and n2 active in the job view, n1 gone",
            lambda: (
                {n: m.get("role") for n, m in view().items()} == {"n0": "active", "n2": "active"}
            ),
            60,
        )
        assert spare.proc.poll() is None
        # The node agents of `flashckpt run` keep one events file per machine in the run dir,
        # across rounds: the goodput report covers the elastic run.
        files = sorted(Path(cluster.run_dir).glob(f"{cluster.run_id}.n*.events.jsonl"))
        assert [f.name.split(".")[1] for f in files] == ["n0", "n1", "n2"]
        assert cli.main(["goodput", "--json", *map(str, files)]) == 0
        report = json.loads(capsys.readouterr().out)
        assert sorted(report["ranks"]) == ["0", "1"] and report["ranks"]["1"]["steps"] > 0
    finally:
        cluster.close()
