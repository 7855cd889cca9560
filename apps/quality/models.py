"""Evaluation sets and their runs through Triton: a release is judged on its answers as well
as its latency (DESIGN.md, idea 7)."""

from django.db import models

from apps.fleet.models import Node
from apps.registry.models import Model


class EvaluationSet(models.Model):
    """Named cases for one model, versioned: an import is the name's next version, never a
    change in place, so a run keeps the very cases it was judged on."""

    model = models.ForeignKey(Model, on_delete=models.PROTECT, related_name="evaluation_sets")
    name = models.SlugField(max_length=60)
    version = models.PositiveIntegerField()
    source = models.CharField(max_length=200, blank=True, help_text="the file it came from")
    created_by = models.CharField(max_length=150)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["model__name", "name", "-version"]
        constraints = [
            models.UniqueConstraint(
                fields=["model", "name", "version"], name="one_evaluation_set_version"
            )
        ]

    def __str__(self) -> str:
        return f"{self.model.name}/{self.name} v{self.version}"


class EvaluationCase(models.Model):
    evaluation_set = models.ForeignKey(
        EvaluationSet, on_delete=models.CASCADE, related_name="cases"
    )
    line = models.PositiveIntegerField(help_text="its line in the JSON Lines file")
    name = models.CharField(max_length=120)
    inputs = models.JSONField(help_text="tensor name -> value, without the batch dimension")
    expect = models.JSONField(help_text="output tensor name -> rule (apps/quality/rules.py)")

    class Meta:
        ordering = ["line"]
        constraints = [
            models.UniqueConstraint(fields=["evaluation_set", "name"], name="one_case_name")
        ]

    def __str__(self) -> str:
        return self.name


class EvaluationRun(models.Model):
    """One pass of a set's cases through Triton, each sent to an explicit `version` and, where a
    baseline is named, the same case to `baseline_version` for its "agrees" rules and for the
    comparison of scores."""

    class Status(models.TextChoices):
        QUEUED = "queued"
        RUNNING = "running"
        DONE = "done"
        FAILED = "failed"  # could not run at all (no node with the version READY...)

    OPEN = [Status.QUEUED, Status.RUNNING]

    evaluation_set = models.ForeignKey(EvaluationSet, on_delete=models.PROTECT, related_name="runs")
    version = models.PositiveIntegerField()
    baseline_version = models.PositiveIntegerField(null=True, blank=True)
    node = models.ForeignKey(
        Node, null=True, blank=True, on_delete=models.SET_NULL, related_name="evaluation_runs"
    )
    baseline_node = models.ForeignKey(
        Node, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    concurrency = models.PositiveIntegerField(default=4)
    timeout_s = models.FloatField(default=10.0, help_text="per case")
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.QUEUED)
    purpose = models.CharField(max_length=200, blank=True, help_text='"rollout #12 gate"...')
    requested_by = models.CharField(max_length=150)
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    score = models.FloatField(null=True, blank=True, help_text="the share of cases passed")
    baseline_score = models.FloatField(null=True, blank=True)
    passed = models.PositiveIntegerField(default=0)
    failed = models.PositiveIntegerField(default=0)
    error = models.TextField(blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"#{self.pk} {self.evaluation_set} on v{self.version}"

    @property
    def finished(self) -> bool:
        return self.status not in self.OPEN


class CaseResult(models.Model):
    """What one version answered to one case, and how each rule judged it."""

    run = models.ForeignKey(EvaluationRun, on_delete=models.CASCADE, related_name="results")
    case = models.ForeignKey(EvaluationCase, on_delete=models.CASCADE, related_name="results")
    version = models.PositiveIntegerField()
    outputs = models.JSONField(default=dict)
    scores = models.JSONField(default=dict, help_text="output -> {passed, value, detail}")
    passed = models.BooleanField(null=True, help_text="null: no rule applied")
    latency_ms = models.FloatField(null=True, blank=True)
    first_ms = models.FloatField(
        null=True, blank=True, help_text="a streamed answer's first response, after the request"
    )
    tokens = models.PositiveIntegerField(
        null=True, blank=True, help_text="a streamed answer's responses, one a token"
    )
    error = models.TextField(blank=True, help_text="Triton's refusal, or the timeout")

    class Meta:
        ordering = ["case__line", "version"]
        constraints = [
            models.UniqueConstraint(fields=["run", "case", "version"], name="one_answer_per_case")
        ]

    def __str__(self) -> str:
        return f"{self.case} on v{self.version}"


class SyntheticLoad(models.Model):
    """Requests made from a set's inputs to nodes whose own traffic is too thin for a judge:
    recorded, so that a rollout's evidence and its page say which of its requests were made."""

    evaluation_set = models.ForeignKey(
        EvaluationSet, on_delete=models.PROTECT, related_name="loads"
    )
    nodes = models.JSONField(help_text="the names of the nodes sent to, round-robin")
    rps = models.FloatField(help_text="requests per second, across those nodes")
    seconds = models.PositiveIntegerField()
    purpose = models.CharField(max_length=200, blank=True)
    requested_by = models.CharField(max_length=150)
    created_at = models.DateTimeField(auto_now_add=True)
    claimed_at = models.DateTimeField(null=True, blank=True)
    sent = models.PositiveIntegerField(default=0)
    failed = models.PositiveIntegerField(default=0)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.rps:g} rps to {', '.join(self.nodes)} for {self.seconds} s"
