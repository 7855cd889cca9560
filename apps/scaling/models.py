from django.db import models

from apps.fleet.models import NodePool


class Scaling(models.Model):
    """A pool's nodes as an autoscaler should have them: its bounds and a person's pin, and the
    signal the last tick computed (apps/scaling/signal.py), with its reasons."""

    pool = models.OneToOneField(NodePool, on_delete=models.CASCADE, related_name="scaling")
    least = models.PositiveIntegerField(default=1, help_text="nodes the signal never goes below")
    most = models.PositiveIntegerField(null=True, blank=True, help_text="none: no limit")
    # A person's pin: the signal says this many nodes, whatever the readings, until unpinned.
    pinned = models.PositiveIntegerField(null=True, blank=True)
    pinned_by = models.CharField(max_length=150, blank=True)
    pinned_reason = models.TextField(blank=True)
    wanted = models.PositiveIntegerField(null=True, blank=True, help_text="none: not computed")
    nodes = models.PositiveIntegerField(default=0, help_text="the pool's nodes when computed")
    reasons = models.JSONField(default=list, blank=True)
    held = models.TextField(blank=True, help_text="why it asks for no scale-in, if it does")
    computed_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"{self.pool_id}: {self.wanted} nodes wanted"
