"""Per-user API tokens, and the same role permissions as the pages, checked before the request
body is even read: a viewer gets 403 on every mutation, whatever it sends, and a user with no
role on every call. The pool an operation acts on is checked by its service.

An alerts token (Alertmanager's, whose credentials sit in its config file) opens and resolves
incidents and nothing else: a leaked copy cannot read the fleet or change it."""

from django.http import HttpRequest
from ninja.security import HttpBearer

from apps.accounts.models import ApiToken
from apps.accounts.permissions import ANY_ROLE, may_somewhere
from apps.accounts.services import token_authenticate
from apps.api.errors import ApiError
from apps.audit.context import VIA
from apps.audit.models import AuditEvent
from apps.audit.services import audit_record
from apps.web.nul import MESSAGE, nul_in

READS = {"GET", "HEAD", "OPTIONS"}
ALERTS_ONLY = "this token may only send alerts (POST /api/alertmanager)"


class Token(HttpBearer):
    def __init__(self, permission: str = "", action: str = "", *, alerts: bool = False) -> None:
        super().__init__()
        self.permission, self.action, self.alerts = permission, action, alerts

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
        if found.scope == ApiToken.Scope.ALERTS and not self.alerts:
            audit_record(
                actor=found.user,
                action=self.action or ("api.read" if request.method in READS else "api.write"),
                target=request.path,
                result=AuditEvent.Result.DENIED,
                message=f"token {found} is for alerts only",
            )
            raise ApiError(403, "forbidden", ALERTS_ONLY)
        if not found.user.has_perm(ANY_ROLE) or (
            self.permission and not may_somewhere(found.user, self.permission)
        ):
            needed = self.permission or ANY_ROLE
            audit_record(
                actor=found.user,
                action=self.action or "api.read",
                target=request.path,
                result=AuditEvent.Result.DENIED,
                message=f"missing permission {needed}",
            )
            raise ApiError(403, "forbidden", f"your role lacks {needed}")
        where = nul_in(request)
        if where:
            raise ApiError(400, "invalid_request", MESSAGE.format(where=where))
        return found.user


def can(permission: str, action: str, *, alerts: bool = False) -> Token:
    """Auth for a mutating operation: a live token whose owner holds `permission`; an alerts
    token only where `alerts` says so."""
    return Token(permission, action, alerts=alerts)
