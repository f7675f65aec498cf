"""Typed messages of the trainer <-> node agent protocol (one JSON object per line).

One dataclass per request (``op``), per reply and per pushed event, each with ``to_json`` and
``from_json``. What arrives from a socket is validated here and only here
(:func:`parse_request`): an unknown ``op``, a missing field, a field of the wrong type or out of
range, or a field no message of the protocol has is a :class:`~flashckpt.errors.ProtocolError`
naming it, which the agent answers as an error reply (it never takes the agent down).

The JSON stays what it was before these types existed: a request is
``{"id": <int>, "op": <name>, <fields>}`` (no ``id`` for the one-way ``snap``), a reply
``{"id": ..., "ok": true, <fields>}`` or ``{"id": ..., "ok": false, "error": ..., "kind": ...}``,
an event ``{"event": <name>, <fields>}``. Clients that send the bare dicts are accepted as is.

The byte-format layer: the agent, the client and the trainer import it; no torch.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Union

from flashckpt.errors import ProtocolError
from flashckpt.format.manifest import MAX_WORLD
from flashckpt.format.snapmeta import MAX_LOCAL_RANKS, MAX_STEP

__all__ = [
    "Alloc",
    "AllocReply",
    "ClaimStorage",
    "ClaimStorageReply",
    "Committed",
    "Done",
    "ErrorReply",
    "Event",
    "Fence",
    "Flush",
    "FlushReply",
    "Hash",
    "Hello",
    "HelloReply",
    "OkReply",
    "PersistErrorEvent",
    "Ping",
    "PingReply",
    "Reply",
    "Request",
    "Restored",
    "Snap",
    "Status",
    "StatusReply",
    "parse_event",
    "parse_reply",
    "parse_request",
]

MAX_SLOT_BYTES = 1 << 44
"""Largest slot region a trainer may ask for (16 TiB; the tmpfs bounds it further)."""
MAX_TEXT = 4096
"""Longest text field (a world id, a storage URL, an error)."""
MAX_ID = (1 << 63) - 1
"""Largest request id."""

# Fields a client may put on any request to say who sends it (the trainer tags some requests
# with its whole position): tolerated, and ignored where the op does not use them.
IDENTITY_FIELDS = frozenset({"rank", "local_rank", "world_id", "world_size", "local_world_size"})


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _matches(value: Any, tp: Any) -> bool:
    """Whether a parsed JSON value has the (simple) annotated type ``tp``."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return any(_matches(value, a) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is Any:
        return True
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:  # JSON has one number type: an int is a float here
        return isinstance(value, int | float) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if origin is list:
        (item,) = typing.get_args(tp)
        return (
            isinstance(value, list)
            and len(value) <= 1 << 16
            and all(_matches(v, item) for v in value)
        )
    if origin is dict:
        k, v = typing.get_args(tp)
        return isinstance(value, dict) and all(
            _matches(a, k) and _matches(b, v) for a, b in value.items()
        )
    raise TypeError(f"messages: unsupported field type {tp!r}")  # a bug here, not bad input


class _Message:
    """Shared by requests, replies and events: JSON <-> dataclass with type checks."""

    @classmethod
    def _fields_of(cls) -> dict[str, tuple[Any, bool]]:
        """Field name -> (type, required), resolved once per class."""
        cached = cls.__dict__.get("_field_cache")
        if cached is None:
            hints = typing.get_type_hints(cls)
            cached = {
                f.name: (
                    hints[f.name],
                    f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
                )
                for f in dataclasses.fields(cls)  # type: ignore[arg-type]
            }
            cls._field_cache = cached  # type: ignore[attr-defined]
        return cached

    @classmethod
    def _build(cls, what: str, obj: dict[str, Any], tolerated: frozenset[str]) -> Any:
        fields = cls._fields_of()
        extra = sorted(k for k in obj if k not in fields and k not in tolerated)
        if extra:
            raise ProtocolError(
                f"{what}: unknown field(s) {extra[:5]}; it takes {sorted(fields) or 'none'}"
            )
        kw = {}
        for name, (tp, required) in fields.items():
            if name not in obj:
                if required:
                    raise ProtocolError(f"{what}: missing field {name!r} ({_type_name(tp)})")
                continue
            value = obj[name]
            if not _matches(value, tp):
                raise ProtocolError(
                    f"{what}: field {name!r} is {_short(value)}, not {_type_name(tp)}"
                )
            kw[name] = value
        try:
            return cls(**kw)
        except (TypeError, ValueError) as e:
            if isinstance(e, ProtocolError):
                raise
            raise ProtocolError(f"{what}: {e}") from None

    def fields_json(self) -> dict[str, Any]:
        """The fields as JSON (None-valued optional fields left out)."""
        out = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            v = getattr(self, f.name)
            if v is None and f.default is None:
                continue
            out[f.name] = v
        return out


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 80 else r[:77] + "..."


