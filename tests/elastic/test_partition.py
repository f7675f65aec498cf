"""A machine cut off from the job (a network partition) fences itself (issue 11).

Fast tests: the fence deadline arithmetic, and :class:`NodeRegistry`'s renew loop against a real
etcd whose renewals a wrapper cuts (fenced only when no peer answers either; registered again
with a fresh token, lease and generation). The end-to-end test runs ``flashckpt run`` on
machines in their own namespaces (``_nscluster.py``) and takes one machine's link down.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest

from elastic.etcd import EtcdClient, EtcdUnavailable
from elastic.membership import (
    FenceNotice,
    NodeRegistry,
    fence_deadline,
    lease_expiry,
)

TTL = timedelta(seconds=2)


def test_the_fence_comes_a_fifth_of_the_ttl_before_the_lease_can_lapse() -> None:
    assert fence_deadline(100.0, 5.0) == pytest.approx(104.0)
    assert lease_expiry(100.0, 5.0) == pytest.approx(105.0)
    assert fence_deadline(0.0, 2.0) == pytest.approx(1.6)
    for ttl in (2.0, 5.0, 30.0):
        margin = lease_expiry(7.0, ttl) - fence_deadline(7.0, ttl)
        assert margin == pytest.approx(ttl / 5), "the workers get ttl/5 to stop"


class _Cuttable:
    """An etcd client that cannot reach etcd while :attr:`cut` is set."""

    def __init__(self, client: EtcdClient) -> None:
        self._client = client
        self.cut = threading.Event()

    def __getattr__(self, name: str) -> Any:
        real = getattr(self._client, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            if self.cut.is_set():
                time.sleep(0.05)
                raise EtcdUnavailable("cut off (test)")
            return real(*args, **kwargs)

        return call


@pytest.fixture
def make_registry(
    etcd_client: EtcdClient, etcd_prefix: str
) -> Iterator[Callable[..., tuple[NodeRegistry, _Cuttable]]]:
    made: list[NodeRegistry] = []

    def make(node: str, **kwargs: Any) -> tuple[NodeRegistry, _Cuttable]:
        client = _Cuttable(etcd_client)
        reg = NodeRegistry(
            client,  # type: ignore[arg-type]
            etcd_prefix,
            node,
            ttl=TTL,
            advertise_host="127.0.0.1",
            bind_host="127.0.0.1",
            **kwargs,
        )
        reg.start(timedelta(seconds=10))
        made.append(reg)
        return reg, client

    yield make
    for reg in made:
        reg.close()


def _wait_for(what: str, cond: Callable[[], Any], timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.etcd
def test_a_machine_that_reaches_neither_etcd_nor_a_peer_is_fenced(
    make_registry: Callable[..., tuple[NodeRegistry, _Cuttable]], etcd_client: EtcdClient
) -> None:
    notices: list[tuple[FenceNotice, float]] = []
    reg, client = make_registry("a", on_fenced=lambda n: notices.append((n, time.monotonic())))
    peer, _ = make_registry("b")
    _wait_for("the peer to be seen", lambda: "b" in reg.peers())
    old_token, old_lease = reg.record.token, etcd_client.get_kv(reg.key)
    assert old_lease is not None
    client.cut.set()
    cut_at = time.monotonic()
    # Cut off from the others too: the peer's probe port no longer answers (its key stays: the
    # watch cannot see anything either).
    peer.close(revoke=False)
    notice, called_at = _wait_for("the fence", lambda: notices and notices[0])
    assert reg.fenced and notice.generation == 1
    assert notice.expiry == pytest.approx(notice.last_ok + TTL.total_seconds())
    assert notice.last_ok <= cut_at, "the last renewal that succeeded was before the cut"
    assert called_at >= fence_deadline(notice.last_ok, TTL.total_seconds())
    assert "no other machine of the job answers" in notice.reason
    # Nothing is written under the fenced registration any more.
    assert reg.publish(reg.key + "-summary", b"x") is False
    time.sleep(TTL.total_seconds() / 5 * 2)
    assert len(notices) == 1, "fenced more than once"
    # The link comes back: registered afresh, never under the stale token or lease.
    client.cut.clear()
    assert reg.rejoin(timedelta(seconds=10)) == 2
    assert not reg.fenced and reg.generation == 2
    kv = etcd_client.get_kv(reg.key)
    assert kv is not None and kv.lease != old_lease.lease
    record = json.loads(kv.value)
    assert record["token"] != old_token and record["state"] == "waiting"
    # ... and renewed from then on: the key outlives several TTLs.
    time.sleep(TTL.total_seconds() * 1.5)
    assert etcd_client.get_kv(reg.key) is not None and not reg.fenced


@pytest.mark.etcd
def test_etcd_unreachable_while_a_peer_answers_is_no_fence(
    make_registry: Callable[..., tuple[NodeRegistry, _Cuttable]],
) -> None:
    notices: list[FenceNotice] = []
    reg, client = make_registry("a", on_fenced=notices.append)
    make_registry("b")  # its probe port answers with its token
    _wait_for("the peer to be seen", lambda: "b" in reg.peers())
    client.cut.set()
    time.sleep(TTL.total_seconds() * 1.5)
    assert notices == [] and not reg.fenced, "an etcd outage every machine sees fenced it"
    client.cut.clear()


@pytest.mark.etcd
def test_a_machine_without_peers_is_not_fenced(
    make_registry: Callable[..., tuple[NodeRegistry, _Cuttable]],
) -> None:
    notices: list[FenceNotice] = []
    reg, client = make_registry("solo", on_fenced=notices.append)
    client.cut.set()
    time.sleep(TTL.total_seconds() * 1.5)
    assert notices == [] and not reg.fenced, "nobody could take its place"
    client.cut.clear()
