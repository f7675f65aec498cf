"""The hand-written codecs of the gRPC path, property-tested against the reference packages as
oracles (issue 45): ``_hpack`` (and the HPACK literals ``_leasestream`` writes) against
``hpack``, ``_kvproto`` against ``protobuf`` with etcd's messages (``rpc.proto``, ``kv.proto``)
declared here field for field.

Both ways each: what the oracle encodes, ours decodes to the same; what ours encodes, the
oracle decodes to the same. Requests are built with the typed operations
(:mod:`flashckpt.elastic.etcd.ops`), so the bodies the client sends are the ones checked.
Hypothesis runs derandomized (the same cases every run) with a bounded number of examples.
"""

from __future__ import annotations

import base64
from typing import Any

import hpack
from google.protobuf import descriptor_pb2, descriptor_pool, json_format, message_factory
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flashckpt.elastic.etcd import _kvproto
from flashckpt.elastic.etcd._hpack import HpackDecoder, HpackError, huffman_decode
from flashckpt.elastic.etcd._leasestream import _hpack_literal
from flashckpt.elastic.etcd.ops import Compare, Delete, Put, Range, Txn

CASES = settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    database=None,  # derandomized: nothing to replay, and no .hypothesis/ folder left behind
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# ------------------------------------------------------------------------------ HPACK

# Header names as HTTP/2 sends them (lower case tokens) and values of any octets but CR/LF/NUL
# (latin-1 both sides: a value's bytes come back as they went).
_NAMES = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_:", min_size=1, max_size=24)
_VALUES = st.binary(max_size=200).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))
# Values the client writes: ASCII and multi-byte UTF-8 (a fixed alphabet: hypothesis builds no
# unicode tables for it).
_TEXT = (
    "".join(chr(c) for c in range(0x20, 0x7F)) + "\t\u00e9\u00fc\u00df\u20ac\u4e2d\u6587\U0001f600"
)
_HEADER = st.tuples(_NAMES, _VALUES, st.booleans())  # (name, value, never indexed)
_BLOCKS = st.lists(
    st.tuples(st.lists(_HEADER, max_size=12), st.booleans(), st.sampled_from([None, 0, 256, 4096])),
    min_size=1,
    max_size=6,
)
# grpc-go's own trailers, to mix in: the static table's entries and their dynamic re-use.
_COMMON = [
    (":status", b"200", False),
    ("content-type", b"application/grpc", False),
    ("grpc-status", b"0", False),
    ("grpc-message", b"", False),
]


@CASES
@given(_BLOCKS, st.booleans())
def test_hpack_decoder_reads_what_hpack_encodes(blocks: list[Any], common: bool) -> None:
    """One connection's header blocks, in order, from ``hpack.Encoder`` (dynamic table,
    Huffman or not, never-indexed fields, table size updates) decode to the same lists."""
    encoder, ours = hpack.Encoder(), HpackDecoder()
    for headers, huffman, table_size in blocks:
        if table_size is not None:
            encoder.header_table_size = table_size
        fields = [*(_COMMON if common else []), *headers]
        wire = [
            hpack.NeverIndexedHeaderTuple(n.encode(), v)
            if never
            else hpack.HeaderTuple(n.encode(), v)
            for n, v, never in fields
        ]
        block = encoder.encode(wire, huffman=huffman)
        decoded = ours.decode(block)
        assert [(n, v.encode("latin-1")) for n, v in decoded] == [(n, v) for n, v, _ in fields]


@CASES
@given(st.binary(max_size=300))
def test_huffman_decode_reads_what_hpack_huffman_encodes(data: bytes) -> None:
    encoded = hpack.huffman.HuffmanEncoder(
        hpack.huffman_constants.REQUEST_CODES, hpack.huffman_constants.REQUEST_CODES_LENGTH
    ).encode(data)
    assert huffman_decode(encoded) == data


@CASES
@given(st.lists(st.tuples(_NAMES, st.text(alphabet=_TEXT, max_size=150)), min_size=1, max_size=5))
def test_hpack_reads_the_literals_leasestream_writes(fields: list[tuple[str, str]]) -> None:
    """The request headers the keep-alive stream and the gRPC channel write (literals without
    indexing, lengths over the 7-bit prefix included) decode with ``hpack.Decoder`` and with
    ours to what was written."""
    block = b"".join(_hpack_literal(n, v) for n, v in fields)
    expected = [(n.encode(), v.encode()) for n, v in fields]
    assert hpack.Decoder().decode(block, raw=True) == expected
    ours = HpackDecoder().decode(block)
    assert [(n.encode("latin-1"), v.encode("latin-1")) for n, v in ours] == expected


