from django.conf import settings
from django.db import models

from apps.fleet.models import NodePool


class Approval(models.Model):
    """A person's change to a protected pool, waiting for a second person; carried out, as the
    requester's, when someone else approves it before it expires."""

    class Status(models.TextChoices):
        PENDING = "pending"
        APPROVED = "approved"
        FAILED = "failed"  # approved, but the change itself was refused (the pool moved on)
        REJECTED = "rejected"  # refused by an approver, who said why
        WITHDRAWN = "withdrawn"  # taken back by its requester

    pool = models.ForeignKey(NodePool, on_delete=models.CASCADE, related_name="approvals")
    action = models.CharField(max_length=30)
    params = models.JSONField()
    # What the change was resolved against when it was asked (the pool's release of the model):
    # approved once that has moved, it would do something its approver never saw.
    resolved = models.JSONField(default=dict, blank=True)
    requested_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="approvals_requested"
    )
    requested_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()
    approved_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.PROTECT,
        null=True,
        blank=True,
        related_name="approvals_given",
    )
    approved_at = models.DateTimeField(null=True, blank=True)
    rejected_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.PROTECT,
        null=True,
        blank=True,
        related_name="approvals_rejected",
    )
    closed_at = models.DateTimeField(null=True, blank=True)  # when rejected or withdrawn
    reason = models.TextField(blank=True)  # a rejection's, or a withdrawal's if one was given
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.PENDING)
    result = models.TextField(blank=True)

    class Meta:
        db_table = "rollouts_approval"  # where it was made, before approvals were their own app
        ordering = ["-requested_at", "-id"]

    def __str__(self) -> str:
        return f"#{self.pk} {self.action} on {self.pool_id}"

    @property
    def summary(self) -> str:
        """What will run, every field of it: a plan's steps and an analysis's settings too."""
        return ", ".join(f"{key} {_shown(value)}" for key, value in self.params.items() if value)


def _shown(value: object) -> str:
    if isinstance(value, dict):
        return " ".join(f"{key}={_shown(each)}" for key, each in value.items())
    if isinstance(value, list):
        return " / ".join(_shown(each) for each in value)
    return str(value)
