"""Two jobs taking one storage root at the same instant (issue 41, row 1): exactly one gets it.

Two real processes, jobs ``A`` and ``B``, wait at a barrier and then enter the same fresh root
through the launcher's check of ``--storage`` on a slow file system (every mutating call 0.05 s
late, :mod:`slowfs`), 10 times. Before the owner file was created exclusively both read the root
free and both wrote it (2 of 2 in the issue); now in every trial exactly one enters, the other
is refused naming the winner and its owner file, and the file names the winner.
"""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import slowfs
from claimrace import race

from flashckpt.format.storage_owner import OWNER_FILE

TRIALS = 10


def test_two_jobs_entering_one_root_at_the_same_instant_one_enters(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv(slowfs.DELAY_ENV, "0.05")
    urls = [f"{slowfs.SCHEME}://{tmp_path}/root{i}" for i in range(TRIALS)]
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=race, args=(job, urls, barrier, results)) for job in "AB"]
    for p in procs:
        p.start()
    try:
        got = [results.get(timeout=120) for _ in range(2 * TRIALS)]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    assert [p.exitcode for p in procs] == [0, 0]
    by_trial: dict[int, dict[str, str | None]] = {}
    for i, job, problem in got:
        by_trial.setdefault(i, {})[job] = problem
    winners = []
    for i in range(TRIALS):
        entered = [job for job, problem in by_trial[i].items() if problem is None]
        assert len(entered) == 1, (i, by_trial[i])  # never both, never neither
        (winner,) = entered
        loser = "B" if winner == "A" else "A"
        text = by_trial[i][loser]
        owner = tmp_path / f"root{i}" / OWNER_FILE
        assert f"--storage {urls[i]} is in use by job {winner!r}: its owner file" in text, text
        assert f"this is job {loser!r}" in text and "--takeover" in text, text
        assert json.loads(owner.read_text())["job"] == winner
        assert (owner.stat().st_mode & 0o777) == 0o600
        assert ((tmp_path / f"root{i}").stat().st_mode & 0o777) == 0o700
        winners.append(winner)
    print(f"winners: {''.join(winners)}")
