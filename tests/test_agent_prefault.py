"""The trainer maps every page of its two slots in the background after entry (so no snapshot
pays first-touch faults), and keeps no slot mapped once it has left the block."""

from __future__ import annotations

import os
import threading

from fchelpers import FcEnv
from tinytrain import make

import flashckpt


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
