"""Evaluation sets and runs through the API: the same services as the import command and the
rollouts' quality gate, refused with every problem named, and read back case by case."""

import io
import json
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.test import Client

from apps.accounts.roles import Role
from apps.audit.models import AuditEvent
from apps.fleet.models import Node, NodePool
from apps.quality.models import CaseResult, EvaluationRun, EvaluationSet
from apps.quality.services import evaluation_set_import
from tests.support.quality import DEMO_SET
from tests.support.registry import import_demo
from tests.support.users import bearer, make_user

pytestmark = pytest.mark.django_db


def case(**fields: object) -> str:
    base = {"name": "track", "inputs": {"QUESTION": "track my order"}}
    return json.dumps(base | {"expect": {"SOURCE": {"exact": "faq:orders-track"}}} | fields)


def upload(
    client: Client, headers: dict[str, str], text: str | bytes, model: str = "rag_pipeline"
) -> Any:
    file = io.BytesIO(text.encode() if isinstance(text, str) else text)
    file.name = "faq.jsonl"
    body = {"name": "faq", "file": file}
    return client.post(f"/api/models/{model}/evaluation-sets", body, headers=headers)


def post(client: Client, path: str, body: object, headers: dict[str, str]) -> Any:
    return client.post(path, json.dumps(body), content_type="application/json", headers=headers)


def faq(text: str = "") -> EvaluationSet:
    text = text or "\n".join([case(), case(name="cancel", inputs={"QUESTION": "cancel it"})])
    return evaluation_set_import(model_name="rag_pipeline", name="faq", text=text, actor="ops")


def serving(name: str, versions: list[int]) -> Node:
    """A node whose last index has those versions of rag_pipeline READY."""
    index = [{"model": "rag_pipeline", "version": v, "state": "READY"} for v in versions]
    pool, _ = NodePool.objects.get_or_create(name="gpu")
    return Node.objects.create(name=name, pool=pool, http_url="http://127.0.0.1:1", index=index)


def answer(run: EvaluationRun, line: int, version: int, source: str, passed: bool) -> None:
    CaseResult.objects.create(
        run=run,
        case=run.evaluation_set.cases.get(line=line),
        version=version,
        outputs={"SOURCE": source, "ANSWER": f"see {source}"},
        scores={"SOURCE": {"passed": passed, "value": source, "detail": ""}},
        passed=passed,
        latency_ms=12.5,
    )


def test_a_set_is_uploaded_as_json_lines_then_listed_and_read_with_its_cases(
    client: Client, admin_user: User
) -> None:
    import_demo()
    headers = bearer(admin_user)
    created = upload(client, headers, DEMO_SET.read_text())
    assert created.status_code == 201, created.content
    found = created.json()
    assert {k: found[k] for k in ("model", "name", "version", "cases", "source", "created_by")} == {
        "model": "rag_pipeline",
        "name": "faq",
        "version": 1,
        "cases": 30,
        "source": "faq.jsonl",
        "created_by": "admin-user",
    }
    again = upload(client, headers, DEMO_SET.read_text())  # CI uploads it on every build
    assert (again.status_code, again.json()["id"]) == (200, found["id"])
    changed = upload(client, headers, case())
    assert (changed.status_code, changed.json()["version"]) == (201, 2)
    listed = client.get("/api/models/rag_pipeline/evaluation-sets", headers=headers).json()
    assert [(s["name"], s["version"], s["cases"]) for s in listed] == [
        ("faq", 2, 1),
        ("faq", 1, 30),
    ]
    page = client.get("/api/models/rag_pipeline/evaluation-sets?offset=1&limit=1", headers=headers)
    assert [s["version"] for s in page.json()] == [1]
    detail = client.get(f"/api/evaluation-sets/{found['id']}?offset=28&limit=5", headers=headers)
    assert detail.json()["cases"] == 30
    assert [c["line"] for c in detail.json()["items"]] == [29, 30]
    line_29 = json.loads(DEMO_SET.read_text().splitlines()[28])
    assert detail.json()["items"][0] == {"line": 29, **line_29}
    events = AuditEvent.objects.filter(action="evaluation_set.import", actor="admin-user")
    assert [e.after["version"] for e in events.order_by("id")] == [1, 2]


