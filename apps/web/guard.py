"""What a request may carry, checked before anything reads its body: a size cap, no uploads
from someone not signed in, JSON no deeper than any of our forms or API bodies, and POST only
to the pages that take it."""

import json
from collections.abc import Callable
from typing import TypeVar

from django.conf import settings
from django.contrib.auth.views import redirect_to_login
from django.http import (
    HttpRequest,
    HttpResponse,
    HttpResponseBase,
    HttpResponseNotAllowed,
    JsonResponse,
)
from django.urls import Resolver404, resolve

MAX_JSON_DEPTH = 32
# Paths with methods and permissions of their own.
OUTSIDE = ("/api/", "/admin/")


class RequestGuardMiddleware:
    """After authentication, before CSRF (which reads the form) and the view."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        api = request.path.startswith("/api/")
        refuse = _api_error if api else _plain
        length = _content_length(request)
        if length > settings.REQUEST_BODY_MAX_BYTES:
            cap = settings.REQUEST_BODY_MAX_BYTES // 2**20
            return refuse(413, "too_large", f"the request body is larger than {cap} MiB")
        anonymous = not request.user.is_authenticated and not (
            api and request.headers.get("Authorization", "").startswith("Bearer ")
        )
        upload = length and request.content_type == "multipart/form-data"
        if upload and anonymous and (api or _needs_login(request)):
            # Parsing the upload would spool it to disk before the view's login check.
            if api:
                return refuse(
                    401, "unauthenticated", "send a live API token: Authorization: Bearer <token>"
                )
            return redirect_to_login(request.get_full_path())
        if request.content_type == "application/json" and too_deep(request.body):
            return refuse(
                400,
                "invalid_request",
                f"the JSON body is nested deeper than {MAX_JSON_DEPTH} levels",
            )
        return self.get_response(request)


def _needs_login(request: HttpRequest) -> bool:
    """As LoginRequiredMiddleware will decide, once the URL is resolved."""
    try:
        view = resolve(request.path_info).func
    except Resolver404:
        return True
    return getattr(view, "login_required", True)


def _content_length(request: HttpRequest) -> int:
    try:
        return max(int(request.META.get("CONTENT_LENGTH") or 0), 0)
    except ValueError:
        return 0


def _plain(status: int, code: str, message: str) -> HttpResponse:
    return HttpResponse(message, status=status, content_type="text/plain; charset=utf-8")


def _api_error(status: int, code: str, message: str) -> HttpResponse:
    """The API's own error shape (apps.api.errors), which this runs before."""
    return JsonResponse(
        {"error": {"code": code, "message": message, "details": None}}, status=status
    )


def too_deep(body: bytes) -> bool:
    """Nested past MAX_JSON_DEPTH. Counting brackets settles almost every body at C speed;
    only one with more brackets than the limit is parsed, without recursion in our code."""
    if body.count(b"[") + body.count(b"{") <= MAX_JSON_DEPTH:
        return False
    try:
        stack = [(json.loads(body), 1)]
    except RecursionError:
        return True
    except ValueError:
        return False  # not JSON: the view says so
    while stack:
        value, depth = stack.pop()
        children = value.values() if isinstance(value, dict) else value
        if isinstance(value, dict | list):
            if depth > MAX_JSON_DEPTH:
                return True
            stack.extend((child, depth + 1) for child in children)
    return False


def client_ip(request: HttpRequest) -> str:
    """The address a request came from: behind TRUSTED_PROXIES proxies, the one the outermost of
    them saw (X-Forwarded-For, read from the right: entries further left are the client's say)."""
    hops = [h.strip() for h in request.headers.get("X-Forwarded-For", "").split(",") if h.strip()]
    trusted = settings.TRUSTED_PROXIES
    if trusted and len(hops) >= trusted:
        return hops[-trusted]
    return str(request.META.get("REMOTE_ADDR", ""))


V = TypeVar("V", bound=Callable[..., HttpResponseBase])


def takes_post(view: V) -> V:
    """Mark a page that acts on POST (a form of the signed-in user's own, a dry run); pages that
    change shared state say so with apps.accounts.permissions.require, which marks them too."""
    view.takes_post = True  # type: ignore[attr-defined]
    return view


class ReadOnlyPagesMiddleware:
    """A page takes POST only if it says so (405 otherwise): a view that reads can never be
    made to change something by a method it did not expect. The API (its own methods per
    operation) and Django's admin (its own permissions) are outside."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        return self.get_response(request)

    def process_view(
        self, request: HttpRequest, view: Callable[..., HttpResponse], *args: object
    ) -> HttpResponse | None:
        if request.method in ("GET", "HEAD", "OPTIONS") or request.path.startswith(OUTSIDE):
            return None
        if getattr(view, "takes_post", False) or hasattr(view, "required"):
            return None
        return HttpResponseNotAllowed(["GET", "HEAD"])
