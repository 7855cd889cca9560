"""What the worker carries out: a queued evaluation run (every case sent, every answer scored
and stored) and a synthetic load."""

import json
import threading
import time
from datetime import datetime, timedelta
from typing import Any

from django.db import transaction
from django.utils import timezone

from apps.fleet import asking
from apps.fleet.models import Node
from apps.fleet.triton import TritonClient
from apps.quality.cases import Signature
from apps.quality.errors import QualityError
from apps.quality.models import CaseResult, EvaluationCase, EvaluationRun, SyntheticLoad
from apps.quality.rules import MISSING, score
from apps.quality.runner import Answer, ask, request, storable
from apps.quality.selectors import reference_version


def evaluation_execute(*, run_id: int) -> None:
    """Send every case, score and store the answers. Claimed by a conditional update, so a run
    delivered twice is sent once."""
    claimed = EvaluationRun.objects.filter(pk=run_id, status=EvaluationRun.Status.QUEUED).update(
        status=EvaluationRun.Status.RUNNING, started_at=timezone.now()
    )
    if claimed != 1:
        return
    run = EvaluationRun.objects.select_related(
        "evaluation_set__model", "node", "baseline_node"
    ).get(pk=run_id)
    try:
        answers = _answers(run)
    except QualityError as exc:
        return _finish(run, status=EvaluationRun.Status.FAILED, error=str(exc))
    _store(run, answers)


def runs_unsent(now: datetime | None = None) -> list[tuple[int, str]]:
    """(run, its node's queue) of each run still queued a minute after it was made, and no more
    than ten: one a broker that was away never took."""
    now = now or timezone.now()
    waiting = EvaluationRun.objects.filter(
        status=EvaluationRun.Status.QUEUED,
        created_at__lt=now - timedelta(minutes=1),
        created_at__gte=now - timedelta(minutes=10),
    )
    return list(waiting.values_list("pk", "node__pool__queue"))


def evaluation_timed_out(*, run_id: int, limit_s: int) -> None:
    """A run stopped at its worker's time limit: failed, saying so, for whoever waits on it
    (a rollout's gate pauses on it at once rather than at its deadline)."""
    EvaluationRun.objects.filter(pk=run_id, status=EvaluationRun.Status.RUNNING).update(
        status=EvaluationRun.Status.FAILED,
        error=f"stopped at its time limit of {limit_s} s: too many cases, or too slow a node",
        finished_at=timezone.now(),
    )


def _answers(run: EvaluationRun) -> dict[int, tuple[list[EvaluationCase], list[Answer]]]:
    model = run.evaluation_set.model
    cases = list(run.evaluation_set.cases.all())
    sides = {run.version: run.node}
    if run.baseline_version:
        sides[run.baseline_version] = run.baseline_node
    configs = dict(model.versions.filter(version__in=sides).values_list("version", "config"))
    found = {}
    for version, node in sides.items():
        if node is None:
            raise QualityError(f"the node chosen for v{version} is gone")
        signature = Signature.of(configs[version])
        try:
            requests = [request(c.inputs, signature) for c in cases]
        except (KeyError, ValueError) as exc:
            raise QualityError(f"v{version} takes other inputs than the set's: {exc}") from exc
        client = TritonClient.of(node)
        answers = ask(
            client,
            model=model.name,
            version=version,
            requests=requests,
            batched=signature.batched,
            concurrency=run.concurrency,
            timeout_s=run.timeout_s,
        )
        found[version] = (cases, answers)
    return found


def _store(
    run: EvaluationRun, answers: dict[int, tuple[list[EvaluationCase], list[Answer]]]
) -> None:
    rows = []
    baseline = answers.get(run.baseline_version or 0)
    for version, (cases, given) in answers.items():
        for index, (case, answer) in enumerate(zip(cases, given, strict=True)):
            against = baseline[1][index] if baseline and version == run.version else None
            rows.append(_judged(run, case, version, answer, against))
    scores = {version: _share([r for r in rows if r.version == version]) for version in answers}
    with transaction.atomic():
        CaseResult.objects.bulk_create(rows)
        mine = [r for r in rows if r.version == run.version]
        _finish(
            run,
            status=EvaluationRun.Status.DONE,
            score=scores[run.version],
            baseline_score=scores.get(run.baseline_version or 0),
            passed=sum(r.passed is True for r in mine),
            failed=sum(r.passed is False for r in mine),
        )


