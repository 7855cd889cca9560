from django.conf import settings
from django.db import models


class AuditEvent(models.Model):
    """One action on the fleet: who, what, on which target, before and after, with what result."""

    class Result(models.TextChoices):
        OK = "ok"
        FAILED = "failed"
        DENIED = "denied"

    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    actor = models.CharField(max_length=150, help_text="username, or system:<component>")
    # PROTECT: the trail is append-only (a database trigger on PostgreSQL), so a user with events
    # is deactivated, never deleted.
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT
    )
    action = models.CharField(max_length=80, db_index=True)
    target = models.CharField(max_length=200, db_index=True)
    before = models.JSONField(default=dict, blank=True)
    after = models.JSONField(default=dict, blank=True)
    result = models.CharField(max_length=10, choices=Result.choices, default=Result.OK)
    message = models.TextField(blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.created_at:%Y-%m-%d %H:%M:%S} {self.actor} {self.action} {self.target}"
