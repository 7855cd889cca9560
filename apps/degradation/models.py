from datetime import datetime

from django.db import models
from django.utils import timezone

from apps.fleet.models import NodePool
from apps.registry.models import Model


class Tiers(models.Model):
    """A pool's degradation tiers of a model: published versions with the same inputs and
    outputs, the primary first, each lighter than the one before (for example rag_pipeline
    without its reranker, then with a light generator); and a person's pin on one of them."""

    pool = models.ForeignKey(NodePool, on_delete=models.CASCADE, related_name="tiers")
    model = models.ForeignKey(Model, on_delete=models.PROTECT, related_name="tiers")
    versions = models.JSONField(help_text="the tiers' versions, the primary first")
    # A person's pin: the pool serves that tier, and nothing else decides until it expires or
    # is lifted.
    pinned = models.PositiveSmallIntegerField(null=True, blank=True, help_text="tier position")
    pinned_by = models.CharField(max_length=150, blank=True)
    pinned_reason = models.TextField(blank=True)
    pinned_until = models.DateTimeField(null=True, blank=True)
    # The automation's own record: when it switched (the last hour's), and when it stopped
    # itself for switching too often, until a person sets the tiers again.
    switched_at = models.JSONField(default=list, blank=True, help_text="ISO times, newest last")
    frozen_at = models.DateTimeField(null=True, blank=True)
    frozen_reason = models.TextField(blank=True)
    # What the automation last found, in words, and since when: why the pool is where it is.
    said = models.TextField(blank=True)
    said_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["pool", "model"], name="one_tier_list_per_pool_model")
        ]
        verbose_name_plural = "tiers"

    def __str__(self) -> str:
        return f"{self.model_id} on {self.pool_id}: " + " > ".join(f"v{v}" for v in self.versions)

    def pin_holds(self, now: datetime | None = None) -> bool:
        """Whether the pin still holds: set, and not expired."""
        return (
            self.pinned is not None
            and self.pinned_until is not None
            and self.pinned_until > (now or timezone.now())
        )