@CASES
@given(st.binary(max_size=120))
def test_hpack_decoder_fails_only_with_hpack_error(block: bytes) -> None:
    """Any bytes: a header list, or HpackError (which breaks the connection), never another
    exception; where ``hpack`` takes the block, ours decodes it to the same list."""
    try:
        ours: list[tuple[str, str]] | None = HpackDecoder().decode(block)
    except HpackError:
        ours = None
    try:
        theirs = hpack.Decoder().decode(block, raw=True)
    except Exception:
        theirs = None
    if ours is not None and theirs is not None:
        assert [(n.encode("latin-1"), v.encode("latin-1")) for n, v in ours] == list(theirs)


# ------------------------------------------------------------------------------ protobuf

_F = descriptor_pb2.FieldDescriptorProto
I64, U64, BOOL, BYTES, STR = (
    _F.TYPE_INT64,
    _F.TYPE_UINT64,
    _F.TYPE_BOOL,
    _F.TYPE_BYTES,
    _F.TYPE_STRING,
)
# (name, number, type, message or enum type name, repeated, oneof index)
_Field = tuple[str, int, int, str, bool, int | None]


def _f(
    name: str, number: int, kind: int | str, *, repeated: bool = False, oneof: int | None = None
) -> _Field:
    """A field; ``kind``: a scalar type, or a message's name (an enum's: ``"enum:Name"``)."""
    if isinstance(kind, int):
        return (name, number, kind, "", repeated, oneof)
    if kind.startswith("enum:"):
        return (name, number, _F.TYPE_ENUM, kind[5:], repeated, oneof)
    return (name, number, _F.TYPE_MESSAGE, kind, repeated, oneof)


# etcd's messages the client sends and reads, from etcdserverpb/rpc.proto and mvccpb/kv.proto:
# names, numbers, types, oneofs and nested enums as there.
_MESSAGES: dict[str, tuple[list[_Field], dict[str, list[str]], tuple[str, ...]]] = {
    "ResponseHeader": (
        [
            _f("cluster_id", 1, U64),
            _f("member_id", 2, U64),
            _f("revision", 3, I64),
            _f("raft_term", 4, U64),
        ],
        {},
        (),
    ),
    "KeyValue": (
        [
            _f("key", 1, BYTES),
            _f("create_revision", 2, I64),
            _f("mod_revision", 3, I64),
            _f("version", 4, I64),
            _f("value", 5, BYTES),
            _f("lease", 6, I64),
        ],
        {},
        (),
    ),
    "RangeRequest": (
        [
            _f("key", 1, BYTES),
            _f("range_end", 2, BYTES),
            _f("limit", 3, I64),
            _f("revision", 4, I64),
            _f("sort_order", 5, "enum:RangeRequest.SortOrder"),
            _f("sort_target", 6, "enum:RangeRequest.SortTarget"),
            _f("serializable", 7, BOOL),
            _f("keys_only", 8, BOOL),
            _f("count_only", 9, BOOL),
            _f("min_mod_revision", 10, I64),
            _f("max_mod_revision", 11, I64),
            _f("min_create_revision", 12, I64),
            _f("max_create_revision", 13, I64),
        ],
        {
            "SortOrder": ["NONE", "ASCEND", "DESCEND"],
            "SortTarget": ["KEY", "VERSION", "CREATE", "MOD", "VALUE"],
        },
        (),
    ),
    "RangeResponse": (
        [
            _f("header", 1, "ResponseHeader"),
            _f("kvs", 2, "KeyValue", repeated=True),
            _f("more", 3, BOOL),
            _f("count", 4, I64),
        ],
        {},
        (),
    ),
    "PutRequest": (
        [
            _f("key", 1, BYTES),
            _f("value", 2, BYTES),
            _f("lease", 3, I64),
            _f("prev_kv", 4, BOOL),
            _f("ignore_value", 5, BOOL),
            _f("ignore_lease", 6, BOOL),
        ],
        {},
        (),
    ),
    "PutResponse": ([_f("header", 1, "ResponseHeader"), _f("prev_kv", 2, "KeyValue")], {}, ()),
    "DeleteRangeRequest": (
        [_f("key", 1, BYTES), _f("range_end", 2, BYTES), _f("prev_kv", 3, BOOL)],
        {},
        (),
    ),
    "DeleteRangeResponse": (
        [
            _f("header", 1, "ResponseHeader"),
            _f("deleted", 2, I64),
            _f("prev_kvs", 3, "KeyValue", repeated=True),
        ],
        {},
        (),
    ),
    "RequestOp": (
        [
            _f("request_range", 1, "RangeRequest", oneof=0),
            _f("request_put", 2, "PutRequest", oneof=0),
            _f("request_delete_range", 3, "DeleteRangeRequest", oneof=0),
            _f("request_txn", 4, "TxnRequest", oneof=0),
        ],
        {},
        ("request",),
    ),
    "ResponseOp": (
        [
            _f("response_range", 1, "RangeResponse", oneof=0),
            _f("response_put", 2, "PutResponse", oneof=0),
            _f("response_delete_range", 3, "DeleteRangeResponse", oneof=0),
            _f("response_txn", 4, "TxnResponse", oneof=0),
        ],
        {},
        ("response",),
    ),
    "Compare": (
        [
            _f("result", 1, "enum:Compare.CompareResult"),
            _f("target", 2, "enum:Compare.CompareTarget"),
            _f("key", 3, BYTES),
            _f("version", 4, I64, oneof=0),
            _f("create_revision", 5, I64, oneof=0),
            _f("mod_revision", 6, I64, oneof=0),
            _f("value", 7, BYTES, oneof=0),
            _f("lease", 8, I64, oneof=0),
            _f("range_end", 64, BYTES),
        ],
        {
            "CompareResult": ["EQUAL", "GREATER", "LESS", "NOT_EQUAL"],
            "CompareTarget": ["VERSION", "CREATE", "MOD", "VALUE", "LEASE"],
        },
        ("target_union",),
    ),
    "TxnRequest": (
        [
            _f("compare", 1, "Compare", repeated=True),
            _f("success", 2, "RequestOp", repeated=True),
            _f("failure", 3, "RequestOp", repeated=True),
        ],
        {},
        (),
    ),
    "TxnResponse": (
        [
            _f("header", 1, "ResponseHeader"),
            _f("succeeded", 2, BOOL),
            _f("responses", 3, "ResponseOp", repeated=True),
        ],
        {},
        (),
    ),
    "LeaseGrantRequest": ([_f("TTL", 1, I64), _f("ID", 2, I64)], {}, ()),
    "LeaseGrantResponse": (
        [
            _f("header", 1, "ResponseHeader"),
            _f("ID", 2, I64),
            _f("TTL", 3, I64),
            _f("error", 4, STR),
        ],
        {},
        (),
    ),
    "LeaseRevokeRequest": ([_f("ID", 1, I64)], {}, ()),
    "LeaseRevokeResponse": ([_f("header", 1, "ResponseHeader")], {}, ()),
}


