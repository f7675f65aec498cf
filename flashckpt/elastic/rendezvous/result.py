"""A round's result and a join as written to etcd: the members packed (:class:`PackedMembers`),
the result's parts (:func:`_decode_result`), a join's value (:func:`_decode_join`). Split out of
:mod:`flashckpt.elastic.rendezvous.handler` (issue 45), which re-exports these names.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch.distributed.elastic.rendezvous import (
    RendezvousStateError,
)

from flashckpt.elastic.etcd.client import (
    KeyValue,
)
from flashckpt.elastic.rendezvous.stable_ranks import RankClaim

logger = logging.getLogger("flashckpt.elastic.rendezvous.handler")  # its log, as before the split

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
