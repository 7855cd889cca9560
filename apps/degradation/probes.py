"""Probes of the tier above the one a pool serves, before the automation switches back to it:
requests sent to that tier's explicit version (it stays loaded beside the tier served:
Tiers.deployment) on a few of the pool's ready nodes, at once; it proves itself when none fails
and their P99 is within the model's latency budget. The requests are the model's warm-up ones
(its evaluation set's inputs where it has one)."""

import math
import random
from dataclasses import dataclass

from django.conf import settings

from apps.degradation.models import Tiers
from apps.fleet.asking import ask
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
    clients = [TritonClient.of(node) for node in nodes]
    try:  # the same requests to each node, the nodes side by side
        requests = requests_for(clients[0], model, settings.DEGRADATION_PROBES, random.Random(0))
    except TritonError as exc:
        return Probed(False, f"no requests to probe v{version} with: {exc}")
    each = [inputs for inputs in requests for _ in clients]
    answers = ask(clients, model, each, version=version, concurrency=len(clients))
    failures = [f"{a.node}: {a.error}" for a in answers if a.error]
    took = sorted(a.latency_ms for a in answers if a.latency_ms is not None)
    names = ", ".join(node.name for node in nodes)
    if failures:
        return Probed(False, f"probes of v{version} on {names}: {failures[0]}")
    p99 = took[math.ceil(0.99 * len(took)) - 1]
    said = f"probes of v{version}: P99 {p99:.0f} ms over {len(took)} requests on {names}"
    if budget is not None and p99 > budget:
        return Probed(False, f"{said}, over the budget of {budget} ms")
    return Probed(True, f"{said}{f', budget {budget} ms' if budget is not None else ''}")
