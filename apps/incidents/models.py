from datetime import datetime

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.utils import timezone

from apps.fleet.models import Node, NodePool
from apps.registry.models import Model


class Incident(models.Model):
    """Something went wrong, from its onset to its resolution: opened by a person from a chart or
    a timeline window, or by Alertmanager from firing alerts (one incident per alert group while
    it is open). Its window grows until it is resolved."""

    class Severity(models.TextChoices):
        CRITICAL = "critical"
        WARNING = "warning"
        INFO = "info"

    class Status(models.TextChoices):
        OPEN = "open"
        MITIGATED = "mitigated"
        RESOLVED = "resolved"

    title = models.CharField(max_length=200)
    severity = models.CharField(max_length=10, choices=Severity.choices, default=Severity.WARNING)
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.OPEN)
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL
    )
    notes = models.TextField(blank=True)
    started_at = models.DateTimeField(help_text="the symptom's onset: the window's start")
    ended_at = models.DateTimeField(
        null=True, blank=True, help_text="the window's end, once resolved"
    )
    opened_at = models.DateTimeField(auto_now_add=True)
    opened_by = models.CharField(max_length=150)
    mitigated_at = models.DateTimeField(null=True, blank=True)
    resolved_at = models.DateTimeField(null=True, blank=True)
    alert_key = models.CharField(
        max_length=500, blank=True, help_text="Alertmanager's group key, for alert-opened incidents"
    )
    alerts = models.JSONField(default=list, blank=True, help_text="the alerts, as last received")
    pool = models.ForeignKey(NodePool, null=True, blank=True, on_delete=models.SET_NULL)
    model = models.ForeignKey(Model, null=True, blank=True, on_delete=models.SET_NULL)
    node = models.ForeignKey(Node, null=True, blank=True, on_delete=models.SET_NULL)

    class Meta:
        ordering = ["-started_at", "-id"]
        permissions = [("manage_incident", "Open, update and resolve incidents")]
        constraints = [
            models.UniqueConstraint(
                fields=["alert_key"],
                condition=~Q(alert_key="") & ~Q(status="resolved"),
                name="one_open_incident_per_alert_group",
            )
        ]

    def __str__(self) -> str:
        return f"#{self.pk} {self.title}"

    @property
    def window(self) -> tuple[datetime, datetime]:
        return self.started_at, self.ended_at or timezone.now()
