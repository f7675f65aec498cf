"""Workers' c10d store clients wait for the round's store themselves
(:mod:`flashckpt.elastic.launch.storewait`) instead of c10d's first backoff pause: a client that
comes before the store listens is created only once the port accepts, a store that never listens is
left to c10d's own error, and the
store's host (worker rank 0) never waits. Ordering is asserted, never speed."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from types import ModuleType
from typing import Any

import pytest
import torch.distributed.rendezvous  # noqa: F401 - the module whose function is wrapped
from torch.distributed import TCPStore

from flashckpt.elastic.launch import storewait

RDZV: ModuleType = sys.modules["torch.distributed.rendezvous"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def wrapped(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, float]]:
    """c10d's function wrapped, with a stand-in for it that records when it was called."""
    calls: list[tuple[str, float]] = []

    def create(hostname: str, port: int, rank: int, world_size: int, timeout: Any) -> Any:
        calls.append((f"rank {rank}", time.monotonic()))
        return TCPStore(hostname, port, world_size, rank == 0, timeout=timeout)

    monkeypatch.setattr(RDZV, "_create_c10d_store", create)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    storewait.install()
    assert RDZV._create_c10d_store is not create
    return calls


def test_a_client_early_for_its_store_is_created_once_the_store_listens(
    wrapped: list[tuple[str, float]],
) -> None:
    port = _free_port()
    listening: list[float] = []
    servers: list[TCPStore] = []

    def host() -> None:
        time.sleep(0.3)
        listening.append(time.monotonic())
        timeout = timedelta(seconds=30)
        srv = TCPStore("127.0.0.1", port, 2, True, timeout=timeout, wait_for_workers=False)
        servers.append(srv)

    t = threading.Thread(target=host)
    t.start()
    try:
        client = RDZV._create_c10d_store("127.0.0.1", port, 1, 2, timedelta(seconds=30))
        client.set("k", "v")
        assert servers[0].get("k") == b"v"
    finally:
        t.join()
    [(who, called_at)] = wrapped
    assert who == "rank 1" and called_at >= listening[0]


def test_the_stores_host_does_not_wait(wrapped: list[tuple[str, float]]) -> None:
    port = _free_port()
    # Nothing listens on the port: a waiting call would not return before its timeout.
    server = RDZV._create_c10d_store("127.0.0.1", port, 0, 1, timedelta(seconds=30))
    server.set("k", "v")
    assert [who for who, _ in wrapped] == ["rank 0"]


def test_a_store_that_never_listens_is_left_to_c10d(wrapped: list[tuple[str, float]]) -> None:
    port = _free_port()
    with pytest.raises(Exception, match=r"(?i)timed? ?out|connect"):
        RDZV._create_c10d_store("127.0.0.1", port, 1, 2, timedelta(seconds=1))
    assert [who for who, _ in wrapped] == ["rank 1"]  # c10d's client tried, and failed


def test_wait_listening() -> None:
    port = _free_port()
    assert storewait.wait_listening("127.0.0.1", port, 0.2) is False
    with socket.create_server(("127.0.0.1", 0)) as srv:
        assert storewait.wait_listening("127.0.0.1", srv.getsockname()[1], 5) is True
    assert storewait.wait_listening("no-such-host.invalid", 1, 5) is False


def test_install_twice_wraps_once(wrapped: list[tuple[str, float]]) -> None:
    first = RDZV._create_c10d_store
    storewait.install()
    assert RDZV._create_c10d_store is first


def test_a_cold_worker_gets_the_wrapper_when_torch_distributed_is_first_imported() -> None:
    code = (
        "import sys; from flashckpt.elastic.launch import storewait; storewait.install();"
        "assert 'torch' not in sys.modules;"
        "import torch.distributed;"
        "f = sys.modules['torch.distributed.rendezvous']._create_c10d_store;"
        "assert getattr(f, '_flashckpt_waits_for_the_store', False), f;"
        "assert not any(type(h).__name__ == '_Hook' for h in sys.meta_path)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
