"""The etcd request bodies the rendezvous builds (puts, ranges, deletes, compares of a
transaction) and what it reads of an answer. Split out of
:mod:`flashckpt.elastic.rendezvous.handler` (issue 45).
"""

from __future__ import annotations

import base64
from typing import Any

from flashckpt.elastic.etcd.client import (
    KeyValue,
)
from flashckpt.elastic.etcd.watchstream import (
    prefix_end,
)


# ------------------------------------------------------------------------------ etcd ops
def _b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode("ascii")


def _put(key: str, value: bytes, lease: int | None = None) -> dict[str, Any]:
    op: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
    if lease:
        op["lease"] = str(lease)
    return {"request_put": op}


def _range(
    key: str, *, prefix: bool = False, count_only: bool = False, keys_only: bool = False
) -> dict[str, Any]:
    op: dict[str, Any] = {"key": _b64(key)}
    if prefix:
        op["range_end"] = _b64(prefix_end(key.encode()))
    if count_only:
        op["count_only"] = True
    if keys_only:
        op["keys_only"] = True
    return {"request_range": op}


def _delete(key: str, *, prefix: bool = False) -> dict[str, Any]:
    op: dict[str, Any] = {"key": _b64(key)}
    if prefix:
        op["range_end"] = _b64(prefix_end(key.encode()))
    return {"request_delete_range": op}


def _cmp(key: str, target: str, value: int | bytes) -> dict[str, Any]:
    field = {"MOD": "mod_revision", "CREATE": "create_revision", "VALUE": "value"}[target]
    return {
        "key": _b64(key),
        "target": target,
        "result": "EQUAL",
        field: _b64(value) if isinstance(value, bytes) else str(value),
    }


def _kvs(response: dict[str, Any], index: int) -> list[KeyValue]:
    responses = response.get("responses") or []
    if index >= len(responses):
        return []
    raw = responses[index].get("response_range", {}).get("kvs") or []
    return [
        KeyValue(
            key=base64.b64decode(r.get("key") or ""),
            value=base64.b64decode(r.get("value") or ""),
            mod_revision=int(r.get("mod_revision", 0)),
            create_revision=int(r.get("create_revision", 0)),
            version=int(r.get("version", 0)),
            lease=int(r.get("lease", 0)),
        )
        for r in raw
    ]


def _revision(response: dict[str, Any]) -> int:
    return int(response.get("header", {}).get("revision", 0))
