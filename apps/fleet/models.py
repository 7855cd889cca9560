from functools import cached_property
from typing import Any

from django.db import models

from apps.fleet import failures
from apps.fleet.triton import ready_in
from apps.registry.models import Model


class JSONHash(models.Func):
    """A JSON column's 64-bit hash on PostgreSQL, to group by; SQLite keeps the text itself."""

    function = "jsonb_hash_extended"
    template = "%(function)s(%(expressions)s, 0)"
    output_field = models.BigIntegerField()

    def as_sqlite(self, compiler: Any, connection: Any, **extra: Any) -> Any:
        return compiler.compile(self.source_expressions[0])


class NodePool(models.Model):
    name = models.SlugField(max_length=60, unique=True)
    queue = models.CharField(
        max_length=60,
        blank=True,
        help_text="the Celery queue whose workers drive this pool's nodes (say, workers in the "
        "same region); empty: the default queue",
    )
    protected = models.BooleanField(
        default=False,
        help_text="deployments, promotions and rollbacks need a second person",
    )
    discoverable = models.BooleanField(
        default=False,
        help_text="nodes that discovery finds labelled with this pool join it by themselves "
        "(turned on for a protected pool only with a second person's approval)",
    )

    class Traffic(models.TextChoices):
        NONE = "", "none"
        HAPROXY = "haproxy", "HAProxy"

    traffic = models.CharField(
        max_length=20,
        choices=Traffic.choices,
        blank=True,
        help_text="the balancer in front of the pool, whose server weights give a rollout's "
        "shares exactly (HAProxy: through its runtime API); none: a share is a number of nodes",
    )
    traffic_runtime = models.CharField(
        max_length=200,
        blank=True,
        help_text="HAProxy's runtime API: host:port, or the path of its unix socket",
    )
    traffic_backends = models.CharField(
        max_length=200,
        blank=True,
        help_text="the HAProxy backends (comma-separated) whose servers are this pool's nodes, "
        "named as the nodes are; `name:grpc` for one whose servers are their gRPC endpoints",
    )
    min_serving = models.PositiveSmallIntegerField(
        default=1, help_text="a node is drained for a load only while this many others serve"
    )
    warmup_requests = models.PositiveSmallIntegerField(
        default=5, help_text="requests a node answers after a load, before it takes traffic"
    )
    rollback_window_s = models.PositiveIntegerField(
        default=900,
        help_text="seconds the release before stays loaded after a promotion (0: none)",
    )
    drain_timeout_s = models.PositiveSmallIntegerField(
        default=30, help_text="how long a drained node's in-flight requests may take to finish"
    )

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def backends(self) -> list[str]:
        return [name.partition(":")[0] for name in self.backend_entries]

    @property
    def grpc_backends(self) -> set[str]:
        """Backends whose servers are the nodes' gRPC endpoints (marked `name:grpc`)."""
        return {e.partition(":")[0] for e in self.backend_entries if e.endswith(":grpc")}

    @property
    def backend_entries(self) -> list[str]:
        """The backends as set: `name`, or `name:grpc` for one of gRPC endpoints."""
        return [name.strip() for name in self.traffic_backends.split(",") if name.strip()]


class NodeQuerySet(models.QuerySet["Node"]):
    def serving(self) -> "NodeQuerySet":
        """The nodes that take their share of traffic: a rollout's, a probe's, a share's count
        (not those joining, quarantined or departed)."""
        return self.filter(stage=Node.Stage.SERVING)

    def in_traffic(self) -> "NodeQuerySet":
        """The nodes that take users' requests now: those `Node.wanted_weight` gives a weight."""
        return self.serving().filter(draining=False, unlisted_since__isnull=True, weight__gt=0)

    def lock(self) -> list[int]:
        """These nodes' rows locked, in id order, within the caller's transaction; returns their
        ids. Whatever locks more than one node locks them this way first: two lockers that
        take rows in other orders (a statement's scan order is the table's, not the ids') may
        each wait for a row the other holds, and PostgreSQL fails one as a deadlock."""
        return list(self.select_for_update().order_by("pk").values_list("pk", flat=True))

    def locked_update(self, **fields: object) -> int:
        """`update` of these nodes, their rows locked first (`lock`): an UPDATE of several rows
        takes them in scan order. Within the caller's transaction; returns how many changed."""
        return self.model.objects.filter(pk__in=self.lock()).update(**fields)


