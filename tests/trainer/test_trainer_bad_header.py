"""A memory snapshot discarded for a damaged header is named in a warning, with the source the
restore used instead (issue 30: the fallback to storage was silent)."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from fchelpers import FcEnv, RunningAgent
from tinytrain import make, train_step

import flashckpt
from flashckpt.format.shm import MAGIC


def test_a_slot_with_a_damaged_header_falls_back_to_storage_with_a_warning(
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
    damaged = []
    for name in fc_env.segments():
        path = os.path.join(fc_env.shm_dir, name)
        with open(path, "r+b") as f:
            if f.read(len(MAGIC)) != MAGIC:
                continue
            f.seek(24)  # inside the header, under its CRC
            b = f.read(1)
            f.seek(24)
            f.write(bytes([b[0] ^ 0xFF]))
        damaged.append(path)
    assert damaged
    model2, opt2, sched2 = make(1)
    with (
        caplog.at_level(logging.WARNING, logger="flashckpt"),
        flashckpt.checkpointing(model2, opt2, scheduler=sched2, **kw) as ck2,
    ):
        assert ck2.start_step == 4 and ck2.restored_from == "storage"
        for k, v in model2.state_dict().items():
            assert torch.equal(v, want[k]), k
    text = "\n".join(r.getMessage() for r in caplog.records)
    for path in damaged:
        assert f"the snapshot in {path} is not used: its header is damaged" in text, text
        assert f"restored step 4 from storage: the snapshot in {path} was discarded" in text, text
    assert "its CRC does not match" in text, text
