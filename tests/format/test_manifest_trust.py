"""Nothing in a committed step is trusted: a manifest, a shard header or a rank file that points
outside its step directory, names a FIFO or a device, claims absurd sizes or is malformed is a
CorruptCheckpointError naming the file, for ``verify``, ``load`` and a trainer's restore alike
(one validator), and restore falls back to the previous good step."""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from stephelpers import RANK, SHARD, file_record, shard_bytes, write_step

import flashckpt
from flashckpt.format.storage import CorruptCheckpointError, Storage
from flashckpt.offline.reading import load

GOOD, BAD = 3, 6


def _root(tmp_path: Path) -> tuple[Storage, Path]:
    root = tmp_path / "ckpt"
    st = Storage(f"file://{root}")
    st.commit(GOOD, write_step(st, GOOD))
    return st, root


def _manifest_path(root: Path, step: int = BAD) -> Path:
    return root / f"step-{step:09d}" / "manifest.json"


def _commit_bad(st: Storage, root: Path, edit: Callable[[dict[str, Any], Path], Any]) -> None:
    """Commits step BAD with a manifest ``edit`` rewrote (the files of a sound step underneath)."""
    manifest = write_step(st, BAD, extras={"pos": "bad"})
    st.commit(BAD, manifest)
    doc = json.loads(_manifest_path(root).read_text())
    new = edit(doc, root / f"step-{BAD:09d}")
    _manifest_path(root).write_text(json.dumps(doc if new is None else new))


def _outside_shard(doc: dict[str, Any], d: Path) -> None:
    # A shard of the right size and hash, in a directory next to the root.
    evil = d.parent.parent / "elsewhere"
    evil.mkdir(exist_ok=True)
    data = shard_bytes(b"E" * 1000)
    (evil / "evil.safetensors").write_bytes(data)
    name = "../../elsewhere/evil.safetensors"
    doc["files"] = {name: file_record(data), RANK: doc["files"][RANK]}
    doc["shards"]["0"]["file"] = name


def _outside_rank(doc: dict[str, Any], d: Path) -> None:
    evil = d.parent.parent / "elsewhere"
    evil.mkdir(exist_ok=True)
    good = json.loads((d / RANK).read_text())
    good["private"]["extras"] = {"pos": "evil"}
    Storage(f"file://{evil}").write_private(BAD, 0, 1, good["private"])
    data = (evil / f"step-{BAD:09d}" / RANK).read_bytes()
    name = f"../../elsewhere/step-{BAD:09d}/{RANK}"
    doc["files"] = {SHARD: doc["files"][SHARD], name: file_record(data)}
    doc["ranks"]["0"]["file"] = name


def _fifo(doc: dict[str, Any], d: Path) -> None:
    fifo = d.parent / "fifo"
    os.mkfifo(fifo)
    name = "../fifo"
    doc["files"] = {name: {"size": 100, "xxh3_64": "0" * 16}, RANK: doc["files"][RANK]}
    doc["shards"]["0"]["file"] = name


def _fifo_in_place(doc: dict[str, Any], d: Path) -> None:
    # The shard itself replaced by a FIFO (no name trick): its type is checked before reading.
    (d / SHARD).unlink()
    os.mkfifo(d / SHARD)


def _symlink_in_place(doc: dict[str, Any], d: Path) -> None:
    # The shard a link to a file of the right size and hash elsewhere.
    evil = d.parent.parent / "elsewhere.safetensors"
    evil.write_bytes((d / SHARD).read_bytes())
    (d / SHARD).unlink()
    (d / SHARD).symlink_to(evil)


def _dev_zero(doc: dict[str, Any], d: Path) -> None:
    name = "../" * 12 + "dev/zero"
    doc["files"] = {name: {"size": 6 << 30, "xxh3_64": "0" * 16}, RANK: doc["files"][RANK]}
    doc["shards"]["0"]["file"] = name


def _copied_dir(doc: dict[str, Any], d: Path) -> dict[str, Any]:
    # Step GOOD's directory copied under step BAD's name (every file and hash intact).
    good = d.parent / f"step-{GOOD:09d}"
    for p in d.iterdir():
        p.unlink()
    for p in good.iterdir():
        (d / p.name).write_bytes(p.read_bytes())
    result: dict[str, Any] = json.loads((d / "manifest.json").read_text())
    return result


