"""A node's warm-up: after a load, before it takes traffic again, it answers a few requests
to each model it loaded: the model's sample inputs from the registry (its evaluation set's
first cases), sample inputs from its metadata where it has none."""

import random

import numpy as np

from apps.audit.services import audit_record
from apps.fleet.asking import ask
from apps.fleet.models import Node
from apps.fleet.traffic.balancer import ACTOR
from apps.fleet.triton import TritonClient, TritonError, sample_inputs, tensors_from
from apps.registry.models import Model

WARMUP_TEXTS = ("warm-up request",)  # a string input's text, where a model has no samples


def requests_for(
    client: TritonClient, model: str, count: int, rng: random.Random
) -> list[dict[str, np.ndarray]]:
    """`count` requests' inputs for `model`: its sample inputs in turn, else sample inputs made
    from its metadata, read from the node (TritonError when it cannot answer)."""
    stored = Model.objects.filter(name=model).values_list("sample_inputs", flat=True).first()
    given = [tensors_from(inputs) for inputs in stored or []]
    spec = [] if given else client.model_inputs(model)
    return [
        given[index % len(given)] if given else sample_inputs(spec, rng, texts=WARMUP_TEXTS)
        for index in range(count)
    ]


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
    client = TritonClient.of(node)
    rng = random.Random(node.pk)
    for model in models:
        try:
            answers = ask([client], model, requests_for(client, model, count, rng))
            failed = next((f"{a.node}: {a.error}" for a in answers if a.error), "")
        except TritonError as exc:  # no metadata to make requests of
            failed = str(exc)
        if failed:  # it takes traffic all the same: it serves what it loaded
            audit_record(
                actor=ACTOR,
                action="node.warm_up",
                target=f"node:{node.name}:{model}",
                result="failed",
                message=f"warm-up of {model} failed: {failed}",
            )
