"""The whole job at a glance from etcd: per-machine summaries, ``flashckpt status --etcd``,
and the straggler -> standby swap.

Every launcher of a job runs a :class:`JobViewPublisher` thread. Every ``period_s`` (2 s) it
asks its current node agent for its ``status()`` (the monitor's
per-rank step times, snapshots in memory, committed steps, alerts), condenses it into one
small JSON document (:func:`machine_summary`) and writes it to
``<key_prefix>/<job>/monitor/<node_id>``, bound to the machine's node lease: when a machine
dies, its summary disappears with its node key. Any machine (or an operator's laptop that
reaches etcd) then reads the job with :func:`read_job_view` and prints it with
:func:`format_job_view`::

    flashckpt status --etcd etcd-host:2379 --job job7

Straggler swap (``flashckpt run --swap-stragglers``, off by default, given to every machine):
one machine judges, the active machine of group rank 0 (the judge changes with the rounds, no
election). At each check it reads the job view and compares the slowest active machine's median
compute time per iteration (forward + optimizer, which data-parallel collectives do not
equalise; the iteration time when those are not seen) with the median of the other active
machines. A machine slower than ``factor`` times that median for ``persist`` consecutive checks
in a row, while a standby waits in etcd, is named in one job-level key
(:func:`straggler_key`, bound to the judge's node lease, one name at a time); the named machine
retires: its launcher stops its workers, its node agent persists what it holds, and it leaves
the job; the next rendezvous round admits the standby in its place (:class:`StragglerSwap`).
The judge reads the whole view (O(N) keys, one machine); every other machine reads that one key
per check (O(1)), never the view. The judge deletes the name once the machine is gone.
"""

from __future__ import annotations

import contextlib
import json
import logging
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from flashckpt.elastic.etcd.client import EtcdClient, EtcdError
from flashckpt.elastic.membership.nodes import NodeRecord, nodes_prefix
from flashckpt.monitor.statusview import by_global_rank, steps_done_of_ring

__all__ = [
    "JobViewPublisher",
    "Retirement",
    "StragglerSwap",
    "agent_status",
    "format_job_view",
    "machine_summary",
    "read_job_view",
    "straggler_key",
    "summaries_prefix",
]

logger = logging.getLogger("flashckpt.jobview")

_AGENT_TIMEOUT_S = 2.0
_ENDED = frozenset({"exit", "error", "died", "killed", "replaced", "ended"})


def summaries_prefix(job_prefix: str) -> str:
    """The etcd prefix of a job's per-machine summaries, given the job's prefix (ending in /)."""
    return job_prefix + "monitor/"


