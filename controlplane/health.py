"""Probes for load balancers and orchestrators: unauthenticated, and revealing nothing but which
dependency is not ready.

Readiness is the web process's own: it and PostgreSQL answer. The broker and the workers are
not part of it: a page reads PostgreSQL and enqueues nothing on a GET, so the UI and the API stay
up while Redis restarts, and a probe that failed with the broker would take every web pod out of
the load balancer at once for something they do not need. /metrics reports the broker
(controlplane_broker_up), the workers (controlplane_workers_up, the heartbeat's age) and the
rollout controller's tick age, and deploy/prometheus/alerts.yml alerts on them."""

from django.contrib.auth.decorators import login_not_required
from django.db import connection
from django.http import HttpRequest, HttpResponse
from django.views.decorators.cache import never_cache


@login_not_required
@never_cache
def healthz(request: HttpRequest) -> HttpResponse:
    """The process answers."""
    return HttpResponse("ok\n", content_type="text/plain")


@login_not_required
@never_cache
def readyz(request: HttpRequest) -> HttpResponse:
    """The database answers: 200 with each check's result, or 503."""
    checks = {"database": _database()}
    body = "".join(f"{name} {'ok' if ok else 'unavailable'}\n" for name, ok in checks.items())
    return HttpResponse(
        body, status=200 if all(checks.values()) else 503, content_type="text/plain"
    )


def _database() -> bool:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
    except Exception:  # any failure: not ready (the detail is not for callers)
        return False
    return True
