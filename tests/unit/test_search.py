"""Model Analyzer's quick search, driven by the product (apps/performance/search.py): what it
tries, in what order, what it keeps and why; its refusals; its winner released as a tuning
rollout; its pages, at a constant count of queries (the search itself, against real nodes:
tests/integration/test_performance.py)."""

import shutil
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from apps.accounts.roles import Role
from apps.audit.models import AuditEvent
from apps.fleet.models import Node, NodePool
from apps.fleet.services.deployments import deployment_set
from apps.performance import search as searching
from apps.performance.analyzer import PerfError, Point, SearchError
from apps.performance.models import PerfSearch, PerfTrial
from apps.performance.services import search_start
from apps.registry.codec import tuned
from apps.registry.imports import repository_import
from apps.registry.models import Model, ModelVersion
from apps.rollouts.models import Rollout
from apps.rollouts.proposals import RolloutError
from apps.rollouts.tuning import search_advice
from tests.support import REPOSITORY
from tests.support.users import make_user

pytestmark = pytest.mark.django_db
SAMPLE = [{"QUESTION": {"datatype": "BYTES", "shape": [1, 1], "data": ["refund?"]}}]


@pytest.fixture
def models(tmp_path: Path, settings: object) -> Path:
    """The demo repository copied and imported with its files, every version published; pool
    trio's nodes serving rag_pipeline v1, which has sample inputs."""
    root = tmp_path / "models"
    shutil.copytree(REPOSITORY, root, ignore=shutil.ignore_patterns("__pycache__"))
    settings.REGISTRY_ARTIFACT_ROOTS = [str(root)]  # type: ignore[attr-defined]
    assert all(r.ok for r in repository_import(path=root, actor="system:test"))
    ModelVersion.objects.update(status=ModelVersion.Status.PUBLISHED)
    Model.objects.filter(name="rag_pipeline").update(sample_inputs=SAMPLE, latency_budget_ms=300)
    pool = NodePool.objects.create(name="trio")
    for name in ("trio-1", "trio-2", "trio-3"):
        Node.objects.create(
            name=name,
            pool=pool,
            http_url=f"http://{name}:8000",
            grpc_url=f"{name}:8001",
            health=Node.Health.READY,
        )
    deployment_set(model_name="rag_pipeline", version=1, pool=pool, actor="ops")
    return root


def started(**asked: Any) -> PerfSearch:
    wanted = {"pipeline": "rag_pipeline", "pool_name": "trio", "step": "reranker"}
    return search_start(**wanted | {"concurrency": 4, "requests": 100, "actor": "ops"} | asked)


