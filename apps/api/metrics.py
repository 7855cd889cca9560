"""The control plane's own metrics, for Prometheus at /metrics.

Every value is read from the database (and the broker) at scrape time: gunicorn and Celery run
many processes and none of them sees the whole picture, so in-process counters would each tell a
part. The queries are aggregates, a fixed number of them whatever the size of the fleet, and
each reads a bounded number of rows whatever the length of the history: tables that only grow
(operations, rollouts, measurements, notifications) are read through their last RECENT_ROWS
rows by primary key, an index range scan, never end to end."""

import math
from bisect import bisect
from collections import Counter
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import Any

import redis
from celery import current_app as celery_app
from django.conf import settings
from django.contrib.auth.decorators import login_not_required
from django.db.models import Count, F, Min, Model, Q, QuerySet, Subquery, Sum, TextChoices
from django.http import HttpRequest, HttpResponse
from django.utils import timezone
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_safe
from kombu.transport.redis import PRIORITY_STEPS, Channel
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from redis.backoff import NoBackoff
from redis.retry import Retry

from apps.accounts.models import ApiToken
from apps.accounts.permissions import ANY_ROLE
from apps.accounts.services import token_authenticate
from apps.fleet.models import Heartbeat, Node, NodePool, Operation
from apps.fleet.queues import ROLLOUTS_QUEUE, TICK_HEARTBEAT
from apps.rollouts.models import Measurement, Notification, Rollout
from apps.rollouts.verdicts import Verdict
from apps.scaling.models import Scaling

# A scrape must answer within Prometheus' timeout (10 s by default) even when the broker does
# not: one short try, then the depth series are left out and broker_up says why.
BROKER_TIMEOUT_S = 1.0
UNFINISHED = [Operation.Status.QUEUED, Operation.Status.RUNNING]
# How far back the per-status counts of ever-growing tables look. Summing whole tables made a
# scrape slower every day (10,000 operations a release of 500 nodes); the last rows are what an
# operator watches, and a release's whole burst of operations fits.
RECENT_ROWS = 10_000
# Expiry series: tokens are few (people's and services'), but each is a series: the soonest to
# expire are the ones to show, and a cap keeps a careless script from flooding Prometheus.
TOKENS_SHOWN = 100
# An expired token stays in the series this long, so its alert fires until someone rotates it.
EXPIRED_SHOWN = timedelta(days=7)


class ControlPlaneCollector(Collector):
    def collect(self) -> Iterable[Metric]:
        pools = list(NodePool.objects.order_by("name").values_list("id", "name", "queue"))
        yield _per_choice(
            "controlplane_rollouts",
            f"Rollouts per state, among the last {RECENT_ROWS} created.",
            _recent(Rollout),
            "state",
            Rollout.State,
        )
        yield _per_choice(
            "controlplane_operations",
            f"Operations per status, among the last {RECENT_ROWS} created.",
            _recent(Operation),
            "status",
            Operation.Status,
        )
        yield _durations()
        yield _reconcile_lag(pools)
        yield from _nodes(pools)
        yield from _scaling()
        yield _per_choice(
            "controlplane_analysis_verdicts",
            f"Analysis measurements per verdict, among the last {RECENT_ROWS} taken.",
            _recent(Measurement),
            "verdict",
            Verdict,
        )
        yield _per_choice(
            "controlplane_webhook_deliveries",
            f"Webhook notifications per delivery status, among the last {RECENT_ROWS}.",
            _recent(Notification),
            "status",
            Notification.Status,
        )
        yield from _heartbeats()
        yield _token_expiry()
        default = celery_app.conf.task_default_queue
        routed = sorted({q for _, _, q in pools if q} - {default, ROLLOUTS_QUEUE})
        yield from _queue_depths([default, ROLLOUTS_QUEUE, *routed])


