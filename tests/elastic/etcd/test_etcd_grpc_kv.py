"""Key-value calls over gRPC (issue 31): ``EtcdClient``'s range, put, delete-range and txn (and
lease grants and revokes) go as unary gRPC calls on one HTTP/2 connection per client instead
of JSON-gateway requests, with the gateway's answers, errors and retry rules.

Without a server: the HPACK decoder against RFC 7541's examples, and malformed input refused
(HPACK blocks, protobuf answers). Against a real etcd: both transports answer the same JSON;
calls of many threads share one connection; a transaction whose answer is lost raises
``EtcdOutcomeUnknown`` and is not sent again; a connection etcd closed or lost in a restart is
opened again; an endpoint that does not speak HTTP/2 gets the calls as gateway requests.
"""

from __future__ import annotations

import base64
import gc
import http.server
import os
import socket
import threading
import urllib.request
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from tcprelay import TcpRelay
from waiting import wait_until

from flashckpt.elastic.deadline import Deadline
from flashckpt.elastic.etcd import _hpack, _kvproto
from flashckpt.elastic.etcd._grpckv import CallFailed, GrpcChannel, GrpcError, NotHttp2
from flashckpt.elastic.etcd._hpack import HpackDecoder, HpackError, huffman_decode
from flashckpt.elastic.etcd.client import EtcdClient, EtcdOutcomeUnknown
from flashckpt.elastic.etcd.server import EtcdV3Server


def _b64(data: bytes | str) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


# --------------------------------------------------------------------------- without a server


def test_the_hpack_decoder_reads_the_rfc_examples() -> None:
    # RFC 7541 C.4.1: Huffman-coded strings.
    assert huffman_decode(bytes.fromhex("f1e3c2e5f23a6ba0ab90f4ff")) == b"www.example.com"
    assert huffman_decode(bytes.fromhex("a8eb10649cbf")) == b"no-cache"
    assert huffman_decode(bytes.fromhex("25a849e95ba97d7f")) == b"custom-key"
    assert huffman_decode(bytes.fromhex("25a849e95bb8e8b4bf")) == b"custom-value"
    # C.4.1-C.4.3: three requests on one connection (static and dynamic table, Huffman).
    decoder = HpackDecoder()
    first = decoder.decode(bytes.fromhex("828684418cf1e3c2e5f23a6ba0ab90f4ff"))
    assert first == [
        (":method", "GET"),
        (":scheme", "http"),
        (":path", "/"),
        (":authority", "www.example.com"),
    ]
    second = decoder.decode(bytes.fromhex("828684be5886a8eb10649cbf"))
    assert second == [*first, ("cache-control", "no-cache")]
    third = decoder.decode(bytes.fromhex("828785bf408825a849e95ba97d7f8925a849e95bb8e8b4bf"))
    assert third == [
        (":method", "GET"),
        (":scheme", "https"),
        (":path", "/index.html"),
        (":authority", "www.example.com"),
        ("custom-key", "custom-value"),
    ]


@pytest.mark.parametrize(
    ("block", "why"),
    [
        ("80", "index 0"),
        ("c0", "index 64 with an empty dynamic table"),
        ("3fe21f", "a table size update over the 4096 allowed"),
        ("0085f1e3c2e5f2", "a Huffman string cut short (its padding is not all ones)"),
        ("000a61", "a string past the end of its block"),
        ("ff8080808080", "an integer over 2**32"),
    ],
)
def test_the_hpack_decoder_refuses_malformed_blocks(block: str, why: str) -> None:
    with pytest.raises(HpackError):
        HpackDecoder().decode(bytes.fromhex(block))


def test_protobuf_answers_are_validated() -> None:
    txn = _kvproto.METHODS["/v3/kv/txn"][2]
    good = bytes.fromhex("1001") + b"\x1a\x02\x0a\x00"  # succeeded, one empty response_range
    assert _kvproto.decode(txn, good) == {"succeeded": True, "responses": [{"response_range": {}}]}
    for bad in (
        b"\x10",  # a varint cut short
        b"\x10" + b"\xff" * 10 + b"\x01",  # a varint over 10 bytes
        b"\x1a\x05\x0a\x00",  # a field longer than its message
        b"\x12\x00",  # succeeded (a bool) sent length-delimited
    ):
        with pytest.raises(ValueError):
            _kvproto.decode(txn, bad)
    nested = b""
    for _ in range(20):  # transactions nested 20 deep
        op = b"\x22" + bytes([len(nested)]) + nested
        nested = b"\x1a" + bytes([len(op)]) + op
    with pytest.raises(ValueError, match="nested"):
        _kvproto.decode(txn, nested)
    with pytest.raises(_kvproto.Untranslatable):
        _kvproto.encode(_kvproto.METHODS["/v3/kv/range"][1], {"key": _b64("k"), "nope": 1})


