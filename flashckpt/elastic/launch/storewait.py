"""A worker's TCPStore client connects once its round's store listens, not up to ~0.75 s later.

Under ``flashckpt run`` worker rank 0 hosts a new TCPStore every round
(:func:`flashckpt.elastic.rendezvous.backend.use_fresh_worker_store`); the other workers connect to
it as clients from ``init_process_group``. Every worker of a round starts at the same moment, so a
client often comes before rank 0 listens. It is refused, and c10d's client then sleeps before it
tries again: an exponential backoff with jitter whose first pause is 0.25-0.75 s (a client 50 ms
early connected after 0.38-0.74 s, 4 tries). That was 4 of 8 sharded failovers on 2026-12-03:
+0.4-0.5 s to the job's kill -> first step (``benchmarks/failover.py``, ``init``).

So in the workers, c10d's ``_create_c10d_store`` first waits for the port itself when it is to
create a client: it tries a plain TCP connection every 10 ms (closed at once; the store counts
no worker for it) until one is accepted, then creates the client, which connects at once.
Nothing else changes: the same store, the same timeout, the same errors. A refusal until the
store's timeout, or any other error (an unknown host, an unreachable network), leaves it to
c10d's client, which fails as before.

:func:`install` is called in every worker before the user's code runs
(:func:`flashckpt.elastic.launch.usercode.run_user_code`): it wraps the function at once where torch
is imported (a worker forked from the pre-warmed zygote), else when ``torch.distributed.rendezvous``
is first imported (a cold start), so a worker that never uses torch does not import it.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import socket
import sys
import time
from collections.abc import Sequence
from datetime import timedelta
from types import ModuleType
from typing import Any

__all__ = ["install", "wait_listening"]

_TARGET = "torch.distributed.rendezvous"
_POLL_S = 0.01
_MARK = "_flashckpt_waits_for_the_store"


def wait_listening(host: str, port: int, timeout_s: float) -> bool:
    """Waits until ``host:port`` accepts a TCP connection (refusals are retried every 10 ms)
    or ``timeout_s`` passes. Returns whether it accepted; any error but a refusal (an unknown
    host, an unreachable network) ends the wait at once with False."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        try:
            with socket.create_connection((host, port), timeout=min(left, 1.0)):
                return True
        except ConnectionRefusedError:
            time.sleep(_POLL_S)
        except OSError:
            return False


def _wrap(module: ModuleType) -> None:
    """Wraps ``module._create_c10d_store`` (once)."""
    create = getattr(module, "_create_c10d_store", None)
    if create is None or getattr(create, _MARK, False):
        return

    def create_c10d_store(
        hostname: str, port: int, rank: int, world_size: int, timeout: Any, *args: Any, **kw: Any
    ) -> Any:
        # torch's own rule for who hosts the store: the agent (every worker a client), or
        # worker rank 0.
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
        if agent_store or rank != 0:
            seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else 300.0
            wait_listening(hostname, int(port), seconds)
        return create(hostname, port, rank, world_size, timeout, *args, **kw)

    setattr(create_c10d_store, _MARK, True)
    create_c10d_store.__doc__ = create.__doc__
    module._create_c10d_store = create_c10d_store  # type: ignore[attr-defined]


class _WrappingLoader(importlib.abc.Loader):
    """Runs the real loader, then wraps the module's store function."""

    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        _wrap(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... for tracebacks
        return getattr(self._inner, name)


class _Hook(importlib.abc.MetaPathFinder):
    """Finds ``torch.distributed.rendezvous`` as the other finders do, with a wrapping loader;
    leaves ``sys.meta_path`` once it did."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _TARGET:
            return None
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _WrappingLoader(spec.loader)
        return spec


def install() -> None:
    """Makes this process's c10d store clients wait for the store (see the module)."""
    module = sys.modules.get(_TARGET)
    if module is not None:
        _wrap(module)
    elif not any(isinstance(f, _Hook) for f in sys.meta_path):
        sys.meta_path.insert(0, _Hook())
