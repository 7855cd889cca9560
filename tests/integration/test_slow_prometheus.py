"""A tick measures before it takes the rollout's lock: with a Prometheus that takes 20 s to
answer, a person's abort still returns at once and takes effect, and the late measurement of a
rollout that moved on meanwhile is dropped."""

import threading
from collections.abc import Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.db import connection
from django.utils import timezone

from apps.accounts.roles import Role
from apps.fleet.models import Node, NodePool
from apps.fleet.services.deployments import deployment_set
from apps.registry.models import ModelVersion
from apps.rollouts.models import Measurement, Rollout
from apps.rollouts.services import rollout_abort
from apps.rollouts.tick import rollout_advance
from tests.support.registry import import_demo
from tests.support.services import Celery
from tests.support.users import make_user

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]
ANSWER_AFTER_S = 20


class SlowPrometheus:
    """Answers every query with no data, after ANSWER_AFTER_S or once released."""

    def __init__(self) -> None:
        self.asked = threading.Event()
        self.released = threading.Event()
        self.answered = threading.Event()
        slow = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                slow.asked.set()
                slow.released.wait(ANSWER_AFTER_S)
                body = b'{"status":"success","data":{"resultType":"vector","result":[]}}'
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                slow.answered.set()

            do_POST = do_GET

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


@pytest.fixture
def slow_prometheus(settings: object) -> Iterator[SlowPrometheus]:
    slow = SlowPrometheus()
    thread = threading.Thread(target=slow.server.serve_forever, daemon=True)
    thread.start()
    settings.PROMETHEUS_URL = slow.url  # type: ignore[attr-defined]
    settings.PROMETHEUS_TIMEOUT_S = ANSWER_AFTER_S + 5  # type: ignore[attr-defined]
    yield slow
    slow.released.set()
    slow.server.shutdown()


def test_an_abort_never_waits_behind_a_slow_prometheus(
    slow_prometheus: SlowPrometheus, celery: Celery
) -> None:
    """The tick is this test's own: the session's worker (started for other tests in this
    process) is kept from ticking the rollout meanwhile."""
    if connection.vendor != "postgresql":
        pytest.skip("a tick and an abort at once need PostgreSQL's row locks")
    with celery.holding_rollouts():
        import_demo()
        ModelVersion.objects.update(status=ModelVersion.Status.PUBLISHED)
        pool = NodePool.objects.create(name="gpu")
        nodes = [
            Node.objects.create(name=f"gpu-{i}", pool=pool, http_url="http://127.0.0.1:1")
            for i in (1, 2)
        ]
        deployment_set(model_name="embedder", version=1, pool=pool, actor="system:test")
        deployment_set(
            model_name="embedder", version=2, baseline=1, node=nodes[0], actor="system:t"
        )
        long_ago = timezone.now() - timedelta(minutes=10)
        rollout = Rollout.objects.create(
            model=ModelVersion.objects.get(model__name="embedder", version=1).model,
            pool=pool,
            baseline_version=1,
            canary_version=2,
            plan=[{"percent": 50}, {"percent": 100}],
            analysis={"judge": "threshold"},
            state=Rollout.State.PROGRESSING,
            canary_nodes=["gpu-1"],
            step_started_at=long_ago,
            step_ready_at=long_ago,
            started_by="ann",
        )

        def tick() -> None:
            try:
                rollout_advance(rollout_id=rollout.pk)
            finally:
                connection.close()

        ticking = threading.Thread(target=tick)
        ticking.start()
        assert slow_prometheus.asked.wait(10), "the tick never asked Prometheus"
        rollout_abort(rollout_id=rollout.pk, actor=make_user(Role.RELEASE_MANAGER), reason="bad")
        # Had the abort waited behind the tick, the tick would have had its answer first: an
        # order of events, not a measured time, so a busy machine cannot fail it.
        waited = slow_prometheus.answered.is_set()
        slow_prometheus.released.set()
        ticking.join(ANSWER_AFTER_S + 10)
        assert not waited, "the abort waited behind the tick's Prometheus query"
        rollout.refresh_from_db()
        assert rollout.state == Rollout.State.ABORTING
        assert not Measurement.objects.exists()  # measured for a rollout that has since moved
