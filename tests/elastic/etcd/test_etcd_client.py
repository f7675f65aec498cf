"""EtcdClient against a real etcd: key-value, compare-and-set, leases, watches, failures.

The key-value tests run on both transports of the key-value calls (``transport``): the JSON
gateway (the default, ``grpc_kv=False``) and gRPC (``grpc_kv=True``, off by default); the
connection-pool tests are the gateway's.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
from tcprelay import TcpRelay
from waiting import wait_until

from flashckpt.elastic.etcd import _gateway as gateway_module
from flashckpt.elastic.etcd import watchstream as watch_module
from flashckpt.elastic.etcd.client import (
    EtcdClient,
    EtcdError,
    EtcdLeaseNotFound,
    EtcdOutcomeUnknown,
    EtcdTimeout,
    EtcdUnavailable,
    WatchClosed,
    WatchCompacted,
    WatchStream,
    parse_endpoints,
    prefix_end,
)
from flashckpt.elastic.etcd.server import EtcdV3Server

SHORT = timedelta(seconds=1)


@pytest.fixture(params=["grpc", "gateway"])
def transport(request: pytest.FixtureRequest) -> str:
    """The transport of the key-value calls under test."""
    return str(request.param)


@pytest.fixture
def etcd_client(etcd_server: str, transport: str) -> Iterator[EtcdClient]:
    """A client of the shared server on ``transport``; calls fail after 5 s."""
    client = EtcdClient(etcd_server, timeout=timedelta(seconds=5), grpc_kv=transport == "grpc")
    try:
        yield client
    finally:
        client.close()


# --------------------------------------------------------------------------- without a server


def test_parse_endpoints_accepts_common_forms() -> None:
    assert parse_endpoints("h1:1,h2") == ["http://h1:1", "http://h2:2379"]
    assert parse_endpoints(["https://e:3", " 127.0.0.1:4 "]) == [
        "https://e:3",
        "http://127.0.0.1:4",
    ]
    assert parse_endpoints("[::1]:5") == ["http://[::1]:5"]


@pytest.mark.parametrize("bad", ["", " , ", "ftp://h:1", "h:notaport", "http://h:1/v3"])
def test_parse_endpoints_rejects_bad_input_with_a_fix(bad: str) -> None:
    with pytest.raises(ValueError, match="endpoint"):
        parse_endpoints(bad)


def test_unreachable_endpoint_raises_unavailable_within_the_timeout(
    dead_endpoint: str, transport: str
) -> None:
    client = EtcdClient(dead_endpoint, timeout=SHORT, grpc_kv=transport == "grpc")
    start = time.monotonic()
    with pytest.raises(EtcdUnavailable, match="did not complete") as info:
        client.get("k")
    elapsed = time.monotonic() - start
    assert not isinstance(info.value, EtcdTimeout)
    assert 0.9 <= elapsed < 1.8, elapsed
    # A transaction that never reached etcd is safe to retry, so it also ends as unavailable.
    with pytest.raises(EtcdUnavailable) as info:
        client.compare_and_set("k", b"v", mod_revision=0)
    assert not isinstance(info.value, EtcdOutcomeUnknown)


@pytest.fixture
def silent_endpoint() -> Iterator[str]:
    """A port that accepts TCP connections but never answers, like a hung etcd."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_server_that_never_answers_raises_timeout(silent_endpoint: str, transport: str) -> None:
    client = EtcdClient(
        silent_endpoint, timeout=timedelta(seconds=0.5), grpc_kv=transport == "grpc"
    )
    start = time.monotonic()
    with pytest.raises(EtcdTimeout):
        client.get("k")
    assert time.monotonic() - start < 1.5
    if transport == "gateway":
        # An unanswered transaction may have been applied: it is never blindly repeated.
        with pytest.raises(EtcdOutcomeUnknown, match="re-read"):
            client.compare_and_set("k", b"v", mod_revision=0)
    else:
        # Over gRPC nothing is sent before the server's HTTP/2 SETTINGS came: etcd cannot
        # have applied the transaction, so it is retried to the deadline like a read.
        with pytest.raises(EtcdTimeout) as info:
            client.compare_and_set("k", b"v", mod_revision=0)
        assert not isinstance(info.value, EtcdOutcomeUnknown)


def test_bad_arguments_are_rejected() -> None:
    with pytest.raises(ValueError, match="timeout"):
        EtcdClient("h:1", timeout=timedelta(0))
    client = EtcdClient("h:1", timeout=SHORT)
    with pytest.raises(ValueError, match="empty prefix"):
        client.delete_prefix("")
    with pytest.raises(ValueError, match="at least 1 second"):
        client.grant_lease(timedelta(milliseconds=10))


