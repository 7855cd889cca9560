"""The real services the tests start for themselves (tests/support/services.py) are theirs: a
port taken by another process between its pick and its bind is not mistaken for their own."""

import socket
from pathlib import Path

import pytest
import redis

from tests.support import services

pytestmark = pytest.mark.integration


def test_a_redis_whose_port_was_taken_after_the_pick_starts_on_a_new_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process listens on the first port picked (it accepts connections, and never
    answers): that Redis exits, and the next one starts on a port of its own."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        picks = iter([port])
        free_port = services.free_port
        monkeypatch.setattr(services, "free_port", lambda: next(picks, None) or free_port())
        with services.redis_server(tmp_path) as (server, url):
            assert url != f"redis://127.0.0.1:{port}/0"
            assert redis.Redis.from_url(url, socket_timeout=5).ping()
            assert server.poll() is None
