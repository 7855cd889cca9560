from django.contrib import admin
from django.urls import include, path

from apps.api.api import urls as api_urls
from apps.api.metrics import metrics
from controlplane.health import healthz, readyz

urlpatterns = [
    path("healthz", healthz, name="healthz"),
    path("readyz", readyz, name="readyz"),
    # Prometheus' scrape, beside the charts page at metrics/ (no slash: CommonMiddleware would
    # otherwise redirect a scrape to the login-protected page).
    path("metrics", metrics, name="self-metrics"),
    path("", include("apps.fleet.urls")),
    path("", include("apps.degradation.urls")),  # a pool's tiers: pools/<pool>/tiers/
    path("", include("apps.scaling.urls")),  # the nodes a pool needs: pools/<pool>/scaling/
    path("accounts/", include("apps.accounts.urls")),
    path("models/", include("apps.registry.urls")),
    path("", include("apps.quality.urls")),  # a model's evaluations, a version's quality, runs
    path("", include("apps.performance.urls")),  # a pool's throughput: pools/<pool>/throughput/
    path("rollouts/approvals/", include("apps.approvals.urls")),
    path("rollouts/", include("apps.rollouts.urls")),
    path("metrics/", include("apps.observability.urls")),
    path("", include("apps.incidents.urls")),  # before audit/: the timeline is audit/timeline/
    path("audit/", include("apps.audit.urls")),
    path("api/", api_urls()),
    path("admin/", admin.site.urls),
]
