"""What etcd's v3 JSON gateway sends and receives: keys and values (base64 in JSON), key
ranges, and the entries and leases it answers with."""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

__all__ = ["Key", "KeyValue", "Lease", "Value", "prefix_end"]

Key = str | bytes
Value = str | bytes


@dataclass(frozen=True, slots=True)
class KeyValue:
    """One key as stored in etcd."""

    key: bytes
    """The key."""
    value: bytes
    """The value (``b""`` for an empty value)."""
    mod_revision: int
    """Revision of the last write to this key; the token for :meth:`EtcdClient.compare_and_set`."""
    create_revision: int
    """Revision at which this key was created (again, after a delete)."""
    version: int
    """Number of writes since the key was created."""
    lease: int
    """ID of the lease the key is attached to, ``0`` if none."""


@dataclass(frozen=True, slots=True)
class Lease:
    """A lease granted by etcd; keys put with it are deleted when it expires or is revoked."""

    id: int
    """The lease ID."""
    ttl: timedelta
    """The TTL etcd granted (etcd may raise a too-small requested TTL to its minimum)."""


def to_bytes(data: Key | Value, what: str) -> bytes:
    if isinstance(data, bytes):
        return data
    if isinstance(data, str):
        return data.encode()
    raise TypeError(f"etcd {what} must be str or bytes, got {type(data).__name__}")


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def mod_revision_is(key_b64: str, mod_revision: int) -> dict[str, str]:
    """A transaction compare that holds while the key was last modified at ``mod_revision``
    (0: the key is absent)."""
    return {"key": key_b64, "target": "MOD", "result": "EQUAL", "mod_revision": str(mod_revision)}


def unb64(text: str | None) -> bytes:
    # binascii's decoder is what base64.b64decode calls, without its Python wrapper (a watch
    # event decodes two of these): the same bytes, the same errors.
    return binascii.a2b_base64(text) if text else b""


def prefix_range_end(prefix: bytes) -> bytes:
    """The smallest key greater than every key that starts with ``prefix``."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\x00"  # With key b"\x00" this means "every key".


def prefix_end(prefix: Key) -> bytes:
    """The end of the range of every key that starts with ``prefix`` (for
    :meth:`EtcdClient.counts`)."""
    return prefix_range_end(to_bytes(prefix, "prefix"))


def prefix_range(prefix: bytes) -> dict[str, Any]:
    """The range-request fields that select every key starting with ``prefix``."""
    return {"key": b64(prefix or b"\x00"), "range_end": b64(prefix_range_end(prefix))}


def lease_id(lease: Lease | int) -> int:
    return lease.id if isinstance(lease, Lease) else int(lease)


def ttl_seconds(ttl: timedelta) -> int:
    seconds = ttl.total_seconds()
    if seconds < 1:
        raise ValueError(f"lease ttl must be at least 1 second (etcd's unit), got {ttl!r}")
    return int(-(-seconds // 1))  # ceil: never grant less than asked


def kv_from_json(raw: dict[str, Any]) -> KeyValue:
    return KeyValue(
        key=unb64(raw.get("key")),
        value=unb64(raw.get("value")),
        mod_revision=int(raw.get("mod_revision", 0)),
        create_revision=int(raw.get("create_revision", 0)),
        version=int(raw.get("version", 0)),
        lease=int(raw.get("lease", 0)),
    )


def kv_from_event_json(raw: dict[str, Any]) -> KeyValue:
    """A watch event's ``kv`` (or ``prev_kv``), stricter than :func:`kv_from_json`: its key and
    ``mod_revision`` must be there (a watch event always has both; a missing revision read as 0
    would drop the event as one already reported), and base64 is decoded strictly. Raises
    ``KeyError``, ``TypeError`` or ``ValueError`` (``binascii.Error``) on a malformed entry
    (the watch names the field: ``watchstream._malformed``)."""
    value = raw.get("value")
    return KeyValue(
        key=binascii.a2b_base64(raw["key"], strict_mode=True),
        value=binascii.a2b_base64(value, strict_mode=True) if value is not None else b"",
        mod_revision=int(raw["mod_revision"]),
        create_revision=int(raw.get("create_revision", 0)),
        version=int(raw.get("version", 0)),
        lease=int(raw.get("lease", 0)),
    )


def header_revision(response: dict[str, Any]) -> int:
    return int(response.get("header", {}).get("revision", 0))