# --------------------------------------------------------------------------- against etcd


@pytest.fixture
def both(etcd_server: str) -> Iterator[tuple[EtcdClient, EtcdClient]]:
    """A client over gRPC and one over the gateway, of the shared server."""
    grpc = EtcdClient(etcd_server, timeout=timedelta(seconds=10), grpc_kv=True)
    gateway = EtcdClient(etcd_server, timeout=timedelta(seconds=10), grpc_kv=False)
    try:
        yield grpc, gateway
    finally:
        grpc.close()
        gateway.close()


@pytest.mark.etcd
def test_grpc_and_gateway_answer_the_same(
    both: tuple[EtcdClient, EtcdClient], etcd_prefix: str
) -> None:
    grpc, gateway = both
    lease = grpc.grant_lease(timedelta(seconds=30))
    big = bytes(range(256)) * 800  # 200 KiB: past the first flow-control windows and frames
    for i in range(5):
        grpc.put(f"{etcd_prefix}k{i}", f"v{i}", lease=lease if i % 2 else None)
    grpc.put(etcd_prefix + "big", big)
    assert grpc.get(etcd_prefix + "big") == gateway.get(etcd_prefix + "big")
    assert grpc.get_kv(etcd_prefix + "big").value == big  # type: ignore[union-attr]
    start, end = _b64(etcd_prefix), _b64(etcd_prefix + "\xff")
    revision = grpc.revision()
    reads: list[tuple[str, dict[str, Any]]] = [
        ("/v3/kv/range", {"key": start, "range_end": end}),
        ("/v3/kv/range", {"key": start, "range_end": end, "limit": "2", "keys_only": True}),
        ("/v3/kv/range", {"key": start, "range_end": end, "count_only": True}),
        (
            "/v3/kv/range",
            {"key": start, "range_end": end, "sort_order": "DESCEND", "sort_target": "MOD"},
        ),
        ("/v3/kv/range", {"key": start, "range_end": end, "min_mod_revision": str(revision)}),
        ("/v3/kv/range", {"key": _b64(etcd_prefix + "absent")}),
        (
            "/v3/kv/txn",
            {
                "compare": [
                    {"key": _b64(etcd_prefix + "k1"), "target": "VALUE", "value": _b64("v1")},
                    {"key": _b64(etcd_prefix + "k1"), "target": "LEASE", "lease": str(lease.id)},
                    {
                        "key": _b64(etcd_prefix + "k2"),
                        "target": "VERSION",
                        "result": "GREATER",
                        "version": "0",
                    },
                ],
                "success": [
                    {"request_range": {"key": _b64(etcd_prefix + "k1")}},
                    {"request_txn": {"success": [{"request_range": {"key": start}}]}},
                ],
                "failure": [{"request_range": {"key": start, "range_end": end}}],
            },
        ),
    ]
    for path, body in reads:
        assert grpc._call(path, body, timeout=None, idempotent=True) == gateway._call(
            path, body, timeout=None, idempotent=True
        ), body
    # Writes: the same answer but for the revisions.
    for client, name in ((grpc, "g"), (gateway, "w")):
        key = _b64(etcd_prefix + name)
        first = client._call(
            "/v3/kv/put", {"key": key, "value": _b64("1")}, timeout=None, idempotent=True
        )
        second = client._call(
            "/v3/kv/put",
            {"key": key, "value": _b64("2"), "prev_kv": True},
            timeout=None,
            idempotent=True,
        )
        assert second["prev_kv"]["value"] == _b64("1")
        assert int(second["prev_kv"]["mod_revision"]) == int(first["header"]["revision"])
        gone = client._call(
            "/v3/kv/deleterange", {"key": key, "prev_kv": True}, timeout=None, idempotent=True
        )
        assert gone["deleted"] == "1" and gone["prev_kvs"][0]["value"] == _b64("2")
    # Lease grants and revokes go over gRPC too.
    for client in (grpc, gateway):
        other = client.grant_lease(timedelta(seconds=7))
        assert other.ttl == timedelta(seconds=7) and other.id != lease.id
        assert client.revoke_lease(other) is True
        assert client.revoke_lease(other) is False  # etcd: not found
    assert grpc.revoke_lease(lease) is True
    assert grpc.get(etcd_prefix + "k1") is None  # its keys went with it
    stats = grpc.connection_stats()
    assert (stats.grpc_connections, stats.opened) == (1, 0), "no call went to the gateway"
    assert gateway.connection_stats().grpc_connections == 0
    grpc.delete_prefix(etcd_prefix)


