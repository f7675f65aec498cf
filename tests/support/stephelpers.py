"""Committed steps written straight through :class:`flashckpt.format.storage.Storage` (no trainer,
no agent): a real safetensors shard and real rank files, as the agent writes them; and the waits
for a step committed or gone."""

from __future__ import annotations

import json
from typing import Any

import xxhash
from waiting import wait_until

from flashckpt.format.layout import Layout, safetensors_header
from flashckpt.format.storage import Storage, rank_file_name, shard_file_name

SHARD = shard_file_name(0, 1)
RANK = rank_file_name(0, 1)


def shard_bytes(payload: bytes, step: int = 0) -> bytes:
    """A one-tensor shard file: ``model/w``, a uint8 vector holding ``payload``."""
    layout = Layout.from_json([["model/w", "U8", [len(payload)], 0, len(payload)]])
    skeleton = {"D": [["model", {"D": [["w", {"T": "model/w"}]]}]]}
    head = safetensors_header(
        layout,
        {"format": "flashckpt/1", "step": str(step), "skeleton": json.dumps(skeleton)},
    )
    return head + payload


def write_step(
    st: Storage, step: int, payload: bytes = b"x" * 1000, extras: Any = None
) -> dict[str, Any]:
    """Writes the files of a one-rank step and returns its manifest (not committed yet)."""
    rec = st.write_stream(st.step_path(step, SHARD), [shard_bytes(payload, step)])
    private = {"extras": extras if extras is not None else {"pos": step}}
    rrec = st.write_private(step, 0, 1, private)
    return {
        "format": "flashckpt/1",
        "job": "test",
        "step": step,
        "world_size": 1,
        "num_shards": 1,
        "created": 0.0,
        "nodes": ["n0"],
        "files": {SHARD: rec.to_json(), RANK: rrec.to_json()},
        "ranks": {"0": {"file": RANK, "shard": 0}},
        "shards": {"0": {"file": SHARD, "writer": 0}},
    }


def file_record(data: bytes) -> dict[str, Any]:
    return {"size": len(data), "xxh3_64": xxhash.xxh3_64_hexdigest(data)}


def wait_committed(st: Storage, step: int, timeout: float = 120.0) -> list[int]:
    """Waits until ``step`` is committed in ``st``; the committed steps then."""

    def committed() -> list[int] | None:
        got = st.committed_steps()
        return got if step in got else None

    return wait_until(
        committed,
        f"step {step} committed in {st.url}",
        timeout,
        0.05,
        state=st.committed_steps,
    )


def wait_gone(st: Storage, step: int, timeout: float = 60.0) -> None:
    """Waits until ``step``'s directory is gone from ``st`` (retention runs after a commit)."""
    wait_until(
        lambda: step not in st.all_step_dirs(),
        f"step {step}'s directory gone from {st.url}",
        timeout,
        0.05,
        state=st.all_step_dirs,
    )


def snapmeta_parts() -> tuple[dict[str, Any], dict[str, Any]]:
    """A minimal one-rank snapshot meta (``SnapshotMeta``'s JSON, step 3, no tensors) in its key
    order: the fields before the optional marks (``persist``, ``mirror``) and those after."""
    import hashlib

    from flashckpt.format.layout import Layout

    base = {
        "job": "j",
        "rank": 0,
        "world_id": "",
        "world_size": 1,
        "local_world_size": 1,
        "shard": 0,
        "num_shards": 1,
        "replica": 0,
        "step": 3,
        "private": {},
    }
    sig = Layout([], 0, hashlib.sha1(b"[]").hexdigest()).signature
    return base, {"layout_sig": sig, "entries": [], "skeleton": {}}
