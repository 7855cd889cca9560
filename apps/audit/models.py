from typing import Any

from django.conf import settings
from django.db import models

# Targets whose second part names the thing and whose third, when there is one, the model it
# concerns: `pool:demo:rag_pipeline`, `node:demo-1`, `rollout:7:rag_pipeline`, `model:rag:v2`.
NAMED = {"pool", "node", "rollout", "model"}


def target_parts(target: str) -> dict[str, str]:
    """The columns a target is read by: its type, its name (or id) and the model it concerns;
    taken apart once, when the event is written, so that no reader parses `target`. A target
    without a type (a refused request's path) has none."""
    kind, colon, rest = target.partition(":")
    if not colon or not kind.isidentifier():
        return {"target_type": "", "target_name": "", "target_model": ""}
    if kind not in NAMED:
        return {"target_type": kind, "target_name": rest, "target_model": ""}
    name, _, model = rest.partition(":")
    return {
        "target_type": kind,
        "target_name": name,
        "target_model": name if kind == "model" else model,
    }


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
    # The target's parts (target_parts): what the charts, suspects and timeline select by.
    # A database default too: an insert that names none of them (an older release of the app
    # during a rolling deploy) still goes in.
    target_type = models.CharField(max_length=30, blank=True, db_default="")
    target_name = models.CharField(max_length=200, blank=True, db_default="")
    target_model = models.CharField(max_length=150, blank=True, db_default="")
    before = models.JSONField(default=dict, blank=True)
    after = models.JSONField(default=dict, blank=True)
    result = models.CharField(max_length=10, choices=Result.choices, default=Result.OK)
    message = models.TextField(blank=True)
    # The web request (or the task it enqueued) the event was written for: X-Request-ID.
    request_id = models.CharField(max_length=64, blank=True)
    via = models.CharField(max_length=120, blank=True, help_text="the API token used, if any")

    class Meta:
        ordering = ["-created_at", "-id"]
        # Looked up by equality only: indexed without the LIKE twin a CharField's db_index
        # adds on PostgreSQL, which every event written (five a node in a release) paid for.
        indexes = [
            models.Index(fields=["target_type", "target_name"], name="audit_target"),
            models.Index(fields=["target_model"], name="audit_target_model"),
            models.Index(fields=["request_id"], name="audit_request"),
        ]

    def __str__(self) -> str:
        return f"{self.created_at:%Y-%m-%d %H:%M:%S} {self.actor} {self.action} {self.target}"

    def save(self, *args: Any, **kwargs: Any) -> None:
        """Written with its target's parts, however it was made (bulk_create skips this: its
        callers pass target_parts themselves)."""
        for name, value in target_parts(self.target).items():
            setattr(self, name, value)
        super().save(*args, **kwargs)

    @property
    def parts(self) -> list[dict[str, Any]]:
        """The steps of this action that other services recorded (a rollback's deployments)."""
        return list(self.after.get("parts", []))

    @property
    def outcome(self) -> dict[str, Any]:
        """What the action itself left, without its parts."""
        return {key: value for key, value in self.after.items() if key != "parts"}

    def as_part(self) -> dict[str, Any]:
        """How the event is listed inside the event of the action it was a step of."""
        part = {"action": self.action, "target": self.target}
        fields = {"before": self.before, "after": self.after, "message": self.message}
        return part | {key: value for key, value in fields.items() if value}