@pytest.mark.etcd
def test_calls_of_many_threads_share_one_connection(etcd_server: str, etcd_prefix: str) -> None:
    client = EtcdClient(etcd_server, timeout=timedelta(seconds=30), grpc_kv=True)
    threads, rounds = 16, 10
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            key = f"{etcd_prefix}{i}"
            revision = 0
            for r in range(rounds):
                ok, kv = client.compare_and_set(key, f"{i}-{r}", mod_revision=revision)
                assert ok and kv is not None, (i, r)
                revision = kv.mod_revision
                # Another thread's answer matched to this call would show here.
                assert client.get(key) == (f"{i}-{r}".encode(), revision)
        except BaseException as exc:
            errors.append(exc)

    workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
    assert not errors, errors[:3]
    assert client.delete_prefix(etcd_prefix) == threads
    stats = client.connection_stats()
    assert (stats.grpc_connections, stats.grpc_calls, stats.opened) == (
        1,
        threads * rounds * 2 + 1,
        0,
    )
    client.close()


@pytest.fixture
def relay(etcd_server: str) -> Iterator[TcpRelay]:
    proxy = TcpRelay(etcd_server)
    try:
        yield proxy
    finally:
        proxy.close()


@pytest.mark.etcd
def test_a_lost_answer_is_outcome_unknown_and_a_closed_connection_is_opened_again(
    relay: TcpRelay, etcd_prefix: str
) -> None:
    client = EtcdClient(relay.url, timeout=timedelta(seconds=10), grpc_kv=True)
    key = etcd_prefix + "cas"
    ok, kv = client.compare_and_set(key, b"1", mod_revision=0)
    assert ok and kv is not None
    # Closed while idle (etcd restarting, a proxy): the next transaction goes once, on a new
    # connection, with no error.
    relay.drop_all()
    ok, kv = client.compare_and_set(key, b"2", mod_revision=kv.mod_revision)
    assert ok and kv is not None and kv.value == b"2"
    assert client.connection_stats().grpc_connections == relay.accepted == 2
    # The answer lost after the request went: the caller is told to re-read; the transaction
    # is not sent again.
    relay.lose_answers = True
    with pytest.raises(EtcdOutcomeUnknown, match="re-read"):
        client.compare_and_set(key, b"3", mod_revision=kv.mod_revision)
    relay.lose_answers = False
    current = client.get_kv(key)
    assert current is not None and current.version in (kv.version, kv.version + 1)
    assert client.connection_stats().grpc_connections == relay.accepted == 3
    assert client.connection_stats().opened == 0, "no call went to the gateway"
    client.close()


@pytest.mark.etcd
def test_calls_over_grpc_ride_out_an_etcd_restart(etcd_instance: EtcdV3Server) -> None:
    client = EtcdClient(etcd_instance.client_url, timeout=timedelta(seconds=15), grpc_kv=True)
    revision = client.put("k", b"before")
    etcd_instance.kill()
    results: list[tuple[bytes, int] | None] = []
    reader = threading.Thread(target=lambda: results.append(client.get("k")))
    reader.start()  # retries against the dead server until it is back
    etcd_instance.start()
    reader.join(timeout=20)
    assert results == [(b"before", revision)]
    ok, _ = client.compare_and_set("k", b"after", mod_revision=revision)
    assert ok
    stats = client.connection_stats()
    assert stats.grpc_connections == 2 and stats.opened == 0
    client.close()


