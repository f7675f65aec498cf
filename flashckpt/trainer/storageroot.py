"""The trainer's checks of its storage root at entry: that it can keep checkpoints at all, that
it is not another job's, and that a run starting from step 0 does not take over another run's
committed steps. A trainer without ``storage=`` of its own checks the root its node agent persists
to (``flashckpt agent --storage``: by hand, deploy/'s DaemonSet or systemd unit) the same way,
through the agent, which looks at the root for it (it may be the only one that can open it)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from flashckpt import envnames
from flashckpt.errors import StorageRootRefused, StorageUnavailableError
from flashckpt.format.storage_owner import (
    claim_root,
    delete_steps,
    foreign_owner,
    probe_round_trip,
)
from flashckpt.protocol.channel import AgentError
from flashckpt.trainer.restore.reshard import listed_steps

if TYPE_CHECKING:
    from flashckpt.format.storage import Storage
    from flashckpt.protocol.messages import HelloReply
    from flashckpt.trainer.config import CheckpointConfig
    from flashckpt.trainer.link import AgentLink
    from flashckpt.trainer.rankctx import RankContext

__all__ = [
    "AgentRoot",
    "check_agent_root",
    "check_owner",
    "probe_storage",
    "start_fresh",
    "start_fresh_agent",
]

log = logging.getLogger("flashckpt")


def probe_storage(st: Storage, ctx: RankContext, what: str = "storage") -> None:
    """Writes, reads back and deletes a small file under the storage root (every rank, then
    all agree), so storage that cannot keep the work fails here, not silently at the end.

    Args:
        what: the option that named the root (``storage``, or ``mirror`` for the remote tier),
            in the error.

    Raises:
        StorageUnavailableError: this rank's probe failed (with the URL and the OS error), or
            another rank's did.
    """
    path = st.path(f".flashckpt-probe-{ctx.rank}-{os.getpid()}-{os.urandom(4).hex()}")
    error = probe_round_trip(st, path)
    others = ctx.all_max(1 if error else 0)
    if error is not None:
        fix = (
            "pass storage=None to keep snapshots in memory only"
            if what == "storage"
            else f"pass {what}=None to go without it"
        )
        raise StorageUnavailableError(
            f"{what} {st.url} cannot keep checkpoints: writing, reading back and deleting "
            f"{path} failed: {error}. Fix the URL, its permissions or its free space, or {fix}"
        )
    if others:
        raise StorageUnavailableError(
            f"{what} {st.url} cannot keep checkpoints: another rank could not write, read "
            "back and delete a file there (its error names the cause)"
        )


def check_owner(st: Storage | None, ctx: RankContext, config: CheckpointConfig) -> None:
    """Takes the storage root (and mirror) for this job, or refuses one that belongs to another
    job: rank 0 claims it atomically (:func:`~flashckpt.format.storage_owner.claim_root`: the
    owner file is created only where none is, so of two jobs entering at the same instant
    exactly one gets the root, issue 41), the other ranks look at it too (a rank may see
    another root under the same URL), and every rank agrees. A root whose owner file (or,
    without one, newest committed step) names another job is refused unless ``takeover=True``
    (or ``overwrite=True`` with ``restore=False``, which deletes those steps), which rewrites
    the owner file for this job: two jobs on one root would resume from each other's steps.

    Raises:
        StorageRootRefused: the root belongs to another job, naming it, the evidence, the root
            and the options.
    """
    if st is None:
        return
    roots = [(st, "storage")]
    if config.mirror is not None:
        from flashckpt.format.storage import Storage

        roots.append((Storage(config.mirror), "mirror"))
    take = config.takeover or (config.overwrite and not config.restore)
    for root, what in roots:
        found = None
        if ctx.rank == 0:
            try:
                found = claim_root(root, ctx.job, takeover=take)
            except Exception as e:  # any backend's failure: the probe passed, so rare
                log.warning(
                    "flashckpt: cannot record job %r as the owner of %s %s (%s): another job "
                    "with nothing committed there would not be refused",
                    ctx.job,
                    what,
                    root.url,
                    e,
                )
        elif not take:
            found = foreign_owner(root, ctx.job)
        if take or not ctx.all_max(1 if found else 0):
            continue
        if found is not None:
            raise StorageRootRefused(found.refusal(what, root.url, ctx.job, "takeover=True"))
        raise StorageRootRefused(
            f"{what} {root.url} belongs to another job (seen by another rank, whose error names "
            "it): give this job a root of its own or pass takeover=True"
        )


def start_fresh(st: Storage | None, ctx: RankContext, config: CheckpointConfig) -> None:
    """A run that starts from step 0 over a storage root holding committed steps: refused,
    unless ``overwrite=True``, which deletes them (every rank agrees first). The remote tier
    (``mirror``) is checked the same way, after the storage root: its steps would otherwise be
    restored next time as this run's.

    Raises:
        StorageRootRefused: the root (or the mirror) holds committed steps and ``overwrite``
            is False.
    """
    if st is None:
        return
    _start_fresh(st, ctx, config, "storage")
    if config.mirror is not None:
        from flashckpt.format.storage import Storage

        _start_fresh(Storage(config.mirror), ctx, config, "mirror")


def _start_fresh(st: Storage, ctx: RankContext, config: CheckpointConfig, what: str) -> None:
    stored = listed_steps(st)
    if not ctx.all_max(1 if stored else 0):
        return
    why = (
        "restore=False"
        if not config.restore
        else "none of them could be restored by every rank (see the warnings above)"
    )
    if not config.overwrite:
        held = f"committed steps {stored}" if stored else "committed steps (seen by a rank)"
        raise StorageRootRefused(
            f"{what} {st.url} holds {held} of an earlier run, and this run starts from "
            f"step 0 ({why}): its steps would be mixed with those, and the older run's taken "
            "for this one's. Pass overwrite=True to delete them and start over, use a new "
            f"{what} root" + (", or drop restore=False to resume" if not config.restore else "")
        )
    if ctx.rank == 0:
        doomed = delete_steps(st)
        log.warning(
            "flashckpt: overwrite=True: deleted steps %s of an earlier run from %s (%s)",
            doomed,
            st.url,
            why,
        )
    ctx.all_max(0)  # nobody writes before the old steps are gone


@dataclass(frozen=True, slots=True)
class AgentRoot:
    """The node agent's own storage root, as a trainer without ``storage=`` saw it at hello."""

    url: str
    """The root's URL (as the agent names it: a path in the agent's view)."""
    steps: list[int]
    """The committed steps there at hello."""


