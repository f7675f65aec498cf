"""A launcher's ``waiting`` between two rounds is written to etcd only if it lasts (issue 31).

``NodeRegistry.update(publish_after=...)`` changes the record at once (this machine's own view)
and writes it only if no other update came within that time: a restart whose next round forms
sooner writes only its new rank, not a write (and a message to each of the node's watchers) for
a state nobody acts on. On a real etcd; each test waits on the deferral thread's own progress
(a marker queued after the deferred write), never on a duration.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta

import pytest

from flashckpt.elastic.etcd.client import EtcdClient
from flashckpt.elastic.membership import leasing
from flashckpt.elastic.membership.nodes import NodeRecord, NodeRegistry

pytestmark = pytest.mark.etcd

TTL = timedelta(seconds=5)


@contextlib.contextmanager
def _started(
    etcd_server: str, etcd_prefix: str, node: str, ttl: timedelta, group_rank: int
) -> Iterator[tuple[NodeRegistry, EtcdClient]]:
    """A started registry of one node (state ``active``) and a second client to read etcd."""
    client = EtcdClient(etcd_server, timeout=timedelta(seconds=10))
    reader = EtcdClient(etcd_server, timeout=timedelta(seconds=10))
    reg = NodeRegistry(
        client,
        etcd_prefix + uuid.uuid4().hex[:6] + "/",
        node,
        ttl=ttl,
        advertise_host="127.0.0.1",
        bind_host="127.0.0.1",
        links=0,
    )
    try:
        reg.start(timedelta(seconds=10), watch=False, state="active", group_rank=group_rank)
        yield reg, reader
    finally:
        reg.close()
        client.close()
        reader.close()


@pytest.fixture
def registry(etcd_server: str, etcd_prefix: str) -> Iterator[tuple[NodeRegistry, EtcdClient]]:
    with _started(etcd_server, etcd_prefix, "n0", TTL, 3) as started:
        yield started


def _stored(reg: NodeRegistry, reader: EtcdClient) -> tuple[NodeRecord, int]:
    kv = reader.get_kv(reg.key)
    assert kv is not None
    record = NodeRecord.from_kv(kv)
    assert record is not None
    return record, kv.version


def _deferred_writes_done(after: timedelta) -> None:
    """Waits until the deferral thread has run everything due up to ``after`` from now (a
    marker queued behind it runs after it, on the same thread)."""
    done = threading.Event()
    leasing._LATER.call_at(time.monotonic() + after.total_seconds(), done.set)
    assert done.wait(60), "the deferral thread never ran the marker"


def test_a_waiting_that_lasts_is_written(registry: tuple[NodeRegistry, EtcdClient]) -> None:
    reg, reader = registry
    before, version = _stored(reg, reader)
    assert (before.state, before.group_rank) == ("active", 3)
    reg.update(state="waiting", group_rank=None, publish_after=timedelta(seconds=0.2))
    # This machine's own view says it at once.
    assert (reg.record.state, reg.record.group_rank) == ("waiting", None)
    _deferred_writes_done(timedelta(seconds=0.2))
    after, version_after = _stored(reg, reader)
    assert (after.state, after.group_rank) == ("waiting", None)
    assert version_after == version + 1


def test_a_waiting_replaced_in_time_is_never_written(
    registry: tuple[NodeRegistry, EtcdClient],
) -> None:
    reg, reader = registry
    _, version = _stored(reg, reader)
    reg.update(state="waiting", group_rank=None, publish_after=timedelta(seconds=0.3))
    reg.update(state="active", group_rank=7)  # the next round formed: its rank, one write
    after, version_after = _stored(reg, reader)
    assert (after.state, after.group_rank) == ("active", 7)
    assert version_after == version + 1
    _deferred_writes_done(timedelta(seconds=0.3))  # the deferred write's time has passed
    after, version_after = _stored(reg, reader)
    assert (after.state, after.group_rank) == ("active", 7)
    assert version_after == version + 1, "the replaced waiting was written after all"


def test_a_later_deferral_restarts_the_wait(registry: tuple[NodeRegistry, EtcdClient]) -> None:
    """Each update cancels the deferred write before it: a second restart's ``waiting`` waits
    its own time (the first one's deferral, due earlier, writes nothing)."""
    reg, reader = registry
    _, version = _stored(reg, reader)
    reg.update(state="waiting", group_rank=None, publish_after=timedelta(seconds=0.3))
    reg.update(state="waiting", group_rank=None, publish_after=timedelta(seconds=600))
    _deferred_writes_done(timedelta(seconds=0.3))
    after, version_after = _stored(reg, reader)
    assert (after.state, after.group_rank, version_after) == ("active", 3, version)


def test_a_rank_back_to_the_written_one_writes_nothing(
    registry: tuple[NodeRegistry, EtcdClient],
) -> None:
    """The round gave this machine the rank etcd already holds: nothing to write at all."""
    reg, reader = registry
    _, version = _stored(reg, reader)
    reg.update(state="waiting", group_rank=None, publish_after=timedelta(seconds=0.3))
    reg.update(state="active", group_rank=3)
    _deferred_writes_done(timedelta(seconds=0.3))
    after, version_after = _stored(reg, reader)
    assert (after.state, after.group_rank, version_after) == ("active", 3, version)


def test_no_deferred_write_after_close(etcd_server: str, etcd_prefix: str) -> None:
    """A registry closed (without revoking: its key stays until its lease lapses, 60 s here)
    before the deferred write is due writes nothing more."""
    with _started(etcd_server, etcd_prefix, "n1", timedelta(seconds=60), 0) as (reg, reader):
        kv = reader.get_kv(reg.key)
        assert kv is not None
        try:
            reg.update(state="waiting", group_rank=None, publish_after=timedelta(seconds=0.3))
            reg.close(revoke=False)
            _deferred_writes_done(timedelta(seconds=0.3))
            after, version_after = _stored(reg, reader)
            assert (after.state, version_after) == ("active", kv.version)
        finally:
            reader.revoke_lease(kv.lease)
