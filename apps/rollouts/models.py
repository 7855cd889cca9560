from django.conf import settings
from django.db import models

from apps.fleet.models import NodePool
from apps.registry.models import Model


class Rollout(models.Model):
    class State(models.TextChoices):
        PENDING = "pending"
        PROGRESSING = "progressing"
        PAUSED = "paused"
        PROMOTING = "promoting"
        SUCCEEDED = "succeeded"
        ABORTING = "aborting"
        ROLLED_BACK = "rolled_back"
        FAILED = "failed"

    model = models.ForeignKey(Model, on_delete=models.PROTECT, related_name="rollouts")
    pool = models.ForeignKey(NodePool, on_delete=models.PROTECT, related_name="rollouts")
    baseline_version = models.PositiveIntegerField()
    canary_version = models.PositiveIntegerField()
    state = models.CharField(max_length=20, choices=State.choices, default=State.PENDING)
    started_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.model} v{self.baseline_version} -> v{self.canary_version} on {self.pool}"