def test_a_bad_set_is_refused_whole_with_each_line_and_field_named(
    client: Client, admin_user: User
) -> None:
    import_demo()
    headers = bearer(admin_user)
    lines = [case(), '{"name": "broken", "inputs": {', case(name="q", inputs={"QUERY": "where"})]
    refused = upload(client, headers, "\n".join(lines))
    assert refused.status_code == 422
    error = refused.json()["error"]
    assert error["code"] == "invalid_evaluation"
    assert error["message"].startswith("line 2: not JSON")
    assert error["details"] == [
        {
            "line": 2,
            "field": "",
            "message": "not JSON: Expecting property name enclosed in double quotes at column 31",
        },
        {"line": 3, "field": "inputs.QUESTION", "message": "missing"},
        {"line": 3, "field": "inputs.QUERY", "message": "no such input; the model's: QUESTION"},
    ]
    assert not EvaluationSet.objects.exists()
    event = AuditEvent.objects.get(action="evaluation_set.import")
    assert (event.result, event.actor) == ("failed", "admin-user")
    binary = upload(client, headers, b"\xff\xfe{}")
    assert binary.status_code == 422
    assert binary.json()["error"]["details"] == [
        {"line": 1, "field": "", "message": "not UTF-8 text"}
    ]
    bad_name = client.post(
        "/api/models/rag_pipeline/evaluation-sets",
        {"name": "no spaces", "file": io.BytesIO(case().encode())},
        headers=headers,
    )
    assert bad_name.status_code == 422
    assert bad_name.json()["error"]["details"] == [
        {
            "line": None,
            "field": "",
            "message": "'no spaces' is not a set's name: letters, digits, - and _",
        }
    ]


def test_unknown_models_sets_versions_and_runs_are_404(client: Client, admin_user: User) -> None:
    import_demo()
    faq()
    headers = bearer(admin_user)
    for url in (
        "/api/models/nope/evaluation-sets",
        "/api/evaluation-sets/999999",
        "/api/evaluation-runs/999999",
        "/api/models/rag_pipeline/versions/99/quality",
        "/api/models/nope/versions/1/quality",
    ):
        missing = client.get(url, headers=headers)
        assert missing.status_code == 404, url
        assert missing.json()["error"]["code"] == "not_found"
    assert upload(client, headers, case(), model="nope").status_code == 404
    run = {"model": "rag_pipeline", "set": "faq", "version": 1, "node": None}
    assert post(client, "/api/evaluation-runs", run | {"model": "nope"}, headers).status_code == 404
    other_set = post(client, "/api/evaluation-runs", run | {"set": "smoke"}, headers)
    assert other_set.status_code == 404
    assert "no evaluation set 'smoke'" in other_set.json()["error"]["message"]
    too_new = post(client, "/api/evaluation-runs", run | {"set_version": 2}, headers)
    assert too_new.status_code == 404
    no_node = post(client, "/api/evaluation-runs", run | {"node": "gpu-9"}, headers)
    assert no_node.status_code == 404
    assert not EvaluationRun.objects.exists()


def test_an_operator_may_not_import_a_set_or_start_a_run_and_each_refusal_is_audited(
    client: Client, operator: User
) -> None:
    import_demo()
    faq()
    headers = bearer(operator)
    run = {"model": "rag_pipeline", "set": "faq", "version": 1}
    refusals = [
        (
            "evaluation_set.import",
            "quality.add_evaluationset",
            "/api/models/rag_pipeline/evaluation-sets",
            upload(client, headers, case()),
        ),
        (
            "evaluation.start",
            "quality.add_evaluationrun",
            "/api/evaluation-runs",
            post(client, "/api/evaluation-runs", run, headers),
        ),
    ]
    for action, permission, path, response in refusals:
        assert response.status_code == 403
        error = response.json()["error"]
        assert (error["code"], error["message"]) == ("forbidden", f"your role lacks {permission}")
        event = AuditEvent.objects.get(action=action, result="denied")
        assert (event.actor, event.target) == ("operator-user", path)
    assert EvaluationSet.objects.count() == 1 and not EvaluationRun.objects.exists()
    reads = client.get("/api/models/rag_pipeline/evaluation-sets", headers=headers)
    assert reads.status_code == 200  # reading needs no more than a role


def test_a_run_is_queued_for_the_worker_with_links_to_poll(
    client: Client, django_capture_on_commit_callbacks: Any
) -> None:
    import_demo()
    found = faq()
    serving("gpu-1", [1, 2])
    manager = make_user(Role.RELEASE_MANAGER)
    headers = bearer(manager)
    body = {"model": "rag_pipeline", "set": "faq", "set_version": None, "version": 2}
    body |= {"baseline_version": 1, "node": None, "concurrency": 4, "timeout_s": 10}
    with django_capture_on_commit_callbacks() as queued:
        started = post(client, "/api/evaluation-runs", body | {"purpose": "ci #41"}, headers)
    assert started.status_code == 202, started.content
    run = started.json()
    assert len(queued) == 1  # the task, sent once this commits
    assert {k: run[k] for k in ("status", "model", "set", "set_version", "version")} == {
        "status": "queued",
        "model": "rag_pipeline",
        "set": "faq",
        "set_version": found.version,
        "version": 2,
    }
    assert (run["baseline_version"], run["node"], run["baseline_node"]) == (1, "gpu-1", "gpu-1")
    assert (run["requested_by"], run["purpose"], run["score"]) == (
        "release_manager-user",
        "ci #41",
        None,
    )
    assert run["links"] == {
        "self": f"/api/evaluation-runs/{run['id']}",
        "set": f"/api/evaluation-sets/{found.pk}",
    }
    polled = client.get(run["links"]["self"], headers=headers).json()
    assert (polled["status"], polled["cases"]) == ("queued", [])
    event = AuditEvent.objects.get(action="evaluation.start")
    assert (event.actor, event.result, event.after["run"]) == (
        "release_manager-user",
        "ok",
        run["id"],
    )


