"""Lease keep-alives on one ``LeaseKeepAlive`` stream per client (issue 31).

``EtcdClient.refresh_lease`` sends every renewal of a process on one long-lived gRPC stream
instead of one gateway request each; its signature and errors are those of a request: a
timeout raises ``EtcdTimeout``, a broken stream is opened again by the next attempt, a renewal
etcd did not confirm is never reported, and TTL 0 (a revoked or expired lease) raises
``EtcdLeaseNotFound``. Against a real etcd, through a TCP relay that counts connections and
breaks them; the matching of answers to requests against a fake etcd on a socket pair.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
from collections.abc import Iterator
from datetime import timedelta

import pytest
from tcprelay import TcpRelay
from waiting import wait_until

from flashckpt.elastic.deadline import Deadline
from flashckpt.elastic.etcd._leasestream import (
    _BDP_PING,
    KeepAliveStream,
    _StreamBroken,
    keepalive_frame,
    keepalive_request,
    parse_keepalive_response,
)
from flashckpt.elastic.etcd.client import (
    EtcdClient,
    EtcdLeaseNotFound,
    EtcdTimeout,
    EtcdUnavailable,
)

TTL = timedelta(seconds=30)


@pytest.fixture
def relay(etcd_server: str) -> Iterator[TcpRelay]:
    proxy = TcpRelay(etcd_server)
    try:
        yield proxy
    finally:
        proxy.close()


@pytest.fixture
def relayed(relay: TcpRelay) -> Iterator[EtcdClient]:
    """A client that reaches etcd through the relay only."""
    client = EtcdClient(relay.url, timeout=timedelta(seconds=10))
    try:
        yield client
    finally:
        client.close()


@pytest.mark.etcd
def test_renewals_of_every_lease_share_one_stream_and_a_broken_one_is_opened_again(
    etcd_client: EtcdClient, relay: TcpRelay, relayed: EtcdClient
) -> None:
    leases = [etcd_client.grant_lease(TTL) for _ in range(3)]
    for _ in range(10):
        for lease in leases:
            assert relayed.refresh_lease(lease) == TTL
    stats = relayed.connection_stats()
    assert (stats.keepalive_streams, stats.opened, relay.accepted) == (1, 0, 1)

    # Closed by the peer (a FIN, then an RST alone): the next renewal goes on a new stream,
    # whether or not the client saw the close before it sent.
    for reset, streams in ((False, 2), (True, 3)):
        relay.drop_all(reset=reset)
        assert relayed.refresh_lease(leases[0]) == TTL
        assert relayed.connection_stats().keepalive_streams == relay.accepted == streams
    for lease in leases:
        etcd_client.revoke_lease(lease)


@pytest.mark.etcd
def test_a_renewal_whose_answer_is_lost_fails_and_the_next_one_reconnects(
    etcd_client: EtcdClient, relay: TcpRelay, relayed: EtcdClient
) -> None:
    lease = etcd_client.grant_lease(TTL)
    assert relayed.refresh_lease(lease) == TTL
    # Nothing comes back: a timeout, as for a request; and the silent stream is not kept.
    relay.blackhole = True
    with pytest.raises(EtcdTimeout, match="keep-alive"):
        relayed.refresh_lease(lease, timeout=timedelta(seconds=1))
    relay.blackhole = False
    assert relayed.refresh_lease(lease) == TTL
    assert relayed.connection_stats().keepalive_streams == relay.accepted == 2
    # Every connection closed at etcd's first answer: retried until the deadline, then a
    # failure, never a renewal reported.
    relay.lose_answers = True
    with pytest.raises(EtcdUnavailable):
        relayed.refresh_lease(lease, timeout=timedelta(seconds=1))
    relay.lose_answers = False
    assert relayed.refresh_lease(lease) == TTL
    etcd_client.revoke_lease(lease)


@pytest.mark.etcd
def test_a_revoked_or_unknown_lease_reports_it_is_gone(
    etcd_server: str, etcd_client: EtcdClient
) -> None:
    client = EtcdClient(etcd_server, timeout=timedelta(seconds=10))
    lease = etcd_client.grant_lease(TTL)
    assert client.refresh_lease(lease) == TTL
    etcd_client.revoke_lease(lease)
    with pytest.raises(EtcdLeaseNotFound, match="expired or was revoked"):
        client.refresh_lease(lease)
    with pytest.raises(EtcdLeaseNotFound):
        client.refresh_lease(12345)
    assert client.connection_stats().keepalive_streams == 1
    client.close()


@pytest.mark.etcd
def test_a_forked_child_renews_on_a_stream_of_its_own(
    etcd_client: EtcdClient, relay: TcpRelay, relayed: EtcdClient
) -> None:
    lease = etcd_client.grant_lease(TTL)
    assert relayed.refresh_lease(lease) == TTL
    pid = os.fork()
    if pid == 0:  # the child: the parent's stream is not its to write on
        code = 1
        try:
            if relayed.refresh_lease(lease) == TTL:
                code = 0 if relayed.connection_stats().keepalive_streams == 1 else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    # The parent's stream was left alone and carries the parent's next renewal.
    assert relayed.refresh_lease(lease) == TTL
    assert relayed.connection_stats().keepalive_streams == 1 and relay.accepted == 2
    etcd_client.revoke_lease(lease)


@pytest.mark.etcd
def test_threads_renewing_different_leases_get_their_own_answers(
    etcd_server: str, etcd_client: EtcdClient
) -> None:
    # Each lease has a TTL of its own, so an answer handed to the wrong thread shows.
    client = EtcdClient(etcd_server, timeout=timedelta(seconds=30))
    leases = [etcd_client.grant_lease(timedelta(seconds=10 + i)) for i in range(16)]
    errors: list[BaseException] = []
    go = threading.Event()

    def renew(i: int) -> None:
        go.wait()
        try:
            for _ in range(20):
                ttl = client.refresh_lease(leases[i])
                assert ttl == timedelta(seconds=10 + i), (i, ttl)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=renew, args=(i,)) for i in range(len(leases))]
    for thread in threads:
        thread.start()
    go.set()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors[:3]
    assert client.connection_stats().keepalive_streams == 1
    client.close()
    for lease in leases:
        etcd_client.revoke_lease(lease)


class _Http1Proxy:
    """A proxy in front of etcd that speaks HTTP/1.1 only: it answers an HTTP/2 connection
    preface with ``400 Bad Request`` and relays everything else."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.split("//")[1].rsplit(":", 1)
        self._upstream = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self.refused = 0
        self._socks: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self._listener.accept()
            except OSError:
                return
            first = down.recv(65536)
            if first.startswith(b"PRI * HTTP/2.0"):
                self.refused += 1
                down.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
                down.close()
                continue
            up = socket.create_connection(self._upstream)
            up.sendall(first)
            self._socks += [down, up]
            for src, dst in ((down, up), (up, down)):
                thread = threading.Thread(target=self._pump, args=(src, dst), daemon=True)
                self._threads.append(thread)
                thread.start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for sock in self._socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for thread in self._threads:
            thread.join(timeout=10)
        for sock in self._socks:
            sock.close()