class Node(models.Model):
    class Health(models.TextChoices):
        UNKNOWN = "unknown"
        READY = "ready"
        LIVE = "live", "live, not ready"
        UNREACHABLE = "unreachable"

    name = models.SlugField(max_length=60, unique=True)
    pool = models.ForeignKey(NodePool, on_delete=models.PROTECT, related_name="nodes")
    http_url = models.URLField()
    grpc_url = models.CharField(max_length=200, blank=True)
    metrics_url = models.URLField(blank=True)
    triton_version = models.CharField(max_length=30, blank=True)
    extensions = models.JSONField(default=list, blank=True)
    health = models.CharField(max_length=20, choices=Health.choices, default=Health.UNKNOWN)
    failed_polls = models.PositiveIntegerField(default=0)
    last_seen = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(blank=True)
    health_changed_at = models.DateTimeField(null=True, blank=True)
    # Up/down changes of a flapping node that were counted here instead of recorded one by one.
    unrecorded_transitions = models.PositiveIntegerField(default=0)
    index = models.JSONField(default=list, blank=True, help_text="last repository index read")
    gpus = models.JSONField(
        default=list, blank=True, help_text="GPU inventory from nv_gpu_* metrics"
    )
    # When the poll last read `gpus` (their use included) from the node's own /metrics: the
    # reading memory-aware loads fall back on while Prometheus is away.
    gpus_read_at = models.DateTimeField(null=True, blank=True)
    memory_limit_mb = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="MiB models may take on a CPU node; loads are checked against it",
    )
    # The models this product loaded here and has not yet unloaded (a release being drained) or
    # that a person adopted: the only ones the reconciler may unload when no deployment names them.
    owned = models.JSONField(default=list, blank=True)
    # The pages group 5,000 nodes alike by these (apps/fleet/selectors.py: node_shapes): kept by
    # the database as the documents are written, rather than 10,000 documents hashed each view.
    index_key = models.GeneratedField(
        expression=JSONHash("index"), output_field=models.BigIntegerField(), db_persist=True
    )
    owned_key = models.GeneratedField(
        expression=JSONHash("owned"), output_field=models.BigIntegerField(), db_persist=True
    )
    # One worker at a time acts on a node: it holds this lease and renews it while it works, so a
    # killed worker's lease lapses within seconds and the next one can take over.
    lease_owner = models.CharField(max_length=64, blank=True)
    lease_until = models.DateTimeField(null=True, blank=True)
    # On a pool with a traffic strategy: the node's share of requests (a rollout's weights), and
    # whether a worker took it out of traffic to load or unload on it.
    weight = models.PositiveSmallIntegerField(default=100, help_text="0-256, as HAProxy's")
    draining = models.BooleanField(default=False)
    served_weight = models.PositiveSmallIntegerField(
        null=True, blank=True, help_text="the weight the balancer last read back"
    )
    traffic_error = models.TextField(blank=True)

    class Stage(models.TextChoices):
        JOINING = "joining", "joining: loading, out of traffic"
        SERVING = "serving"
        QUARANTINED = "quarantined", "quarantined: a load hung, out of traffic"
        DEPARTED = "departed", "departed: gone from discovery"

    # Where a node is in its life: one found by discovery joins out of traffic until it serves
    # its pool's release, warmed; one whose load hung is quarantined, out of traffic and left
    # alone, until a person or a restart clears it (it joins again); one whose target is gone for
    # the grace period has departed (kept with its history, no longer polled). A node registered
    # by hand serves from the start.
    stage = models.CharField(max_length=12, choices=Stage.choices, default=Stage.SERVING)
    stage_changed_at = models.DateTimeField(null=True, blank=True)
    stage_reason = models.TextField(blank=True)  # why it is quarantined
    discovered_at = models.DateTimeField(null=True, blank=True)  # None: registered by hand
    listed_at = models.DateTimeField(
        null=True, blank=True, help_text="when discovery last listed the node's target"
    )
    unlisted_since = models.DateTimeField(
        null=True,
        blank=True,
        help_text="the first discovery pass since then that did not list the node's target",
    )

    objects = NodeQuerySet.as_manager()

    class Meta:
        ordering = ["pool__name", "name"]
        permissions = [("operate_node", "Load, unload and reload models on a node")]

    def __str__(self) -> str:
        return self.name

    @property
    def wanted_weight(self) -> int:
        """The weight the balancer must give the node now."""
        serves = self.stage == self.Stage.SERVING and not self.draining
        # A node whose target is gone is stopping, most likely: no new request is sent to it
        # while its grace runs, and it gets its weight back if it is listed again.
        return self.weight if serves and self.unlisted_since is None else 0

    @property
    def traffic_drift(self) -> str:
        """How the balancer's weight for the node differs from what it must be, if it does
        (a pool with a traffic strategy only; empty until the balancer was first read)."""
        if not self.pool.traffic or self.served_weight in (None, self.wanted_weight):
            return ""
        return f"weight {self.wanted_weight}, the balancer shows {self.served_weight}"

    @cached_property
    def ready_versions(self) -> dict[str, list[int]]:
        """Model -> its versions READY in the last index read, in order (read once per row
        loaded: a fleet page asks it of each node several times)."""
        return {model: sorted(versions) for model, versions in ready_in(self.index).items()}


