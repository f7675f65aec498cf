"""EtcdClient against a real etcd: key-value, compare-and-set, leases, watches, failures."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest

from flashckpt.elastic.etcd.client import (
    EtcdClient,
    EtcdError,
    EtcdLeaseNotFound,
    EtcdOutcomeUnknown,
    EtcdTimeout,
    EtcdUnavailable,
    parse_endpoints,
)
from flashckpt.elastic.etcd.server import EtcdV3Server

SHORT = timedelta(seconds=1)


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


def test_unreachable_endpoint_raises_unavailable_within_the_timeout(dead_endpoint: str) -> None:
    client = EtcdClient(dead_endpoint, timeout=SHORT)
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


def test_server_that_never_answers_raises_timeout(silent_endpoint: str) -> None:
    client = EtcdClient(silent_endpoint, timeout=timedelta(seconds=0.5))
    start = time.monotonic()
    with pytest.raises(EtcdTimeout):
        client.get("k")
    assert time.monotonic() - start < 1.5
    # An unanswered transaction may have been applied: it is never blindly repeated.
    with pytest.raises(EtcdOutcomeUnknown, match="re-read"):
        client.compare_and_set("k", b"v", mod_revision=0)


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
def test_fails_over_to_a_live_endpoint(etcd_server: str, dead_endpoint: str) -> None:
    for endpoints in ([dead_endpoint, etcd_server], [etcd_server, dead_endpoint]):
        client = EtcdClient(endpoints, timeout=timedelta(seconds=5))
        client.put("/test/failover", b"ok")
        assert client.get("/test/failover") is not None


@pytest.mark.etcd
def test_calls_ride_out_an_etcd_restart(etcd_instance: EtcdV3Server) -> None:
    client = EtcdClient(etcd_instance.client_url, timeout=timedelta(seconds=10))
    revision = client.put("k", b"before")
    etcd_instance.kill()
    results: list[tuple[bytes, int] | None] = []
    reader = threading.Thread(target=lambda: results.append(client.get("k")))
    reader.start()  # retries against the dead server until it is back
    time.sleep(0.3)
    etcd_instance.start()
    reader.join(timeout=15)
    assert results == [(b"before", revision)]
    ok, _ = client.compare_and_set("k", b"after", mod_revision=revision)
    assert ok, "revisions survive a restart, so tokens read before it stay valid"


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