def straggler_key(job_prefix: str) -> str:
    """The etcd key that names the machine the straggler judge retires (see the module
    docstring), given the job's prefix (ending in /); not under :func:`summaries_prefix`."""
    return job_prefix + "straggler"


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def machine_summary(
    *,
    node_id: str,
    host: str,
    role: str,
    group_rank: int | None,
    restarts: int,
    agent_status: dict[str, Any] | None,
    now: float | None = None,
) -> dict[str, Any]:
    """Condenses a node agent's ``status()`` into the machine's summary for etcd.

    Args:
        node_id: The machine's node id.
        host: Its host name.
        role: ``active``, ``standby``, ``rejoining`` (between rounds) or ``leaving``.
        group_rank: Its rank among the machines of the current round, when active.
        restarts: Worker-group restarts this launcher saw (rounds after its first).
        agent_status: The agent's ``status()`` reply; None when it did not answer.
        now: Wall-clock time of the summary (default: now).

    Returns:
        A JSON-serialisable dict: per-rank figures (``ranks``) and machine figures: ``step``
        (the slowest rank's steps completed, as ``ckpt.steps_done``), ``p50_ms`` (median of
        the ranks' medians), ``p99_ms`` (worst rank's p99), ``compute_ms`` (median of the
        ranks' forward + optimizer medians; None when the loop's model and optimizer calls
        are not seen), ``snapshot`` (the newest step every live local rank has in memory),
        ``persisted`` (newest committed step), ``restarts``, ``alerts`` (active hang /
        straggler alerts, as messages).
    """
    st = agent_status or {}
    mon = st.get("monitor") or {}
    slot_ranks = by_global_rank(st.get("ranks") or {})
    ranks: dict[str, dict[str, Any]] = {}
    for r, d in (mon.get("ranks") or {}).items():
        parts = d.get("p50_parts_ms") or {}
        fwd, opt = _num(parts.get("forward")) or 0.0, _num(parts.get("optimizer")) or 0.0
        slots = [s for s in ((slot_ranks.get(r) or {}).get("slots") or []) if s is not None]
        ranks[str(r)] = {
            "state": d.get("state"),
            "step": steps_done_of_ring(d.get("step")),
            "p50_ms": _num(d.get("p50_ms")),
            "p99_ms": _num(d.get("p99_ms")),
            "compute_ms": (fwd + opt) if (fwd or opt) else None,
            "snapshot": max(slots, default=None),
            "restarts": int(d.get("restarts") or 0),
            "straggler": bool(d.get("straggler")),
        }
    for r, d in slot_ranks.items():  # ranks connected but not (yet) monitored
        if str(r) not in ranks and isinstance(d, dict):
            slots = [s for s in (d.get("slots") or []) if s is not None]
            ranks[str(r)] = {"state": "connected" if d.get("connected") else "-", "step": None}
            ranks[str(r)]["snapshot"] = max(slots, default=None)
    # A rank whose process ended (a former round's global rank: the agent stays across rounds)
    # is listed but not counted.
    live = [d for d in ranks.values() if d.get("state") not in _ENDED]
    steps = [d["step"] for d in live if d.get("step") is not None]
    p50s = [d["p50_ms"] for d in live if d.get("p50_ms") is not None]
    p99s = [d["p99_ms"] for d in live if d.get("p99_ms") is not None]
    comp = [d["compute_ms"] for d in live if d.get("compute_ms") is not None]
    snaps = [d.get("snapshot") for d in live]
    gp = mon.get("goodput") or {}
    return {
        "node": node_id,
        "host": host,
        "role": role,
        "group_rank": group_rank,
        "t": time.time() if now is None else now,
        "agent": agent_status is not None,
        "ranks": ranks,
        "live_ranks": len(live),
        "step": min(steps) if steps else None,
        "p50_ms": statistics.median(p50s) if p50s else None,
        "p99_ms": max(p99s) if p99s else None,
        "compute_ms": statistics.median(comp) if comp and len(comp) == len(live) else None,
        "snapshot": min(snaps) if snaps and None not in snaps else None,  # type: ignore[type-var]
        "persisted": max(st.get("committed") or [], default=None),
        "restarts": max([restarts, *(int(d.get("restarts") or 0) for d in ranks.values())]),
        "alerts": [f"[{a.get('kind')}] {a.get('message')}" for a in (mon.get("alerts") or [])],
        "goodput": _num(gp.get("goodput")) if gp.get("ranks") else None,
    }


# -- reading the job ------------------------------------------------------------------------
def read_job_view(
    client: EtcdClient, job_prefix: str, *, timeout: timedelta | None = None
) -> dict[str, Any]:
    """Reads every live machine of a job: its node record (role) and its summary.

    Args:
        client: An etcd client.
        job_prefix: The job's prefix (``<key_prefix>/<job>/``).
        timeout: Deadline of each etcd call (default: the client's).

    Returns:
        ``{"machines": [...], "now": t}``; each machine is its summary (or a stub with the
        node record's role when it has published none yet) plus ``state`` (the launcher's
        state in its node key) and ``age_s`` (seconds since the summary was written, by the
        reader's clock).

    Raises:
        EtcdError: etcd did not answer.
    """
    nodes = {}
    for kv in client.get_prefix(nodes_prefix(job_prefix), timeout=timeout):
        rec = NodeRecord.from_kv(kv)
        if rec is not None:
            nodes[rec.node_id] = rec
    sums: dict[str, dict[str, Any]] = {}
    for kv in client.get_prefix(summaries_prefix(job_prefix), timeout=timeout):
        try:
            doc = json.loads(kv.value)
        except ValueError:
            continue
        if isinstance(doc, dict) and isinstance(doc.get("node"), str):
            sums[doc["node"]] = doc
    now = time.time()
    machines = []
    for node in sorted(set(nodes) | set(sums)):
        rec = nodes.get(node)
        doc = dict(sums.get(node) or {"node": node, "ranks": {}, "alerts": []})
        if rec is not None:
            doc["state"] = rec.state
            doc.setdefault("host", rec.host)
            doc.setdefault("group_rank", rec.group_rank)
            if "role" not in doc:
                doc["role"] = "standby" if rec.state == "waiting" else rec.state
        else:
            doc["state"] = None  # a summary whose node key is gone: it is leaving
        doc["age_s"] = now - float(doc["t"]) if "t" in doc else None
        machines.append(doc)
    return {"machines": machines, "now": now}


