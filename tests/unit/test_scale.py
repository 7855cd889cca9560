"""Costs flat in fleet size: each page and API list sends as many queries for a big fleet as for
a small one, and the desired state of a whole pool costs as much as one node's."""

from datetime import timedelta

import pytest
from django.contrib.auth.models import User
from django.db import connection, transaction
from django.db.models import Count
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from apps.accounts.models import PoolRole
from apps.accounts.services import token_create
from apps.approvals.models import Approval
from apps.devtools.seed import Size, seed_fleet
from apps.fleet import desired, reconcile, runner
from apps.fleet.desired import fleet_desired
from apps.fleet.lease import Lease
from apps.fleet.models import Node, NodePool, Operation
from apps.incidents.models import Incident
from apps.quality.models import CaseResult, EvaluationCase, EvaluationRun, EvaluationSet
from apps.registry.models import Model, ModelVersion
from apps.rollouts.models import Rollout
from apps.web.prepared import prepared_cursor
from tests.support.registry import import_demo

SMALL = Size(nodes=4, pools=2, models=10, versions=3, operations=20, rollouts=2, events=30)
BIGGER = Size(nodes=60, pools=3, models=15, versions=4, operations=300, rollouts=9, events=900)


def pages() -> list[str]:
    node = Node.objects.order_by("name").first()
    rollout = Rollout.objects.order_by("id").first()
    incident = Incident.objects.order_by("id").first()
    pool = NodePool.objects.annotate(size=Count("nodes")).order_by("-size", "id").first()
    assert node and rollout and incident and pool
    return [
        "/",
        "/nodes/",
        "/nodes/?drift=1",
        "/nodes/?model=a-model-000",
        "/nodes/?drift=1&page=2",
        "/nodes/serving/?model=a-model-000&version=3",
        f"/nodes/{node.name}/",
        "/deployments/",
        f"/pools/{pool.name}/capacity/",  # the largest pool
        f"/pools/{pool.name}/throughput/",
        f"/pools/{pool.name}/fit/?model_version=a-model-000:2",
        f"/pools/{pool.name}/scaling/",
        "/models/",
        "/models/a-model-000/",
        "/metrics/bottleneck/a-pipeline-00/",
        "/rollouts/",
        f"/rollouts/{rollout.pk}/",
        "/rollouts/approvals/",
        "/pools/roles/",
        "/audit/",
        "/audit/timeline/",
        "/metrics/",
        "/incidents/",
        f"/incidents/{incident.pk}/",
        f"/incidents/{incident.pk}/report.md",
        "/api/nodes",
        "/api/deployments",
        "/api/rollouts",
        "/api/audit",
        "/api/operations",
        "/api/models",
        "/api/approvals",
        "/api/pool-roles",
        f"/api/pools/{pool.name}/scaling",
    ]


def approvals(n: int, prefix: str) -> None:
    """`n` changes to protected pools, by as many people, half of them approved by others."""
    pool = NodePool.objects.order_by("id").last()
    for i in range(n):
        ann, bob = (User.objects.create(username=f"{prefix}{who}{i}") for who in "ab")
        Approval.objects.create(
            pool=pool,
            action="deployment.set",
            params={"pool": pool.name, "model": "m", "version": i},
            requested_by=ann,
            expires_at=timezone.now(),
            approved_by=bob if i % 2 else None,
            status=Approval.Status.APPROVED if i % 2 else Approval.Status.PENDING,
        )


def pool_roles(n: int, prefix: str) -> None:
    """`n` people, each an operator of every pool."""
    for i in range(n):
        user = User.objects.create(username=f"{prefix}op{i}")
        for pool in NodePool.objects.all():
            PoolRole.objects.create(user=user, pool=pool, role=PoolRole.Role.OPERATOR)


def incidents(n: int, prefix: str) -> None:
    """`n` incidents over the last hour, every one in the same pool and model."""
    pool, model = NodePool.objects.order_by("id").first(), Model.objects.order_by("id").first()
    for i in range(n):
        start = timezone.now() - timedelta(minutes=i)
        Incident.objects.create(
            title=f"{prefix}{i}", started_at=start, opened_by="t", pool=pool, model=model
        )


def count(client: Client, url: str, token: str) -> int:
    """The page's queries as a first view: no fleet desired state kept from another page."""
    desired._FLEETS.clear()
    headers = {"Authorization": f"Bearer {token}"} if url.startswith("/api/") else {}
    with CaptureQueriesContext(connection) as captured:
        response = client.get(url, headers=headers)
    assert response.status_code == 200, (url, response.status_code)
    return len(captured)


