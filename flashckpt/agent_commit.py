"""The node agent's commit of a step: once every node's part of the step is in storage, the node
hosting global rank 0 writes the manifest (the commit marker), moves ``latest``, keeps the newest
``keep`` steps and tells the trainers.

A commit thread waits for the parts, so a step whose parts never arrive (a machine died) does not
hold up newer steps: it is dropped once a newer step is committed or ``commit_timeout`` passes.
Parts of another world (a step number reached again after a membership change) are never mixed
into this world's manifest; a malformed part of this world stops the commit and is reported.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from flashckpt.agent_state import AgentState
from flashckpt.messages import Committed
from flashckpt.snapmeta import NodePart
from flashckpt.storage import FORMAT, MANIFEST, PARTS, Storage

__all__ = ["Committer"]

log = logging.getLogger("flashckpt.agent")


class Committer:
    """Commits the steps this node's persister wrote, once every node's part is in."""

    def __init__(self, state: AgentState) -> None:
        self.st = state
        # Steps this node commits once every node's part is in: step -> (world size, shards,
        # world id, deadline). The commit thread waits for them; persistence goes on meanwhile.
        self.commits: dict[int, tuple[int, int, str, float]] = {}
        self.commit_wake = threading.Event()
        # Ranks whose parts a waiting step lacks (for the timeout's report): step -> ranks.
        self.commit_missing: dict[int, list[int]] = {}

    def enqueue(self, step: int, world: int, num_shards: int, world_id: str) -> None:
        """A step this node will commit once every node's part of it is in."""
        with self.st.lock:
            self.commits[step] = (
                world,
                num_shards,
                world_id,
                time.monotonic() + self.st.cfg.commit_timeout,
            )
        self.commit_wake.set()

    def commit_loop(self) -> None:
        while not self.st.stopping.is_set():
            self.commit_wake.wait(0.1)
            self.commit_wake.clear()
            if self.st.stopping.is_set():
                break
            self.commit_round()

    def drain_commits(self, timeout: float) -> None:
        """At shutdown: commits what can still be committed within ``timeout``."""
        deadline = time.monotonic() + timeout
        while self.commits and time.monotonic() < deadline:
            self.commit_round(final=True)
            if self.commits:
                time.sleep(0.1)
        with self.st.lock:
            for step in sorted(self.commits):
                log.warning("step %d not committed at shutdown: parts missing", step)
            self.commits.clear()

    def commit_round(self, final: bool = False) -> None:
        """One look at every step waiting for its commit; commits those whose parts are in."""
        with self.st.lock:
            waiting = sorted(self.commits.items())
        for step, (world, num_shards, world_id, deadline) in waiting:
            try:
                done = self.try_commit(step, world, num_shards, world_id)
            except Exception as e:
                self.report_error(step, f"commit failed: {type(e).__name__}: {e}")
                done = True
            with self.st.lock:
                newest = max(self.committed_steps(), default=-1)
                if not done and newest > step:
                    log.info("step %d dropped: newer step %d is committed", step, newest)
                    done = True
                if not done and time.monotonic() > deadline and not final:
                    missing = self.commit_missing.get(step, [])
                    done = True
                    err = (
                        f"step {step}: parts of ranks {missing} did not arrive within "
                        f"{self.st.cfg.commit_timeout:.0f} s; not committed"
                    )
                else:
                    err = None
                if done:
                    self.commits.pop(step, None)
                    self.commit_missing.pop(step, None)
            if err:
                self.report_error(step, err)

    # -- the root committed to (the remote tier's committer, agent_mirror, overrides these) ----
    def root(self) -> Storage | None:
        """The checkpoint root whose steps this committer commits."""
        return self.st.storage

    def committed_steps(self) -> list[int]:
        """The steps committed in :meth:`root` (as this agent knows them)."""
        return self.st.committed

    def ready(self, step: int) -> bool:
        """Whether a step whose parts are all in may be committed now."""
        return True

    def report_error(self, step: int, error: str) -> None:
        """A step that could not be committed (reported to the trainers)."""
        self.st.record_error(step, error)

    def on_commit(self, step: int, removed: list[int]) -> None:
        """A step was committed (``removed``: the steps retention deleted)."""
        with self.st.lock:
            self.st.committed = sorted({*self.st.committed, step} - set(removed))
            self.st.rewrites.discard(step)
        self.st.broadcast(Committed(step=step))

    def try_commit(self, step: int, world: int, num_shards: int, world_id: str) -> bool:
        storage = self.root()
        assert storage is not None
        if step in self.committed_steps() and storage.fs.exists(storage.step_path(step, MANIFEST)):
            return True  # (a step hidden for a rewrite is committed again, whatever we knew)
        # Parts of other worlds (a step number reached again after a membership change, with a
        # dead machine's old part still there) are never mixed into this world's manifest. A
        # part of this world that fails its checks stops the commit (reported): it names files
        # readers would reject, or it is not what an agent writes.
        src = storage.step_path(step, PARTS)
        parts = [
            NodePart.from_json(p, f"{src} (the part of node {str(p.get('node'))[:64]!r})")
            for p in storage.read_parts(step)
            if p.get("world_id", "") == world_id
        ]
        ranks: dict[str, Any] = {}
        shards: dict[str, Any] = {}
        files: dict[str, Any] = {}
        for p in parts:
            if p.world_size != world or p.step != step:
                continue
            doc = p.to_json()
            ranks.update(doc["ranks"])
            shards.update(doc["shards"])
            files.update(doc["files"])
        if len(ranks) < world or len(shards) < num_shards:
            with self.st.lock:
                self.commit_missing[step] = sorted(set(range(world)) - {int(r) for r in ranks})
            return False
        if not self.ready(step):
            return False
        manifest = {
            "format": FORMAT,
            "job": self.st.cfg.job,
            "step": step,
            "world_size": world,
            "num_shards": num_shards,
            "created": time.time(),
            "nodes": sorted(p.node for p in parts),
            "files": files,
            "ranks": ranks,
            "shards": shards,
        }
        storage.commit(step, manifest)
        removed = storage.retain(self.st.cfg.keep)
        self.on_commit(step, removed)
        return True
