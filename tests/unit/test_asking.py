"""One way to ask a node (apps/fleet/asking.py): the batch's order kept, the nodes taken in turn,
a bounded number at a time, each failure an answer of its own; and no other thread pool of the
product sends inference requests. Against real Triton: the integration tests of evaluations,
warm-ups, probes and synthetic load."""

import ast
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from apps.fleet.asking import ask
from apps.fleet.triton import (
    Reply,
    Session,
    TritonClient,
    TritonRejected,
    TritonTimeout,
    tensors_from,
    tensors_json,
)

APPS = Path(__file__).parents[2] / "apps"


def test_a_batch_goes_round_robin_a_bounded_number_at_a_time_each_failure_its_own_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sent: list[tuple[str, int, int | None]] = []
    busy, most = [0], [0]
    lock = threading.Lock()

    def reply(
        self: Session, model: str, inputs: dict[str, np.ndarray], *, version: int | None = None
    ) -> Reply:
        index = int(inputs["I"][0])
        with lock:
            busy[0] += 1
            most[0] = max(most[0], busy[0])
            sent.append((self.owner.node, index, version))
        time.sleep(0.01)
        with lock:
            busy[0] -= 1
        if index == 3:
            raise TritonTimeout(self.owner.node, "timed out")
        if index == 4:
            raise TritonRejected(self.owner.node, "unexpected shape for input 'I'")
        return Reply({"O": inputs["I"] * 2})

    monkeypatch.setattr(Session, "reply", reply)
    clients = [TritonClient(f"http://127.0.0.1:{port}", node=f"n{port}") for port in (1, 2)]
    requests = [{"I": np.array([i], dtype=np.int64)} for i in range(8)]
    answers = ask(clients, "m", requests, version=2, concurrency=3, timeout_s=0.5)

    assert [a.outputs["O"][0] if a.outputs else None for a in answers] == [
        0, 2, 4, None, None, 10, 12, 14,
    ]  # fmt: skip
    assert [a.node for a in answers] == ["n1", "n2"] * 4
    assert (answers[3].error, answers[4].error) == (
        "no answer within 0.5 s",
        "unexpected shape for input 'I'",
    )
    assert all(a.latency_ms and a.latency_ms >= 10 for a in answers if a.outputs)
    assert sorted(i for _, i, _ in sent) == list(range(8)) and {v for *_, v in sent} == {2}
    assert most[0] <= 3


def test_a_paced_batch_keeps_its_rate_and_reports_between_sends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(Session, "reply", lambda self, model, inputs, **_: Reply({}))
    ticks: list[float] = []
    start = time.monotonic()
    answers = ask(
        [TritonClient("http://127.0.0.1:1")],
        "m",
        [{}] * 5,
        rps=50,
        between=lambda: ticks.append(time.monotonic() - start),
    )
    assert len(answers) == len(ticks) == 5
    assert ticks[-1] >= 4 / 50  # the fifth is sent no earlier than its turn


def test_sample_inputs_are_stored_as_triton_json_and_come_back_the_same() -> None:
    inputs = {
        "QUESTION": np.array([[b"track my order"]], dtype=np.object_),
        "EMBEDDING": np.arange(6, dtype=np.float32).reshape(1, 6),
    }
    stored = tensors_json(inputs)
    assert stored["QUESTION"] == {"datatype": "BYTES", "shape": [1, 1], "data": ["track my order"]}
    back = tensors_from(stored)
    assert back["QUESTION"].tolist() == [[b"track my order"]]
    assert (
        back["EMBEDDING"].dtype == np.float32 and (back["EMBEDDING"] == inputs["EMBEDDING"]).all()
    )


def test_no_other_thread_pool_of_the_product_sends_inference_requests() -> None:
    """The demo's tooling (apps/devtools) sends user traffic of its own; the product does not."""
    found = [
        f"{path.relative_to(APPS.parent)}:{node.lineno}"
        for path in sorted(APPS.glob("**/*.py"))
        if "devtools" not in path.parts and path.name != "asking.py"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Name | ast.Attribute)
        and (node.id if isinstance(node, ast.Name) else node.attr) == "ThreadPoolExecutor"
    ]
    assert not found, "\n".join(found)
