"""The typed snapshot meta and node part: byte-compatible with what a real trainer and agent
write, and every field read back validated in one place (bad input names the field)."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
from fchelpers import FcEnv
from tinytrain import make, train_step

import flashckpt
from flashckpt import names
from flashckpt.errors import CorruptCheckpointError
from flashckpt.format.shm import Slot
from flashckpt.format.snapmeta import META_KEYS, PART_KEYS, NodePart, SnapshotMeta


def _slot_metas(fc_env: FcEnv) -> list[bytes]:
    out = []
    for name in fc_env.segments():
        if not names.SLOT_NAME_RE.match(name):
            continue
        slot = Slot(os.path.join(fc_env.shm_dir, name))
        try:
            info = slot.header()
            if info is not None and info.complete:
                out.append(bytes(slot.buf[slot.meta_off : slot.meta_off + info.meta_len]))
        finally:
            slot.close()
    return out


def test_real_trainer_meta_and_agent_part_round_trip_byte_for_byte(fc_env: FcEnv) -> None:
    model, opt, sched = make(0)
    with flashckpt.checkpointing(model, opt, scheduler=sched, **fc_env.ckpt_kwargs()) as ck:
        ck.extras["epoch"] = 3
        for step in range(2):
            train_step(model, opt, sched, step)
            ck.step()
            ck.save(mode="sync")
        assert ck.flush() == 2
        raws = _slot_metas(fc_env)
    assert len(raws) == 2, "both slots hold a complete snapshot"
    for raw in raws:
        doc = json.loads(raw)
        assert tuple(doc) == META_KEYS  # the trainer writes exactly the known keys, in order
        meta = SnapshotMeta.from_json(doc, "slot")
        assert meta.to_bytes() == raw
        assert meta.private["extras"] == {"epoch": 3} and meta.rank == 0 and meta.job == fc_env.job
    part_path = fc_env.storage_path / "step-000000002" / "_parts" / f"{fc_env.node}.json"
    text = part_path.read_bytes()
    doc = json.loads(text)
    assert tuple(doc) == PART_KEYS
    part = NodePart.from_json(doc, str(part_path))
    assert json.dumps(part.to_json(), indent=1).encode() == text
    assert part.step == 2 and set(part.ranks) == {0} and set(part.shards) == {0}


def _meta_doc() -> dict[str, Any]:
    entries = [["model/w", "F32", [2, 3], 0, 24], ["step", "I64", [], 24, 8]]
    return {
        "job": "j1",
        "rank": 1,
        "world_id": "host:29500/2",
        "world_size": 2,
        "local_world_size": 2,
        "shard": 1,
        "num_shards": 2,
        "replica": 0,
        "step": 7,
        "private": {"rng": {}, "extras": {}},
        "layout_sig": _sig(entries),
        "entries": entries,
        "skeleton": {"model": {"w": {"__t__": "model/w"}}},
    }


def _sig(entries: list[Any]) -> str:
    import hashlib

    return hashlib.sha1(json.dumps(entries, separators=(",", ":")).encode()).hexdigest()


def test_meta_round_trip_and_unknown_keys_kept() -> None:
    doc = _meta_doc()
    assert SnapshotMeta.from_json(doc).to_json() == doc
    doc["future"] = {"x": 1}
    meta = SnapshotMeta.from_json(doc)
    assert meta.extra == {"future": {"x": 1}} and meta.to_json() == doc


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("job", "../evil"),
        ("job", 5),
        ("rank", 2),  # outside the world of 2
        ("rank", True),
        ("rank", "1"),
        ("world_size", 0),
        ("world_id", "x" * 5000),
        ("world_id", "a\nb"),
        ("local_world_size", 10**6),
        ("shard", 2),
        ("num_shards", 3),
        ("replica", -1),
        ("step", -1),
        ("private", [1]),
        ("layout_sig", "0" * 40),
        ("entries", [["w", "F32", [2, -3], 0, 24]]),
        ("entries", [["w", "F32", [2, 3], -1, 24]]),
        ("entries", [["w", "F32"]]),
        ("entries", {"w": 1}),
        ("skeleton", None),  # deleted below
    ],
)
def test_bad_meta_names_the_field(field: str, value: Any) -> None:
    doc = _meta_doc()
    if field == "skeleton":
        del doc["skeleton"]
    else:
        doc[field] = value
    with pytest.raises(CorruptCheckpointError, match=repr(field)) as ei:
        SnapshotMeta.from_json(doc, "/dev/shm/fc.j.n.r00000.s0")
    assert "/dev/shm/fc.j.n.r00000.s0" in str(ei.value)


def test_missing_meta_field_names_it() -> None:
    for key in ("job", "rank", "world_size", "num_shards", "shard", "replica", "step", "private"):
        doc = _meta_doc()
        del doc[key]
        with pytest.raises(CorruptCheckpointError, match=repr(key)):
            SnapshotMeta.from_json(doc)
    with pytest.raises(CorruptCheckpointError, match="not a snapshot meta"):
        SnapshotMeta.from_json([1, 2])


def _part_doc() -> dict[str, Any]:
    rec = {"size": 10, "xxh3_64": "0123456789abcdef"}
    return {
        "node": "n1",
        "step": 5,
        "world_id": "w",
        "world_size": 2,
        "num_shards": 1,
        "ranks": {"1": {"file": "rank-00001-of-00002.json", "shard": 0}},
        "shards": {"0": {"file": "shard-00000-of-00001.safetensors", "writer": 1}},
        "files": {"rank-00001-of-00002.json": rec, "shard-00000-of-00001.safetensors": rec},
    }


def test_part_round_trip() -> None:
    doc = _part_doc()
    assert NodePart.from_json(doc).to_json() == doc


def _set(path: str, value: Any) -> dict[str, Any]:
    doc = _part_doc()
    *keys, last = path.split("/")
    d: Any = doc
    for k in keys:
        d = d[k]
    if value is KeyError:
        del d[last]
    else:
        d[last] = value
    return doc


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        ("node", "../x", "node"),
        ("step", "5", "step"),
        ("world_size", 0, "world_size"),
        ("num_shards", 3, "num_shards"),
        ("ranks", [], "ranks"),
        ("ranks/1/file", "../../evil.json", "ranks"),
        ("ranks/1/shard", 4, "ranks"),
        ("shards/0/file", "/etc/passwd", "shards"),
        ("shards/0/writer", 9, "shards"),
        ("files/rank-00001-of-00002.json", {"size": -1, "xxh3_64": "0" * 16}, "files"),
        ("files/rank-00001-of-00002.json", {"size": 1, "xxh3_64": "XYZ"}, "files"),
        ("files/shard-00000-of-00001.safetensors", KeyError, "files"),
    ],
)
def test_bad_part_names_the_field(path: str, value: Any, field: str) -> None:
    with pytest.raises(CorruptCheckpointError, match=repr(field)) as ei:
        NodePart.from_json(_set(path, value), "step-5/_parts/n1.json")
    assert "step-5/_parts/n1.json" in str(ei.value)


def test_part_listing_a_file_outside_the_step_is_refused() -> None:
    doc = _part_doc()
    doc["files"]["../escape.json"] = {"size": 1, "xxh3_64": "0" * 16}
    with pytest.raises(CorruptCheckpointError, match=r"'files'.*escape"):
        NodePart.from_json(doc)