def _bound(what: str, name: str, v: int | float | None, lo: float, hi: float) -> None:
    if v is not None and not lo <= v <= hi:
        raise ProtocolError(f"{what}: {name}={v} is outside {lo}..{hi}")


def _text(what: str, name: str, v: str | None) -> None:
    if v is not None and len(v) > MAX_TEXT:
        raise ProtocolError(f"{what}: {name} is longer than {MAX_TEXT} characters")


# -- requests --------------------------------------------------------------------------------


class Request(_Message):
    """A message a trainer (or a tool) sends the agent."""

    op: ClassVar[str]
    """The ``op`` on the wire."""
    one_way: ClassVar[bool] = False
    """Sent without an id; the agent never answers it."""

    def to_json(self, rid: int | None = None) -> dict[str, Any]:
        head: dict[str, Any] = {} if rid is None else {"id": rid}
        return {**head, "op": self.op, **self.fields_json()}

    @classmethod
    def from_json(cls, obj: Any) -> Request:
        """The request in ``obj`` (validated by :func:`parse_request`); on a subclass, only
        that request.

        Raises:
            ProtocolError: not a valid request (of this type).
        """
        body = parse_request(obj).body
        if cls is not Request and not isinstance(body, cls):
            raise ProtocolError(f"{body.op!r} is not a {cls.__name__} request")
        return body


@dataclass(frozen=True, slots=True, kw_only=True)
class _Position(Request):
    """A request about one trainer position (keyed by local rank)."""

    rank: int
    """The trainer's global rank."""
    local_rank: int | None = None
    """Its rank on this machine (the key of its slots; older clients send only ``rank``)."""

    @property
    def key(self) -> int:
        """The position the request is about: the local rank, else the rank."""
        return self.local_rank if self.local_rank is not None else self.rank

    def __post_init__(self) -> None:
        _bound(self.op, "rank", self.rank, 0, MAX_WORLD - 1)
        _bound(self.op, "local rank", self.local_rank, 0, MAX_LOCAL_RANKS - 1)


@dataclass(frozen=True, slots=True, kw_only=True)
class Hello(Request):
    """A trainer takes its local-rank position; the reply names its slots."""

    op: ClassVar[str] = "hello"
    rank: int
    """Global rank, ``0 .. world_size-1``."""
    world_size: int
    """Ranks of the trainer's world."""
    local_rank: int | None = None
    """Rank on this machine (older clients send only ``rank``)."""
    world_id: str = ""
    """The world (rendezvous round) the trainer belongs to."""
    local_world_size: int = 1
    """Ranks of the world on this machine."""
    shard: int = 0
    """The shard of the trainer's tensors."""
    num_shards: int = 1
    """Shards of the world."""
    replica: int = 0
    """The trainer's replica index within its shard."""
    storage: str | None = None
    """The checkpoint root URL the trainer persists to (None: the agent's own)."""
    pid: int | None = None
    """The trainer's process id."""

    @property
    def key(self) -> int:
        return self.local_rank if self.local_rank is not None else self.rank

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ProtocolError(
                f"hello: rank {self.rank} is outside the world of {self.world_size}"
            )
        _bound("hello", "world_size", self.world_size, 1, MAX_WORLD)
        if not 1 <= self.local_world_size <= MAX_LOCAL_RANKS:
            raise ProtocolError(
                f"hello: local world size {self.local_world_size} is outside 1..{MAX_LOCAL_RANKS}"
            )
        if self.local_rank is not None and not 0 <= self.local_rank < self.local_world_size:
            raise ProtocolError(
                f"hello: local rank {self.local_rank} is outside this machine's "
                f"{self.local_world_size} ranks"
            )
        if not 0 <= self.key < MAX_LOCAL_RANKS:
            raise ProtocolError(f"hello: local rank {self.key} is outside 0..{MAX_LOCAL_RANKS - 1}")
        _bound("hello", "num_shards", self.num_shards, 1, self.world_size)
        _bound("hello", "shard", self.shard, 0, self.num_shards - 1)
        _bound("hello", "replica", self.replica, 0, self.world_size - 1)
        _text("hello", "world_id", self.world_id)
        _text("hello", "storage", self.storage)


