from django.conf import settings
from django.db import models


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
    fallback_version = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="a degraded, faster version (say, no reranker) for latency emergencies",
    )

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class ModelVersion(models.Model):
    class Status(models.TextChoices):
        DRAFT = "draft"
        RELEASED = "released"
        DEPRECATED = "deprecated"

    model = models.ForeignKey(Model, on_delete=models.PROTECT, related_name="versions")
    version = models.PositiveIntegerField()
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