@pytest.mark.etcd
def test_behind_a_proxy_that_speaks_http1_only_renewals_go_as_gateway_requests(
    etcd_server: str, etcd_client: EtcdClient
) -> None:
    proxy = _Http1Proxy(etcd_server)
    client = EtcdClient(proxy.url, timeout=timedelta(seconds=10))
    try:
        lease = etcd_client.grant_lease(TTL)
        for _ in range(3):
            assert client.refresh_lease(lease) == TTL
        stats = client.connection_stats()
        # One stream tried and refused, then gateway requests on one pooled connection.
        assert (proxy.refused, stats.keepalive_streams, stats.opened) == (1, 1, 1)
        assert stats.reused == 2
        etcd_client.revoke_lease(lease)
        with pytest.raises(EtcdLeaseNotFound):
            client.refresh_lease(lease)
    finally:
        client.close()
        proxy.close()


# ------------------------------------------------------------- against a fake etcd


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return (
        struct.pack(">I", len(payload))[1:]
        + bytes([kind, flags])
        + struct.pack(">I", stream)
        + payload
    )


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 128:
        out.append((value & 127) | 128)
        value >>= 7
    return bytes([*out, value])


def _answer(lease_id: int, ttl: int) -> bytes:
    """A DATA frame with one ``LeaseKeepAliveResponse`` (with a header, as etcd sends)."""
    message = b"\x0a\x04\x08\x01\x10\x02" + b"\x10" + _varint(lease_id) + b"\x18" + _varint(ttl)
    return _frame(0, 0, 1, b"\x00" + struct.pack(">I", len(message)) + message)