def test_a_run_that_cannot_be_served_is_refused_in_words(client: Client, admin_user: User) -> None:
    import_demo()
    faq()
    serving("gpu-1", [1])
    headers = bearer(admin_user)
    body = {"model": "rag_pipeline", "set": "faq", "version": 2}

    def refused(**changes: object) -> str:
        response = post(client, "/api/evaluation-runs", body | changes, headers)
        assert response.status_code == 422, response.content
        error = response.json()["error"]
        assert error["code"] == "invalid_evaluation"
        assert error["details"] == [{"line": None, "field": "", "message": error["message"]}]
        return str(error["message"])

    assert refused() == "no reachable node has rag_pipeline v2 READY"
    assert refused(version=99) == "rag_pipeline has no version 99 in the registry"
    assert refused(version=1, concurrency=100).startswith("concurrency is 1 to 64")
    assert AuditEvent.objects.filter(action="evaluation.start", result="failed").count() == 3
    too_big = post(client, "/api/evaluation-runs", body | {"version": 2**40}, headers)
    assert too_big.status_code == 422 and too_big.json()["error"]["code"] == "invalid_request"
    assert not EvaluationRun.objects.exists()


def test_a_runs_cases_show_both_answers_and_filter_to_failing_or_changed(
    client: Client, viewer: User
) -> None:
    import_demo()
    found = faq("\n".join(case(name=n, inputs={"QUESTION": n}) for n in ("a", "b", "c")))
    run = EvaluationRun.objects.create(
        evaluation_set=found,
        version=2,
        baseline_version=1,
        node=serving("gpu-1", [1, 2]),
        status=EvaluationRun.Status.DONE,
        score=1 / 3,
        baseline_score=1.0,
        passed=1,
        failed=2,
        requested_by="ops",
    )
    for line in (1, 2, 3):
        answer(run, line, 1, "faq:orders-track", passed=True)
    answer(run, 1, 2, "faq:orders-track", passed=True)
    answer(run, 2, 2, "faq:returns", passed=False)
    answer(run, 3, 2, "faq:orders-track", passed=False)
    headers = bearer(viewer)
    url = f"/api/evaluation-runs/{run.pk}"
    whole = client.get(url, headers=headers).json()
    assert (whole["status"], whole["passed"], whole["failed"], whole["baseline_score"]) == (
        "done",
        1,
        2,
        1.0,
    )
    assert [(c["case"], c["changed"]) for c in whole["cases"]] == [
        ("a", False),
        ("b", True),
        ("c", False),
    ]
    second = whole["cases"][1]
    assert second["answer"] == {
        "version": 2,
        "outputs": {"SOURCE": "faq:returns", "ANSWER": "see faq:returns"},
        "scores": {"SOURCE": {"passed": False, "value": "faq:returns", "detail": ""}},
        "passed": False,
        "latency_ms": 12.5,
        "first_ms": None,
        "tokens": None,
        "error": "",
    }
    assert second["baseline"]["outputs"]["SOURCE"] == "faq:orders-track"
    failing = client.get(url, {"only": "failing"}, headers=headers).json()["cases"]
    assert [c["case"] for c in failing] == ["b", "c"]
    changed = client.get(url, {"only": "changed"}, headers=headers).json()["cases"]
    assert [c["case"] for c in changed] == ["b"]
    paged = client.get(url, {"offset": 1, "limit": 1}, headers=headers).json()["cases"]
    assert [c["case"] for c in paged] == ["b"]
    assert client.get(url, {"only": "slow"}, headers=headers).status_code == 422


def test_a_versions_runs_are_listed_newest_first_with_their_scores(
    client: Client, viewer: User
) -> None:
    import_demo()
    found = faq()
    node = serving("gpu-1", [1, 2])
    for version, score in ((2, 0.5), (1, 1.0), (2, 0.75)):
        EvaluationRun.objects.create(
            evaluation_set=found, version=version, node=node, score=score, requested_by="ops"
        )
    headers = bearer(viewer)
    listed = client.get("/api/models/rag_pipeline/versions/2/quality", headers=headers).json()
    assert [(r["version"], r["score"]) for r in listed] == [(2, 0.75), (2, 0.5)]
    assert listed[0]["links"]["self"] == f"/api/evaluation-runs/{listed[0]['id']}"
    page = client.get(
        "/api/models/rag_pipeline/versions/2/quality", {"offset": 1}, headers=headers
    ).json()
    assert [r["score"] for r in page] == [0.5]
