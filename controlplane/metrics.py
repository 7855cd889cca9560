"""The control plane's own metrics, for Prometheus at /metrics.

Every value is read from the database (and the broker) at scrape time: gunicorn and Celery run
many processes and none of them sees the whole picture, so in-process counters would each tell a
part. The queries are aggregates, a fixed number of them whatever the size of the fleet."""

from bisect import bisect
from collections.abc import Iterable, Iterator
from typing import Any

import redis
from django.conf import settings
from django.contrib.auth.decorators import login_not_required
from django.db.models import Count, F, Min, QuerySet, Sum, TextChoices
from django.http import HttpRequest, HttpResponse
from django.utils import timezone
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_safe
from kombu.transport.redis import PRIORITY_STEPS, Channel
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric, SummaryMetricFamily
from prometheus_client.registry import Collector
from redis.backoff import NoBackoff
from redis.retry import Retry

from apps.accounts.permissions import ANY_ROLE
from apps.accounts.services import token_authenticate
from apps.fleet.models import Node, NodePool, Operation
from apps.rollouts.models import Measurement, Notification, Rollout
from controlplane.celery import app as celery_app

# A scrape must answer within Prometheus' timeout (10 s by default) even when the broker does
# not: one short try, then the depth series are left out and broker_up says why.
BROKER_TIMEOUT_S = 1.0
UNFINISHED = [Operation.Status.QUEUED, Operation.Status.RUNNING]


class ControlPlaneCollector(Collector):
    def collect(self) -> Iterable[Metric]:
        pools = list(NodePool.objects.order_by("name").values_list("id", "name", "queue"))
        yield _per_choice(
            "controlplane_rollouts",
            "Rollouts per state.",
            Rollout.objects.all(),
            "state",
            Rollout.State,
        )
        yield _per_choice(
            "controlplane_operations",
            "Operations per status.",
            Operation.objects.all(),
            "status",
            Operation.Status,
        )
        yield _durations()
        yield _reconcile_lag(pools)
        yield _nodes(pools)
        yield _per_choice(
            "controlplane_analysis_verdicts",
            "Analysis measurements per verdict.",
            Measurement.objects.all(),
            "verdict",
            Measurement.Verdict,
        )
        yield _per_choice(
            "controlplane_webhook_deliveries",
            "Webhook notifications per delivery status.",
            Notification.objects.all(),
            "status",
            Notification.Status,
        )
        default = celery_app.conf.task_default_queue
        yield from _queue_depths([default, *sorted({q for _, _, q in pools if q} - {default})])


def _per_choice(
    name: str, documentation: str, rows: QuerySet[Any], field: str, choices: type[TextChoices]
) -> GaugeMetricFamily:
    """Rows per value of a choices field, every value present (0 included), so a series never
    vanishes when its count drops to nothing."""
    counts = dict(rows.order_by().values_list(field).annotate(Count("pk")))
    family = GaugeMetricFamily(name, documentation, labels=[field])
    for choice in choices:
        family.add_metric([choice.value], counts.get(choice.value, 0))
    return family


def _durations() -> SummaryMetricFamily:
    finished = (
        Operation.objects.filter(started_at__isnull=False, finished_at__isnull=False)
        .order_by()
        .values_list("kind")
        .annotate(n=Count("pk"), total=Sum(F("finished_at") - F("started_at")))
    )
    totals = {kind: (count, total) for kind, count, total in finished}
    family = SummaryMetricFamily(
        "controlplane_operation_duration_seconds",
        "Time from start to finish of finished operations, per kind.",
        labels=["kind"],
    )
    for kind in Operation.Kind:
        count, total = totals.get(kind, (0, None))
        family.add_metric([kind.value], count, total.total_seconds() if total else 0.0)
    return family


