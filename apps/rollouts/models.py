from datetime import timedelta

from django.db import models
from django.db.models import Q

from apps.fleet.models import NodePool
from apps.performance.models import PerfRun
from apps.quality.models import EvaluationRun, SyntheticLoad
from apps.registry.models import Model
from apps.rollouts.plans import CustomMetric
from apps.rollouts.verdicts import Verdict


class AnalysisTemplate(models.Model):
    """A named analysis (judge, thresholds, windows), for one model or pool or for any, chosen
    when a rollout starts. Never changed in place: a save is the name's next version, so a
    rollout keeps the very version it was judged by."""

    name = models.SlugField(max_length=60)
    version = models.PositiveIntegerField()
    model = models.ForeignKey(
        Model, null=True, blank=True, on_delete=models.CASCADE, related_name="analysis_templates"
    )
    pool = models.ForeignKey(
        NodePool,
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="analysis_templates",
    )
    analysis = models.JSONField(help_text="the fields it sets; the defaults for the rest")
    created_by = models.CharField(max_length=150)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name", "-version"]
        constraints = [
            models.UniqueConstraint(fields=["name", "version"], name="one_template_version")
        ]

    def __str__(self) -> str:
        return f"{self.name} v{self.version}"


class Rollout(models.Model):
    """A gray release of `canary_version` over `pool`, step by step, judged against the version
    the pool ran before (`baseline_version`). All of its state lives in this row, so the
    controller can be killed and restarted at any point."""

    class State(models.TextChoices):
        PENDING = "pending"
        PROGRESSING = "progressing"
        PAUSED = "paused"
        PROMOTING = "promoting"
        SUCCEEDED = "succeeded"
        ABORTING = "aborting"
        ROLLED_BACK = "rolled_back", "Rolled back"
        FAILED = "failed"

    ACTIVE = [State.PENDING, State.PROGRESSING, State.PAUSED, State.PROMOTING, State.ABORTING]
    TERMINAL = [State.SUCCEEDED, State.ROLLED_BACK, State.FAILED]

    class Strategy(models.TextChoices):
        CANARY = "canary", "Canary: step by step, judged against the baseline"
        BLUE_GREEN = "blue_green", "Blue-green: loaded beside, evaluated, switched at once"

    model = models.ForeignKey(Model, on_delete=models.PROTECT, related_name="rollouts")
    pool = models.ForeignKey(NodePool, on_delete=models.PROTECT, related_name="rollouts")
    strategy = models.CharField(max_length=12, choices=Strategy.choices, default=Strategy.CANARY)
    baseline_version = models.PositiveIntegerField()
    canary_version = models.PositiveIntegerField()
    lockstep = models.JSONField(
        default=list,
        blank=True,
        help_text='released with it, as one: [{"model": "m", "baseline": 1, "canary": 2}]',
    )
    plan = models.JSONField(help_text='steps: [{"nodes": 1, "hold_s": 60}, {"percent": 100}]')
    analysis = models.JSONField(default=dict, help_text="thresholds; see rollouts.plans.Analysis")
    template = models.ForeignKey(
        AnalysisTemplate,
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="rollouts",
        help_text="the analysis template (and version) it started from",
    )
    quality_sets = models.JSONField(
        default=dict,
        blank=True,
        help_text='the evaluation sets its gates run, pinned when it started: {"model": set id}',
    )
    state = models.CharField(max_length=20, choices=State.choices, default=State.PENDING)
    step = models.PositiveIntegerField(default=0, help_text="index of the current step in plan")
    step_started_at = models.DateTimeField(null=True, blank=True, help_text="share applied")
    step_ready_at = models.DateTimeField(null=True, blank=True, help_text="canary READY on it")
    canary_nodes = models.JSONField(default=list, blank=True, help_text="nodes given the canary")
    gate_run = models.ForeignKey(
        EvaluationRun,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
        help_text="the quality gate's evaluation, before the canary gets any traffic",
    )
    gate_runs = models.ManyToManyField(
        EvaluationRun,
        blank=True,
        related_name="+",
        help_text="a blue-green release's evaluations: each changed step, on every node",
    )
    gate_passed_at = models.DateTimeField(null=True, blank=True, help_text="the quality gate")
    perf_runs = models.ManyToManyField(
        PerfRun,
        blank=True,
        related_name="+",
        help_text="the performance gate's runs, canary and baseline, in their order",
    )
    perf_passed_at = models.DateTimeField(null=True, blank=True, help_text="the performance gate")
    quality_run = models.ForeignKey(
        EvaluationRun,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
        help_text="an evaluation under way during a step",
    )
    synthetic_load = models.ForeignKey(
        SyntheticLoad,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
        help_text="the step's latest synthetic requests, where its own were too few",
    )
    last_verdict = models.CharField(max_length=15, blank=True)
    last_measured_at = models.DateTimeField(null=True, blank=True)
    failures = models.PositiveIntegerField(default=0, help_text="failed measurements so far")
    errors = models.PositiveIntegerField(default=0, help_text="Prometheus errors in a row")
    reason = models.TextField(blank=True, help_text="why it paused, was aborted or failed")
    tick_errors = models.PositiveIntegerField(default=0, help_text="controller failures in a row")
    tick_error = models.TextField(blank=True, help_text="the last one, until a tick succeeds")
    started_by = models.CharField(max_length=150)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    first_failure_at = models.DateTimeField(null=True, blank=True)
    rolled_back_at = models.DateTimeField(
        null=True, blank=True, help_text="read back: every canary node serves the baseline only"
    )

    class Meta:
        ordering = ["-created_at", "-id"]
        permissions = [
            ("rollback_release", "Roll a pool back to its last good release or its fallback")
        ]
        constraints = [
            models.UniqueConstraint(
                fields=["model", "pool"],
                # ACTIVE spelled out: Meta cannot see the class body (a test checks they agree).
                condition=Q(
                    state__in=["pending", "progressing", "paused", "promoting", "aborting"]
                ),
                name="one_active_rollout_per_model_and_pool",
            )
        ]

    def __str__(self) -> str:
        return f"{self.moves} on {self.pool}"

    @property
    def moves(self) -> str:
        """What it moves: "rag_pipeline v1 → v3", and its lockstep models after "with"."""
        lead = f"{self.model.name} v{self.baseline_version} → v{self.canary_version}"
        rest = [f"{m['model']} v{m['baseline']} → v{m['canary']}" for m in self.lockstep]
        return " with ".join([lead, ", ".join(rest)]) if rest else lead

    @property
    def model_names(self) -> list[str]:
        return [self.model.name, *(m["model"] for m in self.lockstep)]

    @property
    def active(self) -> bool:
        return self.state in self.ACTIVE

    @property
    def rollback_duration(self) -> timedelta | None:
        """From the first failing measurement to every canary node serving the baseline only."""
        if self.first_failure_at and self.rolled_back_at:
            return self.rolled_back_at - self.first_failure_at
        return None


