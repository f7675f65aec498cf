"""etcd's KV messages (``etcdserverpb`` in etcd's ``rpc.proto``, ``mvccpb.KeyValue``) and its
lease grant and revoke as protobuf, translated from and to the JSON the v3 gateway takes and
answers.

The client's callers build gateway JSON bodies (``{"key": <base64>, "range_end": ...}``,
transactions of ``request_range``/``request_put``/... operations with ``compare`` clauses) and
read gateway JSON answers. For the gRPC transport (:mod:`flashckpt.elastic.etcd._grpckv`) a
body is encoded as the protobuf request it stands for, and the protobuf answer decoded into the
dict the gateway would have answered (grpc-gateway's JSON mapping as etcd configures it:
original field names, int64 as decimal strings, bytes as base64, default values left out,
enums by name), so every caller works unchanged on either transport.

A body with a field this module does not know raises :class:`Untranslatable`; the caller then
sends it to the gateway, which takes (or refuses) it as before. An answer is validated while it
is decoded (varints of at most 10 bytes, lengths within their message, the wire type each
known field must have, a bounded nesting depth); a malformed one raises :class:`ValueError`.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable
from typing import Any

__all__ = ["METHODS", "Untranslatable", "decode", "encode"]


class Untranslatable(Exception):
    """A gateway body with a field or value the protobuf encoder does not know."""


_VARINT, _LEN = 0, 2
_MAX_DEPTH = 16  # nested transactions and messages in an answer


def _varint(value: int) -> bytes:
    value &= 2**64 - 1  # int64 on the wire: a negative value takes ten bytes
    out = bytearray()
    while value > 127:
        out.append((value & 127) | 128)
        value >>= 7
    out.append(value)
    return bytes(out)


def read_varint(data: bytes, at: int, end: int) -> tuple[int, int]:
    """The varint at ``data[at:end]`` and the offset after it (at most 10 bytes, 64 bits)."""
    value = shift = 0
    while True:
        if at >= end or shift > 63:
            raise ValueError("a truncated or over-long protobuf varint")
        byte = data[at]
        at += 1
        value |= (byte & 127) << shift
        shift += 7
        if not byte & 128:
            if value >= 2**64:
                raise ValueError("a protobuf varint over 64 bits")
            return value, at


# ------------------------------------------------------------------------------ requests

# An encoder takes the JSON value and the field number and returns the field's bytes (empty
# for a proto3 default that is left out).
_Encoder = Callable[[Any, int, bool], bytes]


def _tag(number: int, wire: int) -> bytes:
    return _varint((number << 3) | wire)


def _enc_bytes(value: Any, number: int, always: bool) -> bytes:
    if not isinstance(value, str):
        raise Untranslatable(f"a bytes field given as {type(value).__name__}")
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise Untranslatable(f"a bytes field that is not base64: {value[:40]!r}") from exc
    if not raw and not always:
        return b""
    return _tag(number, _LEN) + _varint(len(raw)) + raw


def _enc_int(value: Any, number: int, always: bool) -> bytes:
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise Untranslatable(f"an integer field given as {value!r}")
    try:
        number_value = int(value)
    except ValueError as exc:
        raise Untranslatable(f"an integer field given as {value!r}") from exc
    if not -(2**63) <= number_value < 2**64:
        raise Untranslatable(f"an integer field out of range: {value!r}")
    if not number_value and not always:
        return b""
    return _tag(number, _VARINT) + _varint(number_value)


def _enc_bool(value: Any, number: int, always: bool) -> bytes:
    if not isinstance(value, bool):
        raise Untranslatable(f"a bool field given as {value!r}")
    if not value and not always:
        return b""
    return _tag(number, _VARINT) + (b"\x01" if value else b"\x00")


def _enum(names: tuple[str, ...]) -> _Encoder:
    def encode(value: Any, number: int, always: bool) -> bytes:
        if isinstance(value, str) and value in names:
            index = names.index(value)
        elif isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31:
            index = value
        else:
            raise Untranslatable(f"an enum value {value!r} (known: {names})")
        if not index and not always:
            return b""
        return _tag(number, _VARINT) + _varint(index)

    return encode


# field name -> (number, encoder, always: a oneof member, sent even when it is the default)
_Schema = dict[str, tuple[int, _Encoder, bool]]


def _message(schema_of: Callable[[], _Schema]) -> _Encoder:
    def encode(value: Any, number: int, always: bool) -> bytes:
        body = encode_message(schema_of(), value)
        return _tag(number, _LEN) + _varint(len(body)) + body

    return encode


def _repeated(inner: _Encoder) -> _Encoder:
    def encode(value: Any, number: int, always: bool) -> bytes:
        if not isinstance(value, list):
            raise Untranslatable(f"a repeated field given as {type(value).__name__}")
        return b"".join(inner(item, number, True) for item in value)

    return encode


def encode_message(schema: _Schema, body: Any) -> bytes:
    """The protobuf bytes of the message a gateway JSON object stands for."""
    if not isinstance(body, dict):
        raise Untranslatable(f"a message given as {type(body).__name__}")
    out = []
    for name, value in body.items():
        field = schema.get(name)
        if field is None:
            raise Untranslatable(f"field {name!r} is not known to the gRPC encoder")
        number, encoder, always = field
        if value is None:
            continue
        out.append(encoder(value, number, always))
    return b"".join(out)


_RANGE_REQUEST: _Schema = {
    "key": (1, _enc_bytes, False),
    "range_end": (2, _enc_bytes, False),
    "limit": (3, _enc_int, False),
    "revision": (4, _enc_int, False),
    "sort_order": (5, _enum(("NONE", "ASCEND", "DESCEND")), False),
    "sort_target": (6, _enum(("KEY", "VERSION", "CREATE", "MOD", "VALUE")), False),
    "serializable": (7, _enc_bool, False),
    "keys_only": (8, _enc_bool, False),
    "count_only": (9, _enc_bool, False),
    "min_mod_revision": (10, _enc_int, False),
    "max_mod_revision": (11, _enc_int, False),
    "min_create_revision": (12, _enc_int, False),
    "max_create_revision": (13, _enc_int, False),
}
_PUT_REQUEST: _Schema = {
    "key": (1, _enc_bytes, False),
    "value": (2, _enc_bytes, False),
    "lease": (3, _enc_int, False),
    "prev_kv": (4, _enc_bool, False),
    "ignore_value": (5, _enc_bool, False),
    "ignore_lease": (6, _enc_bool, False),
}
_DELETE_RANGE_REQUEST: _Schema = {
    "key": (1, _enc_bytes, False),
    "range_end": (2, _enc_bytes, False),
    "prev_kv": (3, _enc_bool, False),
}
_COMPARE: _Schema = {
    "result": (1, _enum(("EQUAL", "GREATER", "LESS", "NOT_EQUAL")), False),
    "target": (2, _enum(("VERSION", "CREATE", "MOD", "VALUE", "LEASE")), False),
    "key": (3, _enc_bytes, False),
    # target_union: a oneof, so its member goes on the wire even when 0
    "version": (4, _enc_int, True),
    "create_revision": (5, _enc_int, True),
    "mod_revision": (6, _enc_int, True),
    "value": (7, _enc_bytes, True),
    "lease": (8, _enc_int, True),
    "range_end": (64, _enc_bytes, False),
}
_REQUEST_OP: _Schema = {
    "request_range": (1, _message(lambda: _RANGE_REQUEST), True),
    "request_put": (2, _message(lambda: _PUT_REQUEST), True),
    "request_delete_range": (3, _message(lambda: _DELETE_RANGE_REQUEST), True),
    "request_txn": (4, _message(lambda: _TXN_REQUEST), True),
}
_TXN_REQUEST: _Schema = {
    "compare": (1, _repeated(_message(lambda: _COMPARE)), False),
    "success": (2, _repeated(_message(lambda: _REQUEST_OP)), False),
    "failure": (3, _repeated(_message(lambda: _REQUEST_OP)), False),
}

# ------------------------------------------------------------------------------ answers

_I64, _U64, _BOOL, _BYTES, _MSG, _STR = range(6)
# field number -> (JSON name, kind, sub-schema of a message, repeated)
_Answer = dict[int, tuple[str, int, Any, bool]]

_HEADER: _Answer = {
    1: ("cluster_id", _U64, None, False),
    2: ("member_id", _U64, None, False),
    3: ("revision", _I64, None, False),
    4: ("raft_term", _U64, None, False),
}
_KEY_VALUE: _Answer = {
    1: ("key", _BYTES, None, False),
    2: ("create_revision", _I64, None, False),
    3: ("mod_revision", _I64, None, False),
    4: ("version", _I64, None, False),
    5: ("value", _BYTES, None, False),
    6: ("lease", _I64, None, False),
}
_RANGE_RESPONSE: _Answer = {
    1: ("header", _MSG, _HEADER, False),
    2: ("kvs", _MSG, _KEY_VALUE, True),
    3: ("more", _BOOL, None, False),
    4: ("count", _I64, None, False),
}
_PUT_RESPONSE: _Answer = {
    1: ("header", _MSG, _HEADER, False),
    2: ("prev_kv", _MSG, _KEY_VALUE, False),
}
_DELETE_RANGE_RESPONSE: _Answer = {
    1: ("header", _MSG, _HEADER, False),
    2: ("deleted", _I64, None, False),
    3: ("prev_kvs", _MSG, _KEY_VALUE, True),
}
_RESPONSE_OP: _Answer = {
    1: ("response_range", _MSG, _RANGE_RESPONSE, False),
    2: ("response_put", _MSG, _PUT_RESPONSE, False),
    3: ("response_delete_range", _MSG, _DELETE_RANGE_RESPONSE, False),
}
_TXN_RESPONSE: _Answer = {
    1: ("header", _MSG, _HEADER, False),
    2: ("succeeded", _BOOL, None, False),
    3: ("responses", _MSG, _RESPONSE_OP, True),
}
_RESPONSE_OP[4] = ("response_txn", _MSG, _TXN_RESPONSE, False)


_LEASE_GRANT_REQUEST: _Schema = {"TTL": (1, _enc_int, False), "ID": (2, _enc_int, False)}
_LEASE_GRANT_RESPONSE: _Answer = {
    1: ("header", _MSG, _HEADER, False),
    2: ("ID", _I64, None, False),
    3: ("TTL", _I64, None, False),
    4: ("error", _STR, None, False),
}
_LEASE_REVOKE_REQUEST: _Schema = {"ID": (1, _enc_int, False)}
_LEASE_REVOKE_RESPONSE: _Answer = {1: ("header", _MSG, _HEADER, False)}


def decode_message(schema: _Answer, data: bytes, at: int, end: int, depth: int) -> dict[str, Any]:
    """The gateway JSON of the message in ``data[at:end]`` (unknown fields skipped)."""
    if depth > _MAX_DEPTH:
        raise ValueError(f"protobuf messages nested over {_MAX_DEPTH} deep")
    out: dict[str, Any] = {}
    while at < end:
        tag, at = read_varint(data, at, end)
        number, wire = tag >> 3, tag & 7
        field = schema.get(number)
        if wire == _VARINT:
            value, at = read_varint(data, at, end)
            if field is None:
                continue
            name, kind, _, _ = field
            if kind == _I64:
                signed = value - 2**64 if value >= 2**63 else value
                if signed:
                    out[name] = str(signed)
            elif kind == _U64:
                if value:
                    out[name] = str(value)
            elif kind == _BOOL:
                if value:
                    out[name] = True
            else:
                raise ValueError(f"protobuf field {number} ({name}) is a varint")
        elif wire == _LEN:
            size, at = read_varint(data, at, end)
            if size > end - at:
                raise ValueError(f"a protobuf field of {size} bytes past the end of its message")
            start, at = at, at + size
            if field is None:
                continue
            name, kind, sub, repeated = field
            if kind == _BYTES:
                if size:
                    out[name] = base64.b64encode(data[start:at]).decode("ascii")
            elif kind == _STR:
                if size:
                    out[name] = data[start:at].decode("utf-8", errors="replace")
            elif kind == _MSG and sub is not None:
                value_msg = decode_message(sub, data, start, at, depth + 1)
                if repeated:
                    out.setdefault(name, []).append(value_msg)
                else:
                    out[name] = value_msg
            else:
                raise ValueError(f"protobuf field {number} ({name}) is length-delimited")
        elif wire == 1:
            at += 8
        elif wire == 5:
            at += 4
        else:
            raise ValueError(f"protobuf wire type {wire}")
        if at > end:
            raise ValueError("a truncated protobuf field")
    return out


def encode(request: _Schema, body: dict[str, Any]) -> bytes:
    """The protobuf request of a gateway JSON ``body`` (raises :class:`Untranslatable`)."""
    return encode_message(request, body)


def decode(answer: _Answer, message: bytes) -> dict[str, Any]:
    """The gateway JSON of a protobuf answer (raises :class:`ValueError` if malformed)."""
    return decode_message(answer, message, 0, len(message), 0)


# gateway path -> (gRPC method, request schema, answer schema)
METHODS: dict[str, tuple[str, _Schema, _Answer]] = {
    "/v3/kv/range": ("/etcdserverpb.KV/Range", _RANGE_REQUEST, _RANGE_RESPONSE),
    "/v3/kv/put": ("/etcdserverpb.KV/Put", _PUT_REQUEST, _PUT_RESPONSE),
    "/v3/kv/deleterange": (
        "/etcdserverpb.KV/DeleteRange",
        _DELETE_RANGE_REQUEST,
        _DELETE_RANGE_RESPONSE,
    ),
    "/v3/kv/txn": ("/etcdserverpb.KV/Txn", _TXN_REQUEST, _TXN_RESPONSE),
    "/v3/lease/grant": (
        "/etcdserverpb.Lease/LeaseGrant",
        _LEASE_GRANT_REQUEST,
        _LEASE_GRANT_RESPONSE,
    ),
    "/v3/lease/revoke": (
        "/etcdserverpb.Lease/LeaseRevoke",
        _LEASE_REVOKE_REQUEST,
        _LEASE_REVOKE_RESPONSE,
    ),
}