class Deployment(models.Model):
    """Desired state: `model` at `version` must be READY on every node of `pool`, or on `node`."""

    pool = models.ForeignKey(
        NodePool, null=True, blank=True, on_delete=models.CASCADE, related_name="deployments"
    )
    node = models.ForeignKey(
        Node, null=True, blank=True, on_delete=models.CASCADE, related_name="deployments"
    )
    model = models.ForeignKey(Model, on_delete=models.PROTECT, related_name="deployments")
    version = models.PositiveIntegerField()
    baseline_version = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="kept READY beside `version`, a canary's baseline: a rollback only narrows",
    )
    baseline_until = models.DateTimeField(
        null=True,
        blank=True,
        help_text="the baseline is let go then: the rollback window after a promotion",
    )
    standby_version = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="a pipeline release whose steps are loaded beside, not served: a blue-green "
        "release waiting for its evaluation before the switch",
    )
    created_by = models.CharField(max_length=150)
    updated_at = models.DateTimeField(auto_now=True)
    # The request that last changed it: the reconciles that carry the change out record it too,
    # whichever trigger (that request's own, or the periodic one) gets to a node first.
    request_id = models.CharField(max_length=64, blank=True)

    class Meta:
        ordering = ["model__name"]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(pool__isnull=True) ^ models.Q(node__isnull=True),
                name="deployment_targets_pool_or_node",
            ),
            models.UniqueConstraint(
                fields=["pool", "model"], name="one_version_per_pool_and_model"
            ),
            models.UniqueConstraint(
                fields=["node", "model"], name="one_version_per_node_and_model"
            ),
        ]

    def __str__(self) -> str:
        beside = f" beside v{self.baseline_version}" if self.baseline_version else ""
        standby = f", v{self.standby_version} on standby" if self.standby_version else ""
        return f"{self.model.name} v{self.version}{beside}{standby} on {self.pool or self.node}"

    @property
    def target(self) -> str:
        return f"pool:{self.pool.name}" if self.pool else f"node:{self.node.name}"  # type: ignore[union-attr]


class Release(models.Model):
    """What a pool ran of a model, from when to when: written by the service that changes a pool's
    deployment, read by "last good release" and the rollouts list."""

    pool = models.ForeignKey(NodePool, on_delete=models.CASCADE, related_name="releases")
    model = models.ForeignKey(Model, on_delete=models.CASCADE, related_name="releases")
    version = models.PositiveIntegerField()
    started_at = models.DateTimeField()
    ended_at = models.DateTimeField(null=True, blank=True)
    started_by = models.CharField(max_length=150)
    rolled_back = models.BooleanField(
        default=False, help_text="on-call rolled the pool back from it: never a last good release"
    )

    class Meta:
        ordering = ["-started_at", "-id"]
        indexes = [models.Index(fields=["pool", "model", "-started_at"])]
        constraints = [
            models.UniqueConstraint(
                fields=["pool", "model"],
                condition=models.Q(ended_at__isnull=True),
                name="one_current_release_per_pool_and_model",
            )
        ]

    def __str__(self) -> str:
        return f"{self.model.name} v{self.version} on {self.pool}"


class PoolOwner(models.Model):
    """Who drives what a pool serves of a model now, besides the reconciler (no row): a rollout
    releasing it, or on-call's pin on a degradation tier. One row, claimed and let go by the
    owner's own services (apps.fleet.owners) and read by every road that changes what the pool
    serves; a pin's lapses at `until`."""

    class Kind(models.TextChoices):
        ROLLOUT = "rollout"
        PIN = "pin"

    pool = models.ForeignKey(NodePool, on_delete=models.CASCADE, related_name="owners")
    model = models.ForeignKey(Model, on_delete=models.CASCADE, related_name="owners")
    kind = models.CharField(max_length=10, choices=Kind.choices)
    ref = models.CharField(max_length=60, help_text='which one: "rollout:12", "pin"')
    why = models.TextField(help_text="what a person told to wait reads")
    by = models.CharField(max_length=150)
    since = models.DateTimeField()
    until = models.DateTimeField(null=True, blank=True, help_text="a pin's end")

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["pool", "model"], name="one_owner_per_pool_and_model")
        ]

    def __str__(self) -> str:
        return f"{self.ref} owns {self.model} on {self.pool}"


