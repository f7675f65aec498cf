"""The plan of a restore from memory across layouts (flashckpt.trainer.restore.pieces), on
hand-made metas."""

from __future__ import annotations

from typing import Any

import pytest

from flashckpt.trainer.restore.pieces import covered, plan_needs


def _meta(rows: list[tuple[int, int]], extra: tuple[str, ...] = ("sched/step",)) -> dict[str, Any]:
    """A snapshot description holding row pieces (offset, length) of a (12, 4) tensor "w"."""
    (off, n), *_ = rows
    piece = {"S": "w", "dt": {"shape": [12, 4], "offset": [off, 0], "local": [n, 4]}}
    entries = [["w", "F32", [n, 4], 0, n * 16]]
    entries += [[name, "I64", [], n * 16 + 8 * i, 8] for i, name in enumerate(extra)]
    skeleton = {"D": [["model", {"D": [["w", piece]]}], ["sched", {"T": "sched/step"}]]}
    return {"skeleton": skeleton, "entries": entries}


def test_covered_counts_each_distinct_box_once() -> None:
    box = ((0, 0), (6, 4))
    assert covered(box, [((0, 0), (3, 4)), ((3, 0), (3, 4))])
    # A replica's identical box does not make up for a missing one.
    assert not covered(box, [((0, 0), (3, 4)), ((0, 0), (3, 4))])
    assert covered(((4, 0), (0, 4)), [])  # an empty box needs nothing


def test_a_new_rank_asks_each_old_rank_for_the_pieces_it_overlaps() -> None:
    # Saved by 4 ranks (3 rows each); rank 1 of 3 needs rows 4..7 and holds no snapshot.
    metas = {o: _meta([(3 * o, 3)]) for o in range(4)}
    req = plan_needs(1, 3, metas, set(), [("w", ((4, 0), (4, 4)))], base=0)
    # Rows 4..7 lie in old ranks 1 (3..5) and 2 (6..8); the unsharded part comes from old rank 0.
    assert req == {0: ["sched/step"], 1: ["w"], 2: ["w"]}


def test_held_snapshots_are_not_requested() -> None:
    metas = {o: _meta([(6 * o, 6)]) for o in range(2)}
    req = plan_needs(0, 1, metas, {0, 1}, [("w", ((0, 0), (12, 4)))], base=0)
    assert req == {}
    # A rank holding old rank 1 takes the overlap from it, not from old rank 0 (a replica).
    metas = {0: _meta([(0, 12)]), 1: _meta([(0, 12)])}
    assert plan_needs(0, 2, metas, {1}, [("w", ((0, 0), (6, 4)))], base=1) == {}


def test_hsdp_one_replica_covers_everything() -> None:
    # (2, 2) mesh: old ranks 0, 1 are replica 0 (rows 0..5, 6..11), ranks 2, 3 replica 1; the
    # machine of replica 1 is gone. The survivors' two snapshots cover every row.
    metas = {0: _meta([(0, 6)]), 1: _meta([(6, 6)])}
    assert plan_needs(0, 1, metas, {0, 1}, [("w", ((0, 0), (12, 4)))], base=0) == {}
    req = plan_needs(1, 3, metas, set(), [("w", ((4, 0), (4, 4)))], base=0)
    assert req == {0: ["sched/step", "w"], 1: ["w"]}


def test_a_lost_piece_is_named() -> None:
    metas = {0: _meta([(0, 6)])}  # old rank 1 (rows 6..11) is gone with its machine
    with pytest.raises(ValueError, match=r"do not cover tensor 'w' at \[4, 0\] of shape \[4, 4\]"):
        plan_needs(0, 2, metas, {0}, [("w", ((4, 0), (4, 4)))], base=0)
