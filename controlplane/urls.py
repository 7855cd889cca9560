from django.contrib import admin
from django.urls import include, path

from apps.api.api import urls as api_urls
from controlplane.health import healthz, readyz

urlpatterns = [
    path("healthz", healthz, name="healthz"),
    path("readyz", readyz, name="readyz"),
    path("", include("apps.fleet.urls")),
    path("accounts/", include("apps.accounts.urls")),
    path("models/", include("apps.registry.urls")),
    path("rollouts/", include("apps.rollouts.urls")),
    path("metrics/", include("apps.observability.urls")),
    path("audit/", include("apps.audit.urls")),
    path("api/", api_urls()),
    path("admin/", admin.site.urls),
]