def _huge_size(doc: dict[str, Any], d: Path) -> None:
    doc["files"][SHARD]["size"] = 10**14


def _no_shards(doc: dict[str, Any], d: Path) -> None:
    del doc["shards"]


def _files_list(doc: dict[str, Any], d: Path) -> None:
    doc["files"] = [SHARD, RANK]


def _unlisted_shard(doc: dict[str, Any], d: Path) -> None:
    # Issue 10: verify passed this step (it checks what `files` lists); restore rejected it.
    del doc["files"][SHARD]


def _rewrite_shard(d: Path, header: dict[str, Any], data: bytes) -> dict[str, Any]:
    body = json.dumps(header).encode()
    raw = struct.pack("<Q", len(body)) + body + data
    (d / SHARD).write_bytes(raw)
    return file_record(raw)


def _negative_shape(doc: dict[str, Any], d: Path) -> None:
    # A shard header of right size and hash whose shape is negative ([-2, -500] elements: the
    # same byte count as the data).
    skeleton = {"D": [["model", {"D": [["w", {"T": "model/w"}]]}]]}
    header = {
        "__metadata__": {"skeleton": json.dumps(skeleton)},
        "model/w": {"dtype": "U8", "shape": [-2, -500], "data_offsets": [0, 1000]},
    }
    doc["files"][SHARD] = _rewrite_shard(d, header, b"x" * 1000)


def _skeleton_names_missing_tensor(doc: dict[str, Any], d: Path) -> None:
    skeleton = {"D": [["model", {"D": [["w", {"T": "model/nothere"}]]}]]}
    header = {
        "__metadata__": {"skeleton": json.dumps(skeleton)},
        "model/w": {"dtype": "U8", "shape": [1000], "data_offsets": [0, 1000]},
    }
    doc["files"][SHARD] = _rewrite_shard(d, header, b"x" * 1000)


def _piece_outside_its_tensor(doc: dict[str, Any], d: Path) -> None:
    # A DTensor piece of 1000 elements said to sit in a global tensor of 10.
    dt = {"shape": [10], "offset": [0], "local": [1000], "mesh": [2], "coord": [0]}
    dt["placements"] = [{"shard": 0}]
    skeleton = {"D": [["model", {"D": [["w", {"S": "model/w", "dt": dt}]]}]]}
    header = {
        "__metadata__": {"skeleton": json.dumps(skeleton)},
        "model/w": {"dtype": "U8", "shape": [1000], "data_offsets": [0, 1000]},
    }
    doc["files"][SHARD] = _rewrite_shard(d, header, b"x" * 1000)


def _rank_of_another_step(doc: dict[str, Any], d: Path) -> None:
    # The rank file of step GOOD, hashed into step BAD's manifest.
    data = (d.parent / f"step-{GOOD:09d}" / RANK).read_bytes()
    (d / RANK).write_bytes(data)
    doc["files"][RANK] = file_record(data)


def _rank_not_json(doc: dict[str, Any], d: Path) -> None:
    (d / RANK).write_bytes(b"\xff{")
    doc["files"][RANK] = file_record(b"\xff{")


CASES: dict[str, tuple[Callable[[dict[str, Any], Path], Any], str]] = {
    "outside shard": (_outside_shard, r"not a shard or rank file|format says"),
    "outside rank file": (_outside_rank, r"not a shard or rank file|format says"),
    "../ to a FIFO": (_fifo, r"not a shard or rank file|format says"),
    "FIFO in place": (_fifo_in_place, r"not a regular file"),
    "symlink in place": (_symlink_in_place, r"symbolic link"),
    "../ to /dev/zero, 6 GiB": (_dev_zero, r"not a shard or rank file|format says"),
    "step dir copied": (_copied_dir, r"manifest of step 3, but its directory is that of step 6"),
    "size 10^14": (_huge_size, r"wrong size"),
    "no shards key": (_no_shards, r"no 'shards' table"),
    "files a list": (_files_list, r"no 'files' table"),
    "negative shape": (_negative_shape, r"invalid shape"),
    "skeleton names a missing tensor": (_skeleton_names_missing_tensor, r"not in the file"),
    "shard not in files": (_unlisted_shard, r"does not list .*shard-00000-of-00001"),
    "DTensor piece outside its tensor": (_piece_outside_its_tensor, r"exceeds shape \[10\]"),
    "rank file of another step": (_rank_of_another_step, r"step 3.*not of rank 0, step 6"),
    "rank file not JSON": (_rank_not_json, r"not valid JSON"),
}