# --------------------------------------------------------------------------- key-value


@pytest.mark.etcd
def test_get_put_delete(etcd_client: EtcdClient, etcd_prefix: str) -> None:
    key = etcd_prefix + "k"
    assert etcd_client.get(key) is None
    rev1 = etcd_client.put(key, b"one")
    assert etcd_client.get(key) == (b"one", rev1)
    rev2 = etcd_client.put(key, "two")
    assert rev2 > rev1
    assert etcd_client.get(key) == (b"two", rev2)
    etcd_client.put(key, b"")
    assert etcd_client.get(key) == (b"", rev2 + 1)
    assert etcd_client.delete(key) is True
    assert etcd_client.delete(key) is False
    assert etcd_client.get(key) is None


@pytest.mark.etcd
def test_binary_keys_and_prefix_ranges(etcd_client: EtcdClient, etcd_prefix: str) -> None:
    base = etcd_prefix.encode() + b"\xff"
    keys = [base + b"\xff", base + b"\x00\x01", base + b"a", base]
    for i, key in enumerate(keys):
        etcd_client.put(key, bytes([i, 0xFF]))
    etcd_client.put(etcd_prefix + "other", b"x")
    found = etcd_client.get_prefix(base)
    assert [kv.key for kv in found] == sorted(keys)
    assert {kv.key: kv.value for kv in found} == {k: bytes([i, 0xFF]) for i, k in enumerate(keys)}
    assert etcd_client.count_prefix(base) == len(keys)
    assert etcd_client.count_prefix(etcd_prefix) == len(keys) + 1
    assert etcd_client.delete_prefix(base) == len(keys)
    assert etcd_client.get_prefix(base) == []
    assert etcd_client.get(etcd_prefix + "other") is not None


@pytest.mark.etcd
def test_get_many_reads_one_snapshot(etcd_client: EtcdClient, etcd_prefix: str) -> None:
    rev = etcd_client.put(etcd_prefix + "a", b"1")
    entries, revision = etcd_client.get_many([etcd_prefix + "a", etcd_prefix + "b"])
    assert entries[1] is None
    assert entries[0] is not None and entries[0].value == b"1"
    assert revision >= rev
    assert etcd_client.revision() >= revision


# --------------------------------------------------------------------------- compare-and-set


@pytest.mark.etcd
def test_compare_and_set_semantics(etcd_client: EtcdClient, etcd_prefix: str) -> None:
    key = etcd_prefix + "cas"
    ok, kv = etcd_client.compare_and_set(key, b"v1", mod_revision=0)
    assert ok and kv is not None and kv.value == b"v1"
    assert kv.create_revision == kv.mod_revision and kv.version == 1
    # Create-if-absent loses once the key exists and returns the current entry.
    ok2, current = etcd_client.compare_and_set(key, b"other", mod_revision=0)
    assert not ok2 and current == kv
    # Right revision wins; the entry returned is the new one.
    ok3, kv3 = etcd_client.compare_and_set(key, b"v2", mod_revision=kv.mod_revision)
    assert ok3 and kv3 is not None and kv3.value == b"v2" and kv3.mod_revision > kv.mod_revision
    # A stale revision loses and returns what is stored now.
    ok4, current4 = etcd_client.compare_and_set(key, b"v3", mod_revision=kv.mod_revision)
    assert not ok4 and current4 == kv3
    # Updating a key that was deleted fails and reports it absent.
    etcd_client.delete(key)
    assert etcd_client.compare_and_set(key, b"v4", mod_revision=kv3.mod_revision) == (False, None)
    assert not etcd_client.compare_and_delete(key, mod_revision=kv3.mod_revision)


@pytest.mark.etcd
def test_concurrent_compare_and_set_counts_exactly(
    etcd_client: EtcdClient, etcd_prefix: str
) -> None:
    key = etcd_prefix + "counter"
    threads, increments = 4, 15

    def work() -> None:
        for _ in range(increments):
            while True:
                kv = etcd_client.get_kv(key)
                value, rev = (0, 0) if kv is None else (int(kv.value), kv.mod_revision)
                if etcd_client.compare_and_set(key, str(value + 1), mod_revision=rev)[0]:
                    break

    workers = [threading.Thread(target=work) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=60)
    assert etcd_client.get(key) is not None
    assert int(etcd_client.get(key)[0]) == threads * increments  # type: ignore[index]


# --------------------------------------------------------------------------- watches


