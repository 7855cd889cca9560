"""An LLM step's release against its budget: its first token and its longest answer
(`max_tokens` at the time per token measured on the pool), warned of on the rollout form,
refused under a strict budget, never passed on missing figures. Prometheus is stubbed at its
client (the real one: tests/integration/test_llm_series.py)."""

from typing import Any

import pytest
from django.test import Client

from apps.accounts.roles import Role
from apps.fleet.models import Node, NodePool
from apps.fleet.services.deployments import deployment_set
from apps.observability import llm
from apps.prometheus.client import PrometheusUnavailable
from apps.registry.models import Model, ModelVersion
from apps.rollouts.forms import RolloutForm
from apps.rollouts.models import Rollout
from tests.support.users import bearer, make_user

pytestmark = pytest.mark.django_db

OVER = "first token 250 ms (P99) + 400 tokens x 20.0 ms = 8250 ms, over its budget of 2000 ms"


@pytest.fixture
def measured(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pool's generator: first tokens at 250 ms (P99), 20 ms a token after."""

    def instant_query(query: str) -> list[tuple[dict[str, str], float]]:
        value = 20.0 if "time_per_output_token" in query else 250.0
        return [({"model": "generator"}, value)]

    monkeypatch.setattr(llm, "instant_query", instant_query)


@pytest.fixture(autouse=True)
def generator(db: None) -> None:
    """generator v1 on pool gpu; v2 answers with 400 tokens at most, v3 with 50."""
    model = Model.objects.create(name="generator", latency_budget_ms=2000)
    for version, tokens in ((1, None), (2, 400), (3, 50)):
        config: dict[str, object] = {"name": "generator", "backend": "python"}
        if tokens:
            config["parameters"] = {"max_tokens": {"string_value": str(tokens)}}
        ModelVersion.objects.create(
            model=model, version=version, config=config, status=ModelVersion.Status.PUBLISHED
        )
    pool = NodePool.objects.create(name="gpu")
    Node.objects.create(name="gpu-1", pool=pool, http_url="http://gpu-1:8000")
    deployment_set(model_name="generator", version=1, pool=pool, actor="ops")


def previewed(client: Client, version: int) -> str:
    client.force_login(make_user(Role.RELEASE_MANAGER))
    form = {k: f.initial for k, f in RolloutForm.base_fields.items() if f.initial is not None}
    form |= {"model": "generator", "pool": "gpu", "canary_version": version, "plan": "100%"}
    return client.post("/rollouts/new/", {**form, "preview": ""}).content.decode()


def started(client: Client, version: int, **analysis: object) -> tuple[int, dict[str, Any]]:
    body = {"model": "generator", "pool": "gpu", "canary_version": version, "plan": "100%"}
    answer = client.post(
        "/api/rollouts",
        body | {"analysis": analysis},
        content_type="application/json",
        headers=bearer(make_user(Role.RELEASE_MANAGER)),
    )
    return answer.status_code, answer.json()


def test_a_longest_answer_over_the_budget_is_warned_of_on_the_form(
    measured: None, client: Client
) -> None:
    page = previewed(client, 2)
    assert "LLM budget not shown to fit" in page
    assert f"generator v2 (max_tokens 400): {OVER}" in page
    assert "It may start anyway; an analysis with a strict LLM budget would refuse it" in page
    within = previewed(client, 3)
    assert "generator v3 (max_tokens 50): first token 250 ms (P99) + 50 tokens x 20.0 ms" in within
    assert "within its budget of 2000 ms" in within and "not shown to fit" not in within


def test_a_strict_budget_refuses_it_with_the_figures_and_passes_one_that_fits(
    measured: None, client: Client
) -> None:
    status, answer = started(client, 2, strict_budget=True)
    assert status == 409
    assert answer["error"]["message"] == f"strict LLM budget: generator v2 (max_tokens 400): {OVER}"
    assert not Rollout.objects.exists()
    status, answer = started(client, 3, strict_budget=True)
    assert (status, answer["canary_version"]) == (201, 3)


def test_a_strict_budget_is_never_passed_on_missing_figures(
    monkeypatch: pytest.MonkeyPatch, client: Client
) -> None:
    def down(query: str) -> list[tuple[dict[str, str], float]]:
        raise PrometheusUnavailable("Prometheus at http://prom did not answer: stubbed")

    monkeypatch.setattr(llm, "instant_query", down)
    status, answer = started(client, 3, strict_budget=True)
    assert (status, answer["error"]["message"]) == (
        409,
        "strict LLM budget: generator v3 (max_tokens 50): its budget of 2000 ms cannot be "
        "checked (Prometheus at http://prom did not answer: stubbed)",
    )
    monkeypatch.setattr(llm, "instant_query", lambda query: [])  # no request in the window
    assert started(client, 3, strict_budget=True)[1]["error"]["message"].endswith(
        "cannot be checked (no first token nor tokens)"
    )
