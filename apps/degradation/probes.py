"""Probes of the tier above the one a pool serves, before the automation switches back to it:
requests sent to that tier's explicit version (it stays loaded beside the tier served:
Tiers.deployment) on a few of the pool's ready nodes, at once; it proves itself when none fails
and their P99 is within the model's latency budget. The requests are the model's warm-up ones
(its evaluation set's inputs where it has one)."""

import math
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from django.conf import settings

from apps.degradation.models import Tiers
from apps.fleet.models import Node
from apps.fleet.traffic.warmup import requests_for
from apps.fleet.triton import TritonClient, TritonError


@dataclass(frozen=True)
class Probed:
    passed: bool
    evidence: str  # what was measured, in words


def probe(tiers: Tiers, version: int) -> Probed:
    """DEGRADATION_PROBES requests to `version` of the model on each of up to
    DEGRADATION_PROBE_NODES ready nodes of the pool (the same ones each time: the first by
    name), the nodes probed side by side."""
    model, budget = tiers.model.name, tiers.model.latency_budget_ms
    nodes = list(
        tiers.pool.nodes.serving()
        .filter(health=Node.Health.READY)
        .order_by("name")[: settings.DEGRADATION_PROBE_NODES]
    )
    if not nodes:
        return Probed(False, f"no ready node of {tiers.pool.name} to probe v{version} on")
    with ThreadPoolExecutor(max_workers=len(nodes)) as pool:
        found = list(pool.map(lambda node: _probe_node(node, model, version), nodes))
    failures = [error for _, error in found if error]
    took = sorted(ms for latencies, _ in found for ms in latencies)
    names = ", ".join(node.name for node in nodes)
    if failures:
        return Probed(False, f"probes of v{version} on {names}: {failures[0]}")
    p99 = took[math.ceil(0.99 * len(took)) - 1]
    said = f"probes of v{version}: P99 {p99:.0f} ms over {len(took)} requests on {names}"
    if budget is not None and p99 > budget:
        return Probed(False, f"{said}, over the budget of {budget} ms")
    return Probed(True, f"{said}{f', budget {budget} ms' if budget is not None else ''}")


def _probe_node(node: Node, model: str, version: int) -> tuple[list[float], str]:
    """Each probe's time (ms) on the node, and the first failure in words ('' when none)."""
    client = TritonClient(node.http_url, node=node.name)
    took: list[float] = []
    try:
        with client.session() as session:
            count, rng = settings.DEGRADATION_PROBES, random.Random(node.pk)
            for inputs in requests_for(client, model, count, rng):
                start = time.monotonic()
                session.infer(model, inputs, version=version)
                took.append((time.monotonic() - start) * 1000)
    except TritonError as exc:
        return took, f"{node.name}: {exc}"
    return took, ""
