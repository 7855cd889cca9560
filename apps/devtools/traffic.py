"""Bounded synthetic traffic: real inference requests sent round-robin across nodes."""

import random
import time
from collections import Counter

from apps.fleet.asking import ask
from apps.fleet.triton import TritonClient, TritonError, sample_inputs

QUESTIONS = [
    "How do I track my order?",
    "when will my refund arrive",
    "Can I still cancel my order?",
    "how much is shipping to Germany",
    "I forgot my password",
    "The blender arrived broken, what now?",
    "Do you accept PayPal?",
    "where is my invoice",
    "do gift cards expire",
    "How do I return shoes that do not fit?",
]


def wait_for_model(
    client: TritonClient, model: str, *, timeout: float
) -> list[tuple[str, str, list[int]]]:
    """The model's inputs, once the node serves it (the reconciler may still be loading it)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return client.model_inputs(model)
        except TritonError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(1.0)


def send_traffic(
    clients: list[TritonClient],
    *,
    model: str,
    rps: float,
    seconds: float,
    seed: int = 0,
    wait: float = 0.0,
) -> Counter[str]:
    """Send about `rps * seconds` requests, then stop; counts results as `node ok|failed`. A
    pipeline that streams its answer is read as a stream (over gRPC), as its users read it."""
    rng = random.Random(seed)
    spec = wait_for_model(clients[0], model, timeout=wait)
    requests = [
        sample_inputs(spec, rng, texts=QUESTIONS) for _ in range(max(1, int(rps * seconds)))
    ]
    answers = ask(clients, model, requests, concurrency=8, rps=rps)
    return Counter(f"{a.node} {'failed' if a.outputs is None else 'ok'}" for a in answers)