def _bounded(fn: Callable[[], Any], seconds: float = 60) -> Any:
    """Runs ``fn`` in a thread: a hang (a FIFO opened for reading) fails the test, not blocks it."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        pytest.fail(f"hung for {seconds} s (a FIFO or device was opened)")
    if "error" in out:
        raise out["error"]
    return out.get("value")


@pytest.mark.parametrize("case", sorted(CASES))
def test_untrusted_step_is_corrupt_everywhere(tmp_path: Path, case: str) -> None:
    st, root = _root(tmp_path)
    edit, message = CASES[case]
    _commit_bad(st, root, edit)
    assert st.committed_steps() == [GOOD, BAD]
    # verify (the shared validator) names the step's file and the problem.
    check = _bounded(lambda: st.check_step(BAD))
    assert check.status == "corrupt", check
    assert any(f"step-{BAD:09d}" in p for p in check.problems), check.problems
    assert any(re.search(message, p) for p in check.problems), check.problems
    assert _bounded(lambda: st.check_step(GOOD)).status == "ok"
    # load of that step raises; load of the newest intact step falls back to GOOD.
    with pytest.raises(CorruptCheckpointError, match=f"step-{BAD:09d}"):
        _bounded(lambda: load(st.url, step=BAD))
    with pytest.warns(UserWarning, match=f"skipping step {BAD}"):
        ck = _bounded(lambda: load(st.url))
    assert ck.step == GOOD and ck.ranks[0]["extras"] == {"pos": GOOD}
    assert bytes(ck.state["model"]["w"].numpy()) == b"x" * 1000
    # The CLI says so too, without a traceback.
    r = subprocess.run(
        [sys.executable, "-m", "flashckpt", "verify", st.url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1 and f"step {BAD}: CORRUPT" in r.stdout, r
    assert f"step {GOOD}: ok" in r.stdout and "Traceback" not in r.stderr, r


def test_manifest_itself_a_fifo_does_not_hang(tmp_path: Path) -> None:
    st, root = _root(tmp_path)
    write_step(st, BAD)
    os.mkfifo(_manifest_path(root))
    assert BAD in st.committed_steps()
    check = _bounded(lambda: st.check_step(BAD))
    assert check.status == "corrupt" and "not a regular file" in check.problems[0]
    assert _bounded(lambda: load(st.url, step=GOOD)).step == GOOD


def test_names_are_checked_for_non_local_storage() -> None:
    import uuid

    st = Storage(f"memory://fc-{uuid.uuid4().hex}")
    try:
        manifest = write_step(st, BAD)
        st.fs.pipe_file(f"{st.root}/elsewhere.safetensors", shard_bytes(b"E" * 1000))
        manifest["shards"]["0"]["file"] = "../elsewhere.safetensors"
        manifest["files"] = {
            "../elsewhere.safetensors": file_record(shard_bytes(b"E" * 1000)),
            RANK: manifest["files"][RANK],
        }
        with pytest.raises(CorruptCheckpointError, match="format says"):
            st.commit(BAD, manifest)  # the agent never commits it; a planted one is rejected
        st.replace_json(st.step_path(BAD, "manifest.json"), manifest)
        assert st.check_step(BAD).status == "corrupt"
        with pytest.raises(CorruptCheckpointError, match="format says"):
            load(st.url, step=BAD)
    finally:
        st.fs.rm(st.root, recursive=True)


def _e2e_outside_shard(doc: dict[str, Any], d: Path) -> None:
    # The step's own (valid) shard moved out of its directory: restoring from it would "work".
    evil = d.parent.parent / "elsewhere"
    evil.mkdir(exist_ok=True)
    (d / SHARD).rename(evil / "evil.safetensors")
    name = "../../elsewhere/evil.safetensors"
    doc["files"][name] = doc["files"].pop(SHARD)
    doc["shards"]["0"]["file"] = name


def _e2e_negative_shape(doc: dict[str, Any], d: Path) -> None:
    # The real shard's header with negative shapes of the same element count, right hash.
    raw = (d / SHARD).read_bytes()
    (hlen,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + hlen])
    for k, v in header.items():
        if k != "__metadata__" and v["shape"]:
            v["shape"] = [-v["shape"][0], -1, *v["shape"][1:]]
    doc["files"][SHARD] = _rewrite_shard(d, header, raw[8 + hlen :])


E2E = {
    "outside shard": _e2e_outside_shard,
    "../ to a FIFO": _fifo,
    "size 10^14": _huge_size,
    "negative shape": _e2e_negative_shape,
    "rank file of another step": _rank_of_another_step,
}


@pytest.mark.parametrize("case", sorted(E2E))
def test_trainer_restore_falls_back_past_untrusted_steps(fc_env: Any, case: str) -> None:
    """End to end through flashckpt.checkpointing: a trainer over a root whose newest step is
    untrusted resumes from the previous good step (from storage), bitwise."""
    import torch
    from fchelpers import RunningAgent

    agent = RunningAgent(fc_env.agent_config())
    try:
        model = torch.nn.Linear(4, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with flashckpt.checkpointing(
            model, opt, **fc_env.ckpt_kwargs(agent="connect", every=0)
        ) as ck:
            for label in (GOOD, BAD):
                with torch.no_grad():
                    model.weight.fill_(float(label))
                while ck.steps_done < label:  # every=0: marks steps done, snapshots nothing
                    ck.step()
                ck.save()
                assert ck.flush() == label
    finally:
        agent.stop()
    st = Storage(fc_env.storage)
    assert st.committed_steps() == [GOOD, BAD]
    d = fc_env.storage_path / f"step-{BAD:09d}"
    doc = json.loads(_manifest_path(fc_env.storage_path).read_text())
    E2E[case](doc, d)
    _manifest_path(fc_env.storage_path).write_text(json.dumps(doc))
    a2 = RunningAgent(fc_env.agent_config())
    try:
        model = torch.nn.Linear(4, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def enter() -> tuple[int, str | None]:
            with (
                pytest.warns(UserWarning, match=f"cannot restore step {BAD}"),
                flashckpt.checkpointing(
                    model, opt, **fc_env.ckpt_kwargs(agent="connect", every=0)
                ) as ck,
            ):
                return ck.start_step, ck.restored_from

        assert _bounded(enter, 120) == (GOOD, "storage")
        assert torch.equal(model.weight, torch.full((4, 4), float(GOOD)))
    finally:
        a2.stop()


def test_load_skips_a_listed_step_retention_deleted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """load() lists the steps, then retention deletes the newest before it is read: it reads
    the next one instead of failing with FileNotFoundError."""
    import shutil

    st, root = _root(tmp_path)
    st.commit(BAD, write_step(st, BAD))
    listed = st.committed_steps()
    shutil.rmtree(root / f"step-{BAD:09d}")
    monkeypatch.setattr(Storage, "committed_steps", lambda self: listed)
    assert load(st.url).step == GOOD
    with pytest.raises(FileNotFoundError):
        load(st.url, step=BAD)


@pytest.mark.parametrize("case", ["FIFO in place", "symlink in place", "negative shape"])
def test_resharding_reads_headers_as_carefully(tmp_path: Path, case: str) -> None:
    """Resharding peeks at every shard's header before reading any whole: the same checks."""
    from flashckpt.offline.reading import read_resharded

    st, root = _root(tmp_path)
    _commit_bad(st, root, CASES[case][0])
    manifest = st.manifest(BAD)
    with pytest.raises(CorruptCheckpointError, match=f"step-{BAD:09d}/{SHARD}"):
        _bounded(lambda: read_resharded(st, BAD, {"model/w": ((0,), (10,))}, manifest))


def test_rank_files_of_earlier_versions_still_load(tmp_path: Path) -> None:
    """Rank files written before they carried world_size and an embedded hash: the manifest's
    hash vouches for them (a write-through file, read without a manifest, must carry both)."""
    st, root = _root(tmp_path)
    manifest = write_step(st, BAD)
    old = {"format": "flashckpt/1", "rank": 0, "step": BAD, "private": {"extras": {"pos": 9}}}
    raw = json.dumps(old).encode()
    (root / f"step-{BAD:09d}" / RANK).write_bytes(raw)
    manifest["files"][RANK] = file_record(raw)
    st.commit(BAD, manifest)
    assert st.check_step(BAD).status == "ok"
    assert load(st.url).ranks[0]["extras"] == {"pos": 9}
    assert st.read_private(BAD, 0, 1) is None