def test_every_page_and_api_list_costs_the_same_queries_at_any_fleet_size(
    client: Client, admin_user: User, settings: object
) -> None:
    settings.PROMETHEUS_URL = "http://127.0.0.1:1"  # type: ignore[attr-defined]
    client.force_login(admin_user)
    _, token = token_create(user=admin_user, name="ci", actor="system:test")
    seed_fleet(size=SMALL, prefix="a-")
    approvals(2, "a-")
    pool_roles(1, "a-")
    incidents(2, "a-")
    small = {at: count(client, url, token) for at, url in enumerate(pages())}
    seed_fleet(size=BIGGER, prefix="b-")
    approvals(20, "b-")
    pool_roles(10, "b-")
    incidents(30, "b-")
    urls = pages()
    big = {at: count(client, url, token) for at, url in enumerate(urls)}
    assert big == small, [(urls[at], small[at], n) for at, n in big.items() if small[at] != n]


def test_a_pools_desired_state_costs_the_same_for_any_number_of_nodes(db: None) -> None:
    seed_fleet(size=SMALL, prefix="a-")

    def queries(pool: NodePool) -> tuple[int, int]:
        with CaptureQueriesContext(connection) as captured:
            desired = fleet_desired(pool_ids=[pool.pk])
            states = [desired.of(node) for node in pool.nodes.all()]
        assert all(states)
        return len(captured), len(states)

    few, few_nodes = queries(NodePool.objects.get(name="a-pool-00"))
    seed_fleet(size=BIGGER, prefix="b-")
    many, many_nodes = queries(NodePool.objects.get(name="b-pool-00"))
    assert many_nodes > 5 * few_nodes
    assert many == few


