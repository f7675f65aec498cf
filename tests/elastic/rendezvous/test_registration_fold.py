"""The node key's registration folded into the rendezvous' first join (issue 31), on a real etcd.

``NodeRegistry.start(with_join=True)`` grants the lease and renews it; the handler's first join
creates the node key in its own transaction: one transaction per machine on the way to its first
round, not two. Every outcome of the registration stays: a node id held by a live launcher is
refused with :class:`NodeIdInUse`, a dead launcher's key is taken over, a lost answer is read,
never sent again.
"""

from __future__ import annotations

import socket
import threading
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest

from flashckpt.elastic.etcd.client import EtcdClient, EtcdOutcomeUnknown
from flashckpt.elastic.etcd.store import EtcdV3Store
from flashckpt.elastic.membership.nodes import NodeIdInUse, NodeRecord, NodeRegistry
from flashckpt.elastic.rendezvous.handler import RdzvHandler, RdzvSettings

pytestmark = pytest.mark.etcd

TTL = timedelta(seconds=3)


class Machine:
    """A launcher's registry and handler on a client of their own, counting its etcd calls."""

    def __init__(self, url: str, prefix: str, node_id: str, nodes: int) -> None:
        self.client = EtcdClient(url, timeout=timedelta(seconds=10))
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.reader = EtcdClient(url, timeout=timedelta(seconds=10))  # the test's own reads
        self.lose_answer: Callable[[dict[str, Any]], bool] | None = None
        call = self.client._call

        def counted(path: str, body: dict[str, Any], **kw: Any) -> dict[str, Any]:
            self.calls.append((path, body))
            lose = self.lose_answer is not None and self.lose_answer(body)
            answer = call(path, body, **kw)
            if lose:
                self.lose_answer = None
                raise EtcdOutcomeUnknown("the test lost this answer (it was taken)")
            return answer

        self.client._call = counted  # type: ignore[method-assign]
        self.handler = RdzvHandler(
            self.client,
            EtcdV3Store(self.client, prefix + "store/"),
            RdzvSettings(
                run_id="job",
                job_prefix=prefix,
                min_nodes=nodes,
                max_nodes=nodes,
                last_call_timeout=timedelta(seconds=0.5),
                lease_ttl=TTL,
                join_timeout=timedelta(seconds=30),
                local_addr="127.0.0.1",
            ),
        )
        self.registry = NodeRegistry(
            self.client,
            prefix,
            node_id,
            ttl=TTL,
            advertise_host="127.0.0.1",
            bind_host="127.0.0.1",
            links=0,
        )
        self.out: dict[str, Any] = {}

    def start(self) -> None:
        assert self.handler.share_lease(self.registry)
        self.registry.start(
            timedelta(seconds=10), watch=False, with_join=True, rdzv_node=self.handler.node
        )

    def join(self) -> threading.Thread:
        def run() -> None:
            try:
                self.out["info"] = self.handler.next_rendezvous()
            except BaseException as exc:  # the test checks it
                self.out["error"] = exc

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread

    def until_joined(self, path: str) -> int:
        """Calls of ``path`` up to the transaction that put this machine's join key of round 0
        (the lead's later lease of the round's keys is the round's, not the registration's)."""
        join = self.handler._rp(0) + "a/" + self.handler._qnode
        for n, (sent, body) in enumerate(self.calls):
            if sent == "/v3/kv/txn" and join in _keys(body):
                return sum(p == path for p, _ in self.calls[: n + 1])
        raise AssertionError(f"no join of round 0 among {[p for p, _ in self.calls]}")

    def close(self) -> None:
        self.handler.leave()
        self.registry.close()
        self.client.close()
        self.reader.close()


def _keys(body: Any) -> list[str]:
    """The keys written by the puts of a transaction body, nested ones included (decoded)."""
    import base64

    found: list[str] = []
    if isinstance(body, dict):
        put = body.get("request_put")
        if isinstance(put, dict) and "key" in put:
            found.append(base64.b64decode(put["key"]).decode())
        for value in body.values():
            found += _keys(value)
    elif isinstance(body, list):
        for item in body:
            found += _keys(item)
    return found


@pytest.fixture
def machines(etcd_server: str, etcd_prefix: str) -> Iterator[Callable[[str, int], Machine]]:
    prefix = etcd_prefix + uuid.uuid4().hex[:6] + "/"
    made: list[Machine] = []

    def make(node_id: str, nodes: int) -> Machine:
        m = Machine(etcd_server, prefix, node_id, nodes)
        made.append(m)
        return m

    yield make
    for m in made:
        m.close()


def _done(m: Machine, thread: threading.Thread) -> Any:
    thread.join(60)
    assert not thread.is_alive(), "next_rendezvous did not return"
    if "error" in m.out:
        raise m.out["error"]
    return m.out["info"]


