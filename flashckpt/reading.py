"""Reading committed checkpoints outside training (and the storage half of a restore)."""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from flashckpt.layout import parse_safetensors, tensor_views, unflatten_state
from flashckpt.storage import CorruptCheckpointError, Storage

__all__ = ["LoadedCheckpoint", "load", "read_rank", "read_shard"]


@dataclass(slots=True)
class LoadedCheckpoint:
    """A committed step read back: the state of one shard, and each rank's private state."""

    step: int
    state: dict[str, Any]
    ranks: dict[int, dict[str, Any]]
    manifest: dict[str, Any]


def read_shard(
    storage: Storage, step: int, shard: int, manifest: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Reads and checks one shard of a committed step; returns its state tree.

    Raises:
        CorruptCheckpointError: a file is missing, truncated or fails its checksum.
        FileNotFoundError: the step is not committed.
    """
    manifest = manifest or storage.read_manifest(step)
    info = manifest["shards"].get(str(shard))
    if info is None:
        raise CorruptCheckpointError(
            storage.step_path(step),
            f"has no shard {shard} (the manifest lists shards {sorted(manifest['shards'])})",
        )
    buf = storage.read_file(step, info["file"], manifest)
    try:
        layout, meta, start = parse_safetensors(buf)
        skeleton = json.loads(meta["skeleton"])
    except (ValueError, KeyError) as e:
        raise CorruptCheckpointError(storage.step_path(step, info["file"]), str(e)) from None
    data = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
    state = unflatten_state(skeleton, tensor_views(layout, data[start : start + layout.nbytes]))
    if not isinstance(state, dict):
        raise CorruptCheckpointError(storage.step_path(step, info["file"]), "has no state dict")
    return state


def read_rank(
    storage: Storage, step: int, rank: int, manifest: dict[str, Any]
) -> dict[str, Any] | None:
    """A rank's private state (RNG, extras) of a committed step, or None if it has none."""
    info = manifest["ranks"].get(str(rank))
    if info is None:
        return None
    raw = storage.read_file(step, info["file"], manifest)
    try:
        private = json.loads(raw)["private"]
    except (ValueError, KeyError) as e:
        raise CorruptCheckpointError(storage.step_path(step, info["file"]), str(e)) from None
    return private if isinstance(private, dict) else None


def load(url: str, step: int | None = None, *, shard: int = 0) -> LoadedCheckpoint:
    """Reads a committed checkpoint (no pickle anywhere).

    Args:
        url: the checkpoint root (any fsspec URL).
        step: the step to read; None reads the newest committed step that is intact, warning
            about (and skipping) newer ones that are corrupt.
        shard: which shard's tensors to read (0 for data-parallel jobs).

    Returns:
        The state tree (``model``, ``optimizer``, ...) and every rank's private state.
    """
    storage = Storage(url)
    steps = [step] if step is not None else sorted(storage.committed_steps(), reverse=True)
    if not steps:
        raise FileNotFoundError(f"no committed checkpoint in {url}")
    last_err: Exception | None = None
    for s in steps:
        try:
            manifest = storage.read_manifest(s)
            state = read_shard(storage, s, shard, manifest)
            ranks = {}
            for r in manifest["ranks"]:
                private = read_rank(storage, s, int(r), manifest)
                if private is not None:
                    ranks[int(r)] = private
            return LoadedCheckpoint(s, state, ranks, manifest)
        except CorruptCheckpointError as e:
            if step is not None:
                raise
            warnings.warn(f"flashckpt: skipping step {s}: {e}", stacklevel=2)
            last_err = e
    raise FileNotFoundError(f"no intact committed checkpoint in {url} (last error: {last_err})")
