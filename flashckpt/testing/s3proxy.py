"""A fault proxy in front of a real S3 server (:class:`flashckpt.testing.s3.SeaweedS3`), for tests
of what a client does when the store misbehaves: an HTTP/1.1 proxy on 127.0.0.1 (a port from the
OS) that passes every request through to the server, counts them by S3 operation, and, on
command, answers chosen requests with a real S3 error (403 AccessDenied, 500 InternalError, 503
SlowDown: the status and the XML error document S3 sends), stalls them (no answer until the fault
is cleared: a client's read timeout), resets their connection, or refuses connections altogether
(its listening socket closed: the store is unreachable), and then goes back to passing through.

    with S3FaultProxy(server.endpoint) as proxy:
        fs = s3fs.S3FileSystem(..., client_kwargs={"endpoint_url": proxy.endpoint})
        proxy.fail(503)                            # every request: 503 SlowDown
        proxy.fail(500, op="UploadPart", after=2)  # the 3rd part upload on: 500 InternalError
        proxy.stall(); proxy.refuse(); proxy.reset(op="UploadPart")
        proxy.heal()                               # passes everything through again
        proxy.counts["PutObject"], proxy.faulted   # requests seen, requests faulted

Requests are signed for the proxy's host and port; they reach the server with their headers
unchanged, so the server checks the signature the client made. Torch-free.
"""

from __future__ import annotations

import http.client
import socket
import struct
import threading
from collections import Counter
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from urllib.parse import parse_qs, urlsplit
from xml.sax.saxutils import escape

__all__ = ["S3FaultProxy", "s3_operation"]

_ERRORS = {
    403: ("AccessDenied", "Access Denied"),
    500: ("InternalError", "We encountered an internal error. Please try again."),
    503: ("SlowDown", "Please reduce your request rate."),
}


def s3_operation(method: str, path: str) -> str:
    """The S3 API operation a request is (path-style addressing: ``/bucket/key?query``)."""
    parts = urlsplit(path)
    q = parse_qs(parts.query, keep_blank_values=True)
    segs = [s for s in parts.path.split("/") if s]
    on_object = len(segs) > 1
    if method == "GET" and not segs:
        return "ListBuckets"
    if "uploadId" in q:
        return {
            "PUT": "UploadPart",
            "POST": "CompleteMultipartUpload",
            "DELETE": "AbortMultipartUpload",
            "GET": "ListParts",
        }.get(method, method)
    if "uploads" in q:
        return "CreateMultipartUpload" if method == "POST" else "ListMultipartUploads"
    if "delete" in q and method == "POST":
        return "DeleteObjects"
    if not on_object:
        return {
            "GET": "ListObjectsV2" if q.get("list-type") == ["2"] else "ListObjects",
            "HEAD": "HeadBucket",
            "PUT": "CreateBucket",
            "DELETE": "DeleteBucket",
        }.get(method, method)
    return {
        "GET": "GetObject",
        "HEAD": "HeadObject",
        "PUT": "PutObject",
        "DELETE": "DeleteObject",
    }.get(method, method)


@dataclass(slots=True)
class _Fault:
    kind: str
    """``status``, ``stall`` or ``reset``."""
    status: int = 0
    op: str | None = None
    after: int = 0
    """Matching requests passed through before the fault applies."""
    times: int | None = None
    """Matching requests faulted before it is cleared by itself; None: until :meth:`heal`."""
    seen: int = 0


