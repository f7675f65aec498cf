"""``storage="file://tmp/x"`` (two slashes) is refused naming the three-slash form, instead of
writing to ./tmp/x relative to the working directory (issue 30)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import flashckpt
from flashckpt.format.storage import Storage


@pytest.mark.parametrize("url", ["file://tmp/x", "file://localhost/tmp/x"])
def test_a_file_url_with_a_host_is_refused(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    rest = url.removeprefix("file://")
    with pytest.raises(ValueError) as err:
        flashckpt.checkpointing(torch.nn.Linear(2, 2), storage=url, job="j")
    text = str(err.value)
    assert f"storage URL {url!r}" in text, text
    assert f"write 'file:///{rest}' for /{rest}" in text, text
    with pytest.raises(ValueError, match="file:///"):
        Storage(url)
    assert list(tmp_path.iterdir()) == []  # nothing written relative to the working directory


def test_absolute_file_urls_and_paths_are_taken(tmp_path: Path) -> None:
    assert Storage(f"file://{tmp_path}/ckpt").root == f"{tmp_path}/ckpt"
    assert Storage(f"{tmp_path}/ckpt").root == f"{tmp_path}/ckpt"
    assert Storage("memory://x").root.endswith("x")
