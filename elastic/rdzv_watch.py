"""Event-driven rendezvous: torch's handler wakes on an etcd watch instead of polling each second.

torch's ``DynamicRendezvousHandler`` polls the shared state while it waits for other nodes: each
poll sleeps one second (``_delay(seconds=1)``), and its state holder serves a cached copy for
another second. Forming a round after a failure takes several such polls (leave the old round,
join the wait list, see the dead node dropped, join the new round, see it complete), so about
2 s of a failover is spent sleeping.

:func:`create_watching_handler` builds the same handler, but:

- its state holder (:class:`WatchingStateHolder`) can wait on an etcd watch of the state key
  and drop its cache when the key changed;
- the one-second sleep of the wait loop is replaced by that wait, so a node wakes as soon as
  another node writes the state, and still wakes every second when nothing happens (the
  handler's timeouts and keep-alives behave as before);
- the handler's event records name their method with a frame lookup instead of
  ``inspect.stack()``, which reads the source of every frame (tens of milliseconds per state
  change on a busy machine).

This reaches into torch internals (``_BackendRendezvousStateHolder``,
``_DistributedRendezvousOpExecutor``, the module-level ``_delay`` and ``get_method_name``, all
replaced in the launcher process only), which have been stable
through torch 2.x. If they are missing or differ, the handler is left as torch built it: slower,
equally correct.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import weakref
from datetime import timedelta
from typing import Any

from torch.distributed import Store
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as _dr

from elastic.etcd import EtcdError
from elastic.rendezvous import EtcdRendezvousBackend

__all__ = ["WatchingStateHolder", "create_watching_handler"]

logger = logging.getLogger(__name__)

_SYNC_DELAY_S = 1  # the argument of torch's wait-loop sleep
_original_delay = getattr(_dr, "_delay", None)
_holders: weakref.WeakSet[Any] = weakref.WeakSet()
_install_lock = threading.Lock()
_installed = False

_HolderBase: Any = getattr(_dr, "_BackendRendezvousStateHolder", object)


class WatchingStateHolder(_HolderBase):
    """torch's backend state holder that can wait for the next change of the etcd state key.

    Args:
        backend: Our etcd rendezvous backend.
        settings: The handler's settings.
    """

    def __init__(self, backend: EtcdRendezvousBackend, settings: Any) -> None:
        super().__init__(backend, settings)
        self._etcd = backend
        self._owner = threading.get_ident()

    def sync(self) -> bool | None:
        """See torch's ``_BackendRendezvousStateHolder.sync``; logs each sync when debugging."""
        start = time.monotonic()
        result: bool | None = super().sync()
        if logger.isEnabledFor(logging.DEBUG):
            state = self.state
            logger.debug(
                "rendezvous sync %.3f s: set=%s round=%s complete=%s participants=%d wait=%d "
                "standby=%d",
                time.monotonic() - start,
                result,
                getattr(state, "round", "?"),
                getattr(state, "complete", "?"),
                len(getattr(state, "participants", ())),
                len(getattr(state, "wait_list", ())),
                len(getattr(state, "redundancy_list", ())),
            )
        return result

    def wait_for_change(self, seconds: float) -> None:
        """Blocks until the state key changes after the copy we hold, or ``seconds`` pass.

        On a change the cached copy is invalidated, so the next ``sync()`` reads etcd.
        """
        start = time.monotonic()
        token = getattr(self, "_token", None)
        if type(token) is not int or token <= 0:
            logger.debug("rendezvous wait: no token (%r), sleeping %g s", token, seconds)
            time.sleep(seconds)
            return
        try:
            changed = self._etcd.client.wait_for_change(
                self._etcd.key, after_revision=token, timeout=timedelta(seconds=seconds)
            )
        # Only etcd's own failures: torch's SignalException (SIGTERM/SIGINT) is an Exception too,
        # and must end the wait, not be slept through.
        except EtcdError as exc:  # etcd unreachable: behave like torch's plain sleep
            logger.debug("watching the rendezvous state failed: %s", exc)
            time.sleep(max(0.0, seconds - (time.monotonic() - start)))
            return
        logger.debug(
            "rendezvous wait: %s after %.3f s (token %s)",
            "state changed" if changed else "no change",
            time.monotonic() - start,
            token,
        )
        if changed:
            self._last_sync_time = -1


def _event_driven_delay(seconds: float | tuple[float, float]) -> None:
    if seconds == _SYNC_DELAY_S:
        me = threading.get_ident()
        for holder in list(_holders):
            if holder._owner == me:
                holder.wait_for_change(float(seconds))
                return
    assert _original_delay is not None
    _original_delay(seconds)


def _fast_method_name(depth: int = 2) -> str:
    # torch's get_method_name() calls inspect.stack() twice, which reads the source of every
    # frame: tens of milliseconds per call on a busy machine, several calls per state change.
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:
        return "no_method_name"


def _install() -> bool:
    global _installed
    with _install_lock:
        if _installed:
            return True
        if _original_delay is None or not hasattr(_dr, "_DistributedRendezvousOpExecutor"):
            return False
        _dr._delay = _event_driven_delay
        if hasattr(_dr, "get_method_name"):
            _dr.get_method_name = _fast_method_name
        _installed = True
        return True


def create_watching_handler(
    store: Store, backend: EtcdRendezvousBackend, params: RendezvousParameters
) -> _dr.DynamicRendezvousHandler:
    """Builds torch's dynamic rendezvous handler with event-driven waits (see module docstring).

    Call it from the thread that will call ``next_rendezvous()`` (the launcher's main thread):
    only that thread's waits are event-driven.

    Args:
        store: The store handed to torch.
        backend: Our etcd backend.
        params: The rendezvous parameters (torch's options are parsed as usual).
    """
    handler = _dr.create_handler(store, backend, params)
    if _HolderBase is object or not _install():
        logger.info("torch internals differ; rendezvous waits poll every second")
        return handler
    try:
        settings = handler._settings
        holder = WatchingStateHolder(backend, settings)
        executor = _dr._DistributedRendezvousOpExecutor(handler._this_node, holder, settings)
        handler._state_holder = holder
        handler._op_executor = executor
    except (AttributeError, TypeError) as exc:
        logger.info("torch internals differ (%s); rendezvous waits poll every second", exc)
        return handler
    _holders.add(holder)
    return handler
