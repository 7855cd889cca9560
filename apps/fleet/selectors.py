from dataclasses import dataclass

from django.db.models import QuerySet

from apps.fleet.models import Node


def node_list() -> QuerySet[Node]:
    return Node.objects.select_related("pool")


@dataclass(frozen=True)
class FleetSummary:
    nodes: int
    ready: int
    unreachable: int
    models_ready: int


def fleet_summary(nodes: list[Node]) -> FleetSummary:
    return FleetSummary(
        nodes=len(nodes),
        ready=sum(node.health == Node.Health.READY for node in nodes),
        unreachable=sum(node.health == Node.Health.UNREACHABLE for node in nodes),
        models_ready=sum(len(node.ready_models) for node in nodes),
    )
