import json
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
from django.core.management import CommandError, call_command

from apps.audit.models import AuditEvent
from apps.fleet.models import Node, NodePool
from apps.fleet.traffic import warmup
from apps.fleet.triton import Reply
from apps.quality import cases
from apps.quality.errors import QualityError
from apps.quality.models import EvaluationRun, EvaluationSet
from apps.quality.services import evaluation_set_import
from tests.support.quality import DEMO_SET
from tests.support.registry import import_demo

pytestmark = pytest.mark.django_db


def case(**fields: object) -> str:
    base = {"name": "track", "inputs": {"QUESTION": "track my order"}}
    return json.dumps(base | {"expect": {"SOURCE": {"exact": "faq:orders-track"}}} | fields)


def problems(text: str | Iterator[bytes], model: str = "rag_pipeline") -> list[str]:
    with pytest.raises(QualityError) as refused:
        evaluation_set_import(model_name=model, name="faq", text=text, actor="ops")
    return [str(p) for p in refused.value.problems]


def test_the_demo_set_imports_once_and_again_unchanged_adds_nothing() -> None:
    import_demo()
    call_command("import_evaluation_set", "rag_pipeline", "faq", str(DEMO_SET))
    call_command("import_evaluation_set", "rag_pipeline", "faq", str(DEMO_SET))
    (found,) = EvaluationSet.objects.all()
    assert (found.version, found.cases.count(), found.source) == (1, 30, DEMO_SET.name)
    (event,) = AuditEvent.objects.filter(action="evaluation_set.import")
    assert (event.actor, event.after["cases"], event.after["version"]) == (
        "system:import_evaluation_set",
        30,
        1,
    )


def test_a_changed_set_is_the_next_version() -> None:
    import_demo()
    evaluation_set_import(model_name="rag_pipeline", name="faq", text=case(), actor="ops")
    text = case() + "\n" + case(name="cancel", inputs={"QUESTION": "cancel it"})
    found = evaluation_set_import(model_name="rag_pipeline", name="faq", text=text, actor="ops")
    assert (found.version, [c.name for c in found.cases.all()]) == (2, ["track", "cancel"])


def test_each_bad_line_is_named_with_its_field_and_nothing_is_stored() -> None:
    import_demo()
    lines = [
        case(),
        '{"name": "broken", "inputs": {',
        case(name="tensor", inputs={"QUERY": "where is it"}),
        case(name="type", inputs={"QUESTION": 3.5}),
        case(name="dims", inputs={"QUESTION": ["a", "b"]}),
        case(name="output", expect={"URL": {"exact": "x"}}),
        case(name="rule", expect={"SOURCE": {"top_k": ["x"], "k": "3"}}),
        case(name="track"),
    ]
    found = problems("\n".join(lines))
    assert (
        found[0]
        == "line 2: not JSON: Expecting property name enclosed in double quotes at column 31"
    )
    assert found[1:] == [
        "line 3: inputs.QUESTION: missing",
        "line 3: inputs.QUERY: no such input; the model's: QUESTION",
        "line 4: inputs.QUESTION: BYTES takes strings",
        "line 5: inputs.QUESTION: shape [2] does not match dims [1]",
        "line 6: expect.URL: no such output; the model's: ANSWER, SOURCE",
        found[6],
        "line 8: name: 'track' is already line 1",
    ]
    assert found[6].startswith('line 7: expect.SOURCE: "k" is an integer >= 1')
    assert not EvaluationSet.objects.exists()
    (event,) = AuditEvent.objects.filter(action="evaluation_set.import")
    assert event.result == "failed" and "line 2: not JSON" in event.message


def test_numeric_inputs_are_checked_against_the_declared_type_and_dims() -> None:
    import_demo()
    vector = [0.5] * 64
    ok = json.dumps({"inputs": {"EMBEDDING": vector}, "expect": {"CANDIDATES": {"contains": "x"}}})
    found = evaluation_set_import(model_name="retriever", name="r", text=ok, actor="ops")
    assert found.cases.get().name == "line 1"
    short = json.dumps({"inputs": {"EMBEDDING": [0.5] * 3}, "expect": {"CANDIDATES": {"exact": 1}}})
    words = json.dumps(
        {"inputs": {"EMBEDDING": ["a"] * 64}, "expect": {"CANDIDATES": {"exact": 1}}}
    )
    assert problems(f"{short}\n{words}", model="retriever") == [
        "line 1: inputs.EMBEDDING: shape [3] does not match dims [64]",
        "line 2: inputs.EMBEDDING: FP32 takes numbers, not strings",
    ]