@pytest.mark.etcd
def test_wait_for_change_wakes_on_write_and_times_out(
    etcd_client: EtcdClient, etcd_prefix: str
) -> None:
    key = etcd_prefix + "w"
    revision = etcd_client.revision()
    start = time.monotonic()
    assert not etcd_client.wait_for_change(key, after_revision=revision, timeout=SHORT / 4)
    assert 0.2 <= time.monotonic() - start < 1.0

    timer = threading.Timer(0.2, etcd_client.put, args=(key + "/child", b"x"))
    timer.start()
    start = time.monotonic()
    try:
        assert etcd_client.wait_for_change(
            key, prefix=True, after_revision=revision, timeout=timedelta(seconds=5)
        )
    finally:
        timer.join()
    assert time.monotonic() - start < 2.0
    # A change that happened before the call still counts: the watch starts at the revision.
    assert etcd_client.wait_for_change(key, prefix=True, after_revision=revision, timeout=SHORT)


# --------------------------------------------------------------------------- leases


@pytest.mark.etcd
def test_key_disappears_when_its_lease_expires(etcd_client: EtcdClient, etcd_prefix: str) -> None:
    key = etcd_prefix + "leased"
    lease = etcd_client.grant_lease(timedelta(seconds=1))
    assert lease.ttl >= timedelta(seconds=1)
    revision = etcd_client.put(key, b"alive", lease=lease)
    kv = etcd_client.get_kv(key)
    assert kv is not None and kv.lease == lease.id
    start = time.monotonic()
    assert etcd_client.wait_for_change(key, after_revision=revision, timeout=timedelta(seconds=5))
    assert etcd_client.get(key) is None
    assert time.monotonic() - start < 4.0
    with pytest.raises(EtcdLeaseNotFound, match="expired or was revoked"):
        etcd_client.refresh_lease(lease)
    with pytest.raises(EtcdLeaseNotFound):
        etcd_client.put(key, b"again", lease=lease)
    assert etcd_client.revoke_lease(lease) is False


@pytest.mark.etcd
def test_keep_alive_holds_key_and_revoke_deletes_it(
    etcd_client: EtcdClient, etcd_prefix: str
) -> None:
    key = etcd_prefix + "held"
    lease = etcd_client.grant_lease(timedelta(seconds=2))
    etcd_client.put(key, b"x", lease=lease)
    with etcd_client.keep_alive(lease) as keeper:
        time.sleep(3.0)  # past the TTL: without refreshes the key would be gone
        assert etcd_client.get(key) is not None
        assert etcd_client.refresh_lease(lease) >= timedelta(seconds=1)
        assert etcd_client.revoke_lease(lease) is True
        assert etcd_client.get(key) is None
        # The keeper notices the lease is gone at its next refresh and stops.
        assert keeper.wait_lost(timedelta(seconds=3))
        assert isinstance(keeper.last_error, EtcdLeaseNotFound)


@pytest.mark.etcd
def test_server_errors_are_etcd_errors(etcd_client: EtcdClient) -> None:
    with pytest.raises(EtcdError):
        etcd_client.refresh_lease(12345)
    with pytest.raises(EtcdLeaseNotFound):
        etcd_client.put("/test/bad-lease", b"x", lease=12345)


# --------------------------------------------------------------------------- failover, restarts


@pytest.mark.etcd
def test_fails_over_to_a_live_endpoint(
    etcd_server: str, dead_endpoint: str, transport: str
) -> None:
    for endpoints in ([dead_endpoint, etcd_server], [etcd_server, dead_endpoint]):
        client = EtcdClient(endpoints, timeout=timedelta(seconds=5), grpc_kv=transport == "grpc")
        client.put("/test/failover", b"ok")
        assert client.get("/test/failover") is not None


@pytest.mark.etcd
def test_calls_ride_out_an_etcd_restart(etcd_instance: EtcdV3Server) -> None:
    client = EtcdClient(etcd_instance.client_url, timeout=timedelta(seconds=10), grpc_kv=False)
    revision = client.put("k", b"before")
    etcd_instance.kill()
    _await_pooled_closed(client)
    results: list[tuple[bytes, int] | None] = []
    reader = threading.Thread(target=lambda: results.append(client.get("k")))
    reader.start()  # retries against the dead server until it is back
    time.sleep(0.3)
    etcd_instance.start()
    reader.join(timeout=15)
    assert results == [(b"before", revision)]
    # The pooled connection of the put died with etcd: found closed, replaced, no error.
    assert client.connection_stats().replaced >= 1
    ok, _ = client.compare_and_set("k", b"after", mod_revision=revision)
    assert ok, "revisions survive a restart, so tokens read before it stay valid"
    assert client.connection_stats().reused >= 1


