"""The worker -> launcher record of an error no restart can mend
(:mod:`flashckpt.elastic.launch.workererrors`): found anywhere in the exception's chain, written
whole, and nothing read back is trusted (issue 41)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flashckpt import envnames
from flashckpt.elastic.launch import workererrors
from flashckpt.errors import AgentError, PersistError, ShmSpaceError


def test_an_unrestartable_error_is_recorded_from_anywhere_in_the_chain(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(envnames.WORKER_ERRORS, str(tmp_path))
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("RANK", "3")
    assert not workererrors.record(AgentError("the agent went away"))  # a restart may mend it
    try:
        try:
            raise ShmSpaceError("/dev/shm has 4 KiB free, 2 MiB needed: mount a larger tmpfs")
        except ShmSpaceError as exc:
            raise RuntimeError("the user's wrapper") from exc
    except RuntimeError as outer:
        assert workererrors.record(outer)
    [found] = workererrors.read(str(tmp_path), [0, 1])
    assert found.describe() == (
        "rank 3 (local rank 1): ShmSpaceError: /dev/shm has 4 KiB free, 2 MiB needed: mount a "
        "larger tmpfs"
    )
    assert (tmp_path / "rank1.json").stat().st_mode & 0o777 == 0o600
    workererrors.clear(str(tmp_path))
    assert workererrors.read(str(tmp_path), [1]) == []
    # An instance may say otherwise than its class.
    err = PersistError("step 5 not committed")
    err.restartable = True
    assert workererrors.not_restartable(err) is None


@pytest.mark.parametrize(
    "content",
    [b"not json", b"[1, 2]", json.dumps({"rank": "0", "type": "X", "message": "m"}).encode(),
     b"{" + b" " * (70 * 1024) + b"}"],
    ids=["text", "list", "ill-typed", "oversized"],
)  # fmt: skip
def test_a_record_that_is_not_one_is_ignored(tmp_path: Path, content: bytes) -> None:
    (tmp_path / "rank0.json").write_bytes(content)
    assert workererrors.read(str(tmp_path), [0]) == []
