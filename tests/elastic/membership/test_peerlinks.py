"""Held links between launchers (:mod:`flashckpt.elastic.membership.peerlinks`): a peer launcher's
death is found when its sockets close, not when its lease lapses or when the survivor's workers
happen to fail.

The registries run against a real etcd; the peer that dies is a real process killed with
SIGKILL, with a lease TTL (30 s) far longer than the tests wait, so only the link can tell.
"""

from __future__ import annotations

import os
import selectors
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from waiting import wait_until

from flashckpt.elastic.etcd.client import EtcdClient
from flashckpt.elastic.membership import nodes as membership
from flashckpt.elastic.membership import probes
from flashckpt.elastic.membership.nodes import NodeRecord, NodeRegistry
from flashckpt.elastic.membership.peerlinks import (
    HOLD_ANSWER,
    HOLD_QUESTION,
    LinkTarget,
    PeerLinks,
    read_line,
    ring_successors,
)

LONG_TTL = timedelta(seconds=30)
WAIT_S = 20.0  # well inside LONG_TTL: a loss reported by then was not the lease's lapse


class _Lost:
    """An ``on_lost`` that records what it was told."""

    def __init__(self) -> None:
        self.calls: list[tuple[NodeRecord, str]] = []
        self._lock = threading.Lock()

    def __call__(self, record: NodeRecord, via: str) -> None:
        with self._lock:
            self.calls.append((record, via))

    def of(self, node: str) -> list[str]:
        with self._lock:
            return [via for r, via in self.calls if r.node_id == node]


@pytest.fixture
def make_registry(
    registries: Callable[..., NodeRegistry], etcd_prefix: str
) -> Callable[..., NodeRegistry]:
    """A registry of the test's job, with a lease that outlives the test."""
    return lambda node, **kwargs: registries(etcd_prefix, node, ttl=LONG_TTL, **kwargs)


