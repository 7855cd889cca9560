from django.conf import settings
from django.db import models


class ApiToken(models.Model):
    """A user's key to the API. Only a digest is kept: the token itself is shown once, when it is
    created, and cannot be read back."""

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

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…)"
