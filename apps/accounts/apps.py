from typing import Any

from django.apps import AppConfig


class AccountsConfig(AppConfig):
    name = "apps.accounts"
    label = "accounts"

    def ready(self) -> None:
        from axes.signals import user_locked_out
        from django.contrib.auth.signals import user_logged_in

        from apps.web.sessions import session_started

        user_locked_out.connect(_audit_lockout, dispatch_uid="accounts.audit_lockout")
        user_logged_in.connect(session_started, dispatch_uid="accounts.session_started")


def _audit_lockout(sender: object, request: Any, username: str, ip_address: str, **_: Any) -> None:
    """A lockout is on the audit trail, where on-call looks, not only in django-axes' table."""
    from django.conf import settings

    from apps.audit.models import AuditEvent
    from apps.audit.services import audit_record

    audit_record(
        actor=f"anonymous@{ip_address}",
        action="login.locked_out",
        target=f"user:{username}",
        result=AuditEvent.Result.DENIED,
        message=f"{settings.AXES_FAILURE_LIMIT} failed sign-ins from {ip_address}",
    )
