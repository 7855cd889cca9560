"""A node that takes connections and never answers: every case of an evaluation fails with its
reason, within its own timeout, and the run finishes. The real tritonclient and its timeouts."""

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from apps.fleet.models import Node, NodePool
from apps.quality.evaluations import evaluation_execute
from apps.quality.models import EvaluationRun
from apps.quality.services import evaluation_set_import, evaluation_start
from tests.support.quality import DEMO_SET
from tests.support.registry import import_demo

pytestmark = [pytest.mark.integration, pytest.mark.django_db]


@pytest.fixture
def silent_node() -> Iterator[str]:
    """An address that accepts connections and reads requests, and never answers one."""
    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(5)
        for each in held:
            each.close()
        server.close()


def test_cases_that_get_no_answer_fail_with_their_reason_and_the_run_still_ends(
    silent_node: str,
) -> None:
    import_demo()
    text = DEMO_SET.read_text()
    cases = "\n".join(text.splitlines()[:8])
    found = evaluation_set_import(model_name="rag_pipeline", name="faq", text=cases, actor="ci")
    pool = NodePool.objects.create(name="quiet")
    node = Node.objects.create(name="quiet-1", pool=pool, http_url=silent_node)
    run = evaluation_start(
        set_id=found.pk, version=1, node=node, concurrency=4, timeout_s=0.5, actor="ci"
    )
    start = time.monotonic()
    evaluation_execute(run_id=run.pk)
    took = time.monotonic() - start
    run.refresh_from_db()
    assert (run.status, run.score, run.passed, run.failed) == (EvaluationRun.Status.DONE, 0.0, 0, 8)
    assert {r.error for r in run.results.all()} == {"no answer within 0.5 s"}
    assert took < 8 * 0.5  # 4 at a time: two rounds of timeouts, not eight
