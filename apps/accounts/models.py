from django.conf import settings
from django.db import models


class ApiToken(models.Model):
    """A user's key to the API. Only a digest is kept: the token itself is shown once, when it is
    created, and cannot be read back. Every token expires; a read-only one changes nothing, and
    an alerts one only opens and resolves incidents (Alertmanager's webhook)."""

    class Scope(models.TextChoices):
        READ = "read", "read only"
        WRITE = "write", "read and write (as your role allows)"
        ALERTS = "alerts", "Alertmanager's webhook only"

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="tokens"
    )
    name = models.CharField(max_length=80, help_text="what uses it, e.g. the release pipeline")
    prefix = models.CharField(
        max_length=12, help_text="the token's first characters, to tell it apart"
    )
    digest = models.CharField(max_length=64, unique=True)  # SHA-256 of the whole token
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField()
    scope = models.CharField(max_length=10, choices=Scope.choices, default=Scope.WRITE)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…)"


class PoolRole(models.Model):
    """A role held on one pool only, above the user's own (global) role: an operator of `gpu`
    who is a viewer elsewhere. Every user with access has a global role, viewer at least."""

    class Role(models.TextChoices):
        OPERATOR = "operator"
        RELEASE_MANAGER = "release_manager"

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="pool_roles"
    )
    pool = models.ForeignKey("fleet.NodePool", on_delete=models.CASCADE, related_name="roles")
    role = models.CharField(max_length=20, choices=Role.choices)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["user", "pool"], name="one_role_per_user_and_pool")
        ]

    def __str__(self) -> str:
        return f"{self.role} of {self.pool_id}"
