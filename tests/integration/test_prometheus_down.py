"""A real Prometheus, stopped: every page that holds charts still answers, and says why the charts
are missing."""

import re
import time
from pathlib import Path

import pytest
from django.contrib.auth.models import User
from django.test import Client

from apps.fleet.models import Node, NodePool
from apps.registry.imports import repository_import
from tests.support import REPOSITORY
from tests.support.backfill import backfilled_prometheus

pytestmark = [pytest.mark.integration, pytest.mark.django_db]

# Full pages, then the fragments they load with htmx: those hold the charts and tiles.
PAGES = ["/", "/metrics/", "/models/rag_pipeline/", "/nodes/gpu-1/", "/audit/timeline/"]
FRAGMENTS = [
    "/metrics/?metric=p99&range=1h",
    "/metrics/?metric=p99&model=rag_pipeline&range=1h",
    "/metrics/?metric=gpu_memory&node=gpu-1&range=1h",
    "/metrics/tiles/",
    "/metrics/breakdown/rag_pipeline/",
    "/audit/timeline/chart/?start=2026-11-30T00:00:00&end=2026-11-30T01:00:00&model=rag_pipeline",
]


def test_pages_with_charts_answer_and_say_prometheus_is_down(
    tmp_path: Path, client: Client, viewer: User, settings: object
) -> None:
    assert all(r.ok for r in repository_import(path=REPOSITORY, actor="system:test"))
    Node.objects.create(
        name="gpu-1", pool=NodePool.objects.create(name="gpu"), http_url="http://127.0.0.1:1"
    )
    now = int(time.time())
    sample = f'nv_gpu_utilization{{gpu_uuid="GPU-1"}} 0.5 {now - 60}\n# EOF\n'
    with backfilled_prometheus(tmp_path, sample) as url:
        settings.PROMETHEUS_URL = url  # type: ignore[attr-defined]
    # The context has stopped it: the URL is that of a Prometheus that ran a moment ago.
    client.force_login(viewer)
    for page in PAGES:
        response = client.get(page)
        assert response.status_code == 200, page
    for fragment in FRAGMENTS:
        response = client.get(fragment, headers={"HX-Request": "true"})
        assert response.status_code == 200, fragment
        message = re.search(r'role="status">([^<]*)<', response.content.decode())
        assert message, f"{fragment} does not say why its chart is missing"
        assert f"Prometheus at {url} did not answer" in message.group(1), fragment
