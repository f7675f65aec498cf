"""The contract of the O(1)-per-machine rendezvous handler
(:mod:`flashckpt.elastic.rendezvous.handler`) on a real etcd, with simulated machines as threads:
rounds, stable ranks, standbys, shrink and grow within ``min:max``, the lead's death, a lost answer
to the closing transaction, stale rounds, closing, ``num_nodes_waiting`` from the watch, bounded
keys, and a round of 128 machines.

These replace the compare-and-set contract tests of the blob backend it supersedes.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousGracefulExitError,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStateError,
)
from waiting import wait_until

from flashckpt.elastic.etcd.client import EtcdClient, EtcdOutcomeUnknown, EtcdUnavailable
from flashckpt.elastic.etcd.ops import Put
from flashckpt.elastic.etcd.store import EtcdV3Store
from flashckpt.elastic.membership.nodes import NodeRegistry
from flashckpt.elastic.rendezvous import memberwatch as memberwatch_module
from flashckpt.elastic.rendezvous import result as result_module
from flashckpt.elastic.rendezvous import rounds as rounds_module
from flashckpt.elastic.rendezvous.handler import (
    PackedMembers,
    RdzvHandler,
    RdzvSettings,
    decode_members,
    encode_members,
    settings_from_params,
)
from flashckpt.elastic.rendezvous.result import _digest

pytestmark = pytest.mark.etcd


class Job:
    """Handlers of one job (machines), each calling ``next_rendezvous`` in its own thread."""

    def __init__(self, url: str, prefix: str, **settings: Any) -> None:
        self.url = url
        self.prefix = prefix
        self.settings = settings
        self.client = EtcdClient(url, timeout=timedelta(seconds=10))
        self.handlers: list[RdzvHandler] = []
        self.threads: list[threading.Thread] = []

    def machine(self, **override: Any) -> RdzvHandler:
        kw = {
            "run_id": "job",
            "job_prefix": self.prefix,
            "last_call_timeout": timedelta(seconds=0.5),
            "lease_ttl": timedelta(seconds=3),
            "join_timeout": timedelta(seconds=20),
            "local_addr": "127.0.0.1",
            **self.settings,
            **override,
        }
        h = RdzvHandler(
            self.client, EtcdV3Store(self.client, self.prefix + "store/"), RdzvSettings(**kw)
        )
        self.handlers.append(h)
        return h

    def join(self, h: RdzvHandler) -> dict[str, Any]:
        """Starts ``h.next_rendezvous()`` in a thread; the dict gets ``info`` or ``error``."""
        out: dict[str, Any] = {}

        def run() -> None:
            try:
                out["info"] = h.next_rendezvous()
            except BaseException as exc:  # recorded for the test to check
                out["error"] = exc

        t = threading.Thread(target=run, daemon=True)
        t.start()
        self.threads.append(t)
        out["thread"] = t
        return out

    def rounds(self, hs: list[RdzvHandler]) -> list[RendezvousInfo]:
        outs = [self.join(h) for h in hs]
        return [done(o) for o in outs]

    def key_list(self) -> list[str]:
        return sorted(
            kv.key.decode()[len(self.prefix) :] for kv in self.client.get_prefix(self.prefix)
        )

    def close(self) -> None:
        for h in self.handlers:
            h.leave()
        for t in self.threads:
            t.join(timeout=15)


def done(out: dict[str, Any], timeout: float = 60) -> RendezvousInfo:
    out["thread"].join(timeout)
    assert not out["thread"].is_alive(), "next_rendezvous did not return"
    if "error" in out:
        raise out["error"]
    info: RendezvousInfo = out["info"]
    return info


def kill(h: RdzvHandler) -> None:
    """An abrupt death: the lease goes (as when it lapses), nothing else is said."""
    lease = h._lease
    h._left = True  # its thread stops at its next wake-up: a dead machine does nothing more
    h.suspend()
    assert lease is not None
    h._client.revoke_lease(lease)


@pytest.fixture
def job(etcd_server: str, etcd_prefix: str) -> Iterator[Callable[..., Job]]:
    made: list[Job] = []

    def make(**settings: Any) -> Job:
        j = Job(etcd_server, etcd_prefix + uuid.uuid4().hex[:6] + "/", **settings)
        made.append(j)
        return j

    yield make
    for j in made:
        j.close()


def ranks(infos: list[RendezvousInfo]) -> list[int]:
    return [i.rank for i in infos]


def test_members_packing_roundtrips() -> None:
    revs = [10, 9, 5000, 5001, 3, 1 << 40]
    assert decode_members(encode_members(revs)) == revs
    big = list(range(100_000, 103_000, 3))[::-1]
    assert decode_members(encode_members(big)) == big
    with pytest.raises(ValueError):
        decode_members("gA==")  # no width and base
    with pytest.raises(ValueError):
        encode_members([-1])


def test_a_waiter_finds_its_rank_in_the_packed_members_without_decoding_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Issue 31: every waiter of a round of 1,024 machines decoded the 1,024 members (varints,
    # a Python loop) to find its own rank. The packing is of fixed width: one search of the
    # bytes, and the whole list is decoded only where it is needed (the lead, members()).
    revs = list(range(5000, 5000 + 1024 * 7, 7))[::-1]
    packed = encode_members(revs)
    assert len(packed) <= 2800  # 2 bytes per member, as before
    members = PackedMembers(packed)
    monkeypatch.setattr(PackedMembers, "tolist", lambda self: pytest.fail("the list was decoded"))
    assert len(members) == 1024
    assert [members.rank_of(r) for r in (revs[0], revs[517], revs[-1])] == [0, 517, 1023]
    assert members.rank_of(5001) is None and members.rank_of(1) is None
    assert revs[3] in members and 4999 not in members
    # An offset whose bytes also occur across two members' boundary is found aligned only.
    # (00 01 | 00 00 | 01 00: 0x0100 is also at byte 1.)
    tricky = PackedMembers(encode_members([0x0001, 0x0000, 0x0100]))
    assert tricky.rank_of(0x0100) == 2 and tricky.rank_of(0x0001) == 0
    assert 0x0100 not in PackedMembers(encode_members([0x0001, 0x0000]))
    # A member twice: two ranks for one machine, refused.
    with pytest.raises(ValueError, match="twice"):
        PackedMembers(encode_members([7, 9, 7])).rank_of(7)
    monkeypatch.undo()
    assert PackedMembers(packed).tolist() == revs
    # A standby that joined long before the others: 3 bytes each, searched the same way.
    wide = [10, *range(300_000, 300_000 + 64 * 5, 5)]
    three = PackedMembers(encode_members(wide))
    assert three.tolist() == wide and three.rank_of(wide[40]) == 40 and three.rank_of(10) == 0
    assert len(encode_members(wide)) == 4 * -(-(9 + 3 * len(wide)) // 3)


def test_a_round_forms_with_unique_ranks_and_a_small_result(job: Callable[..., Job]) -> None:
    j = job(min_nodes=4, max_nodes=4)
    hs = [j.machine() for _ in range(4)]
    infos = j.rounds(hs)
    assert sorted(ranks(infos)) == [0, 1, 2, 3]
    assert {i.world_size for i in infos} == {4}
    # Every machine got the same MASTER_ADDR/PORT: rank 0's, from its join, in the result
    # (nobody waits for rank 0 to publish it in the store).
    masters = {
        (i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port) for i in infos
    }
    assert len(masters) == 1 and next(iter(masters))[0] == "127.0.0.1", masters
    assert {h.round for h in hs} == {0}
    # participants() (the --replicas path, when a member's node record lags): one read of the
    # round's join keys, keys only (their names are the descriptors), then cached.
    calls: list[tuple[str, Any]] = []
    real = j.client._call

    def counting(path: str, body: Any, *args: Any, **kw: Any) -> Any:
        calls.append((path, body))
        return real(path, body, *args, **kw)

    j.client._call = counting  # type: ignore[method-assign]
    assert hs[0].participants() == {h.node for h in hs}
    assert hs[0].participants() == {h.node for h in hs}
    assert [(p, b.get("keys_only")) for p, b in calls] == [("/v3/kv/range", True)]
    j.client._call = real  # type: ignore[method-assign]
    result = j.client.get_kv(j.prefix + "rdzv/r/000000000000/c/result")
    assert result is not None and len(result.value) < 200
    doc = json.loads(result.value)
    assert doc["world"] == 4 and doc["master"][1] == infos[0].bootstrap_store_info.master_port
    assert all(h.num_nodes_waiting() == 0 for h in hs)


def test_standby_takes_the_dead_machines_rank_survivors_keep_theirs(
    job: Callable[..., Job],
) -> None:
    # A long lease: a waiter re-reads the round's control keys only after a quiet lease_ttl.
    j = job(min_nodes=3, max_nodes=3, lease_ttl=timedelta(seconds=30))
    hs = [j.machine() for _ in range(3)]
    infos = j.rounds(hs)
    before = {h.node: i.rank for h, i in zip(hs, infos, strict=True)}
    standby = j.machine()
    waiting = j.join(standby)
    wait_until(lambda: standby.waiting_in == 1, "the standby waits in round 1", timeout=30.0)
    # The round is full and every member lives: nobody restarts for the standby.
    time.sleep(0.3)  # let a (wrong) count arrive, if one were coming
    assert [h.num_nodes_waiting() for h in hs] == [0, 0, 0]
    victim = next(h for h, i in zip(hs, infos, strict=True) if i.rank == 1)
    kill(victim)
    survivors = [h for h in hs if h is not victim]
    wait_until(
        lambda: all(h.num_nodes_waiting() > 0 for h in survivors), "standby counted", timeout=30.0
    )
    txns = [h.stats.snapshot()["txns"] for h in survivors]
    after = j.rounds(survivors)
    info = done(waiting)
    # A member's join of the round after its own is one request (it knows the round key from
    # its result), and the result comes in its watch's event: the standby leads this round.
    assert [h.stats.snapshot()["txns"] - t for h, t in zip(survivors, txns, strict=True)] == [
        1,
        1,
    ]
    assert [i.rank for i in after] == [before[h.node] for h in survivors]
    assert info.rank == 1 and info.world_size == 3
    assert {i.world_size for i in after} == {3}


def test_shrink_after_last_call_and_grow_when_a_machine_arrives(job: Callable[..., Job]) -> None:
    j = job(min_nodes=2, max_nodes=3)
    a, b = j.machine(), j.machine()
    infos = j.rounds([a, b])  # min reached: closes after the last call
    assert {i.world_size for i in infos} == {2}
    c = j.machine()
    out_c = j.join(c)
    # The round has room: the newcomer counts, both members restart.
    wait_until(
        lambda: a.num_nodes_waiting() == 1 and b.num_nodes_waiting() == 1, "grow", timeout=30.0
    )
    grown = [*j.rounds([a, b]), done(out_c)]
    assert {i.world_size for i in grown} == {3}
    assert ranks(grown[:2]) == ranks(infos)  # kept
    assert grown[2].rank == 2
    # c leaves (SIGTERM): a and b form a round of 2 again.
    c.leave()
    shrunk = j.rounds([a, b])
    assert {i.world_size for i in shrunk} == {2}
    assert ranks(shrunk) == ranks(infos)


def test_a_member_restarting_counts_as_waiting(job: Callable[..., Job]) -> None:
    j = job(min_nodes=2, max_nodes=2)
    a, b = j.machine(), j.machine()
    j.rounds([a, b])
    calls = []
    real = j.client._call

    def counting(*args: Any, **kw: Any) -> Any:
        calls.append(threading.get_ident())
        return real(*args, **kw)

    j.client._call = counting  # type: ignore[method-assign]
    assert b.num_nodes_waiting() == 0
    out_a = j.join(a)  # a's workers failed: it joins the next round
    wait_until(lambda: b.num_nodes_waiting() == 1, "b sees a waiting", timeout=30.0)
    me = threading.get_ident()
    for _ in range(50):
        assert b.num_nodes_waiting() == 1
    assert me not in calls  # answered locally: this thread made no etcd call
    j.client._call = real  # type: ignore[method-assign]
    assert {i.world_size for i in [done(j.join(b)), done(out_a)]} == {2}


def test_a_waiter_costs_one_join_and_one_watch_however_long_it_waits(
    job: Callable[..., Job], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Short slices: the waiter wakes often (to check its lease), as a slow round of a large job
    # makes it wake every lease_ttl; each wake-up used to cost a read and a new watch.
    monkeypatch.setattr(rounds_module, "_WAIT_SLICE_S", 0.05)
    j = job(min_nodes=3, max_nodes=3)
    lead, waiter = j.machine(), j.machine()
    out_lead = j.join(lead)
    wait_until(lambda: lead.waiting_in == 0, "the first machine leads round 0", timeout=30.0)
    out_waiter = j.join(waiter)
    wait_until(
        lambda: waiter.stats.snapshot()["waits"] >= 10, "the waiter woke 10 times", timeout=30.0
    )
    out_last = j.join(j.machine())
    infos = [done(out_lead), done(out_waiter), done(out_last)]
    assert sorted(ranks(infos)) == [0, 1, 2]
    stats = waiter.stats.snapshot()
    # Its join (one transaction) and one watch of the round's control keys, whose event
    # carried the result: no read, no other watch, whatever the number of wake-ups.
    assert (stats["txns"], stats["wait_watches"]) == (1, 1), stats


def test_lead_dies_another_machine_takes_over(job: Callable[..., Job]) -> None:
    j = job(min_nodes=3, max_nodes=3)
    first, second = j.machine(), j.machine()
    out1, out2 = j.join(first), j.join(second)
    lead_key = j.prefix + "rdzv/r/000000000000/c/lead"
    wait_until(
        lambda: j.client.get(lead_key) is not None and second.waiting_in == 0,
        "the condition",
        timeout=30.0,
    )
    lead_value = j.client.get(lead_key)
    assert lead_value is not None
    leader = first if lead_value[0] == first.node.encode() else second
    other, out_other = (second, out2) if leader is first else (first, out1)
    kill(leader)
    wait_until(
        lambda: (kv := j.client.get(lead_key)) is not None and kv[0] == other.node.encode(),
        "the other machine leads",
        timeout=30.0,
    )
    late = [j.join(j.machine()) for _ in range(2)]
    infos = [done(out_other), *(done(o) for o in late)]
    assert sorted(ranks(infos)) == [0, 1, 2]
    assert {i.world_size for i in infos} == {3}


def test_the_closers_lost_answer_finds_its_result_and_never_closes_twice(
    job: Callable[..., Job],
) -> None:
    j = job(min_nodes=2, max_nodes=2)
    a, b = j.machine(), j.machine()
    real = j.client._call
    lost: list[dict[str, Any]] = []

    def lose_result_answer(path: str, body: dict[str, Any], **kw: Any) -> Any:
        response = real(path, body, **kw)
        put_keys = [
            op["request_put"]["key"] for op in body.get("success", []) if "request_put" in op
        ]
        import base64

        if any(base64.b64decode(k).endswith(b"/c/result") for k in put_keys) and not lost:
            lost.append(response)  # applied, but the answer never arrives
            raise EtcdOutcomeUnknown("answer lost (test)")
        return response

    j.client._call = lose_result_answer  # type: ignore[method-assign]
    infos = j.rounds([a, b])
    j.client._call = real  # type: ignore[method-assign]
    assert lost and lost[0]["succeeded"]
    assert sorted(ranks(infos)) == [0, 1]
    assert j.client.get(j.prefix + "rdzv/round") is not None
    assert j.client.get(j.prefix + "rdzv/round")[0] == b"0"  # type: ignore[index]
    # One round closed, not two: no round-1 result, nobody waits.
    assert j.client.get(j.prefix + "rdzv/r/000000000001/c/result") is None
    assert a.round == 0 and b.round == 0


def test_a_join_with_a_stale_round_is_refused_and_lands_in_the_open_round(
    job: Callable[..., Job],
) -> None:
    j = job(min_nodes=1, max_nodes=1, last_call_timeout=timedelta(0))
    h = j.machine()
    real = h._txn
    raced: list[bool] = []

    def close_round_zero_first(compare: Any, success: Any, failure: Any, **kw: Any) -> Any:
        if compare and not raced and any(isinstance(op, Put) for op in success):
            # Between this machine's read and its join, another closed round 0.
            raced.append(True)
            j.client.put(j.prefix + "rdzv/round", b"0")
        return real(compare, success, failure, **kw)

    h._txn = close_round_zero_first  # type: ignore[method-assign]
    info = done(j.join(h))
    assert raced
    assert info.rank == 0 and h.round == 1
    assert not [k for k in j.key_list() if k.startswith("rdzv/r/000000000000/a/")]


@pytest.mark.parametrize("failure", ["etcd_error", "lease_lapsed"])
def test_a_member_whose_wait_failed_takes_its_rank_not_the_next_round(
    job: Callable[..., Job], failure: str
) -> None:
    # Issue 31 (benchmark at 512 machines under load: 108 leases lapsed between the kill and
    # round 2, 24 members never took their rank): a machine joined round 0, its wait for the
    # result ended without it (its watch could not reach etcd, or its lease lapsed) and the
    # round closed with it meanwhile. Its next join is refused (the round key moved): it must
    # take its rank in round 0 from the refusal, not join round 1, where it would wait forever
    # while its group waits for it.
    j = job(min_nodes=2, max_nodes=2)
    lead, late = j.machine(), j.machine(join_timeout=timedelta(seconds=10))
    out_lead = j.join(lead)
    wait_until(lambda: lead.waiting_in == 0, "the first machine leads round 0", timeout=30.0)
    result_key = j.prefix + "rdzv/r/000000000000/c/result"
    failed: list[bool] = []
    real_wait = late._wait_ctl

    def watch_fails_once(stream: Any, seconds: float) -> Any:
        if not failed:
            wait_until(lambda: j.client.get(result_key) is not None, "round 0 closed", 30.0)
            failed.append(True)
            if failure == "etcd_error":
                raise EtcdUnavailable("no etcd endpoint accepted the watch (test)")
            lease = late._lease
            assert lease is not None
            j.client.revoke_lease(lease)  # lapsed: what its renewal then finds
            late._lease_lost.set()
            return []
        return real_wait(stream, seconds)

    late._wait_ctl = watch_fails_once  # type: ignore[method-assign]
    out_late = j.join(late)
    infos = [done(out_lead), done(out_late)]
    assert failed
    assert sorted(ranks(infos)) == [0, 1] and {i.world_size for i in infos} == {2}
    assert late.round == 0
    assert not [k for k in j.key_list() if k.startswith("rdzv/r/000000000001/")]


def test_a_result_of_another_round_is_a_clear_error(job: Callable[..., Job]) -> None:
    j = job(min_nodes=1, max_nodes=1)
    packed = encode_members([5])
    j.client.put(
        j.prefix + "rdzv/r/000000000000/c/result",
        json.dumps(
            {
                "v": result_module._RESULT_VERSION,
                "round": 7,
                "world": 1,
                "m": packed,
                "digest": _digest(packed),
            }
        ).encode(),
    )
    with pytest.raises(RendezvousStateError, match="says round 7"):
        done(j.join(j.machine()))
    # A result of the version before (its members' watches followed the next round's joins,
    # and its joins say nothing in next-* keys): a job mixing the two is refused.
    j.client.put(
        j.prefix + "rdzv/r/000000000000/c/result",
        json.dumps(
            {"v": 2, "round": 0, "world": 1, "m": packed, "digest": _digest(packed)}
        ).encode(),
    )
    with pytest.raises(RendezvousStateError, match="same flashckpt version"):
        done(j.join(j.machine()))
    j.client.put(j.prefix + "rdzv/round", b"not a round")
    with pytest.raises(RendezvousStateError, match="not a round number"):
        done(j.join(j.machine()))


def test_closed_rendezvous(job: Callable[..., Job]) -> None:
    j = job(min_nodes=2, max_nodes=2)
    a, b = j.machine(), j.machine()
    j.rounds([a, b])
    standby = j.machine()
    out = j.join(standby)
    wait_until(lambda: standby.waiting_in == 1, "the condition", timeout=30.0)
    assert a.shutdown()
    # The waiting standby was not needed: it leaves gracefully; a member's rejoin is refused.
    with pytest.raises(RendezvousGracefulExitError):
        done(out)
    with pytest.raises(RendezvousClosedError):
        b.next_rendezvous()
    assert j.machine().is_closed()
    with pytest.raises(RendezvousClosedError):
        j.machine().next_rendezvous()
    assert not [k for k in j.key_list() if k.startswith("rdzv/r/")]


@pytest.mark.parametrize("done", [True, False], ids=["workers-done", "workers-failed"])
def test_a_standby_learns_whether_the_job_succeeded_from_one_job_level_key(
    job: Callable[..., Job], done: bool
) -> None:
    # The machines that close the rendezvous at the end say in the same write whether their
    # workers finished (what a standby's exit code depends on): one key read by whoever asks,
    # where every machine used to watch every peer's record to see the leavers' "done".
    j = job(min_nodes=2, max_nodes=2)
    a, b = j.machine(), j.machine()
    j.rounds([a, b])
    standby = j.machine()
    assert not standby.finished_done() and not standby.is_closed()
    a.shutdown(done=done)
    assert standby.is_closed() and standby.finished_done() is done
    b.shutdown()  # a later close that does not say done takes nothing back
    assert standby.finished_done() is done


def test_keys_stay_bounded_over_many_rounds(job: Callable[..., Job]) -> None:
    j = job(min_nodes=2, max_nodes=2)
    a, b = j.machine(), j.machine()
    counts = []
    for _ in range(6):
        infos = j.rounds([a, b])
        infos[0].store.set("barrier", "1")  # what the agents write in a round's store
        counts.append(len(j.key_list()))
    assert a.round == 5
    # The closer of round R deleted round R - 2 and its store keys.
    assert {k[7:19] for k in j.key_list() if k.startswith("rdzv/r/")} == {
        "000000000004",
        "000000000005",
    }
    assert {k.split("/")[1] for k in j.key_list() if k.startswith("store/")} == {
        "torch.rendezvous.job.4",
        "torch.rendezvous.job.5",
    }
    assert max(counts[2:]) == min(counts[2:]), counts


def test_settings_from_torchrun_options() -> None:
    params = RendezvousParameters(
        backend="flashckpt-etcd",
        endpoint="h:1",
        run_id="r",
        min_nodes=1,
        max_nodes=4,
        last_call_timeout="2",
        lease_ttl="7",
        join_timeout=90,
    )
    s = settings_from_params(params, "/p/r/")
    assert s.last_call_timeout == timedelta(seconds=2) and s.lease_ttl == timedelta(seconds=7)
    assert s.join_timeout == timedelta(seconds=90) and s.max_nodes == 4
    bad = RendezvousParameters(
        backend="flashckpt-etcd",
        endpoint="h:1",
        run_id="r",
        min_nodes=1,
        max_nodes=2,
        lease_ttl="1",
    )
    with pytest.raises(ValueError, match="lease_ttl"):
        settings_from_params(bad, "/p/r/")


def test_a_round_of_128_machines(job: Callable[..., Job]) -> None:
    n = 128
    j = job(min_nodes=n, max_nodes=n, lease_ttl=timedelta(seconds=10))
    hs = [j.machine() for _ in range(n)]
    infos = j.rounds(hs)
    assert sorted(ranks(infos)) == list(range(n))
    assert {i.world_size for i in infos} == {n}
    result = j.client.get(j.prefix + "rdzv/r/000000000000/c/result")
    assert result is not None and len(result[0]) < 1024
    failed = sum(h.stats.snapshot()["txns_failed"] for h in hs)
    assert failed < n  # lead races only: no compare-and-set storm
    # A join is one request: no read of the round key first (the join's compare checks what
    # the machine knows, none yet), no read of the result after (its watch event carries it);
    # the lead adds a read of the joins and the close. Before: 3 per machine (384).
    txns = sum(h.stats.snapshot()["txns"] for h in hs)
    assert txns < 2 * n, txns
    # What the launcher asks each round (who is in it, this machine's id there) comes from the
    # result each machine holds: no request (participants() read the round's N join keys on
    # every machine, N*N for the job); whether a member went is one count.
    calls: list[str] = []
    real = j.client._call

    def counting(path: str, *args: Any, **kw: Any) -> Any:
        calls.append(path)
        return real(path, *args, **kw)

    j.client._call = counting  # type: ignore[method-assign]
    members = {h.members() for h in hs}
    ids = [h.member_id for h in hs]
    assert calls == []
    assert len(members) == 1 and set(ids) == next(iter(members)) and len(set(ids)) == n
    assert hs[0].members_gone() == 0 and calls == ["/v3/kv/txn"]
    kill(hs[5])
    assert hs[0].members_gone() == 1 and calls.count("/v3/kv/txn") == 2


def test_an_etcd_restart_is_waited_out_by_members_and_standby(etcd_instance: Any) -> None:
    j = Job(etcd_instance.client_url, "/outage/", min_nodes=2, max_nodes=2)
    try:
        a, b = j.machine(), j.machine()
        j.rounds([a, b])
        standby = j.machine()
        out = j.join(standby)
        wait_until(lambda: standby.waiting_in == 1, "the condition", timeout=30.0)
        etcd_instance.restart(down_for=timedelta(seconds=4))  # SIGKILL, 4 s down: > lease_ttl
        # The members' watches and the standby's wait reconnect; the round is still full.
        assert a.num_nodes_waiting() == 0 and b.num_nodes_waiting() == 0
        kill(a)
        wait_until(
            lambda: b.num_nodes_waiting() > 0, "b sees the standby after a's death", timeout=30.0
        )
        info_b, info_s = done(j.join(b)), done(out)
        assert (info_b.world_size, info_s.world_size) == (2, 2)
        assert {info_b.rank, info_s.rank} == {0, 1}
    finally:
        j.close()


def test_a_machine_wrongly_found_dead_joins_again_and_the_round_forms(
    job: Callable[..., Job],
) -> None:
    # Liveness said "dead" (a lapsed node lease on an overloaded host) while it waited: its
    # rendezvous lease is revoked by a peer, its keys go, and it joins again with a new lease.
    j = job(min_nodes=3, max_nodes=3)
    a, b, c = j.machine(), j.machine(), j.machine()
    out_a, out_b = j.join(a), j.join(b)
    wait_until(lambda: a.waiting_in == 0 and b.waiting_in == 0, "a and b wait in round 0")
    old = a._lease
    assert b.expire_nodes([a.node]) == 1
    wait_until(lambda: a._lease is not None and a._lease != old, what="a joins with a new lease")
    out_c = j.join(c)
    infos = [done(out_a), done(out_b), done(out_c)]
    assert sorted(ranks(infos)) == [0, 1, 2] and {i.world_size for i in infos} == {3}
    # A member wrongly found dead while its workers train: its own count says restart.
    assert a.num_nodes_waiting() == 0
    c.expire_nodes([a.node])
    wait_until(lambda: a.num_nodes_waiting() > 0, what="a learns it was dropped")


def test_the_rendezvous_keys_share_the_node_lease(
    etcd_server: str, job: Callable[..., Job]
) -> None:
    # flashckpt run: one lease per machine (NodeRegistry's), renewed by the registry alone. Its
    # end (lapsed, or revoked by a peer that found the machine dead) ends the machine's join
    # keys at once, and the handler joins again with the registry's next lease.
    j = job(min_nodes=2, max_nodes=2)
    ttl = timedelta(seconds=3)
    regs = []
    for name in ("a", "b"):
        reg = NodeRegistry(
            EtcdClient(etcd_server, timeout=timedelta(seconds=10)),
            j.prefix,
            name,
            ttl=ttl,
            advertise_host="127.0.0.1",
            bind_host="127.0.0.1",
            links=0,
        )
        reg.start(timedelta(seconds=10))
        regs.append(reg)
    try:
        a, b = j.machine(lease_ttl=ttl), j.machine(lease_ttl=ttl)
        assert a.share_lease(regs[0]) and b.share_lease(regs[1])
        assert not j.machine(lease_ttl=timedelta(seconds=4)).share_lease(regs[0])  # other TTL
        # Lost before its first join (an overloaded host's lease lapsed): a waits for the
        # registry's next lease, never fails the rendezvous for it.
        first = regs[0].shared_lease()
        assert first is not None and j.client.revoke_lease(first)
        j.rounds([a, b])
        a_join = j.prefix + "rdzv/r/000000000000/a/" + a.node
        kv, lease = j.client.get_kv(a_join), regs[0].shared_lease()
        assert kv is not None and lease is not None and kv.lease == lease.id
        assert a._keepalive is None and b._keepalive is None, "no lease of the handlers' own"

        old = regs[0].shared_lease()
        assert old is not None
        j.client.revoke_lease(old)  # a peer found a dead (wrongly)
        assert j.client.get_kv(a_join) is None, "its join key went with the node lease"
        wait_until(lambda: a.num_nodes_waiting() > 0, "a learns it was dropped", timeout=30.0)
        wait_until(
            lambda: regs[0].shared_lease() not in (None, old),
            "a registered again with a new lease",
            timeout=30.0,
        )
        new = regs[0].shared_lease()
        assert new is not None
        infos = j.rounds([a, b])
        assert {i.world_size for i in infos} == {2}
        kv = j.client.get_kv(j.prefix + "rdzv/r/000000000001/a/" + a.node)
        assert kv is not None and kv.lease == new.id

        # Leaving the rendezvous gives up a's join keys, not the machine's node key (it says
        # how the machine left, after the rendezvous: the launcher's teardown).
        a.leave()
        assert j.client.get_kv(j.prefix + "rdzv/r/000000000001/a/" + a.node) is None
        assert j.client.get_kv(regs[0].key) is not None
    finally:
        for reg in regs:
            reg.close()


def test_a_member_opens_no_watch_of_its_own_once_it_has_its_rank(
    job: Callable[..., Job], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Issue 31 (kill -> round 2 at 1,024 machines): a waiter followed its round's control keys
    # on one watch, closed it once it read the result, and opened another for the member
    # watch (num_nodes_waiting), over every member's join key: two watches per member per
    # round, and every member's death a message to every member. The member watch goes on
    # with the wait's watch (the round's control keys); that a full round lost a member comes
    # from the next round's lead, once (r/<R>/c/room).
    from flashckpt.elastic.etcd.watchstream import WatchStream

    opened: list[bytes] = []

    class Counting(WatchStream):
        def __init__(self, client: Any, key: bytes, *args: Any, **kwargs: Any) -> None:
            opened.append(key)
            super().__init__(client, key, *args, **kwargs)

    for module in (rounds_module, memberwatch_module):  # every watch the handler opens
        monkeypatch.setattr(module, "WatchStream", Counting)
    j = job(min_nodes=4, max_nodes=4, lease_ttl=timedelta(seconds=30))
    hs = [j.machine() for _ in range(4)]
    infos = j.rounds(hs)
    assert sorted(ranks(infos)) == [0, 1, 2, 3]
    # The lead: its joins' watch and its member watch; each of the 3 waiters: one (was two).
    assert len(opened) == 2 + 3, opened
    assert all(h.num_nodes_waiting() == 0 for h in hs)
    # A standby for the full round: it leads the next one (its joins' watch, over the members'
    # keys); the members open nothing, and count nobody while every member lives.
    standby = j.machine()
    waiting = j.join(standby)
    wait_until(lambda: standby.waiting_in == 1, "the standby waits in round 1", timeout=30.0)
    wait_until(lambda: len(opened) == 6, "the standby leading round 1", timeout=30.0)
    time.sleep(0.3)  # let a (wrong) count arrive, if one were coming
    assert [h.num_nodes_waiting() for h in hs] == [0, 0, 0, 0] and len(opened) == 6
    victim = next(h for h, i in zip(hs, infos, strict=True) if i.rank == 2)
    kill(victim)
    survivors = [h for h in hs if h is not victim]
    wait_until(
        lambda: all(h.num_nodes_waiting() > 0 for h in survivors), "standby counted", timeout=30.0
    )
    assert j.client.get(j.prefix + "rdzv/r/000000000000/c/room") is not None
    after = j.rounds(survivors)
    info = done(waiting)
    assert info.rank == 2 and sorted([*ranks(after), info.rank]) == [0, 1, 2, 3]
    # A member restarting (its join of the next round) is counted by the others' watches, as
    # they go on with the stream of their wait.
    restarting = survivors[0]
    others = [*survivors[1:], standby]
    out = j.join(restarting)
    wait_until(
        lambda: all(h.num_nodes_waiting() > 0 for h in others), "the restart counted", timeout=30.0
    )
    j.rounds(others)
    done(out)


def test_a_member_watch_never_receives_the_next_rounds_joins(
    job: Callable[..., Job], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Issue 31 (kill -> round 2 at 1,024 machines): a member's watch followed the next round's
    # join keys, so until its thread stopped it, it received every join of the next round (9-50
    # messages per machine after a kill, up to N each). The next round says what a member
    # counts in one key each under the round's own control keys (next-member, next-other,
    # next-result, room), created once: however many machines join, a member's watch receives
    # at most those.
    from flashckpt.elastic.etcd.watchstream import WatchStream

    ctl0 = b"rdzv/r/000000000000/c/"
    received: list[bytes] = []  # keys delivered on the round-0 members' watches

    class Counting(WatchStream):
        def __init__(self, client: Any, key: bytes, *args: Any, **kwargs: Any) -> None:
            super().__init__(client, key, *args, **kwargs)
            self._counted = key.endswith(ctl0)

        def next_events(self, *args: Any, **kwargs: Any) -> Any:
            events = super().next_events(*args, **kwargs)
            if self._counted:
                received.extend(ev.kv.key for ev in events)
            return events

    for module in (rounds_module, memberwatch_module):  # every watch the handler opens
        monkeypatch.setattr(module, "WatchStream", Counting)
    j = job(min_nodes=6, max_nodes=6, lease_ttl=timedelta(seconds=30))
    hs = [j.machine() for _ in range(6)]
    infos = j.rounds(hs)
    assert sorted(ranks(infos)) == list(range(6))
    # Five members restart (their joins of round 1); the sixth, still training, counts them
    # from one key, and its watch (stopped once it counted) never saw a join key.
    last = hs[5]
    outs = [j.join(h) for h in hs[:5]]
    wait_until(lambda: last.num_nodes_waiting() > 0, "the restart counted", timeout=30.0)
    wait_until(
        lambda: all(h.waiting_in == 1 for h in hs[:5]), "the five wait in round 1", timeout=30.0
    )
    j.rounds([last])
    for out in outs:
        done(out)
    joins = [k for k in received if b"/r/000000000001/a/" in k]
    assert not joins, joins
    said = {
        k.rsplit(b"/", 1)[-1]
        for k in received
        if k.endswith(
            tuple(b"/" + n for n in (b"next-member", b"next-other", b"next-result", b"room"))
        )
    }
    assert b"next-member" in said, received
    keys = j.key_list()
    assert "rdzv/r/000000000000/c/next-member" in keys
    assert "rdzv/r/000000000000/c/next-result" in keys


def test_a_large_result_is_written_in_parts_none_larger_than_a_few_kib(
    job: Callable[..., Job], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Issue 31: "no value it writes is larger than a few KiB at any size". The members take 2-3
    # bytes each (2.9 KB at 1,024 machines, ~28 KB at 10,000): the closer writes them in parts
    # of _RESULT_PART_CHARS, in its one transaction. Here a part holds 4 characters, so a round
    # of 6 is written in several; every machine still gets the same ranks, and a standby that
    # replaces a dead member reads the parts of round 0 (its lead, the previous round's
    # members) as well.
    monkeypatch.setattr(rounds_module, "_RESULT_PART_CHARS", 4)
    j = job(min_nodes=6, max_nodes=6, lease_ttl=timedelta(seconds=30))
    hs = [j.machine() for _ in range(6)]
    infos = j.rounds(hs)
    assert sorted(ranks(infos)) == list(range(6))
    ctl = j.client.get_prefix(j.prefix + "rdzv/r/000000000000/c/result")
    header = next(kv for kv in ctl if kv.key.endswith(b"/c/result"))
    doc = json.loads(header.value)
    parts = [kv for kv in ctl if kv is not header]
    assert doc["parts"] == len(parts) >= 2, [kv.key for kv in ctl]
    assert len(doc["m"]) <= 4 and all(len(kv.value) <= 4 for kv in parts)
    assert len({kv.mod_revision for kv in ctl}) == 1  # one transaction
    assert len({h.members() for h in hs}) == 1 and len(hs[0].members()) == 6
    standby = j.machine()
    waiting = j.join(standby)
    wait_until(lambda: standby.waiting_in == 1, "the standby waits in round 1", timeout=30.0)
    victim = next(h for h, i in zip(hs, infos, strict=True) if i.rank == 4)
    kill(victim)
    survivors = [h for h in hs if h is not victim]
    after = j.rounds(survivors)
    info = done(waiting)
    assert info.rank == 4 and sorted([*ranks(after), info.rank]) == list(range(6))
    assert [i.rank for i in after] == [
        i.rank for h, i in zip(hs, infos, strict=True) if h is not victim
    ]


def test_a_result_missing_a_part_is_refused(job: Callable[..., Job]) -> None:
    from flashckpt.elastic.etcd.client import KeyValue

    packed = encode_members([5, 6, 7])
    key = b"/job/rdzv/r/000000000000/c/result"
    head = {"v": result_module._RESULT_VERSION, "round": 0, "world": 3, "closer": "x"}
    value = json.dumps({**head, "m": packed[:2], "parts": 2, "digest": _digest(packed)})
    kvs = [
        KeyValue(key, value.encode(), 9, 9, 1, 0),
        KeyValue(key + b".2", packed[4:].encode(), 9, 9, 1, 0),
    ]
    with pytest.raises(RendezvousStateError, match="lacks its part 1 of 2"):
        result_module._decode_result(kvs, 0)
    whole = [*kvs, KeyValue(key + b".1", packed[2:4].encode(), 9, 9, 1, 0)]
    result, header = result_module._decode_result(whole, 0)
    assert result.members.tolist() == [5, 6, 7] and header is kvs[0]
    # A part that is not ASCII text (so not the packed members) is refused the same way.
    bad = [*kvs, KeyValue(key + b".1", "é".encode(), 9, 9, 1, 0)]
    with pytest.raises(RendezvousStateError, match="lacks its part 1 of 2"):
        result_module._decode_result(bad, 0)
