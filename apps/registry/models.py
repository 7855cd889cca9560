from pathlib import Path

from django.conf import settings
from django.db import models

from apps.registry.archives import inside_roots


class Model(models.Model):
    class Kind(models.TextChoices):
        STANDALONE = "standalone"
        ENSEMBLE = "ensemble"

    name = models.CharField(max_length=120, unique=True)
    kind = models.CharField(max_length=20, choices=Kind.choices, default=Kind.STANDALONE)
    backend = models.CharField(max_length=60, blank=True, help_text="backend or platform")
    description = models.TextField(blank=True)
    team = models.CharField(max_length=120, blank=True)
    latency_budget_ms = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="P99 budget: per step for step models, end to end for ensembles",
    )
    # Service level objectives, for the rollouts' burn-rate gate (apps/rollouts/slo.py).
    slo_availability = models.FloatField(
        null=True, blank=True, help_text="the share of requests that must succeed, e.g. 0.999"
    )
    slo_latency = models.FloatField(
        null=True,
        blank=True,
        help_text="the share of requests answered within the budget, e.g. 0.99",
    )
    # An LLM's objective on what its users feel first: this share of first tokens within
    # `slo_ttft_ms` (`set_slo --ttft 0.99@800`); degradation steps down when it breaks.
    slo_ttft = models.FloatField(
        null=True, blank=True, help_text="the share of first tokens within slo_ttft_ms, e.g. 0.99"
    )
    slo_ttft_ms = models.PositiveIntegerField(
        null=True, blank=True, help_text="the time to first token they must come within"
    )
    fallback_version = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="a degraded, faster version (say, no reranker) for latency emergencies",
    )
    # What the model is asked in earnest: warm-ups and probes send these (apps/fleet/asking.py),
    # filled from its newest evaluation set (apps.quality); Triton's JSON form, a batch of one.
    sample_inputs = models.JSONField(
        default=list, blank=True, help_text="a few requests' inputs: name -> datatype, shape, data"
    )

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def slo(self) -> str:
        """Its objectives in words: "99.9% of requests succeed, 99% within 3000 ms"."""
        found = []
        if self.slo_availability is not None:
            found.append(f"{_percent(self.slo_availability)} of requests succeed")
        if self.slo_latency is not None and self.latency_budget_ms:
            found.append(f"{_percent(self.slo_latency)} within {self.latency_budget_ms} ms")
        if self.slo_ttft is not None:
            found.append(f"{_percent(self.slo_ttft)} of first tokens within {self.slo_ttft_ms} ms")
        return ", ".join(found)


def _percent(share: float) -> str:
    return f"{share * 100:.4f}".rstrip("0").rstrip(".") + "%"


class ModelVersion(models.Model):
    class Status(models.TextChoices):
        DRAFT = "draft"
        PUBLISHED = "published"
        DEPRECATED = "deprecated"

    model = models.ForeignKey(Model, on_delete=models.PROTECT, related_name="versions")
    version = models.PositiveIntegerField()
    memory_mb = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="declared memory estimate (MiB), used until a footprint is measured",
    )
    config = models.JSONField(help_text="canonical ModelConfig, as Triton's JSON")
    artifact = models.CharField(
        max_length=500,
        blank=True,
        help_text="s3://, gs:// or a path in the nodes' model repository",
    )
    checksum = models.CharField(max_length=100, blank=True)
    notes = models.TextField(blank=True)
    status = models.CharField(max_length=20, choices=Status.choices, default=Status.DRAFT)
    author = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["model__name", "-version"]
        constraints = [
            models.UniqueConstraint(fields=["model", "version"], name="unique_model_version")
        ]

    def __str__(self) -> str:
        return f"{self.model.name} v{self.version}"

    def files_gone(self) -> str:
        """Why the nodes cannot load this version any more ("" when they can, or when its files
        are somewhere this server cannot look: s3://, gs://, another host's path)."""
        files = Path(self.artifact) if self.artifact else None
        roots = [Path(root) for root in settings.REGISTRY_ARTIFACT_ROOTS]
        if files is None or not files.is_absolute() or not inside_roots(files, roots):
            return ""
        return "" if files.is_dir() else f"{self}'s files are gone from {files}"
