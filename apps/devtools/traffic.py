"""Bounded synthetic traffic: real inference requests sent round-robin across nodes."""

import itertools
import random
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import numpy as np

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
    """Send about `rps * seconds` requests, then stop; counts results as `node ok|failed`."""
    rng = random.Random(seed)
    spec = wait_for_model(clients[0], model, timeout=wait)
    results: Counter[str] = Counter()
    nodes = itertools.cycle(clients)

    def one(client: TritonClient, inputs: dict[str, np.ndarray]) -> None:
        try:
            client.infer(model, inputs)
            results[f"{client.node} ok"] += 1
        except TritonError:
            results[f"{client.node} failed"] += 1

    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=8) as pool:
        for sent in itertools.count():
            due = start + sent / rps
            if due - start >= seconds:
                break
            time.sleep(max(0.0, due - time.monotonic()))
            pool.submit(one, next(nodes), sample_inputs(spec, rng, texts=QUESTIONS))
    return results