_PEER_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from datetime import timedelta
    from flashckpt.elastic.etcd.client import EtcdClient
    from flashckpt.elastic.membership.nodes import NodeRegistry

    url, prefix, node = sys.argv[1:4]
    reg = NodeRegistry(EtcdClient(url, timeout=timedelta(seconds=5)), prefix, node,
                       ttl=timedelta(seconds=30), advertise_host="127.0.0.1",
                       bind_host="127.0.0.1")
    reg.start(timedelta(seconds=10))
    print("ready", flush=True)
    while True:
        time.sleep(60)
    """
)


@pytest.fixture
def peer_process(etcd_server: str, etcd_prefix: str) -> Iterator[Callable[[str], int]]:
    """Starts a launcher's registry in a process of its own (to be SIGKILLed); returns its pid.
    Every process is killed at the end, even on failure."""
    procs: list[subprocess.Popen[str]] = []

    def start(node: str) -> int:
        proc = subprocess.Popen(
            [sys.executable, "-c", _PEER_SCRIPT, etcd_server, etcd_prefix, node],
            stdout=subprocess.PIPE,
            text=True,
        )
        procs.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "ready", f"the peer process did not start (exit {proc.poll()})"
        return proc.pid

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()


def test_ring_successors_watch_every_machine_fanout_times() -> None:
    nodes = [f"n{i}" for i in range(7)]
    watchers: dict[str, int] = dict.fromkeys(nodes, 0)
    for own in nodes:
        succ = ring_successors(own, [n for n in nodes if n != own], 2)
        assert len(succ) == 2 and own not in succ
        for n in succ:
            watchers[n] += 1
    assert set(watchers.values()) == {2}, watchers
    assert ring_successors("b", ["a", "c"], 2) == ["c", "a"]
    assert ring_successors("a", ["b"], 2) == ["b"], "fewer peers than the fanout: all of them"
    assert ring_successors("a", [], 2) == []


@pytest.mark.etcd
def test_a_killed_peer_launcher_is_found_dead_by_its_link_long_before_its_lease(
    make_registry: Callable[..., NodeRegistry],
    peer_process: Callable[[str], int],
    etcd_client: EtcdClient,
) -> None:
    lost = _Lost()
    reg = make_registry("a", on_lost=lost)
    pid = peer_process("b")
    wait_until(lambda: reg.linked() == {"b"}, "a link to b", timeout=WAIT_S)
    b_key = reg.key[: -len("a")] + "b"
    assert etcd_client.get_kv(b_key) is not None
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: lost.of("b"), "b reported lost", timeout=WAIT_S)
    found_in = time.monotonic() - killed_at
    assert lost.of("b") == ["link"], "found by the link, once"
    assert found_in < LONG_TTL.total_seconds() / 2
    # Its lease was revoked: the key is gone for every other launcher's watch too.
    assert etcd_client.get_kv(b_key) is None
    assert "b" not in reg.peers() and reg.linked() == set()


@pytest.mark.etcd
def test_without_links_a_killed_peer_waits_for_its_lease(
    make_registry: Callable[..., NodeRegistry],
    peer_process: Callable[[str], int],
    etcd_client: EtcdClient,
) -> None:
    lost = _Lost()
    reg = make_registry("a", on_lost=lost, links=0)
    pid = peer_process("b")
    b = wait_until(lambda: reg.peers().get("b"), "b seen", timeout=WAIT_S)
    b_key = reg.key[: -len("a")] + "b"
    os.kill(pid, signal.SIGKILL)
    # The moment a link would break: b's launcher is gone, its probe port refuses.
    wait_until(
        lambda: membership.probe(b) is membership.ProbeResult.DEAD,
        "b's launcher gone",
        timeout=WAIT_S,
    )
    # Nothing told a: it holds no link, and b's key stays until its 30 s lease lapses.
    assert lost.of("b") == [] and reg.linked() == set()
    assert etcd_client.get_kv(b_key) is not None
    # What the workers' failure does: a probe finds it dead. Its revocation deletes b's key,
    # which a's own watch sees too, maybe before the revocation returns: the loss is still
    # reported once, by the probe that found it (the watch leaves it to the reaper).
    dead = reg.reap_dead_peers()
    assert [r.node_id for r in dead] == ["b"] and lost.of("b") == ["probe"]
    assert etcd_client.get_kv(b_key) is None


@pytest.mark.etcd
@pytest.mark.parametrize("done", [True, False], ids=["workers-done", "stopped"])
def test_a_peer_that_leaves_cleanly_is_not_declared_dead_by_its_link(
    make_registry: Callable[..., NodeRegistry], caplog: pytest.LogCaptureFixture, done: bool
) -> None:
    lost = _Lost()
    reg = make_registry("a", on_lost=lost)
    peer = make_registry("b")
    wait_until(lambda: reg.linked() == {"b"}, "a link to b", timeout=WAIT_S)
    wait_until(lambda: peer.linked() == {"a"}, "a link from b", timeout=WAIT_S)
    # No wait for the watch to see it leaving: the delete's event carries the key's last value
    # (the watch's view may not have applied the put yet when the key goes).
    peer.update(state="leaving", done=done)
    with caplog.at_level("INFO", logger=membership.__name__):
        peer.close()  # revokes its lease first, then closes the links it holds
        wait_until(lambda: lost.of("b"), "b's departure seen", timeout=WAIT_S)
        time.sleep(1.0)  # the link's probe, had it found the key, would have reported by now
    assert lost.of("b") == ["watch"]
    # What it published on leaving reached the watch.
    assert [(r.state, r.done) for r, _ in lost.calls if r.node_id == "b"] == [("leaving", done)]
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if "declaring it dead" in m]
    # The log says whether its workers finished or were taken out of their round.
    said = "left the job, its workers done" if done else "left the job before its workers"
    assert [m for m in messages if said in m], messages
    assert reg.linked() == set()


@pytest.mark.etcd
def test_links_follow_the_ring_and_a_restarted_peer_is_linked_afresh(
    make_registry: Callable[..., NodeRegistry],
) -> None:
    regs = {n: make_registry(n, links=1) for n in ("a", "b", "c")}
    for own, succ in (("a", "b"), ("b", "c"), ("c", "a")):
        wait_until(
            lambda o=own, s=succ: regs[o].linked() == {s}, f"{own} linked to {succ}", timeout=WAIT_S
        )
    old_b = regs["b"].record.token
    regs["b"].close()
    wait_until(lambda: regs["a"].linked() == {"c"}, "a linked to c once b left", timeout=WAIT_S)
    regs["b"] = make_registry("b", links=1)
    assert regs["b"].record.token != old_b
    wait_until(lambda: regs["a"].linked() == {"b"}, "a linked to the new b", timeout=WAIT_S)


def test_the_probe_server_holds_a_bounded_number_of_links(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(probes, "_MAX_HELD", 2)
    server = probes._ProbeServer("tok", "127.0.0.1")
    socks: list[socket.socket] = []
    try:

        def hold() -> bytes:
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            socks.append(sock)
            assert read_line(sock, 64) == b"tok\n"
            sock.sendall(HOLD_QUESTION)
            return read_line(sock, len(HOLD_ANSWER))

        assert hold() == HOLD_ANSWER and hold() == HOLD_ANSWER
        assert hold() == b"", "over the bound: closed, not held"
        wait_until(lambda: server.held == 2, "two links held", timeout=WAIT_S)
        socks[0].close()  # a holder that goes away frees its place
        wait_until(lambda: server.held == 1, "its place freed", timeout=WAIT_S)
        assert hold() == HOLD_ANSWER
        # A probe is answered as ever while links are held.
        record = NodeRecord("x", "h", 1, "tok", f"127.0.0.1:{server.port}")
        assert membership.probe(record) is membership.ProbeResult.ALIVE
        # Closing the server closes the links it held: their holders read EOF.
        server.close()
        assert socks[-1].recv(1) == b""
    finally:
        server.close()
        for sock in socks:
            sock.close()


def test_a_peer_that_never_answers_holds_up_only_its_own_link() -> None:
    # A target that accepts the connection and then says nothing (a stopped process, a machine
    # whose launcher hangs) must not hold up the other links: the live peer is linked while the
    # silent one still waits out its (long) connect timeout, and its kill is seen at once.
    silent = socket.create_server(("127.0.0.1", 0))
    live = probes._ProbeServer("live", "127.0.0.1")
    broken: list[tuple[str, str]] = []
    links = PeerLinks(lambda t, why: broken.append((t.node_id, why)), connect_timeout=60)
    try:
        links.set_targets(
            [
                LinkTarget("silent", "s", f"127.0.0.1:{silent.getsockname()[1]}"),
                LinkTarget("live", "live", f"127.0.0.1:{live.port}"),
            ]
        )
        wait_until(lambda: links.held() == {"live"}, "the live peer's link held", timeout=WAIT_S)
        live.close()  # its launcher gone: its link closes
        wait_until(lambda: broken, "the live peer's link seen broken", timeout=WAIT_S)
        assert broken == [("live", "its link closed")]
        assert links.held() == set()
    finally:
        links.close()
        live.close()
        silent.close()


def test_a_held_link_says_at_once_whether_it_is_intact(monkeypatch: pytest.MonkeyPatch) -> None:
    # The sweep before a new round trusts an intact link instead of a probe; a link whose peer
    # closed it is not intact, even before the link thread read the close.
    monkeypatch.setattr(
        PeerLinks, "_readable", lambda self, target, sock: self._selector.unregister(sock)
    )
    server = probes._ProbeServer("tok", "127.0.0.1")
    links = PeerLinks(lambda t, why: None)
    try:
        assert not links.intact("tok"), "not held yet"
        links.set_targets([LinkTarget("b", "tok", f"127.0.0.1:{server.port}")])
        wait_until(lambda: links.held() == {"b"}, "the link held", timeout=WAIT_S)
        assert links.intact("tok") and not links.intact("other")
        server.close()  # its launcher gone; the link thread (patched) does not look
        wait_until(lambda: not links.intact("tok"), "the closed link seen", timeout=WAIT_S)
        assert links.held() == {"b"}, "the link thread did not drop it: the look did not wait"
    finally:
        links.close()
        server.close()


def test_a_probe_is_answered_while_other_connections_have_not_asked_anything() -> None:
    # Linkers on a loaded host may take a while to ask after the token: the probe port answers
    # a probe meanwhile (it waited for each connection's question in turn: 0.5 s each, so a
    # probe behind a dozen slow linkers timed out and learnt nothing).
    server = probes._ProbeServer("tok", "127.0.0.1")
    silent: list[socket.socket] = []
    try:
        for _ in range(12):
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            silent.append(sock)
        record = NodeRecord("x", "h", 1, "tok", f"127.0.0.1:{server.port}")
        assert membership.probe(record, timeout=5.0) is membership.ProbeResult.ALIVE
        assert all(read_line(sock, 64) == b"tok\n" for sock in silent), "each got the token"
    finally:
        server.close()
        for sock in silent:
            sock.close()


def test_an_idle_probe_port_and_link_thread_sleep_without_a_timer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Issue 31: a host of 1,024 simulated machines woke each one's probe-port thread and link
    # thread every second for nothing (2,048 wake-ups a second on 2 cores). With nothing to
    # time out (no connection waiting to ask, no link waiting to be retried), both sleep until
    # a socket or a wake-up says something happened.
    waits: dict[str, list[float | None]] = {}
    base = selectors.DefaultSelector

    class Recording(base):  # type: ignore[valid-type,misc]
        def select(self, timeout: float | None = None) -> Any:
            waits.setdefault(threading.current_thread().name, []).append(timeout)
            return super().select(timeout)

    monkeypatch.setattr(selectors, "DefaultSelector", Recording)
    server = probes._ProbeServer("tok", "127.0.0.1")
    links = PeerLinks(lambda t, why: None)
    try:
        links.set_targets([LinkTarget("b", "tok", f"127.0.0.1:{server.port}")])
        wait_until(lambda: links.held() == {"b"}, "the link held", timeout=WAIT_S)

        def last(thread: str) -> object:
            return (waits.get(thread) or [0.0])[-1]

        wait_until(
            lambda: last("flashckpt-probe") is None and last("flashckpt-node-links") is None,
            "both threads asleep without a timeout",
            timeout=WAIT_S,
        )
        # Still awake for what matters: a probe is answered, the link's end is seen.
        record = NodeRecord("b", "h", 1, "tok", f"127.0.0.1:{server.port}")
        assert membership.probe(record, timeout=5.0) is membership.ProbeResult.ALIVE
        server.close()
        wait_until(lambda: links.held() == set(), "the closed link dropped", timeout=WAIT_S)
    finally:
        links.close()
        server.close()
