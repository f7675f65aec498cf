"""Stable group ranks (:mod:`elastic.stable_ranks`): the assignment, the records in etcd, and the
``_get_world`` our handler runs instead of torch's numbering."""

from __future__ import annotations

import logging
import random
import re
import threading
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import pytest
import torch
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousError,
    RendezvousParameters,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    _NodeDesc,
)

from elastic.etcd import EtcdClient
from elastic.rdzv_registry import BACKEND_NAME
from elastic.rendezvous import EtcdRendezvousBackend, create_handler
from elastic.stable_ranks import (
    KEEP_ROUNDS,
    RankClaim,
    RankRecords,
    assign_ranks,
    decode_record,
    encode_record,
    install_stable_ranks,
)

# -- the assignment ----------------------------------------------------------------------------


def test_without_claims_the_numbering_is_torchs() -> None:
    assert assign_ranks(["a", "b", "c"], {}) == {"a": 0, "b": 1, "c": 2}
    assert assign_ranks([], {}) == {}


def test_survivor_keeps_rank_1_when_rank_0_dies() -> None:
    # Round 3: a (rank 0) and b (rank 1); a dies, standby s joins. torch would make b rank 0.
    ranks = assign_ranks(["b", "s"], {"b": RankClaim(round=3, rank=1)})
    assert ranks == {"b": 1, "s": 0}


def test_survivor_keeps_rank_0_that_torchs_order_would_give_the_newcomer() -> None:
    assert assign_ranks(["a", "b"], {"b": RankClaim(round=0, rank=0)}) == {"a": 1, "b": 0}


def test_shrink_a_rank_beyond_the_new_world_takes_a_free_one() -> None:
    claims = {"a": RankClaim(round=2, rank=2), "b": RankClaim(round=2, rank=0)}
    assert assign_ranks(["a", "b"], claims) == {"a": 1, "b": 0}
    # Alone, the old rank 2 becomes rank 0.
    assert assign_ranks(["a"], {"a": RankClaim(round=2, rank=2)}) == {"a": 0}


def test_a_rejoined_node_with_an_old_record_loses_to_a_newer_claim() -> None:
    # f had rank 1 in round 1, was fenced; s took rank 1 in round 3; x is new. Both claim 1.
    claims = {"f": RankClaim(round=1, rank=1), "s": RankClaim(round=3, rank=1)}
    assert assign_ranks(["f", "s", "x"], claims) == {"s": 1, "f": 0, "x": 2}
    # The order of the participants does not change who wins: the newer claim.
    assert assign_ranks(["s", "f", "x"], claims) == {"s": 1, "f": 0, "x": 2}


def test_equal_claims_of_one_round_go_in_torchs_order() -> None:
    # Two records of the same round naming the same rank cannot come from our writes; they must
    # still give one answer everywhere.
    claims = {"a": RankClaim(round=5, rank=0), "b": RankClaim(round=5, rank=0)}
    assert assign_ranks(["a", "b"], claims) == {"a": 0, "b": 1}


def test_claims_of_non_participants_are_ignored() -> None:
    claims = {"gone": RankClaim(round=4, rank=0), "b": RankClaim(round=4, rank=1)}
    assert assign_ranks(["b", "new"], claims) == {"b": 1, "new": 0}


def test_duplicate_participants_are_refused() -> None:
    with pytest.raises(ValueError, match="twice"):
        assign_ranks(["a", "a"], {})


def test_any_claims_give_a_permutation_that_keeps_every_unique_fitting_claim() -> None:
    rng = random.Random(11)
    for _ in range(500):
        nodes = [f"n{i}" for i in range(rng.randint(1, 8))]
        participants = rng.sample(nodes, rng.randint(1, len(nodes)))
        participants.sort()
        claims = {
            n: RankClaim(round=rng.randint(0, 3), rank=rng.randint(0, 9))
            for n in nodes
            if rng.random() < 0.7
        }
        ranks = assign_ranks(participants, claims)
        assert sorted(ranks.values()) == list(range(len(participants)))
        for node in participants:
            claim = claims.get(node)
            if claim is None or claim.rank >= len(participants):
                continue
            rivals = [n for n in participants if n != node and claims.get(n) and claims[n] == claim]
            newer = [
                n
                for n in participants
                if n in claims and claims[n].rank == claim.rank and claims[n].round > claim.round
            ]
            if not rivals and not newer:
                assert ranks[node] == claim.rank, (participants, claims, ranks)