class _FakeEtcd:
    """The server end of a socket pair: reads the client's frames, answers by hand."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = bytearray()
        preface = self._take(24)
        assert preface.startswith(b"PRI * HTTP/2.0"), preface
        sock.sendall(_frame(4, 0, 0))  # the server's SETTINGS

    def _take(self, size: int) -> bytes:
        while len(self.buffer) < size:
            data = self.sock.recv(65536)
            assert data, "the client closed the connection"
            self.buffer += data
        out = bytes(self.buffer[:size])
        del self.buffer[:size]
        return out

    def next_frame(self) -> tuple[int, int, bytes]:
        """The next frame the client sent: ``(type, flags, payload)``."""
        head = self._take(9)
        return head[3], head[4], self._take(int.from_bytes(head[:3], "big"))

    def next_request(self) -> int:
        """The lease ID of the next keep-alive the client sent (other frames skipped)."""
        while True:
            head = self._take(9)
            payload = self._take(int.from_bytes(head[:3], "big"))
            if head[3] == 0:  # DATA: a gRPC message of LeaseKeepAliveRequest{ID}
                assert payload[5] == 0x08, payload
                value, shift = 0, 0
                for byte in payload[6:]:
                    value |= (byte & 127) << shift
                    shift += 7
                return value


@pytest.fixture
def fake() -> Iterator[tuple[KeepAliveStream, _FakeEtcd]]:
    client_end, server_end = socket.socketpair()
    stream = KeepAliveStream(client_end, "etcd:2379", "fake etcd", Deadline.after(TTL))
    try:
        yield stream, _FakeEtcd(server_end)
    finally:
        stream.close()
        server_end.close()


def _renew_in_thread(
    stream: KeepAliveStream, lease: int, seconds: float
) -> tuple[threading.Thread, list[int | BaseException | None]]:
    outcome: list[int | BaseException | None] = []

    def renew() -> None:
        try:
            outcome.append(stream.renew(lease, Deadline.after(timedelta(seconds=seconds))))
        except _StreamBroken as exc:
            outcome.append(exc)

    thread = threading.Thread(target=renew)
    thread.start()
    return thread, outcome


def test_a_late_answer_is_dropped_and_the_next_call_waits_for_it_then_gets_its_own(
    fake: tuple[KeepAliveStream, _FakeEtcd],
) -> None:
    stream, etcd = fake
    lease, other = 0x7E57, 0x0BE7
    earlier, earlier_outcome = _renew_in_thread(stream, other, 30)
    assert etcd.next_request() == other
    # (1.5 s: the earlier answer below must come before this deadline, even on a loaded host.)
    first, first_outcome = _renew_in_thread(stream, lease, 1.5)
    assert etcd.next_request() == lease
    # etcd answers in order: the earlier request's answer comes while the first call waits,
    # so the stream is slow, not stuck, and stays open.
    etcd.sock.sendall(_answer(other, 5))
    earlier.join()
    first.join()
    assert earlier_outcome == [5]
    assert first_outcome == [None], "no answer came: the call reports none"
    assert not stream.broken

    second, second_outcome = _renew_in_thread(stream, lease, 30)
    etcd.sock.sendall(_answer(lease, 7))  # the first request's answer, after its caller left
    assert etcd.next_request() == lease
    etcd.sock.sendall(_answer(lease, 9))
    second.join()
    assert second_outcome == [9], "the late answer (7) was taken for the second call's"
    assert stream.answers == 3 and not stream.broken


def test_a_call_that_gets_no_answer_on_a_stuck_stream_closes_it(
    fake: tuple[KeepAliveStream, _FakeEtcd],
) -> None:
    stream, etcd = fake
    # Past the stuck time (no TTL answered yet: the floor) with no answer at all.
    thread, outcome = _renew_in_thread(stream, 0xA, stream.stuck_after() + 0.5)
    assert etcd.next_request() == 0xA
    etcd.sock.sendall(_frame(6, 0, 0, b"12345678"))  # a PING is no answer
    thread.join()
    assert outcome == [None]
    assert stream.broken, "a stream that answered nothing since the request was kept"
    with pytest.raises(_StreamBroken):
        stream.renew(0xB, Deadline.after(timedelta(seconds=5)))


def test_an_answer_for_another_lease_breaks_the_stream_instead_of_renewing(
    fake: tuple[KeepAliveStream, _FakeEtcd],
) -> None:
    stream, etcd = fake
    thread, outcome = _renew_in_thread(stream, 0xA, 30)
    assert etcd.next_request() == 0xA
    etcd.sock.sendall(_answer(0xB, 60))
    thread.join()
    assert len(outcome) == 1 and isinstance(outcome[0], _StreamBroken), outcome
    assert "lease b where lease a's was due" in str(outcome[0])
    assert stream.broken


def test_a_slow_answer_within_the_stuck_time_keeps_the_stream(
    fake: tuple[KeepAliveStream, _FakeEtcd],
) -> None:
    """A loaded etcd (or reader thread) that answers after the caller gave up, well within the
    lease, is slow, not stuck: the stream stays, no new connection (issue 31: a fixed 0.25 s
    opened 801 streams for 128 clients at 1,024 machines)."""
    stream, etcd = fake
    lease = 0x51
    thread, outcome = _renew_in_thread(stream, lease, 5)
    assert etcd.next_request() == lease
    etcd.sock.sendall(_answer(lease, 10))  # a lease of 10 s: stuck after 1 s
    thread.join()
    assert outcome == [10] and stream.stuck_after() == 1.0
    # The caller gives up after 0.4 s (more than the old 0.25 s), the answer comes after it.
    thread, outcome = _renew_in_thread(stream, lease, 0.4)
    assert etcd.next_request() == lease
    thread.join()
    assert outcome == [None], "no answer came: the call reports none"
    assert not stream.broken, "a stream slower than the caller's patience was closed"
    etcd.sock.sendall(_answer(lease, 10))  # the late answer, dropped
    thread, outcome = _renew_in_thread(stream, lease, 30)
    assert etcd.next_request() == lease
    etcd.sock.sendall(_answer(lease, 10))
    thread.join()
    assert outcome == [10] and stream.answers == 3 and not stream.broken


def test_the_stream_has_no_thread_a_waiting_caller_reads_its_answer(
    fake: tuple[KeepAliveStream, _FakeEtcd],
) -> None:
    """No reader thread per stream (issue 31: one per simulated machine): the caller waiting
    for an answer reads the socket; the others get theirs from it or take over the reading."""
    stream, etcd = fake
    assert not [t for t in threading.enumerate() if t.name == "etcd-keepalive-stream"]
    threads = [_renew_in_thread(stream, lease, 30) for lease in (0x1, 0x2, 0x3)]
    asked = [etcd.next_request() for _ in threads]
    for lease in asked:  # answered in the order asked, whoever reads them
        etcd.sock.sendall(_answer(lease, 5))
    for thread, outcome in threads:
        thread.join()
        assert outcome == [5]
    assert stream.answers == 3 and not stream.broken
    # What came while nobody waited (a PING) is read by the next caller, and answered.
    etcd.sock.sendall(_frame(6, 0, 0, b"pingpong"))
    thread, outcome = _renew_in_thread(stream, 0x4, 30)
    assert etcd.next_request() == 0x4
    etcd.sock.sendall(_answer(0x4, 5))
    thread.join()
    assert outcome == [5]


def test_a_kept_request_is_waited_for_again_not_sent_again(
    fake: tuple[KeepAliveStream, _FakeEtcd],
) -> None:
    """A lease's sole renewer waits for one renewal in slices (``keep``): the request stays
    on the wire between them and the next call takes its answer and its send time."""
    stream, etcd = fake
    lease = 0x6B
    first = stream.renew_sent(lease, Deadline.after(timedelta(seconds=0.2)), keep=True)
    assert first is None
    assert etcd.next_request() == lease
    assert not stream.broken
    etcd.sock.sendall(_answer(lease, 8))  # late: nobody waits for it now
    second = stream.renew_sent(lease, Deadline.after(timedelta(seconds=30)), keep=True)
    assert second is not None and second[0] == 8
    etcd.sock.setblocking(False)
    with pytest.raises(BlockingIOError):
        etcd.sock.recv(1)  # the second call sent nothing: it took the first one's answer
    etcd.sock.setblocking(True)
    # Still in flight when a slice ends, answered during the next one: one request.
    third = stream.renew_sent(lease, Deadline.after(timedelta(seconds=0.2)), keep=True)
    assert third is None and etcd.next_request() == lease
    thread, outcome = _renew_in_thread(stream, lease, 30)  # a plain call adopts it as well
    etcd.sock.sendall(_answer(lease, 9))
    thread.join()
    assert outcome == [9] and stream.answers == 2 and not stream.broken


def test_the_cached_request_frame_is_the_freshly_encoded_one() -> None:
    """A lease's keep-alive DATA frame is encoded once and reused: the same bytes as one
    encoded from scratch, for any lease ID (negative ones are ten-byte varints on the wire)."""
    for lease in (0, 1, 127, 128, 0x7E57, 2**31, 2**63 - 1, -1, -(2**63)):
        message = keepalive_request(lease)
        fresh = _frame(0, 0, 1, message)
        assert keepalive_frame(lease) == fresh
        assert keepalive_frame(lease) is keepalive_frame(lease)  # from the cache
        unsigned = lease & (2**64 - 1)
        assert message[5] == 0x08 and int.from_bytes(message[1:5], "big") == len(message) - 5
        value, shift = 0, 0
        for byte in message[6:]:
            value |= (byte & 127) << shift
            shift += 7
        assert value == unsigned


def test_a_bdp_ping_is_acked_with_the_next_request_any_other_ping_at_once(
    fake: tuple[KeepAliveStream, _FakeEtcd],
) -> None:
    """grpc-go's BDP ping (after a request etcd receives) is acked in the same write as the
    next request, after it, not in a write of its own; any other PING is acked as soon as it
    is read."""
    stream, etcd = fake
    thread, outcome = _renew_in_thread(stream, 0x5, 30)
    assert etcd.next_request() == 0x5
    etcd.sock.sendall(_frame(8, 0, 0, struct.pack(">I", 44)) + _frame(6, 0, 0, _BDP_PING))
    etcd.sock.sendall(_answer(0x5, 5))
    thread.join()
    assert outcome == [5]
    assert etcd.next_frame() == (4, 1, b""), "the fake's SETTINGS, acked when first read"
    etcd.sock.setblocking(False)
    with pytest.raises(BlockingIOError):
        etcd.sock.recv(1)  # nothing else written since the request: the ack waits
    etcd.sock.setblocking(True)
    thread, outcome = _renew_in_thread(stream, 0x5, 30)
    kind, _, payload = etcd.next_frame()
    assert (kind, payload[5:]) == (0, b"\x08\x05"), "the request, then (same write) the ack"
    assert etcd.next_frame() == (6, 1, _BDP_PING)
    # Another PING (a keep-alive probe, any payload) while a request waits: acked at once,
    # before its answer is sent.
    etcd.sock.sendall(_frame(6, 0, 0, b"12345678"))
    assert etcd.next_frame() == (6, 1, b"12345678")
    etcd.sock.sendall(_answer(0x5, 5))
    thread.join()
    assert outcome == [5] and not stream.broken


@pytest.mark.parametrize(
    ("data", "why"),
    [
        # A LeaseKeepAliveResponse whose TTL varint never ends.
        (_frame(0, 0, 1, b"\x00\x00\x00\x00\x03\x10\x05\x98"), "truncated"),
        # A TTL field with no value.
        (_frame(0, 0, 1, b"\x00\x00\x00\x00\x03\x10\x05\x18"), "truncated"),
        # A compressed gRPC message (none was asked for).
        (_frame(0, 0, 1, b"\x01\x00\x00\x00\x02\x10\x05"), "compressed"),
        # A length field running past the message.
        (_frame(0, 0, 1, b"\x00\x00\x00\x00\x04\x0a\x09\x08\x01"), "truncated"),
        # Wire type 7 does not exist.
        (_frame(0, 0, 1, b"\x00\x00\x00\x00\x02\x0f\x00"), "wire type"),
        # A gRPC message declared 4 GiB long: failed at once, not buffered while it comes.
        (_frame(0, 0, 1, b"\x00\xff\xff\xff\xff\x08\x05"), "a gRPC message of 4294967295 bytes"),
        # Just past the bound, MAX_KEEPALIVE_ANSWER (64 KiB; a LeaseKeepAliveResponse is ~70
        # bytes).
        (_frame(0, 0, 1, b"\x00" + struct.pack(">I", 65537)), "a gRPC message of 65537 bytes"),
        # A PING's payload is exactly 8 bytes (RFC 9113 6.7), an ack's too.
        (_frame(6, 0, 0, b"1234567"), "PING of 7 bytes"),
        (_frame(6, 0, 0, b"123456789"), "PING of 9 bytes"),
        (_frame(6, 1, 0, b""), "PING of 0 bytes"),
    ],
)
def test_a_malformed_answer_breaks_the_stream_and_renews_nothing(
    fake: tuple[KeepAliveStream, _FakeEtcd], data: bytes, why: str
) -> None:
    stream, etcd = fake
    thread, outcome = _renew_in_thread(stream, 0x5, 30)
    assert etcd.next_request() == 0x5
    etcd.sock.sendall(data)
    thread.join()
    assert len(outcome) == 1 and isinstance(outcome[0], _StreamBroken), outcome
    assert why in str(outcome[0])
    assert stream.broken


def test_a_request_without_room_in_etcds_window_waits_for_its_update(
    fake: tuple[KeepAliveStream, _FakeEtcd],
) -> None:
    """Flow control: a request waits while etcd's stream window has no room for it, and is
    sent when a WINDOW_UPDATE read by another waiting caller opens it."""
    stream, etcd = fake
    etcd.sock.sendall(_frame(4, 0, 0, struct.pack(">HI", 0x4, 0)))  # initial window 0
    reader, reader_outcome = _renew_in_thread(stream, 0x1, 30)  # room before SETTINGS is read
    assert etcd.next_request() == 0x1
    assert etcd.next_frame() == (4, 1, b"")  # the first SETTINGS' ack
    assert etcd.next_frame() == (4, 1, b"")  # the window's: now below 0 on the stream
    waiter, waiter_outcome = _renew_in_thread(stream, 0x2, 30)  # no room: waits, does not read
    wait_until(lambda: 0x2 in stream._busy, "the second request to wait for room", 10)
    etcd.sock.setblocking(False)
    with pytest.raises(BlockingIOError):
        etcd.sock.recv(1)
    etcd.sock.setblocking(True)
    etcd.sock.sendall(_frame(8, 0, 1, struct.pack(">I", 100)))  # read by the first caller
    etcd.sock.settimeout(10)  # (the first caller reads until its answer, 30 s)
    assert etcd.next_request() == 0x2, "the window update did not wake the waiting request"
    etcd.sock.settimeout(None)
    etcd.sock.sendall(_answer(0x1, 5) + _answer(0x2, 6))
    reader.join()
    waiter.join()
    assert (reader_outcome, waiter_outcome) == ([5], [6]) and not stream.broken


def test_a_keepalive_answer_is_parsed_field_by_field_and_checked() -> None:
    header = b"\x0a\x14\x08" + b"\xff" * 8 + b"\x01\x10" + b"\xff" * 8 + b"\x01"
    ten = b"\xff" * 9 + b"\x01"  # -1 as an int64 varint
    assert parse_keepalive_response(header + b"\x10\x85\x01\x18\x3c") == (133, 60)
    assert parse_keepalive_response(b"") == (0, 0)  # proto3: absent fields are 0
    assert parse_keepalive_response(b"\x10" + ten + b"\x18\x00") == (-1, 0)
    # Unknown fields of every wire type are skipped; a field number over 3 changes nothing.
    skipped = b"\x20\x07" + b"\x29" + bytes(8) + b"\x35" + bytes(4) + b"\x3a\x02ab"
    assert parse_keepalive_response(skipped + b"\x10\x02\x18\x03") == (2, 3)
    for bad, why in (
        (b"\x10" + b"\xff" * 10 + b"\x01", "truncated protobuf varint"),  # 11 bytes
        (b"\x10\xff", "truncated protobuf varint"),
        (b"\x29" + bytes(7), "truncated keep-alive answer"),
        (b"\x0a\x05ab", "truncated keep-alive answer"),
        (b"\x13", "wire type 3"),
    ):
        with pytest.raises(ValueError, match=why):
            parse_keepalive_response(bad)