@pytest.mark.etcd
def test_keep_alive_survives_an_etcd_outage(etcd_instance: EtcdV3Server) -> None:
    client = EtcdClient(etcd_instance.client_url, timeout=timedelta(seconds=5))
    lease = client.grant_lease(timedelta(seconds=5))
    client.put("held", b"x", lease=lease)
    with client.keep_alive(lease, interval=timedelta(seconds=0.3)) as keeper:
        etcd_instance.kill()
        time.sleep(0.8)  # a few refreshes fail meanwhile
        assert isinstance(keeper.last_error, EtcdUnavailable)
        etcd_instance.start()
        assert not keeper.lost
        client.revoke_lease(lease)
        # The keeper kept running through the outage: it sees the revocation at once.
        assert keeper.wait_lost(timedelta(seconds=3))
    assert client.get("held") is None


# --------------------------------------------------------------------------- connection pool


@pytest.fixture
def relay(etcd_server: str) -> Iterator[TcpRelay]:
    proxy = TcpRelay(etcd_server)
    try:
        yield proxy
    finally:
        proxy.close()


_PEER_CLOSED = gateway_module._peer_closed  # the real poll, even where a test blinds it


def _await_pooled_closed(client: EtcdClient) -> None:
    """Waits until the client's kernel has seen the peer close every pooled connection (its
    FIN or RST arrived): on a loaded machine that can come after the closer's ``close``
    returned, and a request sent before it would go out on the dead connection."""
    pool = client.transport._pool_here()
    with pool.lock:
        conns = [conn for per in pool.idle.values() for conn, _ in per]
    assert conns, "no pooled connection to watch"
    wait_until(
        lambda: all(_PEER_CLOSED(conn) for conn in conns),
        "the client to see its pooled connection closed",
        30,
    )


