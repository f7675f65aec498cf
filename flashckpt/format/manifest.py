"""The manifest of a committed step and the checks of what a step's files say about themselves.

Nothing read from storage is trusted: a manifest, a shard's safetensors header and a rank file are
validated here, in one place, before anything they name is opened, allocated or used. ``verify``,
:func:`flashckpt.load` and the trainer's restore all go through these checks (via
:class:`flashckpt.format.storage.Storage`), so a step ``verify`` passes is a step restore accepts.

Every problem is a :class:`~flashckpt.errors.CorruptCheckpointError` naming the file at fault.
Torch-free: the node agent and the CLI import it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import xxhash

from flashckpt.errors import CorruptCheckpointError
from flashckpt.format.layout import Layout, parse_safetensors

__all__ = [
    "FORMAT",
    "FileEntry",
    "Manifest",
    "RankEntry",
    "ShardContent",
    "ShardEntry",
    "check_shard",
    "parse_rank_doc",
    "rank_file_name",
    "shard_file_name",
]

FORMAT = "flashckpt/1"
MAX_WORLD = 1 << 20
"""More ranks than any job has: a larger ``world_size`` in a manifest is corrupt."""
MAX_FILE_SIZE = (1 << 63) - 1


def shard_file_name(shard: int, num_shards: int) -> str:
    return f"shard-{shard:05d}-of-{num_shards:05d}.safetensors"


def rank_file_name(rank: int, world_size: int) -> str:
    return f"rank-{rank:05d}-of-{world_size:05d}.json"


@dataclass(frozen=True, slots=True)
class FileEntry:
    """What the manifest says of one file of the step: its size and either one hash of the whole
    file (rank files, and shard files of earlier versions) or two: of the bytes before
    ``data_offset`` (a shard's safetensors header) and of the tensor data after it.

    The split form lets the node agent write a shard straight from shared memory while hashing
    its data once: that hash is compared with the one recorded when the snapshot completed
    (the bytes written are the ones hashed then), and it is the one the manifest keeps.
    """

    size: int
    """Bytes; the file system must agree before a byte is read."""
    xxh3_64: str | None = None
    """xxh3-64 of the whole file, 16 lowercase hex digits (None in the split form)."""
    data_offset: int | None = None
    """Split form: bytes of the file before the data (``0 <= data_offset <= size``)."""
    head_xxh3_64: str | None = None
    """Split form: xxh3-64 of the bytes before ``data_offset``."""
    data_xxh3_64: str | None = None
    """Split form: xxh3-64 of the bytes from ``data_offset`` to the end (a shard's tensor data:
    the data hash its snapshot had in shared memory)."""

    def __post_init__(self) -> None:
        if _int(self.size) is None or not 0 <= self.size <= MAX_FILE_SIZE:
            raise ValueError(f"an invalid size {self.size!r}")
        if self.data_offset is None:
            if not _is_hex16(self.xxh3_64):
                raise ValueError(f"an invalid xxh3_64 {_short(self.xxh3_64)}")
            if self.head_xxh3_64 is not None or self.data_xxh3_64 is not None:
                raise ValueError("head_xxh3_64/data_xxh3_64 without a data_offset")
            return
        if self.xxh3_64 is not None:
            raise ValueError("both a whole-file xxh3_64 and a data_offset")
        if _int(self.data_offset) is None or not 0 <= self.data_offset <= self.size:
            raise ValueError(f"an invalid data_offset {_short(self.data_offset)}")
        if not _is_hex16(self.head_xxh3_64):
            raise ValueError(f"an invalid head_xxh3_64 {_short(self.head_xxh3_64)}")
        if not _is_hex16(self.data_xxh3_64):
            raise ValueError(f"an invalid data_xxh3_64 {_short(self.data_xxh3_64)}")

    @property
    def split(self) -> bool:
        """Whether the head and the data are hashed apart."""
        return self.data_offset is not None

    def to_json(self) -> dict[str, Any]:
        if self.data_offset is None:
            return {"size": self.size, "xxh3_64": self.xxh3_64}
        return {
            "size": self.size,
            "data_offset": self.data_offset,
            "head_xxh3_64": self.head_xxh3_64,
            "data_xxh3_64": self.data_xxh3_64,
        }

    @staticmethod
    def from_json(rec: Any) -> FileEntry:
        """A file record of a manifest or node part, either form.

        Raises:
            ValueError: malformed; the message says what (``"an invalid size 3.5"``), for the
                caller to name the file.
        """
        if not isinstance(rec, dict):
            raise ValueError("an invalid record")
        size: Any = rec.get("size")
        return FileEntry(
            size,
            rec.get("xxh3_64"),
            data_offset=rec.get("data_offset"),
            head_xxh3_64=rec.get("head_xxh3_64"),
            data_xxh3_64=rec.get("data_xxh3_64"),
        )


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


@dataclass(frozen=True, slots=True)
class RankEntry:
    """A rank's private state (RNG, extras) in the step."""

    file: str
    """``rank-RRRRR-of-WWWWW.json`` of this rank and world size."""
    shard: int
    """The shard holding this rank's tensors."""


@dataclass(frozen=True, slots=True)
class ShardEntry:
    """One shard's tensors in the step."""

    file: str
    """``shard-SSSSS-of-NNNNN.safetensors`` of this shard and shard count."""
    writer: int | None
    """The rank whose snapshot was written (None in manifests that do not say)."""


@dataclass(frozen=True, slots=True)
class Manifest:
    """A validated ``manifest.json``: every name in it is one the format defines for this step's
    world, every file the step's ranks and shards need is listed, every number is in range."""

    step: int
    """The step; equal to the number in the step directory's name."""
    world_size: int
    """Ranks of the world that saved the step."""
    num_shards: int
    """Distinct shards (1 for a replicated state)."""
    created: float
    """Unix time of the commit."""
    files: dict[str, FileEntry]
    """File name (in the step directory) -> size and hash."""
    ranks: dict[int, RankEntry]
    """Every rank ``0 .. world_size-1``."""
    shards: dict[int, ShardEntry]
    """Every shard ``0 .. num_shards-1``."""
    job: str | None = None
    """The job id that committed it, if recorded."""
    nodes: tuple[str, ...] = ()
    """The nodes whose agents wrote its files."""
    world_id: str | None = None
    """The world (rendezvous round) that committed it, if recorded; the commit check reads it
    (a manifest of another world), restores do not."""

    def to_json(self) -> dict[str, Any]:
        """The JSON object, keys in the order the node agent writes them: dumped as it dumps a
        manifest, the bytes of the file read (``job`` and ``world_id`` only where recorded)."""
        doc: dict[str, Any] = {"format": FORMAT}
        if self.job is not None:
            doc["job"] = self.job
        doc.update(
            step=self.step,
            world_size=self.world_size,
            num_shards=self.num_shards,
            created=self.created,
            nodes=list(self.nodes),
            files={n: f.to_json() for n, f in self.files.items()},
            ranks={str(r): {"file": e.file, "shard": e.shard} for r, e in self.ranks.items()},
            shards={str(i): {"file": e.file, "writer": e.writer} for i, e in self.shards.items()},
        )
        if self.world_id is not None:
            doc["world_id"] = self.world_id
        return doc

    @staticmethod
    def from_json(doc: Any, path: str, step: int) -> Manifest:
        """Validates a parsed ``manifest.json`` of the step directory of ``step``.

        Raises:
            CorruptCheckpointError: anything malformed, out of range, or naming a file the
                format does not define (``../x``, another world's file), naming ``path``.
        """

        def bad(problem: str) -> CorruptCheckpointError:
            return CorruptCheckpointError(path, problem)

        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise bad(f"is not a {FORMAT} manifest")
        got_step = _int(doc.get("step"))
        if got_step != step:
            raise bad(
                f"is the manifest of step {doc.get('step')!r}, but its directory is that of step "
                f"{step} (a step directory copied or renamed): not used"
            )
        world = _int(doc.get("world_size"))
        if world is None or not 1 <= world <= MAX_WORLD:
            raise bad(f"has an invalid world_size {doc.get('world_size')!r}")
        num_shards = _int(doc.get("num_shards"))
        if num_shards is None or not 1 <= num_shards <= world:
            raise bad(
                f"has an invalid num_shards {doc.get('num_shards')!r} (1 to world_size {world})"
            )
        created = doc.get("created", 0.0)
        if isinstance(created, bool) or not isinstance(created, int | float):
            raise bad(f"has an invalid created time {created!r}")
        job = doc.get("job")
        if job is not None and not isinstance(job, str):
            raise bad(f"has an invalid job {job!r}")
        nodes = doc.get("nodes", [])
        if not isinstance(nodes, list) or not all(isinstance(n, str) for n in nodes):
            raise bad(f"has an invalid nodes list {nodes!r}"[:200])
        for key in ("files", "ranks", "shards"):
            if not isinstance(doc.get(key), dict):
                raise bad(f"has no {key!r} table (found {type(doc.get(key)).__name__})")
        shards: dict[int, ShardEntry] = {}
        for k, v in doc["shards"].items():
            i = _index(k, num_shards)
            if i is None or not isinstance(v, dict):
                raise bad(f"has an invalid shards entry {k!r}")
            want = shard_file_name(i, num_shards)
            if v.get("file") != want:
                raise bad(f"names file {v.get('file')!r} for shard {i}; the format says {want!r}")
            writer = v.get("writer")
            if writer is not None and _index(writer, world) is None:
                raise bad(f"has an invalid writer {writer!r} for shard {i}")
            shards[i] = ShardEntry(want, writer)
        if len(shards) != num_shards:
            missing = sorted(set(range(num_shards)) - set(shards))
            raise bad(f"lacks shard(s) {missing[:5]} of {num_shards}")
        ranks: dict[int, RankEntry] = {}
        for k, v in doc["ranks"].items():
            r = _index(k, world)
            if r is None or not isinstance(v, dict):
                raise bad(f"has an invalid ranks entry {k!r}")
            want = rank_file_name(r, world)
            if v.get("file") != want:
                raise bad(f"names file {v.get('file')!r} for rank {r}; the format says {want!r}")
            shard = _index(v.get("shard", 0), num_shards)
            if shard is None:
                raise bad(f"has an invalid shard {v.get('shard')!r} for rank {r}")
            ranks[r] = RankEntry(want, shard)
        if len(ranks) != world:
            missing = sorted(set(range(world)) - set(ranks))
            raise bad(f"lacks rank(s) {missing[:5]} of world size {world}")
        known = {e.file for e in shards.values()} | {e.file for e in ranks.values()}
        files: dict[str, FileEntry] = {}
        for name, rec in doc["files"].items():
            if name not in known:
                raise bad(
                    f"lists a file {name!r} that is not a shard or rank file of this step "
                    f"(world size {world}, {num_shards} shard(s))"
                )
            try:
                files[name] = FileEntry.from_json(rec)
            except ValueError as e:
                raise bad(f"has {e} for file {name!r}") from None
        unlisted = sorted(known - set(files))
        if unlisted:
            # The step's shards and ranks need these: a step restore rejects must fail verify too.
            raise bad(f"does not list (size, hash) of file(s) {unlisted[:5]} the step needs")
        world_id = doc.get("world_id")
        return Manifest(
            step,
            world,
            num_shards,
            float(created),
            files,
            ranks,
            shards,
            job,
            tuple(nodes),
            # Restores never read it: an ill-typed one is not kept (as the commit check reads it)
            world_id if isinstance(world_id, str) else None,
        )


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _index(v: Any, n: int) -> int | None:
    """``v`` (an int, or the decimal string of one, as JSON keys are) if it is in ``[0, n)``."""
    if isinstance(v, str) and v.isdecimal() and v.isascii() and len(v) < 10:
        v = int(v)
    v = _int(v)
    return v if v is not None and 0 <= v < n else None


def _is_hex16(v: Any) -> bool:
    return isinstance(v, str) and len(v) == 16 and all(c in "0123456789abcdef" for c in v)


def parse_rank_doc(
    raw: bytes | bytearray, path: str, step: int, rank: int, world: int, *, listed: bool = True
) -> Any:
    """The private state (RNG, extras) of a rank file, checked against who it claims to be.

    Args:
        listed: the file's bytes were checked against a manifest's hash: its own ``world_size``
            and embedded hash may then be absent (files of versions before they were written);
            a file read without a manifest (write-through) needs both.

    Raises:
        CorruptCheckpointError: not JSON, another rank's, step's or world's file, or its embedded
            hash does not match.
    """
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CorruptCheckpointError(path, f"is not valid JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("format", FORMAT) != FORMAT:
        raise CorruptCheckpointError(path, f"is not a {FORMAT} rank file")
    doc_world = doc.get("world_size", world if listed else None)
    who = (doc.get("rank"), doc.get("step"), doc_world)
    if who != (rank, step, world) or any(_int(x) is None for x in who):
        raise CorruptCheckpointError(
            path,
            f"is the file of rank {who[0]!r}, step {who[1]!r}, world size {who[2]!r}, not of "
            f"rank {rank}, step {step}, world size {world}",
        )
    private = doc.get("private")
    if not isinstance(private, dict):
        raise CorruptCheckpointError(path, "holds no private state")
    if listed and "xxh3_64" not in doc:
        return private
    try:
        body = json.dumps(private, sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError) as e:
        raise CorruptCheckpointError(path, f"holds malformed private state ({e})") from None
    if doc.get("xxh3_64") != xxhash.xxh3_64_hexdigest(body.encode()):
        raise CorruptCheckpointError(path, "fails its embedded checksum (corrupted)")
    return private


@dataclass(frozen=True, slots=True)
class ShardContent:
    """A shard file's safetensors header and skeleton, validated."""

    layout: Layout
    """Where each tensor lies, offsets relative to ``data_start``."""
    metadata: dict[str, str]
    """The header's ``__metadata__``."""
    skeleton: Any
    """The JSON tree of the state; every tensor name in it is one of ``layout``'s."""
    data_start: int
    """File offset of the tensor bytes."""


def check_shard(buf: bytes | bytearray | memoryview, path: str) -> ShardContent:
    """Validates a shard file held in memory: header, tensor byte ranges and skeleton.

    Raises:
        CorruptCheckpointError: malformed safetensors (negative shapes, ranges outside the file,
            unknown dtypes), or a skeleton that is not the tree the writer makes.
    """
    try:
        layout, meta, start = parse_safetensors(buf)
        skeleton = json.loads(meta["skeleton"])
    except KeyError:
        raise CorruptCheckpointError(path, "has no skeleton in its safetensors metadata") from None
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(path, f"is not a valid shard ({e})") from None
    check_skeleton(skeleton, layout, path)
    return ShardContent(layout, meta, skeleton, start)


def check_skeleton(skeleton: Any, layout: Layout, path: str) -> None:
    """Checks that a skeleton is the tree :func:`flashckpt.state.codec.flatten_state` makes, naming
    only tensors of ``layout`` (DTensor pieces with a well-formed description)."""
    shapes = {e.name: e.shape for e in layout.entries}

    def bad(problem: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(path, f"has a malformed skeleton: {problem}")

    def walk(node: Any, depth: int) -> None:
        if depth > 200:
            raise bad("nested too deeply")
        if node is None or isinstance(node, bool | int | str):
            return
        if isinstance(node, float):
            return
        if not isinstance(node, dict) or not node:
            raise bad(f"a node of type {type(node).__name__}")
        tags = set(node)
        if tags in ({"T"}, {"N"}):
            (name,) = node.values()
            if name not in shapes:
                raise bad(f"tensor {name!r} is not in the file")
            return
        if tags == {"S", "dt"}:
            if node["S"] not in shapes:
                raise bad(f"tensor {node['S']!r} is not in the file")
            _check_piece(node["dt"], shapes[node["S"]], bad)
            return
        if tags == {"D"} and isinstance(node["D"], list):
            for item in node["D"]:
                if not (isinstance(item, list) and len(item) == 2):
                    raise bad("a dict item that is not a [key, value] pair")
                key, value = item
                if not (key is None or isinstance(key, bool | int | float | str)):
                    raise bad(f"a dict key of type {type(key).__name__}")
                walk(value, depth + 1)
            return
        if tags in ({"L"}, {"U"}):
            (items,) = node.values()
            if not isinstance(items, list):
                raise bad("a list that is not a list")
            for v in items:
                walk(v, depth + 1)
            return
        raise bad(f"a node with tags {sorted(map(str, tags))[:5]}")

    if not isinstance(skeleton, dict) or set(skeleton) != {"D"}:
        raise bad("the root is not a dict")
    walk(skeleton, 0)


def _check_piece(meta: Any, local_shape: tuple[int, ...], bad: Any) -> None:
    """A DTensor piece's description: global shape, its box in it, mesh and placements."""
    if not isinstance(meta, dict):
        raise bad("a DTensor piece without its description")
    dims = []
    for key in ("shape", "offset", "local", "mesh", "coord"):
        v = meta.get(key)
        if not isinstance(v, list) or any(_int(x) is None or x < 0 for x in v):
            raise bad(f"a DTensor piece with an invalid {key!r}: {v!r}")
        dims.append(v)
    shape, offset, local, mesh, coord = dims
    if not len(shape) == len(offset) == len(local) or tuple(local) != local_shape:
        raise bad(f"a DTensor piece whose box {offset}+{local} does not fit shape {shape}")
    if any(o + n > s for o, n, s in zip(offset, local, shape, strict=True)):
        raise bad(f"a DTensor piece whose box {offset}+{local} exceeds shape {shape}")
    if len(coord) not in (0, len(mesh)) or any(c >= m for c, m in zip(coord, mesh, strict=False)):
        raise bad(f"a DTensor piece with coordinate {coord} outside mesh {mesh}")
    placements = meta.get("placements")
    if math.prod(mesh) > MAX_WORLD or not isinstance(placements, list):
        raise bad("a DTensor piece with an invalid mesh or placements")
    if len(placements) != len(mesh) or not all(_placement_ok(p, len(shape)) for p in placements):
        raise bad(f"a DTensor piece with placements {placements!r} for mesh {mesh}"[:300])


def _placement_ok(p: Any, ndim: int) -> bool:
    """A placement as :func:`flashckpt.state.sharded.describe` writes it."""
    if p == "replicate":
        return True
    if not isinstance(p, dict) or set(p) - {"shard", "split_factor"}:
        return False
    dim = _int(p.get("shard"))
    split = _int(p.get("split_factor", 1))
    return dim is not None and 0 <= dim < ndim and split is not None and split >= 1
