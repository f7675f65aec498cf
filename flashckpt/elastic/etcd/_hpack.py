"""An HPACK (RFC 7541) header-block decoder: what the etcd gRPC client needs to read the
``:status``, ``grpc-status`` and ``grpc-message`` that etcd's gRPC server (grpc-go) sends.

grpc-go encodes its headers and trailers with a dynamic table and Huffman coding, so reading a
trailer's ``grpc-status`` takes the whole decoder: the static table (Appendix A), the dynamic
table of the connection (every header block of the connection must be decoded, in order, to
keep it in step), integers, string literals and the canonical Huffman code (Appendix B).

Everything is bounded: integers to 32 bits, a string to the bytes of its block, a decoded
header list to ``MAX_HEADER_LIST`` bytes, the dynamic table to the size this client advertised
(the default 4,096 bytes); anything else raises :class:`HpackError`, which breaks the
connection.
"""

from __future__ import annotations

import collections

__all__ = ["MAX_HEADER_LIST", "HpackDecoder", "HpackError", "huffman_decode"]

# The largest header list (names + values + 32 bytes each, RFC 7541 section 4.1) accepted in
# one block; the client advertises it as SETTINGS_MAX_HEADER_LIST_SIZE.
MAX_HEADER_LIST = 64 * 1024
# The dynamic table size the client allows (HTTP/2's default SETTINGS_HEADER_TABLE_SIZE).
DEFAULT_TABLE_SIZE = 4096


class HpackError(Exception):
    """A header block that is not valid HPACK (or exceeds a bound): the connection is broken."""


_STATIC: tuple[tuple[str, str], ...] = (
    (":authority", ""),
    (":method", "GET"),
    (":method", "POST"),
    (":path", "/"),
    (":path", "/index.html"),
    (":scheme", "http"),
    (":scheme", "https"),
    (":status", "200"),
    (":status", "204"),
    (":status", "206"),
    (":status", "304"),
    (":status", "400"),
    (":status", "404"),
    (":status", "500"),
    ("accept-charset", ""),
    ("accept-encoding", "gzip, deflate"),
    ("accept-language", ""),
    ("accept-ranges", ""),
    ("accept", ""),
    ("access-control-allow-origin", ""),
    ("age", ""),
    ("allow", ""),
    ("authorization", ""),
    ("cache-control", ""),
    ("content-disposition", ""),
    ("content-encoding", ""),
    ("content-language", ""),
    ("content-length", ""),
    ("content-location", ""),
    ("content-range", ""),
    ("content-type", ""),
    ("cookie", ""),
    ("date", ""),
    ("etag", ""),
    ("expect", ""),
    ("expires", ""),
    ("from", ""),
    ("host", ""),
    ("if-match", ""),
    ("if-modified-since", ""),
    ("if-none-match", ""),
    ("if-range", ""),
    ("if-unmodified-since", ""),
    ("last-modified", ""),
    ("link", ""),
    ("location", ""),
    ("max-forwards", ""),
    ("proxy-authenticate", ""),
    ("proxy-authorization", ""),
    ("range", ""),
    ("referer", ""),
    ("refresh", ""),
    ("retry-after", ""),
    ("server", ""),
    ("set-cookie", ""),
    ("strict-transport-security", ""),
    ("transfer-encoding", ""),
    ("user-agent", ""),
    ("vary", ""),
    ("via", ""),
    ("www-authenticate", ""),
)

# Code lengths of the Huffman code (RFC 7541 Appendix B), symbols 0..256 (256: EOS). The code
# is canonical (codes of one length are consecutive, in symbol order, after the shorter ones),
# so the lengths determine the codes; tests/elastic/etcd/test_etcd_grpc_kv.py checks them against
# the RFC's examples.
# fmt: off
_HUFFMAN_LENGTHS = (
    13, 23, 28, 28, 28, 28, 28, 28, 28, 24, 30, 28, 28, 30, 28, 28,
    28, 28, 28, 28, 28, 28, 30, 28, 28, 28, 28, 28, 28, 28, 28, 28,
    6, 10, 10, 12, 13, 6, 8, 11, 10, 10, 8, 11, 8, 6, 6, 6,
    5, 5, 5, 6, 6, 6, 6, 6, 6, 6, 7, 8, 15, 6, 12, 10,
    13, 6, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7,
    7, 7, 7, 7, 7, 7, 7, 7, 8, 7, 8, 13, 19, 13, 14, 6,
    15, 5, 6, 5, 6, 5, 6, 6, 6, 5, 7, 7, 6, 6, 6, 5,
    6, 7, 6, 5, 5, 6, 7, 7, 7, 7, 7, 15, 11, 14, 13, 28,
    20, 22, 20, 20, 22, 22, 22, 23, 22, 23, 23, 23, 23, 23, 24, 23,
    24, 24, 22, 23, 24, 23, 23, 23, 23, 21, 22, 23, 22, 23, 23, 24,
    22, 21, 20, 22, 22, 23, 23, 21, 23, 22, 22, 24, 21, 22, 23, 23,
    21, 21, 22, 21, 23, 22, 23, 23, 20, 22, 22, 22, 23, 22, 22, 23,
    26, 26, 20, 19, 22, 23, 22, 25, 26, 26, 26, 27, 27, 26, 24, 25,
    19, 21, 26, 27, 27, 26, 27, 24, 21, 21, 26, 26, 28, 27, 27, 27,
    20, 24, 20, 21, 22, 21, 21, 23, 22, 22, 25, 25, 24, 24, 26, 23,
    26, 27, 26, 26, 27, 27, 27, 27, 27, 28, 27, 27, 27, 27, 27, 26,
    30,
)
# fmt: on
_EOS = 256


