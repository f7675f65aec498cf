"""What ``flashckpt status`` prints: the status of every node agent of a run directory, and
its one-screen table (machines, ranks, steps, step times, snapshots, alerts).

:func:`by_global_rank` is the one place that re-keys an agent status's ``ranks`` by global rank,
as the monitor's summary is keyed (the metrics and the cluster-wide job view use it too).
"""

from __future__ import annotations

import glob
import os
import time
from typing import Any

__all__ = ["by_global_rank", "collect_status", "format_status"]


def by_global_rank(agent_ranks: dict[str, Any]) -> dict[str, Any]:
    """The agent status's ``ranks`` (keyed by local rank) keyed by global rank, like the
    monitor's (an entry without ``rank`` keeps its key)."""
    out: dict[str, Any] = {}
    for key, d in agent_ranks.items():
        r = d.get("rank") if isinstance(d, dict) else None
        out[str(r) if isinstance(r, int) else str(key)] = d
    return out


def collect_status(
    run_dir: str,
    job: str | None = None,
    timeout: float = 0.8,
    *,
    show_dead: bool = False,
) -> list[dict[str, Any]]:
    """Asks every node agent whose socket is in ``run_dir`` (or one level below it, where a
    launcher keeps each agent generation) for its status, all at once, within ``timeout``.

    A socket nobody listens on (its agent is gone: killed, or a finished job's leftover) is
    found with one connect attempt and left out unless ``show_dead``: it is no machine of a live
    job, and waiting on each one (the agent client's connect retries) made a run directory full
    of them take seconds.

    Returns:
        One dict per socket: the agent's ``status()``, or ``{"socket", "error"}`` if it did not
        answer in time or is not this user's (a dead one also has ``"dead": True``).
    """
    from concurrent.futures import ThreadPoolExecutor

    socks = sorted(
        set(glob.glob(os.path.join(run_dir, "*.sock")))
        | set(glob.glob(os.path.join(run_dir, "*", "*.sock")))
    )
    if job is not None:
        socks = [p for p in socks if os.path.basename(p).startswith(f"{job}.")]
    if not socks:
        return []
    deadline = time.monotonic() + timeout
    with ThreadPoolExecutor(max_workers=min(32, len(socks))) as pool:
        found = list(pool.map(lambda path: _ask(path, deadline), socks))
    return [a for a in found if show_dead or not a.get("dead")]


def _ask(path: str, deadline: float) -> dict[str, Any]:
    """One agent's status, or why there is none."""
    import socket

    from flashckpt.errors import UnsafeLocalStateError
    from flashckpt.protocol.channel import AgentClient, AgentError, check_socket

    try:
        check_socket(path)  # a foreign socket is never connected to
    except UnsafeLocalStateError as e:
        return {"socket": path, "error": str(e)}
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(max(0.01, deadline - time.monotonic()))
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError) as e:
        return {"socket": path, "error": f"no node agent listening ({e})", "dead": True}
    except OSError as e:
        return {"socket": path, "error": f"cannot connect: {e}"}
    finally:
        probe.close()
    left = max(0.05, deadline - time.monotonic())
    try:
        client = AgentClient(path, timeout=left)
    except (AgentError, UnsafeLocalStateError) as e:
        return {"socket": path, "error": str(e)}
    try:
        st = client.request("status", timeout=max(0.05, deadline - time.monotonic()))
        st.pop("id", None)
        st.pop("ok", None)
        return {"socket": path, **st}
    except AgentError as e:
        return {"socket": path, "error": str(e)}
    finally:
        client.close()


