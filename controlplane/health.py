"""Probes for load balancers and orchestrators: unauthenticated, and revealing nothing but which
dependency is not ready."""

from datetime import timedelta

from django.conf import settings
from django.contrib.auth.decorators import login_not_required
from django.db import connection
from django.http import HttpRequest, HttpResponse
from django.utils import timezone
from django.views.decorators.cache import never_cache

from apps.fleet.models import Heartbeat
from controlplane.celery import app as celery_app


@login_not_required
@never_cache
def healthz(request: HttpRequest) -> HttpResponse:
    """The process answers."""
    return HttpResponse("ok\n", content_type="text/plain")


@login_not_required
@never_cache
def readyz(request: HttpRequest) -> HttpResponse:
    """The database and the broker answer, and a heartbeat went from beat through a worker to the
    database recently: 200 with each check's result, or 503."""
    checks = {"database": _database(), "broker": _broker(), "workers": _heartbeat()}
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


def _broker() -> bool:
    try:
        with celery_app.connection_for_write() as conn:
            conn.ensure_connection(max_retries=1, timeout=2)
    except Exception:
        return False
    return True


def _heartbeat() -> bool:
    try:
        since = timezone.now() - timedelta(seconds=settings.READY_HEARTBEAT_MAX_AGE_S)
        return Heartbeat.objects.filter(name="worker", at__gte=since).exists()
    except Exception:
        return False
