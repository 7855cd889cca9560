from collections.abc import Callable
from functools import wraps
from typing import Any

from django.contrib.auth.models import User
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from apps.audit.models import AuditEvent
from apps.audit.services import audit_record

View = Callable[..., HttpResponse]


def current_user(request: HttpRequest) -> User:
    """The signed-in user; LoginRequiredMiddleware guarantees one on every view."""
    assert isinstance(request.user, User)
    return request.user


def require(permission: str, action: str) -> Callable[[View], View]:
    """Refuse (403, audited) a user without `permission`; the role check is always server-side."""

    def decorator(view: View) -> View:
        @wraps(view)
        def wrapped(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            if request.user.has_perm(permission):
                return view(request, *args, **kwargs)
            audit_record(
                actor=current_user(request),
                action=action,
                target=request.path,
                result=AuditEvent.Result.DENIED,
                message=f"missing permission {permission}",
            )
            context = {"permission": permission, "action": action}
            return render(request, "403.html", context, status=403)

        wrapped.required = (permission, action)  # type: ignore[attr-defined]  # for tests/unit/test_audit.py
        return wrapped

    return decorator