def _classes() -> dict[str, Any]:
    file = descriptor_pb2.FileDescriptorProto(
        name="etcd_subset.proto", package="etcd", syntax="proto3"
    )
    for name, (fields, enums, oneofs) in _MESSAGES.items():
        message = file.message_type.add(name=name)
        for enum_name, values in enums.items():
            message.enum_type.add(name=enum_name).value.extend(
                descriptor_pb2.EnumValueDescriptorProto(name=v, number=i)
                for i, v in enumerate(values)
            )
        for oneof in oneofs:
            message.oneof_decl.add(name=oneof)
        for fname, number, kind, type_name, repeated, oneof_index in fields:
            field = message.field.add(
                name=fname,
                json_name=fname,
                number=number,
                type=kind,  # type: ignore[arg-type]
                label=_F.LABEL_REPEATED if repeated else _F.LABEL_OPTIONAL,
            )
            if type_name:
                field.type_name = ".etcd." + type_name
            if oneof_index is not None:
                field.oneof_index = oneof_index
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return {
        name: message_factory.GetMessageClass(pool.FindMessageTypeByName("etcd." + name))
        for name in _MESSAGES
    }


PB = _classes()


def _to_dict(message: Any) -> dict[str, Any]:
    """grpc-gateway's JSON of a message as etcd configures it (original names, int64 as
    strings, bytes base64, enums by name, defaults left out): protobuf's own mapping."""
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


