"""The name of our rendezvous backend, below both :mod:`flashckpt.elastic.rendezvous.backend` (which
reports it to torch) and :mod:`flashckpt.elastic.rendezvous.registry` (which registers it), so
neither imports the other for it. Imports nothing.
"""

from __future__ import annotations

__all__ = ["BACKEND_NAME"]

BACKEND_NAME = "flashckpt-etcd"
"""The name users pass as ``--rdzv-backend`` (public: torchrun command lines name it)."""
