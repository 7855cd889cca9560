"""What streaming costs, measured on the trio of real Triton nodes behind a real HAProxy:

- the first token through HAProxy and the pipeline (rag_pipeline v10) against the LLM step alone
  (llm 1, asked on a node with the very passages the pipeline would give it), at the same
  concurrency: a ratio, both measured in this run;
- streams cut by a release and its move back, drained node by node, under 10 streams a second
  through HAProxy (target 0).

Run with `make bench` (not part of CI), or alone:
`DATABASE_URL=postgres://postgres@127.0.0.1:5432/test .venv/bin/pytest tests/bench/test_llm_streams.py -s -p no:cacheprovider`
"""

import importlib.util
import json
import random
import statistics
import time
from types import ModuleType

import numpy as np
import pytest

from apps.devtools.processes import FleetState, Proc
from apps.devtools.traffic import QUESTIONS
from apps.fleet.asking import ask
from apps.fleet.models import NodePool
from apps.fleet.services.deployments import deployment_set
from apps.fleet.triton import TritonClient, sample_inputs
from tests.support import ROOT
from tests.support.bench import Report
from tests.support.fleet import equal, nodes_asked, settled, traffic_to, wait_for, weights

STEPS_V10 = {("embedder", 2), ("retriever", 2), ("reranker", 2), ("llm", 1), ("rag_pipeline", 10)}
STEPS_V11 = STEPS_V10 - {("llm", 1), ("rag_pipeline", 10)} | {("llm", 2), ("rag_pipeline", 11)}
ASKED = 60
CONCURRENCY = 2


def ragkit() -> ModuleType:
    """The demo models' own code, to give the LLM step what the pipeline's steps give it."""
    spec = importlib.util.spec_from_file_location("ragkit", ROOT / "deploy/ragkit/ragkit.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def prompts(questions: list[str]) -> list[dict[str, np.ndarray]]:
    """Each question with the passages v10's retriever 2 and reranker 2 rank for it."""
    kit = ragkit()
    asked = []
    for question in questions:
        found = kit.retrieve(kit.embed(question, refined=True), refined=True, k=6)
        ranked = kit.rerank(question, found, refined=True)
        passages = [json.dumps(p).encode() for p in ranked]
        asked.append(
            {
                "QUESTION": np.array([[question.encode()]], dtype=np.object_),
                "CONTEXTS": np.array([passages], dtype=np.object_),
            }
        )
    return asked


def first_tokens(
    clients: list[TritonClient], model: str, requests: list[dict[str, np.ndarray]]
) -> float:
    answers = ask(clients, model, requests, concurrency=CONCURRENCY, timeout_s=30)
    assert [a.error for a in answers] == [""] * len(requests)
    return statistics.median(a.first_ms for a in answers if a.first_ms is not None)


@pytest.mark.timeout(1200)
@pytest.mark.django_db(transaction=True)
def test_streaming_adds_little_and_a_drained_release_cuts_no_stream(
    weighted: NodePool, haproxy: Proc, trio: tuple[object, FleetState], report: Report
) -> None:
    state = trio[1]
    deployment_set(model_name="rag_pipeline", version=10, pool=weighted, actor="system:bench")
    in_traffic = lambda: weights(haproxy) == equal(state)  # noqa: E731
    wait_for("v10 everywhere, in traffic", lambda: settled(weighted, STEPS_V10)() and in_traffic())
    questions = [random.Random(n).choice(QUESTIONS) for n in range(ASKED)]
    through = TritonClient(
        f"http://127.0.0.1:{haproxy.ports['http']}",
        node="balancer",
        grpc=f"127.0.0.1:{haproxy.ports['grpc']}",
    )
    spec = through.model_inputs("rag_pipeline")
    pipeline = [sample_inputs(spec, random.Random(0), texts=[q]) for q in questions]
    alone = prompts(questions)
    node = nodes_asked(state)[:1]
    first_tokens([through], "rag_pipeline", pipeline[:10])  # warm both paths
    first_tokens(node, "llm", alone[:10])
    rounds = [
        (first_tokens(node, "llm", alone), first_tokens([through], "rag_pipeline", pipeline))
        for _ in range(3)
    ]
    step, whole = (statistics.median(side) for side in zip(*rounds, strict=True))
    bench = f"streaming, {ASKED} answers at concurrency {CONCURRENCY}, 3 rounds alternated"
    report.add(bench, "first token, llm 1 alone on a node", f"{step:.0f} ms", "")
    report.add(bench, "first token, through HAProxy and rag_pipeline v10", f"{whole:.0f} ms", "")
    report.add(
        bench, "through HAProxy and the pipeline / alone", f"{whole / step:.2f}x", "<= 1.15x"
    )

    with traffic_to(state, balancer=haproxy, rps=10) as outcomes:
        wait_for("streams flow", lambda: outcomes.total() >= 20, timeout=60)
        started = time.monotonic()
        deployment_set(model_name="rag_pipeline", version=11, pool=weighted, actor="bench")
        wait_for("v11 everywhere", lambda: settled(weighted, STEPS_V11)() and in_traffic(), 240)
        deployment_set(model_name="rag_pipeline", version=10, pool=weighted, actor="bench")
        wait_for("v10 again", lambda: settled(weighted, STEPS_V10)() and in_traffic(), 240)
        took = time.monotonic() - started
        time.sleep(4)  # the last streams end
    cut = sum(n for outcome, n in outcomes.items() if outcome.endswith("failed"))
    bench = "streams at 10/s through HAProxy, a release and its move back, node by node"
    report.add(bench, "streams cut", f"{cut} of {outcomes.total()} ({took:.0f} s)", "0")