class _Http11Proxy(http.server.ThreadingHTTPServer):
    """An HTTP/1.1-only front of etcd's gateway (as some proxies are): it forwards POSTs and
    refuses HTTP/2's opening (``PRI * HTTP/2.0``) with a 505, counting those."""

    daemon_threads = True

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.refused = 0
        super().__init__(("127.0.0.1", 0), _ProxyHandler)


class _ProxyHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Http11Proxy

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        if code == 505:
            self.server.refused += 1
        super().send_error(code, message, explain)

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        request = urllib.request.Request(self.server.upstream + self.path, data=body, method="POST")
        with urllib.request.urlopen(request, timeout=10) as answer:
            data = answer.read()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.mark.etcd
def test_an_endpoint_without_http2_gets_the_calls_as_gateway_requests(
    etcd_server: str, etcd_prefix: str
) -> None:
    proxy = _Http11Proxy(etcd_server)
    serving = threading.Thread(target=proxy.serve_forever, daemon=True)
    serving.start()
    try:
        client = EtcdClient(
            f"http://127.0.0.1:{proxy.server_address[1]}",
            timeout=timedelta(seconds=10),
            grpc_kv=True,
        )
        key = etcd_prefix + "k"
        ok, kv = client.compare_and_set(key, b"1", mod_revision=0)
        assert ok and kv is not None
        assert client.get(key) == (b"1", kv.mod_revision)
        assert client.delete(key)
        stats = client.connection_stats()
        # Asked once, refused, never again: every call went to the gateway.
        assert (proxy.refused, stats.grpc_connections, stats.grpc_calls) == (1, 0, 0)
        assert stats.opened + stats.reused == 3
        client.close()
    finally:
        proxy.shutdown()
        proxy.server_close()
        serving.join(timeout=10)


@pytest.mark.etcd
def test_a_forked_child_opens_its_own_connection_and_a_dropped_client_closes_its_own(
    etcd_server: str, etcd_prefix: str
) -> None:
    client = EtcdClient(etcd_server, timeout=timedelta(seconds=10), grpc_kv=True)
    client.put(etcd_prefix + "k", b"parent")
    channel = client.transport._pool_here().kv[_endpoint(client)]
    pid = os.fork()
    if pid == 0:  # the child: a connection of its own, the parent's left alone
        code = 1
        try:
            client.put(etcd_prefix + "k", b"child")
            stats = client.connection_stats()
            if (stats.grpc_connections, stats.grpc_calls) == (1, 1):
                code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert client.get(etcd_prefix + "k") is not None and channel.usable
    assert client.connection_stats().grpc_connections == 1
    # Dropped without close(): collected, it closes its connection (socket, reader thread).
    reader = channel._reader
    del client
    gc.collect()
    wait_until(lambda: not reader.is_alive(), "the dropped client's connection to close", 30)
    assert not channel.usable


def _endpoint(client: EtcdClient) -> Any:
    return client.transport._endpoints[0]


# --------------------------------------------------------------------------- a scripted peer


