"""A long-lived etcd v3 watch that hands over its events (key, value, previous value).

The implementation is :class:`flashckpt.elastic.etcd.client.WatchStream`, the one watch of the
client (:meth:`~flashckpt.elastic.etcd.client.EtcdClient.watch_events` and
:meth:`~flashckpt.elastic.etcd.client.EtcdClient.wait_for_change` run on it too); this module
keeps the names the rendezvous handler imports (:mod:`flashckpt.elastic.rendezvous.handler`).
"""

from __future__ import annotations

from flashckpt.elastic.etcd.client import (
    WatchClosed,
    WatchCompacted,
    WatchEvent,
    WatchStream,
    prefix_end,
)

__all__ = ["WatchClosed", "WatchCompacted", "WatchEvent", "WatchStream", "prefix_end"]