def _canonical_codes(lengths: tuple[int, ...]) -> list[int]:
    codes = [0] * len(lengths)
    code, previous = -1, 0
    for symbol in sorted(range(len(lengths)), key=lambda s: (lengths[s], s)):
        code = (code + 1) << (lengths[symbol] - previous)
        previous = lengths[symbol]
        codes[symbol] = code
    return codes


HUFFMAN_CODES = _canonical_codes(_HUFFMAN_LENGTHS)
# (length << 32 | code) -> symbol
_HUFFMAN_DECODE = {
    (length << 32) | code: symbol
    for symbol, (length, code) in enumerate(zip(_HUFFMAN_LENGTHS, HUFFMAN_CODES, strict=True))
}
_LONGEST = max(_HUFFMAN_LENGTHS)


def huffman_decode(data: bytes) -> bytes:
    """Decodes a Huffman-coded HPACK string.

    Raises:
        HpackError: On EOS inside the string, a code longer than any, or padding that is longer
            than 7 bits or not the EOS code's most significant bits (all ones).
    """
    out = bytearray()
    code = length = 0
    for byte in data:
        for shift in range(7, -1, -1):
            code = (code << 1) | ((byte >> shift) & 1)
            length += 1
            symbol = _HUFFMAN_DECODE.get((length << 32) | code)
            if symbol is not None:
                if symbol == _EOS:
                    raise HpackError("EOS inside a Huffman-coded HPACK string")
                out.append(symbol)
                code = length = 0
            elif length >= _LONGEST:
                raise HpackError("an invalid Huffman code in an HPACK string")
    if length > 7 or code != (1 << length) - 1:
        raise HpackError("invalid padding at the end of a Huffman-coded HPACK string")
    return bytes(out)


def _integer(block: bytes, at: int, prefix_bits: int) -> tuple[int, int]:
    """An HPACK integer with a ``prefix_bits`` prefix at ``block[at]``; bounded to 2**32."""
    top = (1 << prefix_bits) - 1
    value = block[at] & top
    at += 1
    if value < top:
        return value, at
    shift = 0
    while True:
        if at >= len(block):
            raise HpackError("a truncated HPACK integer")
        byte = block[at]
        at += 1
        value += (byte & 127) << shift
        shift += 7
        if value > 2**32 or shift > 35:
            raise HpackError("an HPACK integer over 2**32")
        if not byte & 128:
            return value, at


def _string(block: bytes, at: int) -> tuple[str, int]:
    if at >= len(block):
        raise HpackError("a truncated HPACK string")
    huffman = block[at] & 128
    size, at = _integer(block, at, 7)
    if at + size > len(block):
        raise HpackError(f"an HPACK string of {size} bytes past the end of its block")
    raw = block[at : at + size]
    text = huffman_decode(raw) if huffman else raw
    return text.decode("latin-1"), at + size


class HpackDecoder:
    """The decoding side of one HTTP/2 connection's header compression (one per connection;
    feed it every header block of the connection in order). Not thread-safe: one reader."""

    def __init__(self, max_table_size: int = DEFAULT_TABLE_SIZE) -> None:
        self._limit = max_table_size  # what we advertised: the encoder may not go above it
        self._max = max_table_size  # the table's current maximum (size updates lower it)
        self._table: collections.deque[tuple[str, str]] = collections.deque()  # newest first
        self._size = 0

    def decode(self, block: bytes) -> list[tuple[str, str]]:
        """The header list of one complete header block (names as sent: lower case).

        Raises:
            HpackError: If the block is not valid HPACK or exceeds a bound.
        """
        headers: list[tuple[str, str]] = []
        total = 0
        at = 0
        try:
            while at < len(block):
                byte = block[at]
                if byte & 0x80:  # indexed field
                    index, at = _integer(block, at, 7)
                    name, value = self._entry(index)
                elif byte & 0x40:  # literal with incremental indexing
                    name, value, at = self._literal(block, at, 6)
                    self._add(name, value)
                elif byte & 0x20:  # dynamic table size update
                    size, at = _integer(block, at, 5)
                    if size > self._limit:
                        raise HpackError(
                            f"an HPACK table size update to {size} over the {self._limit} allowed"
                        )
                    self._max = size
                    self._evict()
                    continue
                else:  # literal without indexing (0000) or never indexed (0001)
                    name, value, at = self._literal(block, at, 4)
                total += len(name) + len(value) + 32
                if total > MAX_HEADER_LIST:
                    raise HpackError(f"a header list over {MAX_HEADER_LIST} bytes")
                headers.append((name, value))
        except IndexError as exc:
            raise HpackError("a truncated HPACK header block") from exc
        return headers

    def _literal(self, block: bytes, at: int, prefix_bits: int) -> tuple[str, str, int]:
        index, at = _integer(block, at, prefix_bits)
        if index:
            name = self._entry(index)[0]
        else:
            name, at = _string(block, at)
        value, at = _string(block, at)
        return name, value, at

    def _entry(self, index: int) -> tuple[str, str]:
        if 1 <= index <= len(_STATIC):
            return _STATIC[index - 1]
        dynamic = index - len(_STATIC) - 1
        if index == 0 or dynamic >= len(self._table):
            raise HpackError(f"HPACK index {index} is not in the tables")
        return self._table[dynamic]

    def _add(self, name: str, value: str) -> None:
        size = len(name) + len(value) + 32
        if size > self._max:  # a too-large entry empties the table (RFC 7541 section 4.4)
            self._table.clear()
            self._size = 0
            return
        self._table.appendleft((name, value))
        self._size += size
        self._evict()

    def _evict(self) -> None:
        while self._size > self._max:
            name, value = self._table.pop()
            self._size -= len(name) + len(value) + 32
