"""A rendezvous whose cost per machine does not grow with the job: torch's ``RendezvousHandler``
implemented directly on etcd v3, with one small key per machine and one small write per round.

torch's ``DynamicRendezvousHandler`` keeps the whole job (participants, wait list, heartbeats) in
one value that every machine rewrites by compare-and-set on each join and heartbeat: O(N) bytes
per write, O(N) collisions per join, N^2 for the job; past a few dozen machines most writes are
retries (``benchmarks/README.md``, issue 31). Here:

Keys (under the job's prefix ``<key_prefix>/<run_id>/rdzv/``; ``<R>`` is a round, 12 digits):

- ``r/<R>/a/<node>``: machine ``<node>`` joined round ``R``. Bound to the machine's lease (the
  launcher's node lease, :meth:`RdzvHandler.share_lease`, renewed every ``lease_ttl / 5``; under
  torchrun a lease of the handler's own, renewed every ``lease_ttl / 3``: the keep-alive is the
  heartbeat, nothing is rewritten), so it disappears with the machine. Value: a small JSON
  object (node, its last group rank and the round of it: its *claim*).
- ``r/<R>/c/lead``: the machine that decides when round ``R`` closes (its *lead*), bound to its
  lease: created if absent by a waiting machine; when the lead dies, another takes over.
- ``r/<R>/c/result``: the round's outcome, written once by the lead in one transaction that
  creates it only if absent: round number, world size and the members in rank order, as the
  ``create_revision`` of their join keys, packed in fixed width (2-3 bytes each; a machine
  finds its rank with one search of the bytes, :class:`PackedMembers`). The packed members go
  in parts of at most :data:`_RESULT_PART_CHARS` (~1,000-1,500 machines): ``c/result`` holds
  the first, ``c/result.1``, ``c/result.2``, ... the others, written in the same transaction,
  so no value is larger than ~3.3 KiB at any size and a waiter receives them together.
- ``r/<R>/c/next-member``, ``r/<R>/c/next-other``: a member of round ``R`` (or another
  machine) joined round ``R + 1``: created by the first such join, inside its transaction (no
  request of its own), on its lease; ``r/<R>/c/next-result``: round ``R + 1`` formed (written
  with its result); ``r/<R>/c/room``: written once by the lead of ``R + 1`` when round ``R``
  was full and lost a member (a machine not of ``R`` now counts as waiting, below). What the
  next round says to the members of ``R`` is one key each, under ``R``'s control keys: their
  watch never follows the next round's N join keys.
- ``round``: the newest closed round. Every join is a transaction that compares this key's
  revision with the one the machine last read, so no machine can join a round that closed
  meanwhile (a stale round number is refused, and the refusal carries the key: the machine joins
  again from it, never joins a world it is not in). A join is one request when the machine's
  knowledge is current (round 1; a member's join of the round after its own).
- ``closed``: the rendezvous is closed (the job finished); on a lease of ``state_ttl``.

A round ``R`` closes when every live member of round ``R - 1`` joined it (a dead member's key
went with its lease, or was deleted by a peer that found it dead: :meth:`expire_nodes`) and
``max_nodes`` machines joined, or ``min_nodes`` did and ``last_call_timeout`` passed since. The
lead follows the joins with one watch (O(1) work per join); the others wait on a watch of the
round's control keys, whose event carries the result (no read).
The lead of ``R`` deletes
the keys of round ``R - 2`` and its store keys, so a job holds at most three rounds of keys at
any time.

Group ranks are stable: a member of the previous round keeps its rank if it is below the new
world size (:func:`flashckpt.elastic.rendezvous.stable_ranks.assign_ranks`); standbys and new
machines take the free ranks (a standby takes a dead machine's rank). Only the lead computes them.

While its workers train, a member answers ``num_nodes_waiting()`` from the watch its wait for
the result followed, which goes on with the ``next-*`` and ``room`` keys of its round, never
from an etcd read and without a watch of its own. A joining member of its round always counts;
another machine counts only while the round has room: it had fewer than ``max_nodes``
members, or its next round's lead said it lost one (``room``; a standby of a full round waits
without restarting anybody, as in torch's redundancy list).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import itertools
import json
import logging
import os
import random
import socket
import struct
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStateError,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.utils.distributed import get_free_port

from flashckpt.elastic.deadline import Deadline
from flashckpt.elastic.etcd.client import (
    EtcdClient,
    EtcdError,
    EtcdLeaseNotFound,
    EtcdOutcomeUnknown,
    KeyValue,
    Lease,
)
from flashckpt.elastic.etcd.watchstream import (
    WatchClosed,
    WatchCompacted,
    WatchEvent,
    WatchStream,
    prefix_end,
)
from flashckpt.elastic.rendezvous.name import BACKEND_NAME
from flashckpt.elastic.rendezvous.stable_ranks import RankClaim, assign_ranks

__all__ = [
    "DEFAULT_LEASE_TTL",
    "LeaseSource",
    "PackedMembers",
    "RdzvHandler",
    "RdzvSettings",
    "decode_members",
    "encode_members",
]

logger = logging.getLogger(__name__)

DEFAULT_LEASE_TTL = timedelta(seconds=10)
_RESULT_VERSION = 3  # 1: the members as varints (decoded in full by every waiter); 2: as 3,
# the members' watches followed the next round's joins (no next-* keys: a job mixing 2 and 3 would
# not count every restart, so it is refused)
_JOIN_VERSION = 1
_MAX_VALUE_BYTES = 128 << 10  # a value of the rendezvous larger than this is not ours
_RESULT_PART_CHARS = 3000
"""A round's members are written in parts of at most this many characters: ``c/result`` carries
the first (with the round, world, digest, closer, master), ``c/result.1``, ``c/result.2``, ...
the others, all in the one transaction that closes the round (so a waiter receives them
together: one revision, one watch message). No value the rendezvous writes is larger than
~3.3 KiB at any size (issue 31; the members take 2-3 bytes each: ~1,000-1,500 per part)."""
_MAX_RESULT_PARTS = 64
"""At most this many parts after the first (~190,000 characters, 60,000+ machines)."""
_MAX_ROUND = 10**12 - 1
_ROOM = "room"
"""``r/<R>/c/room``: written once by round ``R + 1``'s lead when round ``R`` was full and lost
a member: a machine that is not of round ``R`` now counts as waiting for its members."""
_NEXT_MEMBER = "next-member"
"""``r/<R>/c/next-member``: a member of round ``R`` joined round ``R + 1`` (created by the first
such join, in its transaction, on its lease; a later one creates it again if it went)."""
_NEXT_OTHER = "next-other"
"""``r/<R>/c/next-other``: a machine not of round ``R`` joined round ``R + 1`` (the same way)."""
_NEXT_RESULT = "next-result"
"""``r/<R>/c/next-result``: round ``R + 1`` formed (written with its result)."""
_NEXT_KEYS = frozenset({_ROOM, _NEXT_MEMBER, _NEXT_OTHER, _NEXT_RESULT})
"""The control keys of a round that its members' watches follow (:class:`_MemberWatch`): what
the next round's joins, lead and result say to them, one key each, whatever the size of the
round (the next round's join keys themselves are not watched: a member's watch received every
join of the next round until it stopped, up to N each, N^2 for the job; issue 31)."""
_WAIT_SLICE_S = 30.0  # a waiter re-checks its lease at least this often
_QUIET_READ_S = 30.0  # a waiter reads its round's control keys after a watch this quiet
_node_ids = itertools.count()


# ------------------------------------------------------------------------------ encodings
_WIDTH_CODES = {1: "B", 2: "H", 3: "", 4: "I", 8: "Q"}  # "": no struct code (tolist)
_PACK_HEAD = 9  # the width (1 byte) and the base (8 bytes, big-endian)


def encode_members(revisions: Sequence[int]) -> str:
    """The members of a round in rank order (their join keys' ``create_revision``), packed in
    fixed width: one byte ``w`` (1, 2, 3, 4 or 8), the smallest revision as 8 bytes, then each
    member's offset from it in ``w`` bytes, big-endian; base64. 2 bytes per machine for a round
    whose machines joined within 65,536 revisions (2.7 KiB for 1,024 machines, as the varints
    of version 1), 3 within 16.7 million (a standby that waited long before the others
    joined), but a machine finds its rank with one search of the bytes
    (:class:`PackedMembers`), without decoding the list (issue 31: every waiter of a round of
    1,024 decoded 1,024 varints in Python).

    Raises:
        ValueError: If a revision is negative or above 2**63.
    """
    base = min(revisions, default=0)
    top = max(revisions, default=0)
    if base < 0 or top >= 1 << 63:
        raise ValueError(f"revisions must be in [0, 2**63), got {base}..{top}")
    width = next(w for w in _WIDTH_CODES if top - base < 1 << (8 * w))
    raw = bytearray([width]) + base.to_bytes(8, "big")
    code = _WIDTH_CODES[width]
    if code:
        raw += struct.pack(f">{len(revisions)}{code}", *(r - base for r in revisions))
    else:
        for r in revisions:
            raw += (r - base).to_bytes(width, "big")
    return base64.b64encode(bytes(raw)).decode("ascii")


class PackedMembers:
    """A round's members as :func:`encode_members` packed them: its size, a member's rank
    (:meth:`rank_of`) and membership without decoding the list; :meth:`tolist` decodes it
    (where the whole list is needed: the lead, :meth:`RdzvHandler.members`).

    Raises:
        ValueError: If ``text`` is not such a packing.
    """

    __slots__ = ("_base", "_code", "_n", "_raw", "_width")

    def __init__(self, text: str) -> None:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
        if len(raw) < _PACK_HEAD or raw[0] not in _WIDTH_CODES:
            raise ValueError("not a packing of members (no width and base)")
        width = raw[0]
        if (len(raw) - _PACK_HEAD) % width:
            raise ValueError(f"{len(raw) - _PACK_HEAD} bytes of members of {width} bytes each")
        base = int.from_bytes(raw[1:_PACK_HEAD], "big")
        if base >= 1 << 63:
            raise ValueError("a base revision above 2**63")
        self._raw, self._width, self._base = raw, width, base
        self._code = _WIDTH_CODES[width]
        self._n = (len(raw) - _PACK_HEAD) // width

    def __len__(self) -> int:
        return self._n

    def _find(self, revision: int, start: int) -> int:
        """The first aligned position of ``revision`` at or after byte ``start``; -1: none."""
        offset = revision - self._base
        if not 0 <= offset < 1 << (8 * self._width):
            return -1
        needle = offset.to_bytes(self._width, "big")
        at = self._raw.find(needle, start)
        while at >= 0 and (at - _PACK_HEAD) % self._width:
            at = self._raw.find(needle, at + 1)
        return at

    def rank_of(self, revision: int) -> int | None:
        """The rank of the member ``revision`` (None: not a member): one search of the bytes.

        Raises:
            ValueError: ``revision`` is there twice (two ranks for one machine).
        """
        at = self._find(revision, _PACK_HEAD)
        if at < 0:
            return None
        if self._find(revision, at + self._width) >= 0:
            raise ValueError(f"member {revision} is there twice")
        return (at - _PACK_HEAD) // self._width

    def __contains__(self, revision: object) -> bool:
        return isinstance(revision, int) and self._find(revision, _PACK_HEAD) >= 0

    def tolist(self) -> list[int]:
        """Every member, in rank order."""
        base, raw, width = self._base, self._raw, self._width
        if self._code:
            offsets = struct.unpack_from(f">{self._n}{self._code}", raw, _PACK_HEAD)
            return [base + o for o in offsets]
        return [
            base + int.from_bytes(raw[at : at + width], "big")
            for at in range(_PACK_HEAD, len(raw), width)
        ]


def decode_members(text: str) -> list[int]:
    """Inverse of :func:`encode_members`.

    Raises:
        ValueError: If ``text`` is not such a packing.
    """
    return PackedMembers(text).tolist()


@dataclass(frozen=True, slots=True)
class _Result:
    round: int
    members: PackedMembers  # create revisions of the members' join keys, in rank order
    digest: str
    closer: str
    master: tuple[str, int] | None  # rank 0's address and a port free on it, from its join


def _result_kvs(kvs: Sequence[KeyValue]) -> list[KeyValue]:
    """The keys of a round's result among ``kvs`` (its ``c/`` keys): ``c/result`` and its parts."""
    return [kv for kv in kvs if kv.key.rsplit(b"/", 1)[-1].split(b".", 1)[0] == b"result"]


def _decode_result(kvs: Sequence[KeyValue], expected_round: int) -> tuple[_Result, KeyValue]:
    """A round's result from its keys (``c/result`` and its parts, :data:`_RESULT_PART_CHARS`),
    and the ``c/result`` key itself."""
    header = next((kv for kv in kvs if kv.key.endswith(b"/c/result")), None)
    if header is None:
        raise RendezvousStateError(
            f"the rendezvous result of round {expected_round} has no c/result key ({len(kvs)} "
            "parts): the job's keys were changed by something else; use another --rdzv-id"
        )
    where = header.key.decode(errors="replace")
    if len(header.value) > _MAX_VALUE_BYTES:
        raise RendezvousStateError(f"the rendezvous result {where!r} is {len(header.value)} bytes")
    try:
        doc = json.loads(header.value)
        if not isinstance(doc, dict) or doc.get("v") != _RESULT_VERSION:
            raise ValueError(f"version {doc.get('v') if isinstance(doc, dict) else doc!r}")
        parts = doc.get("parts", 0)
        if type(parts) is not int or not 0 <= parts <= _MAX_RESULT_PARTS:
            raise ValueError(f"parts {parts!r}")
        first = doc["m"]
        if not isinstance(first, str):
            raise ValueError("m must be a string")
        rnd, world = doc["round"], doc["world"]
        if type(rnd) is not int or type(world) is not int:
            raise ValueError("round and world must be integers")
    except (ValueError, KeyError, TypeError) as exc:
        raise _foreign_result(where, exc) from None
    values = {x.key: x.value for x in kvs}
    chunks = [first]
    for i in range(1, parts + 1):
        value = values.get(header.key + f".{i}".encode())
        if value is None or len(value) > _MAX_VALUE_BYTES or not value.isascii():
            raise RendezvousStateError(
                f"the rendezvous result {where!r} lacks its part {i} of {parts} (or it is not "
                "one this flashckpt writes): the job's keys were changed by something else; use "
                "another --rdzv-id"
            )
        chunks.append(value.decode("ascii"))
    try:
        packed = "".join(chunks)
        members = PackedMembers(packed)
    except (ValueError, TypeError) as exc:
        raise _foreign_result(where, exc) from None
    if rnd != expected_round:
        raise RendezvousStateError(
            f"the rendezvous result {where!r} says round {rnd}, its key round {expected_round}: "
            "the job's keys were changed by something else; use another --rdzv-id"
        )
    # The members are not decoded here (a waiter searches its own, PackedMembers.rank_of,
    # which also refuses it twice); the digest the lead wrote covers them all.
    digest = str(doc.get("digest", ""))
    if world != len(members) or world < 1 or digest != _digest(packed):
        raise RendezvousStateError(
            f"the rendezvous result {where!r} is inconsistent: world {world}, "
            f"{len(members)} members, digest {digest!r} (of the members: {_digest(packed)!r})"
        )
    master = doc.get("master")
    parsed_master: tuple[str, int] | None = None
    if (
        isinstance(master, list)
        and len(master) == 2
        and isinstance(master[0], str)
        and type(master[1]) is int
        and 0 < master[1] < 65536
    ):
        parsed_master = (master[0], master[1])
    return _Result(rnd, members, digest, str(doc.get("closer", "")), parsed_master), header


def _foreign_result(where: str, exc: Exception) -> RendezvousStateError:
    """The error for a result another flashckpt version (or another program) wrote."""
    return RendezvousStateError(
        f"the rendezvous result {where!r} is not one this flashckpt writes ({exc}): every "
        "machine of a job must run the same flashckpt version; if another program wrote "
        "it, use another --rdzv-id"
    )


def _digest(packed: str) -> str:
    """The digest of a result's packed members (logged, and checked by every reader)."""
    return hashlib.sha256(packed.encode()).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class _Join:
    node: str
    create_revision: int
    claim: RankClaim | None
    master: list[Any] | None = None  # [address, port free there] should it become rank 0


def _decode_join(kv: KeyValue) -> _Join | None:
    try:
        doc = json.loads(kv.value)
        node = doc["node"]
        claim = doc.get("claim")
        if not isinstance(node, str):
            return None
        parsed = None
        if isinstance(claim, list) and len(claim) == 2:
            parsed = RankClaim(round=int(claim[0]), rank=int(claim[1]))
        master = doc.get("master")
        return _Join(node, kv.create_revision, parsed, master if isinstance(master, list) else None)
    except (ValueError, KeyError, TypeError):
        logger.warning("ignoring an unreadable rendezvous join %r", kv.key)
        return None


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


# ------------------------------------------------------------------------------ handler
@dataclass(frozen=True, slots=True)
class RdzvSettings:
    """What :class:`RdzvHandler` needs besides its client and store."""

    run_id: str
    job_prefix: str  # "<key_prefix>/<run_id>/"
    min_nodes: int
    max_nodes: int
    join_timeout: timedelta = timedelta(seconds=600)
    last_call_timeout: timedelta = timedelta(seconds=30)
    lease_ttl: timedelta = DEFAULT_LEASE_TTL
    state_ttl: timedelta | None = timedelta(hours=2)
    local_addr: str | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.min_nodes <= self.max_nodes:
            raise ValueError(
                f"the rendezvous needs 1 <= min_nodes <= max_nodes, got "
                f"{self.min_nodes}:{self.max_nodes}"
            )
        if self.lease_ttl < timedelta(seconds=2):
            raise ValueError(f"lease_ttl must be at least 2 s, got {self.lease_ttl}")
        if not self.job_prefix.endswith("/"):
            raise ValueError(f"the job prefix must end with '/', got {self.job_prefix!r}")


class LeaseSource(Protocol):
    """Another owner of this machine's etcd lease that the handler's keys can share
    (:meth:`RdzvHandler.share_lease`; the launcher's
    :class:`~flashckpt.elastic.membership.nodes.NodeRegistry`): it grants and renews the
    lease, and says when it ended."""

    @property
    def ttl(self) -> timedelta:
        """The lease's TTL."""
        ...

    def shared_lease(self) -> Lease | None:
        """The lease now; None while there is none (not registered, fenced, closed)."""
        ...

    def lease_failed(self, lease: Lease) -> None:
        """etcd told a user of ``lease`` that it is gone: check it now."""
        ...

    def on_lease_ended(self, callback: Callable[[Lease], None]) -> None:
        """Calls ``callback(lease)`` whenever a lease it handed out ended (lapsed, revoked,
        fenced, closed)."""
        ...

    # A source may also create its own key in the handler's first join (one transaction for
    # both): ``fold_registration(lease, compare, success, failure) -> body | None`` and
    # ``fold_answered(lease, response | None) -> nested response | None``, as
    # :class:`~flashckpt.elastic.membership.nodes.NodeRegistry` does (see
    # :meth:`RdzvHandler._join_txn`).


class _Stats:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.txns = 0
        self.txns_failed = 0
        self.bytes_written = 0
        self.max_value = 0
        self.waits = 0  # slices a waiter of a round waited on its watch (events or quiet)
        self.wait_watches = 0  # watches a waiter opened on its round's control keys

    def snapshot(self) -> dict[str, int]:
        with self.lock:
            return {
                "txns": self.txns,
                "txns_failed": self.txns_failed,
                "bytes_written": self.bytes_written,
                "max_value": self.max_value,
                "waits": self.waits,
                "wait_watches": self.wait_watches,
            }


class RdzvHandler(RendezvousHandler):
    """torch's ``RendezvousHandler`` on per-machine etcd keys (see the module docstring).

    Args:
        client: The etcd client.
        store: The store handed to torch for each round (under a per-round prefix), usually an
            :class:`flashckpt.elastic.etcd.store.EtcdV3Store` under ``<job>/store/``.
        settings: Sizes, timeouts, lease TTLs.
    """

    def __init__(self, client: EtcdClient, store: dist.Store, settings: RdzvSettings) -> None:
        self._client = client
        self._store = store
        self._s = settings
        self._addr = settings.local_addr or socket.getfqdn()
        self._node = f"{self._addr}_{os.getpid()}_{next(_node_ids)}"
        self._qnode = urllib.parse.quote(self._node, safe="")
        self._p = settings.job_prefix + "rdzv/"
        self._lock = threading.Lock()
        self._lease: Lease | None = None
        self._source: LeaseSource | None = None  # the lease's owner, when shared
        self._keepalive: threading.Thread | None = None
        self._keepalive_stop = threading.Event()
        self._lease_lost = threading.Event()
        self._closed = False
        self._left = False
        # The round this machine is a member of, and what it knows of it.
        self._round: int | None = None
        self._rank: int | None = None
        self._standby_said = -1  # the round this machine last said it stands by in
        self._members: PackedMembers | None = None
        self._member_set: frozenset[int] | None = None  # members(), decoded once asked
        self._member_id: int | None = None
        self._result_rev = 0
        self._round_lease = 0  # the lease of the round and result keys (state_ttl)
        self._claim: RankClaim | None = None
        self._participants: set[str] | None = None
        self._waiting = 0
        self._member_watch: _MemberWatch | None = None
        self._waiting_in: int | None = None  # the round this machine waits in, if any
        self._local = threading.local()
        self._reached = False  # etcd answered this handler once
        self._streams: set[WatchStream] = set()  # the watches next_rendezvous waits on
        self.phases: dict[str, float] = {}
        """Wall-clock times (``time.time()``) of the last ``next_rendezvous``: ``start``,
        ``joined`` (its join transaction answered), ``result`` (it read the round's result),
        ``done`` (rank 0's ``MASTER_ADDR``/``MASTER_PORT`` read): for the scale benchmark."""
        self._newest_seen = -1  # the newest closed round this machine read
        # The newest closed round this machine knows of: (round, the round key's mod_revision,
        # its lease); (-1, 0, 0): none. A join compares it (see _attempt).
        self._known: tuple[int, int, int] = (-1, 0, 0)
        self._joined = False  # joined a round since it was last admitted to one
        # The round this machine joined and has not read the result of yet, and its join key's
        # create_revision (how a result names it): (-1, 0) when none.
        self._pending: tuple[int, int] = (-1, 0)
        self.stats = _Stats()
        self.on_waiting: Callable[[int], None] | None = None
        """Called (from ``next_rendezvous``' thread, exceptions logged) with the round this
        machine starts to wait in when that is not the job's first round (a standby, or a
        member joining again): the launcher starts its peers' watch then, if not yet (a machine
        forming the first round starts it once it has its rank)."""

    # -------------------------------------------------------------------- torch's interface
    def get_backend(self) -> str:
        """See base class."""
        return BACKEND_NAME

    @property
    def use_agent_store(self) -> bool:
        """See base class: the workers of each round get a fresh TCPStore."""
        return False

    def get_run_id(self) -> str:
        """See base class."""
        return self._s.run_id

    def next_rendezvous(self) -> RendezvousInfo:
        """Joins the next round and returns this machine's rank in it (see the module
        docstring).

        Raises:
            RendezvousClosedError: The rendezvous is closed (the job finished).
            RendezvousGracefulExitError: It closed while this machine waited as a standby.
            RendezvousTimeoutError: No round took this machine within ``join_timeout``.
            RendezvousConnectionError: etcd failed beyond the client's retries.
            RendezvousStateError: The job's keys hold something this handler never writes.
        """
        self._stop_member_watch()
        if self._closed:
            raise RendezvousClosedError(f"the rendezvous {self._s.run_id!r} is closed")
        deadline = Deadline.after(self._s.join_timeout)
        self.phases = {"start": time.time()}
        warned = 0.0
        try:
            while True:
                if deadline.expired():
                    raise RendezvousTimeoutError(
                        f"no rendezvous round of job {self._s.run_id!r} took this machine "
                        f"({self._node}) within {self._s.join_timeout.total_seconds():g} s "
                        f"(join_timeout); {self._s.min_nodes} to {self._s.max_nodes} machines "
                        "must join"
                    )
                try:
                    info = self._attempt(deadline)
                except EtcdLeaseNotFound as exc:
                    # The shared lease ended and its owner has not registered again yet (it
                    # does within a renewal interval): wait for it, however far we got.
                    if deadline.expired():
                        raise RendezvousTimeoutError(
                            f"this machine ({self._node}) had no lease to join the rendezvous "
                            f"of job {self._s.run_id!r} with: {exc}"
                        ) from exc
                    logger.info("waiting for this machine's next lease: %s", exc)
                    deadline.sleep(0.2)
                    continue
                except EtcdError as exc:
                    # etcd answered before: an outage (a leader election, a restart) is waited
                    # out until join_timeout; one that never answered is a configuration error.
                    if not self._reached or deadline.expired():
                        raise RendezvousConnectionError(
                            f"the rendezvous of job {self._s.run_id!r} failed to reach etcd at "
                            f"{','.join(self._client.endpoints)}: {exc}"
                        ) from exc
                    if time.monotonic() - warned > 10:
                        warned = time.monotonic()
                        logger.warning("etcd failed during the rendezvous (retrying): %s", exc)
                    deadline.sleep(1.0)
                    continue
                if info is not None:
                    return info
        finally:
            self._waiting_in = None

    def is_closed(self) -> bool:
        """See base class (one etcd read)."""
        if self._closed:
            return True
        try:
            return self._client.get(self._p + "closed") is not None
        except EtcdError as exc:
            raise RendezvousConnectionError(f"cannot read {self._p}closed: {exc}") from exc

    def set_closed(self, *, done: bool = False) -> None:
        """See base class: closes the rendezvous for every machine; deletes the rounds' keys.

        Args:
            done: This machine's workers finished the job: the job-level ``done`` key is
                written in the same transaction (:meth:`finished_done`: a standby that finds
                the rendezvous closed learns from it that it was not needed).
        """
        lease = self._new_state_lease()
        ops = [
            _put(self._p + "closed", json.dumps({"by": self._node}).encode(), lease),
            _delete(self._p + "r/", prefix=True),
            _delete(self._p + "round"),
        ]
        if done:
            ops.append(_put(self._p + "done", json.dumps({"by": self._node}).encode(), lease))
        try:
            self._txn([], ops, [])
        except EtcdError as exc:
            raise RendezvousConnectionError(f"could not close the rendezvous: {exc}") from exc
        self._closed = True

    def num_nodes_waiting(self) -> int:
        """See base class: machines waiting to join the next round that it has room for (a
        restarting member of this round always counts). Answered from a watch, no etcd call."""
        watch = self._member_watch
        if watch is None:
            return 0
        if self._lease_lost.is_set():
            return max(1, watch.waiting())  # dropped from its round: the workers restart
        return watch.waiting()

    def finished_done(self, timeout: timedelta | None = None) -> bool:
        """Whether a machine closed the rendezvous with its workers done (the job succeeded):
        one read of the job-level ``done`` key, whatever the size of the job.

        Raises:
            EtcdError: etcd did not answer.
        """
        return self._client.get(self._p + "done", timeout=timeout) is not None

    def shutdown(self, *, done: bool = False) -> bool:
        """See base class: closes the rendezvous (``done``: see :meth:`set_closed`) and gives
        up this machine's keys."""
        try:
            self.set_closed(done=done)
        except RendezvousError as exc:
            logger.warning("could not close the rendezvous %r: %s", self._s.run_id, exc)
            self.leave()
            return False
        self.leave()
        return True

    # -------------------------------------------------------------------- flashckpt's extras
    @property
    def client(self) -> EtcdClient:
        """The etcd client."""
        return self._client

    @contextlib.contextmanager
    def call_timeout(self, timeout: timedelta) -> Iterator[None]:
        """Caps the deadline of this thread's etcd calls of the handler inside the block (the
        launcher's teardown: waiting the client's full ``read_timeout`` helps nobody)."""
        previous = getattr(self._local, "timeout", None)
        self._local.timeout = timeout if previous is None else min(previous, timeout)
        try:
            yield
        finally:
            self._local.timeout = previous

    def _timeout(self) -> timedelta | None:
        timeout: timedelta | None = getattr(self._local, "timeout", None)
        return timeout

    def note_reachable(self) -> None:
        """Tells the handler that etcd answered (the launcher checked it): from now on an etcd
        failure in ``next_rendezvous`` is an outage, waited out until ``join_timeout``, not a
        configuration error that fails at once."""
        self._reached = True

    @property
    def node(self) -> str:
        """This machine's descriptor in the rendezvous (``addr_pid_n``), as in the keys."""
        return self._node

    @property
    def round_key(self) -> str:
        """The key of the newest closed round: it exists once the job's first round formed."""
        return self._p + "round"

    @property
    def join_timeout(self) -> timedelta:
        """How long ``next_rendezvous`` waits for a round."""
        return self._s.join_timeout

    @property
    def round(self) -> int | None:
        """The round this machine is a member of (``None`` before the first)."""
        return self._round

    @property
    def waiting_in(self) -> int | None:
        """The round this machine waits in right now (inside ``next_rendezvous``), if any."""
        return self._waiting_in

    def members(self) -> frozenset[int]:
        """The members of this machine's round, from its result (no etcd call): the
        ``create_revision`` of each member's join key, which identifies the member in this round
        only (a machine that joins again gets another). Empty before the first round."""
        with self._lock:
            packed, decoded = self._members, self._member_set
        if decoded is None and packed is not None:
            decoded = frozenset(packed.tolist())
            with self._lock:
                if self._members is packed:
                    self._member_set = decoded
        return decoded if decoded is not None else frozenset()

    @property
    def member_id(self) -> int | None:
        """This machine's id among :meth:`members` (its join key's ``create_revision`` in its
        round); ``None`` before the first round. The launcher publishes it in its node record
        (:attr:`~flashckpt.elastic.membership.nodes.NodeRecord.rdzv_member`), so a peer's record
        says whether it was in this machine's round without reading the round's N join keys."""
        with self._lock:
            return self._member_id

    def members_gone(self, timeout: timedelta | None = None) -> int:
        """How many members of this machine's round hold no join key now (dead, found dead, or
        left): one count of the round's join keys, O(1) bytes whatever the size of the round.
        A machine the round did not take holds its key only until it read the result, so
        while one does, a gone member may be missed (never the other way round).

        Raises:
            EtcdError: etcd did not answer.
        """
        with self._lock:
            rnd, world = self._round, len(self._members or ())
        if rnd is None:
            return 0
        with self.call_timeout(timeout) if timeout is not None else contextlib.nullcontext():
            count = _range(self._rp(rnd) + "a/", prefix=True, count_only=True)
            response = self._txn([], [count], [])
        responses = response.get("responses") or []
        held = int(responses[0].get("response_range", {}).get("count", 0)) if responses else 0
        return max(0, world - held)

    def participants(self) -> set[str] | None:
        """The descriptors of the members of this machine's round: one etcd read of the round's
        N join keys, keys only (a join key's name is its machine's descriptor, its create
        revision the member id), cached for the round. Not for every machine of a large job
        every round: the launcher identifies members by :meth:`members` and :attr:`member_id`,
        from the result it holds, and its replica ring asks this only when a member's node
        record does not carry its member id yet. ``None`` before the first round or when etcd
        fails."""
        with self._lock:
            if self._participants is not None or self._round is None:
                return self._participants
            rnd = self._round
        members = self.members()
        joins = self._rp(rnd) + "a/"
        try:
            kvs = self._client.get_range(joins, prefix_end(joins), keys_only=True)
        except EtcdError as exc:
            logger.warning("cannot read the members of round %d: %s", rnd, exc)
            return None
        start = len(joins.encode())
        nodes = {
            urllib.parse.unquote(kv.key[start:].decode())
            for kv in kvs
            if kv.create_revision in members
        }
        with self._lock:
            if self._round == rnd:
                self._participants = nodes
        return nodes

    def expire_nodes(self, nodes: Sequence[str]) -> int:
        """Ends the rendezvous lease of machines found dead, as its lapse would: their join
        keys (of every round) and their lead key go at once, and a machine that was wrongly
        found dead joins again with a new lease. Returns how many leases were revoked. Never
        raises for etcd (the leases lapse anyway)."""
        try:
            head = self._txn([], [_range(self._p + "round")], [])
            kvs = _kvs(head, 0)
            newest = self._parse_round(kvs[0]) if kvs else -1
            keys = [
                self._rp(r) + "a/" + urllib.parse.quote(node, safe="")
                for node in nodes
                for r in (newest, newest + 1)
                if r >= 0
            ]
            found = self._txn([], [_range(k) for k in keys], []) if keys else {}
            leases = {kv.lease for i in range(len(keys)) for kv in _kvs(found, i) if kv.lease}
            revoked = 0
            for lease in sorted(leases):
                revoked += int(self._client.revoke_lease(lease, timeout=self._timeout()))
            return revoked
        except (EtcdError, RendezvousStateError) as exc:
            logger.warning("could not drop %s from the rendezvous: %s", list(nodes), exc)
            return 0

    def leave(self) -> None:
        """Gives up this machine's place: its lease (and every key on it) goes. Never raises."""
        self._left = True
        self._wake_waits()
        self._stop_member_watch()
        self._keepalive_stop.set()
        with self._lock:
            lease, self._lease = self._lease, None
        if lease is not None and self._source is not None:
            # The lease is the machine's (its node key lives on it, and says how it left):
            # only this handler's keys go.
            self._delete_own_keys()
        elif lease is not None:
            try:
                self._client.revoke_lease(lease, timeout=self._timeout() or timedelta(seconds=2))
            except EtcdError as exc:
                logger.info("could not revoke the rendezvous lease (it lapses): %s", exc)

    def share_lease(self, source: LeaseSource) -> bool:
        """Binds this machine's rendezvous keys to ``source``'s lease (the launcher's node
        lease) instead of a lease of the handler's own: one lease and one renewal per machine
        (issue 31). The keys still go with the machine: its node lease lapsing, or being
        revoked by a peer that found it dead, is its rendezvous lease lapsing; the handler
        then joins again with the source's next lease. Call before the first
        ``next_rendezvous``.

        Returns:
            False (nothing shared) when the source's TTL is not this handler's ``lease_ttl``:
            the rendezvous keys keep their own lease and TTL.
        """
        if source.ttl != self._s.lease_ttl:
            logger.info(
                "the rendezvous keeps a lease of its own: its lease_ttl %g s is not the node "
                "lease's %g s",
                self._s.lease_ttl.total_seconds(),
                source.ttl.total_seconds(),
            )
            return False
        with self._lock:
            if self._lease is not None:
                raise RuntimeError("share_lease must be called before the first next_rendezvous")
            self._source = source
        source.on_lease_ended(self._shared_lease_ended)
        return True

    def _shared_lease_ended(self, lease: Lease) -> None:
        """The source's lease ended: a wait in ``next_rendezvous`` joins again, and a member
        counts as waiting (its workers restart), as when a lease of its own lapses."""
        with self._lock:
            current = self._lease
        if current is None or current.id != lease.id:
            return
        logger.warning(
            "this machine's lease is gone (it lapsed, or a peer found this machine dead); it "
            "joins the rendezvous again with its next one"
        )
        self._lease_lost.set()
        self._wake_waits()

    def _delete_own_keys(self) -> None:
        """Deletes this machine's join keys of the rounds it may be in, and the lead key of
        such a round while it holds it (a shared lease is not revoked on leave)."""
        rounds = {self._round, self._waiting_in, self._known[0], self._known[0] + 1}
        ops: list[dict[str, Any]] = []
        for rnd in sorted(r for r in rounds if r is not None and 0 <= r <= _MAX_ROUND):
            ops.append(_delete(self._rp(rnd) + "a/" + self._qnode))
            lead = self._rp(rnd) + "c/lead"
            ops.append(
                {
                    "request_txn": {
                        "compare": [_cmp(lead, "VALUE", self._node.encode())],
                        "success": [_delete(lead)],
                    }
                }
            )
        try:
            self._txn([], ops, [])
        except EtcdError as exc:
            logger.info("could not delete this machine's rendezvous keys (they lapse): %s", exc)

    def suspend(self) -> None:
        """Stops renewing this machine's lease (a fenced machine: its keys lapse with it); the
        next ``next_rendezvous`` takes a new lease."""
        self._stop_member_watch()
        self._keepalive_stop.set()
        with self._lock:
            self._lease = None
        self._lease_lost.set()  # a wait in next_rendezvous joins again, with a new lease
        self._wake_waits()

    # -------------------------------------------------------------------- one attempt
    def _rp(self, rnd: int) -> str:
        return f"{self._p}r/{rnd:012d}/"

    def _check_left(self) -> None:
        if self._left:
            raise RendezvousClosedError(
                f"this machine ({self._node}) left the rendezvous {self._s.run_id!r}"
            )

    def _attempt(self, deadline: Deadline) -> RendezvousInfo | None:
        """One join: a single transaction on the round this machine believes is the newest
        closed one (``_known``: none at first, then the last result it read). Its compare
        (the round key's revision, no ``closed`` key) refuses a stale belief, and the refusal
        carries the round key and ``closed``: the next attempt joins from them. A round-1 join,
        or a member's join of the round after its own, is one request. A machine that joined
        this round before and stopped waiting (an etcd error, its lease lapsed) also gets the
        round's result in the refusal, and takes its rank from it if the round took it."""
        self._check_left()
        lease = self._ensure_lease()
        newest, round_rev, round_lease = self._known
        self._round_lease = round_lease
        rnd = newest + 1
        if rnd > _MAX_ROUND:
            raise RendezvousStateError(f"the rendezvous ran out of round numbers ({rnd})")
        join_key = self._rp(rnd) + "a/" + self._qnode
        claim = self._claim
        value = json.dumps(
            {
                "v": _JOIN_VERSION,
                "node": self._node,
                "claim": [claim.round, claim.rank] if claim else None,
                # Should it be rank 0: where the workers meet (torch's RendezvousStoreInfo
                # picks a free port on rank 0's host the same way). In the result, so nobody
                # waits for rank 0 to publish it in the store.
                "master": [self._addr, get_free_port()],
            },
            separators=(",", ":"),
        ).encode()
        compare = [_cmp(self._p + "round", "MOD", round_rev), _cmp(self._p + "closed", "CREATE", 0)]
        lead_key = self._rp(rnd) + "c/lead"
        success = [
            _put(join_key, value, lease.id),
            _range(join_key),
            # The first machine to join leads the round: decided in the same transaction (a
            # nested one), so nobody races for it.
            {
                "request_txn": {
                    "compare": [_cmp(lead_key, "CREATE", 0)],
                    "success": [_put(lead_key, self._node.encode(), lease.id)],
                }
            },
            _range(self._rp(rnd) + "c/", prefix=True),
        ]
        if rnd >= 1:
            # Tells the previous round's members that one of them (or another machine) joined
            # this round: one key of theirs, created by the first such join (_NEXT_KEYS).
            member = claim is not None and claim.round == rnd - 1
            marker = self._rp(rnd - 1) + "c/" + (_NEXT_MEMBER if member else _NEXT_OTHER)
            success.append(
                {
                    "request_txn": {
                        "compare": [_cmp(marker, "CREATE", 0)],
                        "success": [_put(marker, self._node.encode(), lease.id)],
                    }
                }
            )
        failure = [_range(self._p + "round"), _range(self._p + "closed")]
        pending_round, pending_create = self._pending
        if pending_round == rnd:
            # This machine joined round rnd before and stopped waiting for its result (an etcd
            # error, its lease lost): if rnd closed meanwhile, the refusal carries the result,
            # which may name this machine (see below).
            failure.append(_range(self._rp(rnd) + "c/result", prefix=True))
        try:
            found = self._join_txn(lease, compare, success, failure, write=len(value))
        except EtcdLeaseNotFound:
            self._lease_failed(lease)
            return None
        except EtcdOutcomeUnknown:
            return None  # again: the join is a put, repeating it is harmless
        self._reached = True
        if found is None:
            return None  # the node key's registration was settled apart from it: join again
        response = found
        if not response.get("succeeded"):
            # A round closed meanwhile, or this machine's belief was stale, or the job closed:
            # the refusal says which; join again from what it read.
            if _kvs(response, 1):
                self._raise_closed()
            round_kvs = _kvs(response, 0)
            if round_kvs:
                kv = round_kvs[0]
                self._known = (self._parse_round(kv), kv.mod_revision, kv.lease)
            else:
                self._known = (-1, 0, 0)
            self._newest_seen = max(self._newest_seen, self._known[0])
            result_kvs = _kvs(response, 2) if pending_round == rnd else []
            if result_kvs and self._known[0] == rnd:
                # The round this machine joined closed while it was not waiting, and it is still
                # the newest: its result decides. A member takes its rank (joining the next
                # round instead would leave its group waiting for it forever, issue 31); a
                # machine the round did not take stands by for the next one.
                return self._take_result(rnd, result_kvs, pending_create)
            return None
        self._newest_seen = max(self._newest_seen, newest)
        mine = _kvs(response, 1)
        if not mine:
            return None
        my_create = mine[0].create_revision
        self._pending = (rnd, my_create)
        ctl = {kv.key.decode().rsplit("/", 1)[-1]: kv for kv in _kvs(response, 3)}
        self._waiting_in = rnd
        self._joined = True
        self.phases["joined"] = time.time()
        if rnd > 0 and self.on_waiting is not None:
            try:
                self.on_waiting(rnd)
            except Exception:
                logger.exception("the rendezvous' on_waiting callback failed")
        if rnd > 0 and self._rank is None and self._standby_said != rnd:
            # Never a member of this job: a standby (or a machine joining a running job). Said
            # once per round it waits in, at info level, so its log says what it is doing.
            self._standby_said = rnd
            logger.info(
                "standby: job %r runs without this machine (%s); it waits in round %d and joins "
                "when the job takes it (a machine leaves or fails, or the round has room)",
                self._s.run_id,
                self._node,
                rnd,
            )
        logger.debug("joined round %d as %s (revision %d)", rnd, self._node, my_create)
        return self._wait_round(rnd, round_rev, my_create, _revision(response), ctl, deadline)

    def _wait_round(
        self,
        rnd: int,
        round_rev: int,
        my_create: int,
        rev: int,
        ctl: dict[str, KeyValue],
        deadline: Deadline,
    ) -> RendezvousInfo | None:
        """Waits for round ``rnd``'s result (or leads the round), from the control keys as read
        at ``rev``. One watch of the control keys follows them for the whole wait: a quiet slice
        changes nothing (no read, no new watch), a change comes with the event and is applied as
        it is; the keys are read again only when the lead went (every waiter races for it), the
        watch ended (closed, compacted, failed) or stayed quiet for ``_QUIET_READ_S``."""
        ctl_prefix = self._rp(rnd) + "c/"
        watch: WatchStream | None = None
        quiet_since = time.monotonic()
        try:
            while True:
                if "result" in ctl:
                    handed, watch = watch, None
                    if handed is not None:
                        with self._lock:
                            self._streams.discard(handed)
                    # What the next round said so far (the member watch goes on with the
                    # stream, from after it).
                    said = [WatchEvent(False, kv, None) for n, kv in ctl.items() if n in _NEXT_KEYS]
                    return self._take_result(
                        rnd, _result_kvs(list(ctl.values())), my_create, handed=handed, pending=said
                    )
                mine = "lead" in ctl and ctl["lead"].value == self._node.encode()
                read = True
                if "lead" not in ctl and not mine:
                    # The lead died (the first joiner leads, chosen in its join): every waiter
                    # sees it at once. Each first waits a moment for another to take over, so
                    # that not all of them race for it.
                    self._drop_watch(watch)
                    watch = None
                    self._wait_ctl_once(
                        ctl_prefix, rev, min(deadline.remaining(), random.random() * 0.3)
                    )
                    self._check_left()
                    if self._lease_lost.is_set() or deadline.expired():
                        return None
                    response = self._read_ctl(ctl_prefix)
                    rev = _revision(response)
                    ctl = {kv.key.decode().rsplit("/", 1)[-1]: kv for kv in _kvs(response, 0)}
                    if "result" in ctl or "lead" in ctl:
                        continue
                if "lead" not in ctl or mine:
                    self._drop_watch(watch)
                    watch = None
                    if self._try_lead(rnd, round_rev, ctl.get("lead")):
                        result = self._lead(rnd, round_rev, deadline)
                        if result is not None:
                            return self._take_result(rnd, result, my_create)
                    # Lost the race, or stopped leading: read what is there now.
                elif deadline.expired():
                    return None
                else:
                    if watch is None:
                        watch = self._open_ctl_watch(ctl_prefix, rev)
                    events = self._wait_ctl(
                        watch,
                        min(deadline.remaining(), _WAIT_SLICE_S, self._lease_ttl_s()),
                    )
                    if events:
                        quiet_since = time.monotonic()
                    if events is not None and time.monotonic() - quiet_since < _QUIET_READ_S:
                        # The watch carries every change, the result itself included: no read
                        # (one request less for every waiter of the round, and none per slice).
                        for ev in events:
                            name = ev.kv.key.decode(errors="replace").rsplit("/", 1)[-1]
                            if ev.deleted:
                                if name not in _NEXT_KEYS:  # what they said stays said
                                    ctl.pop(name, None)
                            else:
                                ctl[name] = ev.kv
                        rev = max(rev, watch.next_revision - 1)
                        read = False
                    else:
                        # The watch ended (closed, compacted, failed), or stayed quiet for
                        # _QUIET_READ_S: read the keys, and watch again from that read.
                        self._drop_watch(watch)
                        watch = None
                        quiet_since = time.monotonic()
                self._check_left()
                if self._lease_lost.is_set() or deadline.expired():
                    return None
                if not read:
                    continue
                response = self._read_ctl(ctl_prefix)
                rev = _revision(response)
                ctl = {kv.key.decode().rsplit("/", 1)[-1]: kv for kv in _kvs(response, 0)}
        finally:
            self._drop_watch(watch)

    def _read_ctl(self, ctl_prefix: str) -> dict[str, Any]:
        """The round's control keys; raises if the rendezvous closed."""
        response = self._txn([], [_range(ctl_prefix, prefix=True), _range(self._p + "closed")], [])
        if _kvs(response, 1):
            self._raise_closed()
        return response

    def _open_ctl_watch(self, ctl_prefix: str, rev: int) -> WatchStream:
        """A watch of the round's control keys after ``rev`` (the next round's say among them:
        :data:`_NEXT_KEYS`), closed by :meth:`_wake_waits`."""
        key = ctl_prefix.encode()
        stream = WatchStream(self._client, key, prefix_end(key), rev + 1)
        with self._lock:
            self._streams.add(stream)
        with self.stats.lock:
            self.stats.wait_watches += 1
        return stream

    def _drop_watch(self, stream: WatchStream | None) -> None:
        """Closes ``stream``, if any."""
        if stream is not None:
            with self._lock:
                self._streams.discard(stream)
            stream.close()

    def _wait_ctl(self, stream: WatchStream, seconds: float) -> list[WatchEvent] | None:
        """The changes of the round's control keys on ``stream`` within ``seconds`` (``[]``:
        none, or this machine's lease was lost or it left: the caller checks); None when the
        stream ended (closed by :meth:`_wake_waits`, compacted, failed): read the keys again."""
        if self._lease_lost.is_set() or self._left:
            return []
        if seconds <= 0:
            return []
        with self.stats.lock:
            self.stats.waits += 1
        try:
            return stream.next_events(timedelta(seconds=seconds))
        except (WatchClosed, WatchCompacted):
            return None
        except EtcdError as exc:
            logger.debug("watching the round's control keys failed (reading them): %s", exc)
            return None

    def _wait_ctl_once(self, ctl_prefix: str, rev: int, seconds: float) -> None:
        """Waits for a change of the round's control keys after ``rev``, at most ``seconds``;
        woken at once when this machine's lease is lost or it leaves."""
        if seconds <= 0:
            return
        stream = self._open_ctl_watch(ctl_prefix, rev)
        try:
            self._wait_ctl(stream, seconds)
        finally:
            self._drop_watch(stream)

    def _wake_waits(self) -> None:
        """Ends this machine's watches in ``next_rendezvous`` (its lease is gone, or it left)."""
        with self._lock:
            streams = list(self._streams)
        for stream in streams:
            stream.close()

    def _try_lead(self, rnd: int, round_rev: int, current: KeyValue | None) -> bool:
        lease = self._lease
        if lease is None:
            return False
        lead_key = self._rp(rnd) + "c/lead"
        if current is not None:
            return current.lease == lease.id  # ours already (after a broken watch)
        compare = [_cmp(lead_key, "CREATE", 0), _cmp(self._p + "round", "MOD", round_rev)]
        try:
            response = self._txn(compare, [_put(lead_key, self._node.encode(), lease.id)], [])
        except EtcdOutcomeUnknown:
            kv = self._client.get_kv(lead_key)
            return kv is not None and kv.lease == lease.id
        except EtcdLeaseNotFound:
            self._lease_failed(lease)
            return False
        return bool(response.get("succeeded"))

    # -------------------------------------------------------------------- the lead
    def _lead(self, rnd: int, round_rev: int, deadline: Deadline) -> list[KeyValue] | None:
        """Follows the joins of round ``rnd`` and closes it; returns its result's keys, or ``None``
        when this machine stopped leading (its lease ended, its watch fell too far behind)."""
        prev, cur = self._rp(rnd - 1), self._rp(rnd)
        ops = [
            _range(prev + "c/result", prefix=True),
            # The previous round's joins: their keys name their machines (no values: N of
            # them, ~150 bytes each, for nothing).
            _range(prev + "a/", prefix=True, keys_only=True),
            _range(cur + "a/", prefix=True),
            _range(cur + "c/", prefix=True),
            _range(prev + "c/" + _ROOM),
        ]
        snap = self._txn([], ops, [])
        ctl = {kv.key.decode().rsplit("/", 1)[-1]: kv for kv in _kvs(snap, 3)}
        if "result" in ctl:
            return _result_kvs(_kvs(snap, 3))
        lead_kv = ctl.get("lead")
        if lead_kv is None or self._lease is None or lead_kv.lease != self._lease.id:
            return None
        prev_members: set[int] = set()
        if rnd > 0:
            prev_result = _kvs(snap, 0)
            if prev_result:
                prev_members = set(_decode_result(prev_result, rnd - 1)[0].members.tolist())
        alive_prev: dict[bytes, str] = {}
        prev_a = (prev + "a/").encode()
        for kv in _kvs(snap, 1):
            if kv.create_revision in prev_members and kv.key.startswith(prev_a):
                alive_prev[kv.key] = urllib.parse.unquote(kv.key[len(prev_a) :].decode())
        joins: dict[bytes, _Join] = {}
        for kv in _kvs(snap, 2):
            j = _decode_join(kv)
            if j is not None:
                joins[kv.key] = j
        cur_a = (cur + "a/").encode()
        lead_key, result_key = (cur + "c/lead").encode(), (cur + "c/result").encode()
        # No previous values: a deleted key is all the lead needs to know.
        stream = WatchStream(self._client, prev_a, prefix_end(cur.encode()), _revision(snap) + 1)
        with self._lock:
            self._streams.add(stream)
        last_call_at: float | None = None
        # The previous round was full: once it lost a member, machines not of it count as
        # waiting for its members (_MemberWatch); said once, in r/<rnd - 1>/c/room.
        room_said = bool(_kvs(snap, 4)) or len(prev_members) < self._s.max_nodes
        logger.info(
            "leading round %d: %d joined, %d live members of round %d", rnd, len(joins),
            len(alive_prev), rnd - 1,
        )  # fmt: skip
        try:
            while True:
                if not room_said and len(alive_prev) < len(prev_members):
                    room_said = self._say_room(prev, len(prev_members) - len(alive_prev))
                joined_nodes = {j.node for j in joins.values()}
                ready = all(node in joined_nodes for node in alive_prev.values())
                n = len(joins)
                now = time.monotonic()
                if n < self._s.min_nodes:
                    last_call_at = None
                close = False
                if ready and n >= self._s.max_nodes:
                    close = True
                elif ready and n >= self._s.min_nodes:
                    if last_call_at is None:
                        last_call_at = now + self._s.last_call_timeout.total_seconds()
                    close = now >= last_call_at
                if close:
                    result = self._close_round(rnd, round_rev, joins, set(alive_prev.values()))
                    if result is not None:
                        return result
                    return None
                if deadline.expired() or self._lease_lost.is_set() or self._left:
                    return None
                wait = min(deadline.remaining(), self._lease_ttl_s())
                if last_call_at is not None and ready:
                    wait = min(wait, max(0.0, last_call_at - now))
                try:
                    events = stream.next_events(timedelta(seconds=wait))
                except (WatchCompacted, WatchClosed):
                    return None  # read everything again (or the lease is gone: join again)
                for ev in events:
                    key = ev.kv.key
                    if key.startswith(prev_a):
                        if ev.deleted:
                            alive_prev.pop(key, None)
                    elif key.startswith(cur_a):
                        if ev.deleted:
                            joins.pop(key, None)
                        else:
                            j = _decode_join(ev.kv)
                            if j is not None:
                                joins[key] = j
                    elif key == lead_key and (ev.deleted or ev.kv.lease != self._lease_id()):
                        logger.info("no longer leading round %d (its lead key went)", rnd)
                        return None
                    elif key == result_key and not ev.deleted:
                        # Another machine closed it: its parts are in the same revision.
                        return _result_kvs(self._client.get_prefix(result_key.decode()))
        finally:
            with self._lock:
                self._streams.discard(stream)
            stream.close()

    def _say_room(self, prev: str, gone: int) -> bool:
        """Writes the previous round's room key (see :data:`_ROOM`) on this lead's lease;
        whether it was written (else it is tried again at the lead's next wake-up)."""
        lease = self._lease
        if lease is None:
            return False
        try:
            self._client.put(prev + "c/" + _ROOM, str(gone).encode(), lease=lease)
        except EtcdError as exc:
            logger.info("could not tell the members that their round lost one: %s", exc)
            return False
        return True

    def _close_round(
        self, rnd: int, round_rev: int, joins: dict[bytes, _Join], survivors: set[str]
    ) -> list[KeyValue] | None:
        # Members: the live members of the previous round (all joined), then the others in
        # the order they joined, up to max_nodes.
        order = sorted(
            joins.values(), key=lambda j: (j.node not in survivors, j.create_revision, j.node)
        )
        chosen = order[: self._s.max_nodes]
        nodes = [j.node for j in chosen]
        claims = {j.node: j.claim for j in chosen if j.claim is not None}
        ranks = assign_ranks(nodes, claims)
        by_rank = sorted(chosen, key=lambda j: ranks[j.node])
        members = [j.create_revision for j in by_rank]
        packed = encode_members(members)
        digest = _digest(packed)
        parts = [
            packed[i : i + _RESULT_PART_CHARS] for i in range(0, len(packed), _RESULT_PART_CHARS)
        ]
        parts = parts or [""]
        if len(parts) - 1 > _MAX_RESULT_PARTS:
            raise RendezvousStateError(
                f"a round of {len(members)} machines is more than this rendezvous can write "
                f"({_MAX_RESULT_PARTS + 1} parts of {_RESULT_PART_CHARS} characters)"
            )
        value = json.dumps(
            {
                "v": _RESULT_VERSION,
                "round": rnd,
                "world": len(members),
                "m": parts[0],
                "parts": len(parts) - 1,
                "digest": digest,
                "closer": self._node,
                "master": by_rank[0].master,
            },
            separators=(",", ":"),
        ).encode()
        cur = self._rp(rnd)
        result_key = cur + "c/result"
        state_lease = self._state_lease()
        success = [
            _put(result_key, value, state_lease),
            _put(self._p + "round", str(rnd).encode(), state_lease),
            *(
                _put(f"{result_key}.{i}", part.encode(), state_lease)
                for i, part in enumerate(parts[1:], 1)
            ),
        ]
        read_at = len(success)  # the result as written, its parts included
        success.append(_range(result_key, prefix=True))
        if rnd >= 1:  # the previous round's members that are not in this one learn it here
            success.append(
                _put(self._rp(rnd - 1) + "c/" + _NEXT_RESULT, str(rnd).encode(), state_lease)
            )
        if rnd >= 2:
            success.append(_delete(self._rp(rnd - 2), prefix=True))
            success.append(
                _delete(
                    f"{self._s.job_prefix}store/torch.rendezvous.{self._s.run_id}.{rnd - 2}/",
                    prefix=True,
                )
            )
        compare = [_cmp(result_key, "CREATE", 0), _cmp(self._p + "round", "MOD", round_rev)]
        try:
            response = self._txn(
                compare,
                success,
                [_range(result_key, prefix=True)],
                write=len(value) + sum(len(p) for p in parts[1:]),
                largest=max([len(value), *(len(p) for p in parts[1:])]),
            )
        except EtcdOutcomeUnknown:
            # The answer was lost; whether it was applied or not, the key says: never close
            # twice, never guess.
            return _result_kvs(self._client.get_prefix(result_key)) or None
        kept = sum(1 for j in chosen if j.claim is not None and ranks[j.node] == j.claim.rank)
        if response.get("succeeded"):
            logger.info(
                "closed round %d: %d machines (%d kept their rank, %d standing by), result %s "
                "(%d bytes)",
                rnd,
                len(members),
                kept,
                len(order) - len(chosen),
                digest,
                len(value),
            )
            found = _kvs(response, read_at)
        else:
            found = _kvs(response, 0)
        return _result_kvs(found) or None

    # -------------------------------------------------------------------- the outcome
    def _take_result(
        self,
        rnd: int,
        kvs: list[KeyValue],
        my_create: int,
        *,
        handed: WatchStream | None = None,
        pending: Sequence[WatchEvent] = (),
    ) -> RendezvousInfo | None:
        """This machine's rank from round ``rnd``'s result (``kvs``: ``c/result`` and its
        parts), or None if the round did not take it. ``handed``: the stream the wait followed
        (the round's control keys; ``pending``: what the next round said on it so far), which
        the member watch goes on with (closed here otherwise)."""
        try:
            return self._take_result_of(rnd, kvs, my_create, handed, pending)
        finally:
            if handed is not None and self._member_watch is None:
                handed.close()  # not taken, or a bad result: nobody goes on with it

    def _take_result_of(
        self,
        rnd: int,
        kvs: list[KeyValue],
        my_create: int,
        handed: WatchStream | None,
        pending: Sequence[WatchEvent],
    ) -> RendezvousInfo | None:
        result, kv = _decode_result(kvs, rnd)
        self._pending = (-1, 0)
        # The result and the round key are written in one transaction (_close_round): the
        # round key's revision and lease are the result's. The next join compares them.
        if rnd > self._known[0]:
            self._known = (rnd, kv.mod_revision, kv.lease)
        self._newest_seen = max(self._newest_seen, rnd)
        try:
            rank = result.members.rank_of(my_create)
        except ValueError as exc:
            raise RendezvousStateError(
                f"the rendezvous result of round {rnd} is inconsistent: {exc}; use another "
                "--rdzv-id"
            ) from None
        if rank is None:
            # Not taken (the round was full, or this machine's key lapsed before it closed):
            # a standby for the next round. Its key of this round goes.
            logger.info(
                "round %d formed with %d machines without this one (%s): a standby, waiting for "
                "the next",
                rnd,
                len(result.members),
                self._node,
            )
            with contextlib.suppress(EtcdError):
                self._client.delete(self._rp(rnd) + "a/" + self._qnode)
            return None
        world = len(result.members)
        self.phases["result"] = time.time()
        with self._lock:
            self._round, self._rank, self._members = rnd, rank, result.members
            self._member_set, self._member_id = None, my_create
            self._result_rev = kv.mod_revision
            self._round_lease = kv.lease
            self._joined = False
            self._participants = None
            self._claim = RankClaim(round=rnd, rank=rank)
        store = dist.PrefixStore(f"torch.rendezvous.{self._s.run_id}.{rnd}", self._store)
        if result.master is not None:
            bootstrap = RendezvousStoreInfo(result.master[0], result.master[1])
        else:  # a closer that did not carry it: torch's exchange through the store
            bootstrap = RendezvousStoreInfo.build(rank, store, local_addr=self._addr)
        self.phases["done"] = time.time()
        self._member_watch = _MemberWatch(
            self, rnd, result.members, kv.mod_revision, rank, handed, pending
        )
        logger.info(
            "round %d of %r: group rank %d of %d (result %s)",
            rnd,
            self._s.run_id,
            rank,
            world,
            result.digest,
        )
        return RendezvousInfo(store, rank, world, bootstrap)

    def _raise_closed(self) -> None:
        self._closed = True
        # A machine that joined and was not in the newest round stood by: torch's redundancy
        # list, which leaves with success. Members (and machines that never joined) did not.
        if self._joined and (self._round is None or self._round < self._newest_seen):
            raise RendezvousGracefulExitError(
                f"the rendezvous {self._s.run_id!r} closed (the job finished) while this "
                "machine stood by; it was not needed"
            )
        raise RendezvousClosedError(
            f"the rendezvous {self._s.run_id!r} is closed: the job finished, or a machine gave "
            "up; start a new job with another --rdzv-id"
        )

    # -------------------------------------------------------------------- plumbing
    def _parse_round(self, kv: KeyValue) -> int:
        try:
            rnd = int(kv.value)
        except ValueError:
            rnd = -1
        if not 0 <= rnd <= _MAX_ROUND:
            raise RendezvousStateError(
                f"{kv.key.decode(errors='replace')!r} holds {kv.value[:40]!r}, not a round "
                "number: something else wrote the job's keys; use another --rdzv-id"
            )
        return rnd

    def _lease_ttl_s(self) -> float:
        return self._s.lease_ttl.total_seconds()

    def _lease_id(self) -> int:
        lease = self._lease
        return lease.id if lease is not None else 0

    def _lease_failed(self, lease: Lease) -> None:
        """etcd said ``lease`` is gone: join again with a new one (the source's, if shared)."""
        self._lease_lost.set()
        source = self._source
        if source is not None:
            source.lease_failed(lease)

    def _ensure_lease(self) -> Lease:
        self._check_left()
        with self._lock:
            if self._lease is not None and not self._lease_lost.is_set():
                return self._lease
            source, lost = self._source, self._lease
        if source is not None:
            shared = source.shared_lease()
            if shared is None or (lost is not None and shared.id == lost.id):
                raise EtcdLeaseNotFound(
                    "this machine's node lease is gone and not registered again yet; the "
                    "rendezvous joins with the next one"
                )
            with self._lock:
                self._lease = shared
                self._lease_lost.clear()
            return shared
        lease = self._client.grant_lease(self._s.lease_ttl)
        self._keepalive_stop.set()
        if self._keepalive is not None:
            self._keepalive.join(timeout=2)
        stop = threading.Event()
        with self._lock:
            self._lease = lease
            self._keepalive_stop = stop
            self._lease_lost.clear()
        thread = threading.Thread(
            target=self._renew, args=(lease, stop), name="flashckpt-rdzv-lease", daemon=True
        )
        thread.start()
        self._keepalive = thread
        return lease

    def _renew(self, lease: Lease, stop: threading.Event) -> None:
        interval = max(0.5, lease.ttl.total_seconds() / 3)
        while not stop.wait(interval):
            try:
                self._client.refresh_lease(lease, timeout=timedelta(seconds=interval))
            except EtcdLeaseNotFound:
                if not stop.is_set():
                    logger.warning(
                        "this machine's rendezvous lease is gone (it lapsed, or a peer found "
                        "this machine dead); it joins again with a new one"
                    )
                    self._lease_lost.set()
                    self._wake_waits()
                return
            except EtcdError as exc:
                logger.debug("renewing the rendezvous lease failed (retrying): %s", exc)

    def _new_state_lease(self) -> int | None:
        if self._s.state_ttl is None:
            return None
        try:
            return self._client.grant_lease(self._s.state_ttl, timeout=self._timeout()).id
        except EtcdError:
            return None

    def _state_lease(self) -> int | None:
        """The lease of the job's round keys: the newest round's (renewed), or a new one."""
        if self._s.state_ttl is None:
            return None
        if self._round_lease:
            try:
                self._client.refresh_lease(self._round_lease)
                return self._round_lease
            except EtcdLeaseNotFound:
                pass
        self._round_lease = self._client.grant_lease(self._s.state_ttl).id
        return self._round_lease

    def _refresh_state_lease(self) -> None:
        lease = self._round_lease
        if lease:
            with contextlib.suppress(EtcdError):
                self._client.refresh_lease(lease, timeout=timedelta(seconds=5))

    def _txn(
        self,
        compare: list[dict[str, Any]],
        success: list[dict[str, Any]],
        failure: list[dict[str, Any]],
        *,
        write: int = 0,
        largest: int | None = None,
    ) -> dict[str, Any]:
        """One transaction; ``write``: the bytes of the values it writes (``largest``: the
        largest of them, when it writes several), for :attr:`stats`."""
        body: dict[str, Any] = {"success": success}
        if compare:
            body["compare"] = compare
        if failure:
            body["failure"] = failure
        writes = any("request_put" in op or "request_delete_range" in op for op in success)
        response: dict[str, Any] = self._client._call(
            "/v3/kv/txn", body, timeout=self._timeout(), idempotent=not (compare and writes)
        )
        with self.stats.lock:
            self.stats.txns += 1
            if compare and not response.get("succeeded"):
                self.stats.txns_failed += 1
            elif write:
                self.stats.bytes_written += write
                self.stats.max_value = max(self.stats.max_value, largest or write)
        return response

    def _join_txn(
        self,
        lease: Lease,
        compare: list[dict[str, Any]],
        success: list[dict[str, Any]],
        failure: list[dict[str, Any]],
        *,
        write: int,
    ) -> dict[str, Any] | None:
        """A join's transaction (:meth:`_txn`). While the lease's source has not created its
        node key yet (``NodeRegistry.start(with_join=True)``), the key's creation and the join
        go in one transaction (:meth:`NodeRegistry.fold_registration
        <flashckpt.elastic.membership.nodes.NodeRegistry.fold_registration>`): one request per
        machine on the way to its first round, not two (issue 31). Returns None when the join
        was not made because the registration was settled apart from it (the key was held, or
        the answer was lost: the source reads or takes the key over, never resends blindly;
        the caller joins again).

        Raises:
            NodeIdInUse: A live launcher holds this machine's node id (from the source).
        """
        fold = getattr(self._source, "fold_registration", None)
        answered = getattr(self._source, "fold_answered", None)
        body = fold(lease, compare, success, failure) if fold and answered else None
        if body is None:
            return self._txn(compare, success, failure, write=write)
        assert answered is not None
        try:
            outer: dict[str, Any] | None = self._client._call(
                "/v3/kv/txn", body, timeout=self._timeout(), idempotent=False
            )
        except EtcdOutcomeUnknown:
            outer = None
        response: dict[str, Any] | None = answered(lease, outer)
        with self.stats.lock:
            self.stats.txns += 1
            if response is not None and not response.get("succeeded"):
                self.stats.txns_failed += 1
            elif response is not None:
                self.stats.bytes_written += write
                self.stats.max_value = max(self.stats.max_value, write)
        return response

    def _stop_member_watch(self) -> None:
        watch, self._member_watch = self._member_watch, None
        if watch is not None:
            watch.stop()


class _MemberWatch:
    """A member's view of who waits for the next round, fed by one watch (see the module
    docstring); the thread ends once someone counts (torch restarts the workers then).

    It follows the round's control keys (``r/R/c/``), going on with the stream its wait for
    the result followed (``handed``), so a member opens no watch once it has its rank (issue
    31: at 1,024 machines one watch opened and one closed per member per round). What it
    counts is said there, one key each (:data:`_NEXT_KEYS`): that a member of the round joined
    the next one, that another machine did, that the next round formed, and whether a full
    round lost a member, which lets a machine that is not of the round count (the next round's
    lead follows the round's join keys anyway and writes ``r/R/c/room`` once). It never
    follows the next round's join keys: until its thread stopped it, a member's watch received
    every join of the next round (at 1,024 machines, 9-50 messages per machine after a kill,
    N^2 for the job at worst). What was said stays said (a ``next-*`` key goes with the lease
    of the machine that wrote it, a ``room`` key with its lead's): the count never goes back
    down, as it did when a joined machine's key went, which once counted restarts the workers
    anyway."""

    def __init__(
        self,
        handler: RdzvHandler,
        rnd: int,
        members: PackedMembers,
        result_rev: int,
        rank: int,
        handed: WatchStream | None = None,
        pending: Sequence[WatchEvent] = (),
    ) -> None:
        self._h = handler
        self._rnd = rnd
        self._world = len(members)
        self._room = False  # the next round's lead said a member of this full round went
        self._rank = rank
        self._lock = threading.Lock()
        self._count = 0
        self._member_joined = False  # a member of this round joined the next one
        self._other_joined = False  # a machine not of this round joined the next one
        self._excluded = False
        self._stop = threading.Event()
        self._stream: WatchStream | None = handed
        self._pending = list(pending)
        self._start = handed.next_revision if handed is not None else result_rev + 1
        self._thread = threading.Thread(
            target=self._run, name="flashckpt-rdzv-members", daemon=True
        )
        self._thread.start()

    def waiting(self) -> int:
        with self._lock:
            return self._count

    def stop(self) -> None:
        self._stop.set()
        stream = self._stream
        if stream is not None:
            stream.close()

    def _run(self) -> None:
        h = self._h
        ctl = h._rp(self._rnd) + "c/"
        keys = _MemberKeys(ctl)
        start = self._start
        refresh_every = 60.0
        if h._s.state_ttl is not None:
            refresh_every = min(refresh_every, h._s.state_ttl.total_seconds() / 4)
        last_refresh = time.monotonic()
        pending, self._pending = self._pending, []
        if pending and self._apply(pending, keys):
            self._close_stream()
            return
        while not self._stop.is_set():
            stream = self._stream
            if stream is None:
                stream = WatchStream(h._client, ctl.encode(), prefix_end(ctl.encode()), start)
                self._stream = stream
            if self._stop.is_set():
                stream.close()
                return
            try:
                while not self._stop.is_set():
                    events = stream.next_events(timedelta(seconds=refresh_every))
                    if self._rank == 0 and time.monotonic() - last_refresh >= refresh_every:
                        h._refresh_state_lease()
                        last_refresh = time.monotonic()
                    if self._apply(events, keys):
                        return  # counted: torch restarts the workers, next_rendezvous follows
            except WatchClosed:
                return
            except WatchCompacted as exc:
                start = self._resync(exc.compact_revision, ctl)
            except EtcdError as exc:
                logger.debug("the rendezvous watch failed (retrying): %s", exc)
                start = stream.next_revision
                self._stop.wait(1.0)
            finally:
                stream.close()
                self._stream = None

    def _close_stream(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()

    def _apply(self, events: Sequence[WatchEvent], keys: _MemberKeys) -> bool:
        mine = self._h._node.encode()
        for ev in events:
            if ev.deleted:
                continue  # what the next round said stays said (a marker goes with its lease)
            key = ev.kv.key
            if key == keys.member:
                if ev.kv.value != mine:  # not this machine's own join (it stopped watching)
                    self._member_joined = True
            elif key == keys.other:
                self._other_joined = True
            elif key == keys.result:
                self._excluded = True  # the next round formed without this machine
            elif key == keys.room:
                self._room = True
        room = self._room or self._world < self._h._s.max_nodes
        count = int(self._member_joined) + int(self._other_joined and room)
        if self._excluded:
            count = max(count, 1)
        with self._lock:
            self._count = count
        return count > 0

    def _resync(self, compacted: int, ctl: str) -> int:
        """After a compaction: the round's control keys from one read, the watch from after it."""
        h = self._h
        while not self._stop.is_set():
            try:
                snap = h._txn([], [_range(ctl, prefix=True)], [])
            except EtcdError:
                self._stop.wait(1.0)
                continue
            events = [WatchEvent(False, kv, None) for kv in _kvs(snap, 0)]
            self._apply(events, _MemberKeys(ctl))
            return _revision(snap) + 1
        return compacted + 1


class _MemberKeys:
    """The keys of a round a member watch tells apart (:data:`_NEXT_KEYS`)."""

    __slots__ = ("member", "other", "result", "room")

    def __init__(self, ctl: str) -> None:
        self.member = (ctl + _NEXT_MEMBER).encode()
        self.other = (ctl + _NEXT_OTHER).encode()
        self.result = (ctl + _NEXT_RESULT).encode()
        self.room = (ctl + _ROOM).encode()


# ------------------------------------------------------------------------------ creation
def settings_from_params(params: RendezvousParameters, job_prefix: str) -> RdzvSettings:
    """The handler's settings from torchrun's rendezvous parameters.

    +-------------------+--------------------------------------------------------------+
    | join_timeout      | Seconds ``next_rendezvous`` waits for a round (600).         |
    | last_call_timeout | Seconds a round waits for more machines once ``min_nodes``   |
    |                   | joined (30).                                                 |
    | lease_ttl         | Seconds after its last renewal a dead machine's keys go (10; |
    |                   | torch's keep_alive_interval x keep_alive_max_attempt when    |
    |                   | those are given instead).                                    |
    | state_ttl         | Seconds the round keys outlive the job's last round; 0:      |
    |                   | forever (7200).                                              |
    +-------------------+--------------------------------------------------------------+

    Raises:
        ValueError: If a parameter is invalid; the message names it.
    """

    def seconds(name: str, default: float, minimum: float) -> float:
        raw = params.get(name, default)
        try:
            value = float(raw)
        except (TypeError, ValueError):
            raise ValueError(f"rendezvous option {name} must be a number, got {raw!r}") from None
        if value < minimum:
            raise ValueError(f"rendezvous option {name} must be >= {minimum:g}, got {raw!r}")
        return value

    state_ttl = seconds("state_ttl", 7200, 0)
    lease_default = DEFAULT_LEASE_TTL.total_seconds()
    if params.get("lease_ttl") is None and params.get("keep_alive_interval") is not None:
        # torch's own options: a machine is dead after keep_alive_max_attempt missed beats.
        interval = seconds("keep_alive_interval", 5, 0.1)
        attempts = seconds("keep_alive_max_attempt", 3, 1)
        lease_default = max(2.0, interval * attempts)
    return RdzvSettings(
        run_id=params.run_id,
        job_prefix=job_prefix,
        min_nodes=params.min_nodes,
        max_nodes=params.max_nodes,
        join_timeout=timedelta(seconds=seconds("join_timeout", 600, 1)),
        last_call_timeout=timedelta(seconds=seconds("last_call_timeout", 30, 0)),
        lease_ttl=timedelta(seconds=seconds("lease_ttl", lease_default, 2)),
        state_ttl=timedelta(seconds=state_ttl) if state_ttl else None,
        local_addr=params.local_addr,
    )