# Requests, built with the typed operations the client sends.
_KEYS = st.binary(max_size=24)
_REVS = st.integers(min_value=0, max_value=2**63 - 1)
_LEASES = st.one_of(st.none(), st.integers(min_value=0, max_value=2**63 - 1))
_RANGES = st.builds(
    Range,
    _KEYS,
    st.one_of(st.none(), _KEYS),
    limit=st.integers(min_value=0, max_value=2**40),
    count_only=st.booleans(),
    keys_only=st.booleans(),
    min_mod_revision=_REVS,
    descend=st.booleans(),
)
_PUTS = st.builds(Put, _KEYS, st.binary(max_size=64), _LEASES)
_DELETES = st.builds(Delete, _KEYS, st.one_of(st.none(), _KEYS))
_COMPARES = st.one_of(
    st.builds(Compare.modified, _KEYS, _REVS),
    st.builds(Compare.created, _KEYS, _REVS),
    st.builds(Compare.value_is, _KEYS, st.binary(max_size=32)),
    st.builds(Compare, _KEYS, st.just("VERSION"), _REVS),
)
_TXNS = st.recursive(
    st.builds(
        Txn,
        st.lists(_COMPARES, max_size=3),
        st.lists(st.one_of(_RANGES, _PUTS, _DELETES), max_size=4),
        st.lists(st.one_of(_RANGES, _PUTS, _DELETES), max_size=3),
    ),
    lambda inner: st.builds(
        Txn,
        st.lists(_COMPARES, max_size=2),
        st.lists(st.one_of(_RANGES, _PUTS, inner), max_size=3),
        st.lists(st.one_of(_RANGES, inner), max_size=2),
    ),
    max_leaves=8,
)


def _request(path: str) -> Any:
    return _kvproto.METHODS[path][1]


@CASES
@given(_TXNS)
def test_kvproto_encodes_transactions_as_protobuf_does(txn: Txn) -> None:
    """A transaction's gateway body, encoded by ``_kvproto``, parses with ``protobuf`` into the
    message ``protobuf`` makes of the same JSON (nested transactions, oneof members at 0)."""
    body = txn.to_json()
    ours = _kvproto.encode(_request("/v3/kv/txn"), body)
    expected = json_format.ParseDict(body, PB["TxnRequest"]())
    assert PB["TxnRequest"].FromString(ours) == expected
    # Field order aside, the same bytes: protobuf's own encoding decodes to the same message.
    assert PB["TxnRequest"].FromString(expected.SerializeToString()) == expected


@CASES
@given(st.one_of(_RANGES, _PUTS, _DELETES))
def test_kvproto_encodes_single_requests_as_protobuf_does(op: Range | Put | Delete) -> None:
    path, name = {
        Range: ("/v3/kv/range", "RangeRequest"),
        Put: ("/v3/kv/put", "PutRequest"),
        Delete: ("/v3/kv/deleterange", "DeleteRangeRequest"),
    }[type(op)]
    body = op.to_json()
    assert PB[name].FromString(_kvproto.encode(_request(path), body)) == json_format.ParseDict(
        body, PB[name]()
    )


@CASES
@given(st.integers(min_value=1, max_value=2**40), st.integers(min_value=0, max_value=2**62))
def test_kvproto_encodes_lease_requests_as_protobuf_does(ttl: int, lease: int) -> None:
    grant = {"TTL": ttl, "ID": str(lease)}
    ours = _kvproto.encode(_request("/v3/lease/grant"), grant)
    assert PB["LeaseGrantRequest"].FromString(ours) == json_format.ParseDict(
        grant, PB["LeaseGrantRequest"]()
    )
    revoke = {"ID": str(lease)}
    ours = _kvproto.encode(_request("/v3/lease/revoke"), revoke)
    assert PB["LeaseRevokeRequest"].FromString(ours) == json_format.ParseDict(
        revoke, PB["LeaseRevokeRequest"]()
    )


# Answers, built as protobuf messages.
_I64S = st.integers(min_value=-(2**63), max_value=2**63 - 1)
_U64S = st.integers(min_value=0, max_value=2**64 - 1)
_HEADERS = st.builds(
    lambda c, m, r, t: PB["ResponseHeader"](cluster_id=c, member_id=m, revision=r, raft_term=t),
    _U64S,
    _U64S,
    _I64S,
    _U64S,
)
_KVS = st.builds(
    lambda k, c, m, v, val, lease: PB["KeyValue"](
        key=k, create_revision=c, mod_revision=m, version=v, value=val, lease=lease
    ),
    _KEYS,
    _I64S,
    _I64S,
    _I64S,
    st.binary(max_size=64),
    _I64S,
)


def _range_response(header: Any, kvs: list[Any], more: bool, count: int) -> Any:
    return PB["RangeResponse"](header=header, kvs=kvs, more=more, count=count)


_RANGE_RESPONSES = st.builds(
    _range_response,
    st.one_of(st.none(), _HEADERS),
    st.lists(_KVS, max_size=4),
    st.booleans(),
    _I64S,
)
_PUT_RESPONSES = st.builds(
    lambda h, kv: PB["PutResponse"](header=h, prev_kv=kv),
    st.one_of(st.none(), _HEADERS),
    st.one_of(st.none(), _KVS),
)
_DELETE_RESPONSES = st.builds(
    lambda h, d, kvs: PB["DeleteRangeResponse"](header=h, deleted=d, prev_kvs=kvs),
    st.one_of(st.none(), _HEADERS),
    _I64S,
    st.lists(_KVS, max_size=3),
)


