"""etcd's key-value operations as types: what a transaction compares, reads, writes and deletes
(:class:`Compare`, :class:`Range`, :class:`Put`, :class:`Delete`, a nested :class:`Txn`), and
what it answers (:class:`TxnResult`, :class:`RangeResult`).

A caller builds a :class:`Txn` and sends it with :meth:`EtcdClient.txn
<flashckpt.elastic.etcd.client.EtcdClient.txn>`; the request body (the JSON gateway's, with
base64 keys and values, which the gRPC path translates to protobuf) is written here and
nowhere else, and the answer is read here::

    txn = Txn(
        compare=[Compare.created(b"job/lead", 0)],
        success=[Put(b"job/lead", b"node-3", lease=lease.id), Range(b"job/lead")],
        failure=[Range(b"job/lead")],
    )
    result = client.txn(txn)
    holder = result.kvs(0 if not result.succeeded else 1)

Keys and values are ``bytes`` or ``str`` (UTF-8 encoded).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from flashckpt.elastic.etcd._wire import (
    Key,
    KeyValue,
    Value,
    b64,
    header_revision,
    kv_from_json,
    prefix_range_end,
    to_bytes,
)

__all__ = ["Compare", "Delete", "Op", "Put", "Range", "RangeResult", "Txn", "TxnResult"]

Target = Literal["MOD", "CREATE", "VALUE", "VERSION"]
_FIELD = {
    "MOD": "mod_revision",
    "CREATE": "create_revision",
    "VALUE": "value",
    "VERSION": "version",
}


@dataclass(frozen=True, slots=True)
class Compare:
    """A transaction's condition: the key's ``target`` equals ``value``. A revision or version
    of 0 means the key is absent."""

    key: Key
    target: Target
    value: int | Value

    @classmethod
    def modified(cls, key: Key, mod_revision: int) -> Compare:
        """Holds while ``key`` was last written at ``mod_revision`` (0: the key is absent)."""
        return cls(key, "MOD", mod_revision)

    @classmethod
    def created(cls, key: Key, create_revision: int) -> Compare:
        """Holds while ``key`` was created at ``create_revision`` (0: the key is absent)."""
        return cls(key, "CREATE", create_revision)

    @classmethod
    def value_is(cls, key: Key, value: Value) -> Compare:
        """Holds while ``key`` holds ``value`` (false when the key is absent)."""
        return cls(key, "VALUE", value)

    def to_json(self) -> dict[str, Any]:
        """The JSON gateway's form of this compare."""
        if self.target not in _FIELD:
            raise ValueError(
                f"etcd compare target must be one of {sorted(_FIELD)}, got {self.target!r}"
            )
        value = self.value
        if self.target == "VALUE":
            rendered = b64(to_bytes(value, "compare value"))  # type: ignore[arg-type]
        elif isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            rendered = str(value)
        else:
            raise ValueError(
                f"etcd compare of {self.target} needs an int >= 0 (0: the key is absent), got "
                f"{value!r}"
            )
        return {
            "key": b64(to_bytes(self.key, "key")),
            "target": self.target,
            "result": "EQUAL",
            _FIELD[self.target]: rendered,
        }


@dataclass(frozen=True, slots=True)
class Range:
    """A read of the key ``key``, or of the keys from ``key`` to ``end`` (excluded; ``b"\\x00"``:
    every key from ``key`` on)."""

    key: Key
    end: Key | None = None
    limit: int = 0
    """At most this many keys (0: all); the answer's ``count`` is every key of the range."""
    count_only: bool = False
    """Count the keys without returning them."""
    keys_only: bool = False
    """Return the keys without their values (``value`` is ``b""``)."""
    min_mod_revision: int = 0
    """Only keys last written at this revision or later (0: all)."""
    descend: bool = False
    """Sorted by key, the last first (with ``limit``: the ``limit`` keys nearest ``end``; etcd
    reads every key of a sorted range's span whatever its limit)."""

    @classmethod
    def prefix(
        cls,
        prefix: Key,
        *,
        count_only: bool = False,
        keys_only: bool = False,
    ) -> Range:
        """Every key that starts with ``prefix`` (an empty one: every key)."""
        start = to_bytes(prefix, "prefix")
        return cls(
            start or b"\x00", prefix_range_end(start), count_only=count_only, keys_only=keys_only
        )

    def to_json(self) -> dict[str, Any]:
        """The JSON gateway's ``RangeRequest``."""
        body: dict[str, Any] = {"key": b64(to_bytes(self.key, "key"))}
        if self.end is not None:
            body["range_end"] = b64(to_bytes(self.end, "range end"))
        if self.limit < 0 or self.min_mod_revision < 0:
            raise ValueError(f"a range's limit and min_mod_revision must be >= 0: {self!r}")
        if self.limit:
            body["limit"] = str(self.limit)
        if self.count_only:
            body["count_only"] = True
        if self.keys_only:
            body["keys_only"] = True
        if self.min_mod_revision:
            body["min_mod_revision"] = str(self.min_mod_revision)
        if self.descend:
            body["sort_order"] = "DESCEND"
            body["sort_target"] = "KEY"
        return body


@dataclass(frozen=True, slots=True)
class Put:
    """A write of ``value`` to ``key``, attached to the lease ``lease`` (``None``: none)."""

    key: Key
    value: Value
    lease: int | None = None
    """The lease's id (``None`` or 0: none)."""

    def to_json(self) -> dict[str, Any]:
        """The JSON gateway's ``PutRequest``."""
        body: dict[str, Any] = {
            "key": b64(to_bytes(self.key, "key")),
            "value": b64(to_bytes(self.value, "value")),
        }
        if self.lease:  # 0: none, as etcd reads it
            body["lease"] = str(self.lease)
        return body


