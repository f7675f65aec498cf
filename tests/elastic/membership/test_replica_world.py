"""``--replicas``: the replica ring's world comes from the node records the launcher reads for
the replica servers; the round's N join keys are read only while a member's record lags."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from typing import Any

from flashckpt.elastic.launch.config import EventLog, LauncherConfig
from flashckpt.elastic.launch.session import LaunchSession, round_world
from flashckpt.elastic.membership.nodes import NodeRecord


def _record(i: int, member: int | None, state: str = "active") -> NodeRecord:
    return NodeRecord(
        f"n{i}", f"h{i}", i, f"t{i}", "", state=state, rdzv_node=f"d{i}", rdzv_member=member,
        replica=f"10.0.0.{i}:7000",
    )  # fmt: skip


# n0..n3 in the round (member ids 100..103); n4 a standby that was in round 2 (id 50).
RECORDS = [_record(i, 100 + i) for i in range(4)] + [_record(4, 50, "waiting")]
MEMBERS = frozenset({100, 101, 102, 103})


class Registry:
    def __init__(self, records: list[NodeRecord]) -> None:
        self.record = records[0]
        self._records = records
        self.reads = 0

    def records(self, timeout: timedelta | None = None) -> list[NodeRecord]:
        self.reads += 1
        return list(self._records)


class Handler:
    def __init__(self) -> None:
        self.reads = 0

    def members(self) -> frozenset[int]:
        return MEMBERS

    def participants(self) -> set[str]:  # one read of the round's join keys
        self.reads += 1
        return {"d0", "d1", "d2", "d3"}


class Agent:
    def __init__(self) -> None:
        self.peers: list[dict[str, str]] = []

    def set_replica_peers(self, peers: dict[str, str]) -> None:
        self.peers.append(peers)


def test_round_world_needs_every_members_id() -> None:
    assert round_world(RECORDS, MEMBERS) == {"d0", "d1", "d2", "d3"}
    # n3 is between its rendezvous and its record's update: its record says round 2's id.
    lagging = [*RECORDS[:3], replace(RECORDS[3], rdzv_member=49), RECORDS[4]]
    assert round_world(lagging, MEMBERS) is None
    assert round_world(RECORDS, frozenset()) is None


def _session(tmp_path: Any, records: list[NodeRecord]) -> tuple[LaunchSession, Registry, Handler]:
    config = LauncherConfig(
        entrypoint="s.py", rdzv_id="job", min_nodes=2, max_nodes=5,
        rdzv_endpoint="127.0.0.1:2379", replicas=1,
    )  # fmt: skip
    s = LaunchSession(config, EventLog(str(tmp_path / "events.jsonl"), "n0"))
    registry, handler = Registry(records), Handler()
    s._registry = registry  # type: ignore[assignment]
    s._handler = handler  # type: ignore[assignment]
    s._node_agent = Agent()  # type: ignore[assignment]
    s.config.node_id = "n0"
    return s, registry, handler


def test_replica_peers_cost_one_read_of_the_node_records_per_round(tmp_path: Any) -> None:
    # Before: a read of the node records and a read of the round's N join keys on every
    # machine every round (participants()); now the records say who is in the round.
    s, registry, handler = _session(tmp_path, RECORDS)
    s._send_replica_peers()
    assert (registry.reads, handler.reads) == (1, 0)
    want = {f"n{i}": f"10.0.0.{i}:7000" for i in (1, 2, 3)}  # not itself, not the standby
    assert s._node_agent.peers == [want]  # type: ignore[union-attr]
    # A member whose record lags: the join keys say it (one read), never a guess.
    lagging = [*RECORDS[:3], replace(RECORDS[3], rdzv_member=None), RECORDS[4]]
    s, registry, handler = _session(tmp_path, lagging)
    s._send_replica_peers()
    assert (registry.reads, handler.reads) == (1, 1)
    assert s._node_agent.peers == [want]  # type: ignore[union-attr]