def test_an_unknown_model_or_an_empty_file_is_refused_in_words() -> None:
    import_demo()
    assert problems(case(), model="nope") == ["no model named 'nope' in the registry"]
    assert problems("\n\n") == ["line 1: no cases: one JSON object per line is expected"]
    with pytest.raises(CommandError, match=r"missing\.jsonl"):
        call_command("import_evaluation_set", "rag_pipeline", "faq", "/nonexistent/missing.jsonl")


def test_a_node_is_warmed_with_its_models_own_cases_and_not_while_it_gets_no_traffic(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import_demo()
    call_command("import_evaluation_set", "rag_pipeline", "faq", str(DEMO_SET))
    sent: list[tuple[str, list[str]]] = []

    class Client:  # Triton, at the client's boundary
        def __init__(self, node: str) -> None:
            self.node = node

        @classmethod
        def of(cls, node: Node) -> "Client":
            return cls(node.name)

        @contextmanager
        def session(self, timeout: float | None = None) -> Iterator["Client"]:
            yield self

        def reply(self, model: str, inputs: dict[str, np.ndarray], **_: object) -> Reply:
            sent.append((model, [q.decode() for q in inputs["QUESTION"].flat]))
            return Reply({})

    monkeypatch.setattr(warmup, "TritonClient", Client)
    pool = NodePool.objects.create(name="demo", warmup_requests=2)
    node = Node.objects.create(name="demo-1", pool=pool, http_url="http://demo-1:8000")
    warmup.warm_up(node, {"rag_pipeline": None})
    assert sent == [
        ("rag_pipeline", ["How do I track my order?"]),
        ("rag_pipeline", ["track my parcel please"]),
    ]
    Node.objects.filter(pk=node.pk).update(weight=0)  # a canary waiting for its quality gate
    warmup.warm_up(node, {"rag_pipeline": None})
    assert len(sent) == 2


def test_the_gate_passes_only_a_score_at_the_minimum_and_near_the_baseline() -> None:
    from apps.rollouts.gate import evaluation_verdict
    from apps.rollouts.plans import Analysis

    import_demo()
    found = evaluation_set_import(model_name="rag_pipeline", name="faq", text=case(), actor="ops")
    spec = Analysis(quality_min_score=0.9, quality_tolerance=0.05)

    def verdict(**fields: object) -> tuple[str, str]:
        run = EvaluationRun(evaluation_set=found, version=7, baseline_version=1, **fields)
        run.save()
        return evaluation_verdict(run, spec)

    done = EvaluationRun.Status.DONE
    assert verdict(status=done, score=0.95, baseline_score=1.0, passed=19, failed=1) == (
        "success",
        "canary scored 95% (19 of 20 cases), the baseline 100%",
    )
    assert verdict(status=done, score=0.85, baseline_score=0.8, passed=17, failed=3)[1] == (
        "canary scored 85% (17 of 20 cases), below 90%"
    )
    below = verdict(status=done, score=0.92, baseline_score=1.0, passed=23, failed=2)
    assert below == (
        "failure",
        "canary scored 92% (23 of 25 cases), the baseline 100%: more than 5% below it",
    )
    assert verdict(status=done, score=None, passed=0, failed=0) == (
        "failure",
        "no case was judged",
    )
    lost = verdict(status=EvaluationRun.Status.FAILED, error="no reachable node has it READY")
    assert lost[0] == "inconclusive" and lost[1].endswith(
        "could not run: no reachable node has it READY"
    )


def test_a_run_stopped_at_its_time_limit_fails_saying_so_and_is_never_waited_on_for_hours(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from celery.exceptions import SoftTimeLimitExceeded

    from apps.quality import tasks
    from apps.rollouts.gate import gate_deadline
    from apps.rollouts.plans import Analysis

    import_demo()
    text = "\n".join(case(name=f"c{n}") for n in range(400))
    found = evaluation_set_import(model_name="rag_pipeline", name="faq", text=text, actor="ops")
    run = EvaluationRun.objects.create(
        evaluation_set=found, version=7, baseline_version=1, concurrency=1, timeout_s=10
    )

    def slow(*, run_id: int) -> None:
        EvaluationRun.objects.filter(pk=run_id).update(status=EvaluationRun.Status.RUNNING)
        raise SoftTimeLimitExceeded()

    monkeypatch.setattr(tasks, "evaluation_execute", slow)
    tasks.run_evaluation(run.pk)
    run.refresh_from_db()
    assert (run.status, run.finished_at is not None) == (EvaluationRun.Status.FAILED, True)
    assert run.error == ("stopped at its time limit of 540 s: too many cases, or too slow a node")
    # 400 cases of 10 s, one at a time, on both sides: 8,000 s; a run is killed at 570 s.
    assert (gate_deadline(run, Analysis()) - run.created_at).total_seconds() == 630


def test_a_case_nested_too_deep_or_holding_a_nul_is_refused_with_its_line() -> None:
    import_demo()
    deep = '{"name": "deep", "inputs": {"QUESTION": ' + "[" * 100_000 + "]" * 100_000 + "}}"
    nul = case(name="nul", inputs={"QUESTION": "track\u0000 my order"})
    literal = case(name="literal", inputs={"QUESTION": "a \\u0000 written out"})
    assert problems("\n".join([deep, nul, literal])) == [
        "line 1: nested deeper than a case can be",
        "line 2: a NUL character (\\u0000), which no case may hold",
    ]


def test_a_file_is_read_a_line_at_a_time_and_stops_at_its_limits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import_demo()
    read: list[int] = []

    def lines(*texts: str) -> Iterator[bytes]:
        for text in texts:
            read.append(len(read) + 1)
            yield text.encode() + b"\n"

    huge = case(name="huge", inputs={"QUESTION": "x" * cases.MAX_LINE_BYTES})
    refused = problems(lines(case(), huge, "[]", case(name="q")))  # type: ignore[arg-type]
    assert refused == [
        "line 2: a case is at most 1 MiB",
        "line 3: a case is a JSON object with inputs and expect",
    ]
    monkeypatch.setattr(cases, "MAX_PROBLEMS", 3)
    read.clear()
    refused = problems(lines(*["{"] * 10))  # type: ignore[arg-type]
    assert refused[-1] == "line 3: 3 problems: reading stopped here" and read == [1, 2, 3]
    monkeypatch.setattr(cases, "MAX_BYTES", len(case(name="c0")) * 3 // 2)
    read.clear()
    refused = problems(lines(*[case(name=f"c{n}") for n in range(10)]))  # type: ignore[arg-type]
    assert refused == ["line 2: the set is larger than 0 MiB"] and read == [1, 2]  # of 10


def test_a_gates_verdict_names_the_failing_cases_without_reading_any_answer() -> None:
    """Asked in a rollout's locked tick: one query for the names, whatever the run's size."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from apps.rollouts.gate import evaluation_verdict
    from apps.rollouts.plans import Analysis
    from tests.support.quality import demo_faq, wrong_answers

    found = demo_faq()
    names = list(found.cases.order_by("line").values_list("name", flat=True))
    run = wrong_answers(found, right=tuple(names[:2]))
    with CaptureQueriesContext(connection) as queries:
        verdict, detail = evaluation_verdict(run, Analysis())
    assert verdict == "failure"
    assert detail.endswith(f"failing: {', '.join(names[2:7])}, ...")
    (read,) = [q["sql"] for q in queries.captured_queries if "quality_caseresult" in q["sql"]]
    assert "outputs" not in read and "LIMIT 5" in read


def test_a_large_answer_is_judged_whole_and_kept_only_in_part() -> None:
    from apps.quality import evaluations
    from apps.quality.runner import Answer

    import_demo()
    found = evaluation_set_import(model_name="rag_pipeline", name="faq", text=case(), actor="ops")
    run = EvaluationRun.objects.create(evaluation_set=found, version=7)
    long = "faq:orders-track" + " and more" * 5_000
    given = Answer(outputs={"SOURCE": ["faq:orders-track"], "ANSWER": [long]}, latency_ms=3.0)
    kept = evaluations._judged(run, found.cases.get(), 7, given, None)
    assert kept.passed is True  # on the whole answer
    assert kept.outputs["SOURCE"] == ["faq:orders-track"]
    assert kept.outputs["ANSWER"]["truncated"] == "45,020 characters"
    assert len(kept.outputs["ANSWER"]["start"]) == evaluations.MAX_KEPT_OUTPUT


def test_a_run_the_broker_never_took_is_sent_again_for_its_first_minutes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from datetime import timedelta

    from django.utils import timezone

    from apps.quality import tasks

    import_demo()
    found = evaluation_set_import(model_name="rag_pipeline", name="faq", text=case(), actor="ops")
    pool = NodePool.objects.create(name="gpu", queue="eu")
    node = Node.objects.create(name="gpu-1", pool=pool, http_url="http://127.0.0.1:1")
    now = timezone.now()
    made = {}
    for label, age, status in [
        ("unsent", 3, "queued"),
        ("just made", 0, "queued"),
        ("given up", 30, "queued"),
        ("running", 3, "running"),
    ]:
        run = EvaluationRun.objects.create(
            evaluation_set=found, version=1, node=node, status=status
        )
        EvaluationRun.objects.filter(pk=run.pk).update(created_at=now - timedelta(minutes=age))
        made[label] = run.pk
    sent: list[tuple[str, int]] = []
    monkeypatch.setattr(tasks, "send_to", lambda queue, task, run_id: sent.append((queue, run_id)))
    tasks.resend_queued()
    assert sent == [("eu", made["unsent"])]