def _reconcile_lag(pools: list[tuple[int, str, str]]) -> GaugeMetricFamily:
    oldest = dict(
        Operation.objects.filter(status__in=UNFINISHED)
        .order_by()
        .values_list("node__pool_id")
        .annotate(Min("created_at"))
    )
    now = timezone.now()
    family = GaugeMetricFamily(
        "controlplane_reconcile_lag_seconds",
        "Age of the oldest queued or running operation on the pool's nodes; 0 when none.",
        labels=["pool"],
    )
    for pool_id, name, _ in pools:
        since = oldest.get(pool_id)
        family.add_metric([name], max((now - since).total_seconds(), 0.0) if since else 0.0)
    return family


def _nodes(pools: list[tuple[int, str, str]]) -> GaugeMetricFamily:
    counts = {
        (pool_id, health): n
        for pool_id, health, n in Node.objects.order_by()
        .values_list("pool_id", "health")
        .annotate(Count("pk"))
    }
    family = GaugeMetricFamily(
        "controlplane_nodes", "Nodes per pool and health.", labels=["pool", "health"]
    )
    for pool_id, name, _ in pools:
        for health in Node.Health:
            family.add_metric([name, health.value], counts.get((pool_id, health.value), 0))
    return family


def _queue_depths(queues: list[str]) -> Iterator[GaugeMetricFamily]:
    """Messages waiting in each queue, summed as kombu's Redis transport counts them
    (kombu.transport.redis.Channel._size): one list per priority step, named `<queue>` for
    priority 0 and `<queue>\\x06\\x16<step>` for the others, behind the transport's key prefix."""
    options = celery_app.conf.broker_transport_options or {}
    prefix = options.get("global_keyprefix", "")
    steps = options.get("priority_steps", PRIORITY_STEPS)
    # Channel.priority's mapping, as _size applies it to each step.
    priorities = dict.fromkeys(steps[bisect(steps, step) - 1] for step in steps)
    keys = {
        queue: [f"{prefix}{queue}{Channel.sep}{p}" if p else f"{prefix}{queue}" for p in priorities]
        for queue in queues
    }
    up = GaugeMetricFamily("controlplane_broker_up", "1 if the broker (Redis) answered the scrape.")
    try:
        with redis.Redis.from_url(
            celery_app.conf.broker_url,
            socket_timeout=BROKER_TIMEOUT_S,
            socket_connect_timeout=BROKER_TIMEOUT_S,
            retry=Retry(NoBackoff(), retries=0),
        ) as client:
            pipe = client.pipeline(transaction=False)
            for names in keys.values():
                for key in names:
                    pipe.llen(key)
            lengths = iter(pipe.execute())
    except (redis.RedisError, OSError):
        up.add_metric([], 0)
        yield up
        return
    up.add_metric([], 1)
    yield up
    depth = GaugeMetricFamily(
        "controlplane_celery_queue_depth",
        "Tasks waiting in each Celery queue (the default one and every pool's).",
        labels=["queue"],
    )
    for queue, names in keys.items():
        depth.add_metric([queue], sum(next(lengths) for _ in names))
    yield depth


REGISTRY = CollectorRegistry()  # auto_describe off: nothing is collected before a scrape
REGISTRY.register(ControlPlaneCollector())


@login_not_required
@never_cache
@require_safe
def metrics(request: HttpRequest) -> HttpResponse:
    """Prometheus' scrape: a live API token (read scope is enough) as `Authorization: Bearer`,
    or nothing where METRICS_ALLOW_ANONYMOUS says so. The series name pools and states: not for
    anyone on the network."""
    if not _allowed(request):
        response = HttpResponse(
            "send a live API token: Authorization: Bearer <token>\n",
            status=401,
            content_type="text/plain; charset=utf-8",
        )
        response["WWW-Authenticate"] = 'Bearer realm="metrics"'
        return response
    return HttpResponse(generate_latest(REGISTRY), content_type=CONTENT_TYPE_LATEST)


def _allowed(request: HttpRequest) -> bool:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme or token:
        # Credentials that were sent are checked even where anonymous scrapes are allowed: a
        # revoked or mistyped token should show as a failing target, not pass unnoticed.
        found = token_authenticate(token.strip()) if scheme.lower() == "bearer" else None
        return found is not None and found.user.has_perm(ANY_ROLE)  # a viewer at least
    return bool(settings.METRICS_ALLOW_ANONYMOUS)
