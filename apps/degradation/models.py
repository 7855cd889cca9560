from datetime import datetime
from typing import NamedTuple

from django.db import models

from apps.fleet.models import NodePool
from apps.registry.models import Model
from apps.web.clock import database_now


class Shape(NamedTuple):
    """A pool's deployment of a model serving one of its tiers (Tiers.deployment)."""

    version: int
    baseline: int | None
    standby: int | None


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
    breached_at = models.DateTimeField(null=True, blank=True, help_text="last seen over budget")
    judged_from = models.DateTimeField(
        null=True,
        blank=True,
        help_text="a breach decides nothing before: the readings hold older requests",
    )
    # The last probes of the tier above the one served, before switching back to it: what they
    # measured, in words, and when (one round a dwell at most).
    probed = models.TextField(blank=True)
    probed_at = models.DateTimeField(null=True, blank=True)
    # On a protected pool the automation never steps back up alone: the tier its probes cleared,
    # waiting for a person to confirm the switch.
    cleared = models.PositiveSmallIntegerField(
        null=True, blank=True, help_text="tier position the probes cleared, to be confirmed"
    )
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

    def deployment(self, position: int) -> "Shape":
        """What the pool's deployment names to serve tier `position`: its version, the tier
        above kept READY beside it (probes reach it by its version, and a switch back only
        narrows), the steps of the tier below loaded beside it, unserved (a switch down loads
        nothing but the pipeline's own config). Each tier is a newer version than the one above
        (tiers_set), so Triton serves the tier named, the newest READY version."""
        versions, below = self.versions, position + 1 < len(self.versions)
        pipeline = self.model.kind == Model.Kind.ENSEMBLE
        return Shape(
            versions[position],
            baseline=versions[position - 1] if position > 0 else None,
            standby=versions[position + 1] if below and pipeline else None,
        )

    def pin_holds(self, now: datetime | None = None) -> bool:
        """Whether the pin still holds: set, and not expired."""
        return (
            self.pinned is not None
            and self.pinned_until is not None
            and self.pinned_until > (now or database_now())
        )