class Operation(models.Model):
    """One load, unload or reload on one node, from the reconciler or a person."""

    class Kind(models.TextChoices):
        LOAD = "load"
        UNLOAD = "unload"
        RELOAD = "reload"

    class Status(models.TextChoices):
        QUEUED = "queued"
        RUNNING = "running"
        SUCCEEDED = "succeeded"
        FAILED = "failed"
        UNKNOWN = "unknown"
        CANCELLED = "cancelled"

    OPEN = [Status.QUEUED, Status.RUNNING]  # not ended: waiting for a worker, or being run

    # Indexed by (node, status, seq) below. A release writes each operation three times (its
    # plan, its claim, its end), each write into every index that covers a column it changes:
    # an index of its own for the node, and two for the status (Django's, and its LIKE twin),
    # cost those writes a third of their time in PostgreSQL for no query.
    node = models.ForeignKey(
        Node, on_delete=models.CASCADE, related_name="operations", db_index=False
    )
    kind = models.CharField(max_length=10, choices=Kind.choices)
    model_name = models.CharField(max_length=120)
    versions = models.JSONField(
        default=list, help_text="the versions the node must serve afterwards"
    )
    config = models.JSONField(
        null=True, blank=True, help_text="the config override sent with a load"
    )
    config_digest = models.CharField(max_length=64, blank=True)
    plan_digest = models.CharField(
        max_length=64, blank=True, help_text="desired state it was planned from"
    )
    seq = models.PositiveIntegerField(default=0, help_text="order within its plan")
    requested_by = models.CharField(max_length=150)
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.QUEUED)
    attempts = models.PositiveIntegerField(default=0)
    error = models.TextField(blank=True, help_text="Triton's own words when it refused")
    failure = models.CharField(max_length=15, choices=failures.CHOICES, blank=True)
    retry_at = models.DateTimeField(
        null=True, blank=True, help_text="when the reconciler tries a transient failure again"
    )
    override = models.TextField(
        blank=True, help_text="why a person sent it although it would not fit in memory"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [
            # A node's operations in order: its history, and its last plan, read from the end.
            # Without it a reconcile's look for the last plan walked the whole table backwards
            # wherever the planner had no statistics yet (a new database, autovacuum off).
            models.Index(fields=["node", "id"], name="fleet_operation_node"),
            # The work under way, a node's and the fleet's (OPEN: a few rows of many); none that
            # ended. A statement prepared once names the statuses it looks for in its text: a
            # parameter in their place would not let a generic plan use this index.
            models.Index(
                fields=["node", "status", "seq"],
                condition=models.Q(status__in=["queued", "running"]),
                name="fleet_operation_open",
            ),
            # The overview's latest finished operations, read from the end of the table.
            models.Index(fields=["-finished_at", "-id"], name="fleet_operation_finished"),
        ]

    def __str__(self) -> str:
        return f"{self.kind} {self.model_name} {self.versions} on {self.node}"

    @property
    def duration_s(self) -> float | None:
        if self.started_at and self.finished_at:
            return (self.finished_at - self.started_at).total_seconds()
        return None


class Heartbeat(models.Model):
    """When beat's heartbeat task last ran on a worker: both are alive (one row per name)."""

    name = models.CharField(max_length=30, primary_key=True)
    at = models.DateTimeField()

    def __str__(self) -> str:
        return f"{self.name} at {self.at:%H:%M:%S}"


class Footprint(models.Model):
    """The memory a model version was measured to take on one kind of device, as its backend
    reported it after a load or from the node's memory before and after: the mean of `samples`
    loads."""

    class Device(models.TextChoices):
        CPU = "cpu"
        GPU = "gpu"

    class Source(models.TextChoices):
        BACKEND = "backend", "reported by its backend"
        METRICS = "metrics", "the node's memory before and after"

    model_name = models.CharField(max_length=120)
    version = models.PositiveIntegerField()
    device = models.CharField(max_length=3, choices=Device.choices)
    mb = models.FloatField(help_text="mean of the measured samples, MiB")
    samples = models.PositiveIntegerField(default=1)
    source = models.CharField(
        max_length=7,
        choices=Source.choices,
        default=Source.METRICS,
        help_text="where the last sample came from",
    )
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["model_name", "version", "device"]
        constraints = [
            models.UniqueConstraint(
                fields=["model_name", "version", "device"], name="one_footprint_per_device"
            )
        ]

    def __str__(self) -> str:
        return f"{self.model_name} v{self.version} on {self.device}: {self.mb:.0f} MiB"
