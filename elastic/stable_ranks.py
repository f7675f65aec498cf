"""Stable group ranks: a machine that survives a rendezvous round keeps its rank in the next one.

torch's ``DynamicRendezvousHandler`` numbers the machines of every round afresh, in the order of
their node descriptors (``enumerate(sorted(state.participants))`` in
``_mark_rendezvous_complete``). When the machine of rank 0 dies, the survivor of rank 1 becomes
rank 0 of the next round: its own memory holds the snapshots of old rank 1, and in a fully
sharded job no machine holds what new rank 0 needs (or what the replacement, now rank 1, needs
from the survivor's replica of old rank 0, which nobody asks for), so the job started over.

Here every machine of round ``R`` computes the same numbering from data no machine changes while
it is read:

- after its rank in round ``R`` is known, each machine writes one record
  ``<job>/ranks/<incarnation>/<R>/<node>`` -> its rank, before ``next_rendezvous`` returns (a
  failed write fails the rendezvous, like any other etcd failure in it);
- in round ``R`` each participant's *claim* is its record from the newest of the rounds
  ``R - KEEP_ROUNDS .. R - 1``. All those records were written before round ``R`` could start:
  torch starts a round only once every participant of the previous one left it (by calling
  ``next_rendezvous`` again, after writing its record) or was dropped as dead;
- :func:`assign_ranks` then keeps each claim whose rank is below the new world size and not
  taken by a newer claim (newer rounds win, then torch's order); the other machines (standbys,
  new machines, machines whose claim was lost) fill the free ranks in torch's order.

``<incarnation>`` is the ``create_revision`` of the rendezvous state key: a job started again
under the same run id after its state expired counts rounds from 0 again, and must not read the
old job's records (node descriptors repeat where launchers run as the same pid, e.g. in
containers). ``<node>`` is the node descriptor's ``repr`` (``addr_pid_localid``, as in
:attr:`elastic.membership.NodeRecord.rdzv_node`), percent-encoded.

The rank-0 machine of each round deletes the records older than the rounds anyone can still read
(and older incarnations'): at most ``KEEP_ROUNDS + 1`` rounds of records are kept. Records
are validated when read (bounded size, a JSON object of known version with integer fields in
range); a record that is not is ignored with a warning, never fatal, never unpickled.

This overrides torch's private ``_get_world`` (what ``next_rendezvous`` returns as the rank, and
what ``RendezvousStoreInfo.build`` uses to choose who publishes ``MASTER_ADDR``/``MASTER_PORT``:
with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, always set by our handler, the new rank 0 picks a
port and publishes it in this round's store). :func:`install_stable_ranks` checks the internals
it needs and raises naming the torch version if they differ.
"""

from __future__ import annotations

import json
import logging
import re
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousError,
    RendezvousStateError,
)

from elastic.etcd import EtcdClient, EtcdError, KeyValue

__all__ = [
    "KEEP_ROUNDS",
    "RankClaim",
    "RankRecords",
    "assign_ranks",
    "decode_record",
    "encode_record",
    "install_stable_ranks",
]

logger = logging.getLogger(__name__)

KEEP_ROUNDS = 4
"""How many past rounds a claim is looked up in (and kept in etcd, besides the current one). A
live machine normally takes part in every round; one that waited a few rounds out (the round
filled up without it) still keeps its rank."""

RECORD_VERSION = 1
_MAX_RECORD_BYTES = 256
_MAX_WORLD = 1 << 20  # more machines than any job has: a bound for what a record may say
_MAX_ROUND = 10**12 - 1  # 12 digits in the key, so keys sort by round
_TXN_CHUNK = 64  # keys read per transaction: below etcd's default --max-txn-ops of 128
_ROUND_KEY = re.compile(r"([0-9]{20})/([0-9]{12})/")


