"""Every API error is `{"error": {"code", "message", "details"}}` with the status that fits."""

from typing import Any

from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse
from ninja import NinjaAPI, Schema
from ninja.errors import AuthenticationError, HttpError, ValidationError

from apps.accounts.permissions import ApprovalRequired, current_user
from apps.approvals.services import approval_request
from apps.quality.errors import QualityError


class ErrorBody(Schema):
    code: str
    message: str
    details: Any = None


class ErrorOut(Schema):
    error: ErrorBody


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str, details: Any = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.details = status, code, message, details


# Declared on every operation, so that the schema says what a client can get back.
ERRORS: dict[int, type[Schema]] = {code: ErrorOut for code in (400, 401, 403, 404, 409, 422)}


class WaitOut(Schema):
    """A change to a protected pool, kept for a second person to approve."""

    approval: int
    status: str
    expires_at: str
    message: str


# Declared on the changes a protected pool holds for approval.
WAITS: dict[int, type[Schema]] = {202: WaitOut}


def error_response(api: NinjaAPI, request: HttpRequest, exc: ApiError) -> HttpResponse:
    body = {"error": {"code": exc.code, "message": exc.message, "details": exc.details}}
    return api.create_response(request, body, status=exc.status)


def _location(loc: list[Any]) -> list[Any]:
    """`["body", "payload", "plan"]` reads `["body", "plan"]`: the second item is only the
    name of the view's parameter, which a client never sees."""
    return [loc[0], *loc[2:]] if len(loc) > 2 and loc[0] == "body" else list(loc)


def install(api: NinjaAPI) -> None:
    @api.exception_handler(ApiError)
    def _own(request: HttpRequest, exc: ApiError) -> HttpResponse:
        return error_response(api, request, exc)

    @api.exception_handler(ValidationError)
    def _invalid(request: HttpRequest, exc: ValidationError) -> HttpResponse:
        details = [
            {
                "loc": _location(e.get("loc", [])),
                "message": e.get("msg", ""),
                "type": e.get("type", ""),
            }
            for e in exc.errors
        ]
        where = "; ".join(f"{'.'.join(map(str, d['loc']))}: {d['message']}" for d in details)
        return error_response(api, request, ApiError(422, "invalid_request", where, details))

    @api.exception_handler(AuthenticationError)
    def _unauthenticated(request: HttpRequest, exc: AuthenticationError) -> HttpResponse:
        message = "send a live API token: Authorization: Bearer <token>"
        return error_response(api, request, ApiError(401, "unauthenticated", message))

    @api.exception_handler(ApprovalRequired)
    def _waits(request: HttpRequest, exc: ApprovalRequired) -> HttpResponse:
        """A change to a protected pool: kept as a request for a second person (202)."""
        approval = approval_request(refused=exc, actor=current_user(request))
        body = {
            "approval": approval.pk,
            "status": approval.status,
            "expires_at": approval.expires_at.isoformat(),
            "message": f"{exc} (POST /api/approvals/{approval.pk}/approve)",
        }
        return api.create_response(request, body, status=202)

    @api.exception_handler(QualityError)
    def _quality(request: HttpRequest, exc: QualityError) -> HttpResponse:
        """An evaluation set or run refused: every problem, each with its line (null where
        none applies) and field, as the import command lists them."""
        details = [
            {"line": p.line or None, "field": p.field, "message": p.message} for p in exc.problems
        ]
        return error_response(api, request, ApiError(422, "invalid_evaluation", str(exc), details))

    @api.exception_handler(PermissionDenied)
    def _forbidden(request: HttpRequest, exc: PermissionDenied) -> HttpResponse:
        return error_response(api, request, ApiError(403, "forbidden", str(exc)))

    @api.exception_handler(Http404)
    def _missing(request: HttpRequest, exc: Http404) -> HttpResponse:
        return error_response(api, request, ApiError(404, "not_found", str(exc) or "not found"))

    @api.exception_handler(HttpError)
    def _http(request: HttpRequest, exc: HttpError) -> HttpResponse:
        return error_response(api, request, ApiError(exc.status_code, "http_error", str(exc)))