def format_job_view(view: dict[str, Any], job: str, *, ranks: bool = True) -> str:
    """The job at a glance: machines, ranks, step, step time p50/p99, last snapshot and
    persisted step, restarts, standby machines, alerts.

    Args:
        view: What :func:`read_job_view` returned.
        job: The job id (for the header).
        ranks: Also list every rank under its machine.
    """
    ms = view["machines"]
    if not ms:
        return f"job {job}: no machine registered in etcd (is the job running? right --job?)"
    active = [m for m in ms if m.get("role") == "active"]
    standby = [m for m in ms if m.get("role") == "standby"]
    nranks = sum(_live(m) for m in active)
    steps = [m["step"] for m in active if m.get("step") is not None]
    p50 = [m["p50_ms"] for m in active if m.get("p50_ms") is not None]
    p99 = [m["p99_ms"] for m in active if m.get("p99_ms") is not None]
    snaps = [m.get("snapshot") for m in active]
    pers = [m["persisted"] for m in active if m.get("persisted") is not None]
    lines = [
        f"job {job}: {len(active)} active machine(s), {len(standby)} standby, "
        f"{len(ms) - len(active) - len(standby)} other; {nranks} rank(s)",
        f"  step {_f(min(steps) if steps else None)}"
        f"  p50 {_f(statistics.median(p50) if p50 else None, '.1f')} ms"
        f"  p99 {_f(max(p99) if p99 else None, '.1f')} ms"
        f"  last snapshot {_f(min(snaps) if snaps and None not in snaps else None)}"
        f"  persisted {_f(max(pers) if pers else None)}"
        f"  restarts {max((int(m.get('restarts') or 0) for m in ms), default=0)}",
        f"{'machine':<16} {'role':<9} {'grp':>3} {'ranks':>5} {'step':>8} {'p50 ms':>8} "
        f"{'p99 ms':>8} {'comp ms':>8} {'snapshot':>8} {'persist':>8} {'rstrt':>5} {'age s':>5}",
    ]
    alerts: list[str] = []
    order = {"active": 0, "rejoining": 1, "standby": 2}
    for m in sorted(ms, key=lambda m: (order.get(m.get("role", ""), 3), str(m.get("node")))):
        lines.append(
            f"{m.get('node')!s:<16} {m.get('role') or '-'!s:<9} {_f(m.get('group_rank')):>3} "
            f"{_live(m):>5} {_f(m.get('step')):>8} "
            f"{_f(m.get('p50_ms'), '.1f'):>8} {_f(m.get('p99_ms'), '.1f'):>8} "
            f"{_f(m.get('compute_ms'), '.1f'):>8} {_f(m.get('snapshot')):>8} "
            f"{_f(m.get('persisted')):>8} {_f(m.get('restarts')):>5} {_f(m.get('age_s'), '.0f'):>5}"
        )
        if ranks:
            for r, d in sorted((m.get("ranks") or {}).items(), key=lambda kv: int(kv[0])):
                lines.append(
                    f"{'':<4}rank {r:<6} {d.get('state') or '-'!s:<10} {_f(d.get('step')):>8} "
                    f"{_f(d.get('p50_ms'), '.1f'):>8} {_f(d.get('p99_ms'), '.1f'):>8} "
                    f"{_f(d.get('compute_ms'), '.1f'):>8} {_f(d.get('snapshot')):>8}"
                    + ("  STRAGGLER" if d.get("straggler") else "")
                )
        alerts.extend(f"  {m.get('node')}: {a}" for a in m.get("alerts") or [])
        if m.get("agent") is False:
            alerts.append(f"  {m.get('node')}: its node agent did not answer the launcher")
    alerts.extend(f"  {a}" for a in slow_machines(view))
    lines.append("standby: " + (", ".join(str(m["node"]) for m in standby) or "none"))
    lines.append("alerts:" if alerts else "alerts: none")
    lines.extend(alerts)
    return "\n".join(lines)


