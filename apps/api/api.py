"""The automation API: the same services as the pages, for release pipelines. django-ninja
(see README): typed function views like the rest of the project, and the OpenAPI document
comes from the same type hints that validate requests."""

from collections.abc import Callable
from functools import wraps

from django.contrib.auth.views import redirect_to_login
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import URLPattern, URLResolver
from ninja import NinjaAPI

from apps.accounts.models import ApiToken
from apps.accounts.permissions import ANY_ROLE
from apps.accounts.services import token_authenticate
from apps.api import (
    approvals,
    audit,
    degradation,
    desired,
    errors,
    fleet,
    incidents,
    quality,
    registry,
    rollouts,
    scaling,
)
from apps.api.auth import ALERTS_ONLY


def signed_in(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """The docs and the OpenAPI document describe every operation: for people signed in, or
    calls with a live token, like everything else here."""

    @wraps(view)
    def guarded(request: HttpRequest, *args: object, **kwargs: object) -> HttpResponse:
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if request.user.is_authenticated:
            return view(request, *args, **kwargs)
        if scheme.lower() != "bearer":
            return redirect_to_login(request.get_full_path())
        found = token_authenticate(token.strip())
        if found is None:
            message = "send a live API token: Authorization: Bearer <token>"
            error = {"code": "unauthenticated", "message": message, "details": None}
            return JsonResponse({"error": error}, status=401)
        if not found.user.has_perm(ANY_ROLE):
            error = {"code": "forbidden", "message": f"your role lacks {ANY_ROLE}", "details": None}
            return JsonResponse({"error": error}, status=403)
        if found.scope == ApiToken.Scope.ALERTS:
            error = {"code": "forbidden", "message": ALERTS_ONLY, "details": None}
            return JsonResponse({"error": error}, status=403)
        return view(request, *args, **kwargs)

    return guarded


api = NinjaAPI(
    title="Triton control plane",
    version="1",
    description="Registry, fleet, rollouts and audit for Triton Inference Server fleets. "
    "Authenticate with `Authorization: Bearer <token>`; create a token on your account page.",
    urls_namespace="api",
    docs_decorator=signed_in,
)
errors.install(api)
for module in (
    registry,
    fleet,
    rollouts,
    degradation,
    scaling,
    desired,
    approvals,
    audit,
    incidents,
    quality,
):
    api.add_router("", module.router)


def urls() -> tuple[list[URLResolver | URLPattern], str, str]:
    """The API's URLs, outside the pages' sign-in: a call authenticates with its token."""
    patterns, app_name, namespace = api.urls
    for pattern in patterns:
        pattern.callback.login_required = False  # type: ignore[union-attr]
    return patterns, app_name, namespace