@dataclass(frozen=True, slots=True)
class Delete:
    """A delete of the key ``key``, or of the keys from ``key`` to ``end`` (excluded)."""

    key: Key
    end: Key | None = None

    @classmethod
    def prefix(cls, prefix: Key) -> Delete:
        """Every key that starts with ``prefix``.

        Raises:
            ValueError: If ``prefix`` is empty (that would delete every key).
        """
        start = to_bytes(prefix, "prefix")
        if not start:
            raise ValueError("refusing to delete with an empty prefix: it would delete every key")
        return cls(start, prefix_range_end(start))

    def to_json(self) -> dict[str, Any]:
        """The JSON gateway's ``DeleteRangeRequest``."""
        body: dict[str, Any] = {"key": b64(to_bytes(self.key, "key"))}
        if self.end is not None:
            body["range_end"] = b64(to_bytes(self.end, "range end"))
        return body


@dataclass(frozen=True, slots=True)
class Txn:
    """A transaction: if every compare holds, the ``success`` operations run, else the
    ``failure`` ones, atomically. A transaction may nest in another (as an operation)."""

    compare: Sequence[Compare] = ()
    success: Sequence[Op] = ()
    failure: Sequence[Op] = ()

    @property
    def writes(self) -> bool:
        """Whether any branch puts or deletes (a nested transaction's included)."""
        return any(
            isinstance(op, (Put, Delete)) or (isinstance(op, Txn) and op.writes)
            for op in (*self.success, *self.failure)
        )

    @property
    def idempotent(self) -> bool:
        """Whether sending it twice does what sending it once does, so an attempt whose answer
        was lost may be sent again: true unless it writes under a condition (a second try
        would find the condition changed by the first and answer as if it failed)."""
        return not (self.compare and self.writes)

    def to_json(self) -> dict[str, Any]:
        """The JSON gateway's ``TxnRequest``."""
        body: dict[str, Any] = {}
        if self.compare:
            body["compare"] = [c.to_json() for c in self.compare]
        body["success"] = [_op_json(op) for op in self.success]
        if self.failure:
            body["failure"] = [_op_json(op) for op in self.failure]
        return body


Op = Range | Put | Delete | Txn
"""One operation of a transaction's branch."""


def _op_json(op: Op) -> dict[str, Any]:
    if isinstance(op, Range):
        return {"request_range": op.to_json()}
    if isinstance(op, Put):
        return {"request_put": op.to_json()}
    if isinstance(op, Delete):
        return {"request_delete_range": op.to_json()}
    if isinstance(op, Txn):
        return {"request_txn": op.to_json()}
    raise TypeError(f"not an etcd operation: {op!r} (use Range, Put, Delete or Txn)")


@dataclass(frozen=True, slots=True)
class RangeResult:
    """What a :class:`Range` read."""

    kvs: list[KeyValue]
    """The keys read, sorted by key (or as asked); empty with ``count_only``."""
    count: int
    """Every key of the range (not only those returned, with a ``limit``)."""

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> RangeResult:
        """Reads the gateway's ``RangeResponse``."""
        return cls(
            [kv_from_json(kv) for kv in raw.get("kvs") or []],
            int(raw.get("count", 0)),
        )


_NO_RANGE = RangeResult([], 0)


@dataclass(frozen=True, slots=True)
class TxnResult:
    """What a :class:`Txn` answered: which branch ran, the store's revision after it, and one
    answer per operation of that branch (read with :meth:`range`, :meth:`kvs`, :meth:`count`,
    :meth:`deleted`, :meth:`txn` by the operation's index)."""

    succeeded: bool
    """Whether the compares held (the ``success`` branch ran)."""
    revision: int
    """The store's revision after the transaction."""
    responses: Sequence[dict[str, Any]] = ()
    """The branch's answers as the gateway sent them (read with the methods)."""

    @classmethod
    def from_json(cls, response: dict[str, Any]) -> TxnResult:
        """Reads the gateway's ``TxnResponse``."""
        return cls(
            bool(response.get("succeeded")),
            header_revision(response),
            response.get("responses") or [],
        )

    def __len__(self) -> int:
        return len(self.responses)

    def range(self, index: int) -> RangeResult:
        """The answer of the read at ``index`` (empty when there is none there)."""
        if not 0 <= index < len(self.responses):
            return _NO_RANGE
        raw = self.responses[index].get("response_range")
        return _NO_RANGE if raw is None else RangeResult.from_json(raw)

    def kvs(self, index: int) -> list[KeyValue]:
        """The keys the read at ``index`` returned (none when there is no read there)."""
        return self.range(index).kvs

    def count(self, index: int) -> int:
        """The keys the read at ``index`` counted (0 when there is no read there)."""
        return self.range(index).count

    def deleted(self, index: int) -> int:
        """How many keys the delete at ``index`` deleted."""
        if not 0 <= index < len(self.responses):
            return 0
        return int(self.responses[index].get("response_delete_range", {}).get("deleted", 0))

    def txn(self, index: int) -> TxnResult:
        """The answer of the nested transaction at ``index`` (with this one's revision); a
        failed empty answer when there is none there."""
        if not 0 <= index < len(self.responses):
            return TxnResult(False, self.revision)
        raw = self.responses[index].get("response_txn") or {}
        return TxnResult(bool(raw.get("succeeded")), self.revision, raw.get("responses") or [])