def format_status(agents: list[dict[str, Any]]) -> str:
    """The live job at a glance: machines, ranks, steps, step times, snapshots, alerts.

    Every step column counts steps completed (``ckpt.steps_done``): the newest one a rank
    finished, its newest snapshot in memory, the newest committed."""
    live = [a for a in agents if "error" not in a]
    if not agents:
        return (
            "no live node agent found (is the job running? pass its --run-dir; --all also "
            "lists dead agents' sockets)"
        )
    jobs = sorted({a.get("job", "?") for a in live})
    nranks = sum(len((a.get("monitor") or {}).get("ranks", {})) for a in live)
    lines = [
        f"job {', '.join(jobs) or '?'}: {len(live)} machine(s) reachable"
        + (f", {len(agents) - len(live)} not answering" if len(agents) > len(live) else "")
        + f", {nranks} rank(s)"
    ]
    head = (
        f"{'node':<12} {'rank':>5} {'pid':>8} {'state':<10} {'step':>8} {'p50 ms':>9} "
        f"{'p99 ms':>9} {'snapshot':>9} {'persisted':>9} {'restarts':>8}"
    )
    lines.append(head)
    alerts: list[str] = []
    for a in sorted(live, key=lambda a: str(a.get("node"))):
        mon = a.get("monitor") or {}
        committed = max(a.get("committed") or [], default=None)
        slot_ranks = by_global_rank(a.get("ranks") or {})
        mranks = mon.get("ranks", {})
        for r in sorted({*mranks, *slot_ranks}, key=int):
            d = mranks.get(r, {})
            snaps = [s for s in (slot_ranks.get(r, {}).get("slots") or []) if s is not None]
            lines.append(
                f"{a.get('node')!s:<12} {r:>5} {_fmt(d.get('pid')):>8} "
                f"{d.get('state', '-')!s:<10} {_fmt(steps_done_of_ring(d.get('step'))):>8} "
                f"{_fmt(d.get('p50_ms'), '.1f'):>9} {_fmt(d.get('p99_ms'), '.1f'):>9} "
                f"{_fmt(max(snaps, default=None)):>9} {_fmt(committed):>9} "
                f"{_fmt(d.get('restarts', 0)):>8}"
            )
        for al in mon.get("alerts", []):
            alerts.append(f"  [{al.get('kind')}] {a.get('node')}: {al.get('message')}")
        gp = mon.get("goodput") or {}
        if gp.get("ranks"):
            lines.append(
                f"{'':<12} goodput so far {100 * gp['goodput']:.1f}% of {gp['wall_s']:.0f} s"
                f" (restarts {gp['restarts']})"
            )
        rep = _replication_line(a.get("replication"))
        if rep:
            lines.append(f"{'':<12} {rep}")
    for a in agents:
        if "error" in a:
            lines.append(f"not answering: {a['socket']}: {a['error']}")
    lines.append("alerts:" if alerts else "alerts: none")
    lines.extend(alerts)
    return "\n".join(lines)


def _replication_line(rep: Any) -> str:
    """Replicas sent (target, rank, step, age) and held (sender, rank, step), failures."""
    if not isinstance(rep, dict):
        return ""
    now = time.time()
    parts = []
    sent = [
        f"{s.get('target')} r{s.get('rank')} step {s.get('step')} "
        f"({max(0.0, now - float(s.get('time') or now)):.0f} s ago)"
        for s in rep.get("sent") or []
        if isinstance(s, dict)
    ]
    held = [
        f"{h.get('sender')} r{h.get('rank')} step {h.get('step')}"
        for h in rep.get("held") or []
        if isinstance(h, dict)
    ]
    parts.append("sent " + (", ".join(sent) if sent else "none"))
    if rep.get("listen"):
        parts.append("held " + (", ".join(held) if held else "none"))
    if rep.get("failures"):
        parts.append(f"{rep['failures']} failed")
    return "replicas: " + "; ".join(parts)


def steps_done_of_ring(ring_step: Any) -> int | None:
    """Steps completed (``ckpt.steps_done``, as every step flashckpt prints) from the monitor's
    ``step``, the 0-based index of the newest iteration in the rank's step ring."""
    return ring_step + 1 if isinstance(ring_step, int) else None


def _fmt(v: Any, spec: str = "") -> str:
    if v is None:
        return "-"
    return format(v, spec)
