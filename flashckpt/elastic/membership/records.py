"""A launcher's node record (:class:`NodeRecord`) and its key under the job's prefix. Split out of
:mod:`flashckpt.elastic.membership.nodes` (issue 45), which re-exports the
public names.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from datetime import datetime, timezone

from flashckpt.elastic.etcd.client import (
    KeyValue,
)
from flashckpt.errors import ElasticJobError


def nodes_prefix(job_prefix: str) -> str:
    """The etcd prefix of a job's node keys, given the job's prefix (ending in ``/``)."""
    return job_prefix + "nodes/"


class NodeIdInUse(ElasticJobError, RuntimeError):
    """Another live launcher of this job already registered the same node id."""


@dataclass(frozen=True, slots=True)
class NodeRecord:
    """What a launcher publishes about itself under its node key."""

    node_id: str
    """The launcher's ``--node-id``."""
    host: str
    """The host name of its machine."""
    pid: int
    """The launcher's process id."""
    token: str
    """A random id of this launcher instance (answered by its probe port)."""
    probe: str
    """``host:port`` of its probe listener; empty if it has none."""
    state: str = "starting"
    """``starting``, ``waiting`` (in the rendezvous, standby included), ``active`` or
    ``leaving``."""
    rdzv_node: str | None = None
    """torch's rendezvous node descriptor of this launcher (``addr_pid_localid``)."""
    group_rank: int | None = None
    """Its rank among the machines of the current round, when active."""
    lease: int = 0
    """The etcd lease the key is bound to (filled in when read)."""
    replica: str = ""
    """``host:port`` of its node agent's replica server (other machines send it replicas of
    their snapshots there); empty if it holds none."""
    done: bool = False
    """Set as it leaves (``leaving``): its workers finished the job. A machine that left done
    broke nothing for workers still running elsewhere; one that left otherwise (signalled,
    preempted, retired for a standby, failed) took its workers out of their round."""
    rdzv_member: int | None = None
    """While ``active``: its id among the members of its rendezvous round (its join key's
    ``create_revision``, :attr:`RdzvHandler.member_id
    <flashckpt.elastic.rendezvous.handler.RdzvHandler.member_id>`): whether a peer that went
    was in this machine's round is read from its last record, not from the round's join keys."""

    @property
    def left_done(self) -> bool:
        """It left with its workers done: nothing of its round was broken by its leaving."""
        return self.state == "leaving" and self.done

    def to_json(self) -> bytes:
        """The key's value."""
        data = asdict(self)
        data.pop("lease")
        return json.dumps(data, separators=(",", ":")).encode()

    @classmethod
    def from_kv(cls, kv: KeyValue) -> NodeRecord | None:
        """Parses a node key; ``None`` if it is not one of ours."""
        try:
            data = json.loads(kv.value)
            fields = {k: data[k] for k in cls.__dataclass_fields__ if k in data and k != "lease"}
            # Only a true JSON boolean says done: anything else is the safer "not done".
            fields["done"] = fields.get("done") is True
            if type(fields.get("rdzv_member")) is not int:
                fields["rdzv_member"] = None
            return cls(**fields, lease=kv.lease)
        except (ValueError, TypeError, KeyError):
            return None


def _record_or_none(kv: KeyValue | None) -> NodeRecord | None:
    return NodeRecord.from_kv(kv) if kv is not None else None


_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
