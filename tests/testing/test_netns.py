"""Simulated machines in their own namespaces (flashckpt/testing/netns.py): separate, and cleaned
up."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from waiting import wait_until

from flashckpt.testing import netns

_REASON = netns.unavailable()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")

_PY = sys.executable


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


@pytest.fixture
def cluster() -> Iterator[netns.Cluster]:
    c = netns.Cluster(shm_size="64m")
    try:
        yield c
    finally:
        c.close()
    left = {n for n in _namespaces() if n.startswith(c.tag)}
    assert not left, f"namespaces left behind: {left}"


def _py(machine: netns.Machine, code: str) -> str:
    done = machine.run([_PY, "-c", code], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@contextlib.contextmanager
def _server(m: netns.Machine, port: int, reply: str, accepts: int = 1) -> Iterator[None]:
    """A TCP server on machine ``m`` (every address of it, ``port``) that answers ``accepts``
    connections with ``reply`` (a Python expression of bytes); listening when this yields."""
    code = (
        f"import socket; s = socket.create_server(('0.0.0.0', {port}))\n"
        "print('up', flush=True)\n"
        f"for _ in range({accepts}):\n c, _ = s.accept(); c.sendall({reply}); c.close()"
    )
    server = m.popen([_PY, "-c", code], stdout=subprocess.PIPE)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == b"up"
        yield
    finally:
        server.kill()
        server.wait()


def _fetch(m: netns.Machine, addr: str, port: int) -> str:
    """What a connection from machine ``m`` to ``addr:port`` reads."""
    code = f"import socket; c = socket.create_connection(('{addr}', {port}), timeout=5)"
    return _py(m, code + "; print(c.recv(100).decode())")


def test_machines_are_separate(cluster: netns.Cluster) -> None:
    a, b = cluster.add("ma"), cluster.add("mb")
    # Own hostnames.
    assert _py(a, "import socket; print(socket.gethostname())") == "ma"
    assert _py(b, "import socket; print(socket.gethostname())") == "mb"
    # Own /dev/shm: a segment written on one machine is seen neither on the other nor here.
    name = f"fctest-{uuid.uuid4().hex}"
    _py(a, f"open('/dev/shm/{name}', 'w').write('x'); print('ok')")
    assert _py(a, f"import os; print(os.path.exists('/dev/shm/{name}'))") == "True"
    assert _py(b, f"import os; print(os.path.exists('/dev/shm/{name}'))") == "False"
    assert not os.path.exists(f"/dev/shm/{name}")
    # Own network: b reaches a at a's address; loopback is each machine's own.
    with _server(a, 7070, "socket.gethostname().encode()"):
        got = _fetch(b, a.addr, 7070)
        assert got == "ma"
        # Nothing listens on b's own loopback, though a does on its.
        refused = _py(
            b,
            (
                "import socket\ntry:\n socket.create_connection(('127.0.0.1', 7070), timeout=2)\n"
                " print('connected')\nexcept OSError as e:\n print(type(e).__name__)"
            ),
        )
        assert refused == "ConnectionRefusedError"
    # Nothing leaves the private network: a machine has no route but its own subnet (checked
    # on the routing table, never by sending traffic to an outside address).
    routes = a.run(["ip", "route"], capture_output=True, text=True).stdout
    assert "default" not in routes
    assert routes.split()[0] == "10.77.0.0/24"


def test_kill_takes_the_memory_and_boot_starts_empty(cluster: netns.Cluster) -> None:
    m = cluster.add("mk")
    _py(m, "open('/dev/shm/seg', 'w').write('state'); print('ok')")
    sleeper = m.popen(["sleep", "300"])
    # nsenter joins the namespaces a moment after it starts (CI once looked too early)
    wait_until(
        lambda: sleeper.pid in m.pids(),
        "the sleeper in the machine's namespaces",
        10,
        0.01,
        state=m.pids,
    )
    m.kill()
    assert sleeper.wait(timeout=10) == -9
    assert m.pids() == []
    assert not m.up
    m.boot()
    assert _py(m, "import os; print(os.listdir('/dev/shm'))") == "[]"


def test_kill_takes_a_process_started_a_moment_before(cluster: netns.Cluster) -> None:
    """kill() right after popen(): nsenter may not be in the namespace yet; nothing survives."""
    m = cluster.add("mr")
    for _ in range(10):
        started = m.popen(["sleep", "300"])
        m.kill()
        # killed in the namespace or before it got there; never left running
        assert started.wait(timeout=10) == -9
        assert m.pids() == []
        m.boot()


def test_partition_cuts_the_link_and_heal_restores_it(cluster: netns.Cluster) -> None:
    a, b = cluster.add("pa"), cluster.add("pb")
    probe = (
        "import socket\ntry:\n"
        f" socket.create_connection(('{b.addr}', 9), timeout=1)\nexcept ConnectionRefusedError:\n"
        " print('reachable')\nexcept OSError as e:\n print('unreachable', type(e).__name__)"
    )
    assert _py(a, probe) == "reachable"  # b answers (with a refusal: nothing listens on 9)
    a.partition()
    assert _py(a, probe).startswith("unreachable")
    a.heal()
    assert _py(a, probe) == "reachable"


def test_cut_from_one_address_keeps_the_others(cluster: netns.Cluster) -> None:
    a, b, c = cluster.add("ca"), cluster.add("cb"), cluster.add("cc")

    def probe(to: netns.Machine) -> str:
        return _py(
            a,
            "import socket\ntry:\n"
            f" socket.create_connection(('{to.addr}', 9), timeout=1)\n"
            "except ConnectionRefusedError:\n print('reachable')\n"
            "except OSError as e:\n print('unreachable', type(e).__name__)",
        )

    a.cut_from(b.addr)
    assert probe(b).startswith("unreachable") and probe(c) == "reachable"
    a.reconnect_to(b.addr)
    assert probe(b) == "reachable"


def test_hub_service_reached_from_machines_and_through_forward(cluster: netns.Cluster) -> None:
    m = cluster.add("mh")
    hub = cluster.hub
    with _server(hub, 2379, "b'hub'", accepts=2):
        got = _fetch(m, cluster.hub_addr, 2379)
        assert got == "hub"
        port = cluster.forward(2379)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
            assert c.recv(10) == b"hub"


def test_etcd_in_the_hub(cluster: netns.Cluster, tmp_path: object) -> None:
    from flashckpt.elastic.etcd.server import EtcdV3ServerError, find_etcd_binary

    try:
        binary = find_etcd_binary()
    except EtcdV3ServerError as e:
        pytest.skip(str(e))
    url = cluster.start_etcd(str(tmp_path), binary=binary)
    m = cluster.add("me")
    put = (
        "import base64, json, urllib.request\n"
        "b = lambda s: base64.b64encode(s.encode()).decode()\n"
        f"r = urllib.request.Request('{url}/v3/kv/put', method='POST',"
        " data=json.dumps({'key': b('k'), 'value': b('v')}).encode())\n"
        "print(json.load(urllib.request.urlopen(r, timeout=5))['header']['revision'])"
    )
    assert int(_py(m, put)) >= 2


def test_etcd_in_the_hub_that_exits_says_so_with_its_log(
    cluster: netns.Cluster, tmp_path: Path
) -> None:
    # The hub's etcd starts and is probed like every other etcd (flashckpt.elastic.etcd.server): one
    # that
    # exits while starting is an EtcdV3ServerError naming the exit and its log, not a timeout.
    from flashckpt.elastic.etcd.server import EtcdV3ServerError

    fake = tmp_path / "etcd"
    fake.write_text("#!/bin/sh\necho 'fake etcd: bad flag' >&2\nexit 3\n")
    fake.chmod(0o755)
    with pytest.raises(EtcdV3ServerError, match=r"(?s)exited with code 3.*fake etcd: bad flag"):
        cluster.start_etcd(str(tmp_path / "data"), binary=str(fake), timeout=120)