def _huffman(text: str) -> bytes:
    bits = length = 0
    for byte in text.encode():
        bits = (bits << _hpack._HUFFMAN_LENGTHS[byte]) | _hpack.HUFFMAN_CODES[byte]
        length += _hpack._HUFFMAN_LENGTHS[byte]
    pad = -length % 8
    return ((bits << pad) | ((1 << pad) - 1)).to_bytes((length + pad) // 8, "big")


def _h2frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return (
        len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload
    )


class _ScriptedPeer:
    """The server end of a socket pair speaking just enough HTTP/2: its SETTINGS first, then for
    each call (a client HEADERS frame) the frames ``answer(stream)`` returns."""

    def __init__(self, sock: socket.socket, answer: Any, *, first: bytes | None = None) -> None:
        self.sock = sock
        self.answer = answer
        self.first = _h2frame(4, 0, 0) if first is None else first
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _recv(self, size: int) -> bytes:
        data = b""
        while len(data) < size:
            chunk = self.sock.recv(size - len(data))
            if not chunk:
                raise ConnectionError
            data += chunk
        return data

    def _run(self) -> None:
        try:
            self._recv(24)  # the client preface
            if not self.first:  # closes without a word
                self.sock.shutdown(socket.SHUT_RDWR)
                return
            self.sock.sendall(self.first)
            while True:
                head = self._recv(9)
                self._recv(int.from_bytes(head[:3], "big"))
                stream = int.from_bytes(head[5:9], "big")
                if head[3] == 1:  # a call's HEADERS
                    self.sock.sendall(self.answer(stream))
        except OSError:
            pass


def _channel(answer: Any, *, first: bytes | None = None) -> tuple[GrpcChannel, _ScriptedPeer]:
    ours, theirs = socket.socketpair()
    peer = _ScriptedPeer(theirs, answer, first=first)
    return GrpcChannel(ours, "etcd:2379", "fake://etcd", Deadline.after(timedelta(seconds=5))), peer


def test_answers_errors_and_refusals_of_a_scripted_peer_are_told_apart() -> None:
    grpc_status = b"\x40\x0bgrpc-status"  # a literal with incremental indexing, new name

    def answer(stream: int) -> bytes:
        if stream == 1:  # an answer: headers, the message, trailers (grpc-status 0, indexed next)
            message = b"\x10\x01"  # TxnResponse{succeeded: true}
            return (
                _h2frame(1, 4, stream, b"\x88")
                + _h2frame(0, 0, stream, b"\x00" + len(message).to_bytes(4, "big") + message)
                + _h2frame(1, 5, stream, grpc_status + b"\x010")
            )
        if stream == 3:  # trailers only: status 5 from the dynamic table's name, message Huffman
            text = _huffman("etcdserver: requested lease not found")
            return _h2frame(
                1,
                5,
                stream,
                b"\x88\x7e\x015" + b"\x00\x0cgrpc-message" + bytes([0x80 | len(text)]) + text,
            )
        if stream == 5:
            return _h2frame(3, 0, stream, (7).to_bytes(4, "big"))  # RST_STREAM REFUSED_STREAM
        if stream == 7:
            return _h2frame(3, 0, stream, (2).to_bytes(4, "big"))  # RST_STREAM INTERNAL_ERROR
        return _h2frame(7, 0, 0, (7).to_bytes(4, "big") + bytes(4))  # GOAWAY, last stream 7

    channel, peer = _channel(answer)
    deadline = Deadline.after(timedelta(seconds=5))
    assert channel.call("/etcdserverpb.KV/Txn", b"", deadline) == b"\x10\x01"
    with pytest.raises(GrpcError) as error:
        channel.call("/etcdserverpb.KV/Txn", b"", deadline)
    assert (error.value.code, error.value.grpc_message) == (
        5,
        "etcdserver: requested lease not found",
    )
    with pytest.raises(CallFailed) as refused:
        channel.call("/etcdserverpb.KV/Txn", b"", deadline)
    assert not refused.value.sent  # refused: never processed, safe to send again
    with pytest.raises(CallFailed) as reset:
        channel.call("/etcdserverpb.KV/Txn", b"", deadline)
    assert reset.value.sent  # reset after etcd had it: the outcome is unknown
    with pytest.raises(CallFailed) as goaway:
        channel.call("/etcdserverpb.KV/Txn", b"", deadline)
    assert not goaway.value.sent and not channel.usable  # past GOAWAY's last stream
    assert channel.calls == 2
    channel.close()
    peer.sock.close()


@pytest.mark.parametrize(
    ("first", "kind"),
    [
        (b"HTTP/1.1 400 Bad Request\r\n\r\n", NotHttp2),
        (b"", NotHttp2),  # closed without a word
        (None, None),
    ],
)
def test_a_peer_that_is_not_http2_or_breaks_the_rules_is_refused(
    first: bytes | None, kind: type[Exception] | None
) -> None:
    if kind is not None:
        ours, theirs = socket.socketpair()
        with theirs:
            peer = _ScriptedPeer(theirs, lambda stream: b"", first=first)
            with pytest.raises(kind) as info:
                GrpcChannel(ours, "etcd:2379", "fake://etcd", Deadline.after(timedelta(seconds=5)))
            assert info.value.definite == bool(first)  # type: ignore[attr-defined]
        peer.thread.join(timeout=10)
        return
    # An oversized frame (16,385 bytes: over the 16,384 this client allows) breaks the
    # connection; the call in flight fails.
    channel, peer = _channel(lambda stream: _h2frame(0, 0, stream, bytes(16385)))
    with pytest.raises(CallFailed):
        channel.call("/etcdserverpb.KV/Range", b"", Deadline.after(timedelta(seconds=5)))
    assert not channel.usable
    peer.sock.close()
