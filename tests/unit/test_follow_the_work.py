"""A quality-gated rollout followed through the code, call by call, as a new maintainer reads it
(the README's "follow the work"): the files it enters, and how often it comes back to each. The
nodes and Prometheus are stubbed at their boundaries (what the workers do, loads and the
evaluation's requests, is the integration tests')."""

import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from types import FrameType
from typing import Any

import pytest
from django.db.models import F
from django.utils import timezone

from apps.fleet.desired import fleet_desired
from apps.fleet.models import Node, NodePool
from apps.fleet.services.deployments import deployment_set
from apps.prometheus.client import Series
from apps.quality.models import EvaluationRun
from apps.rollouts import analysis
from apps.rollouts.models import Rollout
from apps.rollouts.services import rollout_start
from apps.rollouts.tick import rollout_advance
from tests.support import ROOT
from tests.support.quality import demo_faq

pytestmark = pytest.mark.django_db

APPS = f"{ROOT}/apps/"
FLOW = f"{ROOT}/apps/rollouts/"  # the rollout's calls; another app's own calls are its business
STUBS = {"converged"}  # the workers' side, done by the test
READER = {"test_a_quality_gated_rollout_enters_few_files_and_comes_back_to_none_often", "ticked"}
FIRST = 50  # the calls a reader follows before knowing the way
MOST_FILES = 25  # as traced here; the workers' side adds its own (README)
MOST_ENTRIES = 3  # visits to one file among the first calls


def _function(frame: FrameType) -> bool:
    """A module's own function, as a reader names it: not a method, a closure or a wrapper (an
    audited service runs inside `audited`'s `_holding`)."""
    code = frame.f_code
    return "." not in code.co_qualname and code.co_name[0] != "<" and code.co_name != "_holding"


def _name(frame: FrameType) -> str:
    return f"{frame.f_code.co_filename.removeprefix(f'{ROOT}/')}:{frame.f_code.co_name}"


@contextmanager
def followed(into: list[tuple[str, str]]) -> Iterator[None]:
    """Each call the flow makes from one of its files into a function of another file, as its
    (caller, callee), once: the reader reads a call once, however often a loop makes it. A
    wrapper (an audited service) is passed through."""

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        here = frame.f_code.co_filename
        if event != "call" or not here.startswith(APPS) or not _function(frame):
            return
        if frame.f_back is None or frame.f_back.f_code.co_filename == here:
            return  # within its own file: no entry
        caller = frame.f_back
        while caller is not None and not (
            (caller.f_code.co_filename.startswith(APPS) and _function(caller))
            or caller.f_code.co_name in READER | STUBS
        ):
            caller = caller.f_back
        if caller is None or caller.f_code.co_filename == here or caller.f_code.co_name in STUBS:
            return
        if caller.f_code.co_filename.startswith(FLOW) or caller.f_code.co_name in READER:
            into.append((_name(caller), _name(frame)))

    sys.setprofile(profile)
    try:
        yield
    finally:
        sys.setprofile(None)


def converged(pool: NodePool) -> None:
    """Every node's index read back serving its desired state, as the reconciler leaves it."""
    desired, now = fleet_desired(pool_ids=[pool.pk]), timezone.now()
    for node in pool.nodes.all():
        index = [
            {"model": name, "version": version, "state": "READY", "reason": ""}
            for name, wanted in desired.of(node).items()
            for version in wanted.versions
        ]
        Node.objects.filter(pk=node.pk).update(index=index, last_seen=now)


def answered(query: str) -> list[tuple[dict[str, str], float]]:
    """Prometheus: each node served 100 requests in the window, none failed, 40 ms at most (a
    step's mean latency at each version)."""
    if "kv_cache" in query:
        return []  # no LLM here
    value = 0.0 if "failure" in query else 40.0 if "duration" in query else 100.0
    return [({"node": f"trio-{n}", "version": v}, value) for n in (1, 2, 3) for v in ("1", "2")]


def sampled(query: str, **_: object) -> list[Series]:
    """Prometheus' samples: canary and baseline alike; no LLM's."""
    if "vllm:" in query:
        return []
    value = 0.0 if "failure" in query else 40.0
    return [Series({"node": f"trio-{n}"}, [], [value] * 4) for n in (1, 2, 3)]


def ticked(rollout: Rollout) -> Rollout:
    """A tick, a minute after the last one (the timestamps the controller reads move back), on
    nodes that loaded what they were told."""
    converged(rollout.pool)
    earlier = timedelta(minutes=1)
    found = Rollout.objects.filter(pk=rollout.pk)
    found.filter(step_ready_at__isnull=False).update(step_ready_at=F("step_ready_at") - earlier)
    found.filter(last_measured_at__isnull=False).update(
        last_measured_at=F("last_measured_at") - earlier
    )
    rollout_advance(rollout_id=rollout.pk)
    return found.get()


def test_a_quality_gated_rollout_enters_few_files_and_comes_back_to_none_often(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    faq = demo_faq()
    pool = NodePool.objects.create(name="trio")
    for n in (1, 2, 3):
        Node.objects.create(name=f"trio-{n}", pool=pool, http_url=f"http://10.0.0.{n}:8000")
    deployment_set(model_name="rag_pipeline", version=1, pool=pool, actor="ops")
    monkeypatch.setattr(analysis, "instant_query", answered)
    monkeypatch.setattr(analysis, "range_query", sampled)
    calls: list[tuple[str, str]] = []
    with followed(calls):
        rollout = rollout_start(
            model_name="rag_pipeline",
            pool_name="trio",
            canary_version=2,
            plan="1 node, hold 1m\n100%",
            analysis={"quality_set": faq.name, "warmup_s": 0, "window_s": 20, "interval_s": 10},
            actor="release-manager",
        )
        rollout = ticked(ticked(rollout))  # the step's share out; its canary READY: the gate
        assert rollout.gate_run is not None
        EvaluationRun.objects.filter(pk=rollout.gate_run.pk).update(
            status=EvaluationRun.Status.DONE,
            score=1.0,
            baseline_score=1.0,
            passed=30,
            finished_at=timezone.now(),
        )
        for _ in range(8):
            if rollout.state in Rollout.TERMINAL:
                break
            rollout = ticked(rollout)
    assert rollout.state == Rollout.State.SUCCEEDED, rollout.reason
    edges = list(dict.fromkeys(calls))
    files = list(dict.fromkeys(_file(callee) for _, callee in edges))
    entries = Counter(callee for _, callee in _visits(edges[:FIRST])).most_common(3)
    assert len(files) <= MOST_FILES, "entered, in order:\n" + "\n".join(files)
    assert entries[0][1] <= MOST_ENTRIES, "\n".join(f"{a} -> {b}" for a, b in edges[:FIRST])


def _file(name: str) -> str:
    return name.split(":")[0]


def _visits(edges: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The files entered, as (from, into), a call after another from the same file into the
    same file being one visit: a reader opens `into` once to read both."""
    visits: list[tuple[str, str]] = []
    for caller, callee in edges:
        visit = (_file(caller), _file(callee))
        if not visits or visits[-1] != visit:
            visits.append(visit)
    return visits
