"""Reading committed checkpoints outside training (and the storage half of a restore)."""

from __future__ import annotations

import json
import struct
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from flashckpt.format.layout import parse_safetensors_header, tensor_views, torch_dtype
from flashckpt.format.manifest import Manifest, check_skeleton
from flashckpt.format.storage import CorruptCheckpointError, Storage
from flashckpt.state.codec import piece_nodes, unflatten_state
from flashckpt.state.sharded import ShardedPiece, assemble, overlaps, replace_at, walk_pieces

__all__ = [
    "LoadedCheckpoint",
    "load",
    "load_full",
    "read_rank",
    "read_resharded",
    "read_shard",
]


@dataclass(slots=True)
class LoadedCheckpoint:
    """A committed step read back: the state of one shard, and each rank's private state."""

    step: int
    state: dict[str, Any]
    ranks: dict[int, dict[str, Any]]
    manifest: Manifest
    """The step's validated manifest (``manifest.to_json()``: the JSON of ``manifest.json``)."""


def read_shard(
    storage: Storage, step: int, shard: int, manifest: Manifest | None = None
) -> dict[str, Any]:
    """Reads and checks one shard of a committed step; returns its state tree.

    Raises:
        CorruptCheckpointError: a file is missing, truncated or fails its checksum.
        FileNotFoundError: the step is not committed.
    """
    if manifest is None:
        manifest = storage.manifest(step)
    info = manifest.shards.get(shard)
    if info is None:
        raise CorruptCheckpointError(
            storage.step_path(step),
            f"has no shard {shard} (the manifest lists shards {sorted(manifest.shards)})",
        )
    state, _ = _read_shard_file(storage, step, info.file, manifest)
    return state


def _shard_files(manifest: Manifest) -> list[str]:
    return [manifest.shards[k].file for k in sorted(manifest.shards)]


def _peek_header(storage: Storage, step: int, name: str) -> dict[str, Any]:
    """The safetensors header of a shard file, read (confined to the step directory, validated)
    without reading its tensors.

    Only used to choose files; the files chosen are then read whole and checked against the
    manifest before any byte of them is used.
    """
    path = storage.step_path(step, name)
    try:
        with storage.open_step_file(step, name) as (f, size):
            raw = f.read(8)
            if len(raw) < 8:
                raise CorruptCheckpointError(path, "is too short to be safetensors")
            (hlen,) = struct.unpack("<Q", raw)
            if hlen > 100 << 20 or hlen > size - 8:
                raise CorruptCheckpointError(path, f"has a header length of {hlen} bytes")
            header = json.loads(f.read(hlen))
        layout, meta = parse_safetensors_header(header)
        check_skeleton(json.loads(meta["skeleton"]), layout, path)
    except OSError as e:
        raise CorruptCheckpointError(path, f"cannot be read: {e}") from None
    except KeyError:
        raise CorruptCheckpointError(path, "has no skeleton in its safetensors metadata") from None
    except (UnicodeDecodeError, RecursionError, ValueError) as e:
        raise CorruptCheckpointError(path, f"has a malformed safetensors header ({e})") from None
    assert isinstance(header, dict)
    return header


def read_resharded(
    storage: Storage,
    step: int,
    wants: dict[str, tuple[tuple[int, ...], tuple[int, ...]]],
    manifest: Manifest | None = None,
) -> dict[str, torch.Tensor]:
    """Builds boxes of sharded (DTensor) tensors of a committed step from its saved pieces.

    Reads only the shard files that hold a piece overlapping a wanted box (every file read is
    checked whole against the manifest).

    Args:
        wants: tensor name (as in the skeleton) -> (global offset, shape) of the box to build.

    Returns:
        tensor name -> the box, a new tensor.

    Raises:
        CorruptCheckpointError: a needed file is missing or corrupt, or the pieces do not cover a
            box.
        KeyError: a wanted tensor is not a sharded tensor of the step.
    """
    if manifest is None:
        manifest = storage.manifest(step)
    files = _shard_files(manifest)
    dtypes: dict[str, torch.dtype] = {}
    needed: list[str] = []
    for name in files:
        header = _peek_header(storage, step, name)
        skeleton = json.loads(header["__metadata__"]["skeleton"])
        use = False
        for tname, meta in piece_nodes(skeleton):
            if tname in wants and tname not in dtypes:
                try:
                    dtypes[tname] = torch_dtype(header[tname]["dtype"])
                except ValueError as e:
                    raise CorruptCheckpointError(storage.step_path(step, name), str(e)) from None
            if tname in wants and overlaps(meta, *wants[tname]):
                use = True
        if use:
            needed.append(name)
    missing = sorted(set(wants) - set(dtypes))
    if missing:
        raise KeyError(f"step {step} has no sharded tensor(s) {missing[:5]}")
    pieces: dict[str, list[ShardedPiece]] = {n: [] for n in wants}
    for name in needed:
        state, skeleton = _read_shard_file(storage, step, name, manifest)
        del state
        for tname, piece in skeleton.items():
            if tname in pieces:
                pieces[tname].append(piece)
    out = {}
    for tname, (offset, shape) in wants.items():
        try:
            out[tname] = assemble(tname, pieces[tname], offset, shape, dtypes[tname])
        except ValueError as e:
            raise CorruptCheckpointError(storage.step_path(step), str(e)) from None
    return out


