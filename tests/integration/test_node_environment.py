"""`make demo` from any shell: the nodes' Python backend must not depend on the caller's PATH."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from apps.devtools.devfleet import Devfleet
from apps.fleet.triton import TritonClient
from tests.support import REPOSITORY

pytestmark = pytest.mark.integration


def test_python_models_load_when_another_python_comes_first_on_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shell whose first python3 is a virtualenv without numpy (as pyenv's or conda's can be)
    started nodes whose every Python model failed: "No module named 'numpy'"."""
    foreign = tmp_path / "foreign"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(foreign)], check=True)
    monkeypatch.setenv("PATH", f"{foreign / 'bin'}:{os.environ['PATH']}")
    monkeypatch.setenv("VIRTUAL_ENV", str(foreign))
    devfleet = Devfleet(home=tmp_path / "fleet", repository=REPOSITORY)
    state = devfleet.up(nodes=1, pool="env", base_port=None, prometheus_port=None)
    try:
        (node,) = state.nodes
        client = TritonClient(state.node_urls(node)["http_url"], node=node.name)
        client.load("embedder")  # a Python-backend model: it imports numpy
        ready = {(e.model, e.version) for e in client.repository_index() if e.state == "READY"}
        assert ready == {("embedder", 2)}
    finally:
        devfleet.down()