def _txn_response(header: Any, succeeded: bool, ops: list[tuple[str, Any]]) -> Any:
    answer = PB["TxnResponse"](header=header, succeeded=succeeded)
    for field, value in ops:
        getattr(answer.responses.add(), field).CopyFrom(value)
    return answer


_TXN_RESPONSES = st.recursive(
    st.builds(
        _txn_response,
        st.one_of(st.none(), _HEADERS),
        st.booleans(),
        st.lists(
            st.one_of(
                st.tuples(st.just("response_range"), _RANGE_RESPONSES),
                st.tuples(st.just("response_put"), _PUT_RESPONSES),
                st.tuples(st.just("response_delete_range"), _DELETE_RESPONSES),
            ),
            max_size=4,
        ),
    ),
    lambda inner: st.builds(
        _txn_response,
        st.one_of(st.none(), _HEADERS),
        st.booleans(),
        st.lists(
            st.one_of(
                st.tuples(st.just("response_range"), _RANGE_RESPONSES),
                st.tuples(st.just("response_txn"), inner),
            ),
            max_size=3,
        ),
    ),
    max_leaves=8,
)


def _answer(path: str) -> Any:
    return _kvproto.METHODS[path][2]


@CASES
@given(_TXN_RESPONSES)
def test_kvproto_decodes_answers_as_protobuf_maps_them(answer: Any) -> None:
    """What ``protobuf`` encodes of a transaction's answer (nested ones, empty oneof members,
    negative int64, uint64 above 2**63), ``_kvproto`` decodes to protobuf's own JSON mapping."""
    assert _kvproto.decode(_answer("/v3/kv/txn"), answer.SerializeToString()) == _to_dict(answer)


@CASES
@given(
    _RANGE_RESPONSES,
    _PUT_RESPONSES,
    _DELETE_RESPONSES,
    _HEADERS,
    _I64S,
    _I64S,
    st.text(alphabet=_TEXT, max_size=40),
)
def test_kvproto_decodes_single_answers_as_protobuf_maps_them(
    rng: Any, put: Any, delete: Any, header: Any, lease: int, ttl: int, error: str
) -> None:
    for path, answer in (
        ("/v3/kv/range", rng),
        ("/v3/kv/put", put),
        ("/v3/kv/deleterange", delete),
        (
            "/v3/lease/grant",
            PB["LeaseGrantResponse"](header=header, ID=lease, TTL=ttl, error=error),
        ),
        ("/v3/lease/revoke", PB["LeaseRevokeResponse"](header=header)),
    ):
        assert _kvproto.decode(_answer(path), answer.SerializeToString()) == _to_dict(answer), path


@CASES
@given(_TXN_RESPONSES, st.data())
def test_kvproto_refuses_mangled_answers_with_value_error(answer: Any, data: st.DataObject) -> None:
    """A transaction's answer cut short or with bytes flipped: decoded to what protobuf reads of
    it where protobuf reads it, or refused with ValueError; never another exception."""
    wire = bytearray(answer.SerializeToString())
    if wire:
        cut = data.draw(st.integers(min_value=0, max_value=len(wire) - 1))
        if data.draw(st.booleans()):
            del wire[cut:]
        else:
            wire[cut] ^= data.draw(st.integers(min_value=1, max_value=255))
    try:
        ours: dict[str, Any] | None = _kvproto.decode(_answer("/v3/kv/txn"), bytes(wire))
    except ValueError:
        ours = None
    try:
        theirs: dict[str, Any] | None = _to_dict(PB["TxnResponse"].FromString(bytes(wire)))
    except Exception:
        theirs = None
    if ours is not None and theirs is not None:
        assert ours == theirs


def test_the_oracle_sees_a_wrong_field_number() -> None:
    """The comparison can fail: a range request whose ``keys_only`` went out as field 9
    (``count_only``) parses to a different message."""
    body = Range(b"k", keys_only=True).to_json()
    wrong = b"\x0a\x01k" + b"\x48\x01"  # key, then field 9 varint 1
    assert PB["RangeRequest"].FromString(wrong) != json_format.ParseDict(body, PB["RangeRequest"]())
    assert PB["RangeRequest"].FromString(_kvproto.encode(_request("/v3/kv/range"), body)) == (
        json_format.ParseDict(body, PB["RangeRequest"]())
    )
    assert base64.b64decode(body["key"]) == b"k"
