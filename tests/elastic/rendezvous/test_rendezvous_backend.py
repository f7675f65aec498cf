"""``flashckpt-etcd`` as torchrun builds it
(:func:`flashckpt.elastic.rendezvous.backend.create_handler`): its options, TLS, errors, and the
per-round worker store.

The contract of the handler itself (rounds, standbys, closing, ...) is in ``test_rdzv_handler.py``;
it replaced torch's ``DynamicRendezvousHandler`` on a compare-and-set blob, whose
``RendezvousBackend`` contract tests lived here.
"""

from __future__ import annotations

import os
import shutil
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousParameters,
)

from flashckpt.elastic.etcd.server import EtcdV3Server
from flashckpt.elastic.rendezvous.backend import SHARE_STORE_ENV, create_handler, job_prefix
from flashckpt.elastic.rendezvous.handler import RdzvHandler
from flashckpt.elastic.rendezvous.registry import BACKEND_NAME
from flashckpt.testing.elastic import make_test_certificates


def _params(endpoint: str, **config: Any) -> RendezvousParameters:
    return RendezvousParameters(BACKEND_NAME, endpoint, "job1", 1, 2, **config)


def test_create_handler_reads_torchrun_options() -> None:
    handler = create_handler(
        _params(
            "h1:1,https://h2:2",
            read_timeout="7",
            key_prefix="/custom",
            state_ttl="0",
            store_timeout="9",
            join_timeout="11",
            last_call_timeout="3",
            lease_ttl="4",
        )
    )
    assert isinstance(handler, RdzvHandler)
    assert handler.get_backend() == BACKEND_NAME and handler.get_run_id() == "job1"
    assert handler.client.endpoints == ("http://h1:1", "https://h2:2")
    assert handler.client.timeout == timedelta(seconds=7)
    settings = handler._s
    assert settings.job_prefix == "/custom/job1/"
    assert settings.state_ttl is None  # 0: never expire
    assert (settings.join_timeout, settings.last_call_timeout, settings.lease_ttl) == (
        timedelta(seconds=11),
        timedelta(seconds=3),
        timedelta(seconds=4),
    )
    assert handler._store.prefix == "/custom/job1/store/"  # type: ignore[attr-defined]
    assert handler._store.timeout == timedelta(seconds=9)  # type: ignore[attr-defined]


def test_torchs_keep_alive_options_set_the_lease() -> None:
    # torch's dynamic handler drops a node after keep_alive_max_attempt missed beats.
    handler = create_handler(_params("h:1", keep_alive_interval=1, keep_alive_max_attempt=3))
    assert handler._s.lease_ttl == timedelta(seconds=3)


@pytest.mark.parametrize(
    ("endpoint", "config", "match"),
    [
        ("", {}, "rdzv-endpoint"),
        ("h:1", {"read_timeout": "0"}, "read_timeout"),
        ("h:1", {"protocol": "udp"}, "protocol"),
        ("h:1", {"state_ttl": "-1"}, "state_ttl"),
        ("h:1", {"store_timeout": "0"}, "store_timeout"),
        ("h:1", {"lease_ttl": "1"}, "lease_ttl"),
        ("h:1", {"join_timeout": "soon"}, "join_timeout"),
    ],
)
def test_create_handler_rejects_bad_options(
    endpoint: str, config: dict[str, Any], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        create_handler(_params(endpoint, **config))


def test_run_id_with_slash_is_rejected() -> None:
    with pytest.raises(ValueError, match="must not contain '/'"):
        job_prefix("a/b")
    with pytest.raises(ValueError, match="must not contain '/'"):
        create_handler(RendezvousParameters(BACKEND_NAME, "h:1", "a/b", 1, 1))


def test_unreachable_etcd_raises_rendezvous_connection_error(dead_endpoint: str) -> None:
    handler = create_handler(_params(dead_endpoint, read_timeout="1"))
    with pytest.raises(RendezvousConnectionError, match="failed to reach etcd"):
        handler.next_rendezvous()
    with pytest.raises(RendezvousConnectionError, match="could not close"):
        handler.set_closed()
    assert handler.num_nodes_waiting() == 0  # no etcd call: nothing known to wait


@pytest.mark.etcd
def test_tls_etcd_through_torchrun_options(tmp_path: Path) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl CLI to make test certificates (apt-get install openssl)")
    tls = make_test_certificates(tmp_path / "certs")
    with EtcdV3Server(tmp_path / "etcd", tls=tls) as server:
        endpoint = server.client_url.removeprefix("https://")
        handler = create_handler(
            _params(
                endpoint,
                protocol="https",
                ca_cert=tls.ca_file,
                read_timeout=5,
                last_call_timeout=0,
            )
        )
        assert handler.client.endpoints == (server.client_url,)
        info = handler.next_rendezvous()  # min 1: a round of one, over TLS
        assert (info.rank, info.world_size) == (0, 1)
        info.store.set("k", "v")
        assert info.store.get("k") == b"v"
        handler.set_closed()
        with pytest.raises(RendezvousClosedError):
            handler.next_rendezvous()
        handler.leave()
        # Without the CA the certificate cannot be verified: a config error, reported at once.
        untrusting = create_handler(_params(endpoint, protocol="https", read_timeout=5))
        start = time.monotonic()
        with pytest.raises(RendezvousConnectionError, match="ca_cert"):
            untrusting.next_rendezvous()
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
