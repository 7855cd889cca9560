"""A real tritonserver is the judge: each ensemble case must load exactly when the validator says
it is valid, each model on its own (a decoupled one with the response cache, say) too, and each
model of a repository exactly when its import says it is valid."""

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from apps.devtools.devfleet import Devfleet
from apps.fleet.triton import TritonClient, TritonRejected
from apps.registry.codec import parse_pbtxt
from apps.registry.imports import candidates_import, read_candidates
from apps.registry.validation import errors, validate_config
from tests.support.ensemble_cases import (
    CASES,
    MODEL_CASES,
    REPOSITORY_CASES,
    STEPS,
    Case,
    repository_configs,
    verdict,
    write_repository,
)

pytestmark = pytest.mark.integration


@dataclass
class Oracle:
    client: TritonClient
    repository: Path


@pytest.fixture(scope="module")
def oracle(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Oracle]:
    repository = tmp_path_factory.mktemp("oracle-repository")
    write_repository(repository, repository_configs())
    devfleet = Devfleet(home=tmp_path_factory.mktemp("oracle-fleet"), repository=repository)
    state = devfleet.up(nodes=1, pool="oracle", base_port=None, prometheus_port=None)
    try:
        client = TritonClient(state.node_urls(state.nodes[0])["http_url"], node="oracle")
        for name in STEPS:
            client.load(name)
        yield Oracle(client, repository)
    finally:
        devfleet.down()


def triton_loads(oracle: Oracle, name: str) -> tuple[bool, str]:
    try:
        oracle.client.load(name)
    except TritonRejected as exc:
        return False, exc.message
    oracle.client.unload(name)
    return True, ""


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_validator_agrees_with_tritonserver(oracle: Oracle, case: Case) -> None:
    name = f"ens_{case.id}"
    write_repository(oracle.repository, {name: case.config(name)})
    loaded, message = triton_loads(oracle, name)
    ours = verdict(case)
    assert loaded == (not ours), f"triton: {loaded} {message!r}; validator: {ours}"


@pytest.mark.parametrize("name", list(MODEL_CASES))
def test_validator_agrees_with_tritonserver_on_models_alone(oracle: Oracle, name: str) -> None:
    text, valid = MODEL_CASES[name]
    write_repository(oracle.repository, {name: text})
    loaded, message = triton_loads(oracle, name)
    ours = errors(validate_config(parse_pbtxt(text), expected_name=name))
    assert (loaded, not ours) == (valid, valid), f"triton: {loaded} {message!r}; ours: {ours}"


@pytest.mark.django_db
@pytest.mark.parametrize("case", REPOSITORY_CASES, ids=[c.id for c in REPOSITORY_CASES])
def test_repository_import_agrees_with_tritonserver(oracle: Oracle, case: Case) -> None:
    candidates, _ = read_candidates(oracle.repository)  # with the ens_* of the cases above
    names = repository_configs().keys()
    imported = [c for c in candidates if c.name in names]
    results = candidates_import(candidates=imported, actor="system:test", dry_run=True)
    (ours,) = [r for r in results if r.model == case.id]
    loaded, message = triton_loads(oracle, case.id)
    assert loaded == ours.ok, f"triton: {loaded} {message!r}; import: {ours.errors}"