def check_agent_root(
    reply: HelloReply, link: AgentLink, ctx: RankContext, config: CheckpointConfig
) -> AgentRoot | None:
    """For a trainer without ``storage=``: the root its node agent persists to (the hello reply
    names it) is checked as :func:`check_owner` checks ``storage=``, with this trainer's
    ``takeover=`` (or ``overwrite=True`` with ``restore=False``): rank 0 has its agent take the
    root for this job (atomically: the owner file created only where none is), and every rank
    agrees. The agent looked at the root
    (its steps' manifests, its owner file) for the trainer, which may not be able to open it (a
    path in the agent's mount namespace, credentials only the agent has): one code path for
    every root. A root the launcher passed (``flashckpt run --storage``, the same URL in
    ``$FLASHCKPT_STORAGE`` of its workers) was checked and claimed by the launcher, with its
    ``--takeover``.

    Returns:
        The agent's root (for :func:`start_fresh_agent`), or None: this trainer has
        ``storage=`` (checked itself; an agent on another root refused the hello), or the agent
        persists nowhere.

    Raises:
        StorageRootRefused: the root belongs to another job (the agent's refusal: the job, the
            evidence, the root and the fix).
    """
    if config.storage:
        return None
    url = reply.storage
    checked = url is not None and _launchers(url)
    foreign = reply.storage_foreign if url is not None and not checked else None
    take = config.takeover or (config.overwrite and not config.restore)
    if ctx.rank == 0 and url is not None and not checked:
        # Taken atomically by the agent (issue 41): of two jobs whose trainers both saw the
        # root free at hello, the second gets the refusal here.
        try:
            claim = link.claim_storage(delete_steps=False, takeover=take)
            owner_error, foreign = claim.owner_error, foreign or claim.foreign
        except AgentError as e:
            owner_error = str(e)
        if owner_error is not None:
            log.warning(
                "flashckpt: the node agent cannot record job %r as the owner of its storage %s "
                "(%s): another job with nothing committed there would not be refused",
                ctx.job,
                url,
                owner_error,
            )
    if not take and ctx.all_max(1 if foreign else 0):
        if foreign is not None:
            raise StorageRootRefused(
                f"this rank passed no storage=: its node agent (pid {reply.pid}) persists this "
                f"job to the agent's own --storage, and {foreign}"
            )
        raise StorageRootRefused(
            "the storage root another rank's node agent persists to belongs to another job "
            "(that rank's error names it): give the agents a root of this job's own, or pass "
            "takeover=True"
        )
    return AgentRoot(url, list(reply.storage_steps or [])) if url is not None else None


