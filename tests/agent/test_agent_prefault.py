"""The trainer maps every page of its two slots (so no snapshot pays first-touch faults): at
entry on a fresh CPU start, in the background on a resume or when asked; and it keeps no slot
mapped once it has left the block."""

from __future__ import annotations

import os
import resource
import threading

import pytest
import torch
from fchelpers import FcEnv, RunningAgent
from tinytrain import make

import flashckpt
from flashckpt.trainer.config import CheckpointConfig, resolve_prefault


def _slot_mappings(paths: list[str]) -> dict[str, int]:
    """Rss of this process's mappings of the given files (summed per file)."""
    out: dict[str, int] = {}
    with open("/proc/self/smaps") as f:
        current = None
        for line in f:
            parts = line.split()
            if "-" in parts[0] and not parts[0].endswith(":"):
                name = parts[5] if len(parts) > 5 else ""
                current = name if name in paths else None
                if current is not None:
                    out.setdefault(current, 0)
            elif current is not None and parts[0] == "Rss:":
                out[current] += int(parts[1]) * 1024
    return out


def _join_prefault_threads() -> None:
    for t in threading.enumerate():
        if t.name == "flashckpt-prefault":
            t.join(timeout=120)
            assert not t.is_alive()


def test_slots_prefaulted_after_entry_and_unmapped_after_exit(fc_env: FcEnv) -> None:
    model, opt, sched = make(0)
    ck = flashckpt.checkpointing(
        model, opt, scheduler=sched, **fc_env.ckpt_kwargs()
    )  # agent in its own process
    with ck:
        paths = [f"{fc_env.shm_dir}/{n}" for n in fc_env.segments() if n[-3:] in (".s0", ".s1")]
        assert len(paths) == 2
        _join_prefault_threads()
        rss = _slot_mappings(paths)
        assert rss == {p: os.path.getsize(p) for p in paths}, "every slot page is mapped"
        ck.step()
        ck.save(mode="sync")
    _join_prefault_threads()
    # The checkpointer object is still referenced here (stats are read after the block): it
    # must not keep the slots' memory mapped.
    assert ck.stats.saves >= 1
    assert _slot_mappings(paths) == {}


def _big() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """64 MiB of parameters (192 MiB with Adam's moments): populating its two slots takes a
    background thread long enough to be seen unfinished right after entry."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4096, 4096)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.ones(4, 4096)).square().mean().backward()
    opt.step()


def _thread_minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def test_a_fresh_cpu_start_populates_every_slot_page_before_entry_returns(
    fc_env: FcEnv,
) -> None:
    model, opt = _big()
    _train_step(model, opt)  # the optimizer state exists: the slots are sized from it
    with flashckpt.checkpointing(model, opt, **fc_env.ckpt_kwargs(storage=None)) as ck:
        paths = [f"{fc_env.shm_dir}/{n}" for n in fc_env.segments() if n[-3:] in (".s0", ".s1")]
        # Read at once, no join: entry itself waited for the pages.
        assert _slot_mappings(paths) == {p: os.path.getsize(p) for p in paths}
        assert min(os.path.getsize(p) for p in paths) > 190 * 2**20
        status = ck.status()["prefault"]
        assert status["configured"] == "auto" and status["resolved"] == "entry"
        assert "fresh start" in status["reason"] and "host memory" in status["reason"]
        assert status["entry_wait_s"] > 0
        _train_step(model, opt)
        ck.step()
        before = _thread_minor_faults()
        ck.save(mode="sync")
        # A copy into 192 MiB of never-touched pages faults ~49,000 times on this thread.
        assert _thread_minor_faults() - before < 2_000


def test_background_prefault_is_selectable(fc_env: FcEnv) -> None:
    model, opt = _big()
    _train_step(model, opt)
    kw = fc_env.ckpt_kwargs(storage=None)
    with flashckpt.checkpointing(model, opt, prefault="background", **kw) as ck:
        status = ck.status()["prefault"]
        assert status == {
            "configured": "background",
            "resolved": "background",
            "reason": "prefault='background' configured",
            "entry_wait_s": 0.0,
        }
        _train_step(model, opt)
        ck.step()
    _join_prefault_threads()


def test_a_resume_prefaults_in_the_background(fc_env: FcEnv, agent: RunningAgent) -> None:
    """A resume's first step comes first: the slots are populated beside it. The agent is a
    standing one: an auto-started agent exits once every rank finished ("done"), and with it
    the memory the next entry would resume from (a race with the next entry)."""
    model, opt = _big()
    _train_step(model, opt)
    kw = fc_env.ckpt_kwargs()
    phases = ["join", "hello", "restore", "timeline", "preallocate", "prefault"]
    with flashckpt.checkpointing(model, opt, **kw) as ck:
        entry = ck.status()["entry"]
        assert list(entry["phases_s"]) == phases and min(entry["phases_s"].values()) >= 0
        # The fresh start waited for the pages: that wait is the prefault phase.
        assert entry["phases_s"]["prefault"] >= ck.stats.prefault_wait_s > 0
        assert entry["total_s"] == pytest.approx(sum(entry["phases_s"].values()))
        _train_step(model, opt)
        ck.step()
    _join_prefault_threads()
    model2, opt2 = _big()
    with flashckpt.checkpointing(model2, opt2, **kw) as ck2:
        assert ck2.restored_from == "memory" and ck2.start_step == 1
        status = ck2.status()["prefault"]
        assert status["resolved"] == "background" and "resume" in status["reason"]
        assert status["entry_wait_s"] == 0.0
        entry = ck2.status()["entry"]
        # A resume: the pages of the slots it has first, then the room of those it lacks.
        assert list(entry["phases_s"]) == [*phases[:4], "prefault", "preallocate"]
        # The restore phase holds the restore pipeline (timed inside it).
        assert entry["phases_s"]["restore"] >= ck2.status()["restore_s"] > 0
    _join_prefault_threads()


def test_prefault_resolution_and_bad_values() -> None:
    assert resolve_prefault("auto", {"cpu"}, restored=False)[0] == "entry"
    assert resolve_prefault("auto", {"cpu"}, restored=True)[0] == "background"
    how, why = resolve_prefault("auto", {"cpu", "cuda"}, restored=False)
    assert (how, why) == ("background", "prefault='auto': the state has tensors on cuda")
    assert resolve_prefault("entry", {"cuda"}, restored=True)[0] == "entry"
    assert resolve_prefault("background", {"cpu"}, restored=False)[0] == "background"
    with pytest.raises(ValueError, match="prefault='lazy': use 'auto', 'entry' or 'background'"):
        CheckpointConfig(prefault="lazy")  # type: ignore[arg-type]
