from django.db import models

from apps.fleet.models import Node
from apps.registry.models import Model


class PerfRun(models.Model):
    """perf_analyzer's measurement of one version of a model on one node, at each concurrency of
    a range, a fixed number of requests at each; queued, then run by a worker, which stores a
    point per concurrency."""

    class Status(models.TextChoices):
        QUEUED = "queued"
        RUNNING = "running"
        DONE = "done"
        FAILED = "failed"  # could not measure: perf_analyzer's words in `error`

    OPEN = [Status.QUEUED, Status.RUNNING]

    model = models.ForeignKey(Model, on_delete=models.PROTECT, related_name="perf_runs")
    version = models.PositiveIntegerField()
    node = models.ForeignKey(Node, null=True, on_delete=models.SET_NULL, related_name="perf_runs")
    node_name = models.CharField(max_length=200, help_text="kept when the node is removed")
    concurrencies = models.JSONField(help_text="[start, end, step], as perf_analyzer's range")
    requests = models.PositiveIntegerField(help_text="at each concurrency")
    streaming = models.BooleanField(default=False, help_text="a decoupled model, streamed")
    timeout_s = models.PositiveIntegerField(help_text="for each concurrency's run")
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.QUEUED)
    purpose = models.CharField(max_length=200, blank=True, help_text='"rollout #12, gate"...')
    requested_by = models.CharField(max_length=150)
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    error = models.TextField(blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"#{self.pk} {self.model.name} v{self.version} on {self.node_name}"

    @property
    def finished(self) -> bool:
        return self.status not in self.OPEN

    @property
    def concurrency_range(self) -> range:
        start, end, step = self.concurrencies
        return range(start, end + 1, step)


class PerfPoint(models.Model):
    """One concurrency's figures, as perf_analyzer reported them."""

    run = models.ForeignKey(PerfRun, on_delete=models.CASCADE, related_name="points")
    concurrency = models.PositiveIntegerField()
    throughput = models.FloatField(help_text="inferences a second")
    p50_ms = models.FloatField()
    p90_ms = models.FloatField()
    p99_ms = models.FloatField()
    queue_us = models.FloatField(help_text="the server's queue time per request")
    compute_us = models.FloatField(help_text="the server's compute time per request")

    class Meta:
        ordering = ["run", "concurrency"]
        constraints = [
            models.UniqueConstraint(fields=["run", "concurrency"], name="one_point_a_concurrency")
        ]

    def __str__(self) -> str:
        return f"{self.throughput:.4g}/s at {self.concurrency}"

    @property
    def queue_ms(self) -> float:
        return self.queue_us / 1000

    @property
    def compute_ms(self) -> float:
        return self.compute_us / 1000


class PerfSearch(models.Model):
    """A search over one step's config on one node held aside (apps/fleet/trials.py): each
    config tried is a trial, the pipeline measured end to end with it at one concurrency; the
    winner serves the most within the pipeline's latency budget."""

    class Status(models.TextChoices):
        QUEUED = "queued"
        RUNNING = "running"
        DONE = "done"
        FAILED = "failed"  # could not search: why in `error`, the trials so far kept

    OPEN = [Status.QUEUED, Status.RUNNING]

    pipeline = models.ForeignKey(Model, on_delete=models.PROTECT, related_name="perf_searches")
    version = models.PositiveIntegerField(help_text="the pipeline version measured")
    step = models.CharField(max_length=120, help_text="the step whose config is searched")
    pool_name = models.CharField(max_length=200, help_text="where the tuning is released")
    node = models.ForeignKey(Node, null=True, on_delete=models.SET_NULL, related_name="searches")
    node_name = models.CharField(max_length=200, help_text="kept when the node is removed")
    concurrency = models.PositiveIntegerField()
    requests = models.PositiveIntegerField(help_text="a trial")
    budget_ms = models.PositiveIntegerField(null=True, blank=True, help_text="P99, end to end")
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.QUEUED)
    requested_by = models.CharField(max_length=150)
    created_at = models.DateTimeField(auto_now_add=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    error = models.TextField(blank=True)
    winner = models.ForeignKey(
        "PerfTrial", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"search #{self.pk}: {self.step} in {self.pipeline.name} v{self.version}"

    @property
    def finished(self) -> bool:
        return self.status not in self.OPEN


class PerfTrial(models.Model):
    """One config tried: the fields laid over the step's config ({} for the config it serves),
    and the pipeline's figures with it, or why it could not be measured."""

    search = models.ForeignKey(PerfSearch, on_delete=models.CASCADE, related_name="trials")
    fields = models.JSONField(default=dict)
    label = models.CharField(max_length=200, help_text='"2 instances, batch 8, delay 2000 us"')
    throughput = models.FloatField(null=True, blank=True, help_text="requests a second")
    p99_ms = models.FloatField(null=True, blank=True)
    queue_us = models.FloatField(null=True, blank=True)
    compute_us = models.FloatField(null=True, blank=True)
    error = models.TextField(blank=True)

    class Meta:
        ordering = ["search", "id"]

    def __str__(self) -> str:
        return self.label

    @property
    def queue_ms(self) -> float | None:
        return None if self.queue_us is None else self.queue_us / 1000

    @property
    def compute_ms(self) -> float | None:
        return None if self.compute_us is None else self.compute_us / 1000