@dataclass(frozen=True, slots=True)
class RankClaim:
    """A machine's rank in an earlier round, which it claims again in the current one."""

    round: int
    """The round the machine had the rank in."""
    rank: int
    """Its group rank in that round."""

    def __post_init__(self) -> None:
        for name in ("round", "rank"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise ValueError(f"RankClaim.{name} must be an int >= 0, got {value!r}")


def assign_ranks(participants: Sequence[str], claims: Mapping[str, RankClaim]) -> dict[str, int]:
    """The group rank of each machine of a round.

    A machine keeps its claimed rank if that rank is below the round's world size and no newer
    claim takes it (claims of newer rounds first, ties in ``participants`` order); the other
    machines take the free ranks in ascending order, in ``participants`` order.

    Args:
        participants: The round's machines in torch's order (sorted node descriptors): with no
            claims the result is torch's own numbering.
        claims: Each machine's claim, if it has one; claims of non-participants are ignored.

    Returns:
        Machine -> rank, a permutation of ``range(len(participants))``.

    Raises:
        ValueError: If a machine appears twice in ``participants``.
    """
    world = len(participants)
    order = {node: i for i, node in enumerate(participants)}
    if len(order) != world:
        raise ValueError(f"a machine appears twice among the participants: {list(participants)}")
    claimants = sorted(
        (n for n in participants if n in claims and claims[n].rank < world),
        key=lambda n: (-claims[n].round, order[n]),
    )
    ranks: dict[str, int] = {}
    taken: set[int] = set()
    for node in claimants:
        rank = claims[node].rank
        if rank not in taken:
            ranks[node] = rank
            taken.add(rank)
    free = (r for r in range(world) if r not in taken)
    for node in participants:
        if node not in ranks:
            ranks[node] = next(free)
    return ranks


def encode_record(rank: int, world_size: int) -> bytes:
    """The value of a rank record."""
    return json.dumps(
        {"v": RECORD_VERSION, "rank": rank, "world_size": world_size}, separators=(",", ":")
    ).encode()


def decode_record(value: bytes) -> tuple[int, int]:
    """Checks a rank record read from etcd and returns ``(rank, world_size)``.

    Raises:
        ValueError: If it is not a record of this version with a rank below its world size;
            the message says what is wrong.
    """
    if len(value) > _MAX_RECORD_BYTES:
        raise ValueError(f"{len(value)} bytes, more than a record has ({_MAX_RECORD_BYTES})")
    try:
        doc = json.loads(value.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"not a JSON object: {type(doc).__name__}")
    if doc.get("v") != RECORD_VERSION or type(doc.get("v")) is not int:
        raise ValueError(f"version {doc.get('v')!r}, this flashckpt reads {RECORD_VERSION}")
    rank, world = doc.get("rank"), doc.get("world_size")
    if type(world) is not int or not 1 <= world <= _MAX_WORLD:
        raise ValueError(f"world_size {world!r} is not an int in [1, {_MAX_WORLD}]")
    if type(rank) is not int or not 0 <= rank < world:
        raise ValueError(f"rank {rank!r} is not an int in [0, {world})")
    return rank, world


class RankRecords:
    """The rank records of one job in etcd (see the module docstring).

    Args:
        client: The etcd client.
        job_prefix: The job's prefix (:func:`elastic.rendezvous.job_prefix`).
    """

    def __init__(self, client: EtcdClient, job_prefix: str) -> None:
        if not job_prefix.endswith("/"):
            raise ValueError(f"the job prefix must end with '/', got {job_prefix!r}")
        self._client = client
        self._prefix = job_prefix + "ranks/"

    @property
    def prefix(self) -> str:
        """The etcd prefix of every record: ``<job>/ranks/``."""
        return self._prefix

    def key(self, incarnation: int, round_: int, node: str) -> str:
        """The key of one machine's record of one round."""
        _check_round(incarnation, round_)
        return f"{self._round_prefix(incarnation, round_)}{urllib.parse.quote(node, safe='')}"

    def _round_prefix(self, incarnation: int, round_: int) -> str:
        return f"{self._prefix}{incarnation:020d}/{round_:012d}/"

    def claims(self, incarnation: int, round_: int, nodes: Sequence[str]) -> dict[str, RankClaim]:
        """Each node's claim in round ``round_``: its record of the newest of the previous
        :data:`KEEP_ROUNDS` rounds. A record that does not validate is no claim (warned).

        Raises:
            EtcdError: If etcd could not be read (no guess: every machine must see the same).
        """
        _check_round(incarnation, round_)
        rounds = list(range(round_ - 1, max(-1, round_ - 1 - KEEP_ROUNDS), -1))  # newest first
        wanted = [(node, r) for node in nodes for r in rounds]
        found: dict[tuple[str, int], KeyValue] = {}
        for start in range(0, len(wanted), _TXN_CHUNK):
            chunk = wanted[start : start + _TXN_CHUNK]
            # Separate snapshots are fine: no key of these rounds changes while round_ runs.
            kvs, _ = self._client.get_many([self.key(incarnation, r, n) for n, r in chunk])
            found.update({pair: kv for pair, kv in zip(chunk, kvs, strict=True) if kv})
        claims: dict[str, RankClaim] = {}
        for node in nodes:
            newest = next(((r, found[node, r]) for r in rounds if (node, r) in found), None)
            if newest is None:
                continue
            r, kv = newest
            try:
                rank, _ = decode_record(kv.value)
            except ValueError as exc:
                logger.warning(
                    "ignoring the rank record %r of machine %s (%s): it takes a free rank",
                    kv.key.decode(errors="replace"),
                    node,
                    exc,
                )
                continue
            claims[node] = RankClaim(round=r, rank=rank)
        return claims

    def record(self, incarnation: int, round_: int, node: str, rank: int, world_size: int) -> None:
        """Writes ``node``'s rank of round ``round_``.

        Raises:
            EtcdError: If etcd could not be written.
        """
        self._client.put(self.key(incarnation, round_, node), encode_record(rank, world_size))

    def prune(self, incarnation: int, round_: int) -> int:
        """Deletes every record that no machine of round ``round_`` or later reads: older
        incarnations', and rounds before ``round_ - KEEP_ROUNDS``; also keys under the prefix
        that this module never writes. Returns how many keys went.

        Raises:
            EtcdError: If etcd could not be read or written.
        """
        _check_round(incarnation, round_)
        oldest_kept = round_ - KEEP_ROUNDS
        doomed_rounds: set[str] = set()
        doomed_keys: list[bytes] = []
        for kv in self._client.get_prefix(self._prefix):
            match = _ROUND_KEY.match(kv.key[len(self._prefix) :].decode(errors="replace"))
            if match is None:  # in our namespace, not written by us: in the way, never read
                doomed_keys.append(kv.key)
                continue
            inc, rnd = int(match.group(1)), int(match.group(2))
            if inc < incarnation or (inc == incarnation and rnd < oldest_kept):
                doomed_rounds.add(self._prefix + match.group(0))
        deleted = sum(self._client.delete_prefix(p) for p in sorted(doomed_rounds))
        for key in doomed_keys:
            deleted += int(self._client.delete(key))
        return deleted


def _check_round(incarnation: int, round_: int) -> None:
    if type(incarnation) is not int or not 0 < incarnation < 10**20:
        raise ValueError(f"the incarnation must be an etcd revision (int > 0), got {incarnation!r}")
    if type(round_) is not int or not 0 <= round_ <= _MAX_ROUND:
        raise ValueError(f"the round must be an int in [0, {_MAX_ROUND}], got {round_!r}")


class _StateBackend(Protocol):
    """What the rank records need of :class:`elastic.rendezvous.EtcdRendezvousBackend`."""

    @property
    def client(self) -> EtcdClient: ...

    @property
    def key(self) -> str: ...

    @property
    def job_prefix(self) -> str: ...


class _StableWorld:
    """The ``_get_world`` installed on a handler by :func:`install_stable_ranks`."""

    def __init__(self, handler: Any, backend: _StateBackend, records: RankRecords) -> None:
        self._handler = handler
        self._backend = backend
        self._records = records

    def __call__(self) -> tuple[int, int]:
        handler = self._handler
        # The keep-alive thread runs already and may drop a dead participant: copy under its lock.
        with handler._heartbeat_lock:
            state = handler._state_holder.state
            participants = sorted(state.participants)  # torch's order
            torch_rank = state.participants.get(handler._this_node)
            round_ = state.round
        me = repr(handler._this_node)
        nodes = [repr(p) for p in participants]
        if me not in nodes:
            raise RendezvousStateError(
                f"this node ({me}) is not among the participants of round {round_} it joined"
            )
        try:
            incarnation = self._incarnation()
            claims = self._records.claims(incarnation, round_, nodes)
            ranks = assign_ranks(nodes, claims)
            rank = ranks[me]
            self._records.record(incarnation, round_, me, rank, len(nodes))
        except EtcdError as exc:
            raise RendezvousConnectionError(
                f"could not read or write the group ranks of rendezvous round {round_} under "
                f"{self._records.prefix!r} in etcd: {exc}"
            ) from exc
        if rank == 0:
            try:
                self._records.prune(incarnation, round_)
            except EtcdError as exc:  # the next round's rank 0 tries again
                logger.warning("could not delete old rank records: %s", exc)
        kept = {n: c.rank for n, c in claims.items() if ranks[n] == c.rank}
        logger.info(
            "round %d: group rank %d of %d (torch's numbering: %s); ranks kept from earlier "
            "rounds: %s",
            round_,
            rank,
            len(nodes),
            torch_rank,
            kept or "none",
        )
        return rank, len(nodes)

    def _incarnation(self) -> int:
        kv = self._backend.client.get_kv(self._backend.key)
        if kv is None:
            raise RendezvousStateError(
                f"the rendezvous state {self._backend.key!r} vanished from etcd right after the "
                "round completed (expired or deleted): start the rendezvous again"
            )
        return kv.create_revision


_NEEDED = (
    "_get_world",
    "_state_holder",
    "_this_node",
    "_heartbeat_lock",
)


def install_stable_ranks(handler: Any, backend: _StateBackend) -> None:
    """Makes ``handler`` (torch's ``DynamicRendezvousHandler`` on our etcd backend) keep the
    group ranks of surviving machines across rounds (see the module docstring).

    Args:
        handler: The handler, built by torch's ``create_handler``.
        backend: Its etcd backend (for the client, the state key and the job's prefix).

    Raises:
        RendezvousError: If the handler lacks the torch internals this relies on; the message
            names the torch version.
    """
    missing = [name for name in _NEEDED if not hasattr(handler, name)]
    next_rendezvous = getattr(type(handler), "next_rendezvous", None)
    code = getattr(next_rendezvous, "__code__", None)
    if code is None or "_get_world" not in code.co_names:
        missing.append("next_rendezvous() calling _get_world()")
    state = getattr(getattr(handler, "_state_holder", None), "state", None)
    if not isinstance(getattr(state, "participants", None), dict):
        missing.append("_state_holder.state.participants")
    if type(getattr(state, "round", None)) is not int:
        missing.append("_state_holder.state.round")
    node = getattr(handler, "_this_node", None)
    if node is not None and not all(hasattr(node, f) for f in ("addr", "pid", "local_id")):
        missing.append("_this_node.addr/pid/local_id")
    if missing:
        raise RendezvousError(
            f"flashckpt keeps machines' group ranks stable across rendezvous rounds through "
            f"internals of torch's DynamicRendezvousHandler that torch {torch.__version__} "
            f"lacks or changed: {', '.join(missing)}. Use a torch version this flashckpt "
            "supports (these internals were checked against torch 2.13), or report it"
        )
    records = RankRecords(backend.client, backend.job_prefix)
    handler._get_world = _StableWorld(handler, backend, records)