def _open_fds() -> set[str]:
    """What this process's descriptors point to (``socket:[inode]`` for a socket)."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            found.add(os.readlink(f"/proc/self/fd/{fd}"))
    return found


@pytest.mark.etcd
def test_requests_share_one_kept_alive_connection(relay: TcpRelay, etcd_prefix: str) -> None:
    client = EtcdClient(relay.url, timeout=timedelta(seconds=5), grpc_kv=False)
    key = etcd_prefix + "k"
    lease = client.grant_lease(timedelta(seconds=5))
    rev = client.put(key, b"0", lease=lease)
    for i in range(10):
        ok, kv = client.compare_and_set(key, str(i + 1), mod_revision=rev, lease=lease)
        assert ok and kv is not None
        rev = kv.mod_revision
        assert client.get(key) == (str(i + 1).encode(), rev)
        client.refresh_lease(lease)
    # Every request after the first went on the same connection; the keep-alives went on the
    # lease keep-alive stream, a connection of its own.
    stats = client.connection_stats()
    assert relay.accepted == 2 and stats.keepalive_streams == 1
    assert (stats.opened, stats.reused, stats.idle) == (1, 21, 1)
    # A watch has a connection of its own and leaves the pooled one alone.
    assert client.wait_for_change(key, after_revision=rev - 1, timeout=SHORT)
    assert relay.accepted == 3 and client.connection_stats().idle == 1
    client.close()
    assert client.connection_stats().idle == 0


@pytest.mark.etcd
def test_idle_connection_past_the_idle_timeout_is_not_reused(
    relay: TcpRelay, etcd_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = EtcdClient(relay.url, timeout=timedelta(seconds=5), grpc_kv=False)
    client.put(etcd_prefix + "k", b"x")
    monkeypatch.setattr(gateway_module, "_IDLE_TIMEOUT_S", 0.0)
    client.put(etcd_prefix + "k", b"y")
    stats = client.connection_stats()
    assert (stats.opened, stats.reused, stats.expired) == (2, 0, 1)
    assert relay.accepted == 2
    client.close()


@pytest.mark.etcd
def test_connection_closed_by_the_server_is_replaced(
    relay: TcpRelay, etcd_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = EtcdClient(relay.url, timeout=timedelta(seconds=5), grpc_kv=False)
    key = etcd_prefix + "cas"
    ok, kv = client.compare_and_set(key, b"1", mod_revision=0)
    assert ok and kv is not None
    # Closed with a FIN while idle: the poll before reuse sees it; the transaction (not
    # idempotent) goes out once, on a new connection, with no error.
    relay.drop_all()
    _await_pooled_closed(client)
    ok, kv = client.compare_and_set(key, b"2", mod_revision=kv.mod_revision)
    assert ok and kv is not None and kv.value == b"2"
    assert client.connection_stats().replaced == 1 and relay.accepted == 2

    # The peer closed it between the poll and the send (poll made blind here): an RST makes
    # the send fail, so etcd never had the request and it is sent again on a new connection.
    monkeypatch.setattr(gateway_module, "_peer_closed", lambda conn: False)
    relay.drop_all(reset=True)
    _await_pooled_closed(client)  # the RST arrived, so the send fails
    ok, kv = client.compare_and_set(key, b"3", mod_revision=kv.mod_revision)
    assert ok and kv is not None and kv.value == b"3"
    assert client.connection_stats().replaced == 2 and relay.accepted == 3

    # Closed after etcd took the request on a reused connection, the answer lost: the
    # transaction was applied, so it is not sent again; the caller is told to re-read.
    relay.lose_answers = True
    with pytest.raises(EtcdOutcomeUnknown, match="re-read"):
        client.compare_and_set(key, b"4", mod_revision=kv.mod_revision)
    relay.lose_answers = False
    current = client.get_kv(key)
    assert current is not None and current.value == b"4"
    assert current.version == kv.version + 1, "applied exactly once"
    client.close()


@pytest.mark.etcd
def test_many_threads_share_the_pool_and_close_leaks_nothing(etcd_server: str) -> None:
    before = _open_fds()
    client = EtcdClient(etcd_server, timeout=timedelta(seconds=20), grpc_kv=False)
    threads, rounds = 24, 8
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            key = f"/test/pool-threads/{i}"
            for r in range(rounds):
                client.put(key, f"{i}-{r}")
                # A mixed-up answer (another thread's response on a shared socket) shows here.
                assert client.get(key) == (f"{i}-{r}".encode(), client.get_kv(key).mod_revision)  # type: ignore[union-attr]
        except BaseException as exc:
            errors.append(exc)

    workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
    assert not errors, errors
    stats = client.connection_stats()
    requests = threads * rounds * 3
    assert stats.opened + stats.reused == requests and stats.reused > 0, stats
    assert stats.idle <= gateway_module._MAX_IDLE_PER_ENDPOINT
    assert client.delete_prefix("/test/pool-threads/") == threads
    client.close()
    assert _open_fds() <= before, "close() left connections open"


@pytest.mark.etcd
def test_a_forked_child_does_not_share_the_pool(etcd_server: str, etcd_prefix: str) -> None:
    client = EtcdClient(etcd_server, timeout=timedelta(seconds=5), grpc_kv=False)
    client.put(etcd_prefix + "k", b"parent")
    assert client.connection_stats().idle == 1
    pid = os.fork()
    if pid == 0:  # the child: its own empty pool, the parent's socket left alone
        code = 1
        try:
            fresh = client.connection_stats()
            client.put(etcd_prefix + "k", b"child")
            if (fresh.opened, fresh.idle) == (0, 0) and client.connection_stats().opened == 1:
                code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    # The parent's pooled connection still works and carries the parent's next request.
    assert client.get(etcd_prefix + "k") is not None
    stats = client.connection_stats()
    assert (stats.opened, stats.reused, stats.replaced) == (1, 1, 0)
    client.close()


# --------------------------------------------------------------------------- watch streams


@pytest.mark.etcd
def test_a_watch_stays_on_one_connection_through_quiet_timeouts(
    relay: TcpRelay, etcd_prefix: str
) -> None:
    client = EtcdClient(relay.url, timeout=timedelta(seconds=5))
    key = (etcd_prefix + "w").encode()
    start = client.revision()
    stream = WatchStream(client, key, None, start + 1)
    try:
        for _ in range(3):
            assert stream.next_events(timedelta(seconds=0.1)) == []
        rev = client.put(key, b"1")
        events = stream.next_events(timedelta(seconds=10))
        assert [(e.kv.value, e.kv.mod_revision) for e in events] == [(b"1", rev)]
        assert stream.next_revision == rev + 1
        assert stream.connections == 1
        # watch_events goes on with the stream it opened, from one call to the next.
        revision = start
        seen: list[tuple[bytes, bytes | None]] = []
        for value in (b"2", b"3"):
            quiet = client.watch_events(
                etcd_prefix, after_revision=revision, timeout=timedelta(seconds=0.1), prefix=True
            )
            seen += [(e.kv.value, e.prev.value if e.prev else None) for e in quiet.events]
            revision = quiet.revision
            client.put(key, value)
            while len(seen) < {b"2": 1, b"3": 2}[value] + 1:
                batch = client.watch_events(
                    etcd_prefix, after_revision=revision, timeout=timedelta(seconds=10), prefix=True
                )
                seen += [(e.kv.value, e.prev.value if e.prev else None) for e in batch.events]
                revision = batch.revision
        assert seen == [(b"1", None), (b"2", b"1"), (b"3", b"2")]
        # One pooled connection for the requests, one per watch: nothing reconnected.
        assert relay.accepted == 3
    finally:
        stream.close()
        client.close()


@pytest.mark.etcd
def test_a_broken_watch_resumes_without_losing_or_repeating_events(
    relay: TcpRelay, etcd_client: EtcdClient, etcd_prefix: str
) -> None:
    key = (etcd_prefix + "r").encode()
    client = EtcdClient(relay.url, timeout=timedelta(seconds=5))
    stream = WatchStream(client, key, prefix_end(key), etcd_client.revision() + 1)
    try:
        etcd_client.put(key + b"/1", b"1")
        assert [e.kv.key for e in stream.next_events(timedelta(seconds=10))] == [key + b"/1"]
        relay.drop_all()  # the stream's connection breaks; these writes happen meanwhile
        etcd_client.put(key + b"/2", b"2")
        etcd_client.delete(key + b"/1")
        seen: list[tuple[bytes, bool]] = []
        while len(seen) < 2:
            seen += [(e.kv.key, e.deleted) for e in stream.next_events(timedelta(seconds=10))]
        assert seen == [(key + b"/2", False), (key + b"/1", True)]
        assert stream.connections == 2
        # close() from another thread wakes a blocked reader, and frees its socket.
        sock = stream._sock
        assert sock is not None
        threading.Timer(0.2, stream.close).start()
        with pytest.raises(WatchClosed):
            stream.next_events(timedelta(seconds=30))
        assert stream._sock is None and sock.fileno() == -1
        # Compacted history: the stream says so; watch_events reports it in the batch.
        now = etcd_client.put(key + b"/3", b"3")
        etcd_client.compact(now)
        with pytest.raises(WatchCompacted) as info:
            WatchStream(client, key, prefix_end(key), now - 1).next_events(timedelta(seconds=10))
        assert info.value.compact_revision == now
        assert (
            client.watch_events(
                key, after_revision=now - 2, timeout=timedelta(seconds=10), prefix=True
            ).compacted
            == now
        )
    finally:
        stream.close()
        client.close()


def test_a_watch_request_not_answered_yet_is_waited_on_then_given_up(
    silent_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An overloaded etcd answers a watch late: the request stays pending across calls instead
    # of being sent again on a new connection (each would cost etcd a new watch and a replay).
    client = EtcdClient(silent_endpoint, timeout=SHORT)
    stream = WatchStream(client, b"k", None, 1)
    try:
        for _ in range(3):
            assert stream.next_events(timedelta(seconds=0.1)) == []
        assert stream.connections == 1
        # Past the patience, the endpoint counts as failed: new requests, then unavailable.
        monkeypatch.setattr(watch_module, "_WATCH_OPEN_PATIENCE_S", 0.0)
        with pytest.raises(EtcdUnavailable, match="no answer to the watch request"):
            stream.next_events(timedelta(seconds=0.3))
        assert stream.connections >= 2
    finally:
        stream.close()


def test_the_watch_reader_reassembles_lines_split_anywhere_across_chunks() -> None:
    messages = [
        json.dumps({"result": {"n": i, "pad": "x" * (i * 7)}}).encode() + b"\n" for i in range(6)
    ]
    body = b"".join(messages)
    # Chunks of uneven sizes, not aligned with the lines, one with an extension.
    chunked = b""
    for i, cut in enumerate(range(0, len(body), 37)):
        piece = body[cut : cut + 37]
        ext = b";x=1" if i == 1 else b""
        chunked += f"{len(piece):x}".encode() + ext + b"\r\n" + piece + b"\r\n"
    for step in (1, 2, 3, 5, 64, len(chunked)):
        stream = WatchStream(EtcdClient("h:1", timeout=SHORT), b"k", None, 1)
        lines = []
        for at in range(0, len(chunked), step):
            stream._raw += chunked[at : at + step]
            while (line := stream._next_line()) is not None:
                lines.append(line)
        assert lines == messages, step
        stream._raw += b"0\r\n\r\n"
        with pytest.raises(ConnectionError, match="ended"):
            stream._next_line()


def test_whole_one_line_chunks_and_every_other_framing_give_the_same_lines() -> None:
    """etcd sends each message as a chunk of its own, which the reader takes as a line without
    copying it through its buffer; chunks of two lines, a line split over chunks, a chunk that
    ends inside a line and an empty line give the same lines as ever, fed whole or in pieces."""
    lines = [json.dumps({"result": {"n": i}}).encode() + b"\n" for i in range(5)] + [b"\n"]
    pieces = [
        lines[0],  # one line, one chunk (the fast path)
        lines[1] + lines[2],  # two lines in one chunk
        lines[3][:10],  # a line over two chunks
        lines[3][10:],
        lines[4],  # one line again
        lines[5],  # an empty line, alone
    ]
    chunked = b"".join(f"{len(p):x}".encode() + b"\r\n" + p + b"\r\n" for p in pieces)
    for step in (1, 7, 40, len(chunked)):
        stream = WatchStream(EtcdClient("h:1", timeout=SHORT), b"k", None, 1)
        got = []
        for at in range(0, len(chunked), step):
            stream._raw += chunked[at : at + step]
            while (line := stream._next_line()) is not None:
                got.append(line)
        assert got == lines, step
        assert not stream._raw and not stream._body
    stream._raw += b"-5\r\nabc\r\n"
    with pytest.raises(ValueError, match="a chunk of -5 bytes"):
        stream._next_line()


@pytest.mark.parametrize(
    "line",
    [
        b'{"result":{"events":[{"kv":{"key":"aw=="}}]}}\n',
        b'{"a": 1} \t\r\n',
        b'{"a": "\\ud800"}\n',  # a lone surrogate, as json.loads keeps it
        b'{"a": 1} x\n',  # extra data
        b'{"a": 1}{"b": 2}\n',
        b'{"a": \xff}\n',  # not UTF-8
        b'{"a": "\xed\xa0\x80"}\n',  # an encoded surrogate (surrogatepass)
        b'{"a": 1\n',  # truncated
        b"{}\n",
        b' {"a": 1}\n',  # leading whitespace: json.loads itself
        b"[1, 2]\n",
        b"\xef\xbb\xbf{}\n",  # a byte-order mark
        b"\n",
    ],
)
def test_a_watch_line_decodes_exactly_as_json_loads(line: bytes) -> None:
    try:
        expected: object = json.loads(line)
    except ValueError as exc:
        expected = type(exc)
    try:
        got: object = watch_module._json_line(line)
    except ValueError as exc:
        got = type(exc)
    assert got == expected


class _FakeWatchGateway:
    """A ``/v3/watch`` endpoint that answers the n-th watch request with the n-th list of
    ``answers`` (each item written as one HTTP chunk), then keeps the connection open: what a
    broken peer or a proxy could send, which a real etcd never does. ``requests`` holds each
    watch request received (its ``create_request``)."""

    def __init__(self, answers: list[list[bytes]]) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self.requests: list[dict[str, object]] = []
        self._answers = answers
        self._socks: list[socket.socket] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        for chunks in self._answers:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            self._socks.append(sock)
            with contextlib.suppress(OSError):
                data = b""
                while b"\r\n\r\n" not in data:
                    more = sock.recv(65536)
                    if not more:
                        raise ConnectionError("the client went")
                    data += more
                head, _, body = data.partition(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                while len(body) < length:
                    body += sock.recv(65536)
                self.requests.append(json.loads(body)["create_request"])
                sock.sendall(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    b"Transfer-Encoding: chunked\r\n\r\n"
                )
                for chunk in chunks:
                    sock.sendall(chunk)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for sock in self._socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        self._thread.join(timeout=10)
        assert not self._thread.is_alive()


def _chunk(line: bytes) -> bytes:
    return f"{len(line):x}\r\n".encode() + line + b"\r\n"


def _watch_message(result: object) -> bytes:
    return _chunk(json.dumps({"result": result}).encode() + b"\n")


_CREATED = _watch_message({"header": {"revision": "4"}, "created": True})


def _put_event(revision: int) -> dict[str, object]:
    return {
        "kv": {
            "key": "aw==",  # b"k"
            "create_revision": "5",
            "mod_revision": str(revision),
            "version": str(revision - 4),
            "value": "dg==",  # b"v"
        }
    }


def _kv(**fields: object) -> dict[str, object]:
    kv: dict[str, object] = {"key": "aw==", "mod_revision": "6"}
    kv.update(fields)
    return {k: v for k, v in kv.items() if v is not None}


@pytest.mark.parametrize(
    ("result", "problem"),
    [
        (5, "result: expected a JSON object"),
        ({"compact_revision": "x"}, "result.compact_revision: expected an integer"),
        ({"events": "x"}, "result.events: expected a JSON list"),
        ({"events": {"kv": {}}}, "result.events: expected a JSON list"),
        ({"events": [5]}, r"result.events\[0\]: expected a JSON object"),
        ({"events": [{"type": "DELETE"}]}, r"result.events\[0\].kv: missing"),
        ({"events": [{"kv": 5}]}, r"result.events\[0\].kv: expected a JSON object"),
        ({"events": [{"kv": _kv(mod_revision="x")}]}, r"\[0\].kv.mod_revision: expected an int"),
        ({"events": [{"kv": _kv(mod_revision=None)}]}, r"\[0\].kv.mod_revision: missing"),
        ({"events": [{"kv": _kv(mod_revision="-3")}]}, r"\[0\].kv.mod_revision: expected a rev"),
        ({"events": [{"kv": _kv(key=None)}]}, r"\[0\].kv.key: missing"),
        ({"events": [{"kv": _kv(key="a")}]}, r"\[0\].kv.key: expected base64"),
        ({"events": [{"kv": _kv(key="a!w==")}]}, r"\[0\].kv.key: expected base64"),
        ({"events": [{"kv": _kv(value=7)}]}, r"\[0\].kv.value: expected base64"),
        ({"events": [{"kv": _kv(version=[1])}]}, r"\[0\].kv.version: expected an integer"),
        ({"events": [{"kv": _kv(), "type": "BOGUS"}]}, r"\[0\].type: expected \"PUT\""),
        ({"events": [{"kv": _kv(), "prev_kv": "x"}]}, r"\[0\].prev_kv: expected a JSON object"),
        (
            {"events": [{"kv": _kv(), "prev_kv": _kv(mod_revision="y")}]},
            r"\[0\].prev_kv.mod_revision: expected an integer",
        ),
        # A good event, then a malformed one: nothing of the message is reported.
        ({"events": [_put_event(6), {"kv": 5}]}, r"result.events\[1\].kv: expected a JSON"),
    ],
)
def test_a_malformed_watch_message_fails_the_stream_which_resumes_from_the_last_good_event(
    result: object, problem: str
) -> None:
    """A watch message that is not what etcd sends (a wrong-typed or missing field, bad base64)
    is a stream failure that names the field, never a stray ValueError/KeyError nor an event
    skipped: the next call opens the stream again from the revision after the last event it
    returned, so nothing is lost or repeated."""
    gateway = _FakeWatchGateway(
        [
            [_CREATED, _watch_message({"events": [_put_event(5)]}), _watch_message(result)],
            [_CREATED, _watch_message({"events": [_put_event(6)]})],
        ]
    )
    client = EtcdClient(gateway.url, timeout=timedelta(seconds=5))
    stream = WatchStream(client, b"k", None, 5)
    try:
        got = stream.next_events(timedelta(seconds=5))
        assert [(e.kv.key, e.kv.value, e.kv.mod_revision) for e in got] == [(b"k", b"v", 5)]
        with pytest.raises(EtcdUnavailable, match=f"malformed watch message from .*{problem}"):
            stream.next_events(timedelta(seconds=5))
        assert stream._sock is None  # dropped
        got = stream.next_events(timedelta(seconds=5))
        assert [e.kv.mod_revision for e in got] == [6]
        assert [r["start_revision"] for r in gateway.requests] == ["5", "6"]
        assert stream.connections == 2
    finally:
        stream.close()
        client.close()
        gateway.close()


def test_a_watch_message_that_is_not_a_json_object_fails_the_stream() -> None:
    gateway = _FakeWatchGateway([[_CREATED, _chunk(b"[1, 2]\n")], [_CREATED]])
    client = EtcdClient(gateway.url, timeout=timedelta(seconds=5))
    stream = WatchStream(client, b"k", None, 5)
    try:
        with pytest.raises(EtcdUnavailable, match=r"malformed watch message .*expected a JSON obj"):
            stream.next_events(timedelta(seconds=5))
        assert stream.next_events(timedelta(seconds=0.1)) == []
        assert [r["start_revision"] for r in gateway.requests] == ["5", "5"]
    finally:
        stream.close()
        client.close()
        gateway.close()


def test_a_watch_line_longer_than_the_bound_fails_the_stream_instead_of_growing() -> None:
    """A peer that never ends its line: the stream fails once the line passes
    MAX_WATCH_MESSAGE (64 MiB), then resumes from where it was on a new connection."""
    block = b"x" * 2**20
    endless = [b"7fffffff\r\n", *[block] * 65]  # a 2 GiB chunk, 65 MiB of it without a newline
    gateway = _FakeWatchGateway(
        [
            [_CREATED, _watch_message({"events": [_put_event(5)]}), *endless],
            [_CREATED, _watch_message({"events": [_put_event(6)]})],
        ]
    )
    client = EtcdClient(gateway.url, timeout=timedelta(seconds=5))
    stream = WatchStream(client, b"k", None, 5)
    try:
        assert [e.kv.mod_revision for e in stream.next_events(timedelta(seconds=5))] == [5]
        with pytest.raises(EtcdUnavailable, match="ran past 64 MiB without ending its line"):
            stream.next_events(timedelta(seconds=30))
        assert not stream._body  # freed at once
        assert [e.kv.mod_revision for e in stream.next_events(timedelta(seconds=5))] == [6]
        assert [r["start_revision"] for r in gateway.requests] == ["5", "6"]
    finally:
        stream.close()
        client.close()
        gateway.close()
