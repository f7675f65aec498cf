"""``storage_options=``'s way to the node agent: the 0600 file it reads (issue 43)."""

from __future__ import annotations

from pathlib import Path

import pytest

from flashckpt.format.storage import (
    read_storage_options_file,
    storage_options_for,
    use_storage_options,
    write_storage_options_file,
)


def test_options_file_is_private_and_refused_when_not(tmp_path: Path) -> None:
    """The file is written 0600 and read back; one others may read is refused naming the file
    and the fix, never its contents; options that are not JSON values are refused at the key."""
    path = str(tmp_path / "opts.json")
    opts = {"s3://b/run": {"key": "AK", "secret": "s3cr3t-value", "client_kwargs": {"a": 1}}}
    write_storage_options_file(path, opts)
    assert (tmp_path / "opts.json").stat().st_mode & 0o777 == 0o600
    assert read_storage_options_file(path) == opts
    (tmp_path / "opts.json").chmod(0o644)
    with pytest.raises(ValueError, match="chmod 600") as e:
        read_storage_options_file(path)
    assert "s3cr3t-value" not in str(e.value) and path in str(e.value)
    with pytest.raises(ValueError, match=r"storage_options\['secret'\] is a bytes") as e:
        use_storage_options("s3://b/run", {"secret": b"s3cr3t-value"})
    assert "s3cr3t-value" not in str(e.value)
    use_storage_options("s3://b/other", {"key": "k"})
    try:
        assert storage_options_for("s3://b/other") == {"key": "k"}
    finally:
        use_storage_options("s3://b/other", None)
    assert storage_options_for("s3://b/other") is None