class Round(models.Model):
    """One judgement of a rollout's step, with its verdict (the round's whole: a marginal round
    is marginal, whatever its measurements): an analysis during the step, the quality or the
    performance gate before any traffic, or the evaluation before a blue-green switch."""

    class Kind(models.TextChoices):
        ANALYSIS = "analysis"
        GATE = "gate"  # quality before traffic
        PERF = "perf"  # performance before traffic
        SWITCH = "switch"  # quality before a blue-green switch

    rollout = models.ForeignKey(Rollout, on_delete=models.CASCADE, related_name="rounds")
    step = models.PositiveIntegerField()
    number = models.PositiveIntegerField(help_text="its place among the step's rounds, from 1")
    kind = models.CharField(max_length=10, choices=Kind.choices, default=Kind.ANALYSIS)
    taken_at = models.DateTimeField(auto_now_add=True, db_index=True)
    verdict = models.CharField(max_length=15, choices=Verdict.choices)

    class Meta:
        ordering = ["-taken_at", "-id"]
        constraints = [
            models.UniqueConstraint(fields=["rollout", "step", "number"], name="one_round_number")
        ]

    def __str__(self) -> str:
        return f"step {self.step + 1} round {self.number}: {self.verdict}"


class Measurement(models.Model):
    """One analysis query, canary against baseline, with what it was judged against; part of
    its round."""

    class Kind(models.TextChoices):
        REQUESTS = "requests"  # how many requests each side served: enough to judge?
        THROUGHPUT = "throughput"  # requests a second, a node at a concurrency (performance gate)
        LATENCY = "latency"  # P99, or latency samples
        ERRORS = "errors"  # the share of requests that failed, or its samples
        STEP = "step"  # a pipeline step's latency, at the version each release pins
        BURN = "burn"  # an objective's burn rate
        TTFT = "ttft"  # an LLM step's time to first token
        ITL = "itl"  # an LLM step's time per output token
        TOKENS = "tokens"  # an LLM step's output tokens per request: its answers' length
        KV_CACHE = "kv_cache"  # an LLM step's KV cache in use, where its backend exports it
        CUSTOM = "custom"  # a metric of the analysis's own
        QUALITY = "quality"  # an evaluation run's score
        PROMETHEUS = "prometheus"  # the measurement itself could not be taken

    rollout = models.ForeignKey(Rollout, on_delete=models.CASCADE, related_name="measurements")
    round = models.ForeignKey(
        Round, null=True, on_delete=models.CASCADE, related_name="measurements"
    )
    step = models.PositiveIntegerField()
    taken_at = models.DateTimeField(auto_now_add=True)
    kind = models.CharField(max_length=12, choices=Kind.choices, help_text="what it measures")
    metric = models.CharField(max_length=120, help_text="its name, as people read it")
    query = models.TextField(help_text="the PromQL as sent")
    canary_value = models.FloatField(null=True, blank=True)
    baseline_value = models.FloatField(null=True, blank=True)
    threshold = models.FloatField(null=True, blank=True)
    verdict = models.CharField(max_length=15, choices=Verdict.choices)
    detail = models.TextField(blank=True)
    evidence = models.JSONField(
        default=dict, blank=True, help_text="the statistical judge's samples, U, p and effect"
    )

    class Meta:
        ordering = ["-taken_at", "-id"]

    def __str__(self) -> str:
        return f"{self.metric}: {self.verdict}"

    @property
    def custom_name(self) -> str:
        """The name of the analysis's own metric this measures; empty for the built-in ones."""
        return (
            self.metric.removeprefix(CustomMetric.PREFIX) if self.kind == self.Kind.CUSTOM else ""
        )


class Notification(models.Model):
    """A webhook message about a rollout, or about a pool's model that no rollout carries (the
    degradation automation's switches); delivered by a worker, retried, never blocking."""

    class Status(models.TextChoices):
        PENDING = "pending"
        SENT = "sent"
        FAILED = "failed"

    rollout = models.ForeignKey(
        Rollout, null=True, blank=True, on_delete=models.CASCADE, related_name="notifications"
    )
    event = models.CharField(max_length=30)
    payload = models.JSONField()
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.PENDING)
    attempts = models.PositiveIntegerField(default=0)
    last_error = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    sent_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.event} ({self.status})"
