"""The automation API: the same services as the pages, for release pipelines. django-ninja
(see README): typed function views like the rest of the project, and the OpenAPI document
comes from the same type hints that validate requests."""

from django.urls import URLPattern, URLResolver
from ninja import NinjaAPI

from apps.api import audit, errors, fleet, registry, rollouts

api = NinjaAPI(
    title="Triton control plane",
    version="1",
    description="Registry, fleet, rollouts and audit for Triton Inference Server fleets. "
    "Authenticate with `Authorization: Bearer <token>`; create a token on your account page.",
    urls_namespace="api",
)
errors.install(api)
for module in (registry, fleet, rollouts, audit):
    api.add_router("", module.router)


def urls() -> tuple[list[URLResolver | URLPattern], str, str]:
    """The API's URLs, outside the pages' sign-in: a call authenticates with its token."""
    patterns, app_name, namespace = api.urls
    for pattern in patterns:
        pattern.callback.login_required = False  # type: ignore[union-attr]
    return patterns, app_name, namespace