def _recent(model: type[Model]) -> QuerySet[Any]:
    """The model's last RECENT_ROWS rows, by primary key: read backwards along its index, so a
    scrape reads as many rows after a year of history as after a day. (A bound on the key in
    the WHERE clause is not enough: SQLite then counts along the whole index of the grouped
    column, which sorts for it.)"""
    last = model._default_manager.order_by("-pk").values("pk")[:RECENT_ROWS]
    return model._default_manager.filter(pk__in=Subquery(last))


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


def _durations() -> GaugeMetricFamily:
    # Counted among the recent rows, not filtered in the WHERE clause: there, it let the planner
    # start from every finished operation (fleet_operation_finished) where statistics were thin.
    ended = Q(started_at__isnull=False, finished_at__isnull=False)
    finished = (
        _recent(Operation)
        .order_by()
        .values_list("kind")
        .annotate(n=Count("pk", filter=ended), total=Sum(F("finished_at") - F("started_at")))
    )
    totals = {kind: (count, total) for kind, count, total in finished}
    # A mean over a window, not a summary's _count and _sum: those must only grow, and a
    # window's do not.
    family = GaugeMetricFamily(
        "controlplane_operation_duration_seconds",
        f"Mean time from start to finish of the finished operations among the last {RECENT_ROWS}"
        " created, per kind; 0 when none.",
        labels=["kind"],
    )
    for kind in Operation.Kind:
        count, total = totals.get(kind, (0, None))
        family.add_metric([kind.value], total.total_seconds() / count if total else 0.0)
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


def _nodes(pools: list[tuple[int, str, str]]) -> Iterator[GaugeMetricFamily]:
    """Nodes per pool and health (of those that have not departed), and per pool and stage."""
    rows = Node.objects.order_by().values_list("pool_id", "stage", "health").annotate(Count("pk"))
    healths: Counter[tuple[int, str]] = Counter()
    stages: Counter[tuple[int, str]] = Counter()
    for pool_id, stage, health, count in rows:
        stages[pool_id, stage] += count
        if stage != Node.Stage.DEPARTED:
            healths[pool_id, health] += count
    for metric, what, counted, choices in (
        ("controlplane_nodes", "health", healths, Node.Health),
        ("controlplane_node_stages", "stage", stages, Node.Stage),
    ):
        family = GaugeMetricFamily(metric, f"Nodes per pool and {what}.", labels=["pool", what])
        for pool_id, name, _ in pools:
            for choice in choices:
                family.add_metric([name, choice.value], counted[pool_id, choice.value])
        yield family


def _scaling() -> Iterator[GaugeMetricFamily]:
    """The nodes each pool needs (apps/scaling), the series an autoscaler follows: the chart's
    HPA through prometheus-adapter as an External metric, or KEDA's Prometheus scaler. A pool
    whose signal was never computed has none: an HPA without its metric changes nothing."""
    rows = (
        Scaling.objects.filter(wanted__isnull=False)
        .order_by("pool__name")
        .values_list("pool__name", "wanted", "held", "pinned")
    )
    wanted = GaugeMetricFamily(
        "controlplane_pool_nodes_wanted",
        "Nodes the pool needs: its request rate against each release's measured capacity, its"
        " steps' queue-to-compute ratio and GPU utilization; never fewer than it has while a"
        " release runs on it; a person's pin where pinned.",
        labels=["pool"],
    )
    held = GaugeMetricFamily(
        "controlplane_pool_nodes_held",
        "1 while a release on the pool (a rollout, a degradation episode, a search) holds its"
        " nodes from a scale-in, 2 while a person pins the count; 0 otherwise.",
        labels=["pool"],
    )
    for name, count, why, pinned in rows:
        wanted.add_metric([name], count or 0)
        held.add_metric([name], 2 if pinned is not None else 1 if why else 0)
    yield wanted
    yield held


