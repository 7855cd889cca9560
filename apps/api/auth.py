"""Per-user API tokens, and the same role permissions as the pages, checked before the request
body is even read: a viewer gets 403 on every mutation, whatever it sends."""

from django.http import HttpRequest
from ninja.security import HttpBearer

from apps.accounts.models import ApiToken
from apps.accounts.services import token_authenticate
from apps.api.errors import ApiError
from apps.audit.context import VIA
from apps.audit.models import AuditEvent
from apps.audit.services import audit_record
from controlplane.nul import MESSAGE, nul_in

READS = {"GET", "HEAD", "OPTIONS"}


class Token(HttpBearer):
    def __init__(self, permission: str = "", action: str = "") -> None:
        super().__init__()
        self.permission, self.action = permission, action

    def authenticate(self, request: HttpRequest, token: str) -> object | None:
        found = token_authenticate(token)
        if found is None:
            return None  # 401
        request.user = found.user
        VIA.set(f"API token {found}")  # on every event the call writes
        if found.scope == ApiToken.Scope.READ and request.method not in READS:
            audit_record(
                actor=found.user,
                action=self.action or "api.write",
                target=request.path,
                result=AuditEvent.Result.DENIED,
                message=f"token {found} is read-only",
            )
            raise ApiError(403, "forbidden", "this token is read-only")
        if self.permission and not found.user.has_perm(self.permission):
            audit_record(
                actor=found.user,
                action=self.action,
                target=request.path,
                result=AuditEvent.Result.DENIED,
                message=f"missing permission {self.permission}",
            )
            raise ApiError(403, "forbidden", f"your role lacks {self.permission}")
        where = nul_in(request)
        if where:
            raise ApiError(400, "invalid_request", MESSAGE.format(where=where))
        return found.user


def can(permission: str, action: str) -> Token:
    """Auth for a mutating operation: a live token whose owner holds `permission`."""
    return Token(permission, action)
