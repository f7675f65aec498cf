"""The worker of the storage-claim race (tests/elastic/launch/test_launcher_claim_race.py): a
process that, for each trial, waits at a barrier shared with the other job's process and then
takes the trial's root through the launcher's own check (:func:`check_storage`), on the slow file
system (:mod:`slowfs`)."""

from __future__ import annotations

from typing import Any


def race(job: str, urls: list[str], barrier: Any, results: Any) -> None:
    """Enters each root in ``urls`` as ``job`` the instant the other process does; puts
    ``(trial, job, problem)`` on ``results`` (``problem``: None where it entered)."""
    import slowfs

    slowfs.register()
    from flashckpt.elastic.launch.storage_check import check_storage

    for i, url in enumerate(urls):
        barrier.wait(timeout=60)
        try:
            problem = check_storage(url, job)
        except Exception as e:  # reported to the test, which fails on it
            problem = f"raised {type(e).__name__}: {e}"
        results.put((i, job, problem))