def test_rank_claim_checks_its_fields() -> None:
    for bad in ({"round": -1, "rank": 0}, {"round": 0, "rank": -1}, {"round": True, "rank": 0}):
        with pytest.raises(ValueError, match="RankClaim"):
            RankClaim(**bad)


# -- the records ---------------------------------------------------------------------------------


def test_record_round_trip() -> None:
    assert decode_record(encode_record(3, 4)) == (3, 4)


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (b"x" * 300, "bytes"),
        (b"\xff\xfe", "not JSON"),
        (b"{", "not JSON"),
        (b"[1, 2]", "not a JSON object"),
        (b'{"v": 2, "rank": 0, "world_size": 1}', "version"),
        (b'{"v": true, "rank": 0, "world_size": 1}', "version"),
        (b'{"v": 1, "rank": 1, "world_size": 1}', "rank"),
        (b'{"v": 1, "rank": -1, "world_size": 2}', "rank"),
        (b'{"v": 1, "rank": false, "world_size": 2}', "rank"),
        (b'{"v": 1, "rank": "0", "world_size": 2}', "rank"),
        (b'{"v": 1, "rank": 0, "world_size": 0}', "world_size"),
        (b'{"v": 1, "rank": 0, "world_size": 99999999}', "world_size"),
        (b'{"v": 1, "rank": 0}', "world_size"),
        (b"", "not JSON"),
    ],
)
def test_garbage_records_are_refused_with_the_reason(value: bytes, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        decode_record(value)


def _records(etcd_server: str, etcd_prefix: str) -> tuple[EtcdClient, RankRecords]:
    client = EtcdClient(etcd_server, timeout=timedelta(seconds=5))
    return client, RankRecords(client, etcd_prefix)


@pytest.mark.etcd
def test_claims_are_the_newest_record_of_the_last_rounds(
    etcd_server: str, etcd_prefix: str
) -> None:
    _, records = _records(etcd_server, etcd_prefix)
    inc = 7
    records.record(inc, 1, "a_1_0", 0, 2)
    records.record(inc, 1, "b/x_2_0", 1, 2)  # a '/' in the address stays one key level
    records.record(inc, 2, "b/x_2_0", 0, 1)
    records.record(inc, 3, "c_3_0", 1, 2)  # round 3 is the current round: not a claim yet
    records.record(inc + 1, 1, "a_1_0", 1, 2)  # another incarnation: never read here
    claims = records.claims(inc, 3, ["a_1_0", "b/x_2_0", "c_3_0", "d_4_0"])
    assert claims == {"a_1_0": RankClaim(round=1, rank=0), "b/x_2_0": RankClaim(round=2, rank=0)}
    assert records.key(inc, 2, "b/x_2_0").endswith("/00000000000000000007/000000000002/b%2Fx_2_0")
    # Only the last KEEP_ROUNDS rounds count: round 1 is out of reach from round 1 + KEEP + 1.
    assert records.claims(inc, 2 + KEEP_ROUNDS, ["a_1_0", "b/x_2_0"]) == {
        "b/x_2_0": RankClaim(round=2, rank=0)
    }
    assert records.claims(inc, 0, ["a_1_0"]) == {}  # round 0: no earlier round


@pytest.mark.etcd
def test_claims_read_many_nodes_across_transactions(etcd_server: str, etcd_prefix: str) -> None:
    _, records = _records(etcd_server, etcd_prefix)
    nodes = [f"h{i:03d}_1_0" for i in range(40)]  # 40 x KEEP_ROUNDS keys: several transactions
    for i, node in enumerate(nodes):
        records.record(1, 9, node, i, len(nodes))
    claims = records.claims(1, 10, nodes)
    assert claims == {n: RankClaim(round=9, rank=i) for i, n in enumerate(nodes)}


@pytest.mark.etcd
def test_a_garbage_record_is_no_claim_and_is_warned(
    etcd_server: str, etcd_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    client, records = _records(etcd_server, etcd_prefix)
    records.record(1, 0, "a_1_0", 0, 2)
    records.record(1, 0, "b_1_0", 1, 2)
    client.put(records.key(1, 1, "b_1_0"), b"\x80\x04garbage")  # newer, and not a record
    with caplog.at_level(logging.WARNING, logger="elastic.stable_ranks"):
        claims = records.claims(1, 2, ["a_1_0", "b_1_0"])
    assert claims == {"a_1_0": RankClaim(round=0, rank=0)}
    assert "b_1_0" in caplog.text and "not JSON" in caplog.text
    # The assignment goes on: b takes the free rank.
    assert assign_ranks(["a_1_0", "b_1_0"], claims) == {"a_1_0": 0, "b_1_0": 1}


@pytest.mark.etcd
def test_prune_keeps_the_rounds_still_read_and_deletes_the_rest(
    etcd_server: str, etcd_prefix: str
) -> None:
    client, records = _records(etcd_server, etcd_prefix)
    for r in range(10):
        records.record(5, r, "a_1_0", 0, 1)
    records.record(4, 3, "a_1_0", 0, 1)  # an older incarnation of the job's state
    records.record(6, 0, "a_1_0", 0, 1)  # a newer one: not ours to delete
    client.put(records.prefix + "stray", b"x")  # not a key this module writes
    deleted = records.prune(5, 9)
    assert deleted == (9 - KEEP_ROUNDS) + 1 + 1
    left = sorted(
        kv.key.decode()[len(records.prefix) :] for kv in client.get_prefix(records.prefix)
    )
    assert left == [
        *(f"00000000000000000005/{r:012d}/a_1_0" for r in range(9 - KEEP_ROUNDS, 10)),
        "00000000000000000006/000000000000/a_1_0",
    ]
    # What round 9 reads is still there.
    assert records.claims(5, 9, ["a_1_0"]) == {"a_1_0": RankClaim(round=8, rank=0)}
    assert records.prune(5, 9) == 0


def test_records_check_their_arguments(etcd_prefix: str, dead_endpoint: str) -> None:
    records = RankRecords(EtcdClient(dead_endpoint, timeout=timedelta(seconds=1)), etcd_prefix)
    with pytest.raises(ValueError, match="incarnation"):
        records.key(0, 1, "a")
    with pytest.raises(ValueError, match="round"):
        records.key(1, -1, "a")
    with pytest.raises(ValueError, match="end with '/'"):
        RankRecords(EtcdClient(dead_endpoint, timeout=timedelta(seconds=1)), "/x")


# -- the handler -----------------------------------------------------------------------------


def _params(endpoint: str, run_id: str) -> RendezvousParameters:
    return RendezvousParameters(
        backend=BACKEND_NAME,
        endpoint=endpoint,
        run_id=run_id,
        min_nodes=1,
        max_nodes=4,
        read_timeout=5,
        key_prefix="/test-ranks",
    )


def test_our_handler_numbers_with_stable_ranks(dead_endpoint: str) -> None:
    handler = create_handler(_params(dead_endpoint, f"job-{uuid.uuid4().hex[:8]}"))
    assert isinstance(handler, DynamicRendezvousHandler)
    assert type(handler.__dict__.get("_get_world")).__name__ == "_StableWorld"


class _Plain:
    """Not torch's handler: none of the internals."""


class _Renamed(DynamicRendezvousHandler):
    """A torch whose next_rendezvous no longer asks _get_world for the rank."""

    def next_rendezvous(self) -> Any:  # type: ignore[override]
        return None


def test_missing_torch_internals_fail_loudly_at_creation(dead_endpoint: str) -> None:
    backend = EtcdRendezvousBackend(
        EtcdClient(dead_endpoint, timeout=timedelta(seconds=1)), "j", key_prefix="/t"
    )
    version = re.escape(torch.__version__)
    with pytest.raises(RendezvousError, match=rf"torch {version} .*_get_world"):
        install_stable_ranks(_Plain(), backend)
    handler = create_handler(_params(dead_endpoint, "j2"))
    handler.__class__ = _Renamed
    with pytest.raises(RendezvousError, match=r"next_rendezvous\(\) calling _get_world"):
        install_stable_ranks(handler, backend)


@dataclass
class _State:
    round: int
    participants: dict[_NodeDesc, int]


@dataclass
class _Holder:
    state: _State


@dataclass
class _FakeHandler(DynamicRendezvousHandler):
    """Just what ``_get_world`` reads of torch's handler: the state after a completed round."""

    _this_node: _NodeDesc
    _state_holder: _Holder
    _heartbeat_lock: Any = field(default_factory=threading.Lock)


def _world(
    backend: EtcdRendezvousBackend, me: _NodeDesc, round_: int, nodes: list[_NodeDesc]
) -> tuple[int, int]:
    # torch's own ranks (sorted order) are in the state; ours must not depend on them.
    participants = {n: i for i, n in enumerate(sorted(nodes))}
    handler = _FakeHandler(me, _Holder(_State(round_, participants)))
    install_stable_ranks(handler, backend)
    world: tuple[int, int] = handler._get_world()
    return world


@pytest.mark.etcd
def test_get_world_keeps_survivors_ranks_across_rounds(etcd_server: str) -> None:
    backend = EtcdRendezvousBackend(
        EtcdClient(etcd_server, timeout=timedelta(seconds=5)),
        f"job-{uuid.uuid4().hex[:8]}",
        key_prefix="/test-ranks",
    )
    assert backend.set_state(b"state") is not None  # the state key: its create_revision counts
    a, b, s, t = (_NodeDesc(f"10.0.0.{i}", 100, 0) for i in (1, 2, 3, 4))
    # Round 0: torch's order.
    assert [_world(backend, n, 0, [a, b]) for n in (a, b)] == [(0, 2), (1, 2)]
    # a (rank 0) dies; standby s joins: b keeps rank 1, s takes 0 (torch: b 0, s 1).
    assert [_world(backend, n, 1, [b, s]) for n in (b, s)] == [(1, 2), (0, 2)]
    # A worker restart: same machines, same ranks.
    assert [_world(backend, n, 2, [b, s]) for n in (s, b)] == [(0, 2), (1, 2)]
    # Grow by one: the newcomer gets the next rank.
    assert [_world(backend, n, 3, [b, s, t]) for n in (b, s, t)] == [(1, 3), (0, 3), (2, 3)]
    # More rounds of the same world; each rank 0 deletes the rounds no one reads any more.
    for r in range(4, 8):
        assert [_world(backend, n, r, [b, s, t]) for n in (t, s, b)] == [(2, 3), (0, 3), (1, 3)]
    keys = backend.client.get_prefix(backend.job_prefix + "ranks/")
    assert {int(kv.key.decode().split("/")[-2]) for kv in keys} == set(range(7 - KEEP_ROUNDS, 8))

    # The state expires and a job is started again under the same run id: the old job's
    # records are not claims of the new incarnation.
    backend.client.delete(backend.key)
    assert backend.set_state(b"state again") is not None
    assert [_world(backend, n, 0, [b, s]) for n in (b, s)] == [(0, 2), (1, 2)]
    keys = backend.client.get_prefix(backend.job_prefix + "ranks/")
    left = {kv.key.decode().split("/")[-3] for kv in keys}
    assert len(left) == 1, left  # the new rank 0 deleted the old incarnation's records


@pytest.mark.etcd
def test_get_world_fails_clearly_without_state_or_etcd(
    etcd_server: str, dead_endpoint: str
) -> None:
    node = _NodeDesc("h", 1, 0)
    backend = EtcdRendezvousBackend(
        EtcdClient(etcd_server, timeout=timedelta(seconds=5)), f"job-{uuid.uuid4().hex[:8]}"
    )
    with pytest.raises(RendezvousStateError, match="vanished"):
        _world(backend, node, 0, [node])
    down = EtcdRendezvousBackend(EtcdClient(dead_endpoint, timeout=timedelta(seconds=1)), "j")
    with pytest.raises(RendezvousConnectionError, match="group ranks of rendezvous round 0"):
        _world(down, node, 0, [node])
