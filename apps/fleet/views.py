from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from apps.audit.models import AuditEvent
from apps.fleet.selectors import fleet_summary, node_list
from controlplane.htmx import HtmxHttpRequest


def overview(request: HttpRequest) -> HttpResponse:
    nodes = list(node_list())
    context = {
        "summary": fleet_summary(nodes),
        "nodes": nodes,
        "events": AuditEvent.objects.all()[:8],
    }
    return render(request, "fleet/overview.html", context)


def serving(request: HttpRequest) -> HttpResponse:
    """Nodes whose index shows `model` at `version` READY (a fragment for other pages)."""
    model, version = request.GET.get("model", ""), request.GET.get("version", "")
    found = [
        node
        for node in node_list()
        if any(e["model"] == model and str(e["version"]) == version for e in node.ready_models)
    ]
    return render(request, "fleet/partials/serving.html", {"nodes": found})


def nodes(request: HtmxHttpRequest) -> HttpResponse:
    """The full page, or for htmx polling just the table (`#node-table`)."""
    template = "fleet/nodes.html#node-table" if request.htmx else "fleet/nodes.html"
    return render(request, template, {"nodes": node_list()})
