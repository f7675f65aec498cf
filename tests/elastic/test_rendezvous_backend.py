"""RendezvousBackend contract, run against our etcd backend and the in-memory reference.

The contract is torch's (``dynamic_rendezvous.RendezvousBackend``, and the behaviours its
``RendezvousBackendTestMixin`` checks, listed below): a write succeeds only with the current
token (``None``: only if there is no state); otherwise nothing is written and the current state
and token come back with ``False``; a stored value that is not a valid state raises
``RendezvousStateError``.
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousParameters,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend

from elastic.etcd import EtcdClient
from elastic.etcd_server import EtcdServer
from elastic.rdzv_registry import BACKEND_NAME
from elastic.rendezvous import (
    SHARE_STORE_ENV,
    EtcdRendezvousBackend,
    create_backend,
    create_handler,
    decode_state,
    encode_state,
)
from elastic.testing import InMemoryRendezvousBackend, make_test_certificates

BackendFactory = Callable[[], RendezvousBackend]


@pytest.fixture(params=["memory", pytest.param("etcd", marks=pytest.mark.etcd)])
def make_backend(request: pytest.FixtureRequest) -> BackendFactory:
    """Makes backends that share one state, as the nodes of one job do."""
    if request.param == "memory":
        shared = InMemoryRendezvousBackend()
        return lambda: shared
    url = request.getfixturevalue("etcd_server")
    run_id = f"job-{uuid.uuid4().hex[:8]}"
    return lambda: EtcdRendezvousBackend(
        EtcdClient(url, timeout=timedelta(seconds=5)), run_id, key_prefix="/test-rdzv"
    )


def test_absent_state_reads_as_none(make_backend: BackendFactory) -> None:
    assert make_backend().get_state() is None


def test_create_if_absent(make_backend: BackendFactory) -> None:
    a, b = make_backend(), make_backend()
    result = a.set_state(b"first")
    assert result is not None
    state, token, ok = result
    assert (state, ok) == (b"first", True)
    assert a.get_state() == (b"first", token)
    assert b.get_state() == (b"first", token)
    # A second create loses and returns the existing state and its token.
    assert b.set_state(b"second", None) == (b"first", token, False)
    assert a.get_state() == (b"first", token)


def test_update_with_current_token_and_stale_token(make_backend: BackendFactory) -> None:
    a, b = make_backend(), make_backend()
    created = a.set_state(b"v1")
    assert created is not None
    _, token1, _ = created
    updated = b.set_state(b"v2", token1)
    assert updated is not None
    state2, token2, ok2 = updated
    assert (state2, ok2) == (b"v2", True)
    assert token2 != token1
    # The other node still holds token1: its write is refused, and it learns the current state.
    assert a.set_state(b"v3", token1) == (b"v2", token2, False)
    assert b.get_state() == (b"v2", token2)


def test_foreign_token_is_stale(make_backend: BackendFactory) -> None:
    backend = make_backend()
    created = backend.set_state(b"v1")
    assert created is not None
    _, token, _ = created
    for foreign in ("not-a-token", b"bytes", 10**12):
        assert backend.set_state(b"x", foreign) == (b"v1", token, False)
    assert backend.get_state() == (b"v1", token)


def test_concurrent_writers_exactly_one_wins_per_round(make_backend: BackendFactory) -> None:
    writers, rounds = 4, 6
    backends = [make_backend() for _ in range(writers)]
    created = backends[0].set_state(b"round-0")
    assert created is not None
    barrier = threading.Barrier(writers)
    results: list[list[tuple[bytes, object, bool] | None]] = [[] for _ in range(rounds)]
    lock = threading.Lock()
    errors: list[BaseException] = []

    def writer(index: int) -> None:
        try:
            for r in range(rounds):
                barrier.wait(timeout=30)  # everybody reads the same token ...
                current = backends[index].get_state()
                assert current is not None
                barrier.wait(timeout=30)  # ... before anybody writes
                result = backends[index].set_state(f"r{r}-w{index}".encode(), current[1])
                with lock:
                    results[r].append(result)
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    for r, round_results in enumerate(results):
        assert len(round_results) == writers
        winners = [res for res in round_results if res is not None and res[2]]
        assert len(winners) == 1, f"round {r}: {round_results}"
        winner_state, winner_token, _ = winners[0]
        # Every loser was told the winner's state and token.
        for res in round_results:
            assert res is not None and res[:2] == (winner_state, winner_token)


# --------------------------------------------------------------------------- etcd specifics


# ---------------------------------------------------------- torch's RendezvousBackendTestMixin
# torch ships the backend contract in its test tree only
# (test/distributed/elastic/rendezvous/rendezvous_backend_test.py); its eight behaviours, and
# where each is tested here:
#   get_state returns the backend state ..................... test_get_state_returns_what_was_set
#   get_state returns None if there is no state ............. test_absent_state_reads_as_none
#   get_state raises RendezvousStateError if corrupt ........ test_corrupt_state_raises_*
#   set_state sets the state if it does not exist ........... test_create_if_absent
#   set_state sets the state if the token is current ........ test_update_with_current_token_...
#   set_state returns the current state if the token is old . test_update_with_current_token_...
#   set_state returns the current state if the token is None  test_create_if_absent
#   set_state returns the current state if the token is bad . test_foreign_token_is_stale


def test_get_state_returns_what_was_set(make_backend: BackendFactory) -> None:
    backend = make_backend()
    backend.set_state(b"x")
    found = backend.get_state()
    assert found is not None
    state, token = found
    assert state == b"x"
    assert token is not None


class _Trap:
    """Unpickling this creates a directory: proof that a value reached ``pickle.loads``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.mkdir, (str(self.marker),)


