"""Reading the control plane's own /metrics in tests: a scrape token, the samples, a fleet."""

from datetime import timedelta

from django.contrib.auth.models import User
from django.test import Client
from django.utils import timezone
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from apps.accounts.models import ApiToken
from apps.accounts.services import token_create
from apps.fleet.models import Node, NodePool, Operation

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape_headers(user: User) -> dict[str, str]:
    """A read-only token's header, as Prometheus' scrape config sends it."""
    _, value = token_create(
        user=user, name="prometheus", actor="system:test", scope=ApiToken.Scope.READ
    )
    return {"Authorization": f"Bearer {value}"}


def scrape(client: Client, headers: dict[str, str]) -> Samples:
    response = client.get("/metrics", headers=headers)
    assert response.status_code == 200
    assert response["Content-Type"] == CONTENT_TYPE_LATEST
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.content.decode())
        for sample in family.samples
    }


def matching(samples: Samples, name: str) -> dict[tuple[str, ...], float]:
    """One metric's samples, keyed by their label values in label-name order."""
    return {
        tuple(value for _, value in labels): v
        for (sample, labels), v in samples.items()
        if sample == name
    }


def operation(node: Node, kind: str, status: str, *, took_s: float | None = None) -> Operation:
    op = Operation.objects.create(node=node, kind=kind, model_name="m", status=status)
    if took_s is not None:
        start = timezone.now() - timedelta(minutes=5)
        op.started_at, op.finished_at = start, start + timedelta(seconds=took_s)
        op.save()
    return op


def make_fleet(prefix: str, nodes: int, queue: str = "") -> NodePool:
    pool = NodePool.objects.create(name=prefix, queue=queue)
    for i in range(nodes):
        node = Node.objects.create(
            name=f"{prefix}-{i}", pool=pool, http_url="http://127.0.0.1:1", health="ready"
        )
        operation(node, "load", "succeeded", took_s=1)
        operation(node, "unload", "queued")
    return pool