def _metric(ms: list[dict[str, Any]]) -> str | None:
    """compute_ms when every machine has it (data parallelism evens out iteration times, not
    compute), else p50_ms when every machine has that, else None."""
    for metric in ("compute_ms", "p50_ms"):
        if ms and all(m.get(metric) is not None for m in ms):
            return metric
    return None


def slow_machines(view: dict[str, Any], factor: float = 1.5, min_ms: float = 1.0) -> list[str]:
    """Alerts for active machines slower than ``factor`` times the other active machines'
    median (compute time per iteration; iteration time where compute is not seen)."""
    active = [m for m in view["machines"] if m.get("role") == "active"]
    metric = _metric(active)
    if metric is None or len(active) < 2:
        return []
    out = []
    for m in active:
        mine = float(m[metric])
        others = statistics.median(float(p[metric]) for p in active if p is not m)
        if mine > factor * others and mine - others >= min_ms:
            out.append(
                f"[straggler] machine {m['node']}: {metric} {mine:.1f} ms vs {others:.1f} ms on "
                f"the other active machines (x{mine / others if others else float('inf'):.2f})"
            )
    return out


def _live(m: dict[str, Any]) -> int:
    n = m.get("live_ranks")
    return int(n) if isinstance(n, int) else len(m.get("ranks") or {})


def _f(v: Any, spec: str = "") -> str:
    return "-" if v is None else format(v, spec)


# -- straggler swap ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Retirement:
    """The judge's decision: which machine gives its place to a standby, and why."""

    node: str
    """The straggler's node id."""
    reason: str
    """Why (the figures compared, the standby that waits)."""
    t: float | None = None
    """The time of the straggler's summary the decision is based on, by the straggler's own
    clock (its launcher acts only on a decision about its own summaries, never on one about a
    former launcher of the same node id)."""

    def encode(self) -> bytes:
        """The value of :func:`straggler_key`."""
        doc = {"node": self.node, "reason": self.reason, "t": self.t}
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, value: bytes) -> Retirement | None:
        """Inverse of :meth:`encode`; None (logged) for a value it cannot read."""
        try:
            doc = json.loads(value)
            return cls(node=str(doc["node"]), reason=str(doc["reason"]), t=_num(doc.get("t")))
        except (ValueError, TypeError, KeyError) as exc:
            logger.warning("ignoring an unreadable straggler decision %r: %s", value[:200], exc)
            return None


