"""The node agent's commit of a step: once every node's part of the step is in storage, the node
hosting global rank 0 writes the manifest (the commit marker), moves ``latest``, keeps the newest
``keep`` steps and tells the trainers.

A commit thread waits for the parts, so a step whose parts never arrive (a machine died) does not
hold up newer steps: it is dropped once a newer step is committed or ``commit_timeout`` passes.
Parts of another world (a step number reached again after a membership change) are never mixed
into this world's manifest; a malformed part of this world stops the commit and is reported.

Two guards keep ``latest`` from moving backwards or to another timeline when a machine that was
cut off (a network partition) still holds steps of its old world:

- *fence* (:meth:`Committer.fence`, the ``fence`` request its launcher sends when its etcd lease
  is about to lapse): from then on nothing is committed, steps waiting are dropped, until a
  trainer of a new world says hello;
- every commit is checked against the manifests in storage (defence in depth, fenced or not): a
  step is refused when storage holds a committed step at least as new that another world
  committed after this world's first commit was queued (world ids are names, not ordered: a
  manifest committed meanwhile by another world is what says this world was superseded). Steps
  that were committed before (an abandoned timeline, an older run: the persister rewrites those)
  do not count. Manifests record their world id (``world_id``) for this check; older manifests
  without it count as another world's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from flashckpt.agent.state import AgentState
from flashckpt.format.snapmeta import NodePart
from flashckpt.format.storage import FORMAT, MANIFEST, PARTS, Storage
from flashckpt.protocol.messages import Committed

__all__ = ["Committer"]

log = logging.getLogger("flashckpt.agent.daemon")

_WORLDS_KEPT = 16  # worlds whose baseline the commit check keeps
COMMIT_POLL_S = 0.1
"""Seconds between two looks in storage for the parts of a step waiting for its commit (only
while one waits: the parts of the other nodes come with no notice)."""


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
        # Why this agent is fenced (its machine lost its place in the job), None when it is not:
        # nothing is committed until a trainer of a new world says hello.
        self.fenced: str | None = None
        # The world that was current when the fence came (its trainers' hellos are refused).
        self.fenced_world: str | None = None
        # World id -> the steps committed in storage when that world's first step was queued:
        # those another world committed before it began, which the check ignores. Kept per
        # world (the newest few): a late step of an older world is checked against its own.
        self._baselines: dict[str, frozenset[int]] = {}
        self.holders: list[Callable[[], set[int]]] = []
        """What :meth:`retain` must not delete yet: each returns steps still needed."""
        self._retain_lock = threading.Lock()  # one retention at a time (two threads call it)

    def enqueue(self, step: int, world: int, num_shards: int, world_id: str) -> None:
        """A step this node will commit once every node's part of it is in (dropped, with a log
        line, while the agent is fenced)."""
        with self.st.lock:
            if self.fenced is not None:
                log.warning("step %d not queued for its commit: this agent is fenced", step)
                return
        self._note_world(world_id)
        with self.st.lock:
            self.commits[step] = (
                world,
                num_shards,
                world_id,
                time.monotonic() + self.st.cfg.commit_timeout,
            )
        self.commit_wake.set()

    def commit_loop(self) -> None:
        """Looks at the waiting steps every :data:`COMMIT_POLL_S` while there are some (the
        other nodes' parts arrive in storage, which tells nobody), and sleeps otherwise until a
        step is queued (``commit_wake``), the agent stops, or ``poll_interval`` passes (a safety
        net)."""
        while not self.st.stopping.is_set():
            with self.st.lock:
                waiting = bool(self.commits)
            self.commit_wake.wait(COMMIT_POLL_S if waiting else self.st.cfg.poll_interval)
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
                time.sleep(COMMIT_POLL_S)  # the other nodes' parts come with no notice
        with self.st.lock:
            for step in sorted(self.commits):
                log.warning("step %d not committed at shutdown: parts missing", step)
            self.commits.clear()

    def fence(self, reason: str) -> list[int]:
        """Commits nothing from now on (until :meth:`unfence`); returns the steps dropped.

        Called when this machine lost (or is about to lose) its place in the job: a new world
        may form without it, and a commit of its old world's steps could move ``latest``
        backwards or onto a timeline the job abandoned.
        """
        with self.st.lock:
            first = self.fenced is None
            if first:
                self.fenced_world = self.st.world_id
            self.fenced = reason
            dropped = sorted(self.commits)
            self.commits.clear()
            self.commit_missing.clear()
        if first:
            log.warning(
                "fenced (%s): committing nothing more of world %r; steps dropped: %s",
                reason,
                self.fenced_world,
                dropped or "none",
            )
        return dropped

    def unfence(self, world_id: str) -> None:
        """A trainer of a new world said hello: commits resume, for that world."""
        with self.st.lock:
            if self.fenced is None:
                return
            self.fenced = None
            old, self.fenced_world = self.fenced_world, None
        log.warning("fence lifted: a trainer of new world %r said hello (was %r)", world_id, old)

    def _note_world(self, world_id: str, committed: list[int] | None = None) -> None:
        """Records storage's committed steps when a world's first step is queued (see the
        module docstring); ``committed`` if just listed."""
        with self.st.lock:
            if world_id in self._baselines:
                return
        storage = self.root()
        if committed is None:
            if storage is None:
                return
            try:
                committed = storage.committed_steps()
            except OSError as e:
                log.warning("cannot list storage's committed steps: %s", e)
                return
        with self.st.lock:
            self._baselines.setdefault(world_id, frozenset(committed))
            while len(self._baselines) > _WORLDS_KEPT:
                del self._baselines[next(iter(self._baselines))]

    def refusal(self, storage: Storage, step: int, world_id: str) -> tuple[str, bool] | None:
        """Why ``step`` of world ``world_id`` must not be committed now, or None.

        Returns:
            The reason, and whether it is an error to report (a step of this world that a newer
            step of the same world superseded is only logged).
        """
        committed = storage.committed_steps()
        self._note_world(world_id, committed)
        with self.st.lock:
            fenced = self.fenced
            baseline = self._baselines.get(world_id, frozenset())
        if fenced is not None:
            return f"this agent is fenced ({fenced})", True
        for newer in sorted((s for s in committed if s >= step), reverse=True):
            if newer in baseline:
                continue  # committed before this world began: rewritten by the persister
            other = storage.manifest_world(newer)
            if other == world_id:
                if newer > step:
                    return f"step {newer} of this world is committed", False
                continue  # this step of this world again: committed once more, as before
            if newer > step:
                return (
                    f"storage already holds step {newer}, committed by another world "
                    f"({other!r}) after this world ({world_id!r}) began: committing step {step} "
                    "would move the job back to an abandoned timeline (was this machine cut "
                    "off from the job?)",
                    True,
                )
            return (
                f"step {step} is already committed by another world ({other!r}): this world "
                f"({world_id!r}) is an abandoned timeline (was this machine cut off from the "
                "job?)",
                True,
            )
        return None

    def commit_round(self, final: bool = False) -> None:
        """One look at every step waiting for its commit; commits those whose parts are in."""
        with self.st.lock:
            if self.fenced is not None:
                self.commits.clear()
                self.commit_missing.clear()
            waiting = sorted(self.commits.items())
        for step, (world, num_shards, world_id, deadline) in waiting:
            try:
                done = self.try_commit(step, world, num_shards, world_id)
            except Exception as e:
                # The root's URL names the bucket, which an object store's answer often does not.
                root = self.root()
                where = root.url if root is not None else "storage"
                self.report_error(step, f"commit to {where} failed: {type(e).__name__}: {e}")
                done = True
            with self.st.lock:
                newest = max(self.committed_steps(), default=-1)
                if not done and newest > step:
                    log.info("step %d dropped: newer step %d is committed", step, newest)
                    done = True
                if not done and time.monotonic() > deadline and not final:
                    missing = self.commit_missing.get(step)
                    done = True
                    if missing is None:  # every part came: the step was never ready()
                        err = (
                            f"step {step}: every part arrived, but {self.not_ready_reason(step)} "
                            f"within {self.st.cfg.commit_timeout:.0f} s; not committed"
                        )
                    else:
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
        """The steps committed in :meth:`root` (as this agent knows them): the list itself,
        which :meth:`try_commit` updates in place after retention."""
        return self.st.committed

    def ready(self, step: int) -> bool:
        """Whether a step whose parts are all in may be committed now."""
        return True

    def not_ready_reason(self, step: int) -> str:
        """What :meth:`ready` waited for (the timeout's report)."""
        return "it was never ready to commit"

    def report_error(self, step: int, error: str) -> None:
        """A step that could not be committed (reported to the trainers)."""
        self.st.record_error(step, error)

    def retain(self) -> list[int]:
        """Deletes all but the newest ``keep`` committed steps of :meth:`root`, except the steps
        a holder still needs (:attr:`holders`: the remote tier copies its marked steps from
        this root); returns the deleted steps."""
        storage = self.root()
        if storage is None:
            return []
        with self._retain_lock:
            hold: set[int] = set()
            for held in self.holders:
                hold |= held()
            removed = storage.retain(self.st.cfg.keep, frozenset(hold))
            if removed:
                with self.st.lock:
                    known = self.committed_steps()  # the list itself (either tier's): in place
                    known[:] = [s for s in known if s not in removed]
        return removed

    def on_commit(self, step: int, removed: list[int]) -> None:
        """A step was committed (``removed``: the steps retention deleted)."""
        with self.st.lock:
            self.st.committed = sorted({*self.st.committed, step} - set(removed))
            self.st.rewrites.discard(step)
            self.st.progress.notify_all()  # a flush waiting for it returns now
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
        with self.st.lock:
            self.commit_missing.pop(step, None)  # every part is in
        if not self.ready(step):
            return False
        refused = self.refusal(storage, step, world_id)
        if refused is not None:
            reason, report = refused
            if report:
                self.report_error(step, f"step {step} not committed: {reason}")
            else:
                log.info("step %d not committed: %s", step, reason)
            return True
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
            # Readers ignore it; the commit check reads it (a manifest of another world).
            "world_id": world_id,
        }
        t0 = time.monotonic()
        storage.commit(step, manifest)
        t1 = time.monotonic()
        # Announced before retention deletes the old steps (a GB-sized step takes a while to
        # unlink): a flush waiting for this commit returns now.
        self.on_commit(step, [])
        removed = self.retain()
        log.info(
            "committed step %d to %s: manifest and latest in %.3f s (%d parts), then retention "
            "removed %s in %.3f s",
            step,
            storage.url,
            t1 - t0,
            len(parts),
            removed or "nothing",
            time.monotonic() - t1,
        )
        return True