def _flip_last(data: bytes) -> bytes:
    """``data`` with its last byte changed (setting it to 0 changed nothing 1 time in 256)."""
    return data[:-1] + bytes([data[-1] ^ 0xFF])


def _corruptions(marker: Path) -> dict[str, bytes]:
    good = encode_state(pickle.dumps({"round": 1}))
    wrong_version = bytearray(good)
    wrong_version[6] = 99
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 0x01
    return {
        "empty": b"",
        "garbage": b"\x80\x04not a state at all",
        # torch's bytes without a frame: an older flashckpt, or another tool, wrote the key. A
        # trap inside shows whether anything reached the unpickler.
        "unframed pickle": pickle.dumps(_Trap(marker)),
        "truncated": good[:-3],
        "padded": good + b"\x00",
        "bit flip": bytes(flipped),
        "other version": bytes(wrong_version),
        "framed trap, bad checksum": _flip_last(encode_state(pickle.dumps(_Trap(marker)))),
    }


@pytest.mark.etcd
@pytest.mark.parametrize(
    "case",
    [
        "empty",
        "garbage",
        "unframed pickle",
        "truncated",
        "padded",
        "bit flip",
        "other version",
        "framed trap, bad checksum",
    ],
)
def test_corrupt_state_raises_rendezvous_state_error(
    etcd_server: str, tmp_path: Path, case: str
) -> None:
    client = EtcdClient(etcd_server, timeout=timedelta(seconds=5))
    run_id = f"job-{uuid.uuid4().hex[:8]}"
    params = _params(etcd_server, read_timeout=5, key_prefix="/test-corrupt")
    params.run_id = run_id
    backend, _ = create_backend(params)
    marker = tmp_path / "unpickled"
    client.put(backend.key, _corruptions(marker)[case])
    with pytest.raises(RendezvousStateError, match=re.escape(backend.key)):
        backend.get_state()
    # A writer that loses the compare-and-set is told the current state: the same check.
    with pytest.raises(RendezvousStateError):
        backend.set_state(b"mine", None)
    # Through torch's handler (what torchrun runs): the error surfaces, nothing is unpickled.
    handler = create_handler(params)
    with pytest.raises(RendezvousStateError, match="etcdctl del"):
        handler.num_nodes_waiting()
    assert not marker.exists(), "a corrupt value reached torch's unpickler"


@pytest.mark.etcd
def test_state_is_framed_under_the_job_key_with_a_lease(etcd_server: str) -> None:
    client = EtcdClient(etcd_server, timeout=timedelta(seconds=5))
    backend = EtcdRendezvousBackend(
        client, "job-raw", key_prefix="/test-raw", state_ttl=timedelta(seconds=60)
    )
    client.delete_prefix("/test-raw/")
    backend.set_state(b"\x00\xffpickle")
    kv = client.get_kv("/test-raw/job-raw/rdzv/state")
    assert kv is not None and kv.value == encode_state(b"\x00\xffpickle")
    assert kv.value.startswith(b"FCRDZV") and kv.value != b"\x00\xffpickle"
    assert decode_state(kv.value, backend.key) == b"\x00\xffpickle"
    assert kv.lease != 0
    assert backend.get_state() == (b"\x00\xffpickle", kv.mod_revision)
    assert backend.name == BACKEND_NAME