@dataclass(kw_only=True, slots=True)
class StragglerSwap:
    """Decides which machine should give its place to a standby (see the module docstring).

    The judge feeds it one job view per check with :meth:`judge`; it answers with the machine
    to retire, or None.
    """

    factor: float = 1.5
    """Slower than this many times the other active machines' median counts as straggling."""
    min_ms: float = 1.0
    """Differences below this many milliseconds never count (timer noise)."""
    persist: int = 5
    """Consecutive checks flagged before retiring (at 2 s a check: 10 s)."""
    max_age_s: float = 30.0
    """Summaries older than this (by the reader's clock) are left out of the comparison."""
    flagged: int = field(default=0, init=False)
    """Consecutive checks the current candidate (the slowest machine) was flagged so far."""
    candidate: str | None = field(default=None, init=False)
    """The machine flagged at the last check, if any."""

    def __post_init__(self) -> None:
        if self.factor <= 1:
            raise ValueError(f"straggler factor {self.factor}: must be > 1")
        if self.persist < 1:
            raise ValueError(f"straggler persist {self.persist}: must be at least 1 check")

    def judge(self, view: dict[str, Any]) -> Retirement | None:
        """One check of the whole job.

        Args:
            view: The job view (:func:`read_job_view`).

        Returns:
            The machine to retire now and why, or None.
        """
        ms = view["machines"]
        active = [
            m
            for m in ms
            if m.get("role") == "active"
            and (m.get("age_s") is None or m["age_s"] <= self.max_age_s)
        ]
        metric = _metric(active)
        if metric is None or len(active) < 2:
            self.flagged, self.candidate = 0, None
            return None
        slowest = max(active, key=lambda m: (float(m[metric]), str(m.get("node"))))
        node = str(slowest.get("node"))
        mv = float(slowest[metric])
        others = statistics.median(float(m[metric]) for m in active if m is not slowest)
        if not (mv > self.factor * others and mv - others >= self.min_ms):
            self.flagged, self.candidate = 0, None
            return None
        if node != self.candidate:
            self.flagged, self.candidate = 0, node
        self.flagged += 1
        standbys = [m["node"] for m in ms if m.get("role") == "standby"]
        if self.flagged < self.persist or not standbys:
            return None
        ratio = mv / others if others else float("inf")
        reason = (
            f"machine {node} is a straggler: {metric} {mv:.1f} ms vs {others:.1f} ms median of the "
            f"other {len(active) - 1} active machine(s) (x{ratio:.2f} for {self.flagged} checks); "
            f"standby {', '.join(map(str, standbys))} waits"
        )
        return Retirement(node=node, reason=reason, t=_num(slowest.get("t")))

    def observe(self, me: str, view: dict[str, Any]) -> str | None:
        """One check, answered for one machine: why ``me`` should retire now, or None."""
        decision = self.judge(view)
        return decision.reason if decision is not None and decision.node == me else None


