"""The node agent's remote tier: copies the mirror-marked steps it persisted to a second root.

The trainers mark a snapshot for the remote tier (``mirror=``, ``mirror_every``) in its meta,
with the mirror's URL, so every node's agent mirrors the same steps to the same root. Once this
node's part of such a step is persisted to the primary root (node-local disk, typically), the
:class:`Mirrorer` copies the node's files of it to the mirror root in a thread of its own, at
low CPU and IO priority, in bounded chunks that give way to a trainer's copy, then writes the
node's part there too. The committing node (it hosts global rank 0) commits the mirror step
with the primary tier's commit code over the second root (:class:`MirrorCommitter`): the same
manifest, written only once every node's part is in the mirror and the step is committed in the
primary root, then the mirror's ``latest``; ``keep`` applies to the mirror on its own.

Why from the primary files and not from the slot: a remote upload may take minutes, and a slot
held (pinned) that long would keep the trainer from snapshotting into it; the persisted files
are there for as long as retention keeps them, and the primary tier's retention keeps a step
until the mirror is done with it (copied and committed, dropped, or failed), so a slow mirror
never loses a marked step to it (the primary root holds more than ``keep`` steps meanwhile).
They are not trusted for that: each file is
verified against the hash(es) its part recorded (the completion hash of the snapshot, for a
shard) while it is copied, and a file that fails is removed from the mirror and the step is not
mirrored. A step that is half copied (the agent died, the mirror failed) has no part of this
node, so it is never committed there; its files are removed by the mirror's next retention or
when the next agent opens the mirror.

Only the newest waiting step is copied: a slow link skips steps rather than building a queue.
Errors of the mirror are logged, kept in ``status()["mirror"]`` and sent to the trainers as
``persist_error`` events (``"mirror <url>: ..."``: they land in ``stats.persist_errors`` and the
trainers' log, as the disk tier's do), but a flush of the step still succeeds (the primary tier
holds it). At the agent's stop the newest step due for the mirror (waiting, or whose copy
failed) is copied and committed with retries until ``commit_timeout``; the stop reports whether
it got there (the agent's exit code, :data:`~flashckpt.agent.daemon.EXIT_MIRROR_FAILED`).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from flashckpt.agent.commit import Committer
from flashckpt.agent.state import AgentState, lower_thread_priority
from flashckpt.format.snapmeta import NodePart
from flashckpt.format.storage import MANIFEST, Storage
from flashckpt.protocol.messages import PersistErrorEvent

__all__ = ["MirrorCommitter", "MirrorJob", "Mirrorer"]

log = logging.getLogger("flashckpt.agent.daemon")

MIRROR_CHUNK = 16 << 20
"""Bytes copied to the mirror between two looks at the trainers."""


@dataclass(frozen=True, slots=True)
class MirrorJob:
    """One step of this node to copy to the mirror."""

    step: int
    """The step (persisted to the primary root, this node's part written)."""
    url: str
    """The mirror root, as the trainers' marks name it."""
    part: NodePart
    """This node's part of the step: the files to copy and their hashes."""
    commits: bool
    """Whether this node commits the step (it hosts global rank 0)."""


class MirrorCommitter(Committer):
    """The primary tier's :class:`~flashckpt.agent.commit.Committer` over the mirror root."""

    def __init__(self, state: AgentState, mirrorer: Mirrorer) -> None:
        super().__init__(state)
        self.m = mirrorer

    def root(self) -> Storage | None:
        return self.m.storage

    def committed_steps(self) -> list[int]:
        return self.m.committed

    def ready(self, step: int) -> bool:
        # A fenced agent (its machine cut off from the job) commits nothing, in either tier.
        if self.m.primary is not None and self.m.primary.fenced is not None:
            return False
        # The mirror never holds a step the primary tier did not commit (a step whose commit
        # failed there, a part refused, is not one to restore from either).
        primary = self.st.storage
        return primary is not None and primary.fs.exists(primary.step_path(step, MANIFEST))

    def not_ready_reason(self, step: int) -> str:
        if self.m.primary is not None and self.m.primary.fenced is not None:
            return f"this agent is fenced ({self.m.primary.fenced})"
        return "the storage root never committed it (its commit failed or it was removed)"

    def report_error(self, step: int, error: str) -> None:
        self.m.error(step, error)

    def commit_round(self, final: bool = False) -> None:
        with self.st.lock:
            before = set(self.commits)
        super().commit_round(final)
        with self.st.lock:
            done = before - set(self.commits)
        if done:
            self.m.release()  # committed or dropped: the primary root need not keep it now

    def on_commit(self, step: int, removed: list[int]) -> None:
        with self.st.lock:
            self.m.committed = sorted({*self.m.committed, step} - set(removed))
        log.info("mirrored step %d committed in %s", step, self.m.url)


class Mirrorer:
    """Copies this node's files of the mirror-marked steps to the mirror root (see the module)."""

    def __init__(self, state: AgentState, primary: Committer | None = None) -> None:
        self.st = state
        self.primary = primary
        """The primary tier's committer (its fence holds the mirror's commits too)."""
        self.storage: Storage | None = None
        """The mirror root (opened at the first marked step)."""
        self.committed: list[int] = []
        """The steps committed in the mirror root (as this agent knows them)."""
        self.errors: list[dict[str, Any]] = []
        """The newest errors of the mirror (step, error, time)."""
        self.mirrored_high = -1
        """The newest step this node's part of which is in the mirror."""
        self.committer = MirrorCommitter(state, self)
        self.wake = threading.Event()
        self._pending: dict[int, MirrorJob] = {}
        self._busy = threading.Lock()  # held while one step is copied
        self._copying: int | None = None  # the step being copied
        # The newest step whose copy failed (newer than any copied): the stop tries it again.
        self._failed: MirrorJob | None = None
        if primary is not None:
            # The primary tier's retention keeps the steps this mirror still copies or commits
            # (under load a step could be retained away before its copy or its mirror commit:
            # the marked step never reached the mirror).
            primary.holders.append(self.held_steps)

    def held_steps(self) -> set[int]:
        """The steps of the primary root this mirror still needs: waiting to be copied, being
        copied, or waiting for their commit in the mirror (which checks that the primary root
        committed them)."""
        with self.st.lock:
            held = set(self._pending) | set(self.committer.commits)
            if self._copying is not None:
                held.add(self._copying)
        return held

    def release(self) -> None:
        """Runs the primary tier's retention once the mirror is done with a step it held (the
        primary root may hold more than ``keep`` steps meanwhile)."""
        if self.primary is None or self.primary.root() is None:
            return
        try:
            self.primary.retain()
        except Exception as e:  # retention's errors are the next commit's to meet
            log.warning("retention after the mirror released a step failed: %s", e)

    @property
    def url(self) -> str | None:
        return self.storage.url if self.storage is not None else None

    def error(self, step: int | None, error: str) -> None:
        """Logs, keeps (``status()``) and sends a mirror error to the trainers."""
        log.error("mirror step %s failed: %s", step, error)
        with self.st.lock:
            self.errors.append({"step": step, "error": error, "time": time.time()})
            del self.errors[:-50]
        where = self.url or "(not opened)"
        self.st.broadcast(PersistErrorEvent(step=step, error=f"mirror {where}: {error}"))

    def enqueue(self, job: MirrorJob) -> None:
        """A step this node persisted whose snapshots are marked for the mirror."""
        with self.st.lock:
            self._pending[job.step] = job
        self.wake.set()

    def pending(self) -> bool:
        """Whether a step waits to be copied or committed."""
        with self.st.lock:
            return bool(self._pending) or self._busy.locked() or bool(self.committer.commits)

    def status(self) -> dict[str, Any]:
        with self.st.lock:
            return {
                "url": self.url,
                "committed": list(self.committed),
                "committing": sorted(self.committer.commits),
                "pending": sorted(self._pending),
                "mirrored_high": self.mirrored_high,
                "errors": list(self.errors[-10:]),
            }

    # -- threads -----------------------------------------------------------------------------
    def mirror_loop(self) -> None:
        """Copies a step once one is queued (``wake``: :meth:`enqueue`, the stop), else looks
        every ``poll_interval`` (a safety net: the queue is filled only by ``enqueue``)."""
        lower_thread_priority()
        while not self.st.stopping.is_set():
            self.wake.wait(self.st.cfg.poll_interval)
            self.wake.clear()
            if self.st.stopping.is_set():
                break
            self.run_once()

    def commit_loop(self) -> None:
        self.committer.commit_loop()

    def drain(self, timeout: float) -> bool:
        """At shutdown: copies the newest step due for the mirror (waiting, or the newest whose
        copy failed) and commits it, trying again after a failure (every ``retry_interval``,
        growing to 10 s) until it is there or ``timeout`` seconds passed: the exit's final step
        reaches the mirror, a bounded wait. Returns whether it got there (True when no step
        was due; on the committing node "there" means committed in the mirror)."""
        deadline = time.monotonic() + timeout
        if not self._busy.acquire(timeout=max(0.0, timeout)):
            self.error(None, f"a copy still ran at shutdown after {timeout:g} s (commit_timeout)")
            return False
        self._busy.release()
        with self.st.lock:
            jobs = [*self._pending.values(), *([self._failed] if self._failed else [])]
            target = max(jobs, key=lambda j: j.step) if jobs else None
            waiting = set(self.committer.commits)
        ok = True
        if target is not None:
            pause = self.st.cfg.retry_interval
            tries = 0
            while True:
                tries += 1
                with self.st.lock:
                    self._pending[target.step] = target  # run_once copies the newest waiting
                self.run_once()
                with self.st.lock:
                    ok = self.mirrored_high >= target.step
                left = deadline - time.monotonic()
                if ok or left <= pause:
                    break
                log.warning(
                    "mirror: the final step %d failed to copy (try %d); trying again in %.0f s "
                    "(%.0f s left of commit_timeout)",
                    target.step,
                    tries,
                    pause,
                    left,
                )
                time.sleep(pause)
                pause = min(pause * 2, 10.0)
            if ok and target.commits:
                waiting.add(target.step)
        self.committer.drain_commits(max(0.0, deadline - time.monotonic()))
        self.release()
        with self.st.lock:
            missing = sorted(s for s in waiting if s not in self.committed)
        if target is not None and not ok:
            self.error(
                target.step,
                f"the final step {target.step} never reached the mirror within {timeout:g} s "
                "(commit_timeout): it is in the storage root only",
            )
        elif missing:
            ok = False
            self.error(
                missing[-1],
                f"step {missing[-1]} was not committed in the mirror within {timeout:g} s "
                "(commit_timeout): it is in the storage root only",
            )
        return ok

    def run_once(self) -> bool:
        """Copies the newest waiting step (older waiting ones are dropped: superseded).
        Returns whether there was one."""
        with self.st.lock:
            if not self._pending:
                return False
            step = max(self._pending)
            job = self._pending.pop(step)
            skipped = sorted(self._pending)
            for old in skipped:
                log.info("mirror: step %d skipped, newer step %d is due", old, step)
            self._pending.clear()
            self._copying = step
        with self._busy:
            try:
                self.copy(job)
            except Exception as e:  # the daemon lives on; the error is kept
                with self.st.lock:
                    if step > self.mirrored_high and (
                        self._failed is None or step >= self._failed.step
                    ):
                        self._failed = job
                self.error(step, f"{type(e).__name__}: {e}")
            else:
                with self.st.lock:
                    if self._failed is not None and self._failed.step <= step:
                        self._failed = None
            finally:
                with self.st.lock:
                    self._copying = None
        if skipped or step not in self.held_steps():
            self.release()  # steps the primary root kept for the mirror may go now
        return True

    # -- copying -----------------------------------------------------------------------------
    def open_root(self, url: str) -> Storage:
        """The mirror root the marks name (one per agent: another URL is an error)."""
        if self.storage is not None:
            if url != self.storage.url:
                raise ValueError(
                    f"the trainers mark steps for mirror {url}, but this agent mirrors job "
                    f"{self.st.cfg.job!r} to {self.storage.url}: use one mirror URL per job id"
                )
            return self.storage
        root = Storage(url, file_mode=self.st.cfg.storage_file_mode)
        committed = root.committed_steps()
        root.remove_partial_steps(committed)  # left by an earlier agent (one killed mid-copy)
        with self.st.lock:
            self.storage, self.committed = root, committed
        return root

    def copy(self, job: MirrorJob) -> None:
        primary = self.st.storage
        assert primary is not None
        mirror = self.open_root(job.url)
        step, part = job.step, job.part
        t0 = time.monotonic()
        if job.commits and mirror.fs.exists(mirror.step_path(step, MANIFEST)):
            # A step number reached again (an abandoned timeline's step): hidden before its
            # files are rewritten, committed again once every part is in.
            mirror.uncommit(step)
            with self.st.lock:
                self.committed = [s for s in self.committed if s != step]
        pace = self.st.pacer()
        size = 0
        for name in sorted(part.files):
            rec = primary.copy_step_file(
                step, name, part.files[name], mirror, check=pace, chunk=MIRROR_CHUNK
            )
            size += rec.size
        mirror.write_part(step, self.st.cfg.node, part.to_json())
        with self.st.lock:
            self.mirrored_high = max(self.mirrored_high, step)
        if job.commits:
            self.committer.enqueue(step, part.world_size, part.num_shards, part.world_id)
        dt = time.monotonic() - t0
        log.info("mirrored step %d to %s: %.1f MiB in %.2f s", step, mirror.url, size / 2**20, dt)