def _judged(
    run: EvaluationRun,
    case: EvaluationCase,
    version: int,
    answer: Answer,
    baseline: Answer | None,
) -> CaseResult:
    """One version's answer to one case, judged by each of its rules ("agrees" rules against
    the baseline's answer to the same case, on the version under test only)."""
    scores: dict[str, dict[str, Any]] = {}
    if answer.outputs is not None:
        for output, rule in case.expect.items():
            other = baseline.outputs.get(output) if baseline and baseline.outputs else MISSING
            judged = score(rule, answer.outputs.get(output), baseline=other)
            scores[output] = {
                "passed": judged.passed,
                "value": judged.value,
                "detail": judged.detail,
            }
    applied = [s["passed"] for s in scores.values() if s["passed"] is not None]
    passed = False if answer.error else (all(applied) if applied else None)
    return CaseResult(
        run=run,
        case=case,
        version=version,
        outputs=_kept(storable(answer.outputs or {})),
        scores=storable(scores),
        passed=passed,
        latency_ms=answer.latency_ms,
        first_ms=answer.first_ms,
        tokens=answer.tokens,
        error=answer.error,
    )


# What is kept of one answer's outputs, for the run's page: an LLM step's or an embedding's can be
# large, and a set holds up to thousands of cases, each answered twice.
MAX_KEPT_OUTPUT = 16 * 1024


def _kept(outputs: dict[str, Any]) -> dict[str, Any]:
    """Each output as answered, or, past MAX_KEPT_OUTPUT characters of JSON, its beginning and
    its size: it was judged whole, before this."""
    kept = {}
    for name, value in outputs.items():
        text = json.dumps(value)
        kept[name] = (
            value
            if len(text) <= MAX_KEPT_OUTPUT
            else {"truncated": f"{len(text):,} characters", "start": text[:MAX_KEPT_OUTPUT]}
        )
    return kept


def _share(rows: list[CaseResult]) -> float | None:
    judged = [r.passed for r in rows if r.passed is not None]
    return sum(judged) / len(judged) if judged else None


def _finish(run: EvaluationRun, **values: Any) -> None:
    values["finished_at"] = timezone.now()
    EvaluationRun.objects.filter(pk=run.pk).update(**values)
    for key, value in values.items():
        setattr(run, key, value)


def load_drive(*, load_id: int) -> None:
    """Send the load's requests at its rate, round-robin over its nodes, counting what was
    answered; the counts are saved every few seconds, for the pages and the judge's evidence."""
    claimed = SyntheticLoad.objects.filter(pk=load_id, claimed_at=None).update(
        claimed_at=timezone.now()
    )
    if claimed != 1:
        return
    load = SyntheticLoad.objects.select_related("evaluation_set__model").get(pk=load_id)
    model = load.evaluation_set.model
    reference = reference_version(model)
    nodes = {n.name: n for n in Node.objects.filter(name__in=load.nodes)}
    if reference is None or not nodes:
        return
    signature = Signature.of(reference.config)
    requests = [request(c.inputs, signature) for c in load.evaluation_set.cases.all()]
    clients = [TritonClient.of(nodes[name]) for name in load.nodes if name in nodes]
    total = int(load.rps * load.seconds)
    counts = {"sent": 0, "failed": 0}
    lock = threading.Lock()
    saved = [time.monotonic()]

    def answered(answer: asking.Answer) -> None:
        with lock:
            counts["failed" if answer.error else "sent"] += 1

    def between() -> None:  # in this thread, which holds the database connection
        if time.monotonic() - saved[0] >= SAVE_EVERY_S:
            saved[0] = time.monotonic()
            with lock:  # the counts as they stand; written with no answer kept waiting
                now = dict(counts)
            SyntheticLoad.objects.filter(pk=load_id).update(**now)

    asking.ask(
        clients,
        model.name,
        [requests[index % len(requests)] for index in range(total)],
        concurrency=LOAD_THREADS,
        rps=load.rps,
        answered=answered,
        between=between,
    )
    SyntheticLoad.objects.filter(pk=load_id).update(**counts)


LOAD_THREADS = 4
SAVE_EVERY_S = 5.0
