"""One way to send inference requests to nodes: warm-ups, degradation probes, evaluations and
synthetic load all send theirs through `ask`, and nothing else holds a thread pool that does.

A batch of requests goes to a model (to one version of it, when given), round-robin over the
nodes given, a bounded number at a time, each within its own timeout, paced at a rate when asked.
A request that fails or takes too long is an answer with its error: one slow request never holds
the rest. A model that answers with a stream (decoupled) is asked over gRPC, its answer joined,
with the time to its first response."""

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass

import numpy as np

from apps.fleet.triton import Session, TritonClient, TritonError, TritonTimeout


@dataclass(frozen=True)
class Answer:
    node: str
    outputs: dict[str, np.ndarray] | None  # None: failed, saying why in `error`
    latency_ms: float | None
    error: str = ""
    first_ms: float | None = None  # a streamed answer's first response
    responses: int = 1  # a streamed answer's responses (its tokens)


def ask(
    clients: Sequence[TritonClient],
    model: str,
    requests: Sequence[dict[str, np.ndarray]],
    *,
    version: int | None = None,
    concurrency: int = 1,
    timeout_s: float | None = None,
    rps: float | None = None,
    answered: Callable[[Answer], None] | None = None,
    between: Callable[[], None] | None = None,
) -> list[Answer]:
    """One answer per request, in their order; request i goes to clients[i % len(clients)], over
    a connection its thread keeps to that node. Paced at `rps` when given, `between()` called in
    the caller's thread between sends (to save progress); `answered(answer)` in the sending
    thread as each answer comes."""
    local = threading.local()
    with ExitStack() as sessions, ThreadPoolExecutor(max_workers=concurrency) as pool:
        lock = threading.Lock()

        def session(at: int) -> Session:
            held = local.__dict__.setdefault("sessions", {})
            if at not in held:
                with lock:  # ExitStack is not thread-safe
                    held[at] = sessions.enter_context(clients[at].session(timeout_s))
            return held[at]

        def one(index: int) -> Answer:
            at = index % len(clients)
            client, start = clients[at], time.perf_counter()
            try:
                reply = session(at).reply(model, requests[index], version=version)
            except TritonTimeout:
                waited = timeout_s if timeout_s is not None else client.timeout
                answer = Answer(client.node, None, None, f"no answer within {waited:g} s")
            except TritonError as exc:
                answer = Answer(client.node, None, None, exc.message)
            else:
                took = (time.perf_counter() - start) * 1000
                answer = Answer(
                    client.node, reply.outputs, took, "", reply.first_ms, reply.responses
                )
            if answered is not None:
                answered(answer)
            return answer

        if rps is None:
            return list(pool.map(one, range(len(requests))))
        start, sent = time.monotonic(), []
        for index in range(len(requests)):
            time.sleep(max(0.0, start + index / rps - time.monotonic()))
            sent.append(pool.submit(one, index))
            if between is not None:
                between()
        return [future.result() for future in sent]
