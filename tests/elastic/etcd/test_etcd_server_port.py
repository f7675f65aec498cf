"""An etcd that flashckpt starts again keeps its client URL (its clients know it): where another
process took that port while it was down, the start fails with an EtcdV3ServerError naming the
URL and the fix, not with the server's private retry signal (issue 45)."""

from __future__ import annotations

import socket

import pytest

from flashckpt.elastic.etcd.server import EtcdV3Server, EtcdV3ServerError
from flashckpt.errors import EtcdError

pytestmark = pytest.mark.etcd


def test_a_restart_on_a_port_taken_meanwhile_names_the_url(etcd_instance: EtcdV3Server) -> None:
    url = etcd_instance.client_url
    etcd_instance.kill()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        # SO_REUSEADDR: the killed etcd's connections may linger in TIME_WAIT on the port.
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind(("127.0.0.1", int(url.rpartition(":")[2])))
        taken.listen()
        with pytest.raises(EtcdV3ServerError) as err:
            etcd_instance.start()
    assert isinstance(err.value, EtcdError) and isinstance(err.value, RuntimeError)
    assert url in str(err.value) and "another process took the port" in str(err.value)
    assert "address already in use" in str(err.value)  # etcd's own log line is quoted
    assert not etcd_instance.running
    assert etcd_instance.start() == url  # the port free again: the same URL serves