def test_the_first_join_creates_the_node_key_one_transaction_per_machine(
    machines: Callable[[str, int], Machine],
) -> None:
    a, b = machines("a", 2), machines("b", 2)
    for m in (a, b):
        m.start()
        assert m.reader.get_kv(m.registry.key) is None, "the key waits for the first join"
        assert [p for p, _ in m.calls] == ["/v3/lease/grant"], "start sent the grant alone"
        m.registry.update(state="waiting", replica="127.0.0.1:1")  # recorded, not written yet
        assert len(m.calls) == 1
    infos = [_done(m, t) for m, t in [(m, m.join()) for m in (a, b)]]
    assert sorted(i.rank for i in infos) == [0, 1]
    for m in (a, b):
        # The old path: the registration's transaction, then the join's: two.
        assert m.until_joined("/v3/kv/txn") == 1, [p for p, _ in m.calls]
        assert m.until_joined("/v3/lease/grant") == 1
        lease = m.registry.shared_lease()
        kv = m.reader.get_kv(m.registry.key)
        assert kv is not None and lease is not None and kv.lease == lease.id
        assert kv.version == 1, "the node key was written once"
        record = NodeRecord.from_kv(kv)
        assert record is not None
        assert (record.rdzv_node, record.state, record.replica) == (
            m.handler.node,
            "waiting",
            "127.0.0.1:1",
        )
        join = m.reader.get_kv(m.handler._rp(0) + "a/" + m.handler._qnode)
        assert join is not None and join.lease == lease.id
        assert join.create_revision == kv.create_revision, "created by one transaction"
    a.registry.update(state="active", group_rank=infos[0].rank)
    kv = a.client.get_kv(a.registry.key)
    assert kv is not None and kv.version == 2, "update writes once the key exists"


def test_a_node_id_held_by_a_live_launcher_is_refused_by_the_first_join(
    machines: Callable[[str, int], Machine],
) -> None:
    live = machines("n", 1)
    live.registry.start(timedelta(seconds=10))  # registered the old way, alive
    before = live.reader.get_kv(live.registry.key)
    second = machines("n", 1)
    second.start()
    thread = second.join()
    with pytest.raises(NodeIdInUse, match="is already used in this job by a running launcher"):
        _done(second, thread)
    after = live.reader.get_kv(live.registry.key)
    assert before is not None and after is not None and after.mod_revision == before.mod_revision
    assert second.reader.get_prefix(second.handler._p) == [], "it joined nothing"


def test_a_dead_launchers_key_is_taken_over_by_the_first_join(
    machines: Callable[[str, int], Machine],
) -> None:
    m = machines("n", 1)
    # A launcher that died on this host: its key on a lease that still runs, its probe port
    # closed (refused).
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    lease = m.reader.grant_lease(timedelta(seconds=60))
    dead = NodeRecord(node_id="n", host="gone", pid=1, token="dead", probe=f"127.0.0.1:{port}")
    m.reader.put(m.registry.key, dead.to_json(), lease=lease)
    m.start()
    info = _done(m, m.join())
    assert info.rank == 0
    kv = m.reader.get_kv(m.registry.key)
    mine = m.registry.shared_lease()
    assert kv is not None and mine is not None and kv.lease == mine.id
    record = NodeRecord.from_kv(kv)
    assert record is not None and record.token == m.registry.record.token
    assert m.until_joined("/v3/lease/grant") == 1, "the registry's lease, kept meanwhile"


@pytest.mark.parametrize("taken", [True, False], ids=["taken", "not-taken"])
def test_a_lost_answer_is_read_never_sent_again(
    machines: Callable[[str, int], Machine], taken: bool
) -> None:
    m = machines("n", 1)
    m.start()
    key = m.registry.key

    def is_fold(body: dict[str, Any]) -> bool:
        return key in _keys(body)

    if taken:
        m.lose_answer = is_fold  # etcd took it, the answer was lost
    else:
        real = m.client._call

        def refused(path: str, body: dict[str, Any], **kw: Any) -> dict[str, Any]:
            if is_fold(body) and not refused.done:  # type: ignore[attr-defined]
                refused.done = True  # type: ignore[attr-defined]
                m.calls.append((path, body))
                raise EtcdOutcomeUnknown("the test lost this request (never taken)")
            return real(path, body, **kw)

        refused.done = False  # type: ignore[attr-defined]
        m.client._call = refused  # type: ignore[method-assign]
    info = _done(m, m.join())
    assert info.rank == 0
    kv = m.reader.get_kv(key)
    lease = m.registry.shared_lease()
    assert kv is not None and lease is not None and kv.lease == lease.id
    assert kv.version == 1, "the node key was created once"
    folds = [b for p, b in m.calls if p == "/v3/kv/txn" and key in _keys(b)]
    # Taken: read, found, never sent again. Not taken: read, not found, and the registration's
    # own transaction (a compare on the key's absence) created it.
    assert len(folds) == (1 if taken else 2), folds
    paths = [p for p, _ in m.calls]
    at = paths.index("/v3/kv/txn")
    assert paths[at + 1] == "/v3/kv/range", f"the lost answer was settled by a read: {paths}"


def test_a_lease_lost_before_the_first_join_registers_the_old_way(
    machines: Callable[[str, int], Machine],
) -> None:
    # An overloaded host's lease lapsed before its first join: the fold is refused (no lease),
    # the registry registers again on a new lease (its own transaction: it must not wait for a
    # join), and the handler joins with that lease.
    m = machines("n", 1)
    m.start()
    first = m.registry.shared_lease()
    assert first is not None and m.reader.revoke_lease(first)
    info = _done(m, m.join())
    assert info.rank == 0
    kv = m.reader.get_kv(m.registry.key)
    lease = m.registry.shared_lease()
    assert kv is not None and lease is not None and lease.id != first.id and kv.lease == lease.id
    join = m.reader.get_kv(m.handler._rp(0) + "a/" + m.handler._qnode)
    assert join is not None and join.lease == lease.id
