"""The read path passes the typed :class:`~flashckpt.format.manifest.Manifest` (``Storage``,
``load``'s ``LoadedCheckpoint``, the restore), while ``manifest.json`` stays byte for byte what
the node agent writes: a manifest written before the typed read path loads, and written back from
its ``Manifest`` it is the same bytes."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

from fchelpers import FcEnv, RunningAgent
from tinytrain import make, train_steps

import flashckpt
from flashckpt.format.manifest import FileEntry, Manifest
from flashckpt.format.storage import MANIFEST, Storage

DATA = Path(__file__).with_name("data")
WRITTEN_BEFORE = DATA / "manifest-step4-2ranks-2nodes.json"
"""``manifest.json`` of step 4 of a 2-rank FSDP2 run on 2 nodes (tests/support/shardtrain.py
``--world 2 --steps 4 --every 2 --per-node 1``), written by the node agent of the code before the
read path was typed; its ranks and shards are listed 1 before 0, as the agent merged the parts."""


def _rewritten(st: Storage, m: Manifest, tmp: Path) -> bytes:
    """``m`` written back as the storage writes a manifest."""
    out = tmp / "rewritten.json"
    st.write_json(str(out), m.to_json())
    return out.read_bytes()


def test_a_manifest_written_before_loads_and_round_trips_byte_identical(tmp_path: Path) -> None:
    st = Storage(f"file://{tmp_path}/ckpt")
    step_dir = Path(st.step_path(4))
    step_dir.mkdir(parents=True)
    shutil.copy(WRITTEN_BEFORE, step_dir / MANIFEST)
    m = st.manifest(4)
    assert isinstance(m, Manifest)
    assert (m.step, m.world_size, m.num_shards, m.nodes) == (4, 2, 2, ("n0-0", "n0-1"))
    assert m.world_id == "wb075dc453b46/2" and m.job == "tgold18439"
    assert m.shards[1].writer == 1 and m.ranks[0].shard == 0
    assert m.files["shard-00001-of-00002.safetensors"] == FileEntry(
        9360, None, 8192, "f85b02800d65ba8b", "38a0410d300b79d1"
    )
    assert _rewritten(st, m, tmp_path) == WRITTEN_BEFORE.read_bytes()


def test_a_manifest_without_the_later_fields_loads_and_writes_back_only_what_it_has(
    tmp_path: Path,
) -> None:
    """An older manifest (no ``job``, ``world_id``): it loads; written back, no field appears
    from nowhere but ``nodes`` (an empty list, as readers took its absence)."""
    doc = json.loads(WRITTEN_BEFORE.read_text())
    for key in ("job", "world_id", "nodes"):
        del doc[key]
    m = Manifest.from_json(doc, "manifest.json", 4)
    assert (m.job, m.world_id, m.nodes) == (None, None, ())
    assert m.to_json() == {**doc, "nodes": []}


def test_a_committed_step_reaches_storage_and_load_as_a_manifest(
    fc_env: FcEnv, agent: RunningAgent, tmp_path: Path
) -> None:
    """A step the agent commits now: its manifest round-trips byte for byte, and ``load`` hands
    the same typed manifest that ``Storage`` reads."""
    model, opt, sched = make(0)
    kw = fc_env.ckpt_kwargs(agent="connect", every=1, persist_every=1, mode="sync")
    with flashckpt.checkpointing(model, opt, scheduler=sched, **kw) as ck:
        train_steps(ck, model, opt, sched, 0, 2)
        ck.flush()
    st = Storage(fc_env.storage)
    step = st.committed_steps()[-1]
    m = st.manifest(step)
    raw = Path(st.step_path(step, MANIFEST)).read_bytes()
    assert _rewritten(st, m, tmp_path) == raw
    assert m.world_id is not None and m.job == fc_env.job  # the fields the agent writes now
    loaded = flashckpt.load(fc_env.storage)
    assert isinstance(loaded.manifest, Manifest) and loaded.manifest == m
    assert sorted(loaded.ranks) == sorted(m.ranks) == [0]
    # Equality is field by field (the storage's check_step compares two reads this way).
    assert dataclasses.replace(m, created=m.created + 1) != m
