"""Stable group ranks (:func:`flashckpt.elastic.rendezvous.stable_ranks.assign_ranks`): what the
rendezvous' round
lead computes from the members' claims (the handler's use of it: ``test_rdzv_handler.py``)."""

from __future__ import annotations

import random

import pytest

from flashckpt.elastic.rendezvous.stable_ranks import RankClaim, assign_ranks

# -- the assignment ----------------------------------------------------------------------------


def test_without_claims_the_numbering_is_torchs() -> None:
    assert assign_ranks(["a", "b", "c"], {}) == {"a": 0, "b": 1, "c": 2}
    assert assign_ranks([], {}) == {}


def test_survivor_keeps_rank_1_when_rank_0_dies() -> None:
    # Round 3: a (rank 0) and b (rank 1); a dies, standby s joins. torch would make b rank 0.
    ranks = assign_ranks(["b", "s"], {"b": RankClaim(round=3, rank=1)})
    assert ranks == {"b": 1, "s": 0}


def test_survivor_keeps_rank_0_that_torchs_order_would_give_the_newcomer() -> None:
    assert assign_ranks(["a", "b"], {"b": RankClaim(round=0, rank=0)}) == {"a": 1, "b": 0}


def test_shrink_a_rank_beyond_the_new_world_takes_a_free_one() -> None:
    claims = {"a": RankClaim(round=2, rank=2), "b": RankClaim(round=2, rank=0)}
    assert assign_ranks(["a", "b"], claims) == {"a": 1, "b": 0}
    # Alone, the old rank 2 becomes rank 0.
    assert assign_ranks(["a"], {"a": RankClaim(round=2, rank=2)}) == {"a": 0}


def test_a_rejoined_node_with_an_old_record_loses_to_a_newer_claim() -> None:
    # f had rank 1 in round 1, was fenced; s took rank 1 in round 3; x is new. Both claim 1.
    claims = {"f": RankClaim(round=1, rank=1), "s": RankClaim(round=3, rank=1)}
    assert assign_ranks(["f", "s", "x"], claims) == {"s": 1, "f": 0, "x": 2}
    # The order of the participants does not change who wins: the newer claim.
    assert assign_ranks(["s", "f", "x"], claims) == {"s": 1, "f": 0, "x": 2}


def test_equal_claims_of_one_round_go_in_torchs_order() -> None:
    # Two records of the same round naming the same rank cannot come from our writes; they must
    # still give one answer everywhere.
    claims = {"a": RankClaim(round=5, rank=0), "b": RankClaim(round=5, rank=0)}
    assert assign_ranks(["a", "b"], claims) == {"a": 0, "b": 1}


def test_claims_of_non_participants_are_ignored() -> None:
    claims = {"gone": RankClaim(round=4, rank=0), "b": RankClaim(round=4, rank=1)}
    assert assign_ranks(["b", "new"], claims) == {"b": 1, "new": 0}


def test_duplicate_participants_are_refused() -> None:
    with pytest.raises(ValueError, match="twice"):
        assign_ranks(["a", "a"], {})


def test_any_claims_give_a_permutation_that_keeps_every_unique_fitting_claim() -> None:
    rng = random.Random(11)
    for _ in range(500):
        nodes = [f"n{i}" for i in range(rng.randint(1, 8))]
        participants = rng.sample(nodes, rng.randint(1, len(nodes)))
        participants.sort()
        claims = {
            n: RankClaim(round=rng.randint(0, 3), rank=rng.randint(0, 9))
            for n in nodes
            if rng.random() < 0.7
        }
        ranks = assign_ranks(participants, claims)
        assert sorted(ranks.values()) == list(range(len(participants)))
        for node in participants:
            claim = claims.get(node)
            if claim is None or claim.rank >= len(participants):
                continue
            rivals = [n for n in participants if n != node and claims.get(n) and claims[n] == claim]
            newer = [
                n
                for n in participants
                if n in claims and claims[n].rank == claim.rank and claims[n].round > claim.round
            ]
            if not rivals and not newer:
                assert ranks[node] == claim.rank, (participants, claims, ranks)


def test_rank_claim_checks_its_fields() -> None:
    for bad in ({"round": -1, "rank": 0}, {"round": 0, "rank": -1}, {"round": True, "rank": 0}):
        with pytest.raises(ValueError, match="RankClaim"):
            RankClaim(**bad)