@dataclass(frozen=True, slots=True, kw_only=True)
class Alloc(_Position):
    """Slots of at least these sizes for the position this connection said hello for."""

    op: ClassVar[str] = "alloc"
    meta_cap: int
    """Bytes of the meta region."""
    data_cap: int
    """Bytes of the data region."""
    keep: list[int] | None = None
    """Slots (0, 1) the trainer needs as they are: never replaced, whatever their size."""
    check_only: bool | None = None
    """True: only check that the shared memory has room for them (as the alloc would: the
    replicas' capacity check and the free space), allocate nothing; the reply lists no slot.
    (None, the default, is left off the wire: an alloc's JSON is what it was.)"""

    def __post_init__(self) -> None:
        _Position.__post_init__(self)
        if self.check_only is not None and type(self.check_only) is not bool:
            raise ProtocolError(f"alloc: check_only={self.check_only!r} is not a boolean")
        if not (0 <= self.meta_cap <= MAX_SLOT_BYTES and 0 <= self.data_cap <= MAX_SLOT_BYTES):
            raise ProtocolError(
                f"alloc: slot sizes {self.meta_cap} + {self.data_cap} B are outside "
                f"0..{MAX_SLOT_BYTES}"
            )
        if not set(self.keep or ()) <= {0, 1}:
            raise ProtocolError(
                f"alloc: keep={sorted(set(self.keep or ()))} names slots other than 0 and 1"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class Snap(_Position):
    """One-way: the position's snapshot of ``step`` is complete."""

    op: ClassVar[str] = "snap"
    one_way: ClassVar[bool] = True
    step: int
    """The step of the snapshot."""

    def __post_init__(self) -> None:
        _Position.__post_init__(self)
        _bound("snap", "step", self.step, 0, MAX_STEP)


@dataclass(frozen=True, slots=True, kw_only=True)
class Hash(Request):
    """Record the data hash of every complete snapshot now (before a restore checks them)."""

    op: ClassVar[str] = "hash"


@dataclass(frozen=True, slots=True, kw_only=True)
class Restored(Request):
    """The trainers' timeline starts at ``step`` (-1: a fresh start, nothing restored)."""

    op: ClassVar[str] = "restored"
    step: int
    """The step resumed at, or -1."""

    def __post_init__(self) -> None:
        _bound("restored", "step", self.step, -1, MAX_STEP)


@dataclass(frozen=True, slots=True, kw_only=True)
class Flush(Request):
    """Answer once ``step`` (or a newer one) is committed, or the timeout passed."""

    op: ClassVar[str] = "flush"
    step: int
    """The step to wait for."""
    timeout_s: float = 300.0
    """Seconds the agent waits."""

    def __post_init__(self) -> None:
        _bound("flush", "step", self.step, 0, MAX_STEP)
        _bound("flush", "timeout_s", self.timeout_s, 0, 7 * 86400)


@dataclass(frozen=True, slots=True, kw_only=True)
class Done(_Position):
    """The position finished training (an auto-started agent may exit once all did)."""

    op: ClassVar[str] = "done"


@dataclass(frozen=True, slots=True, kw_only=True)
class Status(Request):
    """The agent's status (ranks, slots, commits, errors, monitor)."""

    op: ClassVar[str] = "status"


@dataclass(frozen=True, slots=True, kw_only=True)
class Ping(Request):
    """Liveness: the reply names the agent's pid."""

    op: ClassVar[str] = "ping"


REQUESTS: dict[str, type[Request]] = {
    c.op: c for c in (Hello, Alloc, Snap, Hash, Restored, Flush, Done, Status, Ping)
}
"""Every request, by its ``op``."""

# ``hash`` comes with the position too (it hashes every one); ``hello`` names the pid.
_TOLERATED = IDENTITY_FIELDS | {"pid"}


@dataclass(frozen=True, slots=True, kw_only=True)
class Envelope:
    """A request as received: its id (None for a one-way message) and the typed body."""

    rid: int | str | None
    """The id to answer with."""
    body: Request
    """The request."""


def request_id(obj: Any) -> int | str | None:
    """The id of a received object, if it has a usable one (to address an error reply)."""
    rid = obj.get("id") if isinstance(obj, dict) else None
    if isinstance(rid, bool) or not isinstance(rid, int | str):
        return None
    if isinstance(rid, str) and len(rid) > 64:
        return None
    return rid


def parse_request(obj: Any) -> Envelope:
    """Validates one received object: the one place input from a socket is checked.

    Raises:
        ProtocolError: not an object, no or an unknown ``op``, a bad ``id``, or a field
            missing, unknown, ill-typed or out of range (the message names it).
    """
    if not isinstance(obj, dict):
        raise ProtocolError(f"a message is a JSON object, not {type(obj).__name__}")
    op = obj.get("op")
    cls = REQUESTS.get(op) if isinstance(op, str) else None
    if cls is None:
        raise ProtocolError(f"unknown request {_short(op)}; the agent knows {sorted(REQUESTS)}")
    rid = obj.get("id")
    if rid is not None and request_id(obj) is None:
        raise ProtocolError(f"{op}: invalid id {_short(rid)}")
    if isinstance(rid, int) and not 0 <= rid <= MAX_ID:
        raise ProtocolError(f"{op}: id {rid} is outside 0..{MAX_ID}")
    body = {k: v for k, v in obj.items() if k not in ("op", "id")}
    own = cls._fields_of()
    tolerated = frozenset(k for k in _TOLERATED if k not in own)
    return Envelope(rid=rid, body=cls._build(cls.op, body, tolerated))


# -- replies ---------------------------------------------------------------------------------


class Reply(_Message):
    """The agent's answer to a request (``ok`` true or false)."""

    ok: ClassVar[bool] = True

    def to_json(self, rid: int | str | None = None) -> dict[str, Any]:
        head: dict[str, Any] = {} if rid is None else {"id": rid}
        return {**head, "ok": self.ok, **self.fields_json()}

    @classmethod
    def from_json(cls, op: str, obj: Any) -> Reply:
        """The reply to ``op`` in ``obj`` (see :func:`parse_reply`)."""
        return parse_reply(op, obj)


@dataclass(frozen=True, slots=True, kw_only=True)
class OkReply(Reply):
    """Done, nothing to tell (``hash``, ``restored``, ``done``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ErrorReply(Reply):
    """The request was refused or failed."""

    ok: ClassVar[bool] = False
    error: str
    """What went wrong and what to do."""
    kind: str | None = None
    """The agent-side exception type (e.g. ``ShmSpaceError``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class HelloReply(Reply):
    """The position is taken."""

    slots: list[str | None]
    """The position's two slot files (None: none usable yet)."""
    pid: int
    """The agent's pid."""
    committed: list[int]
    """The committed steps the agent knows of."""
    shm_dir: str
    """The tmpfs of the slots."""
    auto_started: bool
    """Started by a trainer (it exits when done): any trainer may start the next one."""
    storage: str | None = None
    """The checkpoint root the agent persists to (None: memory only)."""
    storage_steps: list[int] | None = None
    """To a hello without ``storage`` (the agent's own root, which the trainer may not be able to
    open): the committed steps listed there now (None: not looked at)."""
    storage_foreign: str | None = None
    """To a hello without ``storage``: why the agent's root belongs to another job (its committed
    steps or its owner file name that job: the refusal, naming job, root and fix), else None."""


@dataclass(frozen=True, slots=True, kw_only=True)
class AllocReply(Reply):
    """The position's slots, allocated or kept."""

    slots: list[str]
    """The two slot files (none for ``check_only``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class FlushReply(Reply):
    """A step at or past the one asked for is committed."""

    committed: int
    """The newest committed step."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PingReply(Reply):
    """The agent lives."""

    pid: int
    """Its pid."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StatusReply(Reply):
    """The agent's status; on the wire its keys sit next to ``ok``."""

    status: dict[str, Any] = field(default_factory=dict)
    """What :meth:`flashckpt.agent.daemon.NodeAgent.status` returns."""

    def fields_json(self) -> dict[str, Any]:
        return dict(self.status)


REPLIES: dict[str, type[Reply]] = {
    "hello": HelloReply,
    "alloc": AllocReply,
    "flush": FlushReply,
    "ping": PingReply,
    "status": StatusReply,
    "hash": OkReply,
    "restored": OkReply,
    "done": OkReply,
}
"""The reply type of each request that is answered."""


def parse_reply(op: str, obj: Any) -> Reply:
    """Validates a reply to ``op`` (a client's check of what its agent answered).

    Raises:
        ProtocolError: not a reply of that request.
    """
    if not isinstance(obj, dict) or not isinstance(obj.get("ok"), bool):
        raise ProtocolError(f"reply to {op!r}: not a reply object")
    body = {k: v for k, v in obj.items() if k not in ("ok", "id")}
    if not obj["ok"]:
        return ErrorReply._build(f"reply to {op!r}", body, frozenset())
    cls = REPLIES.get(op)
    if cls is None:
        raise ProtocolError(f"reply to unknown request {op!r}")
    if cls is StatusReply:
        return StatusReply(status=body)
    # Replies may grow fields a client does not know yet: they are ignored, not refused.
    known = cls._fields_of()
    return cls._build(
        f"reply to {op!r}", {k: v for k, v in body.items() if k in known}, frozenset()
    )


# -- events ----------------------------------------------------------------------------------


class Event(_Message):
    """Pushed by the agent to every connected trainer (no id)."""

    event: ClassVar[str]
    """The ``event`` on the wire."""

    def to_json(self) -> dict[str, Any]:
        return {"event": self.event, **self.fields_json()}

    @classmethod
    def from_json(cls, obj: Any) -> Event:
        """The event in ``obj`` (see :func:`parse_event`)."""
        return parse_event(obj)


@dataclass(frozen=True, slots=True, kw_only=True)
class Committed(Event):
    """A step is committed to storage."""

    event: ClassVar[str] = "committed"
    step: int
    """The step."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PersistErrorEvent(Event):
    """Persisting (or committing) a step failed."""

    event: ClassVar[str] = "persist_error"
    step: int | None
    """The step (None when the failure is not about one, e.g. listing storage)."""
    error: str
    """What failed."""

    def fields_json(self) -> dict[str, Any]:
        return {"step": self.step, "error": self.error}  # step: null is part of the wire


EVENTS: dict[str, type[Event]] = {c.event: c for c in (Committed, PersistErrorEvent)}
"""Every event, by its name."""


def parse_event(obj: Any) -> Event:
    """Validates a pushed event.

    Raises:
        ProtocolError: not an event the protocol has, or a field wrong.
    """
    name = obj.get("event") if isinstance(obj, dict) else None
    cls = EVENTS.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ProtocolError(f"unknown event {_short(name)}")
    body = {k: v for k, v in obj.items() if k != "event"}
    return cls._build(f"event {name!r}", body, frozenset())


# -- replica_peers (issue 11: the launcher tells the agent where the world's machines are) -----

MAX_REPLICA_PEERS = 4096
"""The most machines one ``replica_peers`` request may name."""


def _host_port(what: str, text: str) -> tuple[str, int]:
    """``host:port`` (``[v6addr]:port``) as (host, port), or a ProtocolError naming ``what``."""
    host, sep, port_text = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    ok = (
        bool(sep and host)
        and len(text) <= 300
        and port_text.isascii()
        and port_text.isdigit()
        and len(port_text) <= 5
        and all(c.isascii() and (c.isalnum() or c in ".-_:%") for c in host)
    )
    if not ok or not 1 <= int(port_text) <= 65535:
        raise ProtocolError(
            f"{what}: {_short(text)} is not host:port with a port in 1-65535 "
            "(e.g. 10.0.0.2:7070, [fd00::2]:7070)"
        )
    return host, int(port_text)


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplicaPeers(Request):
    """The other machines of the current world and their agents' replica servers (the launcher
    sends it at every rendezvous round): replaces the agent's peer list; the replica targets
    are re-derived from it (ring order) and replicas of machines that left are dropped once the
    new world has a snapshot here (a replacement may restore from them until then)."""

    op: ClassVar[str] = "replica_peers"
    peers: dict[str, str]
    """Node id -> ``host:port`` of its replica server; never this machine's own node."""

    def __post_init__(self) -> None:
        if len(self.peers) > MAX_REPLICA_PEERS:
            raise ProtocolError(
                f"replica_peers: {len(self.peers)} machines, more than {MAX_REPLICA_PEERS}"
            )
        from flashckpt.names import check_name

        for node, addr in self.peers.items():
            try:
                check_name("node", node)
            except ValueError as e:
                raise ProtocolError(f"replica_peers: {e}") from None
            _host_port(f"replica_peers: the address of node {node!r}", addr)

    def addresses(self) -> dict[str, tuple[str, int]]:
        """The peers as node id -> (host, port)."""
        return {n: _host_port(f"replica_peers {n!r}", a) for n, a in self.peers.items()}


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplicaPeersReply(Reply):
    """The peer list is taken."""

    listen: str | None = None
    """``host:port`` this agent's replica server listens on (None: it runs none)."""
    targets: list[str] = field(default_factory=list)
    """The machines this agent now sends its replicas to."""


REQUESTS[ReplicaPeers.op] = ReplicaPeers
REPLIES[ReplicaPeers.op] = ReplicaPeersReply
__all__ += ["ReplicaPeers", "ReplicaPeersReply"]


# -- pull_replica (issue 11: restore a lost machine's ranks from a peer agent's replica) -------


@dataclass(frozen=True, slots=True, kw_only=True)
class PullReplica(_Position):
    """Find a peer agent's replica of global rank ``rank``'s snapshot (step >= ``min_step``, of a
    world of ``world_size`` ranks) and, with ``fetch``, copy the newest into a slot of the
    position this connection said hello for, hash-verified (the trainer then reads it as
    memory). Without ``fetch`` only says what the peers hold."""

    op: ClassVar[str] = "pull_replica"
    world_size: int
    """Ranks of the world the snapshot must have been taken in (the trainer's world)."""
    min_step: int = 0
    """The oldest step wanted."""
    world_id: str | None = None
    """The world id the snapshot must have been taken in (None: any)."""
    fetch: bool = True
    """Copy it into a slot (else only look)."""
    timeout_s: float = 120.0
    """Seconds one peer may take to answer (and to send a replica)."""
    holder: str | None = None
    """With ``fetch``: the peer agent (node id) an earlier look found the replica at; the agent
    fetches from it at once instead of asking every peer again (it still checks everything it
    is sent; a holder it does not know, or one that no longer has it, makes it ask them all)."""
    sender: str | None = None
    """With ``holder``: the machine whose snapshot the replica is (as that look said)."""

    def __post_init__(self) -> None:
        _Position.__post_init__(self)
        _text("pull_replica", "holder", self.holder)
        _text("pull_replica", "sender", self.sender)
        _bound("pull_replica", "world_size", self.world_size, 1, MAX_WORLD)
        if self.rank >= self.world_size:
            raise ProtocolError(
                f"pull_replica: rank {self.rank} is outside the world of {self.world_size}"
            )
        _bound("pull_replica", "min_step", self.min_step, 0, MAX_STEP)
        _bound("pull_replica", "timeout_s", self.timeout_s, 0.1, 3600)
        _text("pull_replica", "world_id", self.world_id)


@dataclass(frozen=True, slots=True, kw_only=True)
class PullReplicaReply(Reply):
    """What a pull found: the replica (and, fetched, the slot it is in now), or why none."""

    found: bool
    """A peer holds a replica that fits (and, with ``fetch``, it is in ``path`` now)."""
    step: int = -1
    """Its step (-1: none found)."""
    holder: str = ""
    """The node id of the peer agent that holds it."""
    source: str = ""
    """That agent's replica server (``host:port``)."""
    sender: str = ""
    """The machine whose snapshot it is (the one it protects)."""
    world_id: str = ""
    """The world id it was taken in."""
    bytes: int = 0
    """Bytes of tensor data."""
    path: str | None = None
    """The slot file it was copied into (fetched only)."""
    slot: int = -1
    """The slot's index (0 or 1; fetched only)."""
    reason: str = ""
    """Why none was found (each peer's answer), for the trainer's warning."""
    phases_s: dict[str, float] = field(default_factory=dict)
    """Seconds the agent spent in each phase of the pull (``ask``: the peers' answers;
    fetched: ``connect``, ``alloc``, ``recv`` (data received and hashed), ``install``,
    ``total``), for the benchmarks and logs."""


REQUESTS[PullReplica.op] = PullReplica
REPLIES[PullReplica.op] = PullReplicaReply
__all__ += ["PullReplica", "PullReplicaReply"]


# -- fencing (a machine cut off from the job) ---------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Fence(Request):
    """This machine lost its place in the job (its etcd lease is lapsing: a network partition):
    commit nothing more, persist nothing more of the current world and refuse its trainers, until
    a trainer of a new world says hello. Sent by the launcher; answered once no persist is in
    flight (or ``timeout_s`` passed)."""

    op: ClassVar[str] = "fence"
    reason: str = ""
    """Why (the agent logs it)."""
    timeout_s: float = 5.0
    """Seconds to wait for a persist in flight to end before answering."""

    def __post_init__(self) -> None:
        _text("fence", "reason", self.reason)
        _bound("fence", "timeout_s", self.timeout_s, 0, 600)


REQUESTS[Fence.op] = Fence
REPLIES[Fence.op] = OkReply


# -- the agent's own storage root (issue 30: a job's state is its own) --------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ClaimStorage(Request):
    """A trainer that brought no ``storage=`` takes the agent's own root for its job (after
    every rank agreed the root is its job's, or takeover): the agent records the job in the
    root's owner file and, with ``delete_steps``, first deletes every step there (the trainers'
    ``overwrite=True``). The agent does it because it may be the only one that can open the root
    (its own mount namespace, credentials)."""

    op: ClassVar[str] = "claim_storage"
    delete_steps: bool = False
    """Delete the root's steps first (committed or not)."""
    takeover: bool = True
    """Rewrite the owner file for the job whoever owned the root (the trainers' takeover);
    False: take the root only where its owner file is missing or the job's own, atomically
    (issue 41), else answer with the refusal in ``foreign``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ClaimStorageReply(Reply):
    """The root is claimed."""

    deleted: list[int]
    """The steps deleted (``delete_steps``)."""
    owner_error: str | None = None
    """Why the owner file could not be written (the trainer warns), else None."""
    foreign: str | None = None
    """Without ``takeover``: the refusal, where the root belongs to another job (nothing was
    written), else None."""


REQUESTS[ClaimStorage.op] = ClaimStorage
REPLIES[ClaimStorage.op] = ClaimStorageReply


# -- persisted (issue 14: a marked snapshot is not lost from storage's cadence) ---------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Persisted(Event):
    """This node's part of a step is written to storage (the commit follows once every node's
    part is in). A trainer that marked a snapshot for storage learns from it that its node's
    persister took a step at least as new, so the mark need not be carried forward."""

    event: ClassVar[str] = "persisted"
    step: int
    """The step."""


EVENTS[Persisted.event] = Persisted
__all__ += ["Persisted"]


# -- persisting (issue 30: a persist in flight holds the trainers' mark) ----------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Persisting(Event):
    """This node's persister took a step's snapshots (pinned, or copied out of the slots) and
    writes them to storage now; ``persisted`` follows, or ``persist_abandoned``. A trainer
    whose marked snapshot left its slot while this step (or a newer one) is being written
    counts the mark as pending, not lost: slow storage then gets one persist per
    ``persist_every``, not one after another."""

    event: ClassVar[str] = "persisting"
    step: int
    """The step."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PersistAbandoned(Event):
    """The persist of a step announced by ``persisting`` ended without writing it (it gave way
    to a trainer, the slot changed under it, its data failed its hash, storage failed)."""

    event: ClassVar[str] = "persist_abandoned"
    step: int
    """The step."""


EVENTS[Persisting.event] = Persisting
EVENTS[PersistAbandoned.event] = PersistAbandoned
__all__ += ["PersistAbandoned", "Persisting"]
