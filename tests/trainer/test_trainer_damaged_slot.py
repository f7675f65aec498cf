"""Every memory snapshot a restore discards is named in a warning, with its damage and the step
restored instead, whatever part of the slot is damaged: the header, the description (meta JSON),
the data (its hash), or the sizes (issue 41, row 4: random writes into the meta JSON fell back
to storage without a word; only a damaged header warned); every slot's header damaged at once,
each named with its CRC mismatch (issue 30: the fallback to storage was silent)."""

from __future__ import annotations

import logging
import os
import random
import struct
import zlib
from typing import Any

import pytest
import torch
from fchelpers import FcEnv, RunningAgent
from tinytrain import make, train_step

import flashckpt

HEADER = 4096
# The slot header as docs/ and flashckpt/format/shm.py lay it out: magic, seq, state, version,
# step, meta_len, data_len, meta_cap, data_cap, t_complete, meta_crc; then its CRC32.
HDR = struct.Struct("<8sQIIqQQQQdI")

WHY = {
    "header": "its header is damaged",
    "meta": "its description (meta JSON) is damaged",
    "data": "its data does not match its hash",
    "size": "its sizes do not match",
}


def _fields(raw: bytes) -> tuple:
    return HDR.unpack_from(raw, 0)


def _damage(path: str, part: str, rng: random.Random) -> None:
    """Eight random byte writes into one part of the slot (each changes its byte); ``size``
    instead gives the header a shorter data length, its CRC made to match."""
    with open(path, "r+b") as f:
        raw = bytearray(f.read())
        f.seek(0)
        (_, _, _, _, _, meta_len, data_len, meta_cap, _, _, _) = _fields(raw)
        if part == "size":
            fields = list(_fields(raw))
            fields[6] = data_len - rng.randrange(1, data_len)
            hdr = HDR.pack(*fields)
            raw[: HDR.size + 4] = hdr + struct.pack("<I", zlib.crc32(hdr))
        else:
            lo, hi = {
                "header": (0, HDR.size + 4),
                "meta": (HEADER, HEADER + meta_len),
                "data": (HEADER + meta_cap, HEADER + meta_cap + data_len),
            }[part]
            for _ in range(8):
                i = rng.randrange(lo, hi)
                raw[i] ^= rng.randrange(1, 256)
        f.write(raw)


def _restore_from_storage(
    kw: dict[str, Any], want: dict[str, torch.Tensor], caplog: pytest.LogCaptureFixture, where: Any
) -> str:
    """A new run restores step 4 from storage, bitwise; the warnings it logged."""
    caplog.clear()
    model2, opt2, sched2 = make(1)
    with (
        caplog.at_level(logging.WARNING, logger="flashckpt"),
        flashckpt.checkpointing(model2, opt2, scheduler=sched2, **kw) as ck2,
    ):
        assert (ck2.start_step, ck2.restored_from) == (4, "storage"), where
        for k, v in model2.state_dict().items():
            assert torch.equal(v, want[k]), (where, k)
    return "\n".join(r.getMessage() for r in caplog.records)


def test_every_damaged_part_of_a_slot_is_named_with_the_step_restored_instead(
    fc_env: FcEnv, agent: RunningAgent, caplog: pytest.LogCaptureFixture
) -> None:
    kw = fc_env.ckpt_kwargs(agent="connect")
    model, opt, sched = make(0)
    with flashckpt.checkpointing(
        model, opt, scheduler=sched, every=2, persist_every=1, **kw
    ) as ckpt:
        for step in range(4):
            train_step(model, opt, sched, step)
            ckpt.step()
    assert ckpt.stats.last_committed_step == 4
    want = {k: v.clone() for k, v in model.state_dict().items()}
    slots = {}
    for name in fc_env.segments():
        path = os.path.join(fc_env.shm_dir, name)
        with open(path, "rb") as f:
            raw = f.read()
        if raw[:8] == b"FLCKSLT1":
            slots[_fields(raw)[4]] = (path, raw)
    assert sorted(slots) == [2, 4], sorted(slots)
    path, pristine = slots[4]  # the newest snapshot: the one a restore would take
    rng = random.Random(41)
    for trial, part in enumerate(["meta", "data", "size", "header"] * 2):
        with open(path, "r+b") as f:  # the slot as the first run left it
            f.write(pristine)
        _damage(path, part, rng)
        where = (trial, part)
        text = _restore_from_storage(kw, want, caplog, where)
        snap = (
            f"the snapshot in {path}" if part == "header" else f"the snapshot of step 4 in {path}"
        )
        # Said when found, with its damage ...
        assert f"{snap} is not used: {WHY[part]}" in text, (where, text)
        # ... and once restored, with the step and the source taken instead.
        assert f"restored step 4 from storage: {snap} was discarded (" in text, (where, text)
        line = next(ln for ln in text.splitlines() if "was discarded" in ln)
        assert WHY[part] in line, (where, line)
    # Both slots' headers damaged (one byte under the header's CRC; issue 30: the fallback to
    # storage was silent): each slot is named, with why, and the restore says what it took.
    for p, raw in slots.values():
        with open(p, "r+b") as f:
            f.write(raw[:24] + bytes([raw[24] ^ 0xFF]) + raw[25:])
    text = _restore_from_storage(kw, want, caplog, "every header")
    for p, _ in slots.values():
        assert f"the snapshot in {p} is not used: its header is damaged" in text, text
        assert f"restored step 4 from storage: the snapshot in {p} was discarded" in text, text
    assert "its CRC does not match" in text, text