def _operations_read() -> int:
    """Rows of fleet_operation this transaction has read so far, by index or by scan."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT COALESCE(idx_tup_fetch, 0) + seq_tup_read FROM pg_stat_xact_user_tables"
            " WHERE relname = 'fleet_operation'"
        )
        return cursor.fetchone()[0]


@pytest.mark.skipif(connection.vendor != "postgresql", reason="PostgreSQL's statistics views")
def test_a_nodes_plan_and_run_read_none_of_the_fleets_nor_its_own_past_operations(
    db: None,
) -> None:
    """The statements a reconcile and a run send for every node of a release read the node's
    open operations and its last plan, never the rest of the table, whatever the planner knows
    of it (a new database has no statistics: the look for the last plan walked the whole table
    backwards) and however often a prepared statement has run (a generic plan, from the sixth
    run on, cannot use an index whose condition names a status given as a parameter)."""
    pool = NodePool.objects.create(name="p")
    fleet = Node.objects.bulk_create(
        Node(name=f"n-{n}", pool=pool, http_url=f"http://node-{n}:8000") for n in range(1, 4001)
    )
    fresh, busy = fleet[:2]

    # A release's worth, configs and all: with no statistics yet, the planner counts rows by the
    # table's pages.
    Operation.objects.bulk_create(
        Operation(
            node=node,
            kind="load",
            model_name=f"m{m}",
            versions=[1],
            config={"name": f"m{m}", "parameters": {"prompt": {"string_value": "x" * 1000}}},
            plan_digest="p",
            status=Operation.Status.SUCCEEDED,
        )
        for node in fleet[1:]
        for m in range(5)
    )
    before = _operations_read()
    with transaction.atomic():
        reconcile._locked([fresh.pk])  # no operation of its own yet
    after = _operations_read()
    assert after - before == 0
    for _ in range(8):
        with Lease(busy.pk).hold() as lease:
            assert lease.held
            assert runner._next_batch(busy) == []
            with prepared_cursor() as cursor:
                cursor.execute(*lease.let_go_when_idle())
            lease.let_go = True
    assert _operations_read() - after == 0


def evaluations(model: Model, sets: int, cases: int) -> None:
    """`sets` more versions of a set of `cases` cases, each run once on version 1 beside
    version 2, every case answered by both."""
    for _ in range(sets):
        latest = EvaluationSet.objects.filter(model=model).order_by("-version").first()
        found = EvaluationSet.objects.create(
            model=model, name="faq", version=latest.version + 1 if latest else 1, created_by="t"
        )
        made = EvaluationCase.objects.bulk_create(
            EvaluationCase(evaluation_set=found, line=n, name=f"c{n}", inputs={}, expect={})
            for n in range(1, cases + 1)
        )
        run = EvaluationRun.objects.create(
            evaluation_set=found, version=1, baseline_version=2, requested_by="t", score=0.5
        )
        CaseResult.objects.bulk_create(
            CaseResult(run=run, case=c, version=v, outputs={"A": v}, passed=v == 1)
            for c in made
            for v in (1, 2)
        )


def test_the_evaluation_api_costs_the_same_queries_for_any_number_of_sets_runs_and_cases(
    client: Client, admin_user: User
) -> None:
    model = Model.objects.create(name="rag")
    for version in (1, 2):
        ModelVersion.objects.create(model=model, version=version, config={})
    _, token = token_create(user=admin_user, name="ci", actor="system:test")

    def urls() -> list[str]:
        largest = EvaluationSet.objects.order_by("-version").first()
        run = EvaluationRun.objects.order_by("-id").first()
        assert largest and run
        return [
            "/api/models/rag/evaluation-sets",
            f"/api/evaluation-sets/{largest.pk}",
            "/api/models/rag/versions/1/quality",
            f"/api/evaluation-runs/{run.pk}",
            f"/api/evaluation-runs/{run.pk}?only=failing",
        ]

    evaluations(model, sets=2, cases=3)
    small = [count(client, url, token) for url in urls()]
    evaluations(model, sets=20, cases=40)
    assert [count(client, url, token) for url in urls()] == small


def evaluation(found: EvaluationSet, cases: int, runs: int, prefix: str) -> EvaluationRun:
    """`cases` more cases in the set and `runs` more finished runs of it on rag_pipeline v7
    against v1, each with both answers to every case; the last run."""
    start = found.cases.count()
    EvaluationCase.objects.bulk_create(
        EvaluationCase(
            evaluation_set=found,
            line=start + i + 1,
            name=f"{prefix}{i}",
            inputs={"QUESTION": f"question {i}"},
            expect={"SOURCE": {"exact": "faq:orders-track"}},
        )
        for i in range(cases)
    )
    every = list(found.cases.all())
    for _ in range(runs):
        run = EvaluationRun.objects.create(
            evaluation_set=found,
            version=7,
            baseline_version=1,
            status=EvaluationRun.Status.DONE,
            score=0.0,
            baseline_score=1.0,
            failed=len(every),
            requested_by="ops",
        )
        CaseResult.objects.bulk_create(
            CaseResult(
                run=run,
                case=case,
                version=version,
                outputs={"SOURCE": [source]},
                scores={"SOURCE": {"passed": version == 1, "value": None, "detail": "wrong"}},
                passed=version == 1,
            )
            for case in every
            for version, source in ((7, "faq:contact"), (1, "faq:orders-track"))
        )
    return run


def test_the_quality_pages_cost_the_same_queries_as_sets_cases_and_runs_grow(
    client: Client, admin_user: User, settings: object
) -> None:
    settings.PROMETHEUS_URL = "http://127.0.0.1:1"  # type: ignore[attr-defined]
    client.force_login(admin_user)
    import_demo()
    ModelVersion.objects.update(status=ModelVersion.Status.PUBLISHED)
    model = Model.objects.get(name="rag_pipeline")
    found = EvaluationSet.objects.create(model=model, name="faq", version=1, created_by="ops")
    run = evaluation(found, cases=2, runs=1, prefix="a-")
    pool = NodePool.objects.create(name="trio")
    Node.objects.create(name="trio-1", pool=pool, http_url="http://10.0.0.1:8000")
    rollout = Rollout.objects.create(
        model=model,
        pool=pool,
        baseline_version=1,
        canary_version=7,
        plan=[{"percent": 100}],
        analysis={"quality_set": "faq"},
        state=Rollout.State.ROLLED_BACK,
        gate_run=run,
        started_by="ops",
    )
    urls = [
        "/models/rag_pipeline/evaluations/",
        "/models/rag_pipeline/evaluations/faq/v1/",
        f"/evaluations/runs/{run.pk}/",
        f"/evaluations/runs/{run.pk}/?only=changed",
        "/models/rag_pipeline/v7/quality/",
        f"/rollouts/{rollout.pk}/",
        "/rollouts/new/?model=rag_pipeline",
    ]
    small = [count(client, url, "") for url in urls]
    for i in range(30):  # more sets and versions of sets, each with a case
        grown = EvaluationSet.objects.create(
            model=model, name=f"set-{i % 10}", version=2 + i // 10, created_by="ops"
        )
        evaluation(grown, cases=1, runs=1, prefix="c-")
    last = evaluation(found, cases=60, runs=40, prefix="b-")
    Rollout.objects.filter(pk=rollout.pk).update(gate_run=last)
    urls = [url.replace(f"/runs/{run.pk}/", f"/runs/{last.pk}/") for url in urls]
    big = [count(client, url, "") for url in urls]
    assert big == small, [(url, s, b) for url, s, b in zip(urls, small, big, strict=True) if s != b]
