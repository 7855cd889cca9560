"""Evaluation data for tests: the demo's FAQ set, and finished runs (evaluations, the
performance gate's) written straight to the database (no Triton)."""

from datetime import timedelta

from django.utils import timezone

from apps.fleet.models import Node
from apps.performance.models import PerfRun
from apps.quality.models import CaseResult, EvaluationRun, EvaluationSet
from apps.quality.rules import score
from apps.quality.services import evaluation_set_import
from apps.registry.models import Model, ModelVersion
from apps.rollouts.models import Rollout
from tests.support import ROOT
from tests.support.registry import import_demo

DEMO_SET = ROOT / "deploy" / "evaluations" / "rag_pipeline-faq.jsonl"


def demo_faq() -> EvaluationSet:
    """The demo repository, every rag_pipeline version with status published, and its set."""
    import_demo()
    ModelVersion.objects.filter(model__name="rag_pipeline").update(
        status=ModelVersion.Status.PUBLISHED
    )
    return evaluation_set_import(
        model_name="rag_pipeline",
        name="faq",
        text=DEMO_SET.read_text(),
        actor="release_manager-user",
        source=DEMO_SET.name,
    )


def wrong_answers(
    found: EvaluationSet,
    *,
    version: int = 7,
    baseline: int = 1,
    right: tuple[str, ...] = (),
    node: Node | None = None,
    baseline_node: Node | None = None,
    purpose: str = "",
) -> EvaluationRun:
    """A finished run where `version` names the wrong source for every case but those named in
    `right`, and the baseline the right one for each, as rag_pipeline v7 (whose reranker ranks
    the worst passage first) does against v1."""
    now = timezone.now()
    cases = list(found.cases.all())
    run = EvaluationRun.objects.create(
        evaluation_set=found,
        version=version,
        baseline_version=baseline,
        node=node,
        baseline_node=baseline_node,
        status=EvaluationRun.Status.DONE,
        score=len(right) / len(cases),
        baseline_score=1.0,
        passed=len(right),
        failed=len(cases) - len(right),
        purpose=purpose,
        requested_by="system:rollouts",
        started_at=now - timedelta(seconds=4),
        finished_at=now,
    )
    results = []
    for case in cases:
        expected = case.expect["SOURCE"]["exact"]
        wrong = "faq:contact" if expected != "faq:contact" else "faq:warranty"
        given = expected if case.name in right else wrong
        for number, source in ((version, given), (baseline, expected)):
            judged = score(case.expect["SOURCE"], [source])
            results.append(
                CaseResult(
                    run=run,
                    case=case,
                    version=number,
                    outputs={
                        "ANSWER": [f"Here is what our help centre says ({source})."],
                        "SOURCE": [source],
                    },
                    scores={"SOURCE": vars(judged)},
                    passed=judged.passed,
                    latency_ms=11.0,
                )
            )
    CaseResult.objects.bulk_create(results)
    return run


def perf_measured(
    model: Model, version: int, rate: float, p99: float = 3.0, node: str = "trio-1"
) -> PerfRun:
    """perf_analyzer's run at concurrency 4, stored as a worker would: `rate` requests a second
    at a P99 of `p99` ms (within any budget by default): the version's capacity a node."""
    run = PerfRun.objects.create(
        model=model,
        version=version,
        node_name=node,
        concurrencies=[4, 4, 1],
        requests=120,
        timeout_s=60,
        status=PerfRun.Status.DONE,
        requested_by="system:rollout-controller",
    )
    run.points.create(
        concurrency=4,
        throughput=rate,
        p50_ms=p99 / 2,
        p90_ms=p99 * 0.8,
        p99_ms=p99,
        queue_us=900,
        compute_us=41000,
    )
    return run


def perf_gate_runs(rollout: Rollout, figures: list[tuple[int, float, float]]) -> list[PerfRun]:
    """The gate's four runs, each (version, throughput, P99 ms)."""
    runs = [perf_measured(rollout.model, *figure) for figure in figures]
    rollout.perf_runs.add(*runs)
    return runs