def _read_shard_file(
    storage: Storage, step: int, name: str, manifest: Manifest
) -> tuple[dict[str, Any], dict[str, ShardedPiece]]:
    """Reads one shard file: its state tree and its DTensor pieces by tensor name.

    Raises:
        CorruptCheckpointError: the file fails any check of :meth:`Storage.read_shard_file`.
    """
    buf, content = storage.read_shard_file(step, name, manifest)
    path = storage.step_path(step, name)
    data = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
    start = content.data_start
    try:
        views = tensor_views(content.layout, data[start : start + content.layout.nbytes])
        state = unflatten_state(content.skeleton, views)
        pieces = {n: ShardedPiece(views[n], m, n) for n, m in piece_nodes(content.skeleton)}
    except (ValueError, TypeError, RuntimeError) as e:  # validated before; a dtype torch lacks
        raise CorruptCheckpointError(path, str(e)) from None
    if not isinstance(state, dict):
        raise CorruptCheckpointError(path, "has no state dict")
    return state, pieces


def load_full(url: str, step: int | None = None) -> LoadedCheckpoint:
    """Reads a committed checkpoint with every sharded (DTensor) tensor gathered whole.

    Sharded tensors are assembled from the pieces of every shard file; everything else comes from
    shard 0 (in a sharded job it is the same on every rank). Reads every shard file: use it
    offline (export, inspection), not in training.

    Args:
        url: the checkpoint root (any fsspec URL).
        step: the step; None reads the newest committed step.

    Returns:
        The full state tree (plain tensors only) and every rank's private state.
    """
    storage = Storage(url)
    if step is None:
        steps = storage.committed_steps()
        if not steps:
            raise FileNotFoundError(f"no committed checkpoint in {url}")
        step = steps[-1]
    manifest = storage.manifest(step)
    files = _shard_files(manifest)
    if not files:
        raise CorruptCheckpointError(storage.step_path(step), "lists no shard files")
    state: dict[str, Any] = {}
    pieces: dict[str, list[ShardedPiece]] = {}
    for i, name in enumerate(files):
        st, ps = _read_shard_file(storage, step, name, manifest)
        if i == 0:
            state = st
        for tname, piece in ps.items():
            pieces.setdefault(tname, []).append(piece)
    for path, piece in list(walk_pieces(state)):
        tname = piece.name
        shape = tuple(piece.meta["shape"])
        try:
            full = assemble(tname, pieces[tname], (0,) * len(shape), shape, piece.tensor.dtype)
        except ValueError as e:
            raise CorruptCheckpointError(storage.step_path(step), str(e)) from None
        state = replace_at(state, path, full)
    ranks = {}
    for r in manifest.ranks:
        private = read_rank(storage, step, r, manifest)
        if private is not None:
            ranks[r] = private
    return LoadedCheckpoint(step, state, ranks, manifest)


def read_rank(storage: Storage, step: int, rank: int, manifest: Manifest) -> dict[str, Any] | None:
    """A rank's private state (RNG, extras) of a committed step, or None if it has none.

    Raises:
        CorruptCheckpointError: the rank file is missing, corrupt, or another rank's.
    """
    if rank not in manifest.ranks:
        return None
    return storage.read_rank_file(step, rank, manifest)


def load(url: str, step: int | None = None, *, shard: int = 0) -> LoadedCheckpoint:
    """Reads a committed checkpoint (no pickle anywhere).

    Args:
        url: the checkpoint root (any fsspec URL).
        step: the step to read; None reads the newest committed step that is intact, warning
            about (and skipping) newer ones that are corrupt.
        shard: which shard's tensors to read (0 for data-parallel jobs).

    Returns:
        The state tree (``model``, ``optimizer``, ...) and every rank's private state. In a
        sharded (DTensor) checkpoint each sharded tensor is that shard's
        :class:`~flashckpt.state.sharded.ShardedPiece`; :func:`load_full` gathers them whole.
    """
    storage = Storage(url)
    steps = [step] if step is not None else sorted(storage.committed_steps(), reverse=True)
    if not steps:
        raise FileNotFoundError(f"no committed checkpoint in {url}")
    last_err: Exception | None = None
    for s in steps:
        try:
            manifest = storage.manifest(s)
            state = read_shard(storage, s, shard, manifest)
            ranks = {}
            for r in manifest.ranks:
                private = read_rank(storage, s, r, manifest)
                if private is not None:
                    ranks[r] = private
            return LoadedCheckpoint(s, state, ranks, manifest)
        except FileNotFoundError:
            if step is not None:
                raise
            continue  # deleted by retention since it was listed
        except CorruptCheckpointError as e:
            if step is not None:
                raise
            warnings.warn(f"flashckpt: skipping step {s}: {e}", stacklevel=2)
            last_err = e
    raise FileNotFoundError(f"no intact committed checkpoint in {url} (last error: {last_err})")
