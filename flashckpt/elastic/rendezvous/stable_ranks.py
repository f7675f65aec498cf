"""Stable group ranks: a machine that survives a rendezvous round keeps its rank in the next one.

torch's ``DynamicRendezvousHandler`` numbers the machines of every round afresh, in the order of
their node descriptors. When the machine of rank 0 dies, the survivor of rank 1 becomes rank 0
of the next round: its own memory holds the snapshots of old rank 1, and in a fully sharded job
no machine holds what new rank 0 needs, so the job started over.

Our rendezvous (:mod:`flashckpt.elastic.rendezvous.handler`) numbers each round with
:func:`assign_ranks`: each machine joins with its *claim* (its rank in the last round it was a
member of, held in its own memory and written in its join key), and the round's lead keeps every
claim that fits the new world and is not taken by a newer one; standbys and new machines fill the
free ranks (a standby takes a dead machine's rank).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["RankClaim", "assign_ranks"]


@dataclass(frozen=True, slots=True)
class RankClaim:
    """A machine's rank in an earlier round, which it claims again in the current one."""

    round: int
    """The round the machine had the rank in."""
    rank: int
    """Its group rank in that round."""

    def __post_init__(self) -> None:
        for name in ("round", "rank"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise ValueError(f"RankClaim.{name} must be an int >= 0, got {value!r}")


def assign_ranks(participants: Sequence[str], claims: Mapping[str, RankClaim]) -> dict[str, int]:
    """The group rank of each machine of a round.

    A machine keeps its claimed rank if that rank is below the round's world size and no newer
    claim takes it (claims of newer rounds first, ties in ``participants`` order); the other
    machines take the free ranks in ascending order, in ``participants`` order.

    Args:
        participants: The round's machines in torch's order (sorted node descriptors): with no
            claims the result is torch's own numbering.
        claims: Each machine's claim, if it has one; claims of non-participants are ignored.

    Returns:
        Machine -> rank, a permutation of ``range(len(participants))``.

    Raises:
        ValueError: If a machine appears twice in ``participants``.
    """
    world = len(participants)
    order = {node: i for i, node in enumerate(participants)}
    if len(order) != world:
        raise ValueError(f"a machine appears twice among the participants: {list(participants)}")
    claimants = sorted(
        (n for n in participants if n in claims and claims[n].rank < world),
        key=lambda n: (-claims[n].round, order[n]),
    )
    ranks: dict[str, int] = {}
    taken: set[int] = set()
    for node in claimants:
        rank = claims[node].rank
        if rank not in taken:
            ranks[node] = rank
            taken.add(rank)
    free = (r for r in range(world) if r not in taken)
    for node in participants:
        if node not in ranks:
            ranks[node] = next(free)
    return ranks
