"""Store contract: our EtcdV3Store behaves like torch's own HashStore, through torch's C++ side.

Every case runs against both stores, each wrapped in torch's ``PrefixStore`` so that calls go
through the C++ dispatch torch itself uses (rendezvous, gloo), not just the Python methods.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import pytest
import torch.distributed as dist

from flashckpt.elastic.etcd.client import EtcdClient
from flashckpt.elastic.etcd.store import EtcdV3Store


@dataclass
class StoreUnderTest:
    store: dist.Store
    """What the test calls: a PrefixStore over ``inner``."""
    inner: dist.Store
    """Kept referenced: torch's PrefixStore does not keep a Python store alive."""


@pytest.fixture(params=["hash", pytest.param("etcd", marks=pytest.mark.etcd)])
def store(request: pytest.FixtureRequest) -> Iterator[StoreUnderTest]:
    inner: dist.Store
    if request.param == "hash":
        inner = dist.HashStore()
    else:
        url = request.getfixturevalue("etcd_server")
        client = EtcdClient(url, timeout=timedelta(seconds=5))
        inner = EtcdV3Store(client, f"/test/store-{uuid.uuid4().hex}/")
    inner.set_timeout(timedelta(seconds=5))
    yield StoreUnderTest(dist.PrefixStore("p", inner), inner)


def test_set_get_round_trips_str_and_bytes(store: StoreUnderTest) -> None:
    s = store.store
    s.set("a", "text")
    s.set("b", b"\x00\xffbin")  # type: ignore[arg-type]  # the stubs say str; torch takes bytes
    assert s.get("a") == b"text"
    assert s.get("b") == b"\x00\xffbin"
    s.set("a", "")
    assert s.get("a") == b""


def test_get_of_missing_key_times_out(store: StoreUnderTest) -> None:
    store.store.set_timeout(timedelta(milliseconds=300))
    start = time.monotonic()
    with pytest.raises(dist.DistStoreError):
        store.store.get("missing")
    assert 0.25 <= time.monotonic() - start < 2.0


def test_wait_returns_when_another_thread_sets_the_key(store: StoreUnderTest) -> None:
    s = store.store
    timer = threading.Timer(0.2, s.set, args=("late", "v"))
    timer.start()
    try:
        start = time.monotonic()
        s.wait(["late"], timedelta(seconds=5))
        assert time.monotonic() - start < 2.0
        assert s.get("late") == b"v"
    finally:
        timer.join()
    with pytest.raises(dist.DistStoreError):
        s.wait(["late", "never"], timedelta(milliseconds=200))


def test_check(store: StoreUnderTest) -> None:
    s = store.store
    assert not s.check(["x"])
    s.set("x", "1")
    assert s.check(["x"])
    assert not s.check(["x", "y"])


def test_add_is_atomic_and_counts_from_zero(store: StoreUnderTest) -> None:
    s = store.store
    assert s.add("n", 3) == 3
    assert s.add("n", -1) == 2
    assert s.get("n") == b"2"

    threads, per_thread = 4, 10
    workers = [
        threading.Thread(target=lambda: [s.add("c", 1) for _ in range(per_thread)])
        for _ in range(threads)
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=60)
    assert s.get("c") == str(threads * per_thread).encode()


def test_add_on_non_integer_value_raises_value_error(store: StoreUnderTest) -> None:
    store.store.set("text", "abc")
    with pytest.raises(ValueError):
        store.store.add("text", 1)


def test_compare_set_follows_c10d_semantics(store: StoreUnderTest) -> None:
    s = store.store
    # Absent key with a non-empty expectation: nothing is written, the expectation comes back.
    assert s.compare_set("k", "x", "y") == b"x"
    assert not s.check(["k"])
    # Absent key with an empty expectation: created.
    assert s.compare_set("k", "", "y") == b"y"
    # Mismatch: the current value comes back.
    assert s.compare_set("k", "q", "z") == b"y"
    # Match: swapped.
    assert s.compare_set("k", "y", "z") == b"z"
    assert s.get("k") == b"z"


def test_delete_key_and_num_keys(store: StoreUnderTest) -> None:
    s = store.store
    s.set("a", "1")
    s.set("b", "2")
    assert s.num_keys() == 2
    assert s.delete_key("a") is True
    assert s.delete_key("a") is False
    assert s.num_keys() == 1


def test_multi_get_and_multi_set(store: StoreUnderTest) -> None:
    s = store.store
    s.multi_set(["m1", "m2"], ["v1", "v2"])  # type: ignore[attr-defined]  # missing from stubs
    assert s.multi_get(["m2", "m1"]) == [b"v2", b"v1"]


@pytest.mark.etcd
def test_unreachable_etcd_raises_network_error(dead_endpoint: str) -> None:
    inner = EtcdV3Store(EtcdClient(dead_endpoint, timeout=timedelta(seconds=0.5)), "/s/")
    s = dist.PrefixStore("p", inner)
    start = time.monotonic()
    with pytest.raises(dist.DistNetworkError, match="did not complete"):
        s.set("k", "v")
    with pytest.raises(dist.DistNetworkError):
        s.get("k")
    assert time.monotonic() - start < 3.0


def test_store_rejects_empty_prefix() -> None:
    with pytest.raises(ValueError, match="prefix"):
        EtcdV3Store(EtcdClient("127.0.0.1:1", timeout=timedelta(seconds=1)), "")