def _heartbeats() -> Iterator[GaugeMetricFamily]:
    """Whether beat and a worker of the rollouts queue are alive, and how late the rollout
    controller runs: what /readyz no longer says (the web process does not need them)."""
    at = dict(
        Heartbeat.objects.filter(name__in=["worker", TICK_HEARTBEAT]).values_list("name", "at")
    )
    now = timezone.now()

    def age(name: str) -> float:
        return max((now - at[name]).total_seconds(), 0.0) if name in at else math.inf

    heartbeat = GaugeMetricFamily(
        "controlplane_heartbeat_age_seconds",
        "Seconds since beat's heartbeat last ran on a worker of the rollouts queue; +Inf before"
        " the first.",
    )
    heartbeat.add_metric([], age("worker"))
    yield heartbeat
    workers = GaugeMetricFamily(
        "controlplane_workers_up",
        "1 while beat's heartbeat through a worker is younger than READY_HEARTBEAT_MAX_AGE_S.",
    )
    workers.add_metric([], float(age("worker") <= settings.READY_HEARTBEAT_MAX_AGE_S))
    yield workers
    tick = GaugeMetricFamily(
        "controlplane_rollout_tick_age_seconds",
        "Seconds since the rollout controller's last completed tick, due every ROLLOUT_TICK_S;"
        " +Inf before the first.",
    )
    tick.add_metric([], age(TICK_HEARTBEAT))
    yield tick
    interval = GaugeMetricFamily(
        "controlplane_rollout_tick_interval_seconds",
        "How often the rollout controller is scheduled to tick (ROLLOUT_TICK_S).",
    )
    interval.add_metric([], settings.ROLLOUT_TICK_S)
    yield interval


def _token_expiry() -> GaugeMetricFamily:
    """When each live API token expires, for an alert a week ahead: an expired Prometheus or
    Alertmanager token fails quietly (a target down, an incident never opened)."""
    now = timezone.now()
    tokens = (
        ApiToken.objects.filter(revoked_at__isnull=True, expires_at__gt=now - EXPIRED_SHOWN)
        .order_by("expires_at", "pk")
        .values_list("user__username", "pk", "name", "scope", "expires_at")[:TOKENS_SHOWN]
    )
    family = GaugeMetricFamily(
        "controlplane_api_token_expiry_timestamp_seconds",
        f"When each API token expires (Unix time): the {TOKENS_SHOWN} that expire soonest,"
        " not revoked, expired a week ago at most.",
        labels=["user", "token", "name", "scope"],
    )
    for user, pk, name, scope, expires_at in tokens:
        family.add_metric([user, str(pk), name, scope], expires_at.timestamp())
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
        "Tasks waiting in each Celery queue (the default one, rollouts and every pool's).",
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
    anyone on the network, nor for Alertmanager's token, which only sends alerts."""
    allowed = _allowed(request)
    if allowed is None:
        return HttpResponse(
            "this token may only send alerts (POST /api/alertmanager)\n",
            status=403,
            content_type="text/plain; charset=utf-8",
        )
    if not allowed:
        response = HttpResponse(
            "send a live API token: Authorization: Bearer <token>\n",
            status=401,
            content_type="text/plain; charset=utf-8",
        )
        response["WWW-Authenticate"] = 'Bearer realm="metrics"'
        return response
    return HttpResponse(generate_latest(REGISTRY), content_type=CONTENT_TYPE_LATEST)


def _allowed(request: HttpRequest) -> bool | None:
    """True or False, or None for a live token of the alerts scope (refused: 403)."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme or token:
        # Credentials that were sent are checked even where anonymous scrapes are allowed: a
        # revoked or mistyped token should show as a failing target, not pass unnoticed.
        found = token_authenticate(token.strip()) if scheme.lower() == "bearer" else None
        if found is not None and found.scope == ApiToken.Scope.ALERTS:
            return None
        return found is not None and found.user.has_perm(ANY_ROLE)  # a viewer at least
    return bool(settings.METRICS_ALLOW_ANONYMOUS)
