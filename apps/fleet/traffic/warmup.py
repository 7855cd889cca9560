"""A node's warm-up: after a load, before it takes traffic again, it answers a few requests
to each model it loaded: the model's own evaluation inputs where an app above registers them
(apps.quality), sample inputs from its metadata otherwise."""

import random
from collections.abc import Callable, Iterator

import numpy as np

from apps.audit.services import audit_record
from apps.fleet.models import Node
from apps.fleet.traffic.balancer import ACTOR
from apps.fleet.triton import TritonClient, TritonError, sample_inputs

# Where a model's warm-up requests come from, asked in order: apps above the fleet register
# theirs (its evaluation sets' inputs: apps.quality.apps), each giving requests with their
# batch dimension, or none; sample inputs from the model's metadata where none has any.
WARMUP_TEXTS = ("warm-up request",)  # a string input's text, where a model has no set
WARMUP_INPUTS: list[Callable[[str], list[dict[str, np.ndarray]]]] = []


def requests_for(
    client: TritonClient, model: str, count: int, rng: random.Random
) -> Iterator[dict[str, np.ndarray]]:
    """`count` requests' inputs for `model`: its registered ones (WARMUP_INPUTS) in turn, else
    sample inputs from its metadata, read from the node (TritonError when it cannot answer)."""
    given = next((found for source in WARMUP_INPUTS if (found := source(model))), [])
    spec = [] if given else client.model_inputs(model)
    for index in range(count):
        yield given[index % len(given)] if given else sample_inputs(spec, rng, texts=WARMUP_TEXTS)


def warm_up(node: Node, configs: dict[str, dict | None]) -> None:
    """`warmup_requests` sample requests to each model just loaded (`configs`: by name, the
    config it was loaded with), sent to the node itself, before it takes traffic again. A step
    of an ensemble loaded with it is warmed through the ensemble; a model whose config has its
    own `model_warmup` was warmed by Triton during the load. A node that will get no traffic
    (weight 0: a canary waiting for its quality gate) is not warmed: no request but its
    evaluation reaches it before it takes traffic."""
    count = node.pool.warmup_requests
    if not Node.objects.filter(pk=node.pk, weight__gt=0).exists():
        return
    steps = {
        step.get("model_name")
        for config in configs.values()
        for step in ((config or {}).get("ensemble_scheduling") or {}).get("step", [])
    }
    warmed = {name for name, config in configs.items() if (config or {}).get("model_warmup")}
    models = sorted(set(configs) - steps - warmed)
    if not count or not models:
        return
    client = TritonClient(node.http_url, node=node.name)
    rng = random.Random(node.pk)
    for model in models:
        try:
            for inputs in requests_for(client, model, count, rng):
                client.infer(model, inputs)
        except TritonError as exc:  # it takes traffic all the same: it serves what it loaded
            audit_record(
                actor=ACTOR,
                action="node.warm_up",
                target=f"node:{node.name}:{model}",
                result="failed",
                message=f"warm-up of {model} failed: {exc}",
            )
