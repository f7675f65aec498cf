"""``LaunchSession.round_lost``: whether the workers' failure is their world's (a machine of their
round is gone: restart for the next round, not counted) or their own (counted against
``--max-restarts``), decided without processes against a registry that plays the races.

The race fresh-ci hit: the link thread revoked a dead peer's lease and dropped it from the peer
table, but had not reported it yet when the failed workers were seen; the failure then found
neither a report nor a peer to probe, and a job with ``--max-restarts 0`` exited 1.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest

from flashckpt.elastic.etcd.client import EtcdError, KeyValue
from flashckpt.elastic.launch.config import EventLog, LauncherConfig
from flashckpt.elastic.launch.session import LaunchSession
from flashckpt.elastic.membership.nodes import NodeRecord

OWN = NodeRecord(
    "n0", "h0", 1, "t0", "127.0.0.1:1", state="active", rdzv_node="d0", rdzv_member=100
)
PEER = NodeRecord(
    "n1", "h1", 2, "t1", "127.0.0.1:2", state="active", rdzv_node="d1", rdzv_member=101
)


class Registry:
    """What ``round_lost`` reads: the watch's peer table, etcd's keys, the probes."""

    def __init__(self, table: list[NodeRecord], keys: list[NodeRecord]) -> None:
        self.record = OWN
        self.table = {r.node_id: r for r in table}
        self.keys = keys
        self.probed: list[set[str]] = []
        self.etcd_down = False

    def peers(self) -> dict[str, NodeRecord]:
        return dict(self.table)

    def records(self, timeout: timedelta | None = None) -> list[NodeRecord]:
        raise AssertionError("round_lost reads no node record: a round of N would read N")

    def reap_dead_peers(self, candidates: set[str], *, via: str = "probe") -> list[NodeRecord]:
        self.probed.append(set(candidates))
        return []


class Handler:
    """What ``round_lost`` asks the rendezvous: the round's members (from its result) and how
    many of them hold no join key in etcd (one count), played from the registry's etcd keys."""

    round = 3

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.counted = 0

    def members(self) -> frozenset[int]:
        return frozenset({100, 101})

    def members_gone(self, timeout: timedelta | None = None) -> int:
        self.counted += 1
        if self.registry.etcd_down:
            raise EtcdError("etcd did not answer")
        held = {r.rdzv_member for r in [OWN, *self.registry.keys]}
        return len(self.members() - held)


def _session(registry: Registry, tmp_path: Any) -> LaunchSession:
    config = LauncherConfig(
        entrypoint="s.py",
        rdzv_id="job",
        min_nodes=2,
        max_nodes=3,
        rdzv_endpoint="127.0.0.1:2379",
    )
    s = LaunchSession(config, EventLog(str(tmp_path / "events.jsonl"), "n0"))
    s._registry = registry  # type: ignore[assignment]
    s._handler = Handler(registry)  # type: ignore[assignment]
    s._round_members = frozenset({100, 101})
    return s


def test_a_peer_revoked_but_not_yet_reported_makes_the_failure_the_worlds(tmp_path: Any) -> None:
    # Gone from the table and from etcd, no report yet: etcd says it.
    registry = Registry(table=[], keys=[])
    s = _session(registry, tmp_path)
    assert s.round_lost(failed=True) == "1 of round 3"
    # Workers that still run restart only on a report.
    assert s.round_lost(failed=False) is None


def test_a_peer_still_in_the_table_is_probed_and_a_live_one_makes_the_failure_the_workers(
    tmp_path: Any,
) -> None:
    registry = Registry(table=[PEER], keys=[PEER])
    s = _session(registry, tmp_path)
    assert s.round_lost(failed=True) is None
    assert registry.probed == [{"n1"}]


def test_a_reported_loss_needs_no_look(tmp_path: Any) -> None:
    registry = Registry(table=[PEER], keys=[PEER])
    s = _session(registry, tmp_path)
    s._round_lost.append(PEER)
    assert s.round_lost(failed=True) == "n1"
    assert s.round_lost(failed=False) == "n1"
    assert registry.probed == []
    # A machine that left with its workers done broke nothing for workers that still run.
    done = NodeRecord("n1", "h1", 2, "t1", "", state="leaving", rdzv_node="d1", done=True)
    s._round_lost[:] = [done]
    assert s.round_lost(failed=False) is None
    assert s.round_lost(failed=True) == "n1"
    # One that left otherwise (SIGTERM, preemption, retired) took its workers out of the round.
    s._round_lost[:] = [replace(done, done=False)]
    assert s.round_lost(failed=False) == "n1"
    assert s.round_lost(failed=True) == "n1"


def test_only_a_json_true_says_a_leaving_machine_was_done() -> None:
    record = NodeRecord("n1", "h1", 2, "t1", "", state="leaving", rdzv_node="d1", done=True)
    assert NodeRecord.from_kv(KeyValue(b"k", record.to_json(), 0, 0, 0, 7)) == replace(
        record, lease=7
    )
    for value in ('"yes"', "1", "null", '{"a": 1}'):
        raw = record.to_json().replace(b'"done":true', f'"done":{value}'.encode())
        parsed = NodeRecord.from_kv(KeyValue(b"k", raw, 0, 0, 0, 7))
        assert parsed is not None and parsed.done is False, value
    # A record from a launcher that does not publish the field: not done.
    raw = record.to_json().replace(b',"done":true', b"")
    parsed = NodeRecord.from_kv(KeyValue(b"k", raw, 0, 0, 0, 7))
    assert parsed is not None and parsed.done is False


def test_etcd_down_counts_the_failure_as_the_workers(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    registry = Registry(table=[], keys=[])
    registry.etcd_down = True
    s = _session(registry, tmp_path)
    assert s.round_lost(failed=True) is None
    assert "cannot count the round's machines in etcd" in caplog.text


def test_a_lost_peer_is_of_the_round_when_its_last_record_says_so(tmp_path: Any) -> None:
    # The record carries the peer's id in its round (RdzvHandler.member_id): no read of the
    # round's join keys to know that a peer that went was in it.
    s = _session(Registry(table=[PEER], keys=[PEER]), tmp_path)
    s._on_peer_lost(replace(PEER, rdzv_member=99), "watch")  # a member of another round
    s._on_peer_lost(replace(PEER, token="t2", rdzv_member=None), "watch")  # of none yet
    assert s.round_lost(failed=False) is None
    s._on_peer_lost(PEER, "watch")
    assert s.round_lost(failed=False) == "n1"
