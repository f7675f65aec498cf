"""Registers the ``flashckpt-etcd`` rendezvous backend with torchrun.

torch discovers out-of-tree rendezvous handlers through the ``torchrun.handlers`` entry-point
group when ``torch.distributed.elastic.rendezvous`` is first imported: it loads each entry point,
calls it with no arguments, and registers what it returns as the handler creator
(``RendezvousParameters -> RendezvousHandler``) under the entry point's name. Our
``pyproject.toml`` declares::

    [project.entry-points."torchrun.handlers"]
    flashckpt-etcd = "flashckpt.elastic.rendezvous.registry:get_handler_creator"

so that ``torchrun --rdzv-backend=flashckpt-etcd --rdzv-endpoint=host:2379 ...`` works.

This module imports nothing from torch at import time: torch loads it *while* its rendezvous
package is still initializing, and importing that package back from here would be a cycle.
The backend name lives in :mod:`flashckpt.elastic.rendezvous.name`, which both modules import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flashckpt.elastic.rendezvous.name import BACKEND_NAME

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters

__all__ = ["BACKEND_NAME", "create_handler", "get_handler_creator", "register"]


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Creates our etcd v3 rendezvous handler; see
    :func:`flashckpt.elastic.rendezvous.backend.create_handler`."""
    # Imported when torch calls this, not when torch loads the entry point:
    # flashckpt.elastic.rendezvous.backend
    # imports torch's rendezvous package, which is still initialising at that point.
    from flashckpt.elastic.rendezvous.backend import create_handler as _create_handler

    return _create_handler(params)


def get_handler_creator() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The ``torchrun.handlers`` entry point: returns the handler creator for torch to register.

    Returns:
        :func:`create_handler`.
    """
    return create_handler


def register() -> None:
    """Registers ``flashckpt-etcd`` with torch's handler registry explicitly.

    Only needed where the package's entry points are not installed (for example when running
    from a source tree on ``PYTHONPATH``). Registering twice is harmless.
    """
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(BACKEND_NAME, create_handler)