class Aside:
    """A node held aside, as the search sees it: what it loaded, and Triton's refusals."""

    def __init__(self, config: dict[str, Any], refused: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        self.base = type("Base", (), {"config": config})()
        self.loaded: list[dict[str, Any]] = []
        self.refused = refused

    def load(self, fields: dict[str, Any]) -> str:
        self.loaded.append(fields)
        label = searching.label(tuned(self.base.config, fields))
        return f"Triton refused {label}" if label in self.refused else ""


def measured_as(aside: Aside, figures: Any) -> Any:
    """perf_analyzer replaced: the figures of whatever the node has loaded last."""

    def measurer(search: PerfSearch) -> Any:
        def measure() -> list[Point]:
            config = tuned(aside.base.config, aside.loaded[-1])
            rate, p99 = figures(config)
            if rate is None:
                raise PerfError(f"{search.node_name}: rag_pipeline v1: perf_analyzer failed: gone")
            return [Point(search.concurrency, rate, p99 / 2, p99 / 1.5, p99, 100.0, 900.0)]

        return measure

    return measurer


def instances(config: dict[str, Any]) -> int:
    return int(config["instance_group"][0]["count"])


def run(search: PerfSearch, aside: Aside, figures: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(searching, "_measurer", measured_as(aside, figures))
    searching._search(search, aside)  # type: ignore[arg-type]
    search.refresh_from_db()


def test_instances_double_while_the_pipeline_serves_more_then_batch_then_delay(
    models: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    search = started()
    reranker = ModelVersion.objects.get(model__name="reranker", version=1).config
    aside = Aside(reranker)
    # Two instances serve twice one's requests, four a little more than two (under 5 %): kept
    # at two; a larger batch or a longer delay serve no more.
    run(search, aside, lambda c: ({1: 20.0, 2: 40.0, 4: 41.0}[instances(c)], 120.0), monkeypatch)
    trials = list(search.trials.values_list("label", "throughput"))
    assert trials == [
        ("1 instance, batch 8, delay 2,000 us", 20.0),
        ("2 instances, batch 8, delay 2,000 us", 40.0),
        ("4 instances, batch 8, delay 2,000 us", 41.0),
        ("2 instances, batch 16, delay 2,000 us", 40.0),
        ("2 instances, batch 8, delay 5,000 us", 40.0),
    ]
    assert search.winner is not None and search.winner.label == trials[1][0]
    assert search.winner.fields == {"instance_group": [{"count": 2}]}
    assert aside.loaded[0] == {}  # the config it serves, measured first


def test_a_configuration_over_the_budget_is_never_kept_however_many_it_serves(
    models: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    search = started()
    aside = Aside(ModelVersion.objects.get(model__name="reranker", version=1).config)
    # Two instances serve more, at 400 ms: beyond rag_pipeline's 300 ms budget.
    run(search, aside, lambda c: (10.0 * instances(c), 100.0 * instances(c) ** 2), monkeypatch)
    assert search.winner is not None and search.winner.label.startswith("1 instance,")
    assert [t.label.split(",")[0] for t in search.trials.all()][:2] == ["1 instance", "2 instances"]


def test_a_refused_or_unmeasured_configuration_is_kept_with_why_and_the_search_goes_on(
    models: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    search = started()
    refused = "2 instances, batch 8, delay 2,000 us"
    aside = Aside(ModelVersion.objects.get(model__name="reranker", version=1).config, {refused})
    batch = lambda c: (None, 0.0) if c["max_batch_size"] == 16 else (20.0, 100.0)  # noqa: E731
    run(search, aside, batch, monkeypatch)
    errors = dict(search.trials.values_list("label", "error"))
    assert errors[refused] == f"Triton refused {refused}"
    assert errors["1 instance, batch 16, delay 2,000 us"].endswith("perf_analyzer failed: gone")
    assert "1 instance, batch 8, delay 5,000 us" in errors  # the delay, tried after both
    assert search.winner is not None and search.winner.fields == {}


def test_the_config_it_serves_unmeasured_is_no_search(
    models: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    search = started()
    aside = Aside(ModelVersion.objects.get(model__name="reranker", version=1).config)
    with pytest.raises(SearchError, match="the config reranker serves could not be measured: "):
        run(search, aside, lambda c: (None, 0.0), monkeypatch)


def test_a_search_starts_on_the_pools_last_node_and_is_refused_where_it_cannot_run(
    models: Path,
) -> None:
    search = started()
    assert (search.node_name, search.version, search.budget_ms) == ("trio-3", 1, 300)
    event = AuditEvent.objects.filter(action="perf.search").get()
    assert (event.target, event.result, event.after["node"]) == ("pool:trio", "ok", "trio-3")
    for asked, said in [
        ({"pool_name": "gpu"}, "pool gpu does not run rag_pipeline"),
        ({"step": "llm"}, "rag_pipeline v1 has no step 'llm' (its steps: embedder, "),
        ({"concurrency": 0}, "a concurrency from 1 to 64, and 10 to 10,000 requests a trial"),
    ]:
        with pytest.raises(SearchError, match=said.replace("(", r"\(")):
            started(**asked)
    Model.objects.filter(name="rag_pipeline").update(sample_inputs=[])
    with pytest.raises(SearchError, match="rag_pipeline has no sample inputs"):
        started()
    assert PerfSearch.objects.count() == 1
    assert AuditEvent.objects.filter(action="perf.search", result="failed").count() == 4


def found(search: PerfSearch, *trials: tuple[dict[str, Any], str, float, float]) -> PerfSearch:
    made = [
        PerfTrial.objects.create(search=search, fields=f, label=label, throughput=t, p99_ms=p)
        for f, label, t, p in trials
    ]
    PerfSearch.objects.filter(pk=search.pk).update(status="done", winner=made[-1])
    search.refresh_from_db()
    return search


def test_a_winner_is_released_as_a_tuning_rollout_and_nothing_else_is(
    models: Path, client: Client
) -> None:
    serves = ({}, "1 instance, batch 8, delay 2,000 us", 20.0, 150.0)
    same = found(started(), serves)
    with pytest.raises(RolloutError, match=f"search #{same.pk} found nothing better than"):
        search_advice(same.pk)
    with pytest.raises(RolloutError, match=r"search #\d+ is queued: it has no winner yet"):
        search_advice(started().pk)
    two = ({"instance_group": [{"count": 2}]}, "2 instances, batch 8, delay 2,000 us", 38.0, 90.0)
    better = found(started(), serves, two)
    _, advice = search_advice(better.pk)
    assert (advice.step, advice.change, advice.fields) == ("reranker", two[1], two[0])
    assert advice.because == (
        f"search #{better.pk} on trio-3 measured 38.0 requests a second at P99 90 ms against "
        "20.0 at 150 ms with 1 instance, batch 8, delay 2,000 us, 4 users, within 300 ms"
    )
    assert advice.expect == "90% more requests a second a node"
    client.force_login(make_user(Role.RELEASE_MANAGER))
    response = client.post(f"/rollouts/tune/searches/{better.pk}/", {"plan": "1 node\n100%"})
    rollout = Rollout.objects.get()
    assert response.status_code == 302 and response["Location"] == f"/rollouts/{rollout.pk}/"
    assert (rollout.pool.name, rollout.baseline_version, rollout.canary_version) == ("trio", 1, 15)
    step = ModelVersion.objects.get(model__name="reranker", version=7)
    assert step.config["instance_group"] == [{"kind": "KIND_CPU", "count": 2}]
    assert "search #" in AuditEvent.objects.get(action="rollout.tune", result="ok").after["because"]
    deployment_set(model_name="rag_pipeline", version=2, pool=NodePool.objects.get(), actor="ops")
    with pytest.raises(RolloutError, match="measured rag_pipeline v1; pool trio serves v2 now"):
        search_advice(better.pk)


def test_the_search_pages_show_each_trial_the_budget_and_the_winner_at_a_constant_cost(
    models: Path, client: Client, admin_user: User, settings: object
) -> None:
    settings.PROMETHEUS_URL = "http://127.0.0.1:1"  # type: ignore[attr-defined]
    client.force_login(admin_user)
    serves = ({}, "1 instance, batch 8, delay 2,000 us", 20.0, 150.0)
    two = ({"instance_group": [{"count": 2}]}, "2 instances, batch 8, delay 2,000 us", 38.0, 90.0)
    one = found(started(), serves, two)
    page = client.get(f"/searches/{one.pk}/").content.decode()
    assert "within a budget of <strong>300 ms</strong>" in page
    assert "<strong>90% more</strong>" in page and "Release it as a tuning rollout" in page
    assert page.count('verdict-success">winner') == 1

    def costs() -> list[int]:
        counts = []
        for url in ("/pipelines/rag_pipeline/searches/", f"/searches/{one.pk}/"):
            with CaptureQueriesContext(connection) as captured:
                assert client.get(url).status_code == 200
            counts.append(len(captured))
        return counts

    few = costs()
    for _ in range(30):
        found(started(), serves, two, two, two)
    assert costs() == few
    listed = client.get("/pipelines/rag_pipeline/searches/").content.decode()
    assert listed.count("2 instances, batch 8, delay 2,000 us") == 25  # a page of them


def test_a_viewer_sees_searches_but_starts_none(models: Path, client: Client, viewer: User) -> None:
    client.force_login(viewer)
    page = client.get("/pipelines/rag_pipeline/searches/").content.decode()
    assert "No search yet." in page and "Start the search" not in page
    response = client.post(
        "/pipelines/rag_pipeline/searches/start/",
        {"pool": "trio", "step": "reranker", "concurrency": 4, "requests": 100},
    )
    assert response.status_code == 403 and not PerfSearch.objects.exists()
    assert client.get("/pipelines/embedder/searches/").status_code == 404  # not a pipeline


def test_a_release_manager_starts_a_search_from_the_form_and_a_refusal_says_why(
    models: Path, client: Client
) -> None:
    client.force_login(make_user(Role.RELEASE_MANAGER))
    url = "/pipelines/rag_pipeline/searches/start/"
    asked = {"pool": "trio", "step": "reranker", "concurrency": 4, "requests": 100}
    response = client.post(url, asked | {"concurrency": 0})
    assert response.status_code == 422 and not PerfSearch.objects.exists()
    assert "Ensure this value is greater than or equal to 1." in response.content.decode()
    response = client.post(url, asked)
    search = PerfSearch.objects.get()
    assert response["Location"] == f"/searches/{search.pk}/"
    assert (search.step, search.requested_by) == ("reranker", "release_manager-user")
    Model.objects.filter(name="rag_pipeline").update(sample_inputs=[])
    page = client.post(url, asked, follow=True).content.decode()
    assert "rag_pipeline has no sample inputs" in page and PerfSearch.objects.count() == 1
