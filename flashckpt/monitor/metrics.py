"""Prometheus metrics of the node agent's step monitor: the metric families and the endpoint
that serves them (the standard ``prometheus_client`` library, imported only when an endpoint
is asked for).
"""

from __future__ import annotations

import logging
import socketserver
import threading
from collections.abc import Callable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from flashckpt.monitor.goodput import CATEGORIES
from flashckpt.monitor.statusview import by_global_rank, steps_done_of_ring

__all__ = ["MetricsServer", "metric_families", "serve_metrics"]

log = logging.getLogger("flashckpt.monitor.step_monitor")


class MetricsServer(socketserver.ThreadingMixIn, WSGIServer):
    """The metrics endpoint: one thread per scrape."""

    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


class _Collector:
    def __init__(self, collect: Callable[[], list[Any]]) -> None:
        self._collect = collect

    def collect(self) -> Any:
        try:
            yield from self._collect()
        except Exception:  # a scrape must never take the agent down
            log.exception("monitor: collecting metrics failed")


def serve_metrics(addr: str, port: int, collect: Callable[[], list[Any]]) -> MetricsServer:
    """Serves ``collect()``'s metric families on ``addr:port`` from a daemon thread.

    Args:
        addr: the address to bind.
        port: the port (0: a free one chosen by the OS; read it from ``server_address``).
        collect: returns the current metric families (:func:`metric_families`).

    Raises:
        RuntimeError: prometheus_client is missing or the port cannot be bound (the message
            names the fix).
    """
    try:
        from prometheus_client import CollectorRegistry, make_wsgi_app
    except ImportError:
        raise RuntimeError(
            "metrics_port is set but prometheus_client is not installed: "
            "pip install prometheus_client (or leave --metrics-port at 0)"
        ) from None
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(collect))
    try:
        server = make_server(
            addr,
            port,
            make_wsgi_app(registry),
            server_class=MetricsServer,
            handler_class=_QuietHandler,
        )
    except OSError as e:
        raise RuntimeError(
            f"cannot serve metrics on {addr}:{port}: {e}; pick a free "
            "--metrics-port (0 = no endpoint)"
        ) from None
    threading.Thread(
        target=server.serve_forever, name="flashckpt-agent-metrics", daemon=True
    ).start()
    return server


def metric_families(
    *, job: str, node: str, status: dict[str, Any], summary: dict[str, Any]
) -> list[Any]:
    """The current metrics, as prometheus_client metric families.

    Args:
        job: the job id (a label of every metric).
        node: the node id (a label of every metric).
        status: the agent's ``status()`` (snapshots and committed steps); may be empty.
        summary: the monitor's summary
        (:meth:`flashckpt.monitor.step_monitor.AgentMonitor.summary`).
    """
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    agent_ranks = by_global_rank(status.get("ranks") or {})
    base = ["job", "node", "rank"]
    lv = [job, node]

    def gauge(name: str, doc: str, extra: list[str] | None = None) -> GaugeMetricFamily:
        return GaugeMetricFamily(name, doc, labels=base + (extra or []))

    fam_step = gauge("flashckpt_step", "steps completed (as ckpt.steps_done)")
    fam_steps = CounterMetricFamily(
        "flashckpt_steps", "iterations recorded by this agent", labels=base
    )
    fam_time = gauge("flashckpt_step_time_seconds", "iteration time quantile", ["quantile"])
    fam_part = gauge("flashckpt_step_part_seconds", "median time per iteration part", ["part"])
    fam_ckpt = CounterMetricFamily(
        "flashckpt_checkpoint_stall_seconds", "time blocked by flashckpt", labels=base
    )
    fam_idle = gauge("flashckpt_seconds_since_progress", "seconds since the last step ended")
    fam_rest = CounterMetricFamily("flashckpt_restarts", "trainer restarts", labels=base)
    fam_hung = gauge("flashckpt_hung", "1 while the rank is flagged hung")
    fam_strag = gauge("flashckpt_straggler", "1 while the rank is flagged a straggler")
    fam_snap = gauge("flashckpt_last_snapshot_step", "newest complete snapshot in memory")
    for r, d in summary.get("ranks", {}).items():
        labels = [*lv, r]
        done = steps_done_of_ring(d.get("step"))
        if done is not None:
            fam_step.add_metric(labels, done)
        fam_steps.add_metric(labels, d["steps"])
        for q, key in (("0.5", "p50_ms"), ("0.99", "p99_ms")):
            if d.get(key) is not None:
                fam_time.add_metric([*labels, q], d[key] / 1e3)
        for part, v in (d.get("p50_parts_ms") or {}).items():
            if v is not None:
                fam_part.add_metric([*labels, part], v / 1e3)
        fam_ckpt.add_metric(labels, d["ckpt_total_s"])
        if d.get("idle_s") is not None:
            fam_idle.add_metric(labels, d["idle_s"])
        fam_rest.add_metric(labels, d["restarts"])
        fam_hung.add_metric(labels, 1.0 if d["state"] == "hung" else 0.0)
        fam_strag.add_metric(labels, 1.0 if d["straggler"] else 0.0)
        slots = [s for s in (agent_ranks.get(r, {}).get("slots") or []) if s is not None]
        if slots:
            fam_snap.add_metric(labels, max(slots))
    fam_commit = GaugeMetricFamily(
        "flashckpt_last_committed_step",
        "newest step committed to storage",
        labels=["job", "node"],
    )
    if status.get("committed"):
        fam_commit.add_metric(lv, max(status["committed"]))
    gp = summary.get("goodput") or {}
    fam_gp = GaugeMetricFamily(
        "flashckpt_goodput_ratio", "useful time over wall time", labels=["job", "node"]
    )
    fam_gps = GaugeMetricFamily(
        "flashckpt_goodput_seconds",
        "wall time per category (mean over ranks)",
        labels=["job", "node", "category"],
    )
    if gp.get("ranks"):
        fam_gp.add_metric(lv, gp["goodput"])
        for c in CATEGORIES:
            fam_gps.add_metric([*lv, c], gp["job_s"][c])
    return [
        fam_step,
        fam_steps,
        fam_time,
        fam_part,
        fam_ckpt,
        fam_idle,
        fam_rest,
        fam_hung,
        fam_strag,
        fam_snap,
        fam_commit,
        fam_gp,
        fam_gps,
    ]