# -- the publisher thread ---------------------------------------------------------------------
class JobViewPublisher:
    """Publishes this machine's summary to etcd every ``period_s``; takes part in the swap.

    With ``swap``, each round also reads :func:`straggler_key` (one key); the machine of group
    rank 0 (the judge) reads the job view too and runs the policy (see the module docstring).

    Args:
        client: The launcher's etcd client.
        job_prefix: The job's prefix.
        node_id: This machine's node id.
        host: Its host name.
        publish: Writes a key bound to the machine's node lease; False when there is no lease
            (:meth:`flashckpt.elastic.membership.nodes.NodeRegistry.publish`).
        agent_status: Returns the node agent's ``status()`` (None when it does not answer);
            see :func:`agent_status`.
        role: This machine's role and group rank now.
        restarts: Worker-group restarts seen by this launcher.
        period_s: Seconds between summaries.
        swap: The straggler swap policy, used when this machine judges (None: never swap, and
            never judge).
        on_retire: Called once, from this thread, with the reason when the judge names this
            machine.
    """

    def __init__(
        self,
        *,
        client: EtcdClient,
        job_prefix: str,
        node_id: str,
        host: str,
        publish: Callable[[str, bytes], bool],
        agent_status: Callable[[], dict[str, Any] | None],
        role: Callable[[], tuple[str, int | None]],
        restarts: Callable[[], int],
        period_s: float = 2.0,
        swap: StragglerSwap | None = None,
        on_retire: Callable[[str], None] | None = None,
    ) -> None:
        if period_s <= 0:
            raise ValueError(f"period_s={period_s}: must be > 0 seconds")
        self._client = client
        self._job_prefix = job_prefix
        self.key = summaries_prefix(job_prefix) + node_id
        self._node = node_id
        self._host = host
        self._publish = publish
        self._agent_status = agent_status
        self._role = role
        self._restarts = restarts
        self._period = period_s
        self._swap = swap
        self._on_retire = on_retire
        self._retired = False
        self._first_t: float | None = None  # this publisher's first summary, by this clock
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="flashckpt-jobview", daemon=True)
        self.last: dict[str, Any] | None = None
        """The last summary published."""

    def start(self) -> None:
        """Starts the thread; returns at once."""
        self._thread.start()

    def close(self, timeout: float | None = None) -> None:
        """Stops the thread (the summary goes with the node lease). Never raises.

        Args:
            timeout: Seconds to wait for a round in flight (an etcd write may hang while etcd
                is unreachable); default: one period plus the agent's answer time. The thread
                is a daemon: one still blocked ends with the process, and its late write fails
                on the revoked lease.
        """
        self._stop.set()
        if timeout is None:
            timeout = self._period + _AGENT_TIMEOUT_S + 2
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=timeout)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception:  # the launcher lives on; one failed round must not end this
                logger.exception("publishing this machine's summary failed (will retry)")
            self._stop.wait(self._period)

    def tick(self) -> dict[str, Any]:
        """One round: summary to etcd, then the swap policy. Returns the summary."""
        role, group_rank = self._role()
        summary = machine_summary(
            node_id=self._node,
            host=self._host,
            role=role,
            group_rank=group_rank,
            restarts=self._restarts(),
            agent_status=self._agent_status(),
        )
        data = json.dumps(summary, separators=(",", ":"), allow_nan=False, default=str)
        try:
            self._publish(self.key, data.encode())
        except EtcdError as exc:
            logger.warning("cannot publish this machine's summary to etcd: %s", exc)
        self.last = summary
        if self._first_t is None:
            self._first_t = float(summary["t"])
        if self._swap is not None and not self._retired and self._on_retire is not None:
            try:
                self._check_swap(role, group_rank)
            except EtcdError as exc:
                logger.warning("cannot check the job's stragglers in etcd: %s", exc)
        return summary

    def _check_swap(self, role: str, group_rank: int | None) -> None:
        """The straggler swap's part of a round: the judge (the active machine of group rank
        0) reads the job view and names a straggler; every other machine reads the name."""
        key = straggler_key(self._job_prefix)
        kv = self._client.get_kv(key)
        named = Retirement.decode(kv.value) if kv is not None else None
        if not (role == "active" and group_rank == 0):
            # A decision about a former launcher of this node id (its summaries are older than
            # this one's first) is not this launcher's.
            if named is None or named.node != self._node or role != "active":
                return
            if named.t is None or self._first_t is None or named.t >= self._first_t:
                self._retire(named.reason)
            return
        assert self._swap is not None
        view = read_job_view(self._client, self._job_prefix)
        if named is not None and kv is not None:
            m = next((m for m in view["machines"] if m.get("node") == named.node), None)
            if m is None or m.get("state") is None or m.get("role") != "active":
                # Gone (or no longer active): a later straggler may be named.
                self._client.compare_and_delete(key, mod_revision=kv.mod_revision)
                named = None
            elif named.node == self._node:  # named by a former judge
                self._retire(named.reason)
                return
            else:
                return  # one swap at a time: the named machine is on its way out
        decision = self._swap.judge(view)
        if decision is None:
            return
        if decision.node == self._node:
            self._retire(decision.reason)
        elif self._publish(key, decision.encode()):  # bound to this machine's node lease
            logger.warning("naming machine %s for a standby's place: %s", decision.node,
                           decision.reason)  # fmt: skip
            self._swap.flagged, self._swap.candidate = 0, None

    def _retire(self, reason: str) -> None:
        assert self._on_retire is not None
        self._retired = True
        logger.warning("retiring this machine so a standby takes its place: %s", reason)
        self._on_retire(reason)


def agent_status(path: str | None) -> dict[str, Any] | None:
    """Asks the node agent on socket ``path`` for its ``status()``; None if it does not answer."""
    from flashckpt.protocol.channel import AgentClient, AgentError

    if path is None:
        return None
    try:
        client = AgentClient(path, timeout=_AGENT_TIMEOUT_S)
    except AgentError:
        return None
    try:
        reply = client.request("status", timeout=_AGENT_TIMEOUT_S)
    except AgentError:
        return None
    finally:
        with contextlib.suppress(Exception):
            client.close()
    reply.pop("id", None)
    reply.pop("ok", None)
    return reply