def _launchers(url: str) -> bool:
    """Whether ``url`` is the launcher's ``--storage`` (``$FLASHCKPT_STORAGE`` in a worker of
    ``flashckpt run``, which sets ``$FLASHCKPT_LAUNCHER_PID``: deploy/'s JobSet sets
    ``$FLASHCKPT_STORAGE`` for torchrun's workers too, and nothing checked that root)."""
    given = envnames.get(envnames.STORAGE)
    if not given or not envnames.get(envnames.LAUNCHER_PID):
        return False
    if given == url:
        return True
    from flashckpt.format.storage import Storage

    try:
        return Storage(given).url == url
    except (ValueError, ImportError):
        return False


def start_fresh_agent(
    root: AgentRoot | None, link: AgentLink, ctx: RankContext, config: CheckpointConfig
) -> None:
    """:func:`start_fresh` for a trainer without ``storage=``: a run that starts from step 0
    while its node agent's own root holds committed steps (this job's from an earlier run, or a
    job's taken over) is refused unless ``overwrite=True``, which has rank 0's agent delete
    them (every rank agrees first). Such a trainer cannot read them back (it restores from
    memory only), and the agent would otherwise write this run's steps among them and its
    retention delete them, silently.

    Raises:
        StorageRootRefused: the agent's root holds committed steps and ``overwrite`` is False.
    """
    if config.storage:
        return
    steps = root.steps if root is not None else []
    if not ctx.all_max(1 if steps else 0):
        return
    url = root.url if root is not None else "(another rank's agent's)"
    if not config.overwrite:
        held = f"committed steps {steps}" if steps else "committed steps (seen by a rank)"
        why = "restore=False" if not config.restore else "memory held no snapshot to restore"
        raise StorageRootRefused(
            f"storage {url}, where this job's node agent persists (its own --storage: this "
            f"rank passed no storage=), holds {held} of an earlier run, and this run starts "
            f"from step 0 ({why}): without storage= of its own a trainer cannot read them "
            "back, and its steps would be mixed with those. Pass storage= with that root (where "
            "this process can read it) to resume from them, overwrite=True to delete them and "
            "start over, or give the node agent a new --storage root"
        )
    if ctx.rank == 0 and root is not None:
        deleted = link.claim_storage(delete_steps=True).deleted
        log.warning(
            "flashckpt: overwrite=True: the node agent deleted steps %s of an earlier run from "
            "its storage %s (%s)",
            deleted,
            url,
            "restore=False" if not config.restore else "nothing restored",
        )
    ctx.all_max(0)  # nobody writes before the old steps are gone