class S3FaultProxy:
    """The proxy; see the module docstring.

    Args:
        upstream: the S3 server's endpoint URL (``http://127.0.0.1:PORT``).
    """

    def __init__(self, upstream: str) -> None:
        u = urlsplit(upstream)
        if u.scheme != "http" or not u.hostname or not u.port:
            raise ValueError(f"upstream must be http://HOST:PORT, got {upstream!r}")
        self._up = (u.hostname, u.port)
        self._lock = threading.Lock()
        self._cleared = threading.Condition(self._lock)
        self._fault: _Fault | None = None
        self._epoch = 0
        self.counts: Counter[str] = Counter()
        """Requests that reached the proxy, by S3 operation (faulted ones included)."""
        self.requests: list[tuple[str, str]] = []
        """Every request that reached the proxy: its S3 operation and path (with the query)."""
        self.faulted = 0
        """Requests answered with a fault (an error, a stall, a reset)."""
        self.passed = 0
        """Requests passed through to the server and answered by it."""
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    @property
    def endpoint(self) -> str:
        """The endpoint URL clients use."""
        return f"http://127.0.0.1:{self.port}"

    # -- faults ------------------------------------------------------------------------------
    def fail(
        self, status: int, *, op: str | None = None, after: int = 0, times: int | None = None
    ) -> None:
        """Answers requests with the S3 error of ``status`` (403, 500 or 503).

        Args:
            op: only requests of this S3 operation (``UploadPart``, ``PutObject``...); None: all.
            after: let this many matching requests through first.
            times: fault this many, then pass through again; None: until :meth:`heal`.
        """
        if status not in _ERRORS:
            raise ValueError(f"status {status}: one of {sorted(_ERRORS)}")
        self._set(_Fault("status", status, op, after, times))

    def stall(self, *, op: str | None = None, after: int = 0) -> None:
        """Holds requests unanswered (reading them whole) until :meth:`heal`: a client's read
        timeout. A held connection is then closed without an answer."""
        self._set(_Fault("stall", 0, op, after))

    def reset(self, *, op: str | None = None, after: int = 0, times: int | None = None) -> None:
        """Resets the connection (an RST) of matching requests, read whole, before answering."""
        self._set(_Fault("reset", 0, op, after, times))

    def refuse(self) -> None:
        """Closes the listening socket and every connection: new connections are refused (the
        store is unreachable) until :meth:`heal` listens on the same port again."""
        self._set(None)
        self._stop_server()

    def heal(self) -> None:
        """Passes everything through again (listening again after :meth:`refuse`)."""
        self._set(None)
        if self._server is None and self.port:
            self._serve(self.port)

    def _set(self, fault: _Fault | None) -> None:
        with self._lock:
            self._fault = fault
            self._epoch += 1
            self._cleared.notify_all()

    def _decide(self, op: str, path: str) -> tuple[_Fault | None, int]:
        with self._lock:
            self.counts[op] += 1
            self.requests.append((op, path))
            f = self._fault
            if f is None or (f.op is not None and f.op != op):
                return None, self._epoch
            f.seen += 1
            if f.seen <= f.after:
                return None, self._epoch
            if f.times is not None and f.seen > f.after + f.times:
                return None, self._epoch
            self.faulted += 1
            return f, self._epoch

    def _hold(self, epoch: int) -> None:
        with self._lock:
            while self._epoch == epoch and self._server is not None:
                self._cleared.wait(1.0)

    # -- life cycle --------------------------------------------------------------------------
    def start(self) -> None:
        """Listens on a port from the OS."""
        self._serve(0)

    def close(self) -> None:
        """Stops listening, releases stalled requests and closes every connection."""
        self._stop_server()
        self._set(None)

    def __enter__(self) -> S3FaultProxy:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _serve(self, port: int) -> None:
        proxy = self

        class Handler(_Handler):
            owner = proxy

        server = _Server(("127.0.0.1", port), Handler)
        self.port = int(server.server_address[1])
        t = threading.Thread(target=server.serve_forever, name="s3-fault-proxy", daemon=True)
        with self._lock:
            self._server, self._thread = server, t
        t.start()

    def _stop_server(self) -> None:
        with self._lock:
            server, t = self._server, self._thread
            self._server = self._thread = None
            self._cleared.notify_all()
        if server is not None:
            server.shutdown()
            server.server_close()
            server.close_connections()
        if t is not None:
            t.join(timeout=10)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, *a: object, **kw: object) -> None:
        super().__init__(*a, **kw)  # type: ignore[arg-type]
        self.conns: set[socket.socket] = set()
        self.conns_lock = threading.Lock()

    def process_request(self, request: socket.socket, client_address: object) -> None:  # type: ignore[override]
        with self.conns_lock:
            self.conns.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: socket.socket) -> None:  # type: ignore[override]
        with self.conns_lock:
            self.conns.discard(request)
        super().shutdown_request(request)

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a client that went away mid-answer (a timeout, a kill): what the tests cause

    def close_connections(self) -> None:
        with self.conns_lock:
            conns = list(self.conns)
        for c in conns:
            _rst(c)


def _rst(sock: socket.socket) -> None:
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class _Handler(BaseHTTPRequestHandler):
    owner: S3FaultProxy
    protocol_version = "HTTP/1.1"
    _upstream: http.client.HTTPConnection | None = None

    def log_message(self, format: str, *args: object) -> None:
        pass  # quiet: the counts are the record

    def _body(self) -> bytes:
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _any(self) -> None:
        body = self._body()
        op = s3_operation(self.command, self.path)
        fault, epoch = self.owner._decide(op, self.path)
        if fault is None:
            self._forward(body)
            return
        if fault.kind == "stall":
            self.owner._hold(epoch)
            self.close_connection = True
            _rst(self.connection)
            return
        if fault.kind == "reset":
            self.close_connection = True
            _rst(self.connection)
            return
        code, message = _ERRORS[fault.status]
        bucket = urlsplit(self.path).path.strip("/").split("/")[0]
        doc = (
            '<?xml version="1.0" encoding="UTF-8"?>\n<Error>'
            f"<Code>{code}</Code><Message>{escape(message)}</Message>"
            f"<BucketName>{escape(bucket)}</BucketName>"
            f"<Resource>{escape(urlsplit(self.path).path)}</Resource>"
            "<RequestId>fcproxy</RequestId></Error>"
        ).encode()
        self.send_response(fault.status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(doc)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(doc)

    def _forward(self, body: bytes) -> None:
        if self._upstream is None:
            self._upstream = http.client.HTTPConnection(*self.owner._up, timeout=300)
        up = self._upstream
        try:
            up.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for k, v in self.headers.items():
                if k.lower() != "expect":  # answered here already (100 Continue)
                    up.putheader(k, v)
            up.endheaders(body if body else None)
            resp = up.getresponse()
            data = resp.read()
        except (OSError, http.client.HTTPException):
            self._upstream = None
            up.close()
            self.close_connection = True
            _rst(self.connection)  # the server went away: so does the answer
            return
        self.send_response_only(resp.status, resp.reason)
        for k, v in resp.getheaders():
            if k.lower() not in ("transfer-encoding", "content-length", "connection"):
                self.send_header(k, v)
        if self.command != "HEAD":
            self.send_header("Content-Length", str(len(data)))
        elif resp.getheader("Content-Length") is not None:
            self.send_header("Content-Length", resp.getheader("Content-Length", "0"))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
        with self.owner._lock:
            self.owner.passed += 1

    def finish(self) -> None:
        if self._upstream is not None:
            self._upstream.close()
        try:
            super().finish()
        except OSError:
            pass

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _any
