"""Typed snapshot meta (a slot's JSON description) and node part (a node's record of a step).

The trainer writes a :class:`SnapshotMeta` into a slot's header region with every snapshot; the
node agent reads it to persist the snapshot (who the rank is, which shard it holds, its layout and
skeleton, its private state). The agent writes one :class:`NodePart` per node and step into
``<step>/_parts/<node>.json``; the committing agent builds the manifest from the parts.

Neither is trusted when read back: a slot may be scribbled, a part may come from a dead agent or
be planted. ``from_json`` is the one place both are validated (types, bounds, names confined to
those the format defines, lengths bounded); anything wrong is a
:class:`~flashckpt.errors.CorruptCheckpointError` naming the field. ``to_json`` gives back the
same JSON, key for key and in the same order, so the bytes on the wire and in storage do not
change.

Torch-free: the node agent imports it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from flashckpt.errors import CorruptCheckpointError
from flashckpt.format.layout import Layout, TensorEntry
from flashckpt.format.manifest import (
    MAX_FILE_SIZE,
    MAX_WORLD,
    FileEntry,
    RankEntry,
    ShardEntry,
    rank_file_name,
    shard_file_name,
)
from flashckpt.names import ID_RE

__all__ = [
    "MAX_LOCAL_RANKS",
    "META_KEYS",
    "OPTIONAL_META_KEYS",
    "PART_KEYS",
    "NodePart",
    "SnapshotMeta",
]

MAX_LOCAL_RANKS = 4096
"""Most trainer positions (local ranks) one machine's agent serves."""
MAX_WORLD_ID = 1024
"""Longest world id (a rendezvous round's name, e.g. ``host:port/world``)."""
MAX_ENTRIES = 1 << 24
"""Most tensors one snapshot's layout lists."""
MAX_NAME = 1 << 16
"""Longest tensor name (flattened state key) in a layout."""
MAX_NDIM = 64
"""Most dimensions of one tensor."""
MAX_STEP = (1 << 62) - 1
"""Largest step number."""
MAX_URL = 4096
"""Longest mirror root URL in a snapshot meta."""

# The meta keys the trainer writes, in its order (``Checkpointer._meta_bytes``): the format.
META_KEYS = (
    "job",
    "rank",
    "world_id",
    "world_size",
    "local_world_size",
    "shard",
    "num_shards",
    "replica",
    "step",
    "private",
    "persist",
    "layout_sig",
    "entries",
    "skeleton",
)
# The meta keys the trainer writes only where they apply (after ``persist``): the format too.
OPTIONAL_META_KEYS = ("mirror",)
# The keys of a node part, in the agent's order: the format.
PART_KEYS = ("node", "step", "world_id", "world_size", "num_shards", "ranks", "shards", "files")


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _index(v: Any, n: int) -> int | None:
    """``v`` (an int, or the decimal string of one, as JSON keys are) if it is in ``[0, n)``."""
    if isinstance(v, str) and v.isdecimal() and v.isascii() and len(v) < 10:
        v = int(v)
    v = _int(v)
    return v if v is not None and 0 <= v < n else None


class _Checker:
    """Raises :class:`CorruptCheckpointError` naming ``source`` and the field at fault."""

    def __init__(self, source: str, what: str) -> None:
        self.source = source
        self.what = what

    def bad(self, key: str, problem: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            self.source, f"has an invalid {self.what} field {key!r}: {problem}"
        )

    def int_in(
        self, doc: dict[str, Any], key: str, lo: int, hi: int, default: int | None = None
    ) -> int:
        v = doc.get(key, default)
        i = _int(v)
        if i is None or not lo <= i <= hi:
            raise self.bad(key, f"{_short(v)} is not an integer in {lo}..{hi}")
        return i

    def text(self, doc: dict[str, Any], key: str, limit: int, default: str | None = None) -> str:
        v = doc.get(key, default)
        if not isinstance(v, str) or len(v) > limit or not v.isprintable():
            raise self.bad(key, f"{_short(v)} is not printable text of at most {limit} characters")
        return v

    def ident(self, doc: dict[str, Any], key: str) -> str:
        v = doc.get(key)
        if not isinstance(v, str) or not ID_RE.match(v):
            raise self.bad(key, f"{_short(v)} is not an id of 1-64 letters, digits, '_' or '-'")
        return v


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 80 else r[:77] + "..."


