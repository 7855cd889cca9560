"""The pipeline's LLM step streams, on 3 real Triton nodes behind a real HAProxy: its answer
is read token by token over gRPC, its first token and tokens are exported under vLLM's names
and scraped by a real Prometheus, and the real worker's judge rolls back a release whose first
token got twice as slow while the whole request did not."""

import json
import random
import re

import pytest
from django.contrib.auth.models import User
from django.test import Client

from apps.devtools.processes import FleetState, Proc
from apps.devtools.traffic import QUESTIONS
from apps.fleet.asking import ask
from apps.fleet.models import NodePool
from apps.fleet.services.deployments import deployment_set
from apps.fleet.triton import TritonClient, sample_inputs
from apps.prometheus.client import instant_query
from apps.quality.models import EvaluationRun
from apps.quality.services import evaluation_set_import, evaluation_start
from apps.registry.services import model_set_budget
from apps.rollouts.models import Rollout
from apps.rollouts.proposals import rollout_start
from tests.support.fleet import converged, traffic_to, until_state, wait_for
from tests.support.services import Celery

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

# rag_pipeline v10: v2's chain, its answer streamed by llm 1 (deploy/models)
STEPS_V10 = {("embedder", 2), ("retriever", 2), ("reranker", 2), ("llm", 1), ("rag_pipeline", 10)}
STEPS_V12 = STEPS_V10 - {("llm", 1), ("rag_pipeline", 10)} | {("llm", 3), ("rag_pipeline", 12)}


@pytest.fixture
def streaming(
    pool: NodePool, trio: tuple[object, FleetState], celery: Celery, settings: object
) -> NodePool:
    """The trio serving the streaming pipeline, the worker judging from its Prometheus."""
    state = trio[1]
    celery.use_prometheus(state.prometheus_url)
    settings.PROMETHEUS_URL = state.prometheus_url  # type: ignore[attr-defined]
    deployment_set(model_name="rag_pipeline", version=10, pool=pool, actor="system:test")
    wait_for("v10 is READY on every node", converged(pool, STEPS_V10), timeout=240)
    return pool


def balanced(haproxy: Proc) -> TritonClient:
    return TritonClient(
        f"http://127.0.0.1:{haproxy.ports['http']}",
        node="balancer",
        grpc=f"127.0.0.1:{haproxy.ports['grpc']}",
    )


def test_an_answer_streams_through_haproxy_token_by_token_and_its_series_are_scraped(
    streaming: NodePool, haproxy: Proc, client: Client, viewer: User
) -> None:
    through = balanced(haproxy)
    spec = through.model_inputs("rag_pipeline")
    asked = [sample_inputs(spec, random.Random(0), texts=[q]) for q in QUESTIONS]
    answers = ask([through], "rag_pipeline", asked, concurrency=3, timeout_s=30)
    assert [a.error for a in answers] == [""] * len(QUESTIONS)
    for answer in answers:
        assert answer.outputs is not None and answer.first_ms is not None
        text = answer.outputs["ANSWER"][0][0].decode()
        # The whole answer, joined from one response a token, its source said once.
        assert answer.responses == len(text.split(" ")) > 10
        assert answer.outputs["SOURCE"][0][0].decode().startswith("faq:")
        assert answer.first_ms < answer.latency_ms  # type: ignore[operator]
    served = 'sum(vllm:time_to_first_token_seconds_count{model="llm",version="1",pool="trio"})'
    wait_for(
        "Prometheus holds every answer's first token",
        lambda: sum(value for _, value in instant_query(served)) >= len(QUESTIONS),
        timeout=30,
    )
    # The pipeline's budget, its LLM step split: the first token, then the longest answer.
    model_set_budget(model_name="llm", latency_budget_ms=2000, actor="sre")
    client.force_login(viewer)
    split = client.get("/metrics/breakdown/rag_pipeline/").content.decode()
    assert "Step of v10" in split  # found from its steps' series: its own say v1
    assert "longest answer after it: 128 tokens (max_tokens)" in split
    assert re.search(r"128 x \d+\.\d ms = \d+ ms", split), split
    assert re.search(r"first token, P99 \(15 min\)</td><td>\d+ ms", split), split


def test_a_streamed_answer_is_judged_whole_and_keeps_its_first_token_and_tokens(
    streaming: NodePool,
) -> None:
    case = {
        "name": "track",
        "inputs": {"QUESTION": "How do I track my order?"},
        # A phrase from the middle of the answer: no one token holds it.
        "expect": {
            "ANSWER": {"contains": "choose Track package; the carrier link"},
            "SOURCE": {"exact": "faq:orders-track"},
        },
    }
    found = evaluation_set_import(
        model_name="rag_pipeline", name="streamed", text=json.dumps(case), actor="ci"
    )
    node = streaming.nodes.order_by("name").first()
    run = evaluation_start(set_id=found.pk, version=10, node=node, actor="ci")
    done = EvaluationRun.objects.filter(pk=run.pk, status=EvaluationRun.Status.DONE)
    wait_for("the worker ran the case", done.exists, timeout=60)
    result = run.results.get()
    assert result.passed, result.scores
    [answer] = result.outputs["ANSWER"]
    assert result.tokens == len(answer.split(" ")) > 10
    assert 0 < result.first_ms < result.latency_ms  # type: ignore[operator]


def test_a_release_whose_first_token_is_twice_as_slow_is_rolled_back_on_it(
    streaming: NodePool, haproxy: Proc, trio: tuple[object, FleetState]
) -> None:
    """llm 3 answers as fast in all as llm 1, its first token twice as late."""
    with traffic_to(trio[1], balancer=haproxy, rps=8):
        rollout = rollout_start(
            model_name="rag_pipeline",
            pool_name=streaming.name,
            canary_version=12,
            plan="1 node, hold 60s\n100%",
            # Judged every 2 s on 2 s samples over the last 10 s, once 2 s of warm-up passed.
            analysis={
                "judge": "statistical",
                "interval_s": 2,
                "sample_s": 2,
                "window_s": 10,
                "warmup_s": 2,
                "failure_limit": 1,
            },
            actor="release-manager",
        )
        rollout = until_state(rollout, Rollout.State.ROLLED_BACK, Rollout.State.SUCCEEDED)
        assert rollout.state == Rollout.State.ROLLED_BACK, rollout.reason
        assert "time to first token (samples)" in rollout.reason
        # The failing round's (a round before it may have found too few samples yet).
        ttft = rollout.measurements.filter(metric="time to first token (samples)")
        failing = ttft.get(verdict="failure")
        assert failing.evidence["effect"] > 0.5
        assert 'model="llm"' in failing.query
        whole = rollout.measurements.filter(metric="latency (samples)", verdict="failure")
        assert not whole.exists()  # the whole request did not tell
        wait_for("v10 alone everywhere", converged(streaming, STEPS_V10), timeout=60)