@pytest.mark.etcd
def test_state_expires_after_its_ttl_without_writes(etcd_server: str) -> None:
    client = EtcdClient(etcd_server, timeout=timedelta(seconds=5))
    backend = EtcdRendezvousBackend(
        client, f"job-{uuid.uuid4().hex[:8]}", state_ttl=timedelta(seconds=1)
    )
    assert backend.set_state(b"s") is not None
    revision = client.revision()
    assert client.wait_for_change(
        backend.key, after_revision=revision, timeout=timedelta(seconds=5)
    )
    assert backend.get_state() is None


@pytest.mark.etcd
def test_state_and_tokens_survive_an_etcd_restart(etcd_instance: EtcdServer) -> None:
    client = EtcdClient(etcd_instance.client_url, timeout=timedelta(seconds=10))
    backend = EtcdRendezvousBackend(client, "job")
    created = backend.set_state(b"before")
    assert created is not None
    etcd_instance.restart()
    assert backend.get_state() == (b"before", created[1])
    after = backend.set_state(b"after", created[1])
    assert after is not None and after[2]


def test_unreachable_etcd_raises_rendezvous_connection_error(dead_endpoint: str) -> None:
    backend = EtcdRendezvousBackend(EtcdClient(dead_endpoint, timeout=timedelta(seconds=0.3)), "j")
    start = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match="could not read"):
        backend.get_state()
    with pytest.raises(RendezvousConnectionError, match="could not write"):
        backend.set_state(b"x")
    assert time.monotonic() - start < 2.0


def _params(endpoint: str, **config: Any) -> RendezvousParameters:
    return RendezvousParameters(BACKEND_NAME, endpoint, "job1", 1, 2, **config)


def test_create_backend_reads_torchrun_options() -> None:
    backend, store = create_backend(
        _params(
            "h1:1,https://h2:2",
            read_timeout="7",
            key_prefix="/custom",
            state_ttl="0",
            store_timeout="9",
        )
    )
    assert backend.client.endpoints == ("http://h1:1", "https://h2:2")
    assert backend.client.timeout == timedelta(seconds=7)
    assert backend.key == "/custom/job1/rdzv/state"
    assert store.prefix == "/custom/job1/store/"
    assert store.timeout == timedelta(seconds=9)  # type: ignore[attr-defined]
    handler = create_handler(_params("h1:1"))
    assert handler.get_backend() == BACKEND_NAME


@pytest.mark.parametrize(
    ("endpoint", "config", "match"),
    [
        ("", {}, "rdzv-endpoint"),
        ("h:1", {"read_timeout": "0"}, "read_timeout"),
        ("h:1", {"protocol": "udp"}, "protocol"),
        ("h:1", {"state_ttl": "-1"}, "state_ttl"),
        ("h:1", {"store_timeout": "0"}, "store_timeout"),
    ],
)
def test_create_backend_rejects_bad_options(
    endpoint: str, config: dict[str, Any], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        create_backend(_params(endpoint, **config))


def test_run_id_with_slash_is_rejected() -> None:
    with pytest.raises(ValueError, match="must not contain '/'"):
        EtcdRendezvousBackend(EtcdClient("h:1", timeout=timedelta(seconds=1)), "a/b")


@pytest.mark.etcd
def test_tls_etcd_through_torchrun_options(tmp_path: Path) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl CLI to make test certificates (apt-get install openssl)")
    tls = make_test_certificates(tmp_path / "certs")
    with EtcdServer(tmp_path / "etcd", tls=tls) as server:
        endpoint = server.client_url.removeprefix("https://")
        backend, store = create_backend(
            _params(endpoint, protocol="https", ca_cert=tls.ca_file, read_timeout=5)
        )
        assert backend.client.endpoints == (server.client_url,)
        created = backend.set_state(b"over-tls")
        assert created is not None and created[2]
        store.set("k", "v")
        assert store.get("k") == b"v"
        # Without the CA the certificate cannot be verified: a config error, reported at once.
        untrusting, _ = create_backend(_params(endpoint, protocol="https", read_timeout=5))
        start = time.monotonic()
        with pytest.raises(RendezvousConnectionError, match="ca_cert"):
            untrusting.get_state()
        assert time.monotonic() - start < 2.0


@pytest.mark.parametrize("before", [None, "0", "1"])
def test_handler_gives_each_worker_group_its_own_store(
    before: str | None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # torchrun creates our handler in its agent process; the workers inherit the variable.
    if before is None:
        monkeypatch.delenv(SHARE_STORE_ENV, raising=False)
    else:
        monkeypatch.setenv(SHARE_STORE_ENV, before)
    handler = create_handler(_params("h1:1"))
    assert os.environ[SHARE_STORE_ENV] == "1"
    assert handler.use_agent_store is False  # workers: TORCHELASTIC_USE_AGENT_STORE=False
    assert ("overridden" in caplog.text) == (before == "0"), caplog.text