def _entries(c: _Checker, items: Any) -> tuple[TensorEntry, ...]:
    if not isinstance(items, list) or len(items) > MAX_ENTRIES:
        raise c.bad("entries", f"is not a list of at most {MAX_ENTRIES} tensors")
    out = []
    for i, item in enumerate(items):
        if not isinstance(item, list) or len(item) != 5:
            raise c.bad("entries", f"entry {i} is not [name, dtype, shape, offset, nbytes]")
        name, dtype, shape, offset, nbytes = item
        if not isinstance(name, str) or len(name) > MAX_NAME:
            raise c.bad("entries", f"entry {i} has an invalid name {_short(name)}")
        if not isinstance(dtype, str) or not dtype.isalnum() or len(dtype) > 16:
            raise c.bad("entries", f"entry {i} ({name!r}) has an invalid dtype {_short(dtype)}")
        if (
            not isinstance(shape, list)
            or len(shape) > MAX_NDIM
            or any(_int(d) is None or d < 0 for d in shape)
        ):
            raise c.bad("entries", f"entry {i} ({name!r}) has an invalid shape {_short(shape)}")
        for what, v in (("offset", offset), ("nbytes", nbytes)):
            if _int(v) is None or not 0 <= v <= MAX_FILE_SIZE:
                raise c.bad("entries", f"entry {i} ({name!r}) has an invalid {what} {_short(v)}")
        if offset + nbytes > MAX_FILE_SIZE:
            raise c.bad("entries", f"entry {i} ({name!r}) ends past {MAX_FILE_SIZE}")
        out.append(TensorEntry(name, dtype, tuple(shape), offset, nbytes))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class SnapshotMeta:
    """What a trainer says of one snapshot in its slot (``Checkpointer._meta_bytes``'s JSON)."""

    job: str
    """The job id (a segment-name id)."""
    rank: int
    """The trainer's global rank, ``0 .. world_size-1``."""
    world_id: str
    """The world (rendezvous round) the snapshot was taken in; ``""`` outside a launcher."""
    world_size: int
    """Ranks of that world."""
    local_world_size: int
    """Ranks of that world on this machine."""
    shard: int
    """The shard this rank's tensors belong to, ``0 .. num_shards-1``."""
    num_shards: int
    """Distinct shards of the world (1: a replicated state)."""
    replica: int
    """This rank's replica index in its shard (replica 0 writes the shard to storage)."""
    step: int
    """The training step."""
    private: dict[str, Any]
    """The rank's private state (RNG, extras, buffers hash, per-rank objects): opaque here."""
    layout: Layout
    """Where each tensor lies in the slot's data region."""
    skeleton: Any
    """The state's structure around the tensors (JSON, read by the torch state codec)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Keys this version does not know (a newer trainer's), kept so nothing is lost."""
    persist: bool | None = None
    """Whether the trainers want this snapshot written to storage (``persist_every``: every rank
    marks the same snapshots). None (the key absent, an older trainer): yes. An unmarked one is
    still persisted when a flush waits for it, or its trainer died or finished."""

    mirror: str | None = None
    """The remote tier's root URL (``mirror=``) where the trainers want this snapshot copied
    once it is persisted (``mirror_every``: every rank marks the same snapshots); None (the key
    absent): not mirrored. The URL travels with the mark so every node's agent copies the same
    step to the same root, whatever it was started with."""

    @property
    def persist_wanted(self) -> bool:
        return self.persist is not False

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size or not 0 <= self.shard < self.num_shards:
            raise ValueError(
                f"rank {self.rank} of {self.world_size}, shard {self.shard} of "
                f"{self.num_shards}: out of range"
            )

    @property
    def layout_sig(self) -> str:
        return self.layout.signature

    def to_json(self) -> dict[str, Any]:
        """The JSON object, keys in the trainer's order (byte-identical dumped the same way)."""
        return {
            "job": self.job,
            "rank": self.rank,
            "world_id": self.world_id,
            "world_size": self.world_size,
            "local_world_size": self.local_world_size,
            "shard": self.shard,
            "num_shards": self.num_shards,
            "replica": self.replica,
            "step": self.step,
            "private": self.private,
            **({} if self.persist is None else {"persist": self.persist}),
            **({} if self.mirror is None else {"mirror": self.mirror}),
            **self.extra,
            "layout_sig": self.layout.signature,
            "entries": self.layout.to_json(),
            "skeleton": self.skeleton,
        }

    def to_bytes(self) -> bytes:
        """The bytes a trainer writes into its slot."""
        return json.dumps(self.to_json(), separators=(",", ":"), allow_nan=True).encode()

    @staticmethod
    def from_json(doc: Any, source: str = "snapshot meta") -> SnapshotMeta:
        """Validates a parsed snapshot meta.

        Args:
            doc: the parsed JSON.
            source: where it was read (a slot file's path), named in errors.

        Raises:
            CorruptCheckpointError: a field missing, of the wrong type, out of range or
                inconsistent (the layout's signature), naming the field.
        """
        c = _Checker(source, "snapshot meta")
        if not isinstance(doc, dict):
            raise CorruptCheckpointError(source, "is not a snapshot meta JSON object")
        job = c.ident(doc, "job")
        world_size = c.int_in(doc, "world_size", 1, MAX_WORLD)
        rank = c.int_in(doc, "rank", 0, world_size - 1)
        world_id = c.text(doc, "world_id", MAX_WORLD_ID, default="")
        local_world = c.int_in(doc, "local_world_size", 1, MAX_LOCAL_RANKS, default=1)
        num_shards = c.int_in(doc, "num_shards", 1, world_size)
        shard = c.int_in(doc, "shard", 0, num_shards - 1)
        replica = c.int_in(doc, "replica", 0, world_size - 1)
        step = c.int_in(doc, "step", 0, MAX_STEP)
        private = doc.get("private")
        if not isinstance(private, dict):
            raise c.bad("private", f"is {type(private).__name__}, not a JSON object")
        persist = doc.get("persist")
        if persist is not None and not isinstance(persist, bool):
            raise c.bad("persist", f"is {type(persist).__name__}, not true or false")
        mirror = None if doc.get("mirror") is None else c.text(doc, "mirror", MAX_URL)
        if mirror == "":
            raise c.bad("mirror", "is empty, not a URL")
        entries = _entries(c, doc.get("entries"))
        layout = Layout(
            entries,
            max((e.offset + e.nbytes for e in entries), default=0),
            hashlib.sha1(
                json.dumps([e.to_json() for e in entries], separators=(",", ":")).encode()
            ).hexdigest(),
        )
        sig = doc.get("layout_sig")
        if sig != layout.signature:
            raise c.bad("layout_sig", f"{_short(sig)} is not the signature of its entries")
        if "skeleton" not in doc:
            raise c.bad("skeleton", "is missing")
        extra = {k: v for k, v in doc.items() if k not in META_KEYS + OPTIONAL_META_KEYS}
        return SnapshotMeta(
            job=job,
            rank=rank,
            world_id=world_id,
            world_size=world_size,
            local_world_size=local_world,
            shard=shard,
            num_shards=num_shards,
            replica=replica,
            step=step,
            private=private,
            layout=layout,
            skeleton=doc["skeleton"],
            extra=extra,
            persist=persist,
            mirror=mirror,
        )


