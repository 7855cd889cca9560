"""A node started with Triton's restricted repository API (--http-restricted-api) serves index,
load and unload only to requests carrying the configured header: the product sends it."""

from collections.abc import Iterator
from typing import Any

import pytest

from apps.devtools.devfleet import Devfleet
from apps.fleet.triton import TritonClient, TritonRejected
from tests.support import REPOSITORY

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def restricted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonClient]:
    devfleet = Devfleet(home=tmp_path_factory.mktemp("restricted"), repository=REPOSITORY)
    state = devfleet.up(
        nodes=1,
        pool="locked",
        base_port=None,
        prometheus_port=None,
        repository_key="admin-key=s3cret",
    )
    try:
        (node,) = state.nodes
        yield TritonClient(state.node_urls(node)["http_url"], node=node.name)
    finally:
        devfleet.down()


def test_repository_calls_carry_the_configured_header(
    restricted: TritonClient, settings: Any
) -> None:
    with pytest.raises(TritonRejected, match="admin-key"):
        restricted.repository_index()  # Triton refuses a call without it
    settings.TRITON_REPOSITORY_HEADER = {"admin-key": "s3cret"}
    restricted.load("embedder")
    ready = {(e.model, e.version) for e in restricted.repository_index() if e.state == "READY"}
    assert ready == {("embedder", 2)}  # Triton's default policy: the latest version
    restricted.unload("embedder")
    assert not [e for e in restricted.repository_index() if e.state == "READY"]
    settings.TRITON_REPOSITORY_HEADER = {"admin-key": "wrong"}
    with pytest.raises(TritonRejected, match="admin-key"):
        restricted.load("embedder")
