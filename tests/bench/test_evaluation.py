"""An evaluation of 100 cases on one real Triton node, against a plain tritonclient loop at the
same concurrency, measured side by side.

Product: `evaluation_execute` of a queued run (the worker's whole task: each case sent to an
explicit version through the product's client, 4 at a time, each answer scored and stored).
Floor: the same 100 requests, to the same version and node, from 4 threads each holding one
`tritonclient.http` client. They alternate, ROUNDS each, on the trio serving rag_pipeline v1,
the worker paused; medians are reported. Target and assertion: the product costs at most 1.2x
the floor.

Run with `make bench` (not part of CI), or alone:
`DATABASE_URL=postgres://postgres@127.0.0.1:5432/test .venv/bin/pytest tests/bench/test_evaluation.py -s -p no:cacheprovider`
"""

import json
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.http as httpclient

from apps.fleet.models import Node, NodePool
from apps.quality.evaluations import evaluation_execute
from apps.quality.models import EvaluationRun
from apps.quality.services import evaluation_set_import, evaluation_start
from tests.support.bench import Report
from tests.support.quality import DEMO_SET
from tests.support.services import Celery

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

ROUNDS = 5
CASES = 100
CONCURRENCY = 4


def hundred_cases() -> str:
    demo = DEMO_SET.read_text().splitlines()
    lines = []
    for number in range(CASES):
        case = json.loads(demo[number % len(demo)])
        lines.append(json.dumps(case | {"name": f"{case['name']}-{number}"}))
    return "\n".join(lines)


def floor(url: str, questions: list[str]) -> float:
    """The plain loop: each thread its own client, every question to version 1."""
    local = threading.local()

    def one(question: str) -> None:
        if not hasattr(local, "client"):
            local.client = httpclient.InferenceServerClient(url.removeprefix("http://"))
        tensor = httpclient.InferInput("QUESTION", [1, 1], "BYTES")
        tensor.set_data_from_numpy(np.array([[question.encode()]], dtype=np.object_))
        local.client.infer("rag_pipeline", [tensor], model_version="1")

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=CONCURRENCY) as pool:
        list(pool.map(one, questions))
    return time.perf_counter() - start


def product(set_id: int, node: Node) -> float:
    run = evaluation_start(
        set_id=set_id, version=1, node=node, concurrency=CONCURRENCY, actor="system:bench"
    )
    start = time.perf_counter()
    evaluation_execute(run_id=run.pk)
    took = time.perf_counter() - start
    run.refresh_from_db()
    assert (run.status, run.passed) == (EvaluationRun.Status.DONE, CASES)
    return took


def test_an_evaluation_costs_at_most_a_fifth_more_than_a_plain_client_loop(
    serving_v1: NodePool, celery: Celery, report: Report
) -> None:
    found = evaluation_set_import(
        model_name="rag_pipeline", name="bench", text=hundred_cases(), actor="system:bench"
    )
    questions = [case.inputs["QUESTION"] for case in found.cases.all()]
    node = Node.objects.get(name="trio-1")
    celery.pause()  # the run is sent here, not by the worker
    try:
        floor(node.http_url, questions)  # connections and the pipeline warmed up alike
        product(found.pk, node)
        floors, products = [], []
        for _ in range(ROUNDS):
            floors.append(floor(node.http_url, questions))
            products.append(product(found.pk, node))
    finally:
        celery.resume()
    ratio = statistics.median(products) / statistics.median(floors)
    name = f"evaluation, {CASES} cases on 1 node"
    report.add(name, "plain tritonclient loop (median)", f"{statistics.median(floors):.3f} s")
    report.add(name, "product (median)", f"{statistics.median(products):.3f} s")
    report.add(name, "product / plain", f"{ratio:.2f}x", "<= 1.2x")
    assert ratio <= 1.2, f"{ratio:.2f}x the plain loop"