@dataclass(frozen=True, slots=True)
class NodePart:
    """One node's record of a step (``<step>/_parts/<node>.json``): the ranks, shards and files
    its agent wrote. The committing node merges every node's part of a world into the manifest."""

    node: str
    """The node id of the agent that wrote it."""
    step: int
    """The step."""
    world_id: str
    """The world the step was saved in: parts of other worlds are never merged."""
    world_size: int
    """Ranks of that world."""
    num_shards: int
    """Shards of that world."""
    ranks: dict[int, RankEntry]
    """Global rank -> its rank file and shard (the ranks this node hosts)."""
    shards: dict[int, ShardEntry]
    """Shard -> its file and writer (the shards this node wrote)."""
    files: dict[str, FileEntry]
    """File name -> size and hash, for every file named in ``ranks`` and ``shards``."""

    def to_json(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "step": self.step,
            "world_id": self.world_id,
            "world_size": self.world_size,
            "num_shards": self.num_shards,
            "ranks": {str(r): {"file": e.file, "shard": e.shard} for r, e in self.ranks.items()},
            "shards": {
                str(s): {"file": e.file, "writer": e.writer} for s, e in self.shards.items()
            },
            "files": {n: f.to_json() for n, f in self.files.items()},
        }

    @staticmethod
    def from_json(doc: Any, source: str = "node part") -> NodePart:
        """Validates a parsed node part.

        Args:
            doc: the parsed JSON.
            source: the part file's path, named in errors.

        Raises:
            CorruptCheckpointError: a field missing, ill-typed or out of range, or a file name
                that is not the one the format gives that rank or shard (``../x``), naming the
                field.
        """
        c = _Checker(source, "node part")
        if not isinstance(doc, dict):
            raise CorruptCheckpointError(source, "is not a node part JSON object")
        node = c.ident(doc, "node")
        step = c.int_in(doc, "step", 0, MAX_STEP)
        world_id = c.text(doc, "world_id", MAX_WORLD_ID, default="")
        world = c.int_in(doc, "world_size", 1, MAX_WORLD)
        num_shards = c.int_in(doc, "num_shards", 1, world)
        for key in ("ranks", "shards", "files"):
            if not isinstance(doc.get(key), dict):
                raise c.bad(key, f"is {type(doc.get(key)).__name__}, not a JSON object")
        ranks: dict[int, RankEntry] = {}
        for k, v in doc["ranks"].items():
            r = _index(k, world)
            if r is None or not isinstance(v, dict):
                raise c.bad("ranks", f"entry {_short(k)} is not a rank of {world}")
            want = rank_file_name(r, world)
            if v.get("file") != want:
                raise c.bad(
                    "ranks",
                    f"names file {_short(v.get('file'))} for rank {r}; the format says {want!r}",
                )
            shard = _index(v.get("shard"), num_shards)
            if shard is None:
                raise c.bad("ranks", f"rank {r} has an invalid shard {_short(v.get('shard'))}")
            ranks[r] = RankEntry(want, shard)
        shards: dict[int, ShardEntry] = {}
        for k, v in doc["shards"].items():
            s = _index(k, num_shards)
            if s is None or not isinstance(v, dict):
                raise c.bad("shards", f"entry {_short(k)} is not a shard of {num_shards}")
            want = shard_file_name(s, num_shards)
            if v.get("file") != want:
                raise c.bad(
                    "shards",
                    f"names file {_short(v.get('file'))} for shard {s}; the format says {want!r}",
                )
            writer = v.get("writer")
            if writer is not None and _index(writer, world) is None:
                raise c.bad("shards", f"shard {s} has an invalid writer {_short(writer)}")
            shards[s] = ShardEntry(want, writer)
        known = {e.file for e in ranks.values()} | {e.file for e in shards.values()}
        files: dict[str, FileEntry] = {}
        for name, rec in doc["files"].items():
            if name not in known:
                raise c.bad(
                    "files",
                    f"lists {_short(name)}, not a rank or shard file of this part; the format "
                    f"says one of {sorted(known)[:4]}",
                )
            try:
                files[name] = FileEntry.from_json(rec)
            except ValueError as e:
                raise c.bad("files", f"file {name!r} has {e}") from None
        missing = sorted(known - set(files))
        if missing:
            raise c.bad("files", f"does not list (size, hash) of {missing[:4]}")
        return NodePart(node, step, world_id, world, num_shards, ranks, shards, files)
