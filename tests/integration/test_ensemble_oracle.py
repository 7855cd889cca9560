"""A real tritonserver is the judge: each ensemble case must load exactly when the validator says
it is valid."""

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from apps.fleet.devfleet import Devfleet
from apps.fleet.triton import TritonClient, TritonRejected
from tests.ensemble_cases import CASES, STEPS, Case
from tests.unit.test_ensembles import verdict

pytestmark = pytest.mark.integration

# Loading is all the oracle needs: the steps never run.
STEP_MODEL = """class TritonPythonModel:
    def execute(self, requests):
        return [None for _ in requests]
"""


@dataclass
class Oracle:
    client: TritonClient
    repository: Path


@pytest.fixture(scope="module")
def oracle(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Oracle]:
    repository = tmp_path_factory.mktemp("oracle-repository")
    for name, text in STEPS.items():
        (repository / name / "1").mkdir(parents=True)
        (repository / name / "config.pbtxt").write_text(text)
        if "ensemble" not in text:
            (repository / name / "1" / "model.py").write_text(STEP_MODEL)
    devfleet = Devfleet(home=tmp_path_factory.mktemp("oracle-fleet"), repository=repository)
    state = devfleet.up(nodes=1, pool="oracle", base_port=None, prometheus_port=None)
    try:
        client = TritonClient(state.node_urls(state.nodes[0])["http_url"], node="oracle")
        for name in STEPS:
            client.load(name)
        yield Oracle(client, repository)
    finally:
        devfleet.down()


def triton_loads(oracle: Oracle, case: Case) -> tuple[bool, str]:
    name = f"ens_{case.id}"
    (oracle.repository / name / "1").mkdir(parents=True, exist_ok=True)
    (oracle.repository / name / "config.pbtxt").write_text(case.config(name))
    try:
        oracle.client.load(name)
    except TritonRejected as exc:
        return False, exc.message
    oracle.client.unload(name)
    return True, ""


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_validator_agrees_with_tritonserver(oracle: Oracle, case: Case) -> None:
    loaded, message = triton_loads(oracle, case)
    ours = verdict(case)
    assert loaded == (not ours), f"triton: {loaded} {message!r}; validator: {ours}"
